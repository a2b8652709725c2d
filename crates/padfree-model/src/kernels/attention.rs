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
//! output), longest first, across rayon's threads.
//!
//! This file holds, in order: the differentiable burn op
//! ([`varlen_attention`], through `host_op`), the host kernel (`forward`,
//! `backward`), and the slow, obvious oracle it is tested against
//! ([`composed_varlen_attention`], [`composed_padded_attention`]: burn ops,
//! one example or padded row at a time), then the kernel's unit tests
//! against an f64 definition and central differences.
//!
//! # Shapes
//! `T` tokens of the flattened batch, `H` query heads, `Hkv` key/value heads,
//! `D` head size. `q`, `out`, `dq`: `[T, H, D]`; `k`, `v`, `dk`, `dv`:
//! `[T, Hkv, D]`; `lse`: `[T, H]`; all row-major.

use std::collections::BTreeMap;
use std::sync::Arc;

use padfree_pack::BatchMeta;
use rayon::prelude::*;

use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::simd::{self, axpy, dot};
use crate::tensor::{Bool, Device, Tensor, cat, causal_mask, mask_fill, narrow, softmax_last};

// ---- the differentiable burn op ----

/// Fused causal attention of every example of a flattened batch.
///
/// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]`, `cu_seqlens`: `B + 1` offsets
/// (the collator's own, from `BatchMeta::cu_seqlens_shared`: kept for the
/// backward pass without a copy) -> `[T, H, D]`.
pub fn varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    cu_seqlens: Arc<[u32]>,
    scale: f32,
) -> Result<Tensor<3>, UnsupportedTensor> {
    let [_, num_heads, head_dim] = q.dims();
    let op = VarlenAttention {
        cu_seqlens,
        dims: AttentionDims {
            num_heads,
            num_kv_heads: k.dims()[1],
            head_dim,
        },
        scale,
    };
    apply(op, [q, k, v])
}

#[derive(Debug, Clone)]
struct VarlenAttention {
    cu_seqlens: Arc<[u32]>,
    dims: AttentionDims,
    scale: f32,
}

impl HostOp<3> for VarlenAttention {
    /// Saves one log-sum-exp per row and head, `[T, H]`, not the `[L, L]`
    /// probabilities.
    fn forward(&self, [q, k, v]: [HostTensor<'_>; 3]) -> HostOutput {
        let inputs = Qkv {
            q: q.values,
            k: k.values,
            v: v.values,
        };
        let forward = forward(inputs, &self.cu_seqlens, self.dims, self.scale);
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
    ) -> [Vec<f32>; 3] {
        let inputs = Qkv {
            q: q.values,
            k: k.values,
            v: v.values,
        };
        let grads = backward(
            inputs,
            output,
            lse,
            d_out,
            &self.cu_seqlens,
            self.dims,
            self.scale,
        );
        [grads.dq, grads.dk, grads.dv]
    }
}

// ---- the host kernel ----

/// Sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionDims {
    /// Query heads, `H`.
    pub num_heads: usize,
    /// Key/value heads, `Hkv` (divides `H`).
    pub num_kv_heads: usize,
    /// Head size, `D`.
    pub head_dim: usize,
}

impl AttentionDims {
    fn q_row(&self) -> usize {
        self.num_heads * self.head_dim
    }

    fn kv_row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// What the backward pass needs from the forward one.
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// `[T, H, D]`.
    pub out: Vec<f32>,
    /// `[T, H]`: log of every query row's softmax denominator, max included.
    pub lse: Vec<f32>,
}

/// Gradients of `q`, `k`, `v`.
#[derive(Debug, Clone)]
pub struct BackwardOutput {
    /// `[T, H, D]`.
    pub dq: Vec<f32>,
    /// `[T, Hkv, D]`.
    pub dk: Vec<f32>,
    /// `[T, Hkv, D]`.
    pub dv: Vec<f32>,
}

/// `softmax(q k^T * scale + causal) v` for every example of the batch.
///
/// `cu_seqlens`: `B + 1` offsets from 0 to `T`, as the collator computed them.
pub fn forward(
    inputs: Qkv<'_>,
    cu_seqlens: &[u32],
    dims: AttentionDims,
    scale: f32,
) -> ForwardOutput {
    let Qkv { q, k, v } = inputs;
    let total = total_tokens(cu_seqlens);
    let heads = dims.num_heads;
    let mut out = vec![0.0; total * dims.q_row()];
    let mut lse = vec![0.0; total * heads];
    let out_blocks = split_rows(&mut out, cu_seqlens, dims.q_row());
    let lse_blocks = split_rows(&mut lse, cu_seqlens, heads);
    let mut jobs: Vec<_> = out_blocks
        .into_iter()
        .zip(lse_blocks)
        .zip(cu_seqlens.windows(2))
        .map(|((out, lse), bounds)| (offset(bounds[0]), len(bounds), out, lse))
        .collect();
    longest_first(&mut jobs, |job| job.1);
    jobs.into_par_iter().for_each(|(start, len, out, lse)| {
        let example = Example::new(q, k, v, start, len, dims);
        simd::dispatch(
            #[inline(always)]
            || example.forward(scale, out, lse),
        );
    });
    ForwardOutput { out, lse }
}

/// The inputs of one call, `[T, H, D]` and twice `[T, Hkv, D]`.
#[derive(Debug, Clone, Copy)]
pub struct Qkv<'a> {
    /// Queries.
    pub q: &'a [f32],
    /// Keys.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
}

/// Gradients of `forward`'s inputs given `d_out`, the gradient of its output;
/// `out` and `lse` are what `forward` returned.
pub fn backward(
    inputs: Qkv<'_>,
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    cu_seqlens: &[u32],
    dims: AttentionDims,
    scale: f32,
) -> BackwardOutput {
    let Qkv { q, k, v } = inputs;
    let total = total_tokens(cu_seqlens);
    let mut dq = vec![0.0; total * dims.q_row()];
    let mut dk = vec![0.0; total * dims.kv_row()];
    let mut dv = vec![0.0; total * dims.kv_row()];
    let dq_blocks = split_rows(&mut dq, cu_seqlens, dims.q_row());
    let dk_blocks = split_rows(&mut dk, cu_seqlens, dims.kv_row());
    let dv_blocks = split_rows(&mut dv, cu_seqlens, dims.kv_row());
    let mut jobs: Vec<_> = dq_blocks
        .into_iter()
        .zip(dk_blocks)
        .zip(dv_blocks)
        .zip(cu_seqlens.windows(2))
        .map(|(((dq, dk), dv), bounds)| (offset(bounds[0]), len(bounds), dq, dk, dv))
        .collect();
    longest_first(&mut jobs, |job| job.1);
    jobs.into_par_iter().for_each(|(start, len, dq, dk, dv)| {
        let example = Example::new(q, k, v, start, len, dims);
        let saved = Saved {
            out: &out[start * dims.q_row()..(start + len) * dims.q_row()],
            lse: &lse[start * dims.num_heads..(start + len) * dims.num_heads],
            d_out: &d_out[start * dims.q_row()..(start + len) * dims.q_row()],
        };
        simd::dispatch(
            #[inline(always)]
            || example.backward(scale, &saved, Grads { dq, dk, dv }),
        );
    });
    BackwardOutput { dq, dk, dv }
}

fn total_tokens(cu_seqlens: &[u32]) -> usize {
    cu_seqlens.last().copied().map_or(0, offset)
}

/// An offset of `cu_seqlens` as an index.
fn offset(value: u32) -> usize {
    value as usize
}

/// The length of the example between two consecutive offsets.
fn len(bounds: &[u32]) -> usize {
    offset(bounds[1]) - offset(bounds[0])
}

/// Cuts `values` (`[T, width]`) into one mutable block of rows per example.
fn split_rows<'a>(values: &'a mut [f32], cu_seqlens: &[u32], width: usize) -> Vec<&'a mut [f32]> {
    let mut blocks = Vec::with_capacity(cu_seqlens.len().saturating_sub(1));
    let mut rest = values;
    for bounds in cu_seqlens.windows(2) {
        let (block, tail) = rest.split_at_mut(len(bounds) * width);
        blocks.push(block);
        rest = tail;
    }
    blocks
}

/// Quadratic work: starting the longest examples first keeps the threads
/// busy to the end.
fn longest_first<J>(jobs: &mut [J], len: impl Fn(&J) -> usize) {
    jobs.sort_by_key(|job| std::cmp::Reverse(len(job)));
}

/// One example's rows of the inputs.
struct Example<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    len: usize,
    dims: AttentionDims,
}

/// One example's rows of what the forward pass saved and of `d_out`.
struct Saved<'a> {
    out: &'a [f32],
    lse: &'a [f32],
    d_out: &'a [f32],
}

/// One example's rows of the gradients, written by that example alone.
struct Grads<'a> {
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

impl<'a> Example<'a> {
    fn new(
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        start: usize,
        len: usize,
        dims: AttentionDims,
    ) -> Self {
        let (qr, kr) = (dims.q_row(), dims.kv_row());
        Self {
            q: &q[start * qr..(start + len) * qr],
            k: &k[start * kr..(start + len) * kr],
            v: &v[start * kr..(start + len) * kr],
            len,
            dims,
        }
    }

    /// Row `i`, head `h` of a `[len, heads, D]` block.
    #[inline(always)]
    fn head<'s>(&self, block: &'s [f32], heads: usize, i: usize, h: usize) -> &'s [f32] {
        let d = self.dims.head_dim;
        &block[(i * heads + h) * d..(i * heads + h + 1) * d]
    }

    /// Inlined into `simd::dispatch`, so compiled for the CPU's vector set.
    #[inline(always)]
    fn forward(&self, scale: f32, out: &mut [f32], lse: &mut [f32]) {
        let AttentionDims {
            num_heads,
            num_kv_heads,
            head_dim,
        } = self.dims;
        let mut scores = vec![0.0f32; self.len];
        for h in 0..num_heads {
            let kv = h / self.dims.group();
            for i in 0..self.len {
                let query = self.head(self.q, num_heads, i, h);
                let row = &mut scores[..=i];
                for (j, score) in row.iter_mut().enumerate() {
                    *score = dot(query, self.head(self.k, num_kv_heads, j, kv)) * scale;
                }
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for score in row.iter_mut() {
                    *score = simd::exp(*score - max);
                    sum += *score;
                }
                let offset = (i * num_heads + h) * head_dim;
                let o = &mut out[offset..offset + head_dim];
                for (j, &p) in row.iter().enumerate() {
                    axpy(p, self.head(self.v, num_kv_heads, j, kv), o);
                }
                let inv = 1.0 / sum;
                o.iter_mut().for_each(|x| *x *= inv);
                lse[i * num_heads + h] = max + sum.ln();
            }
        }
    }

    /// Inlined into `simd::dispatch`, so compiled for the CPU's vector set.
    #[inline(always)]
    fn backward(&self, scale: f32, saved: &Saved<'_>, grads: Grads<'_>) {
        let AttentionDims {
            num_heads,
            num_kv_heads,
            head_dim,
        } = self.dims;
        let Grads { dq, dk, dv } = grads;
        let mut probs = vec![0.0f32; self.len];
        for h in 0..num_heads {
            let kv = h / self.dims.group();
            for i in 0..self.len {
                let query = self.head(self.q, num_heads, i, h);
                let d_o = self.head(saved.d_out, num_heads, i, h);
                // D_i = dO_i . O_i = sum_j P_ij dP_ij: the softmax Jacobian's
                // correction term, without the row of dP.
                let correction = dot(d_o, self.head(saved.out, num_heads, i, h));
                let lse = saved.lse[i * num_heads + h];
                let row = &mut probs[..=i];
                for (j, p) in row.iter_mut().enumerate() {
                    *p =
                        simd::exp(dot(query, self.head(self.k, num_kv_heads, j, kv)) * scale - lse);
                }
                let offset = (i * num_heads + h) * head_dim;
                for (j, &p) in row.iter().enumerate() {
                    let kv_offset = (j * num_kv_heads + kv) * head_dim;
                    axpy(p, d_o, &mut dv[kv_offset..kv_offset + head_dim]);
                    let d_score =
                        p * (dot(d_o, self.head(self.v, num_kv_heads, j, kv)) - correction);
                    let d_score = d_score * scale;
                    axpy(
                        d_score,
                        self.head(self.k, num_kv_heads, j, kv),
                        &mut dq[offset..offset + head_dim],
                    );
                    axpy(d_score, query, &mut dk[kv_offset..kv_offset + head_dim]);
                }
            }
        }
    }
}

// ---- the composed oracle (burn ops) ----

/// A causal mask (`[1, 1, len, len]`) for every distinct example length of a
/// batch, built once per forward pass and shared by every layer.
#[derive(Debug, Clone)]
pub struct CausalMasks {
    by_len: BTreeMap<usize, Tensor<4, Bool>>,
}

impl CausalMasks {
    /// Masks for examples of these lengths.
    pub fn new(lengths: impl IntoIterator<Item = usize>, device: &Device) -> Self {
        let mut by_len = BTreeMap::new();
        for len in lengths {
            by_len
                .entry(len)
                .or_insert_with(|| causal_mask(len, device));
        }
        Self { by_len }
    }

    /// The mask of an example of `len` tokens (built on demand if the batch
    /// did not announce that length).
    fn get(&self, len: usize, device: &Device) -> Tensor<4, Bool> {
        self.by_len
            .get(&len)
            .cloned()
            .unwrap_or_else(|| causal_mask(len, device))
    }
}

/// Added to scores of masked positions before the softmax. The most negative
/// finite f32, as transformers uses: `-inf` would turn into NaN in backward
/// wherever `0 * inf` appears.
const MASKED: f32 = f32::MIN;

/// The slow, obvious varlen attention: each example attends causally to
/// itself only, one small attention per example from burn ops, so the work
/// is the sum of squared lengths, not `T^2`.
///
/// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]` -> `[T, H, D]`.
pub fn composed_varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    meta: &BatchMeta,
    masks: &CausalMasks,
) -> Tensor<3> {
    let device = q.device();
    let outputs: Vec<Tensor<3>> = meta
        .example_ranges()
        .map(|range| {
            let len = range.len();
            let rows = |t: &Tensor<3>| {
                narrow(t.clone(), 0, range.start, len)
                    .swap_dims(0, 1)
                    .unsqueeze_dim::<4>(0)
            };
            let out = composed_core(rows(&q), rows(&k), rows(&v), masks.get(len, &device));
            // [1, H, len, D] -> [len, H, D]
            out.squeeze_dim::<3>(0).swap_dims(0, 1)
        })
        .collect();
    cat(outputs, 0)
}

/// The slow, obvious padded attention: `B` rows of `L` tokens with a
/// `[B, 1, L, L]` mask, true where a query may not see a key (the future, or
/// a pad).
///
/// `q`: `[B * L, H, D]`, `k`, `v`: `[B * L, Hkv, D]` -> `[B * L, H, D]`.
pub fn composed_padded_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    batch_size: usize,
    seq_len: usize,
    mask: Tensor<4, Bool>,
) -> Tensor<3> {
    let [_, heads, head_dim] = q.dims();
    let rows = |t: Tensor<3>| {
        let heads = t.dims()[1];
        t.reshape([batch_size, seq_len, heads, head_dim])
            .swap_dims(1, 2)
    };
    let out = composed_core(rows(q), rows(k), rows(v), mask);
    out.swap_dims(1, 2)
        .reshape([batch_size * seq_len, heads, head_dim])
}

/// Scaled dot-product attention with grouped key/value heads.
///
/// `q`: `[b, H, l, D]`, `k`, `v`: `[b, Hkv, l, D]`, `mask`: `[b, 1, l, l]`
/// (true = hidden) -> `[b, H, l, D]`.
fn composed_core(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Tensor<4, Bool>) -> Tensor<4> {
    let [b, h, l, head_dim] = q.dims();
    let group = h / k.dims()[1];
    let k = repeat_kv(k, group);
    let v = repeat_kv(v, group);
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    let scores = mask_fill(scores, mask.expand([b, h, l, l]), MASKED);
    softmax_last(scores).matmul(v)
}

/// `[b, Hkv, l, D] -> [b, Hkv * group, l, D]`, each key/value head serving
/// its group of query heads (HF's `repeat_kv`).
fn repeat_kv(x: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return x;
    }
    let [b, hkv, l, d] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .repeat_dim(2, group)
        .reshape([b, hkv * group, l, d])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The obvious O(T^2) definition in f64: every query of every head
    /// against every key of the whole row, masked unless same example and
    /// not in the future.
    fn oracle(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cu_seqlens: &[u32],
        dims: AttentionDims,
        scale: f32,
    ) -> Vec<f64> {
        let total = total_tokens(cu_seqlens);
        let example_of = |t: usize| {
            cu_seqlens
                .windows(2)
                .position(|w| offset(w[0]) <= t && t < offset(w[1]))
        };
        let d = dims.head_dim;
        let mut out = vec![0.0; total * dims.q_row()];
        for h in 0..dims.num_heads {
            let kv = h / dims.group();
            for i in 0..total {
                let visible: Vec<usize> = (0..=i)
                    .filter(|&j| example_of(j) == example_of(i))
                    .collect();
                let scores: Vec<f64> = visible
                    .iter()
                    .map(|&j| {
                        (0..d)
                            .map(|x| {
                                f64::from(q[(i * dims.num_heads + h) * d + x])
                                    * f64::from(k[(j * dims.num_kv_heads + kv) * d + x])
                            })
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = weights.iter().sum();
                for x in 0..d {
                    out[(i * dims.num_heads + h) * d + x] = visible
                        .iter()
                        .zip(&weights)
                        .map(|(&j, w)| w / sum * f64::from(v[(j * dims.num_kv_heads + kv) * d + x]))
                        .sum();
                }
            }
        }
        out
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    const DIMS: AttentionDims = AttentionDims {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 12,
    };
    const CU: [u32; 4] = [0, 5, 6, 14];

    fn qkv<'a>(q: &'a [f32], k: &'a [f32], v: &'a [f32]) -> Qkv<'a> {
        Qkv { q, k, v }
    }

    fn inputs() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let t = 14;
        (
            values(t * DIMS.q_row(), 1),
            values(t * DIMS.kv_row(), 2),
            values(t * DIMS.kv_row(), 3),
        )
    }

    #[test]
    fn forward_matches_the_masked_full_row_oracle() {
        let (q, k, v) = inputs();
        let fast = forward(qkv(&q, &k, &v), &CU, DIMS, 0.4);
        let slow = oracle(&q, &k, &v, &CU, DIMS, 0.4);
        for (a, b) in fast.out.iter().zip(&slow) {
            assert!((f64::from(*a) - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    /// Central differences of `sum(out * w)` in f64 through the oracle,
    /// for every input element.
    #[test]
    fn backward_matches_finite_differences_of_the_oracle() {
        let (q, k, v) = inputs();
        let weights = values(14 * DIMS.q_row(), 4);
        let objective = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
            oracle(q, k, v, &CU, DIMS, 0.4)
                .iter()
                .zip(&weights)
                .map(|(o, w)| o * f64::from(*w))
                .sum()
        };
        let saved = forward(qkv(&q, &k, &v), &CU, DIMS, 0.4);
        let grads = backward(
            qkv(&q, &k, &v),
            &saved.out,
            &saved.lse,
            &weights,
            &CU,
            DIMS,
            0.4,
        );
        let step = 1e-2f32;
        let check = |which: usize, analytic: &[f32]| {
            for index in 0..analytic.len() {
                let mut plus = [q.clone(), k.clone(), v.clone()];
                let mut minus = plus.clone();
                plus[which][index] += step;
                minus[which][index] -= step;
                let numeric = (objective(&plus[0], &plus[1], &plus[2])
                    - objective(&minus[0], &minus[1], &minus[2]))
                    / (2.0 * f64::from(step));
                // f32 inputs perturbed by 1e-2: the f64 oracle's central
                // difference is exact to O(step^2) ~ 1e-4 relative.
                let tolerance = 1e-3 * (1.0 + numeric.abs());
                let got = f64::from(analytic[index]);
                assert!(
                    (got - numeric).abs() < tolerance,
                    "input {which}[{index}]: {got} vs {numeric}"
                );
            }
        };
        check(0, &grads.dq);
        check(1, &grads.dk);
        check(2, &grads.dv);
    }

    #[test]
    fn examples_never_see_each_other() {
        let (q, k, mut v) = inputs();
        let before = forward(qkv(&q, &k, &v), &CU, DIMS, 0.4).out;
        // Change every value of the last example: the first two must not move.
        for x in &mut v[6 * DIMS.kv_row()..] {
            *x += 1.0;
        }
        let after = forward(qkv(&q, &k, &v), &CU, DIMS, 0.4).out;
        assert_eq!(before[..6 * DIMS.q_row()], after[..6 * DIMS.q_row()]);
        assert_ne!(before[6 * DIMS.q_row()..], after[6 * DIMS.q_row()..]);
    }
}
