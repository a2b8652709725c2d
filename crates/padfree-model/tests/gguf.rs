//! GGUF import against llama.cpp's own Python package (`gguf` on PyPI): the
//! fixtures in `fixtures/gguf/` were written by `scripts/make_gguf_fixtures.py`.

mod common;

use std::path::{Path, PathBuf};

use common::host;
use padfree_model::gguf::{GgmlType, GgufFile, dequantize};
use padfree_model::tensor::cpu_device;
use padfree_model::{LlamaModel, ModelError};
use safetensors::SafeTensors;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// Our dequantisation equals gguf-py's, value for value: both compute the
/// same f32 products in the same order, so no tolerance is needed.
#[test]
fn dequantization_matches_llama_cpp_reference() {
    let bytes =
        std::fs::read(fixtures().join("gguf/dequant.safetensors")).expect("fixture present");
    let fixture = SafeTensors::deserialize(&bytes).expect("valid fixture");
    let types = [
        ("Q4_0", GgmlType::Q4_0),
        ("Q4_1", GgmlType::Q4_1),
        ("Q8_0", GgmlType::Q8_0),
        ("Q4_K", GgmlType::Q4K),
        ("Q6_K", GgmlType::Q6K),
    ];
    for (name, ggml_type) in types {
        let raw = fixture.tensor(&format!("raw.{name}")).expect("raw blocks");
        let expected: Vec<f32> = fixture
            .tensor(&format!("expected.{name}"))
            .expect("expected values")
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let ours = dequantize(ggml_type, raw.data());
        assert_eq!(ours.len(), expected.len(), "{name}: value count");
        for (index, (a, b)) in ours.iter().zip(&expected).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{name}: value {index}: ours {a}, gguf-py {b}"
            );
        }
    }
}

/// The tiny HF Llama, converted as llama.cpp does (renamed, query/key rows
/// permuted, embedding in Q8_0), loads back to the HF weights.
#[test]
fn a_converted_llama_loads_back_to_the_hf_weights() {
    let device = cpu_device(false);
    let from_gguf = LlamaModel::from_gguf(&fixtures().join("gguf/llama-tiny.gguf"), &device)
        .expect("loads GGUF");
    let from_hf =
        LlamaModel::from_hf_dir(&fixtures().join("hf/llama-tiny"), &device).expect("loads HF");
    let (a, b) = (from_gguf.config(), from_hf.config());
    assert_eq!(
        (
            a.vocab_size,
            a.hidden_size,
            a.intermediate_size,
            a.num_hidden_layers
        ),
        (
            b.vocab_size,
            b.hidden_size,
            b.intermediate_size,
            b.num_hidden_layers
        )
    );
    assert_eq!(
        (a.num_attention_heads, a.num_key_value_heads, a.head_dim),
        (b.num_attention_heads, b.num_key_value_heads, b.head_dim)
    );
    assert_eq!(
        (a.rope_theta, a.tie_word_embeddings),
        (b.rope_theta, b.tie_word_embeddings)
    );
    assert!((a.rms_norm_eps - b.rms_norm_eps).abs() < 1e-9);

    for (ours, theirs) in from_gguf.params().into_iter().zip(from_hf.params()) {
        assert_eq!(ours.name(), theirs.name());
        let (x, y) = (host(ours.value.clone()), host(theirs.value.clone()));
        if ours.name() == "model.embed_tokens.weight" {
            // Q8_0 rounds each value to a multiple of its block's max/127.
            let err = x
                .iter()
                .zip(&y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            assert!(err < 1e-3, "embedding quantisation error {err}");
        } else {
            assert_eq!(x, y, "{}", ours.name());
        }
    }
}

#[test]
fn a_file_that_is_not_gguf_is_refused_with_its_path() {
    let path = fixtures().join("hf/llama-tiny/config.json");
    match GgufFile::open(&path) {
        Err(err @ ModelError::Format { .. }) => {
            assert!(err.to_string().contains("config.json"), "{err}")
        }
        other => panic!("expected a format error, got {other:?}"),
    }
}
