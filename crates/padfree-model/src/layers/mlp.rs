use super::linear::{Linear, shared_input};
use crate::error::ModelError;
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
    /// `[N, C] -> [N, C]`; the gate through the fused kernel, on the CPU
    /// in one op with `down_proj` (`kernels/swiglu/`).
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        // On a GPU under `--bf16` gate and up share one 16-bit copy of `x`
        // (not with LoRA adapters, which read it in f32).
        let x = match self.gate_proj.shared_half_input() {
            Some(half) => x.cast(half.dtype()),
            None => x,
        };
        let shared = shared_input(&[&self.gate_proj, &self.up_proj], &x);
        let gate = self
            .gate_proj
            .forward_sharing_input(x.clone(), shared.as_ref())?;
        let up = self.up_proj.forward_sharing_input(x, shared.as_ref())?;
        self.down_proj.forward_after_swiglu(gate, up)
    }
}
