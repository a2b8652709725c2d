//! padfree's fast paths against their slow, obvious oracles on the same
//! weights and batch:
//!
//! - the fused varlen attention kernel against the attention composed of
//!   burn ops, one example at a time (`AttentionKernel::Composed`);
//! - `LlamaModel::loss_sum` (logits only for labelled rows, fused
//!   cross-entropy) against `causal_lm_loss` over the full logits;
//! - fused RMSNorm and SwiGLU against their formulas in burn ops.
//!
//! Tolerances: both sides run the same f32 arithmetic except the order of
//! the sums (the kernel sums dot products in eight lanes, the composed path
//! in gemm's order), which moves results by a few ulps per op. Gradients
//! here are of the summed loss (magnitudes up to ~1), so 1e-5 absolute plus
//! 1e-4 relative leaves a margin of ~10x over the differences seen, and is
//! still far below what a wrong mask or a missing term would produce (the
//! isolation test below changes losses at the 1e-2 level).

mod common;

use common::{assert_close, examples, host, loss_and_grads, param_grads, trainable_model};
use padfree_model::kernels::{composed_rms_norm, composed_swiglu, rms_norm, swiglu};
use padfree_model::tensor::{
    IntoHostVec, Tensor, backward, cpu_device, cpu_device_with_checkpointing, float_tensor, grad,
    trainable,
};
use padfree_model::{AttentionKernel, LlamaConfig, LlamaModel, ModelInput};
use padfree_pack::{Example, flatten, pad};

const ATOL: f32 = 1e-5;
const RTOL: f32 = 1e-4;

/// Grouped heads (8 query / 4 key-value), head size 32 (a multiple of the
/// kernel's 8 lanes) and a larger init so attention is far from uniform.
fn config() -> LlamaConfig {
    LlamaConfig {
        initializer_range: 0.2,
        ..LlamaConfig::tiny()
    }
}

/// Ragged lengths, including a one-token example (no label left after the
/// shift) and a 2-token one.
fn batch(config: &LlamaConfig) -> Vec<Example> {
    examples(&[37, 1, 64, 2, 19], config.vocab_size as u32, 7)
}

fn assert_same_grads(
    a: &LlamaModel,
    b: &LlamaModel,
    ga: &padfree_model::tensor::Gradients,
    gb: &padfree_model::tensor::Gradients,
) {
    for ((name, x), (_, y)) in param_grads(a, ga).iter().zip(param_grads(b, gb)) {
        assert_close(name, x, &y, ATOL, RTOL);
    }
}

#[test]
fn fused_attention_matches_the_composed_oracle() {
    let config = config();
    let fused = trainable_model(&config, 3);
    assert_eq!(
        fused.attention_kernel(),
        AttentionKernel::Fused,
        "fused is the default"
    );
    let composed = fused
        .clone()
        .with_attention_kernel(AttentionKernel::Composed);
    let packed = flatten(&batch(&config)).expect("flattens");
    for input in [
        ModelInput::Varlen(&packed),
        ModelInput::VarlenPerLayer(&packed),
    ] {
        let logits_fused = host(fused.forward(&input).expect("forward"));
        let logits_composed = host(composed.forward(&input).expect("forward"));
        assert_close("logits", &logits_fused, &logits_composed, ATOL, RTOL);

        let (loss_fused, _, grads_fused) = loss_and_grads(&fused, &input);
        let (loss_composed, _, grads_composed) = loss_and_grads(&composed, &input);
        assert_close("loss", &[loss_fused], &[loss_composed], ATOL, RTOL);
        assert_same_grads(&fused, &composed, &grads_fused, &grads_composed);
    }
}

/// Padded rows through the fused kernel (each row one sequence, pads at its
/// end) against the composed attention with its `[B, 1, L, L]` mask. Pad
/// rows compute different things in the two (nothing reads them), so
/// logits are compared at real tokens only.
#[test]
fn fused_attention_on_padded_rows_matches_the_masked_oracle() {
    let config = config();
    let fused = trainable_model(&config, 19);
    let composed = fused
        .clone()
        .with_attention_kernel(AttentionKernel::Composed);
    let examples = batch(&config);
    let padded = pad(&examples, 0, None).expect("pads");
    let input = ModelInput::Padded(&padded);
    let (rows, vocab) = (padded.seq_len(), config.vocab_size);
    let real_logits = |model: &LlamaModel| -> Vec<f32> {
        let logits = host(model.forward(&input).expect("forward"));
        let mut kept = Vec::new();
        for (b, example) in examples.iter().enumerate() {
            let start = b * rows * vocab;
            kept.extend_from_slice(&logits[start..start + example.len() * vocab]);
        }
        kept
    };
    assert_close(
        "logits",
        &real_logits(&fused),
        &real_logits(&composed),
        ATOL,
        RTOL,
    );
    let (loss_fused, _, grads_fused) = loss_and_grads(&fused, &input);
    let (loss_composed, _, grads_composed) = loss_and_grads(&composed, &input);
    assert_close("loss", &[loss_fused], &[loss_composed], ATOL, RTOL);
    assert_same_grads(&fused, &composed, &grads_fused, &grads_composed);
}

#[test]
fn fused_attention_under_gradient_checkpointing_gives_the_same_gradients() {
    let config = config();
    let plain = trainable_model(&config, 5);
    let checkpointed =
        LlamaModel::init(&config, 5, &cpu_device_with_checkpointing()).expect("valid");
    let packed = flatten(&batch(&config)).expect("flattens");
    let input = ModelInput::Varlen(&packed);
    let (loss_plain, _, grads_plain) = loss_and_grads(&plain, &input);
    let (loss_checkpointed, _, grads_checkpointed) = loss_and_grads(&checkpointed, &input);
    assert_eq!(loss_plain, loss_checkpointed);
    assert_same_grads(&plain, &checkpointed, &grads_plain, &grads_checkpointed);
}

#[test]
fn fused_attention_keeps_examples_apart() {
    let config = config();
    let model = trainable_model(&config, 11);
    let mut examples = batch(&config);
    let alone = flatten(&examples[..1]).expect("flattens");
    let first_alone = host(model.forward(&ModelInput::Varlen(&alone)).expect("forward"));
    // Another batch whose later examples are different: the first example's
    // logits must not move.
    examples.truncate(1);
    examples.extend(common::examples(&[50, 9], config.vocab_size as u32, 99));
    let together = flatten(&examples).expect("flattens");
    let logits = host(
        model
            .forward(&ModelInput::Varlen(&together))
            .expect("forward"),
    );
    assert_close(
        "first example's logits",
        &logits[..first_alone.len()],
        &first_alone,
        ATOL,
        RTOL,
    );
}

#[test]
fn loss_on_labelled_rows_matches_the_full_logits_oracle() {
    let config = config();
    let model = trainable_model(&config, 13);
    let packed = flatten(&batch(&config)).expect("flattens");
    let input = ModelInput::Varlen(&packed);
    let fast = model.loss_sum(&input).expect("loss");
    let fast_value = fast.sum.clone().into_vec()[0];
    let fast_grads = backward(&fast.sum);
    let (oracle_value, oracle_tokens, oracle_grads) = loss_and_grads(&model, &input);
    assert_eq!(fast.num_tokens, oracle_tokens);
    assert_close("loss", &[fast_value], &[oracle_value], ATOL, RTOL);
    assert_same_grads(&model, &model, &fast_grads, &oracle_grads);
}

#[test]
fn loss_without_labels_is_zero_and_still_differentiable() {
    let config = config();
    let model = trainable_model(&config, 17);
    let ids = vec![1, 2, 3, 4];
    let unlabelled = Example::new(ids, vec![-100; 4]).expect("valid");
    let packed = flatten(&[unlabelled]).expect("flattens");
    let loss = model.loss_sum(&ModelInput::Varlen(&packed)).expect("loss");
    assert_eq!(loss.num_tokens, 0);
    assert_eq!(loss.sum.clone().into_vec(), vec![0.0]);
    let grads = backward(&loss.sum);
    for (name, g) in param_grads(&model, &grads) {
        assert!(
            g.iter().all(|&x| x == 0.0),
            "{name} has a gradient without labels"
        );
    }
}

/// `[rows, cols]` of smooth pseudo-random values on an autodiff device.
fn leaf(rows: usize, cols: usize, seed: u64) -> Tensor<2> {
    let mut rng = padfree_pack::SplitMix64::new(seed);
    let values = (0..rows * cols)
        .map(|_| rng.standard_normal() as f32)
        .collect();
    trainable(float_tensor(values, [rows, cols], &cpu_device(true)))
}

/// Gradients of `sum(out * probe)` with respect to `leaves`.
fn grads_of(out: Tensor<2>, probe: &Tensor<2>, leaves: &[&Tensor<2>]) -> Vec<Vec<f32>> {
    let gradients = backward(&(out * probe.clone()).sum());
    leaves
        .iter()
        .map(|leaf| {
            grad(leaf, &gradients)
                .map(IntoHostVec::into_vec)
                .unwrap_or_default()
        })
        .collect()
}

#[test]
fn fused_rms_norm_matches_the_composed_formula() {
    let (x, weight) = (leaf(70, 48, 1), leaf(1, 48, 2));
    let probe = leaf(70, 48, 3).detach();
    let eps = 1e-5;
    let fused = rms_norm(x.clone(), weight.clone(), eps).expect("fused");
    // HF's LlamaRMSNorm, op by op (the GPU path too).
    let composed = composed_rms_norm(x.clone(), weight.clone(), eps);
    assert_close(
        "rms_norm",
        &host(fused.clone()),
        &host(composed.clone()),
        ATOL,
        RTOL,
    );
    let fused_grads = grads_of(fused, &probe, &[&x, &weight]);
    let composed_grads = grads_of(composed, &probe, &[&x, &weight]);
    for (name, (a, b)) in ["dx", "dweight"]
        .iter()
        .zip(fused_grads.iter().zip(&composed_grads))
    {
        assert!(!a.is_empty(), "{name} missing");
        assert_close(name, a, b, ATOL, RTOL);
    }
}

#[test]
fn fused_swiglu_matches_the_composed_formula() {
    let (gate, up) = (leaf(33, 40, 4), leaf(33, 40, 5));
    let probe = leaf(33, 40, 6).detach();
    let fused = swiglu(gate.clone(), up.clone()).expect("fused");
    let composed = composed_swiglu(gate.clone(), up.clone());
    assert_close(
        "swiglu",
        &host(fused.clone()),
        &host(composed.clone()),
        ATOL,
        RTOL,
    );
    let fused_grads = grads_of(fused, &probe, &[&gate, &up]);
    let composed_grads = grads_of(composed, &probe, &[&gate, &up]);
    for (name, (a, b)) in ["d_gate", "d_up"]
        .iter()
        .zip(fused_grads.iter().zip(&composed_grads))
    {
        assert!(!a.is_empty(), "{name} missing");
        assert_close(name, a, b, ATOL, RTOL);
    }
}
