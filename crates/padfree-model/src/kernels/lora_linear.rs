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
//! Under `--bf16` ([`bf16_lora_linear`]) every product has bf16 operands
//! and f32 accumulation, as PEFT's layer computes under autocast: the
//! base's `W` from its bf16 copy (made once: it is frozen) or dequantised
//! to bf16 tiles (QLoRA), `A` and `B` from their copies (made once per
//! optimizer step), `x`, `drop(x)` and `dy` rounded as the products read
//! them, `down` rounded to bf16 (autocast's `lora_A` output) and the sum
//! rounded once. autocast also rounds the base's and the adapter's outputs
//! before adding them; here the adapter's product is added into the base's
//! in f32 and the sum rounded, one rounding fewer (`composed_bf16_lora_linear`
//! is the oracle of exactly this).
//!
//! # Shapes
//! `N` rows, `C` input width, `O` output width, `r` the rank: `x` `[N, C]`,
//! `W` `[O, C]`, `A` `[r, C]`, `B` `[O, r]`.

use std::sync::Arc;

use half::bf16;

use super::attention::is_cpu;
use super::bf16::{load, round_in_place, store};
use super::dropout::{DropoutMask, composed_dropout, composed_dropout_matmul};
use super::gemm::{View, Write, product, product_into};
use super::gemm_bf16::{self, View16};
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::linear::{composed_half_linear, half_linear, round_tensor};
use super::quant_matmul::{self, composed_quant_linear};
use crate::precision::HalfFloat;
use burn::tensor::DType;

use crate::tensor::{Tensor, float_tensor, linear};
use crate::weights::quantized::QuantMatrix;

/// The adapter's side of a LoRA layer.
#[derive(Debug, Clone, PartialEq)]
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

/// [`lora_linear`] on a GPU under `--bf16`: the base's product by
/// [`half_linear`] from `w16`, `W`'s 16-bit copy on the device (made once:
/// the base is frozen), on the runtime's 16-bit matmul; the adapter's two
/// low-rank products as burn's f32 matmul of operands rounded to that
/// 16-bit float ([`composed_half_linear`]: `drop(x)` and `A`, then `down`
/// and `B`), with `down` rounded in bf16 (autocast's `lora_A` output; in
/// f16 the products' outputs stay f32, as [`half_linear`]'s do). At
/// rank `r` those take `r / C + r / O` of the base's FLOPs (5.6% at
/// `r` = 16 on SmolLM2's 576-wide projections), so the adapter needs no
/// 16-bit device copies made every step. Their backward pass is burn's f32
/// matmul of the rounded operands with `dy` unrounded (the rounding is
/// differentiated as the identity), where the CPU's op rounds `dy` too.
/// The scaled adapter output is added to the base's in f32.
/// `[N, C] -> [N, O]`.
pub fn half_lora_linear(
    x: Tensor<2>,
    layer: LoraLayer<'_>,
    w16: &Tensor<2>,
) -> Result<Tensor<2>, UnsupportedTensor> {
    let Some(half) = HalfFloat::of(w16.dtype()) else {
        return Err(UnsupportedTensor(format!(
            "a LoRA base copy of dtype {:?} (bf16 or f16 expected)",
            w16.dtype()
        )));
    };
    if layer.quantized.is_some() {
        return Err(UnsupportedTensor(
            "a base in GGUF blocks on a GPU (QLoRA runs on the CPU)".into(),
        ));
    }
    if x.dtype() != DType::F32 {
        // Its adapter reads `x` in f32 (a 16-bit input is the plain
        // projections' shared copy: `Linear::shared_half_input`).
        return Err(UnsupportedTensor(format!(
            "a LoRA layer's input of dtype {:?} on a GPU (f32 expected)",
            x.dtype()
        )));
    }
    let base = half_linear(x.clone(), layer.w, w16)?;
    let dropped = match layer.factors.dropout {
        Some(mask) => composed_dropout(x, mask),
        None => x,
    };
    let down = composed_half_linear(dropped, layer.a, half);
    let up = composed_half_linear(down, layer.b, half);
    Ok(base + up.mul_scalar(layer.factors.scale))
}

/// The bf16 copies a LoRA layer multiplies under `--bf16`.
#[derive(Debug, Clone)]
pub struct LoraCopies {
    /// `W`'s copy, `[O, C]`; `None` for a base in GGUF blocks (its tiles
    /// are rounded as they are dequantised).
    pub w: Option<Arc<[bf16]>>,
    /// `[r, C]`.
    pub a: Arc<[bf16]>,
    /// `[O, r]`.
    pub b: Arc<[bf16]>,
}

/// [`lora_linear`] with bf16 operands and f32 accumulation (`--bf16`, see
/// the module's notes): `[N, C] -> [N, O]`, the output rounded to bf16,
/// differentiable in `x` and the adapter. CPU only.
///
/// # Panics
/// When a copy's length differs from its weight's (a bug in the caller),
/// or a dense base has no copy.
pub fn bf16_lora_linear(
    x: Tensor<2>,
    layer: LoraLayer<'_>,
    copies: LoraCopies,
) -> Result<Tensor<2>, UnsupportedTensor> {
    if !is_cpu(&x.device()) {
        return Err(UnsupportedTensor(
            "bf16 matmuls run on the CPU only in this build".into(),
        ));
    }
    let LoraLayer {
        w,
        quantized,
        a,
        b,
        factors,
    } = layer;
    let base = match (quantized, copies.w) {
        (Some(quantized), _) => Base16::Quantized(quantized.clone()),
        (None, Some(copy)) => {
            assert_eq!(
                copy.len(),
                w.dims().iter().product::<usize>(),
                "bf16 LoRA: W's copy"
            );
            Base16::Dense(copy)
        }
        (None, None) => panic!("bf16 LoRA: a dense base without its bf16 copy"),
    };
    assert_eq!(
        copies.a.len(),
        a.dims().iter().product::<usize>(),
        "bf16 LoRA: A's copy"
    );
    assert_eq!(
        copies.b.len(),
        b.dims().iter().product::<usize>(),
        "bf16 LoRA: B's copy"
    );
    apply::<_, 4, 2, 2>(
        Bf16LoraLinear {
            base,
            a16: copies.a,
            b16: copies.b,
            factors,
        },
        [x, w, a, b],
    )
}

/// The oracle of [`bf16_lora_linear`]: every operand rounded to bf16 before
/// burn's f32 matmuls (the base dequantised first), `down` rounded, the sum
/// rounded; each rounding the identity's gradient.
pub fn composed_bf16_lora_linear(x: Tensor<2>, layer: LoraLayer<'_>) -> Tensor<2> {
    let [n, c] = x.dims();
    let device = x.device();
    let w = match layer.quantized {
        Some(quantized) => float_tensor(quantized.dequantized(), quantized.dims(), &device),
        None => layer.w,
    };
    let base = linear(round_tensor(x.clone()), &round_tensor(w));
    let dropped = match layer.factors.dropout {
        Some(mask) => x * float_tensor(mask.values(c), [n, c], &device),
        None => x,
    };
    let down = round_tensor(linear(round_tensor(dropped), &round_tensor(layer.a)));
    let update = linear(down, &round_tensor(layer.b)).mul_scalar(layer.factors.scale);
    round_tensor(base + update)
}

/// The frozen base of a bf16 LoRA layer.
#[derive(Debug, Clone)]
enum Base16 {
    /// `W`'s bf16 copy, `[O, C]`.
    Dense(Arc<[bf16]>),
    /// GGUF blocks, dequantised to bf16 a tile at a time.
    Quantized(QuantMatrix),
}

#[derive(Debug, Clone)]
struct Bf16LoraLinear {
    base: Base16,
    a16: Arc<[bf16]>,
    b16: Arc<[bf16]>,
    factors: LoraFactors,
}

impl HostOp<4> for Bf16LoraLinear {
    /// No gradient reads the output; `down` is kept in `saved` (as bf16).
    const KEEPS_OUTPUT: bool = false;

    fn forward(&self, [x, _w, a, b]: [HostTensor<'_>; 4]) -> HostOutput {
        let (n, c, r) = (x.shape[0], x.shape[1], a.shape[0]);
        let o = b.shape[0];
        let xv = View16::f32(x.values, n, c);
        let mut y = match &self.base {
            Base16::Quantized(quantized) => quant_matmul::forward_bf16(quantized, x.values, n),
            Base16::Dense(w16) => gemm_bf16::product(xv, View16::bf16(w16, o, c).t()),
        };
        let dropped = self
            .factors
            .dropout
            .as_ref()
            .map(|mask| mask.dropped(x.values));
        // `down` is rounded to bf16 as the next product reads it, and as
        // it is stored: autocast's bf16 `lora_A` output either way.
        let down = gemm_bf16::product(
            View16::f32(dropped.as_deref().unwrap_or(x.values), n, c),
            View16::bf16(&self.a16, r, c).t(),
        );
        gemm_bf16::product_into(
            &mut y,
            o,
            View16::f32(&down, n, r),
            View16::bf16(&self.b16, o, r).t(),
            Write::Add(self.factors.scale),
        );
        round_in_place(&mut y);
        HostOutput {
            values: y,
            shape: vec![n, o],
            saved: store(&down),
        }
    }

    fn backward(
        &self,
        [x, _w, a, b]: [HostTensor<'_>; 4],
        _output: &[f32],
        saved: &[f32],
        d_out: &[f32],
        [x_needed, _, a_needed, b_needed]: [bool; 4],
    ) -> [Vec<f32>; 4] {
        let (n, c, r) = (x.shape[0], x.shape[1], a.shape[0]);
        let o = b.shape[0];
        let s = self.factors.scale;
        let down = load(saved, n * r);
        let dy = View16::f32(d_out, n, o);
        // d(down) = s dy B: `[N, r]`, f32 (autocast would round it: one
        // rounding of a small matrix that costs nothing to keep).
        let mut d_down = gemm_bf16::product(dy, View16::bf16(&self.b16, o, r));
        d_down.iter_mut().for_each(|v| *v *= s);
        let d_down_view = View16::f32(&d_down, n, r);
        let d_b = if b_needed {
            let mut d_b = gemm_bf16::product(dy.t(), View16::f32(&down, n, r));
            d_b.iter_mut().for_each(|v| *v *= s);
            d_b
        } else {
            Vec::new()
        };
        let a_view = View16::bf16(&self.a16, r, c);
        let mut dx = if x_needed {
            match &self.base {
                Base16::Quantized(quantized) => quant_matmul::backward_bf16(quantized, d_out, n),
                Base16::Dense(w16) => gemm_bf16::product(dy, View16::bf16(w16, o, c)),
            }
        } else {
            Vec::new()
        };
        let d_a_from = |dropped: &[f32]| {
            if a_needed {
                gemm_bf16::product(d_down_view.t(), View16::f32(dropped, n, c))
            } else {
                Vec::new()
            }
        };
        let d_a = match &self.factors.dropout {
            Some(mask) if x_needed => {
                let mut through = gemm_bf16::product(d_down_view, a_view);
                mask.backward(x.values, &mut through, &mut dx);
                d_a_from(&through)
            }
            Some(mask) => d_a_from(&mask.dropped(x.values)),
            None => {
                if x_needed {
                    gemm_bf16::product_into(&mut dx, c, d_down_view, a_view, Write::Add(1.0));
                }
                d_a_from(x.values)
            }
        };
        [dx, Vec::new(), d_a, d_b]
    }
}

#[derive(Debug, Clone)]
struct LoraLinear {
    quantized: Option<QuantMatrix>,
    factors: LoraFactors,
}

impl LoraLinear {
    /// `drop(x)`, or `x` itself without dropout.
    fn dropped<'x>(&self, x: &'x [f32]) -> std::borrow::Cow<'x, [f32]> {
        match &self.factors.dropout {
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
        let d_a = match &self.factors.dropout {
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
    use crate::kernels::dropout::RowKeys;
    use crate::kernels::test_util::{assert_within, random};
    use crate::tensor::{IntoHostVec, backward, cpu_device, float_tensor, frozen, grad, trainable};
    use crate::weights::gguf::GgmlType;
    use padfree_pack::SplitMix64;

    /// Q8_0 blocks of `[o, c]`: an f16 scale, then 32 signed bytes.
    fn q8_0(o: usize, c: usize) -> QuantMatrix {
        let mut rng = SplitMix64::new(6);
        let blocks: Vec<u8> = (0..o * c / 32)
            .flat_map(|_| {
                let mut block = half::f16::from_f32(0.02).to_le_bytes().to_vec();
                block.extend((0..32).map(|_| rng.next_u64() as u8));
                block
            })
            .collect();
        QuantMatrix::new(GgmlType::Q8_0, o, c, blocks).expect("whole blocks")
    }

    /// The layer tests' shape and inputs: `x` `[37, 64]`, `W` `[48, 64]`,
    /// `A` `[4, 64]`, `B` `[48, 4]`, `dy` `[37, 48]` (through `dy_value`).
    const N: usize = 37;
    const C: usize = 64;
    const O: usize = 48;
    const R: usize = 4;

    fn inputs(dy_value: fn(f32) -> f32) -> [Vec<f32>; 5] {
        let dy = random(N * O, 5).into_iter().map(dy_value).collect();
        [
            random(N * C, 1),
            random(O * C, 2),
            random(R * C, 3),
            random(O * R, 4),
            dy,
        ]
    }

    #[derive(Clone, Copy)]
    enum Op {
        Fused,
        Composed,
        Bf16,
        ComposedBf16,
    }

    /// Without dropout, and with a mask over the `N` rows.
    fn dropouts() -> [Option<DropoutMask>; 2] {
        [
            None,
            Some(DropoutMask {
                p: 0.3,
                seed: 11,
                rows: RowKeys::indexed(N),
            }),
        ]
    }

    /// `[y, dx, dA, dB]` of `sum(op(x) * dy)`, the base dense or `quantized`.
    fn run(
        op: Op,
        [x0, w0, a0, b0, dy0]: &[Vec<f32>; 5],
        quantized: Option<&QuantMatrix>,
        dropout: Option<DropoutMask>,
    ) -> [Vec<f32>; 4] {
        use crate::kernels::bf16::round_slice;
        let device = cpu_device(true);
        let x = trainable(float_tensor(x0.clone(), [N, C], &device));
        let w = match quantized {
            Some(_) => frozen(float_tensor(vec![0.0], [1, 1], &device)),
            None => frozen(float_tensor(w0.clone(), [O, C], &device)),
        };
        let a = trainable(float_tensor(a0.clone(), [R, C], &device));
        let b = trainable(float_tensor(b0.clone(), [O, R], &device));
        let layer = LoraLayer {
            w: w.clone(),
            quantized,
            a: a.clone(),
            b: b.clone(),
            factors: LoraFactors {
                scale: 2.0,
                dropout,
            },
        };
        let y = match op {
            Op::Fused => lora_linear(x.clone(), layer).expect("f32 on the CPU"),
            Op::Composed => composed_lora_linear(x.clone(), layer),
            Op::Bf16 => {
                let copies = LoraCopies {
                    w: quantized.is_none().then(|| round_slice(w0).into()),
                    a: round_slice(a0).into(),
                    b: round_slice(b0).into(),
                };
                bf16_lora_linear(x.clone(), layer, copies).expect("CPU")
            }
            Op::ComposedBf16 => composed_bf16_lora_linear(x.clone(), layer),
        };
        let dy = float_tensor(dy0.clone(), [N, O], &device);
        let grads = backward(&(y.clone() * dy).sum());
        assert!(grad(&w, &grads).is_none(), "the base is frozen");
        let g = |t: &Tensor<2>| grad(t, &grads).expect("gradient").into_vec();
        [y.into_vec(), g(&x), g(&a), g(&b)]
    }

    /// The bf16 layer against its oracle (every operand rounded, burn's f32
    /// matmuls), for a dense and a Q8_0 base, with and without dropout,
    /// `dy` rounded beforehand as the op rounds it. Tolerances: `y` and
    /// `down` are rounded in both, so `y` agrees but where an f32 sum
    /// straddles a rounding tie (one bf16 step, 1e-2 of the scale, and at
    /// least 99% of the values equal); `dB` reads the rounded `down`, the
    /// same way (1e-2); `dx` and `dA` read `d(down)`, which the op rounds
    /// to bf16 (as autocast's `lora_A` gradient is) and the oracle does not:
    /// half a bf16 step relative on the adapter's share, 4e-3 of the
    /// scale. And the bf16 layer is not the f32 one: rounding must show.
    #[test]
    fn bf16_layer_matches_its_rounded_oracle() {
        use crate::kernels::bf16::rounded;
        let inputs = inputs(rounded);
        let quant = q8_0(O, C);
        for quantized in [None, Some(&quant)] {
            for dropout in dropouts() {
                let case = |what: &str| {
                    format!(
                        "bf16 {what} (quantized {}, dropout {})",
                        quantized.is_some(),
                        dropout.is_some()
                    )
                };
                let ours = run(Op::Bf16, &inputs, quantized, dropout.clone());
                let theirs = run(Op::ComposedBf16, &inputs, quantized, dropout.clone());
                let f32s = run(Op::Fused, &inputs, quantized, dropout.clone());
                for (i, (what, tolerance)) in
                    [("y", 1e-2), ("dx", 4e-3), ("dA", 4e-3), ("dB", 1e-2)]
                        .into_iter()
                        .enumerate()
                {
                    assert_within(&case(what), &ours[i], &theirs[i], tolerance);
                }
                let exact = ours[0]
                    .iter()
                    .zip(&theirs[0])
                    .filter(|(a, b)| a == b)
                    .count();
                assert!(
                    exact * 100 >= 99 * ours[0].len(),
                    "{}: {exact} of {} equal",
                    case("y"),
                    ours[0].len()
                );
                assert_ne!(ours[0], f32s[0], "{}: rounding must show", case("y"));
            }
        }
    }

    /// The fused layer against the composed one: output and the gradients
    /// of `x`, `A`, `B`, for an f32 and a Q8_0 base, with and without
    /// dropout. Tolerance 1e-5 of the largest value: the same f32 products,
    /// the adapter's scale applied before rather than after its second
    /// product and its sum taken inside gemm (a few roundings apart).
    #[test]
    fn fused_layer_matches_the_composed_one() {
        let inputs = inputs(|v| v);
        let quant = q8_0(O, C);
        for quantized in [None, Some(&quant)] {
            for dropout in dropouts() {
                let ours = run(Op::Fused, &inputs, quantized, dropout.clone());
                let theirs = run(Op::Composed, &inputs, quantized, dropout.clone());
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
