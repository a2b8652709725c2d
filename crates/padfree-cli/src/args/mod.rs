//! Every command's flags, one file each, in one convention: clap parses
//! `XArgs` (plain values), and `XArgs::validate` turns them into an `XJob`
//! that the command in `crate::commands` runs on (ripgrep's `lowargs` ->
//! `hiargs`). Nothing past `validate` sees a raw flag.

mod bench;
mod check;
mod data;
mod lengths;
mod lora;
mod pack;
mod train;

use clap::{Parser, Subcommand};

pub use bench::{BenchArgs, BenchJob, BenchMode, Peer};
pub use check::{CheckArgs, CheckJob};
pub use lora::LoraArgs;
pub use pack::{PackArgs, PackData, PackJob};
pub use train::{ModelSource, TrainArgs, TrainJob, is_gguf};

#[derive(Debug, Parser)]
#[command(
    name = "padfree",
    version,
    about = "Padding-free fine-tuning of decoder language models"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the padding-free collator and multipack packing on a dataset's
    /// example lengths (an embedded synthetic dataset unless --lengths or
    /// --data is given).
    Pack(Box<PackArgs>),
    /// Fine-tune a model (padding-free by default). With no arguments: a
    /// short demo run of the `small` preset on the shipped maths dataset.
    // Negative numbers reach validation (`--warmup-ratio -0.5` is refused
    // there by name) instead of being taken for flags.
    #[command(allow_negative_numbers = true)]
    Train(Box<TrainArgs>),
    /// Train the same model on the same data in each attention mode (padded,
    /// padding-free with per-layer metadata, padding-free with the collator's)
    /// and report the table: runtime, real/fed tokens/s, memory, loss.
    Bench(Box<BenchArgs>),
    /// Prove on your own model and data that padding-free computes what
    /// padded and one-example-at-a-time batches compute: logits, loss and
    /// every gradient of the run's first batches, and a perturbation that
    /// must move no other example. Takes `padfree train`'s flags.
    #[command(allow_negative_numbers = true)]
    Check(Box<CheckArgs>),
    /// padfree's own: tokenizes a data file on every core for a run that
    /// started it, the job on standard input (see commands/data/helper.rs).
    #[command(name = "tokenize-helper", hide = true)]
    TokenizeHelper,
}
