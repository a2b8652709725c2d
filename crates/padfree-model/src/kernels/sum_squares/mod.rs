//! Every tensor's sum of squares, one value per tensor: the gradient norm's
//! per-parameter terms. On a GPU two kernels (`cube.rs`): one launch per
//! tensor writes a partial sum per block of its elements into one shared
//! buffer, then one launch adds each tensor's partials, in a fixed order.
//! Composed from burn ops ([`composed_sums_of_squares`], the oracle) it is
//! four launches a tensor (the square, a zeroed output, the reduction, and
//! the copy into the result), ~1,100 a step for SmolLM2-135M's 272 tensors
//! where this takes 273.
//!
//! On the host, [`host_sum_of_squares`] is one tensor's term in f64, the
//! same bits on every CPU.
//!
//! # Shapes
//! `tensors`: any 2-D shapes, f32; the result `[P]`, one per tensor.

use crate::tensor::{Tensor, cat};

#[cfg(feature = "cube")]
mod cube;

/// Interleaved f64 accumulators of [`host_sum_of_squares`]: independent
/// additions the CPU overlaps, where one running sum waits on every
/// previous addition.
const LANES: usize = 8;

/// `sum x^2` of `values` in f64, element `i` into lane `i % 8`, the lanes
/// then added in order: a fixed function of the values, whatever the
/// instruction set. Compiled for the CPU's best set ([`simd::dispatch`]):
/// built for baseline x86-64 (the eight f64 lanes in four SSE2 registers)
/// SmolLM2-135M's 135M gradient values took 58-59 ms on 2 threads,
/// against 39-43 ms dispatched on an AVX-512 Xeon.
pub fn host_sum_of_squares(values: &[f32]) -> f64 {
    super::simd::dispatch(
        #[inline(always)]
        || portable_sum_of_squares(values),
    )
}

/// [`host_sum_of_squares`]'s arithmetic, compiled for baseline x86-64: its
/// oracle.
#[inline(always)]
fn portable_sum_of_squares(values: &[f32]) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let mut blocks = values.chunks_exact(LANES);
    for block in &mut blocks {
        for (lane, &x) in lanes.iter_mut().zip(block) {
            *lane += f64::from(x) * f64::from(x);
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(blocks.remainder()) {
        *lane += f64::from(x) * f64::from(x);
    }
    lanes.iter().sum()
}

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

#[cfg(test)]
mod tests {
    use super::{host_sum_of_squares, portable_sum_of_squares};
    use crate::kernels::test_util::random;

    /// The dispatched sum is the baseline build's bits (the gradient norm,
    /// and so clipping, does not depend on the CPU), and the lanes are
    /// those documented: element `i` into lane `i % 8`, lanes in order.
    #[test]
    fn host_sum_is_the_portable_sum_bit_for_bit() {
        for len in [0, 1, 7, 8, 9, 1000, 65_537] {
            let values: Vec<f32> = random(len, 91).iter().map(|x| x * 1e3).collect();
            let fast = host_sum_of_squares(&values);
            assert_eq!(
                fast.to_bits(),
                portable_sum_of_squares(&values).to_bits(),
                "{len}"
            );
            let mut lanes = [0.0f64; 8];
            for (i, &x) in values.iter().enumerate() {
                lanes[i % 8] += f64::from(x) * f64::from(x);
            }
            let by_lane = lanes.iter().fold(0.0, |sum, lane| sum + lane);
            assert_eq!(fast.to_bits(), by_lane.to_bits(), "{len}");
        }
    }
}
