//! The best model of a run (HF `best_model_checkpoint`): which evaluated
//! step, its eval loss, and where its checkpoint is. Its own room, so the
//! trainer's state and the run's summary both name it without importing
//! each other.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The evaluated model with the lowest eval loss that can be loaded back:
/// one written as a checkpoint, or the last step's (the final model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BestModel {
    /// The step it was evaluated after.
    pub step: usize,
    /// Its eval loss.
    pub eval_loss: f64,
    /// The checkpoint holding it, by its name in the run directory
    /// (`checkpoint-N`), so a run directory that is moved or copied still
    /// finds it; by its whole path when it lies in another directory (the
    /// run was resumed from there into a new one); `None` for a last step's
    /// model that was not saved. See [`BestModel::checkpoint_in`].
    pub checkpoint: Option<PathBuf>,
}

impl BestModel {
    /// Whether an evaluation with `eval_loss` replaces `best`: strictly
    /// lower, so the earliest of equal losses stays (as in HF).
    pub fn improves(best: Option<&BestModel>, eval_loss: f64) -> bool {
        eval_loss.is_finite() && best.is_none_or(|best| eval_loss < best.eval_loss)
    }
}

impl BestModel {
    /// Where its checkpoint is, for a state read in run directory
    /// `run_dir`: a name is looked up there; a whole path (a best model
    /// left in another directory by a resume into a new one) is taken as
    /// it is while it holds a checkpoint, else by its name in `run_dir`
    /// (a moved run, or a state of before 2026-12). `is_checkpoint` is
    /// `checkpoint::is_checkpoint`, handed in so that this room imports no
    /// other (the checkpointer's state names the best model).
    pub fn checkpoint_in(
        &self,
        run_dir: &Path,
        is_checkpoint: impl Fn(&Path) -> bool,
    ) -> Option<PathBuf> {
        let path = self.checkpoint.as_deref()?;
        if path.is_absolute() && is_checkpoint(path) {
            return Some(path.to_owned());
        }
        Some(run_dir.join(path.file_name()?))
    }
}
