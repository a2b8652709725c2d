//! Helpers shared by the model's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use padfree_model::tensor::{Device, Gradients, IntoHostVec, Tensor, backward, cpu_device, grad};
use padfree_model::{LlamaConfig, LlamaModel, ModelInput, causal_lm_loss};
use padfree_pack::{Example, flatten, synthetic_prompted_examples};
use safetensors::{Dtype, SafeTensors};

pub mod gpu;

/// Examples of the given lengths with pseudo-random ids below `vocab`, the
/// first third of each a prompt without labels, so masking is exercised too.
pub fn examples(lengths: &[usize], vocab: u32, seed: u64) -> Vec<Example> {
    synthetic_prompted_examples(lengths, vocab, seed, 3)
}

/// Logits of the real tokens of a padded batch, in flattened order.
pub fn real_rows(
    padded_logits: &[f32],
    examples: &[Example],
    seq_len: usize,
    vocab: usize,
) -> Vec<f32> {
    let mut rows = Vec::new();
    for (row, example) in examples.iter().enumerate() {
        let start = row * seq_len * vocab;
        rows.extend_from_slice(&padded_logits[start..start + example.len() * vocab]);
    }
    rows
}

/// The model on an autodiff device.
pub fn trainable_model(config: &LlamaConfig, seed: u64) -> LlamaModel {
    LlamaModel::init(config, seed, &cpu_device(true)).expect("valid config")
}

/// Loss sum, its label-token count and the gradients of the sum.
pub fn loss_and_grads(model: &LlamaModel, input: &ModelInput<'_>) -> (f32, usize, Gradients) {
    let logits = model.forward(input).expect("forward");
    let loss = causal_lm_loss(logits, &input.targets()).expect("loss");
    let value = loss.sum.clone().into_vec()[0];
    let grads = backward(&loss.sum);
    (value, loss.num_tokens, grads)
}

/// Every parameter's gradient, by HF name.
pub fn param_grads(model: &LlamaModel, grads: &Gradients) -> Vec<(String, Vec<f32>)> {
    model
        .params()
        .into_iter()
        .map(|p| {
            let g = grad(&p.value, grads)
                .map(IntoHostVec::into_vec)
                .unwrap_or_else(|| vec![0.0; p.numel()]);
            (p.name().to_owned(), g)
        })
        .collect()
}

/// Largest absolute difference and largest magnitude of the reference.
pub fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f32::max);
    (diff, scale)
}

/// Asserts `|a - b| <= atol + rtol * max|b|` elementwise, naming `what`.
pub fn assert_close(what: &str, a: &[f32], b: &[f32], atol: f32, rtol: f32) {
    let (diff, scale) = max_diff(a, b);
    assert!(
        diff <= atol + rtol * scale,
        "{what}: max abs diff {diff:e} exceeds {atol:e} + {rtol:e} * {scale:e}"
    );
}

/// Host copy of a tensor.
pub fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_vec()
}

/// An i64 tensor of a fixture, by name.
pub fn ints(tensors: &SafeTensors<'_>, name: &str) -> Vec<i64> {
    fixture_tensor(tensors, name, Dtype::I64, i64::from_le_bytes)
}

/// An f32 tensor of a fixture, by name.
pub fn floats(tensors: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    fixture_tensor(tensors, name, Dtype::F32, f32::from_le_bytes)
}

/// A fixture tensor of `dtype`, its little-endian `N`-byte elements decoded.
fn fixture_tensor<T, const N: usize>(
    tensors: &SafeTensors<'_>,
    name: &str,
    dtype: Dtype,
    decode: fn([u8; N]) -> T,
) -> Vec<T> {
    let view = tensors
        .tensor(name)
        .unwrap_or_else(|_| panic!("fixture lacks {name}"));
    assert_eq!(view.dtype(), dtype, "{name}");
    view.data()
        .chunks_exact(N)
        .map(|b| decode(b.try_into().expect("N bytes")))
        .collect()
}

/// The examples of a fixture: its `input_ids` cut by its `lengths`, with
/// `labels` (one per token) cut the same way.
pub fn fixture_examples(tensors: &SafeTensors<'_>, labels: &[i64]) -> Vec<Example> {
    let input_ids = ints(tensors, "input_ids");
    let mut examples = Vec::new();
    let mut start = 0;
    for len in ints(tensors, "lengths") {
        let end = start + len as usize;
        let ids = input_ids[start..end].iter().map(|&id| id as u32).collect();
        examples.push(Example::new(ids, labels[start..end].to_vec()).expect("valid example"));
        start = end;
    }
    examples
}

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/hf")
        .join(name)
}

/// The HF fixture `name` (`fixtures/hf/`) on `device` (autodiff): our
/// collator against `DataCollatorWithFlattening`, our logits, mean loss and
/// every gradient against transformers' (tolerances: `hf_reference.rs`).
pub fn check_against_transformers(name: &str, device: &Device) {
    let dir = fixture_dir(name);
    let bytes = std::fs::read(dir.join("expected.safetensors")).expect("fixture present");
    let expected = SafeTensors::deserialize(&bytes).expect("valid fixture");

    // Rebuild the examples and flatten them with our collator.
    let labels = ints(&expected, "labels");
    let examples = fixture_examples(&expected, &labels);
    let batch = flatten(&examples).expect("flattens");
    let hf_positions: Vec<u32> = ints(&expected, "position_ids")
        .iter()
        .map(|&p| p as u32)
        .collect();
    assert_eq!(
        batch.labels(),
        labels.as_slice(),
        "labels differ from DataCollatorWithFlattening's"
    );
    assert_eq!(
        batch.position_ids(),
        hf_positions.as_slice(),
        "position_ids differ from transformers'"
    );

    let model = LlamaModel::from_hf_dir(&dir, device).expect("loads the HF checkpoint");
    let input = ModelInput::Varlen(&batch);
    let logits = model.forward(&input).expect("forward");
    assert_close(
        "logits",
        &host(logits.clone()),
        &floats(&expected, "logits"),
        2e-5,
        0.0,
    );

    let loss = causal_lm_loss(logits, &input.targets()).expect("loss");
    let mean = loss.mean();
    assert_close(
        "mean loss",
        &host(mean.clone()),
        &floats(&expected, "loss"),
        0.0,
        1e-5,
    );

    let grads = param_grads(&model, &backward(&mean));
    for (param, ours) in grads {
        let theirs = floats(&expected, &format!("grad.{param}"));
        assert_close(&format!("{param}: gradient"), &ours, &theirs, 1e-7, 1e-4);
    }
}
