use super::linear::Linear;
use crate::error::ModelError;
use crate::kernels::swiglu;
use crate::tensor::Tensor;

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp<'a> {
    /// `[I, C]`.
    pub(crate) gate_proj: Linear<'a>,
    /// `[I, C]`.
    pub(crate) up_proj: Linear<'a>,
    /// `[C, I]`.
    pub(crate) down_proj: Linear<'a>,
}

impl Mlp<'_> {
    /// `[N, C] -> [N, C]`; the gate through the fused kernel
    /// (`kernels/swiglu.rs`).
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        let gate = self.gate_proj.forward(x.clone())?;
        let up = self.up_proj.forward(x)?;
        self.down_proj.forward(swiglu(gate, up)?)
    }
}
