//! A cold start's tokenization in a helper process, on every core.
//!
//! padfree tunes glibc's malloc for training steps (`crate::allocator`):
//! one arena for every thread. The tokenizer allocates for every word, and
//! threads sharing one arena wait on its lock: 2 threads tokenized 20,000
//! records in 6.3 s against 4.8 s on one (docs/benchmarks). So a tuned
//! process that must tokenize a data file starts `padfree tokenize-helper`
//! without the tuning (malloc as the user has it: an arena per thread),
//! hands it the job on standard input (the file, field names, tokenizer
//! files, settings and a cache directory) and reads the examples from the
//! cache entry the helper writes (a step's at a time): the cache is the
//! hand-over. The helper reads the records a chunk at a time and appends
//! each chunk's examples to the entry (`DataCache::build`): neither process
//! holds the data set. Without
//! `--no-data-cache` that is the user's cache; with it, a temporary
//! directory removed once read.
//!
//! The helper answers one JSON line on standard output: the key it wrote,
//! or the error (a bad record: file, location, field, HINT), which the run
//! reports as its own. Anything else (no helper started, another key, an
//! entry not written) falls back to tokenizing in this process, with a note.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use padfree_data::{
    CacheKeyParts, CacheUse, DataCache, DataSet, FieldNames, Lookup, ReadProgress, TextTokenizer,
    TokenizeConfig, cache_key, data_fingerprint,
};
use serde::{Deserialize, Serialize};

/// The subcommand the helper runs as (hidden from `--help`).
pub const SUBCOMMAND: &str = "tokenize-helper";

/// What the helper is asked to do.
#[derive(Debug, Serialize, Deserialize)]
struct Job {
    file: PathBuf,
    fields: FieldNames,
    tokenizer: Option<TokenizerFiles>,
    config: TokenizeConfig,
    cache_dir: PathBuf,
    /// An MPI rank's share of the records (their range of record numbers,
    /// in file order) and the share entry to write, instead of the whole
    /// entry: streamed from the file as a whole entry is.
    share: Option<ShareJob>,
    /// Whether to draw the progress bar (the lead rank's helper, or the
    /// only process's).
    show_progress: bool,
    /// Threads to tokenize on: the run's own (every core, or under
    /// `mpirun` the rank's share of its node's cores).
    threads: usize,
}

/// A rank's share, for `DataCache::build_on_ranks` (or `tokenize_on_ranks`).
#[derive(Debug, Serialize, Deserialize)]
struct ShareJob {
    start: usize,
    end: usize,
    key: String,
}

/// A tokenizer as its HF files, so the helper builds the same one.
#[derive(Debug, Serialize, Deserialize)]
struct TokenizerFiles {
    name: String,
    tokenizer_json: String,
    config_json: String,
}

/// The helper's answer.
#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    /// The entry `key` is in the cache directory; `used` says how.
    Written {
        key: String,
        threads: usize,
        used: String,
    },
    /// Tokenized, but the entry could not be written (why).
    NotWritten(String),
    /// The data (or the job) was refused: the run's error.
    Failed(String),
}

/// The examples of `file` (whose `records` this process read and checked),
/// tokenized by a helper into `cache` (or a temporary hand-over without
/// one) and read back, with what the cache did; `None` when the helper
/// could not be used, said in a note: tokenize here instead.
pub(super) fn tokenize(
    cache: Option<&DataCache>,
    fields: &FieldNames,
    file: &Path,
    tokenizer: Option<&TextTokenizer>,
    config: &TokenizeConfig,
) -> anyhow::Result<Option<(DataSet, Option<String>)>> {
    let parts = CacheKeyParts {
        content: data_fingerprint(file)?,
        fields,
        tokenizer,
        config,
    };
    // Removed when this returns: by then the entry's files are open.
    let (dir, _handover) = match cache {
        Some(cache) => (cache.dir().to_owned(), None),
        None => {
            let handover = Handover::new();
            (handover.0.clone(), Some(handover))
        }
    };
    if let Some(Lookup::Hit(dataset, entry)) =
        cache.map(|cache| cache.open(file, &parts)).transpose()?
    {
        return Ok(Some((dataset, Some(CacheUse::Reused(entry).to_string()))));
    }
    let job = Job {
        file: file.to_owned(),
        fields: fields.clone(),
        tokenizer: tokenizer.map(tokenizer_files).transpose()?,
        config: config.clone(),
        cache_dir: dir.clone(),
        share: None,
        show_progress: true,
        threads: rayon::current_num_threads(),
    };
    let not_used = |why: String| {
        warn!(
            "the tokenizing helper was not used ({why}): tokenizing {} on one thread in this process",
            file.display()
        );
        Ok(None)
    };
    let (key, threads, used) = match ask(&job) {
        Ok(Reply::Written { key, threads, used }) => (key, threads, used),
        Ok(Reply::Failed(error)) => anyhow::bail!("{error}"),
        Ok(Reply::NotWritten(why)) => {
            return not_used(format!("its cache entry was not written: {why}"));
        }
        Err(why) => return not_used(why),
    };
    let ours = cache_key(&parts)?;
    if key != ours {
        return not_used(format!("it wrote entry {key}, this run's key is {ours}"));
    }
    // A hand-over is removed when this returns, its files open: on Linux (where
    // the helper runs) the open files stay readable until the run ends.
    let read = DataCache::new(&dir).open(file, &parts)?;
    let Lookup::Hit(dataset, _) = read else {
        return not_used(format!("its entry {key} does not read back whole"));
    };
    let note = cache.map(|_| format!("{used}, tokenized by a helper process on {threads} threads"));
    Ok(Some((dataset, note)))
}

fn tokenizer_files(tokenizer: &TextTokenizer) -> anyhow::Result<TokenizerFiles> {
    let files = tokenizer
        .hf_files()
        .map_err(|message| anyhow::anyhow!("{}: {message}", tokenizer.source_name()))?;
    let text = |name: &str| {
        files
            .iter()
            .find(|(file, _)| *file == name)
            .map(|(_, bytes)| String::from_utf8_lossy(bytes).into_owned())
            .unwrap_or_default()
    };
    Ok(TokenizerFiles {
        name: tokenizer.source_name().to_owned(),
        tokenizer_json: text("tokenizer.json"),
        config_json: text("tokenizer_config.json"),
    })
}

/// Has a helper write this rank's share (`range` of the records of `file`)
/// into the share entry `share_key` of `cache`, on every core the rank
/// has: a [`padfree_data::ShareWriter`]. Gives why it could not (then the
/// rank tokenizes its share itself).
pub(super) fn write_share(
    (cache, fields): (&DataCache, &FieldNames),
    file: &Path,
    tokenizer: Option<&TextTokenizer>,
    config: &TokenizeConfig,
    range: std::ops::Range<usize>,
    share_key: &str,
) -> Result<(), String> {
    let job = Job {
        file: file.to_owned(),
        fields: fields.clone(),
        tokenizer: tokenizer
            .map(tokenizer_files)
            .transpose()
            .map_err(|err| err.to_string())?,
        config: config.clone(),
        cache_dir: cache.dir().to_owned(),
        share: Some(ShareJob {
            start: range.start,
            end: range.end,
            key: share_key.to_owned(),
        }),
        show_progress: crate::ranks::is_lead(),
        threads: rayon::current_num_threads(),
    };
    match ask(&job)? {
        Reply::Written { key, .. } if key == share_key => Ok(()),
        Reply::Written { key, .. } => Err(format!("it wrote {key}, not {share_key}")),
        Reply::NotWritten(why) | Reply::Failed(why) => Err(why),
    }
}

/// Runs the helper on `job`: its answer, or why there is none.
fn ask(job: &Job) -> Result<Reply, String> {
    let exe = std::env::current_exe().map_err(|err| format!("no path to this binary: {err}"))?;
    let mut command = Command::new(exe);
    command.arg(SUBCOMMAND);
    crate::allocator::user_environment(&mut command);
    command
        .env("PADFREE_MALLOC", "system")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = command
        .spawn()
        .map_err(|err| format!("it could not be started: {err}"))?;
    let job = serde_json::to_vec(job).map_err(|err| err.to_string())?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(&job)
            .map_err(|err| format!("it did not take its job: {err}"))?;
    }
    let mut answer = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        stdout
            .read_to_string(&mut answer)
            .map_err(|err| format!("its answer could not be read: {err}"))?;
    }
    let status = child.wait().map_err(|err| err.to_string())?;
    serde_json::from_str(answer.trim())
        .map_err(|_| format!("it ended ({status}) without an answer"))
}

/// A temporary directory for one hand-over, removed when dropped.
struct Handover(PathBuf);

impl Handover {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Self(std::env::temp_dir().join(format!("padfree-tokenized-{}-{nanos}", std::process::id())))
    }
}

impl Drop for Handover {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `padfree tokenize-helper`: reads a job on standard input, tokenizes on
/// every core into the job's cache directory, answers on standard output.
pub fn run() -> ExitCode {
    let reply = serve().unwrap_or_else(|err| Reply::Failed(format!("{err:#}")));
    let failed = matches!(reply, Reply::Failed(_));
    let answer = serde_json::to_string(&reply).unwrap_or_default();
    println!("{answer}");
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn serve() -> anyhow::Result<Reply> {
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input)?;
    let job: Job = serde_json::from_str(&input)
        .map_err(|err| anyhow::anyhow!("{SUBCOMMAND} takes the job padfree writes on its standard input: {err}\nHINT: this command is padfree's own; run `padfree train` or `padfree pack`"))?;
    let tokenizer = job
        .tokenizer
        .map(|files| {
            TextTokenizer::from_bytes(
                &files.name,
                files.tokenizer_json.as_bytes(),
                Some(files.config_json),
            )
        })
        .transpose()?;
    let parts = CacheKeyParts {
        content: data_fingerprint(&job.file)?,
        fields: &job.fields,
        tokenizer: tokenizer.as_ref(),
        config: &job.config,
    };
    let threads = job.threads.max(1);
    let cache = DataCache::new(&job.cache_dir).with_threads(threads);
    if let Some(share) = &job.share {
        // The share's records are streamed into its entry, as a whole
        // entry's are below; the records before it are passed over.
        let bar = super::records_bar(&job.file, share.end - share.start);
        if !job.show_progress {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        let written = cache.build_share(
            &job.file,
            &parts,
            (share.start..share.end, &share.key),
            &mut |read| bar.set_position(read.records as u64),
        );
        bar.finish_and_clear();
        return Ok(match written {
            Ok(()) => Reply::Written {
                key: share.key.clone(),
                threads,
                used: String::new(),
            },
            Err(why) => Reply::NotWritten(why),
        });
    }
    // The records are read as they are tokenized: their count is known at
    // the end; the bar's length is estimated from how far through the
    // file the reading is.
    let bar = super::records_bar(&job.file, 0);
    let mut progress = |read: ReadProgress| {
        let estimate = if read.fraction > 0.0 {
            (read.records as f64 / read.fraction).round() as u64
        } else {
            0
        };
        bar.set_length(estimate.max(read.records as u64));
        bar.set_position(read.records as u64);
    };
    let used = cache.build(&job.file, &parts, &mut progress);
    bar.finish_and_clear();
    let used = used?;
    Ok(match used {
        CacheUse::NotWritten(_, why) => Reply::NotWritten(why),
        used => Reply::Written {
            key: cache_key(&parts)?,
            threads,
            used: used.to_string(),
        },
    })
}
