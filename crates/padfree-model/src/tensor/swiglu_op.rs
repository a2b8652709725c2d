//! The fused SwiGLU gate (`crate::swiglu_kernel`) as a differentiable burn op.

use burn::tensor::Tensor;

use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::swiglu_kernel;

/// `silu(gate) * up`, element-wise; `gate`, `up`: `[N, I]` -> `[N, I]`.
pub fn swiglu(gate: Tensor<2>, up: Tensor<2>) -> Result<Tensor<2>, UnsupportedTensor> {
    apply(SwiGlu, [gate, up])
}

#[derive(Debug, Clone)]
struct SwiGlu;

impl HostOp<2> for SwiGlu {
    const RECOMPUTE: bool = true;

    fn forward(&self, [gate, up]: [HostTensor<'_>; 2]) -> HostOutput {
        HostOutput {
            values: swiglu_kernel::forward(gate.values, up.values),
            shape: gate.shape.to_vec(),
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [gate, up]: [HostTensor<'_>; 2],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
    ) -> [Vec<f32>; 2] {
        let (d_gate, d_up) = swiglu_kernel::backward(gate.values, up.values, d_out);
        [d_gate, d_up]
    }
}
