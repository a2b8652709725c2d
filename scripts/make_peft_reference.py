#!/usr/bin/env python3
"""Writes the PEFT fixture that padfree-model's LoRA test compares against.

Base: the tiny Llama of fixtures/hf/llama-tiny (from make_reference.py).
PEFT puts LoRA adapters (r=4, alpha=8, no dropout) on every linear layer of
every decoder layer; B, zero after PEFT's initialisation, is filled with
N(0, 0.05) so the adapters change the outputs. The adapter is saved with
`save_pretrained`, loaded back onto a fresh base with
`PeftModel.from_pretrained` (the path a user's PEFT takes), and on the
fixture's flattened batch (DataCollatorWithFlattening) the logits, the mean
loss and every adapter gradient are saved, in float32 on the CPU.

Usage (from the repository root, in a virtual environment):

    python -m venv .venv-ref && .venv-ref/bin/pip install torch transformers peft safetensors numpy
    .venv-ref/bin/python scripts/make_peft_reference.py

The fixture lands in fixtures/peft/llama-tiny-lora/ and is committed; the
tests need no Python.

With `--bf16` it loads the committed adapter onto the base (as `make` does
after saving it) and writes expected-bf16.safetensors beside it: the same
batch under `torch.autocast("cpu", torch.bfloat16)` (HF's Trainer with
`bf16=True` and PEFT), logits, loss and every adapter gradient as float32.

With `--check DIR` it instead loads the adapter padfree wrote in DIR onto the
same base with PEFT and compares PEFT's logits with DIR/logits.safetensors
(written by padfree's test when PADFREE_PEFT_CHECK_DIR is set).
"""

import json
import pathlib
import sys

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import DataCollatorWithFlattening, LlamaForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = ROOT / "fixtures" / "hf" / "llama-tiny"
OUT = ROOT / "fixtures" / "peft" / "llama-tiny-lora"

LENGTHS = [7, 1, 12, 2, 5]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model():
    model = LlamaForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model


def features(vocab_size):
    generator = torch.Generator().manual_seed(77)
    out = []
    for length in LENGTHS:
        ids = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        prompt = length // 3
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def forward(model, batch):
    return model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        labels=batch["labels"],
        use_cache=False,
    )


def make():
    torch.manual_seed(4321)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    model = get_peft_model(base_model(), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    # No model card, and the base named relative to the repository, not by
    # this machine's path.
    (OUT / "README.md").unlink(missing_ok=True)
    config_path = OUT / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = "fixtures/hf/llama-tiny"
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    # What a user's PEFT does with the files: load them onto the base.
    loaded = PeftModel.from_pretrained(base_model(), OUT, is_trainable=True)
    batch = DataCollatorWithFlattening(return_tensors="pt")(features(loaded.config.vocab_size))
    out = forward(loaded, batch)
    out.loss.backward()
    expected = {
        "input_ids": batch["input_ids"][0].to(torch.int64),
        "labels": batch["labels"][0].to(torch.int64),
        "position_ids": batch["position_ids"][0].to(torch.int64),
        "lengths": torch.tensor(LENGTHS, dtype=torch.int64),
        "logits": out.logits[0].detach().contiguous(),
        "loss": out.loss.detach().reshape(1),
    }
    grads = 0
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            # PEFT's in-memory names carry the adapter's name; its files do not.
            expected[f"grad.{name.replace('.default', '')}"] = param.grad.detach().contiguous()
            grads += 1
    save_file(expected, OUT / "expected.safetensors")
    (OUT / "SOURCE.json").write_text(
        json.dumps(
            {
                "made_by": "scripts/make_peft_reference.py",
                "base": "fixtures/hf/llama-tiny",
                "peft": peft.__version__,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "attn_implementation": "eager",
                "collator": "DataCollatorWithFlattening(return_tensors='pt')",
                "loss": "mean cross-entropy over label tokens",
            },
            indent=2,
        )
        + "\n"
    )
    print(f"{OUT}: loss {out.loss.item():.6f}, {grads} adapter gradients")


def make_bf16():
    loaded = PeftModel.from_pretrained(base_model(), OUT, is_trainable=True)
    batch = DataCollatorWithFlattening(return_tensors="pt")(features(loaded.config.vocab_size))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = forward(loaded, batch)
    out.loss.backward()
    expected = {
        "logits": out.logits[0].detach().float().contiguous(),
        "loss": out.loss.detach().float().reshape(1),
    }
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            expected[f"grad.{name.replace('.default', '')}"] = param.grad.detach().float().contiguous()
    save_file(expected, OUT / "expected-bf16.safetensors")
    print(f"{OUT}/expected-bf16.safetensors: loss {out.loss.item():.6f} under bf16 autocast "
          f"(peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__})")


def check(directory):
    directory = pathlib.Path(directory)
    model = PeftModel.from_pretrained(base_model(), directory)
    ours = load_file(directory / "logits.safetensors")
    with torch.no_grad():
        batch = {
            "input_ids": ours["input_ids"].unsqueeze(0),
            "position_ids": ours["position_ids"].unsqueeze(0),
            "labels": None,
        }
        logits = forward(model, batch).logits[0]
    diff = (logits - ours["logits"]).abs().max().item()
    scale = ours["logits"].abs().max().item()
    print(f"PEFT loaded padfree's adapter: max |logits diff| {diff:.3e} of scale {scale:.3e}")
    sys.exit(0 if diff <= 1e-4 * scale else 1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        check(sys.argv[2])
    elif sys.argv[1:] == ["--bf16"]:
        make_bf16()
    else:
        make()
