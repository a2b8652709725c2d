use crate::error::ModelError;
use crate::kernels::{RopeTables, rope};
use crate::tensor::{Device, Tensor, float_tensor};

/// Rotary position embedding, Hugging Face's rotate-half layout: the head is
/// split into halves `x1, x2` and rotated as `x * cos + (-x2, x1) * sin`, with
/// frequency `theta^(-2i/D)` for pair `i`; on the CPU one fused op
/// (`kernels/rope.rs`).
///
/// Built once per forward from the batch's `position_ids` and shared by every
/// layer, so padded rows and flattened examples rotate by their own positions.
///
/// # Shapes
/// `cos`, `sin`: `[N, 1, D]`, broadcast over the heads of `[N, H, D]` (the
/// composed form's tables); the fused op's are `[N, D / 2]`.
#[derive(Debug, Clone)]
pub struct Rope {
    tables: RopeTables,
    cos: Tensor<3>,
    sin: Tensor<3>,
}

impl Rope {
    /// Tables for tokens at `positions` (`[N]`).
    pub fn new(positions: &[u32], head_dim: usize, theta: f64, device: &Device) -> Self {
        let tables = RopeTables::new(positions, head_dim, theta);
        let (cos_half, sin_half) = tables.values();
        let half = head_dim / 2;
        let widen = |values: &[f32]| -> Vec<f32> {
            values
                .chunks(half)
                .flat_map(|pairs| pairs.iter().chain(pairs).copied())
                .collect()
        };
        let n = positions.len();
        Self {
            cos: float_tensor(widen(cos_half), [n, 1, head_dim], device),
            sin: float_tensor(widen(sin_half), [n, 1, head_dim], device),
            tables,
        }
    }

    /// Rotates queries or keys, `[N, H, D]`.
    pub fn apply(&self, x: Tensor<3>) -> Result<Tensor<3>, ModelError> {
        Ok(rope(x, &self.tables, &self.cos, &self.sin)?)
    }
}
