//! What a training step costs, worked out from the configuration before
//! anything runs: [`memory`], the bytes it holds (checked against the
//! machine before loading), and [`flops`], its model FLOPs and the
//! machine's peak (MFU in `padfree bench`).

pub mod flops;
pub mod memory;
