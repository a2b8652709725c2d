#!/usr/bin/env python3
"""The summary of scripts/bench_bf16.sh: per cell, padfree f32 and bf16
against HF transformers' modes (f32 or bf16=True, padded or flattening):
real tokens/s, MFU (padfree f32 against the f32 calibration matmul, padfree
bf16 against the bf16 one and the f32 one), peak memory, final losses.

    python3 scripts/bf16_report.py runs/bf16 > runs/bf16/summary.md
"""
import json
import os
import sys

MODELS = {"smollm2": "SmolLM2-135M", "medium": "`medium`"}
DATA = {"shipped": "maths", "short": "short chat"}


def load(path):
    with open(os.path.join(path, "bench.json")) as f:
        return json.load(f)


def order(cell):
    model, data, batch = cell.split("-")
    return (list(MODELS).index(model), list(DATA).index(data), int(batch[1:]))


def name(cell):
    model, data, batch = cell.split("-")
    return f"{MODELS[model]}, {DATA[data]}, batch {batch[1:]}"


def main():
    out = sys.argv[1]
    cells = sorted({d.rsplit("-", 1)[0] for d in os.listdir(out)
                    if os.path.isfile(os.path.join(out, d, "bench.json"))}, key=order)
    rows = []
    for cell in cells:
        try:
            f32, bf16 = load(os.path.join(out, f"{cell}-f32")), load(os.path.join(out, f"{cell}-bf16"))
        except FileNotFoundError:
            continue
        rows.append((cell, f32, bf16))

    print("Real (non-pad) tokens per second. HF's rows ran in the same `padfree bench` "
          "process as padfree's (f32 beside padfree f32, `bf16=True` beside `--bf16`).\n")
    print("| cell | padfree f32 | padfree bf16 | bf16 / f32 | HF f32 (best of padded, flattening) "
          "| HF bf16 (best) | padfree f32 / HF fastest | padfree bf16 / HF fastest |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    speed = lambda r: r["real_tokens_per_second"]
    for cell, f32, bf16 in rows:
        ours = {p: next(r for r in d["results"] if r["mode"] == "varlen") for p, d in (("f32", f32), ("bf16", bf16))}
        hf32 = max((r for r in f32["results"] if r["mode"].startswith("hf-")), key=speed)
        hf16 = max((r for r in bf16["results"] if r["mode"].startswith("hf-")), key=speed)
        best = max(speed(hf32), speed(hf16))
        a, b = speed(ours["f32"]), speed(ours["bf16"])
        short = lambda r: r["mode"].replace("hf-", "").replace("-bf16", "")
        print(f"| {name(cell)} | {a:.0f} | {b:.0f} | {b / a:.2f}x | {speed(hf32):.0f} ({short(hf32)}) "
              f"| {speed(hf16):.0f} ({short(hf16)}) | {a / best:.2f}x | {b / best:.2f}x |")

    print("\nMFU: the model FLOPs of the timed steps (`cost/flops.rs`: 6 x the layers' matmul "
          "parameters x real tokens, the head on labelled rows, the causal attention) over their "
          "time, against the cell's own calibration products (1024^3, best of 5: f32 through burn, "
          "bf16 operands through `--bf16`'s kernel). Peak memory: the resident high-water mark of "
          "padfree's process.\n")
    print("| cell | calibration GFLOP/s f32 / bf16 | MFU f32 | MFU bf16 (of bf16 peak; of f32 peak) "
          "| peak MiB f32 -> bf16 | final loss f32 / bf16 / HF bf16 flattening |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for cell, f32, bf16 in rows:
        ours = {p: next(r for r in d["results"] if r["mode"] == "varlen") for p, d in (("f32", f32), ("bf16", bf16))}
        achieved = lambda r: r["model_flops"] / r["train_runtime"] / 1e9
        p32 = f32["peak"]["calibrated_gflops"]
        p16 = bf16["peak"].get("calibrated_bf16_gflops") or float("nan")
        p32b = bf16["peak"]["calibrated_gflops"]
        mib = lambda r: r["peak_memory_bytes"] / 1048576
        hf_flat = next((r for r in bf16["results"] if r["mode"] == "hf-flattening-bf16"), None)
        hf_loss = f"{hf_flat['final_loss']:.4f}" if hf_flat else "-"
        print(f"| {name(cell)} | {p32:.0f} / {p16:.0f} | {100 * achieved(ours['f32']) / p32:.1f}% "
              f"| {100 * achieved(ours['bf16']) / p16:.1f}%; {100 * achieved(ours['bf16']) / p32b:.1f}% "
              f"| {mib(ours['f32']):.0f} -> {mib(ours['bf16']):.0f} ({mib(ours['bf16']) / mib(ours['f32']):.2f}x) "
              f"| {ours['f32']['final_loss']:.4f} / {ours['bf16']['final_loss']:.4f} / {hf_loss} |")
    machine = rows[0][1]["machine"] if rows else "?"
    print(f"\nmachine: {machine}")


if __name__ == "__main__":
    main()
