use std::fmt;
use std::path::Path;

use padfree_pack::{Example, IGNORE_INDEX};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::error::DataError;
use crate::records::{Message, Record, SourceRecord, UnusedField, unused_text_fields};
use crate::template::{CHATML_TEMPLATE, ChatTemplate};

/// Tokens that end a document in common tokenizers, tried in order when the
/// tokenizer's configuration names no EOS token.
const EOS_CANDIDATES: [&str; 5] = ["<|endoftext|>", "</s>", "<|eot_id|>", "<|im_end|>", "<eos>"];

/// A tokenizer with what fine-tuning needs besides the vocabulary: its EOS
/// token and its chat template.
#[derive(Debug)]
pub struct TextTokenizer {
    tokenizer: Tokenizer,
    source_name: String,
    eos_token: String,
    eos_id: u32,
    bos_token: Option<String>,
    chat_template_source: Option<String>,
    chat_template: ChatTemplate,
    config_json: Option<String>,
}

impl TextTokenizer {
    /// Reads `tokenizer.json`, and `tokenizer_config.json` beside it when present
    /// (EOS/BOS tokens and `chat_template`).
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        let tokenizer_json = std::fs::read(path).map_err(|err| DataError::Io {
            path: path.to_owned(),
            err,
            hint: "give an existing, readable tokenizer.json (--tokenizer)",
        })?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config_json = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(text),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => None,
            Err(err) => {
                return Err(DataError::Io {
                    path: config_path,
                    err,
                    hint: "make tokenizer_config.json readable, or remove it",
                });
            }
        };
        Self::from_bytes(&path.display().to_string(), &tokenizer_json, config_json)
    }

    /// A `tokenizer.json` and optional `tokenizer_config.json` held in memory
    /// (e.g. embedded in the binary); `name` stands for them in errors.
    pub fn from_bytes(
        name: &str,
        tokenizer_json: &[u8],
        config_json: Option<String>,
    ) -> Result<Self, DataError> {
        let tokenizer =
            Tokenizer::from_bytes(tokenizer_json).map_err(|err| DataError::Tokenizer {
                source_name: name.to_owned(),
                message: format!("not a readable tokenizer.json: {err}"),
                hint: "give the tokenizer.json of a Hugging Face model (--tokenizer)".into(),
            })?;
        let config: Value = match &config_json {
            Some(text) => serde_json::from_str(text).map_err(|err| DataError::Tokenizer {
                source_name: format!("tokenizer_config.json beside {name}"),
                message: format!("not valid JSON: {err}"),
                hint: "fix or remove tokenizer_config.json".into(),
            })?,
            None => Value::Null,
        };
        let mut this = Self::new(
            tokenizer,
            name,
            special_token(&config, "eos_token").as_deref(),
            special_token(&config, "bos_token").as_deref(),
            chat_template(&config).as_deref(),
        )?;
        this.config_json = config_json;
        Ok(this)
    }

    /// Wraps a tokenizer built elsewhere (e.g. from GGUF metadata).
    /// Without `eos_token`, common EOS tokens are looked up in the vocabulary.
    pub fn new(
        tokenizer: Tokenizer,
        source_name: &str,
        eos_token: Option<&str>,
        bos_token: Option<&str>,
        chat_template: Option<&str>,
    ) -> Result<Self, DataError> {
        let refuse = |message: String, hint: &str| DataError::Tokenizer {
            source_name: source_name.to_owned(),
            message,
            hint: hint.to_owned(),
        };
        let eos_token = match eos_token {
            Some(token) => token.to_owned(),
            None => EOS_CANDIDATES
                .iter()
                .find(|t| tokenizer.token_to_id(t).is_some())
                .map(|t| (*t).to_owned())
                .ok_or_else(|| {
                    refuse(
                        "no EOS token: tokenizer_config.json names none and the vocabulary has none of <|endoftext|>, </s>, <|eot_id|>, <|im_end|>, <eos>".into(),
                        "put a tokenizer_config.json with \"eos_token\" beside tokenizer.json",
                    )
                })?,
        };
        let eos_id = tokenizer.token_to_id(&eos_token).ok_or_else(|| {
            refuse(
                format!("the EOS token `{eos_token}` is not in the vocabulary"),
                "check eos_token in tokenizer_config.json",
            )
        })?;
        let template_source = chat_template.unwrap_or(CHATML_TEMPLATE);
        let compiled = ChatTemplate::new(template_source, bos_token.unwrap_or(""), &eos_token)
            .map_err(|message| refuse(message, "fix chat_template in tokenizer_config.json"))?;
        Ok(Self {
            tokenizer,
            source_name: source_name.to_owned(),
            eos_token,
            eos_id,
            bos_token: bos_token.map(str::to_owned),
            chat_template_source: chat_template.map(str::to_owned),
            chat_template: compiled,
            config_json: None,
        })
    }

    /// The underlying tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Where it came from, for messages.
    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    /// Number of ids the tokenizer can produce (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The id appended to every response.
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// Whether the tokenizer brought its own chat template (else ChatML is used).
    pub fn has_own_chat_template(&self) -> bool {
        self.chat_template_source.is_some()
    }

    /// Token ids of `text`; `add_special_tokens` runs the post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|err| format!("tokenization failed: {err}"))
    }

    /// Text of `ids`, special tokens kept.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|err| format!("decoding failed: {err}"))
    }

    /// How this tokenizer's ids differ from `other`'s (a model's own):
    /// ids of both whose token strings differ, and the first of them.
    pub fn differences_from(&self, other: &TextTokenizer) -> TokenizerDifference {
        let shared = self.vocab_size().min(other.vocab_size()) as u32;
        let token = |t: &Tokenizer, id| t.id_to_token(id).unwrap_or_default();
        let mut differing = 0;
        let mut first = None;
        for id in 0..shared {
            let (ours, theirs) = (token(&self.tokenizer, id), token(&other.tokenizer, id));
            if ours != theirs {
                differing += 1;
                first.get_or_insert((id, ours, theirs));
            }
        }
        TokenizerDifference {
            sizes: (self.vocab_size(), other.vocab_size()),
            differing,
            first,
        }
    }

    /// `tokenizer.json` and `tokenizer_config.json` as they belong in a model
    /// directory, so a checkpoint loads with `AutoTokenizer`.
    pub fn hf_files(&self) -> Result<Vec<(&'static str, Vec<u8>)>, String> {
        let tokenizer_json = self
            .tokenizer
            .to_string(false)
            .map_err(|err| format!("cannot serialise the tokenizer: {err}"))?;
        let config_json = match &self.config_json {
            Some(text) => text.clone(),
            None => {
                let mut config = serde_json::json!({
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": self.eos_token,
                    "bos_token": self.bos_token,
                });
                if let Some(template) = &self.chat_template_source {
                    config["chat_template"] = Value::String(template.clone());
                }
                serde_json::to_string_pretty(&config).unwrap_or_default()
            }
        };
        Ok(vec![
            ("tokenizer.json", tokenizer_json.into_bytes()),
            ("tokenizer_config.json", config_json.into_bytes()),
        ])
    }
}

fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(token) => Some(token.clone()),
        Value::Object(object) => object.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn chat_template(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(template) => Some(template.clone()),
        // Several named templates: the one called "default".
        Value::Array(named) => named.iter().find_map(|entry| {
            (entry.get("name")?.as_str()? == "default")
                .then(|| entry.get("template")?.as_str().map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}

/// What to do with an example longer than `max_seq_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Overlong {
    /// Keep its first `max_seq_len` tokens (TRL's SFT default).
    Truncate,
    /// Leave it out.
    Drop,
}

/// How records become examples.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenizeConfig {
    /// Put the loss on the prompt too, not only on the response.
    pub train_on_inputs: bool,
    /// Render prompt/completion, question/answer and Alpaca records as a
    /// user/assistant chat with the tokenizer's template (for instruct models).
    pub use_chat_template: bool,
    /// The longest example kept as is.
    pub max_seq_len: usize,
    /// The policy for longer ones.
    pub overlong: Overlong,
    /// Token ids must be below this (the model's vocabulary size).
    pub vocab_limit: usize,
}

/// Examples ready for the collator, with where each came from.
#[derive(Debug, Clone)]
pub struct TokenizedDataset {
    /// The file the records were read from.
    pub source: std::path::PathBuf,
    /// One per kept record, in file order.
    pub examples: Vec<Example>,
    /// The record location (`line N`) of every example.
    pub locations: Vec<String>,
    /// Counts for the user.
    pub report: DataReport,
    /// Fields the records hold text in but their shape does not train on
    /// ([`crate::unused_text_fields`]; kept in the cache, so a start that
    /// reads the records no more still warns).
    pub unused_fields: Vec<UnusedField>,
}

/// What tokenization kept, cut and dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DataReport {
    /// Records read.
    pub records: usize,
    /// Examples kept.
    pub examples: usize,
    /// Examples cut to `max_seq_len`.
    pub truncated: usize,
    /// Examples left out for being longer than `max_seq_len`.
    pub dropped_overlong: usize,
    /// Examples left out with no label token (every label -100, or none
    /// left after truncation).
    pub dropped_no_labels: usize,
    /// Tokens of the kept examples.
    pub tokens: usize,
    /// Tokens that carry loss (the causal shift accounted for).
    pub label_tokens: usize,
    /// Shortest, median and longest kept example.
    pub min_len: usize,
    /// See `min_len`.
    pub median_len: usize,
    /// See `min_len`.
    pub max_len: usize,
    /// The `max_seq_len` applied.
    pub max_seq_len: usize,
}

impl DataReport {
    /// Adds the counts of `more` (records, cut, dropped, tokens), the
    /// report of a later part of the same file.
    fn add_counts(&mut self, more: &DataReport) {
        self.records += more.records;
        self.truncated += more.truncated;
        self.dropped_overlong += more.dropped_overlong;
        self.dropped_no_labels += more.dropped_no_labels;
        self.tokens += more.tokens;
        self.label_tokens += more.label_tokens;
    }
}

impl fmt::Display for DataReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} records -> {} examples, {} tokens ({} with loss); length min/median/max {}/{}/{}; max_seq_len {}: {} truncated, {} dropped as too long, {} dropped with no label left",
            self.records,
            self.examples,
            self.tokens,
            self.label_tokens,
            self.min_len,
            self.median_len,
            self.max_len,
            self.max_seq_len,
            self.truncated,
            self.dropped_overlong,
            self.dropped_no_labels
        )
    }
}

/// How two tokenizers' ids differ ([`TextTokenizer::differences_from`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerDifference {
    /// Vocabulary sizes: this one's, the other's.
    pub sizes: (usize, usize),
    /// Ids both have whose token strings differ.
    pub differing: usize,
    /// The first such id, with this one's and the other's token.
    pub first: Option<(u32, String, String)>,
}

impl TokenizerDifference {
    /// Whether ids mean other tokens: a tokenizer that only adds tokens
    /// past the other's vocabulary agrees.
    pub fn disagrees(&self) -> bool {
        self.differing > 0
    }
}

/// Tokenizes every record. `tokenizer` may be `None` only when every record
/// is pre-tokenized.
pub fn tokenize_records(
    path: &Path,
    records: &[SourceRecord],
    tokenizer: Option<&TextTokenizer>,
    config: &TokenizeConfig,
) -> Result<TokenizedDataset, DataError> {
    tokenize_with_progress(path, records, tokenizer, config, &mut |_, _| {})
}

/// [`tokenize_records`], telling `progress` (records tokenized, records)
/// as it goes.
pub fn tokenize_with_progress(
    path: &Path,
    records: &[SourceRecord],
    tokenizer: Option<&TextTokenizer>,
    config: &TokenizeConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<TokenizedDataset, DataError> {
    let total = records.len();
    let part = tokenize_part_with(path, records, tokenizer, config, &mut |done| {
        progress(done, total)
    })?;
    let mut dataset = finish_parts(path, vec![part], config)?;
    dataset.unused_fields = unused_text_fields(records);
    Ok(dataset)
}

/// [`tokenize_with_progress`] on `threads` threads: the records in chunks of
/// [`PROGRESS_EVERY`], a wave of `threads` chunks at a time on rayon's
/// pool, `progress` told after each wave. The examples, their order and the
/// error (the first bad record in file order) are those of one thread.
///
/// Run it in a process whose allocator gives each thread its own arena:
/// the tokenizer allocates for every word, and threads sharing one malloc
/// arena wait on its lock (`glibc.malloc.arena_max=1` made 2 threads slower
/// than one, docs/benchmarks/2026-12-04-data-start.md).
pub fn tokenize_in_parallel(
    path: &Path,
    records: &[SourceRecord],
    tokenizer: Option<&TextTokenizer>,
    config: &TokenizeConfig,
    threads: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<TokenizedDataset, DataError> {
    let total = records.len();
    let pool = thread_pool(path, threads)?;
    let mut parts = Vec::with_capacity(total.div_ceil(PROGRESS_EVERY));
    tokenize_waves(
        path,
        records,
        (tokenizer, config),
        &pool,
        &mut |wave, done| {
            parts.extend(wave);
            progress(done, total);
            Ok(())
        },
    )?;
    let mut dataset = finish_parts(path, parts, config)?;
    dataset.unused_fields = unused_text_fields(records);
    Ok(dataset)
}

/// A pool of `threads` threads to tokenize on.
pub(crate) fn thread_pool(path: &Path, threads: usize) -> Result<rayon::ThreadPool, DataError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("tokenize-{i}"))
        .build()
        .map_err(|err| DataError::File {
            path: path.to_owned(),
            message: format!("no threads to tokenize on: {err}"),
            hint: "run with fewer threads (RAYON_NUM_THREADS=1)".into(),
        })
}

/// Tokenizes `records` in chunks of [`PROGRESS_EVERY`] on `pool`, a wave
/// of as many chunks as it has threads at a time; `each` gets every wave's
/// parts in file order and the records done. The first bad record in file
/// order is the error.
pub(crate) fn tokenize_waves(
    path: &Path,
    records: &[SourceRecord],
    (tokenizer, config): (Option<&TextTokenizer>, &TokenizeConfig),
    pool: &rayon::ThreadPool,
    each: &mut dyn FnMut(Vec<TokenizedPart>, usize) -> Result<(), DataError>,
) -> Result<(), DataError> {
    use rayon::prelude::*;
    let mut done = 0;
    for wave in records.chunks(PROGRESS_EVERY * pool.current_num_threads()) {
        let results: Vec<Result<TokenizedPart, DataError>> = pool.install(|| {
            wave.par_chunks(PROGRESS_EVERY)
                .map(|chunk| tokenize_part_with(path, chunk, tokenizer, config, &mut |_| {}))
                .collect()
        });
        let parts = results.into_iter().collect::<Result<Vec<_>, _>>()?;
        done += wave.len();
        each(parts, done)?;
    }
    Ok(())
}

/// The examples of some of a file's records (a rank's share), before the
/// whole set is known ([`tokenize_part_with`]): [`finish_parts`] joins the
/// parts in file order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizedPart {
    /// One per kept record, in file order.
    pub examples: Vec<Example>,
    /// The record location of every example.
    pub locations: Vec<String>,
    /// Its records, and what was cut and dropped (the counts only).
    pub report: DataReport,
    /// Examples dropped for having one token: nothing precedes it to
    /// predict it from.
    pub single_tokens: usize,
}

impl TokenizedPart {
    /// Adds `next`, the part after this one in file order.
    pub fn append(&mut self, next: TokenizedPart) {
        self.examples.extend(next.examples);
        self.locations.extend(next.locations);
        self.report.add_counts(&next.report);
        self.single_tokens += next.single_tokens;
    }
}

/// Records between two calls of a progress hook.
pub const PROGRESS_EVERY: usize = 1024;

/// Tokenizes `records`, a part of the file at `path` (all of it, or a
/// rank's share); the first bad record in file order is the error.
/// `progress` hears the records done every [`PROGRESS_EVERY`] records and
/// once at the end.
pub fn tokenize_part_with(
    path: &Path,
    records: &[SourceRecord],
    tokenizer: Option<&TextTokenizer>,
    config: &TokenizeConfig,
    progress: &mut dyn FnMut(usize),
) -> Result<TokenizedPart, DataError> {
    let mut report = DataReport {
        records: records.len(),
        max_seq_len: config.max_seq_len,
        ..DataReport::default()
    };
    let mut examples = Vec::with_capacity(records.len());
    let mut locations = Vec::with_capacity(records.len());
    let mut single_tokens = 0;
    for (done, source) in records.iter().enumerate() {
        if done % PROGRESS_EVERY == 0 && done > 0 {
            progress(done);
        }
        let fail = |message: String, hint: &str| DataError::Record {
            path: path.to_owned(),
            location: source.location.clone(),
            message,
            hint: hint.to_owned(),
        };
        let (mut input_ids, mut labels) = match &source.record {
            Record::Tokenized { input_ids, labels } => (
                input_ids.clone(),
                labels
                    .clone()
                    .unwrap_or_else(|| input_ids.iter().map(|&id| i64::from(id)).collect()),
            ),
            record => {
                let tokenizer = tokenizer.ok_or_else(|| {
                    fail(
                        "a text record needs a tokenizer".into(),
                        "give --tokenizer (or a --model that brings one)",
                    )
                })?;
                encode_text_record(record, tokenizer, config)
                    .map_err(|m| fail(m, "check the record and the tokenizer's chat template"))?
            }
        };
        if let Some((i, &id)) = input_ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= config.vocab_limit)
        {
            return Err(fail(
                format!(
                    "token id {id} at position {i} is outside the model's vocabulary of {}",
                    config.vocab_limit
                ),
                "the data was tokenized for another model; use its tokenizer and model together",
            ));
        }
        if let Some((i, &label)) = labels.iter().enumerate().find(|&(_, &label)| {
            label != IGNORE_INDEX && (label < 0 || label as usize >= config.vocab_limit)
        }) {
            return Err(fail(
                format!(
                    "`labels[{i}]` = {label} is neither -100 nor a token id below {}",
                    config.vocab_limit
                ),
                "labels are token ids or -100",
            ));
        }
        if input_ids.len() > config.max_seq_len {
            match config.overlong {
                Overlong::Drop => {
                    report.dropped_overlong += 1;
                    continue;
                }
                Overlong::Truncate => {
                    input_ids.truncate(config.max_seq_len);
                    labels.truncate(config.max_seq_len);
                    report.truncated += 1;
                }
            }
        }
        let example = Example::new(input_ids, labels)
            .map_err(|err| fail(err.to_string(), "check the record"))?;
        if example.num_loss_tokens() == 0 {
            report.dropped_no_labels += 1;
            single_tokens += usize::from(example.len() == 1);
            continue;
        }
        report.tokens += example.len();
        report.label_tokens += example.num_loss_tokens();
        examples.push(example);
        locations.push(source.location.clone());
    }
    progress(records.len());
    Ok(TokenizedPart {
        examples,
        locations,
        report,
        single_tokens,
    })
}

/// The data set of `parts`, in file order: their examples end to end, the
/// report over all of them (`unused_fields` left for the caller, which has
/// the records); refused when no example is left.
pub fn finish_parts(
    path: &Path,
    parts: Vec<TokenizedPart>,
    config: &TokenizeConfig,
) -> Result<TokenizedDataset, DataError> {
    let mut tally = Tally::default();
    let (mut examples, mut locations) = (Vec::new(), Vec::new());
    for part in parts {
        tally.add(&part);
        examples.extend(part.examples);
        locations.extend(part.locations);
    }
    let report = tally.finish(path, config)?;
    Ok(TokenizedDataset {
        source: path.to_owned(),
        examples,
        locations,
        report,
        unused_fields: Vec::new(),
    })
}

/// The counts of a data set's parts as they come (the examples themselves
/// may already be on disk): the report once all are in.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    report: DataReport,
    lengths: Vec<u32>,
    single_tokens: usize,
}

impl Tally {
    /// Counts `part`, the next in file order.
    pub(crate) fn add(&mut self, part: &TokenizedPart) {
        self.add_counts(&part.report, part.single_tokens);
        part.examples.iter().for_each(|e| self.add_length(e.len()));
    }

    /// Counts a part's report (its examples' lengths come one by one).
    pub(crate) fn add_counts(&mut self, more: &DataReport, single_tokens: usize) {
        self.report.add_counts(more);
        self.single_tokens += single_tokens;
    }

    /// Counts the length of an example kept.
    pub(crate) fn add_length(&mut self, len: usize) {
        self.lengths.push(u32::try_from(len).unwrap_or(u32::MAX));
    }

    /// The counts alone (records, tokens, cut and dropped; no lengths) and
    /// the examples dropped for having one token: a share's, for the join.
    pub(crate) fn into_counts(self) -> (DataReport, usize) {
        (self.report, self.single_tokens)
    }

    /// The report over every part; refused when no example is left.
    pub(crate) fn finish(
        mut self,
        path: &Path,
        config: &TokenizeConfig,
    ) -> Result<DataReport, DataError> {
        let mut report = self.report;
        report.max_seq_len = config.max_seq_len;
        if self.lengths.is_empty() {
            return Err(DataError::File {
                path: path.to_owned(),
                message: format!("no example left after tokenization ({report})"),
                hint: if report.dropped_overlong > 0 {
                    "raise --max-seq-len, or keep the first --max-seq-len tokens of longer examples with --overlong truncate".to_owned()
                } else if self.single_tokens == report.dropped_no_labels {
                    "every example is a single token: a token is learned from the ones before it, so the first token of an example never carries loss and an example needs at least 2 tokens; join short records or give longer ones".to_owned()
                } else if report.truncated > 0 {
                    format!(
                        "cut to --max-seq-len {} tokens, no example keeps a token with loss (prompts are longer than that?): raise --max-seq-len",
                        config.max_seq_len
                    )
                } else if config.train_on_inputs {
                    "no record has a token to learn from (every label is -100): check the labels of pre-tokenized records".to_owned()
                } else {
                    "no record has a token to learn from (every label is -100): check that the completion field is not empty, or pass --train-on-inputs".to_owned()
                },
            });
        }
        let lengths = &mut self.lengths;
        lengths.sort_unstable();
        report.examples = lengths.len();
        report.min_len = lengths[0] as usize;
        report.median_len = lengths[lengths.len() / 2] as usize;
        report.max_len = lengths[lengths.len() - 1] as usize;
        Ok(report)
    }
}

const ALPACA_WITH_INPUT: &str = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
const ALPACA_NO_INPUT: &str = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";

/// The prompt and response of a text record, before tokenization.
struct Rendered {
    prompt: String,
    response: String,
    /// Whether the prompt still needs the tokenizer's special tokens (BOS);
    /// chat templates write their own.
    prompt_needs_special_tokens: bool,
}

fn render(record: &Record, tokenizer: &TextTokenizer, as_chat: bool) -> Result<Rendered, String> {
    let (user, response) = match record {
        Record::Chat { messages } => return render_chat(messages, tokenizer),
        Record::PromptCompletion { prompt, completion } => (prompt.clone(), completion.clone()),
        Record::QuestionAnswer { question, answer } if !as_chat => {
            return Ok(plain(format!("Question: {question}\nAnswer: "), answer));
        }
        Record::QuestionAnswer { question, answer } => (question.clone(), answer.clone()),
        Record::Alpaca {
            instruction,
            input,
            output,
        } if !as_chat => {
            let prompt = if input.trim().is_empty() {
                ALPACA_NO_INPUT.replace("{instruction}", instruction)
            } else {
                ALPACA_WITH_INPUT
                    .replace("{instruction}", instruction)
                    .replace("{input}", input)
            };
            return Ok(plain(prompt, output));
        }
        Record::Alpaca {
            instruction,
            input,
            output,
        } => {
            let user = if input.trim().is_empty() {
                instruction.clone()
            } else {
                format!("{instruction}\n\n{input}")
            };
            (user, output.clone())
        }
        // Raw text stays raw under a chat template: BOS, the text, EOS.
        Record::Text { text } => return Ok(plain(String::new(), text)),
        Record::Tokenized { .. } => return Err("a pre-tokenized record has no text".into()),
    };
    if !as_chat {
        return Ok(plain(user, &response));
    }
    let messages = [
        Message {
            role: "user".into(),
            content: user,
        },
        Message {
            role: "assistant".into(),
            content: response,
        },
    ];
    render_chat(&messages, tokenizer)
}

fn plain(prompt: String, response: &str) -> Rendered {
    Rendered {
        prompt,
        response: response.to_owned(),
        prompt_needs_special_tokens: true,
    }
}

/// Splits a rendered conversation at the start of the final assistant turn.
fn render_chat(messages: &[Message], tokenizer: &TextTokenizer) -> Result<Rendered, String> {
    let template = &tokenizer.chat_template;
    let full = template.render(messages, false)?;
    let prompt = template.render(&messages[..messages.len() - 1], true)?;
    let response = full.strip_prefix(&prompt).ok_or_else(|| {
        "the chat template does not render the conversation as its prompt followed by the final answer, so the response cannot be told apart".to_owned()
    })?;
    Ok(Rendered {
        response: response.to_owned(),
        prompt,
        prompt_needs_special_tokens: false,
    })
}

/// Prompt and response are tokenized apart, so the boundary is exact even
/// where a BPE merge would cross it; EOS ends every example.
fn encode_text_record(
    record: &Record,
    tokenizer: &TextTokenizer,
    config: &TokenizeConfig,
) -> Result<(Vec<u32>, Vec<i64>), String> {
    let rendered = render(record, tokenizer, config.use_chat_template)?;
    let prompt_ids = tokenizer.encode(&rendered.prompt, rendered.prompt_needs_special_tokens)?;
    let mut response_ids = tokenizer.encode(&rendered.response, false)?;
    if response_ids.last() != Some(&tokenizer.eos_id) {
        response_ids.push(tokenizer.eos_id);
    }
    let prompt_label = |id: u32| {
        if config.train_on_inputs {
            i64::from(id)
        } else {
            IGNORE_INDEX
        }
    };
    let labels = prompt_ids
        .iter()
        .map(|&id| prompt_label(id))
        .chain(response_ids.iter().map(|&id| i64::from(id)))
        .collect();
    let mut input_ids = prompt_ids;
    input_ids.extend(response_ids);
    Ok((input_ids, labels))
}
