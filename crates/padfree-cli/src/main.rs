//! `padfree`: padding-free fine-tuning of decoder language models.
//!
//! `args/` holds every command's flags: clap parses them into plain values,
//! then `validate` turns them into a typed job once. `commands/` runs the
//! jobs. `clock.rs` names run directories and dates reports;
//! `allocator.rs` keeps glibc's malloc from returning memory between steps
//! and puts big buffers on cache lines;
//! `ranks.rs` says which data-parallel rank this process is (MPI).

mod allocator;
mod args;
mod commands;
mod ranks;

use clap::Parser;

fn main() -> std::process::ExitCode {
    allocator::tune();
    let cli = args::Cli::parse();
    let result = match cli.command {
        args::Command::Pack(pack_args) => pack_args
            .validate()
            .and_then(|job| commands::pack::run(&job))
            .map(|()| false),
        args::Command::Bench(bench_args) => bench_args
            .validate()
            .and_then(|job| commands::bench::run(&job))
            .map(|()| false),
        args::Command::Check(check_args) => check_args
            .validate()
            .and_then(|job| commands::check::run(&job))
            .map(|()| false),
        args::Command::Train(train_args) => train_args
            .validate()
            .and_then(|job| commands::train::run(&job)),
        args::Command::TokenizeHelper => return commands::run_tokenize_helper(),
    };
    if result.is_ok() {
        ranks::finish();
    }
    match result {
        Ok(false) => std::process::ExitCode::SUCCESS,
        Ok(true) => std::process::ExitCode::from(commands::train::INTERRUPTED_EXIT),
        Err(err) => {
            eprintln!("error: {err:#}");
            ranks::end_after(&err);
            std::process::ExitCode::FAILURE
        }
    }
}
