//! Padded, flattened (`varlen`, `varlen-per-layer`) and one-example-at-a-time
//! forward and backward passes of the same examples agree: logits, loss and
//! every parameter gradient.
//!
//! Tolerances: all paths compute the same sums in f32, but over different
//! shapes (a padded row multiplies by exact zeros for masked keys; matmul
//! kernels block differently for different sizes), so results differ by
//! rounding only. Logits are O(1) after two layers of a 0.02-std model; f32
//! rounding through ~10 accumulations per layer stays below 1e-5 absolute. The
//! loss is a sum over up to ~40 tokens of O(5) terms: 1e-5 relative. Gradients
//! accumulate over every token: 1e-4 of the largest gradient of each tensor,
//! plus 1e-7 absolute for tensors whose gradient is nearly zero.

mod common;

use common::{
    assert_close, examples, host, loss_and_grads, param_grads, real_rows, trainable_model,
};
use padfree_model::tensor::cpu_device;
use padfree_model::{LlamaConfig, LlamaModel, ModelInput};
use padfree_pack::{Example, flatten, pad};

const LOGITS_ATOL: f32 = 1e-5;
const LOSS_RTOL: f32 = 1e-5;
const GRAD_RTOL: f32 = 1e-4;
const GRAD_ATOL: f32 = 1e-7;

fn check_logits_agree(lengths: &[usize]) {
    let config = LlamaConfig::tiny();
    let vocab = config.vocab_size;
    let model = LlamaModel::init(&config, 7, &cpu_device(false)).expect("valid config");
    let examples = examples(lengths, vocab as u32, 11);
    let packed = flatten(&examples).expect("flattens");
    let padded = pad(&examples, 0, None).expect("pads");

    let varlen = host(
        model
            .forward(&ModelInput::Varlen(&packed))
            .expect("forward"),
    );
    let per_layer = host(
        model
            .forward(&ModelInput::VarlenPerLayer(&packed))
            .expect("forward"),
    );
    let padded_logits = host(
        model
            .forward(&ModelInput::Padded(&padded))
            .expect("forward"),
    );
    let one_at_a_time: Vec<f32> = examples
        .iter()
        .flat_map(|example| {
            let alone = flatten(std::slice::from_ref(example)).expect("flattens");
            host(model.forward(&ModelInput::Varlen(&alone)).expect("forward"))
        })
        .collect();

    assert_eq!(varlen.len(), packed.num_tokens() * vocab);
    assert_eq!(
        varlen, per_layer,
        "varlen-per-layer must compute the very same thing"
    );
    assert_close(
        "padded vs varlen logits",
        &real_rows(&padded_logits, &examples, padded.seq_len(), vocab),
        &varlen,
        LOGITS_ATOL,
        0.0,
    );
    assert_close(
        "one-at-a-time vs varlen logits",
        &one_at_a_time,
        &varlen,
        LOGITS_ATOL,
        0.0,
    );
}

#[test]
fn logits_agree_for_single_token_examples() {
    check_logits_agree(&[1, 1, 1]);
}

#[test]
fn logits_agree_for_two_token_examples() {
    check_logits_agree(&[2, 2]);
}

#[test]
fn logits_agree_for_ragged_examples() {
    check_logits_agree(&[7, 1, 12, 3, 2]);
}

#[test]
fn logits_of_one_example_do_not_depend_on_its_neighbours() {
    // The second example's logits must not change when the first changes:
    // the varlen attention keeps examples apart.
    let config = LlamaConfig::tiny();
    let model = LlamaModel::init(&config, 3, &cpu_device(false)).expect("valid config");
    let second = examples(&[6], 128, 5).remove(0);
    let logits_after = |first: Example| {
        let batch = flatten(&[first.clone(), second.clone()]).expect("flattens");
        let logits = host(model.forward(&ModelInput::Varlen(&batch)).expect("forward"));
        logits[first.len() * config.vocab_size..].to_vec()
    };
    let a = logits_after(examples(&[4], 128, 1).remove(0));
    let b = logits_after(examples(&[9], 128, 2).remove(0));
    assert_close("second example's logits", &a, &b, 1e-6, 0.0);
}

/// `every_gradient_flows`: whether every parameter must get a non-zero
/// gradient. Not so when every loss token sits at position 0 (examples of two
/// tokens): attention over a single key has zero gradient for q and k.
fn check_loss_and_grads_agree(lengths: &[usize], every_gradient_flows: bool) {
    check_loss_and_grads_agree_for(&LlamaConfig::tiny(), lengths, every_gradient_flows);
}

fn check_loss_and_grads_agree_for(
    config: &LlamaConfig,
    lengths: &[usize],
    every_gradient_flows: bool,
) {
    let config = config.clone();
    let examples = examples(lengths, config.vocab_size as u32, 17);
    let packed = flatten(&examples).expect("flattens");
    let padded = pad(&examples, 0, Some(4)).expect("pads");

    let model = trainable_model(&config, 23);
    let (varlen_loss, varlen_count, grads) = loss_and_grads(&model, &ModelInput::Varlen(&packed));
    let varlen_grads = param_grads(&model, &grads);

    let model = trainable_model(&config, 23);
    let (padded_loss, padded_count, grads) = loss_and_grads(&model, &ModelInput::Padded(&padded));
    let padded_grads = param_grads(&model, &grads);

    let model = trainable_model(&config, 23);
    let (per_layer_loss, _, grads) = loss_and_grads(&model, &ModelInput::VarlenPerLayer(&packed));
    let per_layer_grads = param_grads(&model, &grads);

    // One example at a time: losses are sums, so they and their gradients add up.
    let mut single_loss = 0.0;
    let mut single_count = 0;
    let mut single_grads: Option<Vec<(String, Vec<f32>)>> = None;
    for example in &examples {
        let model = trainable_model(&config, 23);
        let alone = flatten(std::slice::from_ref(example)).expect("flattens");
        let (loss, count, grads) = loss_and_grads(&model, &ModelInput::Varlen(&alone));
        single_loss += loss;
        single_count += count;
        let grads = param_grads(&model, &grads);
        single_grads = Some(match single_grads {
            None => grads,
            Some(acc) => acc
                .into_iter()
                .zip(grads)
                .map(|((name, a), (_, b))| (name, a.iter().zip(&b).map(|(x, y)| x + y).collect()))
                .collect(),
        });
    }
    let single_grads = single_grads.expect("at least one example");

    assert_eq!(varlen_count, packed.num_loss_tokens());
    assert_eq!(padded_count, varlen_count);
    assert_eq!(single_count, varlen_count);
    assert_eq!(per_layer_loss, varlen_loss);
    assert_close(
        "padded vs varlen loss",
        &[padded_loss],
        &[varlen_loss],
        0.0,
        LOSS_RTOL,
    );
    assert_close(
        "one-at-a-time vs varlen loss",
        &[single_loss],
        &[varlen_loss],
        0.0,
        LOSS_RTOL,
    );

    assert_eq!(varlen_grads.len(), model.params().len());
    for (((name, varlen), (_, padded)), ((_, single), (_, per_layer))) in varlen_grads
        .iter()
        .zip(&padded_grads)
        .zip(single_grads.iter().zip(&per_layer_grads))
    {
        if every_gradient_flows {
            assert!(
                varlen.iter().any(|&g| g != 0.0),
                "{name}: gradient is all zero"
            );
        }
        assert_eq!(varlen, per_layer, "{name}: varlen-per-layer gradient");
        assert_close(
            &format!("{name}: padded vs varlen gradient"),
            padded,
            varlen,
            GRAD_ATOL,
            GRAD_RTOL,
        );
        assert_close(
            &format!("{name}: one-at-a-time vs varlen gradient"),
            single,
            varlen,
            GRAD_ATOL,
            GRAD_RTOL,
        );
    }
}

#[test]
fn loss_and_gradients_agree_for_single_token_examples() {
    // Single-token examples have no loss token of their own; add a longer one.
    check_loss_and_grads_agree(&[1, 1, 5], true);
}

#[test]
fn loss_and_gradients_agree_for_two_token_examples() {
    check_loss_and_grads_agree(&[2, 2, 2], false);
}

#[test]
fn loss_and_gradients_agree_for_ragged_examples() {
    check_loss_and_grads_agree(&[9, 1, 4, 13, 2], true);
}

#[test]
fn loss_and_gradients_agree_for_qwen2_and_qwen3_layers() {
    let qwen2 = LlamaConfig {
        model_type: "qwen2".to_owned(),
        qkv_bias: true,
        ..LlamaConfig::tiny()
    };
    let qwen3 = LlamaConfig {
        model_type: "qwen3".to_owned(),
        qk_norm: true,
        ..LlamaConfig::tiny()
    };
    for config in [qwen2, qwen3] {
        check_loss_and_grads_agree_for(&config, &[9, 1, 4, 13, 2], true);
    }
}
