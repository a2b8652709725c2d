//! The portable body of the bf16 products, and their oracle: the bf16
//! operands widened to f32 (exactly) and multiplied by the f32 gemm.

use rayon::prelude::*;

use super::operand::{Element, Values, View16, with_values};
use crate::kernels::gemm::{self, Write};

/// The widened body widens B in column blocks of at most this many values,
/// so that a vocabulary-sized weight is never widened whole.
const WIDENED_B_VALUES: usize = 1 << 22;
/// ... and K in blocks of at most this many, so that a vocabulary-sized
/// inner dimension (the head's `dy W`) still leaves wide column blocks.
const WIDENED_K: usize = 4096;

/// The portable body: blocks of K and of B's columns widened (A's K block
/// once for all column blocks), each product by the f32 gemm.
pub(super) fn widened(
    dst: &mut [f32],
    row_stride: usize,
    a: View16<'_>,
    b: View16<'_>,
    write: Write,
) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let kb = k.min(WIDENED_K);
    let nb = (WIDENED_B_VALUES / kb).clamp(64, n.max(64));
    for k0 in (0..k).step_by(kb) {
        let kc = kb.min(k - k0);
        let write = match write {
            Write::Set if k0 > 0 => Write::Add(1.0),
            other => other,
        };
        let a_block = widen_block(a, (0, m), (k0, kc));
        let a_view = a_block.view(m, kc);
        for j0 in (0..n).step_by(nb) {
            let cols = nb.min(n - j0);
            let b_block = widen_block(b, (k0, kc), (j0, cols));
            let b_view = b_block.view(kc, cols);
            gemm::product_into(&mut dst[j0..], row_stride, a_view, b_view, write);
        }
    }
}

/// A widened block, stored row-major or column-major as the view lies in
/// memory, so that it is read in order.
struct Widened {
    values: Vec<f32>,
    row_major: bool,
}

impl Widened {
    fn view(&self, rows: usize, cols: usize) -> gemm::View<'_> {
        if self.row_major {
            gemm::View::row_major(&self.values, rows, cols)
        } else {
            gemm::View::row_major(&self.values, cols, rows).t()
        }
    }
}

/// Rows `row0..row0 + rows` and columns `col0..col0 + cols` of `view`,
/// widened to f32.
fn widen_block(
    view: View16<'_>,
    (row0, rows): (usize, usize),
    (col0, cols): (usize, usize),
) -> Widened {
    let row_major = view.col_stride == 1 || view.row_stride != 1;
    let mut values = vec![0.0f32; rows * cols];
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
    with_values!(view.values, v => {
        let body = |(line, out): (usize, &mut [f32])| {
            let from = first(line);
            if step == 1 {
                for (o, &x) in out.iter_mut().zip(&v[from..from + line_len]) {
                    *o = x.widened();
                }
            } else {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = v[from + i * step].widened();
                }
            }
        };
        if rows * cols >= 1 << 16 {
            values.par_chunks_mut(line_len.max(1)).enumerate().for_each(body);
        } else {
            values.chunks_mut(line_len.max(1)).enumerate().for_each(body);
        }
    });
    Widened { values, row_major }
}
