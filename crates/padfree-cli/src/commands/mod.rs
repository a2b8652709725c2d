//! What each command does, given its validated job (`crate::args`).
//!
//! `load.rs` reads what a run starts from (model, tokenizer, data) for
//! `train`, `check` and `bench`; `train.rs` runs the trainer, `check.rs`
//! the packing check; neither imports the other's module but for
//! `train --verify-packing`, which calls the check.

/// `println!` on the lead rank only (the only process, or rank 0 under MPI).
macro_rules! say {
    ($($arg:tt)*) => {
        if crate::ranks::is_lead() {
            println!($($arg)*);
        }
    };
}

/// A warning on standard error, from the lead rank only.
macro_rules! warn {
    ($($arg:tt)*) => {
        if crate::ranks::is_lead() {
            eprintln!("warning: {}", format!($($arg)*));
        }
    };
}

pub mod bench;
pub mod check;
mod data;
pub mod load;
pub mod pack;
pub mod train;

pub use data::run_helper as run_tokenize_helper;
