use super::linear::Linear;
use crate::error::ModelError;
use crate::kernels::{bf16_swiglu, swiglu};
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
        // On a GPU under `--bf16` gate and up share one 16-bit copy of `x`
        // (not with LoRA adapters, which read it in f32).
        let x = match self.gate_proj.shared_half_input() {
            Some(half) => x.cast(half.dtype()),
            None => x,
        };
        let gate = self.gate_proj.forward(x.clone())?;
        let up = self.up_proj.forward(x)?;
        if self.down_proj.device_half().is_some() {
            // On a GPU the down projection keeps its input as 16-bit itself.
            return self.down_proj.forward(swiglu(gate, up)?);
        }
        if self.down_proj.is_bf16() {
            // gate and up kept as bf16 by SwiGLU, its output by down_proj.
            return self.down_proj.forward_storing_input(bf16_swiglu(gate, up)?);
        }
        self.down_proj.forward(swiglu(gate, up)?)
    }
}
