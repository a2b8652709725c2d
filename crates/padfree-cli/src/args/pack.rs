//! `padfree pack` flags, parsed by clap and validated once into a
//! [`PackJob`].

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::ValueEnum;
use padfree_data::{DataCache, FieldNames, Overlong};
use padfree_pack::{Balance, BinPacking};

use super::data::DataArgs;
use super::lengths::{LengthSource, read_lengths_file};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AlgorithmArg {
    Ffd,
    Bfd,
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BalanceArg {
    Tokens,
    Attention,
    Both,
}

#[derive(Debug, clap::Args)]
pub struct PackArgs {
    /// A text file of example lengths in tokens, one per line ('#' starts a
    /// comment). Without it (or --data), a synthetic dataset is generated.
    #[arg(long)]
    pub lengths: Option<PathBuf>,
    /// A data file (JSONL or a JSON array) to plan: its records read and
    /// tokenized as `padfree train` reads them (the same flags), through the
    /// same tokenized-data cache.
    #[arg(long, conflicts_with = "lengths")]
    pub data: Option<PathBuf>,
    /// The tokenizer of --data: tokenizer.json (with tokenizer_config.json
    /// beside it) or a .gguf file (default: the shipped one).
    #[arg(long, requires = "data")]
    pub tokenizer: Option<PathBuf>,
    /// How --data's records are read and tokenized, and where the result is cached.
    #[command(flatten)]
    pub records: DataArgs,
    /// Examples in the synthetic dataset.
    #[arg(long, default_value_t = 4000)]
    pub num_examples: usize,
    /// Median length of a synthetic example, in tokens.
    #[arg(long, default_value_t = 256)]
    pub median_length: usize,
    /// Longest example allowed, in tokens (the synthetic dataset is clamped to it).
    #[arg(long, default_value_t = 2048)]
    pub max_seq_len: usize,
    /// Examples per batch for the padded-vs-flattened comparison.
    #[arg(long, default_value_t = 8)]
    pub per_device_train_batch_size: usize,
    /// Token capacity of one packed micro-batch (bin).
    #[arg(long, default_value_t = 8192)]
    pub capacity: usize,
    /// Data-parallel ranks to distribute bins over.
    #[arg(long, default_value_t = 8)]
    pub world_size: usize,
    /// Bin-packing algorithm: first-fit or best-fit decreasing.
    #[arg(long, value_enum, default_value_t = AlgorithmArg::Both)]
    pub algorithm: AlgorithmArg,
    /// What every rank gets an equal share of.
    #[arg(long, value_enum, default_value_t = BalanceArg::Both)]
    pub balance: BalanceArg,
    /// Seed of the synthetic data and of the packing's shuffles.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// A data file to plan, read as `padfree train` reads it.
#[derive(Debug, Clone)]
pub struct PackData {
    pub path: PathBuf,
    /// `None`: the shipped tokenizer.
    pub tokenizer: Option<PathBuf>,
    pub fields: FieldNames,
    pub train_on_inputs: bool,
    pub use_chat_template: bool,
    pub overlong: Overlong,
    pub cache: Option<DataCache>,
}

/// A validated `padfree pack` invocation.
#[derive(Debug, Clone)]
pub struct PackJob {
    /// The examples' lengths; with `data`, measured when the data is
    /// tokenized (empty until then).
    pub lengths: Vec<usize>,
    pub data: Option<PackData>,
    pub max_seq_len: usize,
    pub source: LengthSource,
    pub per_device_train_batch_size: usize,
    pub capacity: usize,
    pub world_size: usize,
    pub algorithms: Vec<BinPacking>,
    pub balances: Vec<Balance>,
    pub seed: u64,
}

impl PackArgs {
    pub fn validate(self) -> anyhow::Result<PackJob> {
        if self.per_device_train_batch_size == 0 {
            bail!("--per-device-train-batch-size is 0\nHINT: give at least 1 example per batch");
        }
        if self.max_seq_len == 0 {
            bail!("--max-seq-len is 0\nHINT: give the longest example length in tokens, e.g. 2048");
        }
        if self.capacity < self.max_seq_len {
            bail!(
                "--capacity {} is smaller than --max-seq-len {}\nHINT: a bin must hold the longest example; raise --capacity",
                self.capacity,
                self.max_seq_len
            );
        }
        if self.world_size == 0 {
            bail!("--world-size is 0\nHINT: use 1 for a single process");
        }
        self.records.check_template()?;
        let data = self.data.as_ref().map(|path| PackData {
            path: path.clone(),
            tokenizer: self.tokenizer.clone(),
            fields: self.records.fields(),
            train_on_inputs: self.records.train_on_inputs,
            use_chat_template: self.records.use_chat_template,
            overlong: self.records.overlong(),
            cache: self.records.cache(),
        });
        let (lengths, source) = match (&self.lengths, &data) {
            (_, Some(data)) => (Vec::new(), LengthSource::Data(data.path.clone())),
            (Some(path), None) => {
                let lengths = read_lengths_file(path, self.max_seq_len)
                    .with_context(|| format!("reading --lengths {}", path.display()))?;
                (lengths, LengthSource::File(path.clone()))
            }
            (None, None) => {
                if self.num_examples == 0 || self.median_length == 0 {
                    bail!("--num-examples and --median-length must be positive");
                }
                let lengths = padfree_pack::synthetic_lengths(
                    self.num_examples,
                    self.median_length,
                    self.max_seq_len,
                    self.seed,
                );
                (
                    lengths,
                    LengthSource::Synthetic {
                        median: self.median_length,
                    },
                )
            }
        };
        Ok(PackJob {
            lengths,
            data,
            max_seq_len: self.max_seq_len,
            source,
            per_device_train_batch_size: self.per_device_train_batch_size,
            capacity: self.capacity,
            world_size: self.world_size,
            algorithms: match self.algorithm {
                AlgorithmArg::Ffd => vec![BinPacking::FirstFitDecreasing],
                AlgorithmArg::Bfd => vec![BinPacking::BestFitDecreasing],
                AlgorithmArg::Both => vec![
                    BinPacking::FirstFitDecreasing,
                    BinPacking::BestFitDecreasing,
                ],
            },
            balances: match self.balance {
                BalanceArg::Tokens => vec![Balance::Tokens],
                BalanceArg::Attention => vec![Balance::Attention],
                BalanceArg::Both => vec![Balance::Tokens, Balance::Attention],
            },
            seed: self.seed,
        })
    }
}
