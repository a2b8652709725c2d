//! Checkpoints: `checkpoint-N/` holds `config.json` + `model.safetensors`
//! (HF names, f32, loadable by transformers) or, training LoRA adapters,
//! `adapter_config.json` + `adapter_model.safetensors` (loadable by PEFT
//! onto the base), the tokenizer files,
//! `optimizer.safetensors` (AdamW moments) and `trainer_state.json` (step,
//! settings, data fingerprint, losses). The schedule is a function of the
//! step and the data order a function of the seed, so nothing else is needed
//! to continue bit-identically. A checkpoint is written into a temporary
//! directory and renamed into place: an interrupted save leaves no
//! half-written checkpoint.
//!
//! The last file written is `integrity.json`: the size and SHA-256 of every
//! other file and the step they belong to. Resume verifies it before reading
//! anything, so a flipped byte, a truncated file or a file copied in from
//! another checkpoint is refused by name instead of training on.
//!
//! The checkpointer is handed what it saves (a [`Snapshot`]: the trainer's
//! state, the model, the optimizer) and hands back what it reads; it never
//! imports the trainer (torchtitan's checkpointer works the same way).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use padfree_model::LlamaModel;
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::TrainError;
use crate::optim::AdamW;
use crate::state::TrainerState;

/// The trainer state file.
pub const STATE_FILE: &str = "trainer_state.json";
/// The optimizer state file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The integrity record, written last.
pub const INTEGRITY_FILE: &str = "integrity.json";
/// Tag of the integrity record's layout.
const INTEGRITY_FORMAT: &str = "padfree-checkpoint-integrity/1";
/// Name prefix of a checkpoint being written.
pub(crate) const TEMP_PREFIX: &str = ".tmp-checkpoint-";

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
///
/// On failure (a full disk) the temporary directory is removed, so it does
/// not keep the disk full, and earlier checkpoints are untouched.
pub fn write(output_dir: &Path, snapshot: Snapshot<'_>) -> Result<PathBuf, TrainError> {
    let temp_dir = temp_dir(output_dir, snapshot.state.global_step);
    write_through(output_dir, &temp_dir, snapshot).inspect_err(|_| {
        std::fs::remove_dir_all(&temp_dir).ok();
    })
}

fn temp_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!("{TEMP_PREFIX}{step}-{}", std::process::id()))
}

fn write_through(
    output_dir: &Path,
    temp_dir: &Path,
    snapshot: Snapshot<'_>,
) -> Result<PathBuf, TrainError> {
    let temp_dir = temp_dir.to_owned();
    let name = checkpoint_name(snapshot.state.global_step);
    let final_dir = output_dir.join(&name);
    if temp_dir.exists() {
        std::fs::remove_dir_all(&temp_dir).map_err(|err| TrainError::io(&temp_dir, err))?;
    }
    write_model_files(snapshot.model, snapshot.artifacts, &temp_dir)?;
    write_optimizer(snapshot.optimizer, &temp_dir.join(OPTIMIZER_FILE))?;
    std::fs::write(temp_dir.join(STATE_FILE), to_json(snapshot.state))
        .map_err(|err| TrainError::io(temp_dir.join(STATE_FILE), err))?;
    let record = Integrity::of_dir(&temp_dir, snapshot.state.global_step)?;
    std::fs::write(temp_dir.join(INTEGRITY_FILE), to_json(&record))
        .map_err(|err| TrainError::io(temp_dir.join(INTEGRITY_FILE), err))?;
    if final_dir.is_dir() {
        // A checkpoint of the same step from an earlier, interrupted run.
        std::fs::remove_dir_all(&final_dir).map_err(|err| TrainError::io(&final_dir, err))?;
    } else if final_dir.symlink_metadata().is_ok() {
        return Err(in_the_way(&final_dir));
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
    if model.lora_config().is_some() {
        // The base is frozen and stays where it was loaded from: only the
        // adapters are the run's.
        model.save_adapter(dir)?;
    } else {
        model.save_hf_dir(dir)?;
    }
    for (name, bytes) in artifacts {
        write_atomically(&dir.join(name), bytes)?;
    }
    Ok(())
}

/// AdamW's moments as `exp_avg.<name>` / `exp_avg_sq.<name>`, one tensor
/// in memory at a time, with the optimizer step in the metadata.
fn write_optimizer(optimizer: &AdamW, path: &Path) -> Result<(), TrainError> {
    let tensors: Vec<(String, [usize; 1], &[f32])> = optimizer
        .moments()
        .flat_map(|(name, exp_avg, exp_avg_sq)| {
            [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
                .map(|(kind, values)| (format!("{kind}.{name}"), [values.len()], values))
        })
        .collect();
    let step = optimizer.steps_taken().to_string();
    padfree_model::write_f32_file(
        path,
        tensors.iter().map(|(name, shape, values)| {
            let values: Box<dyn Fn() -> Vec<f32>> = Box::new(move || values.to_vec());
            (name.as_str(), shape.as_slice(), values)
        }),
        Some(("step", &step)),
    )?;
    Ok(())
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
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(at) = values.iter().position(|v| !v.is_finite()) {
            return Err(format!(
                "`{name}` holds {} at element {at}: a moment must be finite",
                values[at]
            ));
        }
        Ok(values)
    };
    let saved_step = SafeTensors::read_metadata(&bytes)
        .ok()
        .and_then(|(_, meta)| meta.metadata().as_ref()?.get("step")?.parse::<u64>().ok());
    if saved_step != Some(state.optimizer_steps) {
        return Err(refuse(
            optimizer_path,
            format!(
                "it belongs to optimizer step {}, the trainer state to step {}",
                saved_step.map_or_else(|| "unknown".to_owned(), |s| s.to_string()),
                state.optimizer_steps
            ),
            "the checkpoint mixes files of different steps; resume from an earlier one",
        ));
    }
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

/// An entry named like a checkpoint that is not a directory.
fn in_the_way(path: &Path) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_owned(),
        message:
            "is a file, not a checkpoint directory: it is in the way of the checkpoint of that step"
                .into(),
        hint: format!(
            "move or rename {} (padfree writes checkpoint-N directories there), then run again",
            path.display()
        ),
    }
}

/// Refuses an output directory holding a `checkpoint-N` entry that is not
/// a directory: found before training, not when that step saves.
pub fn check_nothing_in_the_way(output_dir: &Path) -> Result<(), TrainError> {
    for step in checkpoint_steps(output_dir) {
        let path = checkpoint_dir(output_dir, step);
        if !path.is_dir() {
            return Err(in_the_way(&path));
        }
    }
    Ok(())
}

/// The run a checkpoint belongs to (its trainer state's `run_id`; empty for
/// checkpoints written before runs had one), `None` if unreadable.
pub fn run_id_of(dir: &Path) -> Option<String> {
    #[derive(Deserialize)]
    struct RunOnly {
        #[serde(default)]
        run_id: String,
    }
    let text = std::fs::read_to_string(dir.join(STATE_FILE)).ok()?;
    serde_json::from_str::<RunOnly>(&text)
        .ok()
        .map(|state| state.run_id)
}

/// The checkpoints in `output_dir` that belong to another run than
/// `run_id` (an older run's, left there with `--overwrite-output-dir`).
pub fn other_runs_checkpoints(output_dir: &Path, run_id: &str) -> Vec<PathBuf> {
    checkpoint_steps(output_dir)
        .into_iter()
        .map(|step| checkpoint_dir(output_dir, step))
        .filter(|dir| is_checkpoint(dir) && run_id_of(dir).as_deref() != Some(run_id))
        .collect()
}

/// The name of step `step`'s checkpoint directory: `checkpoint-{step}`.
pub fn checkpoint_name(step: usize) -> String {
    format!("checkpoint-{step}")
}

/// Where the checkpoint of `step` goes: `output_dir/checkpoint-{step}`.
pub fn checkpoint_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(checkpoint_name(step))
}

/// The steps of the `checkpoint-N` entries in `dir`, ascending.
fn checkpoint_steps(dir: &Path) -> Vec<usize> {
    let mut steps: Vec<usize> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name();
                    let step = name.to_str()?.strip_prefix("checkpoint-")?.parse().ok()?;
                    // `checkpoint-+5` parses too, but is not ours.
                    (name.to_str() == Some(checkpoint_name(step).as_str())).then_some(step)
                })
                .collect()
        })
        .unwrap_or_default();
    steps.sort_unstable();
    steps
}

/// Removes the oldest checkpoints of run `run_id` in `output_dir` beyond
/// `limit` (HF `save_total_limit`) and returns them. `saved` (the one just
/// written) and `keep` (the best model's checkpoint) are never removed and
/// count towards the limit, so a limit of 1 can leave two, as in HF. The
/// rest go by step, highest kept first. Only padfree checkpoints of this
/// run are counted: another run's, left in the directory, are neither
/// counted nor removed. Each is renamed to a temporary name before it is
/// deleted, so an interruption leaves no half-deleted checkpoint that looks
/// whole (temporaries are cleared at the next start).
///
/// `saved` matters after a resume from an earlier checkpoint: the
/// directory can hold later ones of the same run (from before the resume),
/// which are higher in step but not newer.
pub fn remove_old_checkpoints(
    output_dir: &Path,
    limit: usize,
    saved: &Path,
    keep: Option<&Path>,
    run_id: &str,
) -> Result<Vec<PathBuf>, TrainError> {
    let keep = keep.and_then(|dir| dir.canonicalize().ok());
    let saved = saved.canonicalize().ok();
    let mut dirs: Vec<(PathBuf, bool)> = checkpoint_steps(output_dir)
        .into_iter()
        .rev()
        .map(|step| checkpoint_dir(output_dir, step))
        .filter(|dir| is_checkpoint(dir) && run_id_of(dir).as_deref() == Some(run_id))
        .map(|dir| {
            let kept = keep.is_some() && dir.canonicalize().ok() == keep;
            (dir, kept)
        })
        .collect();
    // The one just written first: the first the budget keeps.
    if let Some(at) = dirs
        .iter()
        .position(|(dir, _)| saved.is_some() && dir.canonicalize().ok() == saved)
    {
        let just_saved = dirs.remove(at);
        dirs.insert(0, just_saved);
    }
    let protected = dirs.iter().any(|(_, kept)| *kept);
    let mut budget = limit.saturating_sub(usize::from(protected));
    if budget == 0 && dirs.first().is_some_and(|(_, kept)| !kept) {
        budget = 1;
    }
    let mut removed = Vec::new();
    for (dir, kept) in dirs {
        if kept {
            continue;
        }
        if budget > 0 {
            budget -= 1;
            continue;
        }
        let name = dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let doomed = output_dir.join(format!(
            "{TEMP_PREFIX}removed-{name}-{}",
            std::process::id()
        ));
        std::fs::rename(&dir, &doomed).map_err(|err| TrainError::io(&dir, err))?;
        std::fs::remove_dir_all(&doomed).map_err(|err| TrainError::io(&doomed, err))?;
        removed.push(dir);
    }
    Ok(removed)
}

/// Whether `dir` looks like a checkpoint. A finished run's own directory
/// has a trainer state too, but neither of the others.
pub fn is_checkpoint(dir: &Path) -> bool {
    dir.join(STATE_FILE).is_file()
        && (dir.join(OPTIMIZER_FILE).is_file() || dir.join(INTEGRITY_FILE).is_file())
}

/// Refuses a directory that is not a checkpoint, listing the checkpoints
/// inside it when it is a run's own directory.
fn check_is_checkpoint(dir: &Path) -> Result<(), TrainError> {
    if is_checkpoint(dir) {
        return Ok(());
    }
    if !dir.exists() {
        // Said alone: what the directory lacks means nothing before this.
        return Err(TrainError::Checkpoint {
            path: dir.to_owned(),
            message: "the directory does not exist".into(),
            hint: "give a checkpoint-N directory written by padfree train (--resume-from-checkpoint OUTPUT_DIR/checkpoint-N)".into(),
        });
    }
    let steps = checkpoint_steps(dir);
    let hint = match steps.last() {
        Some(&last) => format!(
            "checkpoints here: {}; the latest is --resume-from-checkpoint {}",
            steps
                .iter()
                .map(|s| checkpoint_name(*s))
                .collect::<Vec<_>>()
                .join(", "),
            checkpoint_dir(dir, last).display()
        ),
        None => "give a checkpoint-N directory written by padfree train".to_owned(),
    };
    Err(TrainError::Checkpoint {
        path: dir.to_owned(),
        message: format!(
            "this is not a checkpoint (it lacks {STATE_FILE} beside {OPTIMIZER_FILE} and {INTEGRITY_FILE})"
        ),
        hint,
    })
}

/// What `integrity.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Integrity {
    format: String,
    /// The step every file belongs to.
    step: usize,
    /// Every other file of the checkpoint, by name.
    files: BTreeMap<String, FileRecord>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct FileRecord {
    bytes: u64,
    sha256: String,
}

impl Integrity {
    /// The record of every file in `dir` (but itself).
    fn of_dir(dir: &Path, step: usize) -> Result<Self, TrainError> {
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir).map_err(|err| TrainError::io(dir, err))? {
            let entry = entry.map_err(|err| TrainError::io(dir, err))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != INTEGRITY_FILE && entry.path().is_file() {
                files.insert(name, FileRecord::of(&entry.path())?);
            }
        }
        Ok(Self {
            format: INTEGRITY_FORMAT.to_owned(),
            step,
            files,
        })
    }
}

impl FileRecord {
    fn of(path: &Path) -> Result<Self, TrainError> {
        let mut file = std::fs::File::open(path).map_err(|err| TrainError::io(path, err))?;
        let mut hasher = Sha256::new();
        let mut buffer = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let read = file
                .read(&mut buffer)
                .map_err(|err| TrainError::io(path, err))?;
            if read == 0 {
                break;
            }
            hasher.update(&buffer[..read]);
            bytes += read as u64;
        }
        let sha256 = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(Self { bytes, sha256 })
    }
}

/// A checkpoint whose files matched its integrity record when
/// [`verify`] read them; resume takes one, so a checkpoint is hashed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    dir: PathBuf,
}

impl Verified {
    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Checks that `dir` is a checkpoint, every file of it against its
/// `integrity.json`, and that they belong to the step its trainer state
/// says; names the first file that differs.
pub fn verify(dir: &Path) -> Result<Verified, TrainError> {
    check_is_checkpoint(dir)?;
    let damaged = |path: PathBuf, message: String| {
        TrainError::Checkpoint {
        path,
        message,
        hint: "the checkpoint is damaged or was changed after it was written; resume from an earlier checkpoint".into(),
    }
    };
    let record_path = dir.join(INTEGRITY_FILE);
    let text = match std::fs::read_to_string(&record_path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(damaged(
                record_path,
                "missing: the checkpoint was not finished, or was written by a padfree without integrity records".into(),
            ));
        }
        Err(err) => return Err(TrainError::io(&record_path, err)),
    };
    let record: Integrity = serde_json::from_str(&text)
        .ok()
        .filter(|r: &Integrity| r.format == INTEGRITY_FORMAT)
        .ok_or_else(|| damaged(record_path.clone(), "not a padfree integrity record".into()))?;
    for (name, expected) in &record.files {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(damaged(path, "missing".into()));
        }
        let found = FileRecord::of(&path)?;
        if found.bytes != expected.bytes {
            return Err(damaged(
                path,
                format!("{} bytes, but {} were written", found.bytes, expected.bytes),
            ));
        }
        if found.sha256 != expected.sha256 {
            return Err(damaged(
                path,
                format!(
                    "its contents differ from what was written at step {} (SHA-256 {} vs {})",
                    record.step, found.sha256, expected.sha256
                ),
            ));
        }
    }
    for required in [STATE_FILE, OPTIMIZER_FILE] {
        if !record.files.contains_key(required) {
            return Err(damaged(record_path, format!("it does not list {required}")));
        }
    }
    // The model's weights, or (LoRA) its adapters.
    if !record.files.contains_key("model.safetensors")
        && !record.files.contains_key(padfree_model::ADAPTER_WEIGHTS)
    {
        return Err(damaged(
            record_path,
            format!(
                "it lists neither model.safetensors nor {}",
                padfree_model::ADAPTER_WEIGHTS
            ),
        ));
    }
    let state = read_state(dir)?;
    if state.global_step != record.step {
        return Err(damaged(
            dir.join(STATE_FILE),
            format!(
                "step {}, but the checkpoint was written at step {}",
                state.global_step, record.step
            ),
        ));
    }
    Ok(Verified {
        dir: dir.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dir` with checkpoints (the files `is_checkpoint` looks for) of
    /// `steps`, plus entries that are not padfree checkpoints.
    fn run_dir(steps: &[usize]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for &step in steps {
            let checkpoint = checkpoint_dir(dir.path(), step);
            std::fs::create_dir_all(&checkpoint).expect("mkdir");
            for file in [STATE_FILE, INTEGRITY_FILE] {
                std::fs::write(checkpoint.join(file), b"{}").expect("write");
            }
        }
        for foreign in ["checkpoint-1", "checkpoint-notes", "checkpoint-+9"] {
            std::fs::create_dir_all(dir.path().join(foreign)).expect("mkdir");
        }
        dir
    }

    fn left(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("read")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn the_oldest_go_the_best_and_the_newest_stay() {
        let foreign = ["checkpoint-+9", "checkpoint-1", "checkpoint-notes"];
        // (limit, best, what is left of 2, 4, 6, 8, 10 besides the foreign)
        let cases: [(usize, Option<usize>, &[usize]); 6] = [
            (2, None, &[10, 8]),
            (5, None, &[10, 8, 6, 4, 2]),
            (2, Some(4), &[10, 4]),
            (3, Some(4), &[10, 8, 4]),
            // HF: a limit of 1 keeps the best and the newest.
            (1, Some(4), &[10, 4]),
            (1, Some(10), &[10]),
        ];
        for (limit, best, kept) in cases {
            let dir = run_dir(&[2, 4, 6, 8, 10]);
            let best_dir = best.map(|step| checkpoint_dir(dir.path(), step));
            let newest = checkpoint_dir(dir.path(), 10);
            let removed =
                remove_old_checkpoints(dir.path(), limit, &newest, best_dir.as_deref(), "")
                    .expect("removes");
            let mut expected: Vec<String> = kept.iter().map(|&s| checkpoint_name(s)).collect();
            expected.extend(foreign.map(String::from));
            expected.sort();
            assert_eq!(left(dir.path()), expected, "limit {limit}, best {best:?}");
            assert_eq!(
                removed.len(),
                5 - kept.len(),
                "limit {limit}, best {best:?}"
            );
        }
    }

    #[test]
    fn another_runs_checkpoints_are_neither_counted_nor_removed() {
        // An older run's 4 and 5 beside this run's 1 and 2 (what
        // --overwrite-output-dir leaves): a limit of 1 keeps this run's
        // newest, and the older run's stay.
        let dir = tempfile::tempdir().expect("temp dir");
        for (step, run) in [(1, "new"), (2, "new"), (4, "old"), (5, "old")] {
            let checkpoint = checkpoint_dir(dir.path(), step);
            std::fs::create_dir_all(&checkpoint).expect("mkdir");
            let state = format!("{{\"run_id\": \"{run}\"}}");
            std::fs::write(checkpoint.join(STATE_FILE), state).expect("write");
            std::fs::write(checkpoint.join(INTEGRITY_FILE), b"{}").expect("write");
        }
        let saved = checkpoint_dir(dir.path(), 2);
        let removed = remove_old_checkpoints(dir.path(), 1, &saved, None, "new").expect("removes");
        assert_eq!(removed, vec![checkpoint_dir(dir.path(), 1)]);
        assert_eq!(
            left(dir.path()),
            ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
        );
        assert_eq!(
            other_runs_checkpoints(dir.path(), "new"),
            vec![checkpoint_dir(dir.path(), 4), checkpoint_dir(dir.path(), 5)]
        );
    }

    #[test]
    fn the_checkpoint_just_written_stays_when_later_ones_of_the_run_exist() {
        // Resumed from 4 in a directory that still holds 6, 8 and 10 of the
        // same run: saving 6 again with a limit of 1 keeps that 6.
        let dir = run_dir(&[2, 4, 6, 8, 10]);
        let saved = checkpoint_dir(dir.path(), 6);
        remove_old_checkpoints(dir.path(), 1, &saved, None, "").expect("removes");
        assert_eq!(
            left(dir.path()),
            [
                "checkpoint-+9",
                "checkpoint-1",
                "checkpoint-6",
                "checkpoint-notes"
            ]
        );
    }

    #[test]
    fn a_file_named_like_a_checkpoint_is_refused_before_training() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("checkpoint-1"), b"notes").expect("write");
        let err = check_nothing_in_the_way(dir.path()).expect_err("in the way");
        assert!(
            err.to_string()
                .contains("is a file, not a checkpoint directory"),
            "{err}"
        );
        assert!(err.to_string().contains("HINT: move or rename"), "{err}");
    }
}
