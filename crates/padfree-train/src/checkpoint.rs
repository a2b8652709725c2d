//! Checkpoints and the files of the output directory.
//!
//! `checkpoint-N/` holds `config.json` + `model.safetensors` (HF names, f32,
//! loadable by transformers), the tokenizer files, `optimizer.safetensors`
//! (AdamW moments) and `trainer_state.json` (step, settings, data
//! fingerprint, losses). The schedule is a function of the step and the data
//! order a function of the seed, so nothing else is needed to continue
//! bit-identically. A checkpoint is written into a temporary directory and
//! renamed into place: an interrupted save leaves no half-written checkpoint.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::metrics::{LogRecord, TrainSummary};
use crate::trainer::Trainer;

/// Tag of the `trainer_state.json` layout.
pub const STATE_FORMAT: &str = "padfree-trainer-state/1";
/// The trainer state file.
pub const STATE_FILE: &str = "trainer_state.json";
/// The optimizer state file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// One JSON line per log step.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The loss curve.
pub const LOSS_PLOT_FILE: &str = "loss.png";
/// The end-of-training summary.
pub const RESULTS_FILE: &str = "train_results.json";

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
}

/// Makes sure `dir` can take a new run's output: created if missing; a
/// non-empty directory only with `overwrite` (or when resuming into it).
pub fn prepare_output_dir(dir: &Path, overwrite: bool, resuming: bool) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|err| TrainError::io(dir, err))?;
    let mut entries = std::fs::read_dir(dir).map_err(|err| TrainError::io(dir, err))?;
    if entries.next().is_some() && !overwrite && !resuming {
        return Err(TrainError::Config {
            flag: "output-dir",
            message: format!("{} exists and is not empty", dir.display()),
            hint: "pass --overwrite-output-dir, choose another --output-dir, or --resume-from-checkpoint",
        });
    }
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|err| TrainError::io(&probe, err))?;
    std::fs::remove_file(&probe).map_err(|err| TrainError::io(&probe, err))?;
    remove_stale_temporaries(dir)
}

/// Temporary checkpoint directories of an interrupted earlier run.
fn remove_stale_temporaries(dir: &Path) -> Result<(), TrainError> {
    let entries = std::fs::read_dir(dir).map_err(|err| TrainError::io(dir, err))?;
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(".tmp-checkpoint-")
        {
            std::fs::remove_dir_all(entry.path())
                .map_err(|err| TrainError::io(entry.path(), err))?;
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file renamed into place.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    Ok(padfree_model::write_atomically(path, bytes)?)
}

fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    let mut bytes = serde_json::to_vec_pretty(value).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// Writes the model, artifacts, optimizer and state into `checkpoint-N`.
pub(crate) fn write_checkpoint(trainer: &Trainer) -> Result<PathBuf, TrainError> {
    let name = format!("checkpoint-{}", trainer.global_step);
    let final_dir = trainer.output_dir.join(&name);
    let temp_dir = trainer
        .output_dir
        .join(format!(".tmp-{name}-{}", std::process::id()));
    if temp_dir.exists() {
        std::fs::remove_dir_all(&temp_dir).map_err(|err| TrainError::io(&temp_dir, err))?;
    }
    write_model_files(trainer, &temp_dir)?;
    std::fs::write(temp_dir.join(OPTIMIZER_FILE), optimizer_bytes(trainer)?)
        .map_err(|err| TrainError::io(temp_dir.join(OPTIMIZER_FILE), err))?;
    std::fs::write(temp_dir.join(STATE_FILE), to_json(&trainer.state()))
        .map_err(|err| TrainError::io(temp_dir.join(STATE_FILE), err))?;
    if final_dir.exists() {
        // A checkpoint of the same step from an earlier, interrupted run.
        std::fs::remove_dir_all(&final_dir).map_err(|err| TrainError::io(&final_dir, err))?;
    }
    std::fs::rename(&temp_dir, &final_dir).map_err(|err| TrainError::io(&final_dir, err))?;
    Ok(final_dir)
}

fn write_model_files(trainer: &Trainer, dir: &Path) -> Result<(), TrainError> {
    trainer.model.save_hf_dir(dir)?;
    for (name, bytes) in &trainer.artifacts {
        write_atomically(&dir.join(name), bytes)?;
    }
    Ok(())
}

fn optimizer_bytes(trainer: &Trainer) -> Result<Vec<u8>, TrainError> {
    let buffers: Vec<(String, Vec<u8>, usize)> = trainer
        .optimizer
        .moments()
        .flat_map(|(name, exp_avg, exp_avg_sq)| {
            [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)].map(|(kind, values)| {
                let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                (format!("{kind}.{name}"), bytes, values.len())
            })
        })
        .collect();
    let views = buffers
        .iter()
        .map(|(name, bytes, len)| {
            TensorView::new(Dtype::F32, vec![*len], bytes)
                .map(|view| (name.as_str(), view))
                .map_err(|err| internal(trainer, err))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([(
        "step".to_owned(),
        trainer.optimizer.steps_taken().to_string(),
    )]);
    safetensors::serialize(views, Some(metadata)).map_err(|err| internal(trainer, err))
}

fn internal(trainer: &Trainer, err: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: trainer.output_dir.clone(),
        message: format!("cannot serialise the optimizer state: {err}"),
        hint: "this is a bug in padfree; please report it".into(),
    }
}

/// Loads optimizer moments and trainer state from `dir` into a trainer built
/// with the checkpoint's weights, after checking it is the same run.
pub(crate) fn restore(trainer: &mut Trainer, dir: &Path) -> Result<(), TrainError> {
    let refuse = |path: PathBuf, message: String, hint: &str| TrainError::Checkpoint {
        path,
        message,
        hint: hint.to_owned(),
    };
    let state_path = dir.join(STATE_FILE);
    let text =
        std::fs::read_to_string(&state_path).map_err(|err| TrainError::io(&state_path, err))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|err| {
        refuse(
            state_path.clone(),
            format!("not a padfree trainer state: {err}"),
            "give a checkpoint-N directory written by padfree train",
        )
    })?;
    if state.format != STATE_FORMAT {
        return Err(refuse(
            state_path,
            format!("format `{}`, expected `{STATE_FORMAT}`", state.format),
            "resume with the padfree version that wrote it",
        ));
    }
    if let Some(field) = differing_setting(&state.config, &trainer.config) {
        return Err(refuse(
            state_path,
            format!("the run was saved with a different `{field}` than given now"),
            "resume with the same training flags as the saved run; a bit-exact continuation needs them",
        ));
    }
    let fingerprint = format!("{:016x}", trainer.data_fingerprint);
    if state.data_fingerprint != fingerprint || state.num_examples != trainer.examples.len() {
        return Err(refuse(
            state_path,
            format!(
                "the data differs from the saved run's ({} examples, fingerprint {} now; {} and {} saved)",
                trainer.examples.len(),
                fingerprint,
                state.num_examples,
                state.data_fingerprint
            ),
            "resume with the same --data, tokenizer and --max-seq-len",
        ));
    }
    if state.total_steps != trainer.plan.len() || state.global_step > state.total_steps {
        return Err(refuse(
            state_path,
            format!(
                "{} steps planned now, {} saved",
                trainer.plan.len(),
                state.total_steps
            ),
            "resume with the same --max-steps / --num-train-epochs",
        ));
    }
    let optimizer_path = dir.join(OPTIMIZER_FILE);
    let bytes =
        std::fs::read(&optimizer_path).map_err(|err| TrainError::io(&optimizer_path, err))?;
    let tensors = SafeTensors::deserialize(&bytes).map_err(|err| {
        refuse(
            optimizer_path.clone(),
            format!("not a safetensors file: {err}"),
            "the checkpoint is damaged; resume from an earlier one",
        )
    })?;
    let read = |name: &str, len: usize| -> Result<Vec<f32>, String> {
        let view = tensors
            .tensor(name)
            .map_err(|err| format!("`{name}`: {err}"))?;
        if view.dtype() != Dtype::F32 || view.shape() != [len] {
            return Err(format!(
                "`{name}` is {:?} {:?}, expected F32 [{len}]",
                view.dtype(),
                view.shape()
            ));
        }
        Ok(view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    };
    trainer
        .optimizer
        .restore(state.optimizer_steps, |name, len| {
            Ok((
                read(&format!("exp_avg.{name}"), len)?,
                read(&format!("exp_avg_sq.{name}"), len)?,
            ))
        })
        .map_err(|message| {
            refuse(
                optimizer_path,
                message,
                "the checkpoint does not match this model; resume from a checkpoint of this run",
            )
        })?;
    trainer.global_step = state.global_step;
    trainer.real_tokens_seen = state.real_tokens_seen;
    trainer.step_losses = state.step_losses;
    trainer.log_history = state.log_history;
    trainer.last_checkpoint = Some(dir.to_owned());
    Ok(())
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
    const FREE: [&str; 2] = ["logging_steps", "save_strategy"];
    saved
        .iter()
        .find(|(key, value)| !FREE.contains(&key.as_str()) && now.get(*key) != Some(value))
        .map(|(key, _)| key.clone())
}

/// `metrics.jsonl` as the log history says, so a resumed run's file holds
/// exactly the lines up to its checkpoint.
pub(crate) fn rewrite_metrics(trainer: &Trainer) -> Result<(), TrainError> {
    let mut text = String::new();
    for record in &trainer.log_history {
        text.push_str(&serde_json::to_string(record).unwrap_or_default());
        text.push('\n');
    }
    write_atomically(&trainer.output_dir.join(METRICS_FILE), text.as_bytes())
}

pub(crate) fn append_metrics(trainer: &Trainer, record: &LogRecord) -> Result<(), TrainError> {
    let path = trainer.output_dir.join(METRICS_FILE);
    let mut line = serde_json::to_string(record).unwrap_or_default();
    line.push('\n');
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&path)
        .map_err(|err| TrainError::io(&path, err))?;
    // One write per line: an interruption loses at most the line being written.
    file.write_all(line.as_bytes())
        .map_err(|err| TrainError::io(&path, err))
}

/// The final model, tokenizer files, state, results and loss plot.
pub(crate) fn save_final(trainer: &Trainer, summary: &TrainSummary) -> Result<(), TrainError> {
    let dir = &trainer.output_dir;
    write_model_files(trainer, dir)?;
    write_atomically(&dir.join(STATE_FILE), &to_json(&trainer.state()))?;
    write_atomically(&dir.join(RESULTS_FILE), &to_json(summary))?;
    let png = loss_plot(trainer).map_err(|message| TrainError::Checkpoint {
        path: dir.join(LOSS_PLOT_FILE),
        message,
        hint: "this is a bug in padfree; please report it".into(),
    })?;
    write_atomically(&dir.join(LOSS_PLOT_FILE), &png)
}

fn loss_plot(trainer: &Trainer) -> Result<Vec<u8>, String> {
    let steps = padfree_plot::Series {
        label: "step loss".into(),
        points: trainer
            .step_losses
            .iter()
            .enumerate()
            .map(|(i, &l)| ((i + 1) as f64, l))
            .collect(),
    };
    let logged = padfree_plot::Series {
        label: "logged mean".into(),
        points: trainer
            .log_history
            .iter()
            .map(|r| (r.step as f64, r.loss))
            .collect(),
    };
    let title = format!("training loss ({})", trainer.config.attention.name());
    padfree_plot::line_chart_png(
        &title,
        "optimizer step",
        "loss (nats/token)",
        &[steps, logged],
    )
}
