//! The model's LoRA adapters: attaching fresh or saved ones, their dropout,
//! saving them, and merging them into the base weights.

use std::path::Path;

use super::LlamaModel;
use crate::error::ModelError;
use crate::lora::{DropoutDraw, Lora, LoraConfig, merged_weight, peft};
use crate::tensor::{IntoHostVec, float_tensor, frozen};
use crate::weights::table::index;

impl LlamaModel {
    /// The model with fresh LoRA adapters on `lora.targets` (PEFT's
    /// initialisation, deterministic for `seed`); every base weight is
    /// frozen from now on. `base` names the base model in the adapter files
    /// (PEFT's `base_model_name_or_path`: a path or a hub name).
    pub fn with_lora(
        mut self,
        lora: &LoraConfig,
        seed: u64,
        base: &str,
    ) -> Result<Self, ModelError> {
        let mut adapters = Lora::init(lora, &self.config, seed, &self.device)?;
        adapters.base = base.to_owned();
        self.attach(adapters);
        Ok(self)
    }

    /// The model with the adapters saved in `dir` (PEFT's files, from
    /// [`Self::save_adapter`] or PEFT's `save_pretrained`); the base weights
    /// are frozen. Returns the base model the adapter config names.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<Option<String>, ModelError> {
        let (adapters, base) = peft::read(dir, &self.config, &self.device)?;
        self.attach(adapters);
        Ok(base)
    }

    fn attach(&mut self, mut adapters: Lora) {
        for param in &mut self.params {
            param.value = frozen(param.value.clone());
        }
        // A GPU's adapters have no copies (`kernels::half_lora_linear`).
        if self.bf16.is_some() && self.on_cpu() {
            adapters.refresh_bf16();
        }
        self.lora = Some(adapters);
        // The base's layers read copies under LoRA, which a model without
        // adapters may not have made (`refresh_base_copies`).
        if self.bf16.as_ref().is_some_and(|b| b.half.is_none()) {
            self.refresh_base_copies();
        }
    }

    /// The adapters' settings, when the model has adapters.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|lora| &lora.config)
    }

    /// Sets what the dropout of the next forward passes' adapters draws
    /// from (`None`: no dropout). The trainer sets one per micro-batch:
    /// the run's seed and the step, and the micro-batch's examples by
    /// their index in the data set, so a resumed run, any layout and any
    /// micro-batch split draw the same masks for the same tokens.
    pub fn set_lora_dropout(&mut self, draw: Option<DropoutDraw>) {
        if let Some(lora) = &mut self.lora {
            lora.dropout = draw;
        }
    }

    /// Writes `adapter_model.safetensors` and `adapter_config.json` into
    /// `dir`. Refused without adapters.
    pub fn save_adapter(&self, dir: &Path) -> Result<(), ModelError> {
        let lora = self.lora.as_ref().ok_or_else(|| ModelError::Config {
            field: "lora",
            message: "the model has no LoRA adapters to save".into(),
            hint: "train with --use-peft, or save the full model",
        })?;
        peft::write(dir, lora)
    }

    /// The model with every adapter folded into its layer's weight
    /// (`W + (alpha / r) B A`), no adapters left: what `--merge-adapter`
    /// saves. The same model without adapters when it has none.
    pub fn merged(&self) -> Self {
        let mut merged = self.clone();
        let Some(lora) = merged.lora.take() else {
            return merged;
        };
        let per_layer = self.layer_tensors.len();
        let (scale, r) = (lora.config.scale(), lora.config.r);
        for layer in 0..self.config.num_hidden_layers {
            for (slot, target) in lora.config.targets.iter().enumerate() {
                let at = (layer * lora.config.targets.len() + slot) * 2;
                let (a, b) = (&lora.params[at], &lora.params[at + 1]);
                let index = index::layer_start(layer, per_layer) + target.layer_tensor() as usize;
                let dense = match merged.quantized.get_mut(index).and_then(Option::take) {
                    Some(quantized) => quantized.dequantized(),
                    None => merged.params[index].value.clone().into_vec(),
                };
                let weight = &mut merged.params[index];
                let dims = weight.matrix_dims();
                let values = merged_weight(
                    &dense,
                    &a.value.clone().into_vec(),
                    &b.value.clone().into_vec(),
                    r,
                    scale,
                );
                weight.value = float_tensor(values, dims, &self.device);
            }
        }
        // The merged weights need copies of their own.
        if merged.bf16.is_some() {
            merged.refresh_base_copies();
        }
        merged
    }
}
