//! The run's own files in the output directory, beside the checkpoints:
//! `metrics.jsonl` (one line per log step), `trainer_state.json` and
//! `train_results.json` of the finished run, and the loss plot `loss.png`.
//! Each takes the values it writes; nothing here imports the trainer.

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::checkpoint::{
    STATE_FILE, TEMP_PREFIX, remove_stale_temporaries, to_json, write_atomically,
};
use crate::error::TrainError;
use crate::metrics::{LogRecord, TrainSummary};
use crate::state::TrainerState;

/// One JSON line per log step.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The loss curve.
pub const LOSS_PLOT_FILE: &str = "loss.png";
/// The end-of-training summary.
pub const RESULTS_FILE: &str = "train_results.json";

/// Makes sure `dir` can take a new run's output: created if missing; a
/// non-empty directory only with `overwrite` (or when resuming into it).
/// Call it holding the directory's [`OutputLock`], which it ignores.
pub fn prepare_output_dir(dir: &Path, overwrite: bool, resuming: bool) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|err| unusable(dir, "cannot be created", &err))?;
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|err| unusable(dir, "cannot be read", &err))? {
        let entry = entry.map_err(|err| unusable(dir, "cannot be read", &err))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != LOCK_FILE {
            names.push(name);
        }
    }
    if !names.is_empty() && !overwrite && !resuming {
        names.sort();
        // What a run killed before its first checkpoint leaves: there is
        // nothing to resume, so the generic HINT's resume would not help.
        let leftovers = names.iter().all(|name| {
            name == METRICS_FILE || name == LOSS_PLOT_FILE || name.starts_with(TEMP_PREFIX)
        });
        if leftovers {
            return Err(TrainError::Config {
                flag: "output-dir",
                message: format!(
                    "{} holds only what a run that stopped before its first checkpoint left ({}): there is no checkpoint to resume",
                    dir.display(),
                    names.join(", ")
                ),
                hint: "pass --overwrite-output-dir to start afresh there (a temporary checkpoint is removed), or choose another --output-dir",
            });
        }
        return Err(TrainError::Config {
            flag: "output-dir",
            message: format!("{} exists and is not empty", dir.display()),
            hint: "pass --overwrite-output-dir, choose another --output-dir, or --resume-from-checkpoint",
        });
    }
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|err| unusable(dir, "is not writable", &err))?;
    std::fs::remove_file(&probe).map_err(|err| unusable(dir, "is not writable", &err))?;
    crate::checkpoint::check_nothing_in_the_way(dir)?;
    remove_stale_temporaries(dir)
}

/// The output directory cannot be used: which way, and the OS's reason.
fn unusable(dir: &Path, what: &str, err: &std::io::Error) -> TrainError {
    TrainError::Path {
        flag: "output-dir",
        path: dir.to_owned(),
        message: format!("{what}: {err}"),
        hint: "choose a directory this user can create and write (--output-dir), or fix the permissions of this one".into(),
    }
}

/// The lock file of an output directory.
pub const LOCK_FILE: &str = ".padfree.lock";

/// An output directory held by this run: an exclusive lock on its
/// [`LOCK_FILE`] (released by the operating system when the process ends,
/// however it ends), which names the holder for a run that finds it taken.
#[derive(Debug)]
pub struct OutputLock {
    _file: std::fs::File,
}

/// Creates `dir` if missing and locks it for this run, or says who holds it.
pub fn lock_output_dir(dir: &Path) -> Result<OutputLock, TrainError> {
    std::fs::create_dir_all(dir).map_err(|err| unusable(dir, "cannot be created", &err))?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|err| unusable(dir, "is not writable (its lock file)", &err))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            file.read_to_string(&mut holder).ok();
            return Err(TrainError::Checkpoint {
                path: dir.to_owned(),
                message: format!(
                    "another padfree run is writing here ({})",
                    holder.trim().trim_end_matches('.')
                ),
                hint: "wait for it to finish, stop it, or choose another --output-dir".into(),
            });
        }
        Err(std::fs::TryLockError::Error(err)) => return Err(TrainError::io(&path, err)),
    }
    let holder = format!(
        "process {} on {}, since {}\n",
        std::process::id(),
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map_or_else(|_| "this machine".to_owned(), |h| h.trim().to_owned()),
        crate::clock::utc_timestamp()
    );
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(holder.as_bytes()))
        .map_err(|err| TrainError::io(&path, err))?;
    Ok(OutputLock { _file: file })
}

/// Refuses to start a run whose files (`needed` bytes) would not fit on the
/// disk of `dir`: found at the first checkpoint or, with no checkpoints,
/// only after all the training.
pub fn check_free_space(dir: &Path, needed: u64) -> Result<(), TrainError> {
    // A test hook: a small disk without making one.
    let free = match std::env::var("PADFREE_ASSUME_FREE_BYTES") {
        Ok(bytes) => bytes.parse().ok(),
        Err(_) => nix::sys::statvfs::statvfs(dir)
            .ok()
            .map(|s| s.blocks_available().saturating_mul(s.fragment_size())),
    };
    match free {
        Some(free) if free < needed => Err(TrainError::Checkpoint {
            path: dir.to_owned(),
            message: format!(
                "the run writes about {:.2} GiB (its checkpoints and the final model), but {:.2} GiB are free",
                needed as f64 / 1073741824.0,
                free as f64 / 1073741824.0
            ),
            hint: "free disk space, choose another --output-dir, save less often (--save-steps), or --save-strategy no".into(),
        }),
        _ => Ok(()),
    }
}

/// Refuses an output directory that is, or lies inside, the checkpoint a run
/// resumes from (its files would be overwritten under it), or that is itself
/// a checkpoint.
pub fn check_output_dir_outside(
    output_dir: &Path,
    checkpoint: Option<&Path>,
) -> Result<(), TrainError> {
    let out = resolved(output_dir);
    if let Some(checkpoint) = checkpoint {
        let checkpoint = resolved(checkpoint);
        if out.starts_with(&checkpoint) {
            return Err(TrainError::Checkpoint {
                path: output_dir.to_owned(),
                message: format!(
                    "the output directory is inside the checkpoint it resumes from ({}): the run would overwrite it",
                    checkpoint.display()
                ),
                hint: "give the run's own directory (the checkpoint's parent) or a new one as --output-dir".into(),
            });
        }
    }
    if crate::checkpoint::is_checkpoint(&out) {
        return Err(TrainError::Checkpoint {
            path: output_dir.to_owned(),
            message: "the output directory is a checkpoint".into(),
            hint: "give the run's own directory (the checkpoint's parent) or a new one as --output-dir".into(),
        });
    }
    Ok(())
}

/// `path` made absolute with links resolved as far as it exists.
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return rest.iter().rev().fold(real, |acc, part| acc.join(part));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

/// `metrics.jsonl` as the log history says, so a resumed run's file holds
/// exactly the lines up to its checkpoint.
pub fn rewrite_metrics(dir: &Path, log_history: &[LogRecord]) -> Result<(), TrainError> {
    let mut text = String::new();
    for record in log_history {
        text.push_str(&serde_json::to_string(record).unwrap_or_default());
        text.push('\n');
    }
    write_atomically(&dir.join(METRICS_FILE), text.as_bytes())
}

/// Appends one log line to `metrics.jsonl`.
pub fn append_metrics(dir: &Path, record: &LogRecord) -> Result<(), TrainError> {
    let path = dir.join(METRICS_FILE);
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

/// The finished run's state, results and loss plot (the final model is
/// written beside them by the checkpointer's `write_model_files`).
pub fn write_final_reports(
    dir: &Path,
    state: &TrainerState,
    summary: &TrainSummary,
) -> Result<(), TrainError> {
    write_atomically(&dir.join(STATE_FILE), &to_json(state))?;
    write_atomically(&dir.join(RESULTS_FILE), &to_json(summary))?;
    let png = loss_plot(state).map_err(|message| TrainError::Checkpoint {
        path: dir.join(LOSS_PLOT_FILE),
        message,
        hint: "this is a bug in padfree; please report it".into(),
    })?;
    write_atomically(&dir.join(LOSS_PLOT_FILE), &png)
}

fn loss_plot(state: &TrainerState) -> Result<Vec<u8>, String> {
    let steps = padfree_plot::Series {
        label: "step loss".into(),
        points: state
            .step_losses
            .iter()
            .enumerate()
            .map(|(i, &l)| ((i + 1) as f64, l))
            .collect(),
    };
    let logged = padfree_plot::Series {
        label: "logged mean".into(),
        points: state
            .log_history
            .iter()
            .map(|r| (r.step as f64, r.loss))
            .collect(),
    };
    let eval: Vec<(f64, f64)> = state
        .log_history
        .iter()
        .filter_map(|r| Some((r.step as f64, r.eval_loss?)))
        .collect();
    let mut series = vec![steps, logged];
    let title = if eval.is_empty() {
        format!("training loss ({})", state.config.attention.name())
    } else {
        series.push(padfree_plot::Series {
            label: "eval loss".into(),
            points: eval,
        });
        if let Some(best) = &state.best_model {
            // One point, drawn as a square.
            series.push(padfree_plot::Series {
                label: "best eval = final model".into(),
                points: vec![(best.step as f64, best.eval_loss)],
            });
        }
        format!("training and eval loss ({})", state.config.attention.name())
    };
    padfree_plot::line_chart_png(&title, "optimizer step", "loss (nats/token)", &series)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run killed before its first checkpoint leaves `metrics.jsonl` and a
    /// temporary checkpoint: a fresh start there is refused with a message
    /// that says so and a HINT that does not send the user to resume; with
    /// `--overwrite-output-dir` the temporary goes. Any other content keeps
    /// the generic message.
    #[test]
    fn leftovers_of_a_run_stopped_before_its_first_checkpoint_are_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join(METRICS_FILE), "{}\n").expect("write");
        std::fs::write(dir.path().join(LOCK_FILE), "").expect("write");
        let temporary = dir.path().join(format!("{TEMP_PREFIX}2-21111"));
        std::fs::create_dir(&temporary).expect("mkdir");
        let err = prepare_output_dir(dir.path(), false, false)
            .expect_err("refused")
            .to_string();
        assert!(
            err.contains(&format!(
                "holds only what a run that stopped before its first checkpoint left ({TEMP_PREFIX}2-21111, metrics.jsonl): there is no checkpoint to resume"
            )),
            "{err}"
        );
        assert!(
            err.contains("HINT: pass --overwrite-output-dir to start afresh there"),
            "{err}"
        );
        prepare_output_dir(dir.path(), true, false).expect("overwrite");
        assert!(!temporary.exists(), "the temporary checkpoint is removed");

        std::fs::create_dir(dir.path().join("checkpoint-3")).expect("mkdir");
        let err = prepare_output_dir(dir.path(), false, false)
            .expect_err("refused")
            .to_string();
        assert!(err.contains("exists and is not empty"), "{err}");
        assert!(err.contains("--resume-from-checkpoint"), "{err}");
    }
}
