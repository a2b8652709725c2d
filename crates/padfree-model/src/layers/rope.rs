use crate::tensor::{Device, Tensor, cat, float_tensor, narrow};

/// Rotary position embedding, Hugging Face's rotate-half layout: the head is
/// split into halves `x1, x2` and rotated as `x * cos + (-x2, x1) * sin`, with
/// frequency `theta^(-2i/D)` for pair `i`.
///
/// Built once per forward from the batch's `position_ids` and shared by every
/// layer, so padded rows and flattened examples rotate by their own positions.
///
/// # Shapes
/// `cos`, `sin`: `[N, 1, D]`, broadcast over the heads of `[N, H, D]`.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor<3>,
    sin: Tensor<3>,
}

impl Rope {
    /// Tables for tokens at `positions` (`[N]`).
    pub fn new(positions: &[u32], head_dim: usize, theta: f64, device: &Device) -> Self {
        let half = head_dim / 2;
        // f32 throughout, as transformers computes them, so positions far from
        // 0 round the same way.
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let n = positions.len();
        let mut cos = Vec::with_capacity(n * head_dim);
        let mut sin = Vec::with_capacity(n * head_dim);
        for &position in positions {
            for _repeat in 0..2 {
                for &freq in &inv_freq {
                    let angle = position as f32 * freq;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        Self {
            cos: float_tensor(cos, [n, 1, head_dim], device),
            sin: float_tensor(sin, [n, 1, head_dim], device),
        }
    }

    /// Rotates queries or keys, `[N, H, D]`.
    pub fn apply(&self, x: Tensor<3>) -> Tensor<3> {
        let head_dim = x.dims()[2];
        let half = head_dim / 2;
        let x1 = narrow(x.clone(), 2, 0, half);
        let x2 = narrow(x.clone(), 2, half, half);
        let rotated = cat(vec![x2.neg(), x1], 2);
        x * self.cos.clone() + rotated * self.sin.clone()
    }
}
