//! A Hugging Face `tokenizers` tokenizer rebuilt from a GGUF file's
//! `tokenizer.ggml.*` metadata (byte-level BPE, llama.cpp's `gpt2` model).

use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::file::{GgufFile, GgufValue};
use crate::error::ModelError;

/// llama.cpp's token type for control tokens (`<|im_start|>`, `<|endoftext|>`, ...).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's token type for user-defined tokens, also matched whole.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

fn tokenizer_error(file: &GgufFile, message: String) -> ModelError {
    ModelError::Format {
        path: file.path().to_owned(),
        message,
        hint: "padfree builds byte-level BPE tokenizers (llama.cpp's `gpt2` model) from GGUF; pass a tokenizer.json instead",
    }
}

fn strings(file: &GgufFile, key: &str) -> Result<Vec<String>, ModelError> {
    let values = file
        .get(key)
        .and_then(GgufValue::as_array)
        .ok_or_else(|| tokenizer_error(file, format!("lacks `{key}`")))?;
    values
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| tokenizer_error(file, format!("`{key}` holds a non-string")))
        })
        .collect()
}

/// Builds the tokenizer of a GGUF file.
///
/// The pre-tokenizer follows the file's `tokenizer.ggml.pre`: SmolLM-style
/// (`smollm`) splits digits one by one before the GPT-2 byte-level split;
/// other byte-level models use the GPT-2 split alone. Control and
/// user-defined tokens are special tokens, matched whole in the text.
pub fn tokenizer_from_gguf(file: &GgufFile) -> Result<Tokenizer, ModelError> {
    let model = file
        .get("tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .unwrap_or("");
    if model != "gpt2" {
        return Err(tokenizer_error(
            file,
            format!("has tokenizer model `{model}`"),
        ));
    }
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let merges = strings(file, "tokenizer.ggml.merges")?;
    let token_types: Vec<i64> = file
        .get("tokenizer.ggml.token_type")
        .and_then(GgufValue::as_array)
        .map(|types| {
            types
                .iter()
                .map(|t| t.as_u64().map_or(1, |v| v as i64))
                .collect()
        })
        .unwrap_or_default();

    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| (token.clone(), json!(id)))
        .collect();
    let added_tokens: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter(|&(id, _)| {
            matches!(
                token_types.get(id),
                Some(&TOKEN_TYPE_CONTROL | &TOKEN_TYPE_USER_DEFINED)
            )
        })
        .map(|(id, token)| {
            json!({
                "id": id, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            })
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre = file
        .get("tokenizer.ggml.pre")
        .and_then(GgufValue::as_str)
        .unwrap_or("default");
    let pre_tokenizer = if pre == "smollm" {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level
        ]})
    } else {
        byte_level
    };
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges
        }
    });
    Tokenizer::from_bytes(spec.to_string().as_bytes())
        .map_err(|err| tokenizer_error(file, format!("tokenizer: {err}")))
}
