//! How far the run has come: steps taken, every step's loss, the logged
//! history and the tokens trained on. A checkpoint saves it whole and a
//! resume puts it back; the log lines are made here.

use crate::metrics::{LogRecord, StepMetrics};

#[derive(Debug, Default)]
pub(super) struct Progress {
    pub(super) global_step: usize,
    pub(super) log_history: Vec<LogRecord>,
    pub(super) step_losses: Vec<f64>,
    pub(super) real_tokens_seen: usize,
    pub(super) padded_tokens_seen: usize,
    /// The most device memory the GPU runtime held after any step of this
    /// process (`None` on the CPU).
    pub(super) device_memory_peak: Option<u64>,
}

impl Progress {
    /// Counts a step just taken.
    pub(super) fn took(&mut self, metrics: &StepMetrics) {
        self.global_step = metrics.step;
        self.real_tokens_seen += metrics.real_tokens;
        self.padded_tokens_seen += metrics.fed_tokens.saturating_sub(metrics.real_tokens);
        self.step_losses.push(metrics.loss);
    }

    /// Counts the device memory held after a step.
    pub(super) fn held_on_device(&mut self, bytes: Option<u64>) {
        if let Some(bytes) = bytes {
            self.device_memory_peak = Some(self.device_memory_peak.map_or(bytes, |b| b.max(bytes)));
        }
    }

    /// The log line of the step `last` closing `interval`: the mean loss of
    /// every step since the previous line (across a resume).
    pub(super) fn record(&self, interval: &Interval, last: &StepMetrics) -> LogRecord {
        let since = self.log_history.last().map_or(0, |r| r.step);
        interval.record(last, &self.step_losses[since..], self.real_tokens_seen)
    }

    /// The eval loss logged at the current step, if it was evaluated.
    pub(super) fn eval_loss_now(&self) -> Option<f64> {
        self.log_history
            .last()
            .filter(|record| record.step == self.global_step)
            .and_then(|record| record.eval_loss)
    }

    /// The latest evaluation in the history: its step and loss.
    pub(super) fn last_evaluation(&self) -> Option<(usize, f64)> {
        self.log_history
            .iter()
            .rev()
            .find_map(|r| Some((r.step, r.eval_loss?)))
    }

    /// Whether any step of the history was evaluated.
    pub(super) fn was_evaluated(&self) -> bool {
        self.log_history.iter().any(|r| r.eval_loss.is_some())
    }
}

/// Throughput and balance since the previous log line (of this process).
#[derive(Default)]
pub(super) struct Interval {
    real_tokens: usize,
    seconds: f64,
    bin_capacity_tokens: Option<usize>,
    busiest_rank_tokens: usize,
    world_size: usize,
    exchange_seconds: f64,
    steps: usize,
}

impl Interval {
    pub(super) fn add(&mut self, metrics: &StepMetrics) {
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
