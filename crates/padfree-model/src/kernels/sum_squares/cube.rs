//! The CubeCL body of [`super::sums_of_squares`].
//!
//! - **Partials**: a workgroup per block of [`BLOCK_ELEMENTS`] of a
//!   tensor's elements; each thread sums the squares of every
//!   `threads`-th element of the block, the workgroup adds the threads'
//!   sums in a fixed tree ([`workgroup_sum()`]) and writes one partial into
//!   the shared buffer, at the tensor's offset plus the block. A launch
//!   takes eight tensors ([`GROUP`]), the last few a launch each.
//! - **Combine**: one launch, a workgroup per tensor, adding its partials
//!   (listed by a `[P + 1]` table of offsets) the same way.
//!
//! Every sum is f32 and in a fixed order: the same values on every run.
//! A tensor is read in its buffer's order, so a transposed view (its
//! buffer holds exactly its elements) is read in place; another layout is
//! made contiguous first.
//!
//! # Shapes
//! each input 2-D; `partials`: `[sum of each tensor's blocks]`;
//! `offsets`: `[P + 1]` (f32, exact below 2^24 blocks); the result `[P]`.

use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_op::{empty_like, row_groups, workgroup_index, workgroup_sum};
use crate::tensor::Tensor as BurnTensor;

/// Elements a workgroup of the partial pass sums.
const BLOCK_ELEMENTS: usize = 8192;

#[cube(launch)]
fn partial_kernel(
    x: &Tensor<f32>,
    partials: &mut Tensor<f32>,
    offset: u32,
    #[comptime] block_elements: usize,
    #[comptime] threads: usize,
) {
    let block = workgroup_index();
    let start = block * block_elements;
    // The grid's last row may hold workgroups past the last block: a
    // whole workgroup leaves together, before any barrier.
    if start >= x.len() {
        terminate!();
    }
    let sum = block_sum(x, block, block_elements, threads);
    let total = workgroup_sum(sum, threads);
    if UNIT_POS_X == 0 {
        partials[offset as usize + block] = total;
    }
}

/// Tensors one group launch of the partial pass reads.
pub(super) const GROUP: usize = 8;

/// The squares of block `block` of `x`, this thread's share (every
/// `threads`-th element).
#[cube]
fn block_sum(
    x: &Tensor<f32>,
    block: usize,
    #[comptime] block_elements: usize,
    #[comptime] threads: usize,
) -> f32 {
    let start = block * block_elements;
    let mut end = start + block_elements;
    if end > x.len() {
        end = x.len();
    }
    let mut sum = 0.0f32;
    let mut i = start + UNIT_POS_X as usize;
    while i < end {
        let v = x[i];
        sum += v * v;
        i += threads;
    }
    sum
}

/// [`partial_kernel()`] of 8 tensors in one launch: their blocks end to
/// end, each workgroup finding its tensor by the running sum of the
/// block counts (the same for the whole workgroup, so the tree after it
/// runs in uniform control flow), its partial at `offset` plus its block
/// in the group: the same partials, in the same places, as a launch a
/// tensor.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn partial_group_kernel(
    x_0: &Tensor<f32>,
    x_1: &Tensor<f32>,
    x_2: &Tensor<f32>,
    x_3: &Tensor<f32>,
    x_4: &Tensor<f32>,
    x_5: &Tensor<f32>,
    x_6: &Tensor<f32>,
    x_7: &Tensor<f32>,
    partials: &mut Tensor<f32>,
    offset: u32,
    #[comptime] block_elements: usize,
    #[comptime] threads: usize,
) {
    let block = workgroup_index();
    let end_0 = x_0.len().div_ceil(block_elements);
    let end_1 = end_0 + x_1.len().div_ceil(block_elements);
    let end_2 = end_1 + x_2.len().div_ceil(block_elements);
    let end_3 = end_2 + x_3.len().div_ceil(block_elements);
    let end_4 = end_3 + x_4.len().div_ceil(block_elements);
    let end_5 = end_4 + x_5.len().div_ceil(block_elements);
    let end_6 = end_5 + x_6.len().div_ceil(block_elements);
    let end_7 = end_6 + x_7.len().div_ceil(block_elements);
    if block >= end_7 {
        terminate!();
    }
    let mut sum = 0.0f32;
    if block < end_0 {
        sum = block_sum(x_0, block, block_elements, threads);
    } else if block < end_1 {
        sum = block_sum(x_1, block - end_0, block_elements, threads);
    } else if block < end_2 {
        sum = block_sum(x_2, block - end_1, block_elements, threads);
    } else if block < end_3 {
        sum = block_sum(x_3, block - end_2, block_elements, threads);
    } else if block < end_4 {
        sum = block_sum(x_4, block - end_3, block_elements, threads);
    } else if block < end_5 {
        sum = block_sum(x_5, block - end_4, block_elements, threads);
    } else if block < end_6 {
        sum = block_sum(x_6, block - end_5, block_elements, threads);
    } else if block < end_7 {
        sum = block_sum(x_7, block - end_6, block_elements, threads);
    }
    let total = workgroup_sum(sum, threads);
    if UNIT_POS_X == 0 {
        partials[offset as usize + block] = total;
    }
}

#[cube(launch)]
fn combine_kernel(
    partials: &Tensor<f32>,
    offsets: &Tensor<f32>,
    sums: &mut Tensor<f32>,
    #[comptime] threads: usize,
) {
    let tensor = workgroup_index();
    if tensor >= sums.len() {
        terminate!();
    }
    let start = u32::cast_from(offsets[tensor]) as usize;
    let end = u32::cast_from(offsets[tensor + 1]) as usize;
    let mut sum = 0.0f32;
    let mut i = start + UNIT_POS_X as usize;
    while i < end {
        sum += partials[i];
        i += threads;
    }
    let total = workgroup_sum(sum, threads);
    if UNIT_POS_X == 0 {
        sums[tensor] = total;
    }
}

/// Whether `t`'s device binds a group launch's buffers beside the
/// kernel's metadata.
fn fits_a_group(t: &CubeTensor) -> bool {
    t.client.properties().hardware.max_bindings as usize >= GROUP + 3
}

/// Whether a group launch runs on `reference`'s device (`None` off burn's
/// CubeCL backend).
pub(super) fn groups_fit(reference: &BurnTensor<2>) -> Option<bool> {
    let t = reference.clone().try_into_primitive::<CubeBackend>().ok()?;
    Some(fits_a_group(&t))
}

/// Whether `t`'s buffer holds exactly its elements, in some order: rows
/// (contiguous) or columns (a transposed view) packed.
fn packed(t: &CubeTensor) -> bool {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    let [rows, cols] = [shape[0], shape[1]];
    let row_major = (strides[1] == 1 || cols == 1) && (strides[0] == cols || rows == 1);
    let col_major = (strides[0] == 1 || rows == 1) && (strides[1] == rows || cols == 1);
    row_major || col_major
}

pub(super) fn sums_of_squares(tensors: &[BurnTensor<2>]) -> Option<BurnTensor<1>> {
    let mut inputs = Vec::with_capacity(tensors.len());
    for t in tensors {
        let primitive = t.clone().try_into_primitive::<CubeBackend>().ok()?;
        inputs.push(if packed(&primitive) {
            primitive
        } else {
            into_contiguous(primitive)
        });
    }
    let first = inputs.first()?;
    let blocks: Vec<usize> = inputs
        .iter()
        .map(|t| {
            t.meta
                .shape()
                .iter()
                .product::<usize>()
                .div_ceil(BLOCK_ELEMENTS)
        })
        .collect();
    let mut offsets = Vec::with_capacity(blocks.len() + 1);
    let mut total = 0usize;
    offsets.push(0.0f32);
    for &b in &blocks {
        total += b;
        offsets.push(total as f32);
    }
    let partials = empty_like(first, vec![total.max(1)]);
    let groups = if fits_a_group(first) {
        inputs.len() / GROUP
    } else {
        0
    };
    let grouped = groups * GROUP;
    for (g, group) in inputs[..grouped].chunks_exact(GROUP).enumerate() {
        let group_blocks: usize = blocks[g * GROUP..(g + 1) * GROUP].iter().sum();
        if group_blocks == 0 {
            continue;
        }
        let (count, dim, threads) = row_groups(&group[0], group_blocks);
        let x = |t: usize| group[t].clone().into_tensor_arg();
        partial_group_kernel::launch(
            &group[0].client,
            count,
            dim,
            x(0),
            x(1),
            x(2),
            x(3),
            x(4),
            x(5),
            x(6),
            x(7),
            partials.clone().into_tensor_arg(),
            offsets[g * GROUP] as u32,
            BLOCK_ELEMENTS,
            threads,
        );
    }
    for ((x, &b), offset) in inputs.iter().zip(&blocks).zip(&offsets).skip(grouped) {
        if b == 0 {
            continue;
        }
        let (count, dim, threads) = row_groups(x, b);
        partial_kernel::launch(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            *offset as u32,
            BLOCK_ELEMENTS,
            threads,
        );
    }
    let device = tensors[0].device();
    let offsets = crate::tensor::float_tensor(offsets, [blocks.len() + 1], &device)
        .try_into_primitive::<CubeBackend>()
        .ok()?;
    let sums = empty_like(first, vec![inputs.len()]);
    let (count, dim, threads) = row_groups(first, inputs.len());
    combine_kernel::launch(
        &first.client,
        count,
        dim,
        partials.into_tensor_arg(),
        offsets.into_tensor_arg(),
        sums.clone().into_tensor_arg(),
        threads,
    );
    Some(BurnTensor::from_primitive::<CubeBackend>(sums))
}
