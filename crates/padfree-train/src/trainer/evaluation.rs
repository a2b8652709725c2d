//! The held-out set and the best model: when to evaluate, which model is
//! the best and where its checkpoint is, and loading it back at the end
//! (`load_best_model_at_end`).

use std::path::{Path, PathBuf};

use padfree_model::LlamaModel;

use super::identity::{same_dir, set_fingerprint};
use crate::AttentionMode;
use crate::best_model::BestModel;
use crate::checkpoint;
use crate::comm::Communicator;
use crate::config::SaveStrategy;
use crate::error::TrainError;
use crate::eval::{EvalResult, EvalSet, EvalSettings, EvalStrategy, evaluate};
use crate::outputs;
use crate::plan::TrainPlan;
use crate::state::DataIdentity;

#[derive(Debug, Default)]
pub(super) struct Evaluation {
    eval: Option<EvalSet>,
    /// The held-out set of the eval losses in the history (kept across
    /// resumes, also by a resumed run that does not evaluate).
    pub(super) eval_data: Option<DataIdentity>,
    pub(super) best_model: Option<BestModel>,
    /// Where the best model's checkpoint is now: in this run's output
    /// directory, or beside the checkpoint a run was resumed from.
    pub(super) best_model_dir: Option<PathBuf>,
}

impl Evaluation {
    /// Evaluates on `eval` from now on; refuses a held-out set other than
    /// the one the (resumed) history was evaluated on.
    pub(super) fn set(
        &mut self,
        eval: EvalSet,
        save_strategy: SaveStrategy,
    ) -> Result<(), TrainError> {
        eval.validate(save_strategy)?;
        let identity = DataIdentity {
            examples: eval.examples.len(),
            fingerprint: format!("{:016x}", set_fingerprint(&eval.examples)),
        };
        if let Some(saved) = self.eval_data.as_ref().filter(|saved| **saved != identity) {
            return Err(TrainError::Config {
                flag: "eval-data",
                message: format!(
                    "the resumed run was evaluated on another held-out set ({} examples, fingerprint {}; this one has {} and {}): eval losses, and the best model, would be compared across the two",
                    saved.examples, saved.fingerprint, identity.examples, identity.fingerprint
                ),
                hint: "resume with the run's own --eval-data (same tokenizer and --max-seq-len), or without --eval-data to go on without evaluation; to evaluate on a new set, start a new run",
            });
        }
        self.eval_data = Some(identity);
        self.eval = Some(eval);
        Ok(())
    }

    /// The eval loss of `model` as it stands, `None` without an eval set.
    pub(super) fn evaluate(
        &self,
        model: &LlamaModel,
        attention: AttentionMode,
        comm: &dyn Communicator,
    ) -> Result<Option<EvalResult>, TrainError> {
        self.eval
            .as_ref()
            .map(|eval| {
                evaluate(
                    model,
                    &eval.examples,
                    eval.settings.batch_size,
                    attention,
                    comm,
                )
            })
            .transpose()
    }

    /// Whether an evaluation follows step `step` (1-based): by the strategy,
    /// and after the last step always (the final model's eval loss; with
    /// `epoch`, HF evaluates a last epoch cut short by `max_steps` too).
    pub(super) fn evaluates_after(&self, step: usize, plan: &TrainPlan) -> bool {
        match self.eval.as_ref().map(|eval| eval.settings.strategy) {
            None => false,
            Some(_) if step == plan.len() => true,
            Some(EvalStrategy::Steps(every)) => step.is_multiple_of(every),
            Some(EvalStrategy::Epoch) => plan.steps()[step - 1].ends_epoch(),
        }
    }

    /// Whether the best model is tracked and loaded at the end.
    fn tracks_best_model(&self) -> bool {
        self.eval
            .as_ref()
            .is_some_and(|e| e.settings.load_best_model_at_end)
    }

    /// Takes the model of step `step`, evaluated to `eval_loss`, as the
    /// best if it is; `saved`: whether it is being saved as a checkpoint
    /// in `output_dir` (else it is the last step's model, the final model).
    pub(super) fn consider(&mut self, step: usize, eval_loss: f64, saved: bool, output_dir: &Path) {
        if self.tracks_best_model() && BestModel::improves(self.best_model.as_ref(), eval_loss) {
            let dir = checkpoint::checkpoint_dir(output_dir, step);
            self.best_model = Some(BestModel {
                step,
                eval_loss,
                checkpoint: saved.then(|| PathBuf::from(checkpoint::checkpoint_name(step))),
            });
            self.best_model_dir = saved.then_some(dir);
        }
    }

    /// With `load_best_model_at_end`, the best checkpoint's model (verified
    /// first) in place of `model`, the last step's (`global_step`); `None`
    /// when that is the best, or on a rank that does not write the final
    /// model (`writes`).
    pub(super) fn load_best(
        &self,
        model: &LlamaModel,
        global_step: usize,
        writes: bool,
        output_dir: &Path,
    ) -> Result<Option<LlamaModel>, TrainError> {
        let (
            Some(BestModel {
                step, eval_loss, ..
            }),
            Some(dir),
        ) = (&self.best_model, &self.best_model_dir)
        else {
            return Ok(None);
        };
        if *step == global_step || !writes {
            return Ok(None);
        }
        let loaded = checkpoint::verify(dir).and_then(|verified| {
            if model.lora_config().is_some() {
                // The base is frozen: only the adapters differ.
                let mut model = model.clone();
                model.load_adapter(verified.dir())?;
                return Ok(model);
            }
            Ok(LlamaModel::from_hf_dir(verified.dir(), model.device())?)
        });
        loaded.map(Some).map_err(|err| TrainError::BestModelNotLoaded {
            path: dir.clone(),
            message: format!(
                "the best model (step {step}, eval_loss {eval_loss:.6}) could not be loaded back, so {} holds the last step's model: {err}",
                output_dir.display()
            ),
            hint: format!(
                "the last step's model is complete; to use the best one, repair {} or pick another checkpoint by its eval_loss in {}",
                dir.display(),
                output_dir.join(outputs::METRICS_FILE).display()
            ),
        })
    }

    /// Takes back a saved run's best model and held-out set; the best
    /// model's checkpoint is looked for in `run_dir`, where the resumed
    /// checkpoint is now.
    pub(super) fn restore(
        &mut self,
        best_model: Option<BestModel>,
        eval_data: Option<DataIdentity>,
        run_dir: &Path,
        output_dir: &Path,
    ) {
        self.best_model_dir = best_model
            .as_ref()
            .and_then(|best| best.checkpoint_in(run_dir, checkpoint::is_checkpoint));
        self.best_model = best_model.map(|mut best| {
            // Resumed into another output directory, the best stays where it
            // is: the state then names it by its whole path.
            if let Some(dir) = &self.best_model_dir
                && !same_dir(run_dir, output_dir)
            {
                best.checkpoint = Some(std::path::absolute(dir).unwrap_or_else(|_| dir.clone()));
            }
            best
        });
        self.eval_data = eval_data;
    }

    /// What the user should know about evaluation before the steps start
    /// (`resumed`: the run continues a checkpoint; `evaluated`: its history
    /// holds eval losses); drops a resumed best model this run does not
    /// track.
    pub(super) fn notes_before_training(
        &mut self,
        global_step: usize,
        plan_len: usize,
        evaluated: bool,
    ) -> Vec<String> {
        let mut notes = Vec::new();
        let remaining = global_step < plan_len;
        if self.eval.is_none() && self.eval_data.is_some() && remaining {
            notes.push(
                "the resumed run evaluated on a held-out set, this one is given none (--eval-data): no more evaluations, and the summary's eval_loss is the last one taken".to_owned(),
            );
        }
        // A fresh run starts at step 0; a resumed one after its checkpoint's.
        let resumed = global_step > 0;
        if resumed && self.tracks_best_model() {
            match (&self.best_model, &self.best_model_dir) {
                (None, _) if evaluated => {
                    notes.push(format!(
                        "the resumed run did not keep a best model: the best is chosen among the models evaluated from step {} on",
                        global_step + 1
                    ));
                }
                (Some(best), Some(dir)) if !checkpoint::is_checkpoint(dir) => notes.push(format!(
                    "the best model so far (step {}, eval_loss {:.4}) was in {}, which is gone: a better model found from now on replaces it, else the run writes the last step's model and exits non-zero",
                    best.step,
                    best.eval_loss,
                    dir.display()
                )),
                _ => {}
            }
        }
        if !self.tracks_best_model()
            && let Some(best) = self.best_model.take()
        {
            self.best_model_dir = None;
            notes.push(format!(
                "the resumed run kept its best model (step {}, eval_loss {:.4}); without --load-best-model-at-end the final model is the last step's",
                best.step, best.eval_loss
            ));
        }
        if let Some(EvalSet {
            settings:
                EvalSettings {
                    strategy: EvalStrategy::Steps(every),
                    ..
                },
            ..
        }) = &self.eval
            && *every > plan_len
        {
            notes.push(format!(
                "--eval-steps {every} is past the run's last step ({plan_len}): the only evaluation is the final model's"
            ));
        }
        notes
    }
}
