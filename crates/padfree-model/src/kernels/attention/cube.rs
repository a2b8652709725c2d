//! The CubeCL varlen causal attention: the same algorithm as the host
//! kernel (FlashAttention-2's varlen scheme), written once for every GPU
//! runtime burn's CubeCL backend reaches (Vulkan, Metal, DX12 through WGSL;
//! CUDA through NVRTC), differentiable through `cube_op.rs`.
//!
//! The rooms: this file, the op (what is saved, which body runs);
//! `cube/tiled.rs`, the tiled kernels that run (a workgroup per block of
//! rows and set of a group's query heads, keys and values staged through
//! shared memory once for the set);
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
//! `lse`: `[T, H]`; all contiguous f32, but for `q`, `k` and `v` under
//! `--bf16` (16-bit, [`attention`]).

use burn::tensor::{DType, Tensor as BurnTensor};
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;

use super::host::AttentionDims;
use crate::kernels::cube_op::{CubeOp, apply, contiguous_primitive};
use crate::kernels::host_op::UnsupportedTensor;
use crate::precision::HalfFloat;

mod rows;
mod tiled;

/// The largest head size the kernels take (one local accumulator per head).
pub const MAX_HEAD_DIM: usize = 256;

/// Which kernels run the op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Body {
    /// The tiled kernels (`cube/tiled.rs`), over the `[NB, 3]` block table,
    /// a workgroup taking several query heads of a group.
    Tiled,
    /// The same with one query head a workgroup: [`Body::Tiled`]'s oracle,
    /// bit for bit (each thread's sums are the same, in the same order).
    TiledByHead,
    /// The per-row oracle (`cube/rows.rs`), over the `[T, 2]` row bounds.
    PerRow,
}

/// What the backward pass needs: the inputs (16-bit under `half`), the
/// output, the log-sum-exp, the body's row table.
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

/// A 16-bit input as the per-row kernels read it: f32.
fn widen(t: &CubeTensor) -> CubeTensor {
    cast(t.clone(), DType::F32)
}

impl Saved {
    /// `q`, `k`, `v` as the per-row kernels read them: f32.
    fn widened(&self) -> Self {
        Self {
            q: widen(&self.q),
            k: widen(&self.k),
            v: widen(&self.v),
            ..self.clone()
        }
    }
}

/// The differentiable op on a CubeCL device: `q`, `k`, `v` (plain or on an
/// autodiff device of that backend) -> `[T, H, D]`, by `body` over its row
/// `table` (blocks for [`Body::Tiled`], bounds for [`Body::PerRow`]).
///
/// Under `half` (`--bf16` on a GPU, autocast's attention) `q`, `k` and `v`
/// are cast to that 16-bit float on the way in and kept so for the
/// backward pass; the tiled kernels read them as such, every sum in f32;
/// the output is rounded to `half` (it is a weighted mean of `v`'s rows,
/// so within f16's range), the gradients leave in f32. The per-row oracle
/// reads the same rounded values widened to f32.
pub(super) fn attention(
    inputs: [BurnTensor<3>; 3],
    table: &BurnTensor<2>,
    body: Body,
    dims: AttentionDims,
    scale: f32,
    half: Option<HalfFloat>,
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
            half,
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
    half: Option<HalfFloat>,
}

impl CubeOp<3> for Attention {
    type Saved = Saved;

    fn forward(&self, [q, k, v]: [CubeTensor; 3]) -> (CubeTensor, Saved) {
        let [q, k, v] = match self.half {
            Some(half) => [q, k, v].map(|t| cast(t, half.storage())),
            None => [q, k, v],
        };
        let (mut out, lse) = match (self.body, self.half) {
            (Body::Tiled | Body::TiledByHead, _) => tiled::forward(
                [&q, &k, &v],
                &self.table,
                self.dims,
                self.scale,
                self.body == Body::Tiled,
            ),
            (Body::PerRow, None) => rows::forward(&q, &k, &v, &self.table, self.dims, self.scale),
            (Body::PerRow, Some(_)) => {
                let (q, k, v) = (widen(&q), widen(&k), widen(&v));
                rows::forward(&q, &k, &v, &self.table, self.dims, self.scale)
            }
        };
        if let Some(half) = self.half {
            out = cast(cast(out, half.storage()), DType::F32);
        }
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
            Body::Tiled => tiled::backward(saved, d_out, true),
            Body::TiledByHead => tiled::backward(saved, d_out, false),
            Body::PerRow if saved.q.dtype != DType::F32 => rows::backward(&saved.widened(), d_out),
            Body::PerRow => rows::backward(saved, d_out),
        }
    }
}
