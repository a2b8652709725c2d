//! Times the gradient exchange alone, for the cost model of
//! `docs/distributed.md`: `mpirun -np W exchange_bench N...` sums a buffer
//! of `N` f32 values over the ranks with the ring (reduce-scatter +
//! all-gather) and with gather-and-add, `ROUNDS` times each after a
//! barrier, and rank 0 prints one line per size and exchange:
//! `ranks values bytes exchange median_s min_s`. `EXCHANGES=ring` times
//! one of them only.
//!
//! `cargo build --release --features mpi -p padfree-train --example exchange_bench`;
//! `scripts/bench_exchange.sh` runs it for the model sizes and world sizes.

#[cfg(feature = "mpi")]
fn main() {
    use padfree_train::Communicator;
    use padfree_train::comm::mpi::{MpiWorld, finalize};
    use std::time::Instant;

    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("sizes are element counts"))
        .collect();
    let comm = MpiWorld::init().expect("MPI");
    let rank = comm.rank();
    for &len in &sizes {
        let mut values: Vec<f32> = (0..len)
            .map(|i| ((i * 31 + rank * 17) % 1000) as f32 * 1e-3)
            .collect();
        let exchanges = std::env::var("EXCHANGES").unwrap_or_else(|_| "ring,gather".into());
        for exchange in exchanges.split(',') {
            let mut times = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                comm.barrier().expect("barrier");
                let started = Instant::now();
                match exchange {
                    "ring" => {
                        comm.reduce_scatter_sum_f32(&mut [values.as_mut_slice()])
                            .expect("reduce-scatter");
                        comm.all_gather_f32(&mut [values.as_mut_slice()])
                            .expect("all-gather");
                    }
                    _ => comm.all_reduce_sum_f32(&mut values).expect("all-reduce"),
                }
                times.push(started.elapsed().as_secs_f64());
                // Keep the values bounded over the rounds.
                values.iter_mut().for_each(|v| *v *= 0.5);
            }
            times.sort_by(f64::total_cmp);
            if rank == 0 {
                println!(
                    "{} {len} {} {exchange} {:.6} {:.6}",
                    comm.world_size(),
                    4 * len,
                    times[times.len() / 2],
                    times[0]
                );
            }
        }
    }
    comm.barrier().expect("barrier");
    finalize();
}

#[cfg(not(feature = "mpi"))]
fn main() {
    eprintln!("build with --features mpi");
    std::process::exit(2);
}
