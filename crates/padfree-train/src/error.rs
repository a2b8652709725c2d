use std::path::PathBuf;

use padfree_model::ModelError;
use padfree_pack::PackError;
use thiserror::Error;

/// Everything training can refuse or stop on.
#[derive(Debug, Error)]
pub enum TrainError {
    /// A training setting that cannot work.
    #[error("--{flag}: {message}\nHINT: {hint}")]
    Config {
        /// The flag (HF TrainingArguments name, dashes).
        flag: &'static str,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: &'static str,
    },
    /// The model refused a batch or a file.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The collator refused a batch.
    #[error(transparent)]
    Pack(#[from] PackError),
    /// A data-parallel collective failed (another rank stopped).
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
    /// A file could not be read or written. (The reason is in the message,
    /// not chained as a source: `anyhow`'s `{:#}` would print it twice.)
    #[error("{path}: {err}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        err: std::io::Error,
    },
    /// A path given by a flag (the output directory) that cannot be used.
    #[error("--{flag} {path}: {message}\nHINT: {hint}")]
    Path {
        /// The flag.
        flag: &'static str,
        /// The path as given.
        path: PathBuf,
        /// What is wrong, with the operating system's reason.
        message: String,
        /// What to do.
        hint: String,
    },
    /// An example longer than the micro-batch limit it must fit in.
    #[error(
        "--{flag}: example {index} has {len} tokens, more than the {what} of {limit}\nHINT: raise --{flag} to at least {len} (the longest example is {longest} tokens), or cut or drop longer examples with --max-seq-len {limit} (--overlong truncate|drop)"
    )]
    ExampleTooLong {
        /// The flag that sets the limit.
        flag: &'static str,
        /// What the limit is called.
        what: &'static str,
        /// The example's index in the data set (file order).
        index: usize,
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
        /// The longest example's length.
        longest: usize,
    },
    /// A checkpoint that cannot be resumed from.
    #[error("{path}: {message}\nHINT: {hint}")]
    Checkpoint {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: String,
    },
    /// `--load-best-model-at-end`: the best checkpoint could not be loaded
    /// back; the output directory holds the last step's model, complete.
    #[error("{path}: {message}\nHINT: {hint}")]
    BestModelNotLoaded {
        /// The best checkpoint.
        path: PathBuf,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: String,
    },
    /// The loss or the gradient became NaN or infinite; the step was not applied.
    #[error(
        "step {step}: the {what} is {value}; training stopped before applying this step\n{last_checkpoint}\nHINT: lower --learning-rate, add --warmup-steps, or check --max-grad-norm"
    )]
    NonFinite {
        /// The optimizer step (1-based).
        step: usize,
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// The value seen.
        value: f64,
        /// Where the last good checkpoint is, or that there is none.
        last_checkpoint: String,
    },
}

impl TrainError {
    pub(crate) fn io(path: impl Into<PathBuf>, err: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            err,
        }
    }
}
