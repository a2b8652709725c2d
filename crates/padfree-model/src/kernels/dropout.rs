//! LoRA's dropout mask, never stored: each multiplier is a counter-based
//! hash of a seed, its row's key and its column, drawn again in the
//! backward pass (`kernels/lora_linear.rs` draws it once in the forward
//! pass, for `x * m`, and once in the backward one, for
//! `dx += (dy_down A) * m` and `x * m` together). Composed burn ops would
//! keep the `[N, C]` mask and the dropped input of every adapter until the
//! backward pass: twice the input per targeted layer, as much as the rest
//! of the layer's activations together with `all-linear`. The oracle
//! beside it is exactly those composed ops (`composed_dropout_matmul`,
//! also the GPU's path).
//!
//! A row's key names its token, not its place ([`RowKeys`]): the model
//! keys each row by (example, position in the example), so a token draws
//! the same mask padded or flattened, alone or in any micro-batch, on any
//! rank and device. Keyed by the row's index, padding moved the masks:
//! padded and padding-free LoRA runs differed by 1e-3 relative at
//! dropout 0.3.
//!
//! # Shapes
//! `N` rows, `C` input width, `r` the adapter's rank (`A` is `[r, C]`).

use std::sync::Arc;

use rayon::prelude::*;

use crate::tensor::{Tensor, float_tensor, linear};

/// A 32-bit key per row of a batch, `[N]`: which token the row holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowKeys(Arc<[u32]>);

impl RowKeys {
    /// Rows keyed by `keys`.
    pub fn new(keys: Vec<u32>) -> Self {
        Self(keys.into())
    }

    /// The key of the token at `position` of example `example`: equal for
    /// equal pairs, and unequal pairs collide with probability 2^-32.
    pub fn token(example: u64, position: u32) -> u32 {
        mix(example, u64::from(position)) as u32
    }

    /// `n` rows keyed by their index (kernel tests; a batch without
    /// examples).
    pub fn indexed(n: usize) -> Self {
        Self::new((0..n).map(|row| Self::token(0, row as u32)).collect())
    }

    /// `N`.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Inverted dropout: each value kept with probability `1 - p` and scaled by
/// `1/(1-p)`, the mask a function of `seed`, the value's row key and its
/// column alone.
#[derive(Debug, Clone, PartialEq)]
pub struct DropoutMask {
    /// Probability of dropping a value, in `[0, 1)`.
    pub p: f32,
    /// Picks the mask (the step, the layer and the module).
    pub seed: u64,
    /// `[N]`: the token of every row.
    pub rows: RowKeys,
}

impl DropoutMask {
    /// `x * m`, `[N, C]` row-major.
    pub(crate) fn dropped(&self, x: &[f32]) -> Vec<f32> {
        let mut dropped = x.to_vec();
        self.scale(&mut dropped);
        dropped
    }

    /// The `[N, C]` multipliers, `0` with probability `p`, else `1/(1-p)`:
    /// each a hash of the seed, its row's key and its column, so the mask
    /// is the same however many threads draw it, on any device, and drawn
    /// again it is the same.
    pub fn values(&self, c: usize) -> Vec<f32> {
        let mut mask = vec![1.0f32; self.rows.len() * c];
        self.scale(&mut mask);
        mask
    }

    /// `C` of a `[N, C]` buffer of `len` values.
    ///
    /// # Panics
    /// When `len` is not `N` rows (a bug: the model keys every row of the
    /// batch it runs).
    fn width(&self, len: usize) -> usize {
        let n = self.rows.len();
        assert!(
            n > 0 && len.is_multiple_of(n),
            "a dropout mask of {n} rows applied to {len} values (a bug in padfree)"
        );
        len / n
    }

    /// The rows, `rows_per_chunk` at a time, with each row's hash key.
    fn chunks(&self, c: usize) -> (usize, impl Fn(usize) -> u32 + Sync + '_) {
        // About 16k values per task, whole rows.
        let rows_per_chunk = (CHUNK / c.max(1)).max(1);
        let key = mix(self.seed, 0) as u32;
        let rows = &self.rows.0;
        (rows_per_chunk, move |row| hash32(key ^ rows[row]))
    }

    /// `dst[i] *= m[i]`, the mask drawn on the way and never stored.
    ///
    /// Each 32-bit hash gives two 16-bit draws (columns `2k` and `2k + 1`
    /// of a row): a value is dropped when its draw is below `p * 65536`, so
    /// `p` is honoured to 1/65536. The hash is 32-bit integer arithmetic in
    /// blocks of eight, which the SIMD dispatch vectorises (AVX2's
    /// `vpmulld`; 64-bit multiplies have no AVX2 instruction): the mask is
    /// drawn twice per adapter and micro-batch (three times with gradient
    /// checkpointing), and the scalar 64-bit hash it replaces was 8% of a
    /// QLoRA step's `perf` profile.
    pub(crate) fn scale(&self, dst: &mut [f32]) {
        if dst.is_empty() {
            return;
        }
        let c = self.width(dst.len());
        let keep = 1.0 / (1.0 - self.p);
        let threshold = threshold(self.p);
        let (rows_per_chunk, row_key) = self.chunks(c);
        dst.par_chunks_mut(rows_per_chunk * c)
            .enumerate()
            .for_each(|(chunk, out)| {
                for (at, out) in out.chunks_mut(c).enumerate() {
                    let key = row_key(chunk * rows_per_chunk + at);
                    super::simd::dispatch(
                        #[inline(always)]
                        || scale_block(key, threshold, keep, out),
                    );
                }
            });
    }

    /// The backward pass of a dropped input in one pass, the mask drawn
    /// once: `dx[i] += through[i] * m[i]` (the gradient through the
    /// dropout), then `through[i] = x[i] * m[i]` (the dropped input, for
    /// the weight's gradient), reusing `through`'s buffer.
    pub(crate) fn backward(&self, x: &[f32], through: &mut [f32], dx: &mut [f32]) {
        if through.is_empty() {
            return;
        }
        let c = self.width(through.len());
        assert!(
            x.len() == through.len() && dx.len() == through.len(),
            "dropout's backward pass on buffers of {}, {} and {} values (a bug in padfree)",
            x.len(),
            through.len(),
            dx.len()
        );
        let keep = 1.0 / (1.0 - self.p);
        let threshold = threshold(self.p);
        let (rows_per_chunk, row_key) = self.chunks(c);
        let values = rows_per_chunk * c;
        through
            .par_chunks_mut(values)
            .zip(dx.par_chunks_mut(values))
            .enumerate()
            .for_each(|(chunk, (through, dx))| {
                let x = &x[chunk * values..chunk * values + through.len()];
                for (at, ((through, dx), x)) in through
                    .chunks_mut(c)
                    .zip(dx.chunks_mut(c))
                    .zip(x.chunks(c))
                    .enumerate()
                {
                    let key = row_key(chunk * rows_per_chunk + at);
                    super::simd::dispatch(
                        #[inline(always)]
                        || backward_block(key, threshold, keep, x, through, dx),
                    );
                }
            });
    }
}

/// Values per parallel task.
const CHUNK: usize = 1 << 14;

/// Draws below this are dropped: `p` in 1/65536.
fn threshold(p: f32) -> u32 {
    (f64::from(p) * 65536.0).round() as u32
}

/// [`DropoutMask::scale`] on one row, its hash key `key`.
#[inline(always)]
fn scale_block(key: u32, threshold: u32, keep: f32, out: &mut [f32]) {
    for (block, values) in out.chunks_mut(16).enumerate() {
        let factors = factors(key, threshold, keep, block);
        for (v, &f) in values.iter_mut().zip(&factors) {
            *v *= f;
        }
    }
}

/// [`DropoutMask::backward`] on one row, its hash key `key`.
#[inline(always)]
fn backward_block(
    key: u32,
    threshold: u32,
    keep: f32,
    x: &[f32],
    through: &mut [f32],
    dx: &mut [f32],
) {
    for (block, (through, dx)) in through.chunks_mut(16).zip(dx.chunks_mut(16)).enumerate() {
        let factors = factors(key, threshold, keep, block);
        let x = &x[block * 16..];
        for (((t, d), &x), &f) in through.iter_mut().zip(dx).zip(x).zip(&factors) {
            *d += *t * f;
            *t = x * f;
        }
    }
}

/// The multipliers of sixteen values, columns `16 block ..` of the row
/// whose hash key is `key`: eight hashes, two 16-bit draws each.
#[inline(always)]
fn factors(key: u32, threshold: u32, keep: f32, block: usize) -> [f32; 16] {
    let first = (block * 8) as u32;
    let mut hashes = [0u32; 8];
    for (lane, hash) in hashes.iter_mut().enumerate() {
        *hash = hash32(key ^ first.wrapping_add(lane as u32).wrapping_mul(0x9e37_79b9));
    }
    let mut factors = [0.0f32; 16];
    for (k, factor) in factors.iter_mut().enumerate() {
        let draw = (hashes[k >> 1] >> (16 * (k & 1))) & 0xffff;
        *factor = if draw < threshold { 0.0 } else { keep };
    }
    factors
}

/// A 32-bit integer hash with full avalanche (Wellons' `lowbias32`).
#[inline(always)]
fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// SplitMix64's finaliser of `seed + index * golden`: a counter-based stream.
pub fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The oracle (and the GPU's path): the mask as a tensor, then burn ops.
pub fn composed_dropout_matmul(x: Tensor<2>, a: Tensor<2>, mask: DropoutMask) -> Tensor<2> {
    linear(composed_dropout(x, mask), &a)
}

/// `drop(x)`, `[N, C]`: the mask as a tensor times `x` (burn ops).
pub fn composed_dropout(x: Tensor<2>, mask: DropoutMask) -> Tensor<2> {
    let dims = x.dims();
    let m = float_tensor(mask.values(dims[1]), dims, &x.device());
    x * m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(p: f32, seed: u64, rows: usize) -> DropoutMask {
        DropoutMask {
            p,
            seed,
            rows: RowKeys::indexed(rows),
        }
    }

    #[test]
    fn dropout_drops_about_p_and_keeps_the_expectation() {
        let (n, c) = (400, 500);
        let values = mask(0.25, 7, n).values(c);
        let dropped = values.iter().filter(|&&v| v == 0.0).count() as f64 / values.len() as f64;
        assert!((dropped - 0.25).abs() < 0.01, "dropped {dropped}");
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64;
        assert!((mean - 1.0).abs() < 0.01, "mean {mean}");
        assert_ne!(values, mask(0.25, 8, n).values(c));
        assert_eq!(values, mask(0.25, 7, n).values(c));
        // The two values of one hash are independent: both dropped p^2.
        let both = values
            .chunks_exact(2)
            .filter(|pair| pair[0] == 0.0 && pair[1] == 0.0)
            .count() as f64
            / (values.len() / 2) as f64;
        assert!((both - 0.0625).abs() < 0.005, "both dropped {both}");
        // So are two rows: a column dropped in rows k and k + 1, p^2.
        let rows: Vec<&[f32]> = values.chunks(c).collect();
        let both = rows
            .windows(2)
            .flat_map(|pair| pair[0].iter().zip(pair[1]))
            .filter(|(a, b)| **a == 0.0 && **b == 0.0)
            .count() as f64
            / ((n - 1) * c) as f64;
        assert!((both - 0.0625).abs() < 0.005, "both rows dropped {both}");
    }

    /// A row's multipliers depend on its key and its columns alone: not on
    /// the other rows, their order, the width or where the threads' chunks
    /// begin. This is what makes padded and flattened batches, and any
    /// micro-batch split, draw the same mask for the same token.
    #[test]
    fn a_rows_mask_is_a_function_of_its_key_alone() {
        let keys: Vec<u32> = (0..9).map(|k| RowKeys::token(3, k)).collect();
        for c in [1, 15, 17, 576, 16_385] {
            let all = DropoutMask {
                p: 0.3,
                seed: 5,
                rows: RowKeys::new(keys.clone()),
            }
            .values(c);
            // Rows 6, 2, 2 again and 0, in another batch.
            let picked = DropoutMask {
                p: 0.3,
                seed: 5,
                rows: RowKeys::new(vec![keys[6], keys[2], keys[2], keys[0]]),
            }
            .values(c);
            for (at, row) in [6, 2, 2, 0].into_iter().enumerate() {
                assert_eq!(
                    picked[at * c..(at + 1) * c],
                    all[row * c..(row + 1) * c],
                    "row {row}, width {c}"
                );
            }
            // A wider row starts with the narrower one's mask.
            let wider = DropoutMask {
                p: 0.3,
                seed: 5,
                rows: RowKeys::new(vec![keys[6]]),
            }
            .values(c + 3);
            assert_eq!(wider[..c], all[6 * c..7 * c], "width {c}");
        }
        // Other tokens, other masks.
        let m = mask(0.3, 5, 2).values(512);
        assert_ne!(m[..256], m[256..]);
    }

    /// The one-pass backward against its definition from the mask's values,
    /// over more than one thread chunk and a ragged end.
    #[test]
    fn backward_pass_is_the_gradient_and_the_dropped_input() {
        for (n, c) in [(41, 1000), (3, 16_387), (7, 9)] {
            let mask = mask(0.2, 5, n);
            let len = n * c;
            let m = mask.values(c);
            let x: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut through: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut dx: Vec<f32> = (0..len).map(|i| i as f32 * 1e-4).collect();
            let (through0, dx0) = (through.clone(), dx.clone());
            mask.backward(&x, &mut through, &mut dx);
            for i in 0..len {
                assert_eq!(dx[i], dx0[i] + through0[i] * m[i], "dx[{i}]");
                assert_eq!(through[i], x[i] * m[i], "dropped[{i}]");
            }
            assert_eq!(mask.dropped(&x), through);
        }
    }

    #[test]
    #[should_panic(expected = "a dropout mask of 3 rows applied to 10 values")]
    fn a_mask_of_other_rows_is_a_bug_said_so() {
        mask(0.2, 5, 3).dropped(&[0.0; 10]);
    }
}
