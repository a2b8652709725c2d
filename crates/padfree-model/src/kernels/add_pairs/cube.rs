//! The CubeCL body of [`super::add_pairs`]: one invocation per element.
//! A launch takes [`GROUP`] pairs as named arguments (three bindings
//! each: CubeCL 0.11's tensors are unsized, so a kernel cannot take a
//! sequence of them); its grid covers their elements end to end, and an
//! invocation finds its pair by the running sum of the lengths. The last
//! few pairs (fewer than a group) take the one-pair kernel, with the same
//! element function ([`add_element()`]).
//!
//! # Shapes
//! `a`, `b` `[R, C]` in any strides (a gradient may arrive as a
//! transposed view, read in place); the sum contiguous, or in `b`'s
//! strides where it is written into `b`.

use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_op::{at, empty_like, grid};
use crate::tensor::Tensor as BurnTensor;

/// Pairs a group launch adds.
const GROUP: usize = super::ADD_PAIRS_GROUP;

/// Element `i` (row-major) of one pair's sum: both kernels' arithmetic.
#[cube]
fn add_element(a: &Tensor<f32>, b: &Tensor<f32>, sum: &mut Tensor<f32>, i: usize) {
    let cols = sum.shape(1);
    let (row, col) = (i / cols, i % cols);
    // `sum` is `b` itself where the sum is written in place.
    let at_sum = row * sum.stride(0) + col * sum.stride(1);
    sum[at_sum] = a[at(a, row, col)] + b[at(b, row, col)];
}

#[cube(launch)]
fn add_kernel(a: &Tensor<f32>, b: &Tensor<f32>, sum: &mut Tensor<f32>) {
    let i = ABSOLUTE_POS;
    if i < sum.len() {
        add_element(a, b, sum, i);
    }
}

/// Eight pairs' sums in one launch: the grid covers their elements end to
/// end; an invocation finds its pair by the running sum of the lengths.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn add_group_kernel(
    a_0: &Tensor<f32>,
    b_0: &Tensor<f32>,
    a_1: &Tensor<f32>,
    b_1: &Tensor<f32>,
    a_2: &Tensor<f32>,
    b_2: &Tensor<f32>,
    a_3: &Tensor<f32>,
    b_3: &Tensor<f32>,
    a_4: &Tensor<f32>,
    b_4: &Tensor<f32>,
    a_5: &Tensor<f32>,
    b_5: &Tensor<f32>,
    a_6: &Tensor<f32>,
    b_6: &Tensor<f32>,
    a_7: &Tensor<f32>,
    b_7: &Tensor<f32>,
    sum_0: &mut Tensor<f32>,
    sum_1: &mut Tensor<f32>,
    sum_2: &mut Tensor<f32>,
    sum_3: &mut Tensor<f32>,
    sum_4: &mut Tensor<f32>,
    sum_5: &mut Tensor<f32>,
    sum_6: &mut Tensor<f32>,
    sum_7: &mut Tensor<f32>,
) {
    let pos = ABSOLUTE_POS;
    let end_0 = sum_0.len();
    let end_1 = end_0 + sum_1.len();
    let end_2 = end_1 + sum_2.len();
    let end_3 = end_2 + sum_3.len();
    let end_4 = end_3 + sum_4.len();
    let end_5 = end_4 + sum_5.len();
    let end_6 = end_5 + sum_6.len();
    let end_7 = end_6 + sum_7.len();
    if pos < end_0 {
        add_element(a_0, b_0, sum_0, pos);
    } else if pos < end_1 {
        add_element(a_1, b_1, sum_1, pos - end_0);
    } else if pos < end_2 {
        add_element(a_2, b_2, sum_2, pos - end_1);
    } else if pos < end_3 {
        add_element(a_3, b_3, sum_3, pos - end_2);
    } else if pos < end_4 {
        add_element(a_4, b_4, sum_4, pos - end_3);
    } else if pos < end_5 {
        add_element(a_5, b_5, sum_5, pos - end_4);
    } else if pos < end_6 {
        add_element(a_6, b_6, sum_6, pos - end_5);
    } else if pos < end_7 {
        add_element(a_7, b_7, sum_7, pos - end_6);
    }
}

/// Whether `t`'s device binds a group launch's 24 buffers and one more,
/// the kernel's metadata.
fn fits_a_group(t: &CubeTensor) -> bool {
    t.client.properties().hardware.max_bindings as usize > 3 * GROUP
}

/// Whether a group launch runs on `reference`'s device (`None` off burn's
/// CubeCL backend).
pub(super) fn groups_fit(reference: &BurnTensor<2>) -> Option<bool> {
    let t = reference.clone().try_into_primitive::<CubeBackend>().ok()?;
    Some(fits_a_group(&t))
}

/// Every pair's sum: a launch per [`GROUP`] pairs, the last few a launch
/// each; the pairs back if any tensor is not on burn's CubeCL backend.
///
/// A group whose gradients `b` are each their buffer's only owner (and
/// hold each element once) writes the sums into them: fresh sums for every
/// tensor of a micro-batch made cubecl's pools hold 5,040 MiB for a
/// SmolLM2-135M run that needed 3,842 with burn's in-place `add`. Not into
/// the running sums `a`, as burn's `add` does: on lavapipe, with the
/// trainer's two rayon threads, a write in place into a sum that an
/// earlier micro-batch made gave different sums from run to run (the same
/// kernel, aliased to `a`: 3 of 6 runs differed; on one thread 5 of 5
/// agreed), and a write into `b`, made by this micro-batch, or into a
/// fresh buffer did not. (The trainer's device steps now run on the
/// calling thread, one stream; the rule stays, as other callers may not.)
pub(super) fn add_pairs(
    pairs: Vec<(BurnTensor<2>, BurnTensor<2>)>,
) -> Result<Vec<BurnTensor<2>>, Pairs> {
    // Checked on clones (dropped at once, so that each buffer's only owner
    // stays its only owner); taken below without a copy.
    let on_cube = |t: &BurnTensor<2>| t.clone().try_into_primitive::<CubeBackend>().is_ok();
    if !pairs.iter().all(|(a, b)| on_cube(a) && on_cube(b)) {
        return Err(pairs);
    }
    let primitive = |t: BurnTensor<2>| {
        t.try_into_primitive::<CubeBackend>()
            .expect("checked on a clone above")
    };
    let inputs: Vec<[CubeTensor; 2]> = pairs
        .into_iter()
        .map(|(a, b)| [primitive(a), primitive(b)])
        .collect();
    let Some(first) = inputs.first() else {
        return Ok(Vec::new());
    };
    let groups = if fits_a_group(&first[0]) {
        inputs.len() / GROUP
    } else {
        0
    };
    let len = |[a, _]: &[CubeTensor; 2]| a.meta.shape().iter().product::<usize>();
    // Never an empty `b`: burn's overlap check underflows on a zero extent.
    let writable = |pair: &[CubeTensor; 2]| {
        let b = &pair[1];
        len(pair) > 0 && b.can_mut() && b.is_nonoverlapping()
    };
    let fresh = |[a, _]: &[CubeTensor; 2]| empty_like(a, a.meta.shape().to_vec());
    let wrap = |t: CubeTensor| BurnTensor::from_primitive::<CubeBackend>(t);
    let mut sums = Vec::with_capacity(inputs.len());
    let mut rest = inputs.into_iter();
    for _ in 0..groups {
        let group: Vec<[CubeTensor; 2]> = rest.by_ref().take(GROUP).collect();
        // One variant of the kernel or the other for the whole group (each
        // aliasing pattern is a kernel of its own to compile).
        let in_place = group.iter().all(writable);
        let outputs: Vec<CubeTensor> = if in_place {
            group.iter().map(|[_, b]| b.clone()).collect()
        } else {
            group.iter().map(fresh).collect()
        };
        let total: usize = group.iter().map(len).sum();
        let (count, dim) = grid(&group[0][0], total);
        let i = |t: usize, k: usize| group[t][k].clone().into_tensor_arg();
        // Output `t` aliases input `2 t + 1` (`b_t`) in place.
        let o = |t: usize| {
            if in_place {
                outputs[t].as_tensor_alias(2 * t + 1)
            } else {
                outputs[t].clone().into_tensor_arg()
            }
        };
        add_group_kernel::launch(
            &group[0][0].client,
            count,
            dim,
            i(0, 0),
            i(0, 1),
            i(1, 0),
            i(1, 1),
            i(2, 0),
            i(2, 1),
            i(3, 0),
            i(3, 1),
            i(4, 0),
            i(4, 1),
            i(5, 0),
            i(5, 1),
            i(6, 0),
            i(6, 1),
            i(7, 0),
            i(7, 1),
            o(0),
            o(1),
            o(2),
            o(3),
            o(4),
            o(5),
            o(6),
            o(7),
        );
        drop(group);
        sums.extend(outputs.into_iter().map(wrap));
    }
    // The last few (fewer than a group), a launch each.
    for pair in rest {
        let in_place = writable(&pair);
        let sum = if in_place {
            pair[1].clone()
        } else {
            fresh(&pair)
        };
        let (count, dim) = grid(&pair[0], len(&pair));
        let out = if in_place {
            sum.as_tensor_alias(1)
        } else {
            sum.clone().into_tensor_arg()
        };
        add_kernel::launch(
            &pair[0].client,
            count,
            dim,
            pair[0].clone().into_tensor_arg(),
            pair[1].clone().into_tensor_arg(),
            out,
        );
        sums.push(wrap(sum));
    }
    Ok(sums)
}

/// Pairs handed back untouched where a tensor is not on burn's CubeCL
/// backend.
pub(super) type Pairs = Vec<(BurnTensor<2>, BurnTensor<2>)>;
