use thiserror::Error;

/// Why a single example is not a valid training example.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ExampleError {
    /// No tokens at all.
    #[error(
        "input_ids is empty\nHINT: drop empty examples before batching; an empty example has nothing to learn"
    )]
    Empty,
    /// `labels` is not aligned with `input_ids`.
    #[error(
        "input_ids has {input_ids} tokens but labels has {labels}\nHINT: labels must be aligned one-to-one with input_ids; use -100 where no loss is wanted"
    )]
    LengthMismatch {
        /// Length of `input_ids`.
        input_ids: usize,
        /// Length of `labels`.
        labels: usize,
    },
    /// A negative label other than the ignore index.
    #[error(
        "labels[{position}] is {label}, a negative value other than -100\nHINT: a label is a token id (>= 0) or -100 to ignore that token"
    )]
    InvalidLabel {
        /// Index of the offending label inside the example.
        position: usize,
        /// Its value.
        label: i64,
    },
}

/// Every way batching, packing or metadata derivation can refuse its input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PackError {
    /// An example of the input failed validation.
    #[error("example {index}: {cause}")]
    InvalidExample {
        /// Index of the example in the input.
        index: usize,
        /// What is wrong with it (in the message, not chained, so `{:#}`
        /// prints it once).
        cause: ExampleError,
    },
    /// A stored example whose tokens could not be read.
    #[error(
        "example {index} could not be read: {message}\nHINT: the tokenized-data cache entry it is read from changed or is damaged; run again to rebuild it, or pass --no-data-cache"
    )]
    Unreadable {
        /// Index of the example.
        index: usize,
        /// Why.
        message: String,
    },
    /// A batch with no examples.
    #[error(
        "the batch has no examples\nHINT: a batch needs at least one example; check the batch size and that the dataset is not empty"
    )]
    EmptyBatch,
    /// A packing or batching request with no examples at all.
    #[error(
        "there are no examples to pack\nHINT: check that the dataset is not empty and that no filter (such as --max-seq-len with dropping) removed every example"
    )]
    NoExamples,
    /// A length of 0 given to a packing function.
    #[error("example {index} has length 0\nHINT: drop empty examples before packing")]
    ZeroLength {
        /// Index of the example.
        index: usize,
    },
    /// An example that cannot fit the limit it is packed or batched under.
    #[error(
        "example {index} has {len} tokens, more than the {limit_name} of {limit}\nHINT: raise the {limit_name}, or truncate or drop examples longer than it (--max-seq-len)"
    )]
    ExampleTooLong {
        /// Index of the example.
        index: usize,
        /// Its length in tokens.
        len: usize,
        /// The limit it exceeds.
        limit: usize,
        /// What the limit is called (bin capacity, token budget, ...).
        limit_name: &'static str,
    },
    /// A bin capacity or token budget of zero.
    #[error("the {what} is 0 tokens\nHINT: give a {what} of at least the longest example's length")]
    ZeroCapacity {
        /// Which limit was zero.
        what: &'static str,
    },
    /// A world size of zero.
    #[error(
        "world_size is 0\nHINT: world_size is the number of data-parallel ranks; use 1 for a single process"
    )]
    ZeroWorldSize,
    /// `pad_to_multiple_of` of zero.
    #[error(
        "pad_to_multiple_of is 0\nHINT: leave it unset for no rounding, or give a positive multiple such as 8"
    )]
    ZeroPadMultiple,
    /// A batch too large for 32-bit boundary offsets (what varlen kernels take).
    #[error(
        "the batch holds {total} tokens, more than the {max} that 32-bit cu_seqlens can address\nHINT: use smaller batches"
    )]
    TooManyTokens {
        /// Tokens in the batch (saturating).
        total: usize,
        /// The largest supported total.
        max: usize,
    },
    /// `position_ids` that do not describe a sequence of examples.
    #[error(
        "position_ids[{index}] is {found}, expected {expected}\nHINT: position_ids of a flattened batch start at 0 and count up by one inside every example"
    )]
    InvalidPositionIds {
        /// Token index of the first inconsistent position.
        index: usize,
        /// What was found there.
        found: u32,
        /// What was expected (0 or the previous position plus one).
        expected: String,
    },
}
