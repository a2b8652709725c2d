//! LoRA's first product with dropout on its input, `y = (x * m) A^T`, whose
//! mask `m` is never stored: it is a counter-based hash of a seed, drawn
//! again in the backward pass (`dx = (dy A) * m`, `dA = dy^T (x * m)`).
//! Composed burn ops would keep the `[N, C]` mask and the dropped input of
//! every adapter until the backward pass: twice the input per targeted
//! layer, as much as the rest of the layer's activations together with
//! `all-linear`. The oracle beside it is exactly those composed ops.
//!
//! # Shapes
//! `N` rows, `C` input width, `r` the adapter's rank (`A` is `[r, C]`).

use rayon::prelude::*;

use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::tensor::{IntoHostVec, Tensor, cpu_device, float_tensor, linear};

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
    /// `len` multipliers, `0` with probability `p`, else `1/(1-p)`: each a
    /// hash of the seed and its index, so the mask is the same however many
    /// threads draw it, on any device, and drawn again it is the same.
    pub fn values(&self, len: usize) -> Vec<f32> {
        let mut mask = vec![1.0f32; len];
        self.scale(None, &mut mask);
        mask
    }

    /// `dst[i] = src[i] * m[i]` (`dst[i] *= m[i]` without `src`), the mask
    /// drawn on the way and never stored.
    ///
    /// Each 32-bit hash gives two 16-bit draws (values `2k` and `2k + 1`):
    /// a value is dropped when its draw is below `p * 65536`, so `p` is
    /// honoured to 1/65536. The hash is 32-bit integer arithmetic in
    /// blocks of eight, which the SIMD dispatch vectorises (AVX2's
    /// `vpmulld`; 64-bit multiplies have no AVX2 instruction): the mask is
    /// drawn three times per adapter and micro-batch (four with gradient
    /// checkpointing), and the scalar 64-bit hash it replaces was 8% of a
    /// QLoRA step's `perf` profile. The hash's counter is 32-bit: masks
    /// repeat only past 2^33 values of one adapter's input.
    pub(crate) fn scale(&self, src: Option<&[f32]>, dst: &mut [f32]) {
        const CHUNK: usize = 1 << 14;
        let keep = 1.0 / (1.0 - self.p);
        let threshold = (f64::from(self.p) * 65536.0).round() as u32;
        let key = mix(self.seed, 0) as u32;
        dst.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(chunk, out)| {
                let start = chunk * CHUNK;
                let src = src.map(|src| &src[start..start + out.len()]);
                super::simd::dispatch(
                    #[inline(always)]
                    || scale_block(key, threshold, keep, start, src, out),
                );
            });
    }
}

/// [`DropoutMask::scale`] on `out`, the values from index `start` (even).
#[inline(always)]
fn scale_block(
    key: u32,
    threshold: u32,
    keep: f32,
    start: usize,
    src: Option<&[f32]>,
    out: &mut [f32],
) {
    let mut factors = [0.0f32; 16];
    for (block, values) in out.chunks_mut(16).enumerate() {
        // Eight hashes, sixteen draws.
        let first = ((start >> 1) + block * 8) as u32;
        let mut hashes = [0u32; 8];
        for (lane, hash) in hashes.iter_mut().enumerate() {
            *hash = hash32(key ^ first.wrapping_add(lane as u32).wrapping_mul(0x9e37_79b9));
        }
        for (k, factor) in factors.iter_mut().enumerate() {
            let draw = (hashes[k >> 1] >> (16 * (k & 1))) & 0xffff;
            *factor = if draw < threshold { 0.0 } else { keep };
        }
        let base = block * 16;
        match src {
            Some(src) => {
                for ((v, &x), &f) in values.iter_mut().zip(&src[base..]).zip(&factors) {
                    *v = x * f;
                }
            }
            None => {
                for (v, &f) in values.iter_mut().zip(&factors) {
                    *v *= f;
                }
            }
        }
    }
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

/// `(x * m) A^T`: `[N, C]`, `[r, C]` -> `[N, r]`, differentiable in both,
/// the mask drawn again in the backward pass (CPU).
pub fn dropout_matmul(
    x: Tensor<2>,
    a: Tensor<2>,
    mask: DropoutMask,
) -> Result<Tensor<2>, UnsupportedTensor> {
    apply::<_, 2, 2, 2>(DropoutMatmul { mask }, [x, a])
}

/// The oracle (and the GPU's path): the mask as a tensor, then burn ops.
pub fn composed_dropout_matmul(x: Tensor<2>, a: Tensor<2>, mask: DropoutMask) -> Tensor<2> {
    let dims = x.dims();
    let m = float_tensor(mask.values(dims[0] * dims[1]), dims, &x.device());
    linear(x * m, &a)
}

#[derive(Debug, Clone)]
struct DropoutMatmul {
    mask: DropoutMask,
}

/// `[rows, cols]` host values as a tensor on the CPU, off the graph.
fn host(values: Vec<f32>, rows: usize, cols: usize) -> Tensor<2> {
    float_tensor(values, [rows, cols], &cpu_device(false))
}

impl DropoutMatmul {
    /// `x * m`, row-major.
    fn dropped(&self, x: &[f32]) -> Vec<f32> {
        let mut dropped = vec![0.0f32; x.len()];
        self.mask.scale(Some(x), &mut dropped);
        dropped
    }
}

impl HostOp<2> for DropoutMatmul {
    /// The backward pass needs only the inputs and the seed.
    const KEEPS_OUTPUT: bool = false;

    fn forward(&self, [x, a]: [HostTensor<'_>; 2]) -> HostOutput {
        let (n, c, r) = (x.shape[0], x.shape[1], a.shape[0]);
        let y = linear(
            host(self.dropped(x.values), n, c),
            &host(a.values.to_vec(), r, c),
        );
        HostOutput {
            values: y.into_vec(),
            shape: vec![n, r],
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [x, a]: [HostTensor<'_>; 2],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
    ) -> [Vec<f32>; 2] {
        let (n, c, r) = (x.shape[0], x.shape[1], a.shape[0]);
        let dy = host(d_out.to_vec(), n, r);
        // The mask drawn again for each gradient rather than kept: keeping
        // it would hold `N x C` floats per adapter between the two.
        let d_a = dy
            .clone()
            .transpose()
            .matmul(host(self.dropped(x.values), n, c))
            .into_vec();
        let mut dx = dy.matmul(host(a.values.to_vec(), r, c)).into_vec();
        self.mask.scale(None, &mut dx);
        [dx, d_a]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{backward, grad, trainable};
    use padfree_pack::SplitMix64;

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

    /// The kernel against the composed ops: output and both gradients, the
    /// same f32 products (1e-6 of the largest value; seen: equal bits or
    /// one rounding apart).
    #[test]
    fn kernel_matches_the_composed_ops() {
        let device = cpu_device(true);
        let (n, c, r) = (37, 48, 5);
        let mut rng = SplitMix64::new(1);
        let mut random =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.standard_normal() as f32).collect() };
        let (x0, a0, dy0) = (random(n * c), random(r * c), random(n * r));
        let mask = DropoutMask { p: 0.3, seed: 99 };
        let run = |fused: bool| {
            let x = trainable(float_tensor(x0.clone(), [n, c], &device));
            let a = trainable(float_tensor(a0.clone(), [r, c], &device));
            let y = if fused {
                dropout_matmul(x.clone(), a.clone(), mask).expect("f32 on the CPU")
            } else {
                composed_dropout_matmul(x.clone(), a.clone(), mask)
            };
            let grads = backward(&(y.clone() * float_tensor(dy0.clone(), [n, r], &device)).sum());
            let dx = grad(&x, &grads).expect("dx").into_vec();
            let da = grad(&a, &grads).expect("dA").into_vec();
            (y.into_vec(), dx, da)
        };
        let (ours, theirs) = (run(true), run(false));
        for (what, a, b) in [
            ("y", &ours.0, &theirs.0),
            ("dx", &ours.1, &theirs.1),
            ("dA", &ours.2, &theirs.2),
        ] {
            let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let diff = a
                .iter()
                .zip(b.iter())
                .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(diff <= 1e-6 * scale, "{what}: {diff:e} of {scale:e}");
        }
    }
}
