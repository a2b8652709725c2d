//! Checkpoints: `checkpoint-N/` holds `config.json` + `model.safetensors`
//! (HF names, f32, loadable by transformers), the tokenizer files,
//! `optimizer.safetensors` (AdamW moments) and `trainer_state.json` (step,
//! settings, data fingerprint, losses). The schedule is a function of the
//! step and the data order a function of the seed, so nothing else is needed
//! to continue bit-identically. A checkpoint is written into a temporary
//! directory and renamed into place: an interrupted save leaves no
//! half-written checkpoint.
//!
//! The checkpointer is handed what it saves (a [`Snapshot`]: the trainer's
//! state, the model, the optimizer) and hands back what it reads; it never
//! imports the trainer (torchtitan's checkpointer works the same way).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use padfree_model::LlamaModel;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde::Serialize;

use crate::error::TrainError;
use crate::optim::AdamW;
use crate::state::TrainerState;

/// The trainer state file.
pub const STATE_FILE: &str = "trainer_state.json";
/// The optimizer state file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Name prefix of a checkpoint being written.
const TEMP_PREFIX: &str = ".tmp-checkpoint-";

/// Everything a checkpoint holds, lent by the trainer.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    /// The trainer's state (step, settings, data fingerprint, history).
    pub state: &'a TrainerState,
    /// The weights.
    pub model: &'a LlamaModel,
    /// The optimizer's moments.
    pub optimizer: &'a AdamW,
    /// Files written beside every saved model (tokenizer), name and bytes.
    pub artifacts: &'a [(String, Vec<u8>)],
}

/// Temporary checkpoint directories of an interrupted earlier run.
pub fn remove_stale_temporaries(dir: &Path) -> Result<(), TrainError> {
    let entries = std::fs::read_dir(dir).map_err(|err| TrainError::io(dir, err))?;
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
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

/// Pretty JSON with a final newline.
pub(crate) fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    let mut bytes = serde_json::to_vec_pretty(value).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// Writes the model, artifacts, optimizer and state into
/// `output_dir/checkpoint-N` (`N`: the state's step) and returns that path.
pub fn write(output_dir: &Path, snapshot: Snapshot<'_>) -> Result<PathBuf, TrainError> {
    let name = checkpoint_name(snapshot.state.global_step);
    let final_dir = output_dir.join(&name);
    let temp_dir = output_dir.join(format!(
        "{TEMP_PREFIX}{}-{}",
        snapshot.state.global_step,
        std::process::id()
    ));
    if temp_dir.exists() {
        std::fs::remove_dir_all(&temp_dir).map_err(|err| TrainError::io(&temp_dir, err))?;
    }
    write_model_files(snapshot.model, snapshot.artifacts, &temp_dir)?;
    std::fs::write(
        temp_dir.join(OPTIMIZER_FILE),
        optimizer_bytes(snapshot.optimizer, output_dir)?,
    )
    .map_err(|err| TrainError::io(temp_dir.join(OPTIMIZER_FILE), err))?;
    std::fs::write(temp_dir.join(STATE_FILE), to_json(snapshot.state))
        .map_err(|err| TrainError::io(temp_dir.join(STATE_FILE), err))?;
    if final_dir.exists() {
        // A checkpoint of the same step from an earlier, interrupted run.
        std::fs::remove_dir_all(&final_dir).map_err(|err| TrainError::io(&final_dir, err))?;
    }
    std::fs::rename(&temp_dir, &final_dir).map_err(|err| TrainError::io(&final_dir, err))?;
    Ok(final_dir)
}

/// The HF model files and the artifacts (tokenizer) into `dir`.
pub fn write_model_files(
    model: &LlamaModel,
    artifacts: &[(String, Vec<u8>)],
    dir: &Path,
) -> Result<(), TrainError> {
    model.save_hf_dir(dir)?;
    for (name, bytes) in artifacts {
        write_atomically(&dir.join(name), bytes)?;
    }
    Ok(())
}

fn optimizer_bytes(optimizer: &AdamW, output_dir: &Path) -> Result<Vec<u8>, TrainError> {
    let buffers: Vec<(String, Vec<u8>, usize)> = optimizer
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
                .map_err(|err| internal(output_dir, err))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("step".to_owned(), optimizer.steps_taken().to_string())]);
    safetensors::serialize(views, Some(metadata)).map_err(|err| internal(output_dir, err))
}

fn internal(output_dir: &Path, err: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: output_dir.to_owned(),
        message: format!("cannot serialise the optimizer state: {err}"),
        hint: "this is a bug in padfree; please report it".into(),
    }
}

/// The trainer state saved in checkpoint `dir`.
pub fn read_state(dir: &Path) -> Result<TrainerState, TrainError> {
    let state_path = dir.join(STATE_FILE);
    let text =
        std::fs::read_to_string(&state_path).map_err(|err| TrainError::io(&state_path, err))?;
    serde_json::from_str(&text).map_err(|err| TrainError::Checkpoint {
        path: state_path.clone(),
        message: format!("not a padfree trainer state: {err}"),
        hint: "give a checkpoint-N directory written by padfree train".to_owned(),
    })
}

/// Loads the moments saved in checkpoint `dir` into `optimizer` (built for
/// the same model), with the step count of `state`.
pub fn read_optimizer(
    dir: &Path,
    state: &TrainerState,
    optimizer: &mut AdamW,
) -> Result<(), TrainError> {
    let refuse = |path: PathBuf, message: String, hint: &str| TrainError::Checkpoint {
        path,
        message,
        hint: hint.to_owned(),
    };
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
    optimizer
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
    Ok(())
}

fn checkpoint_name(step: usize) -> String {
    format!("checkpoint-{step}")
}

/// Where the checkpoint of `step` goes: `output_dir/checkpoint-{step}`.
pub fn checkpoint_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(checkpoint_name(step))
}
