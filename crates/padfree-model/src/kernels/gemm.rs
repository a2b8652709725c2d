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
        run(out.as_mut_ptr(), n, a, b, Write::Set, 1.0);
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
    let factor = match write {
        Write::Set => 1.0,
        Write::Add(factor) => factor,
    };
    // SAFETY: the bounds were checked above; `dst` is initialised.
    unsafe { run(dst.as_mut_ptr(), row_stride, a, b, write, factor) }
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

/// # Safety
/// `dst` must be valid for writes of `[M, N]` values `dst_row_stride` apart
/// (and initialised when `write` adds).
unsafe fn run(
    dst: *mut f32,
    dst_row_stride: usize,
    a: View<'_>,
    b: View<'_>,
    write: Write,
    factor: f32,
) {
    check(a, b);
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_OPS {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
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
