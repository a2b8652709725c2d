use std::path::{Path, PathBuf};
use std::time::Instant;

use padfree_model::tensor::{
    Gradients, IntoHostVec, Tensor, backward, float_tensor, grad, take_grad, trainable,
};
use padfree_model::{DropoutDraw, LlamaModel};
use padfree_pack::Example;

use crate::AttentionMode;
use crate::best_model::BestModel;
use crate::checkpoint::{self, Snapshot};
use crate::collate::Collated;
use crate::comm::{Communicator, SingleProcess};
use crate::config::{Batching, SaveStrategy, TrainConfig, Warmup};
use crate::error::TrainError;
use crate::eval::{EvalResult, EvalSet, EvalStrategy, evaluate};
use crate::grads::GradSums;
use crate::metrics::{LogRecord, RunPart, StepMetrics, TrainSummary, peak_memory_bytes};
use crate::optim::{AdamW, DeviceAdamW};
use crate::outputs;
use crate::overlap::{Overlapped, all_reduce_by_bucket, forward_backward_overlapped};
use crate::plan::{EarlierLayout, TrainPlan};
use crate::schedule::LrSchedule;
use crate::state::{Continuation, DataIdentity, STATE_FORMAT, TrainerState};

/// Hooks for what the user sees; every method has a do-nothing default.
pub trait Observer {
    /// After every optimizer step.
    fn on_step(&mut self, _metrics: &StepMetrics, _total_steps: usize) {}
    /// At every logging step.
    fn on_log(&mut self, _record: &LogRecord) {}
    /// After a checkpoint was written.
    fn on_save(&mut self, _dir: &Path) {}
    /// After an old checkpoint was removed (`save_total_limit`).
    fn on_remove(&mut self, _dir: &Path) {}
    /// Before (`true`) and after (`false`) the trainer writes a checkpoint
    /// or the final model: a process that must quit should wait for the
    /// `false`, so what was being written is complete.
    fn on_writing(&mut self, _writing: bool) {}
    /// Something the user should know before training starts (a setting
    /// of the resumed run that no longer applies, another run's files).
    fn on_note(&mut self, _note: &str) {}
    /// Polled between steps: true stops training after the current step
    /// (Ctrl-C), with a checkpoint written.
    fn stop_requested(&self) -> bool {
        false
    }
}

impl Observer for () {}

/// A model being fine-tuned on a fixed plan of batches.
#[derive(Debug)]
pub struct Trainer {
    model: LlamaModel,
    /// The master values and moments; on a GPU, as of the last checkpoint
    /// (the live ones are `device_optimizer`'s).
    optimizer: AdamW,
    /// On a GPU: the values and moments the steps update there, made from
    /// `optimizer` at the first step (after a resume has filled it).
    device_optimizer: Option<DeviceAdamW>,
    schedule: LrSchedule,
    plan: TrainPlan,
    /// The layouts the steps before this one's were planned for (a run
    /// resumed on another `W x A`).
    earlier_layouts: Vec<EarlierLayout>,
    config: TrainConfig,
    examples: Vec<Example>,
    data_fingerprint: u64,
    output_dir: PathBuf,
    artifacts: Vec<(String, Vec<u8>)>,
    global_step: usize,
    log_history: Vec<LogRecord>,
    step_losses: Vec<f64>,
    real_tokens_seen: usize,
    padded_tokens_seen: usize,
    last_checkpoint: Option<PathBuf>,
    eval: Option<EvalSet>,
    /// The held-out set of the eval losses in the history (kept across
    /// resumes, also by a resumed run that does not evaluate).
    eval_data: Option<DataIdentity>,
    best_model: Option<BestModel>,
    /// Where the best model's checkpoint is now: in this run's output
    /// directory, or beside the checkpoint a run was resumed from.
    best_model_dir: Option<PathBuf>,
    run_id: String,
    /// Told to the observer when training starts.
    notes: Vec<String>,
    comm: Box<dyn Communicator>,
    /// Per-layer recomputation in the backward pass (`--gradient-checkpointing`).
    /// Not a setting of the run: it changes memory, not the result (beyond
    /// the order of a few f32 sums), so a resume may turn it on or off.
    gradient_checkpointing: bool,
}

impl Trainer {
    /// Recompute each decoder layer in the backward pass instead of keeping
    /// its activations (`LlamaModel::loss_backward_checkpointed`): activation
    /// memory no longer grows with depth, for about a third more compute.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// Whether [`Self::set_gradient_checkpointing`] is on.
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
    }

    /// A fresh run in one process. `model` must live on an autodiff device;
    /// `artifacts` (e.g. tokenizer files) are written beside every saved model.
    pub fn new(
        model: LlamaModel,
        examples: Vec<Example>,
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
        examples: Vec<Example>,
        config: TrainConfig,
        output_dir: &Path,
        artifacts: Vec<(String, Vec<u8>)>,
    ) -> Result<Self, TrainError> {
        if config.world_size != comm.world_size() {
            return Err(TrainError::Config {
                flag: "world-size",
                message: format!(
                    "the config says {} ranks, the launcher started {}",
                    config.world_size,
                    comm.world_size()
                ),
                hint: "set the world size from the communicator (mpirun -np N)",
            });
        }
        if !model.device().is_autodiff() {
            return Err(TrainError::Config {
                flag: "model",
                message: "the model is not on an autodiff device".into(),
                hint: "load it with padfree_model::tensor::cpu_device(true)",
            });
        }
        // One pass over the weights: refuse a non-finite one and, with
        // several ranks, fingerprint them (a rank that read another file,
        // flags or weights would train its share of the plan on something
        // else, silently).
        if model.lora_config() != config.lora.as_ref() {
            let message = match (model.lora_config(), config.lora.as_ref()) {
                (Some(saved), Some(given)) => format!(
                    "other LoRA flags than the model's adapters were given: {}",
                    saved.differing_flags(given).join(", ")
                ),
                (Some(_), None) => {
                    "the model carries LoRA adapters, but --use-peft is not given".to_owned()
                }
                (None, _) => {
                    "--use-peft is given, but the model carries no LoRA adapters".to_owned()
                }
            };
            return Err(TrainError::Config {
                flag: "use-peft",
                message,
                hint: "a LoRA run resumes with its own --use-peft and --lora-* flags, a full fine-tuning run without them",
            });
        }
        if model.is_quantized() && model.lora_config().is_none() {
            return Err(TrainError::Config {
                flag: "use-peft",
                message: "the model's weights are kept in GGUF blocks, which cannot be trained"
                    .into(),
                hint: "train LoRA adapters on it (--use-peft), or load the model dequantised for full fine-tuning",
            });
        }
        let adapters = match model.lora_config() {
            Some(_) => model.trainable(),
            None => Vec::new(),
        };
        let mut weights_hash = Fnv1a::new();
        for param in model.params().into_iter().chain(adapters) {
            let values = param.value.clone().into_vec();
            if comm.world_size() > 1 {
                values
                    .iter()
                    .for_each(|v| weights_hash.eat(u64::from(v.to_bits())));
            }
            if let Some(at) = values.iter().position(|v| !v.is_finite()) {
                return Err(TrainError::Config {
                    flag: "model",
                    message: format!(
                        "weight `{}` holds {} at element {at}: the model cannot be trained",
                        param.name(),
                        values[at]
                    ),
                    hint: "the weights are damaged: load an earlier checkpoint or the original model",
                });
            }
        }
        if comm.world_size() > 1 {
            let mut settings = Fnv1a::new();
            serde_json::to_vec(&config)
                .unwrap_or_default()
                .into_iter()
                .for_each(|b| settings.eat(u64::from(b)));
            crate::comm::check_same_on_every_rank(
                comm.as_ref(),
                &[
                    ("training data", fingerprint(&examples)),
                    ("settings", settings.finish()),
                    ("initial weights", weights_hash.finish()),
                ],
            )?;
        }
        let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
        let plan = TrainPlan::new(&lengths, &config)?;
        let schedule = schedule_for(&config, plan.len());
        let params = model
            .trainable()
            .into_iter()
            .map(|p| (p.name().to_owned(), p.value.clone().into_vec()))
            .collect();
        let mut optimizer = AdamW::new(
            params,
            config.adam_beta1,
            config.adam_beta2,
            config.adam_epsilon,
            config.weight_decay,
        );
        // bf16 copies of the weights from here on, remade after every update.
        let model = model.with_precision(config.precision)?;
        if config.zero_stage == 1 && comm.world_size() > 1 {
            if !model.on_cpu() {
                return Err(TrainError::Config {
                    flag: "zero-stage",
                    message: "the sharded optimizer runs on the CPU only".into(),
                    hint: "use --zero-stage 0 on a GPU",
                });
            }
            optimizer.shard(comm.world_size(), comm.rank());
        }
        Ok(Self {
            data_fingerprint: fingerprint(&examples),
            model,
            optimizer,
            device_optimizer: None,
            schedule,
            plan,
            earlier_layouts: Vec::new(),
            config,
            examples,
            output_dir: output_dir.to_owned(),
            artifacts,
            global_step: 0,
            log_history: Vec::new(),
            step_losses: Vec::new(),
            real_tokens_seen: 0,
            padded_tokens_seen: 0,
            last_checkpoint: None,
            eval: None,
            eval_data: None,
            best_model: None,
            best_model_dir: None,
            run_id: new_run_id(),
            notes: Vec::new(),
            comm,
            gradient_checkpointing: false,
        })
    }

    /// Continues the run saved in `checkpoint` (from `checkpoint::verify`);
    /// `model` must be its weights (`LlamaModel::from_hf_dir(checkpoint.dir(), ..)`).
    /// The data and every setting that shapes the run must be the saved ones.
    pub fn resume(
        model: LlamaModel,
        checkpoint: &checkpoint::Verified,
        examples: Vec<Example>,
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
        examples: Vec<Example>,
        config: TrainConfig,
        output_dir: &Path,
        artifacts: Vec<(String, Vec<u8>)>,
    ) -> Result<Self, TrainError> {
        let checkpoint_dir = checkpoint.dir();
        let mut trainer = Self::new_on(comm, model, examples, config, output_dir, artifacts)?;
        let saved = checkpoint::read_state(checkpoint_dir)?;
        // The steps the saved run took were planned for its own layouts.
        if !saved.earlier_layouts.is_empty() {
            trainer.replan(saved.earlier_layouts.clone())?;
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
            trainer.replan(earlier)?;
        }
        checkpoint::read_optimizer(checkpoint_dir, &saved, &mut trainer.optimizer)?;
        // The run directory the checkpoint sits in now, wherever it was
        // when it was written (moved and copied runs resume too).
        let run_dir = checkpoint_dir.parent().unwrap_or(Path::new(""));
        trainer.apply_state(saved, run_dir);
        match continuation {
            Continuation::Extends { saved } => {
                let total = trainer.plan.len();
                trainer.notes.push(format!(
                    "extending the finished run of {saved} steps to {total}: its steps are the first {saved} of the longer plan, but the learning-rate schedule is recomputed over {total} steps, so this is not one uninterrupted {total}-step run"
                ));
            }
            Continuation::Relaid { saved } => {
                trainer.notes.push(format!(
                    "resuming a run saved as {saved} on {}: every step trains the same examples and the optimizer state is re-cut, but the ranks' gradients are added in another order, so the losses match the saved layout's to f32 rounding, not bit for bit",
                    crate::state::layout(&trainer.config)
                ));
            }
            Continuation::Replanned { saved, at_step } => {
                let step = at_step.checked_sub(1).map(|i| &trainer.plan.steps()[i]);
                let place = match step {
                    Some(step) if !step.ends_epoch() => format!(
                        "the rest of epoch {} (the examples its first {} steps did not train on) and every later epoch are planned",
                        step.epoch + 1,
                        step.index_in_epoch + 1
                    ),
                    _ => "every epoch from here is planned".to_owned(),
                };
                trainer.notes.push(format!(
                    "resuming a run saved as {saved} after step {at_step} on {}: another number of micro-batches per step, so {place} for the new layout; the run now has {} steps and its learning-rate schedule is recomputed over them: not bit-identical to any uninterrupted run",
                    crate::state::layout(&trainer.config),
                    trainer.plan.len()
                ));
            }
            Continuation::Exact => {}
        }
        trainer.last_checkpoint = Some(checkpoint_dir.to_owned());
        Ok(trainer)
    }

    /// Evaluates on `eval` as its strategy says (HF `eval_strategy`), and
    /// the final model after the last step: the result joins the log line
    /// of that step, `metrics.jsonl`, the summary and the loss plot. A
    /// resumed run refuses a held-out set other than the one its history
    /// was evaluated on.
    pub fn with_eval(mut self, eval: EvalSet) -> Result<Self, TrainError> {
        eval.validate(self.config.save_strategy)?;
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
        Ok(self)
    }

    /// The eval loss of the model as it stands now, `None` without an eval set
    /// (a forward pass off the autodiff graph: nothing kept for a backward).
    pub fn evaluate(&self) -> Result<Option<EvalResult>, TrainError> {
        self.eval
            .as_ref()
            .map(|eval| {
                evaluate(
                    &self.model,
                    &eval.examples,
                    eval.settings.batch_size,
                    self.config.attention,
                    self.comm.as_ref(),
                )
            })
            .transpose()
    }

    /// Whether an evaluation follows step `step` (1-based): by the strategy,
    /// and after the last step always (the final model's eval loss; with
    /// `epoch`, HF evaluates a last epoch cut short by `max_steps` too).
    fn evaluates_after(&self, step: usize) -> bool {
        match self.eval.as_ref().map(|eval| eval.settings.strategy) {
            None => false,
            Some(_) if step == self.plan.len() => true,
            Some(EvalStrategy::Steps(every)) => step.is_multiple_of(every),
            Some(EvalStrategy::Epoch) => self.plan.steps()[step - 1].ends_epoch(),
        }
    }

    /// Whether the best model is tracked and loaded at the end.
    fn tracks_best_model(&self) -> bool {
        self.eval
            .as_ref()
            .is_some_and(|e| e.settings.load_best_model_at_end)
    }

    /// Takes the model of this step, evaluated to `eval_loss`, as the best
    /// if it is; `saved`: whether it is being saved as a checkpoint (else
    /// it is the last step's model, the final model).
    fn consider_best_model(&mut self, eval_loss: f64, saved: bool) {
        if self.tracks_best_model() && BestModel::improves(self.best_model.as_ref(), eval_loss) {
            let dir = checkpoint::checkpoint_dir(&self.output_dir, self.global_step);
            self.best_model = Some(BestModel {
                step: self.global_step,
                eval_loss,
                checkpoint: saved
                    .then(|| PathBuf::from(checkpoint::checkpoint_name(self.global_step))),
            });
            self.best_model_dir = saved.then_some(dir);
        }
    }

    /// With `load_best_model_at_end`, replaces the last step's weights by
    /// the best checkpoint's (verified first) on the rank that writes the
    /// final model. Returns whether it did.
    fn load_best_model(&mut self) -> Result<bool, TrainError> {
        let (
            Some(BestModel {
                step, eval_loss, ..
            }),
            Some(dir),
        ) = (self.best_model.clone(), self.best_model_dir.clone())
        else {
            return Ok(false);
        };
        if step == self.global_step || !self.writes_outputs() {
            return Ok(false);
        }
        let loaded = checkpoint::verify(&dir).and_then(|verified| {
            if self.model.lora_config().is_some() {
                // The base is frozen: only the adapters differ.
                let mut model = self.model.clone();
                model.load_adapter(verified.dir())?;
                return Ok(model);
            }
            Ok(LlamaModel::from_hf_dir(
                verified.dir(),
                self.model.device(),
            )?)
        });
        match loaded {
            Ok(model) => {
                self.model = model;
                Ok(true)
            }
            Err(err) => Err(TrainError::BestModelNotLoaded {
                path: dir.clone(),
                message: format!(
                    "the best model (step {step}, eval_loss {eval_loss:.6}) could not be loaded back, so {} holds the last step's model: {err}",
                    self.output_dir.display()
                ),
                hint: format!(
                    "the last step's model is complete; to use the best one, repair {} or pick another checkpoint by its eval_loss in {}",
                    dir.display(),
                    self.output_dir.join(outputs::METRICS_FILE).display()
                ),
            }),
        }
    }

    /// The model: the last step's weights, or after `train` with
    /// `load_best_model_at_end` the best model's (on the writing rank).
    pub fn model(&self) -> &LlamaModel {
        &self.model
    }

    /// The batches of every step.
    pub fn plan(&self) -> &TrainPlan {
        &self.plan
    }

    /// The learning-rate schedule.
    pub fn schedule(&self) -> &LrSchedule {
        &self.schedule
    }

    /// The optimizer, with its moments (on a GPU, as of the last
    /// checkpoint: the live values and moments stay on the device).
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }

    /// Steps taken (0 before training).
    pub fn global_step(&self) -> usize {
        self.global_step
    }

    /// Every loss logged so far.
    pub fn log_history(&self) -> &[LogRecord] {
        &self.log_history
    }

    /// The loss of every step taken so far, in order.
    pub fn step_losses(&self) -> &[f64] {
        &self.step_losses
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
        self.last_checkpoint.as_deref()
    }

    /// Runs the remaining steps, logging, checkpointing, and writing the
    /// final model and reports into the output directory.
    pub fn train(&mut self, observer: &mut dyn Observer) -> Result<TrainSummary, TrainError> {
        for note in self.notes_before_training() {
            observer.on_note(&note);
        }
        if self.writes_outputs() {
            outputs::rewrite_metrics(&self.output_dir, &self.log_history)?;
        }
        let started = Instant::now();
        let first_step = self.global_step;
        let (mut samples, mut real, mut fed) = (0usize, 0usize, 0usize);
        let mut interval = Interval::default();
        let mut interrupted = false;
        while self.global_step < self.plan.len() {
            if self.stop_requested(observer)? {
                interrupted = true;
                break;
            }
            let metrics = self.train_step()?;
            samples += metrics.examples;
            real += metrics.real_tokens;
            fed += metrics.fed_tokens;
            interval.add(&metrics);
            observer.on_step(&metrics, self.plan.len());
            let last = self.global_step == self.plan.len();
            let eval = if self.evaluates_after(metrics.step) {
                self.evaluate()?
            } else {
                None
            };
            // An evaluation gets its log line even off the logging steps.
            if self.global_step.is_multiple_of(self.config.logging_steps) || last || eval.is_some()
            {
                let since = self.log_history.last().map_or(0, |r| r.step);
                let mut record =
                    interval.record(&metrics, &self.step_losses[since..], self.real_tokens_seen);
                if let Some(eval) = eval {
                    record.eval_loss = Some(eval.loss);
                    record.eval_perplexity = Some(eval.perplexity());
                    record.eval_runtime = Some(eval.seconds);
                }
                if self.writes_outputs() {
                    outputs::append_metrics(&self.output_dir, &record)?;
                }
                observer.on_log(&record);
                self.log_history.push(record);
                interval = Interval::default();
            }
            if self.saves_after(metrics.step) {
                // It considers this step's model for the best, if evaluated.
                self.checkpoint_now(observer)?;
            } else if let (true, Some(eval)) = (last, eval) {
                // The last step's model is the final model, unsaved.
                self.consider_best_model(eval.loss, false);
            }
        }
        // Unless the step it stopped after was just saved.
        let saved_now = checkpoint::checkpoint_dir(&self.output_dir, self.global_step);
        if interrupted
            && self.global_step > first_step
            && self.last_checkpoint.as_deref() != Some(saved_now.as_path())
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
        let evaluated = match (&self.best_model, best_model_loaded) {
            (Some(best), true) => Some((best.step, best.eval_loss)),
            _ => self
                .log_history
                .iter()
                .rev()
                .find_map(|r| Some((r.step, r.eval_loss?))),
        };
        let runtime = started.elapsed().as_secs_f64().max(1e-9);
        let steps = self.global_step - first_step;
        let mean = |losses: &[f64]| losses.iter().sum::<f64>() / losses.len().max(1) as f64;
        let summary = TrainSummary {
            train_runtime: runtime,
            train_samples_per_second: samples as f64 / runtime,
            train_steps_per_second: steps as f64 / runtime,
            train_tokens_per_second: real as f64 / runtime,
            real_tokens: self.real_tokens_seen,
            padded_tokens: self.padded_tokens_seen,
            train_loss: mean(&self.step_losses),
            final_loss: self.step_losses.last().copied().unwrap_or(f64::NAN),
            steps,
            global_step: self.global_step,
            resumed: (first_step > 0).then(|| RunPart {
                from_step: first_step,
                steps,
                real_tokens: real,
                padded_tokens: fed - real,
                train_loss: mean(&self.step_losses[first_step..]),
            }),
            peak_memory_bytes: peak_memory_bytes(),
            interrupted,
            eval_loss: evaluated.map(|(_, loss)| loss),
            eval_perplexity: evaluated.map(|(_, loss)| loss.exp()),
            eval_step: evaluated.map(|(step, _)| step),
            best_model: self.best_model.clone(),
            best_model_checkpoint: self.best_model_dir.clone(),
            best_model_loaded,
        };
        if !interrupted && self.writes_outputs() {
            observer.on_writing(true);
            let written =
                checkpoint::write_model_files(&self.model, &self.artifacts, &self.output_dir)
                    .and_then(|()| {
                        outputs::write_final_reports(&self.output_dir, &self.state(), &summary)
                    });
            observer.on_writing(false);
            written?;
        }
        best_loaded?;
        self.comm.barrier().map_err(TrainError::from)?;
        Ok(summary)
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

    /// Whether step `step` (1-based) is followed by a checkpoint, by the
    /// save strategy; the last step is saved too unless the strategy is
    /// `no` (HF's habit: a finished run can be extended from it).
    fn saves_after(&self, step: usize) -> bool {
        match self.config.save_strategy {
            SaveStrategy::No => false,
            _ if step == self.plan.len() => true,
            SaveStrategy::Steps(every) => step.is_multiple_of(every),
            SaveStrategy::Epoch => self.plan.steps()[step - 1].ends_epoch(),
        }
    }

    /// The checkpoints the rest of the run will write.
    pub fn checkpoints_ahead(&self) -> usize {
        (self.global_step + 1..=self.plan.len())
            .filter(|&step| self.saves_after(step))
            .count()
    }

    /// What the user should know before the steps start; drops a resumed
    /// best model this run does not track. Called once, by `train`.
    fn notes_before_training(&mut self) -> Vec<String> {
        let mut notes = std::mem::take(&mut self.notes);
        let remaining = self.global_step < self.plan.len();
        if self.eval.is_none() && self.eval_data.is_some() && remaining {
            notes.push(
                "the resumed run evaluated on a held-out set, this one is given none (--eval-data): no more evaluations, and the summary's eval_loss is the last one taken".to_owned(),
            );
        }
        // A fresh run starts at step 0; a resumed one after its checkpoint's.
        let resumed = self.global_step > 0;
        if resumed && self.tracks_best_model() {
            match (&self.best_model, &self.best_model_dir) {
                (None, _) if self.log_history.iter().any(|r| r.eval_loss.is_some()) => {
                    notes.push(format!(
                        "the resumed run did not keep a best model: the best is chosen among the models evaluated from step {} on",
                        self.global_step + 1
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
                crate::eval::EvalSettings {
                    strategy: EvalStrategy::Steps(every),
                    ..
                },
            ..
        }) = &self.eval
            && *every > self.plan.len()
        {
            notes.push(format!(
                "--eval-steps {every} is past the run's last step ({}): the only evaluation is the final model's",
                self.plan.len()
            ));
        }
        if self.writes_outputs()
            && !resumed
            && checkpoint::run_id_of(&self.output_dir).is_some_and(|id| id != self.run_id)
        {
            notes.push(format!(
                "{} holds another run's final model and reports (model.safetensors, train_results.json, ...): this run replaces them when it finishes; until then they are not this run's",
                self.output_dir.display()
            ));
        }
        if self.writes_outputs() && self.config.save_strategy != SaveStrategy::No {
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

    /// About how many bytes the rest of the run writes: every checkpoint
    /// ahead (weights and AdamW's two moments, f32, plus the tokenizer
    /// files) and the final model.
    pub fn bytes_to_write(&self) -> u64 {
        // What a checkpoint holds: the trained values (all weights, or the
        // adapters) and their two moments.
        let params: u64 = self
            .model
            .trainable()
            .iter()
            .map(|p| p.numel() as u64)
            .sum();
        let artifacts: u64 = self.artifacts.iter().map(|(_, b)| b.len() as u64).sum();
        // Headers, configs, states: a megabyte is generous.
        let slack = 1 << 20;
        let model = 4 * params + artifacts + slack;
        let checkpoint = model + 8 * params;
        // With a limit, the kept ones, the best model's and the one being
        // written are on disk at once.
        let at_once = match self.config.save_total_limit {
            Some(limit) => self.checkpoints_ahead().min(limit + 2),
            None => self.checkpoints_ahead(),
        };
        at_once as u64 * checkpoint + model
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
        let best = self.best_model_dir.as_deref();
        let removed =
            checkpoint::remove_old_checkpoints(&self.output_dir, limit, &saved, best, &self.run_id)
            .map_err(|err| TrainError::Checkpoint {
                path: self.output_dir.clone(),
                message: format!("could not remove an old checkpoint (--save-total-limit {limit}): {err}"),
                hint: format!(
                    "the run is saved in {}: make the old checkpoints removable (or drop --save-total-limit) and resume with --resume-from-checkpoint {}",
                    saved.display(),
                    saved.display()
                ),
            })?;
        for dir in removed {
            observer.on_remove(&dir);
        }
        Ok(())
    }

    /// Writes `checkpoint-{global_step}` now (rank 0; the other ranks wait
    /// for it, so every rank can resume from it once this returns).
    pub fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        // Before the state is taken, so the checkpoint knows it is the best.
        let evaluated = self
            .log_history
            .last()
            .filter(|record| record.step == self.global_step)
            .and_then(|record| record.eval_loss);
        if let Some(eval_loss) = evaluated {
            self.consider_best_model(eval_loss, true);
        }
        if let Some(device) = &self.device_optimizer {
            self.optimizer.copy_from_device(device);
        }
        // A checkpoint holds whole moments whatever the world size, so any
        // world size can resume it: sharded ones are gathered first (every
        // rank takes part; the copy lives until the files are written).
        let gathered = if self.optimizer.is_sharded() {
            Some(self.optimizer.gathered(self.comm.as_ref())?)
        } else {
            None
        };
        let dir = if self.writes_outputs() {
            let state = self.state();
            let snapshot = Snapshot {
                state: &state,
                model: &self.model,
                optimizer: gathered.as_ref().unwrap_or(&self.optimizer),
                artifacts: &self.artifacts,
            };
            checkpoint::write(&self.output_dir, snapshot).map_err(|err| self.save_failed(err))?
        } else {
            checkpoint::checkpoint_dir(&self.output_dir, self.global_step)
        };
        self.comm.barrier()?;
        self.last_checkpoint = Some(dir.clone());
        Ok(dir)
    }

    /// A checkpoint write that failed, with what to do about its cause and
    /// where the run can resume.
    fn save_failed(&self, err: TrainError) -> TrainError {
        let path = checkpoint::checkpoint_dir(&self.output_dir, self.global_step);
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

    /// One optimizer step: every micro-batch of the window forward and
    /// backward, the loss normalised by the window's label tokens, clipping,
    /// AdamW. Nothing is applied if the loss or gradient is not finite.
    pub fn train_step(&mut self) -> Result<StepMetrics, TrainError> {
        let started = Instant::now();
        let planned = self.plan.steps()[self.global_step].clone();
        // What every rank trains on in this step: the global figures come
        // from the shared plan, so they need no communication.
        let step_examples: Vec<&Example> = planned
            .examples()
            .into_iter()
            .map(|i| &self.examples[i])
            .collect();
        let label_tokens: usize = step_examples.iter().map(|e| e.num_loss_tokens()).sum();
        let sum_squared_lengths: u64 = step_examples
            .iter()
            .map(|example| (example.len() as u64).pow(2))
            .sum();
        let real_tokens: usize = step_examples.iter().map(|e| e.len()).sum();
        let examples = step_examples.len();
        let rank_real_tokens: Vec<usize> = planned
            .ranks
            .iter()
            .map(|batches| {
                batches
                    .iter()
                    .flatten()
                    .map(|&i| self.examples[i].len())
                    .sum()
            })
            .collect();
        let bin_capacity_tokens = match self.config.batching {
            Batching::Multipack(multipack) => {
                Some(planned.all_batches().count() * multipack.capacity)
            }
            _ => None,
        };
        let on_device = !self.model.on_cpu();
        let overlap = self.overlaps_exchange()?;
        let mut grads = GradSums::new(on_device, self.model.trainable().len());
        let (mut loss_sum, mut fed_tokens) = (0.0, 0);
        let batches = planned.rank_batches(self.comm.rank());
        let mut overlapped: Option<Overlapped> = None;
        for (at, indices) in batches.iter().enumerate() {
            let batch: Vec<Example> = indices.iter().map(|&i| self.examples[i].clone()).collect();
            self.model.set_lora_dropout(Some(DropoutDraw {
                seed: self.dropout_seed(),
                examples: indices.iter().map(|&i| i as u64).collect(),
            }));
            let (model, attention, checkpointed) = (
                &self.model,
                self.config.attention,
                self.gradient_checkpointing,
            );
            let pass = match &mut grads {
                // The window's last micro-batch completes the sums bucket by
                // bucket, so the exchange can start.
                GradSums::Host(sums) if overlap && at + 1 == batches.len() => {
                    let done = forward_backward_overlapped(
                        model,
                        attention,
                        &batch,
                        label_tokens.max(1),
                        sums,
                        self.comm.as_ref(),
                    )?;
                    let pass = Pass {
                        loss_sum: done.loss_sum,
                        fed_tokens: done.fed_tokens,
                    };
                    overlapped = Some(done);
                    pass
                }
                grads => on_workers(|| {
                    forward_backward(
                        model,
                        attention,
                        checkpointed,
                        &batch,
                        label_tokens.max(1),
                        grads,
                    )
                })?,
            };
            loss_sum += pass.loss_sum;
            fed_tokens += pass.fed_tokens;
        }
        self.model.set_lora_dropout(None);
        let device = self.model.device().clone().inner();
        grads.zero_where_missing(&self.model.trainable(), &device);
        let sharded = self.optimizer.is_sharded();
        let exchange_started = Instant::now();
        let mut norm_of_shards = None;
        if let (true, None, GradSums::Host(sums)) = (overlap, &overlapped, &mut grads) {
            // No micro-batch on this rank in this step: its (zero) sums
            // still join every bucket's all-reduce, in the same order.
            all_reduce_by_bucket(self.comm.as_ref(), &self.model.gradient_buckets(), sums)?;
        }
        if self.comm.world_size() > 1 {
            if sharded {
                let (comm, shard) = (self.comm.as_ref(), self.shard());
                norm_of_shards = Some(grads.reduce_scatter(comm, shard)?);
            } else if !overlap {
                grads.all_reduce(self.comm.as_ref(), &device, self.config.ddp_exchange)?;
            }
            let mut scalars = [loss_sum, fed_tokens as f64];
            self.comm.all_reduce_sum_f64(&mut scalars)?;
            (loss_sum, fed_tokens) = (scalars[0], scalars[1] as usize);
        }
        let mut exchange_seconds = exchange_started.elapsed().as_secs_f64();
        if let Some(timing) = overlapped {
            exchange_seconds += timing.exposed_seconds;
        }
        let step = self.global_step + 1;
        let loss = loss_sum / label_tokens.max(1) as f64;
        let grad_norm = match norm_of_shards {
            Some(norm) => norm,
            None => on_workers(|| grads.global_norm()),
        };
        for (what, value) in [("loss", loss), ("gradient norm", grad_norm)] {
            if !value.is_finite() {
                return Err(TrainError::NonFinite {
                    step,
                    what,
                    value,
                    last_checkpoint: match &self.last_checkpoint {
                        Some(dir) => format!("the last good checkpoint is {}", dir.display()),
                        None => "no checkpoint was written in this run".to_owned(),
                    },
                });
            }
        }
        let clip = if self.config.max_grad_norm > 0.0 {
            (self.config.max_grad_norm / (grad_norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        let learning_rate = self.schedule.lr(self.global_step);
        match grads {
            GradSums::Host(grads) => {
                let shapes = self.reclaim_optimizer_values();
                let optimizer = &mut self.optimizer;
                on_workers(|| optimizer.step(&grads, clip as f32, learning_rate));
                drop(grads);
                if sharded {
                    // Each rank updated its shard; every rank needs all of them.
                    let gathering = Instant::now();
                    self.comm.all_gather_f32(&mut self.optimizer.values_mut())?;
                    exchange_seconds += gathering.elapsed().as_secs_f64();
                }
                self.load_optimizer_values(&shapes);
                self.model.refresh_bf16_weights();
            }
            GradSums::Device(grads) => {
                let grads: Vec<_> = grads.into_iter().flatten().collect();
                let shapes: Vec<[usize; 2]> = self
                    .model
                    .trainable()
                    .iter()
                    .map(|p| p.value.dims())
                    .collect();
                let state = self
                    .device_optimizer
                    .get_or_insert_with(|| self.optimizer.to_device(&shapes, &device));
                self.optimizer
                    .step_on_device(state, &grads, clip as f32, learning_rate);
                let strategy = self.model.device().gradient_checkpointing_strategy();
                for (index, param) in self.model.trainable_mut().into_iter().enumerate() {
                    let mut value = Tensor::from_inner(state.values(index).clone());
                    if let Some(strategy) = strategy {
                        value = value.with_gradient_checkpointing_strategy(strategy);
                    }
                    param.value = trainable(value);
                }
                self.model.refresh_bf16_weights();
            }
        }
        self.global_step = step;
        self.real_tokens_seen += real_tokens;
        self.padded_tokens_seen += fed_tokens.saturating_sub(real_tokens);
        self.step_losses.push(loss);
        Ok(StepMetrics {
            step,
            epoch: planned.epoch_progress(),
            loss,
            grad_norm,
            learning_rate,
            examples,
            real_tokens,
            fed_tokens,
            label_tokens,
            sum_squared_lengths,
            rank_real_tokens,
            bin_capacity_tokens,
            exchange_seconds,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Whether this step's exchange runs bucket by bucket under the
    /// backward pass (`ddp_overlap`, several ranks); refuses the overlap
    /// where the backward pass does not hand its gradients over in parts.
    fn overlaps_exchange(&self) -> Result<bool, TrainError> {
        if !self.config.ddp_overlap || self.comm.world_size() == 1 {
            return Ok(false);
        }
        if !self.gradient_checkpointing {
            return Err(TrainError::Config {
                flag: "ddp-overlap",
                message: "the backward pass hands gradients over layer by layer only when it recomputes the layers".into(),
                hint: "add --gradient-checkpointing, or drop --ddp-overlap",
            });
        }
        if !self.model.on_cpu() {
            return Err(TrainError::Config {
                flag: "ddp-overlap",
                message: "the overlapped exchange runs on the CPU only".into(),
                hint: "drop --ddp-overlap on a GPU",
            });
        }
        Ok(true)
    }

    /// This rank's shard of the trained parameters laid end to end (ZeRO
    /// stage 1).
    fn shard(&self) -> std::ops::Range<usize> {
        let total: usize = self.model.trainable().iter().map(|p| p.numel()).sum();
        crate::comm::shard_range(total, self.comm.world_size(), self.comm.rank())
    }

    /// The seed of this step's LoRA dropout: a function of the run's seed
    /// and the step alone. The masks key each token by its example and its
    /// position there (`DropoutDraw`), so a resumed run, padded and
    /// padding-free batches, and any micro-batch split over any number of
    /// ranks draw the same mask for the same token.
    fn dropout_seed(&self) -> u64 {
        let mut hash = Fnv1a::new();
        hash.eat(self.config.seed);
        hash.eat(self.global_step as u64);
        hash.finish()
    }

    /// Puts the optimizer's master values into the model as fresh leaves,
    /// lent rather than copied: the model's tensors are the master values
    /// until [`Self::reclaim_optimizer_values`] takes them back.
    /// `shapes`: every trained parameter's, in order.
    fn load_optimizer_values(&mut self, shapes: &[[usize; 2]]) {
        let device = self.model.device().clone();
        for (index, param) in self.model.trainable_mut().into_iter().enumerate() {
            let values = self.optimizer.lend_values(index);
            param.value = trainable(float_tensor(values, shapes[index], &device));
        }
    }

    /// Takes the lent master values back from the model before an update
    /// (nothing to take before the first one). The step's graph is gone by
    /// then, so each weight's buffer has one owner and comes back without
    /// a copy; the model holds an empty placeholder until the update puts
    /// the new values in. Gives every trained parameter's shape.
    fn reclaim_optimizer_values(&mut self) -> Vec<[usize; 2]> {
        let device = self.model.device().clone();
        let mut shapes = Vec::new();
        for (index, param) in self.model.trainable_mut().into_iter().enumerate() {
            shapes.push(param.value.dims());
            if self.optimizer.is_lent(index) {
                let placeholder = float_tensor(Vec::new(), [0, 0], &device);
                let values = std::mem::replace(&mut param.value, placeholder).into_vec();
                self.optimizer.return_values(index, values);
            }
        }
        shapes
    }
}

/// Forward and backward of one micro-batch; its gradients, already divided
/// by the window's label-token count, are added to `grads`.
fn forward_backward(
    model: &LlamaModel,
    attention: AttentionMode,
    gradient_checkpointing: bool,
    batch: &[Example],
    window_label_tokens: usize,
    grads: &mut GradSums,
) -> Result<Pass, TrainError> {
    let collated = Collated::new(batch, attention)?;
    let input = collated.input();
    let fed_tokens = input.input_ids().len();
    let trainable = model.trainable();
    let divisor = window_label_tokens as f64;
    let loss_sum = if gradient_checkpointing {
        // Every trained tensor's part of the gradient, added to its sum.
        let take = |gradients: &Gradients, _complete: usize| {
            for (index, param) in trainable.iter().enumerate() {
                if let Some(g) = grad(&param.value, gradients) {
                    grads.add(index, g);
                }
            }
        };
        model.loss_backward_checkpointed(&input, divisor, model.head_chunk_rows(), take)?
    } else {
        let loss = model.loss_sum(&input)?;
        let value = loss.value();
        let mut gradients = backward(&loss.sum.div_scalar(divisor));
        // Taken out of the container, each gradient is its buffer's only
        // owner and reaches the sums without a copy.
        for (index, param) in trainable.iter().enumerate() {
            if let Some(g) = take_grad(&param.value, &mut gradients) {
                grads.add(index, g);
            }
        }
        value
    };
    Ok(Pass {
        loss_sum: f64::from(loss_sum),
        fed_tokens,
    })
}

/// The learning-rate schedule of `config` over `total_steps`.
fn schedule_for(config: &TrainConfig, total_steps: usize) -> LrSchedule {
    let warmup_steps = match config.warmup {
        Warmup::Steps(steps) => steps,
        Warmup::Ratio(ratio) => (ratio * total_steps as f64).ceil() as usize,
    };
    LrSchedule {
        base: config.learning_rate,
        kind: config.lr_scheduler_type,
        warmup_steps,
        total_steps,
    }
}

/// Runs `f` on a thread of rayon's pool, where the kernels' parallel loops
/// and gemm's threads then start without a hand-over: called from outside
/// the pool, every one of the hundreds of parallel calls of a step queues
/// its work, wakes a worker through the kernel (a futex) and sleeps until
/// it is done. That hand-over was 11% of a short-example step on `medium`
/// (2 threads, a virtual machine); inside the pool it happens once. MPI
/// calls stay on the calling thread (funneled threading).
fn on_workers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

struct Pass {
    loss_sum: f64,
    fed_tokens: usize,
}

/// Throughput and balance since the previous log line (of this process).
#[derive(Default)]
struct Interval {
    real_tokens: usize,
    seconds: f64,
    bin_capacity_tokens: Option<usize>,
    busiest_rank_tokens: usize,
    world_size: usize,
    exchange_seconds: f64,
    steps: usize,
}

impl Interval {
    fn add(&mut self, metrics: &StepMetrics) {
        self.real_tokens += metrics.real_tokens;
        self.seconds += metrics.seconds;
        if let Some(capacity) = metrics.bin_capacity_tokens {
            *self.bin_capacity_tokens.get_or_insert(0) += capacity;
        }
        self.busiest_rank_tokens += metrics.rank_real_tokens.iter().copied().max().unwrap_or(0);
        self.world_size = metrics.rank_real_tokens.len();
        self.exchange_seconds += metrics.exchange_seconds;
        self.steps += 1;
    }

    /// `losses`: every step since the previous log line, across a resume.
    fn record(&self, last: &StepMetrics, losses: &[f64], real_tokens_seen: usize) -> LogRecord {
        LogRecord {
            step: last.step,
            epoch: last.epoch,
            loss: losses.iter().sum::<f64>() / losses.len().max(1) as f64,
            grad_norm: last.grad_norm,
            learning_rate: last.learning_rate,
            tokens_per_second: self.real_tokens as f64 / self.seconds.max(1e-9),
            real_tokens_seen,
            packing_efficiency: self
                .bin_capacity_tokens
                .map(|capacity| self.real_tokens as f64 / capacity.max(1) as f64),
            rank_imbalance: (self.world_size > 1).then(|| {
                let mean = self.real_tokens as f64 / self.world_size as f64;
                self.busiest_rank_tokens as f64 / mean.max(1e-9)
            }),
            exchange_seconds: (self.world_size > 1)
                .then(|| self.exchange_seconds / self.steps.max(1) as f64),
            eval_loss: None,
            eval_perplexity: None,
            eval_runtime: None,
        }
    }
}

/// FNV-1a over every example's ids and labels: a resumed run must train on
/// the same data.
fn fingerprint(examples: &[Example]) -> u64 {
    let mut hash = Fnv1a::new();
    for example in examples {
        hash.eat(example.len() as u64);
        example
            .input_ids()
            .iter()
            .for_each(|&id| hash.eat(u64::from(id)));
        example
            .labels()
            .iter()
            .for_each(|&label| hash.eat(label as u64));
    }
    hash.finish()
}

/// Whether two paths name the same directory (links resolved where they exist).
fn same_dir(a: &Path, b: &Path) -> bool {
    let resolve = |p: &Path| {
        let p = if p.as_os_str().is_empty() {
            Path::new(".")
        } else {
            p
        };
        p.canonicalize()
            .or_else(|_| std::path::absolute(p))
            .unwrap_or_else(|_| p.to_owned())
    };
    resolve(a) == resolve(b)
}

/// A name for a fresh run, different from any other run's: the clock, the
/// process and an address mixed by SplitMix64 (no random-number crate).
fn new_run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let address = std::ptr::addr_of!(local) as u64;
    let mut rng = padfree_pack::SplitMix64::new(
        nanos ^ u64::from(std::process::id()).rotate_left(32) ^ address,
    );
    format!("{:016x}", rng.next_u64())
}

/// FNV-1a over the sorted fingerprints of the examples one by one: the same
/// for the same examples in any order (the eval loss is a sum over the set,
/// so a reshuffled eval file is the same set).
fn set_fingerprint(examples: &[Example]) -> u64 {
    let mut each: Vec<u64> = examples
        .iter()
        .map(|e| fingerprint(std::slice::from_ref(e)))
        .collect();
    each.sort_unstable();
    let mut hash = Fnv1a::new();
    each.into_iter().for_each(|h| hash.eat(h));
    hash.finish()
}

/// FNV-1a over the little-endian bytes of each value eaten.
struct Fnv1a(u64);

impl Fnv1a {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn eat(&mut self, value: u64) {
        for byte in value.to_le_bytes() {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl Trainer {
    /// Everything that says where the run stands, as data: what a checkpoint
    /// saves beside the weights and the optimizer's moments.
    pub fn state(&self) -> TrainerState {
        TrainerState {
            format: STATE_FORMAT.to_owned(),
            global_step: self.global_step,
            epoch: self
                .global_step
                .checked_sub(1)
                .map_or(0.0, |i| self.plan.steps()[i].epoch_progress()),
            total_steps: self.plan.len(),
            optimizer_steps: self.optimizer.steps_taken(),
            config: self.config.clone(),
            num_examples: self.examples.len(),
            data_fingerprint: format!("{:016x}", self.data_fingerprint),
            real_tokens_seen: self.real_tokens_seen,
            step_losses: self.step_losses.clone(),
            log_history: self.log_history.clone(),
            best_model: self.best_model.clone(),
            run_id: self.run_id.clone(),
            padded_tokens_seen: self.padded_tokens_seen,
            eval_data: self.eval_data.clone(),
            earlier_layouts: self.earlier_layouts.clone(),
        }
    }

    /// Plans the run anew as resumed after `earlier` layouts (the steps
    /// each took, then this config's from there), with the
    /// learning-rate schedule over the new total.
    fn replan(&mut self, earlier: Vec<EarlierLayout>) -> Result<(), TrainError> {
        let lengths: Vec<usize> = self.examples.iter().map(Example::len).collect();
        self.plan = TrainPlan::with_history(&lengths, &self.config, &earlier)?;
        self.schedule = schedule_for(&self.config, self.plan.len());
        self.earlier_layouts = earlier;
        Ok(())
    }

    /// Continues from a saved state (already checked with
    /// [`TrainerState::check_continues`] against this trainer's own) found
    /// in the run directory `run_dir`.
    fn apply_state(&mut self, state: TrainerState, run_dir: &Path) {
        self.global_step = state.global_step;
        self.real_tokens_seen = state.real_tokens_seen;
        self.padded_tokens_seen = state.padded_tokens_seen;
        self.step_losses = state.step_losses;
        self.log_history = state.log_history;
        self.best_model_dir = state
            .best_model
            .as_ref()
            .and_then(|best| best.checkpoint_in(run_dir, checkpoint::is_checkpoint));
        self.best_model = state.best_model.map(|mut best| {
            // Resumed into another output directory, the best stays where it
            // is: the state then names it by its whole path.
            if let Some(dir) = &self.best_model_dir
                && !same_dir(run_dir, &self.output_dir)
            {
                best.checkpoint = Some(std::path::absolute(dir).unwrap_or_else(|_| dir.clone()));
            }
            best
        });
        self.run_id = state.run_id;
        self.eval_data = state.eval_data;
    }
}
