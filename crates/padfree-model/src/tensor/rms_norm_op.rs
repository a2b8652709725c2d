//! The fused RMSNorm kernel (`crate::rms_norm_kernel`) as a differentiable
//! burn op.

use burn::tensor::Tensor;

use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::rms_norm_kernel;

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension.
///
/// `x`: `[N, C]`, `weight`: `[1, C]` -> `[N, C]`.
pub fn rms_norm(x: Tensor<2>, weight: Tensor<2>, eps: f64) -> Result<Tensor<2>, UnsupportedTensor> {
    apply(RmsNorm { eps: eps as f32 }, [x, weight])
}

#[derive(Debug, Clone)]
struct RmsNorm {
    eps: f32,
}

impl HostOp<2> for RmsNorm {
    const RECOMPUTE: bool = true;

    /// Saves each row's `1 / rms`.
    fn forward(&self, [x, weight]: [HostTensor<'_>; 2]) -> HostOutput {
        let (y, inv_rms) = rms_norm_kernel::forward(x.values, weight.values, self.eps);
        HostOutput {
            values: y,
            shape: x.shape.to_vec(),
            saved: inv_rms,
        }
    }

    fn backward(
        &self,
        [x, weight]: [HostTensor<'_>; 2],
        _output: &[f32],
        inv_rms: &[f32],
        d_out: &[f32],
    ) -> [Vec<f32>; 2] {
        let (dx, dweight) = rms_norm_kernel::backward(x.values, weight.values, inv_rms, d_out);
        [dx, dweight]
    }
}
