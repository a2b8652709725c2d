//! Against Hugging Face transformers on the same weights: the fixtures in
//! `fixtures/hf/` were written by `scripts/make_reference.py` (transformers'
//! own `DataCollatorWithFlattening`, eager attention, float32, CPU). Our
//! collator must reproduce transformers' flattened batch exactly, and our model
//! its logits, mean loss and every parameter gradient.
//!
//! Tolerances: two f32 implementations of the same maths with different
//! summation orders (torch's BLAS against burn's gemm, its softmax against
//! ours). Logits are O(1): 2e-5 absolute. The mean loss: 1e-5 relative.
//! Gradients: 1e-4 of each tensor's largest gradient plus 1e-7 absolute, the
//! same bound as the padded/flattened equivalence tests.

mod common;

use std::path::{Path, PathBuf};

use common::{assert_close, fixture_examples, floats, host, ints, param_grads};
use padfree_model::tensor::{backward, cpu_device};
use padfree_model::{LlamaModel, ModelInput, causal_lm_loss};
use padfree_pack::flatten;
use safetensors::SafeTensors;

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/hf")
        .join(name)
}

fn check_against_transformers(name: &str) {
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

    let model = LlamaModel::from_hf_dir(&dir, &cpu_device(true)).expect("loads the HF checkpoint");
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

#[test]
fn llama_matches_transformers() {
    check_against_transformers("llama-tiny");
}

#[test]
fn mistral_with_tied_embeddings_matches_transformers() {
    check_against_transformers("mistral-tiny");
}

#[test]
fn qwen2_with_qkv_biases_matches_transformers() {
    check_against_transformers("qwen2-tiny");
}

#[test]
fn qwen3_with_per_head_qk_norm_matches_transformers() {
    check_against_transformers("qwen3-tiny");
}
