//! GGUF, llama.cpp's format: the file itself (`file.rs`: header, metadata,
//! tensor directory, dequantisation), a Llama-architecture model in it
//! (`llama.rs`: config from the metadata, tensors by the parameter table),
//! and its tokenizer (`tokenizer.rs`).

mod file;
pub(crate) mod llama;
mod tokenizer;

pub use file::{GgmlType, GgufFile, GgufTensorInfo, GgufValue, dequantize, dequantize_into};
pub use tokenizer::tokenizer_from_gguf;
