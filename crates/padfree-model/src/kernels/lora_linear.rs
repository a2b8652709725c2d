//! A LoRA layer in one op: `y = x W^T + s (drop(x) A^T) B^T`, `W` frozen
//! (f32, or QLoRA's GGUF blocks), `A` and `B` trained.
//!
//! Composed, the layer is five ops, each with its own `[N, O]` or `[N, C]`
//! buffer: the base product, the two adapter products, the scale and the
//! sum, and in the backward pass the input gradients of the base and the
//! adapter summed by burn. Here the adapter's product is added into the
//! base's output by gemm itself (`kernels/gemm.rs`), and the adapter's input
//! gradient into the base's (through the dropout mask, drawn again, when
//! there is one): one `[N, O]` output and one `[N, C]` input gradient. The
//! op keeps `down = drop(x) A^T` (`[N, r]`, small) for `dB`; the dropped
//! input is drawn again for `dA` rather than kept.
//!
//! The oracle beside it is the composed layer (`composed_lora_linear`):
//! burn's matmul, or dequantize-then-multiply, plus the adapter from burn
//! ops with the mask as a tensor.
//!
//! # Shapes
//! `N` rows, `C` input width, `O` output width, `r` the rank: `x` `[N, C]`,
//! `W` `[O, C]`, `A` `[r, C]`, `B` `[O, r]`.

use super::attention::is_cpu;
use super::dropout::{DropoutMask, composed_dropout_matmul};
use super::gemm::{View, Write, product, product_into};
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::quant_matmul::{self, composed_quant_linear};
use crate::tensor::{Tensor, linear};
use crate::weights::quantized::QuantMatrix;

/// The adapter's side of a LoRA layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraFactors {
    /// `alpha / r`.
    pub scale: f32,
    /// Dropout on the adapter's input, when training with it.
    pub dropout: Option<DropoutMask>,
}

/// A LoRA layer's weights: the frozen base and the adapter.
#[derive(Debug, Clone)]
pub struct LoraLayer<'a> {
    /// `[O, C]`, frozen; a placeholder when `quantized` holds the weight.
    pub w: Tensor<2>,
    /// The base in GGUF blocks (QLoRA).
    pub quantized: Option<&'a QuantMatrix>,
    /// `[r, C]`.
    pub a: Tensor<2>,
    /// `[O, r]`.
    pub b: Tensor<2>,
    /// The scale and the dropout mask.
    pub factors: LoraFactors,
}

/// `x W^T + s (drop(x) A^T) B^T`: `[N, C] -> [N, O]`, differentiable in
/// `x` and the adapter (`W` is frozen).
///
/// On a GPU this is [`composed_lora_linear`].
pub fn lora_linear(x: Tensor<2>, layer: LoraLayer<'_>) -> Result<Tensor<2>, UnsupportedTensor> {
    if !is_cpu(&x.device()) {
        return Ok(composed_lora_linear(x, layer));
    }
    let LoraLayer {
        w,
        quantized,
        a,
        b,
        factors,
    } = layer;
    apply::<_, 4, 2, 2>(
        LoraLinear {
            quantized: quantized.cloned(),
            factors,
        },
        [x, w, a, b],
    )
}

/// The oracle, and the GPU path: the layer from burn ops (PEFT's order:
/// base, then the adapter, scaled, added).
pub fn composed_lora_linear(x: Tensor<2>, layer: LoraLayer<'_>) -> Tensor<2> {
    let base = match layer.quantized {
        Some(quantized) => composed_quant_linear(x.clone(), quantized),
        None => linear(x.clone(), &layer.w),
    };
    let down = match layer.factors.dropout {
        Some(mask) => composed_dropout_matmul(x, layer.a, mask),
        None => linear(x, &layer.a),
    };
    base + linear(down, &layer.b).mul_scalar(layer.factors.scale)
}

#[derive(Debug, Clone)]
struct LoraLinear {
    quantized: Option<QuantMatrix>,
    factors: LoraFactors,
}

impl LoraLinear {
    /// `drop(x)`, or `x` itself without dropout.
    fn dropped<'x>(&self, x: &'x [f32]) -> std::borrow::Cow<'x, [f32]> {
        match self.factors.dropout {
            Some(mask) => std::borrow::Cow::Owned(mask.dropped(x)),
            None => std::borrow::Cow::Borrowed(x),
        }
    }
}

impl HostOp<4> for LoraLinear {
    /// No gradient reads the output; `down` is kept in `saved`.
    const KEEPS_OUTPUT: bool = false;

    fn forward(&self, [x, w, a, b]: [HostTensor<'_>; 4]) -> HostOutput {
        let (n, c, r) = (x.shape[0], x.shape[1], a.shape[0]);
        let o = b.shape[0];
        let mut y = match &self.quantized {
            Some(quantized) => quant_matmul::forward(quantized, x.values, n),
            None => product(
                View::row_major(x.values, n, c),
                View::row_major(w.values, o, c).t(),
            ),
        };
        let down = product(
            View::row_major(&self.dropped(x.values), n, c),
            View::row_major(a.values, r, c).t(),
        );
        product_into(
            &mut y,
            o,
            View::row_major(&down, n, r),
            View::row_major(b.values, o, r).t(),
            Write::Add(self.factors.scale),
        );
        HostOutput {
            values: y,
            shape: vec![n, o],
            saved: down,
        }
    }

    fn backward(
        &self,
        [x, w, a, b]: [HostTensor<'_>; 4],
        _output: &[f32],
        down: &[f32],
        d_out: &[f32],
        [x_needed, _, a_needed, b_needed]: [bool; 4],
    ) -> [Vec<f32>; 4] {
        let (n, c, r) = (x.shape[0], x.shape[1], a.shape[0]);
        let o = b.shape[0];
        let s = self.factors.scale;
        let dy = View::row_major(d_out, n, o);
        // d(down) = s dy B: `[N, r]`.
        let mut d_down = product(dy, View::row_major(b.values, o, r));
        d_down.iter_mut().for_each(|v| *v *= s);
        let d_down_view = View::row_major(&d_down, n, r);
        let d_b = if b_needed {
            let mut d_b = product(dy.t(), View::row_major(down, n, r));
            d_b.iter_mut().for_each(|v| *v *= s);
            d_b
        } else {
            Vec::new()
        };
        let a_view = View::row_major(a.values, r, c);
        let mut dx = if x_needed {
            match &self.quantized {
                Some(quantized) => quant_matmul::backward(quantized, d_out, n),
                None => product(dy, View::row_major(w.values, o, c)),
            }
        } else {
            Vec::new()
        };
        let d_a_from = |dropped: &[f32]| {
            if a_needed {
                product(d_down_view.t(), View::row_major(dropped, n, c))
            } else {
                Vec::new()
            }
        };
        let d_a = match self.factors.dropout {
            // One pass draws the mask for both: the gradient through it
            // into `dx`, and the dropped input for `dA`.
            Some(mask) if x_needed => {
                let mut through = product(d_down_view, a_view);
                mask.backward(x.values, &mut through, &mut dx);
                d_a_from(&through)
            }
            Some(mask) => d_a_from(&mask.dropped(x.values)),
            None => {
                if x_needed {
                    product_into(&mut dx, c, d_down_view, a_view, Write::Add(1.0));
                }
                d_a_from(x.values)
            }
        };
        // `W` is frozen: its gradient is never asked for.
        [dx, Vec::new(), d_a, d_b]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{assert_within, random};
    use crate::tensor::{IntoHostVec, backward, cpu_device, float_tensor, frozen, grad, trainable};
    use crate::weights::gguf::GgmlType;
    use padfree_pack::SplitMix64;

    /// The fused layer against the composed one: output and the gradients
    /// of `x`, `A`, `B`, for an f32 and a Q8_0 base, with and without
    /// dropout. Tolerance 1e-5 of the largest value: the same f32 products,
    /// the adapter's scale applied before rather than after its second
    /// product and its sum taken inside gemm (a few roundings apart).
    #[test]
    fn fused_layer_matches_the_composed_one() {
        let device = cpu_device(true);
        let (n, c, o, r) = (37, 64, 48, 4);
        let (x0, w0, a0, b0, dy0) = (
            random(n * c, 1),
            random(o * c, 2),
            random(r * c, 3),
            random(o * r, 4),
            random(n * o, 5),
        );
        // Q8_0 blocks: an f16 scale, then 32 signed bytes.
        let mut rng = SplitMix64::new(6);
        let blocks: Vec<u8> = (0..o * c / 32)
            .flat_map(|_| {
                let mut block = half::f16::from_f32(0.02).to_le_bytes().to_vec();
                block.extend((0..32).map(|_| rng.next_u64() as u8));
                block
            })
            .collect();
        let quant = QuantMatrix::new(GgmlType::Q8_0, o, c, blocks).expect("whole blocks");
        for quantized in [None, Some(&quant)] {
            for dropout in [None, Some(DropoutMask { p: 0.3, seed: 11 })] {
                let factors = LoraFactors {
                    scale: 2.0,
                    dropout,
                };
                let run = |fused: bool| {
                    let x = trainable(float_tensor(x0.clone(), [n, c], &device));
                    let w = match quantized {
                        Some(_) => frozen(float_tensor(vec![0.0], [1, 1], &device)),
                        None => frozen(float_tensor(w0.clone(), [o, c], &device)),
                    };
                    let a = trainable(float_tensor(a0.clone(), [r, c], &device));
                    let b = trainable(float_tensor(b0.clone(), [o, r], &device));
                    let layer = LoraLayer {
                        w: w.clone(),
                        quantized,
                        a: a.clone(),
                        b: b.clone(),
                        factors,
                    };
                    let y = if fused {
                        lora_linear(x.clone(), layer).expect("f32 on the CPU")
                    } else {
                        composed_lora_linear(x.clone(), layer)
                    };
                    let dy = float_tensor(dy0.clone(), [n, o], &device);
                    let grads = backward(&(y.clone() * dy).sum());
                    assert!(grad(&w, &grads).is_none(), "the base is frozen");
                    let g = |t: &Tensor<2>| grad(t, &grads).expect("gradient").into_vec();
                    [y.into_vec(), g(&x), g(&a), g(&b)]
                };
                let (ours, theirs) = (run(true), run(false));
                for ((what, a), b) in ["y", "dx", "dA", "dB"].iter().zip(&ours).zip(&theirs) {
                    let case = format!(
                        "{what} (quantized {}, dropout {})",
                        quantized.is_some(),
                        dropout.is_some()
                    );
                    assert_within(&case, a, b, 1e-5);
                }
            }
        }
    }
}
