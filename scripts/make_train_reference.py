#!/usr/bin/env python3
"""Writes the reference for padfree-train's optimizer step: four AdamW steps
of the tiny Llama in fixtures/hf/llama-tiny, computed by PyTorch and
transformers the way HF's Trainer computes them.

- micro-batches of 2 examples flattened by transformers'
  `DataCollatorWithFlattening`, 2 micro-batches per step (accumulation);
- each micro-batch's loss is the model's loss with `num_items_in_batch` set to
  the label tokens of the whole window (what the Trainer passes), so the
  window's loss is a sum over its tokens divided once;
- `clip_grad_norm_(1.0)`, `torch.optim.AdamW(lr=1e-3, weight_decay=0.01)`
  with norm weights in a no-decay group (as `get_decay_parameter_names`),
  a linear schedule with 1 warm-up step stepped after the optimizer.

Saved: the examples, every step's loss and pre-clip gradient norm, and every
parameter after the last step, in fixtures/hf/llama-tiny-train/.

    .venv-ref/bin/python scripts/make_train_reference.py
"""

import pathlib

import torch
import transformers
from safetensors.torch import save_file
from transformers import DataCollatorWithFlattening, LlamaForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "fixtures" / "hf" / "llama-tiny"
OUT = ROOT / "fixtures" / "hf" / "llama-tiny-train"

LENGTHS = [9, 3, 14, 6, 1, 11, 7, 4, 12, 5, 8, 2, 10, 13, 6, 3]
MICRO_BATCH = 2
ACCUMULATION = 2
STEPS = 4
LR, WEIGHT_DECAY, WARMUP = 1e-3, 0.01, 1


def make_examples(vocab_size):
    generator = torch.Generator().manual_seed(1234)
    examples = []
    for length in LENGTHS:
        ids = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        prompt = length // 3
        examples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return examples


def label_tokens(features):
    # The first label of an example is never predicted (the collator sets it to -100).
    return sum(sum(1 for label in f["labels"][1:] if label != -100) for f in features)


def main():
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager")
    model.train()
    examples = make_examples(model.config.vocab_size)
    collator = DataCollatorWithFlattening(return_tensors="pt")

    no_decay = [n for n, _ in model.named_parameters() if "norm" in n]
    groups = [
        {"params": [p for n, p in model.named_parameters() if n not in no_decay], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in model.named_parameters() if n in no_decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)

    losses, grad_norms, rates = [], [], []
    window = MICRO_BATCH * ACCUMULATION
    for step in range(STEPS):
        features = examples[step * window:(step + 1) * window]
        num_items = label_tokens(features)
        step_loss = 0.0
        for start in range(0, window, MICRO_BATCH):
            batch = collator(features[start:start + MICRO_BATCH])
            out = model(**batch, use_cache=False, num_items_in_batch=torch.tensor(num_items))
            out.loss.backward()
            step_loss += out.loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        grad_norms.append(norm.item())
        print(f"step {step + 1}: loss {step_loss:.6f}, grad_norm {norm.item():.6f}, lr {rates[-1]:.2e}")

    tensors = {f"param.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    tensors["step_losses"] = torch.tensor(losses, dtype=torch.float64)
    tensors["grad_norms"] = torch.tensor(grad_norms, dtype=torch.float64)
    tensors["learning_rates"] = torch.tensor(rates, dtype=torch.float64)
    tensors["input_ids"] = torch.tensor([i for e in examples for i in e["input_ids"]], dtype=torch.int64)
    tensors["labels"] = torch.tensor([l for e in examples for l in e["labels"]], dtype=torch.int64)
    tensors["lengths"] = torch.tensor(LENGTHS, dtype=torch.int64)
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(tensors, OUT / "expected.safetensors", metadata={
        "transformers": transformers.__version__, "torch": torch.__version__,
        "micro_batch": str(MICRO_BATCH), "accumulation": str(ACCUMULATION),
    })
    print(f"wrote {OUT / 'expected.safetensors'} (transformers {transformers.__version__}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
