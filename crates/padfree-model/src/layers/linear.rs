use std::sync::Arc;

use half::bf16;

use crate::error::ModelError;
use crate::kernels::{
    LoraCopies, LoraLayer, SharedInput16, Weight16, bf16_linear, bf16_linear_sharing_input,
    bf16_linear_storing_input, bf16_lora_linear, bf16_quant_linear, bf16_swiglu, bf16_swiglu_down,
    composed_quant_linear, fused_linear, half_linear, half_lora_linear, lora_linear, on_cpu,
    quant_linear, swiglu, swiglu_down,
};
use crate::lora::Adapter;
use crate::precision::HalfFloat;
use crate::tensor::Tensor;
use crate::weights::quantized::QuantMatrix;
use crate::weights::table::Param;

/// A linear layer without bias, HF's `[O, C]` weight (f32, or frozen in GGUF
/// blocks), and its LoRA adapter when it has one.
#[derive(Debug, Clone)]
pub struct Linear<'a> {
    /// `[O, C]`; frozen when an adapter trains beside it.
    pub(crate) weight: &'a Param,
    /// The weight in GGUF blocks (QLoRA's base): `weight` is then a
    /// placeholder and this is what multiplies.
    pub(crate) quantized: Option<&'a QuantMatrix>,
    pub(crate) adapter: Option<Adapter<'a>>,
    /// `--bf16`: the products have bf16 operands.
    pub(crate) bf16: bool,
    /// `--bf16`: the dense weight's bf16 copy (made once per optimizer
    /// step, or once for a frozen base); `None` for a base in GGUF blocks.
    pub(crate) bf16_copy: Option<&'a Arc<[bf16]>>,
    /// `--bf16` on a GPU: the dense weight's 16-bit copy on the device
    /// (bf16 or f16, `precision.rs`), used instead of `bf16_copy`.
    pub(crate) device_copy: Option<&'a Tensor<2>>,
}

/// One bf16 store of `x` for `readers` (the projections that read one
/// norm's output) where every one of them reads only its rounding on the
/// CPU and the products pack their operands (`kernels::SharedInput16`);
/// `None` elsewhere.
pub fn shared_input(readers: &[&Linear<'_>], x: &Tensor<2>) -> Option<SharedInput16> {
    let all = readers.iter().all(|r| r.reads_only_rounded_input());
    if all && on_cpu(&x.device()) {
        SharedInput16::for_packed_bodies()
    } else {
        None
    }
}

impl<'a> Linear<'a> {
    /// `weight` (`[O, C]`, or `quantized`) with `adapter`.
    pub fn new(
        weight: &'a Param,
        quantized: Option<&'a QuantMatrix>,
        adapter: Option<Adapter<'a>>,
    ) -> Self {
        Self {
            weight,
            quantized,
            adapter,
            bf16: false,
            bf16_copy: None,
            device_copy: None,
        }
    }

    /// The same layer multiplying in bf16 (`bf16`), the dense weight from
    /// `copy`.
    pub fn with_bf16(mut self, bf16: bool, copy: Option<&'a Arc<[bf16]>>) -> Self {
        self.bf16 = bf16;
        self.bf16_copy = copy;
        self
    }

    /// The same layer's weight copy on a GPU (`--bf16` there).
    pub fn with_device_copy(mut self, copy: Option<&'a Tensor<2>>) -> Self {
        self.device_copy = copy;
        self
    }

    /// Whether the product has bf16 operands (`--bf16`).
    pub fn is_bf16(&self) -> bool {
        self.bf16
    }

    /// Whether the layer reads nothing of its input but the input's bf16
    /// rounding: `--bf16` on the CPU with a dense weight and no adapter
    /// (LoRA's dropout scales the input before it is rounded; a GGUF
    /// base is read by its own kernel).
    pub fn reads_only_rounded_input(&self) -> bool {
        self.bf16
            && self.adapter.is_none()
            && self.quantized.is_none()
            && self.device_copy.is_none()
    }

    /// The GPU's 16-bit float when this layer multiplies in it (`--bf16`
    /// on a GPU); `None` in f32 and on the CPU.
    pub fn device_half(&self) -> Option<HalfFloat> {
        if !self.bf16 {
            return None;
        }
        self.device_copy
            .and_then(|copy| HalfFloat::of(copy.dtype()))
    }

    /// The GPU's 16-bit float this layer's input may come in, cast once for
    /// the projections that share it (`--bf16` on a GPU); `None` also for
    /// a layer with an adapter, whose low-rank products read the input in
    /// f32 (`kernels::half_lora_linear`): its base product casts it itself.
    pub fn shared_half_input(&self) -> Option<HalfFloat> {
        match self.adapter {
            Some(_) => None,
            None => self.device_half(),
        }
    }

    /// Where the dense weight's `--bf16` products read it: its bf16 copy,
    /// or (no copy: `gemm_bf16::reads_weight_copies`) the f32 weight rounded.
    fn weight16(&self) -> Weight16 {
        Weight16::of(self.bf16_copy)
    }

    /// The dense weight's bf16 copy, which a LoRA layer's base always has
    /// under bf16; one without is a bug in the model.
    fn copy(&self) -> Result<&'a Arc<[bf16]>, ModelError> {
        self.bf16_copy.ok_or_else(|| ModelError::Config {
            field: "bf16",
            message: format!("`{}` has no bf16 copy", self.weight.name()),
            hint: "this is a bug in padfree; please report it",
        })
    }

    /// [`Self::forward`] for an input no other op keeps: under `--bf16`
    /// the layer keeps it for the backward pass as bf16 (half the memory).
    pub fn forward_storing_input(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        if self.bf16 && self.adapter.is_none() && self.quantized.is_none() {
            if self.device_copy.is_some() {
                // The GPU's op keeps its own 16-bit copy of `x` anyway.
                return self.forward(x);
            }
            return Ok(bf16_linear_storing_input(
                x,
                self.weight.value.clone(),
                self.weight16(),
            )?);
        }
        self.forward(x)
    }

    /// [`Self::forward`] for an input that other layers read too, kept
    /// once for all of them as bf16 through `shared` where this layer
    /// reads only its rounding (`kernels::SharedInput16`; `None`: each
    /// layer as [`Self::forward`]).
    pub fn forward_sharing_input(
        &self,
        x: Tensor<2>,
        shared: Option<&SharedInput16>,
    ) -> Result<Tensor<2>, ModelError> {
        match shared {
            Some(shared) if self.reads_only_rounded_input() => Ok(bf16_linear_sharing_input(
                x,
                self.weight.value.clone(),
                self.weight16(),
                shared,
            )?),
            _ => self.forward(x),
        }
    }

    /// `silu(gate) * up` through this layer (the MLP's `down_proj`):
    /// `[N, I]`, `[N, I]` -> `[N, O]`. A dense layer without an adapter
    /// on the CPU runs both as one op that keeps `gate` and `up` but not
    /// SwiGLU's output (`kernels/swiglu/down.rs`, the same bits); anywhere
    /// else SwiGLU runs first, under `--bf16` keeping its inputs as bf16
    /// and this layer its input.
    pub fn forward_after_swiglu(
        &self,
        gate: Tensor<2>,
        up: Tensor<2>,
    ) -> Result<Tensor<2>, ModelError> {
        let dense = self.adapter.is_none() && self.quantized.is_none();
        if dense && self.device_copy.is_none() && on_cpu(&gate.device()) {
            let w = self.weight.value.clone();
            return Ok(if self.bf16 {
                bf16_swiglu_down(gate, up, w, self.weight16())?
            } else {
                swiglu_down(gate, up, w)?
            });
        }
        if self.bf16 && self.device_copy.is_none() {
            return self.forward_storing_input(bf16_swiglu(gate, up)?);
        }
        // On a GPU under `--bf16` the layer keeps its input as 16-bit itself.
        self.forward(swiglu(gate, up)?)
    }

    /// `x W^T (+ the adapter's update)`: `[N, C] -> [N, O]`.
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        if let Some(adapter) = &self.adapter {
            // Base and adapter in one op (`kernels/lora_linear.rs`).
            let layer = LoraLayer {
                w: self.weight.value.clone(),
                quantized: self.quantized,
                a: adapter.a.value.clone(),
                b: adapter.b.value.clone(),
                factors: adapter.factors(),
            };
            if !self.bf16 {
                return Ok(lora_linear(x, layer)?);
            }
            if let Some(copy) = self.device_copy {
                // On a GPU: the base's device copy, the adapter rounded.
                return Ok(half_lora_linear(x, layer, copy)?);
            }
            let [a, b] = adapter.copies.ok_or_else(|| ModelError::Config {
                field: "bf16",
                message: format!("the adapter of `{}` has no bf16 copies", self.weight.name()),
                hint: "this is a bug in padfree; please report it",
            })?;
            let copies = LoraCopies {
                w: match self.quantized {
                    Some(_) => None,
                    None => Some(self.copy()?.clone()),
                },
                a: a.clone(),
                b: b.clone(),
            };
            return Ok(bf16_lora_linear(x, layer, copies)?);
        }
        Ok(match self.quantized {
            // The fused dequantise-and-multiply kernel is the CPU's; a GPU
            // multiplies the dequantised weight.
            Some(quantized) if self.bf16 => bf16_quant_linear(x, quantized)?,
            Some(quantized) if on_cpu(&x.device()) => quant_linear(x, quantized)?,
            Some(quantized) => composed_quant_linear(x, quantized),
            None if self.bf16 => match self.device_copy {
                Some(copy) => half_linear(x, self.weight.value.clone(), copy)?,
                None => bf16_linear(x, self.weight.value.clone(), self.weight16())?,
            },
            None => fused_linear(x, self.weight.value.clone())?,
        })
    }
}
