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
/// many mean-length examples, in one process or (multipack only) as
/// `ranks` MPI ranks sharing the threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BenchMode {
    pub attention: AttentionMode,
    pub multipack: bool,
    /// Data-parallel ranks (`mpirun -np`), 1 for one process.
    pub ranks: usize,
}

impl BenchMode {
    /// The rows run when --modes is not given.
    pub const DEFAULT: [&'static str; 3] = ["padded", "varlen-per-layer", "varlen"];
    /// The forms --modes takes.
    pub const FORMS: &'static str = "padded, varlen-per-layer, varlen, padded-multipack, varlen-multipack, or a multipack mode on N MPI ranks: varlen-multipack-2ranks";

    /// The name used by --modes and in bench.json.
    pub fn name(self) -> String {
        let mut name = self.attention.name().to_owned();
        if self.multipack {
            name.push_str("-multipack");
        }
        if self.ranks > 1 {
            name.push_str(&format!("-{}ranks", self.ranks));
        }
        name
    }
}

impl std::str::FromStr for BenchMode {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let bad = || format!("unknown mode `{name}`: give {}", Self::FORMS);
        let (rest, ranks) = match name.strip_suffix("ranks").and_then(|r| r.rsplit_once('-')) {
            Some((rest, count)) => (rest, count.parse::<usize>().map_err(|_| bad())?),
            None => (name, 1),
        };
        let (attention, multipack) = match rest.strip_suffix("-multipack") {
            Some(attention) => (attention, true),
            None => (rest, false),
        };
        if ranks == 0 || (ranks > 1 && !multipack) {
            return Err(format!(
                "mode `{name}`: ranks need multipack bins and at least 1 rank (e.g. varlen-multipack-2ranks)"
            ));
        }
        Ok(Self {
            attention: attention.parse().map_err(|_| bad())?,
            multipack,
            ranks,
        })
    }
}

fn bench_mode(name: &str) -> Result<BenchMode, String> {
    name.parse()
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// A model to benchmark: an HF directory or a .gguf file (default: --config).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the runs train: cpu, or a GPU (vulkan, wgpu, metal, dx12, cuda; `vulkan:1`).
    #[arg(long, default_value = "cpu", value_parser = super::train::device_choice())]
    pub device: padfree_model::device::DeviceChoice,
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
    /// Modes named `...-Nranks` run as N MPI ranks (`--mpirun`), each with
    /// --threads / N threads (needs a padfree built with `--features mpi`).
    #[arg(long, value_parser = bench_mode, value_delimiter = ',', default_values = BenchMode::DEFAULT)]
    pub modes: Vec<BenchMode>,
    /// Multipack bins per optimizer step in every multipack row: a row on N
    /// ranks gives each rank bins / N of them, a one-process row accumulates
    /// over all, so the rows train on the same bins per step and their
    /// losses agree (default: the largest rank count among --modes).
    #[arg(long)]
    pub multipack_bins_per_step: Option<usize>,
    /// The MPI launcher of `...-Nranks` modes; it gets `-np N --bind-to none
    /// --oversubscribe` (Open MPI's flags).
    #[arg(long, default_value = "mpirun")]
    pub mpirun: PathBuf,
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
    /// LoRA adapters in every padfree mode (QLoRA on a GGUF model's blocks),
    /// and in the HF peer through PEFT, starting from the same adapters.
    #[command(flatten)]
    pub lora: super::LoraArgs,
    /// Per-layer gradient checkpointing in every padfree mode.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// bf16 mixed precision in every padfree mode, and HF's Trainer with
    /// `bf16=True` (docs/training.md, "bf16").
    #[arg(long)]
    pub bf16: bool,
    /// Time the varlen attention alone instead of training: one layer's
    /// forward and backward on each micro-batch of the varlen mode, the
    /// tiled kernels against the per-row ones (and, with --bf16 on a GPU,
    /// the tiled kernels on 16-bit inputs); writes attention.md and
    /// attention.json.
    #[arg(long, conflicts_with_all = ["peer", "peer_python"])]
    pub attention_alone: bool,
    /// Internal: run one mode in this process and write its result here.
    #[arg(long, hide = true, requires = "child_result", value_parser = bench_mode)]
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
    pub device: padfree_model::device::DeviceChoice,
    pub config: String,
    pub tokenizer: Option<PathBuf>,
    pub data: Option<PathBuf>,
    pub per_device_train_batch_size: usize,
    pub max_steps: usize,
    pub timing_warmup_steps: usize,
    /// CPU threads of every run, resolved (all cores unless --threads).
    pub threads: usize,
    pub modes: Vec<BenchMode>,
    /// Multipack bins per optimizer step, resolved.
    pub multipack_bins_per_step: usize,
    pub mpirun: PathBuf,
    pub learning_rate: f64,
    pub seed: u64,
    pub max_seq_len: usize,
    /// Where the reports go, resolved (runs/bench-<time> unless given).
    pub output_dir: PathBuf,
    pub repeats: u32,
    pub peer: Option<Peer>,
    pub child: Option<Child>,
    /// `--use-peft` and its settings.
    pub lora: Option<padfree_model::LoraConfig>,
    pub gradient_checkpointing: bool,
    /// `--bf16`.
    pub precision: padfree_model::Precision,
    /// `--attention-alone`: time the attention op, train nothing.
    pub attention_alone: bool,
}

/// `1st`, `2nd`, `3rd`, `4th`, ...
fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

impl BenchArgs {
    pub fn validate(self) -> anyhow::Result<BenchJob> {
        if self.max_steps == 0 {
            bail!("--max-steps must be at least 1");
        }
        if self.threads == Some(0) {
            bail!("--threads is 0\nHINT: give at least 1, or leave it out to use every core");
        }
        if let Some((i, mode)) = self
            .modes
            .iter()
            .enumerate()
            .find(|(i, mode)| self.modes[..*i].contains(mode))
        {
            bail!(
                "--modes: `{}` is given twice (the {} entry repeats an earlier one)\nHINT: give each mode once; --repeats N runs every mode N times and reports the median and range",
                mode.name(),
                ordinal(i + 1)
            );
        }
        let most_ranks = self.modes.iter().map(|m| m.ranks).max().unwrap_or(1);
        let bins_per_step = self.multipack_bins_per_step.unwrap_or(most_ranks);
        for mode in self.modes.iter().filter(|m| m.multipack) {
            if bins_per_step == 0 || !bins_per_step.is_multiple_of(mode.ranks) {
                bail!(
                    "--multipack-bins-per-step {bins_per_step} cannot be shared by the {} ranks of mode {}\nHINT: give a multiple of every rank count in --modes",
                    mode.ranks,
                    mode.name()
                );
            }
        }
        if most_ranks > 1 && !cfg!(feature = "mpi") {
            bail!(
                "--modes asks for MPI ranks, but this padfree was built without MPI\nHINT: build it with `cargo build --release --features mpi` (needs Debian's openmpi-bin libopenmpi-dev libclang-dev pkg-config)"
            );
        }
        let threads = self
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
        if let Some(mode) = self.modes.iter().find(|m| !threads.is_multiple_of(m.ranks)) {
            bail!(
                "mode {} splits the {threads} threads over {} ranks unevenly\nHINT: give --threads as a multiple of the rank count",
                mode.name(),
                mode.ranks
            );
        }
        let lora = self.lora.validate()?;
        let job = BenchJob {
            lora,
            gradient_checkpointing: self.gradient_checkpointing,
            precision: if self.bf16 {
                padfree_model::Precision::Bf16
            } else {
                padfree_model::Precision::F32
            },
            threads,
            multipack_bins_per_step: bins_per_step,
            mpirun: self.mpirun,
            output_dir: self
                .output_dir
                .unwrap_or_else(|| padfree_train::clock::run_dir("bench")),
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
            device: self.device,
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
            attention_alone: self.attention_alone,
        };
        // Every mode shares these settings: refuse bad ones before any run.
        job.train_job(BenchMode {
            attention: AttentionMode::Varlen,
            multipack: false,
            ranks: 1,
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
            gradient_accumulation_steps: if mode.multipack {
                self.multipack_bins_per_step / mode.ranks
            } else {
                1
            },
            world_size: mode.ranks,
            learning_rate: self.learning_rate,
            lr_scheduler_type: SchedulerKind::Linear,
            warmup: Warmup::Steps(0),
            max_steps: Some(self.timing_warmup_steps + self.max_steps),
            seed: self.seed,
            logging_steps: usize::MAX,
            save_strategy: SaveStrategy::No,
            lora: self.lora.clone(),
            precision: self.precision,
            ..TrainConfig::default()
        };
        train.validate()?;
        Ok(TrainJob {
            embedded_default: false,
            model_given: true,
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
            // A benchmark times training, and leaves nothing behind.
            data_cache: None,
            gradient_checkpointing: self.gradient_checkpointing,
            merge_adapter: false,
            dequantize_base: false,
            device: self.device,
            multipack_examples_per_bin: mode.multipack.then_some(batch),
            verify_packing: None,
            eval: None,
            train,
        })
    }
}
