//! What the user sees of a run: the trainer calls these hooks, it never
//! prints.

use std::path::Path;

use crate::metrics::{LogRecord, StepMetrics};

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
