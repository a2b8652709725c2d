//! The decoder's layers, each a view that borrows its parameters from the
//! model (which keeps them in the parameter table's order): built per
//! forward pass at no cost, so the table stays the one list of parameters.
//!
//! `embedding` -> `decoder` x layers (`norm`, `attention` with `rope`, `mlp`,
//! their projections each a `linear` with its LoRA adapter, if any) -> `norm`. Fused kernels and their oracles live in `crate::kernels`.

mod attention;
mod decoder;
mod embedding;
mod linear;
mod mlp;
mod norm;
mod rope;

pub use attention::{Attention, AttentionKernel, AttentionLayout, PaddedAttention};
pub use decoder::DecoderLayer;
pub use embedding::Embedding;
pub use linear::Linear;
pub use mlp::Mlp;
pub use norm::RmsNorm;
pub use rope::Rope;
