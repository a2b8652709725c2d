//! LoRA's dropout mask, never stored: each multiplier is a counter-based
//! hash of a seed and the value's index, drawn again in the backward pass
//! (`kernels/lora_linear.rs` draws it once in the forward pass, for
//! `x * m`, and once in the backward one, for `dx += (dy_down A) * m` and
//! `x * m` together). Composed burn ops would keep the `[N, C]` mask and
//! the dropped input of every adapter until the backward pass: twice the
//! input per targeted layer, as much as the rest of the layer's
//! activations together with `all-linear`. The oracle beside it is exactly
//! those composed ops (`composed_dropout_matmul`, also the GPU's path).
//!
//! # Shapes
//! `N` rows, `C` input width, `r` the adapter's rank (`A` is `[r, C]`).

use rayon::prelude::*;

use crate::tensor::{Tensor, float_tensor, linear};

/// Inverted dropout: each value kept with probability `1 - p` and scaled by
/// `1/(1-p)`, the mask a function of `seed` and the value's index alone.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutMask {
    /// Probability of dropping a value, in `[0, 1)`.
    pub p: f32,
    /// Picks the mask.
    pub seed: u64,
}

impl DropoutMask {
    /// `x * m`, row-major.
    pub(crate) fn dropped(&self, x: &[f32]) -> Vec<f32> {
        let mut dropped = x.to_vec();
        self.scale(&mut dropped);
        dropped
    }

    /// `len` multipliers, `0` with probability `p`, else `1/(1-p)`: each a
    /// hash of the seed and its index, so the mask is the same however many
    /// threads draw it, on any device, and drawn again it is the same.
    pub fn values(&self, len: usize) -> Vec<f32> {
        let mut mask = vec![1.0f32; len];
        self.scale(&mut mask);
        mask
    }

    /// `dst[i] *= m[i]`, the mask drawn on the way and never stored.
    ///
    /// Each 32-bit hash gives two 16-bit draws (values `2k` and `2k + 1`):
    /// a value is dropped when its draw is below `p * 65536`, so `p` is
    /// honoured to 1/65536. The hash is 32-bit integer arithmetic in
    /// blocks of eight, which the SIMD dispatch vectorises (AVX2's
    /// `vpmulld`; 64-bit multiplies have no AVX2 instruction): the mask is
    /// drawn twice per adapter and micro-batch (three times with gradient
    /// checkpointing), and the scalar 64-bit hash it replaces was 8% of a
    /// QLoRA step's `perf` profile. The hash's counter is 32-bit: masks
    /// repeat only past 2^33 values of one adapter's input.
    pub(crate) fn scale(&self, dst: &mut [f32]) {
        const CHUNK: usize = 1 << 14;
        let keep = 1.0 / (1.0 - self.p);
        let threshold = (f64::from(self.p) * 65536.0).round() as u32;
        let key = mix(self.seed, 0) as u32;
        dst.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(chunk, out)| {
                let start = chunk * CHUNK;
                super::simd::dispatch(
                    #[inline(always)]
                    || scale_block(key, threshold, keep, start, out),
                );
            });
    }

    /// The backward pass of a dropped input in one pass, the mask drawn
    /// once: `dx[i] += through[i] * m[i]` (the gradient through the
    /// dropout), then `through[i] = x[i] * m[i]` (the dropped input, for
    /// the weight's gradient), reusing `through`'s buffer.
    pub(crate) fn backward(&self, x: &[f32], through: &mut [f32], dx: &mut [f32]) {
        const CHUNK: usize = 1 << 14;
        let keep = 1.0 / (1.0 - self.p);
        let threshold = (f64::from(self.p) * 65536.0).round() as u32;
        let key = mix(self.seed, 0) as u32;
        through
            .par_chunks_mut(CHUNK)
            .zip(dx.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(chunk, (through, dx))| {
                let start = chunk * CHUNK;
                let x = &x[start..start + through.len()];
                super::simd::dispatch(
                    #[inline(always)]
                    || backward_block(key, threshold, keep, start, x, through, dx),
                );
            });
    }
}

/// [`DropoutMask::scale`] on `out`, the values from index `start` (even).
#[inline(always)]
fn scale_block(key: u32, threshold: u32, keep: f32, start: usize, out: &mut [f32]) {
    for (block, values) in out.chunks_mut(16).enumerate() {
        let factors = factors(key, threshold, keep, start, block);
        for (v, &f) in values.iter_mut().zip(&factors) {
            *v *= f;
        }
    }
}

/// [`DropoutMask::backward`] on one chunk, the values from index `start` (even).
#[inline(always)]
fn backward_block(
    key: u32,
    threshold: u32,
    keep: f32,
    start: usize,
    x: &[f32],
    through: &mut [f32],
    dx: &mut [f32],
) {
    for (block, (through, dx)) in through.chunks_mut(16).zip(dx.chunks_mut(16)).enumerate() {
        let factors = factors(key, threshold, keep, start, block);
        let x = &x[block * 16..];
        for (((t, d), &x), &f) in through.iter_mut().zip(dx).zip(x).zip(&factors) {
            *d += *t * f;
            *t = x * f;
        }
    }
}

/// The multipliers of sixteen values, block `block` of a chunk whose values
/// start at index `start` (even): eight hashes, two 16-bit draws each.
#[inline(always)]
fn factors(key: u32, threshold: u32, keep: f32, start: usize, block: usize) -> [f32; 16] {
    let first = ((start >> 1) + block * 8) as u32;
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
    let dims = x.dims();
    let m = float_tensor(mask.values(dims[0] * dims[1]), dims, &x.device());
    linear(x * m, &a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropout_drops_about_p_and_keeps_the_expectation() {
        let mask = DropoutMask { p: 0.25, seed: 7 }.values(200_000);
        let dropped = mask.iter().filter(|&&v| v == 0.0).count() as f64 / mask.len() as f64;
        assert!((dropped - 0.25).abs() < 0.01, "dropped {dropped}");
        let mean = mask.iter().map(|&v| f64::from(v)).sum::<f64>() / mask.len() as f64;
        assert!((mean - 1.0).abs() < 0.01, "mean {mean}");
        assert_ne!(mask, DropoutMask { p: 0.25, seed: 8 }.values(200_000));
        assert_eq!(mask, DropoutMask { p: 0.25, seed: 7 }.values(200_000));
        // The two values of one hash are independent: both dropped p^2.
        let both = mask
            .chunks_exact(2)
            .filter(|pair| pair[0] == 0.0 && pair[1] == 0.0)
            .count() as f64
            / (mask.len() / 2) as f64;
        assert!((both - 0.0625).abs() < 0.005, "both dropped {both}");
        // A value's multiplier depends on its index alone, not on the
        // length or where the threads' chunks begin.
        for len in [1, 15, 17, 16_385, 40_001] {
            assert_eq!(
                DropoutMask { p: 0.25, seed: 7 }.values(len)[..],
                mask[..len],
                "{len}"
            );
        }
    }

    /// The one-pass backward against its definition from the mask's values,
    /// over more than one thread chunk and a ragged end.
    #[test]
    fn backward_pass_is_the_gradient_and_the_dropped_input() {
        let mask = DropoutMask { p: 0.2, seed: 5 };
        let len = 40_003;
        let m = mask.values(len);
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
