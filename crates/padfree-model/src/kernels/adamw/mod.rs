//! AdamW's update on a device: the values, both moments and the gradient
//! read once and the three written once, in one kernel launch for a
//! parameter (`cube.rs`) where burn's composed ops take fifteen, each a
//! launch and a buffer from the pool, and one launch for four parameters
//! ([`adamw_update_all`]). On an H200 a SmolLM2-135M step of
//! ~2,300 tokens took ~234 ms for 25 ms of arithmetic at the f32 peak; the
//! composed update is fifteen launches for each of its 272 tensors, about
//! 4,100 a step.
//!
//! The formula is torch's `AdamW` (decoupled weight decay), as the host
//! loop in padfree-train applies it; [`composed_adamw_update`] is the same
//! formula in burn ops, in the same order, and the oracle.
//!
//! # Shapes
//! `values`, `exp_avg`, `exp_avg_sq`, `grad`: one parameter's, all the
//! same shape `[R, C]`, f32.

use crate::tensor::Tensor;

#[cfg(feature = "cube")]
mod cube;

/// Parameters one launch of [`adamw_update_all`] updates on a CubeCL
/// device. A caller that hands it a group at a time keeps one group's old
/// and new state alive at once, not every parameter's.
pub const ADAMW_GROUP: usize = 4;

/// One optimizer step's scalars, the same for every parameter of a group.
/// The host works them out in f64 and rounds each to f32 once, as the
/// composed path's scalar ops receive them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Multiplies the gradient first (the gradient clipping's factor, 1
    /// when it does not clip).
    pub grad_scale: f32,
    /// `1 - lr * weight_decay`, or 1 for a parameter that does not decay.
    pub decay: f32,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// The second moment's decay, `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias_correction2_sqrt: f32,
    /// Added to the denominator, after the bias correction (torch's order).
    pub eps: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
}

/// A parameter's `[values, exp_avg, exp_avg_sq]`, what a step reads and
/// gives back.
pub type AdamWState = [Tensor<2>; 3];

/// The parameter's new [`AdamWState`] after one step with `grad`. On a
/// CubeCL device one fused kernel; elsewhere (and for a tensor the kernel
/// cannot take) [`composed_adamw_update`].
pub fn adamw_update(state: AdamWState, grad: &Tensor<2>, step: &AdamWStep) -> AdamWState {
    #[cfg(feature = "cube")]
    if let Some(updated) = fused_adamw_update(&state, grad, step) {
        return updated;
    }
    composed_adamw_update(state, grad, step)
}

/// The fused kernel alone: `None` unless every tensor is on a CubeCL device.
#[cfg(feature = "cube")]
pub fn fused_adamw_update(
    state: &AdamWState,
    grad: &Tensor<2>,
    step: &AdamWStep,
) -> Option<AdamWState> {
    if super::attention::is_cpu(&state[0].device()) {
        return None;
    }
    cube::adamw_update(state, grad, step)
}

/// [`adamw_update`] of several parameters with one step's scalars: on a
/// CubeCL device a kernel launch per four (`cube.rs`), where a launch a
/// parameter made 272 launches of SmolLM2-135M's step (71 now: 211
/// parameters that decay and 61 that do not, a class at a time); elsewhere
/// each parameter's [`adamw_update`]. The same values as one parameter at
/// a time: the same expression per element.
pub fn adamw_update_all(
    states: Vec<AdamWState>,
    grads: &[Tensor<2>],
    step: &AdamWStep,
) -> Vec<AdamWState> {
    #[cfg(feature = "cube")]
    if let Some(updated) = fused_adamw_update_group(&states, grads, step) {
        return updated;
    }
    states
        .into_iter()
        .zip(grads)
        .map(|(state, grad)| adamw_update(state, grad, step))
        .collect()
}

/// The group kernel alone: `None` unless every tensor is on a CubeCL
/// device.
#[cfg(feature = "cube")]
pub fn fused_adamw_update_group(
    states: &[AdamWState],
    grads: &[Tensor<2>],
    step: &AdamWStep,
) -> Option<Vec<AdamWState>> {
    assert_eq!(states.len(), grads.len(), "AdamW: a gradient per parameter");
    if let Some([values, ..]) = states.first()
        && super::attention::is_cpu(&values.device())
    {
        return None;
    }
    cube::adamw_update_group(states, grads, step)
}

/// Whether [`fused_adamw_update_group`] runs groups of parameters on
/// `reference`'s device (it binds 30 buffers a launch), rather than a
/// launch a parameter; `None` off a CubeCL device.
#[cfg(feature = "cube")]
pub fn adamw_groups_fit(reference: &Tensor<2>) -> Option<bool> {
    cube::groups_fit(reference)
}

/// The oracle: the update in burn's tensor ops, one op per term.
pub fn composed_adamw_update(
    [values, exp_avg, exp_avg_sq]: AdamWState,
    grad: &Tensor<2>,
    step: &AdamWStep,
) -> AdamWState {
    let g = grad.clone().mul_scalar(step.grad_scale);
    let p = values.mul_scalar(step.decay);
    let m = exp_avg.clone() + (g.clone() - exp_avg).mul_scalar(step.one_minus_beta1);
    let v = exp_avg_sq.mul_scalar(step.beta2) + (g.clone() * g).mul_scalar(step.one_minus_beta2);
    let denom = v
        .clone()
        .sqrt()
        .div_scalar(step.bias_correction2_sqrt)
        .add_scalar(step.eps);
    let p = p - (m.clone() / denom).mul_scalar(step.step_size);
    [p, m, v]
}
