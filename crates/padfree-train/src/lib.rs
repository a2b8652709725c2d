//! # padfree-train
//!
//! Fine-tunes a [`padfree_model::LlamaModel`] on [`padfree_pack::Example`]s.
//!
//! - [`TrainConfig`]: HF `TrainingArguments` names and defaults, validated once.
//! - [`TrainPlan`]: every optimizer step's micro-batches, fixed by the seed
//!   before training starts, so a resumed run sees exactly the same data.
//! - [`Trainer`]: forward/backward per micro-batch with the loss summed and
//!   divided by the label tokens of the whole accumulation window, global-norm
//!   clipping, [`AdamW`], the [`LrSchedule`], logging, checkpoints.
//! - [`checkpoint`]: HF-loadable model files plus optimizer and trainer state,
//!   written to a temporary directory and renamed into place.

pub mod checkpoint;
mod config;
mod error;
mod metrics;
mod optim;
mod plan;
mod schedule;
mod trainer;

pub use config::{AttentionMode, Batching, SaveStrategy, SchedulerKind, TrainConfig, Warmup};
pub use error::TrainError;
pub use metrics::{LogRecord, StepMetrics, TrainSummary, peak_memory_bytes};
pub use optim::AdamW;
pub use plan::{PlannedStep, TrainPlan};
pub use schedule::LrSchedule;
pub use trainer::{Observer, Trainer};
