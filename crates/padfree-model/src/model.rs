//! `LlamaModel`: its parameters in the table's order, the forward pass, the
//! fused loss, and loading and saving through `weights/` (which never sees
//! this type).

use std::path::Path;

use padfree_pack::{BatchMeta, PaddedBatch, SplitMix64};

use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::input::ModelInput;
use crate::kernels::dropout::RowKeys;
use crate::kernels::{
    AttentionRows, CausalMasks, Weight16, bf16_linear, fused_linear, half_linear,
};
use crate::layers::{
    AttentionKernel, AttentionLayout, DecoderLayer, Embedding, PaddedAttention, RmsNorm, Rope,
};
use crate::lora::{DropoutDraw, Lora, LoraTarget};
use crate::loss::{LabelRows, LossSum, fused_head_cross_entropy_sum, host_head_cross_entropy_sum};
use crate::precision::Bf16Weights;
use crate::tensor::{
    Bool, Device, IntoHostVec, Tensor, bool_tensor, float_tensor, frozen, linear, trainable,
};
use crate::weights::gguf::GgufFile;
use crate::weights::gguf::llama as gguf_llama;
use crate::weights::quantized::QuantMatrix;
use crate::weights::safetensors::{Held, WeightFiles, read_frozen, write_hf_dir};
use crate::weights::table::{
    Init, LayerTensor, Param, ParamSpec, index, layer_tensors, param_specs,
};

mod adapters;
mod bf16;
mod checkpointing;

/// A Llama-family causal language model (`LlamaForCausalLM`).
#[derive(Debug, Clone)]
pub struct LlamaModel {
    config: LlamaConfig,
    device: Device,
    /// Every parameter in the order of `weights::table::param_specs`; the
    /// layers borrow theirs for each forward pass.
    params: Vec<Param>,
    /// The tensors of each decoder layer's block of `params`, in order.
    layer_tensors: Vec<LayerTensor>,
    attention_kernel: AttentionKernel,
    /// LoRA adapters: when present they are what trains, and `params` are
    /// frozen (no gradients, no optimizer state).
    lora: Option<Lora>,
    /// Beside `params` (empty when none is): a frozen projection kept in its
    /// GGUF blocks (QLoRA's base), whose `params` entry is then a `[1, 1]`
    /// placeholder.
    quantized: Vec<Option<QuantMatrix>>,
    /// `--bf16`: the bf16 copies of the matmuls' weights (`precision.rs`);
    /// `None` in f32.
    bf16: Option<Bf16Weights>,
}

/// A parameter's values as loaded.
enum Loaded {
    Dense(Vec<f32>),
    Quantized(QuantMatrix),
}

impl LlamaModel {
    /// Random initialisation as transformers does it: normal(0,
    /// `initializer_range`) for matrices, ones for norms. Deterministic for a seed.
    pub fn init(config: &LlamaConfig, seed: u64, device: &Device) -> Result<Self, ModelError> {
        let mut rng = SplitMix64::new(seed);
        let std = config.initializer_range as f32;
        Self::build(config, device, |spec| {
            Ok(match spec.init {
                Init::Ones => vec![1.0; spec.numel()],
                Init::Zeros => vec![0.0; spec.numel()],
                Init::Normal => (0..spec.numel())
                    .map(|_| std * rng.standard_normal() as f32)
                    .collect(),
            })
        })
    }

    /// Loads a Hugging Face model directory: `config.json` plus
    /// `model.safetensors` or the shards of `model.safetensors.index.json`.
    pub fn from_hf_dir(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_hf_file(&dir.join("config.json"))?;
        Self::from_safetensors(&config, dir, device)
    }

    /// Loads weights for `config` from the safetensors file(s) in `dir`.
    pub fn from_safetensors(
        config: &LlamaConfig,
        dir: &Path,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let files = WeightFiles::read(dir)?;
        let checkpoint = files.parse()?;
        Self::build(config, device, |spec| checkpoint.read(spec))
    }

    /// Loads a Hugging Face model directory as a frozen LoRA base: the seven
    /// projections of every decoder layer that the files hold in F16 or BF16
    /// stay in those 2 bytes a weight (multiplied by the fused kernel on the
    /// CPU, like GGUF blocks), everything else (F32 projections, embedding,
    /// norms, LM head) in f32. Train it only with adapters.
    pub fn from_hf_dir_frozen(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_hf_file(&dir.join("config.json"))?;
        config.validate()?;
        let projections = projection_names(&config);
        let mut held = read_frozen(dir, &param_specs(&config), |spec| {
            projections.contains(&spec.hf_name)
        })?;
        let mut model =
            Self::build_loaded(&config, device, |spec| match held.remove(&spec.hf_name) {
                Some(Held::Half(half)) => Ok(Loaded::Quantized(half)),
                Some(Held::F32(values)) => Ok(Loaded::Dense(values)),
                None => Err(ModelError::Config {
                    field: "weights",
                    message: format!("{} was read twice", spec.hf_name),
                    hint: "this is a bug in padfree; please report it",
                }),
            })?;
        model.freeze();
        Ok(model)
    }

    /// Loads a Llama-architecture GGUF file, dequantizing every tensor to f32.
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self, ModelError> {
        Self::from_gguf_file(&GgufFile::open(path)?, device)
    }

    /// Builds the model from an opened GGUF file.
    pub fn from_gguf_file(file: &GgufFile, device: &Device) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_gguf(file)?;
        Self::build(&config, device, |spec| {
            gguf_llama::read_tensor(file, &config, spec)
        })
    }

    /// Writes `config.json` and `model.safetensors` (f32, HF names) into
    /// `dir`, each through a temporary file renamed into place.
    pub fn save_hf_dir(&self, dir: &Path) -> Result<(), ModelError> {
        let tensors = self.params.iter().enumerate().map(|(index, p)| {
            let values: Box<dyn Fn() -> Vec<f32> + '_> = match self.quantized.get(index) {
                Some(Some(quantized)) => Box::new(move || quantized.dequantized()),
                _ => Box::new(move || p.value.clone().into_vec()),
            };
            (p.name(), p.hf_shape(), values)
        });
        write_hf_dir(dir, &self.config.to_hf_json(), tensors)
    }

    /// Loads a Llama-architecture GGUF file for QLoRA: the seven projections
    /// of every decoder layer stay in their GGUF blocks (frozen; on the CPU
    /// the fused kernel multiplies them, elsewhere they are dequantised per
    /// use), the rest (embedding, norms, LM head) is dequantised to f32.
    /// Train it only with adapters ([`Self::with_lora`]): the trainer
    /// refuses a quantized model without them.
    pub fn from_gguf_quantized(file: &GgufFile, device: &Device) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_gguf(file)?;
        let projections = projection_names(&config);
        let mut model = Self::build_loaded(&config, device, |spec| {
            if projections.contains(&spec.hf_name)
                && let Some(quantized) = gguf_llama::read_quantized(file, &config, spec)?
            {
                return Ok(Loaded::Quantized(quantized));
            }
            Ok(Loaded::Dense(gguf_llama::read_tensor(file, &config, spec)?))
        })?;
        model.freeze();
        Ok(model)
    }

    /// Frozen from the start: nothing of a base held in blocks trains.
    fn freeze(&mut self) {
        for param in &mut self.params {
            param.value = frozen(param.value.clone());
        }
    }

    /// Bytes of the weights as held: f32 values, GGUF blocks for the
    /// quantized projections, and under `--bf16` the weights' bf16 copies.
    pub fn weight_bytes(&self) -> usize {
        let bytes = Bf16Weights::bytes;
        let copies = self.bf16.as_ref().map_or(0, bytes)
            + self
                .lora
                .as_ref()
                .and_then(|lora| lora.bf16.as_ref())
                .map_or(0, bytes);
        let held: usize = self
            .params
            .iter()
            .enumerate()
            .map(|(index, param)| match self.quantized.get(index) {
                Some(Some(quantized)) => quantized.bytes(),
                _ => 4 * param.numel(),
            })
            .sum();
        held + copies
    }

    /// True when some weights are kept in GGUF blocks.
    pub fn is_quantized(&self) -> bool {
        self.quantized.iter().any(Option::is_some)
    }

    /// Builds every parameter of the table, in its order, from
    /// `source(spec)`. On an autodiff device every parameter is a trainable
    /// leaf.
    fn build(
        config: &LlamaConfig,
        device: &Device,
        mut source: impl FnMut(&ParamSpec) -> Result<Vec<f32>, ModelError>,
    ) -> Result<Self, ModelError> {
        Self::build_loaded(config, device, |spec| Ok(Loaded::Dense(source(spec)?)))
    }

    fn build_loaded(
        config: &LlamaConfig,
        device: &Device,
        mut source: impl FnMut(&ParamSpec) -> Result<Loaded, ModelError>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let mut quantized = Vec::new();
        let params = param_specs(config)
            .into_iter()
            .map(|spec| {
                let mut value = match source(&spec)? {
                    Loaded::Dense(values) => {
                        quantized.push(None);
                        float_tensor(values, spec.matrix_shape(), device)
                    }
                    Loaded::Quantized(blocks) => {
                        quantized.push(Some(blocks));
                        float_tensor(vec![0.0], [1, 1], device)
                    }
                };
                if device.is_autodiff() {
                    value = trainable(value);
                }
                Ok(Param::new(spec.hf_name, spec.hf_shape, value))
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        if quantized.iter().all(Option::is_none) {
            quantized.clear();
        }
        Ok(Self {
            config: config.clone(),
            device: device.clone(),
            params,
            layer_tensors: layer_tensors(config),
            attention_kernel: AttentionKernel::default(),
            lora: None,
            quantized,
            bf16: None,
        })
    }

    /// The same weights off the autodiff graph, for forward passes that keep
    /// nothing for a backward pass (evaluation, the logits of `padfree
    /// check`). On an autodiff device every forward pass records its graph
    /// on the parameters, and a graph that is never run backward stays
    /// alive with its activations until the parameters are replaced: the
    /// demo's 25 eval batches then held 2.2 GB. The weights' memory is
    /// shared, not copied.
    pub fn without_autodiff(&self) -> Self {
        // No dropout where nothing trains.
        self.off_graph(None)
    }

    /// The same weights off the autodiff graph, drawing the dropout masks
    /// of `dropout`.
    fn off_graph(&self, dropout: Option<DropoutDraw>) -> Self {
        Self {
            config: self.config.clone(),
            device: self.device.clone().inner(),
            params: off_the_graph(&self.params),
            layer_tensors: self.layer_tensors.clone(),
            attention_kernel: self.attention_kernel,
            lora: self.lora.as_ref().map(|lora| Lora {
                config: lora.config.clone(),
                params: off_the_graph(&lora.params),
                dropout,
                base: lora.base.clone(),
                bf16: lora.bf16.clone(),
            }),
            quantized: self.quantized.clone(),
            bf16: self.bf16.clone(),
        }
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

    /// True on the CPU (burn's Flex backend and padfree's host kernels).
    pub fn on_cpu(&self) -> bool {
        crate::kernels::on_cpu(&self.device)
    }

    /// Every parameter, in HF order.
    pub fn params(&self) -> Vec<&Param> {
        self.params.iter().collect()
    }

    /// Every parameter, mutable, in HF order.
    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        self.params.iter_mut().collect()
    }

    /// What trains: the LoRA adapters (`A` then `B` of each targeted layer,
    /// layer by layer) when the model has them, else every parameter in HF
    /// order. Gradients, their exchange between ranks, the optimizer and
    /// its checkpoints all go by this list.
    pub fn trainable(&self) -> Vec<&Param> {
        match &self.lora {
            Some(lora) => lora.params.iter().collect(),
            None => self.params(),
        }
    }

    /// [`Self::trainable`], mutable (for optimizers).
    pub fn trainable_mut(&mut self) -> Vec<&mut Param> {
        match &mut self.lora {
            Some(lora) => lora.params.iter_mut().collect(),
            None => self.params.iter_mut().collect(),
        }
    }

    /// Decoder layer `layer`, borrowing its block of parameters; its
    /// adapters' dropout masks over `rows` (the batch's row keys, from
    /// [`Self::with_layout`]) when given.
    fn layer<'a>(
        &'a self,
        layer: usize,
        rows: Option<&'a RowKeys>,
    ) -> Result<DecoderLayer<'a>, ModelError> {
        let per_layer = self.layer_tensors.len();
        let start = index::layer_start(layer, per_layer);
        let block =
            self.params
                .get(start..start + per_layer)
                .ok_or_else(|| ModelError::Config {
                    field: "num_hidden_layers",
                    message: format!("layer {layer} has no full block of parameters"),
                    hint: "this is a bug in padfree; please report it",
                })?;
        let lora = self.lora.as_ref();
        let quantized = self.quantized.get(start..start + per_layer).unwrap_or(&[]);
        let copies = self
            .bf16
            .as_ref()
            .and_then(|b| b.copies.get(start..start + per_layer))
            .unwrap_or(&[]);
        let device_copies = self
            .bf16
            .as_ref()
            .and_then(|b| b.device.get(start..start + per_layer))
            .unwrap_or(&[]);
        Ok(DecoderLayer::new(
            block,
            quantized,
            self.bf16.is_some(),
            copies,
            device_copies,
            &self.layer_tensors,
            &self.config,
            |target| lora.and_then(|lora| lora.adapter(layer, target, rows)),
        ))
    }

    /// Logits of every row of the batch, `[N, V]` with `N = T` (flattened) or
    /// `B * L` (padded, row-major).
    pub fn forward(&self, input: &ModelInput<'_>) -> Result<Tensor<2>, ModelError> {
        if self.bf16.is_some() {
            return self.head_product(self.hidden_states(input)?);
        }
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
        self.loss_sum_in_batch(input, None)
    }

    /// [`Self::loss_sum`] of one example of a batch with `batch_rows`
    /// labelled rows, computed alone: kernels chosen by a row count (the
    /// LM head's under `--bf16`) choose by the batch's, so that the
    /// example runs what its batch runs (`check`'s one-at-a-time pass).
    pub fn loss_sum_in_batch(
        &self,
        input: &ModelInput<'_>,
        batch_rows: Option<usize>,
    ) -> Result<LossSum, ModelError> {
        let hidden = self.hidden_states(input)?;
        let [rows, _] = hidden.dims();
        let labels =
            LabelRows::new(&input.targets(), rows, self.config.vocab_size)?.in_batch_of(batch_rows);
        if labels.is_empty() {
            return Ok(LossSum::empty(hidden));
        }
        let kept = hidden.select(0, labels.rows_tensor(&self.device));
        self.head_loss_sum(kept, &labels)
    }

    /// The summed loss of the labelled rows' final-norm outputs `kept`
    /// (`[K, C]`) through the LM head, in one op that never holds the
    /// `[K, V]` logits (`kernels/cross_entropy`): on a GPU it makes them
    /// again chunk by chunk in its backward pass, on the CPU it makes the
    /// gradients with them; under `--bf16` with the head's 16-bit copy.
    pub(crate) fn head_loss_sum(
        &self,
        kept: Tensor<2>,
        labels: &LabelRows,
    ) -> Result<LossSum, ModelError> {
        let head = self.head().value.clone();
        if !crate::kernels::on_cpu(&self.device) {
            let head16 = self
                .bf16
                .as_ref()
                .and_then(|b| b.get_device(self.head_index()));
            return fused_head_cross_entropy_sum(kept, head, head16, labels);
        }
        let head16 = self
            .bf16
            .as_ref()
            .map(|b| Weight16::of(b.get(self.head_index())));
        host_head_cross_entropy_sum(kept, head, head16, labels)
    }

    /// The LM head: its own matrix, or the embedding when tied.
    fn head(&self) -> &Param {
        &self.params[self.head_index()]
    }

    fn head_index(&self) -> usize {
        let layers = self.config.num_hidden_layers;
        if self.config.tie_word_embeddings {
            index::EMBEDDING
        } else {
            index::lm_head(layers, self.layer_tensors.len())
        }
    }

    /// `x W^T` of the LM head, `[N, C] -> [N, V]`, in the model's precision.
    pub(crate) fn head_product(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        let head = self.head();
        let Some(copies) = self.bf16.as_ref() else {
            return Ok(fused_linear(x, head.value.clone())?);
        };
        if let Some(copy) = copies.get_device(self.head_index()) {
            return Ok(half_linear(x, head.value.clone(), copy)?);
        }
        let head16 = Weight16::of(copies.get(self.head_index()));
        Ok(bf16_linear(x, head.value.clone(), head16)?)
    }

    /// The final-norm output of every row, `[N, C]`.
    pub fn hidden_states(&self, input: &ModelInput<'_>) -> Result<Tensor<2>, ModelError> {
        self.run(input, |_| {})
    }

    /// Every row's state at each depth, `num_hidden_layers + 2` tensors of
    /// `[N, C]`: the embedding, the output of each decoder layer, and the
    /// final norm (HF `output_hidden_states` gives the first `L + 1` of these
    /// with its last entry already normed). For tracing where two ways of
    /// computing a batch part.
    pub fn layer_states(&self, input: &ModelInput<'_>) -> Result<Vec<Tensor<2>>, ModelError> {
        let mut states = Vec::with_capacity(self.config.num_hidden_layers + 2);
        let last = self.run(input, |state| states.push(state))?;
        states.push(last);
        Ok(states)
    }

    /// The forward pass to the final norm, handing `visit` the embedding and
    /// each decoder layer's output on the way.
    fn run(
        &self,
        input: &ModelInput<'_>,
        mut visit: impl FnMut(Tensor<2>),
    ) -> Result<Tensor<2>, ModelError> {
        self.with_layout(input, |rope, layout, rows| {
            let mut x = self.embed(input)?;
            visit(x.clone());
            for layer in 0..self.config.num_hidden_layers {
                x = self.layer(layer, rows)?.forward(x, rope, layout)?;
                visit(x.clone());
            }
            self.final_norm().forward(x)
        })
    }

    /// `[N, C]`: the embedding of every token of the batch.
    fn embed(&self, input: &ModelInput<'_>) -> Result<Tensor<2>, ModelError> {
        Ok(Embedding::new(&self.params[index::EMBEDDING]).forward(input.input_ids())?)
    }

    /// The norm after the last decoder layer.
    fn final_norm(&self) -> RmsNorm<'_> {
        let layers = self.config.num_hidden_layers;
        RmsNorm::new(
            &self.params[index::final_norm(layers, self.layer_tensors.len())],
            self.config.rms_norm_eps,
        )
    }

    /// Checks `input` and runs `f` with the rotary tables, the attention
    /// layout and the LoRA dropout's row keys (when it draws) of the batch,
    /// built once on this model's device for all layers.
    fn with_layout<R>(
        &self,
        input: &ModelInput<'_>,
        f: impl FnOnce(&Rope, &AttentionLayout<'_>, Option<&RowKeys>) -> Result<R, ModelError>,
    ) -> Result<R, ModelError> {
        self.check_input(input)?;
        let dropout_rows = match &self.lora {
            Some(lora) => lora.dropout_rows(input)?,
            None => None,
        };
        let rope = Rope::new(
            input.rows().position_ids(),
            self.config.head_dim,
            self.config.rope_theta,
            &self.device,
        );
        let (masks, rows);
        let layout = match input {
            ModelInput::Varlen(batch) => {
                rows = AttentionRows::new(batch.meta().cu_seqlens_shared(), &self.device);
                // Only the composed kernel reads masks.
                let lengths = match self.attention_kernel {
                    AttentionKernel::Fused => Vec::new(),
                    AttentionKernel::Composed => batch.meta().seq_lens().collect(),
                };
                masks = CausalMasks::new(lengths, &self.device);
                AttentionLayout::Varlen {
                    meta: batch.meta(),
                    rows: &rows,
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
                        let padded_rows =
                            BatchMeta::from_lengths(vec![batch.seq_len(); batch.batch_size()])
                                .map_err(|source| ModelError::Pack {
                                    what: "padded rows",
                                    cause: source,
                                })?;
                        rows = AttentionRows::new(padded_rows.cu_seqlens_shared(), &self.device);
                        PaddedAttention::Fused { rows: &rows }
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
        f(&rope, &layout, dropout_rows.as_ref())
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
        let len = input.rows().max_seqlen();
        if let Some(window) = self.config.sliding_window
            && len > window
        {
            return Err(ModelError::SequenceTooLong { len, window });
        }
        Ok(())
    }
}

/// HF names of the seven projections of every decoder layer: what a
/// frozen base may hold in blocks.
fn projection_names(config: &LlamaConfig) -> std::collections::HashSet<String> {
    (0..config.num_hidden_layers)
        .flat_map(|layer| {
            LoraTarget::ALL.map(|t| format!("model.layers.{layer}.{}.weight", t.hf_path()))
        })
        .collect()
}

/// The same values without autodiff (memory shared, not copied).
fn off_the_graph(params: &[Param]) -> Vec<Param> {
    params
        .iter()
        .map(|p| {
            Param::new(
                p.name().to_owned(),
                p.hf_shape().to_vec(),
                p.value.clone().inner(),
            )
        })
        .collect()
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
