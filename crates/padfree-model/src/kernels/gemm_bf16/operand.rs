//! The operands of a bf16 product: a matrix view over f32 or bf16 values,
//! and what each element type reads as.

use half::bf16;

use crate::kernels::bf16::{holds_bf16_values, round, rounded, widen};

/// The values an operand reads.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Values<'a> {
    /// Rounded to bf16 as they are read.
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    /// f32 values that are bf16 values already (a buffer rounded once for
    /// two products): the widened body reads them where they lie; the
    /// others round them again, which leaves them as they are.
    Rounded(&'a [f32]),
}

impl Values<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Self::F32(v) | Self::Rounded(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }
}

/// A read-only matrix operand: element `(i, j)` at `i * row_stride + j * col_stride`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct View16<'a> {
    pub(super) values: Values<'a>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row_stride: usize,
    pub(super) col_stride: usize,
}

impl<'a> View16<'a> {
    /// `values` as a row-major `[rows, cols]` matrix.
    ///
    /// # Panics
    /// When `values` holds fewer than `rows * cols` values (a bug in the caller).
    pub fn row_major(values: Values<'a>, rows: usize, cols: usize) -> Self {
        assert!(
            values.len() >= rows * cols,
            "bf16 gemm view: {} values for [{rows}, {cols}]",
            values.len()
        );
        Self {
            values,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// A row-major bf16 matrix.
    pub fn bf16(values: &'a [bf16], rows: usize, cols: usize) -> Self {
        Self::row_major(Values::Bf16(values), rows, cols)
    }

    /// A row-major f32 matrix, rounded to bf16 as it is read.
    pub fn f32(values: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::row_major(Values::F32(values), rows, cols)
    }

    /// A row-major f32 matrix of values rounded to bf16 already.
    ///
    /// # Panics
    /// In builds with debug assertions, when a value is not a bf16 value
    /// (a bug in the caller: the widened body would read it unrounded).
    pub fn rounded(values: &'a [f32], rows: usize, cols: usize) -> Self {
        debug_assert!(
            values.iter().all(|&x| rounded(x).to_bits() == x.to_bits()),
            "bf16 gemm: an operand said to be rounded is not"
        );
        Self::row_major(Values::Rounded(values), rows, cols)
    }

    /// A row-major f32 matrix, read where it lies when every value is a
    /// bf16 value already (one scan, on rayon's threads when long), rounded
    /// as it is read otherwise: for an operand that more than one product
    /// reads, so that it is scanned once ([`Self::reads_rounded`] says
    /// what the scan found).
    pub fn f32_or_rounded(values: &'a [f32], rows: usize, cols: usize) -> Self {
        let view = Self::f32(values, rows, cols);
        if holds_bf16_values(&values[..rows * cols]) {
            Self {
                values: Values::Rounded(values),
                ..view
            }
        } else {
            view
        }
    }

    /// Whether the view reads values known to be bf16 values already.
    pub fn reads_rounded(&self) -> bool {
        matches!(self.values, Values::Rounded(_))
    }

    /// `rows` rows of `cols` f32 values rounded to bf16 already,
    /// `row_stride` values apart (one head's rows of a `[T, heads, D]`
    /// activation: `row_stride = heads * D`).
    ///
    /// # Panics
    /// When the last row runs past `values` (a bug in the caller); in
    /// builds with debug assertions, as [`Self::rounded`].
    pub fn rounded_rows(values: &'a [f32], rows: usize, cols: usize, row_stride: usize) -> Self {
        crate::kernels::gemm::check_bounds(
            "bf16 gemm view",
            (rows, cols),
            (row_stride, 1),
            values.len(),
        );
        debug_assert!(
            (0..rows).all(|i| {
                values[i * row_stride..i * row_stride + cols]
                    .iter()
                    .all(|&x| rounded(x).to_bits() == x.to_bits())
            }),
            "bf16 gemm: an operand said to be rounded is not"
        );
        Self {
            values: Values::Rounded(values),
            rows,
            cols,
            row_stride,
            col_stride: 1,
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

    /// Columns `start..start + len` of the view, without a copy.
    ///
    /// # Panics
    /// When the columns run past the view.
    pub fn columns(self, start: usize, len: usize) -> Self {
        assert!(
            start + len <= self.cols,
            "bf16 gemm view: columns {start}+{len} of {}",
            self.cols
        );
        let from = |len: usize| (start * self.col_stride).min(len);
        let values = match self.values {
            Values::F32(v) => Values::F32(&v[from(v.len())..]),
            Values::Bf16(v) => Values::Bf16(&v[from(v.len())..]),
            Values::Rounded(v) => Values::Rounded(&v[from(v.len())..]),
        };
        Self {
            values,
            cols: len,
            ..self
        }
    }

    /// Element `(i, j)` as the f32 of its bf16 value (tests' oracle).
    #[cfg(test)]
    pub(super) fn widened(&self, i: usize, j: usize) -> f32 {
        let at = i * self.row_stride + j * self.col_stride;
        match self.values {
            Values::F32(v) | Values::Rounded(v) => rounded(v[at]),
            Values::Bf16(v) => widen(v[at]),
        }
    }
}

/// The three layouts the packing tests read an operand in, named: row-major
/// `[rows, cols]`, column-major (the transpose of a row-major
/// `[cols, rows]`), and strided both ways (every other row and column of a
/// row-major `[rows, 2 cols]`). `values` holds at least `2 rows cols`.
#[cfg(test)]
pub(super) fn test_layouts(
    values: Values<'_>,
    rows: usize,
    cols: usize,
) -> [(&'static str, View16<'_>); 3] {
    [
        ("row-major", View16::row_major(values, rows, cols)),
        ("column-major", View16::row_major(values, cols, rows).t()),
        (
            "strided",
            View16 {
                row_stride: 2 * cols,
                col_stride: 2,
                ..View16::row_major(values, rows, cols)
            },
        ),
    ]
}

/// What an operand's elements are read as.
pub(super) trait Element: Copy + Send + Sync {
    /// The bf16 bits of the element (rounded when it is f32).
    fn bits(self) -> u32;
    /// The f32 of its bf16 value.
    fn widened(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn bits(self) -> u32 {
        u32::from(round(self).to_bits())
    }
    #[inline(always)]
    fn widened(self) -> f32 {
        rounded(self)
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
    #[inline(always)]
    fn widened(self) -> f32 {
        widen(self)
    }
}

/// Runs `$body` with `$v` bound to the operand's slice, whichever element
/// type it holds (the body is compiled once for each; rounded f32 values
/// are read as f32 ones, rounding being the identity on them).
macro_rules! with_values {
    ($values:expr, $v:ident => $body:expr) => {
        match $values {
            Values::F32($v) | Values::Rounded($v) => $body,
            Values::Bf16($v) => $body,
        }
    };
}
pub(super) use with_values;
