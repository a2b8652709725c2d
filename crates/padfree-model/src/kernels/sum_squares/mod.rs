//! Every tensor's sum of squares, one value per tensor: the gradient norm's
//! per-parameter terms. On a GPU two kernels (`cube.rs`): one launch per
//! eight tensors writes a partial sum per block of their elements into
//! one shared buffer, then one launch adds each tensor's partials, in a
//! fixed order. Composed from burn ops ([`composed_sums_of_squares`], the
//! oracle) it is four launches a tensor (the square, a zeroed output, the
//! reduction, and the copy into the result), ~1,100 a step for
//! SmolLM2-135M's 272 tensors where this takes 35 (273 at a launch a
//! tensor).
//!
//! On the host, [`host_sum_of_squares`] is one tensor's term in f64, the
//! same bits on every CPU.
//!
//! # Shapes
//! `tensors`: any 2-D shapes, f32; the result `[P]`, one per tensor.

use crate::tensor::{Tensor, cat};

#[cfg(feature = "cube")]
mod cube;

/// Whether [`sums_of_squares`] reads eight tensors a launch on
/// `reference`'s device, rather than one; `None` off a CubeCL device.
#[cfg(feature = "cube")]
pub fn sums_of_squares_groups_fit(reference: &Tensor<2>) -> Option<bool> {
    cube::groups_fit(reference)
}

/// Interleaved f64 accumulators of [`host_sum_of_squares`]: independent
/// additions the CPU overlaps, where one running sum waits on every
/// previous addition.
const LANES: usize = 8;

/// `sum x^2` of `values` in f64, element `i` into lane `i % 8`, the lanes
/// then added in order: a fixed function of the values, whatever the
/// instruction set. Compiled for the CPU's best set ([`super::simd::dispatch`]):
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

/// [`host_sum_of_squares`] of each of `chunks`, the same bits, four
/// chunks of one length at a time in one loop.
///
/// One sum's lanes wait on their own additions: eight f64 lanes are one
/// AVX-512 register, so a single sum adds 8 values per addition's
/// latency, under the memory's speed (the norm of `medium`'s 56M
/// gradients took 13 ms, 7% of a `--bf16` short-chat step, where
/// AdamW's pass over five times the bytes ran at 2.6x the bandwidth).
/// Four sums in one loop are four independent chains. Each keeps its
/// own lanes and order, so its bits are its own call's; chunks of other
/// lengths (a tensor's tail) are summed one at a time.
pub fn host_sums_of_squares(chunks: &[&[f32]]) -> Vec<f64> {
    let mut sums = Vec::with_capacity(chunks.len());
    let mut rest = chunks;
    while let Some(four) = rest.first_chunk::<4>() {
        if four.iter().all(|c| c.len() == four[0].len()) {
            sums.extend(super::simd::dispatch(
                #[inline(always)]
                || portable_sums_of_squares(*four),
            ));
            rest = &rest[4..];
        } else {
            sums.push(host_sum_of_squares(four[0]));
            rest = &rest[1..];
        }
    }
    sums.extend(rest.iter().map(|c| host_sum_of_squares(c)));
    sums
}

/// `N` [`portable_sum_of_squares`] of slices of one length, in one loop:
/// each slice's lanes and order as its own call's.
#[inline(always)]
fn portable_sums_of_squares<const N: usize>(slices: [&[f32]; N]) -> [f64; N] {
    let full = slices.first().map_or(0, |s| s.len()) / LANES * LANES;
    let mut lanes = [[0.0f64; LANES]; N];
    let blocks = slices.map(|s| s[..full].as_chunks::<LANES>().0);
    for b in 0..full / LANES {
        for (lanes, blocks) in lanes.iter_mut().zip(&blocks) {
            for (lane, &x) in lanes.iter_mut().zip(&blocks[b]) {
                *lane += f64::from(x) * f64::from(x);
            }
        }
    }
    for (lanes, slice) in lanes.iter_mut().zip(slices) {
        for (lane, &x) in lanes.iter_mut().zip(&slice[full..]) {
            *lane += f64::from(x) * f64::from(x);
        }
    }
    lanes.map(|l| l.iter().sum())
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
    use super::{host_sum_of_squares, host_sums_of_squares, portable_sum_of_squares};
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

    /// Four at a time, each chunk's sum is its own call's bits: runs of
    /// four of one length, a shorter tail among them, lengths not a
    /// multiple of the lanes, fewer than four left at the end.
    #[test]
    fn four_sums_at_once_are_each_ones_own_bits() {
        for lens in [
            vec![64, 64, 64, 64],
            vec![13, 13, 13, 13, 13, 13, 5],
            vec![100, 100, 100, 7, 100, 100, 100, 100, 100],
            vec![9, 9],
            vec![],
        ] {
            let values: Vec<Vec<f32>> = lens
                .iter()
                .enumerate()
                .map(|(i, &len)| random(len, 300 + i as u64))
                .collect();
            let chunks: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let one_at_a_time: Vec<f64> = chunks.iter().map(|c| host_sum_of_squares(c)).collect();
            assert_eq!(
                bits(&host_sums_of_squares(&chunks)),
                bits(&one_at_a_time),
                "{lens:?}"
            );
        }
    }
}
