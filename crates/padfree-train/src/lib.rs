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
//! - [`TrainerState`]: where a run stands, as data (`state.rs`); the trainer
//!   exposes it and takes it back, and checks a saved one continues it.
//! - [`checkpoint`]: HF-loadable model files plus optimizer and trainer state,
//!   written to a temporary directory and renamed into place; handed a
//!   [`checkpoint::Snapshot`], it never imports the trainer.
//! - [`comm`]: the [`Communicator`] of data-parallel ranks: one process, or
//!   threads of one ([`LocalGroup`]); each rank trains on its own
//!   micro-batches of the shared plan, gradients are summed in rank order.
//! - [`eval`]: the held-out loss during training ([`EvalSet`]), same
//!   collator and attention as training, no backward pass.
//! - [`outputs`]: the run's own files (`metrics.jsonl`, results, loss plot)
//!   and the output-directory check.
//!
//! - `collate.rs`: a micro-batch flattened or padded, for training and
//!   evaluation alike; `grads.rs`: a step's gradient sums on the host or on
//!   the device (norm, rank exchange); `optim.rs`: AdamW on the host, and its
//!   values and moments on a GPU; `best_model.rs`: the run's best model;
//!   `overlap.rs`: the exchange bucket by bucket under the recomputed
//!   backward pass (`ddp_overlap`); `workers.rs`: where a step's and an
//!   evaluation's passes run (rayon's pool on the CPU, the calling thread
//!   on a GPU).
//!
//! - `trainer/`: the [`Trainer`] as parts that each own their state (the
//!   step's engine, the course of batches, progress, evaluation and the best
//!   model, saving); `docs/architecture.md` maps them and the flow of one step
//!   and one save.
//!
//! Modules depend one way: `trainer` -> `checkpoint`, `outputs` -> `state`
//! -> `metrics` -> `best_model`; `trainer` -> `eval` -> `collate`, `grads`,
//! `optim`, `workers`; `trainer` -> `overlap` -> `collate`, `grads`; nothing imports
//! `trainer`, and inside it no part imports `trainer/mod.rs` (the CI's
//! import-circle check holds both).

mod best_model;
pub mod checkpoint;
pub mod clock;
mod collate;
pub mod comm;
mod config;
mod error;
pub mod eval;
mod grads;
mod metrics;
mod optim;
pub mod outputs;
mod overlap;
mod plan;
mod schedule;
mod state;
mod trainer;
mod workers;

pub use best_model::BestModel;
pub use comm::{CommError, Communicator, LocalGroup, SingleProcess};
pub use config::{
    AttentionMode, BalanceBy, Batching, Exchange, Multipack, Packer, SaveStrategy, SchedulerKind,
    TrainConfig, Warmup,
};
pub use error::TrainError;
pub use eval::{EvalResult, EvalSet, EvalSettings, EvalStrategy};
pub use metrics::{LogRecord, RunPart, StepMetrics, TrainSummary, peak_memory_bytes};
pub use optim::AdamW;
pub use plan::{EarlierLayout, PlannedStep, TrainPlan};
pub use schedule::LrSchedule;
pub use state::{Continuation, DataIdentity, STATE_FORMAT, TrainerState};
pub use trainer::{Observer, Trainer};
