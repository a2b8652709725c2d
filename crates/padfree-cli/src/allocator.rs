//! Keeps glibc's malloc from handing freed memory back to the kernel, and
//! puts big buffers on cache lines (the global allocator, below).
//!
//! A training step allocates and frees buffers of many megabytes
//! (activations, gradients, kernel outputs). By default glibc serves each
//! from a fresh `mmap` and unmaps it on free, so the next step page-faults
//! every page in again: on `medium` that was 2.4 million page faults in
//! 8 steps and about a fifth of the step time
//! (docs/benchmarks/2026-11-30-real-sizes.md). With the tunables below the
//! memory is kept in malloc's heap and reused; the resident high-water mark
//! is the same, but the memory is returned only at exit.
//!
//! glibc reads its tunables from the environment before `main` runs, and
//! setting them from Rust would take `unsafe` (`mallopt`), which this
//! workspace forbids. So the binary re-executes itself once with
//! `GLIBC_TUNABLES` set: one `exec` at start-up, the same process id.
//! `PADFREE_MALLOC=system` turns this off; tunables the user set for malloc
//! are left alone.

use std::ffi::OsString;

/// Buffers of 4 KiB or more on cache lines (`malloc` aligns to 16 bytes):
/// the AMX products store their output tiles in place only there
/// (`padfree_model::kernels::LineAligned` says what it measured).
#[global_allocator]
static LINES: padfree_model::kernels::LineAligned = padfree_model::kernels::LineAligned;

/// Set to `tuned` in the re-executed process, `system` by a user to opt out.
const MARKER: &str = "PADFREE_MALLOC";
/// The user's own `GLIBC_TUNABLES`, if any, kept for child processes that
/// are not padfree (the HF peer of `padfree bench`).
const USER_TUNABLES: &str = "PADFREE_USER_GLIBC_TUNABLES";

/// No `mmap` per allocation (threshold 4 GiB), never trim the heap (64 GiB),
/// grow it 256 MiB at a time, and one arena for all threads.
///
/// The one arena matters since the step runs on rayon's workers: with an
/// arena per thread, each kept the buffers freed into it for itself, so the
/// resident peak was about the sum of every thread's own peak (`medium`,
/// batch 8: 2,073 MiB against 1,387 with one arena), and a worker's arena
/// (heaps of at most 64 MiB) still served larger buffers by `mmap`, faulting
/// them in on every step (709k page faults in 6 steps against 394k). Small
/// allocations stay off the arena's lock through malloc's per-thread cache.
const TUNABLES: &str = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=68719476736:glibc.malloc.top_pad=268435456:glibc.malloc.arena_max=1";

/// Re-executes this binary with the tunables set, unless that was done, the
/// user opted out or set malloc tunables, or this is not glibc on Linux.
/// Returns (and runs untuned) if the `exec` fails.
pub fn tune() {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) || std::env::var_os(MARKER).is_some() {
        return;
    }
    let existing = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
    if existing.contains("glibc.malloc.") {
        return;
    }
    let tunables = if existing.is_empty() {
        TUNABLES.to_owned()
    } else {
        format!("{existing}:{TUNABLES}")
    };
    reexec(tunables);
}

#[cfg(unix)]
fn reexec(tunables: String) {
    use std::os::unix::process::CommandExt;
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    // `exec` returns only if it failed; then this process carries on as is.
    let mut command = std::process::Command::new(exe);
    command
        .args(args)
        .env(MARKER, "tuned")
        .env("GLIBC_TUNABLES", tunables);
    if let Some(user) = std::env::var_os("GLIBC_TUNABLES") {
        command.env(USER_TUNABLES, user);
    }
    let _failed = command.exec();
}

/// Whether this process runs with the tunables (re-executed by [`tune`]).
pub fn is_tuned() -> bool {
    std::env::var(MARKER).as_deref() == Ok("tuned")
}

/// Gives a child that is not padfree the environment the user started
/// padfree with: without the malloc tunables padfree set for itself. A
/// benchmark peer must run as its users run it, not with padfree's tuning.
pub fn user_environment(command: &mut std::process::Command) {
    if std::env::var(MARKER).as_deref() != Ok("tuned") {
        return;
    }
    command.env_remove(MARKER).env_remove(USER_TUNABLES);
    match std::env::var_os(USER_TUNABLES) {
        Some(user) => command.env("GLIBC_TUNABLES", user),
        None => command.env_remove("GLIBC_TUNABLES"),
    };
}

#[cfg(not(unix))]
fn reexec(_tunables: String) {}
