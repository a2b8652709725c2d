//! The portable body of the bf16 products, and their oracle: the bf16
//! operands widened to f32 (exactly) and multiplied by the f32 gemm.
//!
//! Its buffers are written once, never zeroed first: in a `--bf16` profile
//! on an Intel Xeon the zeroing (`memset`) of the widened blocks and of the
//! outputs took as many samples as the widening itself (528 and 665 of
//! 13,641). An operand already holding bf16 values in f32
//! ([`View16::rounded`]) is read where it lies, not copied. The one
//! `unsafe` here sets a buffer's length after every value was written.
#![allow(unsafe_code)]

use rayon::prelude::*;

use super::operand::{Element, Values, View16, with_values};
use crate::kernels::gemm::{self, View, Write};
use crate::kernels::simd::dispatch;

/// The widened body widens B in column blocks of at most this many values,
/// so that a vocabulary-sized weight is never widened whole.
const WIDENED_B_VALUES: usize = 1 << 22;
/// ... and K in blocks of at most this many, so that a vocabulary-sized
/// inner dimension (the head's `dy W`) still leaves wide column blocks.
const WIDENED_K: usize = 4096;

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
    Borrowed(View<'a>),
}

impl Block<'_> {
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
            Self::Borrowed(view) => *view,
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
    if let Values::Rounded(v) = view.values {
        let from = row0 * view.row_stride + col0 * view.col_stride;
        return Block::Borrowed(View::strided(
            &v[from.min(v.len())..],
            (rows, view.row_stride),
            (cols, view.col_stride),
        ));
    }
    let row_major = view.col_stride == 1 || view.row_stride != 1;
    let len = rows * cols;
    let mut values = Vec::with_capacity(len);
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
        && all_rounded(v, len / line_len.max(1), line_len, first, step)
    {
        return Block::Borrowed(View::strided(
            &v[first(0).min(v.len())..],
            (rows, view.row_stride),
            (cols, view.col_stride),
        ));
    }
    let spare = &mut values.spare_capacity_mut()[..len];
    with_values!(view.values, v => {
        let body = |(line, out): (usize, &mut [std::mem::MaybeUninit<f32>])| {
            let from = first(line);
            if step == 1 {
                for (o, &x) in out.iter_mut().zip(&v[from..from + line_len]) {
                    o.write(x.widened());
                }
            } else {
                for (i, o) in out.iter_mut().enumerate() {
                    o.write(v[from + i * step].widened());
                }
            }
        };
        if len >= 1 << 16 {
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
/// under `--bf16`), so that it can be read where it lies. Reads 64 values
/// at a time (a loop that vectorises) and stops at the first 64 holding
/// one that is not: on unrounded data, the first.
fn all_rounded(
    v: &[f32],
    lines: usize,
    line_len: usize,
    first: impl Fn(usize) -> usize,
    step: usize,
) -> bool {
    dispatch(|| {
        (0..lines).all(|line| {
            let from = first(line);
            if step == 1 {
                v[from..from + line_len]
                    .chunks(64)
                    .all(|chunk| chunk.iter().fold(0, |acc, &x| acc | unrounded_bits(x)) == 0)
            } else {
                (0..line_len).all(|i| unrounded_bits(v[from + i * step]) == 0)
            }
        })
    })
}

/// Zero exactly when rounding `x` to bf16 leaves it as it is
/// (`bf16::rounded`: the low 16 bits clear, and a NaN quiet already).
#[inline(always)]
fn unrounded_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    let signalling = x.is_nan() && bits & 0x0040_0000 == 0;
    (bits & 0xFFFF) | u32::from(signalling)
}

#[cfg(test)]
mod tests {
    use super::unrounded_bits;
    use crate::kernels::bf16::rounded;

    /// The in-place test agrees with rounding itself on every kind of
    /// value: zeros, infinities, subnormals, quiet and signalling NaNs
    /// with their low bits clear or not, and a spread of ordinary ones.
    #[test]
    fn a_value_is_found_rounded_exactly_when_rounding_keeps_it() {
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x0001_0000,
            0x0000_0001,
            0x7FC0_0000,
            0x7FC0_0001,
            0x7F81_0000,
            0x7F80_0001,
            0xFFA0_0000,
            0x3F80_0000,
            0x3F80_8000,
            0x3F81_8000,
        ];
        bits.extend((0..5000u32).map(|i| i.wrapping_mul(2_654_435_761)));
        bits.extend((0..5000u32).map(|i| i.wrapping_mul(2_654_435_761) & 0xFFFF_0000));
        for b in bits {
            let x = f32::from_bits(b);
            assert_eq!(
                unrounded_bits(x) == 0,
                rounded(x).to_bits() == b,
                "{b:#010x}"
            );
        }
    }
}
