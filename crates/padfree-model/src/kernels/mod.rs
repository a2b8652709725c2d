//! padfree's fused CPU kernels, one file each: the differentiable burn op,
//! the host kernel (forward and backward on row-major f32 slices, threads
//! through rayon), and where it has one the slow oracle composed of burn ops,
//! then the unit tests against f64 definitions and central differences
//! (llm.c keeps a kernel with its CPU reference; candle-nn's `attention/`
//! keeps the unfused reference beside the fused one).
//!
//! `simd.rs` runs kernel bodies compiled for the CPU's best vector set
//! (chosen at run time; `PADFREE_SIMD` caps it, so that one machine runs
//! every version) and holds their vectorisable `exp`, `dot`, `sum_exp`.
//!
//! `lora_linear.rs` is a LoRA layer in one op (frozen base, f32 or GGUF
//! blocks, plus the adapter); `dropout.rs` its dropout mask, drawn again
//! in the backward pass instead of kept.
//!
//! `quant_matmul.rs` is QLoRA's frozen linear layer: `x W^T` and its input
//! gradient with `W` in GGUF blocks, dequantised a tile at a time.
//!
//! `rope.rs` is the rotary position embedding of queries and keys.
//!
//! `embedding.rs` is the token embedding's lookup, its table gradient
//! written once (burn's `select`, its oracle, zeroed and copied it).
//!
//! `linear/` is a linear layer's `x W^T` and its two gradients (f32, or
//! bf16 operands for `--bf16`; on a GPU 16-bit operands on burn's matmul,
//! `linear/cube.rs`), and `gemm.rs` the products on host slices
//! it and the other kernels call (burn-flex's gemm kernels without its
//! zeroed, copied outputs); `gemm_bf16/` the bf16 products (AMX,
//! AVX512-BF16, or widened to f32 where the CPU lacks them; the LM head's
//! products for a few labelled rows in `gemm_bf16/skinny.rs`, streamed or
//! on AMX tiles) and
//! `bf16.rs` the rounding; `shared16.rs` one bf16 store of an activation
//! that several ops keep (a norm's output for the projections that read
//! it; the attention's output for itself and `o_proj`).
//!
//! On a GPU, `adamw/` is AdamW's update, four parameters a kernel launch
//! (the host loop in padfree-train does it on the CPU); `sum_squares/`
//! the gradient norm's per-tensor sums of squares, eight tensors a launch
//! plus one; `add_pairs/` gradient accumulation's sums, eight pairs a
//! launch.
//!
//! `fresh.rs` hands kernels output buffers they write in full, never
//! zeroed first (`calloc` zeroes reused memory), and `FreshArc`, a shared
//! slice written chunk by chunk on rayon's threads (each chunk zeroed in
//! cache as it is handed out): the weights' bf16 copies the update makes.
//!
//! `line_alloc.rs` is the global allocator the binary installs: buffers
//! of 4 KiB or more start on cache lines, where the AMX body stores its
//! output tiles in place and vector loops read whole lines.
//!
//! `host_op.rs` is the one generic layer that enters a host kernel into
//! burn's autodiff graph (backend-extension API), for plain autodiff and
//! gradient checkpointing; the kernels themselves know nothing of burn's
//! autodiff.

mod adamw;
mod add_pairs;
mod attention;
pub(crate) mod bf16;
mod cross_entropy;
#[cfg(feature = "cube")]
mod cube_op;
pub mod dropout;
mod embedding;
mod fresh;
pub(crate) use fresh::FreshArc;
mod gemm;
pub mod gemm_bf16;
pub use gemm_bf16::Weight16;
mod host_op;
mod line_alloc;
mod linear;
mod lora_linear;
pub mod quant_matmul;
mod rms_norm;
mod rope;
mod shared16;
mod simd;
mod sum_squares;
mod swiglu;

pub use adamw::{
    ADAMW_GROUP, AdamWState, AdamWStep, adamw_update, adamw_update_all, composed_adamw_update,
};
#[cfg(feature = "cube")]
pub use adamw::{adamw_groups_fit, fused_adamw_update, fused_adamw_update_group};
pub use add_pairs::{ADD_PAIRS_GROUP, add_pairs, composed_add_pairs};
#[cfg(feature = "cube")]
pub use add_pairs::{add_pairs_groups_fit, fused_add_pairs};
pub use attention::{
    AttentionRows, BLOCK_ROWS, CausalMasks, bf16_varlen_attention, composed_padded_attention,
    composed_varlen_attention, half_varlen_attention, per_row_varlen_attention,
    tiled_by_head_varlen_attention, varlen_attention,
};
pub use bf16::round as round_bf16;
pub use cross_entropy::{
    composed_cross_entropy_sum, cross_entropy_sum, head_chunk_rows, head_cross_entropy_sum,
    host_head_cross_entropy_sum,
};
pub use embedding::{composed_embedding, embedding};
pub use host_op::UnsupportedTensor;
pub use line_alloc::{LINED_FROM, LineAligned, LinedBytes, lined_bytes, reset_lined_peak};
#[cfg(feature = "cube")]
pub use linear::F16_TARGET;
pub(crate) use linear::round_tensor;
pub use linear::{
    bf16_linear, bf16_linear_sharing_input, bf16_linear_storing_input, composed_bf16_linear,
    composed_half_linear, composed_linear, fused_linear, half_linear, round_to_half,
};
pub use lora_linear::{
    LoraCopies, LoraFactors, LoraLayer, bf16_lora_linear, composed_bf16_lora_linear,
    composed_lora_linear, half_lora_linear, lora_linear,
};
pub use quant_matmul::{
    bf16_quant_linear, composed_bf16_quant_linear, composed_quant_linear, quant_linear,
};
pub use rms_norm::{bf16_rms_norm, composed_rms_norm, rms_norm};
pub use rope::{RopeTables, composed_rope, rope};
pub use shared16::SharedInput16;
pub use simd::{
    Level as SimdLevel, capped as simd_capped, detected as simd_detected,
    dispatch as simd_dispatch, level as simd_level,
};
pub use sum_squares::{
    composed_sums_of_squares, host_sum_of_squares, host_sums_of_squares, sums_of_squares,
};
#[cfg(feature = "cube")]
pub use sum_squares::{fused_sums_of_squares, sums_of_squares_groups_fit};
pub use swiglu::{bf16_swiglu, bf16_swiglu_down, composed_swiglu, swiglu, swiglu_down};

/// True on burn's Flex device, where the host kernels run.
pub fn on_cpu(device: &crate::tensor::Device) -> bool {
    attention::is_cpu(device)
}

/// Which body each kernel runs on `device`, for the log: `(kernel, body)`.
pub fn kernel_bodies(device: &crate::tensor::Device) -> Vec<(&'static str, &'static str)> {
    if attention::is_cpu(device) {
        return vec![
            ("varlen attention", "fused host kernel"),
            (
                "cross-entropy",
                "fused host kernel with the LM head, in chunks of rows",
            ),
            ("RMSNorm", "fused host kernel"),
            ("SwiGLU", "fused host kernel"),
            ("RoPE", "fused host kernel"),
            ("linear and LoRA layers", "fused host kernels (gemm)"),
        ];
    }
    vec![
        ("varlen attention", "tiled CubeCL kernel"),
        (
            "cross-entropy",
            "CubeCL kernel with the LM head, in chunks of rows",
        ),
        ("RMSNorm", "CubeCL kernel"),
        ("SwiGLU", "CubeCL kernel"),
        ("RoPE", "CubeCL kernel"),
        (
            "linear and LoRA layers",
            "burn's matmul (composed LoRA layer)",
        ),
        ("AdamW", "CubeCL kernel, one launch a parameter"),
        (
            "gradient norm",
            "CubeCL kernels, one launch a parameter and one to combine",
        ),
    ]
}

/// What the kernels' unit tests share.
#[cfg(test)]
pub(crate) mod test_util {
    use padfree_pack::SplitMix64;

    /// `len` standard normal values from `seed`.
    pub fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..len).map(|_| rng.standard_normal() as f32).collect()
    }

    /// Panics unless `ours` and `theirs` agree within `tolerance` of
    /// `theirs`' largest magnitude (which must not be zero: a test of
    /// zeros shows nothing).
    pub fn assert_within(what: &str, ours: &[f32], theirs: &[f32], tolerance: f32) {
        assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
        let scale = theirs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = ours
            .iter()
            .zip(theirs)
            .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            diff <= tolerance * scale && scale > 0.0,
            "{what}: max diff {diff:e} of scale {scale:e}"
        );
    }
}
