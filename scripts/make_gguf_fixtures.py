#!/usr/bin/env python3
"""Writes GGUF fixtures for padfree-model's tests with llama.cpp's own Python
package `gguf` (PyPI):

- fixtures/gguf/llama-tiny.gguf: the tiny HF Llama of fixtures/hf/llama-tiny
  written as llama.cpp's converter does (tensor names, query/key row
  permutation, metadata), all tensors F32 except the embedding in Q8_0.
- fixtures/gguf/llama-tiny-q4.gguf: the same with every decoder-layer
  projection quantized (Q4_0, Q4_1, Q8_0: PROJECTION_TYPES), a QLoRA base.
- fixtures/gguf/dequant.safetensors: for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K, raw
  blocks (`raw.<type>`, u8) and their values as gguf-py dequantizes them
  (`expected.<type>`, f32).

Usage: .venv-ref/bin/pip install gguf numpy safetensors torch; .venv-ref/bin/python scripts/make_gguf_fixtures.py
"""

import json
import pathlib

import gguf
import numpy as np
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "gguf"


def permute(weights, n_head):
    """llama.cpp convert_hf_to_gguf.py's permutation of query/key rows."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


# llama-tiny-q4.gguf: the decoder layers' projections quantized as a QLoRA
# base is (the test of the fused quantized matmul on a whole model).
PROJECTION_TYPES = {
    "self_attn.q_proj": "Q4_0", "self_attn.k_proj": "Q4_0", "self_attn.v_proj": "Q4_1",
    "self_attn.o_proj": "Q4_1", "mlp.gate_proj": "Q8_0", "mlp.up_proj": "Q8_0", "mlp.down_proj": "Q4_0",
}


def write_tiny_llama(file_name="llama-tiny.gguf", projection_types=None):
    source = ROOT / "fixtures" / "hf" / "llama-tiny"
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    writer = gguf.GGUFWriter(OUT / file_name, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if name == "model.embed_tokens.weight":
            raw = quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if name == "model.norm.weight":
            target = "output_norm.weight"
        elif name == "lm_head.weight":
            target = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            target = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
            if rest.startswith("self_attn.q_proj"):
                value = permute(value, config["num_attention_heads"])
            elif rest.startswith("self_attn.k_proj"):
                value = permute(value, config["num_key_value_heads"])
            kind = (projection_types or {}).get(rest.removesuffix(".weight"))
            if kind is not None:
                kind = gguf.GGMLQuantizationType[kind]
                raw = quantize(np.ascontiguousarray(value), kind)
                writer.add_tensor(target, raw, raw_shape=raw.shape, raw_dtype=kind)
                continue
        writer.add_tensor(target, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_dequant_fixtures():
    rng = np.random.default_rng(7)
    out = {}
    values = rng.standard_normal(512).astype(np.float32)
    for qtype in ("Q4_0", "Q4_1", "Q8_0"):
        kind = gguf.GGMLQuantizationType[qtype]
        raw = quantize(values, kind)
        out[f"raw.{qtype}"] = raw.reshape(-1).view(np.uint8)
        out[f"expected.{qtype}"] = dequantize(raw, kind).reshape(-1).astype(np.float32)
    # K-quants: random blocks with small positive f16 scales (gguf-py has no
    # quantizer for them), dequantized by gguf-py's reference code.
    for qtype, scale_offsets in (("Q4_K", (0, 2)), ("Q6_K", (208,))):
        kind = gguf.GGMLQuantizationType[qtype]
        _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        blocks = rng.integers(0, 256, size=(2, block_bytes), dtype=np.uint8)
        for offset in scale_offsets:
            blocks[:, offset : offset + 2] = np.frombuffer(
                rng.uniform(0.001, 0.05, size=2).astype(np.float16).tobytes(), dtype=np.uint8
            ).reshape(2, 2)
        out[f"raw.{qtype}"] = blocks.reshape(-1)
        out[f"expected.{qtype}"] = dequantize(blocks, kind).reshape(-1).astype(np.float32)
    save_file(out, OUT / "dequant.safetensors")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    write_tiny_llama()
    write_tiny_llama("llama-tiny-q4.gguf", PROJECTION_TYPES)
    write_dequant_fixtures()
    print("wrote", *sorted(p.name for p in OUT.iterdir()))
