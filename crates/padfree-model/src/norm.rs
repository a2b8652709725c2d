use crate::error::ModelError;
use crate::param::Param;
use crate::tensor::{Tensor, rms_norm};

/// RMSNorm: `x / sqrt(mean(x^2) + eps) * weight`, over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[1, C]` (HF `[C]`).
    pub(crate) weight: Param,
    eps: f64,
}

impl RmsNorm {
    pub(crate) fn new(weight: Param, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// `[N, C] -> [N, C]`, through the fused kernel (`rms_norm_kernel.rs`).
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        Ok(rms_norm(x, self.weight.value.clone(), self.eps)?)
    }
}
