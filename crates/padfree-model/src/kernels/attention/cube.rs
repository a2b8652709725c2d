//! The CubeCL varlen causal attention: the same algorithm as the host
//! kernel (FlashAttention-2's varlen scheme), written once for every GPU
//! runtime burn's CubeCL backend reaches (Vulkan, Metal, DX12 through WGSL;
//! CUDA through NVRTC), differentiable through `cube_op.rs`.
//!
//! The rooms: this file, the op (what is saved, which body runs);
//! `cube/tiled.rs`, the tiled kernels that run (a workgroup per block of
//! rows and head, keys and values staged through shared memory);
//! `cube/rows.rs`, the per-row kernels they are tested against (one
//! invocation per row and head, everything from global memory).
//!
//! Every thread keeps its row's accumulators in local arrays of `D` floats,
//! so head sizes up to [`MAX_HEAD_DIM`] work. The tiled kernels' `[NB, 3]`
//! block table is uploaded once per batch ([`super::AttentionRows`]) and
//! shared by every layer (the per-row oracle's `[T, 2]` bounds are made
//! when it runs); the tables are f32 (exact below 2^24 tokens), so they
//! travel as ordinary float tensors.
//!
//! # Shapes
//! `q`, `out`, `dq`: `[T, H, D]`; `k`, `v`, `dk`, `dv`: `[T, Hkv, D]`;
//! `lse`: `[T, H]`; all contiguous f32.

use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use super::host::AttentionDims;
use crate::kernels::cube_op::{CubeOp, apply, contiguous_primitive};
use crate::kernels::host_op::UnsupportedTensor;

mod rows;
mod tiled;

/// The largest head size the kernels take (one local accumulator per head).
pub const MAX_HEAD_DIM: usize = 256;

/// Which kernels run the op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Body {
    /// The tiled kernels (`cube/tiled.rs`), over the `[NB, 3]` block table.
    Tiled,
    /// The per-row oracle (`cube/rows.rs`), over the `[T, 2]` row bounds.
    PerRow,
}

/// What the backward pass needs: the inputs, the output, the log-sum-exp,
/// the body's row table.
#[derive(Debug, Clone)]
struct Saved {
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    table: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    dims: AttentionDims,
    scale: f32,
    body: Body,
}

/// The differentiable op on a CubeCL device: `q`, `k`, `v` (plain or on an
/// autodiff device of that backend) -> `[T, H, D]`, by `body` over its row
/// `table` (blocks for [`Body::Tiled`], bounds for [`Body::PerRow`]).
pub(super) fn attention(
    inputs: [BurnTensor<3>; 3],
    table: &BurnTensor<2>,
    body: Body,
    dims: AttentionDims,
    scale: f32,
) -> Result<BurnTensor<3>, UnsupportedTensor> {
    if dims.head_dim > MAX_HEAD_DIM || dims.head_dim == 0 {
        return Err(UnsupportedTensor(format!(
            "head size {} (the GPU kernel takes 1 to {MAX_HEAD_DIM})",
            dims.head_dim
        )));
    }
    let table = contiguous_primitive(table)?;
    // Compute-bound: gradient checkpointing keeps the output and the
    // log-sum-exp rather than running the kernel again.
    apply(
        &Attention {
            table,
            body,
            dims,
            scale,
        },
        inputs,
    )
}

/// The op: the batch's row table, the body and the attention's settings.
struct Attention {
    table: CubeTensor,
    body: Body,
    dims: AttentionDims,
    scale: f32,
}

impl CubeOp<3> for Attention {
    type Saved = Saved;

    fn forward(&self, [q, k, v]: [CubeTensor; 3]) -> (CubeTensor, Saved) {
        let (out, lse) = match self.body {
            Body::Tiled => tiled::forward([&q, &k, &v], &self.table, self.dims, self.scale),
            Body::PerRow => rows::forward(&q, &k, &v, &self.table, self.dims, self.scale),
        };
        let saved = Saved {
            q,
            k,
            v,
            table: self.table.clone(),
            out: out.clone(),
            lse,
            dims: self.dims,
            scale: self.scale,
            body: self.body,
        };
        (out, saved)
    }

    fn backward(saved: &Saved, d_out: CubeTensor) -> [CubeTensor; 3] {
        let d_out = into_contiguous(d_out);
        match saved.body {
            Body::Tiled => tiled::backward(saved, d_out),
            Body::PerRow => rows::backward(saved, d_out),
        }
    }
}
