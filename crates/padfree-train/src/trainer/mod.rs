//! The trainer: a run's parts, and the loop that drives them.
//!
//! [`Trainer`] holds one part per concern, each owning its state, and
//! lends each what it needs from the others; no part imports the trainer
//! or another part's owner:
//!
//! - `step.rs`: [`Engine`] (the model, AdamW, and on a GPU its live copy):
//!   one optimizer step over this rank's micro-batches, the exchange,
//!   clipping and the update. The only place that knows accumulation,
//!   ranks, ZeRO-1 and the GPU optimizer.
//! - `course.rs`: [`Course`] (the examples, the plan of steps over them,
//!   the learning-rate schedule, earlier layouts of a re-planned run).
//! - `progress.rs`: [`Progress`] (steps taken, losses, log history, token
//!   counts) and the log line of an interval.
//! - `evaluation.rs`: [`Evaluation`] (the held-out set, when to evaluate,
//!   the best model and where it is, loading it back at the end).
//! - `saving.rs`: [`Saver`] (the output directory, artifacts, run id, the
//!   last checkpoint): when to save, writing, rotation, the final model.
//! - `resume.rs`: what a resumed run tells the user; `preflight.rs`: what
//!   is refused before a run starts; `identity.rs`: fingerprints and run
//!   ids; `observer.rs`: the hooks of what the user sees.
//!
//! State flows one way: [`Trainer::state`] assembles a [`TrainerState`]
//! from the parts; `checkpoint.rs` takes it (in a `Snapshot`) and writes
//! it; a resume reads it back and hands each part its own fields.

mod course;
mod evaluation;
mod identity;
mod memory_trace;
mod observer;
mod preflight;
mod progress;
mod resume;
mod saving;
mod step;

use std::path::{Path, PathBuf};
use std::time::Instant;

use padfree_model::LlamaModel;
use padfree_model::device::device_memory_reserved;
use padfree_pack::ExampleSet;

use self::course::Course;
use self::evaluation::Evaluation;
pub use self::observer::Observer;
use self::progress::{Interval, Progress};
use self::saving::Saver;
use self::step::{Engine, StepJob};
use crate::checkpoint;
use crate::comm::{Communicator, SingleProcess};
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::eval::{EvalResult, EvalSet};
use crate::metrics::{LogRecord, RunPart, StepMetrics, TrainSummary, peak_memory_bytes};
use crate::optim::AdamW;
use crate::outputs;
use crate::plan::{EarlierLayout, TrainPlan};
use crate::schedule::LrSchedule;
use crate::state::{Continuation, STATE_FORMAT, TrainerState};

/// A model being fine-tuned on a fixed plan of batches.
#[derive(Debug)]
pub struct Trainer {
    config: TrainConfig,
    comm: Box<dyn Communicator>,
    engine: Engine,
    course: Course,
    progress: Progress,
    evaluation: Evaluation,
    saver: Saver,
    /// Told to the observer when training starts.
    notes: Vec<String>,
}

impl Trainer {
    /// Recompute each decoder layer in the backward pass instead of keeping
    /// its activations (`LlamaModel::loss_backward_checkpointed`): activation
    /// memory no longer grows with depth, for about a third more compute.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.engine.gradient_checkpointing = on;
    }

    /// On a GPU: the most device memory the runtime held after any step of
    /// this process, bytes; `None` on the CPU.
    pub fn device_memory_peak(&self) -> Option<u64> {
        self.progress.device_memory_peak
    }

    /// Whether [`Self::set_gradient_checkpointing`] is on.
    pub fn gradient_checkpointing(&self) -> bool {
        self.engine.gradient_checkpointing
    }

    /// A fresh run in one process. `model` must live on an autodiff device;
    /// `artifacts` (e.g. tokenizer files) are written beside every saved model.
    pub fn new(
        model: LlamaModel,
        examples: impl Into<ExampleSet>,
        config: TrainConfig,
        output_dir: &Path,
        artifacts: Vec<(String, Vec<u8>)>,
    ) -> Result<Self, TrainError> {
        Self::new_on(
            Box::new(SingleProcess),
            model,
            examples,
            config,
            output_dir,
            artifacts,
        )
    }

    /// A fresh run as one rank of a data-parallel job: every rank holds the
    /// same model, examples and config (`config.world_size` ranks) and trains
    /// on its own micro-batches of the shared plan; rank 0 alone writes.
    pub fn new_on(
        comm: Box<dyn Communicator>,
        model: LlamaModel,
        examples: impl Into<ExampleSet>,
        config: TrainConfig,
        output_dir: &Path,
        artifacts: Vec<(String, Vec<u8>)>,
    ) -> Result<Self, TrainError> {
        let examples = examples.into();
        let data_fingerprint = identity::fingerprint(&examples)?;
        preflight::check_run(comm.as_ref(), &model, data_fingerprint, &config)?;
        let course = Course::new(examples, data_fingerprint, &config)?;
        let engine = Engine::new(model, &config, comm.as_ref())?;
        Ok(Self {
            saver: Saver::new(output_dir, artifacts, identity::new_run_id()),
            config,
            comm,
            engine,
            course,
            progress: Progress::default(),
            evaluation: Evaluation::default(),
            notes: Vec::new(),
        })
    }

    /// Continues the run saved in `checkpoint` (from `checkpoint::verify`);
    /// `model` must be its weights (`LlamaModel::from_hf_dir(checkpoint.dir(), ..)`).
    /// The data and every setting that shapes the run must be the saved ones.
    pub fn resume(
        model: LlamaModel,
        checkpoint: &checkpoint::Verified,
        examples: impl Into<ExampleSet>,
        config: TrainConfig,
        output_dir: &Path,
        artifacts: Vec<(String, Vec<u8>)>,
    ) -> Result<Self, TrainError> {
        Self::resume_on(
            Box::new(SingleProcess),
            model,
            checkpoint,
            examples,
            config,
            output_dir,
            artifacts,
        )
    }

    /// [`Self::resume`] as one rank of a data-parallel job (the same world
    /// size as the saved run).
    pub fn resume_on(
        comm: Box<dyn Communicator>,
        model: LlamaModel,
        checkpoint: &checkpoint::Verified,
        examples: impl Into<ExampleSet>,
        config: TrainConfig,
        output_dir: &Path,
        artifacts: Vec<(String, Vec<u8>)>,
    ) -> Result<Self, TrainError> {
        let checkpoint_dir = checkpoint.dir();
        let mut trainer = Self::new_on(comm, model, examples, config, output_dir, artifacts)?;
        let saved = checkpoint::read_state(checkpoint_dir)?;
        // The steps the saved run took were planned for its own layouts.
        if !saved.earlier_layouts.is_empty() {
            let earlier = saved.earlier_layouts.clone();
            trainer.course.replan(&trainer.config, earlier)?;
        }
        let continuation = saved.check_continues(
            &trainer.state(),
            &checkpoint_dir.join(checkpoint::STATE_FILE),
        )?;
        if let Continuation::Replanned { at_step, .. } = continuation {
            let mut earlier = saved.earlier_layouts.clone();
            earlier.push(EarlierLayout {
                world_size: saved.config.world_size,
                gradient_accumulation_steps: saved.config.gradient_accumulation_steps,
                until_step: at_step,
            });
            trainer.course.replan(&trainer.config, earlier)?;
        }
        checkpoint::read_optimizer(checkpoint_dir, &saved, &mut trainer.engine.optimizer)?;
        // The run directory the checkpoint sits in now, wherever it was
        // when it was written (moved and copied runs resume too).
        let run_dir = checkpoint_dir.parent().unwrap_or(Path::new(""));
        trainer.apply_state(saved, run_dir);
        if let Some(note) =
            resume::continuation_note(&continuation, &trainer.config, &trainer.course.plan)
        {
            trainer.notes.push(note);
        }
        trainer.saver.last_checkpoint = Some(checkpoint_dir.to_owned());
        Ok(trainer)
    }

    /// Evaluates on `eval` as its strategy says (HF `eval_strategy`), and
    /// the final model after the last step: the result joins the log line
    /// of that step, `metrics.jsonl`, the summary and the loss plot. A
    /// resumed run refuses a held-out set other than the one its history
    /// was evaluated on.
    pub fn with_eval(mut self, eval: EvalSet) -> Result<Self, TrainError> {
        self.evaluation.set(eval, self.config.save_strategy)?;
        Ok(self)
    }

    /// The eval loss of the model as it stands now, `None` without an eval set
    /// (a forward pass off the autodiff graph: nothing kept for a backward).
    pub fn evaluate(&self) -> Result<Option<EvalResult>, TrainError> {
        self.evaluation.evaluate(
            &self.engine.model,
            self.config.attention,
            self.comm.as_ref(),
        )
    }

    /// The model: the last step's weights, or after `train` with
    /// `load_best_model_at_end` the best model's (on the writing rank).
    pub fn model(&self) -> &LlamaModel {
        &self.engine.model
    }

    /// The batches of every step.
    pub fn plan(&self) -> &TrainPlan {
        &self.course.plan
    }

    /// The learning-rate schedule.
    pub fn schedule(&self) -> &LrSchedule {
        &self.course.schedule
    }

    /// The optimizer, with its moments (on a GPU, as of the last
    /// checkpoint: the live values and moments stay on the device).
    pub fn optimizer(&self) -> &AdamW {
        &self.engine.optimizer
    }

    /// Steps taken (0 before training).
    pub fn global_step(&self) -> usize {
        self.progress.global_step
    }

    /// Every loss logged so far.
    pub fn log_history(&self) -> &[LogRecord] {
        &self.progress.log_history
    }

    /// The loss of every step taken so far, in order.
    pub fn step_losses(&self) -> &[f64] {
        &self.progress.step_losses
    }

    /// This process's rank and the job's ranks.
    pub fn communicator(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// Whether this process writes the run's files (rank 0).
    pub fn writes_outputs(&self) -> bool {
        self.comm.rank() == 0
    }

    /// The checkpoint written last, if any.
    pub fn last_checkpoint(&self) -> Option<&Path> {
        self.saver.last_checkpoint.as_deref()
    }

    /// Runs the remaining steps, logging, checkpointing, and writing the
    /// final model and reports into the output directory.
    pub fn train(&mut self, observer: &mut dyn Observer) -> Result<TrainSummary, TrainError> {
        for note in self.notes_before_training() {
            observer.on_note(&note);
        }
        if self.writes_outputs() {
            outputs::rewrite_metrics(&self.saver.output_dir, &self.progress.log_history)?;
        }
        let started = Instant::now();
        let first_step = self.progress.global_step;
        let total_steps = self.course.plan.len();
        let (mut samples, mut real, mut fed) = (0usize, 0usize, 0usize);
        let mut interval = Interval::default();
        let mut interrupted = false;
        while self.progress.global_step < total_steps {
            if self.stop_requested(observer)? {
                interrupted = true;
                break;
            }
            let metrics = self.train_step()?;
            samples += metrics.examples;
            real += metrics.real_tokens;
            fed += metrics.fed_tokens;
            interval.add(&metrics);
            observer.on_step(&metrics, total_steps);
            let last = self.progress.global_step == total_steps;
            let eval = if self
                .evaluation
                .evaluates_after(metrics.step, &self.course.plan)
            {
                self.evaluate()?
            } else {
                None
            };
            // An evaluation gets its log line even off the logging steps.
            if self
                .progress
                .global_step
                .is_multiple_of(self.config.logging_steps)
                || last
                || eval.is_some()
            {
                let mut record = self.progress.record(&interval, &metrics);
                if let Some(eval) = eval {
                    record.eval_loss = Some(eval.loss);
                    record.eval_perplexity = Some(eval.perplexity());
                    record.eval_runtime = Some(eval.seconds);
                }
                if self.writes_outputs() {
                    outputs::append_metrics(&self.saver.output_dir, &record)?;
                }
                observer.on_log(&record);
                self.progress.log_history.push(record);
                interval = Interval::default();
            }
            if Saver::saves_after(metrics.step, &self.course.plan, &self.config) {
                // It considers this step's model for the best, if evaluated.
                self.checkpoint_now(observer)?;
            } else if let (true, Some(eval)) = (last, eval) {
                // The last step's model is the final model, unsaved.
                let step = self.progress.global_step;
                self.evaluation
                    .consider(step, eval.loss, false, &self.saver.output_dir);
            }
        }
        // Unless the step it stopped after was just saved.
        let saved_now =
            checkpoint::checkpoint_dir(&self.saver.output_dir, self.progress.global_step);
        if interrupted
            && self.progress.global_step > first_step
            && self.saver.last_checkpoint.as_deref() != Some(saved_now.as_path())
        {
            self.checkpoint_now(observer)?;
        }
        // Before the final model is written, which is then the best one;
        // a failure to load it is reported after the last step's model has
        // been written in its place, so no training is lost.
        let best_loaded = if interrupted {
            Ok(false)
        } else {
            self.load_best_model()
        };
        let best_model_loaded = matches!(best_loaded, Ok(true));
        // The final model's evaluation: the best one's when it was loaded,
        // else the last evaluation (of an earlier step after a resume
        // without --eval-data, said so by `eval_step`).
        let evaluated = match (&self.evaluation.best_model, best_model_loaded) {
            (Some(best), true) => Some((best.step, best.eval_loss)),
            _ => self.progress.last_evaluation(),
        };
        let runtime = started.elapsed().as_secs_f64().max(1e-9);
        let progress = &self.progress;
        let steps = progress.global_step - first_step;
        let mean = |losses: &[f64]| losses.iter().sum::<f64>() / losses.len().max(1) as f64;
        let summary = TrainSummary {
            train_runtime: runtime,
            train_samples_per_second: samples as f64 / runtime,
            train_steps_per_second: steps as f64 / runtime,
            train_tokens_per_second: real as f64 / runtime,
            real_tokens: progress.real_tokens_seen,
            padded_tokens: progress.padded_tokens_seen,
            train_loss: mean(&progress.step_losses),
            final_loss: progress.step_losses.last().copied().unwrap_or(f64::NAN),
            steps,
            global_step: progress.global_step,
            resumed: (first_step > 0).then(|| RunPart {
                from_step: first_step,
                steps,
                real_tokens: real,
                padded_tokens: fed - real,
                train_loss: mean(&progress.step_losses[first_step..]),
            }),
            peak_memory_bytes: peak_memory_bytes(),
            peak_device_memory_bytes: self.progress.device_memory_peak,
            interrupted,
            eval_loss: evaluated.map(|(_, loss)| loss),
            eval_perplexity: evaluated.map(|(_, loss)| loss.exp()),
            eval_step: evaluated.map(|(step, _)| step),
            best_model: self.evaluation.best_model.clone(),
            best_model_checkpoint: self.evaluation.best_model_dir.clone(),
            best_model_loaded,
        };
        if !interrupted && self.writes_outputs() {
            observer.on_writing(true);
            let written = self
                .saver
                .write_final(&self.engine.model, &self.state(), &summary);
            observer.on_writing(false);
            written?;
        }
        best_loaded?;
        self.comm.barrier().map_err(TrainError::from)?;
        Ok(summary)
    }

    /// One optimizer step (the next of the plan), counted in the run's
    /// progress.
    pub fn train_step(&mut self) -> Result<StepMetrics, TrainError> {
        let steps_taken = self.progress.global_step;
        let metrics = self.engine.step(StepJob {
            planned: self.course.step(steps_taken + 1),
            examples: &self.course.examples,
            config: &self.config,
            comm: self.comm.as_ref(),
            steps_taken,
            learning_rate: self.course.schedule.lr(steps_taken),
            last_checkpoint: self.saver.last_checkpoint.as_deref(),
        })?;
        self.progress.took(&metrics);
        self.progress
            .held_on_device(device_memory_reserved(self.engine.model.device()));
        Ok(metrics)
    }

    /// Whether to stop now: asked of the observer, and with several ranks
    /// agreed by all of them (Ctrl-C may reach them at different steps), so
    /// they stop after the same step.
    fn stop_requested(&self, observer: &dyn Observer) -> Result<bool, TrainError> {
        let mut stop = [f64::from(u8::from(observer.stop_requested()))];
        if self.comm.world_size() > 1 {
            self.comm.all_reduce_sum_f64(&mut stop)?;
        }
        Ok(stop[0] > 0.0)
    }

    /// The checkpoints the rest of the run will write.
    pub fn checkpoints_ahead(&self) -> usize {
        Saver::checkpoints_ahead(self.progress.global_step, &self.course.plan, &self.config)
    }

    /// About how many bytes the rest of the run writes: every checkpoint
    /// ahead (weights and AdamW's two moments, f32, plus the tokenizer
    /// files) and the final model.
    pub fn bytes_to_write(&self) -> u64 {
        // What a checkpoint holds: the trained values (all weights, or the
        // adapters) and their two moments.
        let params: u64 = self
            .engine
            .model
            .trainable()
            .iter()
            .map(|p| p.numel() as u64)
            .sum();
        self.saver
            .bytes_to_write(params, self.checkpoints_ahead(), &self.config)
    }

    /// What the user should know before the steps start; drops a resumed
    /// best model this run does not track. Called once, by `train`.
    fn notes_before_training(&mut self) -> Vec<String> {
        let mut notes = std::mem::take(&mut self.notes);
        notes.extend(self.evaluation.notes_before_training(
            self.progress.global_step,
            self.course.plan.len(),
            self.progress.was_evaluated(),
        ));
        if self.writes_outputs() {
            let resumed = self.progress.global_step > 0;
            notes.extend(self.saver.notes_before_training(resumed, &self.config));
        }
        notes
    }

    /// With `load_best_model_at_end`, replaces the last step's weights by
    /// the best checkpoint's (verified first) on the rank that writes the
    /// final model. Returns whether it did.
    fn load_best_model(&mut self) -> Result<bool, TrainError> {
        let best = self.evaluation.load_best(
            &self.engine.model,
            self.progress.global_step,
            self.writes_outputs(),
            &self.saver.output_dir,
        )?;
        Ok(match best {
            Some(model) => {
                self.engine.model = model;
                true
            }
            None => false,
        })
    }

    /// Writes a checkpoint, tells the observer, then removes what
    /// `save_total_limit` no longer keeps.
    fn checkpoint_now(&mut self, observer: &mut dyn Observer) -> Result<(), TrainError> {
        observer.on_writing(true);
        let result = self.save_and_rotate(observer);
        observer.on_writing(false);
        result
    }

    fn save_and_rotate(&mut self, observer: &mut dyn Observer) -> Result<(), TrainError> {
        let saved = self.save_checkpoint()?;
        observer.on_save(&saved);
        let (Some(limit), true) = (self.config.save_total_limit, self.writes_outputs()) else {
            return Ok(());
        };
        let best = self.evaluation.best_model_dir.as_deref();
        for dir in self.saver.rotate(limit, &saved, best)? {
            observer.on_remove(&dir);
        }
        Ok(())
    }

    /// Writes `checkpoint-{global_step}` now (rank 0; the other ranks wait
    /// for it, so every rank can resume from it once this returns).
    pub fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        // Before the state is taken, so the checkpoint knows it is the best.
        if let Some(eval_loss) = self.progress.eval_loss_now() {
            let step = self.progress.global_step;
            self.evaluation
                .consider(step, eval_loss, true, &self.saver.output_dir);
        }
        // The copy of gathered shards lives until the files are written.
        let gathered = self.engine.optimizer_to_save(self.comm.as_ref())?;
        let dir = if self.writes_outputs() {
            let optimizer = gathered.as_ref().unwrap_or(&self.engine.optimizer);
            self.saver
                .write(&self.state(), &self.engine.model, optimizer)?
        } else {
            checkpoint::checkpoint_dir(&self.saver.output_dir, self.progress.global_step)
        };
        self.comm.barrier()?;
        self.saver.last_checkpoint = Some(dir.clone());
        Ok(dir)
    }

    /// Everything that says where the run stands, as data: what a checkpoint
    /// saves beside the weights and the optimizer's moments, assembled from
    /// the parts.
    pub fn state(&self) -> TrainerState {
        let (progress, course) = (&self.progress, &self.course);
        TrainerState {
            format: STATE_FORMAT.to_owned(),
            global_step: progress.global_step,
            epoch: course.epoch_after(progress.global_step),
            total_steps: course.plan.len(),
            optimizer_steps: self.engine.optimizer.steps_taken(),
            config: self.config.clone(),
            num_examples: course.examples.len(),
            data_fingerprint: format!("{:016x}", course.data_fingerprint),
            real_tokens_seen: progress.real_tokens_seen,
            step_losses: progress.step_losses.clone(),
            log_history: progress.log_history.clone(),
            best_model: self.evaluation.best_model.clone(),
            run_id: self.saver.run_id.clone(),
            padded_tokens_seen: progress.padded_tokens_seen,
            eval_data: self.evaluation.eval_data.clone(),
            earlier_layouts: course.earlier_layouts.clone(),
        }
    }

    /// Continues from a saved state (already checked with
    /// [`TrainerState::check_continues`] against this trainer's own) found
    /// in the run directory `run_dir`: each part takes its own fields back.
    fn apply_state(&mut self, state: TrainerState, run_dir: &Path) {
        self.progress = Progress {
            global_step: state.global_step,
            log_history: state.log_history,
            step_losses: state.step_losses,
            real_tokens_seen: state.real_tokens_seen,
            padded_tokens_seen: state.padded_tokens_seen,
            // Device memory is this process's, not the run's.
            device_memory_peak: None,
        };
        self.evaluation.restore(
            state.best_model,
            state.eval_data,
            run_dir,
            &self.saver.output_dir,
        );
        self.saver.run_id = state.run_id;
    }
}
