//! `PADFREE_MEMORY_TRACE=1`: one line on stderr at each phase of a step,
//! saying what is alive, for finding where a run's peak memory goes.
//!
//! The resident high-water mark (`VmHWM`, the summary's peak) says how
//! much memory the process ever touched, not what held it. Each line here
//! gives the bytes of buffers of 4 KiB or more alive at the phase's end
//! and their most at once since the line before (from the binary's
//! allocator, `padfree_model::kernels::lined_bytes`: weights, gradients,
//! moments, activations, kernel outputs), beside the resident memory and
//! its high-water mark. Traced this way, step 1 of every CPU run held
//! every trained weight twice (the model's and the optimizer's master
//! copy), its peak the run's where the activations are small; see
//! docs/training.md, "Memory".
//!
//! Phases: `collated` (a micro-batch made), `forward` and `backward` (the
//! plain backward pass; the per-layer recomputing and the overlapped ones
//! mark only their end, as `gradients taken`), `gradients taken` (into the
//! step's sums), `update` (AdamW, before the gradients are dropped) and
//! `values back` (the new weights in the model, the sums gone).

use std::sync::OnceLock;

use padfree_model::kernels::{lined_bytes, reset_lined_peak};

/// The variable that turns the trace on.
pub const VARIABLE: &str = "PADFREE_MEMORY_TRACE";

fn on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(VARIABLE).is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// Writes the line of `phase` when the trace is on, and starts the next
/// phase's high-water mark.
pub(super) fn mark(phase: &str) {
    if !on() {
        return;
    }
    let bytes = lined_bytes();
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mib = |name: &str| -> String {
        status
            .lines()
            .find(|line| line.starts_with(name))
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<u64>().ok())
            .map_or_else(|| "?".to_owned(), |kib| (kib >> 10).to_string())
    };
    eprintln!(
        "memory {phase:<16} buffers {:>6} MiB, at most {:>6} MiB since the last line; resident {:>6} MiB, peak {:>6} MiB",
        bytes.live >> 20,
        bytes.peak >> 20,
        mib("VmRSS:"),
        mib("VmHWM:"),
    );
    reset_lined_peak();
}
