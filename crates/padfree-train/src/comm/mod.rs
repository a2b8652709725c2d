//! Data-parallel communication: what the trainer needs from the ranks it
//! runs with, and two implementations.
//!
//! - [`SingleProcess`]: one rank; every collective is the identity.
//! - [`LocalGroup`] (`local.rs`): `W` ranks as threads of one process, for
//!   tests and for checking the data-parallel arithmetic without a launcher.
//! - `MpiWorld` (`mpi.rs`, feature `mpi`): one rank per process under
//!   `mpirun -np W` (Open MPI, MPICH) or `srun`.
//!
//! NCCL can plug in behind the same trait later; the trainer never learns
//! which one it has.
//!
//! Every implementation gives every rank the same bits: the ranks'
//! contributions are summed in rank order, in f64, and rounded once, so a
//! run is bit-identical for a given world size whatever the timing of the
//! ranks, and the same whichever implementation carries it.

mod local;
#[cfg(feature = "mpi")]
pub mod mpi;

pub use local::LocalGroup;

use thiserror::Error;

/// A collective that could not complete.
#[derive(Debug, Error)]
#[error("rank {rank} of {world_size}: {message}\nHINT: {hint}")]
pub struct CommError {
    /// This process's rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// What happened.
    pub message: String,
    /// What to do.
    pub hint: String,
}

/// The ranks of a data-parallel job, as the trainer sees them.
pub trait Communicator: std::fmt::Debug {
    /// This process's rank, `0..W`.
    fn rank(&self) -> usize;
    /// Ranks in the job, `W`.
    fn world_size(&self) -> usize;
    /// Sums `values` element-wise over all ranks, in rank order; every rank
    /// gets the same result.
    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<(), CommError>;
    /// The same for f64 (loss sums, token counts).
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;
    /// What carries the collectives, for the log (`single process`, `MPI`).
    fn backend(&self) -> &'static str;
}

/// One process, one rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum_f32(&self, _values: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }
    fn all_reduce_sum_f64(&self, _values: &mut [f64]) -> Result<(), CommError> {
        Ok(())
    }
    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }
    fn backend(&self) -> &'static str {
        "single process"
    }
}

/// Sums equal-length contributions element-wise in rank order, in f64: what
/// every implementation returns to every rank.
pub(crate) fn sum_in_rank_order<'a>(
    contributions: impl Iterator<Item = &'a [f64]>,
    len: usize,
) -> Vec<f64> {
    let mut sum = vec![0.0f64; len];
    for contribution in contributions {
        for (total, value) in sum.iter_mut().zip(contribution) {
            *total += value;
        }
    }
    sum
}

/// Checks that every rank holds the same value of each named fingerprint
/// (the data, the settings, the initial weights): ranks that tokenized
/// different files, or started from different weights, would otherwise train
/// a silently inconsistent model. Every rank gets every rank's values and so
/// reaches the same verdict, naming the first thing that differs and where.
pub fn check_same_on_every_rank(
    comm: &dyn Communicator,
    fingerprints: &[(&str, u64)],
) -> Result<(), CommError> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    if world_size == 1 {
        return Ok(());
    }
    // 16-bit pieces are exact in f64 and in a sum with zeros.
    const PIECES: usize = 4;
    let per_rank = fingerprints.len() * PIECES;
    let mut table = vec![0.0f64; per_rank * world_size];
    for (i, (_, value)) in fingerprints.iter().enumerate() {
        for piece in 0..PIECES {
            table[rank * per_rank + i * PIECES + piece] = ((value >> (16 * piece)) & 0xffff) as f64;
        }
    }
    comm.all_reduce_sum_f64(&mut table)?;
    let value_of = |r: usize, i: usize| -> u64 {
        (0..PIECES).fold(0u64, |acc, piece| {
            acc | ((table[r * per_rank + i * PIECES + piece] as u64) << (16 * piece))
        })
    };
    for (i, (what, _)) in fingerprints.iter().enumerate() {
        let differing: Vec<usize> = (1..world_size)
            .filter(|&r| value_of(r, i) != value_of(0, i))
            .collect();
        if let Some(&first) = differing.first() {
            return Err(CommError {
                rank,
                world_size,
                message: format!(
                    "the ranks disagree on {what}: rank(s) {} hold something other than rank 0 (fingerprint {:016x} vs {:016x})",
                    differing
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    value_of(first, i),
                    value_of(0, i)
                ),
                hint: format!(
                    "every rank must read the same {what}: give every rank the same flags and make the files identical on every node"
                ),
            });
        }
    }
    Ok(())
}
