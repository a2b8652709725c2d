use std::sync::Arc;

use half::bf16;

use super::attention::{Attention, AttentionLayout};
use super::linear::Linear;
use super::mlp::Mlp;
use super::norm::RmsNorm;
use super::rope::Rope;
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::lora::{Adapter, LoraTarget};
use crate::tensor::Tensor;
use crate::weights::quantized::QuantMatrix;
use crate::weights::table::{LayerTensor, Param};

/// One pre-norm decoder layer: `x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer<'a> {
    input_layernorm: RmsNorm<'a>,
    self_attn: Attention<'a>,
    post_attention_layernorm: RmsNorm<'a>,
    mlp: Mlp<'a>,
}

impl<'a> DecoderLayer<'a> {
    /// The layer over its block of parameters, which holds `tensors` in
    /// this order (`weights::table::layer_tensors` of `config`; `quantized`
    /// beside it: a projection's weight in GGUF blocks, if kept so), with
    /// the LoRA adapter of each projection `adapter` gives; under `--bf16`
    /// (`bf16`) the dense projections multiply their copies in `bf16_copies`
    /// (on the CPU) or `device_copies` (on a GPU).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        params: &'a [Param],
        quantized: &'a [Option<QuantMatrix>],
        bf16: bool,
        bf16_copies: &'a [Option<Arc<[bf16]>>],
        device_copies: &'a [Option<Tensor<2>>],
        tensors: &[LayerTensor],
        config: &LlamaConfig,
        adapter: impl Fn(LoraTarget) -> Option<Adapter<'a>>,
    ) -> Self {
        let find = |tensor: LayerTensor| {
            tensors
                .iter()
                .zip(params)
                .find(|(t, _)| **t == tensor)
                .map(|(_, param)| param)
        };
        // Tensors every model has come first in the table, so they sit at
        // their own index in every block.
        let p = |tensor: LayerTensor| &params[tensor as usize];
        let linear = |target: LoraTarget| {
            let at = target.layer_tensor() as usize;
            Linear::new(
                &params[at],
                quantized.get(at).and_then(Option::as_ref),
                adapter(target),
            )
            .with_bf16(bf16, bf16_copies.get(at).and_then(Option::as_ref))
            .with_device_copy(device_copies.get(at).and_then(Option::as_ref))
        };
        let eps = config.rms_norm_eps;
        Self {
            input_layernorm: RmsNorm::new(p(LayerTensor::InputNorm), config.rms_norm_eps),
            self_attn: Attention {
                q_proj: linear(LoraTarget::QProj),
                k_proj: linear(LoraTarget::KProj),
                v_proj: linear(LoraTarget::VProj),
                o_proj: linear(LoraTarget::OProj),
                q_bias: find(LayerTensor::QBias),
                k_bias: find(LayerTensor::KBias),
                v_bias: find(LayerTensor::VBias),
                q_norm: find(LayerTensor::QNorm).map(|w| RmsNorm::new(w, eps)),
                k_norm: find(LayerTensor::KNorm).map(|w| RmsNorm::new(w, eps)),
                num_heads: config.num_attention_heads,
                num_kv_heads: config.num_key_value_heads,
                head_dim: config.head_dim,
            },
            post_attention_layernorm: RmsNorm::new(p(LayerTensor::PostNorm), config.rms_norm_eps),
            mlp: Mlp {
                gate_proj: linear(LoraTarget::GateProj),
                up_proj: linear(LoraTarget::UpProj),
                down_proj: linear(LoraTarget::DownProj),
            },
        }
    }

    /// `[N, C] -> [N, C]`.
    pub fn forward(
        &self,
        x: Tensor<2>,
        rope: &Rope,
        layout: &AttentionLayout<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        // Under `--bf16` on the CPU a norm read only by bf16 matmuls hands
        // them its output rounded, which they read without a copy.
        let attn = &self.self_attn;
        let rounded = [&attn.q_proj, &attn.k_proj, &attn.v_proj]
            .iter()
            .all(|p| p.reads_only_rounded_input());
        let normed = self.input_layernorm.forward_rounded(x.clone(), rounded)?;
        let h = x + attn.forward(normed, rope, layout)?;
        let rounded = [&self.mlp.gate_proj, &self.mlp.up_proj]
            .iter()
            .all(|p| p.reads_only_rounded_input());
        let normed = self
            .post_attention_layernorm
            .forward_rounded(h.clone(), rounded)?;
        Ok(h + self.mlp.forward(normed)?)
    }
}
