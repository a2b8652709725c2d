"""Makes data/short-arith/: short chat examples with one-number answers.

The short-example benchmark set (issue 23): one-line arithmetic word
problems as a user turn and the bare number as the assistant's reply, in
the `messages` shape, so the chat template masks the prompt and only the
answer's few tokens (and the end-of-turn marker) are labelled. Under a
ChatML template with a system prompt that is about 50-60 tokens per
example, under 10% of them labelled: the shape of instruction data with
one-line answers and of classification-style SFT.

Standard library only, deterministic for a seed; run once, the outputs are
committed:

    python3 scripts/make_short_dataset.py
"""

import argparse
import json
import os
import random
import tempfile

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas",
         "Kira", "Liam", "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tariq"]
ITEMS = ["apples", "stamps", "marbles", "books", "pencils", "coins", "shells", "cards",
         "stickers", "buttons", "eggs", "plums", "tickets", "beads", "nails", "cups"]
PLACES = [("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("basket", "baskets"),
          ("drawer", "drawers"), ("crate", "crates"), ("tin", "tins"), ("shelf", "shelves")]


def problem(rng):
    """One question and its integer answer, from one of eight shapes."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    place, places = rng.choice(PLACES)
    shape = rng.randrange(8)
    if shape == 0:
        a, b = rng.randint(2, 90), rng.randint(2, 90)
        return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b
    if shape == 1:
        a = rng.randint(20, 99)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {item} and gave {b} to {other}. How many are left?", a - b
    if shape == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"There are {a} {places} with {b} {item} in each. How many {item} are there?", a * b
    if shape == 3:
        b = rng.randint(2, 9)
        q = rng.randint(2, 15)
        return f"{name} shares {b * q} {item} equally among {b} friends. How many does each get?", q
    if shape == 4:
        a, b, c = rng.randint(1, 40), rng.randint(1, 40), rng.randint(1, 40)
        return f"A {place} holds {a} red, {b} blue and {c} green {item}. How many in total?", a + b + c
    if shape == 5:
        a = rng.randint(3, 30)
        k = rng.randint(2, 5)
        return f"{other} has {a} {item}. {name} has {k} times as many. How many does {name} have?", a * k
    if shape == 6:
        p, n = rng.randint(2, 20), rng.randint(2, 9)
        return f"One {item[:-1]} costs {p} dollars. What do {n} of them cost, in dollars?", p * n
    a, b = rng.randint(10, 60), rng.randint(10, 60)
    return f"{name} read {a} pages on Monday and {b} on Tuesday. How many pages in all?", a + b


def records(count, seed, exclude=frozenset()):
    rng = random.Random(seed)
    out, seen = [], set(exclude)
    while len(out) < count:
        question, answer = problem(rng)
        if question in seen:
            continue
        seen.add(question)
        out.append({"messages": [
            {"role": "user", "content": question + " Answer with the number only."},
            {"role": "assistant", "content": str(answer)},
        ]})
    return out, seen


def write_atomically(path, rows):
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "data", "short-arith"))
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=23)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    train, seen = records(args.train, args.seed)
    held_out, _ = records(args.eval, args.seed + 1, exclude=seen)
    write_atomically(os.path.join(args.out, "train.jsonl"), train)
    write_atomically(os.path.join(args.out, "eval.jsonl"), held_out)
    print(f"wrote {len(train)} train and {len(held_out)} eval records to {args.out}")


if __name__ == "__main__":
    main()
