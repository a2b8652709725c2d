//! The portable body of the bf16 products, and their oracle: the bf16
//! operands widened to f32 (exactly) and multiplied by the f32 gemm.
//!
//! Its buffers are written once, never zeroed first: in a `--bf16` profile
//! on an Intel Xeon the zeroing (`memset`) of the widened blocks and of the
//! outputs took as many samples as the widening itself (528 and 665 of
//! 13,641). An operand already holding bf16 values in f32
//! ([`View16::rounded`]) is read where it lies, not copied. A few rows
//! times a weight (every layer's `x W^T` and `dy W` on short batches)
//! widen the weight a block at a time into a buffer that stays in the
//! core's cache ([`CACHED_ROWS`]), so that its values cross memory once,
//! as in the f32 product. The one `unsafe` here sets a buffer's length
//! after every value was written.
#![allow(unsafe_code)]

use rayon::prelude::*;

use super::operand::{Element, Values, View16, with_values};
use crate::kernels::bf16::{PARALLEL_VALUES, slice_is_rounded, unrounded_bits};
use crate::kernels::gemm::{self, View, Write};
use crate::kernels::simd::dispatch;

/// The widened body widens B in column blocks of at most this many values,
/// so that a vocabulary-sized weight is never widened whole.
const WIDENED_B_VALUES: usize = 1 << 22;
/// ... and K in blocks of at most this many, so that a vocabulary-sized
/// inner dimension (the head's `dy W`) still leaves wide column blocks.
const WIDENED_K: usize = 4096;

/// Products of at most this many rows take the in-cache path, whether B
/// lies column-major (a weight read transposed: every layer's `x W^T`) or
/// row-major (`dy W`, the weight read as it lies; and `dy^T x` with at
/// most this many output rows). There the weight's traffic is a large
/// part of the product's: widened whole into a buffer in memory, each
/// value was read, written and read again from memory; widened a block at
/// a time into a buffer that stays in the core's cache, it is read from
/// memory once, as the f32 product reads it. Above it, each task's
/// repacking of A for its block costs more than that saves.
///
/// Measured on a 2-core Xeon (AVX-512), SmolLM2-135M's seven products of
/// 30 layers, against the whole-weight path and f32 in the same runs:
/// - `x W^T`: 248 rows 177 ms against 230 (f32 210); 512 rows 320
///   against 356 (f32 337-348); 768 rows 599-600 against 617-671 (f32
///   603-608); 1,024 rows 752-801 against 778-827 (f32 767-806); 1,360
///   rows 1,044-1,098 against 1,058-1,088 (f32 1,017-1,115), 1,536 and
///   2,870 rows slower in cache (1.04-1.12x f32 against 0.97-1.03x);
///   `medium`'s shapes (512 wide, MLP 1,408) at 640-1,024 rows
///   0.99-1.07x f32 in cache against 0.99-1.08x, its 32k-row head at 524
///   rows 223-226 ms against 231-241 (f32 204-218);
/// - `dy W`: 0.99-1.07x f32's time at 248-512 rows against 1.10-1.18x
///   whole, 1.01-1.03x against 0.99-1.09x at 1,024 (at 2,870 rows both
///   1.00-1.02x); `dy^T x` as before (0.94-1.00x against 0.94-1.03x).
const CACHED_ROWS: usize = 1024;
/// `x W^T`'s column blocks: about this many values (256 KiB: a block and
/// A's rows stay in a core's L2 cache); 32K, 128K and more ran slower.
const CACHED_B_VALUES: usize = 1 << 16;

/// `dy W`'s blocks: few and wide, since each task packs A again for its
/// block (the `x W^T` path's blocks gained nothing here, and 160 columns
/// or 64K values lost): about this many columns (SmolLM2's 576: two blocks;
/// 1,536: six) ...
const CACHED_ROW_MAJOR_COLS: usize = 288;
/// ... widened this many values at a time (512 KiB: in a 2 MiB L2).
const CACHED_ROW_MAJOR_VALUES: usize = 1 << 17;

/// Whether `a b` takes the in-cache path (by shapes and layout only, so
/// that a product's sums run in one order whatever its values).
fn in_cache_path(a: View16<'_>, b: View16<'_>) -> bool {
    a.cols > 0 && a.rows <= CACHED_ROWS && (b.col_stride == 1 || b.row_stride == 1)
}

/// The in-cache path: A widened whole (read where it lies when it holds
/// bf16 values), then B's columns in blocks on rayon's threads, each
/// block's K rows widened a slice at a time into its thread's buffer and
/// multiplied on that thread into its block of `dst`. A block's columns
/// depend on the shapes only, so the sums do not depend on the threads.
fn widened_in_cache(
    dst: &mut [f32],
    row_stride: usize,
    a: View16<'_>,
    b: View16<'_>,
    write: Write,
) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let a_block = widen_block(a, (0, m), (0, k));
    let a_view = a_block.view();
    let (cols, kc) = cached_blocks(n, k, b.col_stride == 1);
    gemm::column_blocks(dst, row_stride, (m, n), cols, write, |block| {
        in_cache(block, a_view, b, kc);
    });
}

/// The in-cache path into a fresh row-major `[M, N]` buffer (never zeroed).
fn widened_in_cache_new(a: View16<'_>, b: View16<'_>) -> Vec<f32> {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let a_block = widen_block(a, (0, m), (0, k));
    let a_view = a_block.view();
    let (cols, kc) = cached_blocks(n, k, b.col_stride == 1);
    gemm::fresh_column_blocks((m, n), cols, |block| in_cache(block, a_view, b, kc))
}

/// The in-cache path's blocks: B's columns a task (a multiple of 16), and
/// its K rows a slice.
fn cached_blocks(n: usize, k: usize, b_row_major: bool) -> (usize, usize) {
    if b_row_major {
        let cols = n
            .div_ceil(n.div_ceil(CACHED_ROW_MAJOR_COLS).max(1))
            .next_multiple_of(16)
            .max(16);
        return (cols, (CACHED_ROW_MAJOR_VALUES / cols).clamp(1, k.max(1)));
    }
    let kc = k.clamp(1, WIDENED_K);
    let cols = (CACHED_B_VALUES / kc)
        .next_multiple_of(16)
        .clamp(16, n.next_multiple_of(16).max(16));
    (cols, kc)
}

thread_local! {
    /// Each thread's buffer for its widened column blocks, reused.
    static CACHED_BLOCK: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// One column block of the in-cache path: B's block widened `kc` rows at
/// a time into this thread's buffer, each slice multiplied on this thread.
fn in_cache(block: &gemm::ColumnBlock, a: View<'_>, b: View16<'_>, kc: usize) {
    let (col0, cols) = block.columns();
    let k = a.cols();
    let mut buffer = CACHED_BLOCK.take();
    for k0 in (0..k).step_by(kc) {
        let rows = kc.min(k - k0);
        let b_block = widen_block_into(b, (k0, rows), (col0, cols), buffer, false);
        block.product(a.columns(k0, rows), b_block.view(), k0 > 0);
        buffer = b_block.into_buffer();
    }
    CACHED_BLOCK.set(buffer);
}

/// Column blocks of B: at most [`WIDENED_B_VALUES`] values in a `kb`-row block.
fn column_block(kb: usize, n: usize) -> usize {
    (WIDENED_B_VALUES / kb).clamp(64, n.max(64))
}

/// `a b` in a fresh row-major `[M, N]` buffer, written once where B's
/// columns fit one block (the first K block's product makes the buffer,
/// the others add to it); zeroed first and then set otherwise.
pub(super) fn widened_new(a: View16<'_>, b: View16<'_>) -> Vec<f32> {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let kb = k.min(WIDENED_K);
    if in_cache_path(a, b) {
        return widened_in_cache_new(a, b);
    }
    if k == 0 || column_block(kb, n) < n {
        let mut out = vec![0.0; m * n];
        widened(&mut out, n, a, b, Write::Set);
        return out;
    }
    // K block `k0` of both operands.
    let blocks = |k0: usize| {
        let kc = kb.min(k - k0);
        (
            widen_block(a, (0, m), (k0, kc)),
            widen_block(b, (k0, kc), (0, n)),
        )
    };
    let (a0, b0) = blocks(0);
    let mut out = gemm::product(a0.view(), b0.view());
    for k0 in (kb..k).step_by(kb) {
        let (a_block, b_block) = blocks(k0);
        gemm::product_into(&mut out, n, a_block.view(), b_block.view(), Write::Add(1.0));
    }
    out
}

/// The portable body: blocks of K and of B's columns widened (A's K block
/// once for all column blocks), each product by the f32 gemm; the
/// in-cache path for few rows of A ([`in_cache_path`]).
pub(super) fn widened(
    dst: &mut [f32],
    row_stride: usize,
    a: View16<'_>,
    b: View16<'_>,
    write: Write,
) {
    if in_cache_path(a, b) {
        widened_in_cache(dst, row_stride, a, b, write);
    } else {
        widened_whole(dst, row_stride, a, b, write);
    }
}

/// The path for many rows of A: B widened in large
/// blocks (the whole weight of a layer), each product by the f32 gemm on
/// all threads.
fn widened_whole(dst: &mut [f32], row_stride: usize, a: View16<'_>, b: View16<'_>, write: Write) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let kb = k.min(WIDENED_K);
    let nb = column_block(kb, n);
    for k0 in (0..k).step_by(kb) {
        let kc = kb.min(k - k0);
        let write = match write {
            Write::Set if k0 > 0 => Write::Add(1.0),
            other => other,
        };
        let a_block = widen_block(a, (0, m), (k0, kc));
        let a_view = a_block.view();
        for j0 in (0..n).step_by(nb) {
            let cols = nb.min(n - j0);
            let b_block = widen_block(b, (k0, kc), (j0, cols));
            let b_view = b_block.view();
            gemm::product_into(&mut dst[j0..], row_stride, a_view, b_view, write);
        }
    }
}

/// A block of an operand as f32: widened into a buffer stored row-major
/// or column-major as the view lies in memory (so that it is read in
/// order), or the operand's own values where they are bf16 already.
enum Block<'a> {
    Widened {
        values: Vec<f32>,
        rows: usize,
        cols: usize,
        row_major: bool,
    },
    /// The values where they lie, and the buffer lent for widening them,
    /// unused, for the next block (an in-cache task's buffer outlives a
    /// product whose B needs no widening: `dy^T x`'s rounded `x`).
    Borrowed(View<'a>, Vec<f32>),
}

impl Block<'_> {
    /// The buffer a widened block holds, for the next block.
    fn into_buffer(self) -> Vec<f32> {
        match self {
            Self::Widened { values, .. } => values,
            Self::Borrowed(_, buffer) => buffer,
        }
    }

    fn view(&self) -> View<'_> {
        match self {
            Self::Widened {
                values,
                rows,
                cols,
                row_major: true,
            } => View::row_major(values, *rows, *cols),
            Self::Widened {
                values, rows, cols, ..
            } => View::row_major(values, *cols, *rows).t(),
            Self::Borrowed(view, _) => *view,
        }
    }
}

/// Rows `row0..row0 + rows` and columns `col0..col0 + cols` of `view`,
/// widened to f32.
fn widen_block<'a>(
    view: View16<'a>,
    (row0, rows): (usize, usize),
    (col0, cols): (usize, usize),
) -> Block<'a> {
    widen_block_into(view, (row0, rows), (col0, cols), Vec::new(), true)
}

/// [`widen_block`] into `buffer`'s room (its values dropped), on rayon's
/// threads when `parallel` and the block is large.
fn widen_block_into<'a>(
    view: View16<'a>,
    (row0, rows): (usize, usize),
    (col0, cols): (usize, usize),
    mut values: Vec<f32>,
    parallel: bool,
) -> Block<'a> {
    if let Values::Rounded(v) = view.values {
        let from = row0 * view.row_stride + col0 * view.col_stride;
        return Block::Borrowed(
            View::strided(
                &v[from.min(v.len())..],
                (rows, view.row_stride),
                (cols, view.col_stride),
            ),
            values,
        );
    }
    let row_major = view.col_stride == 1 || view.row_stride != 1;
    let len = rows * cols;
    // Each output line is one line of the view: contiguous on the layouts
    // the kernels use, strided otherwise.
    let (line_len, line_stride, step) = if row_major {
        (cols, view.row_stride, view.col_stride)
    } else {
        (rows, view.col_stride, view.row_stride)
    };
    let first = |line: usize| {
        if row_major {
            (row0 + line) * line_stride + col0 * step
        } else {
            (col0 + line) * line_stride + row0 * step
        }
    };
    if let Values::F32(v) = view.values
        && all_rounded(v, (len / line_len.max(1), line_len), first, step, parallel)
    {
        return Block::Borrowed(
            View::strided(
                &v[first(0).min(v.len())..],
                (rows, view.row_stride),
                (cols, view.col_stride),
            ),
            values,
        );
    }
    values.clear();
    values.reserve(len);
    let spare = &mut values.spare_capacity_mut()[..len];
    with_values!(view.values, v => {
        let body = |(line, out): (usize, &mut [std::mem::MaybeUninit<f32>])| {
            let from = first(line);
            if step == 1 {
                let line = &v[from..from + line_len];
                // Compiled for the CPU's vectors: at the baseline's SSE2
                // the in-cache path's widening was the bound (a layer's
                // `x W^T` products 188 -> 177 ms, its `dy W` 221 -> 214).
                dispatch(#[inline(always)] || {
                    for (o, &x) in out.iter_mut().zip(line) {
                        o.write(x.widened());
                    }
                });
            } else {
                for (i, o) in out.iter_mut().enumerate() {
                    o.write(v[from + i * step].widened());
                }
            }
        };
        if parallel && len >= PARALLEL_VALUES {
            spare.par_chunks_mut(line_len.max(1)).enumerate().for_each(body);
        } else {
            spare.chunks_mut(line_len.max(1)).enumerate().for_each(body);
        }
    });
    // SAFETY: the lines above cover the `len` values (`len / line_len`
    // lines of `line_len`, each value written once), and each line reads
    // within the view, whose bounds the caller checked (a panic there
    // leaves the length at 0).
    unsafe { values.set_len(len) };
    Block::Widened {
        values,
        rows,
        cols,
        row_major,
    }
}

/// Whether every value of the block's `lines` lines is a bf16 value
/// already (an output autocast rounds: SwiGLU's, attention's, a norm's
/// under `--bf16`), so that it can be read where it lies. Stops at the
/// first 64 values holding one that is not: on unrounded data, the first.
/// On rayon's threads when `parallel` and the block is large: at 2,870
/// rows this scan of `x`, on one thread, made SmolLM2-135M's `x W^T`
/// products 10-22% slower than f32's (0-7% without it).
fn all_rounded(
    v: &[f32],
    (lines, line_len): (usize, usize),
    first: impl Fn(usize) -> usize + Sync,
    step: usize,
    parallel: bool,
) -> bool {
    // A function, not a closure, so that it can be `#[inline(always)]`:
    // inlined into the dispatched bodies below, compiled for their SIMD.
    #[inline(always)]
    fn line_is_rounded(v: &[f32], from: usize, (line_len, step): (usize, usize)) -> bool {
        if step == 1 {
            slice_is_rounded(&v[from..from + line_len])
        } else {
            (0..line_len).all(|i| unrounded_bits(v[from + i * step]) == 0)
        }
    }
    if parallel && lines * line_len >= PARALLEL_VALUES {
        (0..lines)
            .into_par_iter()
            .with_min_len((PARALLEL_VALUES / 4).div_ceil(line_len.max(1)))
            .all(|i| {
                dispatch(
                    #[inline(always)]
                    || line_is_rounded(v, first(i), (line_len, step)),
                )
            })
    } else {
        dispatch(
            #[inline(always)]
            || (0..lines).all(|i| line_is_rounded(v, first(i), (line_len, step))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{CACHED_BLOCK, CACHED_ROWS, in_cache_path, widened, widened_new, widened_whole};
    use crate::kernels::bf16::{round_slice, rounded};
    use crate::kernels::gemm::Write;
    use crate::kernels::gemm_bf16::View16;
    use crate::kernels::test_util::{assert_within, random};

    /// The in-cache path is taken by shape and layout only, whatever the
    /// values: up to 1,024 rows of A with a column-major B (`x W^T`) or a
    /// row-major one (`dy W`), never with a B strided both ways.
    #[test]
    fn the_in_cache_path_is_chosen_by_rows_and_layout() {
        let w = round_slice(&random(8 * 6, 1));
        let x = random((CACHED_ROWS + 1) * 8, 2);
        let b = View16::bf16(&w, 6, 8).t();
        let a = |rows| View16::f32(&x[..rows * 8], rows, 8);
        assert!(in_cache_path(a(1), b));
        assert!(in_cache_path(a(CACHED_ROWS), b));
        assert!(!in_cache_path(a(CACHED_ROWS + 1), b));
        // `dy W`: B row-major, up to the same row count.
        let dy = random((CACHED_ROWS + 1) * 6, 3);
        let dy_w = |rows| {
            in_cache_path(
                View16::f32(&dy[..rows * 6], rows, 6),
                View16::bf16(&w, 6, 8),
            )
        };
        assert!(dy_w(1));
        assert!(dy_w(CACHED_ROWS));
        assert!(!dy_w(CACHED_ROWS + 1));
        // B strided both ways: never.
        let strided = View16 {
            row_stride: 2,
            col_stride: 16,
            ..View16::bf16(&w, 8, 3)
        };
        assert!(!in_cache_path(a(1), strided));
        // Values already bf16 (read in place) take the same path.
        let xr: Vec<f32> = x[..6 * 8].iter().map(|&v| rounded(v)).collect();
        assert!(in_cache_path(View16::rounded(&xr, 6, 8), b));
        assert!(in_cache_path(a(6), View16::bf16(&w, 6, 8).t()));
    }

    /// The in-cache path against the whole-weight path it replaces for
    /// `x W^T` and `dy W` at few rows: the same bf16 values, f32 products
    /// by the same gemm in other blocks, so within 2e-6 of the largest
    /// value. Column blocks that do not divide B's columns, several K
    /// slices (K > 4096 for `x W^T`, K over 128K values a block for
    /// `dy W`), one row, the most rows each takes; every write mode into
    /// a wider destination (the columns beyond untouched), and into a
    /// fresh buffer, which is the product set into a buffer bit for bit.
    /// Its blocks depend on the shapes only: one thread or three give the
    /// same bits.
    #[test]
    fn the_in_cache_path_matches_the_whole_path_whatever_the_threads() {
        for (m, k, n, b_row_major) in [
            (1, 3, 1, false),
            (1, 700, 300, false),
            (CACHED_ROWS, 576, 200, false),
            (7, 4100, 130, false),
            (33, 1536, 49, false),
            (1, 3, 1, true),
            (5, 1100, 300, true),
            (CACHED_ROWS, 192, 600, true),
            (40, 576, 20, true),
        ] {
            let x = random(m * k, 11);
            let w = random(n * k, 12);
            let a = View16::f32(&x, m, k);
            let b = if b_row_major {
                View16::f32(&w, k, n)
            } else {
                View16::f32(&w, n, k).t()
            };
            assert!(in_cache_path(a, b));
            let stride = n + 3;
            for write in [Write::Set, Write::Add(-0.5)] {
                let run = |cached: bool| {
                    let mut dst = vec![0.25f32; m * stride];
                    if cached {
                        widened(&mut dst, stride, a, b, write);
                    } else {
                        widened_whole(&mut dst, stride, a, b, write);
                    }
                    dst
                };
                let (cached, whole) = (run(true), run(false));
                assert_within(&format!("[{m},{k},{n}] {write:?}"), &cached, &whole, 2e-6);
                for i in 0..m {
                    assert_eq!(&cached[i * stride + n..(i + 1) * stride], &[0.25; 3]);
                }
                for threads in [1, 3] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .expect("a pool");
                    assert_eq!(
                        pool.install(|| run(true)),
                        cached,
                        "[{m},{k},{n}] {threads} threads"
                    );
                }
            }
            let mut set = vec![f32::NAN; m * n];
            widened(&mut set, n, a, b, Write::Set);
            assert_eq!(widened_new(a, b), set, "fresh [{m},{k},{n}]");
        }
    }

    /// A thread's in-cache buffer outlives a product whose B needs no
    /// widening (read where it lies): `dy^T x` with a rounded `x` comes
    /// between a layer's `dy W` products, and dropping the buffer there
    /// would allocate it again in the next one.
    #[test]
    fn the_in_cache_buffer_outlives_a_product_that_widens_nothing() {
        let (m, k, n) = (8, 300, 200);
        let a = random(m * k, 21);
        let w = random(k * n, 22);
        let w_rounded: Vec<f32> = w.iter().map(|&v| rounded(v)).collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a pool");
        let capacity = |b: View16<'_>| {
            pool.install(|| {
                let a = View16::f32(&a, m, k);
                assert!(in_cache_path(a, b));
                widened_new(a, b);
                CACHED_BLOCK.with(|cell| {
                    let buffer = cell.take();
                    let capacity = buffer.capacity();
                    cell.set(buffer);
                    capacity
                })
            })
        };
        let widening = capacity(View16::f32(&w, k, n));
        assert!(widening >= k * 16, "the buffer after widening: {widening}");
        assert_eq!(capacity(View16::rounded(&w_rounded, k, n)), widening);
    }
}
