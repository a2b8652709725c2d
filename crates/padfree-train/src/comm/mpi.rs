//! One rank per process over MPI (rsmpi): `mpirun -np W padfree train ...`
//! with Open MPI or MPICH, or `srun` under Slurm.
//!
//! Sums are not left to `MPI_Allreduce`, whose order of additions depends on
//! the library, its algorithm choice and the message size. Two exchanges,
//! both in a fixed order, so every rank gets the same bits, every run of the
//! same world size the same result, and the same result as
//! [`super::LocalGroup`] with that world size:
//!
//! - gather-and-add (`all_reduce_sum_*`): every rank's contribution is
//!   gathered (`MPI_Allgather`, in chunks of [`CHUNK`] values so the receive
//!   buffer stays `W x CHUNK`) and every rank adds them in rank order in
//!   f64, rounding once. Each rank receives `W - 1` full buffers (as f64).
//! - the ring (`reduce_scatter_sum_f32`, `all_gather_f32`): `W - 1` steps of
//!   `MPI_Sendrecv` to the next rank and from the previous one, each moving
//!   one shard in pieces of at most [`PIECE`] values; a rank sends and
//!   receives `(W - 1) / W` of the buffer per pass, in f32.

use std::sync::Mutex;

use mpi::Threading;
use mpi::environment::Universe;
use mpi::point_to_point::send_receive_into;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives as _};

use super::{CommError, Communicator, Flat, shard_range, sum_in_rank_order};

/// Values per gathered chunk: 4 Mi (32 MiB of f64 per rank).
pub const CHUNK: usize = 1 << 22;

/// Values per ring message: 1 Mi (4 MiB), so the send and receive buffers
/// stay small whatever the model's size.
pub const PIECE: usize = 1 << 20;

/// Which pass of the ring: a reduce-scatter adds what it receives, an
/// all-gather stores it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    ReduceScatter,
    AllGather,
}

/// The MPI world of this process. Dropping it does not finalise MPI: a rank
/// that drops it on the way out of an error must not wait in
/// `MPI_Finalize` for ranks still waiting for it in a collective (a hang);
/// it calls [`abort_job`], and a rank that finished calls [`finalize`].
pub struct MpiWorld {
    world: SimpleCommunicator,
}

/// The environment `MpiWorld::init` opened, until [`finalize`].
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);

/// Finalises MPI (`MPI_Finalize`, which waits for every rank): call it once
/// this rank has finished without error. Does nothing without MPI.
pub fn finalize() {
    let universe = UNIVERSE.lock().map(|mut u| u.take()).unwrap_or(None);
    drop(universe);
}

/// Whether MPI was initialised and not yet finalised in this process.
pub fn is_initialized() -> bool {
    UNIVERSE.lock().map(|u| u.is_some()).unwrap_or(false)
}

impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiWorld(rank {} of {})",
            self.world.rank(),
            self.world.size()
        )
    }
}

/// Whether a launcher started this process as an MPI rank (Open MPI, MPICH
/// or Slurm's PMI/PMIx set these).
pub fn launched_by_mpi() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MPI_LOCALNRANKS",
    ]
    .iter()
    .any(|name| std::env::var_os(name).is_some())
}

impl MpiWorld {
    /// Initialises MPI: only the main thread calls MPI (`Funneled`); rayon's
    /// threads never do.
    pub fn init() -> Result<Self, CommError> {
        let refuse = |message: &str| CommError {
            rank: 0,
            world_size: 0,
            message: message.to_owned(),
            hint: "launch with mpirun -np N (Open MPI or MPICH) or srun --mpi=pmix".into(),
        };
        let (universe, threading) = mpi::initialize_with_threading(Threading::Funneled)
            .ok_or_else(|| refuse("MPI could not be initialised (or was already)"))?;
        if threading < Threading::Funneled {
            return Err(refuse(
                "the MPI library does not support a multi-threaded process",
            ));
        }
        let world = universe.world();
        if let Ok(mut slot) = UNIVERSE.lock() {
            *slot = Some(universe);
        }
        Ok(Self { world })
    }

    fn gather_sum(&self, values: &mut [f64]) {
        let ranks = self.world_size();
        let mut gathered = vec![0.0f64; ranks * values.len().min(CHUNK)];
        for chunk in values.chunks_mut(CHUNK) {
            let received = &mut gathered[..ranks * chunk.len()];
            self.world.all_gather_into(&*chunk, received);
            let sum = sum_in_rank_order(received.chunks_exact(chunk.len()), chunk.len());
            chunk.copy_from_slice(&sum);
        }
    }

    /// One pass round the ring. At step `s` rank `r` sends shard
    /// `r - s - 1` (reduce-scatter; `r - s` for the all-gather) to `r + 1`
    /// and receives shard `r - s - 2` (`r - s - 1`) from `r - 1`: a shard's
    /// partial sum starts at the rank after its owner and ends, complete, at
    /// the owner, in the order of [`super::ring_order`].
    fn ring(&self, parts: &mut [&mut [f32]], pass: Pass) {
        let (w, r) = (self.world_size(), self.rank());
        if w < 2 {
            return;
        }
        let mut flat = Flat::new(parts);
        let len = flat.len();
        let next = self.world.process_at_rank(((r + 1) % w) as i32);
        let prev = self.world.process_at_rank(((r + w - 1) % w) as i32);
        let lead = usize::from(pass == Pass::ReduceScatter);
        let mut send = Vec::with_capacity(PIECE.min(len));
        let mut recv = vec![0.0f32; PIECE.min(len.div_ceil(w))];
        for step in 0..w - 1 {
            let send_range = shard_range(len, w, (r + 2 * w - step - lead) % w);
            let recv_range = shard_range(len, w, (r + 2 * w - step - lead - 1) % w);
            // The longest shard's count on every rank, so the ranks' calls
            // pair up (a shard shorter by one element sends an empty piece).
            let pieces = len.div_ceil(w).div_ceil(PIECE);
            for piece in 0..pieces {
                let cut = |range: &std::ops::Range<usize>| {
                    let start = (range.start + piece * PIECE).min(range.end);
                    start..(start + PIECE).min(range.end)
                };
                let (out, into) = (cut(&send_range), cut(&recv_range));
                flat.read(out, &mut send);
                let received = &mut recv[..into.len()];
                send_receive_into(&send[..], &next, received, &prev);
                match pass {
                    Pass::ReduceScatter => flat.add(into.start, received),
                    Pass::AllGather => flat.write(into.start, received),
                }
            }
        }
    }
}

/// Ends every rank of the job now (`MPI_Abort`): what a rank does after an
/// error, so the others do not wait for it in their next collective.
pub fn abort_job(code: i32) -> ! {
    SimpleCommunicator::world().abort(code)
}

impl Communicator for MpiWorld {
    fn rank(&self) -> usize {
        usize::try_from(self.world.rank()).unwrap_or(0)
    }
    fn world_size(&self) -> usize {
        usize::try_from(self.world.size()).unwrap_or(1)
    }
    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<(), CommError> {
        if values.is_empty() {
            return Ok(());
        }
        for chunk in values.chunks_mut(CHUNK) {
            let mut wide: Vec<f64> = chunk.iter().map(|&v| f64::from(v)).collect();
            self.gather_sum(&mut wide);
            for (value, sum) in chunk.iter_mut().zip(wide) {
                *value = sum as f32;
            }
        }
        Ok(())
    }
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        if !values.is_empty() {
            self.gather_sum(values);
        }
        Ok(())
    }
    fn reduce_scatter_sum_f32(&self, parts: &mut [&mut [f32]]) -> Result<(), CommError> {
        self.ring(parts, Pass::ReduceScatter);
        Ok(())
    }
    fn all_gather_f32(&self, parts: &mut [&mut [f32]]) -> Result<(), CommError> {
        self.ring(parts, Pass::AllGather);
        Ok(())
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.world.barrier();
        Ok(())
    }
    fn backend(&self) -> &'static str {
        "MPI"
    }
}
