//! Rotary position embedding (HF's rotate-half layout) as one host op: one
//! pass forward and one backward, where the composed form takes two
//! slices, a negation, a concatenation, two products and a sum forward
//! (each a fresh tensor) and about twice as many passes backward, for the
//! queries and the keys of every layer. The rotation is linear in `x` and
//! its tables are constants, so the backward pass needs only `d_out`: the
//! op keeps neither its input nor its output.
//!
//! The products and sums are the composed form's own, in its order
//! (`x1 c + (-x2) s`, no fused multiply-add), so the two agree to the bit.
//!
//! # Shapes
//! `N` tokens, `H` heads, `D` head width (even), `P = D / 2` pairs;
//! `x`, `out` and their gradients `[N, H, D]`, the tables `[N, P]`.
//!
//! Outputs go into buffers never zeroed first (`fresh.rs`), this module's
//! only `unsafe`.
#![allow(unsafe_code)]

use std::sync::Arc;

use rayon::prelude::*;

use super::attention::is_cpu;
use super::fresh::fresh;
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::simd;
use crate::tensor::{Tensor, cat, narrow};

#[cfg(feature = "cube")]
mod cube;

/// `cos` and `sin` of every token's angles, `[N, P]`: pair `i` of a token
/// at position `p` turns by `p * theta^(-2i/D)`.
#[derive(Debug, Clone)]
pub struct RopeTables {
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
    pairs: usize,
}

impl RopeTables {
    /// The tables for tokens at `positions` (`[N]`); f32 throughout, as
    /// transformers computes them, so positions far from 0 round the same
    /// way.
    pub fn new(positions: &[u32], head_dim: usize, theta: f64) -> Self {
        let pairs = head_dim / 2;
        let inv_freq: Vec<f32> = (0..pairs)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(positions.len() * pairs);
        let mut sin = Vec::with_capacity(positions.len() * pairs);
        for &position in positions {
            for &freq in &inv_freq {
                let angle = position as f32 * freq;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Self {
            cos: Arc::new(cos),
            sin: Arc::new(sin),
            pairs,
        }
    }

    /// `(cos, sin)`, `[N, P]` each.
    pub fn values(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }
}

// ---- the differentiable burn op ----

/// Rotates `x` (`[N, H, D]`) by the tables' angles, one token per row: the
/// host kernel on the CPU, the CubeCL kernel (`rope/cube.rs`) on a GPU,
/// which reads the `[N, 1, D]` device tables `cos` and `sin`.
pub fn rope(
    x: Tensor<3>,
    tables: &RopeTables,
    cos: &Tensor<3>,
    sin: &Tensor<3>,
) -> Result<Tensor<3>, UnsupportedTensor> {
    if !is_cpu(&x.device()) {
        return gpu_rope(x, cos, sin);
    }
    let [n, _, d] = x.dims();
    if tables.cos.len() != n * tables.pairs || d != 2 * tables.pairs {
        return Err(UnsupportedTensor(format!(
            "rotary tables for {} tokens of head width {}, queries {:?}",
            tables.cos.len() / tables.pairs.max(1),
            2 * tables.pairs,
            x.dims()
        )));
    }
    apply::<_, 1, 3, 3>(Rotate(tables.clone()), [x])
}

#[cfg(feature = "cube")]
fn gpu_rope(
    x: Tensor<3>,
    cos: &Tensor<3>,
    sin: &Tensor<3>,
) -> Result<Tensor<3>, UnsupportedTensor> {
    cube::rope(x, cos, sin)
}

/// Without GPU kernels, the composed form.
#[cfg(not(feature = "cube"))]
fn gpu_rope(
    x: Tensor<3>,
    cos: &Tensor<3>,
    sin: &Tensor<3>,
) -> Result<Tensor<3>, UnsupportedTensor> {
    Ok(composed_rope(x, cos, sin))
}

/// The oracle: `x * cos + rotate_half(x) * sin` from burn
/// ops, with `cos`, `sin` `[N, 1, D]` (each pair's value twice).
pub fn composed_rope(x: Tensor<3>, cos: &Tensor<3>, sin: &Tensor<3>) -> Tensor<3> {
    let half = x.dims()[2] / 2;
    let x1 = narrow(x.clone(), 2, 0, half);
    let x2 = narrow(x.clone(), 2, half, half);
    let rotated = cat(vec![x2.neg(), x1], 2);
    x * cos.clone() + rotated * sin.clone()
}

#[derive(Debug, Clone)]
struct Rotate(RopeTables);

impl HostOp<1> for Rotate {
    const KEEPS_OUTPUT: bool = false;
    const KEEPS_INPUTS: bool = false;

    fn forward(&self, [x]: [HostTensor<'_>; 1]) -> HostOutput {
        HostOutput {
            values: turn(x.values, x.shape, &self.0, Direction::Forward),
            shape: x.shape.to_vec(),
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [x]: [HostTensor<'_>; 1],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
        _needed: [bool; 1],
    ) -> [Vec<f32>; 1] {
        [turn(d_out, x.shape, &self.0, Direction::Back)]
    }
}

// ---- the host kernel ----

/// Elements per rayon task, in whole tokens.
const ELEMENTS_PER_TASK: usize = 1 << 14;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// `(x1 c - x2 s, x2 c + x1 s)`.
    Forward,
    /// The transpose, for gradients: `(g1 c + g2 s, g2 c - g1 s)`.
    Back,
}

/// `values` (`[N, H, D]`) turned by the tables, forward or back.
fn turn(values: &[f32], shape: &[usize], tables: &RopeTables, direction: Direction) -> Vec<f32> {
    let (heads, d) = (shape[1], shape[2]);
    let pairs = d / 2;
    let token = heads * d;
    let tokens_per_task = (ELEMENTS_PER_TASK / token.max(1)).max(1);
    assert!(
        d.is_multiple_of(2) && values.len().is_multiple_of(token.max(1)),
        "rope: values of {} for heads of {d}",
        values.len()
    );
    // SAFETY: the output's chunks of whole tokens pair with the same
    // tokens of `values` (asserted: whole tokens of whole pairs), and each
    // head's `2P` values are set through its two halves.
    unsafe {
        fresh(values.len(), |out| {
            out.par_chunks_mut(tokens_per_task * token)
                .zip(values.par_chunks(tokens_per_task * token))
                .enumerate()
                .for_each(|(task, (out, values))| {
                    let first = task * tokens_per_task;
                    simd::dispatch(
                        #[inline(always)]
                        || {
                            for (t, (out, values)) in
                                out.chunks_mut(token).zip(values.chunks(token)).enumerate()
                            {
                                let at = (first + t) * pairs;
                                let cos = &tables.cos[at..at + pairs];
                                let sin = &tables.sin[at..at + pairs];
                                for (out, x) in out.chunks_mut(d).zip(values.chunks(d)) {
                                    let (o1, o2) = out.split_at_mut(pairs);
                                    let (x1, x2) = x.split_at(pairs);
                                    match direction {
                                        Direction::Forward => {
                                            for i in 0..pairs {
                                                o1[i].write(x1[i] * cos[i] + -x2[i] * sin[i]);
                                                o2[i].write(x2[i] * cos[i] + x1[i] * sin[i]);
                                            }
                                        }
                                        Direction::Back => {
                                            for i in 0..pairs {
                                                o1[i].write(x1[i] * cos[i] + x2[i] * sin[i]);
                                                o2[i].write(x2[i] * cos[i] + -x1[i] * sin[i]);
                                            }
                                        }
                                    }
                                }
                            }
                        },
                    );
                });
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::random;
    use crate::tensor::{IntoHostVec, backward, cpu_device, float_tensor, grad, trainable};

    /// The `[N, 1, D]` tensors the composed form broadcasts.
    fn full_tables(
        tables: &RopeTables,
        n: usize,
        device: &crate::tensor::Device,
    ) -> [Tensor<3>; 2] {
        let p = tables.pairs;
        let (cos, sin) = tables.values();
        let widen = |half: &[f32]| -> Vec<f32> {
            half.chunks(p)
                .flat_map(|row| row.iter().chain(row).copied())
                .collect()
        };
        [
            float_tensor(widen(cos), [n, 1, 2 * p], device),
            float_tensor(widen(sin), [n, 1, 2 * p], device),
        ]
    }

    /// The op against the composed form, output and gradient, on sizes
    /// below and above one task, positions restarting as in a flattened
    /// batch: the same products in the same order, so equal to the bit.
    #[test]
    fn op_matches_the_composed_form_exactly() {
        let device = cpu_device(true);
        for (lens, h, d) in [
            (vec![1, 2], 1, 2),
            (vec![7, 30, 3], 3, 16),
            (vec![200, 90], 9, 64),
        ] {
            let positions: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
            let n = positions.len();
            let tables = RopeTables::new(&positions, d, 10_000.0);
            let [cos, sin] = full_tables(&tables, n, &device);
            let (x0, dy0) = (random(n * h * d, 5), random(n * h * d, 6));
            let run = |fused: bool| {
                let x = trainable(float_tensor(x0.clone(), [n, h, d], &device));
                let y = if fused {
                    rope(x.clone(), &tables, &cos, &sin).expect("f32 on the CPU")
                } else {
                    composed_rope(x.clone(), &cos, &sin)
                };
                let dy = float_tensor(dy0.clone(), [n, h, d], &device);
                let grads = backward(&(y.clone() * dy).sum());
                (y.into_vec(), grad(&x, &grads).expect("dx").into_vec())
            };
            let (ours, theirs) = (run(true), run(false));
            assert_eq!(ours.0, theirs.0, "y, {n} tokens, {h}x{d}");
            assert_eq!(ours.1, theirs.1, "dx, {n} tokens, {h}x{d}");
        }
    }

    /// The rotation against its definition in f64: pair `i` of a token at
    /// position `p` turns by `p theta^(-2i/D)`, and the backward pass turns
    /// back (a rotation's transpose is its inverse).
    #[test]
    fn rotation_matches_its_definition_and_back_undoes_it() {
        let (h, d) = (2, 8);
        let positions = [0u32, 1, 5, 4000];
        let tables = RopeTables::new(&positions, d, 500_000.0);
        let x = random(positions.len() * h * d, 9);
        let shape = [positions.len(), h, d];
        let y = turn(&x, &shape, &tables, Direction::Forward);
        for (t, &p) in positions.iter().enumerate() {
            for head in 0..h {
                for i in 0..d / 2 {
                    let freq = 500_000f64.powf(-((2 * i) as f64) / d as f64);
                    let (s, c) = (f64::from(p) * freq).sin_cos();
                    let at = (t * h + head) * d;
                    let (a, b) = (f64::from(x[at + i]), f64::from(x[at + i + d / 2]));
                    let (ya, yb) = (a * c - b * s, b * c + a * s);
                    assert!(
                        (f64::from(y[at + i]) - ya).abs() < 2e-3,
                        "token {t} pair {i}"
                    );
                    assert!(
                        (f64::from(y[at + i + d / 2]) - yb).abs() < 2e-3,
                        "token {t} pair {i}"
                    );
                }
            }
        }
        let back = turn(&y, &shape, &tables, Direction::Back);
        for (a, b) in back.iter().zip(&x) {
            assert!((a - b).abs() < 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
