//! Tokenizing on several threads gives what one thread gives: the same
//! examples in the same order, the same report and warnings, and the same
//! error (the first bad record in file order); and the cheap check of
//! whether a data file needs a tokenizer agrees with reading it whole.

use std::path::{Path, PathBuf};

use padfree_data::{
    DataError, FieldNames, Overlong, PROGRESS_EVERY, Record, SourceRecord, TextTokenizer,
    TokenizeConfig, holds_text_records, read_records, read_records_from_str, tokenize_in_parallel,
    tokenize_records,
};

fn shipped(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/gsm-symbolic")
        .join(name)
}

fn config() -> TokenizeConfig {
    TokenizeConfig {
        train_on_inputs: false,
        use_chat_template: false,
        max_seq_len: 120,
        overlong: Overlong::Drop,
        vocab_limit: 4096,
    }
}

/// `count` shipped records, cycled, every 7th with an unused text field:
/// more than two chunks of [`PROGRESS_EVERY`], some dropped as too long.
fn text(count: usize) -> String {
    let shipped = std::fs::read_to_string(shipped("train.jsonl")).expect("shipped data");
    let lines: Vec<&str> = shipped.lines().collect();
    (0..count)
        .map(|i| {
            let line = lines[i % lines.len()];
            if i % 7 == 3 {
                format!("{{\"note\": \"note {i}\", {}\n", &line[1..])
            } else {
                format!("{line}\n")
            }
        })
        .collect()
}

fn records(text: &str) -> Vec<SourceRecord> {
    read_records_from_str(Path::new("d.jsonl"), text, &FieldNames::default()).expect("parses")
}

#[test]
fn threads_give_the_examples_of_one_thread() {
    let tokenizer =
        TextTokenizer::from_file(&shipped("tokenizer.json")).expect("the shipped tokenizer");
    let records = records(&text(2 * PROGRESS_EVERY + 300));
    let path = Path::new("d.jsonl");
    let one = tokenize_records(path, &records, Some(&tokenizer), &config()).expect("tokenizes");
    assert!(one.report.dropped_overlong > 0, "{}", one.report);
    assert_eq!(one.unused_fields.len(), 1);
    let noted = (0..records.len()).filter(|i| i % 7 == 3).count();
    assert_eq!(one.unused_fields[0].records, noted);
    for threads in [1, 2, 3] {
        let mut heard = Vec::new();
        let many = tokenize_in_parallel(
            path,
            &records,
            Some(&tokenizer),
            &config(),
            threads,
            &mut |done, total| heard.push((done, total)),
        )
        .expect("tokenizes");
        assert_eq!(many.examples, one.examples, "{threads} threads");
        assert_eq!(many.locations, one.locations);
        assert_eq!(many.report, one.report);
        assert_eq!(many.unused_fields, one.unused_fields);
        assert_eq!(heard.last(), Some(&(records.len(), records.len())));
        assert!(heard.windows(2).all(|w| w[0].0 < w[1].0), "{heard:?}");
    }
}

#[test]
fn the_first_bad_record_in_file_order_is_the_error() {
    let tokenizer =
        TextTokenizer::from_file(&shipped("tokenizer.json")).expect("the shipped tokenizer");
    let mut records = records(&text(3 * PROGRESS_EVERY));
    // Two bad records in different chunks: a token id past the vocabulary.
    for at in [PROGRESS_EVERY + 5, 2 * PROGRESS_EVERY + 9] {
        records[at].record = Record::Tokenized {
            input_ids: vec![1, 5000],
            labels: None,
        };
    }
    let path = Path::new("d.jsonl");
    let one = tokenize_records(path, &records, Some(&tokenizer), &config()).expect_err("refused");
    let many = tokenize_in_parallel(
        path,
        &records,
        Some(&tokenizer),
        &config(),
        3,
        &mut |_, _| {},
    )
    .expect_err("refused");
    let location = |err: &DataError| match err {
        DataError::Record { location, .. } => location.clone(),
        other => panic!("not a record error: {other}"),
    };
    assert_eq!(location(&one), format!("line {}", PROGRESS_EVERY + 6));
    assert_eq!(location(&many), location(&one));
    assert_eq!(many.to_string(), one.to_string());
}

#[test]
fn whether_a_file_needs_a_tokenizer_is_known_from_its_first_record() {
    let dir = tempfile::tempdir().expect("scratch");
    let fields = FieldNames::default();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path
    };
    let slow = |path: &Path| {
        read_records(path, &fields)
            .expect("reads")
            .iter()
            .any(|r| !matches!(r.record, Record::Tokenized { .. }))
    };
    let ids = "{\"input_ids\": [1, 2, 3]}\n";
    let question = "{\"question\": \"q\", \"answer\": \"a\"}\n";
    let cases = [
        ("text.jsonl", format!("\n{question}{ids}"), true),
        ("ids.jsonl", format!("{ids}{ids}"), false),
        ("ids-then-text.jsonl", format!("{ids}{question}"), true),
        ("array.json", "[{\"input_ids\": [1, 2]}]".to_owned(), false),
    ];
    for (name, text, needs) in cases {
        let path = write(name, &text);
        assert_eq!(
            holds_text_records(&path, &fields).expect(name),
            needs,
            "{name}"
        );
        assert_eq!(slow(&path), needs, "{name}");
    }
    let parquet =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/data/columnar/gsm40.parquet");
    assert!(holds_text_records(&parquet, &fields).expect("parquet"));
    // A bad first record is reported by the whole read, naming its line.
    let bad = write("bad.jsonl", "\n\n{\"question\": 3}\n");
    let err = holds_text_records(&bad, &fields).expect_err("refused");
    assert!(err.to_string().contains("line 3"), "{err}");
}
