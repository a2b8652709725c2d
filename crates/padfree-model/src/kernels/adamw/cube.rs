//! The CubeCL body of [`super::adamw_update`]: one invocation per element,
//! the terms in the composed oracle's order, each rounded to f32 as there
//! (a compiler may still contract a product and a sum into one FMA, so the
//! two agree to an f32 rounding or so, not to the bit).
//!
//! # Shapes
//! every tensor `[R, C]`, f32; the inputs in any strides, the outputs
//! contiguous.

use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{AdamWState, AdamWStep};
use crate::kernels::cube_op::{empty_like, grid};
use crate::tensor::Tensor as BurnTensor;

/// Where element `(row, col)` of `t` lies, whatever its strides: a
/// gradient may arrive as a transposed view, read in place instead of
/// copied first.
#[cube]
fn at(t: &Tensor<f32>, row: usize, col: usize) -> usize {
    row * t.stride(0) + col * t.stride(1)
}

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn update_kernel(
    values: &Tensor<f32>,
    exp_avg: &Tensor<f32>,
    exp_avg_sq: &Tensor<f32>,
    grad: &Tensor<f32>,
    new_values: &mut Tensor<f32>,
    new_exp_avg: &mut Tensor<f32>,
    new_exp_avg_sq: &mut Tensor<f32>,
    grad_scale: f32,
    decay: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    step_size: f32,
) {
    let i = ABSOLUTE_POS;
    if i < new_values.len() {
        let cols = new_values.shape(1);
        let (row, col) = (i / cols, i % cols);
        let g = grad[at(grad, row, col)] * grad_scale;
        let p = values[at(values, row, col)] * decay;
        let m0 = exp_avg[at(exp_avg, row, col)];
        let m = m0 + (g - m0) * one_minus_beta1;
        let v = exp_avg_sq[at(exp_avg_sq, row, col)] * beta2 + (g * g) * one_minus_beta2;
        let denom = v.sqrt() / bias_correction2_sqrt + eps;
        new_values[i] = p - (m / denom) * step_size;
        new_exp_avg[i] = m;
        new_exp_avg_sq[i] = v;
    }
}

/// The fused update, or `None` for tensors not on burn's CubeCL backend
/// (the caller composes it then).
pub(super) fn adamw_update(
    [values, exp_avg, exp_avg_sq]: &AdamWState,
    grad: &BurnTensor<2>,
    step: &AdamWStep,
) -> Option<AdamWState> {
    let primitive = |t: &BurnTensor<2>| t.clone().try_into_primitive::<CubeBackend>().ok();
    let (p, m, v, g) = (
        primitive(values)?,
        primitive(exp_avg)?,
        primitive(exp_avg_sq)?,
        primitive(grad)?,
    );
    let shape = p.meta.shape().to_vec();
    let n = shape.iter().product();
    let out = || empty_like(&p, shape.clone());
    let (new_p, new_m, new_v) = (out(), out(), out());
    let (count, dim) = grid(&p, n);
    let arg = |t: &CubeTensor| t.clone().into_tensor_arg();
    update_kernel::launch(
        &p.client,
        count,
        dim,
        arg(&p),
        arg(&m),
        arg(&v),
        arg(&g),
        new_p.clone().into_tensor_arg(),
        new_m.clone().into_tensor_arg(),
        new_v.clone().into_tensor_arg(),
        step.grad_scale,
        step.decay,
        step.one_minus_beta1,
        step.beta2,
        step.one_minus_beta2,
        step.bias_correction2_sqrt,
        step.eps,
        step.step_size,
    );
    let wrap = |t: CubeTensor| BurnTensor::from_primitive::<CubeBackend>(t);
    Some([wrap(new_p), wrap(new_m), wrap(new_v)])
}
