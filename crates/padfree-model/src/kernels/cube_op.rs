//! What padfree's CubeCL kernels share: output buffers, launch grids of one
//! invocation per element or a workgroup per row, the workgroup reductions
//! of a row (a tree through shared memory in a fixed order), and the glue that makes a kernel pair (forward,
//! backward) a differentiable burn op on the CubeCL backend, with or
//! without autodiff and under either checkpointing strategy.

use std::marker::PhantomData;

use burn::tensor::{GradientCheckpointingStrategy, Tensor as BurnTensor};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::DType;
use burn_backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

use super::host_op::UnsupportedTensor;

/// A contiguous f32 buffer of `shape` on `reference`'s device.
pub(crate) fn empty_like(reference: &CubeTensor, shape: Vec<usize>) -> CubeTensor {
    empty_device_contiguous_dtype(
        reference.client.clone(),
        reference.device.clone(),
        shape.into(),
        DType::F32,
    )
}

/// A constant of an op (a table, the targets) as a contiguous primitive of
/// the CubeCL backend, or why not (a tensor of another backend); an
/// autodiff tensor's graph is dropped: no gradient flows to a constant.
pub(crate) fn contiguous_primitive<const D: usize>(
    tensor: &BurnTensor<D>,
) -> Result<CubeTensor, UnsupportedTensor> {
    tensor
        .clone()
        .inner()
        .try_into_primitive::<CubeBackend>()
        .map(into_contiguous)
        .map_err(|err| UnsupportedTensor(format!("{err:?}")))
}

/// One invocation per element of `n`, in blocks the device accepts.
pub(crate) fn grid(reference: &CubeTensor, n: usize) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new(&reference.client, n.max(1));
    let cube_count = calculate_cube_count_elemwise(&reference.client, n.max(1), cube_dim);
    (cube_count, cube_dim)
}

/// Where element `(row, col)` of `t` lies, whatever its strides: a
/// gradient may arrive as a transposed view, read in place instead of
/// copied first.
#[cube]
pub(crate) fn at(t: &Tensor<f32>, row: usize, col: usize) -> usize {
    row * t.stride(0) + col * t.stride(1)
}

/// This workgroup's index on a grid of [`row_groups`] (or of blocks laid
/// out the same way): past 65,535 workgroups, on the grid's second
/// dimension.
#[cube]
pub(crate) fn workgroup_index() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// The sum of every thread's `value` over the workgroup (of `threads`, a
/// power of two), on every thread: a tree through shared memory in a fixed
/// order, so the same sum on every run.
#[cube]
pub(crate) fn workgroup_sum(value: f32, #[comptime] threads: usize) -> f32 {
    workgroup_reduce(value, threads, false)
}

/// The largest of every thread's `value` over the workgroup, on every
/// thread: the same tree as [`workgroup_sum`].
#[cube]
pub(crate) fn workgroup_max(value: f32, #[comptime] threads: usize) -> f32 {
    workgroup_reduce(value, threads, true)
}

#[cube]
fn workgroup_reduce(value: f32, #[comptime] threads: usize, #[comptime] take_max: bool) -> f32 {
    let lane = UNIT_POS_X as usize;
    let mut partial = Shared::<[f32]>::new_slice(threads);
    partial[lane] = value;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if lane < stride {
            let mine = partial[lane];
            let theirs = partial[lane + stride];
            if take_max {
                if theirs > mine {
                    partial[lane] = theirs;
                }
            } else {
                partial[lane] = mine + theirs;
            }
        }
        sync_cube();
        stride /= 2;
    }
    partial[0]
}

/// A workgroup of `threads` (a power of two, at most 256 and what the
/// device takes) per row, the rows laid over a 2-D grid (a grid dimension
/// holds at most 65,535 workgroups).
pub(crate) fn row_groups(reference: &CubeTensor, rows: usize) -> (CubeCount, CubeDim, usize) {
    let most = reference
        .client
        .properties()
        .hardware
        .max_cube_dim
        .0
        .clamp(1, 256);
    let threads = 1usize << most.ilog2();
    let wide = rows.clamp(1, 65_535);
    let count = CubeCount::Static(wide as u32, rows.div_ceil(wide).max(1) as u32, 1);
    (count, CubeDim::new_1d(threads as u32), threads)
}

/// A CubeCL kernel pair over `N` inputs.
pub(crate) trait CubeOp<const N: usize>: Send + 'static {
    /// What the backward pass reads.
    type Saved: Clone + Send + std::fmt::Debug + 'static;

    /// The output, and what backward needs, from contiguous inputs.
    fn forward(&self, inputs: [CubeTensor; N]) -> (CubeTensor, Self::Saved);

    /// Every input's gradient given the output's (`d_out`, any layout).
    fn backward(saved: &Self::Saved, d_out: CubeTensor) -> [CubeTensor; N];
}

/// `op` on `inputs` of rank `D` (plain, or on an autodiff device of the
/// CubeCL backend), its output of rank `R`, differentiable: its backward
/// pass reads what its forward pass saved (no recomputation, under
/// checkpointing too).
pub(crate) fn apply<O: CubeOp<N>, const D: usize, const R: usize, const N: usize>(
    op: &O,
    inputs: [BurnTensor<D>; N],
) -> Result<BurnTensor<R>, UnsupportedTensor> {
    let unsupported = |err| UnsupportedTensor(format!("{err:?}"));
    if !inputs[0].is_autodiff() {
        let mut plain = Vec::with_capacity(N);
        for input in inputs {
            plain.push(into_contiguous(
                input
                    .try_into_primitive::<CubeBackend>()
                    .map_err(unsupported)?,
            ));
        }
        let (out, _) = op.forward(to_array(plain));
        return Ok(BurnTensor::from_primitive::<CubeBackend>(out));
    }
    // burn names a checkpointing strategy's backend only concretely.
    macro_rules! on {
        ($strategy:ty) => {{
            type Backend = Autodiff<CubeBackend, $strategy>;
            let mut primitives = Vec::with_capacity(N);
            for input in inputs {
                primitives.push(input.try_into_primitive::<Backend>().map_err(unsupported)?);
            }
            let out = tracked::<O, $strategy, N>(op, to_array(primitives));
            Ok(BurnTensor::from_primitive::<Backend>(out))
        }};
    }
    match inputs[0].gradient_checkpointing_strategy() {
        Some(GradientCheckpointingStrategy::Balanced) => on!(BalancedCheckpointing),
        _ => on!(NoCheckpointing),
    }
}

fn to_array<T, const N: usize>(items: Vec<T>) -> [T; N] {
    match items.try_into() {
        Ok(array) => array,
        Err(_) => unreachable!("one item per input"),
    }
}

fn tracked<O: CubeOp<N>, C: CheckpointStrategy, const N: usize>(
    op: &O,
    inputs: [FloatTensor<Autodiff<CubeBackend, C>>; N],
) -> FloatTensor<Autodiff<CubeBackend, C>> {
    let (primitives, nodes): (Vec<_>, Vec<_>) = inputs
        .into_iter()
        .map(|input| {
            let (primitive, node) = input.into_parts();
            (into_contiguous(primitive), node)
        })
        .unzip();
    let (out, saved) = op.forward(to_array(primitives));
    match CubeBackward::<O, N>(PhantomData)
        .prepare::<C>(to_array(nodes))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(saved, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// The backward step of `O` (a marker: burn wants the step stateless).
struct CubeBackward<O, const N: usize>(PhantomData<O>);

impl<O, const N: usize> std::fmt::Debug for CubeBackward<O, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(std::any::type_name::<O>())
    }
}

impl<O: CubeOp<N>, const N: usize> Backward<CubeBackend, N> for CubeBackward<O, N> {
    type State = O::Saved;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<CubeBackend>(&ops.node);
        let gradients = O::backward(&ops.state, d_out);
        for (parent, gradient) in ops.parents.into_iter().zip(gradients) {
            if let Some(node) = parent {
                grads.register::<CubeBackend>(node.id, gradient);
            }
        }
    }
}
