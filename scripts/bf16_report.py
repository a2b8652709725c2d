#!/usr/bin/env python3
"""The summary of scripts/bench_bf16.sh: one row per cell, padfree f32 and
bf16 against HF transformers' fastest mode (f32 or bf16=True, padded or
flattening), real tokens/s, peak memory, final losses.

    python3 scripts/bf16_report.py runs/bf16 > runs/bf16/summary.md
"""
import json
import os
import sys


def load(path):
    with open(os.path.join(path, "bench.json")) as f:
        return json.load(f)


def main():
    out = sys.argv[1]
    cells = sorted({d.rsplit("-", 1)[0] for d in os.listdir(out)
                    if os.path.isfile(os.path.join(out, d, "bench.json"))})
    print("| cell | padfree f32 | padfree bf16 | bf16 / f32 | HF fastest (mode) | padfree bf16 / HF fastest "
          "| peak MiB f32 -> bf16 | final loss f32 / bf16 / HF bf16 flattening |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |")
    for cell in cells:
        try:
            f32, bf16 = load(os.path.join(out, f"{cell}-f32")), load(os.path.join(out, f"{cell}-bf16"))
        except FileNotFoundError:
            continue
        ours = {p: next(r for r in d["results"] if r["mode"] == "varlen") for p, d in (("f32", f32), ("bf16", bf16))}
        hf = [r for d in (f32, bf16) for r in d["results"] if r["mode"].startswith("hf-")]
        best = max(hf, key=lambda r: r["real_tokens_per_second"])
        hf_bf16_flat = next((r for r in hf if r["mode"] == "hf-flattening-bf16"), None)
        mib = lambda r: r["peak_memory_bytes"] / 1048576
        a, b = ours["f32"]["real_tokens_per_second"], ours["bf16"]["real_tokens_per_second"]
        hf_loss = f"{hf_bf16_flat['final_loss']:.4f}" if hf_bf16_flat else "-"
        print(f"| {cell} | {a:.0f} | {b:.0f} | {b / a:.2f}x | {best['real_tokens_per_second']:.0f} ({best['mode']}) "
              f"| {b / best['real_tokens_per_second']:.2f}x | {mib(ours['f32']):.0f} -> {mib(ours['bf16']):.0f} "
              f"({mib(ours['bf16']) / mib(ours['f32']):.2f}x) | {ours['f32']['final_loss']:.4f} / "
              f"{ours['bf16']['final_loss']:.4f} / {hf_loss} |")
    machine = load(os.path.join(out, f"{cells[0]}-f32"))["machine"] if cells else "?"
    print(f"\nmachine: {machine}")


if __name__ == "__main__":
    main()
