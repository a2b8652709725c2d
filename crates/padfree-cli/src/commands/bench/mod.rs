//! `padfree bench`: the same model, data and steps trained in each attention
//! mode, each in its own process (so peak memory is that mode's own), and the
//! reference system's table: runtime, real and fed tokens/s, padding, samples/s,
//! peak memory, final loss; written as markdown, JSON and a PNG bar chart.
//!
//! This file runs the modes (parent and child processes); `peer.rs` runs
//! Hugging Face's Trainer on the same weights and batches; `report.rs`
//! renders the table, the findings and the files; `attention.rs` times the
//! attention op alone (`--attention-alone`).

mod attention;
mod peer;
mod report;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use padfree_model::flops::{StepWork, training_flops};
use padfree_train::checkpoint::write_atomically;
use padfree_train::{Communicator, Trainer, peak_memory_bytes};
use serde::{Deserialize, Serialize};

use crate::args::{BenchJob, BenchMode, Peer};
use crate::commands::load;
use report::Report;

/// One mode's measurements (timed steps only, but peak memory is the process's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModeResult {
    pub mode: String,
    pub timed_steps: usize,
    pub train_runtime: f64,
    pub real_tokens: usize,
    pub fed_tokens: usize,
    pub samples: usize,
    pub real_tokens_per_second: f64,
    pub fed_tokens_per_second: f64,
    pub samples_per_second: f64,
    pub padding_fraction: f64,
    pub peak_memory_bytes: Option<u64>,
    /// On a GPU: the most device memory the runtime held after a step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_device_memory_bytes: Option<u64>,
    pub final_loss: f64,
    pub step_losses: Vec<f64>,
    /// Wall seconds of every step, the warm-up's included: a step that
    /// compiled kernels (a GPU's first steps) stands out here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_seconds: Vec<f64>,
    /// Model FLOPs of the timed steps (`padfree_model::flops`); the same
    /// batches give the same count in every mode, so rows that lack it (the
    /// HF peer's) take it from a padfree row.
    #[serde(default)]
    pub model_flops: Option<f64>,
}

impl BenchJob {
    /// The flags a child process gets: everything that shapes the run.
    fn child_args(&self, mode: BenchMode, result: &Path) -> Vec<String> {
        let mut args: Vec<String> = vec!["bench".into(), "--config".into(), self.config.clone()];
        let mut path = |flag: &str, value: &Option<PathBuf>| {
            if let Some(value) = value {
                args.push(flag.into());
                args.push(value.display().to_string());
            }
        };
        path("--model", &self.model);
        path("--tokenizer", &self.tokenizer);
        path("--data", &self.data);
        for (flag, value) in [
            (
                "--per-device-train-batch-size",
                self.per_device_train_batch_size.to_string(),
            ),
            ("--max-steps", self.max_steps.to_string()),
            ("--device", self.device.to_string()),
            (
                "--timing-warmup-steps",
                self.timing_warmup_steps.to_string(),
            ),
            ("--learning-rate", self.learning_rate.to_string()),
            ("--seed", self.seed.to_string()),
            ("--max-seq-len", self.max_seq_len.to_string()),
            ("--threads", self.threads.to_string()),
            (
                "--multipack-bins-per-step",
                self.multipack_bins_per_step.to_string(),
            ),
            ("--child-mode", mode.name()),
            ("--child-result", result.display().to_string()),
        ] {
            args.push(flag.into());
            args.push(value);
        }
        if let Some(lora) = &self.lora {
            args.extend(crate::args::LoraArgs::flags(lora));
        }
        if self.gradient_checkpointing {
            args.push("--gradient-checkpointing".into());
        }
        if self.precision == padfree_model::Precision::Bf16 {
            args.push("--bf16".into());
        }
        args
    }
}

pub fn run(args: &BenchJob) -> anyhow::Result<()> {
    if let Some(child) = &args.child {
        return run_child(args, child.mode, &child.result);
    }
    if args.attention_alone {
        return attention::run(args);
    }
    let output_dir = args.output_dir.clone();
    check_writable(&output_dir)?;
    let peer_python = match &args.peer {
        Some(Peer::Python(python)) => Some(python.clone()),
        Some(Peer::Setup) => Some(peer::environment()?),
        None => None,
    };
    let peer = match &peer_python {
        Some(python) => Some((python.as_path(), peer::export(args, &output_dir)?)),
        None => None,
    };
    let mut peak = measure_peak(
        args.threads,
        args.precision == padfree_model::Precision::Bf16,
    )?;
    println!(
        "calibration: a {CALIBRATION_SIZE}x{CALIBRATION_SIZE} f32 matmul through burn's Flex backend runs at {:.1} GFLOP/s on {} threads{}",
        peak.calibrated_gflops,
        args.threads,
        peak.theoretical
            .as_ref()
            .map_or_else(String::new, |t| format!(
                "; theoretical peak {:.1} GFLOP/s ({})",
                t.gflops, t.what
            ))
    );
    if let Some(bf16) = peak.calibrated_bf16_gflops {
        println!(
            "calibration: the same product with bf16 operands ({}) runs at {bf16:.1} GFLOP/s",
            padfree_model::Precision::cpu_matmul_body()
        );
    }
    let mut runs = Vec::new();
    // A run that fails leaves the others standing: they are reported, the
    // failure beside them, and the command then fails.
    let mut failures: Vec<Failure> = Vec::new();
    let mut keep = |mode: String, result: anyhow::Result<ModeResult>| match result {
        Ok(run) => runs.push(run),
        Err(err) => {
            eprintln!("error: the {mode} run failed: {err:#}");
            failures.push(Failure {
                mode,
                error: last_lines(&format!("{err:#}"), 20),
            });
        }
    };
    for round in 1..=args.repeats {
        if args.repeats > 1 {
            println!("round {round} of {}", args.repeats);
        }
        for &mode in &args.modes {
            keep(mode.name(), run_mode(args, mode, &output_dir));
        }
        if let Some((python, peer_dir)) = &peer {
            for mode in ["padded", "flattening"] {
                keep(
                    format!("hf-{mode}"),
                    peer::run_mode(args, python, peer_dir, mode),
                );
            }
        }
    }
    // A shared machine's speed drifts; calibrating again after the runs and
    // taking the faster of the two keeps MFU from being inflated by a slow
    // moment during the first calibration.
    peak.calibrate_again(args.threads)?;
    println!(
        "calibration after the runs: {:.1} GFLOP/s; MFU is against {:.1}",
        peak.calibrated_after, peak.calibrated_gflops
    );
    let report = Report::new(args, runs, failures, peak);
    println!("\n{}", report.table());
    println!("{}", report.findings());
    report.write(&output_dir)?;
    println!(
        "\nwrote {}/bench.md, bench.json{}",
        output_dir.display(),
        if report.has_results() {
            ", bench.png"
        } else {
            ""
        }
    );
    if let Some(first) = report.failures().first() {
        bail!(
            "{} of the runs failed ({}); the others are in {}/bench.md\n{}",
            report.failures().len(),
            report
                .failures()
                .iter()
                .map(|f| f.mode.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            output_dir.display(),
            first.error
        );
    }
    Ok(())
}

/// A run that failed, and the end of what it said.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub mode: String,
    pub error: String,
}

/// The last `count` lines of `text`.
fn last_lines(text: &str, count: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    lines[lines.len().saturating_sub(count)..].join("\n")
}

/// Refuses an output directory the reports could not be written to, before
/// any run: found after minutes of training otherwise.
fn check_writable(dir: &Path) -> anyhow::Result<()> {
    let hint = "HINT: choose a directory this user can create and write (--output-dir)";
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--output-dir {}: cannot be created\n{hint}", dir.display()))?;
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|err| {
            anyhow::anyhow!(
                "--output-dir {}: not writable: {err}\n{hint}",
                dir.display()
            )
        })
}

/// Side of the calibration matmul: large enough for gemm's best blocking.
const CALIBRATION_SIZE: usize = 1024;

/// The peaks MFU is measured against.
#[derive(Debug, Clone, Serialize)]
pub struct Peak {
    /// The calibration matmul's GFLOP/s on the benchmark's threads: the
    /// higher of the calibrations before and after the runs.
    pub calibrated_gflops: f64,
    /// The calibration before the runs.
    pub calibrated_before: f64,
    /// The calibration after the runs (equal to `calibrated_before` until
    /// [`Peak::calibrate_again`]).
    pub calibrated_after: f64,
    /// Cores x clock x FLOPs per cycle, where the CPU says.
    pub theoretical: Option<TheoreticalPeak>,
    /// Under `--bf16`: the same calibration through the bf16 kernel (the
    /// higher of before and after the runs).
    pub calibrated_bf16_gflops: Option<f64>,
}

/// The theoretical peak and how it was computed.
#[derive(Debug, Clone, Serialize)]
pub struct TheoreticalPeak {
    pub gflops: f64,
    pub what: String,
}

/// The calibration matmul's GFLOP/s, best of 5, on a pool of `threads`
/// threads, as every run gets.
fn calibrate(threads: usize) -> anyhow::Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("starting the calibration threads")?;
    Ok(pool.install(|| padfree_model::flops::calibrate_matmul_gflops(CALIBRATION_SIZE, 5)))
}

impl Peak {
    /// Calibrates once more and keeps the higher rate.
    fn calibrate_again(&mut self, threads: usize) -> anyhow::Result<()> {
        self.calibrated_after = calibrate(threads)?;
        self.calibrated_gflops = self.calibrated_before.max(self.calibrated_after);
        if let Some(before) = self.calibrated_bf16_gflops {
            self.calibrated_bf16_gflops = Some(before.max(calibrate_bf16(threads)?));
        }
        Ok(())
    }
}

fn calibrate_bf16(threads: usize) -> anyhow::Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("starting the calibration threads")?;
    Ok(pool.install(|| padfree_model::flops::calibrate_bf16_matmul_gflops(CALIBRATION_SIZE, 5)))
}

fn measure_peak(threads: usize, bf16: bool) -> anyhow::Result<Peak> {
    let calibrated_gflops = calibrate(threads)?;
    let calibrated_bf16_gflops = if bf16 {
        Some(calibrate_bf16(threads)?)
    } else {
        None
    };
    let theoretical = padfree_model::flops::CpuPeak::detect().map(|cpu| TheoreticalPeak {
        gflops: cpu.gflops(threads),
        what: format!(
            "{threads} cores x {:.2} GHz x {} f32 FLOPs/cycle ({}, 2 FMA units)",
            cpu.ghz, cpu.flops_per_cycle, cpu.vector_isa
        ),
    });
    Ok(Peak {
        calibrated_gflops,
        calibrated_before: calibrated_gflops,
        calibrated_after: calibrated_gflops,
        theoretical,
        calibrated_bf16_gflops,
    })
}

/// One padfree mode in a child process.
fn run_mode(args: &BenchJob, mode: BenchMode, output_dir: &Path) -> anyhow::Result<ModeResult> {
    let exe = std::env::current_exe().context("finding the padfree binary")?;
    let result_path = output_dir.join(format!(".result-{}.json", mode.name()));
    println!(
        "running {} ({} + {} steps) ...",
        report::label(&mode.name()),
        args.timing_warmup_steps,
        args.max_steps
    );
    let mut command = if mode.ranks > 1 {
        let mut command = Command::new(&args.mpirun);
        command
            .args(["-np", &mode.ranks.to_string(), "--bind-to", "none"])
            .arg("--oversubscribe")
            .arg(&exe);
        command
    } else {
        Command::new(&exe)
    };
    command.args(args.child_args(mode, &result_path));
    command.env(
        "RAYON_NUM_THREADS",
        (args.threads / mode.ranks).max(1).to_string(),
    );
    let output = command.output().with_context(|| {
        if mode.ranks > 1 {
            format!(
                "starting `{} -np {}` for the {} run\nHINT: install Open MPI (Debian: openmpi-bin) or give --mpirun",
                args.mpirun.display(),
                mode.ranks,
                mode.name()
            )
        } else {
            "starting a benchmark run".to_owned()
        }
    })?;
    if !output.status.success() {
        bail!(
            "the {} run failed:\n{}{}",
            mode.name(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = std::fs::read_to_string(&result_path)
        .with_context(|| format!("reading {}", result_path.display()))?;
    let result = serde_json::from_str::<ModeResult>(&text)?;
    std::fs::remove_file(&result_path).ok();
    Ok(result)
}

fn run_child(args: &BenchJob, mode: BenchMode, result: &Path) -> anyhow::Result<()> {
    // One process, or one rank of `mpirun -np ranks`.
    let comm = crate::ranks::communicator()?;
    if comm.world_size() != mode.ranks {
        bail!(
            "the {} run started as {} ranks",
            mode.name(),
            comm.world_size()
        );
    }
    let lead = comm.rank() == 0;
    // The trainer wants an output directory; nothing is saved there.
    let scratch = std::env::temp_dir().join(format!("padfree-bench-{}", std::process::id()));
    let outcome = timed_run(args, mode, comm, &scratch);
    std::fs::remove_dir_all(&scratch).ok();
    let outcome = outcome?;
    if lead {
        write_atomically(result, &serde_json::to_vec_pretty(&outcome)?)?;
    }
    Ok(())
}

/// Trains `mode` for the warm-up and timed steps and measures the timed ones.
/// On several ranks the figures are the job's: real and fed tokens and
/// samples summed over ranks, the time of rank 0 (which waits for the others
/// in every step's gradient sum), peak memory summed over the processes.
fn timed_run(
    args: &BenchJob,
    mode: BenchMode,
    comm: Box<dyn Communicator>,
    scratch: &Path,
) -> anyhow::Result<ModeResult> {
    let job = args.train_job(mode)?;
    let loaded = load::load(&job, None)?;
    let config = loaded.model.config().clone();
    let mut model_flops = 0.0;
    let lengths = loaded.dataset.examples.lengths();
    let (source, locations) = (loaded.dataset.source, loaded.dataset.locations);
    let mut trainer = Trainer::new_on(
        comm,
        loaded.model,
        loaded.dataset.examples,
        job.train_config(&lengths),
        scratch,
        Vec::new(),
    )
    .map_err(|err| load::with_record(err, &source, &locations))?;
    trainer.set_gradient_checkpointing(job.gradient_checkpointing);
    let (mut seconds, mut real, mut fed, mut samples) = (0.0, 0, 0, 0);
    let (mut step_losses, mut step_seconds) = (Vec::new(), Vec::new());
    for step in 0..trainer.plan().len() {
        let metrics = trainer.train_step()?;
        step_losses.push(metrics.loss);
        step_seconds.push(metrics.seconds);
        if step >= args.timing_warmup_steps {
            seconds += metrics.seconds;
            // The step's figures are global (every rank's micro-batches).
            real += metrics.real_tokens;
            fed += metrics.fed_tokens;
            samples += metrics.examples;
            model_flops += training_flops(
                &config,
                StepWork {
                    real_tokens: metrics.real_tokens,
                    sum_squared_lengths: metrics.sum_squared_lengths,
                    label_tokens: metrics.label_tokens,
                },
            );
        }
    }
    let runtime = f64::max(seconds, 1e-9);
    let outcome = ModeResult {
        mode: mode.name(),
        timed_steps: args.max_steps,
        train_runtime: seconds,
        real_tokens: real,
        fed_tokens: fed,
        samples,
        real_tokens_per_second: real as f64 / runtime,
        fed_tokens_per_second: fed as f64 / runtime,
        samples_per_second: samples as f64 / runtime,
        padding_fraction: 1.0 - real as f64 / fed.max(1) as f64,
        peak_memory_bytes: job_peak_memory(trainer.communicator())?,
        peak_device_memory_bytes: trainer.device_memory_peak(),
        final_loss: step_losses.last().copied().unwrap_or(f64::NAN),
        step_losses,
        step_seconds,
        model_flops: Some(model_flops),
    };
    Ok(outcome)
}

/// The peak resident memory of the whole job: every rank's, summed.
fn job_peak_memory(comm: &dyn Communicator) -> anyhow::Result<Option<u64>> {
    let own = peak_memory_bytes();
    // [bytes, ranks that could tell]
    let mut sum = [own.unwrap_or(0) as f64, f64::from(u8::from(own.is_some()))];
    comm.all_reduce_sum_f64(&mut sum)?;
    Ok((sum[1] as usize == comm.world_size()).then_some(sum[0] as u64))
}
