//! `check::check_batch`, the engine of `padfree check`: green on the real
//! thing for every family, red on naive packing, naming the example and the
//! layer where it first shows.

mod common;

use common::{examples, trainable_model};
use padfree_model::LlamaConfig;
use padfree_model::check::{Fault, Tolerances, check_batch};

fn families() -> Vec<LlamaConfig> {
    let tiny = LlamaConfig {
        initializer_range: 0.1,
        ..LlamaConfig::tiny()
    };
    vec![
        tiny.clone(),
        LlamaConfig {
            model_type: "qwen2".to_owned(),
            qkv_bias: true,
            ..tiny.clone()
        },
        LlamaConfig {
            model_type: "qwen3".to_owned(),
            qk_norm: true,
            ..tiny
        },
    ]
}

#[test]
fn the_check_passes_for_every_family() {
    for config in families() {
        let model = trainable_model(&config, 5);
        let batch = examples(&[9, 1, 14, 3, 6], config.vocab_size as u32, 8);
        let check = check_batch(&model, &batch, &Tolerances::default(), Fault::None).expect("runs");
        assert_eq!(check.mismatch, None, "{}", config.model_type);
        assert_eq!(check.rows.len(), 8);
        assert!(check.rows.iter().all(|row| row.passed()), "{check:?}");
        assert_eq!(check.tokens, 33);
        assert_eq!(check.padded_tokens, 5 * 14);
        // The perturbed example moved; the others did not move at all.
        let own = &check.rows[3];
        assert!(own.max_abs > 0.0, "{own:?}");
        assert_eq!(check.rows[2].max_abs, 0.0, "{:?}", check.rows[2]);
    }
}

#[test]
fn naive_packing_is_caught_at_the_second_example_in_the_first_layer() {
    let config = families().remove(0);
    let model = trainable_model(&config, 5);
    let batch = examples(&[9, 4, 14], config.vocab_size as u32, 8);
    let check =
        check_batch(&model, &batch, &Tolerances::default(), Fault::NaivePacking).expect("runs");
    let mismatch = check.mismatch.expect("a mismatch");
    assert_eq!(mismatch.quantity, "logits: padded vs padding-free");
    // Example 0 is first in the row and sees nothing of the others; every
    // later one attends across its boundary from layer 0 on.
    assert_ne!(mismatch.culprit, "example 0");
    assert!(mismatch.layer.starts_with("decoder layer 0 "), "{mismatch}");
    assert!(
        !check.rows[2].passed(),
        "perturbation row: {:?}",
        check.rows[2]
    );
}

#[test]
fn a_perturbation_that_moves_nothing_fails_the_check_instead_of_passing_it() {
    // All matrices zero: every token gives the same logits, so changing
    // example 0 proves nothing about the others.
    let config = LlamaConfig {
        initializer_range: 0.0,
        ..LlamaConfig::tiny()
    };
    let model = trainable_model(&config, 5);
    let batch = examples(&[5, 7], config.vocab_size as u32, 8);
    let check = check_batch(&model, &batch, &Tolerances::default(), Fault::None).expect("runs");
    assert!(!check.rows[3].passed(), "{:?}", check.rows[3]);
    let mismatch = check.mismatch.expect("a mismatch");
    assert_eq!(
        mismatch.quantity,
        "perturbing example 0: its own logits move"
    );
    assert!(mismatch.layer.contains("says nothing"), "{mismatch}");
}
