//! The tokenized-data cache: read back equal to a fresh tokenization, missed
//! when any part of its key changes, never trusted when damaged, whole when
//! several processes build it at once.

use std::path::{Path, PathBuf};

use padfree_data::{
    CacheKeyParts, CacheUse, DataCache, DataError, DataSet, FieldNames, Lookup, Overlong, Ranks,
    ShareWriter, SourceRecord, TextTokenizer, TokenizeConfig, TokenizedDataset, cache_key,
    content_fingerprint, file_fingerprint, read_records_from_str, tokenize_records,
};

fn shipped(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/gsm-symbolic")
        .join(name)
}

fn tokenizer() -> TextTokenizer {
    TextTokenizer::from_file(&shipped("tokenizer.json")).expect("the shipped tokenizer loads")
}

fn config() -> TokenizeConfig {
    TokenizeConfig {
        train_on_inputs: false,
        use_chat_template: false,
        max_seq_len: 160,
        overlong: Overlong::Truncate,
        vocab_limit: 8192,
    }
}

/// The first 300 shipped records (some longer than 160 tokens: truncated).
fn data() -> String {
    let text = std::fs::read_to_string(shipped("train.jsonl")).expect("shipped data");
    text.lines().take(300).collect::<Vec<_>>().join("\n")
}

fn records(text: &str) -> Vec<SourceRecord> {
    read_records_from_str(Path::new("d.jsonl"), text, &FieldNames::default()).expect("parses")
}

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("padfree-data-cache-")
        .tempdir()
        .expect("scratch dir")
}

/// The slow, obvious path: tokenized without a cache.
fn fresh(text: &str, tokenizer: &TextTokenizer, config: &TokenizeConfig) -> TokenizedDataset {
    tokenize_records(
        Path::new("d.jsonl"),
        &records(text),
        Some(tokenizer),
        config,
    )
    .expect("tokenizes")
}

fn same(a: &TokenizedDataset, b: &TokenizedDataset) {
    assert_eq!(a.examples, b.examples);
    assert_eq!(a.locations, b.locations);
    assert_eq!(a.report, b.report);
    assert_eq!(a.unused_fields, b.unused_fields);
}

fn run(
    cache: &DataCache,
    text: &str,
    tokenizer: &TextTokenizer,
    config: &TokenizeConfig,
) -> (TokenizedDataset, CacheUse) {
    let fields = FieldNames::default();
    let parts = CacheKeyParts {
        content: content_fingerprint(text.as_bytes()),
        fields: &fields,
        tokenizer: Some(tokenizer),
        config,
    };
    cache
        .tokenize(Path::new("d.jsonl"), &records(text), &parts, &mut |_, _| {})
        .expect("tokenizes")
}

#[test]
fn a_second_start_reads_back_what_the_first_tokenized() {
    let dir = scratch();
    let cache = DataCache::new(dir.path().join("cache"));
    let (mut text, tokenizer, config) = (data(), tokenizer(), config());
    // A text field no shape reads: its warning is kept in the entry, for
    // starts that read the records no more.
    text.push_str("\n{\"question\": \"1 + 1?\", \"answer\": \"2\", \"note\": \"an easy one\"}");
    let fresh = fresh(&text, &tokenizer, &config);
    assert!(
        fresh.report.truncated > 0,
        "the test needs a truncated example"
    );
    assert_eq!(fresh.unused_fields.len(), 1);
    let (built, first) = run(&cache, &text, &tokenizer, &config);
    assert!(matches!(first, CacheUse::Built(_)), "{first:?}");
    same(&built, &fresh);
    let (reused, second) = run(&cache, &text, &tokenizer, &config);
    let CacheUse::Reused(entry) = second else {
        panic!("{second:?}")
    };
    same(&reused, &fresh);
    assert_eq!(reused.source, Path::new("d.jsonl"));
    let names: Vec<String> = std::fs::read_dir(&entry)
        .expect("the entry")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
}

#[test]
fn every_part_of_the_key_names_another_entry() {
    let (text, tokenizer, config) = (data(), tokenizer(), config());
    let fields = FieldNames::default();
    let template = FieldNames {
        prompt_template: Some("{question}".into()),
        completion: Some("answer".into()),
        ..FieldNames::default()
    };
    let mut edited = text.clone().into_bytes();
    edited[10] ^= 1;
    // Another tokenizer: the same vocabulary with another chat template.
    let json = std::fs::read(shipped("tokenizer.json")).expect("tokenizer.json");
    let other = TextTokenizer::from_bytes(
        "other",
        &json,
        Some(r#"{"eos_token": "<|endoftext|>", "chat_template": "{{ messages }}"}"#.into()),
    )
    .expect("loads");
    let base = CacheKeyParts {
        content: content_fingerprint(text.as_bytes()),
        fields: &fields,
        tokenizer: Some(&tokenizer),
        config: &config,
    };
    let configs = [
        TokenizeConfig {
            train_on_inputs: true,
            ..config.clone()
        },
        TokenizeConfig {
            use_chat_template: true,
            ..config.clone()
        },
        TokenizeConfig {
            max_seq_len: 161,
            ..config.clone()
        },
        TokenizeConfig {
            overlong: Overlong::Drop,
            ..config.clone()
        },
        TokenizeConfig {
            vocab_limit: 8193,
            ..config.clone()
        },
    ];
    let mut keys = vec![
        cache_key(&base).expect("key"),
        cache_key(&CacheKeyParts {
            content: content_fingerprint(&edited),
            ..base
        })
        .expect("key"),
        cache_key(&CacheKeyParts {
            fields: &template,
            ..base
        })
        .expect("key"),
        cache_key(&CacheKeyParts {
            tokenizer: Some(&other),
            ..base
        })
        .expect("key"),
        cache_key(&CacheKeyParts {
            tokenizer: None,
            ..base
        })
        .expect("key"),
    ];
    for config in &configs {
        keys.push(cache_key(&CacheKeyParts { config, ..base }).expect("key"));
    }
    // The same parts give the same key (a fresh load of the tokenizer too).
    let again = tokenizer_again();
    assert_eq!(
        cache_key(&CacheKeyParts {
            tokenizer: Some(&again),
            ..base
        })
        .expect("key"),
        keys[0]
    );
    let count = keys.len();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), count, "every part changes the key");
}

fn tokenizer_again() -> TextTokenizer {
    tokenizer()
}

#[test]
fn a_damaged_entry_is_rebuilt_not_trusted() {
    let (text, tokenizer, config) = (data(), tokenizer(), config());
    let fresh = fresh(&text, &tokenizer, &config);
    type Damage = fn(&Path);
    let damages: [(&str, Damage, &str); 4] = [
        (
            "a flipped id",
            |entry| flip(&entry.join("ids.u32"), 40),
            "checksum",
        ),
        (
            "labels cut short",
            |entry| cut(&entry.join("labels.i32")),
            "cut short",
        ),
        (
            "a torn manifest",
            |entry| cut(&entry.join("dataset.json")),
            "not whole",
        ),
        (
            "a missing offsets file",
            |entry| std::fs::remove_file(entry.join("offsets.u64")).expect("removes"),
            "could not be read",
        ),
    ];
    for (what, damage, said) in damages {
        let dir = scratch();
        let cache = DataCache::new(dir.path());
        let (_, built) = run(&cache, &text, &tokenizer, &config);
        let CacheUse::Built(entry) = built else {
            panic!("{what}: {built:?}")
        };
        damage(&entry);
        let (rebuilt, used) = run(&cache, &text, &tokenizer, &config);
        match &used {
            CacheUse::Rebuilt(_, why) => assert!(why.contains(said), "{what}: {why}"),
            other => panic!("{what}: {other:?}"),
        }
        same(&rebuilt, &fresh);
        let (_, after) = run(&cache, &text, &tokenizer, &config);
        assert!(matches!(after, CacheUse::Reused(_)), "{what}: {after:?}");
    }
}

fn flip(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).expect("reads");
    bytes[at] ^= 0x10;
    std::fs::write(path, bytes).expect("writes");
}

fn cut(path: &Path) {
    let bytes = std::fs::read(path).expect("reads");
    std::fs::write(path, &bytes[..bytes.len() / 2]).expect("writes");
}

#[test]
fn a_writer_stopped_midway_leaves_nothing_that_is_read() {
    let (text, tokenizer, config) = (data(), tokenizer(), config());
    let dir = scratch();
    let cache = DataCache::new(dir.path());
    let fields = FieldNames::default();
    let key = cache_key(&CacheKeyParts {
        content: content_fingerprint(text.as_bytes()),
        fields: &fields,
        tokenizer: Some(&tokenizer),
        config: &config,
    })
    .expect("key");
    // What a process killed while writing leaves: its temporary directory.
    let tmp = dir.path().join(format!(".tmp-{key}-1-2"));
    std::fs::create_dir_all(&tmp).expect("tmp");
    std::fs::write(tmp.join("ids.u32"), [1, 2, 3]).expect("junk");
    let (_, used) = run(&cache, &text, &tokenizer, &config);
    assert!(matches!(used, CacheUse::Built(_)), "{used:?}");
    let (_, used) = run(&cache, &text, &tokenizer, &config);
    assert!(matches!(used, CacheUse::Reused(_)), "{used:?}");
}

#[test]
fn writers_at_once_leave_one_whole_entry() {
    let (text, tokenizer, config) = (data(), tokenizer(), config());
    let fresh = fresh(&text, &tokenizer, &config);
    let dir = scratch();
    let cache = DataCache::new(dir.path());
    let start = std::sync::Barrier::new(4);
    let results: Vec<(TokenizedDataset, CacheUse)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    start.wait();
                    run(&cache, &text, &tokenizer, &config)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a writer"))
            .collect()
    });
    for (dataset, used) in &results {
        same(dataset, &fresh);
        assert!(
            matches!(used, CacheUse::Built(_) | CacheUse::Reused(_)),
            "{used:?}"
        );
    }
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .expect("the cache")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left.len(), 1, "one entry, no temporaries: {left:?}");
    let (again, used) = run(&cache, &text, &tokenizer, &config);
    assert!(matches!(used, CacheUse::Reused(_)), "{used:?}");
    same(&again, &fresh);
}

#[test]
fn a_cache_that_cannot_be_written_is_said_and_the_run_goes_on() {
    let (text, tokenizer, config) = (data(), tokenizer(), config());
    let dir = scratch();
    let not_a_dir = dir.path().join("file");
    std::fs::write(&not_a_dir, "x").expect("a file");
    let (dataset, used) = run(&DataCache::new(&not_a_dir), &text, &tokenizer, &config);
    assert!(!dataset.examples.is_empty());
    assert!(matches!(used, CacheUse::NotWritten(..)), "{used:?}");
    assert!(used.to_string().contains("HINT:"), "{used}");
}

#[test]
fn a_file_is_fingerprinted_as_its_bytes() {
    let dir = scratch();
    // Past one 8 MiB read block, and not a multiple of 8 bytes.
    let bytes: Vec<u8> = (0..(9u32 << 20) + 5)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let path = dir.path().join("big.jsonl");
    std::fs::write(&path, &bytes).expect("writes");
    assert_eq!(
        file_fingerprint(&path).expect("reads"),
        content_fingerprint(&bytes)
    );
    let mut edited = bytes.clone();
    edited[(8 << 20) + 3] ^= 1;
    assert_ne!(content_fingerprint(&edited), content_fingerprint(&bytes));
}

/// Threads standing in for MPI ranks: a barrier, and a vote every rank
/// casts before any reads it.
struct ThreadRanks {
    rank: usize,
    world: usize,
    barrier: std::sync::Arc<std::sync::Barrier>,
    votes: std::sync::Arc<std::sync::Mutex<Vec<bool>>>,
}

impl Ranks for ThreadRanks {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn barrier(&self) -> Result<(), String> {
        self.barrier.wait();
        Ok(())
    }

    fn all(&self, mine: bool) -> Result<bool, String> {
        self.votes.lock().expect("votes")[self.rank] = mine;
        self.barrier.wait();
        let all = self.votes.lock().expect("votes").iter().all(|&v| v);
        // Nobody votes again before everyone has counted.
        self.barrier.wait();
        Ok(all)
    }
}

/// `world` threads as ranks, rank `r` with the cache in `dirs(r)`.
fn on_ranks(
    world: usize,
    text: &str,
    dirs: impl Fn(usize) -> PathBuf + Sync,
) -> Vec<Result<(TokenizedDataset, CacheUse), DataError>> {
    on_ranks_writing(world, text, dirs, Writer::Rank)
}

/// Who writes a rank's share.
#[derive(Clone, Copy)]
enum Writer {
    /// The rank, on its thread.
    Rank,
    /// "Another process" (here a call) on 2 threads, as padfree's helper.
    Helper,
    /// A writer that fails: the rank writes it.
    Failing,
}

fn on_ranks_writing(
    world: usize,
    text: &str,
    dirs: impl Fn(usize) -> PathBuf + Sync,
    writer: Writer,
) -> Vec<Result<(TokenizedDataset, CacheUse), DataError>> {
    let (tokenizer, config, fields) = (tokenizer(), config(), FieldNames::default());
    let parts = text_parts(text, &fields, &tokenizer, &config);
    let records = records(text);
    let (_dir, file) = data_file(text);
    as_ranks(world, |ranks| {
        let rank = ranks.rank;
        let helper = share_helper(writer, dirs(rank), &file, &parts);
        let share_writer: Option<&ShareWriter<'_>> = match writer {
            Writer::Rank => None,
            _ => Some(&helper),
        };
        DataCache::new(dirs(rank)).tokenize_on_ranks(
            &file,
            &records,
            &parts,
            (ranks, share_writer),
            &mut |_, _| {},
        )
    })
}

/// The key parts of data `text` read with `fields`, `tokenizer` and `config`.
fn text_parts<'a>(
    text: &str,
    fields: &'a FieldNames,
    tokenizer: &'a TextTokenizer,
    config: &'a TokenizeConfig,
) -> CacheKeyParts<'a> {
    CacheKeyParts {
        content: content_fingerprint(text.as_bytes()),
        fields,
        tokenizer: Some(tokenizer),
        config,
    }
}

/// `run` on `world` threads as ranks, their results in rank order.
fn as_ranks<T: Send>(world: usize, run: impl Fn(&ThreadRanks) -> T + Sync) -> Vec<T> {
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(world));
    let votes = std::sync::Arc::new(std::sync::Mutex::new(vec![false; world]));
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let ranks = ThreadRanks {
                    rank,
                    world,
                    barrier: barrier.clone(),
                    votes: votes.clone(),
                };
                let run = &run;
                scope.spawn(move || run(&ranks))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank"))
            .collect()
    })
}

/// The data `text` written to a file (in a directory removed when the
/// first is dropped): what a helper streams a share from.
fn data_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = scratch();
    let file = dir.path().join("d.jsonl");
    std::fs::write(&file, text).expect("the data file");
    (dir, file)
}

/// A share writer as `writer` says, streaming its records from `file`
/// into the cache in `dir`.
fn share_helper<'a>(
    writer: Writer,
    dir: PathBuf,
    file: &'a Path,
    parts: &'a CacheKeyParts<'a>,
) -> impl Fn(std::ops::Range<usize>, &str) -> Result<(), String> + 'a {
    move |range: std::ops::Range<usize>, key: &str| match writer {
        Writer::Failing => Err("no helper here".to_owned()),
        _ => {
            DataCache::new(&dir)
                .with_threads(2)
                .build_share(file, parts, (range, key), &mut |_| {})
        }
    }
}

#[test]
fn ranks_tokenize_their_shares_and_join_them_in_file_order() {
    let (text, tokenizer, config) = (data(), tokenizer(), config());
    let fresh = fresh(&text, &tokenizer, &config);
    let dir = scratch();
    for (round, expected) in [("cold", "Shared"), ("warm", "Reused")] {
        for (rank, result) in on_ranks(3, &text, |_| dir.path().to_owned())
            .into_iter()
            .enumerate()
        {
            let (dataset, used) = result.expect("tokenizes");
            same(&dataset, &fresh);
            assert!(
                format!("{used:?}").starts_with(expected),
                "{round}, rank {rank}: {used:?}"
            );
        }
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .expect("the cache")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            left.len(),
            1,
            "{round}: the entry alone, no shares: {left:?}"
        );
    }
    // One process reads what the ranks built.
    let (alone, used) = run(&DataCache::new(dir.path()), &text, &tokenizer, &config);
    assert!(matches!(used, CacheUse::Reused(_)), "{used:?}");
    same(&alone, &fresh);
}

/// Ranks building a cold start without holding it: every share streamed
/// from the file by record number (by a helper, or by the rank when the
/// helper fails; blank lines are not records), rank 0 joining the shares
/// file to file, every rank opening the entry: the examples, locations,
/// report and unused text fields of a fresh tokenization, the entry one
/// process builds byte for byte, no share left; a bad record is every
/// rank's error.
#[test]
fn ranks_build_the_entry_file_to_file_and_open_it() {
    let (tokenizer, config) = (tokenizer(), config());
    let mut lines: Vec<String> = data().lines().map(str::to_owned).collect();
    // Blank lines early, an unused field first met in the last share.
    lines.insert(40, String::new());
    lines.insert(41, "   ".into());
    lines[260] = format!("{{\"note\": \"a note\", {}", &lines[260][1..]);
    let text = lines.join("\n");
    let fresh = fresh(&text, &tokenizer, &config);
    assert_eq!(fresh.unused_fields.len(), 1);
    let build = |(text, file): (&str, &Path), dir: &Path, writer: Writer| {
        let fields = FieldNames::default();
        let parts = text_parts(text, &fields, &tokenizer, &config);
        let records = padfree_data::count_records(file, &fields).expect("counts");
        as_ranks(3, |ranks| -> Result<DataSet, DataError> {
            let cache = DataCache::new(dir);
            let helper = share_helper(writer, dir.to_owned(), file, &parts);
            let placed = cache.build_on_ranks(file, records, &parts, (ranks, Some(&helper)))?;
            assert!(placed, "rank {}: the entry was placed", ranks.rank);
            match cache.open(file, &parts)? {
                Lookup::Hit(dataset, _) => Ok(dataset),
                other => panic!("rank {}: {other:?}", ranks.rank),
            }
        })
    };
    for writer in [Writer::Helper, Writer::Failing] {
        let dir = scratch();
        let (_data, file) = data_file(&text);
        for result in build((&text, &file), dir.path(), writer) {
            let dataset = result.expect("builds");
            assert!(dataset.examples.is_stored());
            assert_eq!(
                dataset.examples.into_examples().expect("reads"),
                fresh.examples
            );
            assert_eq!(
                (&dataset.locations, &dataset.report, &dataset.unused_fields),
                (&fresh.locations, &fresh.report, &fresh.unused_fields)
            );
        }
        let left: Vec<PathBuf> = std::fs::read_dir(dir.path())
            .expect("the cache")
            .map(|e| e.expect("entry").path())
            .collect();
        assert_eq!(left.len(), 1, "the entry alone, no shares");
        // One process streaming the whole file writes the same bytes.
        let alone = scratch();
        let fields = FieldNames::default();
        let parts = text_parts(&text, &fields, &tokenizer, &config);
        let used = DataCache::new(alone.path())
            .build(&file, &parts, &mut |_| {})
            .expect("builds");
        assert!(matches!(used, CacheUse::Built(_)), "{used:?}");
        for name in ["ids.u32", "labels.i32", "offsets.u64", "dataset.json"] {
            let bytes = |dir: &Path| std::fs::read(dir.join(name)).expect("an entry's file");
            assert!(
                bytes(&left[0]) == bytes(&alone.path().join(left[0].file_name().expect("key"))),
                "{name} differs"
            );
        }
    }
    let mut lines: Vec<String> = data().lines().map(str::to_owned).collect();
    lines[150] = "{\"input_ids\": [1, 99999]}".to_owned();
    let dir = scratch();
    let bad = lines.join("\n");
    let (_data, file) = data_file(&bad);
    for result in build((&bad, &file), dir.path(), Writer::Helper) {
        let err = result.expect_err("refused").to_string();
        assert!(err.contains("line 151"), "{err}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).expect("the cache").count(), 0);
}

/// A rank's share written by a helper on 2 threads (padfree's
/// `tokenize-helper` under `mpirun`) joins as the rank's own would; a
/// helper that fails leaves the share to the rank.
#[test]
fn a_share_written_by_a_helper_joins_as_the_ranks_own() {
    let (text, tokenizer, config) = (data(), tokenizer(), config());
    let fresh = fresh(&text, &tokenizer, &config);
    for writer in [Writer::Helper, Writer::Failing] {
        let dir = scratch();
        for result in on_ranks_writing(3, &text, |_| dir.path().to_owned(), writer) {
            let (dataset, used) = result.expect("tokenizes");
            same(&dataset, &fresh);
            assert!(matches!(used, CacheUse::Shared(..)), "{used:?}");
        }
        let left = std::fs::read_dir(dir.path()).expect("the cache").count();
        assert_eq!(left, 1, "the entry alone, no shares");
    }
    // A bad record in a helper's share is every rank's error.
    let mut lines: Vec<String> = data().lines().map(str::to_owned).collect();
    lines[250] = "{\"input_ids\": [1, 99999]}".to_owned();
    let dir = scratch();
    for result in on_ranks_writing(
        3,
        &lines.join("\n"),
        |_| dir.path().to_owned(),
        Writer::Helper,
    ) {
        let err = result.expect_err("refused").to_string();
        assert!(err.contains("line 251"), "{err}");
    }
}

#[test]
fn every_rank_reports_the_first_bad_record_of_the_file() {
    let mut lines: Vec<String> = data().lines().map(str::to_owned).collect();
    // Out of the vocabulary, in the second and the third rank's shares.
    lines[150] = r#"{"input_ids": [1, 99999]}"#.into();
    lines[250] = r#"{"input_ids": [1, 99998]}"#.into();
    let text = lines.join("\n");
    let dir = scratch();
    for result in on_ranks(3, &text, |_| dir.path().to_owned()) {
        let err = result.expect_err("refused").to_string();
        assert!(err.contains("line 151") && err.contains("99999"), "{err}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).expect("the cache").count(), 0);
}

#[test]
fn ranks_that_do_not_share_a_directory_each_tokenize_everything() {
    let (text, tokenizer, config) = (data(), tokenizer(), config());
    let fresh = fresh(&text, &tokenizer, &config);
    let dir = scratch();
    for (rank, result) in on_ranks(2, &text, |rank| dir.path().join(format!("node-{rank}")))
        .into_iter()
        .enumerate()
    {
        let (dataset, used) = result.expect("tokenizes");
        same(&dataset, &fresh);
        assert!(matches!(used, CacheUse::Built(_)), "rank {rank}: {used:?}");
        let node = dir.path().join(format!("node-{rank}"));
        let left = std::fs::read_dir(&node).expect("the node's cache").count();
        assert_eq!(left, 1, "rank {rank}: the entry alone, its share removed");
    }
}

#[test]
fn progress_is_told_while_records_are_tokenized_and_not_when_read_back() {
    let text = std::fs::read_to_string(shipped("train.jsonl")).expect("shipped data");
    let text: String = text
        .lines()
        .cycle()
        .take(2500)
        .collect::<Vec<_>>()
        .join("\n");
    let (tokenizer, config) = (tokenizer(), config());
    let fields = FieldNames::default();
    let parts = CacheKeyParts {
        content: content_fingerprint(text.as_bytes()),
        fields: &fields,
        tokenizer: Some(&tokenizer),
        config: &config,
    };
    let dir = scratch();
    let cache = DataCache::new(dir.path());
    let records = records(&text);
    // Tokenized, then read back: told every 1,024 records and at the end,
    // then not at all.
    let expected: [&[(usize, usize)]; 2] = [&[(1024, 2500), (2048, 2500), (2500, 2500)], &[]];
    for (round, expected) in expected.into_iter().enumerate() {
        let mut heard = Vec::new();
        let (_, used) = cache
            .tokenize(
                Path::new("d.jsonl"),
                &records,
                &parts,
                &mut |done, total| {
                    heard.push((done, total));
                },
            )
            .expect("tokenizes");
        assert_eq!(heard, expected, "round {round}: {used:?}");
        assert_eq!(matches!(used, CacheUse::Reused(_)), round == 1, "{used:?}");
    }
}
