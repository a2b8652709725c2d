"""The peer of `padfree bench`: Hugging Face's Trainer on the batches, initial
weights and settings that padfree exported, padded or with
`DataCollatorWithFlattening`, reporting the same measurements as JSON.

    python bench/hf_peer/hf_peer.py --peer-dir runs/bench-.../peer --mode flattening --out result.json

`padfree bench --peer-python PYTHON` runs it for both modes and prints the
comparison; bench/hf_peer/setup.sh makes a virtual environment for it. With
`padfree bench --use-peft` the peer wraps the model in PEFT's `PeftModel`,
loaded from the adapter files padfree exported (`settings.json`'s
`adapter`), so both train the same adapters from the same start.
`--attn torch_varlen` (with `--bf16 --mode flattening` on CUDA) runs the
flattened rows through PyTorch's own FlashAttention-2 varlen kernel where
the `flash_attn` package is missing; check_torch_varlen.py checks its glue
on a CPU.
"""

import argparse
import json
import os
import resource
import tempfile
import time

import torch
import transformers
from torch.utils.data import Dataset, SequentialSampler
from transformers import (DataCollatorWithFlattening, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)


class Examples(Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


def pad_collator(features):
    """Right padding to the longest example: pad id 0 (masked), labels -100."""
    longest = max(len(f["input_ids"]) for f in features)
    ids, labels, mask = [], [], []
    for f in features:
        pad = longest - len(f["input_ids"])
        ids.append(f["input_ids"] + [0] * pad)
        # As padfree's padded batch: the first label of an example is never predicted.
        labels.append([-100] + f["labels"][1:] + [-100] * pad)
        mask.append([1] * len(f["input_ids"]) + [0] * pad)
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": torch.tensor(mask)}


class InOrder(Trainer):
    """The exported order is the order: no shuffling."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


class StepClock(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a step's kernels are queued, not done
        self.times.append(time.perf_counter())


def register_torch_varlen():
    """PyTorch's own FlashAttention-2 varlen kernel (`torch.nn.attention.varlen`,
    torch >= 2.10, CUDA, 16-bit inputs) as an HF attention named `torch_varlen`:
    the flash-attention 2 peer where the `flash_attn` package is not installed.
    It reads the flattening collator's `cu_seq_lens_q` / `max_length_q`
    (computed once per batch, as padfree's), or else finds the boundaries
    where `position_ids` restart."""
    import inspect
    from torch.nn.attention.varlen import varlen_attn
    from transformers import AttentionInterface
    params = inspect.signature(varlen_attn).parameters
    # torch 2.10 took is_causal; later releases a flash-attn window, (-1, 0) being causal.
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query [1, H, T, D], key and value [1, Hkv, T, D]: one flattened row.
        if query.shape[0] != 1:
            raise SystemExit("torch_varlen needs the flattening collator's one row per batch")
        cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        if cu is None:
            positions = kwargs["position_ids"][0]
            starts = torch.nonzero(positions == 0).flatten()
            cu = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
            longest = int((cu[1:] - cu[:-1]).max())
        # Under autocast, RoPE's f32 cos/sin promote q and k back to f32 while v
        # stays 16-bit; the kernel takes 16-bit only, so all three go to the
        # autocast dtype, as HF's flash-attention integration casts them.
        device = query.device.type
        half = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.bfloat16
        q, k, v = (t[0].transpose(0, 1).to(half) for t in (query, key, value))  # [T, H, D]
        # Grouped keys and values go in as they are: FlashAttention-2's varlen
        # kernel (what varlen_attn calls) takes fewer key/value heads than
        # query heads; releases that say so in the API take enable_gqa.
        extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] and "enable_gqa" in params else {}
        if scaling is not None and "scale" in params:
            extra["scale"] = scaling
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest,
                          **causal, **extra)
        return out.unsqueeze(0), None  # [1, T, H, D], as HF's attentions return

    AttentionInterface.register("torch_varlen", attention)
    try:
        # No [T, T] mask for a kernel that takes the boundaries instead.
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
        AttentionMaskInterface.register("torch_varlen", flash_attention_mask)
    except ImportError:
        pass


def versions():
    found = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import peft
        found["peft"] = peft.__version__
    except ImportError:
        pass
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-dir", required=True)
    parser.add_argument("--mode", choices=["padded", "flattening"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda when padfree ran on a GPU")
    parser.add_argument("--attn", default="sdpa",
                        help="sdpa (float32, as padfree), flash_attention_2 (bfloat16: flash-attn has no "
                             "float32), or torch_varlen (PyTorch's own FlashAttention-2 varlen kernel, CUDA, "
                             "with --bf16 and --mode flattening)")
    parser.add_argument("--bf16", action="store_true",
                        help="TrainingArguments(bf16=True): autocast to bfloat16 over f32 master weights, as padfree --bf16")
    args = parser.parse_args()
    on_gpu = args.device != "cpu"

    with open(os.path.join(args.peer_dir, "settings.json")) as f:
        settings = json.load(f)
    batches = []
    with open(os.path.join(args.peer_dir, "batches.jsonl")) as f:
        for line in f:
            batches.append(json.loads(line)["examples"])
    torch.set_num_threads(settings["threads"])
    torch.manual_seed(settings["seed"])

    if args.attn == "torch_varlen":
        if not (args.bf16 and args.mode == "flattening" and on_gpu):
            raise SystemExit("--attn torch_varlen needs --bf16 --mode flattening --device cuda")
        register_torch_varlen()
    dtype = torch.bfloat16 if args.attn == "flash_attention_2" else torch.float32
    model = LlamaForCausalLM.from_pretrained(os.path.join(args.peer_dir, "model"), dtype=dtype,
                                             attn_implementation=args.attn)
    model.config.use_cache = False  # transformers detects packed rows only without a cache
    adapter = settings.get("adapter")
    if adapter:
        # The adapters padfree starts from (PEFT's files it wrote), trained
        # by PEFT on the frozen f32 base: same r, alpha, dropout and targets.
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, os.path.join(args.peer_dir, adapter), is_trainable=True)
    batch_size = settings["per_device_train_batch_size"]
    if any(len(b) != batch_size for b in batches):
        raise SystemExit("every exported batch must hold per_device_train_batch_size examples")
    examples = [e for batch in batches for e in batch]
    steps = len(batches)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch_size, max_steps=steps,
            learning_rate=settings["learning_rate"], weight_decay=settings["weight_decay"],
            adam_beta1=settings["adam_beta1"], adam_beta2=settings["adam_beta2"],
            adam_epsilon=settings["adam_epsilon"], max_grad_norm=settings["max_grad_norm"],
            lr_scheduler_type="linear", warmup_steps=0, logging_steps=1, save_strategy="no",
            report_to=[], seed=settings["seed"], use_cpu=not on_gpu, dataloader_num_workers=0,
            remove_unused_columns=False, optim="adamw_torch", disable_tqdm=True,
            bf16=args.bf16,
        )
        collator = pad_collator if args.mode == "padded" else DataCollatorWithFlattening(
            return_tensors="pt", return_flash_attn_kwargs=args.attn == "torch_varlen")
        clock = StepClock()
        trainer = InOrder(model=model, args=training_args, train_dataset=Examples(examples),
                          data_collator=collator, callbacks=[clock])
        start = time.perf_counter()
        trainer.train()
    warmup = settings["timing_warmup_steps"]
    timed_from = clock.times[warmup - 1] if warmup > 0 else start
    seconds = clock.times[-1] - timed_from
    timed = batches[warmup:]
    real = sum(len(e["input_ids"]) for b in timed for e in b)
    fed = real if args.mode == "flattening" else sum(len(b) * max(len(e["input_ids"]) for e in b) for b in timed)
    samples = sum(len(b) for b in timed)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if on_gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    suffix = ("" if args.attn == "sdpa" else f"-{args.attn}") + ("-bf16" if args.bf16 else "")
    result = {
        "mode": f"hf-{args.mode}{suffix}",
        "timed_steps": len(timed),
        "train_runtime": seconds,
        "real_tokens": real,
        "fed_tokens": fed,
        "samples": samples,
        "real_tokens_per_second": real / seconds,
        "fed_tokens_per_second": fed / seconds,
        "samples_per_second": samples / seconds,
        "padding_fraction": 1.0 - real / fed,
        "peak_memory_bytes": peak,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "dtype": str(dtype) + (" with bf16 autocast" if args.bf16 else ""),
        "final_loss": losses[-1],
        "step_losses": losses,
        "step_seconds": [b - a for a, b in zip([start] + clock.times[:-1], clock.times)],
        "versions": versions(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
