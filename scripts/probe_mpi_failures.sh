#!/usr/bin/env bash
# Failure probes under mpirun (docs/distributed.md, "Probed by hand"): rank 0
# killed mid-step and mid-write, a ZeRO-1 rank killed on 4 ranks, SIGTERM to
# mpirun, SIGTERM to every rank, and a second SIGTERM during a checkpoint
# write. Each interrupted run is resumed from its newest checkpoint and its
# final model compared with the uninterrupted run's (sha256 prefixes).
#
#   bash scripts/probe_mpi_failures.sh [WORK_DIR]
#
# BIN=... picks the binary (default target/release/padfree, built with
# `--features padfree-cli/mpi`). About 5 minutes on 2 cores. The write delay
# (PADFREE_WRITE_DELAY_MS, a test hook) holds each write open long enough
# to signal inside it.
set -u
cd "$(dirname "$0")/.."
BIN=${BIN:-$PWD/target/release/padfree}
W=${1:-runs/probe-mpi}
export OMPI_MCA_btl=self,vader OMPI_MCA_oob_tcp_if_include=lo RAYON_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPI=(mpirun --bind-to none --oversubscribe)
rm -rf "$W"; mkdir -p "$W"
ARGS=(train --config tiny --data data/gsm-symbolic/train.jsonl --multipack
  --max-tokens-per-batch 600 --max-steps 300 --learning-rate 3e-3 --logging-steps 1
  --save-steps 50 --seed 7)

rank_pid() { # the pid of rank $1 of the running job
  for p in $(pgrep -f "$BIN train"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" && { echo "$p"; return; }
  done
}
wait_for() { for _ in $(seq 1 1200); do [ -e "$1" ] && return 0; sleep 0.05; done; echo "timeout waiting for $1"; }
writes() { grep -c 'PADFREE_WRITE_DELAY_MS: writing' "$1" 2>/dev/null; }
sha() { sha256sum "$1" 2>/dev/null | cut -c1-16; }
latest() { find "$1" -maxdepth 1 -name 'checkpoint-*' | sort -V | tail -1; }
resume() { # $1: run dir, $2: ranks, rest: extra flags
  local dir=$1 ranks=$2 from; shift 2; from=$(latest "$dir")
  "${MPI[@]}" -np "$ranks" "$BIN" "${ARGS[@]}" "$@" --output-dir "$dir" --resume-from-checkpoint "$from" > "$dir.resume.log" 2>&1
  echo "resumed from $(basename "$from"): exit $?; final $(sha "$dir/model.safetensors") (uninterrupted $REF)"
}

echo "== uninterrupted, 2 ranks"
"${MPI[@]}" -np 2 "$BIN" "${ARGS[@]}" --output-dir "$W/ref" > "$W/ref.log" 2>&1; echo "exit $?"
REF=$(sha "$W/ref/model.safetensors")

echo "== kill -9 rank 0 mid-step"
"${MPI[@]}" -np 2 "$BIN" "${ARGS[@]}" --output-dir "$W/p1" > "$W/p1.log" 2>&1 & job=$!
wait_for "$W/p1/checkpoint-50/integrity.json"; sleep 0.3; kill -9 "$(rank_pid 0)"; wait $job
echo "exit $?; left: $(ls -A "$W/p1" | tr '\n' ' ')"; resume "$W/p1" 2

echo "== kill -9 rank 0 while it writes a checkpoint"
PADFREE_WRITE_DELAY_MS=3000 "${MPI[@]}" -np 2 -x PADFREE_WRITE_DELAY_MS "$BIN" "${ARGS[@]}" --output-dir "$W/p2" > "$W/p2.log" 2>&1 & job=$!
wait_for "$W/p2/checkpoint-50/integrity.json"; sleep 3.5
for _ in $(seq 1 400); do [ "$(writes "$W/p2.log")" -ge 2 ] && break; sleep 0.05; done
kill -9 "$(rank_pid 0)"; wait $job
echo "exit $?; left: $(ls -A "$W/p2" | tr '\n' ' ')"; resume "$W/p2" 2

echo "== kill -9 rank 0 once the temporary checkpoint exists, before the first checkpoint (medium preset)"
MARGS=(train --config medium --data data/gsm-symbolic/train.jsonl --multipack --max-tokens-per-batch 300
  --max-steps 4 --learning-rate 3e-3 --save-steps 2 --seed 7)
"${MPI[@]}" -np 2 "$BIN" "${MARGS[@]}" --output-dir "$W/m" > "$W/m.log" 2>&1 & job=$!
for _ in $(seq 1 20000); do compgen -G "$W/m/.tmp-checkpoint-*" >/dev/null && break; sleep 0.005; done
kill -9 "$(rank_pid 0)"; wait $job
echo "exit $?; left: $(ls -A "$W/m" | tr '\n' ' ')"
"${MPI[@]}" -np 2 "$BIN" "${MARGS[@]}" --output-dir "$W/m" > "$W/m2.log" 2>&1
echo "a fresh start into it: exit $?"; grep -E '^(error|HINT)' "$W/m2.log" | head -2

echo "== ZeRO-1 on 4 ranks: kill -9 rank 2, resume on 4 ranks"
"${MPI[@]}" -np 4 "$BIN" "${ARGS[@]}" --zero-stage 1 --output-dir "$W/z" > "$W/z.log" 2>&1
ZREF=$(sha "$W/z/model.safetensors")
"${MPI[@]}" -np 4 "$BIN" "${ARGS[@]}" --zero-stage 1 --output-dir "$W/z4" > "$W/z4.log" 2>&1 & job=$!
wait_for "$W/z4/checkpoint-100/integrity.json"; sleep 0.2; kill -9 "$(rank_pid 2)"; wait $job; echo "exit $?"
REF=$ZREF resume "$W/z4" 4 --zero-stage 1
cmp -s <(grep -o '"loss": [^,]*' "$W/z/metrics.jsonl") <(grep -o '"loss": [^,]*' "$W/z4/metrics.jsonl") \
  && echo "every logged loss identical" || echo "logged losses DIFFER"

echo "== SIGTERM to mpirun"
"${MPI[@]}" -np 2 "$BIN" "${ARGS[@]}" --output-dir "$W/p3" > "$W/p3.log" 2>&1 & job=$!
wait_for "$W/p3/checkpoint-50/integrity.json"; sleep 0.3; kill -TERM $job; wait $job
echo "exit $?"; grep -E '^interrupted after' "$W/p3.log"; resume "$W/p3" 2

echo "== SIGTERM to every rank"
"${MPI[@]}" -np 2 "$BIN" "${ARGS[@]}" --output-dir "$W/p3b" > "$W/p3b.log" 2>&1 & job=$!
wait_for "$W/p3b/checkpoint-50/integrity.json"; sleep 0.3; kill -TERM "$(rank_pid 0)" "$(rank_pid 1)"; wait $job
echo "exit $?"; grep -E '^interrupted after' "$W/p3b.log"; resume "$W/p3b" 2

echo "== SIGTERM to every rank, again during the checkpoint's write"
PADFREE_WRITE_DELAY_MS=3000 "${MPI[@]}" -np 2 -x PADFREE_WRITE_DELAY_MS "$BIN" "${ARGS[@]}" --output-dir "$W/p4" > "$W/p4.log" 2>&1 & job=$!
wait_for "$W/p4/checkpoint-50/integrity.json"; sleep 3.5
a=$(rank_pid 0); b=$(rank_pid 1); n=$(writes "$W/p4.log"); kill -TERM "$a" "$b"
for _ in $(seq 1 400); do [ "$(writes "$W/p4.log")" -gt "$n" ] && break; sleep 0.05; done
sleep 0.5; kill -TERM "$a" "$b"; wait $job
echo "exit $?"; grep -E 'the write is complete' "$W/p4.log" | head -2; resume "$W/p4" 2
