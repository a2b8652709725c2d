//! Fused SwiGLU gate on host slices: `silu(gate) * up`, forward and
//! backward in one pass each (composed from tensor ops: sigmoid, two
//! products, and about twice as many passes backward), chunks over threads;
//! a CubeCL body for GPUs in `cube.rs`, and the op that runs it with the
//! MLP's `down_proj` on the CPU in `down.rs`. Outputs go into buffers never
//! zeroed first (`fresh.rs`), this module's only `unsafe`.
//!
//! # Shapes
//! `gate`, `up`, `out` and their gradients: `[N, I]`.
#![allow(unsafe_code)]

use burn::tensor::Tensor;

use super::attention::is_cpu;
use super::bf16::{load, rounded, store};
use super::fresh::fresh;
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::simd;
use rayon::prelude::*;

#[cfg(feature = "cube")]
mod cube;
mod down;

pub use down::{bf16_swiglu_down, swiglu_down};

// ---- the differentiable burn op ----

/// `silu(gate) * up`, element-wise; `gate`, `up`: `[N, I]` -> `[N, I]`.
///
/// On a GPU the CubeCL body (`cube.rs`; [`composed_swiglu`] in a build
/// without GPU kernels).
pub fn swiglu(gate: Tensor<2>, up: Tensor<2>) -> Result<Tensor<2>, UnsupportedTensor> {
    if !is_cpu(&gate.device()) {
        return gpu_swiglu([gate, up]);
    }
    apply(SwiGlu, [gate, up])
}

#[cfg(feature = "cube")]
fn gpu_swiglu(inputs: [Tensor<2>; 2]) -> Result<Tensor<2>, UnsupportedTensor> {
    cube::swiglu(inputs)
}

#[cfg(not(feature = "cube"))]
fn gpu_swiglu([gate, up]: [Tensor<2>; 2]) -> Result<Tensor<2>, UnsupportedTensor> {
    Ok(composed_swiglu(gate, up))
}

/// [`swiglu`] under `--bf16`: `gate` and `up` (the rounded outputs of
/// bf16 linear layers) kept for the backward pass as bf16, half their
/// memory and exact; the output rounded to bf16 (kept as f32), as
/// autocast's bf16 `silu` and product give it. A kept op, not recomputed:
/// what it keeps is smaller than its inputs.
pub fn bf16_swiglu(gate: Tensor<2>, up: Tensor<2>) -> Result<Tensor<2>, UnsupportedTensor> {
    if !is_cpu(&gate.device()) {
        return Err(UnsupportedTensor(
            "bf16 SwiGLU runs on the CPU only in this build".into(),
        ));
    }
    apply(Bf16SwiGlu, [gate, up])
}

/// The oracle: `silu(gate) * up` from burn ops.
pub fn composed_swiglu(gate: Tensor<2>, up: Tensor<2>) -> Tensor<2> {
    crate::tensor::silu(gate) * up
}

#[derive(Debug, Clone)]
struct SwiGlu;

impl HostOp<2> for SwiGlu {
    const RECOMPUTE: bool = true;

    fn forward(&self, [gate, up]: [HostTensor<'_>; 2]) -> HostOutput {
        HostOutput {
            values: forward(gate.values, up.values),
            shape: gate.shape.to_vec(),
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [gate, up]: [HostTensor<'_>; 2],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
        _needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        let (d_gate, d_up) = backward(gate.values, up.values, d_out);
        [d_gate, d_up]
    }
}

#[derive(Debug, Clone)]
struct Bf16SwiGlu;

impl HostOp<2> for Bf16SwiGlu {
    const KEEPS_OUTPUT: bool = false;
    /// Both come back from `saved`.
    const KEEPS_INPUTS: bool = false;

    fn forward(&self, [gate, up]: [HostTensor<'_>; 2]) -> HostOutput {
        let values = forward_rounded(gate.values, up.values);
        let mut saved = store(gate.values);
        saved.extend(store(up.values));
        HostOutput {
            values,
            shape: gate.shape.to_vec(),
            saved,
        }
    }

    fn backward(
        &self,
        [gate, _]: [HostTensor<'_>; 2],
        _output: &[f32],
        saved: &[f32],
        d_out: &[f32],
        _needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        let len: usize = gate.shape.iter().product();
        let (gate, up) = saved.split_at(len.div_ceil(2));
        let (d_gate, d_up) = backward(&load(gate, len), &load(up, len), d_out);
        [d_gate, d_up]
    }
}

// ---- the host kernel ----

/// Elements per rayon task.
const ELEMENTS_PER_TASK: usize = 1 << 14;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + simd::exp(-x))
}

/// `silu(gate) * up`, `silu(g) = g * sigmoid(g)`.
pub fn forward(gate: &[f32], up: &[f32]) -> Vec<f32> {
    forward_with::<false>(gate, up)
}

/// [`forward`]'s values rounded to bf16 in the same pass (`--bf16`'s
/// SwiGLU output): the same bits as rounding them afterwards, one pass
/// over `[N, I]` fewer.
pub(crate) fn forward_rounded(gate: &[f32], up: &[f32]) -> Vec<f32> {
    forward_with::<true>(gate, up)
}

fn forward_with<const ROUNDS: bool>(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up differ in length");
    // SAFETY: the output's chunks pair with equally long chunks of `gate`
    // and `up` (asserted: the same length), and each value is set.
    unsafe {
        fresh(gate.len(), |out| {
            out.par_chunks_mut(ELEMENTS_PER_TASK)
                .zip(
                    gate.par_chunks(ELEMENTS_PER_TASK)
                        .zip(up.par_chunks(ELEMENTS_PER_TASK)),
                )
                .for_each(|(out, (gate, up))| {
                    simd::dispatch(
                        #[inline(always)]
                        || {
                            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                                let h = g * sigmoid(g) * u;
                                o.write(if ROUNDS { rounded(h) } else { h });
                            }
                        },
                    );
                });
        })
    }
}

/// `(d_gate, d_up)` given `d_out`:
/// `d_up = d_out * silu(g)`, `d_gate = d_out * u * s * (1 + g * (1 - s))`
/// with `s = sigmoid(g)`.
pub fn backward(gate: &[f32], up: &[f32], d_out: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let n = gate.len();
    assert!(
        up.len() == n && d_out.len() == n,
        "swiglu backward: gate, up and d_out differ in length"
    );
    let mut d_up = Vec::new();
    // SAFETY: the chunks of both outputs pair with equally long chunks of
    // the three inputs (asserted: all `n` long), and each value of both is
    // set.
    let d_gate = unsafe {
        fresh(n, |d_gate| {
            d_up = fresh(n, |d_up| {
                d_gate
                    .par_chunks_mut(ELEMENTS_PER_TASK)
                    .zip(d_up.par_chunks_mut(ELEMENTS_PER_TASK))
                    .zip(gate.par_chunks(ELEMENTS_PER_TASK))
                    .zip(
                        up.par_chunks(ELEMENTS_PER_TASK)
                            .zip(d_out.par_chunks(ELEMENTS_PER_TASK)),
                    )
                    .for_each(|(((d_gate, d_up), gate), (up, d_out))| {
                        simd::dispatch(
                            #[inline(always)]
                            || {
                                let inputs = gate.iter().zip(up).zip(d_out);
                                let outputs = d_gate.iter_mut().zip(d_up.iter_mut());
                                for ((dg, du), ((&g, &u), &d)) in outputs.zip(inputs) {
                                    let s = sigmoid(g);
                                    du.write(d * g * s);
                                    dg.write(d * u * s * (1.0 + g * (1.0 - s)));
                                }
                            },
                        );
                    });
            });
        })
    };
    (d_gate, d_up)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objective(gate: &[f32], up: &[f32], probe: &[f32]) -> f64 {
        gate.iter()
            .zip(up)
            .zip(probe)
            .map(|((&g, &u), &p)| {
                let g = f64::from(g);
                g / (1.0 + (-g).exp()) * f64::from(u) * f64::from(p)
            })
            .sum()
    }

    #[test]
    fn forward_and_gradients_match_the_definition() {
        let n = 3 * ELEMENTS_PER_TASK / 2 + 5;
        let gate: Vec<f32> = (0..n).map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.6).collect();
        let up: Vec<f32> = (0..n).map(|i| ((i * 11 % 7) as f32 - 3.0) * 0.4).collect();
        let probe: Vec<f32> = (0..n).map(|i| ((i * 5 % 3) as f32 - 1.0) * 0.7).collect();
        let out = forward(&gate, &up);
        let from_out: f64 = out
            .iter()
            .zip(&probe)
            .map(|(&o, &p)| f64::from(o * p))
            .sum();
        let expected = objective(&gate, &up, &probe);
        assert!((from_out - expected).abs() < 1e-4 * (1.0 + expected.abs()));
        let (d_gate, d_up) = backward(&gate, &up, &probe);
        let step = 1e-2f32;
        for index in (0..n).step_by(997) {
            for which in 0..2 {
                let (mut gp, mut up_p, mut gm, mut up_m) =
                    (gate.clone(), up.clone(), gate.clone(), up.clone());
                let (plus, minus) = if which == 0 {
                    (&mut gp[index], &mut gm[index])
                } else {
                    (&mut up_p[index], &mut up_m[index])
                };
                *plus += step;
                *minus -= step;
                let width = f64::from(*plus) - f64::from(*minus);
                let numeric =
                    (objective(&gp, &up_p, &probe) - objective(&gm, &up_m, &probe)) / width;
                let got = f64::from(if which == 0 {
                    d_gate[index]
                } else {
                    d_up[index]
                });
                assert!(
                    (got - numeric).abs() < 1e-3,
                    "input {which}[{index}]: {got} vs {numeric}"
                );
            }
        }
    }

    /// The bf16 op on bf16 values (what bf16 linear layers hand it): its
    /// output is the f32 kernel's rounded, its gradients the f32 kernel's
    /// exactly (the stored inputs come back bit for bit), and it keeps
    /// half the bytes of its inputs.
    #[test]
    fn bf16_op_is_the_f32_kernel_on_stored_values() {
        use crate::kernels::bf16::rounded;
        use crate::tensor::{
            IntoHostVec, backward as run_backward, cpu_device, float_tensor, grad, trainable,
        };
        let (rows, cols) = (37, 301);
        let n = rows * cols;
        let gate: Vec<f32> = (0..n)
            .map(|i| rounded(((i * 31 % 17) as f32 - 8.0) * 0.61))
            .collect();
        let up: Vec<f32> = (0..n)
            .map(|i| rounded(((i * 11 % 7) as f32 - 3.0) * 0.43))
            .collect();
        let probe: Vec<f32> = (0..n).map(|i| ((i * 5 % 3) as f32 - 1.0) * 0.7).collect();
        let device = cpu_device(true);
        let g = trainable(float_tensor(gate.clone(), [rows, cols], &device));
        let u = trainable(float_tensor(up.clone(), [rows, cols], &device));
        let out = bf16_swiglu(g.clone(), u.clone()).expect("CPU");
        let grads =
            run_backward(&(out.clone() * float_tensor(probe.clone(), [rows, cols], &device)).sum());
        let want: Vec<f32> = forward(&gate, &up).into_iter().map(rounded).collect();
        assert_eq!(out.into_vec(), want);
        let (d_gate, d_up) = backward(&gate, &up, &probe);
        assert_eq!(grad(&g, &grads).expect("d gate").into_vec(), d_gate);
        assert_eq!(grad(&u, &grads).expect("d up").into_vec(), d_up);
        let saved = Bf16SwiGlu
            .forward([
                HostTensor {
                    values: &gate,
                    shape: &[rows, cols],
                },
                HostTensor {
                    values: &up,
                    shape: &[rows, cols],
                },
            ])
            .saved;
        assert_eq!(
            saved.len(),
            2 * n.div_ceil(2),
            "two inputs in half the f32 slots each"
        );
    }
}
