use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// How attention keeps examples apart; the first two train padding-free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionMode {
    /// Flattened batch, boundaries computed once by the collator.
    Varlen,
    /// Flattened batch, boundaries derived again in every layer.
    VarlenPerLayer,
    /// Right-padded `[B, L]` batch with an attention mask.
    Padded,
}

impl AttentionMode {
    /// Every mode, in the order `padfree bench` runs them.
    pub const ALL: [AttentionMode; 3] = [Self::Padded, Self::VarlenPerLayer, Self::Varlen];

    /// The name used by `--attention`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Varlen => "varlen",
            Self::VarlenPerLayer => "varlen-per-layer",
            Self::Padded => "padded",
        }
    }
}

impl std::str::FromStr for AttentionMode {
    type Err = String;

    /// The mode named by [`AttentionMode::name`].
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|m| m.name()).collect();
                format!(
                    "unknown attention mode `{name}`; one of {}",
                    names.join(", ")
                )
            })
    }
}

/// How examples are grouped into micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Batching {
    /// A fixed number of examples (`--per-device-train-batch-size`).
    Examples(usize),
    /// As many consecutive examples as fit in this many real tokens
    /// (`--max-tokens-per-batch`).
    TokenBudget(usize),
    /// Multipack (`--multipack`): each epoch's examples packed into bins of at
    /// most `capacity` real tokens and dealt to ranks and steps so every rank
    /// carries a similar cost.
    Multipack(Multipack),
}

/// Settings of multipack batching.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Multipack {
    /// Real tokens per bin (micro-batch), at least the longest example.
    pub capacity: usize,
    /// Bin-packing rule.
    pub packer: Packer,
    /// What ranks and steps get equal shares of.
    pub balance: BalanceBy,
}

/// Which bin the next (longest remaining) example goes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Packer {
    /// Best-fit decreasing: the fullest bin that still has room.
    BestFit,
    /// First-fit decreasing: the first bin with room (the multipack paper's).
    FirstFit,
}

/// What "equal share" means between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BalanceBy {
    /// Real tokens: the linear layers' and the loss's cost.
    Tokens,
    /// Sum of squared example lengths: causal attention's cost.
    Attention,
}

impl Packer {
    /// For the log.
    pub fn name(self) -> &'static str {
        match self {
            Self::BestFit => "best-fit decreasing",
            Self::FirstFit => "first-fit decreasing",
        }
    }

    /// The planner's rule.
    pub fn algorithm(self) -> padfree_pack::BinPacking {
        match self {
            Self::BestFit => padfree_pack::BinPacking::BestFitDecreasing,
            Self::FirstFit => padfree_pack::BinPacking::FirstFitDecreasing,
        }
    }
}

impl BalanceBy {
    /// For the log.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tokens => "tokens",
            Self::Attention => "attention",
        }
    }

    /// The planner's cost.
    pub fn balance(self) -> padfree_pack::Balance {
        match self {
            Self::Tokens => padfree_pack::Balance::Tokens,
            Self::Attention => padfree_pack::Balance::Attention,
        }
    }
}

/// How the ranks sum their gradients (`--ddp-exchange`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Exchange {
    /// Ring reduce-scatter + all-gather: `2 (W - 1) / W` of the gradients
    /// sent and received per rank, summed in f32 in a fixed ring order.
    #[default]
    Ring,
    /// Every rank gathers every other rank's gradients and adds them in
    /// rank order in f64: `W - 1` buffers received per rank (in f64).
    Gather,
}

impl Exchange {
    /// The name `--ddp-exchange` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ring => "ring",
            Self::Gather => "gather",
        }
    }
}

/// The learning-rate schedule after warm-up (HF `lr_scheduler_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SchedulerKind {
    /// Linear decay to 0 at the last step.
    Linear,
    /// Half a cosine period down to 0 at the last step.
    Cosine,
    /// Constant after warm-up.
    Constant,
}

/// Warm-up length, in steps or as a fraction of all steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Warmup {
    /// `--warmup-steps`.
    Steps(usize),
    /// `--warmup-ratio`: `ceil(ratio * total_steps)` steps, as HF computes it.
    Ratio(f64),
}

/// When checkpoints are written (HF `save_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SaveStrategy {
    /// Never during training (the final model is still written).
    No,
    /// Every this many optimizer steps.
    Steps(usize),
    /// At the end of every epoch.
    Epoch,
}

/// Everything that shapes a training run, validated once by [`Self::validate`].
/// Defaults are Hugging Face `TrainingArguments`' defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Attention strategy; `padded` is the baseline.
    pub attention: AttentionMode,
    /// Micro-batch size.
    pub batching: Batching,
    /// Micro-batches per optimizer step on each rank.
    pub gradient_accumulation_steps: usize,
    /// Data-parallel ranks, `W` (1 in one process; `mpirun -np W`). The
    /// plan, and so the run, depends on it.
    #[serde(default = "one")]
    pub world_size: usize,
    /// How the ranks sum their gradients.
    #[serde(default)]
    pub ddp_exchange: Exchange,
    /// DeepSpeed's ZeRO stage: 0 keeps AdamW's moments whole on every rank,
    /// 1 shards them (each rank updates `1/W` of the weights after a
    /// reduce-scatter; an all-gather brings every rank the new weights).
    #[serde(default)]
    pub zero_stage: u8,
    /// With several ranks and gradient checkpointing: each bucket of
    /// gradients (`LlamaModel::gradient_buckets`, a decoder layer's) is
    /// all-reduced while the backward pass recomputes the layers before it
    /// (PyTorch DDP's overlap), instead of all of them after it.
    #[serde(default)]
    pub ddp_overlap: bool,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Decoupled weight decay, not applied to norm weights and biases.
    pub weight_decay: f64,
    /// Adam's first-moment decay.
    pub adam_beta1: f64,
    /// Adam's second-moment decay.
    pub adam_beta2: f64,
    /// Adam's denominator term.
    pub adam_epsilon: f64,
    /// Schedule after warm-up.
    pub lr_scheduler_type: SchedulerKind,
    /// Warm-up.
    pub warmup: Warmup,
    /// Global gradient-norm clipping; 0 turns it off.
    pub max_grad_norm: f64,
    /// Optimizer steps; overrides `num_train_epochs` when set.
    pub max_steps: Option<usize>,
    /// Passes over the data (may be fractional).
    pub num_train_epochs: f64,
    /// Seeds the data order (and, in the CLI, random initialisation).
    pub seed: u64,
    /// Shuffle every epoch; false keeps the file's order.
    pub shuffle: bool,
    /// Log every this many steps (and at the last step).
    pub logging_steps: usize,
    /// Checkpoints.
    pub save_strategy: SaveStrategy,
    /// Keep at most this many checkpoints in the output directory, removing
    /// the oldest (HF `save_total_limit`); the best model's is kept besides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_total_limit: Option<usize>,
    /// LoRA adapters (`--use-peft`): the base weights are frozen and only
    /// the adapters train. Part of the settings a resume must repeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<padfree_model::LoraConfig>,
    /// What the matmuls compute in (`--bf16`); master weights, gradients
    /// and optimizer state are f32 either way. Saved checkpoints without
    /// it were f32 runs.
    #[serde(default)]
    pub precision: padfree_model::Precision,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            attention: AttentionMode::Varlen,
            batching: Batching::Examples(8),
            gradient_accumulation_steps: 1,
            world_size: 1,
            ddp_exchange: Exchange::Ring,
            zero_stage: 0,
            ddp_overlap: false,
            learning_rate: 5e-5,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            lr_scheduler_type: SchedulerKind::Linear,
            warmup: Warmup::Steps(0),
            max_grad_norm: 1.0,
            max_steps: None,
            num_train_epochs: 3.0,
            seed: 42,
            shuffle: true,
            logging_steps: 500,
            save_strategy: SaveStrategy::Steps(500),
            save_total_limit: None,
            lora: None,
            precision: padfree_model::Precision::F32,
        }
    }
}

fn one() -> usize {
    1
}

impl TrainConfig {
    /// Micro-batches of one optimizer step over all ranks, `W x A`.
    pub fn global_micro_batches(&self) -> usize {
        self.world_size * self.gradient_accumulation_steps
    }

    /// Refuses settings that cannot train, naming the flag.
    pub fn validate(&self) -> Result<(), TrainError> {
        let refuse = |flag, message: String, hint| {
            Err(TrainError::Config {
                flag,
                message,
                hint,
            })
        };
        match self.batching {
            Batching::Examples(0) => {
                return refuse(
                    "per-device-train-batch-size",
                    "must be at least 1".into(),
                    "use 8 (the HF default)",
                );
            }
            Batching::TokenBudget(0) | Batching::Multipack(Multipack { capacity: 0, .. }) => {
                return refuse(
                    "max-tokens-per-batch",
                    "must be at least 1".into(),
                    "use a budget of at least the longest example",
                );
            }
            Batching::Multipack(_) if !self.shuffle => {
                return refuse(
                    "no-shuffle",
                    "multipack orders the bins itself (by --seed), so the file's order cannot be kept".into(),
                    "drop --no-shuffle, or batch without --multipack",
                );
            }
            _ => {}
        }
        if self.world_size == 0 {
            return refuse(
                "world-size",
                "must be at least 1".into(),
                "launch with mpirun -np N, or run one process",
            );
        }
        if self.zero_stage > 1 {
            return refuse(
                "zero-stage",
                format!("stage {} is not offered", self.zero_stage),
                "use 1 (sharded optimizer state) or 0 (none)",
            );
        }
        if self.zero_stage == 1 && self.ddp_exchange == Exchange::Gather {
            return refuse(
                "zero-stage",
                "a sharded optimizer needs the ring's reduce-scatter".into(),
                "drop --ddp-exchange gather, or use --zero-stage 0",
            );
        }
        if self.ddp_overlap && self.zero_stage == 1 {
            return refuse(
                "ddp-overlap",
                "the overlap all-reduces each bucket; a sharded optimizer reduce-scatters the whole buffer after the backward pass".into(),
                "drop --ddp-overlap, or use --zero-stage 0",
            );
        }
        if self.ddp_overlap && self.ddp_exchange == Exchange::Gather {
            return refuse(
                "ddp-overlap",
                "the overlap runs the ring on each bucket".into(),
                "drop --ddp-exchange gather",
            );
        }
        if self.gradient_accumulation_steps == 0 {
            return refuse(
                "gradient-accumulation-steps",
                "must be at least 1".into(),
                "use 1 for no accumulation",
            );
        }
        if !(self.learning_rate.is_finite() && self.learning_rate >= 0.0) {
            return refuse(
                "learning-rate",
                format!("{} is not a non-negative number", self.learning_rate),
                "use e.g. 5e-5 for fine-tuning",
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return refuse(
                "weight-decay",
                format!("{} is not a non-negative number", self.weight_decay),
                "use 0 or e.g. 0.01",
            );
        }
        for (flag, beta) in [
            ("adam-beta1", self.adam_beta1),
            ("adam-beta2", self.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&beta) {
                return refuse(
                    flag,
                    format!("{beta} is outside [0, 1)"),
                    "the defaults are 0.9 and 0.999",
                );
            }
        }
        if !(self.adam_epsilon.is_finite() && self.adam_epsilon > 0.0) {
            return refuse(
                "adam-epsilon",
                format!("{} is not positive", self.adam_epsilon),
                "the default is 1e-8",
            );
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return refuse(
                "max-grad-norm",
                format!("{} is not a non-negative number", self.max_grad_norm),
                "use 1.0, or 0 to turn clipping off",
            );
        }
        if let Warmup::Ratio(ratio) = self.warmup
            && !(0.0..=1.0).contains(&ratio)
        {
            return refuse(
                "warmup-ratio",
                format!("{ratio} is outside [0, 1]"),
                "e.g. 0.03 warms up over 3% of the steps",
            );
        }
        if self.max_steps == Some(0) {
            return refuse(
                "max-steps",
                "must be at least 1".into(),
                "leave it out to train for --num-train-epochs",
            );
        }
        if self.max_steps.is_none()
            && !(self.num_train_epochs.is_finite() && self.num_train_epochs > 0.0)
        {
            return refuse(
                "num-train-epochs",
                format!("{} is not positive", self.num_train_epochs),
                "use e.g. 3, or set --max-steps",
            );
        }
        if self.logging_steps == 0 {
            return refuse(
                "logging-steps",
                "must be at least 1".into(),
                "the HF default is 500",
            );
        }
        if self.save_total_limit == Some(0) {
            return refuse(
                "save-total-limit",
                "must be at least 1".into(),
                "leave it out to keep every checkpoint",
            );
        }
        if self.save_strategy == SaveStrategy::Steps(0) {
            return refuse(
                "save-steps",
                "must be at least 1".into(),
                "or use --save-strategy no",
            );
        }
        Ok(())
    }
}
