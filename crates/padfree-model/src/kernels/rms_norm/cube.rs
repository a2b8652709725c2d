//! The CubeCL body of RMSNorm, forward and backward, with its autodiff
//! glue: one pass over `x` each way where burn's composed ops take about
//! seven forward and twice that backward (each a kernel launch and a
//! buffer of `[N, C]`).
//!
//! - forward: a workgroup per row; its threads read neighbouring channels
//!   (coalesced), their sums of squares meet in shared memory through a
//!   tree in a fixed order, then they write `y = x * r * weight` and the
//!   row's `r = 1 / rms` (saved for backward);
//! - backward: a workgroup per row the same way for `dx = r * g - x * r^3
//!   / C * sum(g * x)` with `g = dy * weight`; one invocation per channel
//!   for `dweight = sum over rows of dy * x * r`, rows in order (neighbouring
//!   invocations read neighbouring channels): no atomics, the same sums on
//!   every run.
//!
//! # Shapes
//! `x`, `y`, `dy`, `dx`: `[N, C]`; `weight`, `dweight`: `[1, C]`; `inv_rms`:
//! `[N]`; all contiguous f32.

use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_op::{
    CubeOp, apply, empty_like, grid, row_groups, workgroup_index, workgroup_sum,
};
use crate::kernels::host_op::UnsupportedTensor;

#[cube(launch)]
fn forward_kernel(
    x: &Tensor<f32>,
    weight: &Tensor<f32>,
    y: &mut Tensor<f32>,
    inv_rms: &mut Tensor<f32>,
    eps: f32,
    #[comptime] channels: usize,
    #[comptime] threads: usize,
) {
    let row = workgroup_index();
    if row >= inv_rms.len() {
        terminate!();
    }
    let lane = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let base = row * channels;
    // Neighbouring threads read neighbouring channels.
    let mut sum = 0.0f32;
    let mut c = lane;
    while c < channels {
        let v = x[base + c];
        sum += v * v;
        c += step;
    }
    let sum = workgroup_sum(sum, threads);
    let r = 1.0f32 / (sum / f32::cast_from(channels) + eps).sqrt();
    let mut c = lane;
    while c < channels {
        y[base + c] = x[base + c] * r * weight[c];
        c += step;
    }
    if lane == 0 {
        inv_rms[row] = r;
    }
}

#[cube(launch)]
fn dx_kernel(
    x: &Tensor<f32>,
    weight: &Tensor<f32>,
    inv_rms: &Tensor<f32>,
    dy: &Tensor<f32>,
    dx: &mut Tensor<f32>,
    #[comptime] channels: usize,
    #[comptime] threads: usize,
) {
    let row = workgroup_index();
    if row >= inv_rms.len() {
        terminate!();
    }
    let lane = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let base = row * channels;
    let r = inv_rms[row];
    let mut dot = 0.0f32;
    let mut c = lane;
    while c < channels {
        dot += dy[base + c] * weight[c] * x[base + c];
        c += step;
    }
    let dot = workgroup_sum(dot, threads);
    let correction = r * r * r / f32::cast_from(channels) * dot;
    let mut c = lane;
    while c < channels {
        dx[base + c] = r * dy[base + c] * weight[c] - x[base + c] * correction;
        c += step;
    }
}

#[cube(launch)]
fn dweight_kernel(
    x: &Tensor<f32>,
    inv_rms: &Tensor<f32>,
    dy: &Tensor<f32>,
    dweight: &mut Tensor<f32>,
    #[comptime] channels: usize,
) {
    let c = ABSOLUTE_POS;
    if c < dweight.len() {
        let mut sum = 0.0f32;
        for row in 0..inv_rms.len() {
            let at = row * channels + c;
            sum += dy[at] * x[at] * inv_rms[row];
        }
        dweight[c] = sum;
    }
}

/// The differentiable op on a CubeCL device: `x` `[N, C]`, `weight`
/// `[1, C]` -> `[N, C]`.
pub(super) fn rms_norm(
    inputs: [BurnTensor<2>; 2],
    eps: f32,
) -> Result<BurnTensor<2>, UnsupportedTensor> {
    apply(&RmsNorm { eps }, inputs)
}

struct RmsNorm {
    eps: f32,
}

/// What the backward pass reads: the input, the weight and each row's
/// `1 / rms` (`[N]` floats), not the output.
#[derive(Debug, Clone)]
struct Saved {
    x: CubeTensor,
    weight: CubeTensor,
    inv_rms: CubeTensor,
}

impl CubeOp<2> for RmsNorm {
    type Saved = Saved;

    fn forward(&self, [x, weight]: [CubeTensor; 2]) -> (CubeTensor, Saved) {
        let (rows, channels) = (x.meta.shape()[0], x.meta.shape()[1]);
        let y = empty_like(&x, vec![rows, channels]);
        let inv_rms = empty_like(&x, vec![rows]);
        let (count, dim, threads) = row_groups(&x, rows);
        forward_kernel::launch(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            weight.clone().into_tensor_arg(),
            y.clone().into_tensor_arg(),
            inv_rms.clone().into_tensor_arg(),
            self.eps,
            channels,
            threads,
        );
        (y, Saved { x, weight, inv_rms })
    }

    fn backward(saved: &Saved, dy: CubeTensor) -> [CubeTensor; 2] {
        let Saved { x, weight, inv_rms } = saved;
        let dy = into_contiguous(dy);
        let (rows, channels) = (x.meta.shape()[0], x.meta.shape()[1]);
        let dx = empty_like(x, vec![rows, channels]);
        let (count, dim, threads) = row_groups(x, rows);
        dx_kernel::launch(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            weight.clone().into_tensor_arg(),
            inv_rms.clone().into_tensor_arg(),
            dy.clone().into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            channels,
            threads,
        );
        let dweight = empty_like(x, vec![1, channels]);
        let (count, dim) = grid(x, channels);
        dweight_kernel::launch(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            inv_rms.clone().into_tensor_arg(),
            dy.into_tensor_arg(),
            dweight.clone().into_tensor_arg(),
            channels,
        );
        [dx, dweight]
    }
}
