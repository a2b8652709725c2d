//! Safetensors round trips (single file, shards, f16/bf16) and the errors a
//! mismatched or broken checkpoint gets.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::host;
use padfree_model::tensor::cpu_device;
use padfree_model::{LlamaConfig, LlamaModel, ModelError, ModelInput};
use padfree_pack::flatten;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// A fresh directory under the system temp dir, removed (with all it holds)
/// when the returned guard is dropped.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("padfree-weights-{name}-"))
        .tempdir()
        .expect("scratch dir")
}

/// Every parameter of a model as (name, shape, f32 values).
fn tensors_of(model: &LlamaModel) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    model
        .params()
        .into_iter()
        .map(|p| {
            (
                p.name().to_owned(),
                p.hf_shape().to_vec(),
                host(p.value.clone()),
            )
        })
        .collect()
}

/// Writes tensors to a safetensors file in `dtype` (F32, F16 or BF16).
fn write_file(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: Dtype) {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape, values)| {
            let bytes = values
                .iter()
                .flat_map(|&v| match dtype {
                    Dtype::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                    Dtype::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    _ => v.to_le_bytes().to_vec(),
                })
                .collect();
            (name.clone(), shape.clone(), bytes)
        })
        .collect();
    let views: BTreeMap<&str, TensorView<'_>> = encoded
        .iter()
        .map(|(name, shape, bytes)| {
            (
                name.as_str(),
                TensorView::new(dtype, shape.clone(), bytes).expect("valid view"),
            )
        })
        .collect();
    std::fs::write(
        path,
        safetensors::serialize(views, None).expect("serializes"),
    )
    .expect("writes");
}

#[test]
fn save_then_load_gives_the_same_model() {
    let dir_guard = temp_dir("roundtrip");
    let dir = dir_guard.path();
    let config = LlamaConfig::tiny();
    let model = LlamaModel::init(&config, 4, &cpu_device(false)).expect("valid config");
    model.save_hf_dir(dir).expect("saves");
    let loaded = LlamaModel::from_hf_dir(dir, &cpu_device(false)).expect("loads");
    assert_eq!(loaded.config(), &config);
    assert_eq!(tensors_of(&loaded), tensors_of(&model));
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .expect("lists")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind");
}

#[test]
fn reads_half_precision_and_sharded_checkpoints() {
    let config = LlamaConfig::tiny();
    let model = LlamaModel::init(&config, 5, &cpu_device(false)).expect("valid config");
    let tensors = tensors_of(&model);
    for dtype in [Dtype::F16, Dtype::BF16] {
        let dir_guard = temp_dir(&format!("{dtype:?}"));
        let dir = dir_guard.path();
        write_file(&dir.join("model.safetensors"), &tensors, dtype);
        let loaded = LlamaModel::from_safetensors(&config, dir, &cpu_device(false)).expect("loads");
        for ((name, _, want), (_, _, got)) in tensors.iter().zip(tensors_of(&loaded)) {
            for (w, g) in want.iter().zip(&got) {
                let rounded = match dtype {
                    Dtype::F16 => half::f16::from_f32(*w).to_f32(),
                    _ => half::bf16::from_f32(*w).to_f32(),
                };
                assert_eq!(*g, rounded, "{name} in {dtype:?}");
            }
        }
    }

    let dir_guard = temp_dir("sharded");
    let dir = dir_guard.path();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    write_file(
        &dir.join("model-00001-of-00002.safetensors"),
        first,
        Dtype::F32,
    );
    write_file(
        &dir.join("model-00002-of-00002.safetensors"),
        second,
        Dtype::F32,
    );
    let weight_map: serde_json::Map<String, serde_json::Value> = first
        .iter()
        .map(|t| (t.0.clone(), "model-00001-of-00002.safetensors".into()))
        .chain(
            second
                .iter()
                .map(|t| (t.0.clone(), "model-00002-of-00002.safetensors".into())),
        )
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("writes");
    let loaded =
        LlamaModel::from_safetensors(&config, dir, &cpu_device(false)).expect("loads shards");
    assert_eq!(tensors_of(&loaded), tensors);
}

#[test]
fn a_missing_tensor_is_named() {
    let config = LlamaConfig::tiny();
    let model = LlamaModel::init(&config, 6, &cpu_device(false)).expect("valid config");
    let mut tensors = tensors_of(&model);
    tensors.retain(|t| t.0 != "model.layers.1.mlp.up_proj.weight");
    let dir_guard = temp_dir("missing");
    let dir = dir_guard.path();
    write_file(&dir.join("model.safetensors"), &tensors, Dtype::F32);
    match LlamaModel::from_safetensors(&config, dir, &cpu_device(false)) {
        Err(err @ ModelError::Weights { .. }) => {
            let message = err.to_string();
            assert!(
                message.contains("model.layers.1.mlp.up_proj.weight")
                    && message.contains("missing"),
                "{message}"
            );
        }
        other => panic!("expected a weights error, got {other:?}"),
    }
}

#[test]
fn a_misshaped_tensor_is_named_with_both_shapes() {
    let dir_guard = temp_dir("misshaped");
    let dir = dir_guard.path();
    let config = LlamaConfig::tiny();
    LlamaModel::init(&config, 6, &cpu_device(false))
        .expect("valid")
        .save_hf_dir(dir)
        .expect("saves");
    let wider = LlamaConfig {
        intermediate_size: 96,
        ..config
    };
    let err =
        LlamaModel::from_safetensors(&wider, dir, &cpu_device(false)).expect_err("shapes differ");
    let message = err.to_string();
    assert!(
        message.contains("model.layers.0.mlp.gate_proj.weight")
            && message.contains("[128, 64]")
            && message.contains("[96, 64]"),
        "{message}"
    );
}

#[test]
fn a_truncated_file_and_a_bad_config_are_reported_with_their_path() {
    let dir_guard = temp_dir("broken");
    let dir = dir_guard.path();
    LlamaModel::init(&LlamaConfig::tiny(), 6, &cpu_device(false))
        .expect("valid")
        .save_hf_dir(dir)
        .expect("saves");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).expect("reads");
    std::fs::write(&file, &bytes[..bytes.len() / 2]).expect("truncates");
    let err = LlamaModel::from_hf_dir(dir, &cpu_device(false)).expect_err("truncated");
    assert!(matches!(err, ModelError::Format { .. }), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");

    std::fs::write(
        dir.join("config.json"),
        "{ \"vocab_size\": 12,\n \"hidden_size\": }",
    )
    .expect("writes");
    let err = LlamaModel::from_hf_dir(dir, &cpu_device(false)).expect_err("bad json");
    assert!(
        err.to_string().contains("config.json") && err.to_string().contains("line 2"),
        "{err}"
    );
}

#[test]
fn token_ids_outside_the_vocabulary_are_refused() {
    let model = LlamaModel::init(&LlamaConfig::tiny(), 6, &cpu_device(false)).expect("valid");
    let examples = vec![padfree_pack::Example::causal(vec![1, 2, 500]).expect("valid")];
    let batch = flatten(&examples).expect("flattens");
    match model.forward(&ModelInput::Varlen(&batch)) {
        Err(ModelError::TokenOutOfVocab {
            index: 2,
            id: 500,
            vocab_size: 128,
        }) => {}
        other => panic!("expected an out-of-vocabulary error, got {other:?}"),
    }
}

/// A LoRA base in F16 or BF16 files, one file or two shards, held in its
/// 2-byte values (`from_hf_dir_frozen`): half the bytes of the projections,
/// and the logits and adapter gradients of the same files read to f32
/// (1e-5 absolute on O(1) logits, 1e-4 of each gradient's largest plus
/// 1e-7: the same f32 products summed in gemm's order vs burn's).
#[test]
fn a_16_bit_lora_base_stays_16_bit_and_trains_as_its_f32_copy() {
    use padfree_model::tensor::{IntoHostVec, backward, grad};
    use padfree_model::{LoraConfig, LoraTarget};
    let config = LlamaConfig::tiny();
    let model = LlamaModel::init(&config, 8, &cpu_device(false)).expect("valid config");
    let tensors = tensors_of(&model);
    let lora = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: LoraTarget::ALL.to_vec(),
    };
    let batch = common::examples(&[6, 11, 3], 128, 5);
    let packed = flatten(&batch).expect("flattens");
    let input = ModelInput::Varlen(&packed);
    for (dtype, shards) in [(Dtype::BF16, 1), (Dtype::F16, 2)] {
        let dir_guard = temp_dir(&format!("frozen-{dtype:?}"));
        let dir = dir_guard.path();
        model.save_hf_dir(dir).expect("saves the config");
        std::fs::remove_file(dir.join("model.safetensors")).expect("removes");
        if shards == 1 {
            write_file(&dir.join("model.safetensors"), &tensors, dtype);
        } else {
            let (first, second) = tensors.split_at(tensors.len() / 2);
            let mut weight_map = serde_json::Map::new();
            for (name, part) in [("a.safetensors", first), ("b.safetensors", second)] {
                write_file(&dir.join(name), part, dtype);
                for t in part {
                    weight_map.insert(t.0.clone(), name.into());
                }
            }
            let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
            std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())
                .expect("writes");
        }
        let device = cpu_device(true);
        let adapt = |base: LlamaModel| {
            let mut adapted = base.with_lora(&lora, 3, "tiny").expect("valid lora");
            // Non-zero B, so that A has a gradient too.
            for param in adapted.trainable_mut() {
                if param.name().contains("lora_B") {
                    param.value = padfree_model::tensor::trainable(
                        param.value.clone().inner().add_scalar(0.02).autodiff(),
                    );
                }
            }
            adapted
        };
        let half = adapt(LlamaModel::from_hf_dir_frozen(dir, &device).expect("loads 16-bit"));
        let dense = adapt(LlamaModel::from_hf_dir(dir, &device).expect("loads f32"));
        assert!(half.is_quantized() && !dense.is_quantized(), "{dtype:?}");
        let (held, f32_bytes) = (half.weight_bytes(), dense.weight_bytes());
        let projection_values: usize = tensors
            .iter()
            .filter(|t| t.0.contains("_proj"))
            .map(|t| t.2.len())
            .sum();
        assert_eq!(
            f32_bytes - held,
            2 * projection_values,
            "{dtype:?}: bytes held"
        );
        let logits = |m: &LlamaModel| host(m.forward(&input).expect("forward"));
        common::assert_close(
            &format!("{dtype:?} logits"),
            &logits(&half),
            &logits(&dense),
            1e-5,
            0.0,
        );
        let grads = |m: &LlamaModel| {
            let loss = m.loss_sum(&input).expect("loss");
            let g = backward(&loss.sum);
            m.trainable()
                .iter()
                .map(|p| grad(&p.value, &g).expect("adapter gradient").into_vec())
                .collect::<Vec<_>>()
        };
        for (a, b) in grads(&half).iter().zip(grads(&dense)) {
            common::assert_close(&format!("{dtype:?} adapter gradient"), a, &b, 1e-7, 1e-4);
        }
    }
}
