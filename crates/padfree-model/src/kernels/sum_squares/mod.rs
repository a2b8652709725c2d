//! Every tensor's sum of squares, one value per tensor: the gradient norm's
//! per-parameter terms. On a GPU two kernels (`cube.rs`): one launch per
//! tensor writes a partial sum per block of its elements into one shared
//! buffer, then one launch adds each tensor's partials, in a fixed order.
//! Composed from burn ops ([`composed_sums_of_squares`], the oracle) it is
//! four launches a tensor (the square, a zeroed output, the reduction, and
//! the copy into the result), ~1,100 a step for SmolLM2-135M's 272 tensors
//! where this takes 273.
//!
//! # Shapes
//! `tensors`: any 2-D shapes, f32; the result `[P]`, one per tensor.

use crate::tensor::{Tensor, cat};

#[cfg(feature = "cube")]
mod cube;

/// `sum(x^2)` of each of `tensors`, in f32, as a `[P]` tensor on their
/// device (empty input: `None`). On a CubeCL device the fused kernels;
/// elsewhere [`composed_sums_of_squares`].
pub fn sums_of_squares(tensors: &[Tensor<2>]) -> Option<Tensor<1>> {
    #[cfg(feature = "cube")]
    if let Some(sums) = fused_sums_of_squares(tensors) {
        return Some(sums);
    }
    composed_sums_of_squares(tensors)
}

/// The fused kernels alone: `None` for an empty list or tensors not on a
/// CubeCL device.
#[cfg(feature = "cube")]
pub fn fused_sums_of_squares(tensors: &[Tensor<2>]) -> Option<Tensor<1>> {
    if super::attention::is_cpu(&tensors.first()?.device()) {
        return None;
    }
    cube::sums_of_squares(tensors)
}

/// The oracle: each tensor squared and summed by burn, the sums
/// concatenated.
pub fn composed_sums_of_squares(tensors: &[Tensor<2>]) -> Option<Tensor<1>> {
    if tensors.is_empty() {
        return None;
    }
    Some(cat(
        tensors
            .iter()
            .map(|t| t.clone().powi_scalar(2).sum())
            .collect(),
        0,
    ))
}
