#!/usr/bin/env bash
# padfree on a real GPU against HF transformers on the same batches: a
# SmolLM2-135M-shaped and a 1B-shaped (TinyLlama-1.1B) Llama, randomly
# initialised, padded vs padding-free (the tiled CubeCL attention), padfree through Vulkan and through
# CUDA (GPU_BENCH_DEVICES, default "vulkan cuda"; a device the binary or
# the machine cannot open is said and skipped), HF through CUDA (sdpa in
# float32, as padfree; flash-attention 2 in bfloat16 where `flash_attn` is
# installed, since it has no float32). Then the same padding-free rows
# with --bf16 (bf16 on CUDA, f16 on Vulkan's WGSL), HF with bf16=True
# beside them, and the varlen attention alone (`padfree bench
# --attention-alone`: the tiled kernels against the per-row ones they
# replaced, and on 16-bit inputs). Prints real tokens/s, device memory and
# MFU against the GPU's float32 peak (bf16 rows: its bf16 peak), and writes
# $out/gpu-bench.md.
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
# tensor-core figure). GPU_BENCH_PARTS picks what runs (default "f32 bf16
# attention"), GPU_BENCH_MODELS the models (default "smollm2-135m
# llama-1b") and GPU_BENCH_DEVICES the devices: a device call limited to
# 10 minutes can run them in turns into the same OUTPUT_DIR (the report
# is remade from whatever results the directory holds).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-.gpu/padfree}
out=${2:-runs/gpu-bench-$(date +%Y%m%d-%H%M%S)}
peak=${FP32_PEAK_TFLOPS:-67}
bf16_peak=${BF16_PEAK_TFLOPS:-989}
steps=${GPU_BENCH_STEPS:-6}
warmup=${GPU_BENCH_WARMUP:-2}
mkdir -p "$out"
if [ ! -x "$bin" ] && [ -f "$bin.gz" ]; then
    gzip -dc "$bin.gz" >"$bin"
    chmod +x "$bin"
fi

if [ -d .gl ] && ! ldconfig -p | grep -q libvulkan; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
# padfree's CUDA build compiles its kernels with NVRTC at run time, which
# needs libnvrtc and CUDA's headers: without a CUDA toolkit, take those of
# the CUDA wheels PyTorch installed (nvidia-cuda-nvrtc, nvidia-cuda-runtime).
if [ -z "${CUDA_PATH:-}" ] && [ ! -d /usr/local/cuda ]; then
    nvidia=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
    if [ -n "$nvidia" ] && [ -d "$nvidia/cuda_runtime/include" ]; then
        export CUDA_PATH="$nvidia/cuda_runtime"
        export LD_LIBRARY_PATH="$nvidia/cuda_nvrtc/lib:$nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}"
    fi
fi
echo "CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true
"$bin" --version

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

devices=${GPU_BENCH_DEVICES:-vulkan cuda}
parts=" ${GPU_BENCH_PARTS:-f32 bf16 attention} "
for model in ${GPU_BENCH_MODELS:-smollm2-135m llama-1b}; do
    peer=(--peer-python python3)
    bf16_peer=(--peer-python python3)
    for device in $devices; do
        if [[ "$parts" == *" f32 "* ]]; then
            echo "== $model on $device"
            # HF's rows once per model, with the first device's run.
            "$bin" bench --device "$device" --config "$out/$model.json" \
                --modes padded,varlen "${peer[@]}" \
                --per-device-train-batch-size 8 --max-steps "$steps" --timing-warmup-steps "$warmup" \
                --output-dir "$out/$model-$device" 2>&1 | tee "$out/$model-$device.log" \
                || echo "padfree on $device did not run (see $out/$model-$device.log)"
            if [ -f "$out/$model-$device/bench.json" ]; then
                peer=()
                [ -d "$out/$model" ] || ln -s "$model-$device" "$out/$model"
            fi
        fi
        if [[ "$parts" == *" bf16 "* ]]; then
            echo "== $model on $device, --bf16"
            "$bin" bench --device "$device" --config "$out/$model.json" --bf16 \
                --modes varlen "${bf16_peer[@]}" \
                --per-device-train-batch-size 8 --max-steps "$steps" --timing-warmup-steps "$warmup" \
                --output-dir "$out/$model-$device-bf16" 2>&1 | tee "$out/$model-$device-bf16.log" \
                || echo "padfree --bf16 on $device did not run (see $out/$model-$device-bf16.log)"
            if [ -f "$out/$model-$device-bf16/bench.json" ]; then bf16_peer=(); fi
        fi
        if [[ "$parts" == *" attention "* ]]; then
            echo "== $model on $device, the attention alone"
            "$bin" bench --device "$device" --config "$out/$model.json" --bf16 --attention-alone \
                --per-device-train-batch-size 8 --max-steps "$steps" --timing-warmup-steps "$warmup" \
                --output-dir "$out/$model-$device-attention" 2>&1 | tee "$out/$model-$device-attention.log" \
                || echo "the attention alone on $device did not run (see $out/$model-$device-attention.log)"
        fi
    done
    if [ "$flash" = yes ] && [ -d "$out/$model/peer" ]; then
        python3 bench/hf_peer/hf_peer.py --peer-dir "$out/$model/peer" --mode flattening \
            --device cuda --attn flash_attention_2 --out "$out/$model/hf-flash.json" \
            2>&1 | tail -3 || echo "flash-attention run failed"
    fi
done

python3 - "$out" "$peak" "$flash" "$bf16_peak" <<'PY'
import json, os, sys
out, peak, flash = sys.argv[1], float(sys.argv[2]) * 1e12, sys.argv[3]
bf16_peak = float(sys.argv[4]) * 1e12
lines = [f"# padfree on a GPU ({open(os.path.join(out, 'gpu.txt')).read().strip() or 'GPU unknown'})", "",
         f"MFU against {peak / 1e12:.0f} TFLOP/s (float32 peak), bf16 rows against {bf16_peak / 1e12:.0f} (bf16 peak). Flash-attention 2 installed: {flash}.", "",
         "| model | mode | real tokens/s | padded tokens | device memory | MFU | final loss |",
         "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
attention = []
for model in ["smollm2-135m", "llama-1b"]:
    rows = []
    for device in os.environ.get("GPU_BENCH_DEVICES", "vulkan cuda").split():
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
    flash_path = os.path.join(out, model, "hf-flash.json")
    if os.path.exists(flash_path):
        rows.append(json.load(open(flash_path)))
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
text = "\n".join(lines) + "\n"
open(os.path.join(out, "gpu-bench.md"), "w").write(text)
print(text)
PY
