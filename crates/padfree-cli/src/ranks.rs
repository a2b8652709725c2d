//! Which data-parallel rank this process is: one process alone, or one rank
//! of `mpirun -np W padfree train` (built with `--features mpi`).
//!
//! Under MPI, rank 0 alone prints and writes; every rank uses
//! `cores / ranks on this node` threads unless `RAYON_NUM_THREADS` says
//! otherwise; an error on one rank ends the whole job (`MPI_Abort`) instead
//! of leaving the others waiting in their next collective. An error every
//! rank reached together ([`EveryRank`]: a bad record of a shared cold
//! start) is said by every rank, which then ends as after success: the
//! first to fail does not kill the others before they speak.

use std::sync::atomic::{AtomicBool, Ordering};

use padfree_train::{Communicator, SingleProcess};

/// Set on ranks other than 0: they print nothing but errors.
static QUIET: AtomicBool = AtomicBool::new(false);

/// Whether this process prints (rank 0, or the only process).
pub fn is_lead() -> bool {
    !QUIET.load(Ordering::Relaxed)
}

/// The ranks on this node, from the launcher's environment.
fn local_ranks() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "SLURM_NTASKS_PER_NODE",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok()?.parse().ok())
}

/// This process's rank among the ranks on its node, and how many there are,
/// from the launcher's environment: each takes its own GPU adapter.
pub fn local_rank() -> Option<(usize, usize)> {
    let rank = [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok()?.parse().ok())?;
    Some((rank, local_ranks()?))
}

/// The world size the launcher announces, if any.
#[cfg(not(feature = "mpi"))]
fn announced_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.parse().ok())
}

/// The communicator of this process: MPI when a launcher started it (and
/// the binary has the `mpi` feature), else a single process.
pub fn communicator() -> anyhow::Result<Box<dyn Communicator>> {
    let comm = open()?;
    if comm.world_size() > 1 {
        QUIET.store(comm.rank() != 0, Ordering::Relaxed);
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            let threads = (cores / local_ranks().unwrap_or(1).max(1)).max(1);
            // Fails only if rayon already started, which nothing does before
            // this; then its own default stays.
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build_global()
                .ok();
        }
    }
    Ok(comm)
}

#[cfg(feature = "mpi")]
fn open() -> anyhow::Result<Box<dyn Communicator>> {
    use padfree_train::comm::mpi::{MpiWorld, launched_by_mpi};
    if launched_by_mpi() {
        return Ok(Box::new(MpiWorld::init()?));
    }
    Ok(Box::new(SingleProcess))
}

#[cfg(not(feature = "mpi"))]
fn open() -> anyhow::Result<Box<dyn Communicator>> {
    if let Some(world) = announced_world_size().filter(|&w| w > 1) {
        anyhow::bail!(
            "started as one of {world} ranks, but this padfree was built without MPI\nHINT: build it with `cargo build --release --features mpi` (needs Debian's openmpi-bin libopenmpi-dev libclang-dev pkg-config)"
        );
    }
    Ok(Box::new(SingleProcess))
}

/// An error every rank of the job reached at the same point, after the
/// same collective (a bad record found in a shared cold start): said as
/// its inner error says itself.
#[derive(Debug)]
pub struct EveryRank(pub padfree_data::DataError);

impl std::fmt::Display for EveryRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for EveryRank {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// After `err` has been printed: an [`EveryRank`] error ends this rank as
/// success does (every rank reaches MPI's finalisation); any other, under
/// MPI, ends every rank now (the others may be waiting for this one in a
/// collective).
pub fn end_after(err: &anyhow::Error) {
    if err.downcast_ref::<EveryRank>().is_some() {
        finish();
    } else {
        end_job_after_error();
    }
}

/// After an error has been printed: under MPI, end every rank now (the
/// others may be waiting for this one in a collective).
pub fn end_job_after_error() {
    #[cfg(feature = "mpi")]
    if padfree_train::comm::mpi::is_initialized() {
        padfree_train::comm::mpi::abort_job(1);
    }
}

/// After this rank finished without error: under MPI, finalise (waits for
/// every rank to get here).
pub fn finish() {
    #[cfg(feature = "mpi")]
    padfree_train::comm::mpi::finalize();
}

/// A test hook: `PADFREE_FAULT=RANK:STEP` makes that rank's process exit at
/// once after that step, as a crashed or killed rank would (no MPI
/// finalisation, no checkpoint).
pub fn injected_fault(rank: usize, step: usize) -> bool {
    std::env::var("PADFREE_FAULT").ok().is_some_and(|spec| {
        spec.split_once(':')
            .and_then(|(r, s)| Some((r.parse::<usize>().ok()?, s.parse::<usize>().ok()?)))
            == Some((rank, step))
    })
}
