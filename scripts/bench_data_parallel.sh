#!/usr/bin/env bash
# Data-parallel rows on this machine: padfree padding-free with fixed
# batches, with multipack, and with multipack on 2 MPI ranks x 1 thread
# against 1 process x 2 threads accumulating over the same bins.
#
#   bash scripts/bench_data_parallel.sh [CONFIG] [STEPS] [OUTPUT_DIR]
#
# Needs Open MPI (Debian: openmpi-bin libopenmpi-dev libclang-dev pkg-config)
# and builds padfree with `--features mpi`. Prints a markdown table of real
# tokens/s (`train_tokens_per_second` of each run's train_results.json).
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-small}
steps=${2:-30}
out=${3:-runs/data-parallel}
cargo build --release --locked --features mpi -p padfree-cli
bin=target/release/padfree
rm -rf "$out"
mkdir -p "$out"
export OMPI_MCA_btl=self,vader OMPI_MCA_oob_tcp_if_include=lo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
common=(train --config "$config" --max-steps "$steps" --learning-rate 1e-3 --save-strategy no --logging-steps 1000)
cores=$(nproc)
run() { # name, launcher..., -- extra flags
    local name=$1; shift
    "$@" --output-dir "$out/$name" > "$out/$name.log" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"| $name | {r['train_tokens_per_second']:.0f} | {r['real_tokens']} | {r['train_loss']:.4f} |\")" "$out/$name/train_results.json"
}
echo "| run ($config, $steps steps, $cores cores) | real tokens/s | real tokens | train loss |"
echo "| --- | ---: | ---: | ---: |"
run fixed-batches-1x${cores}threads "$bin" "${common[@]}" --per-device-train-batch-size 16
run multipack-1x${cores}threads-accum2 "$bin" "${common[@]}" --multipack --gradient-accumulation-steps 2
RAYON_NUM_THREADS=$((cores / 2)) run multipack-2ranks-x$((cores / 2))threads \
    mpirun -np 2 --bind-to none "$bin" "${common[@]}" --multipack
