#!/usr/bin/env bash
# The gradient exchange alone on this machine, for docs/distributed.md's
# cost model: ring vs gather-and-add for the trained-parameter counts of the
# small and medium presets and SmolLM2-135M, on 2..8 ranks over loopback
# (Open MPI's shared-memory transport), one thread per rank, oversubscribed.
# Usage: scripts/bench_exchange.sh [RANKS...]   (default: 2 3 4 6 8)
# Prints `ranks values bytes exchange median_s min_s` lines.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p padfree-train --features mpi --example exchange_bench >&2
ranks=("$@")
[ ${#ranks[@]} -gt 0 ] || ranks=(2 3 4 6 8)
# small 7.1M, medium 56.4M, SmolLM2-135M 134.5M trained parameters.
sizes=(7100000 56400000 134515008)
export OMPI_MCA_btl=self,vader OMPI_MCA_oob_tcp_if_include=lo RAYON_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export ROUNDS=${ROUNDS:-3}
echo "# $(date -u +%F) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; ROUNDS=$ROUNDS"
for w in "${ranks[@]}"; do
    mpirun -np "$w" --bind-to none --oversubscribe \
        target/release/examples/exchange_bench "${sizes[@]}"
done
