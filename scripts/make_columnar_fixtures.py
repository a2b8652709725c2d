"""Columnar fixtures for padfree-data's Parquet and Arrow reader.

The same records as JSONL, as one Parquet file (several row groups), as
Parquet shards in the HF hub's layout, and as an HF `datasets` directory
(what `Dataset.save_to_disk` writes: Arrow IPC stream files, `state.json`,
`dataset_info.json`), written with pyarrow alone:

    pip install pyarrow==26.0.1
    python3 scripts/make_columnar_fixtures.py

Writes fixtures/data/columnar/ (also each set as one Arrow file in the IPC
file format). `shapes`: every record shape padfree reads
(a column is null where a record's shape does not use it); `gsm40`: the
first 40 records of the shipped maths set.
"""
import json
import os

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

ROOT = os.path.join(os.path.dirname(__file__), "..")
OUT = os.path.join(ROOT, "fixtures", "data", "columnar")

SHAPES = [
    {"prompt": "What is 2 + 3?", "completion": "5"},
    {"question": "How many legs do 3 cats have?", "answer": "3 cats have 3 * 4 = 12 legs. #### 12"},
    {"instruction": "Add the numbers.", "input": "7 and 8", "output": "15"},
    {"instruction": "Name a prime number above 10.", "output": "11"},
    {"messages": [
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "42"},
    ]},
    {"messages": [
        {"role": "system", "content": "You answer with a number."},
        {"role": "user", "content": "What is 9 minus 4?"},
        {"role": "assistant", "content": "5"},
    ]},
    {"text": "The sum of the angles of a triangle is 180 degrees."},
    {"input_ids": [11, 12, 13, 14, 15]},
    {"input_ids": [21, 22, 23, 24], "labels": [-100, -100, 23, 24]},
    {"prompt": "Count to three.", "completion": "1, 2, 3"},
]

SCHEMA = pa.schema([
    ("prompt", pa.string()), ("completion", pa.string()),
    ("question", pa.string()), ("answer", pa.string()),
    ("instruction", pa.string()), ("input", pa.string()), ("output", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("text", pa.string()),
    ("input_ids", pa.list_(pa.int64())), ("labels", pa.list_(pa.int64())),
])


def write_all(name, rows, schema):
    table = pa.Table.from_pylist(rows, schema=schema)
    with open(os.path.join(OUT, f"{name}.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    # Row groups of 3 rows, so locations cross groups.
    pq.write_table(table, os.path.join(OUT, f"{name}.parquet"), row_group_size=3)
    shards = os.path.join(OUT, f"{name}-shards", "data")
    os.makedirs(shards, exist_ok=True)
    half = len(rows) // 2
    for index, part in enumerate([rows[:half], rows[half:]]):
        pq.write_table(pa.Table.from_pylist(part, schema=schema),
                       os.path.join(shards, f"train-{index:05d}-of-00002.parquet"))
    hf = os.path.join(OUT, f"{name}-hf")
    os.makedirs(hf, exist_ok=True)
    with ipc.new_stream(os.path.join(hf, "data-00000-of-00001.arrow"), schema) as writer:
        # Two record batches, as datasets writes in batches.
        for batch in table.to_batches(max_chunksize=max(1, len(rows) // 2 + 1)):
            writer.write_batch(batch)
    # A lone Arrow file in the IPC file format (not the stream datasets writes).
    with ipc.new_file(os.path.join(OUT, f"{name}.arrow"), schema) as writer:
        writer.write_table(table, max_chunksize=4)
    with open(os.path.join(hf, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                   "_fingerprint": "padfree-fixture", "_format_type": None,
                   "_split": "train"}, f, indent=2)
    with open(os.path.join(hf, "dataset_info.json"), "w") as f:
        json.dump({"description": f"padfree fixture {name}", "features": {}}, f, indent=2)


def main():
    os.makedirs(OUT, exist_ok=True)
    write_all("shapes", SHAPES, SCHEMA)
    gsm = []
    with open(os.path.join(ROOT, "data", "gsm-symbolic", "train.jsonl")) as f:
        for line in f:
            gsm.append(json.loads(line))
            if len(gsm) == 40:
                break
    gsm_schema = pa.schema([(key, pa.string()) for key in gsm[0]])
    write_all("gsm40", gsm, gsm_schema)
    # Refusals: a record with no completion (row group 1, row 1), and a
    # codec padfree does not read (zstd).
    pc = pa.schema([("prompt", pa.string()), ("completion", pa.string())])
    bad = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)} for i in range(6)]
    bad[4]["completion"] = None
    pq.write_table(pa.Table.from_pylist(bad, schema=pc), os.path.join(OUT, "bad.parquet"),
                   row_group_size=3)
    good = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(good, schema=pc), os.path.join(OUT, "zstd.parquet"),
                   compression="zstd")


if __name__ == "__main__":
    main()
