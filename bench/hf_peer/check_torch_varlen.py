"""Checks hf_peer's `--attn torch_varlen` glue where no GPU is: a tiny Llama
under bf16 autocast, flattened, with PyTorch's varlen kernel replaced by a
stand-in (per-example causal sdpa) that also checks what the real kernel
demands (16-bit q, k and v of one dtype, int32 `cu_seq`, the causal window),
against the same model run one example at a time. Both ways the boundaries
arrive: the collator's `cu_seq_lens_q`, and `position_ids` alone.

    python bench/hf_peer/check_torch_varlen.py    # torch >= 2.10, transformers >= 5
"""

import functools
import os
import sys

import torch
import torch.nn.attention.varlen as varlen

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
real = varlen.varlen_attn
calls = []


@functools.wraps(real)  # hf_peer reads the real signature through it
def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    window = kwargs.get("window_size", (-1, 0) if kwargs.get("is_causal") else (-1, -1))
    assert tuple(window) == (-1, 0), f"not causal: {kwargs}"
    assert cu_q.dtype == torch.int32, cu_q.dtype
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16), (q.dtype, k.dtype, v.dtype)
    calls.append(cu_q.tolist())
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=kwargs.get("scale")).transpose(0, 1)
    return out


varlen.varlen_attn = stand_in
import hf_peer  # noqa: E402  (after the stand-in is in place)
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM  # noqa: E402

hf_peer.register_torch_varlen()
config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
examples = [{"input_ids": torch.randint(0, 100, (n,)).tolist()} for n in (5, 1, 9, 3)]
for e in examples:
    e["labels"] = list(e["input_ids"])


def model(attn):
    torch.manual_seed(1)
    m = LlamaForCausalLM(config)
    m.config._attn_implementation = attn
    return m


for collator_kwargs in (True, False):
    calls.clear()
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=collator_kwargs)(examples)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flat = model("torch_varlen")(**batch)
        ref = model("sdpa")
        one = torch.cat([ref(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in examples])
    flat.loss.backward()
    diff = (flat.logits[0] - one).abs().max().item()
    # bf16 logits of magnitude ~1: a few units in the last place of bf16 (2^-8).
    assert diff < 2e-2, diff
    assert calls == [[0, 5, 6, 15, 18]] * config.num_hidden_layers, calls
    print(f"torch_varlen ({'collator kwargs' if collator_kwargs else 'position_ids'}): "
          f"max |logits - one at a time| = {diff:.2e}, {len(calls)} kernel calls")
print("torch_varlen glue ok")
