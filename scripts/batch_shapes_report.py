"""Summarises the batch-shapes grid (scripts/bench_batch_shapes.sh).

Reads OUT/<model>-<data>-b<batch>/bench.json and prints one markdown table
per model and data set: every mode at every batch size, real tokens/s,
peak memory, MFU against that cell's calibration matmul, and padfree
padding-free's speed and memory against HF's faster mode. Standard library
only:

    python3 scripts/batch_shapes_report.py runs/batch-shapes > summary.md
"""

import json
import os
import sys

MODELS = [("smollm2", "SmolLM2-135M-Instruct"), ("medium", "medium (56.4M, vocabulary 32,000)")]
DATA = [("short", "short chat examples (data/short-arith)"), ("shipped", "shipped maths data (data/gsm-symbolic)")]
BATCHES = [4, 8, 16]
MODES = [("padded", "padfree, padded"), ("varlen", "padfree, padding-free"),
         ("hf-padded", "HF, padded"), ("hf-flattening", "HF, flattening")]


def cell(out, model, data, batch):
    path = os.path.join(out, f"{model}-{data}-b{batch}", "bench.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    rows = {r["mode"]: r for r in report["results"]}
    return report, rows


def mfu(row, flops_row, peak):
    flops = row.get("model_flops") or (flops_row or {}).get("model_flops")
    if not flops or not row["train_runtime"]:
        return None
    return flops / row["train_runtime"] / 1e9 / peak


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/batch-shapes"
    lines = []
    targets = []
    for model, model_name in MODELS:
        for data, data_name in DATA:
            lines.append(f"### {model_name}, {data_name}\n")
            lines.append("| batch | mean tokens per example | mode | real tokens/s | peak memory | MFU vs calibration | final loss |")
            lines.append("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
            for batch in BATCHES:
                found = cell(out, model, data, batch)
                if found is None:
                    lines.append(f"| {batch} | | (not run) | | | | |")
                    continue
                report, rows = found
                peak = report["peak"]["calibrated_gflops"]
                ours = rows.get("varlen")
                for mode, name in MODES:
                    row = rows.get(mode)
                    if row is None:
                        continue
                    per_example = row["real_tokens"] / max(row["samples"], 1)
                    share = mfu(row, ours, peak)
                    memory = row.get("peak_memory_bytes")
                    lines.append(
                        f"| {batch} | {per_example:.0f} | {name} | {row['real_tokens_per_second']:.1f} | "
                        f"{memory / 2**20:.0f} MiB | {100 * share:.1f}% | {row['final_loss']:.6f} |"
                        if memory and share is not None else
                        f"| {batch} | {per_example:.0f} | {name} | {row['real_tokens_per_second']:.1f} | | | {row['final_loss']:.6f} |"
                    )
                # HF's faster mode in this cell: on short examples its
                # padded run is sometimes the faster one.
                hf_rows = [rows[m] for m in ("hf-flattening", "hf-padded") if m in rows]
                hf = max(hf_rows, key=lambda r: r["real_tokens_per_second"], default=None)
                if ours and hf:
                    speed = ours["real_tokens_per_second"] / hf["real_tokens_per_second"]
                    memory = (ours.get("peak_memory_bytes") or 0) / max(hf.get("peak_memory_bytes") or 1, 1)
                    hf_memory = min((r.get("peak_memory_bytes") or 0) for r in hf_rows)
                    memory = (ours.get("peak_memory_bytes") or 0) / max(hf_memory, 1)
                    faster = "flattening" if hf["mode"] == "hf-flattening" else "padded"
                    targets.append((model_name, data, batch, faster, speed, memory, 100 * (mfu(ours, ours, peak) or 0)))
            lines.append("")
    lines.append("### padfree padding-free against HF's faster mode, every cell\n")
    lines.append("Memory ratio: padfree padding-free's peak over the smaller of HF's two.\n")
    lines.append("| model | data | batch | HF's faster mode | real tokens/s ratio | memory ratio | padfree MFU |")
    lines.append("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for model_name, data, batch, faster, speed, memory, share in targets:
        lines.append(f"| {model_name.split(' ')[0]} | {data} | {batch} | {faster} | {speed:.2f}x | {memory:.2f} | {share:.1f}% |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
