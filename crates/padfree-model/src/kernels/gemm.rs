//! Matrix products on host slices, through the `gemm` crate: the kernels
//! burn-flex's matmul calls (AVX-512, AVX2+FMA or SSE, chosen at run time;
//! the same thread split, so results depend on the thread count exactly as
//! burn's matmul does), without burn's tensor around them.
//!
//! Why not burn's matmul inside the fused kernels: burn-flex 0.22.1 makes
//! every output with `FlexTensor::empty`, which zeroes a byte vector and
//! then copies it into a 16-byte-aligned allocation (`Bytes::from_bytes_vec`)
//! before gemm overwrites it; inputs from host slices had to be copied into
//! tensors first. In a QLoRA step's `perf` profile those copies and zeroed
//! pages were 13% of the time. Here an output is written once, straight into
//! its buffer, and inputs are read where they lie, transposed by strides.
//!
//! The oracle beside it is the plain triple loop (`naive`, tests only).
//!
//! One of the two modules of the workspace that allow `unsafe` (with
//! `gemm_bf16/`): gemm's API is raw pointers and strides. Every call
//! checks its views' bounds first.
//!
//! # Shapes
//! `[M, K] x [K, N] -> [M, N]`.
#![allow(unsafe_code)]

/// Products this small run on the calling thread (burn-flex's threshold,
/// so a product splits over threads exactly when burn's would).
const PARALLEL_OPS: usize = 192 * 192 * 192;

/// A read-only matrix view: element `(i, j)` at `data[i * row_stride + j * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct View<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> View<'a> {
    /// `data` as a row-major `[rows, cols]` matrix.
    ///
    /// # Panics
    /// When `data` holds fewer than `rows * cols` values (a bug in the caller).
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(
            data.len() >= rows * cols,
            "gemm view: {} values for [{rows}, {cols}]",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// `data` as a `[rows, cols]` matrix with element `(i, j)` at
    /// `i * row_stride + j * col_stride`.
    ///
    /// # Panics
    /// When the last element lies past `data` (a bug in the caller).
    pub fn strided(
        data: &'a [f32],
        (rows, row_stride): (usize, usize),
        (cols, col_stride): (usize, usize),
    ) -> Self {
        if rows > 0 && cols > 0 {
            let last = (rows - 1) * row_stride + (cols - 1) * col_stride;
            assert!(
                last < data.len(),
                "gemm view: {} values for [{rows}, {cols}] with strides {row_stride}, {col_stride}",
                data.len()
            );
        }
        Self {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// The number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The transpose, without a copy.
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Columns `start..start + len`, without a copy.
    ///
    /// # Panics
    /// When the columns run past the view.
    pub fn columns(self, start: usize, len: usize) -> Self {
        assert!(
            start + len <= self.cols,
            "gemm view: columns {start}+{len} of {}",
            self.cols
        );
        Self {
            data: &self.data[(start * self.col_stride).min(self.data.len())..],
            cols: len,
            ..self
        }
    }
}

/// What a product does with the destination.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Write {
    /// `dst = a b`.
    Set,
    /// `dst += factor * a b`.
    Add(f32),
}

impl Write {
    /// The factor of the product: 1 for `Set`.
    fn factor(self) -> f32 {
        match self {
            Self::Set => 1.0,
            Self::Add(factor) => factor,
        }
    }
}

/// `a b` in a fresh row-major `[M, N]` buffer, written once (never zeroed first).
///
/// # Panics
/// When the inner dimensions differ (a bug in the caller).
pub(crate) fn product(a: View<'_>, b: View<'_>) -> Vec<f32> {
    let (m, n) = (a.rows, b.cols);
    if m == 0 || n == 0 || a.cols == 0 {
        check(a, b);
        return vec![0.0; m * n];
    }
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: `run` writes every one of the `m * n` values through the raw
    // pointer (no reference to the uninitialised memory is made) before
    // the length is set; `k > 0`, so gemm computes and stores each one.
    unsafe {
        run(out.as_mut_ptr(), n, a, b, Write::Set, threads_for(a, b));
        out.set_len(m * n);
    }
    out
}

/// `dst` (row-major, `row_stride` values a row, the product's `N` columns
/// from its start) set to `factor * a b`, or that added to it.
///
/// # Panics
/// When the inner dimensions differ or `dst` is too short (a bug in the caller).
pub(crate) fn product_into(
    dst: &mut [f32],
    row_stride: usize,
    a: View<'_>,
    b: View<'_>,
    write: Write,
) {
    check(a, b);
    let (m, n) = (a.rows, b.cols);
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        n <= row_stride && dst.len() >= (m - 1) * row_stride + n,
        "gemm: destination of {} values for [{m}, {n}] rows of {row_stride}",
        dst.len()
    );
    if a.cols == 0 {
        if write == Write::Set {
            for row in dst.chunks_mut(row_stride).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: the bounds were checked above; `dst` is initialised.
    unsafe { run(dst.as_mut_ptr(), row_stride, a, b, write, threads_for(a, b)) }
}

/// One task's columns of a destination split by [`column_blocks`]:
/// `cols` columns from `col0`, every row.
pub(crate) struct ColumnBlock {
    dst: SendPtr,
    row_stride: usize,
    rows: usize,
    col0: usize,
    cols: usize,
    write: Write,
    /// Whether [`Self::product`] ran (a fresh destination is whole only then).
    written: std::cell::Cell<bool>,
}

/// A destination pointer handed to rayon's threads: each block writes its
/// own columns only.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the blocks of one `column_blocks` call write disjoint columns.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl ColumnBlock {
    /// The block's first column and its number of columns.
    pub(crate) fn columns(&self) -> (usize, usize) {
        (self.col0, self.cols)
    }

    /// `a b` written into this block on the calling thread, as the
    /// split's `write` says, or added to it when `accumulate` (a later
    /// slice of the inner dimension: `Set` adds, `Add` adds its factor).
    ///
    /// # Panics
    /// When the shapes are not the block's (a bug in the caller), or when
    /// `accumulate` onto a block not yet set.
    pub(crate) fn product(&self, a: View<'_>, b: View<'_>, accumulate: bool) {
        assert!(
            !accumulate || self.written.get() || self.write != Write::Set,
            "gemm: a column block added to before it was written"
        );
        let write = match self.write {
            Write::Set if accumulate => Write::Add(1.0),
            other => other,
        };
        check(a, b);
        assert!(
            a.rows == self.rows && b.cols == self.cols && a.cols > 0,
            "gemm: [{}, {}] x [{}, {}] into a block of [{}, {}]",
            a.rows,
            a.cols,
            b.rows,
            b.cols,
            self.rows,
            self.cols
        );
        // SAFETY: `column_blocks` checked that the destination holds the
        // `[rows, col0 + cols]` values `row_stride` apart; this block's
        // columns are its own.
        unsafe {
            run(
                self.dst.0.add(self.col0),
                self.row_stride,
                a,
                b,
                write,
                gemm::Parallelism::None,
            );
        }
        self.written.set(true);
    }
}

/// `dst` (row-major `[M, N]`, `row_stride` values a row) split into
/// blocks of `block` columns (the last may be narrower), each handed to
/// `each` on rayon's threads, which writes it through
/// [`ColumnBlock::product`]. Which columns a block holds depends on the
/// shapes only, never on the thread count.
///
/// # Panics
/// When `dst` is too short, or `each` leaves a block unset under
/// `Write::Set` (bugs in the caller).
pub(crate) fn column_blocks(
    dst: &mut [f32],
    row_stride: usize,
    (m, n): (usize, usize),
    block: usize,
    write: Write,
    each: impl Fn(&ColumnBlock) + Sync,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        n <= row_stride && dst.len() >= (m - 1) * row_stride + n && block > 0,
        "gemm: destination of {} values for [{m}, {n}] rows of {row_stride}",
        dst.len()
    );
    for_each_block(
        SendPtr(dst.as_mut_ptr()),
        (m, n),
        (row_stride, block),
        write,
        &each,
    );
}

/// The blocks of a destination checked by the caller, on rayon's threads.
/// Each block must have been written by `each` when `write` is `Set`
/// (a fresh destination is whole only then).
fn for_each_block(
    dst: SendPtr,
    (m, n): (usize, usize),
    (row_stride, block): (usize, usize),
    write: Write,
    each: &(impl Fn(&ColumnBlock) + Sync),
) {
    use rayon::prelude::*;
    (0..n.div_ceil(block)).into_par_iter().for_each(|i| {
        let col0 = i * block;
        let column_block = ColumnBlock {
            dst,
            row_stride,
            rows: m,
            col0,
            cols: block.min(n - col0),
            write,
            written: false.into(),
        };
        each(&column_block);
        assert!(
            write != Write::Set || column_block.written.get(),
            "gemm: a column block left unwritten"
        );
    });
}

/// A fresh row-major `[M, N]` buffer written by [`column_blocks`] with
/// `Write::Set` (never zeroed first).
///
/// # Panics
/// When `each` leaves a block unwritten (a bug in the caller).
pub(crate) fn fresh_column_blocks(
    (m, n): (usize, usize),
    block: usize,
    each: impl Fn(&ColumnBlock) + Sync,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    if m > 0 && n > 0 {
        assert!(block > 0, "gemm: column blocks of 0 columns");
        for_each_block(
            SendPtr(out.as_mut_ptr()),
            (m, n),
            (n, block),
            Write::Set,
            &each,
        );
    }
    // SAFETY: the blocks cover the `n` columns of every row, and each
    // block's product (with `k > 0`, which it asserts) stored every value
    // of its block through the pointer (checked above; a panic there
    // leaves the length at 0).
    unsafe { out.set_len(m * n) };
    out
}

fn check(a: View<'_>, b: View<'_>) {
    assert_eq!(
        a.cols, b.rows,
        "gemm: [{}, {}] x [{}, {}]",
        a.rows, a.cols, b.rows, b.cols
    );
    for view in [a, b] {
        check_bounds(
            "gemm",
            (view.rows, view.cols),
            (view.row_stride, view.col_stride),
            view.data.len(),
        );
    }
}

/// A view of `rows x cols` elements, `strides` apart, ends within its
/// `len` values (the f32 and the bf16 products' views alike).
///
/// # Panics
/// When it runs past them (a bug in the caller): `what` names the product.
pub(super) fn check_bounds(
    what: &str,
    (rows, cols): (usize, usize),
    (row_stride, col_stride): (usize, usize),
    len: usize,
) {
    if rows > 0 && cols > 0 {
        let last = (rows - 1) * row_stride + (cols - 1) * col_stride;
        assert!(last < len, "{what}: view runs past its {len} values");
    }
}

/// Products this large split over rayon's threads inside the gemm.
fn threads_for(a: View<'_>, b: View<'_>) -> gemm::Parallelism {
    if a.rows.saturating_mul(b.cols).saturating_mul(a.cols) >= PARALLEL_OPS {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// `dst` set to `a b`, or `factor * a b` added to it (`Write::Add`), on
/// the given threads.
///
/// # Safety
/// `dst` must be valid for writes of `[M, N]` values `dst_row_stride` apart
/// (and initialised when `write` adds).
unsafe fn run(
    dst: *mut f32,
    dst_row_stride: usize,
    a: View<'_>,
    b: View<'_>,
    write: Write,
    parallelism: gemm::Parallelism,
) {
    check(a, b);
    let factor = write.factor();
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let stride = |s: usize| s as isize;
    // SAFETY: `check` bounded both views; the caller vouches for `dst`.
    // gemm computes `dst = alpha dst + beta a b` (`alpha` read only with
    // `read_dst`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            stride(dst_row_stride),
            write != Write::Set,
            a.data.as_ptr(),
            stride(a.col_stride),
            stride(a.row_stride),
            b.data.as_ptr(),
            stride(b.col_stride),
            stride(b.row_stride),
            1.0,
            factor,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::random;

    /// The triple loop in f64.
    fn naive(a: View<'_>, b: View<'_>) -> Vec<f64> {
        let at = |v: View<'_>, i: usize, j: usize| {
            f64::from(v.data[i * v.row_stride + j * v.col_stride])
        };
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] = (0..a.cols).map(|p| at(a, i, p) * at(b, p, j)).sum();
            }
        }
        out
    }

    fn assert_close(ours: &[f32], reference: &[f64], what: &str) {
        assert_eq!(ours.len(), reference.len(), "{what}");
        for (i, (&o, &r)) in ours.iter().zip(reference).enumerate() {
            // f32 sums of ~100 unit products: a few 1e-6 relative.
            assert!(
                (f64::from(o) - r).abs() <= 1e-4 * (1.0 + r.abs()),
                "{what}[{i}]: {o} vs {r}"
            );
        }
    }

    /// Every layout the kernels use: plain, transposed either side, column
    /// slices, sizes on both sides of the threading threshold.
    #[test]
    fn products_match_the_triple_loop() {
        for (m, k, n) in [(1, 1, 1), (7, 13, 5), (37, 64, 19), (200, 200, 210)] {
            let a = random(m * k, 1);
            let b = random(k * n, 2);
            let (va, vb) = (View::row_major(&a, m, k), View::row_major(&b, k, n));
            assert_close(&product(va, vb), &naive(va, vb), "a b");
            // a^T stored as [k, m], b^T stored as [n, k].
            let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let (vat, vbt) = (
                View::row_major(&at, k, m).t(),
                View::row_major(&bt, n, k).t(),
            );
            assert_close(&product(vat, vbt), &naive(va, vb), "(a^T)^T (b^T)^T");
            // Columns of b into columns of a wider destination, then added again.
            let cols = n.div_ceil(2);
            let start = n - cols;
            let mut dst = vec![0.5f32; m * (n + 3)];
            product_into(&mut dst, n + 3, va, vb.columns(start, cols), Write::Set);
            product_into(
                &mut dst,
                n + 3,
                va,
                vb.columns(start, cols),
                Write::Add(-0.5),
            );
            let full = naive(va, vb);
            for i in 0..m {
                for j in 0..n + 3 {
                    let got = dst[i * (n + 3) + j];
                    if j < cols {
                        let want = 0.5 * full[i * n + start + j];
                        assert!(
                            (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "[{i},{j}]"
                        );
                    } else {
                        assert_eq!(got, 0.5, "[{i},{j}] outside the product is untouched");
                    }
                }
            }
        }
    }

    /// A destination split into column blocks, each block's product on its
    /// thread and its inner dimension in two slices (the second added):
    /// into a wider destination (the columns beyond untouched) in both
    /// write modes, and into a fresh buffer; blocks that do not divide the
    /// columns, and one block wider than them.
    #[test]
    fn column_blocks_write_their_columns_in_slices_of_k() {
        for (m, k, n, block) in [
            (1, 2, 1, 16),
            (37, 64, 19, 8),
            (200, 130, 210, 48),
            (5, 9, 7, 64),
        ] {
            let a = random(m * k, 3);
            let b = random(k * n, 4);
            let (va, vb) = (View::row_major(&a, m, k), View::row_major(&b, k, n));
            let full = naive(va, vb);
            let half = k / 2;
            let each = |column_block: &ColumnBlock| {
                let (col0, cols) = column_block.columns();
                let b = vb.columns(col0, cols);
                let (a0, b0) = (View::strided(&a, (m, k), (half, 1)), b);
                let b0 = View::strided(b0.data, (half, b0.row_stride), (cols, 1));
                column_block.product(a0, b0, false);
                let a1 = View::strided(&a[half..], (m, k), (k - half, 1));
                let b1 = View::strided(&b.data[half * n..], (k - half, n), (cols, 1));
                column_block.product(a1, b1, true);
            };
            let fresh = fresh_column_blocks((m, n), block, each);
            assert_close(&fresh, &full, "fresh");
            for (write, scale) in [(Write::Set, 1.0), (Write::Add(-0.5), -0.5)] {
                let mut dst = vec![0.25f32; m * (n + 3)];
                column_blocks(&mut dst, n + 3, (m, n), block, write, each);
                for i in 0..m {
                    for j in 0..n + 3 {
                        let got = f64::from(dst[i * (n + 3) + j]);
                        if j < n {
                            let base = if write == Write::Set { 0.0 } else { 0.25 };
                            let want = base + scale * full[i * n + j];
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{write:?} [{i},{j}]"
                            );
                        } else {
                            assert_eq!(got, 0.25, "{write:?} [{i},{j}] beyond the columns");
                        }
                    }
                }
            }
        }
    }

    /// A fresh buffer is whole only when every block wrote itself: one
    /// left unwritten panics rather than handing out uninitialised values.
    #[test]
    #[should_panic(expected = "left unwritten")]
    fn a_fresh_block_left_unwritten_panics() {
        let a = random(4 * 3, 5);
        let b = random(3 * 40, 6);
        let (va, vb) = (View::row_major(&a, 4, 3), View::row_major(&b, 3, 40));
        fresh_column_blocks((4, 40), 16, |block| {
            let (col0, cols) = block.columns();
            if col0 > 0 {
                block.product(va, vb.columns(col0, cols), false);
            }
        });
    }

    /// Adding to a fresh block before it was set would read uninitialised
    /// values: it panics.
    #[test]
    #[should_panic(expected = "added to before it was written")]
    fn adding_to_a_fresh_block_before_setting_it_panics() {
        let a = random(4 * 3, 7);
        let b = random(3 * 8, 8);
        let (va, vb) = (View::row_major(&a, 4, 3), View::row_major(&b, 3, 8));
        fresh_column_blocks((4, 8), 16, |block| block.product(va, vb, true));
    }

    #[test]
    fn empty_inner_dimension_gives_zeros() {
        let a: Vec<f32> = Vec::new();
        assert_eq!(
            product(View::row_major(&a, 3, 0), View::row_major(&a, 0, 2)),
            vec![0.0; 6]
        );
        let mut dst = vec![1.0f32; 6];
        product_into(
            &mut dst,
            2,
            View::row_major(&a, 3, 0),
            View::row_major(&a, 0, 2),
            Write::Set,
        );
        assert_eq!(dst, vec![0.0; 6]);
    }
}
