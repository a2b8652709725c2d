//! The host kernel's micro-kernels: small matmuls over one block of `ROWS`
//! query rows, register-tiled.

/// Query rows per block: a block's scores are computed against each key
/// vector once, four rows at a time (register blocking, as a matmul
/// micro-kernel does), instead of one dot product per (row, key).
pub(super) const ROWS: usize = 4;
/// Keys (columns of a score block) or head lanes per inner step: two AVX2
/// vectors, one AVX-512 vector; eight independent accumulators with `ROWS`.
pub(super) const LANES: usize = 16;

//
// Each keeps a `ROWS x LANES` tile of accumulators in registers and walks the
// shared dimension once, so every value loaded feeds `ROWS` (or `LANES`)
// multiply-adds; `mul_add` is one FMA instruction in the dispatched code and
// exactly rounded everywhere, so results do not depend on the vector set.

/// `out[r][j] = sum_x a[r][x] * columns[x][j]` for `j < n` (rounded up to
/// `LANES`; `columns` is zero-padded that far).
///
/// # Shapes
/// `a`: `[ROWS, D]`; `columns`: `[D, width]`; `out`: `[ROWS, width]`.
#[inline(always)]
pub(super) fn row_times_columns(
    a: &[f32],
    d: usize,
    columns: &[f32],
    width: usize,
    n: usize,
    out: &mut [f32],
) {
    for j0 in (0..n).step_by(LANES) {
        let mut acc = [[0.0f32; LANES]; ROWS];
        for x in 0..d {
            let Some(column) = columns[x * width + j0..].first_chunk::<LANES>() else {
                unreachable!("columns are padded to a multiple of LANES");
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = a[r * d + x];
                for (acc, &c) in acc.iter_mut().zip(column) {
                    *acc = a.mul_add(c, *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[r * width + j0..r * width + j0 + LANES].copy_from_slice(acc);
        }
    }
}

/// `out[r] = sum_{j < n} w[r][j] * rows[j]`.
///
/// # Shapes
/// `w`: `[ROWS, width]`; `rows`: `[L, D]`; `out`: `[ROWS, D]`.
#[inline(always)]
pub(super) fn weighted_rows(
    w: &[f32],
    width: usize,
    rows: &[f32],
    d: usize,
    n: usize,
    out: &mut [f32],
) {
    let mut x0 = 0;
    while x0 + LANES <= d {
        weighted_rows_tile::<LANES>(w, width, rows, d, n, x0, out);
        x0 += LANES;
    }
    while x0 < d {
        weighted_rows_tile::<1>(w, width, rows, d, n, x0, out);
        x0 += 1;
    }
}

#[inline(always)]
fn weighted_rows_tile<const N: usize>(
    w: &[f32],
    width: usize,
    rows: &[f32],
    d: usize,
    n: usize,
    x0: usize,
    out: &mut [f32],
) {
    let mut acc = [[0.0f32; N]; ROWS];
    for j in 0..n {
        let Some(row) = rows[j * d + x0..].first_chunk::<N>() else {
            unreachable!("the tile lies inside the row");
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            let w = w[r * width + j];
            for (acc, &value) in acc.iter_mut().zip(row) {
                *acc = w.mul_add(value, *acc);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        out[r * d + x0..r * d + x0 + N].copy_from_slice(acc);
    }
}

/// `out[j] += sum_r w[r][j] * a[r]` for `j < n`.
///
/// # Shapes
/// `w`: `[ROWS, width]`; `a`: `[ROWS, D]`; `out`: `[L, D]`.
#[inline(always)]
pub(super) fn add_columns_times_rows(
    w: &[f32],
    width: usize,
    a: &[f32],
    d: usize,
    n: usize,
    out: &mut [f32],
) {
    let mut x0 = 0;
    while x0 + LANES <= d {
        add_columns_times_rows_tile::<LANES>(w, width, a, d, n, x0, out);
        x0 += LANES;
    }
    while x0 < d {
        add_columns_times_rows_tile::<1>(w, width, a, d, n, x0, out);
        x0 += 1;
    }
}

/// One `N`-wide tile of the head: the `ROWS x N` values of `a` stay in
/// registers while every key row `j` is updated.
#[inline(always)]
fn add_columns_times_rows_tile<const N: usize>(
    w: &[f32],
    width: usize,
    a: &[f32],
    d: usize,
    n: usize,
    x0: usize,
    out: &mut [f32],
) {
    let tile: [[f32; N]; ROWS] =
        std::array::from_fn(|r| std::array::from_fn(|x| a[r * d + x0 + x]));
    for j in 0..n {
        let Some(acc) = out[j * d + x0..].first_chunk_mut::<N>() else {
            unreachable!("the tile lies inside the row");
        };
        for (r, tile) in tile.iter().enumerate() {
            let weight = w[r * width + j];
            for (acc, &value) in acc.iter_mut().zip(tile) {
                *acc = weight.mul_add(value, *acc);
            }
        }
    }
}
