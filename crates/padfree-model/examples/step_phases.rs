//! Where a training step's time goes: forward + loss, backward, and copying
//! the gradients to the host, for one batch shaped like the shipped data
//! (8 examples, 74 to 260 tokens, the first half of each a prompt without
//! labels), on the `small` preset, for each combination of
//!
//! - attention: padfree's fused varlen kernel or the composed oracle;
//! - loss: `loss_sum` (logits of labelled rows, fused cross-entropy) or
//!   `causal_lm_loss` over the full logits (the oracle).
//!
//! Rounds alternate the four, so a slow spell of the machine hits all of
//! them; each cell is the median of the rounds.
//!
//! `cargo run --release -p padfree-model --example step_phases [rounds]`

use std::time::Instant;

use padfree_model::tensor::{IntoHostVec, backward, cpu_device, grad};
use padfree_model::{AttentionKernel, LlamaConfig, LlamaModel, ModelInput, causal_lm_loss};
use padfree_pack::{Example, flatten, synthetic_prompted_examples};

/// Milliseconds of (forward + loss, backward, gradients to host).
type Phases = [f64; 3];

fn batch(vocab: u32) -> Vec<Example> {
    let lengths = [142, 100, 180, 74, 260, 130, 150, 134];
    synthetic_prompted_examples(&lengths, vocab, 1, 2)
}

fn step(model: &LlamaModel, input: &ModelInput<'_>, labelled_rows_only: bool) -> Phases {
    let started = Instant::now();
    let loss = if labelled_rows_only {
        model.loss_sum(input).expect("loss")
    } else {
        let logits = model.forward(input).expect("forward");
        causal_lm_loss(logits, &input.targets()).expect("loss")
    };
    let _value = loss.sum.clone().into_vec();
    let forward_done = Instant::now();
    let gradients = backward(&loss.sum);
    let backward_done = Instant::now();
    for param in model.params() {
        if let Some(g) = grad(&param.value, &gradients) {
            let _host = g.into_vec();
        }
    }
    let copied = Instant::now();
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    [
        ms(started, forward_done),
        ms(forward_done, backward_done),
        ms(backward_done, copied),
    ]
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[(values.len() - 1) / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let config = LlamaConfig::small();
    let fused = LlamaModel::init(&config, 0, &cpu_device(true)).expect("valid preset");
    let composed = fused
        .clone()
        .with_attention_kernel(AttentionKernel::Composed);
    let examples = batch(4096);
    let packed = flatten(&examples).expect("flattens");
    let input = ModelInput::Varlen(&packed);
    let variants = [
        ("composed attention, full logits", &composed, false),
        ("composed attention, labelled rows", &composed, true),
        ("fused attention, full logits", &fused, false),
        ("fused attention, labelled rows", &fused, true),
    ];
    let mut samples: Vec<Vec<Phases>> = vec![Vec::new(); variants.len()];
    // One untimed round warms caches and the allocator.
    for round in 0..=rounds {
        for (index, (_, model, labelled)) in variants.iter().enumerate() {
            let phases = step(model, &input, *labelled);
            if round > 0 {
                samples[index].push(phases);
            }
        }
    }
    println!(
        "small preset, {} tokens in {} examples, {} with labels; median of {rounds} rounds, ms",
        packed.num_tokens(),
        packed.num_examples(),
        packed.num_loss_tokens()
    );
    println!("| variant | forward + loss | backward | grads to host | step |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for ((name, _, _), runs) in variants.iter().zip(&samples) {
        let phase = |i: usize| median(runs.iter().map(|p| p[i]).collect());
        let total = median(runs.iter().map(|p| p.iter().sum()).collect());
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {total:.0} |",
            phase(0),
            phase(1),
            phase(2)
        );
    }
}
