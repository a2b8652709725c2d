//! The CubeCL body of the SwiGLU gate, `silu(gate) * up`, forward and
//! backward: one invocation per element, one pass each way where burn's
//! composed ops take three forward (sigmoid, two products) and about twice
//! that backward, each a kernel launch and an `[N, I]` buffer.
//!
//! With `s = sigmoid(gate)`: `out = gate * s * up`, `d_up = d_out * gate *
//! s`, `d_gate = d_out * up * s * (1 + gate * (1 - s))`.
//!
//! # Shapes
//! `gate`, `up`, `out` and their gradients: `[N, I]`, contiguous f32.

use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_op::{CubeOp, apply, empty_like, grid};
use crate::kernels::host_op::UnsupportedTensor;

#[cube(launch)]
fn forward_kernel(gate: &Tensor<f32>, up: &Tensor<f32>, out: &mut Tensor<f32>) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let g = gate[i];
        let s = 1.0f32 / (1.0f32 + (-g).exp());
        out[i] = g * s * up[i];
    }
}

#[cube(launch)]
fn backward_kernel(
    gate: &Tensor<f32>,
    up: &Tensor<f32>,
    d_out: &Tensor<f32>,
    d_gate: &mut Tensor<f32>,
    d_up: &mut Tensor<f32>,
) {
    let i = ABSOLUTE_POS;
    if i < d_up.len() {
        let g = gate[i];
        let s = 1.0f32 / (1.0f32 + (-g).exp());
        let d = d_out[i];
        d_up[i] = d * g * s;
        d_gate[i] = d * up[i] * s * (1.0f32 + g * (1.0f32 - s));
    }
}

/// The differentiable op on a CubeCL device: `gate`, `up` `[N, I]` ->
/// `[N, I]`.
pub(super) fn swiglu(inputs: [BurnTensor<2>; 2]) -> Result<BurnTensor<2>, UnsupportedTensor> {
    apply(&SwiGlu, inputs)
}

struct SwiGlu;

/// What the backward pass reads: the two inputs, not the output.
#[derive(Debug, Clone)]
struct Saved {
    gate: CubeTensor,
    up: CubeTensor,
}

impl CubeOp<2> for SwiGlu {
    type Saved = Saved;

    fn forward(&self, [gate, up]: [CubeTensor; 2]) -> (CubeTensor, Saved) {
        let shape = gate.meta.shape().to_vec();
        let n = shape.iter().product();
        let out = empty_like(&gate, shape);
        let (count, dim) = grid(&gate, n);
        forward_kernel::launch(
            &gate.client,
            count,
            dim,
            gate.clone().into_tensor_arg(),
            up.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
        (out, Saved { gate, up })
    }

    fn backward(saved: &Saved, d_out: CubeTensor) -> [CubeTensor; 2] {
        let Saved { gate, up } = saved;
        let d_out = into_contiguous(d_out);
        let shape = gate.meta.shape().to_vec();
        let n = shape.iter().product();
        let d_gate = empty_like(gate, shape.clone());
        let d_up = empty_like(gate, shape);
        let (count, dim) = grid(gate, n);
        backward_kernel::launch(
            &gate.client,
            count,
            dim,
            gate.clone().into_tensor_arg(),
            up.clone().into_tensor_arg(),
            d_out.into_tensor_arg(),
            d_gate.clone().into_tensor_arg(),
            d_up.clone().into_tensor_arg(),
        );
        [d_gate, d_up]
    }
}
