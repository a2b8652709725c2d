#!/usr/bin/env python3
"""Global-memory traffic of padfree's GPU attention per layer, by design.

Counts every load and store the kernels issue (f32), for the per-row kernels
(`attention/cube/rows.rs`: one invocation per row and head, every earlier key
and value read from global memory) and the tiled ones (`cube/tiled.rs`: a
workgroup per block of BLOCK_ROWS rows and set of query heads, keys and values
read once per block and set), with one query head a workgroup (the layout
before) and with a group's query heads together (at most GROUP_THREADS threads
a workgroup: the largest divisor of H / Hkv within that). Caches are not
modelled: on a real GPU the L2 serves part of the repeated reads, which only a
measurement shows.

    python3 scripts/attention_traffic.py
"""

BLOCK_ROWS = 64
GROUP_THREADS = 256


def heads_per_workgroup(group, block=BLOCK_ROWS):
    """As `heads_per_workgroup` in cube/tiled.rs on a device allowing 256 threads."""
    most = max(1, min(group, GROUP_THREADS // block))
    return max(n for n in range(1, most + 1) if group % n == 0)


def traffic(lengths, heads, kv_heads, d, per_workgroup=1, block=BLOCK_ROWS):
    """(per-row forward, per-row backward, tiled forward, tiled backward), bytes,
    the tiled kernels with `per_workgroup` query heads a forward and dQ workgroup."""
    group = heads // kv_heads
    sets = heads // per_workgroup
    pf = pb = tf = tb = 0
    for length in lengths:
        for t in range(length):
            keys = t + 1
            # forward: q and out once, lse, K and V of every earlier key
            pf += heads * (keys * 8 * d + 8 * d + 4)
            # delta = rowsum(dO * O)
            pb += heads * (8 * d + 4)
            # dQ: K and V of every earlier key; q, dO, lse, delta; dq written
            pb += heads * (keys * 8 * d + 8 * d + 8 + 4 * d)
            # dK, dV: k and v once, q, dO, lse, delta of every later query of
            # the group's heads, dk and dv written
            later = length - t
            pb += kv_heads * (8 * d + group * later * (8 * d + 8) + 8 * d)
        for first in range(0, length, block):
            rows = min(block, length - first)
            keys = first + rows
            tf += sets * keys * 8 * d + heads * rows * (8 * d + 4)
            tb += heads * (8 * d + 4) * rows
            tb += sets * keys * 8 * d + heads * rows * (8 * d + 8 + 4 * d)
            queries = length - first
            tb += kv_heads * (rows * 8 * d + group * queries * (8 * d + 8) + rows * 8 * d)
    return pf, pb, tf, tb


def main():
    batches = [
        ("16 x 256", [256] * 16),
        ("4 x 1,024", [1024] * 4),
        ("1 x 2,048 + 8 x 256", [2048] + [256] * 8),
    ]
    models = [("SmolLM2-135M (9/3 heads, D 64)", 9, 3, 64), ("1B (32/4 heads, D 64)", 32, 4, 64)]
    print(
        "| model | micro-batch | forward per-row -> tiled by head -> tiled, heads together"
        " | backward per-row -> tiled by head -> tiled, heads together |"
    )
    print("| --- | --- | ---: | ---: |")
    for model, heads, kv_heads, d in models:
        together = heads_per_workgroup(heads // kv_heads)
        for name, lengths in batches:
            pf, pb, tf, tb = traffic(lengths, heads, kv_heads, d)
            _, _, gf, gb = traffic(lengths, heads, kv_heads, d, together)
            print(
                f"| {model}, {together} heads a workgroup | {name}"
                f" | {pf / 1e6:,.0f} -> {tf / 1e6:,.1f} -> {gf / 1e6:,.1f} MB ({pf / gf:.0f}x)"
                f" | {pb / 1e6:,.0f} -> {tb / 1e6:,.1f} -> {gb / 1e6:,.1f} MB ({pb / gb:.0f}x) |"
            )

if __name__ == "__main__":
    main()
