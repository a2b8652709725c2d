//! The CubeCL body of RMSNorm, forward and backward, with its autodiff
//! glue: one pass over `x` each way where burn's composed ops take about
//! seven forward and twice that backward (each a kernel launch and a
//! buffer of `[N, C]`).
//!
//! - forward: one invocation per row sums the row's squares, then writes
//!   `y = x * r * weight` and the row's `r = 1 / rms` (saved for backward);
//! - backward: one invocation per row for `dx = r * g - x * r^3 / C *
//!   sum(g * x)` with `g = dy * weight`; one per channel for `dweight =
//!   sum over rows of dy * x * r`, rows in order: no atomics, the same sum
//!   on every run.
//!
//! # Shapes
//! `x`, `y`, `dy`, `dx`: `[N, C]`; `weight`, `dweight`: `[1, C]`; `inv_rms`:
//! `[N]`; all contiguous f32.

use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_op::{CubeOp, apply, empty_like, grid};
use crate::kernels::host_op::UnsupportedTensor;

#[cube(launch)]
fn forward_kernel(
    x: &Tensor<f32>,
    weight: &Tensor<f32>,
    y: &mut Tensor<f32>,
    inv_rms: &mut Tensor<f32>,
    eps: f32,
    #[comptime] channels: usize,
) {
    let row = ABSOLUTE_POS;
    if row < inv_rms.len() {
        let base = row * channels;
        let mut sum = 0.0f32;
        for c in 0..channels {
            let v = x[base + c];
            sum += v * v;
        }
        let r = 1.0f32 / (sum / f32::cast_from(channels) + eps).sqrt();
        for c in 0..channels {
            y[base + c] = x[base + c] * r * weight[c];
        }
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
) {
    let row = ABSOLUTE_POS;
    if row < inv_rms.len() {
        let base = row * channels;
        let r = inv_rms[row];
        let mut dot = 0.0f32;
        for c in 0..channels {
            dot += dy[base + c] * weight[c] * x[base + c];
        }
        let correction = r * r * r / f32::cast_from(channels) * dot;
        for c in 0..channels {
            dx[base + c] = r * dy[base + c] * weight[c] - x[base + c] * correction;
        }
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
        let (count, dim) = grid(&x, rows);
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
        );
        (y, Saved { x, weight, inv_rms })
    }

    fn backward(saved: &Saved, dy: CubeTensor) -> [CubeTensor; 2] {
        let Saved { x, weight, inv_rms } = saved;
        let dy = into_contiguous(dy);
        let (rows, channels) = (x.meta.shape()[0], x.meta.shape()[1]);
        let dx = empty_like(x, vec![rows, channels]);
        let (count, dim) = grid(x, rows);
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
