//! `--bf16` on the model: the precision it computes in and the bf16 copies
//! of its matmul weights (the base's and the adapters'), made once per
//! optimizer step.

use super::LlamaModel;
use crate::error::ModelError;
use crate::precision::{Bf16Weights, CopyToWrite, HalfFloat, Precision};
use crate::tensor::Tensor;
use crate::weights::table::index;

impl LlamaModel {
    /// The same model computing its matmuls in `precision`. bf16 makes the
    /// weights' bf16 copies at once (the adapters' too). On a GPU the copies
    /// are device tensors of its runtime's 16-bit float (bf16, or f16 where
    /// it has no bf16: [`Self::half_float`]); with LoRA there the frozen
    /// base has them (made once) and the adapters none (their low-rank
    /// products round their operands as they read them:
    /// `kernels::half_lora_linear`).
    pub fn with_precision(mut self, precision: Precision) -> Result<Self, ModelError> {
        if precision == Precision::F32 {
            self.bf16 = None;
            if let Some(lora) = &mut self.lora {
                lora.bf16 = None;
            }
            return Ok(self);
        }
        let refuse = |message: &str, hint: &'static str| {
            Err(ModelError::Precision {
                message: message.to_owned(),
                hint,
            })
        };
        let mut copies = Bf16Weights::default();
        // Switched on again, bf16 keeps whether the host has copies
        // (`Self::with_bf16_weight_copies`).
        if let Some(before) = &self.bf16 {
            copies.host_copies = before.host_copies;
        }
        if !self.on_cpu() {
            if self.lora.is_some() && self.quantized.iter().any(Option::is_some) {
                return refuse(
                    "--bf16 with QLoRA (a base in GGUF blocks) runs on the CPU only",
                    "drop --device to train QLoRA in bf16 on the CPU, or load the base dense (--dequantize-base)",
                );
            }
            let Some(half) = crate::device::half_float(&self.device) else {
                return refuse(
                    "this GPU's runtime has neither bf16 nor f16 (for WGSL, the adapter lacks `shader-f16`)",
                    "drop --bf16 to train in f32 on this GPU, or use --device cuda on an NVIDIA GPU",
                );
            };
            copies.half = Some(half);
        }
        self.bf16 = Some(copies);
        self.refresh_base_copies();
        if self.on_cpu()
            && let Some(lora) = &mut self.lora
        {
            lora.refresh_bf16();
        }
        Ok(self)
    }

    /// The 16-bit float of the GPU's products under `--bf16`: bf16, or f16
    /// on a runtime without bf16; `None` in f32 and on the CPU.
    pub fn half_float(&self) -> Option<HalfFloat> {
        self.bf16.as_ref().and_then(|b| b.half)
    }

    /// What computes the `--bf16` products here, for the log: the CPU's
    /// kernel, or the GPU's matmul and its 16-bit float.
    pub fn bf16_matmul_body(&self) -> &'static str {
        match self.half_float() {
            Some(HalfFloat::Bf16) => "bf16 operands on the GPU's CubeCL matmul",
            Some(HalfFloat::F16) => {
                "f16 operands on the GPU's CubeCL matmul, as this runtime has no bf16 (WGSL); output gradients scaled into f16's range per product"
            }
            None => Precision::cpu_matmul_body(),
        }
    }

    /// What the matmuls compute in.
    pub fn precision(&self) -> Precision {
        if self.bf16.is_some() {
            Precision::Bf16
        } else {
            Precision::F32
        }
    }

    /// Makes the bf16 copies of what trains again from the f32 master
    /// weights: after every optimizer step (the trainer calls it), never in
    /// between. With LoRA only the adapters' copies: the base is frozen,
    /// its copies were made once. Nothing to do in f32.
    pub fn refresh_bf16_weights(&mut self) {
        if self.bf16.is_none() {
            return;
        }
        let on_gpu = !self.on_cpu();
        match &mut self.lora {
            // A GPU's adapters have no copies (`kernels::half_lora_linear`).
            Some(_) if on_gpu => {}
            Some(lora) => lora.refresh_bf16(),
            None => self.refresh_base_copies(),
        }
    }

    /// The host bf16 copies of what trains, in [`Self::trainable`]'s
    /// order (`None` where a parameter has no copy), for the optimizer to
    /// write as it updates the master weights: each value rounded from the
    /// updated f32 as [`Self::refresh_bf16_weights`] would round it, in the
    /// same pass, without reading the weights again (that pass was ~5% of a
    /// SmolLM2-135M step on short examples). `None` where the copies are
    /// not host values (f32, a GPU): then the optimizer updates the f32
    /// weights alone and the caller refreshes. The writer owes every value
    /// of every copy handed out: this counts as the step's refresh.
    pub fn bf16_copies_to_write(&mut self) -> Option<Vec<Option<CopyToWrite<'_>>>> {
        if !self.on_cpu() {
            return None;
        }
        let copies = match &mut self.lora {
            Some(lora) => lora.bf16.as_mut()?,
            None => self.bf16.as_mut()?,
        };
        Some(copies.lend_for_writing())
    }

    /// Lets go of the host bf16 copies of what trains, after the step's
    /// last forward pass and before its backward pass: the pass's ops hold
    /// the copies they read until their backward pass is done with them,
    /// so each copy's memory is freed as the backward pass leaves its
    /// layer, and the gradients made after take its room. The update then
    /// makes them again ([`Self::bf16_copies_to_write`]), still once per
    /// optimizer step; it must come before the next forward pass, which
    /// would otherwise read the f32 weights rounded (the same values, more
    /// slowly). Without it the copies and all the gradients are alive
    /// together at the backward pass's end: on SmolLM2-135M's short
    /// batches, where that is the step's peak, 256 MiB more than f32's.
    /// Returns the bytes let go of: 0 in f32, on a GPU, under LoRA (the
    /// frozen base's copies are made once; the adapters' are small) and
    /// where the products read the f32 weights rounded (no copies).
    pub fn release_bf16_copies(&mut self) -> usize {
        match (&mut self.bf16, &self.lora) {
            (Some(bf16), None) if bf16.half.is_none() => bf16.release(),
            _ => 0,
        }
    }

    /// The bytes [`Self::release_bf16_copies`] would let go of now.
    pub fn releasable_bf16_bytes(&self) -> usize {
        match (&self.bf16, &self.lora) {
            (Some(bf16), None) if bf16.half.is_none() => bf16.bytes(),
            _ => 0,
        }
    }

    /// The copies of the base's matmul weights.
    pub(super) fn refresh_base_copies(&mut self) {
        let head = self.head_index();
        let per_layer = self.layer_tensors.len();
        let first_layer = index::layer_start(0, per_layer);
        let layers_end = index::layer_start(self.config.num_hidden_layers, per_layer);
        let params: Vec<&Tensor<2>> = self.params.iter().map(|p| &p.value).collect();
        let lora = self.lora.is_some();
        let Some(bf16) = &mut self.bf16 else {
            return;
        };
        // The layers' projection matrices (not their `[1, C]` norms and
        // biases) and the head; the embedding only when it is the head.
        // None where the CPU's products read the f32 weights rounded, but
        // for LoRA's frozen base (made once, and its layer reads only
        // copies); a GPU's products always read their device copies.
        let wanted = bf16.half.is_some() || bf16.host_copies || lora;
        bf16.refresh(&params, |index| {
            let rows = params[index].dims()[0];
            wanted && (index == head || ((first_layer..layers_end).contains(&index) && rows > 1))
        });
    }

    /// The same model with host bf16 copies of its dense weights or
    /// without (the products then read the f32 weights rounded: the same
    /// values), whatever `gemm_bf16::reads_weight_copies` would choose on
    /// this CPU: for tests that run both ways on every machine. Nothing to
    /// do in f32 or on a GPU.
    pub fn with_bf16_weight_copies(mut self, copies: bool) -> Self {
        if let Some(bf16) = &mut self.bf16
            && bf16.half.is_none()
        {
            bf16.host_copies = copies;
            // A setting, not a step: the count of refreshes stays.
            let refreshes = bf16.refreshes;
            self.refresh_base_copies();
            if let Some(bf16) = &mut self.bf16 {
                bf16.refreshes = refreshes;
            }
        }
        self
    }

    /// Whether the dense weights have bf16 copies on the host (`--bf16`
    /// on the CPU with the `vdpbf16ps` body, or LoRA's base); `false` in
    /// f32, on a GPU, and where the products read the f32 weights rounded.
    pub fn bf16_reads_weight_copies(&self) -> bool {
        self.bf16.as_ref().is_some_and(|b| {
            b.copies.iter().any(Option::is_some) || b.released.iter().any(|&len| len > 0)
        })
    }

    /// Weak handles on the host bf16 copies (HF order; `None` where a
    /// parameter has none): for tests that check when a copy's memory is
    /// freed.
    pub fn bf16_copy_handles(&self) -> Vec<Option<std::sync::Weak<[half::bf16]>>> {
        self.bf16.as_ref().map_or_else(Vec::new, |b| {
            b.copies
                .iter()
                .map(|c| c.as_ref().map(std::sync::Arc::downgrade))
                .collect()
        })
    }

    /// The bf16 copy of parameter `index` (HF order), widened to f32, when
    /// it has one: for tests and checks that it is the rounded weight.
    pub fn bf16_copy_values(&self, index: usize) -> Option<Vec<f32>> {
        let copy = self.bf16.as_ref()?.get(index)?;
        Some(copy.iter().map(|v| v.to_f32()).collect())
    }

    /// How many times the bf16 copies of what trains were made (0 in
    /// f32): once when bf16 is switched on, then once per optimizer step.
    /// With LoRA these are the adapters' copies (the base's are made once).
    pub fn bf16_refreshes(&self) -> u64 {
        match self.lora.as_ref() {
            Some(lora) => lora.bf16.as_ref().map_or(0, |b| b.refreshes),
            None => self.bf16.as_ref().map_or(0, |b| b.refreshes),
        }
    }

    /// The bf16 copy of adapter parameter `index` ([`Self::trainable`]'s
    /// order), widened to f32, when it has one.
    pub fn adapter_bf16_copy_values(&self, index: usize) -> Option<Vec<f32>> {
        let copy = self.lora.as_ref()?.bf16.as_ref()?.get(index)?;
        Some(copy.iter().map(|v| v.to_f32()).collect())
    }
}
