"""Checks that a directory written by `padfree train` loads in Hugging Face
transformers and behaves like a trained model.

    python3 scripts/check_hf_load.py runs/train-.../ [--data data/gsm-symbolic/train.jsonl]

Loads the model with AutoModelForCausalLM and the tokenizer with AutoTokenizer,
computes the mean response-only loss on a few records rendered as padfree
renders question/answer records, compares it with the uniform loss ln(V), and
greedily continues one prompt. Needs torch and transformers (the versions of
scripts/make_reference.py); runs on CPU. Exits non-zero when loading fails or
the loss is not below uniform.
"""

import argparse
import json
import math
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--data", default="data/gsm-symbolic/train.jsonl")
    parser.add_argument("--records", type=int, default=8)
    args = parser.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model.eval()
    print(f"loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) "
          f"and {type(tokenizer).__name__} (vocab {len(tokenizer)}) from {args.model_dir}")

    with open(args.data, encoding="utf-8") as f:
        records = [json.loads(line) for line, _ in zip(f, range(args.records))]
    total, count = 0.0, 0
    for record in records:
        prompt = f"Question: {record['question']}\nAnswer: "
        prompt_ids = tokenizer(prompt)["input_ids"]
        response_ids = tokenizer(record["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt_ids + response_ids])
        labels = torch.tensor([[-100] * len(prompt_ids) + response_ids])
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels)
        n = len(response_ids)
        total += out.loss.item() * n
        count += n
    mean = total / count
    uniform = math.log(model.config.vocab_size)
    print(f"mean response loss on {len(records)} records: {mean:.4f} nats/token (uniform: {uniform:.4f})")

    prompt = f"Question: {records[0]['question']}\nAnswer: "
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print("greedy continuation:", repr(tokenizer.decode(generated[0, ids.shape[1]:])))
    if not mean < uniform:
        sys.exit("the loss is not below uniform: the weights did not load as trained")


if __name__ == "__main__":
    main()
