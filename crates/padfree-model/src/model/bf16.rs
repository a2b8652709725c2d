//! `--bf16` on the model: the precision it computes in and the bf16 copies
//! of its matmul weights (the base's and the adapters'), made once per
//! optimizer step.

use super::LlamaModel;
use crate::error::ModelError;
use crate::precision::{Bf16Weights, Precision};
use crate::tensor::Tensor;
use crate::weights::table::index;

impl LlamaModel {
    /// The same model computing its matmuls in `precision`. bf16 makes the
    /// weights' bf16 copies at once (the adapters' too); it runs on the CPU
    /// in this build.
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
        if !self.on_cpu() {
            return refuse(
                "--bf16 runs on the CPU only in this build (the GPU's bf16 matmuls and attention are not built yet)",
                "drop --device to train in bf16 on the CPU, or drop --bf16 to train in f32 on the GPU",
            );
        }
        self.bf16 = Some(Bf16Weights::default());
        self.refresh_base_copies();
        if let Some(lora) = &mut self.lora {
            lora.refresh_bf16();
        }
        Ok(self)
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
        match &mut self.lora {
            Some(lora) => lora.refresh_bf16(),
            None => self.refresh_base_copies(),
        }
    }

    /// The copies of the base's matmul weights.
    pub(super) fn refresh_base_copies(&mut self) {
        let head = self.head_index();
        let per_layer = self.layer_tensors.len();
        let first_layer = index::layer_start(0, per_layer);
        let layers_end = index::layer_start(self.config.num_hidden_layers, per_layer);
        let params: Vec<&Tensor<2>> = self.params.iter().map(|p| &p.value).collect();
        let Some(bf16) = &mut self.bf16 else {
            return;
        };
        // The layers' projection matrices (not their `[1, C]` norms and
        // biases) and the head; the embedding only when it is the head.
        bf16.refresh(&params, |index| {
            let rows = params[index].dims()[0];
            index == head || ((first_layer..layers_end).contains(&index) && rows > 1)
        });
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
