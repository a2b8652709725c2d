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
//! Every implementation gives every rank the same bits, and the same bits
//! as every other implementation with that world size, whatever the timing
//! of the ranks:
//!
//! - [`Communicator::all_reduce_sum_f32`] / `_f64` sum the ranks'
//!   contributions in rank order, in f64, rounded once (gather-and-add);
//! - [`Communicator::reduce_scatter_sum_f32`] sums shard `c` in the fixed
//!   ring order of [`ring_order`], in f32, as a ring reduce-scatter over
//!   point-to-point messages adds it; [`Communicator::all_gather_f32`]
//!   copies every rank's shard to every rank.
//!
//! A buffer of `S` bytes costs each rank `(W - 1) S` of traffic with
//! gather-and-add (twice that on the wire, as f64), `2 (W - 1) / W x S` with
//! the ring (`docs/distributed.md` has the cost model).

mod local;
#[cfg(feature = "mpi")]
pub mod mpi;

pub use local::LocalGroup;

use std::ops::Range;

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
    /// Ring reduce-scatter over the concatenation of `parts` (length `N`,
    /// the same on every rank): afterwards this rank's shard
    /// ([`shard_range`]`(N, W, rank)`) holds the sum over all ranks, added
    /// in [`ring_order`] in f32. What the other elements hold afterwards is
    /// unspecified (partial sums).
    fn reduce_scatter_sum_f32(&self, parts: &mut [&mut [f32]]) -> Result<(), CommError>;
    /// Ring all-gather over the concatenation of `parts`: every rank's shard
    /// ([`shard_range`]) is copied into the same place on every other rank.
    fn all_gather_f32(&self, parts: &mut [&mut [f32]]) -> Result<(), CommError>;
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
    fn reduce_scatter_sum_f32(&self, _parts: &mut [&mut [f32]]) -> Result<(), CommError> {
        Ok(())
    }
    fn all_gather_f32(&self, _parts: &mut [&mut [f32]]) -> Result<(), CommError> {
        Ok(())
    }
    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }
    fn backend(&self) -> &'static str {
        "single process"
    }
}

/// Rank `rank`'s shard of a buffer of `len` elements over `world_size`
/// ranks: contiguous, in rank order, the first `len % W` one element longer.
pub fn shard_range(len: usize, world_size: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (len / world_size, len % world_size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The ranks whose contributions to shard `shard` a ring reduce-scatter
/// adds, in the order it adds them: `shard + 1` first (it starts the
/// shard's trip round the ring), `shard` itself last (the trip ends there).
pub fn ring_order(shard: usize, world_size: usize) -> impl Iterator<Item = usize> {
    (1..=world_size).map(move |step| (shard + step) % world_size)
}

/// The concatenation of several mutable slices as one flat buffer, so the
/// ring runs over the gradients or weights where they are, without a flat
/// copy of them (a copy the size of the model).
pub struct Flat<'p, 'a> {
    parts: &'p mut [&'a mut [f32]],
    /// `[parts + 1]`: where each part starts; the last is the length.
    starts: Vec<usize>,
}

impl<'p, 'a> Flat<'p, 'a> {
    /// The concatenation of `parts`.
    pub fn new(parts: &'p mut [&'a mut [f32]]) -> Self {
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut at = 0;
        starts.push(0);
        for part in parts.iter() {
            at += part.len();
            starts.push(at);
        }
        Self { parts, starts }
    }

    /// Elements in all parts.
    pub fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// Visits the pieces of `range` part by part: `(part, offset in part,
    /// offset in range, length)`.
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn pieces(&self, range: Range<usize>) -> Vec<(usize, usize, usize, usize)> {
        let mut out = Vec::new();
        let first = self
            .starts
            .partition_point(|&s| s <= range.start)
            .saturating_sub(1);
        let mut at = range.start;
        for part in first..self.parts.len() {
            if at >= range.end {
                break;
            }
            let (start, end) = (self.starts[part], self.starts[part + 1]);
            if end <= at {
                continue;
            }
            let take = end.min(range.end) - at;
            out.push((part, at - start, at - range.start, take));
            at += take;
        }
        out
    }

    /// `range` copied into `out` (cleared first).
    pub fn read(&self, range: Range<usize>, out: &mut Vec<f32>) {
        out.clear();
        for (part, offset, _, len) in self.pieces(range) {
            out.extend_from_slice(&self.parts[part][offset..offset + len]);
        }
    }

    /// `values` written at `start`.
    pub fn write(&mut self, start: usize, values: &[f32]) {
        for (part, offset, from, len) in self.pieces(start..start + values.len()) {
            self.parts[part][offset..offset + len].copy_from_slice(&values[from..from + len]);
        }
    }

    /// `values` added at `start`, element by element, in f32.
    pub fn add(&mut self, start: usize, values: &[f32]) {
        for (part, offset, from, len) in self.pieces(start..start + values.len()) {
            let target = &mut self.parts[part][offset..offset + len];
            for (t, &v) in target.iter_mut().zip(&values[from..from + len]) {
                *t += v;
            }
        }
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
