#!/usr/bin/env python3
"""Writes a GGUF file of Mistral-7B's shape with random weights, every matrix
in Q4_0 (the LM head in Q8_0), for the QLoRA benchmark of
docs/benchmarks/2026-12-01-lora.md: 32 layers, hidden 4096, MLP 14336, 32
query / 8 key-value heads of 128, vocabulary 32000, untied head, rope theta
1e6 (Mistral-7B-v0.2's). Weights N(0, 0.02), norms 1. No tokenizer: the
benchmark trains on the shipped data with the shipped tokenizer.

Usage: .venv-ref/bin/pip install gguf numpy; .venv-ref/bin/python scripts/make_7b_gguf.py OUT.gguf

About 3.9 GB, a few minutes on 2 cores; one tensor in memory at a time.
"""

import sys

import gguf
import numpy as np
from gguf.quants import quantize

LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, HEAD, VOCAB = 32, 4096, 14336, 32, 8, 128, 32000


def main(path):
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(32768)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD)
    writer.add_vocab_size(VOCAB)

    def matrix(name, rows, cols, kind=gguf.GGMLQuantizationType.Q4_0):
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        raw = quantize(values, kind)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)

    matrix("token_embd.weight", VOCAB, HIDDEN)
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        matrix(f"blk.{layer}.attn_q.weight", HEADS * HEAD, HIDDEN)
        matrix(f"blk.{layer}.attn_k.weight", KV_HEADS * HEAD, HIDDEN)
        matrix(f"blk.{layer}.attn_v.weight", KV_HEADS * HEAD, HIDDEN)
        matrix(f"blk.{layer}.attn_output.weight", HIDDEN, HEADS * HEAD)
        matrix(f"blk.{layer}.ffn_gate.weight", MLP, HIDDEN)
        matrix(f"blk.{layer}.ffn_up.weight", MLP, HIDDEN)
        matrix(f"blk.{layer}.ffn_down.weight", HIDDEN, MLP)
        print(f"layer {layer + 1}/{LAYERS}", flush=True)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    matrix("output.weight", VOCAB, HIDDEN, gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1])
