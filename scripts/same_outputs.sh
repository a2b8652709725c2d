#!/usr/bin/env bash
# Before/after check for a change that must not change results (issue 36's
# trainer split): runs the same four trainings with two binaries and
# compares what they write, byte for byte.
#
#   bash scripts/same_outputs.sh BIN_BEFORE BIN_AFTER [WORK_DIR]
#
# The runs: the built-in demo (100 steps); eval + best model (step 35 of 40,
# loaded back at the end) + checkpoint rotation; a resumed run (from checkpoint-20 of a 40-step run); 2 MPI
# ranks with ZeRO-1 (when mpirun is here and the binaries have the mpi
# feature). Compared: every model.safetensors (final and checkpoints, by
# sha256), metrics.jsonl and trainer_state.json with the wall-clock fields
# and the run id dropped. About 6 minutes on 2 cores.
set -u
cd "$(dirname "$0")/.."
A=$(realpath "$1"); B=$(realpath "$2"); W=${3:-runs/same-outputs}
rm -rf "$W"; mkdir -p "$W"
export RAYON_NUM_THREADS=2 OMPI_MCA_btl=self,vader OMPI_MCA_oob_tcp_if_include=lo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BASE=(--config tiny --data data/gsm-symbolic/train.jsonl --multipack --max-tokens-per-batch 600
  --logging-steps 1 --seed 7)
TINY=("${BASE[@]}" --learning-rate 3e-3)
# A constant, high rate: the eval loss turns up after step 35, so the best
# model is an earlier checkpoint, kept by the rotation and loaded back.
BEST=("${BASE[@]}" --learning-rate 1e-1 --lr-scheduler-type constant)

runs() { # $1: binary, $2: its work dir
  local bin=$1 d=$2; mkdir -p "$d"
  "$bin" train --output-dir "$d/demo" > "$d/demo.log" 2>&1 || echo "demo: exit $?"
  "$bin" train "${BEST[@]}" --max-steps 40 --eval-data data/gsm-symbolic/eval.jsonl --eval-steps 5 \
    --save-steps 5 --save-total-limit 2 --load-best-model-at-end --output-dir "$d/best" > "$d/best.log" 2>&1 \
    || echo "best: exit $?"
  "$bin" train "${TINY[@]}" --max-steps 40 --save-steps 20 --output-dir "$d/full" > "$d/full.log" 2>&1 \
    || echo "full: exit $?"
  mkdir -p "$d/resumed" && cp -r "$d/full/checkpoint-20" "$d/resumed/"
  "$bin" train "${TINY[@]}" --max-steps 40 --save-steps 20 --output-dir "$d/resumed" \
    --resume-from-checkpoint "$d/resumed/checkpoint-20" > "$d/resumed.log" 2>&1 || echo "resumed: exit $?"
  if command -v mpirun >/dev/null; then
    mpirun --bind-to none --oversubscribe -np 2 -x RAYON_NUM_THREADS=1 "$bin" train "${TINY[@]}" \
      --max-steps 30 --save-steps 15 --zero-stage 1 --output-dir "$d/mpi" > "$d/mpi.log" 2>&1 \
      || echo "mpi: exit $?"
  fi
}

# What must match: JSON with the clocks and run ids taken out.
strip() {
  python3 - "$1" <<'PY'
import json, sys
DROP = {"tokens_per_second", "eval_runtime", "exchange_seconds", "run_id", "train_runtime",
        "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second",
        "peak_memory_bytes", "seconds"}
def clean(v):
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items() if k not in DROP}
    if isinstance(v, list):
        return [clean(x) for x in v]
    return v
path = sys.argv[1]
text = open(path).read()
if path.endswith(".jsonl"):
    print("\n".join(json.dumps(clean(json.loads(l)), sort_keys=True) for l in text.splitlines() if l))
else:
    print(json.dumps(clean(json.loads(text)), sort_keys=True))
PY
}

echo "== before: $A"; runs "$A" "$W/before"
echo "== after:  $B"; runs "$B" "$W/after"
same=0; differ=0
cd "$W/before"
while IFS= read -r f; do
  case "$f" in
    *.safetensors) x=$(sha256sum < "$f"); y=$(sha256sum < "../after/$f" 2>/dev/null) ;;
    *) x=$(strip "$f"); y=$(strip "../after/$f" 2>/dev/null) ;;
  esac
  if [ "$x" = "$y" ]; then same=$((same + 1)); else differ=$((differ + 1)); echo "DIFFER: $f"; fi
done < <(find . \( -name '*.safetensors' -o -name metrics.jsonl -o -name trainer_state.json \) | sort)
n=$(find ../after \( -name '*.safetensors' -o -name metrics.jsonl -o -name trainer_state.json \) | wc -l)
echo "compared $((same + differ)) files (after has $n): $same identical, $differ differ"
for r in demo best full resumed mpi; do
  [ -d "$r" ] && echo "$r: final model $(sha256sum < "$r/model.safetensors" 2>/dev/null | cut -c1-16)"
done
[ "$differ" -eq 0 ] && [ "$((same + differ))" -eq "$n" ]
