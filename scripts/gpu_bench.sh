#!/usr/bin/env bash
# padfree on a real GPU against HF transformers on the same batches: a
# SmolLM2-135M-shaped and a 1B-shaped (TinyLlama-1.1B) Llama, randomly
# initialised, padded vs padding-free (the tiled CubeCL attention), padfree through Vulkan and through
# CUDA (GPU_BENCH_DEVICES, default "vulkan cuda"; a device the binary or
# the machine cannot open is said and skipped), HF through CUDA (sdpa in
# float32, as padfree; flash-attention 2 in bfloat16 where `flash_attn` is
# installed, since it has no float32). Then the same padding-free rows
# with --bf16 (bf16 on CUDA, f16 on Vulkan's WGSL), HF with bf16=True
# beside them, and flattened with PyTorch's own FlashAttention-2 varlen
# kernel (`--attn torch_varlen`, torch >= 2.10) where `flash_attn` is not
# installed, and the varlen attention alone (`padfree bench
# --attention-alone`: the tiled kernels against the per-row ones they
# replaced, and on 16-bit inputs). First of all, `padfree check` on each
# device, f32 and --bf16 (padded = padding-free = one at a time on the
# device). Prints real tokens/s, device memory and MFU against the GPU's
# float32 peak (bf16 rows: its bf16 peak), and writes $out/gpu-bench.md.
#
# Needs nothing built on the GPU machine: a padfree built elsewhere with
#   cargo build --release --locked --features wgpu,cuda && strip target/release/padfree
#   mkdir -p .gpu && gzip -9 -c target/release/padfree > .gpu/padfree.gz
# carried as .gpu/padfree.gz (stripped: 81 MB with `wgpu,cuda`, 69 MB with
# `wgpu` alone, over a 64 MiB carry limit; gzipped: 22 MB, 18 MB; unpacked
# here when .gpu/padfree is missing), the
# repository's bench/hf_peer/
# script, python3 with torch and transformers, and a Vulkan loader
# (libvulkan1; `.gl/*.deb` are unpacked when present). No network.
#
#   bash scripts/gpu_bench.sh [BIN] [OUTPUT_DIR]
#
# FP32_PEAK_TFLOPS overrides the peak MFU is measured against (default 67,
# the H200 SXM's dense float32 figure from NVIDIA's data sheet);
# BF16_PEAK_TFLOPS that of the bf16 rows (default 989, its dense bf16
# tensor-core figure). GPU_BENCH_PARTS picks what runs (default "check
# launches f32 bf16 attention"; "launches" counts the kernel launches of 3
# training steps, every launch logged by cubecl's profiler, with one and
# with two micro-batches a step: GPU_BENCH_LAUNCH_MICRO_BATCHES), GPU_BENCH_MODELS the models (default "smollm2-135m
# llama-1b") and GPU_BENCH_DEVICES the devices (default "cuda vulkan"); the
# order is model by model, each on every device in turn. GPU_BENCH_BATCH is
# the batch (default 16), GPU_BENCH_STEPS / GPU_BENCH_WARMUP the timed and
# untimed steps (15, 5: on CUDA each kernel's first use compiles it through
# NVRTC, about 1.5 s for a matmul kernel, and some kernels are compiled per
# shape, so the first steps are slow). GPU_BENCH_SECONDS (default: none) is the time the
# whole run may take: each command runs under `timeout` with what is left
# (and at most GPU_BENCH_CAP seconds, default 240), and a command that
# would start with under 20 s left is skipped and said, so a device call
# of at most 10 minutes ends with its report. GPU_BENCH_CHECK_DEVICES and
# GPU_BENCH_CHECK_BATCHES narrow the checks (default: every device, 2
# micro-batches). Runs in turns into the same
# OUTPUT_DIR add up (the report is remade from whatever results the
# directory holds). Every command's output is in OUTPUT_DIR/*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-.gpu/padfree}
out=${2:-runs/gpu-bench-$(date +%Y%m%d-%H%M%S)}
peak=${FP32_PEAK_TFLOPS:-67}
bf16_peak=${BF16_PEAK_TFLOPS:-989}
steps=${GPU_BENCH_STEPS:-15}
warmup=${GPU_BENCH_WARMUP:-5}
batch=${GPU_BENCH_BATCH:-16}
budget=${GPU_BENCH_SECONDS:-0}
cap=${GPU_BENCH_CAP:-240}
started=$SECONDS
mkdir -p "$out"
if [ ! -x "$bin" ] && [ -f "$bin.gz" ]; then
    gzip -dc "$bin.gz" >"$bin"
    chmod +x "$bin"
fi

# step NAME LOG COMMAND...: runs COMMAND with its output in LOG (its last
# lines echoed), under `timeout` with what is left of GPU_BENCH_SECONDS;
# fails without running when too little is left.
step() {
    local name=$1 log=$2 limit=$cap rc
    shift 2
    if [ "$budget" -gt 0 ]; then
        local left=$((budget - (SECONDS - started)))
        if [ "$left" -lt 20 ]; then
            echo "skipped: $name (${left} s left of GPU_BENCH_SECONDS=$budget)" | tee -a "$out/skipped.txt"
            return 1
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "== $name (at $((SECONDS - started)) s, at most $limit s)"
    timeout -k 5 "$limit" "$@" >"$log" 2>&1
    rc=$?
    tail -n 12 "$log"
    [ "$rc" -eq 124 ] && echo "timed out after $limit s: $name" | tee -a "$out/skipped.txt"
    [ "$rc" -ne 0 ] && echo "failed ($rc): $name (see $log)"
    return "$rc"
}

if [ -d .gl ] && ! ldconfig -p | grep -q libvulkan; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
# padfree's CUDA build compiles its kernels with NVRTC at run time, which
# needs libnvrtc on the library path and CUDA's headers under
# $CUDA_PATH/include: a toolkit's (/usr/local/cuda), else those of the CUDA
# wheels PyTorch installed (nvidia-cuda-nvrtc and nvidia-cuda-runtime:
# nvidia/cuda_nvrtc/lib in CUDA 12's layout, nvidia/cu13/lib in 13's).
nvidia=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
if [ -z "${CUDA_PATH:-}" ]; then
    for dir in /usr/local/cuda "$nvidia/cu13" "$nvidia/cuda_runtime"; do
        if [ -f "$dir/include/cuda_runtime.h" ] || [ -f "$dir/include/cuda.h" ]; then
            export CUDA_PATH=$dir
            break
        fi
    done
fi
if ! ldconfig -p | grep -q 'libnvrtc\.so'; then
    for lib in "${CUDA_PATH:-/usr/local/cuda}"/lib64 "${CUDA_PATH:-/usr/local/cuda}"/targets/x86_64-linux/lib \
        "$nvidia/cu13/lib" "$nvidia/cuda_nvrtc/lib"; do
        if ls "$lib"/libnvrtc.so* >/dev/null 2>&1; then
            export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
            break
        fi
    done
fi
{
    echo "CUDA_PATH=${CUDA_PATH:-unset} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    ldconfig -p | grep -E 'libcuda\.so|libnvrtc|libvulkan' || true
    first_lib=${LD_LIBRARY_PATH:-}; ls "${first_lib%%:*}" 2>/dev/null | grep -E 'nvrtc' || true
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' 2>&1 | tail -1
    "$bin" --version
    lscpu | grep -E 'Model name|^CPU\(s\)'
} 2>&1 | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/gpu.txt" 2>/dev/null || true

cat >"$out/smollm2-135m.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
 "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
 "tie_word_embeddings": true, "initializer_range": 0.041666666666666664,
 "hidden_act": "silu", "attention_bias": false, "mlp_bias": false}
JSON
cat >"$out/llama-1b.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
 "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 64,
 "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
 "tie_word_embeddings": false, "initializer_range": 0.02,
 "hidden_act": "silu", "attention_bias": false, "mlp_bias": false}
JSON

flash=no
if python3 -c 'import flash_attn' 2>/dev/null; then flash=yes; fi
varlen=no
if python3 -c 'import torch.nn.attention.varlen' 2>/dev/null; then varlen=yes; fi
echo "flash_attn installed: $flash; torch.nn.attention.varlen: $varlen"

devices=${GPU_BENCH_DEVICES:-cuda vulkan}
parts=" ${GPU_BENCH_PARTS:-check launches f32 bf16 attention} "
if [[ "$parts" == *" check "* ]]; then
    # Padded = padding-free = one example at a time, logits, loss and every
    # gradient, on the device itself (the tiny preset: seconds of work).
    for device in ${GPU_BENCH_CHECK_DEVICES:-$devices}; do
        for precision in f32 bf16; do
            flag=()
            [ "$precision" = bf16 ] && flag=(--bf16)
            step "padfree check on $device, $precision" "$out/check-$device-$precision.log" \
                "$bin" check --device "$device" --config tiny --batches "${GPU_BENCH_CHECK_BATCHES:-2}" "${flag[@]}" \
                --output-dir "$out/check-$device-$precision"
            echo "$device $precision $?" >>"$out/checks.txt"
        done
    done
fi
if [[ "$parts" == *" launches "* ]]; then
    # Kernel launches a step: cubecl's profiler at its "minimal" level logs
    # every launch (no timing) to a file, read from a cubecl.toml in the
    # working directory; 3 training steps of the SmolLM2-135M shape.
    # Once with one micro-batch a step and once with two
    # (GPU_BENCH_LAUNCH_MICRO_BATCHES), so that what a micro-batch adds
    # (gradient accumulation's sums among it) shows too.
    abs_bin=$(realpath "$bin") abs_out=$(realpath "$out")
    for device in $devices; do
        for micro in ${GPU_BENCH_LAUNCH_MICRO_BATCHES:-1 2}; do
            dir="$abs_out/launches-$device-$micro"
            mkdir -p "$dir"
            printf '[profiling.logger]\nlevel = "minimal"\nfile = "%s"\n' "$dir/launches.log" >"$dir/cubecl.toml"
            rm -f "$dir/launches.log"
            (cd "$dir" && out=$abs_out step "kernel launches on $device (3 steps of $micro micro-batches)" "$dir/train.log" \
                "$abs_bin" train --device "$device" --config "$abs_out/smollm2-135m.json" \
                --per-device-train-batch-size "$batch" --gradient-accumulation-steps "$micro" \
                --max-steps 3 --logging-steps 1 \
                --save-strategy no --eval-strategy no --output-dir "$dir/run" --overwrite-output-dir)
            sleep 1
            count=$(grep -c '^Executing' "$dir/launches.log" 2>/dev/null)
            echo "$device ${count:-0} $micro" >>"$out/launches.txt"
        done
    done
fi
common=(--per-device-train-batch-size "$batch" --max-steps "$steps" --timing-warmup-steps "$warmup")
for model in ${GPU_BENCH_MODELS:-smollm2-135m llama-1b}; do
    peer=(--peer-python python3)
    bf16_peer=(--peer-python python3)
    for device in $devices; do
        if [[ "$parts" == *" f32 "* ]]; then
            # HF's rows once per model, with the first device's run.
            if step "$model on $device" "$out/$model-$device.log" \
                "$bin" bench --device "$device" --config "$out/$model.json" \
                --modes padded,varlen "${peer[@]}" "${common[@]}" --output-dir "$out/$model-$device" \
                && [ -f "$out/$model-$device/bench.json" ]; then
                peer=()
                [ -e "$out/$model" ] || ln -s "$model-$device" "$out/$model"
            fi
        fi
        if [[ "$parts" == *" bf16 "* ]]; then
            if step "$model on $device, --bf16" "$out/$model-$device-bf16.log" \
                "$bin" bench --device "$device" --config "$out/$model.json" --bf16 \
                --modes varlen "${bf16_peer[@]}" "${common[@]}" --output-dir "$out/$model-$device-bf16" \
                && [ -f "$out/$model-$device-bf16/bench.json" ] && [ ${#bf16_peer[@]} -gt 0 ]; then
                bf16_peer=()
                if [ "$varlen" = yes ] && [ -d "$out/$model-$device-bf16/peer" ]; then
                    step "$model: HF bf16=True, flattened, PyTorch's FlashAttention-2 varlen" \
                        "$out/$model-hf-torch-varlen.log" \
                        python3 bench/hf_peer/hf_peer.py --peer-dir "$out/$model-$device-bf16/peer" \
                        --mode flattening --device cuda --attn torch_varlen --bf16 \
                        --out "$out/$model-hf-torch-varlen.json"
                fi
            fi
        fi
        if [[ "$parts" == *" attention "* ]]; then
            step "$model on $device, the attention alone" "$out/$model-$device-attention.log" \
                "$bin" bench --device "$device" --config "$out/$model.json" --bf16 --attention-alone \
                "${common[@]}" --output-dir "$out/$model-$device-attention"
        fi
    done
    if [ "$flash" = yes ] && [ -d "$out/$model/peer" ]; then
        step "$model: HF flash-attention 2" "$out/$model-hf-flash.log" \
            python3 bench/hf_peer/hf_peer.py --peer-dir "$out/$model/peer" --mode flattening \
            --device cuda --attn flash_attention_2 --out "$out/$model/hf-flash.json"
    fi
done

python3 - "$out" "$peak" "$flash" "$bf16_peak" "$devices" <<'PY'
import json, os, sys
out, peak, flash = sys.argv[1], float(sys.argv[2]) * 1e12, sys.argv[3]
bf16_peak, devices = float(sys.argv[4]) * 1e12, sys.argv[5].split()
gpu = open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(os.path.join(out, "gpu.txt")) else ""
lines = [f"# padfree on a GPU ({gpu or 'GPU unknown'})", "",
         f"MFU against {peak / 1e12:.0f} TFLOP/s (float32 peak), bf16 rows against {bf16_peak / 1e12:.0f} (bf16 peak). Flash-attention 2 installed: {flash}.", ""]
checks = []
for device in devices:
    for precision in ["f32", "bf16"]:
        log = os.path.join(out, f"check-{device}-{precision}.log")
        if not os.path.exists(log):
            continue
        text = open(log, errors="replace").read().splitlines()
        verdict = next((l for l in reversed(text) if l.startswith("packing check")), None)
        worst = [l.split() for l in text if l.strip().startswith("gradients: one-at-a-time")]
        rel = max((float(w[4]) for w in worst), default=None)
        checks.append(f"| {device} | {precision} | {verdict or (text[-1] if text else 'no output')} | "
                      f"{'-' if rel is None else f'{rel:.2e}'} |")
if checks:
    lines += ["## `padfree check` on the device (tiny preset, 2 micro-batches)", "",
              "| device | precision | verdict | largest relative gradient difference, one at a time vs padding-free |",
              "| --- | --- | --- | ---: |"] + checks + [""]
lines += ["## Training (real tokens/s over the timed steps)", "",
          "| model | mode | real tokens/s | padded tokens | device memory | MFU | final loss |",
          "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
attention = []
for model in ["smollm2-135m", "llama-1b"]:
    rows = []
    for device in devices:
        for suffix, tag in [("", ""), ("-bf16", ", bf16")]:
            path = os.path.join(out, f"{model}-{device}{suffix}", "bench.json")
            if not os.path.exists(path):
                lines.append(f"| {model} | padfree{tag} on {device}: no result | | | | | |")
                continue
            for r in json.load(open(path))["results"]:
                if not r["mode"].startswith("hf"):
                    r["mode"] = f"{r['mode']} ({device}{tag})"
                elif tag:
                    r["mode"] = f"{r['mode']} (bf16=True)"
                r["bf16"] = bool(tag)
                rows.append(r)
        path = os.path.join(out, f"{model}-{device}-attention", "attention.json")
        if os.path.exists(path):
            a = json.load(open(path))
            for t in a["timings"]:
                attention.append(f"| {model} | {device} | {t['kernel']} | {a['tokens_per_call']:.0f} | {t['ms_per_call']:.3f} | {t['ms_per_step']:.1f} | {t['gflops']:.1f} |")
    for extra, bf16 in [(os.path.join(out, model, "hf-flash.json"), True),
                        (os.path.join(out, f"{model}-hf-torch-varlen.json"), True)]:
        if os.path.exists(extra):
            r = json.load(open(extra))
            r["bf16"] = bf16
            rows.append(r)
    flops = next((r["model_flops"] for r in rows if r.get("model_flops")), None)
    for r in rows:
        p = bf16_peak if r.get("bf16") else peak
        mfu = f"{100 * flops / r['train_runtime'] / p:.1f}%" if flops else "-"
        # padfree's rows: device memory its runtime held; HF's: CUDA's peak.
        mem = r.get("peak_device_memory_bytes") or r.get("peak_memory_bytes")
        mem = f"{mem / 2**30:.2f} GiB" if mem else "-"
        padded = r["fed_tokens"] - r["real_tokens"]
        lines.append(f"| {model} | {r['mode']} | {r['real_tokens_per_second']:.0f} | {padded} | {mem} | {mfu} | {r['final_loss']:.4f} |")
lines += ["", "Device memory: padfree rows, the most its GPU runtime's pools held after a step",
          "(cubecl's memory report); HF rows on CUDA, torch.cuda.max_memory_allocated."]
lines += ["", "## The varlen attention alone (one layer's forward and backward a call)", "",
          "| model | device | kernel | tokens a call | ms a call | ms a step (all layers) | GFLOP/s |",
          "| --- | --- | --- | ---: | ---: | ---: | ---: |"] + (attention or ["| no result | | | | | | |"])
launches = os.path.join(out, "launches.txt")
if os.path.exists(launches):
    lines += ["", "## Kernel launches (SmolLM2-135M shape, 3 training steps, cubecl's profiler)", "",
              "| device | micro-batches a step | launches | a step |", "| --- | ---: | ---: | ---: |"]
    for l in open(launches).read().splitlines():
        fields = l.split()
        device, count = fields[:2]
        micro = fields[2] if len(fields) > 2 else "1"
        lines.append(f"| {device} | {micro} | {count} | {int(count) / 3:.0f} |")
skipped = os.path.join(out, "skipped.txt")
if os.path.exists(skipped):
    lines += ["", "## Skipped or timed out", ""] + [f"- {l}" for l in open(skipped).read().splitlines()]
text = "\n".join(lines) + "\n"
open(os.path.join(out, "gpu-bench.md"), "w").write(text)
print(text)
PY
