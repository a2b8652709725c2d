//! `padfree bench`: the same model, data and steps trained in each attention
//! mode, each in its own process (so peak memory is that mode's own), and the
//! reference system's table: runtime, real and fed tokens/s, padding, samples/s,
//! peak memory, final loss; written as markdown, JSON and a PNG bar chart.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use padfree_data::{FieldNames, Overlong};
use padfree_train::checkpoint::write_atomically;
use padfree_train::{
    AttentionMode, Batching, SaveStrategy, SchedulerKind, TrainConfig, Trainer, Warmup,
    peak_memory_bytes,
};
use serde::{Deserialize, Serialize};

use crate::train;
use crate::train_args::{AttentionArg, ModelSource, TrainJob, default_output_dir, utc_timestamp};

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// A model to benchmark: an HF directory or a .gguf file (default: --config).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A preset (tiny, small) or config.json, randomly initialised.
    #[arg(long, default_value = "small")]
    pub config: String,
    /// tokenizer.json or .gguf (default: the model's, or the shipped one).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Training data (default: the shipped maths set).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Examples per batch.
    #[arg(long, default_value_t = 8)]
    pub per_device_train_batch_size: usize,
    /// Timed optimizer steps per mode.
    #[arg(long, default_value_t = 20)]
    pub max_steps: usize,
    /// Steps run first in every mode and left out of the timing.
    #[arg(long, default_value_t = 2)]
    pub timing_warmup_steps: usize,
    /// CPU threads of every run (RAYON_NUM_THREADS); default: all cores.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Modes to run, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [AttentionArg::Padded, AttentionArg::VarlenPerLayer, AttentionArg::Varlen])]
    pub modes: Vec<AttentionArg>,
    #[arg(long, default_value_t = 1e-3)]
    pub learning_rate: f64,
    /// Seeds initialisation and data order (the same in every mode).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    #[arg(long, default_value_t = 2048)]
    pub max_seq_len: usize,
    /// Where bench.md, bench.json and bench.png go (default runs/bench-<time>).
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Runs of every mode; the table shows each mode's median run (by real
    /// tokens/s) and the range over all runs. Rounds alternate the modes, so
    /// a slow spell of the machine is spread over all of them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Also run Hugging Face's Trainer, with the Python of `.venv-peer/` in
    /// the repository, made first by `bench/hf_peer/setup.sh` when missing
    /// (torch and transformers from PyPI: several GB).
    #[arg(long, conflicts_with = "peer_python")]
    pub peer: bool,
    /// Also run Hugging Face's Trainer (bench/hf_peer/hf_peer.py) with this
    /// Python, padded and with DataCollatorWithFlattening, on the same batches,
    /// initial weights, settings and threads.
    #[arg(long)]
    pub peer_python: Option<PathBuf>,
    /// Internal: run one mode in this process and write its result here.
    #[arg(long, hide = true, requires = "child_result")]
    pub child_mode: Option<AttentionArg>,
    #[arg(long, hide = true)]
    pub child_result: Option<PathBuf>,
}

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
    pub final_loss: f64,
    pub step_losses: Vec<f64>,
}

fn label(mode: &str) -> &str {
    match mode {
        "padded" => "padfree, padded",
        "varlen-per-layer" => "padfree, padding-free, metadata derived in every layer",
        "varlen" => "padfree, padding-free, metadata from the collator",
        "hf-padded" => "HF transformers, padded",
        "hf-flattening" => "HF transformers, DataCollatorWithFlattening",
        other => other,
    }
}

impl BenchArgs {
    fn job(&self, mode: AttentionMode) -> anyhow::Result<TrainJob> {
        if self.max_steps == 0 {
            bail!("--max-steps must be at least 1");
        }
        let model = match &self.model {
            Some(path) => ModelSource::from_model_path(path),
            None => ModelSource::Init(self.config.clone()),
        };
        let train = TrainConfig {
            attention: mode,
            batching: Batching::Examples(self.per_device_train_batch_size),
            learning_rate: self.learning_rate,
            lr_scheduler_type: SchedulerKind::Linear,
            warmup: Warmup::Steps(0),
            max_steps: Some(self.timing_warmup_steps + self.max_steps),
            seed: self.seed,
            logging_steps: usize::MAX,
            save_strategy: SaveStrategy::No,
            ..TrainConfig::default()
        };
        train.validate()?;
        Ok(TrainJob {
            embedded_default: false,
            model,
            tokenizer: self.tokenizer.clone(),
            data: self.data.clone(),
            output_dir: PathBuf::new(),
            overwrite_output_dir: false,
            resume_from_checkpoint: None,
            fields: FieldNames::default(),
            train_on_inputs: false,
            use_chat_template: false,
            max_seq_len: self.max_seq_len,
            overlong: Overlong::Truncate,
            gradient_checkpointing: false,
            train,
        })
    }

    /// The flags a child process gets: everything that shapes the run.
    fn child_args(&self, mode: AttentionArg, result: &Path) -> Vec<String> {
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
            (
                "--timing-warmup-steps",
                self.timing_warmup_steps.to_string(),
            ),
            ("--learning-rate", self.learning_rate.to_string()),
            ("--seed", self.seed.to_string()),
            ("--max-seq-len", self.max_seq_len.to_string()),
            ("--child-mode", mode_name(mode).to_owned()),
            ("--child-result", result.display().to_string()),
        ] {
            args.push(flag.into());
            args.push(value);
        }
        args
    }
}

fn mode_name(arg: AttentionArg) -> &'static str {
    AttentionMode::from(arg).name()
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    if let (Some(mode), Some(result)) = (args.child_mode, &args.child_result) {
        return run_child(args, AttentionMode::from(mode), result);
    }
    let output_dir = args.output_dir.clone().unwrap_or_else(|| {
        let train_dir = default_output_dir();
        let name = train_dir
            .file_name()
            .map(|n| n.to_string_lossy().replace("train-", "bench-"));
        PathBuf::from("runs").join(name.unwrap_or_else(|| "bench".into()))
    });
    std::fs::create_dir_all(&output_dir)
        .with_context(|| format!("creating {}", output_dir.display()))?;
    let peer_python = match (&args.peer_python, args.peer) {
        (Some(python), _) => Some(python.clone()),
        (None, true) => Some(peer_environment()?),
        (None, false) => None,
    };
    let peer = match &peer_python {
        Some(python) => Some((python.as_path(), export_peer(args, &output_dir)?)),
        None => None,
    };
    let mut runs = Vec::new();
    for round in 1..=args.repeats {
        if args.repeats > 1 {
            println!("round {round} of {}", args.repeats);
        }
        for &mode in &args.modes {
            runs.push(run_mode(args, mode, &output_dir)?);
        }
        if let Some((python, peer_dir)) = &peer {
            for mode in ["padded", "flattening"] {
                runs.push(run_peer_mode(args, python, peer_dir, mode)?);
            }
        }
    }
    let report = Report::new(args, runs);
    println!("\n{}", report.table());
    println!("{}", report.findings());
    report.write(&output_dir)?;
    println!(
        "\nwrote {}/bench.md, bench.json, bench.png",
        output_dir.display()
    );
    Ok(())
}

/// One padfree mode in a child process.
fn run_mode(args: &BenchArgs, mode: AttentionArg, output_dir: &Path) -> anyhow::Result<ModeResult> {
    let exe = std::env::current_exe().context("finding the padfree binary")?;
    let result_path = output_dir.join(format!(".result-{}.json", mode_name(mode)));
    println!(
        "running {} ({} + {} steps) ...",
        label(mode_name(mode)),
        args.timing_warmup_steps,
        args.max_steps
    );
    let mut command = Command::new(&exe);
    command.args(args.child_args(mode, &result_path));
    command.env("RAYON_NUM_THREADS", threads(args).to_string());
    let output = command.output().context("starting a benchmark run")?;
    if !output.status.success() {
        bail!(
            "the {} run failed:\n{}{}",
            mode_name(mode),
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

/// The repository this binary was built from (the peer's script lives there).
fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python of `.venv-peer/`, made by `bench/hf_peer/setup.sh` if missing.
fn peer_environment() -> anyhow::Result<PathBuf> {
    let root = repository();
    let python = root.join(".venv-peer/bin/python");
    if python.is_file() {
        return Ok(python);
    }
    let setup = root.join("bench/hf_peer/setup.sh");
    println!(
        "making {} with {} (torch and transformers from PyPI; several GB, minutes) ...",
        root.join(".venv-peer").display(),
        setup.display()
    );
    let status = Command::new("bash")
        .arg(&setup)
        .status()
        .with_context(|| format!("running {}", setup.display()))?;
    if !status.success() || !python.is_file() {
        bail!(
            "{} failed ({status})\nHINT: it needs python3 with venv and pip, and PyPI; or pass --peer-python with an environment that has torch 2.15 and transformers 5.24",
            setup.display()
        );
    }
    Ok(python)
}

fn threads(args: &BenchArgs) -> usize {
    args.threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Exports the initial weights, batches and settings every padfree mode
/// trains with, for the HF peer; returns the folder.
fn export_peer(args: &BenchArgs, output_dir: &Path) -> anyhow::Result<PathBuf> {
    let peer_dir = output_dir.join("peer");
    let job = args.job(AttentionMode::Varlen)?;
    let loaded = train::load(&job)?;
    loaded.model.save_hf_dir(&peer_dir.join("model"))?;
    let examples = loaded.dataset.examples.clone();
    let trainer = Trainer::new(
        loaded.model,
        loaded.dataset.examples,
        job.train.clone(),
        &peer_dir,
        Vec::new(),
    )?;
    let mut lines = String::new();
    for step in trainer.plan().steps() {
        let batch: Vec<serde_json::Value> = step.micro_batches.concat().iter().map(|&i| {
            serde_json::json!({"input_ids": examples[i].input_ids(), "labels": examples[i].labels()})
        }).collect();
        lines.push_str(&serde_json::json!({ "examples": batch }).to_string());
        lines.push('\n');
    }
    write_atomically(&peer_dir.join("batches.jsonl"), lines.as_bytes())?;
    let c = &job.train;
    let settings = serde_json::json!({
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "learning_rate": c.learning_rate, "weight_decay": c.weight_decay,
        "adam_beta1": c.adam_beta1, "adam_beta2": c.adam_beta2, "adam_epsilon": c.adam_epsilon,
        "max_grad_norm": c.max_grad_norm, "seed": c.seed, "threads": threads(args),
        "timing_warmup_steps": args.timing_warmup_steps,
    });
    write_atomically(
        &peer_dir.join("settings.json"),
        &serde_json::to_vec_pretty(&settings)?,
    )?;
    Ok(peer_dir)
}

/// One run of the HF peer (`padded` or `flattening`).
fn run_peer_mode(
    args: &BenchArgs,
    python: &Path,
    peer_dir: &Path,
    mode: &str,
) -> anyhow::Result<ModeResult> {
    let script = repository().join("bench/hf_peer/hf_peer.py");
    println!("running HF transformers, {mode} ...");
    let out = peer_dir.join(format!("result-{mode}.json"));
    let output = Command::new(python)
        .arg(&script)
        .args([
            "--peer-dir",
            &peer_dir.display().to_string(),
            "--mode",
            mode,
            "--out",
            &out.display().to_string(),
        ])
        .env("OMP_NUM_THREADS", threads(args).to_string())
        .output()
        .with_context(|| format!("starting {}", python.display()))?;
    if !output.status.success() {
        bail!(
            "the HF peer ({mode}) failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
    Ok(serde_json::from_str::<ModeResult>(&text)?)
}

fn run_child(args: &BenchArgs, mode: AttentionMode, result: &Path) -> anyhow::Result<()> {
    // The trainer wants an output directory; nothing is saved there.
    let scratch = std::env::temp_dir().join(format!("padfree-bench-{}", std::process::id()));
    let outcome = timed_run(args, mode, &scratch);
    std::fs::remove_dir_all(&scratch).ok();
    write_atomically(result, &serde_json::to_vec_pretty(&outcome?)?)?;
    Ok(())
}

/// Trains `mode` for the warm-up and timed steps and measures the timed ones.
fn timed_run(args: &BenchArgs, mode: AttentionMode, scratch: &Path) -> anyhow::Result<ModeResult> {
    let job = args.job(mode)?;
    let loaded = train::load(&job)?;
    let mut trainer = Trainer::new(
        loaded.model,
        loaded.dataset.examples,
        job.train.clone(),
        scratch,
        Vec::new(),
    )?;
    let (mut seconds, mut real, mut fed, mut samples) = (0.0, 0, 0, 0);
    let mut step_losses = Vec::new();
    for step in 0..trainer.plan().len() {
        let metrics = trainer.train_step()?;
        step_losses.push(metrics.loss);
        if step >= args.timing_warmup_steps {
            seconds += metrics.seconds;
            real += metrics.real_tokens;
            fed += metrics.fed_tokens;
            samples += metrics.examples;
        }
    }
    let runtime = f64::max(seconds, 1e-9);
    let outcome = ModeResult {
        mode: mode.name().to_owned(),
        timed_steps: args.max_steps,
        train_runtime: seconds,
        real_tokens: real,
        fed_tokens: fed,
        samples,
        real_tokens_per_second: real as f64 / runtime,
        fed_tokens_per_second: fed as f64 / runtime,
        samples_per_second: samples as f64 / runtime,
        padding_fraction: 1.0 - real as f64 / fed.max(1) as f64,
        peak_memory_bytes: peak_memory_bytes(),
        final_loss: step_losses.last().copied().unwrap_or(f64::NAN),
        step_losses,
    };
    Ok(outcome)
}

/// The table and what follows from it.
#[derive(Debug, Serialize)]
struct Report {
    date: String,
    machine: String,
    command: String,
    threads: String,
    repeats: u32,
    /// Each mode's median run, in the order the modes first ran.
    results: Vec<ModeResult>,
    /// Every run, in the order they ran.
    runs: Vec<ModeResult>,
}

impl Report {
    fn new(args: &BenchArgs, runs: Vec<ModeResult>) -> Self {
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        Self {
            date: utc_timestamp(),
            machine: machine_description(),
            command,
            threads: threads(args).to_string(),
            repeats: args.repeats,
            results: medians(&runs),
            runs,
        }
    }

    /// `min-max` real tokens/s over a mode's runs.
    fn range(&self, mode: &str) -> String {
        let speeds: Vec<f64> = self
            .runs
            .iter()
            .filter(|r| r.mode == mode)
            .map(|r| r.real_tokens_per_second)
            .collect();
        let min = speeds.iter().copied().fold(f64::INFINITY, f64::min);
        let max = speeds.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{min:.0}-{max:.0}")
    }

    fn table(&self) -> String {
        let repeated = self.repeats > 1;
        let (range_head, range_rule) = if repeated {
            (
                format!(" real tokens/s, {} runs |", self.repeats),
                " ---: |",
            )
        } else {
            (String::new(), "")
        };
        let mut lines = vec![
            format!(
                "| mode | train runtime | real tokens/s |{range_head} fed tokens/s | padding | samples/s | peak memory | final loss |"
            ),
            format!("| --- | ---: | ---: |{range_rule} ---: | ---: | ---: | ---: | ---: |"),
        ];
        for r in &self.results {
            let memory = r.peak_memory_bytes.map_or_else(
                || "n/a".to_owned(),
                |b| format!("{:.0} MiB", b as f64 / 1048576.0),
            );
            let range = if repeated {
                format!(" {} |", self.range(&r.mode))
            } else {
                String::new()
            };
            lines.push(format!(
                "| {} | {:.1} s | {:.0} |{range} {:.0} | {:.1}% | {:.2} | {} | {:.6} |",
                label(&r.mode),
                r.train_runtime,
                r.real_tokens_per_second,
                r.fed_tokens_per_second,
                100.0 * r.padding_fraction,
                r.samples_per_second,
                memory,
                r.final_loss
            ));
        }
        lines.join("\n")
    }

    fn findings(&self) -> String {
        let mut out = Vec::new();
        let find = |name: &str| self.results.iter().find(|r| r.mode == name);
        if let (Some(padded), Some(varlen)) = (find("padded"), find("varlen")) {
            let ideal = padded.fed_tokens as f64 / padded.real_tokens.max(1) as f64;
            let speedup = varlen.real_tokens_per_second / padded.real_tokens_per_second;
            out.push(format!(
                "- padding-free (collator metadata) vs padded: {speedup:.3}x real tokens/s; the ideal ratio (fed / real tokens of the padded run) is {ideal:.3}, so {:.1}% of ideal.",
                100.0 * speedup / ideal
            ));
            if let (Some(a), Some(b)) = (padded.peak_memory_bytes, varlen.peak_memory_bytes) {
                out.push(format!(
                    "- peak memory: padding-free {:.0} MiB vs padded {:.0} MiB ({:+.1}%).",
                    b as f64 / 1048576.0,
                    a as f64 / 1048576.0,
                    100.0 * (b as f64 / a as f64 - 1.0)
                ));
            }
        }
        if let (Some(per_layer), Some(varlen)) = (find("varlen-per-layer"), find("varlen")) {
            out.push(format!(
                "- metadata from the collator vs derived in every layer: {:.3}x real tokens/s.",
                varlen.real_tokens_per_second / per_layer.real_tokens_per_second
            ));
        }
        if let (Some(ours), Some(theirs)) = (find("varlen"), find("hf-flattening")) {
            out.push(format!(
                "- padfree padding-free vs HF transformers padding-free (same threads): {:.3}x real tokens/s, peak memory {:.0} vs {:.0} MiB.",
                ours.real_tokens_per_second / theirs.real_tokens_per_second,
                ours.peak_memory_bytes.unwrap_or(0) as f64 / 1048576.0,
                theirs.peak_memory_bytes.unwrap_or(0) as f64 / 1048576.0
            ));
        }
        if let (Some(ours), Some(theirs)) = (find("padded"), find("hf-padded")) {
            out.push(format!(
                "- padfree padded vs HF transformers padded: {:.3}x real tokens/s.",
                ours.real_tokens_per_second / theirs.real_tokens_per_second
            ));
        }
        if let Some(first) = self.results.first() {
            let worst = self
                .results
                .iter()
                .flat_map(|r| {
                    r.step_losses
                        .iter()
                        .zip(&first.step_losses)
                        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
                })
                .fold(0.0, f64::max);
            out.push(format!(
                "- losses agree: every run starts from the same weights and sees the same batches; the largest relative difference of any step's loss from the {} run is {worst:.2e} over {} steps (HF logs losses rounded to 4 decimals).",
                first.mode,
                first.step_losses.len()
            ));
        }
        out.join("\n")
    }

    fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let markdown = format!(
            "# padfree bench, {}\n\nMachine: {}\n\nCommand: `{}`\n\nThreads: {}. Runs of every mode: {} (the table shows each mode's median run by real tokens/s). Every mode runs in its own process from the same initial weights on the same batches; the first steps warm up and are not timed; peak memory is each process's resident high-water mark (VmHWM).\n\n{}\n\n{}\n\nPer-step losses are in bench.json.\n",
            self.date,
            self.machine,
            self.command,
            self.threads,
            self.repeats,
            self.table(),
            self.findings()
        );
        write_atomically(&dir.join("bench.md"), markdown.as_bytes())?;
        write_atomically(&dir.join("bench.json"), &serde_json::to_vec_pretty(self)?)?;
        let bars: Vec<padfree_plot::Bar> = self
            .results
            .iter()
            .map(|r| padfree_plot::Bar {
                label: r.mode.clone(),
                value: r.real_tokens_per_second,
            })
            .collect();
        let png = padfree_plot::bar_chart_png("real tokens per second", "tokens/s", &bars)
            .map_err(anyhow::Error::msg)?;
        write_atomically(&dir.join("bench.png"), &png)?;
        Ok(())
    }
}

/// Each mode's median run by real tokens/s (the lower of the two middle
/// runs when the count is even), modes in the order they first ran.
fn medians(runs: &[ModeResult]) -> Vec<ModeResult> {
    let mut modes: Vec<&str> = Vec::new();
    for run in runs {
        if !modes.contains(&run.mode.as_str()) {
            modes.push(&run.mode);
        }
    }
    modes
        .iter()
        .filter_map(|mode| {
            let mut own: Vec<&ModeResult> = runs.iter().filter(|r| r.mode == *mode).collect();
            own.sort_by(|a, b| {
                a.real_tokens_per_second
                    .total_cmp(&b.real_tokens_per_second)
            });
            own.get((own.len().saturating_sub(1)) / 2)
                .map(|r| (*r).clone())
        })
        .collect()
}

/// CPU model and core count, from /proc/cpuinfo where there is one.
fn machine_description() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU", str::trim)
        .to_owned();
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    format!(
        "{model}, {cores} cores available, {} {}",
        std::env::consts::OS,
        std::env::consts::ARCH
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mode: &str, speed: f64) -> ModeResult {
        ModeResult {
            mode: mode.to_owned(),
            timed_steps: 1,
            train_runtime: 1.0,
            real_tokens: 1,
            fed_tokens: 1,
            samples: 1,
            real_tokens_per_second: speed,
            fed_tokens_per_second: speed,
            samples_per_second: 1.0,
            padding_fraction: 0.0,
            peak_memory_bytes: None,
            final_loss: 1.0,
            step_losses: vec![1.0],
        }
    }

    #[test]
    fn each_mode_is_shown_by_its_median_run_in_first_run_order() {
        let runs = [
            run("b", 30.0),
            run("a", 5.0),
            run("b", 10.0),
            run("a", 7.0),
            run("b", 20.0),
            run("a", 6.0),
            run("a", 8.0),
        ];
        let medians = medians(&runs);
        let shown: Vec<(&str, f64)> = medians
            .iter()
            .map(|r| (r.mode.as_str(), r.real_tokens_per_second))
            .collect();
        // b: 10, 20, 30 -> 20; a: 5, 6, 7, 8 -> the lower middle, 6.
        assert_eq!(shown, vec![("b", 20.0), ("a", 6.0)]);
    }
}
