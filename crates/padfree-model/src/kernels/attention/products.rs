//! The host kernel of the varlen attention under `--bf16`: its products on
//! the bf16 gemm ([`crate::kernels::gemm_bf16`]: AMX tiles, `vdpbf16ps`, or
//! f32 on rounded values, whichever this CPU runs), its softmax in f32.
//!
//! What it computes is what PyTorch's CPU flash attention computes under
//! autocast's bf16 (`scaled_dot_product_attention` on bf16 tensors):
//! - `S = Q K^T` from bf16 `q`, `k`, summed in f32; the softmax, its
//!   log-sum-exp and the correction `D_i = dO_i . O_i` in f32;
//! - the softmax's numerators `e^(S scale - max)` rounded to bf16 before
//!   they meet `V`, the product divided by their f32 sum; in the backward
//!   pass `P` and `dS = P (dP - D) scale` rounded to bf16 before
//!   `dV = P^T dO`, `dQ = dS K` and `dK = dS^T Q` (every product sums in
//!   f32);
//! - `dO` is bf16 (the gradient of a bf16 output); the caller rounds it.
//!
//! The f32 kernel (`host.rs`) keeps `P` and `dS` in f32 and multiplies in
//! f32 registers four query rows at a time: on a SmolLM2-135M maths batch
//! (one layer, ~1,170 tokens) it did about 30 GFLOP/s of useful work, an
//! eighth of the 2-core test machine's f32 peak. Here a block of up to
//! [`BLOCK_ROWS`] query rows of one head meets the keys up to its last row
//! in one product, on whole AMX tiles where the CPU has them: forward and
//! backward 1.8-2.2x faster than the f32 kernel on that batch, and
//! 1.7-2.0x on the widened body, the f32 gemm on rounded values
//! (`docs/benchmarks/2026-12-05-bf16-attention-tiles.md`).
//! A block computes the scores of its whole square on the diagonal, half of
//! them masked (about 32 wasted scores a row for 64-row blocks).
//!
//! The tests compare it with the f64 definition, each value within the
//! bound that the rounding of the numerators, `P` and `dS` can move it by
//! (computed by the test from the same values); the f32 kernel stays under
//! a twentieth of those bounds, this one must use more (the rounding
//! happens).
//!
//! # Shapes
//! `q`, `out`, `dq`, `d_out`: `[T, H, D]`; `k`, `v`, `dk`, `dv`:
//! `[T, Hkv, D]`; `lse`: `[T, H]`; inputs bf16-valued f32.

use super::host::{AttentionDims, BackwardOutput, ForwardOutput, Qkv, Saved, for_each_example};
use crate::kernels::gemm::Write;
use crate::kernels::gemm_bf16::{self, Body, View16, product_into_with};
use crate::kernels::simd::{self, dot};

/// Query rows of one head a block of products takes: 64 rows are four
/// AMX row tiles; a taller block computes more masked scores on the
/// diagonal (a block of `B` rows wastes about `B / 2` scores a row).
pub(super) const BLOCK_ROWS: usize = 64;

/// `softmax(q k^T * scale + causal) v` for every example, the softmax's
/// numerators rounded to bf16 before they meet `v` (see the module docs).
/// `q`, `k`, `v` must be bf16-valued.
///
/// # Panics
/// In builds with debug assertions, when an input is not bf16-valued.
pub(super) fn forward(
    inputs: Qkv<'_>,
    cu_seqlens: &[u32],
    dims: AttentionDims,
    scale: f32,
) -> ForwardOutput {
    forward_with(gemm_bf16::body(), inputs, cu_seqlens, dims, scale)
}

/// [`forward`] on a given body of the bf16 products (tests run them all).
///
/// # Panics
/// When this CPU cannot run `body`.
pub(super) fn forward_with(
    body: Body,
    inputs: Qkv<'_>,
    cu_seqlens: &[u32],
    dims: AttentionDims,
    scale: f32,
) -> ForwardOutput {
    let widths = [dims.q_row(), dims.num_heads];
    let [out, lse] = for_each_example(widths, cu_seqlens, |start, len, [out, lse]| {
        Example::new(body, inputs, (start, len), dims).forward(scale, out, lse);
    });
    ForwardOutput { out, lse }
}

/// Gradients of [`forward`]'s inputs: `out` and `lse` are what it returned,
/// `d_out` the gradient of `out`, all bf16-valued but `lse`.
///
/// # Panics
/// In builds with debug assertions, when an input is not bf16-valued.
pub(super) fn backward(
    inputs: Qkv<'_>,
    saved: (&[f32], &[f32], &[f32]),
    cu_seqlens: &[u32],
    dims: AttentionDims,
    scale: f32,
) -> BackwardOutput {
    backward_with(gemm_bf16::body(), inputs, saved, cu_seqlens, dims, scale)
}

/// [`backward`] on a given body of the bf16 products.
///
/// # Panics
/// When this CPU cannot run `body`.
pub(super) fn backward_with(
    body: Body,
    inputs: Qkv<'_>,
    (out, lse, d_out): (&[f32], &[f32], &[f32]),
    cu_seqlens: &[u32],
    dims: AttentionDims,
    scale: f32,
) -> BackwardOutput {
    // dK and dV gather every query head of their group and every block
    // of rows: the products add into the zeros they start as.
    let widths = [dims.q_row(), dims.kv_row(), dims.kv_row()];
    let [dq, dk, dv] = for_each_example(widths, cu_seqlens, |start, len, [dq, dk, dv]| {
        let saved = Saved { out, lse, d_out }.rows(start, len, dims);
        Example::new(body, inputs, (start, len), dims).backward(scale, &saved, [dq, dk, dv]);
    });
    BackwardOutput { dq, dk, dv }
}

/// One example's rows of a `[L, heads, D]` activation.
#[derive(Clone, Copy)]
struct HeadRows<'a> {
    values: &'a [f32],
    heads: usize,
    d: usize,
}

impl<'a> HeadRows<'a> {
    /// Rows `first..first + count` of head `head`, `[count, D]`, in place.
    fn rows(self, head: usize, first: usize, count: usize) -> View16<'a> {
        let at = (first * self.heads + head) * self.d;
        View16::rounded_rows(&self.values[at..], count, self.d, self.heads * self.d)
    }

    /// Row `i` of head `head`, `[D]`.
    fn row(self, head: usize, i: usize) -> &'a [f32] {
        let at = (i * self.heads + head) * self.d;
        &self.values[at..at + self.d]
    }
}

/// One example's rows of the inputs, and the body its products run on.
struct Example<'a> {
    body: Body,
    q: HeadRows<'a>,
    k: HeadRows<'a>,
    v: HeadRows<'a>,
    len: usize,
    dims: AttentionDims,
}

/// Where each block of query rows starts and how many rows it holds.
fn blocks(len: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len)
        .step_by(BLOCK_ROWS)
        .map(move |first| (first, BLOCK_ROWS.min(len - first)))
}

/// `values` cleared and `len` long, for a product to set.
fn sized(values: &mut Vec<f32>, len: usize) -> &mut [f32] {
    values.clear();
    values.resize(len, 0.0);
    values
}

impl<'a> Example<'a> {
    fn new(body: Body, inputs: Qkv<'a>, (start, len): (usize, usize), dims: AttentionDims) -> Self {
        let (qr, kr, d) = (dims.q_row(), dims.kv_row(), dims.head_dim);
        let rows = |values: &'a [f32], width: usize, heads: usize| HeadRows {
            values: &values[start * width..(start + len) * width],
            heads,
            d,
        };
        Self {
            body,
            q: rows(inputs.q, qr, dims.num_heads),
            k: rows(inputs.k, kr, dims.num_kv_heads),
            v: rows(inputs.v, kr, dims.num_kv_heads),
            len,
            dims,
        }
    }

    fn kv_head(&self, head: usize) -> usize {
        head / (self.dims.num_heads / self.dims.num_kv_heads)
    }

    /// `out` (`[L, H, D]`) and `lse` (`[L, H]`) of this example.
    fn forward(&self, scale: f32, out: &mut [f32], lse: &mut [f32]) {
        let (heads, d) = (self.dims.num_heads, self.dims.head_dim);
        let mut scores = Vec::new();
        let mut sums = [0.0f32; BLOCK_ROWS];
        for h in 0..heads {
            let kv = self.kv_head(h);
            for (first, rows) in blocks(self.len) {
                let keys = first + rows;
                let s = sized(&mut scores, rows * keys);
                product_into_with(
                    self.body,
                    s,
                    keys,
                    self.q.rows(h, first, rows),
                    self.k.rows(kv, 0, keys).t(),
                    Write::Set,
                );
                simd::dispatch(
                    #[inline(always)]
                    || {
                        for (r, row) in s.chunks_exact_mut(keys).enumerate() {
                            let (max, sum) = exponentials(row, first + r + 1, scale);
                            lse[(first + r) * heads + h] = max + sum.ln();
                            sums[r] = sum;
                        }
                    },
                );
                let block_out = &mut out[(first * heads + h) * d..];
                product_into_with(
                    self.body,
                    block_out,
                    heads * d,
                    View16::f32(s, rows, keys),
                    self.v.rows(kv, 0, keys),
                    Write::Set,
                );
                // The softmax's denominators, after the product (as torch
                // divides its output at the end).
                for (row, sum) in block_out.chunks_mut(heads * d).zip(&sums[..rows]) {
                    let inv = 1.0 / sum;
                    row[..d].iter_mut().for_each(|o| *o *= inv);
                }
            }
        }
    }

    /// `[dq, dk, dv]` of this example (`[L, H, D]`, twice `[L, Hkv, D]`),
    /// `dk` and `dv` zeros on entry.
    fn backward(&self, scale: f32, saved: &Saved<'_>, [dq, dk, dv]: [&mut [f32]; 3]) {
        let (heads, d) = (self.dims.num_heads, self.dims.head_dim);
        let kv_row = self.dims.kv_row();
        let out = HeadRows {
            values: saved.out,
            ..self.q
        };
        let d_out = HeadRows {
            values: saved.d_out,
            ..self.q
        };
        let (mut probs, mut d_scores) = (Vec::new(), Vec::new());
        for h in 0..heads {
            let kv = self.kv_head(h);
            for (first, rows) in blocks(self.len) {
                let keys = first + rows;
                let p = sized(&mut probs, rows * keys);
                let ds = sized(&mut d_scores, rows * keys);
                // S again (P from the saved log-sum-exp), and dP = dO V^T.
                let query = self.q.rows(h, first, rows);
                product_into_with(
                    self.body,
                    p,
                    keys,
                    query,
                    self.k.rows(kv, 0, keys).t(),
                    Write::Set,
                );
                let d_o = d_out.rows(h, first, rows);
                product_into_with(
                    self.body,
                    ds,
                    keys,
                    d_o,
                    self.v.rows(kv, 0, keys).t(),
                    Write::Set,
                );
                simd::dispatch(
                    #[inline(always)]
                    || {
                        let rows = p.chunks_exact_mut(keys).zip(ds.chunks_exact_mut(keys));
                        for (r, (p_row, ds_row)) in rows.enumerate() {
                            let i = first + r;
                            // D_i = dO_i . O_i = sum_j P_ij dP_ij.
                            let correction = dot(d_out.row(h, i), out.row(h, i));
                            let lse = saved.lse[i * heads + h];
                            d_scores_row(p_row, ds_row, i + 1, (scale, lse, correction));
                        }
                    },
                );
                // dQ = dS K, dK += dS^T Q, dV += P^T dO.
                product_into_with(
                    self.body,
                    &mut dq[(first * heads + h) * d..],
                    heads * d,
                    View16::f32(ds, rows, keys),
                    self.k.rows(kv, 0, keys),
                    Write::Set,
                );
                product_into_with(
                    self.body,
                    &mut dk[kv * d..],
                    kv_row,
                    View16::f32(ds, rows, keys).t(),
                    query,
                    Write::Add(1.0),
                );
                product_into_with(
                    self.body,
                    &mut dv[kv * d..],
                    kv_row,
                    View16::f32(p, rows, keys).t(),
                    d_o,
                    Write::Add(1.0),
                );
            }
        }
    }
}

/// One row of scores, its softmax's numerators in place: `e^(S scale -
/// max)` over its first `seen` entries, zeros past them. Returns the max
/// and the sum of the numerators (the log-sum-exp is `max + ln(sum)`).
///
/// The numerators, not the probabilities, meet `v` (rounded to bf16 on
/// the way), and the product is divided by the sum: where PyTorch's bf16
/// flash attention rounds (its outputs matched this order in 91% of
/// values, and normalised-then-rounded probabilities in 54%, for one
/// 200-token head under autocast; the rest differ by summation order).
#[inline(always)]
fn exponentials(row: &mut [f32], seen: usize, scale: f32) -> (f32, f32) {
    let (visible, future) = row.split_at_mut(seen);
    future.fill(0.0);
    visible.iter_mut().for_each(|s| *s *= scale);
    let max = simd::max(visible);
    (max, simd::exp_in_place(visible, max))
}

/// One row of the backward pass: `p_row` holds `S`, `ds_row` holds `dP`;
/// they become `P = exp(S scale - lse)` and `dS = P (dP - D) scale` over
/// the first `seen` entries, zeros past them.
#[inline(always)]
fn d_scores_row(
    p_row: &mut [f32],
    ds_row: &mut [f32],
    seen: usize,
    (scale, lse, correction): (f32, f32, f32),
) {
    // Whole chunks of 16 up to `seen` where the row allows (the values
    // past it are then zeroed): a scalar tail of exponentials in every row
    // cost as much as the vectorised body.
    let end = seen.next_multiple_of(16).min(p_row.len());
    let one = |p: &mut f32, ds: &mut f32| {
        let prob = simd::exp(*p * scale - lse);
        *p = prob;
        *ds = prob * (*ds - correction) * scale;
    };
    let mut p_chunks = p_row[..end].chunks_exact_mut(16);
    let mut ds_chunks = ds_row[..end].chunks_exact_mut(16);
    for (p, ds) in (&mut p_chunks).zip(&mut ds_chunks) {
        for lane in 0..16 {
            one(&mut p[lane], &mut ds[lane]);
        }
    }
    let rest = p_chunks.into_remainder().iter_mut();
    rest.zip(ds_chunks.into_remainder())
        .for_each(|(p, ds)| one(p, ds));
    p_row[seen..].fill(0.0);
    ds_row[seen..].fill(0.0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::rounded_copy;
    use padfree_pack::SplitMix64;

    /// bf16's unit roundoff (8 significant bits): rounding moves a value
    /// of `P` or `dS` by at most this share of it (half a step, at the
    /// bottom of a binade).
    const HALF_STEP: f64 = 1.0 / 256.0;

    /// GQA 2:1 at SmolLM2's head size; lengths with one row, one block
    /// exactly, and blocks with ragged last ones.
    const DIMS: AttentionDims = AttentionDims {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
    };
    const LENGTHS: [u32; 5] = [70, 1, 64, 131, 9];
    const SCALE: f32 = 0.125;

    fn offsets(lengths: &[u32]) -> Vec<u32> {
        let mut cu = vec![0];
        for len in lengths {
            cu.push(cu.last().copied().unwrap_or(0) + len);
        }
        cu
    }

    /// bf16-valued `q`, `k`, `v` and `d_out`, standard normal.
    fn inputs(total: usize, seed: u64) -> [Vec<f32>; 4] {
        let mut rng = SplitMix64::new(seed);
        let mut values = |n: usize| -> Vec<f32> {
            let raw: Vec<f32> = (0..n).map(|_| rng.standard_normal() as f32).collect();
            rounded_copy(&raw)
        };
        [
            values(total * DIMS.q_row()),
            values(total * DIMS.kv_row()),
            values(total * DIMS.kv_row()),
            values(total * DIMS.q_row()),
        ]
    }

    fn at(i: usize, heads: usize, head: usize, x: usize) -> usize {
        (i * heads + head) * DIMS.head_dim + x
    }

    /// The definition in f64 with exact probabilities, and for every value
    /// of every output the most that rounding `P` and `dS` to bf16 can move
    /// it by: half a bf16 step of each term's magnitude, summed (`|P_ij|
    /// |v_j|` for `O`, `|dS_ij| |k_j|` for `dQ`, `|dS_ij| |q_i|` for `dK`,
    /// `|P_ij| |dO_i|` for `dV`). `out16` is the bf16 output the backward
    /// pass reads `D_i` from.
    struct Oracle {
        out: Vec<f64>,
        out_bound: Vec<f64>,
        grads: [Vec<f64>; 3],
        grad_bounds: [Vec<f64>; 3],
    }

    fn oracle(qkv: [&[f32]; 3], d_out: &[f32], out16: &[f32], cu: &[u32]) -> Oracle {
        let [q, k, v] = qkv;
        let (h_n, kv_n, d) = (DIMS.num_heads, DIMS.num_kv_heads, DIMS.head_dim);
        let total = *cu.last().expect("offsets") as usize;
        let zeros = |n: usize| vec![0.0f64; n];
        let (mut out, mut out_bound) = (zeros(total * h_n * d), zeros(total * h_n * d));
        let mut grads = [
            zeros(total * h_n * d),
            zeros(total * kv_n * d),
            zeros(total * kv_n * d),
        ];
        let mut bounds = grads.clone();
        let f = f64::from;
        for example in cu.windows(2) {
            let (start, end) = (example[0] as usize, example[1] as usize);
            for h in 0..h_n {
                let kv = h / (h_n / kv_n);
                for i in start..end {
                    let keys = start..=i;
                    let dot = |a: &[f32], ha: usize, b: &[f32], hb: usize, j: usize| -> f64 {
                        (0..d)
                            .map(|x| f(a[at(i, ha, h, x)]) * f(b[at(j, hb, kv, x)]))
                            .sum()
                    };
                    let scores: Vec<f64> = keys
                        .clone()
                        .map(|j| dot(q, h_n, k, kv_n, j) * f(SCALE))
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = weights.iter().sum();
                    let correction: f64 = (0..d)
                        .map(|x| f(d_out[at(i, h_n, h, x)]) * f(out16[at(i, h_n, h, x)]))
                        .sum();
                    for (n, j) in keys.enumerate() {
                        let p = weights[n] / sum;
                        let ds = p * (dot(d_out, h_n, v, kv_n, j) - correction) * f(SCALE);
                        for x in 0..d {
                            let (qi, kj) = (at(i, h_n, h, x), at(j, kv_n, kv, x));
                            out[qi] += p * f(v[kj]);
                            out_bound[qi] += HALF_STEP * p * f(v[kj]).abs();
                            grads[0][qi] += ds * f(k[kj]);
                            bounds[0][qi] += HALF_STEP * ds.abs() * f(k[kj]).abs();
                            grads[1][kj] += ds * f(q[qi]);
                            bounds[1][kj] += HALF_STEP * ds.abs() * f(q[qi]).abs();
                            grads[2][kj] += p * f(d_out[qi]);
                            bounds[2][kj] += HALF_STEP * p * f(d_out[qi]).abs();
                        }
                    }
                }
            }
        }
        Oracle {
            out,
            out_bound,
            grads,
            grad_bounds: bounds,
        }
    }

    /// `got` within `bound` of `want` value by value, plus f32's share
    /// (sums of f32 terms and `exp` in f32: 1e-5 of the largest value,
    /// under a tenth of the bounds' typical size). Returns the largest
    /// error as a share of its bound.
    fn within(name: &str, got: &[f32], want: &[f64], bound: &[f64]) -> f64 {
        let largest = want.iter().fold(0f64, |m, x| m.max(x.abs()));
        let mut worst = 0f64;
        for (n, ((&g, &w), &b)) in got.iter().zip(want).zip(bound).enumerate() {
            let error = (f64::from(g) - w).abs();
            let allowed = b + 1e-5 * largest;
            assert!(
                error <= allowed,
                "{name}[{n}]: {g} vs {w}, bound {allowed:e}"
            );
            worst = worst.max(error / allowed);
        }
        worst
    }

    /// Every body this CPU runs against the f64 definition, within what
    /// rounding the numerators, `P` and `dS` to bf16 may move each value;
    /// and the rounding happens: every output's largest error uses more
    /// than a twentieth of its bound, which the f32 kernel (`host.rs`, no
    /// rounding) does not.
    #[test]
    fn products_match_the_definition_within_the_rounding_of_p_and_ds() {
        let cu = offsets(&LENGTHS);
        let total = *cu.last().expect("offsets") as usize;
        let [q, k, v, d_out] = inputs(total, 17);
        let qkv = Qkv {
            q: &q,
            k: &k,
            v: &v,
        };
        let worst_shares = |name: &str, out: &[f32], grads: [&[f32]; 3], oracle: &Oracle| {
            let mut worst = vec![within(name, out, &oracle.out, &oracle.out_bound)];
            for ((got, want), bound) in grads
                .into_iter()
                .zip(&oracle.grads)
                .zip(&oracle.grad_bounds)
            {
                worst.push(within(name, got, want, bound));
            }
            eprintln!(
                "{name}: largest errors as shares of their bounds (O, dQ, dK, dV): {worst:.3?}"
            );
            worst
        };
        // The f32 kernel, on the same inputs and saved values.
        let f32_forward = super::super::host::forward(qkv, &cu, DIMS, SCALE);
        let out16 = rounded_copy(&f32_forward.out);
        let oracle_f32 = oracle([&q, &k, &v], &d_out, &out16, &cu);
        let f32_grads =
            super::super::host::backward(qkv, &out16, &f32_forward.lse, &d_out, &cu, DIMS, SCALE);
        let grads = [f32_grads.dq.as_slice(), &f32_grads.dk, &f32_grads.dv];
        let worst = worst_shares("f32 kernel", &f32_forward.out, grads, &oracle_f32);
        assert!(
            worst.iter().all(|&w| w < 0.05),
            "the f32 kernel used {worst:?} of the bounds"
        );
        for body in gemm_bf16::test_bodies() {
            let name = body.name();
            let forward = forward_with(body, qkv, &cu, DIMS, SCALE);
            let out16 = rounded_copy(&forward.out);
            let oracle = oracle([&q, &k, &v], &d_out, &out16, &cu);
            let saved = (out16.as_slice(), forward.lse.as_slice(), d_out.as_slice());
            let grads = backward_with(body, qkv, saved, &cu, DIMS, SCALE);
            let got = [grads.dq.as_slice(), &grads.dk, &grads.dv];
            let worst = worst_shares(name, &forward.out, got, &oracle);
            assert!(
                worst.iter().all(|&w| w > 0.05),
                "{name}: errors {worst:?} of the bounds: P or dS not rounded?"
            );
        }
    }

    /// An example's rows are the same bits whatever else is in the batch
    /// and wherever it starts: the examples one at a time, and the batch in
    /// reverse order, give the batch's values (flattened == one at a time).
    #[test]
    fn an_example_is_the_same_bits_alone_or_anywhere_in_a_batch() {
        let cu = offsets(&LENGTHS);
        let total = *cu.last().expect("offsets") as usize;
        let inputs = inputs(total, 29);
        let body = gemm_bf16::body();
        let run = |cu: &[u32], [q, k, v, d_out]: &[Vec<f32>; 4]| {
            let qkv = Qkv { q, k, v };
            let forward = forward_with(body, qkv, cu, DIMS, SCALE);
            let out16 = rounded_copy(&forward.out);
            let saved = (out16.as_slice(), forward.lse.as_slice(), d_out.as_slice());
            let grads = backward_with(body, qkv, saved, cu, DIMS, SCALE);
            [forward.out, forward.lse, grads.dq, grads.dk, grads.dv]
        };
        let (q_row, kv_row) = (DIMS.q_row(), DIMS.kv_row());
        let input_widths = [q_row, kv_row, kv_row, q_row];
        let output_widths = [q_row, DIMS.num_heads, q_row, kv_row, kv_row];
        let spans: Vec<(usize, usize)> = cu
            .windows(2)
            .map(|w| (w[0] as usize, w[1] as usize))
            .collect();
        let rows = |values: &[f32], width: usize, (s, e): (usize, usize)| {
            values[s * width..e * width].to_vec()
        };
        let gather = |order: &[(usize, usize)]| -> [Vec<f32>; 4] {
            std::array::from_fn(|n| {
                order
                    .iter()
                    .flat_map(|&span| rows(&inputs[n], input_widths[n], span))
                    .collect()
            })
        };
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();

        let batch = run(&cu, &inputs);
        let reversed_spans: Vec<_> = spans.iter().rev().copied().collect();
        let mut reversed_lengths = LENGTHS;
        reversed_lengths.reverse();
        let reversed = run(&offsets(&reversed_lengths), &gather(&reversed_spans));
        let mut moved_start = total;
        for &span in &spans {
            let len = span.1 - span.0;
            moved_start -= len;
            let alone = run(&[0, len as u32], &gather(&[span]));
            for (n, width) in output_widths.into_iter().enumerate() {
                let want = bits(&rows(&batch[n], width, span));
                assert_eq!(bits(&alone[n]), want, "output {n} of {span:?} alone");
                let moved = rows(&reversed[n], width, (moved_start, moved_start + len));
                assert_eq!(bits(&moved), want, "output {n} of {span:?} moved");
            }
        }
    }

    /// One row's numerators, max and sum against their definition, masked
    /// past `seen`, for lengths around the 16-lane chunks.
    #[test]
    fn exponentials_match_their_definition() {
        for (seen, width) in [(1, 1), (15, 20), (16, 16), (17, 40), (64, 64), (130, 131)] {
            let scores: Vec<f32> = (0..width).map(|j| (j as f32 * 0.61).sin() * 9.0).collect();
            let mut row = scores.clone();
            let (max, sum) = exponentials(&mut row, seen, 0.5);
            let scaled: Vec<f64> = scores[..seen].iter().map(|&s| f64::from(s) * 0.5).collect();
            let want_max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(f64::from(max), want_max, "max of {seen}");
            let want_sum: f64 = scaled.iter().map(|s| (s - want_max).exp()).sum();
            assert!(
                (f64::from(sum) - want_sum).abs() < 1e-6 * want_sum,
                "sum of {seen}"
            );
            for (j, &e) in row.iter().enumerate() {
                let want = if j < seen {
                    (scaled[j] - want_max).exp()
                } else {
                    0.0
                };
                assert!(
                    (f64::from(e) - want).abs() < 1e-6,
                    "e[{j}] of {seen}: {e} vs {want}"
                );
            }
        }
    }
}
