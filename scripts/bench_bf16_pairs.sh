#!/usr/bin/env bash
# Interleaved f32 / --bf16 pairs over cells of the bf16 grid
# (docs/benchmarks/2026-12-07-bf16-zen4.md, section 2): per round, per
# cell, one `padfree bench --modes varlen` in f32 and then one with
# --bf16, padfree only (no HF peer), so that a slow spell of a shared
# machine hits both halves of a pair. Twice the grid's steps (96 / batch
# on short chat, 64 / batch on maths: scripts/bf16_cells.sh), one warm-up
# step. Prints one line a run: cell, precision, round, real tokens/s, peak
# memory.
#
#   bash scripts/bench_bf16_pairs.sh OUTPUT_DIR ROUNDS CELL...
#
# A cell is MODEL-DATA-bBATCH as in scripts/bench_bf16.sh (e.g.
# medium-short-b8, smollm2-shipped-b4). BIN=... runs another binary;
# environment such as PADFREE_SIMD=avx2 (the widened body at AVX2) passes
# through to both halves. The runs' final models are deleted. Benchmark on
# a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUTPUT_DIR}
rounds=${2:?ROUNDS}
shift 2
[[ $# -gt 0 ]] || { echo "no cells given (e.g. medium-short-b8)" >&2; exit 2; }
bin=${BIN:-target/release/padfree}
if [[ -z ${BIN:-} ]]; then cargo build --release --locked; fi
bash scripts/fetch_smollm2.sh
source scripts/bf16_cells.sh
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for cell in "$@"; do
    bf16_cell "$cell" 2
    for precision in f32 bf16; do
      flag=()
      [[ $precision == bf16 ]] && flag=(--bf16)
      dir=$out/$cell-$precision-r$round
      "$bin" bench "${model_args[@]}" "${data_args[@]}" --per-device-train-batch-size "$batch" \
        --max-steps "$steps" --timing-warmup-steps 1 --learning-rate 5e-5 --modes varlen \
        "${flag[@]}" --output-dir "$dir" > "$dir.log" 2>&1
      find "$dir" -name '*.safetensors' -delete
      # The padding-free row of bench.md: real tokens/s and peak memory.
      row=$(grep 'padfree, padding' "$dir/bench.md" | awk -F'|' '{print $4, $8}')
      echo "$cell $precision r$round $row"
    done
  done
done
