use crate::error::ModelError;
use crate::param::Param;
use crate::tensor::{Tensor, linear, swiglu};

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `[I, C]`.
    pub(crate) gate_proj: Param,
    /// `[I, C]`.
    pub(crate) up_proj: Param,
    /// `[C, I]`.
    pub(crate) down_proj: Param,
}

impl Mlp {
    /// `[N, C] -> [N, C]`; the gate through the fused kernel
    /// (`swiglu_kernel.rs`).
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        let gate = linear(x.clone(), &self.gate_proj.value);
        let up = linear(x, &self.up_proj.value);
        Ok(linear(swiglu(gate, up)?, &self.down_proj.value))
    }
}
