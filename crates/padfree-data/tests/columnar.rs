//! Parquet files, Parquet shards in the HF hub's layout and HF `datasets`
//! directories (Arrow IPC) read as JSONL is read: the same records of every
//! shape, the same examples, locations that name the file, the row group or
//! record batch and the row. Fixtures: `scripts/make_columnar_fixtures.py`.

use std::path::{Path, PathBuf};

use padfree_data::{
    FieldNames, Overlong, Record, SourceRecord, TextTokenizer, TokenizeConfig, read_records,
    tokenize_records,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/data/columnar")
        .join(name)
}

fn read(name: &str) -> Vec<SourceRecord> {
    read_records(&fixture(name), &FieldNames::default())
        .unwrap_or_else(|err| panic!("{name}: {err}"))
}

fn records(name: &str) -> Vec<Record> {
    read(name).into_iter().map(|r| r.record).collect()
}

#[test]
fn every_format_holds_the_records_of_the_jsonl() {
    for set in ["shapes", "gsm40"] {
        let jsonl = records(&format!("{set}.jsonl"));
        for form in [
            format!("{set}.parquet"),
            format!("{set}-shards"),
            format!("{set}-hf"),
            format!("{set}.arrow"),
        ] {
            assert_eq!(records(&form), jsonl, "{form}");
        }
    }
    // Every shape is there: prompt/completion, question/answer, Alpaca with
    // and without input, chats, text, token ids with and without labels.
    let shapes = records("shapes.jsonl");
    assert_eq!(shapes.len(), 10);
    let kinds: Vec<&str> = shapes
        .iter()
        .map(|r| match r {
            Record::PromptCompletion { .. } => "prompt",
            Record::QuestionAnswer { .. } => "question",
            Record::Alpaca { .. } => "alpaca",
            Record::Chat { .. } => "chat",
            Record::Text { .. } => "text",
            Record::Tokenized { .. } => "tokenized",
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "prompt",
            "question",
            "alpaca",
            "alpaca",
            "chat",
            "chat",
            "text",
            "tokenized",
            "tokenized",
            "prompt"
        ]
    );
}

#[test]
fn every_format_gives_the_same_examples() {
    let tokenizer = TextTokenizer::from_file(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/gsm-symbolic/tokenizer.json"),
    )
    .expect("the shipped tokenizer");
    let config = TokenizeConfig {
        train_on_inputs: false,
        use_chat_template: false,
        max_seq_len: 2048,
        overlong: Overlong::Truncate,
        vocab_limit: 4096,
    };
    for set in ["shapes", "gsm40"] {
        let examples = |name: &str| {
            tokenize_records(&fixture(name), &read(name), Some(&tokenizer), &config)
                .expect("tokenizes")
                .examples
        };
        let jsonl = examples(&format!("{set}.jsonl"));
        for form in [
            format!("{set}.parquet"),
            format!("{set}-shards"),
            format!("{set}-hf"),
        ] {
            assert_eq!(examples(&form), jsonl, "{form}");
        }
    }
}

#[test]
fn locations_name_the_file_the_row_group_or_batch_and_the_row() {
    let at = |name: &str, index: usize| read(name)[index].location.clone();
    assert_eq!(at("shapes.jsonl", 4), "line 5");
    assert_eq!(at("shapes.parquet", 4), "row group 1, row 1");
    assert_eq!(
        at("shapes-shards", 6),
        "data/train-00001-of-00002.parquet, row group 0, row 1"
    );
    assert_eq!(
        at("shapes-hf", 7),
        "data-00000-of-00001.arrow, record batch 1, row 1"
    );
    // The IPC file format, batches of 4: row 5 is batch 1's second.
    assert_eq!(at("shapes.arrow", 5), "record batch 1, row 1");
}

#[test]
fn bad_columnar_data_is_refused_by_file_row_and_column() {
    let refused = |name: &str| {
        read_records(&fixture(name), &FieldNames::default())
            .expect_err("refused")
            .to_string()
    };
    // Row 4 has no completion: its shape is not one padfree reads.
    let err = refused("bad.parquet");
    assert!(err.contains("bad.parquet:row group 1, row 1"), "{err}");
    assert!(err.contains("prompt"), "{err}");
    let err = refused("zstd.parquet");
    assert!(err.contains("Snappy"), "{err}");
    let empty = tempfile::tempdir().expect("a directory");
    let err = read_records(empty.path(), &FieldNames::default())
        .expect_err("refused")
        .to_string();
    assert!(err.contains("without .parquet or .arrow files"), "{err}");
}
