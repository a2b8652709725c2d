//! The run's files: when a checkpoint is due, writing it (handed a
//! [`Snapshot`]), removing what `save_total_limit` no longer keeps, the
//! final model, and what the output directory already holds.

use std::path::{Path, PathBuf};

use padfree_model::LlamaModel;

use crate::checkpoint::{self, Snapshot};
use crate::config::{SaveStrategy, TrainConfig};
use crate::error::TrainError;
use crate::metrics::TrainSummary;
use crate::outputs;
use crate::plan::TrainPlan;
use crate::state::TrainerState;

#[derive(Debug)]
pub(super) struct Saver {
    pub(super) output_dir: PathBuf,
    /// Written beside every saved model (e.g. tokenizer files).
    artifacts: Vec<(String, Vec<u8>)>,
    /// Tells this run's checkpoints and final files from another run's.
    pub(super) run_id: String,
    pub(super) last_checkpoint: Option<PathBuf>,
}

impl Saver {
    pub(super) fn new(
        output_dir: &Path,
        artifacts: Vec<(String, Vec<u8>)>,
        run_id: String,
    ) -> Self {
        Self {
            output_dir: output_dir.to_owned(),
            artifacts,
            run_id,
            last_checkpoint: None,
        }
    }

    /// Whether step `step` (1-based) is followed by a checkpoint, by the
    /// save strategy; the last step is saved too unless the strategy is
    /// `no` (HF's habit: a finished run can be extended from it).
    pub(super) fn saves_after(step: usize, plan: &TrainPlan, config: &TrainConfig) -> bool {
        match config.save_strategy {
            SaveStrategy::No => false,
            _ if step == plan.len() => true,
            SaveStrategy::Steps(every) => step.is_multiple_of(every),
            SaveStrategy::Epoch => plan.steps()[step - 1].ends_epoch(),
        }
    }

    /// The checkpoints a run at `global_step` will still write.
    pub(super) fn checkpoints_ahead(
        global_step: usize,
        plan: &TrainPlan,
        config: &TrainConfig,
    ) -> usize {
        (global_step + 1..=plan.len())
            .filter(|&step| Self::saves_after(step, plan, config))
            .count()
    }

    /// About how many bytes `checkpoints_ahead` checkpoints and the final
    /// model take, for `params` trained values (weights and AdamW's two
    /// moments, f32, plus the artifacts).
    pub(super) fn bytes_to_write(
        &self,
        params: u64,
        checkpoints_ahead: usize,
        config: &TrainConfig,
    ) -> u64 {
        let artifacts: u64 = self.artifacts.iter().map(|(_, b)| b.len() as u64).sum();
        // Headers, configs, states: a megabyte is generous.
        let slack = 1 << 20;
        let model = 4 * params + artifacts + slack;
        let checkpoint = model + 8 * params;
        // With a limit, the kept ones, the best model's and the one being
        // written are on disk at once.
        let at_once = match config.save_total_limit {
            Some(limit) => checkpoints_ahead.min(limit + 2),
            None => checkpoints_ahead,
        };
        at_once as u64 * checkpoint + model
    }

    /// Writes the checkpoint of `state`'s step (the writing rank only).
    pub(super) fn write(
        &self,
        state: &TrainerState,
        model: &LlamaModel,
        optimizer: &crate::optim::AdamW,
    ) -> Result<PathBuf, TrainError> {
        let snapshot = Snapshot {
            state,
            model,
            optimizer,
            artifacts: &self.artifacts,
        };
        checkpoint::write(&self.output_dir, snapshot)
            .map_err(|err| self.save_failed(err, state.global_step))
    }

    /// Removes the checkpoints `save_total_limit` no longer keeps, never
    /// `saved` (just written) nor the best model's `best`; gives the
    /// removed ones.
    pub(super) fn rotate(
        &self,
        limit: usize,
        saved: &Path,
        best: Option<&Path>,
    ) -> Result<Vec<PathBuf>, TrainError> {
        checkpoint::remove_old_checkpoints(&self.output_dir, limit, saved, best, &self.run_id)
            .map_err(|err| TrainError::Checkpoint {
                path: self.output_dir.clone(),
                message: format!(
                    "could not remove an old checkpoint (--save-total-limit {limit}): {err}"
                ),
                hint: format!(
                    "the run is saved in {}: make the old checkpoints removable (or drop --save-total-limit) and resume with --resume-from-checkpoint {}",
                    saved.display(),
                    saved.display()
                ),
            })
    }

    /// The final model and the run's reports.
    pub(super) fn write_final(
        &self,
        model: &LlamaModel,
        state: &TrainerState,
        summary: &TrainSummary,
    ) -> Result<(), TrainError> {
        checkpoint::write_model_files(model, &self.artifacts, &self.output_dir)
            .and_then(|()| outputs::write_final_reports(&self.output_dir, state, summary))
    }

    /// A checkpoint write of step `step` that failed, with what to do
    /// about its cause and where the run can resume.
    fn save_failed(&self, err: TrainError, step: usize) -> TrainError {
        let path = checkpoint::checkpoint_dir(&self.output_dir, step);
        // The weight files are written by the model crate, the rest here:
        // an operating system's refusal reads the same from either.
        let io_kind = match &err {
            TrainError::Io { err, .. } => Some(err.kind()),
            TrainError::Model(padfree_model::ModelError::Io { err, .. }) => Some(err.kind()),
            _ => None,
        };
        let fix = match (&err, io_kind) {
            (_, Some(std::io::ErrorKind::StorageFull)) => "free disk space",
            (
                _,
                Some(std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem),
            ) => "make the output directory writable",
            // The inner error says what is in the way and what to do.
            (TrainError::Checkpoint { .. }, _) => return err,
            _ => "fix what the message names",
        };
        let resume = match &self.last_checkpoint {
            Some(dir) => format!(
                "then resume from the last good checkpoint: --resume-from-checkpoint {}",
                dir.display()
            ),
            None => "then start again; no checkpoint was written in this run".to_owned(),
        };
        TrainError::Checkpoint {
            path,
            message: format!("could not be written: {err}"),
            hint: format!("{fix}, {resume}"),
        }
    }

    /// What the user should know about the output directory before a run
    /// writes into it (`resumed`: it continues a checkpoint).
    pub(super) fn notes_before_training(&self, resumed: bool, config: &TrainConfig) -> Vec<String> {
        let mut notes = Vec::new();
        if !resumed && checkpoint::run_id_of(&self.output_dir).is_some_and(|id| id != self.run_id) {
            notes.push(format!(
                "{} holds another run's final model and reports (model.safetensors, train_results.json, ...): this run replaces them when it finishes; until then they are not this run's",
                self.output_dir.display()
            ));
        }
        if config.save_strategy != SaveStrategy::No {
            let others = checkpoint::other_runs_checkpoints(&self.output_dir, &self.run_id);
            if !others.is_empty() {
                let names: Vec<String> = others
                    .iter()
                    .filter_map(|dir| Some(dir.file_name()?.to_string_lossy().into_owned()))
                    .collect();
                notes.push(format!(
                    "{} in {} belong to another run: left as they are and not counted by --save-total-limit; a checkpoint this run saves at the same step replaces it",
                    names.join(", "),
                    self.output_dir.display()
                ));
            }
        }
        notes
    }
}
