//! The trainer's state as data: what `trainer_state.json` holds, and the
//! check that a saved state is the same run as the one about to continue it.
//!
//! The trainer exposes this value (`Trainer::state`) and takes one back
//! (`Trainer::apply_state`); the checkpointer writes and reads it. Neither
//! this file nor the checkpointer imports the trainer.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::metrics::LogRecord;

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
}

/// The evaluated model with the lowest eval loss that can be loaded back:
/// one written as a checkpoint, or the last step's (the final model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BestModel {
    /// The step it was evaluated after.
    pub step: usize,
    /// Its eval loss.
    pub eval_loss: f64,
    /// The checkpoint holding it; `None` for the last step's model, which is
    /// the final model itself.
    pub checkpoint: Option<PathBuf>,
}

impl BestModel {
    /// Whether an evaluation with `eval_loss` replaces `best`: strictly
    /// lower, so the earliest of equal losses stays (as in HF).
    pub fn improves(best: Option<&BestModel>, eval_loss: f64) -> bool {
        eval_loss.is_finite() && best.is_none_or(|best| eval_loss < best.eval_loss)
    }
}

impl TrainerState {
    /// Refuses a saved state (`self`, read from `path`) that the run about to
    /// continue it (`now`, a fresh trainer's state) cannot continue
    /// bit-identically: another layout, settings, data or step count.
    pub fn check_continues(&self, now: &TrainerState, path: &Path) -> Result<(), TrainError> {
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
        if let Some(field) = differing_setting(&self.config, &now.config) {
            return Err(refuse(
                format!("the run was saved with a different `{field}` than given now"),
                "resume with the same training flags as the saved run; a bit-exact continuation needs them",
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
        if self.total_steps != now.total_steps || self.global_step > self.total_steps {
            return Err(refuse(
                format!(
                    "{} steps planned now, {} saved",
                    now.total_steps, self.total_steps
                ),
                "resume with the same --max-steps / --num-train-epochs",
            ));
        }
        Ok(())
    }
}

/// The first top-level setting that differs, by its serialised name.
fn differing_setting(saved: &TrainConfig, now: &TrainConfig) -> Option<String> {
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
        .find(|(key, value)| !FREE.contains(&key.as_str()) && now.get(*key) != Some(value))
        .map(|(key, _)| key.clone())
}
