use padfree_pack::{BatchMeta, PackedBatch, PaddedBatch, SplitMix64};

use crate::attention::{Attention, AttentionKernel, AttentionLayout, CausalMasks, PaddedAttention};
use crate::config::LlamaConfig;
use crate::decoder::DecoderLayer;
use crate::embedding::Embedding;
use crate::error::ModelError;
use crate::loss::{LabelRows, LossSum, fused_cross_entropy_sum};
use crate::mlp::Mlp;
use crate::norm::RmsNorm;
use crate::param::Param;
use crate::rope::Rope;
use crate::tensor::{
    Bool, Device, Tensor, bool_tensor, float_tensor, int_tensor, linear, trainable,
};

/// A batch as the model takes it; the variant chooses the attention strategy.
#[derive(Debug, Clone, Copy)]
pub enum ModelInput<'a> {
    /// Padding-free with the collator's boundaries (`varlen`).
    Varlen(&'a PackedBatch),
    /// Padding-free, boundaries derived in every layer (`varlen-per-layer`).
    VarlenPerLayer(&'a PackedBatch),
    /// Padded `[B, L]` with an attention mask (`padded`).
    Padded(&'a PaddedBatch),
}

impl ModelInput<'_> {
    /// `[N]` token ids of the rows the model runs on (`N = T` or `B * L`).
    pub fn input_ids(&self) -> &[u32] {
        match self {
            ModelInput::Varlen(batch) | ModelInput::VarlenPerLayer(batch) => batch.input_ids(),
            ModelInput::Padded(batch) => batch.input_ids(),
        }
    }

    /// `[N]` position of every row inside its sequence.
    pub fn position_ids(&self) -> &[u32] {
        match self {
            ModelInput::Varlen(batch) | ModelInput::VarlenPerLayer(batch) => batch.position_ids(),
            ModelInput::Padded(batch) => batch.position_ids(),
        }
    }

    /// `[N]` the label every row predicts, -100 where none.
    pub fn targets(&self) -> Vec<i64> {
        match self {
            ModelInput::Varlen(batch) | ModelInput::VarlenPerLayer(batch) => {
                batch.next_token_targets()
            }
            ModelInput::Padded(batch) => batch.next_token_targets(),
        }
    }

    /// The longest sequence in the batch.
    pub fn max_seqlen(&self) -> usize {
        match self {
            ModelInput::Varlen(batch) | ModelInput::VarlenPerLayer(batch) => {
                batch.meta().max_seqlen()
            }
            ModelInput::Padded(batch) => batch.seq_len(),
        }
    }
}

/// A Llama-family causal language model (`LlamaForCausalLM`).
#[derive(Debug, Clone)]
pub struct LlamaModel {
    config: LlamaConfig,
    device: Device,
    pub(crate) embed_tokens: Embedding,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) norm: RmsNorm,
    /// `None` when tied to the embedding.
    pub(crate) lm_head: Option<Param>,
    attention_kernel: AttentionKernel,
}

impl LlamaModel {
    /// Random initialisation as transformers does it: normal(0,
    /// `initializer_range`) for matrices, ones for norms. Deterministic for a seed.
    pub fn init(config: &LlamaConfig, seed: u64, device: &Device) -> Result<Self, ModelError> {
        let mut rng = SplitMix64::new(seed);
        let std = config.initializer_range as f32;
        Self::build(config, device, |name, shape| {
            let numel = shape.iter().product();
            if name.ends_with("norm.weight") {
                return Ok(vec![1.0; numel]);
            }
            Ok((0..numel)
                .map(|_| std * rng.standard_normal() as f32)
                .collect())
        })
    }

    /// Builds every parameter, in HF order, from `source(name, hf_shape)`.
    /// On an autodiff device every parameter is a trainable leaf.
    pub(crate) fn build(
        config: &LlamaConfig,
        device: &Device,
        mut source: impl FnMut(&str, &[usize]) -> Result<Vec<f32>, ModelError>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let mut param = |name: String, hf_shape: Vec<usize>| -> Result<Param, ModelError> {
            let values = source(&name, &hf_shape)?;
            let matrix = match hf_shape.as_slice() {
                [cols] => [1, *cols],
                [rows, cols] => [*rows, *cols],
                _ => {
                    return Err(ModelError::Batch(format!(
                        "{name}: parameters are vectors or matrices"
                    )));
                }
            };
            let mut value = float_tensor(values, matrix, device);
            if device.is_autodiff() {
                value = trainable(value);
            }
            Ok(Param::new(name, hf_shape, value))
        };
        let c = config.hidden_size;
        let (h, hkv, d) = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        );
        let embed_tokens = Embedding::new(param(
            "model.embed_tokens.weight".into(),
            vec![config.vocab_size, c],
        )?);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = |suffix: &str| format!("model.layers.{i}.{suffix}");
            layers.push(DecoderLayer {
                input_layernorm: RmsNorm::new(
                    param(p("input_layernorm.weight"), vec![c])?,
                    config.rms_norm_eps,
                ),
                self_attn: Attention {
                    q_proj: param(p("self_attn.q_proj.weight"), vec![h * d, c])?,
                    k_proj: param(p("self_attn.k_proj.weight"), vec![hkv * d, c])?,
                    v_proj: param(p("self_attn.v_proj.weight"), vec![hkv * d, c])?,
                    o_proj: param(p("self_attn.o_proj.weight"), vec![c, h * d])?,
                    num_heads: h,
                    num_kv_heads: hkv,
                    head_dim: d,
                },
                post_attention_layernorm: RmsNorm::new(
                    param(p("post_attention_layernorm.weight"), vec![c])?,
                    config.rms_norm_eps,
                ),
                mlp: Mlp {
                    gate_proj: param(p("mlp.gate_proj.weight"), vec![config.intermediate_size, c])?,
                    up_proj: param(p("mlp.up_proj.weight"), vec![config.intermediate_size, c])?,
                    down_proj: param(p("mlp.down_proj.weight"), vec![c, config.intermediate_size])?,
                },
            });
        }
        let norm = RmsNorm::new(
            param("model.norm.weight".into(), vec![c])?,
            config.rms_norm_eps,
        );
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(param("lm_head.weight".into(), vec![config.vocab_size, c])?)
        };
        Ok(Self {
            config: config.clone(),
            device: device.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            attention_kernel: AttentionKernel::default(),
        })
    }

    /// The same model computing attention with `kernel` (the fused one
    /// unless told otherwise).
    pub fn with_attention_kernel(mut self, kernel: AttentionKernel) -> Self {
        self.attention_kernel = kernel;
        self
    }

    /// How attention is computed.
    pub fn attention_kernel(&self) -> AttentionKernel {
        self.attention_kernel
    }

    /// The architecture.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The device the parameters live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every parameter, in HF order.
    pub fn params(&self) -> Vec<&Param> {
        let mut params = vec![&self.embed_tokens.weight];
        for layer in &self.layers {
            let attn = &layer.self_attn;
            let mlp = &layer.mlp;
            params.extend([
                &layer.input_layernorm.weight,
                &attn.q_proj,
                &attn.k_proj,
                &attn.v_proj,
                &attn.o_proj,
                &layer.post_attention_layernorm.weight,
                &mlp.gate_proj,
                &mlp.up_proj,
                &mlp.down_proj,
            ]);
        }
        params.push(&self.norm.weight);
        params.extend(self.lm_head.as_ref());
        params
    }

    /// Every parameter, mutable, in HF order (for optimizers).
    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut params = vec![&mut self.embed_tokens.weight];
        for layer in &mut self.layers {
            let attn = &mut layer.self_attn;
            let mlp = &mut layer.mlp;
            params.extend([
                &mut layer.input_layernorm.weight,
                &mut attn.q_proj,
                &mut attn.k_proj,
                &mut attn.v_proj,
                &mut attn.o_proj,
                &mut layer.post_attention_layernorm.weight,
                &mut mlp.gate_proj,
                &mut mlp.up_proj,
                &mut mlp.down_proj,
            ]);
        }
        params.push(&mut self.norm.weight);
        params.extend(self.lm_head.as_mut());
        params
    }

    /// Logits of every row of the batch, `[N, V]` with `N = T` (flattened) or
    /// `B * L` (padded, row-major).
    pub fn forward(&self, input: &ModelInput<'_>) -> Result<Tensor<2>, ModelError> {
        Ok(linear(self.hidden_states(input)?, &self.head().value))
    }

    /// The summed next-token loss of a batch, with logits computed only for
    /// the rows that carry a label and the softmax in one fused kernel.
    ///
    /// Same value and gradients as `causal_lm_loss(forward(input), targets)`
    /// (the oracle it is tested against), without the `[N, V]` logits of
    /// prompt tokens and pads: on the shipped data half the rows have no
    /// label, and the head is the largest matrix of a small model.
    pub fn loss_sum(&self, input: &ModelInput<'_>) -> Result<LossSum, ModelError> {
        let hidden = self.hidden_states(input)?;
        let [rows, _] = hidden.dims();
        let labels = LabelRows::new(&input.targets(), rows, self.config.vocab_size)?;
        if labels.is_empty() {
            return Ok(LossSum::empty(hidden));
        }
        let kept = hidden.select(0, labels.rows_tensor(&self.device));
        fused_cross_entropy_sum(linear(kept, &self.head().value), &labels)
    }

    /// The LM head: its own matrix, or the embedding when tied.
    fn head(&self) -> &Param {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens.weight)
    }

    /// The final-norm output of every row, `[N, C]`.
    pub fn hidden_states(&self, input: &ModelInput<'_>) -> Result<Tensor<2>, ModelError> {
        self.check_input(input)?;
        let rope = Rope::new(
            input.position_ids(),
            self.config.head_dim,
            self.config.rope_theta,
            &self.device,
        );
        let (masks, padded_rows);
        let layout = match input {
            ModelInput::Varlen(batch) => {
                // Only the composed kernel reads masks.
                let lengths = match self.attention_kernel {
                    AttentionKernel::Fused => Vec::new(),
                    AttentionKernel::Composed => batch.meta().seq_lens().collect(),
                };
                masks = CausalMasks::new(lengths, &self.device);
                AttentionLayout::Varlen {
                    meta: batch.meta(),
                    kernel: self.attention_kernel,
                    masks: &masks,
                }
            }
            ModelInput::VarlenPerLayer(batch) => AttentionLayout::VarlenPerLayer {
                position_ids: batch.position_ids(),
                kernel: self.attention_kernel,
            },
            ModelInput::Padded(batch) => {
                let kernel = match self.attention_kernel {
                    AttentionKernel::Fused => {
                        padded_rows =
                            BatchMeta::from_lengths(vec![batch.seq_len(); batch.batch_size()])
                                .map_err(|err| ModelError::Batch(format!("padded rows: {err}")))?;
                        PaddedAttention::Fused { rows: &padded_rows }
                    }
                    AttentionKernel::Composed => PaddedAttention::Composed {
                        mask: Box::new(padded_mask(batch, &self.device)),
                    },
                };
                AttentionLayout::Padded {
                    batch_size: batch.batch_size(),
                    seq_len: batch.seq_len(),
                    kernel,
                }
            }
        };
        let mut x = self
            .embed_tokens
            .forward(int_tensor(input.input_ids(), &self.device));
        for layer in &self.layers {
            x = layer.forward(x, &rope, &layout)?;
        }
        self.norm.forward(x)
    }

    fn check_input(&self, input: &ModelInput<'_>) -> Result<(), ModelError> {
        let vocab_size = self.config.vocab_size;
        if let Some((index, &id)) = input
            .input_ids()
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab_size)
        {
            return Err(ModelError::TokenOutOfVocab {
                index,
                id: u64::from(id),
                vocab_size,
            });
        }
        if let Some(window) = self.config.sliding_window
            && input.max_seqlen() > window
        {
            return Err(ModelError::Batch(format!(
                "a sequence of {} tokens is longer than the model's sliding_window of {window}\nHINT: truncate examples to {window} tokens (--max-seq-len); sliding-window attention is not implemented",
                input.max_seqlen()
            )));
        }
        Ok(())
    }
}

/// `[B, 1, L, L]`, true where query `i` of a row may not see key `j`: `j > i`
/// (the future) or `j` is a pad. Built once per forward pass.
fn padded_mask(batch: &PaddedBatch, device: &Device) -> Tensor<4, Bool> {
    let (b, l) = (batch.batch_size(), batch.seq_len());
    let attention_mask = batch.attention_mask();
    let mut mask = Vec::with_capacity(b * l * l);
    for row in 0..b {
        for i in 0..l {
            for j in 0..l {
                mask.push(j > i || attention_mask[row * l + j] == 0);
            }
        }
    }
    bool_tensor(mask, [b, 1, l, l], device)
}
