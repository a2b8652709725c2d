use crate::param::Param;
use crate::tensor::Tensor;

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

    /// `[N, C] -> [N, C]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mean_square = x.clone().square().mean_dim(1);
        let inv_rms = mean_square.add_scalar(self.eps).sqrt().recip();
        x * inv_rms * self.weight.value.clone()
    }
}
