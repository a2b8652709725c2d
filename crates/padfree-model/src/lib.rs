//! # padfree-model
//!
//! A Llama-family decoder (Llama, Mistral, SmolLM2) on burn, whose attention
//! keeps every example of a flattened batch to itself.
//!
//! The model takes a batch from `padfree-pack` as a [`ModelInput`]: the
//! variant picks the attention strategy (`varlen` with the collator's
//! [`padfree_pack::BatchMeta`], `varlen-per-layer`, or `padded`), and the
//! metadata is handed to every layer, never recomputed there.
//!
//! # Shapes
//! `T` tokens of a flattened batch, `B` examples, `L` padded length, `N` rows
//! the model runs on (`T` or `B * L`), `C` hidden size, `H` query heads, `Hkv`
//! key/value heads, `D` head size, `V` vocabulary.

mod attention;
mod config;
mod cross_entropy_kernel;
mod decoder;
mod embedding;
mod error;
pub mod gguf;
mod gguf_model;
mod gguf_tokenizer;
mod loss;
mod mlp;
mod model;
mod norm;
mod param;
mod rms_norm_kernel;
mod rope;
mod safetensors_io;
mod swiglu_kernel;
pub mod tensor;
mod varlen_kernel;

pub use attention::{AttentionKernel, AttentionLayout, CausalMasks, PaddedAttention};
pub use config::LlamaConfig;
pub use error::ModelError;
pub use gguf_tokenizer::tokenizer_from_gguf;
pub use loss::{LabelRows, LossSum, causal_lm_loss};
pub use model::{LlamaModel, ModelInput};
pub use param::Param;
pub use safetensors_io::write_atomically;
