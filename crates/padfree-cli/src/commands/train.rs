//! `padfree train`: runs the trainer on what `load.rs` loaded, with a
//! progress bar, notes and warnings, Ctrl-C handling, and the report.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use padfree_model::check::Fault;
use padfree_model::kernels::SharedInput16;
use padfree_model::memory::{StepSettings, training_memory};
use padfree_train::outputs::{
    LOSS_PLOT_FILE, METRICS_FILE, RESULTS_FILE, check_free_space, check_output_dir_outside,
    lock_output_dir, prepare_output_dir,
};
use padfree_train::{
    AttentionMode, Batching, EvalSet, EvalStrategy, LogRecord, Observer, StepMetrics, TrainConfig,
    Trainer, checkpoint,
};

use super::load::{Loaded, load, machine_memory, with_record};
use crate::args::TrainJob;

/// Exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
pub const INTERRUPTED_EXIT: u8 = 130;

/// The multipack plan's figures, first epoch (and the spread over epochs).
fn print_packing(trainer: &Trainer, config: &TrainConfig) {
    let Batching::Multipack(multipack) = config.batching else {
        return;
    };
    let reports = trainer.plan().packing();
    let Some(first) = reports.first() else {
        return;
    };
    say!(
        "multipack ({}, balance {}): bins of {} tokens; per step {} rank(s) x {} micro-batch(es)",
        multipack.packer.name(),
        multipack.balance.name(),
        multipack.capacity,
        config.world_size,
        config.gradient_accumulation_steps
    );
    for line in first.to_string().lines() {
        say!("  epoch 1: {line}");
    }
    if reports.len() > 1 {
        let efficiency: Vec<f64> = reports.iter().map(|r| r.efficiency).collect();
        let low = efficiency.iter().copied().fold(f64::INFINITY, f64::min);
        let high = efficiency.iter().copied().fold(0.0, f64::max);
        say!(
            "  {} epochs planned: packing efficiency {:.2}%-{:.2}%",
            reports.len(),
            100.0 * low,
            100.0 * high
        );
    }
}

/// What `PADFREE_SIMD` did, in the log: the level it holds padfree's
/// kernels to below the CPU's, or why it was ignored.
fn simd_notes() {
    use padfree_model::kernels::{SimdLevel, simd_capped, simd_detected, simd_level};
    let (ran, has) = (simd_level().name(), simd_detected().name());
    match std::env::var("PADFREE_SIMD").ok().filter(|v| !v.is_empty()) {
        Some(value) if SimdLevel::named(&value).is_none() => say!(
            "NOTE: PADFREE_SIMD={value} is not one of avx512, avx2, baseline: ignored, padfree's kernels run {ran}"
        ),
        Some(value) if !simd_capped() && value != ran => say!(
            "NOTE: PADFREE_SIMD={value}: this CPU runs {has} at most, so padfree's kernels run {ran}"
        ),
        _ if simd_capped() => say!(
            "NOTE: PADFREE_SIMD={ran}: padfree's kernels run their {ran} code on a CPU with {has} (the gemm crate's f32 kernels choose their own)"
        ),
        _ => {}
    }
}

/// Runs the job; `Ok(true)` when it was interrupted.
pub fn run(job: &TrainJob) -> anyhow::Result<bool> {
    if job.embedded_default {
        say!(
            "padfree train: no --model/--config/--tokenizer/--data given, so this is the built-in demo:"
        );
        say!(
            "  the `small` preset (random init) on the shipped maths word problems with the shipped tokenizer;"
        );
        say!(
            "  unless given, --max-steps 100 --learning-rate 1e-3 --warmup-steps 10 --logging-steps 10,"
        );
        say!("  other flags at their HF TrainingArguments defaults\n");
    }
    let comm = crate::ranks::communicator()?;
    let (rank, world_size) = (comm.rank(), comm.world_size());
    if rank == 0 {
        check_output_dir_outside(&job.output_dir, job.resume_from_checkpoint.as_deref())?;
    }
    if world_size > 1 {
        if job.output_dir_defaulted {
            bail!(
                "running as {world_size} ranks: every rank must write to the same place\nHINT: give --output-dir"
            );
        }
        let config = job.train_config(&[]);
        say!(
            "data-parallel: {world_size} ranks over {}, {} threads each; {} exchange{}, ZeRO stage {}{}",
            comm.backend(),
            rayon::current_num_threads(),
            config.ddp_exchange.name(),
            if config.ddp_overlap {
                " overlapped with the backward pass (one bucket per layer)"
            } else {
                ""
            },
            config.zero_stage,
            if config.zero_stage == 1 {
                " (AdamW's moments sharded over the ranks)"
            } else {
                ""
            }
        );
    }
    // Before anything of the checkpoint is read (`load` reads its weights).
    let verified = job
        .resume_from_checkpoint
        .as_deref()
        .map(checkpoint::verify)
        .transpose()?;
    let Loaded {
        model,
        tokenizer,
        dataset,
        eval_dataset,
    } = load(job, Some(comm.as_ref()))?;

    let resuming = job.resume_from_checkpoint.is_some();
    // Held to the end of the run, taken before the directory is checked:
    // no other run can slip in between the check and the first write. Taken
    // after loading, so a run refused for its data creates nothing.
    let _lock = if rank == 0 {
        let lock = lock_output_dir(&job.output_dir)?;
        prepare_output_dir(&job.output_dir, job.overwrite_output_dir, resuming)?;
        Some(lock)
    } else {
        None
    };
    // No rank looks into the directory before rank 0 has checked it.
    comm.barrier()?;
    let artifacts = match &tokenizer {
        Some(tokenizer) => tokenizer
            .hf_files()
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .map(|(name, bytes)| (name.to_owned(), bytes))
            .collect(),
        None => Vec::new(),
    };
    // Pre-tokenized data on a model without a tokenizer writes none.
    let tokenizer_files = if artifacts.is_empty() {
        ""
    } else {
        ", tokenizer files"
    };
    let lengths = dataset.examples.lengths();
    let mut config = job.train_config(&lengths);
    config.world_size = world_size;
    if let Some(batches) = job.verify_packing {
        // Every rank checks its own first batches; after a resume, the
        // first of the run (the check proves the code on this data, not a
        // step).
        let outcome =
            super::check::verify_packing(&model, &dataset, &config, rank, batches, Fault::None)?;
        if !outcome.isolation_tested {
            warn!(
                "--verify-packing: {}, so keeping examples apart was not tested; training goes on (batches of one example are not packed)\nHINT: `padfree check --per-device-train-batch-size 2` (or more) tests it",
                padfree_model::check::ONE_EXAMPLE
            );
        }
    }
    let label_counts = dataset.examples.loss_tokens()?;
    let (source, locations) = (dataset.source, dataset.locations);
    // The merged model (--merge-adapter) gets the tokenizer files too.
    let merge_artifacts = job.merge_adapter.then(|| artifacts.clone());
    let mut trainer = match &verified {
        Some(dir) => Trainer::resume_on(
            comm,
            model,
            dir,
            dataset.examples,
            config.clone(),
            &job.output_dir,
            artifacts,
        ),
        None => Trainer::new_on(
            comm,
            model,
            dataset.examples,
            config.clone(),
            &job.output_dir,
            artifacts,
        ),
    }
    .map_err(|err| with_record(err, &source, &locations))?;
    trainer.set_gradient_checkpointing(job.gradient_checkpointing);
    simd_notes();
    if let (Some(eval), Some(eval_dataset)) = (&job.eval, eval_dataset) {
        let eval = eval.settings;
        say!(
            "evaluation: {} examples in batches of {}, {}{}",
            eval_dataset.examples.len(),
            eval.batch_size,
            match eval.strategy {
                EvalStrategy::Steps(every) => format!("every {every} steps"),
                EvalStrategy::Epoch => "at the end of every epoch".to_owned(),
            },
            if eval.load_best_model_at_end {
                "; the final model is the one with the lowest eval_loss"
            } else {
                ""
            }
        );
        trainer = trainer.with_eval(EvalSet {
            examples: eval_dataset.examples.into_examples()?,
            settings: eval,
        })?;
    }
    if rank == 0 {
        check_free_space(&job.output_dir, trainer.bytes_to_write())?;
        check_step_memory(
            &trainer,
            &config,
            &lengths,
            &label_counts,
            job.gradient_checkpointing,
        )?;
    }
    if config.precision == padfree_model::Precision::Bf16 {
        let model = trainer.model();
        let kept = match (model.lora_config().is_some(), model.is_quantized()) {
            (false, _) if model.on_cpu() && !model.bf16_reads_weight_copies() => {
                "master weights, gradients, AdamW state, checkpoints and the final model in f32; the products read the f32 weights rounded (no bf16 copies: the widened body would widen them again, or PADFREE_BF16_WEIGHT_COPIES=0)"
            }
            (false, _) => {
                "master weights, gradients, AdamW state, checkpoints and the final model in f32; the weights' 16-bit copies made once per optimizer step"
            }
            (true, false) if !model.on_cpu() => {
                "the adapters' master weights, gradients, AdamW state, checkpoints and the saved adapter in f32; the frozen base multiplied from its 16-bit device copy made once, the adapters' low-rank products from their operands rounded as they are read"
            }
            (true, false) => {
                "the adapters' master weights, gradients, AdamW state, checkpoints and the saved adapter in f32; the frozen base multiplied from a bf16 copy made once"
            }
            (true, true) => {
                "the adapters' master weights, gradients, AdamW state, checkpoints and the saved adapter in f32; the frozen base's blocks dequantised to bf16 a tile at a time"
            }
        };
        say!(
            "precision: bf16 matmul operands, f32 accumulation ({}); {kept}",
            model.bf16_matmul_body()
        );
        if model.on_cpu()
            && let Some(why) = padfree_model::Precision::cpu_widened_because()
        {
            say!("NOTE: {why}");
        }
    }
    print_packing(&trainer, &config);
    say!(
        "training: {} optimizer steps ({} from step {}), attention {}{}, output {}",
        trainer.plan().len(),
        trainer.plan().len() - trainer.global_step(),
        trainer.global_step(),
        job.train.attention.name(),
        if job.gradient_checkpointing {
            ", gradient checkpointing"
        } else {
            ""
        },
        job.output_dir.display()
    );
    let mut progress = Progress::new(
        trainer.plan().len(),
        trainer.global_step(),
        (rank, world_size),
        trainer.last_checkpoint(),
    )?;
    let summary = match trainer.train(&mut progress) {
        // The last step's model was written in the best one's place: its
        // merged form is owed too, and said, before the error.
        Err(err @ padfree_train::TrainError::BestModelNotLoaded { .. }) => {
            progress.bar.finish_and_clear();
            if let Some(artifacts) = &merge_artifacts
                && trainer.writes_outputs()
            {
                let dir = job.output_dir.join(MERGED_DIR);
                padfree_train::checkpoint::write_model_files(
                    &trainer.model().merged(),
                    artifacts,
                    &dir,
                )?;
                say!(
                    "wrote {} (the last step's adapters merged into the model's weights, as the output directory holds the last step's adapter: the best model could not be loaded back)",
                    dir.display()
                );
            }
            return Err(err.into());
        }
        other => other?,
    };
    progress.bar.finish_and_clear();
    say!("\n***** train metrics *****\n{summary}");
    if summary.interrupted {
        match trainer.last_checkpoint() {
            Some(dir) => say!(
                "\ninterrupted after step {}: saved {}\nresume with: --resume-from-checkpoint {}",
                summary.global_step,
                dir.display(),
                dir.display()
            ),
            None => say!("\ninterrupted before the first step: nothing saved"),
        }
        return Ok(true);
    }
    let out = &job.output_dir;
    let which = match (&summary.best_model, summary.best_model_loaded) {
        (Some(best), true) => format!(
            " (the best: step {}, eval_loss {:.4}, from {})",
            best.step,
            best.eval_loss,
            summary
                .best_model_checkpoint
                .as_deref()
                .map_or_else(String::new, |dir| dir.display().to_string())
        ),
        (Some(_), false) => " (the best: the last step's)".to_owned(),
        (None, _) => String::new(),
    };
    let files = match trainer.model().lora_config() {
        Some(_) => "adapter_model.safetensors",
        None => "model.safetensors",
    };
    let config_file = match trainer.model().lora_config() {
        Some(_) => "adapter_config.json",
        None => "config.json",
    };
    say!(
        "\nwrote {} ({files}{which}, {config_file}{tokenizer_files}), {}, {}, {}",
        out.display(),
        out.join(METRICS_FILE).display(),
        out.join(RESULTS_FILE).display(),
        out.join(LOSS_PLOT_FILE).display()
    );
    if let Some(artifacts) = merge_artifacts
        && trainer.writes_outputs()
    {
        let dir = out.join(MERGED_DIR);
        padfree_train::checkpoint::write_model_files(&trainer.model().merged(), &artifacts, &dir)?;
        say!(
            "wrote {} (the adapters merged into the model's weights: model.safetensors, config.json{tokenizer_files})",
            dir.display()
        );
    }
    Ok(false)
}

/// Says what a step will hold (weights as held, training state,
/// activations of the largest micro-batch of the plan:
/// `padfree_model::memory`) and refuses a run that cannot fit in this
/// machine's memory, before the first step.
fn check_step_memory(
    trainer: &Trainer,
    config: &TrainConfig,
    lengths: &[usize],
    labels: &[usize],
    checkpointing: bool,
) -> anyhow::Result<()> {
    let padded = config.attention == AttentionMode::Padded;
    let (mut tokens, mut label_tokens) = (0, 0);
    for step in trainer.plan().steps() {
        for batch in step.all_batches() {
            let real: usize = batch.iter().map(|&i| lengths[i]).sum();
            let longest = batch.iter().map(|&i| lengths[i]).max().unwrap_or(0);
            tokens = tokens.max(if padded { batch.len() * longest } else { real });
            label_tokens = label_tokens.max(batch.iter().map(|&i| labels[i]).sum());
        }
    }
    let model = trainer.model();
    let estimate = training_memory(
        model.config(),
        model.weight_bytes() as u64,
        model.lora_config(),
        tokens,
        label_tokens,
        StepSettings {
            checkpointing,
            precision: config.precision,
            on_cpu: model.on_cpu(),
            shares_inputs: SharedInput16::for_packed_bodies().is_some(),
            quantized_base: model.is_quantized(),
            released_copies: model.releasable_bf16_bytes() as u64,
        },
    );
    let gib = |bytes: u64| bytes as f64 / 1073741824.0;
    say!(
        "memory: about {:.2} GiB a step: weights {:.2}, training state {:.2}, activations {:.2}{} (the largest micro-batch: {tokens} tokens, {label_tokens} labelled{})",
        gib(estimate.total()),
        gib(estimate.weights),
        gib(estimate.training_state),
        gib(estimate.activations),
        if estimate.released > 0 {
            format!(
                ", less {:.2} of bf16 weight copies freed in the backward pass for the gradients",
                gib(estimate.released)
            )
        } else {
            String::new()
        },
        if checkpointing {
            ", gradient checkpointing"
        } else {
            ""
        }
    );
    if let Some(total) = machine_memory()
        && estimate.total() as f64 > total
    {
        bail!(
            "a training step needs about {:.1} GiB (weights {:.1}, training state {:.1}, activations {:.1} for {tokens} tokens), more than this machine's {:.1} GiB of memory\nHINT: smaller micro-batches (--per-device-train-batch-size, --max-tokens-per-batch), --gradient-checkpointing, or LoRA (--use-peft) on a quantized GGUF base",
            gib(estimate.total()),
            gib(estimate.weights),
            gib(estimate.training_state),
            gib(estimate.activations),
            total / 1073741824.0
        );
    }
    Ok(())
}

/// Where `--merge-adapter` writes the merged model, inside the output directory.
pub const MERGED_DIR: &str = "merged";

/// The progress bar, log lines and Ctrl-C.
struct Progress {
    bar: ProgressBar,
    signals: Arc<Mutex<Signals>>,
    rank: usize,
    /// A test hook: `PADFREE_WRITE_DELAY_MS=N` waits N ms as each write
    /// begins (after saying so on stderr), so a test can signal during it.
    write_delay: Option<std::time::Duration>,
}

/// What Ctrl-C (SIGTERM, SIGHUP) has asked for, and what is being written.
///
/// The first signal stops training after the current step and saves it. A
/// second one quits at once, unless a checkpoint or the final model is
/// being written: then it quits as soon as that is complete, so no save is
/// lost half-way. A third one during the write abandons it (its temporary
/// directory is removed at the next start). The handler and the trainer
/// change this under one lock, so a write cannot begin between the
/// handler's look and its exit.
#[derive(Debug, Default)]
struct Signals {
    stop: bool,
    writing: bool,
    quit_after_write: bool,
    last_saved: Option<PathBuf>,
}

impl Signals {
    fn last_saved(&self) -> String {
        match &self.last_saved {
            Some(dir) => format!("; resume with --resume-from-checkpoint {}", dir.display()),
            None => String::new(),
        }
    }
}

/// burn's tensor API cannot return an error, so a GPU that runs out of
/// memory panics inside the runtime. This hook turns that panic into an
/// error with the runtime's figures, a HINT and where to resume; every
/// checkpoint is written through a temporary directory, so the last one is
/// whole. Other panics keep the default report.
fn device_memory_hook(signals: Arc<Mutex<Signals>>) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        match out_of_device_memory(message) {
            Some(figures) => {
                let last = signals
                    .try_lock()
                    .map(|signals| signals.last_saved())
                    .unwrap_or_default();
                eprintln!(
                    "error: the device ran out of memory: {figures}\nHINT: lower --per-device-train-batch-size or --max-tokens-per-batch, add --gradient-checkpointing, or train a smaller model{last}"
                );
                crate::ranks::end_job_after_error();
                std::process::exit(1);
            }
            None => default(info),
        }
    }));
}

/// The first line of a runtime's out-of-memory report (cubecl's
/// `out of device memory allocating N bytes`, wgpu's `OutOfMemory`), or
/// `None` for any other panic.
fn out_of_device_memory(message: &str) -> Option<String> {
    let lower = message.to_ascii_lowercase();
    let oom = [
        "out of device memory",
        "out-of-memory",
        "outofmemory",
        "out of memory",
    ];
    oom.iter().any(|needle| lower.contains(needle)).then(|| {
        message
            .lines()
            .find(|line| line.to_ascii_lowercase().contains("memory"))
            .unwrap_or(message)
            .trim()
            .to_owned()
    })
}

fn lock(signals: &Mutex<Signals>) -> std::sync::MutexGuard<'_, Signals> {
    signals.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Progress {
    fn new(
        total_steps: usize,
        done: usize,
        (rank, world_size): (usize, usize),
        resumed_from: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let bar = if crate::ranks::is_lead() {
            ProgressBar::new(total_steps as u64)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}",
            )?
            .progress_chars("=> "),
        );
        bar.set_position(done as u64);
        let signals = Arc::new(Mutex::new(Signals {
            last_saved: resumed_from.map(Path::to_owned),
            ..Signals::default()
        }));
        let shared = Arc::clone(&signals);
        ctrlc::set_handler(move || {
            let mut signals = lock(&shared);
            if !signals.stop {
                signals.stop = true;
                // mpirun ends a job whose rank died by sending the others
                // SIGTERM: this rank cannot tell, so it says both.
                let ranks = if world_size > 1 {
                    format!(
                        "\nUnder mpirun this is also how a job ends when one of its ranks died (mpirun's own message names it): the step cannot finish then{}",
                        match &signals.last_saved {
                            Some(_) => signals.last_saved(),
                            None => "; no checkpoint was saved yet".to_owned(),
                        }
                    )
                } else {
                    String::new()
                };
                eprintln!(
                    "\nCtrl-C or SIGTERM: stopping after this step and saving a checkpoint (again: quit without saving){ranks}"
                );
            } else if signals.writing && !signals.quit_after_write {
                signals.quit_after_write = true;
                eprintln!(
                    "\nCtrl-C again: a checkpoint is being written; quitting as soon as it is complete (a third time: abandon it)"
                );
            } else if signals.writing {
                eprintln!(
                    "\nCtrl-C a third time: quitting, abandoning the checkpoint being written (its temporary directory is removed at the next start){}",
                    signals.last_saved()
                );
                std::process::exit(i32::from(INTERRUPTED_EXIT));
            } else {
                // Every file is written through a temporary and a rename, and
                // nothing is being written: nothing half-written remains.
                eprintln!("\nCtrl-C again: quitting now{}", signals.last_saved());
                std::process::exit(i32::from(INTERRUPTED_EXIT));
            }
        })
        .context("installing the Ctrl-C handler")?;
        device_memory_hook(Arc::clone(&signals));
        let write_delay = std::env::var("PADFREE_WRITE_DELAY_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .map(std::time::Duration::from_millis);
        Ok(Self {
            bar,
            signals,
            rank,
            write_delay,
        })
    }
}

impl Progress {
    /// A line above the bar; printed plainly when the bar is hidden (output
    /// not a terminal), where indicatif would drop it.
    fn line(&self, text: &str) {
        if self.bar.is_hidden() {
            say!("{text}");
        } else {
            self.bar.println(text);
        }
    }
}

impl Observer for Progress {
    fn on_step(&mut self, metrics: &StepMetrics, _total_steps: usize) {
        if crate::ranks::injected_fault(self.rank, metrics.step) {
            eprintln!(
                "rank {}: PADFREE_FAULT: exiting after step {}",
                self.rank, metrics.step
            );
            std::process::exit(1);
        }
        self.bar.set_position(metrics.step as u64);
        self.bar.set_message(format!(
            "{:.2} it/s, {:.0} tok/s, loss {:.4}",
            1.0 / metrics.seconds.max(1e-9),
            metrics.real_tokens as f64 / metrics.seconds.max(1e-9),
            metrics.loss
        ));
    }

    fn on_log(&mut self, record: &LogRecord) {
        self.line(&record.to_string());
    }

    fn on_save(&mut self, dir: &Path) {
        lock(&self.signals).last_saved = Some(dir.to_owned());
        self.line(&format!("saved {}", dir.display()));
    }

    fn on_writing(&mut self, writing: bool) {
        let mut signals = lock(&self.signals);
        signals.writing = writing;
        if !writing && signals.quit_after_write {
            eprintln!(
                "the write is complete: quitting (second Ctrl-C){}",
                signals.last_saved()
            );
            std::process::exit(i32::from(INTERRUPTED_EXIT));
        }
        drop(signals);
        if let (true, Some(delay)) = (writing, self.write_delay) {
            eprintln!("PADFREE_WRITE_DELAY_MS: writing");
            std::thread::sleep(delay);
        }
    }

    fn on_note(&mut self, note: &str) {
        self.line(&format!("note: {note}"));
    }

    fn on_remove(&mut self, dir: &Path) {
        self.line(&format!("removed {} (--save-total-limit)", dir.display()));
    }

    fn stop_requested(&self) -> bool {
        lock(&self.signals).stop
    }
}

#[cfg(test)]
mod tests {
    use super::out_of_device_memory;

    #[test]
    fn a_runtimes_out_of_memory_panic_is_recognised_with_its_figures() {
        let cubecl = "out of device memory allocating 4294967296 bytes\nBacktrace\n  0: ...";
        assert_eq!(
            out_of_device_memory(cubecl).as_deref(),
            Some("out of device memory allocating 4294967296 bytes")
        );
        let launch = "An out-of-memory error happened during launch\nCaused by:\n  pool exhausted";
        assert!(out_of_device_memory(launch).is_some());
        assert_eq!(
            out_of_device_memory("index out of bounds: the len is 3"),
            None
        );
    }
}
