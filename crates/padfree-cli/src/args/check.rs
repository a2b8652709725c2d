//! `padfree check` flags: `padfree train`'s own (so the check sees the very
//! batches a run would train on), plus how many batches to check.

use clap::ValueEnum;
use padfree_model::check::Fault;

use super::train::{TrainArgs, TrainJob};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FaultArg {
    /// Concatenate each batch's examples into one sequence (no boundaries,
    /// positions running on): what a collator that loses the metadata does.
    NaivePacking,
}

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Check the run's first N micro-batches.
    #[arg(long, default_value_t = 2)]
    pub batches: usize,
    /// Break the padding-free path on purpose, to see the check fail.
    #[arg(long, value_enum)]
    pub inject_fault: Option<FaultArg>,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// A validated `padfree check` invocation.
#[derive(Debug, Clone)]
pub struct CheckJob {
    pub batches: usize,
    pub fault: Fault,
    /// Model, tokenizer, data and batching, as `padfree train` reads them.
    pub train: TrainJob,
}

impl CheckArgs {
    pub fn validate(self) -> anyhow::Result<CheckJob> {
        if self.batches == 0 {
            anyhow::bail!("--batches must be at least 1");
        }
        Ok(CheckJob {
            batches: self.batches,
            fault: match self.inject_fault {
                None => Fault::None,
                Some(FaultArg::NaivePacking) => Fault::NaivePacking,
            },
            train: self.train.validate()?,
        })
    }
}
