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

    /// `[rows, cols]` as the model holds it (vectors as `[1, C]`), whatever
    /// `value` holds (a placeholder for a weight kept in GGUF blocks).
    pub fn matrix_dims(&self) -> [usize; 2] {
        match self.hf_shape.as_slice() {
            [rows, cols] => [*rows, *cols],
            [cols] => [1, *cols],
            _ => [1, self.numel()],
        }
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
    /// One head, `D`.
    Head,
}

impl Dim {
    fn size(self, config: &LlamaConfig) -> usize {
        match self {
            Dim::Hidden => config.hidden_size,
            Dim::QueryWidth => config.num_attention_heads * config.head_dim,
            Dim::KvWidth => config.num_key_value_heads * config.head_dim,
            Dim::Intermediate => config.intermediate_size,
            Dim::Vocab => config.vocab_size,
            Dim::Head => config.head_dim,
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
    /// Zeros: biases.
    Zeros,
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
    /// `self_attn.q_proj.bias`, `[H * D]` (Qwen2).
    QBias,
    /// `self_attn.k_proj.bias`, `[Hkv * D]` (Qwen2).
    KBias,
    /// `self_attn.v_proj.bias`, `[Hkv * D]` (Qwen2).
    VBias,
    /// `self_attn.q_norm.weight`, `[D]`, one RMSNorm shared by every query
    /// head (Qwen3).
    QNorm,
    /// `self_attn.k_norm.weight`, `[D]` (Qwen3).
    KNorm,
}

/// Which models have a layer tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Has {
    /// Every Llama-family model.
    Always,
    /// Models with query/key/value biases (Qwen2).
    QkvBias,
    /// Models with per-head query/key RMSNorm (Qwen3).
    QkNorm,
}

impl Has {
    fn holds(self, config: &LlamaConfig) -> bool {
        match self {
            Has::Always => true,
            Has::QkvBias => config.qkv_bias,
            Has::QkNorm => config.qk_norm,
        }
    }
}

/// One row of the table.
struct Row {
    /// HF name (after `model.layers.{i}.` for layer tensors).
    hf: &'static str,
    /// llama.cpp name (after `blk.{i}.` for layer tensors).
    gguf: &'static str,
    shape: &'static [Dim],
    init: Init,
    rope_rows: RopeRows,
    has: Has,
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
        has: Has::Always,
    }
}

const fn optional(
    hf: &'static str,
    gguf: &'static str,
    shape: &'static [Dim],
    init: Init,
    has: Has,
) -> Row {
    Row {
        has,
        ..row(hf, gguf, shape, init, RopeRows::No)
    }
}

use Dim::{Head, Hidden, Intermediate, KvWidth, QueryWidth, Vocab};
use Init::{Normal, Ones, Zeros};

/// Every tensor a decoder layer may have, in HF order (indexed by
/// [`LayerTensor`]); a model holds those whose `has` its config holds, in
/// this order.
const LAYER: [Row; LAYER_ROWS] = [
    row(
        "input_layernorm.weight",
        "attn_norm.weight",
        &[Hidden],
        Ones,
        RopeRows::No,
    ),
    row(
        "self_attn.q_proj.weight",
        "attn_q.weight",
        &[QueryWidth, Hidden],
        Normal,
        RopeRows::QueryHeads,
    ),
    row(
        "self_attn.k_proj.weight",
        "attn_k.weight",
        &[KvWidth, Hidden],
        Normal,
        RopeRows::KvHeads,
    ),
    row(
        "self_attn.v_proj.weight",
        "attn_v.weight",
        &[KvWidth, Hidden],
        Normal,
        RopeRows::No,
    ),
    row(
        "self_attn.o_proj.weight",
        "attn_output.weight",
        &[Hidden, QueryWidth],
        Normal,
        RopeRows::No,
    ),
    row(
        "post_attention_layernorm.weight",
        "ffn_norm.weight",
        &[Hidden],
        Ones,
        RopeRows::No,
    ),
    row(
        "mlp.gate_proj.weight",
        "ffn_gate.weight",
        &[Intermediate, Hidden],
        Normal,
        RopeRows::No,
    ),
    row(
        "mlp.up_proj.weight",
        "ffn_up.weight",
        &[Intermediate, Hidden],
        Normal,
        RopeRows::No,
    ),
    row(
        "mlp.down_proj.weight",
        "ffn_down.weight",
        &[Hidden, Intermediate],
        Normal,
        RopeRows::No,
    ),
    optional(
        "self_attn.q_proj.bias",
        "attn_q.bias",
        &[QueryWidth],
        Zeros,
        Has::QkvBias,
    ),
    optional(
        "self_attn.k_proj.bias",
        "attn_k.bias",
        &[KvWidth],
        Zeros,
        Has::QkvBias,
    ),
    optional(
        "self_attn.v_proj.bias",
        "attn_v.bias",
        &[KvWidth],
        Zeros,
        Has::QkvBias,
    ),
    optional(
        "self_attn.q_norm.weight",
        "attn_q_norm.weight",
        &[Head],
        Ones,
        Has::QkNorm,
    ),
    optional(
        "self_attn.k_norm.weight",
        "attn_k_norm.weight",
        &[Head],
        Ones,
        Has::QkNorm,
    ),
];

/// Rows of [`LAYER`]: every tensor any decoder layer may have.
const LAYER_ROWS: usize = 14;

/// The tensors of one decoder layer of a model of `config`, in the order the
/// model holds them.
pub fn layer_tensors(config: &LlamaConfig) -> Vec<LayerTensor> {
    LayerTensor::ALL
        .into_iter()
        .filter(|&tensor| LAYER[tensor as usize].has.holds(config))
        .collect()
}

impl LayerTensor {
    /// Every layer tensor, in the table's order.
    pub const ALL: [LayerTensor; LAYER_ROWS] = [
        LayerTensor::InputNorm,
        LayerTensor::Q,
        LayerTensor::K,
        LayerTensor::V,
        LayerTensor::O,
        LayerTensor::PostNorm,
        LayerTensor::Gate,
        LayerTensor::Up,
        LayerTensor::Down,
        LayerTensor::QBias,
        LayerTensor::KBias,
        LayerTensor::VBias,
        LayerTensor::QNorm,
        LayerTensor::KNorm,
    ];
}

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
                format!("blk.{i}.{}", row.gguf),
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
/// layer's [`layer_tensors`], the final norm, and the LM head unless it is
/// tied to the embedding.
pub fn param_specs(config: &LlamaConfig) -> Vec<ParamSpec> {
    let per_layer = layer_tensors(config);
    let mut specs = Vec::with_capacity(3 + config.num_hidden_layers * per_layer.len());
    specs.push(ParamSpec::new(&EMBEDDING, config, None));
    for layer in 0..config.num_hidden_layers {
        specs.extend(
            per_layer
                .iter()
                .map(|&tensor| ParamSpec::new(&LAYER[tensor as usize], config, Some(layer))),
        );
    }
    specs.push(ParamSpec::new(&FINAL_NORM, config, None));
    if !config.tie_word_embeddings {
        specs.push(ParamSpec::new(&LM_HEAD, config, None));
    }
    specs
}

/// Where each parameter sits in the order of [`param_specs`].
///
/// `per_layer` is the length of [`layer_tensors`] for the model's config.
pub(crate) mod index {
    #[cfg(test)]
    use super::LayerTensor;

    /// The embedding.
    pub const EMBEDDING: usize = 0;

    /// The first tensor of decoder layer `layer`.
    pub fn layer_start(layer: usize, per_layer: usize) -> usize {
        1 + layer * per_layer
    }

    /// A tensor of decoder layer `layer` of a Llama (no optional tensors).
    #[cfg(test)]
    pub fn layer(layer: usize, tensor: LayerTensor) -> usize {
        layer_start(layer, 9) + tensor as usize
    }

    /// The final norm of a model of `layers` decoder layers.
    pub fn final_norm(layers: usize, per_layer: usize) -> usize {
        layer_start(layers, per_layer)
    }

    /// The LM head (when untied) of a model of `layers` decoder layers.
    pub fn lm_head(layers: usize, per_layer: usize) -> usize {
        final_norm(layers, per_layer) + 1
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
        // A Llama layer: two norms, four attention and three MLP matrices.
        assert_eq!(layer_tensors(&config).len(), 9);
        assert_eq!(
            specs[index::final_norm(layers, layer_tensors(&config).len())].hf_name,
            "model.norm.weight"
        );
        assert_eq!(
            specs[index::final_norm(layers, layer_tensors(&config).len())].gguf_name,
            "output_norm.weight"
        );
        assert_eq!(specs[index::EMBEDDING].gguf_name, "token_embd.weight");
    }

    #[test]
    fn the_lm_head_is_listed_only_when_untied() {
        let mut config = LlamaConfig::tiny();
        config.tie_word_embeddings = false;
        let untied = param_specs(&config);
        let head = &untied[index::lm_head(config.num_hidden_layers, layer_tensors(&config).len())];
        assert_eq!(head.hf_name, "lm_head.weight");
        assert_eq!(head.gguf_name, "output.weight");
        config.tie_word_embeddings = true;
        assert_eq!(param_specs(&config).len(), untied.len() - 1);
    }

    #[test]
    fn qwen_layers_add_their_tensors_in_hf_names() {
        let mut config = LlamaConfig::tiny();
        let plain = param_specs(&config).len();
        config.qkv_bias = true;
        let specs = param_specs(&config);
        assert_eq!(specs.len(), plain + 3 * config.num_hidden_layers);
        let names: Vec<&str> = specs.iter().map(|s| s.hf_name.as_str()).collect();
        assert!(names.contains(&"model.layers.1.self_attn.k_proj.bias"));
        let kv = config.num_key_value_heads * config.head_dim;
        let k_bias = specs
            .iter()
            .find(|s| s.hf_name.ends_with("1.self_attn.k_proj.bias"));
        assert_eq!(k_bias.map(|s| s.hf_shape.clone()), Some(vec![kv]));
        config.qkv_bias = false;
        config.qk_norm = true;
        let specs = param_specs(&config);
        let q_norm = specs
            .iter()
            .find(|s| s.hf_name == "model.layers.0.self_attn.q_norm.weight");
        assert_eq!(
            q_norm.map(|s| (s.hf_shape.clone(), s.init)),
            Some((vec![config.head_dim], Init::Ones))
        );
        // Every layer block is the same length, so the final norm still
        // sits where `index` says.
        let per_layer = layer_tensors(&config).len();
        assert_eq!(per_layer, 11);
        assert_eq!(
            specs[index::final_norm(config.num_hidden_layers, per_layer)].hf_name,
            "model.norm.weight"
        );
    }
}
