//! A run's data: the records of a data file (or the shipped ones), warnings
//! for text fields no record shape trains on, and the examples, through the
//! tokenized-data cache unless `--no-data-cache`; a cold start is
//! tokenized on every core by a helper process (`data/helper.rs`).

use std::path::{Path, PathBuf};

use anyhow::bail;
use indicatif::{ProgressBar, ProgressStyle};
use padfree_data::{
    CacheKeyParts, CacheUse, DataCache, DataError, DataSet, FieldNames, Fingerprint, Lookup, Ranks,
    ShareWriter, SourceRecord, TextTokenizer, TokenizeConfig, TokenizedDataset, UnusedField,
    content_fingerprint, count_records, data_fingerprint, read_records, read_records_from_str,
    tokenize_in_parallel,
};
use padfree_train::Communicator;

use crate::ranks::EveryRank;

mod helper;

pub use helper::run as run_helper;

pub(super) const EMBEDDED_DATA_NAME: &str = "<built-in>/data/gsm-symbolic/train.jsonl";
pub(super) const EMBEDDED_DATA: &str = include_str!("../../../../data/gsm-symbolic/train.jsonl");
pub(super) const EMBEDDED_EVAL_DATA_NAME: &str = "<built-in>/data/gsm-symbolic/eval.jsonl";
pub(super) const EMBEDDED_EVAL_DATA: &str =
    include_str!("../../../../data/gsm-symbolic/eval.jsonl");

/// The examples of the data file `path` (given by `--flag`), or without
/// one of the shipped file `embedded` (its name and text), through the
/// tokenized-data cache unless `--no-data-cache`, with the name they are
/// reported under; says whether the cache was built or reused, and where,
/// and warns of text fields no record's shape trains on.
///
/// A data file in one process whose malloc is tuned for training goes to
/// the helper (`data/helper.rs`), which reads and tokenizes it on every
/// core; this process reads no record, only the cache entry. Under
/// `mpirun` ranks that all find the entry read it the same way; else they
/// share the work, each rank's share of the records streamed into the
/// cache by a helper on the rank's cores (or by the rank, malloc not
/// tuned).
pub(super) fn data_set(
    (flag, path, embedded): (&str, Option<&Path>, (&str, &str)),
    (cache, fields): (Option<&DataCache>, &FieldNames),
    comm: Option<&dyn Communicator>,
    tokenizer: Option<&TextTokenizer>,
    config: &TokenizeConfig,
) -> anyhow::Result<(PathBuf, DataSet)> {
    let mut ranks = comm.filter(|comm| comm.world_size() > 1);
    if let Some(path) = path {
        exists(flag, path)?;
        // Ranks that all find the entry read their examples from it, no
        // record read; else they build it without holding it: each rank's
        // share (a range of record numbers) is streamed into a share entry
        // by a helper on the rank's cores (malloc tuned) or by the rank,
        // rank 0 joins the shares file to file, and every rank reads the
        // entry.
        if let (Some(comm), Some(cache)) = (ranks, cache) {
            let parts = CacheKeyParts {
                content: data_fingerprint(path)?,
                fields,
                tokenizer,
                config,
            };
            if let Some((dataset, entry)) = open_on_ranks(cache, comm, path, &parts)? {
                say!(
                    "data cache: {}: {}",
                    path.display(),
                    CacheUse::Reused(entry)
                );
                warn_unused_fields(path, &dataset, fields);
                return Ok((path.to_owned(), dataset));
            }
            // The file is not parsed here: a JSONL file's lines are only
            // counted, a Parquet file's rows read from its metadata.
            let records = count_records(path, fields)?;
            let writer = |range: std::ops::Range<usize>, share_key: &str| {
                helper::write_share((cache, fields), path, tokenizer, config, range, share_key)
            };
            let share_writer: Option<&ShareWriter<'_>> =
                crate::allocator::is_tuned().then_some(&writer);
            let placed = cache
                .clone()
                .with_threads(rayon::current_num_threads())
                .build_on_ranks(path, records, &parts, (&CommRanks(comm), share_writer))
                .map_err(|err| match err {
                    // Every rank read it from the shares, after a barrier.
                    record @ DataError::Record { .. } => anyhow::Error::new(EveryRank(record)),
                    other => other.into(),
                })?;
            if placed && let Some((dataset, entry)) = open_on_ranks(cache, comm, path, &parts)? {
                let used = CacheUse::Shared(entry, comm.world_size());
                say!("data cache: {}: {used}", path.display());
                warn_unused_fields(path, &dataset, fields);
                return Ok((path.to_owned(), dataset));
            }
        }
        // One process, ranks without a cache, or ranks that could not share
        // it: this process builds the data set alone.
        ranks = None;
        if crate::allocator::is_tuned()
            && let Some((dataset, used)) = helper::tokenize(cache, fields, path, tokenizer, config)?
        {
            if let Some(used) = used {
                say!("data cache: {}: {used}", path.display());
            }
            warn_unused_fields(path, &dataset, fields);
            return Ok((path.to_owned(), dataset));
        }
    }
    let (file, records) = read_data(path, embedded, fields)?;
    let text = path.is_none().then_some(embedded.1);
    let dataset = tokenize_data(
        (cache, fields),
        ranks,
        (&file, text),
        &records,
        tokenizer,
        config,
    )?;
    drop(records);
    let dataset = DataSet::from(dataset);
    warn_unused_fields(&file, &dataset, fields);
    Ok((file, dataset))
}

/// The entry for `parts` opened on every rank, when every rank can.
fn open_on_ranks(
    cache: &DataCache,
    comm: &dyn Communicator,
    path: &Path,
    parts: &CacheKeyParts<'_>,
) -> anyhow::Result<Option<(DataSet, PathBuf)>> {
    let opened = cache.open(path, parts)?;
    let every = CommRanks(comm)
        .all(matches!(opened, Lookup::Hit(..)))
        .map_err(|err| anyhow::anyhow!("the ranks could not share the data cache: {err}"))?;
    Ok(match opened {
        Lookup::Hit(dataset, entry) if every => Some((dataset, entry)),
        _ => None,
    })
}

/// The examples of `records`, read from `file` (`embedded`: the shipped
/// text it names), in this process (on every core unless malloc is tuned:
/// `PADFREE_MALLOC=system`, or not glibc).
fn tokenize_data(
    (cache, fields): (Option<&DataCache>, &FieldNames),
    ranks: Option<&dyn Communicator>,
    (file, embedded): (&Path, Option<&str>),
    records: &[SourceRecord],
    tokenizer: Option<&TextTokenizer>,
    config: &TokenizeConfig,
) -> anyhow::Result<TokenizedDataset> {
    let threads = if crate::allocator::is_tuned() || ranks.is_some() {
        1
    } else {
        rayon::current_num_threads()
    };
    let bar = records_bar(file, records.len());
    let mut progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let Some(cache) = cache else {
        let dataset =
            tokenize_in_parallel(file, records, tokenizer, config, threads, &mut progress);
        bar.finish_and_clear();
        return Ok(dataset?);
    };
    let cache = cache.clone().with_threads(threads);
    let content: Fingerprint = match embedded {
        Some(text) => content_fingerprint(text.as_bytes()),
        None => data_fingerprint(file)?,
    };
    let parts = CacheKeyParts {
        content,
        fields,
        tokenizer,
        config,
    };
    // Ranks get here only with the shipped data (a data file is built
    // above, shared or alone).
    let result = match ranks {
        Some(comm) => cache.tokenize_on_ranks(
            file,
            records,
            &parts,
            (&CommRanks(comm), None),
            &mut progress,
        ),
        None => cache.tokenize(file, records, &parts, &mut progress),
    };
    bar.finish_and_clear();
    let (dataset, used) = result?;
    say!("data cache: {}: {used}", file.display());
    Ok(dataset)
}

/// A bar of the records tokenized (of this rank's share under `mpirun`),
/// with their rate and the time left, on the lead rank's terminal; it
/// shows once the first records are done and is cleared at the end.
pub(super) fn records_bar(file: &Path, records: usize) -> ProgressBar {
    let bar = if crate::ranks::is_lead() {
        ProgressBar::new(records as u64)
    } else {
        ProgressBar::hidden()
    };
    let style = ProgressStyle::with_template(
        "tokenizing {msg} {bar:30.cyan/blue} {pos}/{len} records, {rate} [{elapsed_precise}<{eta_precise}]",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .with_key(
        "rate",
        |state: &indicatif::ProgressState, out: &mut dyn std::fmt::Write| {
            let _ = write!(out, "{:.0}/s", state.per_sec());
        },
    );
    bar.set_style(style.progress_chars("=> "));
    bar.set_message(file.display().to_string());
    bar
}

/// The trainer's communicator as the data cache sees the ranks.
struct CommRanks<'a>(&'a dyn Communicator);

impl Ranks for CommRanks<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn barrier(&self) -> Result<(), String> {
        self.0.barrier().map_err(|err| err.to_string())
    }

    fn all(&self, mine: bool) -> Result<bool, String> {
        let mut not = [f64::from(u8::from(!mine))];
        self.0
            .all_reduce_sum_f64(&mut not)
            .map_err(|err| err.to_string())?;
        Ok(not[0] == 0.0)
    }
}

/// Refuses a `--flag` path that is not there.
pub(super) fn exists(flag: &str, path: &Path) -> anyhow::Result<()> {
    if let Err(err) = std::fs::metadata(path) {
        bail!(
            "--{flag} {}: {err}\nHINT: give an existing, readable JSONL or JSON file, a .parquet file, a directory of .parquet shards or an HF datasets directory",
            path.display()
        );
    }
    Ok(())
}

/// The records of `path`, or without one those of the shipped file
/// `embedded` (its name and text), with the name they are reported under.
fn read_data(
    path: Option<&Path>,
    (embedded_name, embedded_text): (&str, &str),
    fields: &FieldNames,
) -> anyhow::Result<(PathBuf, Vec<SourceRecord>)> {
    Ok(match path {
        Some(path) => (path.to_owned(), read_records(path, fields)?),
        None => (
            PathBuf::from(embedded_name),
            read_records_from_str(Path::new(embedded_name), embedded_text, fields)?,
        ),
    })
}

/// Names the text fields of `file` that no record's shape trains on.
fn warn_unused_fields(file: &Path, dataset: &DataSet, fields: &FieldNames) {
    for field in &dataset.unused_fields {
        warn!(
            "{}: field `{}` holds text in {} of {} records (the first at {}), but their record shape does not use it: it is not trained on\nHINT: to train on it, {}name it with --prompt-field/--completion-field or --dataset-text-field, or drop it from the file to silence this",
            file.display(),
            field.name,
            field.records,
            dataset.report.records,
            field.first,
            template_hint(field, fields)
        );
    }
}

/// `build the prompt from it with --prompt-template (e.g. ...), ` for an
/// unused field of prompt/completion records: the template in use with the
/// field added, or one from the fields the shape reads (the field first,
/// then the prompt's, the completion's as `--completion-field`); empty for
/// other shapes (a template would turn a chat into one prompt).
fn template_hint(field: &UnusedField, fields: &FieldNames) -> String {
    let (template, completion) = match (&fields.prompt_template, &fields.completion) {
        (Some(template), Some(completion)) => (
            format!("{template}\\n{{{}}}", field.name),
            completion.clone(),
        ),
        _ => {
            let Some((completion, prompt)) = field.beside.split_last() else {
                return String::new();
            };
            if !field.prompted {
                return String::new();
            }
            let pieces: Vec<String> = std::iter::once(&field.name)
                .chain(prompt)
                .map(|name| format!("{{{name}}}"))
                .collect();
            (pieces.join("\\n"), completion.clone())
        }
    };
    format!(
        "build the prompt from it with --prompt-template (e.g. --prompt-template '{template}' --completion-field {completion}), "
    )
}
