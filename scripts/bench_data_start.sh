#!/usr/bin/env bash
# The start of a run on a large data set (issue 37): a 1-step `padfree
# train` without the tokenized-data cache, building it (cold), reading it
# back (warm), and the same on 2 MPI ranks; beside it, HF `tokenizers`'
# batch encode of the same prompts and responses (reading included), in
# the same run. Wall time and peak resident memory of each.
#
#   bash scripts/bench_data_start.sh [RECORDS...]      (default: 20000 200000)
#
# BIN=... picks the binary (default target/release/padfree, built with
# `--features padfree-cli/mpi` for the 2-rank rows). The data: the shipped
# maths set's 2,000 records repeated with a "(Variant c)" prefix on each
# question, so no two records are equal. Needs `pip install tokenizers`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-$PWD/target/release/padfree}
W=${W:-runs/bench-data-start}
export OMPI_MCA_btl=self,vader OMPI_MCA_oob_tcp_if_include=lo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$W"
measure() { # NAME COMMAND...: prints "NAME: S s, M MiB"
  local name=$1; shift
  /usr/bin/time -f "%e %M" -o "$W/time" "$@" > "$W/$name.log" 2>&1 || { echo "$name: FAILED (see $W/$name.log)"; return; }
  read -r secs kib < "$W/time"
  printf '%s: %s s, %d MiB\n' "$name" "$secs" $((kib / 1024))
}
[ $# -gt 0 ] || set -- 20000 200000
for records in "$@"; do
  data="$W/data-$records.jsonl"
  python3 - "$records" "$data" <<'PY'
import json, sys
n, out = int(sys.argv[1]), sys.argv[2]
src = [json.loads(l) for l in open("data/gsm-symbolic/train.jsonl")]
with open(out, "w") as f:
    for i in range(n):
        r = dict(src[i % len(src)])
        r["question"] = f"(Variant {i // len(src)}) " + r["question"]
        f.write(json.dumps(r) + "\n")
PY
  echo "== $records records, $(du -m "$data" | cut -f1) MB"
  train=(train --config tiny --data "$data" --max-steps 1 --save-strategy no --multipack)
  measure "hf-tokenizers-batch-encode" python3 - "$data" <<'PY'
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file("data/gsm-symbolic/tokenizer.json")
prompts, answers = [], []
for line in open(sys.argv[1]):
    r = json.loads(line)
    prompts.append(f"Question: {r['question']}\nAnswer: ")
    answers.append(r["answer"])
ids = tok.encode_batch(prompts) + tok.encode_batch(answers, add_special_tokens=False)
print(sum(len(e.ids) for e in ids), "tokens")
PY
  rm -rf "$W/cache" "$W/out"
  measure "padfree-no-cache" "$BIN" "${train[@]}" --output-dir "$W/out" --no-data-cache
  rm -rf "$W/out"
  measure "padfree-cold" "$BIN" "${train[@]}" --output-dir "$W/out" --data-cache-dir "$W/cache"
  rm -rf "$W/out"
  measure "padfree-warm" "$BIN" "${train[@]}" --output-dir "$W/out" --data-cache-dir "$W/cache"
  if command -v mpirun >/dev/null; then
    rm -rf "$W/cache2" "$W/out"
    measure "padfree-2-ranks-cold" mpirun --bind-to none --oversubscribe -np 2 "$BIN" "${train[@]}" \
      --output-dir "$W/out" --data-cache-dir "$W/cache2"
    rm -rf "$W/out"
    measure "padfree-2-ranks-warm" mpirun --bind-to none --oversubscribe -np 2 "$BIN" "${train[@]}" \
      --output-dir "$W/out" --data-cache-dir "$W/cache2"
  fi
  grep -h "^data:" "$W/padfree-cold.log" | head -1
done
