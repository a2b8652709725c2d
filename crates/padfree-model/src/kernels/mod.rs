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
//! `dropout_matmul.rs` is LoRA's `(x * mask) A^T` with the mask drawn again
//! in the backward pass instead of kept.
//!
//! `quant_matmul.rs` is QLoRA's frozen linear layer: `x W^T` and its input
//! gradient with `W` in GGUF blocks, dequantised a tile at a time.
//!
//! `host_op.rs` is the one generic layer that enters a host kernel into
//! burn's autodiff graph (backend-extension API), for plain autodiff and
//! gradient checkpointing; the kernels themselves know nothing of burn's
//! autodiff.

mod attention;
mod cross_entropy;
pub mod dropout_matmul;
mod host_op;
pub mod quant_matmul;
mod rms_norm;
mod simd;
mod swiglu;

pub use attention::{
    AttentionRows, CausalMasks, composed_padded_attention, composed_varlen_attention,
    varlen_attention,
};
pub use cross_entropy::{composed_cross_entropy_sum, cross_entropy_sum};
pub use host_op::UnsupportedTensor;
pub use quant_matmul::{composed_quant_linear, quant_linear};
pub use rms_norm::{composed_rms_norm, rms_norm};
pub use swiglu::{composed_swiglu, swiglu};

/// True on burn's Flex device, where the host kernels run.
pub fn on_cpu(device: &crate::tensor::Device) -> bool {
    attention::is_cpu(device)
}

/// Which body each kernel runs on `device`, for the log: `(kernel, body)`.
pub fn kernel_bodies(device: &crate::tensor::Device) -> Vec<(&'static str, &'static str)> {
    if attention::is_cpu(device) {
        return vec![
            ("varlen attention", "fused host kernel"),
            ("cross-entropy", "fused host kernel"),
            ("RMSNorm", "fused host kernel"),
            ("SwiGLU", "fused host kernel"),
        ];
    }
    vec![
        ("varlen attention", "CubeCL kernel"),
        ("cross-entropy", "composed burn ops (no CubeCL kernel yet)"),
        ("RMSNorm", "composed burn ops (no CubeCL kernel yet)"),
        ("SwiGLU", "composed burn ops (no CubeCL kernel yet)"),
    ]
}
