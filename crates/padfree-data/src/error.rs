use std::path::PathBuf;

use thiserror::Error;

/// Everything reading or tokenizing a dataset can refuse.
#[derive(Debug, Error)]
pub enum DataError {
    /// The file could not be read. (The reason is in the message, not
    /// chained as a source: `anyhow`'s `{:#}` would print it twice.)
    #[error("{path}: {err}\nHINT: {hint}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        err: std::io::Error,
        /// What to do.
        hint: &'static str,
    },
    /// One record is malformed; `location` is `line N` or `element N`.
    #[error("{path}:{location}: {message}\nHINT: {hint}")]
    Record {
        /// The file.
        path: PathBuf,
        /// `line 7` (JSONL, 1-based) or `element 3` (JSON array, 0-based).
        location: String,
        /// What is wrong, naming the field.
        message: String,
        /// What to do.
        hint: String,
    },
    /// The file as a whole is unusable (empty, not JSON at all).
    #[error("{path}: {message}\nHINT: {hint}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: String,
    },
    /// A tokenizer or its configuration is unusable.
    #[error("{source_name}: {message}\nHINT: {hint}")]
    Tokenizer {
        /// The tokenizer file (or "built-in").
        source_name: String,
        /// What is wrong.
        message: String,
        /// What to do.
        hint: String,
    },
}
