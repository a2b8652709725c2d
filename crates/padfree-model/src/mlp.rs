use crate::param::Param;
use crate::tensor::{Tensor, linear, silu};

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
    /// `[N, C] -> [N, C]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let gate = silu(linear(x.clone(), &self.gate_proj.value));
        let up = linear(x, &self.up_proj.value);
        linear(gate * up, &self.down_proj.value)
    }
}
