use std::path::PathBuf;

use thiserror::Error;

/// Everything loading, validating or running a model can refuse.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A tensor padfree's fused kernels cannot take (f32 on the Flex CPU
    /// backend or on a CubeCL GPU device).
    #[error(
        "{0}\nHINT: padfree's fused kernels take f32 tensors on the CPU (`tensor::cpu_device`) or on a GPU opened by `device::open_device`"
    )]
    UnsupportedTensor(String),
    /// A precision this model or device cannot compute in (yet).
    #[error("{message}\nHINT: {hint}")]
    Precision {
        /// What is refused.
        message: String,
        /// What to do.
        hint: &'static str,
    },
    /// A file could not be read or written. (The reason is in the message,
    /// not chained as a source: `anyhow`'s `{:#}` would print it twice.)
    #[error("{path}: {err}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        err: std::io::Error,
    },
    /// `config.json` is not valid JSON or lacks a field.
    #[error(
        "{path}: {message}\nHINT: config.json must be a Hugging Face LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM config"
    )]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// What serde said, with line and column.
        message: String,
    },
    /// A configuration value that this model cannot run.
    #[error("config field `{field}`: {message}\nHINT: {hint}")]
    Config {
        /// The field of `config.json` (or preset) at fault.
        field: &'static str,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: &'static str,
    },
    /// A LoRA setting (TRL's flag names) that no adapter of this model can
    /// have.
    #[error("{flag}: {message}\nHINT: {hint}")]
    LoraSetting {
        /// The flag, e.g. `--lora-r`.
        flag: &'static str,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: &'static str,
    },
    /// A weight file whose tensors do not match the config.
    #[error("{path}: tensor `{tensor}`: {message}\nHINT: {hint}")]
    Weights {
        /// The weight file.
        path: PathBuf,
        /// The HF name of the tensor.
        tensor: String,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: &'static str,
    },
    /// A weight file that is not readable as its format.
    #[error("{path}: {message}\nHINT: {hint}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: &'static str,
    },
    /// A token id at or beyond the vocabulary size.
    #[error(
        "token {index} of the batch has id {id}, outside the vocabulary of {vocab_size}\nHINT: the tokenizer does not match the model; use the model's own tokenizer"
    )]
    TokenOutOfVocab {
        /// Token index in the (flattened or padded) batch.
        index: usize,
        /// The id.
        id: u64,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A batch the collator's checks refuse, with the step that met it.
    #[error("{what}: {cause}")]
    Pack {
        /// What was being derived (e.g. `position_ids`, `padded rows`).
        what: &'static str,
        /// The collator's own error, kept typed (in the message, not chained,
        /// so `{:#}` prints it once).
        cause: padfree_pack::PackError,
    },
    /// A sequence longer than a sliding-window model attends over.
    #[error(
        "a sequence of {len} tokens is longer than the model's sliding_window of {window}\nHINT: truncate examples to {window} tokens (--max-seq-len); sliding-window attention is not implemented"
    )]
    SequenceTooLong {
        /// The longest sequence of the batch.
        len: usize,
        /// The model's `sliding_window`.
        window: usize,
    },
    /// A target list whose length is not the batch's row count.
    #[error(
        "{targets} targets for {rows} rows\nHINT: take the targets from the same batch (`next_token_targets`)"
    )]
    TargetCount {
        /// Targets given.
        targets: usize,
        /// Rows of the logits.
        rows: usize,
    },
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, err: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            err,
        }
    }
}

impl From<crate::kernels::UnsupportedTensor> for ModelError {
    fn from(err: crate::kernels::UnsupportedTensor) -> Self {
        Self::UnsupportedTensor(err.0)
    }
}
