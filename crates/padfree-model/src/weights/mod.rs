//! Weights in and out: the parameter table every format reads
//! (`table.rs`), Hugging Face safetensors (`safetensors.rs`) and GGUF
//! (`gguf/`). Nothing here knows the model type: the model builds itself
//! from the table and hands its parameters over for saving.

pub mod gguf;
pub(crate) mod safetensors;
pub mod table;
