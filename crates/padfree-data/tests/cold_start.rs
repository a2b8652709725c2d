//! A cold start: tokenizing on several threads gives what one thread
//! gives (the same examples in the same order, report, warnings and first
//! bad record); the records read a chunk at a time are those read whole,
//! with the same errors; an entry built chunk by chunk holds the examples
//! of a fresh tokenization, and one opened reads them back a step at a
//! time; whether a data file needs a tokenizer is known from its first
//! record.

use std::path::{Path, PathBuf};

use padfree_data::{
    CacheKeyParts, CacheUse, DataCache, DataError, FieldNames, Lookup, Overlong, PROGRESS_EVERY,
    Record, SourceRecord, TextTokenizer, TokenizeConfig, count_records, file_fingerprint,
    for_each_record_chunk, for_each_record_chunk_in, holds_text_records, read_records,
    read_records_from_str, tokenize_in_parallel, tokenize_records,
};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn shipped_tokenizer() -> TextTokenizer {
    TextTokenizer::from_file(&repo("data/gsm-symbolic/tokenizer.json"))
        .expect("the shipped tokenizer")
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

/// The key parts of the data file `data` with these settings.
fn file_parts<'a>(
    data: &Path,
    fields: &'a FieldNames,
    tokenizer: &'a TextTokenizer,
    config: &'a TokenizeConfig,
) -> CacheKeyParts<'a> {
    CacheKeyParts {
        content: file_fingerprint(data).expect("fingerprint"),
        fields,
        tokenizer: Some(tokenizer),
        config,
    }
}

/// `count` shipped records, cycled, every 7th with an unused text field:
/// more than two chunks of [`PROGRESS_EVERY`], some dropped as too long.
fn text(count: usize) -> String {
    let shipped =
        std::fs::read_to_string(repo("data/gsm-symbolic/train.jsonl")).expect("shipped data");
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
    let tokenizer = shipped_tokenizer();
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
    let tokenizer = shipped_tokenizer();
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

/// The records of `path`, read `chunk` at a time: every chunk full but
/// the last, the progress in step.
fn chunked(path: &Path, chunk: usize) -> Result<Vec<SourceRecord>, String> {
    read_chunks(path, None, chunk)
}

/// The records numbered `range`, read a chunk (2) at a time.
fn in_range(path: &Path, range: std::ops::Range<usize>) -> Result<Vec<SourceRecord>, String> {
    read_chunks(path, Some(range), 2)
}

/// [`for_each_record_chunk`] (the whole file) or
/// [`for_each_record_chunk_in`] (`range`), checking what each hands out.
fn read_chunks(
    path: &Path,
    range: Option<std::ops::Range<usize>>,
    chunk: usize,
) -> Result<Vec<SourceRecord>, String> {
    let (mut all, mut last) = (Vec::new(), 0.0);
    let fields = FieldNames::default();
    let mut each = |records: Vec<SourceRecord>, read: padfree_data::ReadProgress| {
        assert!(!records.is_empty() && records.len() <= chunk);
        assert!(read.fraction >= last && read.fraction <= 1.0, "{read:?}");
        last = read.fraction;
        all.extend(records);
        assert_eq!(read.records, all.len());
        Ok(())
    };
    let count = match range {
        None => for_each_record_chunk(path, &fields, chunk, &mut each),
        Some(range) => for_each_record_chunk_in(path, &fields, range, chunk, &mut each),
    }
    .map_err(|err| err.to_string())?;
    assert_eq!(count, all.len());
    Ok(all)
}

fn whole(path: &Path) -> Result<Vec<SourceRecord>, String> {
    read_records(path, &FieldNames::default()).map_err(|err| err.to_string())
}

#[test]
fn chunks_hold_the_records_of_the_whole_file_and_its_errors() {
    let dir = tempfile::tempdir().expect("scratch");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path
    };
    let shipped = std::fs::read_to_string(repo("data/gsm-symbolic/train.jsonl")).expect("data");
    let some: Vec<&str> = shipped.lines().take(25).collect();
    let jsonl = format!(
        "\u{feff}{}\n\n{}\r\n{{\"note\": \"a note here\", {}\n",
        some[..10].join("\n"),
        some[10..20].join("\n"),
        &some[20][1..]
    );
    let files = [
        write("a.jsonl", &jsonl),
        write("b.json", &format!("  [{}]", some[..9].join(","))),
        repo("fixtures/data/columnar/gsm40.parquet"),
        repo("fixtures/data/columnar/gsm40-shards"),
        repo("fixtures/data/columnar/gsm40-hf"),
    ];
    for path in &files {
        let expected = whole(path).expect("reads");
        for chunk in [1, 3, 7, 1000] {
            assert_eq!(
                chunked(path, chunk).expect("reads"),
                expected,
                "{path:?} by {chunk}"
            );
        }
        // Counted without reading them; ranks' shares cut by that count
        // hold the records in file order (a range past the end, fewer).
        let count = count_records(path, &FieldNames::default()).expect("counts");
        assert_eq!(count, expected.len(), "{path:?}");
        for world in [2, 3, 50] {
            let shares: Vec<Vec<SourceRecord>> = (0..world)
                .map(|r| in_range(path, count * r / world..count * (r + 1) / world))
                .collect::<Result<_, _>>()
                .expect("reads");
            assert_eq!(shares.concat(), expected, "{path:?} in {world} shares");
        }
        assert_eq!(
            in_range(path, count - 2..count + 5).expect("reads"),
            expected[count - 2..]
        );
    }
    let bad = [
        write(
            "bad-json.jsonl",
            &format!("{}\n{}\n{{oops\n{}\n", some[0], some[1], some[2]),
        ),
        write(
            "bad-shape.jsonl",
            &format!("{}\n\n{{\"question\": 3}}\n", some[0]),
        ),
        write("empty.jsonl", "\n\n"),
        write("utf8.jsonl", &format!("{}\n", some[0])),
    ];
    let mut bytes = std::fs::read(&bad[3]).expect("read");
    bytes.extend_from_slice(b"{\"text\": \"\xff\xfe\"}\n");
    std::fs::write(&bad[3], bytes).expect("write");
    for path in &bad {
        let expected = whole(path).expect_err("refused");
        assert_eq!(chunked(path, 2).expect_err("refused"), expected, "{path:?}");
    }
    // A share holding the bad record has its error; a share before or
    // after it (whose lines are passed over unparsed) does not.
    let path = &bad[0];
    assert_eq!(
        count_records(path, &FieldNames::default()).expect("counts"),
        4
    );
    let expected = whole(path).expect_err("refused");
    assert_eq!(in_range(path, 1..3).expect_err("refused"), expected);
    assert_eq!(in_range(path, 0..2).expect("reads").len(), 2);
    assert_eq!(in_range(path, 3..4).expect("reads").len(), 1);
    assert_eq!(
        in_range(&bad[2], 0..1).expect_err("refused"),
        whole(&bad[2]).expect_err("refused")
    );
}

#[test]
fn an_entry_built_chunk_by_chunk_holds_a_fresh_tokenization() {
    let dir = tempfile::tempdir().expect("scratch");
    let tokenizer = shipped_tokenizer();
    let shipped = std::fs::read_to_string(repo("data/gsm-symbolic/train.jsonl")).expect("data");
    let mut text: String = shipped
        .lines()
        .take(300)
        .map(|l| format!("{l}\n"))
        .collect();
    text.push_str("{\"question\": \"1 + 1?\", \"answer\": \"2\", \"note\": \"an easy one\"}\n");
    let data = dir.path().join("d.jsonl");
    std::fs::write(&data, &text).expect("write");
    let fields = FieldNames::default();
    let config = config();
    let parts = file_parts(&data, &fields, &tokenizer, &config);
    let fresh = tokenize_records(
        &data,
        &whole(&data).expect("reads"),
        Some(&tokenizer),
        &config,
    )
    .expect("tokenizes");
    assert!(fresh.report.dropped_overlong > 0 && fresh.unused_fields.len() == 1);
    let cache = DataCache::new(dir.path().join("cache")).with_threads(2);
    let mut heard = 0;
    let used = cache
        .build_in_chunks(&data, &parts, 7, &mut |read| heard = read.records)
        .expect("builds");
    assert!(matches!(used, CacheUse::Built(_)), "{used:?}");
    assert_eq!(heard, 301);
    let Lookup::Hit(read, _) = cache.look_up(&data, &parts).expect("reads") else {
        panic!("the entry is not whole")
    };
    assert_eq!(read.examples, fresh.examples);
    assert_eq!(read.locations, fresh.locations);
    assert_eq!(read.report, fresh.report);
    assert_eq!(read.unused_fields, fresh.unused_fields);
    let Lookup::Hit(opened, entry) = cache.open(&data, &parts).expect("opens") else {
        panic!("the entry does not open")
    };
    assert!(opened.examples.is_stored());
    // Counted while the entry was checked: what holding them would give.
    let held = padfree_pack::ExampleSet::from(fresh.examples.clone());
    assert_eq!(
        opened.examples.fingerprint().expect("counted"),
        held.fingerprint().expect("held")
    );
    assert_eq!(
        opened.examples.loss_tokens().expect("counted"),
        held.loss_tokens().expect("held")
    );
    assert_eq!(
        opened.examples.lengths(),
        read.examples.iter().map(|e| e.len()).collect::<Vec<_>>()
    );
    assert_eq!(
        opened.examples.clone().into_examples().expect("reads"),
        fresh.examples
    );
    assert_eq!(
        (&opened.locations, &opened.report),
        (&fresh.locations, &fresh.report)
    );
    // Built again: the whole entry is kept.
    let again = cache.build(&data, &parts, &mut |_| {}).expect("builds");
    assert!(matches!(again, CacheUse::Reused(_)), "{again:?}");
    // Damaged: not opened, and rebuilt.
    let ids = entry.join("ids.u32");
    let mut bytes = std::fs::read(&ids).expect("ids");
    bytes[100] ^= 1;
    std::fs::write(&ids, bytes).expect("damage");
    assert!(matches!(
        cache.open(&data, &parts).expect("looks"),
        Lookup::Broken(_)
    ));
    let rebuilt = cache
        .build_in_chunks(&data, &parts, 50, &mut |_| {})
        .expect("builds");
    assert!(matches!(rebuilt, CacheUse::Rebuilt(..)), "{rebuilt:?}");
    let Lookup::Hit(opened, _) = cache.open(&data, &parts).expect("opens") else {
        panic!("the rebuilt entry does not open")
    };
    assert_eq!(
        opened.examples.into_examples().expect("reads"),
        fresh.examples
    );
}

#[test]
fn a_bad_record_in_a_later_chunk_leaves_no_entry() {
    let dir = tempfile::tempdir().expect("scratch");
    let tokenizer = shipped_tokenizer();
    let shipped = std::fs::read_to_string(repo("data/gsm-symbolic/train.jsonl")).expect("data");
    let mut text: String = shipped.lines().take(40).map(|l| format!("{l}\n")).collect();
    text.push_str("{\"input_ids\": [1, 9999]}\n");
    text.push_str(shipped.lines().next().expect("a line"));
    let data = dir.path().join("d.jsonl");
    std::fs::write(&data, &text).expect("write");
    let (fields, config) = (FieldNames::default(), config());
    let parts = file_parts(&data, &fields, &tokenizer, &config);
    let cache_dir = dir.path().join("cache");
    let cache = DataCache::new(&cache_dir).with_threads(2);
    let err = cache
        .build_in_chunks(&data, &parts, 8, &mut |_| {})
        .expect_err("refused");
    let fresh = tokenize_records(
        &data,
        &whole(&data).expect("reads"),
        Some(&tokenizer),
        &config,
    )
    .expect_err("refused");
    assert_eq!(err.to_string(), fresh.to_string());
    assert!(err.to_string().contains("line 41"), "{err}");
    let left = std::fs::read_dir(&cache_dir).map_or(0, |d| d.count());
    assert_eq!(left, 0, "nothing is left in the cache");
}
