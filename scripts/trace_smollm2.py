#!/usr/bin/env python3
"""Per-layer comparison of padfree and HF transformers on SmolLM2-135M.

    cargo run -p padfree-model --example trace_smollm2 -- SmolLM2-135M-Instruct.Q4_1.gguf out/
    .venv-peer/bin/python scripts/trace_smollm2.py out/ [--fixture fixtures/hf/smollm2-trace.safetensors]

Runs transformers (float32, eager attention unless --attn sdpa, CPU) on the f32 model and the
batch the example wrote, flattened by `DataCollatorWithFlattening`, with
`output_hidden_states`, and prints for every depth the largest difference
from padfree's hidden states, absolute and relative to the depth's largest
value. With --fixture it also writes what the committed test compares
against: HF's hidden states of the last token of every example at every
depth, HF's loss, and the token ids.
"""

import argparse
import json
import pathlib

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import DataCollatorWithFlattening, LlamaForCausalLM


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--fixture")
    parser.add_argument("--attn", default="eager", help="transformers' attention: eager or sdpa")
    args = parser.parse_args()
    root = pathlib.Path(args.dir)
    torch.set_num_threads(2)
    model = LlamaForCausalLM.from_pretrained(root / "model", dtype=torch.float32, attn_implementation=args.attn)
    model.eval()
    examples = json.loads((root / "batch.json").read_text())
    features = [{"input_ids": ids, "labels": ids} for ids in examples]
    batch = DataCollatorWithFlattening(return_tensors="pt")(features)
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=batch["labels"],
            output_hidden_states=True,
            use_cache=False,
        )
    hf = [h[0].numpy() for h in out.hidden_states]
    tokens, width = hf[0].shape
    ours = np.fromfile(root / "padfree_states.bin", dtype="<f4").reshape(-1, tokens, width)
    pf_loss = float((root / "padfree_loss.txt").read_text())
    print(f"{len(examples)} examples, {tokens} tokens; HF gives {len(hf)} hidden states, padfree {len(ours)}")
    print(f"loss: HF {out.loss.item():.9f}, padfree {pf_loss:.9f}, diff {pf_loss - out.loss.item():+.3e}")
    layers = model.config.num_hidden_layers
    print("depth | max |padfree - HF| | max |HF| | relative | rms diff / rms HF")
    for depth, theirs in enumerate(hf):
        # HF's last entry is the final norm's output.
        mine = ours[depth] if depth < layers else ours[layers + 1]
        name = "embedding" if depth == 0 else (f"layer {depth - 1}" if depth < layers else "final norm")
        diff = np.abs(mine - theirs)
        scale = np.abs(theirs).max()
        rms = np.sqrt((diff**2).mean()) / np.sqrt((theirs**2).mean())
        print(f"{name:>10} | {diff.max():.3e} | {scale:.3e} | {diff.max() / scale:.3e} | {rms:.3e}")
    if args.fixture:
        ends = np.cumsum([len(ids) for ids in examples]) - 1
        states = np.stack([h[ends] for h in hf])  # [depths, examples, C]
        lengths = torch.tensor([len(ids) for ids in examples], dtype=torch.int64)
        save_file(
            {
                "input_ids": torch.tensor([i for ids in examples for i in ids], dtype=torch.int64),
                "lengths": lengths,
                "last_token_states": torch.from_numpy(np.ascontiguousarray(states)),
                "loss": out.loss.detach().reshape(1),
            },
            args.fixture,
        )
        print(f"wrote {args.fixture}: last-token states {states.shape}")


if __name__ == "__main__":
    main()
