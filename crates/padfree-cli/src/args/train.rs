//! `padfree train` flags (named after HF `TrainingArguments`), parsed by clap
//! and validated once into a [`TrainJob`].

use std::path::{Path, PathBuf};

use anyhow::bail;
use clap::ValueEnum;
use padfree_data::{DataCache, FieldNames, Overlong};
use padfree_model::Precision;
use padfree_model::device::DeviceChoice;

use super::LoraArgs;
use super::data::DataArgs;
use padfree_train::{
    AttentionMode, BalanceBy, Batching, EvalSettings, EvalStrategy, Exchange, Multipack, Packer,
    SaveStrategy, SchedulerKind, TrainConfig, Warmup,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PackerArg {
    BestFit,
    FirstFit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BalanceArg {
    Tokens,
    Attention,
}

/// `--ddp-exchange`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExchangeArg {
    Ring,
    Gather,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SchedulerArg {
    Linear,
    Cosine,
    Constant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SaveStrategyArg {
    No,
    Steps,
    Epoch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EvalStrategyArg {
    No,
    Steps,
    Epoch,
}

/// `--metric-for-best-model`: the one metric padfree evaluates, under HF's
/// two spellings of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BestMetricArg {
    #[value(name = "eval_loss", alias = "loss")]
    EvalLoss,
}

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// A model to fine-tune: a Hugging Face directory (config.json +
    /// safetensors) or a .gguf file.
    #[arg(long, conflicts_with = "config")]
    pub model: Option<PathBuf>,
    /// Train from random initialisation: a preset (tiny, small, medium) or a config.json.
    #[arg(long)]
    pub config: Option<String>,
    /// tokenizer.json (with tokenizer_config.json beside it) or a .gguf file.
    /// Defaults to the one of --model, or the shipped one.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Training data: JSONL or a JSON array. Defaults to the shipped maths set.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Where checkpoints, the final model and reports go (default runs/train-<time>).
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Allow writing into a non-empty --output-dir.
    #[arg(long)]
    pub overwrite_output_dir: bool,
    /// Continue a run from its checkpoint-N directory, bit-identically.
    #[arg(long)]
    pub resume_from_checkpoint: Option<PathBuf>,

    /// Longest example in tokens; see --overlong for longer ones.
    #[arg(long, default_value_t = 2048)]
    pub max_seq_len: usize,
    /// How records are read and tokenized, and where the result is cached.
    #[command(flatten)]
    pub records: DataArgs,

    /// Examples per micro-batch.
    #[arg(long, default_value_t = 8, conflicts_with = "max_tokens_per_batch")]
    pub per_device_train_batch_size: usize,
    /// Micro-batches of consecutive examples up to this many real tokens,
    /// instead of a fixed example count (with --multipack: the bin capacity).
    #[arg(long)]
    pub max_tokens_per_batch: Option<usize>,
    /// Multipack: pack each epoch's examples into bins of at most
    /// --max-tokens-per-batch real tokens (default: --per-device-train-batch-size
    /// x the mean example length) and deal them to ranks and steps by cost.
    #[arg(long)]
    pub multipack: bool,
    /// Multipack's bin-packing rule (best-fit or first-fit decreasing).
    #[arg(long, value_enum, default_value_t = PackerArg::BestFit, requires = "multipack")]
    pub multipack_algorithm: PackerArg,
    /// What multipack balances between ranks: real tokens, or attention cost
    /// (sum of squared example lengths).
    #[arg(long, value_enum, default_value_t = BalanceArg::Tokens, requires = "multipack")]
    pub multipack_balance: BalanceArg,
    /// Train padding-free (true) or on padded batches (false).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub padding_free: bool,
    /// Attention strategy (default: varlen when padding-free, else padded).
    #[arg(long, value_parser = attention_mode())]
    pub attention: Option<AttentionMode>,
    /// Keep only each decoder layer's input and recompute the layer in the
    /// backward pass (torch's per-layer checkpointing): activation memory
    /// stops growing with depth, for about a third more compute.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Mixed precision as HF's `bf16=True`: matmul operands rounded to bf16,
    /// products accumulated in f32; master weights, gradients, AdamW state
    /// and the saved model stay f32. Fast on CPUs with AVX512-BF16
    /// (docs/training.md, "bf16").
    #[arg(long)]
    pub bf16: bool,
    /// Refused (f16 needs loss scaling, which padfree has not built): use --bf16.
    #[arg(long, hide = true)]
    pub fp16: bool,
    #[command(flatten)]
    pub lora: LoraArgs,
    /// Also write the model with the adapters merged into its weights (HF
    /// format) to OUTPUT_DIR/merged when training ends.
    #[arg(long, requires = "use_peft")]
    pub merge_adapter: bool,
    /// Hold the frozen base in f32 instead of its GGUF blocks or 16-bit
    /// safetensors values (QLoRA, the default with --use-peft on the CPU).
    #[arg(long, requires = "use_peft")]
    pub dequantize_base: bool,
    /// Where the model trains: cpu, or a GPU (vulkan, wgpu, metal, dx12, cuda;
    /// `vulkan:1` picks an adapter). Never replaced by another device.
    #[arg(long, default_value = "cpu", value_parser = device_choice())]
    pub device: DeviceChoice,
    /// Micro-batches per optimizer step; the loss is normalised by all their label tokens.
    #[arg(long, default_value_t = 1)]
    pub gradient_accumulation_steps: usize,
    /// With several ranks, how they sum gradients: a ring reduce-scatter +
    /// all-gather (2 (W-1)/W of the gradients per rank), or every rank
    /// gathering all the others' (W-1 of them; the older exchange).
    #[arg(long, value_enum, default_value_t = ExchangeArg::Ring)]
    pub ddp_exchange: ExchangeArg,
    /// DeepSpeed's ZeRO stage: 1 shards AdamW's moments over the ranks
    /// (each keeps and updates 1/W of them), saving 8 bytes x trained
    /// parameters x (W-1)/W per rank; 0 keeps them whole on every rank.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub zero_stage: u8,
    /// With several ranks and --gradient-checkpointing: all-reduce each
    /// layer's gradients while the backward pass recomputes the layers
    /// before it (PyTorch DDP's overlap), instead of all after it.
    #[arg(long)]
    pub ddp_overlap: bool,
    /// Peak learning rate [default: 5e-5; 1e-3 for the built-in demo run].
    #[arg(long)]
    pub learning_rate: Option<f64>,
    /// AdamW weight decay (not on norm weights or biases).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f64,
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f64,
    #[arg(long, default_value_t = 1e-8)]
    pub adam_epsilon: f64,
    #[arg(long, value_enum, default_value_t = SchedulerArg::Linear)]
    pub lr_scheduler_type: SchedulerArg,
    /// Linear warm-up steps [default: 0; 10 for the built-in demo run].
    #[arg(long, conflicts_with = "warmup_ratio")]
    pub warmup_steps: Option<usize>,
    /// Warm-up as a fraction of all steps.
    #[arg(long)]
    pub warmup_ratio: Option<f64>,
    /// Clip the global gradient norm to this (0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Optimizer steps; overrides --num-train-epochs [built-in demo run: 100].
    #[arg(long)]
    pub max_steps: Option<usize>,
    #[arg(long, default_value_t = 3.0)]
    pub num_train_epochs: f64,
    /// Seeds data order and random initialisation.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Keep the file's order instead of shuffling every epoch.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Log every N steps [default: 500; 10 for the built-in demo run].
    #[arg(long)]
    pub logging_steps: Option<usize>,
    #[arg(long, value_enum, default_value_t = SaveStrategyArg::Steps)]
    pub save_strategy: SaveStrategyArg,
    #[arg(long, default_value_t = 500)]
    pub save_steps: usize,
    /// Keep at most N checkpoints, removing the oldest (the best model's is
    /// kept besides, with --load-best-model-at-end) [default: keep all].
    #[arg(long)]
    pub save_total_limit: Option<usize>,
    /// Held-out data (same format and fields as --data) for the eval loss
    /// during training [built-in demo run: the shipped eval split].
    #[arg(long)]
    pub eval_data: Option<PathBuf>,
    /// When to evaluate [default: steps with --eval-data, else no].
    #[arg(long, value_enum)]
    pub eval_strategy: Option<EvalStrategyArg>,
    /// Evaluate every N steps (with --eval-strategy steps) [default:
    /// --logging-steps; 25 for the built-in demo run].
    #[arg(long)]
    pub eval_steps: Option<usize>,
    /// Examples per eval batch.
    #[arg(long, default_value_t = 8)]
    pub per_device_eval_batch_size: usize,
    /// Write the evaluated model with the lowest eval loss as the final
    /// model instead of the last step's (HF's rule: --save-strategy equal to
    /// --eval-strategy, --save-steps a multiple of --eval-steps).
    #[arg(long)]
    pub load_best_model_at_end: bool,
    /// What "best" means for --load-best-model-at-end (lower is better).
    #[arg(long, value_enum, requires = "load_best_model_at_end")]
    pub metric_for_best_model: Option<BestMetricArg>,
    /// Before training, run `padfree check` on the first micro-batches: stop
    /// if padding-free and padded or one-at-a-time results differ.
    #[arg(long)]
    pub verify_packing: bool,
    /// Micro-batches --verify-packing checks.
    #[arg(long, default_value_t = 1, requires = "verify_packing")]
    pub verify_packing_batches: usize,
}

/// Where the model's weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A Hugging Face directory.
    HfDir(PathBuf),
    /// A GGUF file.
    Gguf(PathBuf),
    /// Random initialisation from a preset name or a config.json.
    Init(String),
}

/// `--attention`: the trainer's own [`AttentionMode`], by its name (no
/// mirror enum to keep in step).
pub fn attention_mode() -> impl clap::builder::TypedValueParser<Value = AttentionMode> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(AttentionMode::ALL.map(AttentionMode::name))
        .try_map(|name| name.parse::<AttentionMode>())
}

/// `--device`: a name padfree knows (opening it comes later, before any work).
pub fn device_choice() -> impl clap::builder::TypedValueParser<Value = DeviceChoice> {
    |value: &str| value.parse::<DeviceChoice>()
}

/// Whether a model or tokenizer path names a GGUF file.
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gguf")
}

impl ModelSource {
    /// `--model PATH`: a GGUF file or an HF directory.
    pub fn from_model_path(path: &Path) -> Self {
        if is_gguf(path) {
            Self::Gguf(path.to_owned())
        } else {
            Self::HfDir(path.to_owned())
        }
    }
}

/// Evaluation during training, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalJob {
    /// `None`: the shipped eval split (the built-in demo).
    pub data: Option<PathBuf>,
    pub settings: EvalSettings,
}

/// A validated `padfree train` invocation.
#[derive(Debug, Clone)]
pub struct TrainJob {
    /// No model, config, tokenizer nor data given: the shipped demo.
    pub embedded_default: bool,
    pub model: ModelSource,
    /// --model or --config was given (not the default preset): on resume,
    /// it must describe the checkpoint's model.
    pub model_given: bool,
    pub tokenizer: Option<PathBuf>,
    pub data: Option<PathBuf>,
    pub output_dir: PathBuf,
    /// No --output-dir given: `output_dir` is this process's own
    /// `runs/train-<time>` (refused with several ranks).
    pub output_dir_defaulted: bool,
    pub overwrite_output_dir: bool,
    pub resume_from_checkpoint: Option<PathBuf>,
    pub fields: FieldNames,
    pub train_on_inputs: bool,
    pub use_chat_template: bool,
    pub max_seq_len: usize,
    pub overlong: Overlong,
    /// Where tokenized data sets are kept (`None`: --no-data-cache, or no
    /// home directory to keep them in).
    pub data_cache: Option<DataCache>,
    pub gradient_checkpointing: bool,
    /// `--merge-adapter`.
    pub merge_adapter: bool,
    /// `--dequantize-base`.
    pub dequantize_base: bool,
    /// `--device`.
    pub device: DeviceChoice,
    /// Multipack without --max-tokens-per-batch: bins hold this many
    /// examples of mean length; set from the data by `resolve_capacity`.
    pub multipack_examples_per_bin: Option<usize>,
    /// --verify-packing: check this many micro-batches before training.
    pub verify_packing: Option<usize>,
    /// Evaluation: where the held-out data is (`None`: the shipped eval
    /// split, for the demo), when, and in batches of how many.
    pub eval: Option<EvalJob>,
    pub train: TrainConfig,
}

impl TrainJob {
    /// The training config for these example lengths: without
    /// --max-tokens-per-batch, multipack's bins hold the batch size times the
    /// mean example length (so steps stay about as many as with fixed
    /// batches), and at least the longest example.
    pub fn train_config(&self, lengths: &[usize]) -> TrainConfig {
        let mut train = self.train.clone();
        if let (Some(per_bin), Batching::Multipack(multipack)) =
            (self.multipack_examples_per_bin, &mut train.batching)
        {
            let total: usize = lengths.iter().sum();
            let mean = total.div_ceil(lengths.len().max(1));
            let longest = lengths.iter().copied().max().unwrap_or(1);
            multipack.capacity = per_bin.saturating_mul(mean).max(longest).max(1);
        }
        train
    }
}

/// Refuses a `--model` that is neither a model directory nor a GGUF file,
/// before anything is loaded.
fn check_model_path(path: &Path) -> anyhow::Result<()> {
    const HINT: &str = "HINT: give a Hugging Face model directory (config.json + model.safetensors) or a .gguf file";
    match std::fs::metadata(path) {
        Err(err) => bail!("--model {}: {err}\n{HINT}", path.display()),
        Ok(meta) if is_gguf(path) && !meta.is_file() => {
            bail!("--model {}: not a file\n{HINT}", path.display())
        }
        Ok(meta) if !is_gguf(path) && !meta.is_dir() => bail!(
            "--model {}: a file, but not a .gguf one\n{HINT}",
            path.display()
        ),
        Ok(_) if !is_gguf(path) && !path.join("config.json").is_file() => bail!(
            "--model {}: a directory without config.json\n{HINT}",
            path.display()
        ),
        Ok(_) => Ok(()),
    }
}

impl TrainArgs {
    pub fn validate(self) -> anyhow::Result<TrainJob> {
        let embedded_default = self.model.is_none()
            && self.config.is_none()
            && self.tokenizer.is_none()
            && self.data.is_none();
        let model = match (&self.model, &self.config) {
            (Some(path), _) => ModelSource::from_model_path(path),
            (None, Some(config)) => ModelSource::Init(config.clone()),
            (None, None) => ModelSource::Init("small".into()),
        };
        let attention = match (self.padding_free, self.attention) {
            (true, None) => AttentionMode::Varlen,
            (true, Some(mode)) => mode,
            (false, None | Some(AttentionMode::Padded)) => AttentionMode::Padded,
            (false, Some(_)) => {
                bail!(
                    "--padding-free false trains on padded batches; --attention varlen needs a flattened batch\nHINT: drop one of the two flags"
                )
            }
        };
        if self.max_seq_len < 2 {
            bail!(
                "--max-seq-len {}: an example needs at least 2 tokens (a token is learned from the ones before it, so the first never carries loss)\nHINT: give --max-seq-len 2 or more (default 2048)",
                self.max_seq_len
            );
        }
        if let Some(path) = &self.model {
            check_model_path(path)?;
        }
        self.records.check_template()?;
        let batching = match (self.multipack, self.max_tokens_per_batch) {
            (true, budget) => Batching::Multipack(Multipack {
                // Without a budget, a bound here; `resolve_capacity` sets it
                // from the data.
                capacity: budget.unwrap_or(
                    self.per_device_train_batch_size
                        .saturating_mul(self.max_seq_len),
                ),
                packer: match self.multipack_algorithm {
                    PackerArg::BestFit => Packer::BestFit,
                    PackerArg::FirstFit => Packer::FirstFit,
                },
                balance: match self.multipack_balance {
                    BalanceArg::Tokens => BalanceBy::Tokens,
                    BalanceArg::Attention => BalanceBy::Attention,
                },
            }),
            (false, Some(budget)) => Batching::TokenBudget(budget),
            (false, None) => Batching::Examples(self.per_device_train_batch_size),
        };
        let multipack_examples_per_bin = (self.multipack && self.max_tokens_per_batch.is_none())
            .then_some(self.per_device_train_batch_size);
        fn demo<T>(embedded: bool, demo_value: T, hf_default: T) -> T {
            if embedded { demo_value } else { hf_default }
        }
        let demo_usize = |d, hf| demo(embedded_default, d, hf);
        let warmup = match (self.warmup_steps, self.warmup_ratio) {
            (_, Some(ratio)) => Warmup::Ratio(ratio),
            (Some(steps), None) => Warmup::Steps(steps),
            (None, None) => Warmup::Steps(demo_usize(10, 0)),
        };
        let lora = self.lora.validate()?;
        let train = TrainConfig {
            attention,
            batching,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            world_size: 1,
            ddp_exchange: match self.ddp_exchange {
                ExchangeArg::Ring => Exchange::Ring,
                ExchangeArg::Gather => Exchange::Gather,
            },
            zero_stage: self.zero_stage,
            ddp_overlap: self.ddp_overlap,
            learning_rate: self
                .learning_rate
                .unwrap_or(demo(embedded_default, 1e-3, 5e-5)),
            weight_decay: self.weight_decay,
            adam_beta1: self.adam_beta1,
            adam_beta2: self.adam_beta2,
            adam_epsilon: self.adam_epsilon,
            lr_scheduler_type: match self.lr_scheduler_type {
                SchedulerArg::Linear => SchedulerKind::Linear,
                SchedulerArg::Cosine => SchedulerKind::Cosine,
                SchedulerArg::Constant => SchedulerKind::Constant,
            },
            warmup,
            max_grad_norm: self.max_grad_norm,
            max_steps: self
                .max_steps
                .or(if embedded_default { Some(100) } else { None }),
            num_train_epochs: self.num_train_epochs,
            seed: self.seed,
            shuffle: !self.no_shuffle,
            logging_steps: self.logging_steps.unwrap_or(demo_usize(10, 500)),
            save_strategy: match self.save_strategy {
                SaveStrategyArg::No => SaveStrategy::No,
                SaveStrategyArg::Steps => SaveStrategy::Steps(self.save_steps),
                SaveStrategyArg::Epoch => SaveStrategy::Epoch,
            },
            save_total_limit: self.save_total_limit,
            lora,
            precision: if self.bf16 {
                Precision::Bf16
            } else {
                Precision::F32
            },
        };
        train.validate()?;
        let eval_strategy = match (self.eval_strategy, &self.eval_data, embedded_default) {
            (Some(EvalStrategyArg::No), _, _) => None,
            (None, None, false) => None,
            (Some(EvalStrategyArg::Epoch), _, _) => Some(EvalStrategy::Epoch),
            (Some(EvalStrategyArg::Steps) | None, _, _) => {
                // The demo's 200 held-out problems, four times in its 100
                // steps: a forward pass over about a quarter of the tokens
                // it trains on.
                let default = if embedded_default {
                    25
                } else {
                    train.logging_steps
                };
                Some(EvalStrategy::Steps(self.eval_steps.unwrap_or(default)))
            }
        };
        if eval_strategy.is_some() && self.eval_data.is_none() && !embedded_default {
            bail!(
                "--eval-strategy needs held-out data\nHINT: give --eval-data FILE (the same format as --data)"
            );
        }
        if self.fp16 {
            bail!(
                "--fp16 is not built: f16 training needs loss scaling, which padfree does not have\nHINT: use --bf16 (the same exponent range as f32, no loss scaling)"
            );
        }
        if self.ddp_overlap && !self.gradient_checkpointing {
            bail!(
                "--ddp-overlap: the backward pass hands gradients over layer by layer only when it recomputes the layers\nHINT: add --gradient-checkpointing, or drop --ddp-overlap"
            );
        }
        if self.verify_packing && self.verify_packing_batches == 0 {
            bail!("--verify-packing-batches must be at least 1");
        }
        if self.load_best_model_at_end && eval_strategy.is_none() {
            bail!(
                "--load-best-model-at-end needs evaluation\nHINT: give --eval-data FILE (and --eval-strategy steps or epoch)"
            );
        }
        let eval = eval_strategy
            .map(|strategy| -> anyhow::Result<EvalJob> {
                let settings = EvalSettings {
                    strategy,
                    batch_size: self.per_device_eval_batch_size,
                    load_best_model_at_end: self.load_best_model_at_end,
                };
                // Before any model or data is loaded.
                settings.validate(train.save_strategy)?;
                Ok(EvalJob {
                    data: self.eval_data.clone(),
                    settings,
                })
            })
            .transpose()?;
        Ok(TrainJob {
            embedded_default,
            model_given: self.model.is_some() || self.config.is_some(),
            model,
            tokenizer: self.tokenizer,
            data: self.data,
            output_dir_defaulted: self.output_dir.is_none(),
            output_dir: self
                .output_dir
                .unwrap_or_else(|| padfree_train::clock::run_dir("train")),
            overwrite_output_dir: self.overwrite_output_dir,
            resume_from_checkpoint: self.resume_from_checkpoint,
            fields: self.records.fields(),
            train_on_inputs: self.records.train_on_inputs,
            use_chat_template: self.records.use_chat_template,
            max_seq_len: self.max_seq_len,
            overlong: self.records.overlong(),
            data_cache: self.records.cache(),
            gradient_checkpointing: self.gradient_checkpointing,
            merge_adapter: self.merge_adapter,
            dequantize_base: self.dequantize_base,
            device: self.device,
            multipack_examples_per_bin,
            verify_packing: self.verify_packing.then_some(self.verify_packing_batches),
            eval,
            train,
        })
    }
}
