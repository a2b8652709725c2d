"""Makes the dataset and tokenizer that `padfree train` runs on by default.

Maths word problems with worked answers from reasoning-gym's `gsm_symbolic`
generators (Apache-2.0, GSM8K-style templates filled with random values), and
a byte-level BPE tokenizer trained on them. Run once; the outputs are
committed under data/gsm-symbolic/:

    python3 -m venv .venv-data
    .venv-data/bin/pip install reasoning-gym==0.1.25 tokenizers==0.23.3
    .venv-data/bin/python scripts/make_dataset.py

Deterministic for a seed: the same versions give the same files.

eval.jsonl, the held-out split `padfree train`'s demo evaluates on, is 200
records of another seed with every question of train.jsonl left out; it was
added later, with reasoning-gym 0.1.19, by

    .venv-data/bin/python scripts/make_dataset.py --eval-only
"""

import argparse
import json
import os
import tempfile

import reasoning_gym
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
# ChatML markers, so chat-shaped data can be rendered with this tokenizer too.
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_atomically(path, text):
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def make_records(size, seed):
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    records = []
    for item in dataset:
        worked = item["metadata"]["answer_cot"].strip()
        question = item["question"].strip()
        if not worked or not question:
            raise SystemExit(f"empty question or answer from reasoning-gym: {item!r}")
        records.append({"question": question, "answer": worked})
    return records


def train_tokenizer(texts, vocab_size):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/gsm-symbolic")
    parser.add_argument("--size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--eval-seed", type=int, default=20261201)
    parser.add_argument(
        "--eval-only",
        action="store_true",
        help="write only eval.jsonl (train.jsonl and the tokenizer stay as they are)",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    # The held-out split: another seed, without any question of train.jsonl.
    train_path = os.path.join(args.out, "train.jsonl")
    if args.eval_only:
        with open(train_path, encoding="utf-8") as f:
            seen = {json.loads(line)["question"] for line in f}
    else:
        seen = {r["question"] for r in make_records(args.size, args.seed)}
    held_out = [r for r in make_records(2 * args.eval_size, args.eval_seed) if r["question"] not in seen]
    held_out = held_out[: args.eval_size]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in held_out)
    write_atomically(os.path.join(args.out, "eval.jsonl"), lines)
    print(f"eval.jsonl: {len(held_out)} records (seed {args.eval_seed}), none in train.jsonl")
    if args.eval_only:
        return

    records = make_records(args.size, args.seed)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    write_atomically(os.path.join(args.out, "train.jsonl"), lines)

    texts = [r["question"] + "\n" + r["answer"] for r in records]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    write_atomically(os.path.join(args.out, "tokenizer.json"), tokenizer.to_str(pretty=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": None,
        "pad_token": EOS,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }
    write_atomically(
        os.path.join(args.out, "tokenizer_config.json"), json.dumps(config, indent=2) + "\n"
    )
    lengths = sorted(len(tokenizer.encode(t).ids) for t in texts)
    print(
        f"{len(records)} records, vocabulary {tokenizer.get_vocab_size()}, "
        f"tokens per example: min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}, total {sum(lengths)}"
    )


if __name__ == "__main__":
    main()
