//! The CubeCL bodies of [`super::adamw_update`] and
//! [`super::adamw_update_all`]: one invocation per element, the terms in
//! the composed oracle's order, each rounded to f32 as there (a compiler
//! may still contract a product and a sum into one FMA, so the two agree
//! to an f32 rounding or so, not to the bit).
//!
//! A group launch takes [`GROUP`] parameters as named arguments (seven
//! bindings each): its grid covers their elements end to end, and an
//! invocation finds its parameter by the running sum of the lengths. The
//! element's arithmetic is the one-parameter kernel's, the same expression
//! ([`update_element()`]).
//!
//! # Shapes
//! every tensor `[R, C]`, f32; the inputs in any strides, the outputs
//! contiguous.

use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{AdamWState, AdamWStep};
use crate::kernels::cube_op::{at, empty_like, grid};
use crate::tensor::Tensor as BurnTensor;

/// The scalars of one step, as the kernels take them.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
struct StepScalars {
    grad_scale: f32,
    decay: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    step_size: f32,
}

/// Element `i` (row-major) of one parameter: both kernels' arithmetic.
#[allow(clippy::too_many_arguments)]
#[cube]
fn update_element(
    values: &Tensor<f32>,
    exp_avg: &Tensor<f32>,
    exp_avg_sq: &Tensor<f32>,
    grad: &Tensor<f32>,
    new_values: &mut Tensor<f32>,
    new_exp_avg: &mut Tensor<f32>,
    new_exp_avg_sq: &mut Tensor<f32>,
    s: &StepScalars,
    i: usize,
) {
    let cols = new_values.shape(1);
    let (row, col) = (i / cols, i % cols);
    let g = grad[at(grad, row, col)] * s.grad_scale;
    let p = values[at(values, row, col)] * s.decay;
    let m0 = exp_avg[at(exp_avg, row, col)];
    let m = m0 + (g - m0) * s.one_minus_beta1;
    let v = exp_avg_sq[at(exp_avg_sq, row, col)] * s.beta2 + (g * g) * s.one_minus_beta2;
    let denom = v.sqrt() / s.bias_correction2_sqrt + s.eps;
    new_values[i] = p - (m / denom) * s.step_size;
    new_exp_avg[i] = m;
    new_exp_avg_sq[i] = v;
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
    s: StepScalars,
) {
    let i = ABSOLUTE_POS;
    if i < new_values.len() {
        update_element(
            values,
            exp_avg,
            exp_avg_sq,
            grad,
            new_values,
            new_exp_avg,
            new_exp_avg_sq,
            &s,
            i,
        );
    }
}

/// Parameters a group launch updates: CubeCL 0.11's tensors are unsized,
/// so a kernel cannot take a sequence of them, and the group is four
/// named parameters (28 bindings and the kernel's own two:
/// [`fits_a_group`]).
const GROUP: usize = super::ADAMW_GROUP;

/// Four parameters' update in one launch: the grid covers their elements
/// end to end; an invocation finds its parameter by the running sum of
/// the lengths.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn update_group_kernel(
    values_0: &Tensor<f32>,
    exp_avg_0: &Tensor<f32>,
    exp_avg_sq_0: &Tensor<f32>,
    grad_0: &Tensor<f32>,
    values_1: &Tensor<f32>,
    exp_avg_1: &Tensor<f32>,
    exp_avg_sq_1: &Tensor<f32>,
    grad_1: &Tensor<f32>,
    values_2: &Tensor<f32>,
    exp_avg_2: &Tensor<f32>,
    exp_avg_sq_2: &Tensor<f32>,
    grad_2: &Tensor<f32>,
    values_3: &Tensor<f32>,
    exp_avg_3: &Tensor<f32>,
    exp_avg_sq_3: &Tensor<f32>,
    grad_3: &Tensor<f32>,
    new_values_0: &mut Tensor<f32>,
    new_exp_avg_0: &mut Tensor<f32>,
    new_exp_avg_sq_0: &mut Tensor<f32>,
    new_values_1: &mut Tensor<f32>,
    new_exp_avg_1: &mut Tensor<f32>,
    new_exp_avg_sq_1: &mut Tensor<f32>,
    new_values_2: &mut Tensor<f32>,
    new_exp_avg_2: &mut Tensor<f32>,
    new_exp_avg_sq_2: &mut Tensor<f32>,
    new_values_3: &mut Tensor<f32>,
    new_exp_avg_3: &mut Tensor<f32>,
    new_exp_avg_sq_3: &mut Tensor<f32>,
    s: StepScalars,
) {
    let pos = ABSOLUTE_POS;
    let end_0 = new_values_0.len();
    let end_1 = end_0 + new_values_1.len();
    let end_2 = end_1 + new_values_2.len();
    let end_3 = end_2 + new_values_3.len();
    if pos < end_0 {
        update_element(
            values_0,
            exp_avg_0,
            exp_avg_sq_0,
            grad_0,
            new_values_0,
            new_exp_avg_0,
            new_exp_avg_sq_0,
            &s,
            pos,
        );
    } else if pos < end_1 {
        update_element(
            values_1,
            exp_avg_1,
            exp_avg_sq_1,
            grad_1,
            new_values_1,
            new_exp_avg_1,
            new_exp_avg_sq_1,
            &s,
            pos - end_0,
        );
    } else if pos < end_2 {
        update_element(
            values_2,
            exp_avg_2,
            exp_avg_sq_2,
            grad_2,
            new_values_2,
            new_exp_avg_2,
            new_exp_avg_sq_2,
            &s,
            pos - end_1,
        );
    } else if pos < end_3 {
        update_element(
            values_3,
            exp_avg_3,
            exp_avg_sq_3,
            grad_3,
            new_values_3,
            new_exp_avg_3,
            new_exp_avg_sq_3,
            &s,
            pos - end_2,
        );
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
        scalars(step),
    );
    let wrap = |t: CubeTensor| BurnTensor::from_primitive::<CubeBackend>(t);
    Some([wrap(new_p), wrap(new_m), wrap(new_v)])
}

fn scalars(step: &AdamWStep) -> StepScalarsLaunch {
    StepScalarsLaunch::new(
        step.grad_scale,
        step.decay,
        step.one_minus_beta1,
        step.beta2,
        step.one_minus_beta2,
        step.bias_correction2_sqrt,
        step.eps,
        step.step_size,
    )
}

/// Whether `p`'s device binds a group launch's 28 buffers and the
/// kernel's metadata and scalars. Lavapipe's limit, as wgpu caps it, is
/// just enough (a margin of two more turned the groups off there).
fn fits_a_group(p: &CubeTensor) -> bool {
    p.client.properties().hardware.max_bindings as usize >= 7 * GROUP + 2
}

/// Whether a group launch runs on `reference`'s device (`None` off burn's
/// CubeCL backend).
pub(super) fn groups_fit(reference: &BurnTensor<2>) -> Option<bool> {
    let p = reference.clone().try_into_primitive::<CubeBackend>().ok()?;
    Some(fits_a_group(&p))
}

/// [`adamw_update`] of every parameter of `states` with the same `step`:
/// a launch per [`GROUP`] of them, the last few one launch each; `None` if
/// any tensor is not on burn's CubeCL backend.
pub(super) fn adamw_update_group(
    states: &[AdamWState],
    grads: &[BurnTensor<2>],
    step: &AdamWStep,
) -> Option<Vec<AdamWState>> {
    let primitive = |t: &BurnTensor<2>| t.clone().try_into_primitive::<CubeBackend>().ok();
    let mut inputs = Vec::with_capacity(states.len());
    for ([values, exp_avg, exp_avg_sq], grad) in states.iter().zip(grads) {
        inputs.push([
            primitive(values)?,
            primitive(exp_avg)?,
            primitive(exp_avg_sq)?,
            primitive(grad)?,
        ]);
    }
    let Some(first) = inputs.first() else {
        return Some(Vec::new());
    };
    let groups = if fits_a_group(&first[0]) {
        inputs.len() / GROUP
    } else {
        0
    };
    let wrap = |t: CubeTensor| BurnTensor::from_primitive::<CubeBackend>(t);
    let mut updated = Vec::with_capacity(inputs.len());
    for group in inputs[..groups * GROUP].chunks_exact(GROUP) {
        let outputs: Vec<[CubeTensor; 3]> = group
            .iter()
            .map(|[p, ..]| {
                let shape = p.meta.shape().to_vec();
                std::array::from_fn(|_| empty_like(p, shape.clone()))
            })
            .collect();
        let total: usize = group
            .iter()
            .map(|[p, ..]| p.meta.shape().iter().product::<usize>())
            .sum();
        let (count, dim) = grid(&group[0][0], total);
        let i = |t: usize, k: usize| group[t][k].clone().into_tensor_arg();
        let o = |t: usize, k: usize| outputs[t][k].clone().into_tensor_arg();
        update_group_kernel::launch(
            &group[0][0].client,
            count,
            dim,
            i(0, 0),
            i(0, 1),
            i(0, 2),
            i(0, 3),
            i(1, 0),
            i(1, 1),
            i(1, 2),
            i(1, 3),
            i(2, 0),
            i(2, 1),
            i(2, 2),
            i(2, 3),
            i(3, 0),
            i(3, 1),
            i(3, 2),
            i(3, 3),
            o(0, 0),
            o(0, 1),
            o(0, 2),
            o(1, 0),
            o(1, 1),
            o(1, 2),
            o(2, 0),
            o(2, 1),
            o(2, 2),
            o(3, 0),
            o(3, 1),
            o(3, 2),
            scalars(step),
        );
        updated.extend(outputs.into_iter().map(|o| o.map(wrap)));
    }
    // The last few (fewer than a group), a launch each.
    for (state, grad) in states.iter().zip(grads).skip(groups * GROUP) {
        updated.push(adamw_update(state, grad, step)?);
    }
    Some(updated)
}
