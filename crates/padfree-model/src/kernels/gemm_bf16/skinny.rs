//! The three products of the LM head when few rows carry a label (a short
//! batch of chat examples: ~17 of ~170 tokens on `medium` at batch 4),
//! streaming the `[V, C]` weight instead of packing it.
//!
//! With `K` labelled rows the head's products are `x W^T` (`[K, C]` by
//! `[C, V]`), `dz W` and `dz^T x`, each `2 K V C` FLOPs but each touching
//! all `V C` weights. The packed bodies pack the whole weight twice a step
//! (`W^T` and `W`: read, write, zero) and the AMX tiles compute 16 rows
//! however few there are, so at `K` = 17 the head took as long in `--bf16`
//! as in f32 (44-49 ms a step on `medium`, scratch timing, Xeon model
//! 207). Here each product reads the weight once, row by row, widening
//! each row (`Element::widened`: the bf16 copy, or the f32 weight rounded)
//! into a buffer the size of one row block, and writes `dW` once, never
//! zeroed first.
//!
//! The values are those of the other bodies: f32 products of bf16 values
//! (exact) added in f32. Only the order of the additions differs, and it
//! is fixed (sixteen lanes along `C`, then the lanes in one tree; `V` in
//! blocks of [`ROWS_PER_PARTIAL`], the blocks' partial sums added in
//! order; `K` in order), so the bits do not depend on the thread count or
//! the instruction set. The widened body is the oracle (tests below).
//!
//! Where a packed body multiplies (AMX's tiles, [`Tiles::Amx`], or
//! `vdpbf16ps`, [`Tiles::Avx512Bf16`]) the three products run on it
//! instead, with the operands arranged so that the work spreads over the
//! threads and no head-sized pack is made: `x W^T` as `(W x^T)^T`, the
//! weight `A` (its row blocks packed into L2 as the threads reach them);
//! `dz W` a block of the
//! weight's columns a thread; `dz^T x` as the packed path makes it. Each
//! value sums the same pairs in the same order as the packed path's
//! product, so the head's bits are the packed path's whatever its rows
//! (tested). On AMX the three products took 14.1-17.0 ms a step on
//! `medium` short chat at batch 4 (the f32 FMAs here: 19.2-23.5) and
//! 26-30 on SmolLM2-135M (38.6-44.4), timed in the step
//! (docs/benchmarks/2026-12-06-bf16-norm-and-head-tiles.md); on
//! `vdpbf16ps` see [`AVX512_BF16_ROWS`].
//!
//! The `unsafe` blocks are [`fresh_in`] for `dW` and [`fresh`] for the
//! tiles' `x W^T` turned round, every value of each written.
//!
//! # Shapes
//! `x` `[K, C]`, `dz` `[K, V]` (both bf16 values kept as f32), the weight
//! `[V, C]` row-major.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::Body;
use super::operand::{Element, Values, View16, with_values};
use crate::kernels::fresh::{fresh, fresh_in};
use crate::kernels::simd::dispatch;

/// At most this many rows take the FMA products ([`Tiles::No`]; AMX:
/// [`AMX_ROWS`]). On the AMX Xeon, SmolLM2's
/// short chat batches of 8 (about 32 labelled rows) ran at 471 / 433
/// real tokens/s with 32 here and 421 / 388 with 64: from 33 rows on, the
/// packed body's tiles pay for its packs.
pub(crate) const ROWS: usize = 32;

/// Weight rows a task takes (and widens, in the two products that read
/// the weight): rows of `x W^T` and of `dz^T x`, sub-blocks of `dz W`.
const ROWS_PER_TASK: usize = 64;

/// Weight rows whose `dz W` terms one partial sum holds; the partials are
/// added in block order.
const ROWS_PER_PARTIAL: usize = 512;

/// At most this many rows take these products on AMX ([`Tiles::Amx`]),
/// whose bits are the packed path's anyway. Measured at short chat's
/// batches of 8 and 16 (about 42 and 80 labelled rows), in turn with 32
/// here: 6 of 8 runs faster (SmolLM2-135M batch 8 329-373 -> 371-384
/// real tokens/s), the same losses, and peaks 37-50 MiB lower on
/// SmolLM2-135M (no head-sized pack). Batches of hundreds of rows (the
/// maths data) keep the packed path, where the weight's pack is shared
/// by their chunks.
pub(crate) const AMX_ROWS: usize = 128;

/// At most this many rows take these products on `vdpbf16ps`
/// ([`Tiles::Avx512Bf16`]), whose bits are the packed path's too. The
/// head's loss and both gradients, best of 7 in process on AMD Zen 5
/// (family 26, model 2), these products against the chunked packed path:
/// `medium` (`C` 512, `V` 32000) 21.2 against 29.8 ms at 32 rows, 41.8
/// against 53.6 at 128, 49.8 against 58.2 at 192, 70.3 against 64.8 at
/// 256; SmolLM2-135M (`C` 576, `V` 49152) 38.7 / 62.2 at 32, 114 / 146 at
/// 192, 174 / 175 at 256. The FMAs took 46.9 ms (`medium`) and 91.0
/// (SmolLM2-135M) for the three products alone at 32 rows.
pub(crate) const AVX512_BF16_ROWS: usize = 192;

/// The most rows these products take in this process: [`AMX_ROWS`] on
/// AMX, [`AVX512_BF16_ROWS`] on `vdpbf16ps`, [`ROWS`] elsewhere.
pub(crate) fn rows_taken() -> usize {
    match Tiles::of_this_process() {
        Tiles::Amx => AMX_ROWS,
        Tiles::Avx512Bf16 => AVX512_BF16_ROWS,
        Tiles::No => ROWS,
    }
}

/// Columns of the packed bodies' micro-tiles (AMX's and `vdpbf16ps`'s
/// alike): blocks of `dz W`'s columns are whole panels of them.
const PANEL: usize = 32;
const _: () = assert!(PANEL == super::packed::NR);

/// Lanes of the dot products along `C`.
const LANES: usize = 16;

/// Whether `rows` labelled rows against `weight` take these products: a
/// few rows, and a weight whose rows lie contiguous.
pub(crate) fn fits(rows: usize, weight: View16<'_>) -> bool {
    (1..=rows_taken()).contains(&rows)
        && weight.cols > 0
        && weight.col_stride == 1
        && weight.row_stride >= weight.cols
}

/// Weight rows `first..first + count` widened to f32, row after row.
fn widen_rows(weight: View16<'_>, first: usize, count: usize, out: &mut Vec<f32>) {
    let cols = weight.cols;
    out.clear();
    with_values!(weight.values, v => {
        dispatch(
            #[inline(always)]
            || {
                for row in first..first + count {
                    let from = row * weight.row_stride;
                    out.extend(v[from..from + cols].iter().map(|x| x.widened()));
                }
            },
        );
    });
}

/// `sum a[i] b[i]`: element `i` into lane `i % 16`, the lanes added in one
/// fixed tree.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (a_tail, b_tail) = (a_chunks.remainder(), b_chunks.remainder());
    for (x, y) in a_chunks.zip(b_chunks) {
        for i in 0..LANES {
            lanes[i] = x[i].mul_add(y[i], lanes[i]);
        }
    }
    for (i, (x, y)) in a_tail.iter().zip(b_tail).enumerate() {
        lanes[i] = x.mul_add(*y, lanes[i]);
    }
    reduce(lanes)
}

/// Four [`dot`]s of `w` against four rows at once (one load of `w` for
/// four products), each the same bits as its own [`dot`]. Four named lane
/// arrays: a loop over an array of them kept the lanes in memory, one
/// scalar FMA at a time (seen in the disassembly).
#[inline(always)]
fn dot4(w: &[f32], [x0, x1, x2, x3]: [&[f32]; 4]) -> [f32; 4] {
    let (mut l0, mut l1, mut l2, mut l3) =
        ([0.0f32; LANES], [0.0; LANES], [0.0; LANES], [0.0; LANES]);
    let chunks = w
        .chunks_exact(LANES)
        .zip(x0.chunks_exact(LANES))
        .zip(x1.chunks_exact(LANES))
        .zip(x2.chunks_exact(LANES))
        .zip(x3.chunks_exact(LANES));
    for ((((wc, a0), a1), a2), a3) in chunks {
        for i in 0..LANES {
            l0[i] = a0[i].mul_add(wc[i], l0[i]);
            l1[i] = a1[i].mul_add(wc[i], l1[i]);
            l2[i] = a2[i].mul_add(wc[i], l2[i]);
            l3[i] = a3[i].mul_add(wc[i], l3[i]);
        }
    }
    let full = w.len() / LANES * LANES;
    for (i, &wv) in w[full..].iter().enumerate() {
        l0[i] = x0[full + i].mul_add(wv, l0[i]);
        l1[i] = x1[full + i].mul_add(wv, l1[i]);
        l2[i] = x2[full + i].mul_add(wv, l2[i]);
        l3[i] = x3[full + i].mul_add(wv, l3[i]);
    }
    [reduce(l0), reduce(l1), reduce(l2), reduce(l3)]
}

/// Columns a register-held accumulator covers (four AVX-512 registers).
const COLS: usize = 64;

/// `f(c0, width, out[c0..c0 + width])` for each block of [`COLS`]
/// columns of a row, the last one narrower.
#[inline(always)]
fn for_blocks<T>(row: &mut [T], mut f: impl FnMut(usize, usize, &mut [T])) {
    for (block, out) in row.chunks_mut(COLS).enumerate() {
        f(block * COLS, out.len(), out);
    }
}

/// `sum[c] = a x[c] + sum[c]` (fused) for the `x.len()` first columns:
/// a whole block's loop has a known length, so the sums stay in registers.
#[inline(always)]
fn axpy(sum: &mut [f32; COLS], a: f32, x: &[f32]) {
    if let Ok(x) = <&[f32; COLS]>::try_from(x) {
        for c in 0..COLS {
            sum[c] = a.mul_add(x[c], sum[c]);
        }
    } else {
        for (s, &v) in sum.iter_mut().zip(x) {
            *s = a.mul_add(v, *s);
        }
    }
}

#[inline(always)]
fn reduce(mut lanes: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// Whether the head's products run on a packed body ([`Tiles::Amx`],
/// [`Tiles::Avx512Bf16`]), or stream the weight through f32 FMAs
/// ([`Tiles::No`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tiles {
    /// The AMX body's products, operands arranged for few rows.
    Amx,
    /// The `vdpbf16ps` body's products, operands arranged as for AMX.
    Avx512Bf16,
    /// The f32 FMAs of this file, on every CPU.
    No,
}

impl Tiles {
    /// The packed body of the process's choice where there is one
    /// (`gemm_bf16::body`), the FMAs where it multiplies widened values.
    pub(crate) fn of_this_process() -> Self {
        match super::body() {
            Body::Amx => Self::Amx,
            Body::Avx512Bf16 => Self::Avx512Bf16,
            Body::Widened => Self::No,
        }
    }

    /// The packed body these products run on, if any.
    fn packed(self) -> Option<Body> {
        match self {
            Self::Amx => Some(Body::Amx),
            Self::Avx512Bf16 => Some(Body::Avx512Bf16),
            Self::No => None,
        }
    }
}

/// `t` (`[rows, cols]`, row-major) turned round: `[cols, rows]`, into a
/// buffer never zeroed first (`[V, K]`: 7.9 MB for SmolLM2-135M's 40
/// labelled rows).
fn turned(t: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(t.len(), rows * cols, "bf16 skinny turn: [{rows}, {cols}]");
    let write = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(rows.max(1))
            .enumerate()
            .for_each(|(j, column)| {
                for (i, o) in column.iter_mut().enumerate() {
                    o.write(t[i * cols + j]);
                }
            });
    };
    // SAFETY: the `cols` chunks of `rows` values cover all `rows * cols`,
    // and each value of a chunk is written.
    unsafe { fresh(t.len(), write) }
}

/// `x W^T`: `[K, V]`, row-major.
///
/// On a packed body ([`Tiles::Amx`], [`Tiles::Avx512Bf16`]) it is
/// `(W x^T)^T`: the weight is `A`, whose row blocks the threads pack into
/// L2 as they go (`x` packed once as `B`, one panel of 32 columns), where `x` as `A` is one row block for
/// one thread and the weight a head-sized `B` pack. Each value sums the
/// same pairs in the same tile order as the packed body's `x W^T`, so it
/// is that product's bits.
///
/// # Panics
/// When `x` is not `[K, C]` for the weight's `C`, or `K` is 0 (callers
/// ask [`fits`] first).
pub(crate) fn x_wt(x: &[f32], weight: View16<'_>, tiles: Tiles) -> Vec<f32> {
    let (vocab, cols) = (weight.rows, weight.cols);
    let k = x.len() / cols.max(1);
    assert!(
        k > 0 && x.len() == k * cols,
        "bf16 skinny product: x holds {} values for width {cols}",
        x.len()
    );
    if let Some(body) = tiles.packed() {
        let zt = super::product_with(body, weight, View16::f32(x, k, cols).t());
        return turned(&zt, vocab, k);
    }
    // `[V, K]` first (a task owns whole rows of it), then turned round.
    let mut zt = vec![0.0f32; vocab * k];
    zt.par_chunks_mut(ROWS_PER_TASK * k)
        .enumerate()
        .for_each(|(block, out)| {
            let first = block * ROWS_PER_TASK;
            let count = out.len() / k;
            let mut w = Vec::with_capacity(count * cols);
            widen_rows(weight, first, count, &mut w);
            dispatch(
                #[inline(always)]
                || {
                    for (row, z) in w.chunks_exact(cols).zip(out.chunks_exact_mut(k)) {
                        let mut groups = x.chunks_exact(4 * cols);
                        let mut at = 0;
                        for group in &mut groups {
                            let rows = [0, 1, 2, 3].map(|i| &group[i * cols..(i + 1) * cols]);
                            z[at..at + 4].copy_from_slice(&dot4(row, rows));
                            at += 4;
                        }
                        for xr in groups.remainder().chunks_exact(cols) {
                            z[at] = dot(xr, row);
                            at += 1;
                        }
                    }
                },
            );
        });
    let mut z = vec![0.0f32; k * vocab];
    z.par_chunks_mut(vocab).enumerate().for_each(|(i, row)| {
        for (out, column) in row.iter_mut().zip(zt.chunks_exact(k)) {
            *out = column[i];
        }
    });
    z
}

/// `dz W`: `[K, C]`, row-major.
///
/// On a packed body it is that body's `dz W` (its bits), a block of the
/// weight's columns a thread, each packing its columns K block by K
/// block into L2: with `dz` as the one row block of `A`, the whole
/// product would run on one thread.
///
/// # Panics
/// When `dz` is not `[K, V]` for the weight's `V`, or `K` is 0.
pub(crate) fn dz_w(dz: &[f32], weight: View16<'_>, tiles: Tiles) -> Vec<f32> {
    let (vocab, cols) = (weight.rows, weight.cols);
    let k = dz.len() / vocab.max(1);
    assert!(
        k > 0 && dz.len() == k * vocab,
        "bf16 skinny product: dz holds {} values for vocabulary {vocab}",
        dz.len()
    );
    if let Some(body) = tiles.packed() {
        // One block of columns a thread (whole panels of the tiles' 32
        // columns): each task packs `A` (all of `dz`) again, and
        // SmolLM2-135M's `dz W` took 11 ms in blocks of 64 columns, 7 in
        // blocks of 288.
        let amx_cols = cols
            .div_ceil(rayon::current_num_threads())
            .next_multiple_of(PANEL);
        let blocks: Vec<(usize, Vec<f32>)> = (0..cols)
            .step_by(amx_cols)
            .map(|c0| amx_cols.min(cols - c0))
            .collect::<Vec<_>>()
            .into_par_iter()
            .enumerate()
            .map(|(b, width)| {
                let block = weight.columns(b * amx_cols, width);
                let dx = super::product_with(body, View16::f32(dz, k, vocab), block);
                (width, dx)
            })
            .collect();
        // Row by row, the blocks' pieces side by side.
        let mut dx = Vec::with_capacity(k * cols);
        for i in 0..k {
            for (width, block) in &blocks {
                dx.extend_from_slice(&block[i * width..(i + 1) * width]);
            }
        }
        return dx;
    }
    let blocks = vocab.div_ceil(ROWS_PER_PARTIAL);
    let mut partials = vec![0.0f32; blocks * k * cols];
    partials
        .par_chunks_mut(k * cols)
        .enumerate()
        .for_each(|(block, acc)| {
            let first = block * ROWS_PER_PARTIAL;
            let count = ROWS_PER_PARTIAL.min(vocab - first);
            let mut w = Vec::with_capacity(ROWS_PER_TASK * cols);
            for sub in (0..count).step_by(ROWS_PER_TASK) {
                let rows = ROWS_PER_TASK.min(count - sub);
                widen_rows(weight, first + sub, rows, &mut w);
                dispatch(
                    #[inline(always)]
                    || {
                        // Each `(row of dz, block of C)` accumulator stays
                        // in registers over the block's weight rows (the
                        // rows in order, as before): a pass per row of dz
                        // storing to memory was store-bound.
                        for (i, out) in acc.chunks_exact_mut(cols).enumerate() {
                            let dz_row = &dz[i * vocab + first + sub..][..rows];
                            for_blocks(out, |c0, width, out| {
                                let mut sum = [0.0f32; COLS];
                                sum[..width].copy_from_slice(out);
                                for (&a, row) in dz_row.iter().zip(w.chunks_exact(cols)) {
                                    axpy(&mut sum, a, &row[c0..c0 + width]);
                                }
                                out.copy_from_slice(&sum[..width]);
                            });
                        }
                    },
                );
            }
        });
    let mut dx = vec![0.0f32; k * cols];
    let len = k * cols;
    dx.par_chunks_mut(cols).enumerate().for_each(|(i, out)| {
        let from = i * cols;
        for block in partials.chunks_exact(len) {
            for (o, &p) in out.iter_mut().zip(&block[from..from + cols]) {
                *o += p;
            }
        }
    });
    dx
}

/// `dz^T x`: `[V, C]` row-major, in a fresh vector with room for at
/// least `capacity` values, so that a caller can append to it without a
/// copy. On a packed body its product (`dz^T` as `A`, `x` as `B`,
/// both packed by blocks of rows; tiles stored into `dW` in place).
///
/// # Panics
/// When `dz` is not `[K, V]` and `x` `[K, C]` for the same `K` > 0.
pub(crate) fn dzt_x(
    dz: &[f32],
    x: &[f32],
    [vocab, cols]: [usize; 2],
    capacity: usize,
    tiles: Tiles,
) -> Vec<f32> {
    let k = x.len() / cols.max(1);
    assert!(
        k > 0 && x.len() == k * cols && dz.len() == k * vocab,
        "bf16 skinny product: dz holds {} values and x {} for [{vocab}, {cols}]",
        dz.len(),
        x.len()
    );
    if let Some(body) = tiles.packed() {
        return super::product_with_buffer(
            body,
            View16::f32(dz, k, vocab).t(),
            View16::f32(x, k, cols),
            Vec::with_capacity(capacity.max(vocab * cols)),
        );
    }
    let write = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(ROWS_PER_TASK * cols)
            .enumerate()
            .for_each(|(block, out)| {
                let first = block * ROWS_PER_TASK;
                dispatch(
                    #[inline(always)]
                    || {
                        for (j, out) in out.chunks_exact_mut(cols).enumerate() {
                            let n = first + j;
                            // `K` terms a value, in order, in registers.
                            for_blocks(out, |c0, width, out| {
                                let mut sum = [0.0f32; COLS];
                                for (i, xr) in x.chunks_exact(cols).enumerate() {
                                    axpy(&mut sum, dz[i * vocab + n], &xr[c0..c0 + width]);
                                }
                                for (o, &v) in out.iter_mut().zip(&sum) {
                                    o.write(v);
                                }
                            });
                        }
                    },
                );
            });
    };
    // SAFETY: the tasks cover the `vocab * cols` values in whole rows of
    // `cols` (`chunks_exact_mut` of chunks that are whole rows), each row's
    // every value written once.
    unsafe {
        fresh_in(
            Vec::with_capacity(capacity.max(vocab * cols)),
            vocab * cols,
            write,
        )
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::kernels::bf16::{round_slice, rounded};
    use crate::kernels::gemm_bf16::{Body, product_with};

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = padfree_pack::SplitMix64::new(seed);
        (0..len).map(|_| rng.standard_normal() as f32).collect()
    }

    fn rounded_values(len: usize, seed: u64) -> Vec<f32> {
        values(len, seed).into_iter().map(rounded).collect()
    }

    /// `a b` summed in f64 from the rounded operands (`a` `[M, K]`, `b`
    /// `[K, N]`, both given by element).
    fn f64_product(
        (m, k, n): (usize, usize, usize),
        a: impl Fn(usize, usize) -> f32,
        b: impl Fn(usize, usize) -> f32,
    ) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|l| f64::from(a(i, l)) * f64::from(b(l, j)))
                    .sum();
            }
        }
        out
    }

    /// Within f32 rounding of sums of `k` terms of the values' size.
    fn assert_close(ours: &[f32], want: &[f64], k: usize, what: &str) {
        assert_eq!(ours.len(), want.len(), "{what}: length");
        let tolerance = 4.0 * (k as f64).sqrt() * f64::from(f32::EPSILON) * 4.0;
        for (i, (&o, &w)) in ours.iter().zip(want).enumerate() {
            assert!(
                (f64::from(o) - w).abs() <= tolerance * (1.0 + w.abs()),
                "{what}[{i}]: {o} against {w}"
            );
        }
    }

    /// The three products against the widened body (the oracle: f32 gemm
    /// of the same rounded values) and an f64 sum, for the weight as a
    /// bf16 copy and as f32 rounded as read; shapes with `C` not a
    /// multiple of the lanes, `V` not a multiple of the blocks, and 1, 3,
    /// 4, 5 and 32 rows (the four-row groups and their remainder).
    #[test]
    fn the_products_match_the_widened_body_and_an_f64_sum() {
        for (k, cols, vocab) in [
            (1, 40, 70),
            (3, 16, 513),
            (4, 33, 1030),
            (5, 64, 129),
            (32, 24, 700),
        ] {
            let master = values(vocab * cols, 1);
            let copy: Vec<bf16> = round_slice(&master);
            let x = rounded_values(k * cols, 2);
            let dz = rounded_values(k * vocab, 3);
            let weights = [
                ("bf16 copy", View16::bf16(&copy, vocab, cols)),
                ("f32 rounded as read", View16::f32(&master, vocab, cols)),
            ];
            for ((name, weight), tiles) in weights
                .into_iter()
                .flat_map(|w| all_tiles().map(move |t| (w, t)))
            {
                assert!(fits(k, weight));
                let what = format!("K {k}, C {cols}, V {vocab}, {name}, {tiles:?}");
                let w = |i: usize, j: usize| rounded(master[i * cols + j]);

                let z = x_wt(&x, weight, tiles);
                let want = f64_product((k, cols, vocab), |i, l| x[i * cols + l], |l, j| w(j, l));
                assert_close(&z, &want, cols, &format!("x W^T, {what}"));
                let oracle = product_with(Body::Widened, View16::rounded(&x, k, cols), weight.t());
                assert_close(
                    &z,
                    &oracle.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
                    cols,
                    &format!("x W^T against widened, {what}"),
                );

                let dx = dz_w(&dz, weight, tiles);
                let want = f64_product((k, vocab, cols), |i, l| dz[i * vocab + l], w);
                assert_close(&dx, &want, vocab, &format!("dz W, {what}"));

                let dw = dzt_x(&dz, &x, [vocab, cols], vocab * cols + 7, tiles);
                assert!(dw.capacity() >= vocab * cols + 7, "{what}: room kept");
                let want = f64_product(
                    (vocab, k, cols),
                    |j, i| dz[i * vocab + j],
                    |i, l| x[i * cols + l],
                );
                assert_close(&dw, &want, k, &format!("dz^T x, {what}"));
                let oracle = product_with(
                    Body::Widened,
                    View16::rounded(&dz, k, vocab).t(),
                    View16::rounded(&x, k, cols),
                );
                assert_close(
                    &dw,
                    &oracle.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
                    k,
                    &format!("dz^T x against widened, {what}"),
                );
            }
        }
    }

    /// The same bits on one thread and on three: every sum has a fixed
    /// order whatever the split (on a packed body the blocks of `dz W`'s
    /// columns follow the thread count).
    #[test]
    fn the_bits_do_not_depend_on_the_thread_count() {
        let (k, cols, vocab) = (7, 72, 1500);
        let master = values(vocab * cols, 4);
        let x = rounded_values(k * cols, 5);
        let dz = rounded_values(k * vocab, 6);
        let weight = View16::f32(&master, vocab, cols);
        for tiles in all_tiles() {
            let run = |threads: usize| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a thread pool")
                    .install(|| {
                        (
                            x_wt(&x, weight, tiles),
                            dz_w(&dz, weight, tiles),
                            dzt_x(&dz, &x, [vocab, cols], 0, tiles),
                        )
                    })
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let (one, three) = (run(1), run(3));
            assert_eq!(bits(&one.0), bits(&three.0), "x W^T, {tiles:?}");
            assert_eq!(bits(&one.1), bits(&three.1), "dz W, {tiles:?}");
            assert_eq!(bits(&one.2), bits(&three.2), "dz^T x, {tiles:?}");
        }
    }

    /// The tile forms this CPU runs: the FMAs everywhere, the packed
    /// bodies where they are (a NOTE says which is not, so the log shows
    /// it went untested).
    fn all_tiles() -> impl Iterator<Item = Tiles> {
        [Tiles::No].into_iter().chain(packed_tiles())
    }

    /// The packed bodies' forms this CPU runs, with a NOTE for each it
    /// cannot.
    fn packed_tiles() -> impl Iterator<Item = Tiles> {
        [
            (Tiles::Amx, Body::Amx, "AMX-BF16"),
            (Tiles::Avx512Bf16, Body::Avx512Bf16, "AVX512-BF16"),
        ]
        .into_iter()
        .filter_map(|(tiles, body, name)| {
            let here = body.available();
            if !here {
                eprintln!("NOTE: no {name} here: the head's few-row products on it not tested");
            }
            here.then_some(tiles)
        })
    }

    /// On a packed body (AMX, `vdpbf16ps`) the three products are that
    /// body's, bit for bit, with `x` and `dz` as its `A` and the weight its
    /// `B` (the head's products for more rows than [`rows_taken`]): the
    /// weight as `A` sums the same pairs in the same order. So there the
    /// head's bits do not depend on which of its paths a batch's row
    /// count takes.
    #[test]
    fn on_a_packed_body_the_products_are_its_bits() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for tiles in packed_tiles() {
            let body = tiles.packed().expect("a packed body");
            for (k, cols, vocab) in [(1, 40, 70), (21, 576, 3000), (32, 72, 1500), (5, 33, 1030)] {
                let master = values(vocab * cols, 8);
                let copy: Vec<bf16> = round_slice(&master);
                let x = rounded_values(k * cols, 9);
                let dz = rounded_values(k * vocab, 10);
                let weight = View16::bf16(&copy, vocab, cols);
                let what = format!("{tiles:?}, K {k}, C {cols}, V {vocab}");
                assert_eq!(
                    bits(&x_wt(&x, weight, tiles)),
                    bits(&product_with(body, View16::f32(&x, k, cols), weight.t())),
                    "x W^T, {what}"
                );
                assert_eq!(
                    bits(&dz_w(&dz, weight, tiles)),
                    bits(&product_with(body, View16::f32(&dz, k, vocab), weight)),
                    "dz W, {what}"
                );
                assert_eq!(
                    bits(&dzt_x(&dz, &x, [vocab, cols], 0, tiles)),
                    bits(&product_with(
                        body,
                        View16::f32(&dz, k, vocab).t(),
                        View16::f32(&x, k, cols)
                    )),
                    "dz^T x, {what}"
                );
            }
        }
    }

    /// Too many rows, none, or a weight read by columns go to the other
    /// bodies.
    #[test]
    fn only_few_rows_of_a_row_major_weight_fit() {
        let master = values(8 * 16, 7);
        let weight = View16::f32(&master, 8, 16);
        assert!(fits(1, weight) && fits(rows_taken(), weight));
        assert!(!fits(0, weight) && !fits(rows_taken() + 1, weight));
        assert!(!fits(4, View16::f32(&master, 16, 8).t()));
    }
}
