//! `padfree`: padding-free fine-tuning of decoder language models.
//!
//! Arguments are parsed by clap into plain values (`args`), then validated
//! once into typed configurations that the commands run on.

mod args;
mod lengths;
mod pack;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = args::Cli::parse();
    let result = match cli.command {
        args::Command::Pack(pack_args) => {
            pack_args.validate().and_then(|config| pack::run(&config))
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
