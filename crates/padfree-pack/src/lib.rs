//! # padfree-pack
//!
//! The tensor-free core of padding-free training: everything that happens to a
//! batch before it meets a tensor.
//!
//! * [`Example`]: one tokenized training example, validated on construction;
//!   [`ExampleSet`]: a data set's examples, held or read a step at a time
//!   from a [`TokenSource`] (a tokenized-data cache entry's files).
//! * [`flatten`]: the padding-free collator. It concatenates a batch into one
//!   row with `position_ids` restarting at 0, ignores the first label of every
//!   example, and computes the boundary metadata ([`BatchMeta`]) **once**.
//! * [`pad`]: the padded baseline, `[B, L]` with an attention mask.
//! * [`TokenRows`]: what both layouts hand a model (ids, positions, targets).
//! * [`BatchMeta::derive_from_position_ids`]: what an attention layer does when
//!   it is not handed the metadata; kept so the benchmark can show its cost.
//! * [`pack_into_bins`], [`distribute`], [`plan_epoch`]: multipack-style bin
//!   packing of example lengths and token-balanced assignment of bins to
//!   data-parallel ranks; [`batch_by_token_budget`] for ordered batches bounded
//!   by tokens.
//! * [`oracle`]: slow, obvious reference implementations that the tests hold the
//!   fast paths to; [`check`]: invariant checks shared by tests and the fuzzer.
//!
//! # Example
//! ```
//! use padfree_pack::{Example, flatten, pad};
//!
//! let examples = vec![
//!     Example::causal(vec![10, 11, 12])?,
//!     Example::causal(vec![20, 21, 22, 23, 24, 25])?,
//! ];
//! let batch = flatten(&examples)?; // one row, T = 9 tokens
//! assert_eq!(batch.position_ids(), &[0, 1, 2, 0, 1, 2, 3, 4, 5]);
//! assert_eq!(batch.labels()[3], -100); // first label of example 1
//! assert_eq!(batch.meta().cu_seqlens(), &[0, 3, 9]); // computed once, here
//! let padded = pad(&examples, 0, Some(8))?; // the baseline: [2, 8]
//! assert_eq!(padded.num_pad_tokens(), 7);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Shapes
//! Shapes in doc comments use one letter each: `T` = total tokens of a flattened
//! batch, `B` = examples in the batch, `L` = longest example (padded length),
//! `N` = examples in a dataset, `W` = data-parallel world size.

mod binpack;
mod budget;
pub mod check;
mod distribute;
mod error;
mod example;
mod example_set;
mod flatten;
mod meta;
pub mod oracle;
mod pad;
mod plan;
mod rng;
mod rows;
mod synthetic;

pub use binpack::{Bin, BinPacking, Packing, pack_into_bins};
pub use budget::{BudgetKind, batch_by_token_budget};
pub use distribute::{Balance, Distribution, distribute, distribute_steps};
pub use error::{ExampleError, PackError};
pub use example::{Example, IGNORE_INDEX, examples_from_raw};
pub use example_set::{ExampleSet, Fingerprint, TokenSource};
pub use flatten::{PackedBatch, flatten};
pub use meta::BatchMeta;
pub use pad::{PaddedBatch, pad};
pub use plan::{EpochPlan, PackingConfig, PackingReport, plan_epoch};
pub use rng::SplitMix64;
pub use rows::TokenRows;
pub use synthetic::{synthetic_examples, synthetic_lengths, synthetic_prompted_examples};
