//! The one table of a model's parameters: Hugging Face name, shape, llama.cpp
//! (GGUF) name, initialisation and GGUF row permutation, in HF order.
//!
//! Everything that lists parameters reads it: construction
//! (`LlamaModel::build`), `params` / `params_mut` (the model keeps its
//! parameters in this order), the safetensors reader and writer, the GGUF
//! reader and the parameter count. A new tensor is one new row here
//! (torchtitan's `state_dict_adapter.py` plays this part there).

use crate::config::LlamaConfig;
use crate::tensor::Tensor;

/// One trainable tensor with its Hugging Face name and shape.
///
/// Every parameter is held as a matrix: vectors (norm weights, HF shape `[C]`)
/// as `[1, C]`, which broadcasts over `[N, C]` activations. `hf_shape` is what
/// safetensors files hold.
#[derive(Debug, Clone)]
pub struct Param {
    name: String,
    hf_shape: Vec<usize>,
    /// The values, `[rows, cols]`.
    pub value: Tensor<2>,
}

impl Param {
    pub(crate) fn new(name: String, hf_shape: Vec<usize>, value: Tensor<2>) -> Self {
        Self {
            name,
            hf_shape,
            value,
        }
    }

    /// The Hugging Face tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shape in Hugging Face files.
    pub fn hf_shape(&self) -> &[usize] {
        &self.hf_shape
    }

    /// Number of values.
    pub fn numel(&self) -> usize {
        self.hf_shape.iter().product()
    }
}

/// A size of the architecture, resolved against a config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dim {
    /// Hidden size, `C`.
    Hidden,
    /// Query heads times head size, `H * D`.
    QueryWidth,
    /// Key/value heads times head size, `Hkv * D`.
    KvWidth,
    /// MLP width, `I`.
    Intermediate,
    /// Vocabulary, `V`.
    Vocab,
}

impl Dim {
    fn size(self, config: &LlamaConfig) -> usize {
        match self {
            Dim::Hidden => config.hidden_size,
            Dim::QueryWidth => config.num_attention_heads * config.head_dim,
            Dim::KvWidth => config.num_key_value_heads * config.head_dim,
            Dim::Intermediate => config.intermediate_size,
            Dim::Vocab => config.vocab_size,
        }
    }
}

/// How a freshly initialised parameter is filled (as transformers does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// Normal(0, `initializer_range`): matrices.
    Normal,
    /// Ones: norm weights.
    Ones,
}

/// Whose heads llama.cpp's converter interleaved in a tensor's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeRows {
    /// Not permuted.
    No,
    /// Query rows, per query head.
    QueryHeads,
    /// Key rows, per key/value head.
    KvHeads,
}

/// A tensor of one decoder layer; the discriminant is its place in the
/// layer's block of parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerTensor {
    /// `input_layernorm.weight`, `[C]`.
    InputNorm = 0,
    /// `self_attn.q_proj.weight`, `[H * D, C]`.
    Q,
    /// `self_attn.k_proj.weight`, `[Hkv * D, C]`.
    K,
    /// `self_attn.v_proj.weight`, `[Hkv * D, C]`.
    V,
    /// `self_attn.o_proj.weight`, `[C, H * D]`.
    O,
    /// `post_attention_layernorm.weight`, `[C]`.
    PostNorm,
    /// `mlp.gate_proj.weight`, `[I, C]`.
    Gate,
    /// `mlp.up_proj.weight`, `[I, C]`.
    Up,
    /// `mlp.down_proj.weight`, `[C, I]`.
    Down,
}

/// One row of the table.
struct Row {
    /// HF name (after `model.layers.{i}.` for layer tensors).
    hf: &'static str,
    /// llama.cpp name (between `blk.{i}.` and `.weight` for layer tensors).
    gguf: &'static str,
    shape: &'static [Dim],
    init: Init,
    rope_rows: RopeRows,
}

const fn row(
    hf: &'static str,
    gguf: &'static str,
    shape: &'static [Dim],
    init: Init,
    rope_rows: RopeRows,
) -> Row {
    Row {
        hf,
        gguf,
        shape,
        init,
        rope_rows,
    }
}

use Dim::{Hidden, Intermediate, KvWidth, QueryWidth, Vocab};
use Init::{Normal, Ones};

/// Every tensor of a decoder layer, in HF order (indexed by [`LayerTensor`]).
const LAYER: [Row; LAYER_TENSORS] = [
    row(
        "input_layernorm.weight",
        "attn_norm",
        &[Hidden],
        Ones,
        RopeRows::No,
    ),
    row(
        "self_attn.q_proj.weight",
        "attn_q",
        &[QueryWidth, Hidden],
        Normal,
        RopeRows::QueryHeads,
    ),
    row(
        "self_attn.k_proj.weight",
        "attn_k",
        &[KvWidth, Hidden],
        Normal,
        RopeRows::KvHeads,
    ),
    row(
        "self_attn.v_proj.weight",
        "attn_v",
        &[KvWidth, Hidden],
        Normal,
        RopeRows::No,
    ),
    row(
        "self_attn.o_proj.weight",
        "attn_output",
        &[Hidden, QueryWidth],
        Normal,
        RopeRows::No,
    ),
    row(
        "post_attention_layernorm.weight",
        "ffn_norm",
        &[Hidden],
        Ones,
        RopeRows::No,
    ),
    row(
        "mlp.gate_proj.weight",
        "ffn_gate",
        &[Intermediate, Hidden],
        Normal,
        RopeRows::No,
    ),
    row(
        "mlp.up_proj.weight",
        "ffn_up",
        &[Intermediate, Hidden],
        Normal,
        RopeRows::No,
    ),
    row(
        "mlp.down_proj.weight",
        "ffn_down",
        &[Hidden, Intermediate],
        Normal,
        RopeRows::No,
    ),
];

/// Tensors per decoder layer.
pub const LAYER_TENSORS: usize = 9;

const EMBEDDING: Row = row(
    "model.embed_tokens.weight",
    "token_embd.weight",
    &[Vocab, Hidden],
    Normal,
    RopeRows::No,
);
const FINAL_NORM: Row = row(
    "model.norm.weight",
    "output_norm.weight",
    &[Hidden],
    Ones,
    RopeRows::No,
);
const LM_HEAD: Row = row(
    "lm_head.weight",
    "output.weight",
    &[Vocab, Hidden],
    Normal,
    RopeRows::No,
);

/// One parameter of a concrete model: the table's row with names and shape
/// resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// The Hugging Face name.
    pub hf_name: String,
    /// llama.cpp's name in GGUF files.
    pub gguf_name: String,
    /// The shape in Hugging Face files (`[C]` or `[rows, cols]`).
    pub hf_shape: Vec<usize>,
    /// How a fresh model fills it.
    pub init: Init,
    /// Whether GGUF files hold its rows permuted, and by whose heads.
    pub rope_rows: RopeRows,
}

impl ParamSpec {
    fn new(row: &Row, config: &LlamaConfig, layer: Option<usize>) -> Self {
        let (hf_name, gguf_name) = match layer {
            Some(i) => (
                format!("model.layers.{i}.{}", row.hf),
                format!("blk.{i}.{}.weight", row.gguf),
            ),
            None => (row.hf.to_owned(), row.gguf.to_owned()),
        };
        Self {
            hf_name,
            gguf_name,
            hf_shape: row.shape.iter().map(|dim| dim.size(config)).collect(),
            init: row.init,
            rope_rows: row.rope_rows,
        }
    }

    /// Number of values.
    pub fn numel(&self) -> usize {
        self.hf_shape.iter().product()
    }

    /// The `[rows, cols]` it is held as (a vector as one row).
    pub fn matrix_shape(&self) -> [usize; 2] {
        match self.hf_shape.as_slice() {
            [cols] => [1, *cols],
            [rows, cols] => [*rows, *cols],
            // The table has only vectors and matrices.
            _ => [1, self.numel()],
        }
    }
}

/// Every parameter of a model of `config`, in HF order: the embedding, each
/// layer's [`LAYER_TENSORS`] tensors, the final norm, and the LM head unless
/// it is tied to the embedding.
pub fn param_specs(config: &LlamaConfig) -> Vec<ParamSpec> {
    let mut specs = Vec::with_capacity(3 + config.num_hidden_layers * LAYER_TENSORS);
    specs.push(ParamSpec::new(&EMBEDDING, config, None));
    for layer in 0..config.num_hidden_layers {
        specs.extend(
            LAYER
                .iter()
                .map(|row| ParamSpec::new(row, config, Some(layer))),
        );
    }
    specs.push(ParamSpec::new(&FINAL_NORM, config, None));
    if !config.tie_word_embeddings {
        specs.push(ParamSpec::new(&LM_HEAD, config, None));
    }
    specs
}

/// Where each parameter sits in the order of [`param_specs`].
pub(crate) mod index {
    use super::LAYER_TENSORS;
    #[cfg(test)]
    use super::LayerTensor;

    /// The embedding.
    pub const EMBEDDING: usize = 0;

    /// The first tensor of decoder layer `layer`.
    pub fn layer_start(layer: usize) -> usize {
        1 + layer * LAYER_TENSORS
    }

    /// A tensor of decoder layer `layer`.
    #[cfg(test)]
    pub fn layer(layer: usize, tensor: LayerTensor) -> usize {
        layer_start(layer) + tensor as usize
    }

    /// The final norm of a model of `layers` decoder layers.
    pub fn final_norm(layers: usize) -> usize {
        layer_start(layers)
    }

    /// The LM head (when untied) of a model of `layers` decoder layers.
    pub fn lm_head(layers: usize) -> usize {
        final_norm(layers) + 1
    }
}

impl LlamaConfig {
    /// Number of parameters, counting a tied LM head once.
    pub fn num_parameters(&self) -> usize {
        param_specs(self).iter().map(ParamSpec::numel).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_rows_sit_at_their_tensor_index() {
        let config = LlamaConfig::tiny();
        let specs = param_specs(&config);
        let q = &specs[index::layer(1, LayerTensor::Q)];
        assert_eq!(q.hf_name, "model.layers.1.self_attn.q_proj.weight");
        assert_eq!(q.gguf_name, "blk.1.attn_q.weight");
        let down = &specs[index::layer(0, LayerTensor::Down)];
        assert_eq!(down.hf_name, "model.layers.0.mlp.down_proj.weight");
        assert_eq!(
            down.hf_shape,
            vec![config.hidden_size, config.intermediate_size]
        );
        let layers = config.num_hidden_layers;
        assert_eq!(
            specs[index::final_norm(layers)].hf_name,
            "model.norm.weight"
        );
        assert_eq!(
            specs[index::final_norm(layers)].gguf_name,
            "output_norm.weight"
        );
        assert_eq!(specs[index::EMBEDDING].gguf_name, "token_embd.weight");
    }

    #[test]
    fn the_lm_head_is_listed_only_when_untied() {
        let mut config = LlamaConfig::tiny();
        config.tie_word_embeddings = false;
        let untied = param_specs(&config);
        let head = &untied[index::lm_head(config.num_hidden_layers)];
        assert_eq!(head.hf_name, "lm_head.weight");
        assert_eq!(head.gguf_name, "output.weight");
        config.tie_word_embeddings = true;
        assert_eq!(param_specs(&config).len(), untied.len() - 1);
    }
}
