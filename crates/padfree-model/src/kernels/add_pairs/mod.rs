//! `a + b` of many pairs of tensors at once: gradient accumulation's sum
//! of each parameter's gradient so far and the next micro-batch's. On a
//! GPU one kernel launch adds eight pairs (`cube.rs`), where burn's `add`
//! takes a launch a pair: 272 a micro-batch after the first for
//! SmolLM2-135M, 34 this way. Elsewhere, and as the oracle, burn's `add`
//! per pair ([`composed_add_pairs`]). One f32 addition per element either
//! way, so the same bits.
//!
//! # Shapes
//! each pair's `a` and `b` the same `[R, C]` (any strides); each sum
//! `[R, C]`.

use crate::tensor::Tensor;

#[cfg(feature = "cube")]
mod cube;

/// Pairs one launch of [`add_pairs`] adds on a GPU.
pub const ADD_PAIRS_GROUP: usize = 8;

/// `a + b` of every pair, in order: on a CubeCL device a launch per
/// [`ADD_PAIRS_GROUP`] pairs (the last few a launch each); elsewhere
/// [`composed_add_pairs`].
///
/// # Panics
/// If a pair's shapes differ.
pub fn add_pairs(pairs: Vec<(Tensor<2>, Tensor<2>)>) -> Vec<Tensor<2>> {
    for (a, b) in &pairs {
        assert_eq!(a.dims(), b.dims(), "add_pairs: a pair of different shapes");
    }
    #[cfg(feature = "cube")]
    let pairs = match on_device(pairs) {
        Ok(sums) => return sums,
        Err(pairs) => pairs,
    };
    composed_add_pairs(pairs)
}

/// The group kernel, or the pairs back off a CubeCL device (on the CPU).
#[cfg(feature = "cube")]
fn on_device(
    pairs: Vec<(Tensor<2>, Tensor<2>)>,
) -> Result<Vec<Tensor<2>>, Vec<(Tensor<2>, Tensor<2>)>> {
    match pairs.first() {
        Some((a, _)) if super::attention::is_cpu(&a.device()) => Err(pairs),
        _ => cube::add_pairs(pairs),
    }
}

/// The group kernel alone: `None` unless every tensor is on a CubeCL
/// device (off the CPU). A gradient `b` that is its buffer's only owner
/// (nothing else holds the tensor) takes its sum in place.
#[cfg(feature = "cube")]
pub fn fused_add_pairs(pairs: Vec<(Tensor<2>, Tensor<2>)>) -> Option<Vec<Tensor<2>>> {
    on_device(pairs).ok()
}

/// Whether [`fused_add_pairs`] adds eight pairs a launch on `reference`'s
/// device (it binds 24 buffers a launch), rather than one; `None` off a
/// CubeCL device.
#[cfg(feature = "cube")]
pub fn add_pairs_groups_fit(reference: &Tensor<2>) -> Option<bool> {
    cube::groups_fit(reference)
}

/// The oracle: burn's `add`, a pair at a time.
pub fn composed_add_pairs(pairs: Vec<(Tensor<2>, Tensor<2>)>) -> Vec<Tensor<2>> {
    pairs.into_iter().map(|(a, b)| a + b).collect()
}
