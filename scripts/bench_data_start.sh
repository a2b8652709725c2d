#!/usr/bin/env bash
# The start of a run on a large data set (issue 37): a 1-step `padfree
# train` building the tokenized-data cache (cold), reading it back (warm),
# without the cache, and the same on 2 MPI ranks; beside it, HF
# `tokenizers`' batch encode of the same prompts and responses (reading
# included), in the same run. Wall time and peak resident memory of each
# (the largest process of the run, the tokenizing helper included).
#
#   bash scripts/bench_data_start.sh [SET...]
#
# A SET is RECORDS (maths-sized records: about 150 tokens each, with the
# `tiny` model) or orca:RECORDS (ORCA-Math-sized: 4 maths records joined
# into one, about 600 tokens, with the default model). Default:
# `20000 200000 1000000 orca:200000`.
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
[ $# -gt 0 ] || set -- 20000 200000 1000000 orca:200000
for set in "$@"; do
  records=${set#orca:}
  join=1; model=(--config tiny)
  if [ "$set" != "$records" ]; then join=4; model=(); fi
  data="$W/data-$set.jsonl"
  python3 - "$records" "$join" "$data" <<'PY'
import json, sys
n, join, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
src = [json.loads(l) for l in open("data/gsm-symbolic/train.jsonl")]
with open(out, "w") as f:
    for i in range(n):
        parts = [src[(i * join + k) % len(src)] for k in range(join)]
        q = " ".join(p["question"] for p in parts)
        a = "\n".join(p["answer"] for p in parts)
        f.write(json.dumps({"question": f"(Variant {i // len(src)}) " + q, "answer": a}) + "\n")
PY
  echo "== $set: $records records, $(du -m "$data" | cut -f1) MB, model ${model[*]:-default}"
  train=(train "${model[@]}" --data "$data" --max-steps 1 --save-strategy no --multipack)
  # HF's peer encodes 10,000 texts at a time (HF datasets' `map` hands
  # batches of 1,000): holding every Encoding of a large set at once took
  # 146 bytes a token (4.2 GiB for 30.9M tokens).
  measure "hf-tokenizers-batch-encode" python3 - "$data" <<'PY'
import json, sys
from tokenizers import Tokenizer
tok = Tokenizer.from_file("data/gsm-symbolic/tokenizer.json")
tokens = 0
def flush(prompts, answers):
    global tokens
    ids = tok.encode_batch(prompts) + tok.encode_batch(answers, add_special_tokens=False)
    tokens += sum(len(e.ids) for e in ids)
prompts, answers = [], []
for line in open(sys.argv[1]):
    r = json.loads(line)
    prompts.append(f"Question: {r['question']}\nAnswer: ")
    answers.append(r["answer"])
    if len(prompts) == 10000:
        flush(prompts, answers); prompts, answers = [], []
flush(prompts, answers)
print(tokens, "tokens")
PY
  rm -rf "$W/cache" "$W/out"
  measure "padfree-cold" "$BIN" "${train[@]}" --output-dir "$W/out" --data-cache-dir "$W/cache"
  rm -rf "$W/out"
  measure "padfree-warm" "$BIN" "${train[@]}" --output-dir "$W/out" --data-cache-dir "$W/cache"
  rm -rf "$W/out"
  measure "padfree-no-cache" "$BIN" "${train[@]}" --output-dir "$W/out" --no-data-cache
  rm -rf "$W/out"
  measure "padfree-cold-1-thread" env RAYON_NUM_THREADS=1 "$BIN" "${train[@]}" --output-dir "$W/out" \
    --data-cache-dir "$W/cache1"
  rm -rf "$W/out" "$W/cache1"
  if command -v mpirun >/dev/null; then
    rm -rf "$W/cache2" "$W/out"
    measure "padfree-2-ranks-cold" mpirun --bind-to none --oversubscribe -np 2 "$BIN" "${train[@]}" \
      --output-dir "$W/out" --data-cache-dir "$W/cache2"
    rm -rf "$W/out"
    measure "padfree-2-ranks-warm" mpirun --bind-to none --oversubscribe -np 2 "$BIN" "${train[@]}" \
      --output-dir "$W/out" --data-cache-dir "$W/cache2"
    rm -rf "$W/out" "$W/cache2"
  fi
  grep -h "^data:" "$W/padfree-cold.log" | head -1
  grep -h "^hf\|tokens$" "$W/hf-tokenizers-batch-encode.log" | tail -1
  du -sh "$W/cache" | sed 's/^/cache entry: /'
  rm -rf "$W/cache" "$data"
done
