//! Weights in and out: the parameter table every format reads
//! (`table.rs`), Hugging Face safetensors (`safetensors.rs`) and GGUF
//! (`gguf/`), and a frozen weight kept in GGUF blocks (`quantized.rs`). Nothing here knows the model type: the model builds itself
//! from the table and hands its parameters over for saving.

pub mod gguf;
pub mod quantized;
pub(crate) mod safetensors;
pub mod table;
