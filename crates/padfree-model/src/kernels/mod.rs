//! padfree's fused CPU kernels, one file each: the differentiable burn op,
//! the host kernel (forward and backward on row-major f32 slices, threads
//! through rayon), and where it has one the slow oracle composed of burn ops,
//! then the unit tests against f64 definitions and central differences
//! (llm.c keeps a kernel with its CPU reference; candle-nn's `attention/`
//! keeps the unfused reference beside the fused one).
//!
//! `simd.rs` runs kernel bodies compiled for the CPU's best vector set
//! (chosen at run time) and holds their vectorisable `exp`, `dot`, `sum_exp`.
//!
//! `host_op.rs` is the one generic layer that enters a host kernel into
//! burn's autodiff graph (backend-extension API), for plain autodiff and
//! gradient checkpointing; the kernels themselves know nothing of burn's
//! autodiff.

mod attention;
mod cross_entropy;
mod host_op;
mod rms_norm;
mod simd;
mod swiglu;

pub use attention::{
    CausalMasks, composed_padded_attention, composed_varlen_attention, varlen_attention,
};
pub use cross_entropy::{composed_cross_entropy_sum, cross_entropy_sum};
pub use host_op::UnsupportedTensor;
pub use rms_norm::rms_norm;
pub use swiglu::swiglu;
