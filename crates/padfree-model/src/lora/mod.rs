//! LoRA: low-rank adapters on the frozen linear layers of a decoder, in
//! PEFT's layout and with its defaults, so the files load elsewhere.
//!
//! A targeted linear layer `y = x W^T` becomes
//! `y = x W^T + (alpha / r) * (dropout(x) A^T) B^T`, with `W` `[O, C]`
//! frozen, `A` `[r, C]` Kaiming-uniform (PEFT's `kaiming_uniform_(a =
//! sqrt(5))`: uniform in `±1/sqrt(C)`) and `B` `[O, r]` zero, so a fresh
//! adapter leaves the model's outputs exactly as they were.
//!
//! - this file: [`LoraConfig`], [`LoraTarget`], the adapters a model holds
//!   (`Lora`, one `A`/`B` pair per layer and target, in layer order), the
//!   view a layer borrows ([`Adapter`]), merging; the fused layer is
//!   `kernels/lora_linear.rs`, its dropout mask `kernels/dropout.rs`;
//! - `peft.rs`: `adapter_model.safetensors` + `adapter_config.json` in and
//!   out (PEFT's names: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`).
//!
//! # Shapes
//! `N` rows, `C` input width of the layer, `O` its output width, `r` the rank.

pub mod peft;

use std::sync::Arc;

use half::bf16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use padfree_pack::SplitMix64;

use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::input::ModelInput;
use crate::kernels::LoraFactors;
use crate::kernels::dropout::{DropoutMask, RowKeys, mix};
use crate::precision::Bf16Weights;
use crate::tensor::{Device, Tensor, float_tensor, trainable};
use crate::weights::table::{LayerTensor, Param};

/// A linear layer of a decoder layer that may carry an adapter, by PEFT's
/// module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    QProj,
    /// `self_attn.k_proj`.
    KProj,
    /// `self_attn.v_proj`.
    VProj,
    /// `self_attn.o_proj`.
    OProj,
    /// `mlp.gate_proj`.
    GateProj,
    /// `mlp.up_proj`.
    UpProj,
    /// `mlp.down_proj`.
    DownProj,
}

impl LoraTarget {
    /// Every linear layer of a decoder layer, in the parameter table's order:
    /// PEFT's `all-linear` (which leaves out the LM head).
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::QProj,
        LoraTarget::KProj,
        LoraTarget::VProj,
        LoraTarget::OProj,
        LoraTarget::GateProj,
        LoraTarget::UpProj,
        LoraTarget::DownProj,
    ];

    /// PEFT's default for Llama, Mistral and Qwen2 models when no target is
    /// named (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
    pub const DEFAULT: [LoraTarget; 2] = [LoraTarget::QProj, LoraTarget::VProj];

    /// The module name, as `--lora-target-modules` and PEFT write it.
    pub fn module(self) -> &'static str {
        match self {
            Self::QProj => "q_proj",
            Self::KProj => "k_proj",
            Self::VProj => "v_proj",
            Self::OProj => "o_proj",
            Self::GateProj => "gate_proj",
            Self::UpProj => "up_proj",
            Self::DownProj => "down_proj",
        }
    }

    /// The module's path inside a decoder layer.
    pub fn hf_path(self) -> &'static str {
        match self {
            Self::QProj => "self_attn.q_proj",
            Self::KProj => "self_attn.k_proj",
            Self::VProj => "self_attn.v_proj",
            Self::OProj => "self_attn.o_proj",
            Self::GateProj => "mlp.gate_proj",
            Self::UpProj => "mlp.up_proj",
            Self::DownProj => "mlp.down_proj",
        }
    }

    /// The frozen weight the adapter sits beside.
    pub fn layer_tensor(self) -> LayerTensor {
        match self {
            Self::QProj => LayerTensor::Q,
            Self::KProj => LayerTensor::K,
            Self::VProj => LayerTensor::V,
            Self::OProj => LayerTensor::O,
            Self::GateProj => LayerTensor::Gate,
            Self::UpProj => LayerTensor::Up,
            Self::DownProj => LayerTensor::Down,
        }
    }

    /// `(C, O)`: the layer's input and output widths.
    pub fn dims(self, config: &LlamaConfig) -> (usize, usize) {
        let c = config.hidden_size;
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let i = config.intermediate_size;
        match self {
            Self::QProj => (c, q),
            Self::KProj | Self::VProj => (c, kv),
            Self::OProj => (q, c),
            Self::GateProj | Self::UpProj => (c, i),
            Self::DownProj => (i, c),
        }
    }

    /// The target of module name `name`.
    pub fn from_module(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.module() == name)
    }
}

/// The adapters' settings (TRL's `ModelConfig` flags, PEFT's `LoraConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// The rank `r` (`--lora-r`).
    pub r: usize,
    /// `alpha` (`--lora-alpha`); the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// Dropout on the adapter's input during training (`--lora-dropout`).
    pub dropout: f64,
    /// The layers that carry an adapter, in the table's order.
    pub targets: Vec<LoraTarget>,
}

impl LoraConfig {
    /// TRL's defaults: `r = 16`, `alpha = 32`, dropout 0.05, PEFT's default
    /// targets for Llama (`q_proj`, `v_proj`).
    pub fn trl_defaults() -> Self {
        Self {
            r: 16,
            alpha: 32.0,
            dropout: 0.05,
            targets: LoraTarget::DEFAULT.to_vec(),
        }
    }

    /// Values of every adapter of a model of `config`.
    pub fn num_parameters(&self, config: &LlamaConfig) -> usize {
        let per_layer: usize = self
            .targets
            .iter()
            .map(|t| {
                let (c, o) = t.dims(config);
                self.r * (c + o)
            })
            .sum();
        per_layer * config.num_hidden_layers
    }

    /// The flags on which `given` differs from `self` (a checkpoint's
    /// adapters), each as `--lora-r 8 (the checkpoint's: 16)`.
    pub fn differing_flags(&self, given: &LoraConfig) -> Vec<String> {
        let targets = |config: &LoraConfig| -> String {
            config
                .targets
                .iter()
                .map(|t| t.module())
                .collect::<Vec<_>>()
                .join(",")
        };
        [
            ("--lora-r", self.r.to_string(), given.r.to_string()),
            (
                "--lora-alpha",
                self.alpha.to_string(),
                given.alpha.to_string(),
            ),
            (
                "--lora-dropout",
                self.dropout.to_string(),
                given.dropout.to_string(),
            ),
            ("--lora-target-modules", targets(self), targets(given)),
        ]
        .into_iter()
        .filter(|(_, saved, now)| saved != now)
        .map(|(flag, saved, now)| format!("{flag} {now} (the checkpoint's: {saved})"))
        .collect()
    }

    /// `alpha / r`.
    pub fn scale(&self) -> f32 {
        (self.alpha / self.r as f64) as f32
    }

    /// Targets from `--lora-target-modules`: `all-linear`, or module names
    /// separated by commas (`q_proj,v_proj`); returned in the table's order,
    /// each once. The error names the unknown module.
    pub fn parse_targets(text: &str) -> Result<Vec<LoraTarget>, String> {
        if text.trim() == "all-linear" {
            return Ok(LoraTarget::ALL.to_vec());
        }
        let mut targets = Vec::new();
        for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "all-linear" {
                return Err(format!(
                    "`all-linear` stands alone in `{}`: it names every linear layer already; give all-linear by itself, or the modules without it",
                    text.trim()
                ));
            }
            let target = LoraTarget::from_module(name).ok_or_else(|| {
                format!(
                    "`{name}` is not a linear layer of a decoder layer; the names are {}, or all-linear",
                    LoraTarget::ALL.map(LoraTarget::module).join(", ")
                )
            })?;
            targets.push(target);
        }
        if targets.is_empty() {
            return Err("no module named".into());
        }
        targets.sort();
        targets.dedup();
        Ok(targets)
    }

    /// Refuses settings no adapter can have.
    pub fn validate(&self, config: &LlamaConfig) -> Result<(), ModelError> {
        let refuse = |flag: &'static str, message: String, hint: &'static str| {
            Err(ModelError::LoraSetting {
                flag,
                message,
                hint,
            })
        };
        let smallest = self
            .targets
            .iter()
            .map(|t| {
                let (c, o) = t.dims(config);
                c.min(o)
            })
            .min()
            .unwrap_or(0);
        if self.r == 0 || self.r > smallest {
            return refuse(
                "--lora-r",
                format!(
                    "rank {} is not between 1 and the width of the narrowest targeted layer, {smallest}",
                    self.r
                ),
                "give --lora-r between 1 and the narrowest targeted layer's width (8 to 64 is usual), or target wider layers with --lora-target-modules",
            );
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return refuse(
                "--lora-alpha",
                format!("{} is not positive", self.alpha),
                "give a positive --lora-alpha (PEFT's habit: twice --lora-r)",
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return refuse(
                "--lora-dropout",
                format!("{} is not in [0, 1)", self.dropout),
                "give --lora-dropout in [0, 1)",
            );
        }
        if self.targets.is_empty() {
            return refuse(
                "--lora-target-modules",
                "no layer targeted".into(),
                "name modules with --lora-target-modules (q_proj,v_proj or all-linear)",
            );
        }
        Ok(())
    }
}

/// The adapters of a model: for every decoder layer and every target (in
/// `config.targets` order), `A` then `B`.
#[derive(Debug, Clone)]
pub(crate) struct Lora {
    pub(crate) config: LoraConfig,
    pub(crate) params: Vec<Param>,
    /// What this forward pass's dropout masks draw from; `None` runs
    /// without dropout (evaluation, checks, and every pass with
    /// `dropout = 0`).
    pub(crate) dropout: Option<DropoutDraw>,
    /// The base model, as PEFT's `base_model_name_or_path` names it.
    pub(crate) base: String,
    /// `--bf16`: the bf16 copies of `params` (every `A` and `B`), made once
    /// per optimizer step.
    pub(crate) bf16: Option<Bf16Weights>,
}

/// PEFT's tensor name of `A` (`lora_A`) or `B` (`lora_B`).
pub(crate) fn peft_name(layer: usize, target: LoraTarget, b: bool) -> String {
    format!(
        "base_model.model.model.layers.{layer}.{}.lora_{}.weight",
        target.hf_path(),
        if b { "B" } else { "A" }
    )
}

/// `[r, C]` and `[O, r]`.
pub(crate) fn shapes(target: LoraTarget, r: usize, config: &LlamaConfig) -> [[usize; 2]; 2] {
    let (c, o) = target.dims(config);
    [[r, c], [o, r]]
}

impl Lora {
    /// Fresh adapters as PEFT makes them: `A` uniform in `±1/sqrt(C)`, `B`
    /// zero. Deterministic for a seed.
    pub(crate) fn init(
        lora: &LoraConfig,
        model: &LlamaConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self, ModelError> {
        lora.validate(model)?;
        // Its own stream: the base model's initialisation and the data order
        // draw from theirs.
        let mut rng = SplitMix64::new(seed ^ 0x4c6f_5241_6164_6170);
        Self::build(lora, model, device, |_, _, b, shape| {
            let numel = shape[0] * shape[1];
            Ok(if b {
                vec![0.0; numel]
            } else {
                let bound = 1.0 / (shape[1] as f64).sqrt();
                (0..numel)
                    .map(|_| {
                        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                        ((2.0 * u - 1.0) * bound) as f32
                    })
                    .collect()
            })
        })
    }

    /// Adapters whose values come from `source(layer, target, is_b, shape)`.
    pub(crate) fn build(
        lora: &LoraConfig,
        model: &LlamaConfig,
        device: &Device,
        mut source: impl FnMut(usize, LoraTarget, bool, [usize; 2]) -> Result<Vec<f32>, ModelError>,
    ) -> Result<Self, ModelError> {
        lora.validate(model)?;
        let mut params = Vec::with_capacity(model.num_hidden_layers * lora.targets.len() * 2);
        for layer in 0..model.num_hidden_layers {
            for &target in &lora.targets {
                for (b, shape) in [false, true].into_iter().zip(shapes(target, lora.r, model)) {
                    let mut value = float_tensor(source(layer, target, b, shape)?, shape, device);
                    if device.is_autodiff() {
                        value = trainable(value);
                    }
                    params.push(Param::new(
                        peft_name(layer, target, b),
                        shape.to_vec(),
                        value,
                    ));
                }
            }
        }
        Ok(Self {
            config: lora.clone(),
            params,
            dropout: None,
            base: String::new(),
            bf16: None,
        })
    }

    /// The key of every row of `input`, for its dropout masks: `None`
    /// without dropout. Computed once per forward pass and lent to every
    /// layer.
    pub(crate) fn dropout_rows(
        &self,
        input: &ModelInput<'_>,
    ) -> Result<Option<RowKeys>, ModelError> {
        match &self.dropout {
            Some(draw) if self.config.dropout > 0.0 => draw.row_keys(input).map(Some),
            _ => Ok(None),
        }
    }

    /// The adapter of `target` in decoder layer `layer`, if it has one; its
    /// dropout mask over `rows` (from [`Self::dropout_rows`]) when given.
    pub(crate) fn adapter(
        &self,
        layer: usize,
        target: LoraTarget,
        rows: Option<&RowKeys>,
    ) -> Option<Adapter<'_>> {
        let slot = self.config.targets.iter().position(|&t| t == target)?;
        let at = (layer * self.config.targets.len() + slot) * 2;
        let dropout = match (&self.dropout, rows) {
            (Some(draw), Some(rows)) => Some(DropoutMask {
                p: self.config.dropout as f32,
                seed: mix(
                    draw.seed,
                    (layer * LoraTarget::ALL.len() + target as usize) as u64,
                ),
                rows: rows.clone(),
            }),
            _ => None,
        };
        let copies = self
            .bf16
            .as_ref()
            .and_then(|copies| Some([copies.get(at)?, copies.get(at + 1)?]));
        Some(Adapter {
            a: self.params.get(at)?,
            b: self.params.get(at + 1)?,
            scale: self.config.scale(),
            dropout,
            copies,
        })
    }

    /// Makes the bf16 copies of every `A` and `B` again (`--bf16`): when
    /// bf16 is switched on, then after every optimizer step.
    pub(crate) fn refresh_bf16(&mut self) {
        let params: Vec<&Tensor<2>> = self.params.iter().map(|p| &p.value).collect();
        self.bf16
            .get_or_insert_with(Bf16Weights::default)
            .refresh(&params, |_| true);
    }
}

/// What the LoRA dropout of a training forward pass draws from: a seed
/// (the run's and the optimizer step's) and the example every sequence of
/// the batch holds. A value's mask is then a function of (seed, layer,
/// module, example, position in the example, column): the same token gets
/// the same mask padded or flattened, alone or in any micro-batch, on any
/// rank and device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropoutDraw {
    /// The step's seed.
    pub seed: u64,
    /// `[B]`: an id of each sequence's example, in the batch's order (the
    /// trainer's index into the data set).
    pub examples: Vec<u64>,
}

impl DropoutDraw {
    /// `[N]`: row `n` keyed by (its example, its position there).
    fn row_keys(&self, input: &ModelInput<'_>) -> Result<RowKeys, ModelError> {
        let lengths: Vec<usize> = match input {
            ModelInput::Varlen(batch) | ModelInput::VarlenPerLayer(batch) => {
                batch.meta().seq_lens().collect()
            }
            ModelInput::Padded(batch) => vec![batch.seq_len(); batch.batch_size()],
        };
        let positions = input.rows().position_ids();
        let sequences = lengths.len();
        let mismatch = || ModelError::Config {
            field: "lora_dropout",
            message: format!(
                "the batch holds {} sequences of {} rows, its dropout draw names {} examples",
                sequences,
                positions.len(),
                self.examples.len()
            ),
            hint: "this is a bug in padfree; please report it",
        };
        if lengths.len() != self.examples.len() || lengths.iter().sum::<usize>() != positions.len()
        {
            return Err(mismatch());
        }
        let mut keys = Vec::with_capacity(positions.len());
        for (&example, len) in self.examples.iter().zip(lengths.iter().copied()) {
            let start = keys.len();
            let sequence = positions.get(start..start + len).ok_or_else(mismatch)?;
            keys.extend(
                sequence
                    .iter()
                    .map(|&position| RowKeys::token(example, position)),
            );
        }
        Ok(RowKeys::new(keys))
    }
}

/// The adapter of one linear layer, borrowed for a forward pass.
#[derive(Debug, Clone)]
pub struct Adapter<'a> {
    /// `[r, C]`.
    pub(crate) a: &'a Param,
    /// `[O, r]`.
    pub(crate) b: &'a Param,
    /// `alpha / r`.
    pub(crate) scale: f32,
    /// The mask of this pass, when training with dropout.
    pub(crate) dropout: Option<DropoutMask>,
    /// `--bf16`: the bf16 copies of `A` and `B`.
    pub(crate) copies: Option<[&'a Arc<[bf16]>; 2]>,
}

impl Adapter<'_> {
    /// The scale and the dropout mask, as the fused layer takes them.
    pub(crate) fn factors(&self) -> LoraFactors {
        LoraFactors {
            scale: self.scale,
            dropout: self.dropout.clone(),
        }
    }
}

/// `W + scale * B A` on the host: `[O, C]`, for merging an adapter into
/// its layer. `w` `[O, C]`, `a` `[r, C]`, `b` `[O, r]`, row-major.
pub(crate) fn merged_weight(w: &[f32], a: &[f32], b: &[f32], r: usize, scale: f32) -> Vec<f32> {
    let c = a.len() / r.max(1);
    let mut out = w.to_vec();
    out.par_chunks_mut(c.max(1))
        .enumerate()
        .for_each(|(row, values)| {
            let b_row = &b[row * r..(row + 1) * r];
            for (k, &bk) in b_row.iter().enumerate() {
                let a_row = &a[k * c..(k + 1) * c];
                let f = scale * bk;
                for (v, &ak) in values.iter_mut().zip(a_row) {
                    *v += f * ak;
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_in_table_order_and_refuse_unknown_names() {
        assert_eq!(
            LoraConfig::parse_targets("v_proj, q_proj,q_proj"),
            Ok(vec![LoraTarget::QProj, LoraTarget::VProj])
        );
        assert_eq!(
            LoraConfig::parse_targets("all-linear").map(|t| t.len()),
            Ok(7)
        );
        let err = LoraConfig::parse_targets("q_proj,lm_head").expect_err("refused");
        assert!(err.contains("`lm_head`"), "{err}");
    }

    #[test]
    fn merged_weight_is_w_plus_scaled_b_times_a() {
        // O = 2, C = 3, r = 2, against the sums written out.
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let a = [1.0, 0.0, 2.0, 0.0, 1.0, 1.0];
        let b = [1.0, 2.0, 3.0, -1.0];
        let merged = merged_weight(&w, &a, &b, 2, 0.5);
        let expect: Vec<f32> = (0..2)
            .flat_map(|o| {
                (0..3).map(move |c| {
                    w[o * 3 + c] + 0.5 * (0..2).map(|k| b[o * 2 + k] * a[k * 3 + c]).sum::<f32>()
                })
            })
            .collect();
        assert_eq!(merged, expect);
    }
}
