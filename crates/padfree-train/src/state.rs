//! The trainer's state as data: what `trainer_state.json` holds, and the
//! check that a saved state is the same run as the one about to continue it.
//!
//! The trainer exposes this value (`Trainer::state`) and takes one back
//! (`Trainer::apply_state`); the checkpointer writes and reads it. Neither
//! this file nor the checkpointer imports the trainer.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::best_model::BestModel;
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::metrics::LogRecord;
use crate::plan::EarlierLayout;

/// Tag of the `trainer_state.json` layout.
pub const STATE_FORMAT: &str = "padfree-trainer-state/1";

/// What `trainer_state.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// [`STATE_FORMAT`].
    pub format: String,
    /// Steps taken.
    pub global_step: usize,
    /// Fractional epoch reached.
    pub epoch: f64,
    /// Steps of the whole run.
    pub total_steps: usize,
    /// AdamW's step count (bias correction).
    pub optimizer_steps: u64,
    /// The settings of the run.
    pub config: TrainConfig,
    /// Examples trained on.
    pub num_examples: usize,
    /// FNV-1a of the examples' ids and labels.
    pub data_fingerprint: String,
    /// Real tokens trained on so far.
    pub real_tokens_seen: usize,
    /// Loss of every step.
    pub step_losses: Vec<f64>,
    /// Every logged line.
    pub log_history: Vec<LogRecord>,
    /// With `--load-best-model-at-end`: the lowest eval loss among the
    /// models that can be loaded back (HF's `best_metric`,
    /// `best_global_step`, `best_model_checkpoint`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_model: Option<BestModel>,
    /// Names the run across resumes: made at a fresh start, kept by every
    /// resume. `--save-total-limit` counts and removes only checkpoints of
    /// this run, never another run's left in the same directory.
    #[serde(default)]
    pub run_id: String,
    /// Pad tokens the model ran on so far (0 padding-free), for the
    /// whole-run figures of `train_results.json`.
    #[serde(default)]
    pub padded_tokens_seen: usize,
    /// The held-out set the eval losses of `log_history` were taken on: a
    /// resume refuses another one, so no two sets are compared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_data: Option<DataIdentity>,
    /// The layouts of ranks the run trained on before it was resumed on
    /// another `W x A`, oldest first (empty: one layout throughout): the
    /// plan of the steps taken depends on them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub earlier_layouts: Vec<EarlierLayout>,
}

/// Which examples a data set holds, as a resume compares them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataIdentity {
    /// Examples.
    pub examples: usize,
    /// FNV-1a of their ids and labels (hex).
    pub fingerprint: String,
}

/// How a resumed run goes on from its saved state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Continuation {
    /// Another number of micro-batches per step (`W x A`): the steps
    /// taken stay as they were; the rest of the epoch under way (the
    /// examples not yet trained on) and every later epoch are planned for
    /// the new layout, and the learning-rate schedule is recomputed over
    /// the new total. Not bit-identical to any uninterrupted run.
    Replanned {
        /// The saved layout, for the log.
        saved: String,
        /// The steps it took.
        at_step: usize,
    },
    /// The same run, bit-identically.
    Exact,
    /// A finished run trained further: more steps than its `saved` ones,
    /// the learning-rate schedule recomputed over the new total (HF's
    /// habit; not bit-identical to any single run).
    Extends {
        /// The saved run's total steps.
        saved: usize,
    },
    /// The same global batches on another layout of ranks: another world
    /// size with the same `W x A` micro-batches per step, or another
    /// exchange or ZeRO stage. The steps train on the same examples and the
    /// moments are re-cut; the gradient sums add the ranks' parts in
    /// another order, so the run matches the saved layout's to f32
    /// rounding, not bit for bit.
    Relaid {
        /// The saved layout, for the log (`2 ranks x 2 micro-batches, ring`).
        saved: String,
    },
}

/// `W x A`, the exchange (overlapped or not) and the ZeRO stage of a
/// config, for the log.
pub(crate) fn layout(config: &TrainConfig) -> String {
    format!(
        "{} ranks x {} micro-batches, {} exchange{}, ZeRO stage {}",
        config.world_size,
        config.gradient_accumulation_steps,
        config.ddp_exchange.name(),
        if config.ddp_overlap {
            " overlapped with the backward pass"
        } else {
            ""
        },
        config.zero_stage
    )
}

impl TrainerState {
    /// Refuses a saved state (`self`, read from `path`) that the run about to
    /// continue it (`now`, a fresh trainer's state with the saved
    /// `earlier_layouts`) cannot continue: other settings, data or step
    /// count. Two exceptions: a finished run may be extended with a larger
    /// `--max-steps` / `--num-train-epochs` (the steps it took are the first
    /// steps of the longer plan, which depends only on the seed and data),
    /// and another `W x A` re-plans the rest of the run
    /// ([`Continuation::Replanned`]).
    pub fn check_continues(
        &self,
        now: &TrainerState,
        path: &Path,
    ) -> Result<Continuation, TrainError> {
        let refuse = |message: String, hint: &str| TrainError::Checkpoint {
            path: path.to_owned(),
            message,
            hint: hint.to_owned(),
        };
        if self.format != STATE_FORMAT {
            return Err(refuse(
                format!("format `{}`, expected `{STATE_FORMAT}`", self.format),
                "resume with the padfree version that wrote it",
            ));
        }
        // The plan depends on the ranks only through `W x A` (every step
        // holds the same micro-batches for the same product), so another
        // world size with the same product resumes the same steps; another
        // product re-plans the rest of the run (`TrainPlan::with_history`).
        let replanned = self.config.global_micro_batches() != now.config.global_micro_batches();
        let extends = !replanned
            && self.global_step == self.total_steps
            && now.total_steps > self.total_steps;
        let mut free: Vec<&str> = vec![
            "world_size",
            "gradient_accumulation_steps",
            "ddp_exchange",
            "zero_stage",
            "ddp_overlap",
        ];
        if extends {
            free.extend(["max_steps", "num_train_epochs"]);
        }
        if let Some(field) = differing_setting(&self.config, &now.config, &free) {
            return Err(refuse(
                format!("the run was saved with a different `{field}` than given now"),
                if matches!(field.as_str(), "max_steps" | "num_train_epochs") {
                    "resume with the same --max-steps / --num-train-epochs; only a finished run (resumed from its last checkpoint) can be extended with more steps"
                } else {
                    "resume with the same training flags as the saved run; a bit-exact continuation needs them"
                },
            ));
        }
        if self.data_fingerprint != now.data_fingerprint || self.num_examples != now.num_examples {
            return Err(refuse(
                format!(
                    "the data differs from the saved run's ({} examples, fingerprint {} now; {} and {} saved)",
                    now.num_examples,
                    now.data_fingerprint,
                    self.num_examples,
                    self.data_fingerprint
                ),
                "resume with the same --data, tokenizer and --max-seq-len",
            ));
        }
        if replanned {
            return Ok(Continuation::Replanned {
                saved: layout(&self.config),
                at_step: self.global_step,
            });
        }
        if extends {
            return Ok(Continuation::Extends {
                saved: self.total_steps,
            });
        }
        if self.total_steps != now.total_steps || self.global_step > self.total_steps {
            return Err(refuse(
                format!(
                    "{} steps planned now, {} saved (at step {})",
                    now.total_steps, self.total_steps, self.global_step
                ),
                "resume with the same --max-steps / --num-train-epochs; only a finished run can be extended with more steps",
            ));
        }
        if layout(&self.config) != layout(&now.config) {
            return Ok(Continuation::Relaid {
                saved: layout(&self.config),
            });
        }
        Ok(Continuation::Exact)
    }
}

/// The first top-level setting that differs, by its serialised name,
/// besides the cadence settings and `free`.
fn differing_setting(saved: &TrainConfig, now: &TrainConfig, free: &[&str]) -> Option<String> {
    let (serde_json::Value::Object(saved), serde_json::Value::Object(now)) = (
        serde_json::to_value(saved).ok()?,
        serde_json::to_value(now).ok()?,
    ) else {
        return None;
    };
    // Logging and saving cadence do not change the numbers.
    const FREE: [&str; 3] = ["logging_steps", "save_strategy", "save_total_limit"];
    saved
        .iter()
        .find(|(key, value)| {
            !FREE.contains(&key.as_str())
                && !free.contains(&key.as_str())
                && now.get(*key) != Some(value)
        })
        .map(|(key, _)| key.clone())
}
