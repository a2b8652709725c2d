use crate::error::ModelError;
use crate::kernels::{bf16_rms_norm, rms_norm};
use crate::tensor::Tensor;
use crate::weights::table::Param;

/// RMSNorm: `x / sqrt(mean(x^2) + eps) * weight`, over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm<'a> {
    /// `[1, C]` (HF `[C]`).
    weight: &'a Param,
    eps: f64,
}

impl<'a> RmsNorm<'a> {
    /// The norm with `weight` (`[1, C]`).
    pub fn new(weight: &'a Param, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// `[N, C] -> [N, C]`, through the fused kernel (`kernels/rms_norm.rs`).
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        Ok(rms_norm(x, self.weight.value.clone(), self.eps)?)
    }

    /// [`Self::forward`], its output rounded to bf16 when `round` (every
    /// reader a `--bf16` matmul on the CPU, which reads only that:
    /// `kernels::bf16_rms_norm`).
    pub fn forward_rounded(&self, x: Tensor<2>, round: bool) -> Result<Tensor<2>, ModelError> {
        if !round {
            return self.forward(x);
        }
        Ok(bf16_rms_norm(x, self.weight.value.clone(), self.eps)?)
    }
}
