//! Fused variable-length causal attention on the CPU: forward and backward
//! over a whole flattened batch in one call, each example attending to itself
//! only (FlashAttention-2's varlen algorithm, written for host slices).
//!
//! Why a kernel of our own: composed from tensor ops, one example's attention
//! is some twenty small ops (slices, head repeats, masked softmax, matmuls),
//! each allocating and each recorded for autodiff (`examples/step_phases.rs`
//! measures what the kernel saves per step). Here a query row meets only the keys at or
//! before it, the softmax is computed in place, the `[L, L]` probabilities
//! are never stored (the backward pass recomputes them from the saved
//! log-sum-exp), and grouped key/value heads are read in place instead of
//! being repeated.
//!
//! Work is split by example (each owns a contiguous block of rows of every
//! output), longest first, across rayon's threads. Inside an example the
//! work is blocked like a matmul: per key/value head, keys and values are
//! copied out once (keys also transposed), then queries go four rows at a
//! time through register-tiled micro-kernels (`micro.rs`).
//!
//! `bf16.rs` is the same op under `--bf16` (bf16 inputs and output, kept
//! as bf16 for the backward pass) on `products.rs`, a kernel of its own:
//! blocks of 64 query rows through the bf16 gemm (AMX tiles where the CPU
//! has them), `P` and `dS` rounded to bf16 as PyTorch's bf16 flash
//! attention rounds them.
//!
//! The rooms: this file, the differentiable burn op ([`varlen_attention`],
//! through `host_op`); `host.rs`, the host kernel ([`forward`],
//! [`backward`]) with its unit tests against an f64 definition and central
//! differences; `micro.rs`, its register-tiled micro-kernels;
//! `products.rs`, the bf16 kernel, with its tests against an f64
//! definition within the bound its rounding allows; `composed.rs`, the
//! slow, obvious oracle it is tested against
//! ([`composed_varlen_attention`], [`composed_padded_attention`]: burn ops,
//! one example or padded row at a time); `cube.rs` and `cube/`, the GPU
//! kernels (tiled, and the per-row kernel they are tested against).
//!
//! # Shapes
//! `T` tokens of the flattened batch, `H` query heads, `Hkv` key/value heads,
//! `D` head size. `q`, `out`, `dq`: `[T, H, D]`; `k`, `v`, `dk`, `dv`:
//! `[T, Hkv, D]`; `lse`: `[T, H]`; all row-major.

use std::sync::Arc;

use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::precision::HalfFloat;
use crate::tensor::{Device, Tensor, float_tensor};

mod bf16;
mod composed;
#[cfg(feature = "cube")]
mod cube;
mod host;
mod micro;
mod products;

pub use bf16::bf16_varlen_attention;
pub use composed::{CausalMasks, composed_padded_attention, composed_varlen_attention};
use host::total_tokens;
pub use host::{AttentionDims, ForwardOutput, Qkv, backward, forward};

// ---- the differentiable burn op ----

/// Rows of a block of the GPU's tiled attention: the threads of one
/// workgroup, each owning one query (or key) row of one example.
pub const BLOCK_ROWS: usize = 64;

/// The boundaries of a batch as the attention kernels read them, made once
/// per forward pass from the collator's `cu_seqlens` and lent to every layer:
/// the offsets themselves for the host kernel (shared, not copied), and on a
/// GPU the tiled kernels' block table, uploaded once.
#[derive(Debug, Clone)]
pub struct AttentionRows {
    cu_seqlens: Arc<[u32]>,
    /// On a GPU only, `[NB, 3]`: every block of at most [`BLOCK_ROWS`] rows
    /// of one example, as its first row, its example's start and its
    /// example's end.
    blocks: Option<Tensor<2>>,
}

impl AttentionRows {
    /// The rows of `cu_seqlens` (`B + 1` offsets from 0 to `T`) for a model on
    /// `device`.
    pub fn new(cu_seqlens: Arc<[u32]>, device: &Device) -> Self {
        let blocks = (!is_cpu(device)).then(|| {
            let mut blocks = Vec::new();
            for example in cu_seqlens.windows(2) {
                let (start, end) = (example[0], example[1]);
                for first in (start..end).step_by(BLOCK_ROWS) {
                    blocks.extend([first as f32, start as f32, end as f32]);
                }
            }
            let count = blocks.len() / 3;
            float_tensor(blocks, [count, 3], &device.clone().inner())
        });
        Self { cu_seqlens, blocks }
    }

    /// `[T, 2]` on `device`: every row's example start and end, the per-row
    /// oracle's table (made when the oracle runs, not per batch).
    fn row_bounds(&self, device: &Device) -> Tensor<2> {
        let mut bounds = Vec::with_capacity(2 * total_tokens(&self.cu_seqlens));
        for example in self.cu_seqlens.windows(2) {
            for _ in example[0]..example[1] {
                bounds.extend([example[0] as f32, example[1] as f32]);
            }
        }
        let tokens = bounds.len() / 2;
        float_tensor(bounds, [tokens, 2], &device.clone().inner())
    }

    /// The offsets, `B + 1`.
    pub fn cu_seqlens(&self) -> &[u32] {
        &self.cu_seqlens
    }
}

/// True on burn's Flex device, where the host kernels run.
pub(crate) fn is_cpu(device: &Device) -> bool {
    device.clone().inner() == Device::flex()
}

/// A host-only kernel's refusal (`why`) off the CPU.
pub(crate) fn cpu_only(device: &Device, why: &str) -> Result<(), UnsupportedTensor> {
    if is_cpu(device) {
        Ok(())
    } else {
        Err(UnsupportedTensor(why.into()))
    }
}

/// Fused causal attention of every example of a flattened batch: the host
/// kernel on the CPU, the CubeCL kernel (`cube.rs`) on a GPU.
///
/// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]`, `rows`: the batch's boundaries
/// -> `[T, H, D]`.
pub fn varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    rows: &AttentionRows,
    scale: f32,
) -> Result<Tensor<3>, UnsupportedTensor> {
    if rows.blocks.is_some() {
        return gpu_varlen([q, k, v], rows, scale, GpuBody::Tiled, None);
    }
    let op = VarlenAttention {
        cu_seqlens: rows.cu_seqlens.clone(),
        dims: dims_of(&q, &k),
        scale,
    };
    apply(op, [q, k, v])
}

/// The sizes of `q` (`[T, H, D]`) and `k` (`[T, Hkv, D]`).
fn dims_of(q: &Tensor<3>, k: &Tensor<3>) -> AttentionDims {
    let [_, num_heads, head_dim] = q.dims();
    AttentionDims {
        num_heads,
        num_kv_heads: k.dims()[1],
        head_dim,
    }
}

/// The per-row CubeCL attention, the tiled kernels' oracle on the device
/// (`cube/rows.rs`): what [`varlen_attention`] computes on a GPU, one
/// invocation per row and head, everything read from global memory. On the
/// CPU it is the host kernel, as [`varlen_attention`].
pub fn per_row_varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    rows: &AttentionRows,
    scale: f32,
) -> Result<Tensor<3>, UnsupportedTensor> {
    oracle([q, k, v], rows, scale, GpuBody::PerRow)
}

/// The tiled CubeCL attention with one query head a workgroup, each
/// staging its group's keys and values again (the layout before a
/// workgroup took a group's heads together): [`varlen_attention`]'s
/// oracle on a GPU bit for bit, every thread's sums being the same. On
/// the CPU it is the host kernel, as [`varlen_attention`].
pub fn tiled_by_head_varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    rows: &AttentionRows,
    scale: f32,
) -> Result<Tensor<3>, UnsupportedTensor> {
    oracle([q, k, v], rows, scale, GpuBody::TiledByHead)
}

/// An f32 oracle of the tiled kernels by `body` on a GPU; the host kernel
/// on the CPU.
fn oracle(
    [q, k, v]: [Tensor<3>; 3],
    rows: &AttentionRows,
    scale: f32,
    body: GpuBody,
) -> Result<Tensor<3>, UnsupportedTensor> {
    if rows.blocks.is_none() {
        return varlen_attention(q, k, v, rows, scale);
    }
    gpu_varlen([q, k, v], rows, scale, body, None)
}

/// [`varlen_attention`] on a GPU under `--bf16`: `q`, `k`, `v` cast to
/// `half` and kept so, the tiled kernels reading them as such (sums in
/// f32), the output rounded to `half` (`cube.rs`). With `per_row` the
/// per-row oracle reads the same rounded values. A CPU's bf16 attention is
/// [`bf16_varlen_attention`].
pub fn half_varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    rows: &AttentionRows,
    scale: f32,
    half: HalfFloat,
    per_row: bool,
) -> Result<Tensor<3>, UnsupportedTensor> {
    let body = if per_row {
        GpuBody::PerRow
    } else {
        GpuBody::Tiled
    };
    gpu_varlen([q, k, v], rows, scale, body, Some(half))
}

/// The CubeCL op by `body` over its table (the batch's block table for the
/// tiled kernels, the row bounds made now for the per-row oracle), in
/// `half` when given; refused on the CPU (whose `rows` have no blocks).
fn gpu_varlen(
    [q, k, v]: [Tensor<3>; 3],
    rows: &AttentionRows,
    scale: f32,
    body: GpuBody,
    half: Option<HalfFloat>,
) -> Result<Tensor<3>, UnsupportedTensor> {
    let Some(blocks) = &rows.blocks else {
        return Err(UnsupportedTensor(
            "the CubeCL attention runs on a GPU (the CPU's 16-bit attention is bf16_varlen_attention)"
                .into(),
        ));
    };
    let dims = dims_of(&q, &k);
    match body {
        GpuBody::Tiled | GpuBody::TiledByHead => {
            gpu_attention([q, k, v], blocks, body, dims, scale, half)
        }
        GpuBody::PerRow => {
            let bounds = rows.row_bounds(&q.device());
            gpu_attention([q, k, v], &bounds, body, dims, scale, half)
        }
    }
}

#[cfg(feature = "cube")]
use cube::Body as GpuBody;

/// Without GPU kernels, the bodies only name what was asked for.
#[cfg(not(feature = "cube"))]
enum GpuBody {
    Tiled,
    TiledByHead,
    PerRow,
}

#[cfg(feature = "cube")]
fn gpu_attention(
    inputs: [Tensor<3>; 3],
    table: &Tensor<2>,
    body: GpuBody,
    dims: AttentionDims,
    scale: f32,
    half: Option<HalfFloat>,
) -> Result<Tensor<3>, UnsupportedTensor> {
    cube::attention(inputs, table, body, dims, scale, half)
}

#[cfg(not(feature = "cube"))]
fn gpu_attention(
    _: [Tensor<3>; 3],
    _: &Tensor<2>,
    _: GpuBody,
    _: AttentionDims,
    _: f32,
    _: Option<HalfFloat>,
) -> Result<Tensor<3>, UnsupportedTensor> {
    Err(UnsupportedTensor(
        "padfree was built without its GPU kernels (feature `wgpu` or `cuda`)".into(),
    ))
}

/// The op's settings, shared with the bf16 op (`bf16.rs`).
#[derive(Debug, Clone)]
struct VarlenAttention {
    cu_seqlens: Arc<[u32]>,
    dims: AttentionDims,
    scale: f32,
}

impl VarlenAttention {
    fn run_forward(&self, inputs: Qkv<'_>) -> ForwardOutput {
        forward(inputs, &self.cu_seqlens, self.dims, self.scale)
    }

    /// `[dq, dk, dv]`.
    fn gradients(&self, inputs: Qkv<'_>, out: &[f32], lse: &[f32], d_out: &[f32]) -> [Vec<f32>; 3] {
        let grads = backward(
            inputs,
            out,
            lse,
            d_out,
            &self.cu_seqlens,
            self.dims,
            self.scale,
        );
        [grads.dq, grads.dk, grads.dv]
    }
}

impl HostOp<3> for VarlenAttention {
    /// Saves one log-sum-exp per row and head, `[T, H]`, not the `[L, L]`
    /// probabilities.
    fn forward(&self, [q, k, v]: [HostTensor<'_>; 3]) -> HostOutput {
        let forward = self.run_forward(Qkv {
            q: q.values,
            k: k.values,
            v: v.values,
        });
        HostOutput {
            values: forward.out,
            shape: q.shape.to_vec(),
            saved: forward.lse,
        }
    }

    fn backward(
        &self,
        [q, k, v]: [HostTensor<'_>; 3],
        output: &[f32],
        lse: &[f32],
        d_out: &[f32],
        _needed: [bool; 3],
    ) -> [Vec<f32>; 3] {
        let inputs = Qkv {
            q: q.values,
            k: k.values,
            v: v.values,
        };
        self.gradients(inputs, output, lse, d_out)
    }
}
