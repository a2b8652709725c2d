use super::attention::{Attention, AttentionLayout};
use super::mlp::Mlp;
use super::norm::RmsNorm;
use super::rope::Rope;
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::tensor::Tensor;
use crate::weights::table::{LAYER_TENSORS, LayerTensor, Param};

/// One pre-norm decoder layer: `x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer<'a> {
    input_layernorm: RmsNorm<'a>,
    self_attn: Attention<'a>,
    post_attention_layernorm: RmsNorm<'a>,
    mlp: Mlp<'a>,
}

impl<'a> DecoderLayer<'a> {
    /// The layer over its block of parameters, in the table's
    /// [`LayerTensor`] order.
    pub fn new(params: &'a [Param; LAYER_TENSORS], config: &LlamaConfig) -> Self {
        let p = |tensor: LayerTensor| &params[tensor as usize];
        Self {
            input_layernorm: RmsNorm::new(p(LayerTensor::InputNorm), config.rms_norm_eps),
            self_attn: Attention {
                q_proj: p(LayerTensor::Q),
                k_proj: p(LayerTensor::K),
                v_proj: p(LayerTensor::V),
                o_proj: p(LayerTensor::O),
                num_heads: config.num_attention_heads,
                num_kv_heads: config.num_key_value_heads,
                head_dim: config.head_dim,
            },
            post_attention_layernorm: RmsNorm::new(p(LayerTensor::PostNorm), config.rms_norm_eps),
            mlp: Mlp {
                gate_proj: p(LayerTensor::Gate),
                up_proj: p(LayerTensor::Up),
                down_proj: p(LayerTensor::Down),
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
        let h = x.clone()
            + self
                .self_attn
                .forward(self.input_layernorm.forward(x)?, rope, layout)?;
        Ok(h.clone()
            + self
                .mlp
                .forward(self.post_attention_layernorm.forward(h)?)?)
    }
}
