//! `padfree`: padding-free fine-tuning of decoder language models.
//!
//! Arguments are parsed by clap into plain values (`args`), then validated
//! once into typed configurations that the commands run on.

mod args;
mod bench;
mod lengths;
mod pack;
mod train;
mod train_args;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = args::Cli::parse();
    let result = match cli.command {
        args::Command::Pack(pack_args) => pack_args
            .validate()
            .and_then(|config| pack::run(&config))
            .map(|()| false),
        args::Command::Bench(bench_args) => bench::run(&bench_args).map(|()| false),
        args::Command::Train(train_args) => train_args.validate().and_then(|job| train::run(&job)),
    };
    match result {
        Ok(false) => std::process::ExitCode::SUCCESS,
        Ok(true) => std::process::ExitCode::from(train::INTERRUPTED_EXIT),
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
