//! A Llama-architecture GGUF file: its config from the metadata, and each
//! tensor of the parameter table by llama.cpp's name, dequantised to f32 and
//! with llama.cpp's query/key row permutation undone.

use super::file::{GgmlType, GgufFile, GgufTensorInfo, GgufValue};
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::weights::quantized::QuantMatrix;
use crate::weights::table::{ParamSpec, RopeRows};

impl LlamaConfig {
    /// The architecture described by a GGUF file's metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let arch = file
            .get("general.architecture")
            .and_then(GgufValue::as_str)
            .unwrap_or("");
        if arch != "llama" {
            return Err(gguf_config_error(
                file,
                "general.architecture",
                format!("is `{arch}`; only `llama` (Llama, Mistral, SmolLM2, ...) is supported"),
            ));
        }
        let int = |key: &str| -> Result<usize, ModelError> {
            file.get(&format!("llama.{key}"))
                .and_then(GgufValue::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| gguf_config_error(file, "metadata", format!("lacks `llama.{key}`")))
        };
        let optional_int = |key: &str| {
            file.get(&format!("llama.{key}"))
                .and_then(GgufValue::as_u64)
                .map(|v| v as usize)
        };
        let float = |key: &str| {
            file.get(&format!("llama.{key}"))
                .and_then(GgufValue::as_f64)
        };
        if let Some(kind) = file
            .get("llama.rope.scaling.type")
            .and_then(GgufValue::as_str)
            .filter(|kind| *kind != "none")
        {
            return Err(gguf_config_error(
                file,
                "llama.rope.scaling.type",
                format!("is `{kind}`; only unscaled rotary embeddings are supported"),
            ));
        }
        let hidden_size = int("embedding_length")?;
        let heads = int("attention.head_count")?;
        let vocab_size = optional_int("vocab_size")
            .or_else(|| {
                file.get("tokenizer.ggml.tokens")
                    .and_then(GgufValue::as_array)
                    .map(<[_]>::len)
            })
            .ok_or_else(|| {
                gguf_config_error(file, "metadata", "gives no vocabulary size".to_owned())
            })?;
        let config = LlamaConfig {
            model_type: "llama".to_owned(),
            vocab_size,
            hidden_size,
            intermediate_size: int("feed_forward_length")?,
            num_hidden_layers: int("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: optional_int("attention.head_count_kv").unwrap_or(heads),
            head_dim: optional_int("attention.key_length")
                .or_else(|| optional_int("rope.dimension_count"))
                .unwrap_or(hidden_size.checked_div(heads).unwrap_or(0)),
            rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: float("rope.freq_base").unwrap_or(10_000.0),
            tie_word_embeddings: !file.tensors.contains_key("output.weight"),
            max_position_embeddings: optional_int("context_length").unwrap_or(2048),
            sliding_window: None,
            initializer_range: 0.02,
            bos_token_id: file
                .get("tokenizer.ggml.bos_token_id")
                .and_then(GgufValue::as_u64),
            eos_token_id: file
                .get("tokenizer.ggml.eos_token_id")
                .and_then(GgufValue::as_u64)
                .map(serde_json::Value::from),
            qkv_bias: false,
            qk_norm: false,
        };
        config.validate()?;
        Ok(config)
    }
}

fn gguf_config_error(file: &GgufFile, field: &'static str, message: String) -> ModelError {
    ModelError::Format {
        path: file.path().to_owned(),
        message: format!("{field} {message}"),
        hint: if field == "metadata" {
            "the GGUF file lacks Llama metadata; convert the model again with llama.cpp's convert_hf_to_gguf.py"
        } else {
            "this model uses a feature padfree does not implement; pick a plain Llama, Mistral or SmolLM2 GGUF"
        },
    }
}

/// Undoes llama.cpp's conversion permutation of query/key rows.
///
/// llama.cpp interleaves the two rotary halves of every head (its rope rotates
/// adjacent pairs); HF keeps them as halves (rotate-half). Within a head of
/// `D` rows, GGUF row `2i + s` is HF row `s * D/2 + i`.
///
/// # Shapes
/// `values`: `[heads * D, cols]`, row-major.
fn unpermute_rows<T: Copy + Default>(values: &[T], heads: usize, cols: usize) -> Vec<T> {
    let rows = values.len() / cols;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![T::default(); values.len()];
    for head in 0..heads {
        for i in 0..half {
            for s in 0..2 {
                let from = head * head_dim + 2 * i + s;
                let to = head * head_dim + s * half + i;
                out[to * cols..(to + 1) * cols]
                    .copy_from_slice(&values[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// The tensor of `spec` in `file` kept in its blocks, rows in HF order
/// (`QuantMatrix`); `None` for f32 tensors, which stay f32.
pub(crate) fn read_quantized(
    file: &GgufFile,
    config: &LlamaConfig,
    spec: &ParamSpec,
) -> Result<Option<QuantMatrix>, ModelError> {
    let info = checked_info(file, spec)?;
    let (ggml_type, data) = file.raw(&spec.gguf_name)?;
    if ggml_type == GgmlType::F32 {
        return Ok(None);
    }
    let [rows, cols] = spec.matrix_shape();
    let row_bytes = data.len() / rows.max(1);
    let data = match spec.rope_rows {
        RopeRows::QueryHeads => unpermute_rows(&data, config.num_attention_heads, row_bytes),
        RopeRows::KvHeads => unpermute_rows(&data, config.num_key_value_heads, row_bytes),
        RopeRows::No => data,
    };
    QuantMatrix::new(ggml_type, rows, cols, data)
        .map(Some)
        .ok_or_else(|| ModelError::Weights {
            path: file.path().to_owned(),
            tensor: info.name.clone(),
            message: format!("{ggml_type:?} rows of {cols} values are not whole blocks"),
            hint: "the GGUF file is corrupt; convert the model again",
        })
}

/// The tensor info of `spec`, refused when missing or shaped otherwise.
fn checked_info<'a>(
    file: &'a GgufFile,
    spec: &ParamSpec,
) -> Result<&'a GgufTensorInfo, ModelError> {
    let name = &spec.gguf_name;
    let hf_shape = spec.hf_shape.as_slice();
    let info = file.tensors.get(name).ok_or_else(|| ModelError::Weights {
        path: file.path().to_owned(),
        tensor: name.clone(),
        message: format!("is missing (needed for {})", spec.hf_name),
        hint: "the GGUF file is not a complete Llama-architecture model",
    })?;
    if info.shape() != hf_shape {
        return Err(ModelError::Weights {
            path: file.path().to_owned(),
            tensor: name.clone(),
            message: format!(
                "has shape {:?}, the metadata implies {hf_shape:?}",
                info.shape()
            ),
            hint: "the GGUF metadata and tensors disagree; convert the model again",
        });
    }
    Ok(info)
}

/// The tensor of `spec` in `file`, as HF holds it (f32, HF row order).
pub(crate) fn read_tensor(
    file: &GgufFile,
    config: &LlamaConfig,
    spec: &ParamSpec,
) -> Result<Vec<f32>, ModelError> {
    checked_info(file, spec)?;
    let values = file.dequantize(&spec.gguf_name)?;
    let cols = spec.hf_shape.last().copied().unwrap_or(1);
    Ok(match spec.rope_rows {
        RopeRows::QueryHeads => unpermute_rows(&values, config.num_attention_heads, cols),
        RopeRows::KvHeads => unpermute_rows(&values, config.num_key_value_heads, cols),
        RopeRows::No => values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's name for an HF name, from the parameter table.
    fn gguf_name(hf_name: &str) -> String {
        let mut config = LlamaConfig::tiny();
        config.num_hidden_layers = 13;
        config.tie_word_embeddings = false;
        crate::weights::table::param_specs(&config)
            .into_iter()
            .find(|spec| spec.hf_name == hf_name)
            .map(|spec| spec.gguf_name)
            .unwrap_or_default()
    }

    #[test]
    fn names_follow_llama_cpp() {
        assert_eq!(
            gguf_name("model.layers.12.self_attn.o_proj.weight"),
            "blk.12.attn_output.weight"
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight"),
            "blk.0.ffn_norm.weight"
        );
        assert_eq!(gguf_name("lm_head.weight"), "output.weight");
    }

    /// llama.cpp's `permute` in convert_hf_to_gguf.py, transcribed:
    /// `w.reshape(heads, 2, D/2, cols).swapaxes(1, 2).reshape(w.shape)`.
    fn permute_like_llama_cpp(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
        let rows = values.len() / cols;
        let half = rows / heads / 2;
        let mut out = Vec::with_capacity(values.len());
        for head in 0..heads {
            for i in 0..half {
                for s in 0..2 {
                    let row = head * 2 * half + s * half + i;
                    out.extend_from_slice(&values[row * cols..(row + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermuting_inverts_llama_cpp_permutation() {
        let (heads, head_dim, cols) = (3, 8, 5);
        let hf: Vec<f32> = (0..heads * head_dim * cols).map(|v| v as f32).collect();
        let gguf = permute_like_llama_cpp(&hf, heads, cols);
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_rows(&gguf, heads, cols), hf);
    }
}
