#!/usr/bin/env bash
# bf16 against f32 (docs/benchmarks/2026-12-03-bf16.md): for each cell of
# a reduced batch-shapes grid (SmolLM2-135M-Instruct and the `medium`
# preset; the shipped maths data and the short chat data), one
# `padfree bench` in f32 and one with --bf16, padfree padding-free against
# HF transformers padded and with DataCollatorWithFlattening (f32, then
# bf16=True), same weights, batches and threads. Then the summary table
# (scripts/bf16_report.py).
#
#   bash scripts/bench_bf16.sh [OUTPUT_DIR] [PEER_PYTHON] [CELLS...]
#
# A cell is MODEL-DATA-bBATCH, e.g. smollm2-shipped-b8 (default: six
# cells, about 45 minutes on 2 cores; `all`: the 12 cells of the
# batch-shapes grid, then draw them with the `bf16_grid_chart` example). Needs the HF peer environment
# (.venv-peer/ from bench/hf_peer/setup.sh, or PEER_PYTHON) and PyPI for
# the SmolLM2 GGUF. Benchmark on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bf16}
python=${2:-.venv-peer/bin/python}
shift $(( $# > 2 ? 2 : $# ))
cells=("$@")
if [[ ${#cells[@]} -eq 0 ]]; then
  cells=(smollm2-shipped-b4 smollm2-shipped-b8 smollm2-shipped-b16 medium-shipped-b8 smollm2-short-b8 medium-short-b8)
elif [[ ${cells[*]} == all ]]; then
  # The whole grid of the batch-shapes report: 12 cells, about 75 minutes.
  cells=()
  for model in smollm2 medium; do
    for data in shipped short; do
      for batch in 4 8 16; do cells+=("$model-$data-b$batch"); done
    done
  done
fi
cargo build --release --locked
bash scripts/fetch_smollm2.sh
bin=target/release/padfree
source scripts/bf16_cells.sh
for cell in "${cells[@]}"; do
  bf16_cell "$cell" 1
  for precision in f32 bf16; do
    flag=()
    [[ $precision == bf16 ]] && flag=(--bf16)
    "$bin" bench "${model_args[@]}" "${data_args[@]}" --per-device-train-batch-size "$batch" \
      --max-steps "$steps" --timing-warmup-steps 1 --learning-rate 5e-5 --modes varlen \
      --peer-python "$python" "${flag[@]}" --output-dir "$out/$cell-$precision"
  done
done
python3 scripts/bf16_report.py "$out" > "$out/summary.md"
echo "summary: $out/summary.md"
