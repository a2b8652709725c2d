use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::best_model::BestModel;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: usize,
    /// Fractional epoch at the end of the step.
    pub epoch: f64,
    /// Mean cross-entropy per label token of the whole accumulation window.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The learning rate this step was taken with.
    pub learning_rate: f64,
    /// Examples in the window.
    pub examples: usize,
    /// Real (non-pad) tokens in the window.
    pub real_tokens: usize,
    /// Tokens the model ran on, pads included (equals `real_tokens` padding-free).
    pub fed_tokens: usize,
    /// Tokens that carried loss.
    pub label_tokens: usize,
    /// Sum over the window's examples of the squared length (attention work).
    pub sum_squared_lengths: u64,
    /// `[W]`: real tokens each rank trained on in this step.
    pub rank_real_tokens: Vec<usize>,
    /// Multipack only: the token capacity of the step's bins together
    /// (bins x capacity), against which `real_tokens` is the packing efficiency.
    pub bin_capacity_tokens: Option<usize>,
    /// Several ranks: wall time of the gradient exchange (and, with ZeRO
    /// stage 1, of the weights' all-gather), waiting for slower ranks
    /// included; with `ddp_overlap`, only what was left after this rank's
    /// backward pass had finished. 0 in one process.
    #[serde(default)]
    pub exchange_seconds: f64,
    /// Wall time of the step.
    pub seconds: f64,
}

/// One logged line (every `--logging-steps`), also a line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogRecord {
    /// The step logged at.
    pub step: usize,
    /// Fractional epoch.
    pub epoch: f64,
    /// Mean of the step losses since the previous log line (as HF logs it).
    pub loss: f64,
    /// Gradient norm of the last step.
    pub grad_norm: f64,
    /// Learning rate of the last step.
    pub learning_rate: f64,
    /// Real tokens per second over the logging interval.
    pub tokens_per_second: f64,
    /// Real tokens since the start of training.
    pub real_tokens_seen: usize,
    /// Multipack: real tokens over the bins' token capacity in the interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packing_efficiency: Option<f64>,
    /// Several ranks: the straggler factor in the interval, the sum over
    /// steps of the busiest rank's real tokens over the sum of the ranks'
    /// mean (1.0 = every rank equally loaded at every step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_imbalance: Option<f64>,
    /// Several ranks: mean seconds per step spent in the exchange over the
    /// interval (waiting for slower ranks included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange_seconds: Option<f64>,
    /// With an eval set, at an eval step: the held-out loss per label token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// `exp(eval_loss)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_perplexity: Option<f64>,
    /// Seconds the evaluation took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_runtime: Option<f64>,
}

impl fmt::Display for LogRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{{'loss': {:.4}, 'grad_norm': {:.4}, 'learning_rate': {:.3e}, 'epoch': {:.2}, 'step': {}, 'tokens_per_second': {:.0}}}",
            self.loss,
            self.grad_norm,
            self.learning_rate,
            self.epoch,
            self.step,
            self.tokens_per_second
        )?;
        if let Some(efficiency) = self.packing_efficiency {
            write!(f, " packing {:.1}%", 100.0 * efficiency)?;
        }
        if let Some(imbalance) = self.rank_imbalance {
            write!(f, " rank imbalance {imbalance:.3}")?;
        }
        if let Some(seconds) = self.exchange_seconds {
            write!(f, " exchange {seconds:.3} s/step")?;
        }
        if let (Some(loss), Some(perplexity)) = (self.eval_loss, self.eval_perplexity) {
            write!(
                f,
                " {{'eval_loss': {loss:.4}, 'eval_perplexity': {perplexity:.2}}}"
            )?;
        }
        Ok(())
    }
}

/// The end-of-training summary, written as `train_results.json`.
///
/// The loss and token figures cover the whole run, every step from 1 to
/// `global_step` across resumes; the rates and `train_runtime` are this
/// process's own (as HF's), and after a resume `resumed` says which part
/// this process trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSummary {
    /// Seconds of training in this process.
    pub train_runtime: f64,
    /// Examples per second (this process).
    pub train_samples_per_second: f64,
    /// Optimizer steps per second (this process).
    pub train_steps_per_second: f64,
    /// Real (non-pad) tokens per second (this process).
    pub train_tokens_per_second: f64,
    /// Real tokens trained on, whole run.
    pub real_tokens: usize,
    /// Pad tokens the model also ran on, whole run (0 padding-free).
    pub padded_tokens: usize,
    /// Mean of every step's loss, whole run (HF's `train_loss`).
    pub train_loss: f64,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Steps run in this process.
    pub steps: usize,
    /// The step training ended at.
    pub global_step: usize,
    /// After a resume: the part of the run this process trained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed: Option<RunPart>,
    /// Peak resident memory of the process, bytes (`VmHWM`), if known.
    pub peak_memory_bytes: Option<u64>,
    /// On a GPU: the most device memory burn's CubeCL runtime held after
    /// any step of this process (its pools' reservations), bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_device_memory_bytes: Option<u64>,
    /// Whether training stopped early on request (Ctrl-C).
    pub interrupted: bool,
    /// The eval loss of the model at `eval_step`: the final model's when it
    /// was evaluated (the last step's, or the best one loaded), else the
    /// last evaluation's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// `exp(eval_loss)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_perplexity: Option<f64>,
    /// The step whose model `eval_loss` was taken on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_step: Option<usize>,
    /// With `--load-best-model-at-end`: the best model found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_model: Option<BestModel>,
    /// Where the best model's checkpoint is (HF's `best_model_checkpoint`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_model_checkpoint: Option<PathBuf>,
    /// Whether the final model was loaded back from the best model's
    /// checkpoint (false when the best is the last step's own model).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub best_model_loaded: bool,
}

/// The steps one process of a resumed run trained, and their figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunPart {
    /// The step it resumed from (its first step is the next).
    pub from_step: usize,
    /// Steps it ran.
    pub steps: usize,
    /// Real tokens it trained on.
    pub real_tokens: usize,
    /// Pad tokens it ran on.
    pub padded_tokens: usize,
    /// Mean of its steps' losses.
    pub train_loss: f64,
}

impl fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let memory = self.peak_memory_bytes.map_or_else(
            || "unknown".to_owned(),
            |b| format!("{:.0} MiB", b as f64 / 1048576.0),
        );
        let part = if self.resumed.is_some() {
            " (this process)"
        } else {
            ""
        };
        writeln!(
            f,
            "  train_runtime            = {:.1} s{part}",
            self.train_runtime
        )?;
        writeln!(
            f,
            "  train_samples_per_second = {:.3}",
            self.train_samples_per_second
        )?;
        writeln!(
            f,
            "  train_steps_per_second   = {:.3}",
            self.train_steps_per_second
        )?;
        writeln!(
            f,
            "  train_tokens_per_second  = {:.1} (real tokens)",
            self.train_tokens_per_second
        )?;
        let whole = if self.resumed.is_some() {
            format!(" (whole run, steps 1-{})", self.global_step)
        } else {
            String::new()
        };
        writeln!(
            f,
            "  real tokens              = {}{whole}",
            self.real_tokens
        )?;
        writeln!(
            f,
            "  padded tokens processed  = {}{whole}",
            self.padded_tokens
        )?;
        writeln!(
            f,
            "  train_loss               = {:.4}{whole}",
            self.train_loss
        )?;
        match &self.resumed {
            Some(part) if part.steps == 0 => writeln!(
                f,
                "  this process             = no steps (resumed at step {}, the run's end)",
                part.from_step
            )?,
            Some(part) => writeln!(
                f,
                "  this process             = steps {}-{}: train_loss {:.4}, {} real tokens, {} padded",
                part.from_step + 1,
                part.from_step + part.steps,
                part.train_loss,
                part.real_tokens,
                part.padded_tokens
            )?,
            None => {}
        }
        writeln!(f, "  final step loss          = {:.4}", self.final_loss)?;
        if let (Some(loss), Some(perplexity)) = (self.eval_loss, self.eval_perplexity) {
            let of = match self.eval_step {
                Some(step) if step == self.global_step || self.best_model_loaded => {
                    format!(" (step {step}: the final model)")
                }
                Some(step) => format!(
                    " (step {step}; the final model, step {}, was not evaluated)",
                    self.global_step
                ),
                None => String::new(),
            };
            writeln!(f, "  eval_loss                = {loss:.4}{of}")?;
            writeln!(f, "  eval_perplexity          = {perplexity:.2}")?;
        }
        if let Some(best) = &self.best_model {
            let source = match (&self.best_model_checkpoint, self.best_model_loaded) {
                (Some(dir), true) => format!("loaded from {}", dir.display()),
                (_, false) if best.step == self.global_step => "the last step's model".to_owned(),
                (Some(dir), false) => format!("in {}", dir.display()),
                (None, _) => "the last step's model".to_owned(),
            };
            writeln!(
                f,
                "  best model               = step {}, eval_loss {:.4} ({source})",
                best.step, best.eval_loss
            )?;
        }
        if let Some(bytes) = self.peak_device_memory_bytes {
            writeln!(
                f,
                "  device memory held       = {:.0} MiB (GPU runtime's pools, most after a step)",
                bytes as f64 / 1048576.0
            )?;
        }
        write!(f, "  peak memory (VmHWM)      = {memory}")
    }
}

/// The process's peak resident set size, from `/proc/self/status` (Linux).
pub fn peak_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
