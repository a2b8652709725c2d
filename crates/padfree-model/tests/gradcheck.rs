//! Finite-difference check of the analytic gradients on a very small model.
//!
//! For every parameter tensor `W` with analytic gradient `g`, the directional
//! derivative of the mean loss along a direction `u` is measured by central
//! differences, `(L(W + e u) - L(W - e u)) / 2e`, and compared with `<g, u>`.
//! Two directions per tensor: `g / |g|` (large signal; wrong gradients give
//! `<true g, u> != |g|`) and a random unit direction.
//!
//! Step and tolerance: the f32 mean loss (~ln V = 3.5) is computed through
//! thousands of roundings and moves by a few 1e-6 between nearby points for
//! reasons unrelated to its slope; divided by 2e = 6e-3 that is ~1e-3 of noise
//! in the difference quotient (measured: steps of 1e-3 and 3e-4 show errors of
//! 5e-4 and 8e-4 on derivatives of 1e-2). Larger steps add O(e^2) truncation
//! error (a step of 1e-2 is 3% off on the steepest tensor). So e = 3e-3 and
//! the bound is 1e-3 absolute plus 2% relative; along the gradient direction
//! the derivatives are 1 to 5, where 2% is a tight check.

mod common;

use common::{examples, host, param_grads};
use padfree_model::tensor::{backward, cpu_device, float_tensor};
use padfree_model::{LlamaConfig, LlamaModel, ModelInput, causal_lm_loss};
use padfree_pack::{SplitMix64, flatten};

fn micro_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 4,
        // A large init makes every path carry signal (0.02 leaves attention nearly uniform).
        initializer_range: 0.3,
        ..LlamaConfig::tiny()
    }
}

fn mean_loss(model: &LlamaModel, input: &ModelInput<'_>) -> f32 {
    let logits = model.forward(input).expect("forward");
    let loss = causal_lm_loss(logits, &input.targets()).expect("loss");
    host(loss.mean())[0]
}

/// The same model with parameter `index` moved by `step * direction`.
fn moved(model: &LlamaModel, index: usize, direction: &[f32], step: f32) -> LlamaModel {
    let mut model = model.clone();
    let param = &mut model.params_mut()[index];
    let [rows, cols] = param.value.dims();
    let values: Vec<f32> = host(param.value.clone())
        .iter()
        .zip(direction)
        .map(|(w, u)| w + step * u)
        .collect();
    param.value = float_tensor(values, [rows, cols], &cpu_device(false));
    model
}

fn unit(values: Vec<f32>) -> Vec<f32> {
    let norm = values.iter().map(|v| v * v).sum::<f32>().sqrt();
    values.iter().map(|v| v / norm).collect()
}

#[test]
fn analytic_gradients_match_finite_differences() {
    let config = micro_config();
    let examples = examples(&[5, 3, 7], config.vocab_size as u32, 9);
    let batch = flatten(&examples).expect("flattens");
    let input = ModelInput::Varlen(&batch);

    let trainable = LlamaModel::init(&config, 1, &cpu_device(true)).expect("valid config");
    let logits = trainable.forward(&input).expect("forward");
    let loss = causal_lm_loss(logits, &input.targets()).expect("loss");
    let grads = param_grads(&trainable, &backward(&loss.mean()));
    let plain = LlamaModel::init(&config, 1, &cpu_device(false)).expect("valid config");

    let mut rng = SplitMix64::new(5);
    let step = 3e-3;
    for (index, (name, g)) in grads.iter().enumerate() {
        let random: Vec<f32> = (0..g.len())
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        for (kind, direction) in [("gradient", unit(g.clone())), ("random", unit(random))] {
            let analytic: f32 = g.iter().zip(&direction).map(|(a, b)| a * b).sum();
            let plus = mean_loss(&moved(&plain, index, &direction, step), &input);
            let minus = mean_loss(&moved(&plain, index, &direction, -step), &input);
            let numeric = (plus - minus) / (2.0 * step);
            let tolerance = 1e-3 + 2e-2 * analytic.abs().max(numeric.abs());
            assert!(
                (analytic - numeric).abs() <= tolerance,
                "{name} along the {kind} direction: analytic {analytic:e}, finite difference {numeric:e}"
            );
        }
    }
}
