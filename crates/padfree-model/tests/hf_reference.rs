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

use padfree_model::tensor::cpu_device;

fn check_against_transformers(name: &str) {
    common::check_against_transformers(name, &cpu_device(true));
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
