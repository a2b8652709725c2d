use crate::attention::{Attention, AttentionLayout};
use crate::error::ModelError;
use crate::mlp::Mlp;
use crate::norm::RmsNorm;
use crate::rope::Rope;
use crate::tensor::Tensor;

/// One pre-norm decoder layer: `x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub(crate) input_layernorm: RmsNorm,
    pub(crate) self_attn: Attention,
    pub(crate) post_attention_layernorm: RmsNorm,
    pub(crate) mlp: Mlp,
}

impl DecoderLayer {
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
