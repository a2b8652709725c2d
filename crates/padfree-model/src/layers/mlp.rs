use crate::error::ModelError;
use crate::kernels::swiglu;
use crate::tensor::{Tensor, linear};
use crate::weights::table::Param;

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp<'a> {
    /// `[I, C]`.
    pub(crate) gate_proj: &'a Param,
    /// `[I, C]`.
    pub(crate) up_proj: &'a Param,
    /// `[C, I]`.
    pub(crate) down_proj: &'a Param,
}

impl Mlp<'_> {
    /// `[N, C] -> [N, C]`; the gate through the fused kernel
    /// (`kernels/swiglu.rs`).
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        let gate = linear(x.clone(), &self.gate_proj.value);
        let up = linear(x, &self.up_proj.value);
        Ok(linear(swiglu(gate, up)?, &self.down_proj.value))
    }
}
