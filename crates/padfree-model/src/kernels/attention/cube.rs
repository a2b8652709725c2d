//! The CubeCL body of the varlen causal attention: the same algorithm as the
//! host kernel in `mod.rs` (FlashAttention-2's varlen scheme), written once
//! for every GPU runtime burn's CubeCL backend reaches (Vulkan, Metal, DX12
//! through WGSL; CUDA and ROCm when built), differentiable through
//! `cube_op.rs`.
//!
//! - forward: one invocation per query row and head walks the keys of its
//!   own example only (`[start, t]`), with an online softmax; it writes the
//!   output and the row's log-sum-exp, never an `[L, L]` matrix. Work is
//!   proportional to the sum of squared example lengths.
//! - backward: `delta = rowsum(dO * O)`; one invocation per query row and
//!   head recomputes its probabilities from the saved log-sum-exp for `dQ`;
//!   one per key row and key/value head walks the later queries of its
//!   example, over every query head of its group (GQA without atomics), for
//!   `dK` and `dV`.
//!
//! Every invocation keeps one head's accumulator in a local array of `D`
//! floats, so head sizes up to [`MAX_HEAD_DIM`] work; nothing is tiled
//! through shared memory yet (docs/gpu.md lists that as what is left for
//! speed). The `[T, 2]` row bounds (start and end of every row's example)
//! are uploaded once per batch ([`super::AttentionRows`]) and shared by
//! every layer; they are f32 (exact below 2^24 tokens), so they travel as
//! an ordinary float tensor of the device.
//!
//! # Shapes
//! `q`, `out`, `dq`: `[T, H, D]`; `k`, `v`, `dk`, `dv`: `[T, Hkv, D]`;
//! `lse`, `delta`: `[T, H]`; `bounds`: `[T, 2]`; all contiguous f32.

use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::host::AttentionDims;
use crate::kernels::cube_op::{CubeOp, apply, empty_like, grid};
use crate::kernels::host_op::UnsupportedTensor;

/// The largest head size the kernels take (one local accumulator per head).
pub const MAX_HEAD_DIM: usize = 256;

#[cube(launch)]
fn forward_kernel(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    bounds: &Tensor<f32>,
    out: &mut Tensor<f32>,
    lse: &mut Tensor<f32>,
    scale: f32,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
) {
    let idx = ABSOLUTE_POS;
    if idx < lse.len() {
        let t = idx / heads;
        let h = idx % heads;
        let hk = h / (heads / kv_heads);
        let start = u32::cast_from(bounds[t * 2]) as usize;
        let q_base = idx * head_dim;
        let mut acc = Array::<f32>::new(head_dim);
        for d in 0..head_dim {
            acc[d] = 0.0;
        }
        // Stands for minus infinity: WGSL refuses an infinite constant.
        let mut m = f32::new(-1.0e30);
        let mut l = 0.0f32;
        for j in start..t + 1 {
            let k_base = (j * kv_heads + hk) * head_dim;
            let mut s = 0.0f32;
            for d in 0..head_dim {
                s += q[q_base + d] * k[k_base + d];
            }
            s *= scale;
            if s > m {
                let c = (m - s).exp();
                l *= c;
                for d in 0..head_dim {
                    acc[d] *= c;
                }
                m = s;
            }
            let p = (s - m).exp();
            l += p;
            for d in 0..head_dim {
                acc[d] += p * v[k_base + d];
            }
        }
        let inv = 1.0f32 / l;
        for d in 0..head_dim {
            out[q_base + d] = acc[d] * inv;
        }
        lse[idx] = m + l.ln();
    }
}

/// `delta[t, h] = sum_d dO[t, h, d] * O[t, h, d]`.
#[cube(launch)]
fn delta_kernel(
    d_out: &Tensor<f32>,
    out: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    #[comptime] head_dim: usize,
) {
    let idx = ABSOLUTE_POS;
    if idx < delta.len() {
        let base = idx * head_dim;
        let mut sum = 0.0f32;
        for d in 0..head_dim {
            sum += d_out[base + d] * out[base + d];
        }
        delta[idx] = sum;
    }
}

#[cube(launch)]
fn dq_kernel(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    bounds: &Tensor<f32>,
    d_out: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<f32>,
    scale: f32,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
) {
    let idx = ABSOLUTE_POS;
    if idx < lse.len() {
        let t = idx / heads;
        let h = idx % heads;
        let hk = h / (heads / kv_heads);
        let start = u32::cast_from(bounds[t * 2]) as usize;
        let q_base = idx * head_dim;
        let row_lse = lse[idx];
        let row_delta = delta[idx];
        let mut acc = Array::<f32>::new(head_dim);
        for d in 0..head_dim {
            acc[d] = 0.0;
        }
        for j in start..t + 1 {
            let k_base = (j * kv_heads + hk) * head_dim;
            let mut s = 0.0f32;
            let mut dp = 0.0f32;
            for d in 0..head_dim {
                s += q[q_base + d] * k[k_base + d];
                dp += d_out[q_base + d] * v[k_base + d];
            }
            let p = (s * scale - row_lse).exp();
            let ds = p * (dp - row_delta);
            for d in 0..head_dim {
                acc[d] += ds * k[k_base + d];
            }
        }
        for d in 0..head_dim {
            dq[q_base + d] = acc[d] * scale;
        }
    }
}

#[cube(launch)]
fn dkv_kernel(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    bounds: &Tensor<f32>,
    d_out: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<f32>,
    dv: &mut Tensor<f32>,
    scale: f32,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
) {
    let idx = ABSOLUTE_POS;
    if idx * head_dim < dk.len() {
        let j = idx / kv_heads;
        let hk = idx % kv_heads;
        let group = heads / kv_heads;
        let end = u32::cast_from(bounds[j * 2 + 1]) as usize;
        let k_base = idx * head_dim;
        let mut acc_k = Array::<f32>::new(head_dim);
        let mut acc_v = Array::<f32>::new(head_dim);
        for d in 0..head_dim {
            acc_k[d] = 0.0;
            acc_v[d] = 0.0;
        }
        for g in 0..group {
            let h = hk * group + g;
            for i in j..end {
                let row = i * heads + h;
                let q_base = row * head_dim;
                let mut s = 0.0f32;
                let mut dp = 0.0f32;
                for d in 0..head_dim {
                    s += q[q_base + d] * k[k_base + d];
                    dp += d_out[q_base + d] * v[k_base + d];
                }
                let p = (s * scale - lse[row]).exp();
                let ds = p * (dp - delta[row]);
                for d in 0..head_dim {
                    acc_v[d] += p * d_out[q_base + d];
                    acc_k[d] += ds * q[q_base + d];
                }
            }
        }
        for d in 0..head_dim {
            dk[k_base + d] = acc_k[d] * scale;
            dv[k_base + d] = acc_v[d];
        }
    }
}

/// What the backward pass needs: the inputs, the output, the log-sum-exp.
#[derive(Debug, Clone)]
struct Saved {
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    bounds: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    dims: AttentionDims,
    scale: f32,
}

/// The forward kernel on contiguous inputs: `(out, lse)`.
fn forward(
    q: &CubeTensor,
    k: &CubeTensor,
    v: &CubeTensor,
    bounds: &CubeTensor,
    dims: AttentionDims,
    scale: f32,
) -> (CubeTensor, CubeTensor) {
    let tokens = q.meta.shape()[0];
    let out = empty_like(q, vec![tokens, dims.num_heads, dims.head_dim]);
    let lse = empty_like(q, vec![tokens, dims.num_heads]);
    let (count, dim) = grid(q, tokens * dims.num_heads);
    forward_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        bounds.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        scale,
        dims.num_heads,
        dims.num_kv_heads,
        dims.head_dim,
    );
    (out, lse)
}

/// The backward kernels: `[dq, dk, dv]`.
fn backward(saved: &Saved, d_out: CubeTensor) -> [CubeTensor; 3] {
    let Saved {
        q,
        k,
        v,
        bounds,
        out,
        lse,
        dims,
        scale,
    } = saved;
    let d_out = into_contiguous(d_out);
    let tokens = q.meta.shape()[0];
    let (h, hkv, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    let delta = empty_like(q, vec![tokens, h]);
    let (count, dim) = grid(q, tokens * h);
    delta_kernel::launch(
        &q.client,
        count,
        dim,
        d_out.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        d,
    );
    let dq = empty_like(q, vec![tokens, h, d]);
    let (count, dim) = grid(q, tokens * h);
    dq_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        bounds.clone().into_tensor_arg(),
        d_out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        *scale,
        h,
        hkv,
        d,
    );
    let dk = empty_like(q, vec![tokens, hkv, d]);
    let dv = empty_like(q, vec![tokens, hkv, d]);
    let (count, dim) = grid(q, tokens * hkv);
    dkv_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        bounds.clone().into_tensor_arg(),
        d_out.into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dv.clone().into_tensor_arg(),
        *scale,
        h,
        hkv,
        d,
    );
    [dq, dk, dv]
}

/// The device's `[T, 2]` row bounds as the kernels read them, or why not.
pub(super) fn bounds_primitive(bounds: &BurnTensor<2>) -> Result<CubeTensor, UnsupportedTensor> {
    bounds
        .clone()
        .try_into_primitive::<CubeBackend>()
        .map(into_contiguous)
        .map_err(|err| UnsupportedTensor(format!("{err:?}")))
}

/// The differentiable op on a CubeCL device: `q`, `k`, `v` (plain or on an
/// autodiff device of that backend) -> `[T, H, D]`.
pub(super) fn attention(
    inputs: [BurnTensor<3>; 3],
    bounds: &BurnTensor<2>,
    dims: AttentionDims,
    scale: f32,
) -> Result<BurnTensor<3>, UnsupportedTensor> {
    if dims.head_dim > MAX_HEAD_DIM || dims.head_dim == 0 {
        return Err(UnsupportedTensor(format!(
            "head size {} (the GPU kernel takes 1 to {MAX_HEAD_DIM})",
            dims.head_dim
        )));
    }
    let bounds = bounds_primitive(bounds)?;
    // Compute-bound: gradient checkpointing keeps the output and the
    // log-sum-exp rather than running the kernel again.
    apply(
        &Attention {
            bounds,
            dims,
            scale,
        },
        inputs,
    )
}

/// The op: the batch's row bounds and the attention's settings.
struct Attention {
    bounds: CubeTensor,
    dims: AttentionDims,
    scale: f32,
}

impl CubeOp<3> for Attention {
    type Saved = Saved;

    fn forward(&self, [q, k, v]: [CubeTensor; 3]) -> (CubeTensor, Saved) {
        let (out, lse) = forward(&q, &k, &v, &self.bounds, self.dims, self.scale);
        let saved = Saved {
            q,
            k,
            v,
            bounds: self.bounds.clone(),
            out: out.clone(),
            lse,
            dims: self.dims,
            scale: self.scale,
        };
        (out, saved)
    }

    fn backward(saved: &Saved, d_out: CubeTensor) -> [CubeTensor; 3] {
        backward(saved, d_out)
    }
}
