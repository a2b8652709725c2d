//! The host kernel of the varlen attention: forward and backward over a
//! whole flattened batch (FlashAttention-2's varlen algorithm on host
//! slices), split by example across rayon's threads, with its tests against
//! an f64 definition and central differences.

use rayon::prelude::*;

use super::micro::{LANES, ROWS, add_columns_times_rows, row_times_columns, weighted_rows};
use crate::kernels::simd::{self, dot};

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
    pub(super) fn q_row(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub(super) fn kv_row(&self) -> usize {
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
    let widths = [dims.q_row(), dims.num_heads];
    let [out, lse] = for_each_example(widths, cu_seqlens, |start, len, [out, lse]| {
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
    let widths = [dims.q_row(), dims.kv_row(), dims.kv_row()];
    let [dq, dk, dv] = for_each_example(widths, cu_seqlens, |start, len, [dq, dk, dv]| {
        let example = Example::new(q, k, v, start, len, dims);
        let saved = Saved { out, lse, d_out }.rows(start, len, dims);
        simd::dispatch(
            #[inline(always)]
            || example.backward(scale, &saved, Grads { dq, dk, dv }),
        );
    });
    BackwardOutput { dq, dk, dv }
}

pub(super) fn total_tokens(cu_seqlens: &[u32]) -> usize {
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

/// `N` outputs of `[T, width]` (each width given), zeros, written by `each`
/// for every example on rayon's threads, longest example first: `each`
/// gets the example's first row, its length, and its rows of each output,
/// which it alone writes.
pub(super) fn for_each_example<const N: usize>(
    widths: [usize; N],
    cu_seqlens: &[u32],
    each: impl Fn(usize, usize, [&mut [f32]; N]) + Sync,
) -> [Vec<f32>; N] {
    let total = total_tokens(cu_seqlens);
    let mut outputs = widths.map(|width| vec![0.0; total * width]);
    let mut blocks: Vec<_> = outputs
        .iter_mut()
        .zip(widths)
        .map(|(values, width)| split_rows(values, cu_seqlens, width).into_iter())
        .collect();
    let mut jobs: Vec<_> = cu_seqlens
        .windows(2)
        .map(|bounds| {
            let rows: [&mut [f32]; N] =
                std::array::from_fn(|n| blocks[n].next().expect("a block per example"));
            (offset(bounds[0]), len(bounds), rows)
        })
        .collect();
    longest_first(&mut jobs, |job| job.1);
    jobs.into_par_iter()
        .for_each(|(start, len, rows)| each(start, len, rows));
    outputs
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
pub(super) struct Saved<'a> {
    pub out: &'a [f32],
    pub lse: &'a [f32],
    pub d_out: &'a [f32],
}

impl<'a> Saved<'a> {
    /// Rows `start..start + len` (one example's) of a whole batch's.
    pub(super) fn rows(&self, start: usize, len: usize, dims: AttentionDims) -> Saved<'a> {
        let (qr, heads) = (dims.q_row(), dims.num_heads);
        Saved {
            out: &self.out[start * qr..(start + len) * qr],
            lse: &self.lse[start * heads..(start + len) * heads],
            d_out: &self.d_out[start * qr..(start + len) * qr],
        }
    }
}

/// One example's rows of the gradients, written by that example alone.
struct Grads<'a> {
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

/// Keys per score row, rounded up to [`LANES`]: the width of a transposed
/// head copy and of a block of scores.
fn padded_len(len: usize) -> usize {
    len.div_ceil(LANES) * LANES
}

/// Head `head` of an example's `[L, heads, D]` rows, copied out as `[L, D]`
/// so the micro-kernels read contiguous memory.
fn head_rows(block: &[f32], len: usize, heads: usize, head: usize, d: usize) -> Vec<f32> {
    let mut rows = Vec::with_capacity(len * d);
    for j in 0..len {
        rows.extend_from_slice(&block[(j * heads + head) * d..(j * heads + head + 1) * d]);
    }
    rows
}

/// The same head transposed, `[D, Lp]` (`Lp` = [`padded_len`], zero columns
/// past `L`).
fn head_columns(block: &[f32], len: usize, heads: usize, head: usize, d: usize) -> Vec<f32> {
    let width = padded_len(len);
    let mut columns = vec![0.0; d * width];
    for j in 0..len {
        let row = &block[(j * heads + head) * d..(j * heads + head + 1) * d];
        for (x, &value) in row.iter().enumerate() {
            columns[x * width + j] = value;
        }
    }
    columns
}

/// `ROWS` query rows of one head (`[ROWS, D]`, zero rows past the example's
/// end) and where they start.
struct RowBlock {
    start: usize,
    rows: usize,
    values: Vec<f32>,
}

impl RowBlock {
    fn new(d: usize) -> Self {
        Self {
            start: 0,
            rows: 0,
            values: vec![0.0; ROWS * d],
        }
    }

    /// Loads rows `start..start + ROWS` of head `head` of a `[L, heads, D]`
    /// block, zeros past `len`.
    fn load(&mut self, block: &[f32], start: usize, len: usize, heads: usize, head: usize) {
        let d = self.values.len() / ROWS;
        self.start = start;
        self.rows = ROWS.min(len - start);
        for (r, row) in self.values.chunks_exact_mut(d).enumerate() {
            if r < self.rows {
                let i = start + r;
                row.copy_from_slice(&block[(i * heads + head) * d..(i * heads + head + 1) * d]);
            } else {
                row.fill(0.0);
            }
        }
    }

    /// Keys this block sees: every key up to its last row.
    fn keys(&self) -> usize {
        self.start + self.rows
    }
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

    /// `P = softmax(S * scale)` of one block in place, causal: entries past
    /// a row's own position (and rows past the example's end) become 0.
    /// Returns each row's log-sum-exp.
    #[inline(always)]
    fn softmax_block(
        block: &RowBlock,
        scores: &mut [f32],
        width: usize,
        scale: f32,
    ) -> [f32; ROWS] {
        let mut lse = [0.0; ROWS];
        for (r, row) in scores.chunks_exact_mut(width).enumerate() {
            if r >= block.rows {
                row.fill(0.0);
                continue;
            }
            let (visible, future) = row.split_at_mut(block.start + r + 1);
            future.fill(0.0);
            visible.iter_mut().for_each(|s| *s *= scale);
            let max = visible.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for s in visible.iter_mut() {
                *s = simd::exp(*s - max);
                sum += *s;
            }
            let inv = 1.0 / sum;
            visible.iter_mut().for_each(|p| *p *= inv);
            lse[r] = max + sum.ln();
        }
        lse
    }

    /// Inlined into `simd::dispatch`, so compiled for the CPU's vector set.
    #[inline(always)]
    fn forward(&self, scale: f32, out: &mut [f32], lse: &mut [f32]) {
        let AttentionDims {
            num_heads,
            num_kv_heads,
            head_dim: d,
        } = self.dims;
        for kv in 0..num_kv_heads {
            // Forward needs keys transposed and values as rows.
            let key_columns = head_columns(self.k, self.len, num_kv_heads, kv, d);
            let value_rows = head_rows(self.v, self.len, num_kv_heads, kv, d);
            let width = padded_len(self.len);
            let mut scores = vec![0.0f32; ROWS * width];
            let mut block_out = vec![0.0f32; ROWS * d];
            let mut block = RowBlock::new(d);
            for h in kv * self.dims.group()..(kv + 1) * self.dims.group() {
                for start in (0..self.len).step_by(ROWS) {
                    block.load(self.q, start, self.len, num_heads, h);
                    let seen = block.keys();
                    row_times_columns(&block.values, d, &key_columns, width, seen, &mut scores);
                    let row_lse = Self::softmax_block(&block, &mut scores, width, scale);
                    weighted_rows(&scores, width, &value_rows, d, seen, &mut block_out);
                    for r in 0..block.rows {
                        let i = start + r;
                        out[(i * num_heads + h) * d..(i * num_heads + h + 1) * d]
                            .copy_from_slice(&block_out[r * d..(r + 1) * d]);
                        lse[i * num_heads + h] = row_lse[r];
                    }
                }
            }
        }
    }

    /// Inlined into `simd::dispatch`, so compiled for the CPU's vector set.
    #[inline(always)]
    fn backward(&self, scale: f32, saved: &Saved<'_>, grads: Grads<'_>) {
        let AttentionDims {
            num_heads,
            num_kv_heads,
            head_dim: d,
        } = self.dims;
        let Grads { dq, dk, dv } = grads;
        for kv in 0..num_kv_heads {
            // Backward needs keys both ways and values transposed.
            let key_columns = head_columns(self.k, self.len, num_kv_heads, kv, d);
            let key_rows = head_rows(self.k, self.len, num_kv_heads, kv, d);
            let value_columns = head_columns(self.v, self.len, num_kv_heads, kv, d);
            let width = padded_len(self.len);
            let mut probs = vec![0.0f32; ROWS * width];
            let mut d_scores = vec![0.0f32; ROWS * width];
            let mut block_dq = vec![0.0f32; ROWS * d];
            // dK and dV of this head, `[L, D]`, summed over its query heads.
            let mut head_dk = vec![0.0f32; self.len * d];
            let mut head_dv = vec![0.0f32; self.len * d];
            let (mut query, mut d_o, mut out) =
                (RowBlock::new(d), RowBlock::new(d), RowBlock::new(d));
            for h in kv * self.dims.group()..(kv + 1) * self.dims.group() {
                for start in (0..self.len).step_by(ROWS) {
                    query.load(self.q, start, self.len, num_heads, h);
                    d_o.load(saved.d_out, start, self.len, num_heads, h);
                    out.load(saved.out, start, self.len, num_heads, h);
                    let seen = query.keys();
                    // P again, from the saved log-sum-exp.
                    row_times_columns(&query.values, d, &key_columns, width, seen, &mut probs);
                    // dP = dO V^T.
                    row_times_columns(&d_o.values, d, &value_columns, width, seen, &mut d_scores);
                    for r in 0..ROWS {
                        let p_row = &mut probs[r * width..(r + 1) * width];
                        let ds_row = &mut d_scores[r * width..(r + 1) * width];
                        if r >= query.rows {
                            p_row.fill(0.0);
                            ds_row.fill(0.0);
                            continue;
                        }
                        let i = start + r;
                        let lse = saved.lse[i * num_heads + h];
                        // D_i = dO_i . O_i = sum_j P_ij dP_ij: the softmax
                        // Jacobian's correction term, without the row of dP.
                        let correction = dot(
                            &d_o.values[r * d..(r + 1) * d],
                            &out.values[r * d..(r + 1) * d],
                        );
                        for j in 0..=i {
                            let p = simd::exp(p_row[j] * scale - lse);
                            p_row[j] = p;
                            ds_row[j] = p * (ds_row[j] - correction) * scale;
                        }
                        p_row[i + 1..].fill(0.0);
                        ds_row[i + 1..].fill(0.0);
                    }
                    // dQ = dS K, dK += dS^T Q, dV += P^T dO.
                    weighted_rows(&d_scores, width, &key_rows, d, seen, &mut block_dq);
                    for r in 0..query.rows {
                        let i = start + r;
                        dq[(i * num_heads + h) * d..(i * num_heads + h + 1) * d]
                            .copy_from_slice(&block_dq[r * d..(r + 1) * d]);
                    }
                    add_columns_times_rows(&d_scores, width, &query.values, d, seen, &mut head_dk);
                    add_columns_times_rows(&probs, width, &d_o.values, d, seen, &mut head_dv);
                }
            }
            for j in 0..self.len {
                let at = (j * num_kv_heads + kv) * d;
                dk[at..at + d].copy_from_slice(&head_dk[j * d..(j + 1) * d]);
                dv[at..at + d].copy_from_slice(&head_dv[j * d..(j + 1) * d]);
            }
        }
    }
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

    /// The gradients by their textbook formulas in f64, per example and
    /// head: `P = softmax(S)`, `dP = dO V^T`, `dS = P (dP - rowsum(P dP))`,
    /// `dQ = dS K scale`, `dK = dS^T Q scale`, `dV = P^T dO`.
    fn gradient_oracle(
        [q, k, v]: [&[f32]; 3],
        d_out: &[f32],
        cu_seqlens: &[u32],
        dims: AttentionDims,
        scale: f64,
    ) -> [Vec<f64>; 3] {
        let d = dims.head_dim;
        let (hq, hk) = (dims.num_heads, dims.num_kv_heads);
        let total = total_tokens(cu_seqlens);
        let at = |values: &[f32], heads: usize, t: usize, h: usize, x: usize| {
            f64::from(values[(t * heads + h) * d + x])
        };
        let mut dq = vec![0.0; total * dims.q_row()];
        let mut dk = vec![0.0; total * dims.kv_row()];
        let mut dv = vec![0.0; total * dims.kv_row()];
        for bounds in cu_seqlens.windows(2) {
            let (start, end) = (offset(bounds[0]), offset(bounds[1]));
            for h in 0..hq {
                let kv = h / dims.group();
                for i in start..end {
                    let keys = start..=i;
                    let scores: Vec<f64> = keys
                        .clone()
                        .map(|j| {
                            (0..d)
                                .map(|x| at(q, hq, i, h, x) * at(k, hk, j, kv, x))
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                    let p: Vec<f64> = scores.iter().map(|s| (s - max).exp() / sum).collect();
                    let dp: Vec<f64> = keys
                        .clone()
                        .map(|j| {
                            (0..d)
                                .map(|x| at(d_out, hq, i, h, x) * at(v, hk, j, kv, x))
                                .sum()
                        })
                        .collect();
                    let correction: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                    for (n, j) in keys.enumerate() {
                        let ds = p[n] * (dp[n] - correction);
                        for x in 0..d {
                            dq[(i * hq + h) * d + x] += ds * at(k, hk, j, kv, x) * scale;
                            dk[(j * hk + kv) * d + x] += ds * at(q, hq, i, h, x) * scale;
                            dv[(j * hk + kv) * d + x] += p[n] * at(d_out, hq, i, h, x);
                        }
                    }
                }
            }
        }
        [dq, dk, dv]
    }

    /// Sizes that reach every path of the blocked kernel: examples longer
    /// than one block of rows and one tile of keys, lengths that are not
    /// multiples of either, a 1-token example, and a head size (20) with a
    /// full tile and a remainder.
    #[test]
    fn blocked_kernel_matches_the_oracles_at_larger_sizes() {
        let dims = AttentionDims {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 20,
        };
        let cu: [u32; 5] = [0, 37, 38, 58, 74];
        let t = 74;
        let (q, k, v) = (
            values(t * dims.q_row(), 11),
            values(t * dims.kv_row(), 12),
            values(t * dims.kv_row(), 13),
        );
        let d_out = values(t * dims.q_row(), 14);
        let scale = 0.3;
        let fast = forward(qkv(&q, &k, &v), &cu, dims, scale);
        let slow = oracle(&q, &k, &v, &cu, dims, scale);
        for (a, b) in fast.out.iter().zip(&slow) {
            assert!((f64::from(*a) - b).abs() < 1e-5, "out: {a} vs {b}");
        }
        let grads = backward(
            qkv(&q, &k, &v),
            &fast.out,
            &fast.lse,
            &d_out,
            &cu,
            dims,
            scale,
        );
        let expected = gradient_oracle([&q, &k, &v], &d_out, &cu, dims, f64::from(scale));
        for (name, got, want) in [
            ("dq", &grads.dq, &expected[0]),
            ("dk", &grads.dk, &expected[1]),
            ("dv", &grads.dv, &expected[2]),
        ] {
            assert_eq!(got.len(), want.len());
            for (index, (a, b)) in got.iter().zip(want).enumerate() {
                // f32 sums of up to 37 keys x 3 heads of O(1) terms.
                assert!(
                    (f64::from(*a) - b).abs() < 1e-4 * (1.0 + b.abs()),
                    "{name}[{index}]: {a} vs {b}"
                );
            }
        }
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
