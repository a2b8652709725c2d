#!/usr/bin/env python3
"""Writes the Hugging Face reference fixtures that padfree-model's tests compare against.

For a tiny random Llama, Mistral, Qwen2 and Qwen3 (same sizes as padfree's
`tiny` preset; Mistral and Qwen2 with tied embeddings; Qwen2 with its q/k/v
biases, Qwen3 with its per-head q/k RMSNorm), it saves the model with
`save_pretrained` and, for one flattened batch made by transformers' own
`DataCollatorWithFlattening`, the logits, the loss and the gradient of every
parameter, computed by transformers in float32 on the CPU.

Usage (from the repository root, in a virtual environment):

    python -m venv .venv-ref && .venv-ref/bin/pip install torch transformers safetensors numpy
    .venv-ref/bin/python scripts/make_reference.py [llama mistral qwen2 qwen3]

The fixtures land in fixtures/hf/<name>/ and are committed; the tests need no Python.

`--bf16` writes only fixtures/hf/llama-tiny/expected-bf16.safetensors: the
same batch through the saved llama-tiny (f32 weights) under
`torch.autocast("cpu", torch.bfloat16)`, as HF's Trainer with `bf16=True`
runs it, for padfree's `--bf16`:

    .venv-ref/bin/python scripts/make_reference.py --bf16
"""

import json
import pathlib
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "hf"

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
)

# Ragged lengths, one of length 1 and one of 2; the first third of every
# example is a "prompt" whose labels are ignored.
LENGTHS = [7, 1, 12, 2, 5]


def make_features(vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    features = []
    for length in LENGTHS:
        ids = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        prompt = length // 3
        labels = [-100] * prompt + ids[prompt:]
        features.append({"input_ids": ids, "labels": labels})
    return features


def build(kind):
    if kind == "llama":
        config = LlamaConfig(**TINY, tie_word_embeddings=False)
        model_class = LlamaForCausalLM
    elif kind == "mistral":
        config = MistralConfig(**TINY, tie_word_embeddings=True, sliding_window=None)
        model_class = MistralForCausalLM
    elif kind == "qwen2":
        qwen = {k: v for k, v in TINY.items() if k not in ("attention_bias", "mlp_bias")}
        config = Qwen2Config(**qwen, tie_word_embeddings=True, use_sliding_window=False)
        model_class = Qwen2ForCausalLM
    elif kind == "qwen3":
        config = Qwen3Config(**TINY, tie_word_embeddings=False, use_sliding_window=False)
        model_class = Qwen3ForCausalLM
    else:
        sys.exit(f"unknown kind {kind}")
    torch.manual_seed(1234)
    model = model_class(config).to(torch.float32)
    # Norm weights of 1 and biases of 0 would hide a transposed or skipped
    # norm or bias: perturb them.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.config._attn_implementation = "eager"
    return model


def reference(kind):
    model = build(kind)
    features = make_features(model.config.vocab_size, seed=99)
    batch = DataCollatorWithFlattening(return_tensors="pt")(features)
    model.zero_grad()
    out = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        labels=batch["labels"],
        use_cache=False,  # transformers detects packed sequences only without a cache
    )
    out.loss.backward()
    logits = out.logits[0].detach()

    # The fixture is only a reference if transformers kept the examples apart:
    # check against each example run alone.
    start = 0
    with torch.no_grad():
        for feature in features:
            ids = torch.tensor([feature["input_ids"]])
            alone = model(input_ids=ids, use_cache=False).logits[0]
            n = len(feature["input_ids"])
            err = (alone - logits[start : start + n]).abs().max().item()
            if err > 1e-5:
                sys.exit(f"{kind}: transformers mixed examples in the flattened batch (max diff {err})")
            start += n

    directory = OUT / f"{kind}-tiny"
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    expected = {
        "input_ids": batch["input_ids"][0].to(torch.int64),
        "labels": batch["labels"][0].to(torch.int64),
        "position_ids": batch["position_ids"][0].to(torch.int64),
        "lengths": torch.tensor(LENGTHS, dtype=torch.int64),
        "logits": logits.contiguous(),
        "loss": out.loss.detach().reshape(1),
    }
    for name, param in model.named_parameters():
        expected[f"grad.{name}"] = param.grad.detach().contiguous()
    save_file(expected, directory / "expected.safetensors")
    (directory / "SOURCE.json").write_text(
        json.dumps(
            {
                "made_by": "scripts/make_reference.py",
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "attn_implementation": "eager",
                "collator": "DataCollatorWithFlattening(return_tensors='pt')",
                "loss": "mean cross-entropy over label tokens (transformers ForCausalLMLoss)",
            },
            indent=2,
        )
        + "\n"
    )
    print(f"{directory}: loss {out.loss.item():.6f}, {len(expected) - 6} gradients")


def reference_bf16():
    directory = OUT / "llama-tiny"
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    features = make_features(model.config.vocab_size, seed=99)
    batch = DataCollatorWithFlattening(return_tensors="pt")(features)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=batch["labels"],
            use_cache=False,
        )
    out.loss.backward()
    expected = {
        "logits": out.logits[0].detach().float().contiguous(),
        "loss": out.loss.detach().float().reshape(1),
    }
    for name, param in model.named_parameters():
        expected[f"grad.{name}"] = param.grad.detach().float().contiguous()
    save_file(expected, directory / "expected-bf16.safetensors")
    print(f"{directory}/expected-bf16.safetensors: loss {out.loss.item():.6f} under bf16 autocast "
          f"(transformers {transformers.__version__}, torch {torch.__version__})")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--bf16"]:
        reference_bf16()
        sys.exit(0)
    for kind in sys.argv[1:] or ("llama", "mistral", "qwen2", "qwen3"):
        reference(kind)
