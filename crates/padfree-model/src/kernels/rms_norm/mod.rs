//! Fused RMSNorm on host slices, forward and backward (a CubeCL body for
//! GPUs in `cube.rs`).
//!
//! Composed from tensor ops, RMSNorm is seven passes over `[N, C]` forward
//! (square, mean, add, sqrt, reciprocal, two products) and about twice that
//! backward, each allocating; here it is one pass each way, rows over
//! threads, compiled for the CPU's SIMD (`simd::dispatch`). Each row's sum
//! (`x^2` forward, `dy * weight * x` backward) runs in eight lanes of a
//! fixed order (`simd::dot`), so that it vectorises and every instruction
//! set computes the same bits: a single running sum kept these loops scalar
//! (2.9% of a `medium` `--bf16` step, short chat, batch 8, on Zen 4).
//!
//! # Shapes
//! `N` rows, `C` channels. `x`, `y`, `dy`, `dx`: `[N, C]`; `weight`, `dw`:
//! `[C]`; `inv_rms`: `[N]`.
//!
//! `y` and `dx` go into buffers never zeroed first (`fresh.rs`), this
//! module's only `unsafe`.
#![allow(unsafe_code)]

use burn::tensor::Tensor;

use super::attention::is_cpu;
use super::bf16::round_in_place;
use super::fresh::fresh;
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::simd::{self, dispatch};
use rayon::prelude::*;

#[cfg(feature = "cube")]
mod cube;

// ---- the differentiable burn op ----

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension.
///
/// `x`: `[N, C]`, `weight`: `[1, C]` -> `[N, C]`.
/// On a GPU the CubeCL body (`cube.rs`; [`composed_rms_norm`] in a build
/// without GPU kernels).
pub fn rms_norm(x: Tensor<2>, weight: Tensor<2>, eps: f64) -> Result<Tensor<2>, UnsupportedTensor> {
    if !is_cpu(&x.device()) {
        return gpu_rms_norm([x, weight], eps);
    }
    apply(
        RmsNorm {
            eps: eps as f32,
            round: false,
        },
        [x, weight],
    )
}

/// [`rms_norm`] with its output rounded to bf16 (kept as f32), for a norm
/// whose every reader is a `--bf16` matmul on the CPU: those read only the
/// rounded values, so no product changes, and the widened body reads the
/// output where it lies instead of widening a rounded copy of it for each
/// product (`gemm_bf16/widened.rs`). The gradient is the unrounded norm's,
/// as autocast's cast to bf16 passes it straight through.
///
/// # Errors
/// On a GPU (its projections cast their input to 16 bits themselves).
pub fn bf16_rms_norm(
    x: Tensor<2>,
    weight: Tensor<2>,
    eps: f64,
) -> Result<Tensor<2>, UnsupportedTensor> {
    if !is_cpu(&x.device()) {
        return Err(UnsupportedTensor(
            "the norm rounded to bf16 is the CPU's (`--bf16` on a GPU casts in the projections)"
                .into(),
        ));
    }
    apply(
        RmsNorm {
            eps: eps as f32,
            round: true,
        },
        [x, weight],
    )
}

#[cfg(feature = "cube")]
fn gpu_rms_norm(inputs: [Tensor<2>; 2], eps: f64) -> Result<Tensor<2>, UnsupportedTensor> {
    cube::rms_norm(inputs, eps as f32)
}

#[cfg(not(feature = "cube"))]
fn gpu_rms_norm([x, weight]: [Tensor<2>; 2], eps: f64) -> Result<Tensor<2>, UnsupportedTensor> {
    Ok(composed_rms_norm(x, weight, eps))
}

/// The oracle: RMSNorm composed of burn ops, in f32 as transformers
/// computes it.
pub fn composed_rms_norm(x: Tensor<2>, weight: Tensor<2>, eps: f64) -> Tensor<2> {
    let mean_square = x.clone().powi_scalar(2).mean_dim(1);
    x * (mean_square + eps).sqrt().recip() * weight
}

#[derive(Debug, Clone)]
struct RmsNorm {
    eps: f32,
    /// The output rounded to bf16 ([`bf16_rms_norm`]).
    round: bool,
}

impl HostOp<2> for RmsNorm {
    const RECOMPUTE: bool = true;

    /// Saves each row's `1 / rms`.
    fn forward(&self, [x, weight]: [HostTensor<'_>; 2]) -> HostOutput {
        let (mut y, inv_rms) = forward(x.values, weight.values, self.eps);
        if self.round {
            round_in_place(&mut y);
        }
        HostOutput {
            values: y,
            shape: x.shape.to_vec(),
            saved: inv_rms,
        }
    }

    fn backward(
        &self,
        [x, weight]: [HostTensor<'_>; 2],
        _output: &[f32],
        inv_rms: &[f32],
        d_out: &[f32],
        _needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        let (dx, dweight) = backward(x.values, weight.values, inv_rms, d_out);
        [dx, dweight]
    }
}

// ---- the host kernel ----

/// Rows per rayon task. Fixed (not derived from the thread count), so the
/// weight gradient's partial sums, and so its rounding, never depend on
/// how many threads run.
const ROWS_PER_TASK: usize = 32;

/// `y = x / sqrt(mean(x^2) + eps) * weight`, and each row's `1 / rms`.
pub fn forward(x: &[f32], weight: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let channels = weight.len();
    let rows = x.len() / channels.max(1);
    assert_eq!(x.len(), rows * channels, "rms_norm: x is not whole rows");
    let mut inv_rms = vec![0.0f32; rows];
    // SAFETY: `y`'s chunks of whole rows pair with the same rows of `x`
    // (asserted: whole rows) and every value of each row is set.
    let y = unsafe {
        fresh(x.len(), |y| {
            y.par_chunks_mut(ROWS_PER_TASK * channels)
                .zip(inv_rms.par_chunks_mut(ROWS_PER_TASK))
                .zip(x.par_chunks(ROWS_PER_TASK * channels))
                .for_each(|((y, inv_rms), x)| {
                    dispatch(
                        #[inline(always)]
                        || {
                            let rows = y.chunks_exact_mut(channels).zip(x.chunks_exact(channels));
                            for ((y, x), inv) in rows.zip(inv_rms) {
                                let mean_square = simd::dot(x, x) / channels as f32;
                                *inv = 1.0 / (mean_square + eps).sqrt();
                                for ((y, &x), &w) in y.iter_mut().zip(x).zip(weight) {
                                    y.write(x * *inv * w);
                                }
                            }
                        },
                    )
                });
        })
    };
    (y, inv_rms)
}

/// `(dx, dweight)` given `dy`.
///
/// With `r = 1 / rms` and `g = dy * weight`:
/// `dx = r * g - x * r^3 / C * sum(g * x)` and `dweight = sum over rows of
/// dy * x * r`.
pub fn backward(x: &[f32], weight: &[f32], inv_rms: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let channels = weight.len();
    assert!(
        dy.len() == x.len() && x.len() == inv_rms.len() * channels,
        "rms_norm backward: x, dy and inv_rms differ in rows"
    );
    let mut partial_dweights: Vec<Vec<f32>> = Vec::new();
    // SAFETY: `dx`'s chunks of whole rows pair with the same rows of `x`
    // and `dy` and their `inv_rms` (asserted: all of the same rows), and
    // every value of each row is set.
    let dx = unsafe {
        fresh(x.len(), |dx| {
            partial_dweights = dx
                .par_chunks_mut(ROWS_PER_TASK * channels)
                .zip(x.par_chunks(ROWS_PER_TASK * channels))
                .zip(dy.par_chunks(ROWS_PER_TASK * channels))
                .zip(inv_rms.par_chunks(ROWS_PER_TASK))
                .map(|(((dx, x), dy), inv_rms)| {
                    let mut dweight = vec![0.0f32; channels];
                    dispatch(
                        #[inline(always)]
                        || {
                            let rows = dx.chunks_exact_mut(channels).zip(x.chunks_exact(channels));
                            let rows = rows.zip(dy.chunks_exact(channels).zip(inv_rms));
                            for ((dx, x), (dy, &r)) in rows {
                                let dot = simd::dot3(dy, weight, x);
                                let correction = r * r * r / channels as f32 * dot;
                                let columns = dx.iter_mut().zip(x).zip(dy).zip(weight);
                                for ((((dx, &x), &dy), &w), dw) in columns.zip(dweight.iter_mut()) {
                                    dx.write(r * dy * w - x * correction);
                                    *dw += dy * x * r;
                                }
                            }
                        },
                    );
                    dweight
                })
                .collect();
        })
    };
    let mut dweight = vec![0.0f32; channels];
    for partial in partial_dweights {
        for (total, value) in dweight.iter_mut().zip(partial) {
            *total += value;
        }
    }
    (dx, dweight)
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: usize = 5;

    fn inputs(rows: usize) -> (Vec<f32>, Vec<f32>) {
        let x = (0..rows * C)
            .map(|i| ((i * 29 % 13) as f32 - 6.0) * 0.3)
            .collect();
        let w = (0..C).map(|i| 0.5 + i as f32 * 0.25).collect();
        (x, w)
    }

    /// `sum(y * probe)` in f64, straight from the definition.
    fn objective(x: &[f32], w: &[f32], probe: &[f32]) -> f64 {
        x.chunks(C)
            .zip(probe.chunks(C))
            .map(|(row, probe)| {
                let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / C as f64;
                let inv = 1.0 / (ms + 1e-5).sqrt();
                row.iter()
                    .zip(w)
                    .zip(probe)
                    .map(|((&x, &w), &p)| f64::from(x) * inv * f64::from(w) * f64::from(p))
                    .sum::<f64>()
            })
            .sum()
    }

    #[test]
    fn forward_matches_the_definition_and_gradients_match_central_differences() {
        // More rows than one task: partial weight gradients are summed.
        let rows = 70;
        let (x, w) = inputs(rows);
        let probe: Vec<f32> = (0..rows * C)
            .map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.5)
            .collect();
        let (y, inv_rms) = forward(&x, &w, 1e-5);
        let from_y: f64 = y.iter().zip(&probe).map(|(&y, &p)| f64::from(y * p)).sum();
        assert!((from_y - objective(&x, &w, &probe)).abs() < 1e-3);
        let (dx, dw) = backward(&x, &w, &inv_rms, &probe);
        let step = 1e-2f32;
        let numeric = |x: &[f32], w: &[f32], which: usize, index: usize| {
            let (mut xp, mut wp, mut xm, mut wm) = (x.to_vec(), w.to_vec(), x.to_vec(), w.to_vec());
            let (plus, minus) = if which == 0 {
                (&mut xp[index], &mut xm[index])
            } else {
                (&mut wp[index], &mut wm[index])
            };
            *plus += step;
            *minus -= step;
            let width = f64::from(*plus) - f64::from(*minus);
            (objective(&xp, &wp, &probe) - objective(&xm, &wm, &probe)) / width
        };
        for index in (0..x.len()).step_by(7) {
            let expected = numeric(&x, &w, 0, index);
            assert!(
                (f64::from(dx[index]) - expected).abs() < 1e-3,
                "dx[{index}]"
            );
        }
        for (index, &got) in dw.iter().enumerate() {
            let expected = numeric(&x, &w, 1, index);
            assert!(
                (f64::from(got) - expected).abs() < 1e-2 * (1.0 + expected.abs()),
                "dw[{index}]: {got} vs {expected}"
            );
        }
    }

    /// The norm with its output rounded (`--bf16`, every reader a bf16
    /// matmul) changes nothing those readers compute: a bf16 linear layer
    /// after it gives the same output and the same gradients of `x`, the
    /// norm's weight and the layer's weight, bit for bit, as after the
    /// unrounded norm (the layer rounds its input anyway; rounding is the
    /// identity on rounded values, and its gradient passes straight
    /// through). And its output is the unrounded one rounded.
    #[test]
    fn the_rounded_norm_changes_nothing_a_bf16_linear_computes() {
        use crate::kernels::bf16::{round_slice, rounded};
        use crate::kernels::test_util::random;
        use crate::kernels::{Weight16, bf16_linear};
        use crate::tensor::{IntoHostVec, backward, cpu_device, float_tensor, grad, trainable};

        let device = cpu_device(true);
        let (n, c, o) = (37, 48, 29);
        let (x0, g0, w0, dy0) = (
            random(n * c, 11),
            random(c, 12),
            random(o * c, 13),
            random(n * o, 14),
        );
        let run = |round: bool| {
            let x = trainable(float_tensor(x0.clone(), [n, c], &device));
            let gain = trainable(float_tensor(g0.clone(), [1, c], &device));
            let w = trainable(float_tensor(w0.clone(), [o, c], &device));
            let normed = if round {
                bf16_rms_norm(x.clone(), gain.clone(), 1e-5)
            } else {
                rms_norm(x.clone(), gain.clone(), 1e-5)
            }
            .expect("on the CPU");
            let copy = Weight16::Copy(round_slice(&w0).into());
            let y = bf16_linear(normed.clone(), w.clone(), copy).expect("on the CPU");
            let dy = float_tensor(dy0.clone(), [n, o], &device);
            let grads = backward(&(y.clone() * dy).sum());
            let values = |t: Option<crate::tensor::Tensor<2>>| t.expect("a gradient").into_vec();
            (
                normed.into_vec(),
                [
                    y.into_vec(),
                    values(grad(&x, &grads)),
                    values(grad(&gain, &grads)),
                    values(grad(&w, &grads)),
                ],
            )
        };
        let ((plain, theirs), (rounded_norm, ours)) = (run(false), run(true));
        for (what, (a, b)) in ["y", "dx", "d gain", "dW"]
            .iter()
            .zip(ours.iter().zip(&theirs))
        {
            assert_eq!(a, b, "{what}");
        }
        let want: Vec<f32> = plain.iter().map(|&v| rounded(v)).collect();
        assert_eq!(rounded_norm, want, "the output is the norm's, rounded");
        assert_ne!(rounded_norm, plain, "rounding must show in the output");
    }
}
