//! The decoder's layers, each a view that borrows its parameters from the
//! model (which keeps them in the parameter table's order): built per
//! forward pass at no cost, so the table stays the one list of parameters.
//!
//! `embedding` -> `decoder` x layers (`norm`, `attention` with `rope`, `mlp`)
//! -> `norm`. Fused kernels and their oracles live in `crate::kernels`.

mod attention;
mod decoder;
mod embedding;
mod mlp;
mod norm;
mod rope;

pub use attention::{Attention, AttentionKernel, AttentionLayout, PaddedAttention};
pub use decoder::DecoderLayer;
pub use embedding::Embedding;
pub use mlp::Mlp;
pub use norm::RmsNorm;
pub use rope::Rope;
