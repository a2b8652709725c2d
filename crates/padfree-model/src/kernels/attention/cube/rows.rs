//! The per-row CubeCL attention: one invocation per query row and head,
//! each reading its example's keys and values from global memory. The
//! tiled kernels (`tiled.rs`) are tested against it; it stays as their
//! oracle on the device, written as plainly as the algorithm reads.
//!
//! - forward: one invocation per query row and head walks the keys of its
//!   own example only (`[start, t]`), with an online softmax; it writes the
//!   output and the row's log-sum-exp.
//! - backward: `delta = rowsum(dO * O)` (shared with the tiled kernels);
//!   one invocation per query row and head recomputes its probabilities
//!   from the saved log-sum-exp for `dQ`; one per key row and key/value head
//!   walks the later queries of its example, over every query head of its
//!   group (GQA without atomics), for `dK` and `dV`.
//!
//! # Shapes
//! `q`, `out`, `dq`: `[T, H, D]`; `k`, `v`, `dk`, `dv`: `[T, Hkv, D]`;
//! `lse`, `delta`: `[T, H]`; `bounds`: `[T, 2]` (each row's example start
//! and end); all contiguous f32.

use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::Saved;
use crate::kernels::attention::host::AttentionDims;
use crate::kernels::cube_op::{empty_like, grid};

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
        #[unroll]
        for d in 0..head_dim {
            acc[d] = 0.0;
        }
        // Stands for minus infinity: WGSL refuses an infinite constant.
        let mut m = f32::new(-1.0e30);
        let mut l = 0.0f32;
        for j in start..t + 1 {
            let k_base = (j * kv_heads + hk) * head_dim;
            let mut s = 0.0f32;
            #[unroll]
            for d in 0..head_dim {
                s += q[q_base + d] * k[k_base + d];
            }
            s *= scale;
            if s > m {
                let c = (m - s).exp();
                l *= c;
                #[unroll]
                for d in 0..head_dim {
                    acc[d] *= c;
                }
                m = s;
            }
            let p = (s - m).exp();
            l += p;
            #[unroll]
            for d in 0..head_dim {
                acc[d] += p * v[k_base + d];
            }
        }
        let inv = 1.0f32 / l;
        #[unroll]
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
        #[unroll]
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
        #[unroll]
        for d in 0..head_dim {
            acc[d] = 0.0;
        }
        for j in start..t + 1 {
            let k_base = (j * kv_heads + hk) * head_dim;
            let mut s = 0.0f32;
            let mut dp = 0.0f32;
            #[unroll]
            for d in 0..head_dim {
                s += q[q_base + d] * k[k_base + d];
                dp += d_out[q_base + d] * v[k_base + d];
            }
            let p = (s * scale - row_lse).exp();
            let ds = p * (dp - row_delta);
            #[unroll]
            for d in 0..head_dim {
                acc[d] += ds * k[k_base + d];
            }
        }
        #[unroll]
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
        #[unroll]
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
                #[unroll]
                for d in 0..head_dim {
                    s += q[q_base + d] * k[k_base + d];
                    dp += d_out[q_base + d] * v[k_base + d];
                }
                let p = (s * scale - lse[row]).exp();
                let ds = p * (dp - delta[row]);
                #[unroll]
                for d in 0..head_dim {
                    acc_v[d] += p * d_out[q_base + d];
                    acc_k[d] += ds * q[q_base + d];
                }
            }
        }
        #[unroll]
        for d in 0..head_dim {
            dk[k_base + d] = acc_k[d] * scale;
            dv[k_base + d] = acc_v[d];
        }
    }
}

/// The forward kernel on contiguous inputs: `(out, lse)`.
pub(super) fn forward(
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

/// `delta = rowsum(dO * O)`, `[T, H]`, for either body's backward pass.
pub(super) fn delta(d_out: &CubeTensor, out: &CubeTensor, dims: AttentionDims) -> CubeTensor {
    let tokens = out.meta.shape()[0];
    let delta = empty_like(out, vec![tokens, dims.num_heads]);
    let (count, dim) = grid(out, tokens * dims.num_heads);
    delta_kernel::launch(
        &out.client,
        count,
        dim,
        d_out.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dims.head_dim,
    );
    delta
}

/// The backward kernels on a contiguous `d_out`: `[dq, dk, dv]`.
pub(super) fn backward(saved: &Saved, d_out: CubeTensor) -> [CubeTensor; 3] {
    let Saved {
        q,
        k,
        v,
        table: bounds,
        out,
        lse,
        dims,
        scale,
        ..
    } = saved;
    let tokens = q.meta.shape()[0];
    let (h, hkv, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    let delta = delta(&d_out, out, *dims);
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
