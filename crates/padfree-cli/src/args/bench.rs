//! `padfree bench` flags, parsed by clap and validated once into a
//! [`BenchJob`]; `BenchJob::train_job` is the `padfree train` job each mode
//! runs.

use std::path::PathBuf;

use anyhow::bail;
use padfree_data::{FieldNames, Overlong};
use padfree_train::{
    AttentionMode, BalanceBy, Batching, Multipack, Packer, SaveStrategy, SchedulerKind,
    TrainConfig, Warmup,
};

use super::train::{ModelSource, TrainJob};

/// One row of the bench table: an attention mode, on fixed batches of
/// `--per-device-train-batch-size` examples or on multipack bins of that
/// many mean-length examples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BenchMode {
    pub attention: AttentionMode,
    pub multipack: bool,
}

impl BenchMode {
    /// The rows run when --modes is not given.
    pub const DEFAULT: [&'static str; 3] = ["padded", "varlen-per-layer", "varlen"];
    /// Every row name --modes takes.
    pub const NAMES: [&'static str; 5] = [
        "padded",
        "varlen-per-layer",
        "varlen",
        "padded-multipack",
        "varlen-multipack",
    ];

    /// The name used by --modes and in bench.json.
    pub fn name(self) -> String {
        if self.multipack {
            format!("{}-multipack", self.attention.name())
        } else {
            self.attention.name().to_owned()
        }
    }
}

impl std::str::FromStr for BenchMode {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let (attention, multipack) = match name.strip_suffix("-multipack") {
            Some(attention) => (attention, true),
            None => (name, false),
        };
        Ok(Self {
            attention: attention.parse()?,
            multipack,
        })
    }
}

fn bench_mode() -> impl clap::builder::TypedValueParser<Value = BenchMode> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(BenchMode::NAMES)
        .try_map(|name| name.parse::<BenchMode>())
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// A model to benchmark: an HF directory or a .gguf file (default: --config).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A preset (tiny, small, medium) or config.json, randomly initialised.
    #[arg(long, default_value = "small")]
    pub config: String,
    /// tokenizer.json or .gguf (default: the model's, or the shipped one).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Training data (default: the shipped maths set).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Examples per batch.
    #[arg(long, default_value_t = 8)]
    pub per_device_train_batch_size: usize,
    /// Timed optimizer steps per mode.
    #[arg(long, default_value_t = 20)]
    pub max_steps: usize,
    /// Steps run first in every mode and left out of the timing.
    #[arg(long, default_value_t = 2)]
    pub timing_warmup_steps: usize,
    /// CPU threads of every run (RAYON_NUM_THREADS); default: all cores.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Modes to run, in order (`-multipack`: the same attention on multipack
    /// bins of --per-device-train-batch-size mean-length examples).
    #[arg(long, value_parser = bench_mode(), value_delimiter = ',', default_values = BenchMode::DEFAULT)]
    pub modes: Vec<BenchMode>,
    #[arg(long, default_value_t = 1e-3)]
    pub learning_rate: f64,
    /// Seeds initialisation and data order (the same in every mode).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    #[arg(long, default_value_t = 2048)]
    pub max_seq_len: usize,
    /// Where bench.md, bench.json and bench.png go (default runs/bench-<time>).
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Runs of every mode; the table shows each mode's median run (by real
    /// tokens/s) and the range over all runs. Rounds alternate the modes, so
    /// a slow spell of the machine is spread over all of them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Also run Hugging Face's Trainer, with the Python of `.venv-peer/` in
    /// the repository, made first by `bench/hf_peer/setup.sh` when missing
    /// (torch and transformers from PyPI: several GB).
    #[arg(long, conflicts_with = "peer_python")]
    pub peer: bool,
    /// Also run Hugging Face's Trainer (bench/hf_peer/hf_peer.py) with this
    /// Python, padded and with DataCollatorWithFlattening, on the same batches,
    /// initial weights, settings and threads.
    #[arg(long)]
    pub peer_python: Option<PathBuf>,
    /// Internal: run one mode in this process and write its result here.
    #[arg(long, hide = true, requires = "child_result", value_parser = bench_mode())]
    pub child_mode: Option<BenchMode>,
    #[arg(long, hide = true)]
    pub child_result: Option<PathBuf>,
}

/// Where the Hugging Face peer's Python comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// `.venv-peer/` of the repository, made by `bench/hf_peer/setup.sh`
    /// when missing (`--peer`).
    Setup,
    /// This Python (`--peer-python`).
    Python(PathBuf),
}

/// An internal child run: one mode in this process, its result to a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Child {
    /// The mode to train.
    pub mode: BenchMode,
    /// Where its result goes (JSON).
    pub result: PathBuf,
}

/// A validated `padfree bench` invocation.
#[derive(Debug, Clone)]
pub struct BenchJob {
    pub model: Option<PathBuf>,
    pub config: String,
    pub tokenizer: Option<PathBuf>,
    pub data: Option<PathBuf>,
    pub per_device_train_batch_size: usize,
    pub max_steps: usize,
    pub timing_warmup_steps: usize,
    /// CPU threads of every run, resolved (all cores unless --threads).
    pub threads: usize,
    pub modes: Vec<BenchMode>,
    pub learning_rate: f64,
    pub seed: u64,
    pub max_seq_len: usize,
    /// Where the reports go, resolved (runs/bench-<time> unless given).
    pub output_dir: PathBuf,
    pub repeats: u32,
    pub peer: Option<Peer>,
    pub child: Option<Child>,
}

impl BenchArgs {
    pub fn validate(self) -> anyhow::Result<BenchJob> {
        if self.max_steps == 0 {
            bail!("--max-steps must be at least 1");
        }
        if self.threads == Some(0) {
            bail!("--threads is 0\nHINT: give at least 1, or leave it out to use every core");
        }
        let job = BenchJob {
            threads: self
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from)),
            output_dir: self
                .output_dir
                .unwrap_or_else(|| crate::clock::run_dir("bench")),
            peer: match (self.peer_python, self.peer) {
                (Some(python), _) => Some(Peer::Python(python)),
                (None, true) => Some(Peer::Setup),
                (None, false) => None,
            },
            child: match (self.child_mode, self.child_result) {
                (Some(mode), Some(result)) => Some(Child { mode, result }),
                _ => None,
            },
            model: self.model,
            config: self.config,
            tokenizer: self.tokenizer,
            data: self.data,
            per_device_train_batch_size: self.per_device_train_batch_size,
            max_steps: self.max_steps,
            timing_warmup_steps: self.timing_warmup_steps,
            modes: self.modes,
            learning_rate: self.learning_rate,
            seed: self.seed,
            max_seq_len: self.max_seq_len,
            repeats: self.repeats,
        };
        // Every mode shares these settings: refuse bad ones before any run.
        job.train_job(BenchMode {
            attention: AttentionMode::Varlen,
            multipack: false,
        })?;
        Ok(job)
    }
}

impl BenchJob {
    /// The `padfree train` job of one mode: the same model, data, seed and
    /// steps in every mode, nothing saved.
    /// Multipack rows get their bin capacity from the data
    /// (`TrainJob::train_config`).
    pub fn train_job(&self, mode: BenchMode) -> anyhow::Result<TrainJob> {
        let model = match &self.model {
            Some(path) => ModelSource::from_model_path(path),
            None => ModelSource::Init(self.config.clone()),
        };
        let batch = self.per_device_train_batch_size;
        let train = TrainConfig {
            attention: mode.attention,
            batching: if mode.multipack {
                Batching::Multipack(Multipack {
                    capacity: batch.saturating_mul(self.max_seq_len),
                    packer: Packer::BestFit,
                    balance: BalanceBy::Tokens,
                })
            } else {
                Batching::Examples(batch)
            },
            learning_rate: self.learning_rate,
            lr_scheduler_type: SchedulerKind::Linear,
            warmup: Warmup::Steps(0),
            max_steps: Some(self.timing_warmup_steps + self.max_steps),
            seed: self.seed,
            logging_steps: usize::MAX,
            save_strategy: SaveStrategy::No,
            ..TrainConfig::default()
        };
        train.validate()?;
        Ok(TrainJob {
            embedded_default: false,
            model,
            tokenizer: self.tokenizer.clone(),
            data: self.data.clone(),
            output_dir: PathBuf::new(),
            output_dir_defaulted: false,
            overwrite_output_dir: false,
            resume_from_checkpoint: None,
            fields: FieldNames::default(),
            train_on_inputs: false,
            use_chat_template: false,
            max_seq_len: self.max_seq_len,
            overlong: Overlong::Truncate,
            gradient_checkpointing: false,
            multipack_examples_per_bin: mode.multipack.then_some(batch),
            train,
        })
    }
}
