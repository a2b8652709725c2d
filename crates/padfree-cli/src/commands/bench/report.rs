//! The `padfree bench` report: the table (each mode's median run, the range
//! over runs), the findings against the reference system's claims, and
//! `bench.md`, `bench.json`, `bench.png`.

use std::path::Path;

use padfree_train::checkpoint::write_atomically;
use padfree_train::clock::utc_timestamp;
use serde::Serialize;

use super::{Failure, ModeResult, Peak};
use crate::args::{BenchJob, BenchMode};

/// The relative difference two runs' step losses may have and still
/// "agree": `padfree-train/tests/training.rs` and `tests/bf16.rs` hold
/// padded and padding-free training to it over 10-20 steps.
const LOSS_AGREEMENT: f64 = 1e-4;
/// Half a unit of the 4th decimal: HF logs its losses rounded to 4.
const HF_ROUNDING: f64 = 5e-5;
/// HF's `bf16=True` rows against padfree's `--bf16` ones: other kernels
/// round other intermediates to bf16 (oneDNN's blocked products, SDPA's
/// probabilities), a noise of bf16's 3 decimal digits that the steps
/// compound. `padfree-train/tests/bf16.rs` holds bf16 to f32 losses within
/// this over 20 steps; issue 34's target is 2% after 20 steps.
const BF16_PEER_AGREEMENT: f64 = 2e-3;

/// How far runs' step losses are from the first run's: whether every
/// step is within its tolerance ([`LOSS_AGREEMENT`] relative, plus
/// [`HF_ROUNDING`] for HF's rows, `hf-*`, and [`BF16_PEER_AGREEMENT`]
/// relative for HF's bf16 rows, `hf-*-bf16`), and the largest relative
/// difference with its step (1-based) and mode.
fn loss_agreement<'a>(runs: &[(&'a str, &[f64])]) -> (bool, f64, usize, &'a str) {
    let Some(&(first_mode, first)) = runs.first() else {
        return (true, 0.0, 0, "");
    };
    let mut worst = (0.0f64, 0, first_mode);
    let mut within = true;
    for &(mode, losses) in runs {
        let (relative, rounding) = match mode {
            hf if hf.starts_with("hf-") && hf.ends_with("-bf16") => {
                (BF16_PEER_AGREEMENT, HF_ROUNDING)
            }
            hf if hf.starts_with("hf-") => (LOSS_AGREEMENT, HF_ROUNDING),
            _ => (LOSS_AGREEMENT, 0.0),
        };
        for (step, (a, b)) in losses.iter().zip(first).enumerate() {
            within &= (a - b).abs() <= relative * b.abs() + rounding;
            let relative = (a - b).abs() / b.abs().max(1e-12);
            if relative > worst.0 {
                worst = (relative, step + 1, mode);
            }
        }
    }
    (within, worst.0, worst.1, worst.2)
}

/// The row name of a mode in the table.
pub(super) fn label(mode: &str) -> String {
    if let Some((one_process, ranks)) = on_ranks(mode) {
        return format!("{}, {ranks} MPI ranks", label(&one_process));
    }
    if let Some(f32_mode) = mode.strip_suffix("-bf16") {
        return format!("{}, bf16=True", label(f32_mode));
    }
    match mode {
        "padded" => "padfree, padded",
        "varlen-per-layer" => "padfree, padding-free, metadata derived in every layer",
        "varlen" => "padfree, padding-free, metadata from the collator",
        "varlen-multipack" => "padfree, padding-free, multipack bins",
        "padded-multipack" => "padfree, padded, multipack bins",
        "hf-padded" => "HF transformers, padded",
        "hf-flattening" => "HF transformers, DataCollatorWithFlattening",
        other => other,
    }
    .to_owned()
}

fn threads(count: usize) -> String {
    if count == 1 {
        "1 thread".to_owned()
    } else {
        format!("{count} threads")
    }
}

/// A mode on several ranks: the name of the same mode in one process, and
/// the rank count.
fn on_ranks(mode: &str) -> Option<(String, usize)> {
    let parsed = mode.parse::<BenchMode>().ok().filter(|m| m.ranks > 1)?;
    Some((BenchMode { ranks: 1, ..parsed }.name(), parsed.ranks))
}

/// Which rows train on the same batches, so their losses must agree: fixed
/// batches (padfree's and HF's), or multipack bins (one process or ranks).
fn batching(mode: &str) -> &'static str {
    if mode.contains("-multipack") {
        "multipack bins"
    } else {
        "fixed batches"
    }
}

/// The table and what follows from it.
#[derive(Debug, Serialize)]
pub(super) struct Report {
    date: String,
    machine: String,
    command: String,
    threads: String,
    /// Threads of a one-process run (a run on N ranks gives each 1/N).
    #[serde(skip)]
    job_threads: usize,
    repeats: u32,
    /// What trains: every weight, or LoRA adapters (and on which base).
    training: String,
    /// What MFU is measured against.
    peak: Peak,
    /// Each mode's median run, in the order the modes first ran.
    results: Vec<ModeResult>,
    /// Every run, in the order they ran.
    runs: Vec<ModeResult>,
    /// The runs that failed, with the end of what they said.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    failures: Vec<Failure>,
}

/// The memory a run's findings compare: on a GPU the device's (padfree's
/// runtime pools there; HF's peer on CUDA reports CUDA's peak as its only
/// figure), else the process's resident high-water mark.
fn compared_memory(run: &ModeResult) -> Option<u64> {
    run.peak_device_memory_bytes.or(run.peak_memory_bytes)
}

/// What [`compared_memory`] measured, in the findings' words.
fn memory_label(run: &ModeResult) -> &'static str {
    if run.peak_device_memory_bytes.is_some() {
        "device memory"
    } else {
        "peak memory"
    }
}

/// A timed step this many times the median one is called out.
const SLOW_STEP: f64 = 3.0;

/// A finding when one of `run`'s timed steps took [`SLOW_STEP`] times the
/// median or more: a kernel compiled late (a GPU's runtime compiles on
/// first use, some kernels per shape) or another process got in, and the
/// run's figure holds it.
fn uneven_steps(run: &ModeResult) -> Option<String> {
    let timed = run.step_seconds.len().checked_sub(run.timed_steps)?;
    let mut seconds = run.step_seconds[timed..].to_vec();
    if seconds.len() < 2 {
        return None;
    }
    seconds.sort_by(f64::total_cmp);
    let median = seconds[seconds.len() / 2];
    let slowest = seconds[seconds.len() - 1];
    (slowest >= SLOW_STEP * median && median > 0.0).then(|| {
        format!(
            "- {}: its slowest timed step took {:.1}x the median ({slowest:.3} s vs {median:.3} s): a kernel compiled late or another process ran; more --timing-warmup-steps, or `step_seconds` in bench.json, tell which.",
            label(&run.mode),
            slowest / median
        )
    })
}

impl Report {
    pub(super) fn new(
        args: &BenchJob,
        mut runs: Vec<ModeResult>,
        failures: Vec<Failure>,
        peak: Peak,
    ) -> Self {
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        // Every run trains on the same batches: one count serves all.
        let model_flops = runs.iter().find_map(|r| r.model_flops);
        for run in &mut runs {
            run.model_flops = run.model_flops.or(model_flops);
        }
        Self {
            date: utc_timestamp(),
            machine: machine_description(),
            command,
            threads: args.threads.to_string(),
            job_threads: args.threads,
            repeats: args.repeats,
            training: training(args),
            peak,
            results: medians(&runs),
            runs,
            failures,
        }
    }

    /// The runs that failed.
    pub(super) fn failures(&self) -> &[Failure] {
        &self.failures
    }

    /// Whether any run finished.
    pub(super) fn has_results(&self) -> bool {
        !self.results.is_empty()
    }

    /// The failed runs as markdown, empty when none failed.
    fn failures_section(&self) -> String {
        if self.failures.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "\n## Runs that failed\n\nThe table above holds the runs that finished.\n",
        );
        for failure in &self.failures {
            out.push_str(&format!(
                "\n- `{}`:\n\n```\n{}\n```\n",
                failure.mode, failure.error
            ));
        }
        out
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

    pub(super) fn table(&self) -> String {
        let repeated = self.repeats > 1;
        let (range_head, range_rule) = if repeated {
            (
                format!(" real tokens/s, {} runs |", self.repeats),
                " ---: |",
            )
        } else {
            (String::new(), "")
        };
        let bf16_peak = self.peak.calibrated_bf16_gflops;
        let (bf16_head, bf16_rule) = if bf16_peak.is_some() {
            (" MFU vs bf16 calibration |", " ---: |")
        } else {
            ("", "")
        };
        let mut lines = vec![
            format!(
                "| mode | train runtime | real tokens/s |{range_head} fed tokens/s | padding | samples/s | peak memory | model GFLOP/s | MFU vs calibration |{bf16_head} MFU vs theoretical | final loss |"
            ),
            format!(
                "| --- | ---: | ---: |{range_rule} ---: | ---: | ---: | ---: | ---: | ---: |{bf16_rule} ---: | ---: |"
            ),
        ];
        for r in &self.results {
            let mut memory = r.peak_memory_bytes.map_or_else(
                || "n/a".to_owned(),
                |b| format!("{:.0} MiB", b as f64 / 1048576.0),
            );
            if let Some(device) = r.peak_device_memory_bytes {
                memory = format!("{memory} (device {:.0} MiB)", device as f64 / 1048576.0);
            }
            let range = if repeated {
                format!(" {} |", self.range(&r.mode))
            } else {
                String::new()
            };
            let gflops = self.model_gflops(r);
            let percent = |peak: Option<f64>| match (gflops, peak) {
                (Some(achieved), Some(peak)) => format!("{:.1}%", 100.0 * achieved / peak),
                _ => "n/a".to_owned(),
            };
            let bf16_mfu = if bf16_peak.is_some() {
                format!(" {} |", percent(bf16_peak))
            } else {
                String::new()
            };
            lines.push(format!(
                "| {} | {:.1} s | {:.0} |{range} {:.0} | {:.1}% | {:.2} | {} | {} | {} |{bf16_mfu} {} | {:.6} |",
                label(&r.mode),
                r.train_runtime,
                r.real_tokens_per_second,
                r.fed_tokens_per_second,
                100.0 * r.padding_fraction,
                r.samples_per_second,
                memory,
                gflops.map_or_else(|| "n/a".to_owned(), |g| format!("{g:.1}")),
                percent(Some(self.peak.calibrated_gflops)),
                percent(self.peak.theoretical.as_ref().map(|t| t.gflops)),
                r.final_loss
            ));
        }
        lines.join("\n")
    }

    /// Achieved model GFLOP/s of a run.
    fn model_gflops(&self, run: &ModeResult) -> Option<f64> {
        run.model_flops
            .map(|flops| flops / run.train_runtime.max(1e-9) / 1e9)
    }

    pub(super) fn findings(&self) -> String {
        let mut out = Vec::new();
        let find = |name: &str| self.results.iter().find(|r| r.mode == name);
        if let (Some(padded), Some(varlen)) = (find("padded"), find("varlen")) {
            let ideal = padded.fed_tokens as f64 / padded.real_tokens.max(1) as f64;
            let speedup = varlen.real_tokens_per_second / padded.real_tokens_per_second;
            out.push(format!(
                "- padding-free (collator metadata) vs padded: {speedup:.3}x real tokens/s; the ideal ratio (fed / real tokens of the padded run) is {ideal:.3}, so {:.1}% of ideal.",
                100.0 * speedup / ideal
            ));
            if let (Some(a), Some(b)) = (compared_memory(padded), compared_memory(varlen)) {
                out.push(format!(
                    "- {}: padding-free {:.0} MiB vs padded {:.0} MiB ({:+.1}%).",
                    memory_label(varlen),
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
        if let (Some(fixed), Some(packed)) = (find("varlen"), find("varlen-multipack")) {
            out.push(format!(
                "- padding-free on multipack bins vs on fixed batches: {:.3}x real tokens/s (different batches: the bins hold about as many examples, balanced by tokens).",
                packed.real_tokens_per_second / fixed.real_tokens_per_second
            ));
        }
        for ranked in &self.results {
            let Some((one_process, ranks)) = on_ranks(&ranked.mode) else {
                continue;
            };
            if let Some(single) = find(&one_process) {
                out.push(format!(
                    "- {ranks} MPI ranks of {} vs 1 process of {} on the same multipack bins ({}): {:.3}x real tokens/s, peak memory {:.0} vs {:.0} MiB (all ranks).",
                    threads(self.job_threads / ranks),
                    threads(self.job_threads),
                    one_process,
                    ranked.real_tokens_per_second / single.real_tokens_per_second,
                    ranked.peak_memory_bytes.unwrap_or(0) as f64 / 1048576.0,
                    single.peak_memory_bytes.unwrap_or(0) as f64 / 1048576.0
                ));
            }
        }
        // Under --bf16 the peer ran with bf16=True.
        let peer = |mode: &str| find(mode).or_else(|| find(&format!("{mode}-bf16")));
        if let (Some(ours), Some(theirs)) = (find("varlen"), peer("hf-flattening")) {
            out.push(format!(
                "- padfree padding-free vs HF transformers padding-free (same threads): {:.3}x real tokens/s, {} {:.0} vs {:.0} MiB.",
                ours.real_tokens_per_second / theirs.real_tokens_per_second,
                memory_label(ours),
                compared_memory(ours).unwrap_or(0) as f64 / 1048576.0,
                theirs.peak_memory_bytes.unwrap_or(0) as f64 / 1048576.0
            ));
        }
        if let (Some(ours), Some(theirs)) = (find("padded"), peer("hf-padded")) {
            out.push(format!(
                "- padfree padded vs HF transformers padded: {:.3}x real tokens/s.",
                ours.real_tokens_per_second / theirs.real_tokens_per_second
            ));
        }
        for kind in ["fixed batches", "multipack bins"] {
            let group: Vec<&ModeResult> = self
                .results
                .iter()
                .filter(|r| batching(&r.mode) == kind)
                .collect();
            let Some(first) = group.first() else {
                continue;
            };
            let runs: Vec<(&str, &[f64])> = group
                .iter()
                .map(|r| (r.mode.as_str(), r.step_losses.as_slice()))
                .collect();
            let (within, largest, step, mode) = loss_agreement(&runs);
            let verdict = if within { "agree" } else { "DIFFER" };
            out.push(format!(
                "- losses {verdict} on {kind} (tolerance {LOSS_AGREEMENT:.0e} relative, the padded vs padding-free training tests', plus {HF_ROUNDING:.0e} for HF's losses, which it logs rounded to 4 decimals; {BF16_PEER_AGREEMENT:.0e} relative for HF's bf16=True rows, whose kernels round other intermediates to bf16): those runs start from the same weights and see the same batches; the largest relative difference of any step's loss from the {} run is {largest:.2e} over {} steps{}.",
                first.mode,
                first.step_losses.len(),
                if largest > 0.0 {
                    format!(" (step {step}, {mode})")
                } else {
                    String::new()
                }
            ));
        }
        out.extend(self.results.iter().filter_map(uneven_steps));
        out.join("\n")
    }

    /// What MFU is measured against, in words.
    fn peak_line(&self) -> String {
        let theoretical = self.peak.theoretical.as_ref().map_or_else(
            || "theoretical peak unknown on this CPU".to_owned(),
            |t| format!("theoretical peak {:.1} GFLOP/s ({})", t.gflops, t.what),
        );
        format!(
            "Peaks for MFU: calibration matmul (1024x1024x1024 f32 through burn's Flex backend, best of 5 before the runs and best of 5 after, the higher taken) {:.1} GFLOP/s (before {:.1}, after {:.1}); {theoretical}. Model FLOPs: 6 x layer matmul parameters x real tokens + 6 x V x C x labelled rows + 6 x layers x H x D x sum of squared example lengths (docs/model.md, \"Model FLOPs and MFU\").",
            self.peak.calibrated_gflops, self.peak.calibrated_before, self.peak.calibrated_after
        ) + &self.peak.calibrated_bf16_gflops.map_or_else(String::new, |bf16| {
            format!(
                " bf16 calibration: the same product with bf16 operands and f32 accumulation through `--bf16`'s kernel ({}), {bf16:.1} GFLOP/s.",
                padfree_model::Precision::cpu_matmul_body()
            )
        })
    }

    pub(super) fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let markdown = format!(
            "# padfree bench, {}\n\nMachine: {}\n\nCommand: `{}`\n\nTraining: {}\n\n{}\n\nThreads: {}. Runs of every mode: {} (the table shows each mode's median run by real tokens/s). Every mode runs in its own process (a mode on N ranks in N processes under mpirun, sharing the threads) from the same initial weights; the fixed-batch rows (padfree's and HF's) train on the same batches, the multipack rows on the same bins; the first steps warm up and are not timed; peak memory is each process's resident high-water mark (VmHWM).\n\n{}\n\n{}\n{}\nPer-step losses are in bench.json.\n",
            self.date,
            self.machine,
            self.command,
            self.training,
            self.peak_line(),
            self.threads,
            self.repeats,
            self.table(),
            self.findings(),
            self.failures_section()
        );
        write_atomically(&dir.join("bench.md"), markdown.as_bytes())?;
        write_atomically(&dir.join("bench.json"), &serde_json::to_vec_pretty(self)?)?;
        if !self.has_results() {
            return Ok(());
        }
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

/// What the runs train, in words.
fn training(args: &BenchJob) -> String {
    let checkpointing = format!(
        "{}{}",
        if args.gradient_checkpointing {
            "; padfree with per-layer gradient checkpointing"
        } else {
            ""
        },
        if args.precision == padfree_model::Precision::Bf16 {
            format!(
                "; bf16 mixed precision (matmuls: {}; HF: bf16=True)",
                if args.device.is_gpu() {
                    "the GPU's 16-bit matmul: bf16 on CUDA, f16 on WGSL"
                } else {
                    padfree_model::Precision::cpu_matmul_body()
                }
            )
        } else {
            String::new()
        }
    );
    let Some(lora) = &args.lora else {
        return format!("full fine-tuning (every weight){checkpointing}.");
    };
    let gguf = args.model.as_deref().is_some_and(crate::args::is_gguf);
    let targets: Vec<&str> = lora.targets.iter().map(|t| t.module()).collect();
    format!(
        "LoRA r {}, alpha {}, dropout {} on {} (the base frozen{}){}{checkpointing}.",
        lora.r,
        lora.alpha,
        lora.dropout,
        targets.join(", "),
        if gguf && !args.device.is_gpu() {
            ", padfree's projections kept in their GGUF blocks (QLoRA)"
        } else {
            ""
        },
        if args.peer.is_some() {
            "; HF through PEFT, from the same initial adapters, on the f32 base"
        } else {
            ""
        }
    )
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
    let level = padfree_model::kernels::simd_level().name();
    let capped = if padfree_model::kernels::simd_capped() {
        " (PADFREE_SIMD)"
    } else {
        ""
    };
    format!(
        "{model}, {cores} cores available, {} {}, padfree kernels {level}{capped}",
        std::env::consts::OS,
        std::env::consts::ARCH
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_agree_only_within_the_tests_tolerance() {
        let varlen = [2.0, 1.5, 1.25];
        // 2e-4 relative at step 2 (LoRA dropout under padding did that).
        let off = [2.0, 1.5 * (1.0 + 2e-4), 1.25];
        assert_eq!(
            loss_agreement(&[("varlen", &varlen), ("padded", &off)]),
            (false, (off[1] - 1.5) / 1.5, 2, "padded")
        );
        let close = [2.0 * (1.0 + 5e-5), 1.5, 1.25];
        assert!(loss_agreement(&[("varlen", &varlen), ("padded", &close)]).0);
        // HF's rounding to 4 decimals is allowed on its rows only.
        let rounded = [2.0, 1.50018, 1.25];
        assert!(loss_agreement(&[("varlen", &varlen), ("hf-padded", &rounded)]).0);
        assert!(!loss_agreement(&[("varlen", &varlen), ("padded", &rounded)]).0);
        // HF's bf16 rows: bf16 noise, 1e-3 relative, agrees; 3e-3 does not,
        // and neither does 1e-3 on padfree's own rows.
        let bf16_noise = [2.0, 1.5 * (1.0 + 1e-3), 1.25];
        let bf16_off = [2.0, 1.5 * (1.0 + 3e-3), 1.25];
        assert!(loss_agreement(&[("varlen", &varlen), ("hf-flattening-bf16", &bf16_noise)]).0);
        assert!(!loss_agreement(&[("varlen", &varlen), ("hf-flattening-bf16", &bf16_off)]).0);
        assert!(!loss_agreement(&[("varlen", &varlen), ("hf-flattening", &bf16_noise)]).0);
        assert!(!loss_agreement(&[("varlen", &varlen), ("padded", &bf16_noise)]).0);
    }

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
            peak_device_memory_bytes: None,
            final_loss: 1.0,
            step_losses: vec![1.0],
            step_seconds: Vec::new(),
            model_flops: None,
        }
    }

    /// On a GPU the findings compare device memory, not the host's (an
    /// H200 run compared padfree's 2.4 GiB of host memory with HF's 7.3
    /// GiB on the device).
    #[test]
    fn gpu_runs_compare_device_memory() {
        let mut gpu = run("varlen", 1.0);
        gpu.peak_memory_bytes = Some(2 << 30);
        gpu.peak_device_memory_bytes = Some(6 << 30);
        assert_eq!(compared_memory(&gpu), Some(6 << 30));
        assert_eq!(memory_label(&gpu), "device memory");
        let mut cpu = run("varlen", 1.0);
        cpu.peak_memory_bytes = Some(2 << 30);
        assert_eq!(compared_memory(&cpu), Some(2 << 30));
        assert_eq!(memory_label(&cpu), "peak memory");
    }

    /// A timed step 3x the median is called out; the warm-up's are not
    /// looked at, and an even run says nothing.
    #[test]
    fn a_slow_timed_step_is_called_out() {
        let mut even = run("varlen", 1.0);
        even.timed_steps = 4;
        even.step_seconds = vec![9.0, 0.10, 0.11, 0.10, 0.12];
        assert_eq!(uneven_steps(&even), None, "the warm-up step is not timed");
        let mut spiked = even.clone();
        spiked.step_seconds[3] = 0.5;
        let finding = uneven_steps(&spiked).expect("a 4x step");
        assert!(finding.contains("4.2x the median"), "{finding}");
        assert!(finding.contains("0.500 s vs 0.120 s"), "{finding}");
        // The HF peer's rows may come without step times.
        assert_eq!(uneven_steps(&run("hf-padded", 1.0)), None);
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
