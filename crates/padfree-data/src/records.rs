use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::error::DataError;
use crate::prompt_template::PromptTemplate;

/// One message of a chat record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// One training record, as read; not yet tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// `{prompt, completion}` (or the fields named by `--prompt-field`,
    /// `--completion-field`): the prompt text, then the completion.
    PromptCompletion {
        /// Context the model reads but, by default, is not trained on.
        prompt: String,
        /// The response the loss is on.
        completion: String,
    },
    /// `{question, answer}`, rendered `Question: {question}\nAnswer: {answer}`.
    QuestionAnswer {
        /// The question.
        question: String,
        /// The worked answer.
        answer: String,
    },
    /// Alpaca `{instruction, input?, output}`, rendered with the Alpaca prompt.
    Alpaca {
        /// The task.
        instruction: String,
        /// Optional context; empty when absent.
        input: String,
        /// The response.
        output: String,
    },
    /// `{messages: [{role, content}, ...]}` ending with an assistant turn.
    Chat {
        /// The conversation.
        messages: Vec<Message>,
    },
    /// `{text}` (or the field named by `--dataset-text-field`; TRL's
    /// `dataset_text_field`): raw text, the loss on every token (continued
    /// pre-training, raw corpora).
    Text {
        /// The text.
        text: String,
    },
    /// `{input_ids, labels?}`: used as is; labels default to the ids.
    Tokenized {
        /// Token ids.
        input_ids: Vec<u32>,
        /// Per-token labels (-100 = ignored), aligned with `input_ids`.
        labels: Option<Vec<i64>>,
    },
}

/// A record and where it came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceRecord {
    /// `line 7` (JSONL, 1-based) or `element 3` (JSON array, 0-based).
    pub location: String,
    /// The record.
    pub record: Record,
    /// Fields of the record that hold text (a string with a space in it)
    /// but that its shape does not use: what a run would silently not
    /// train on (ASDiv's `passage` beside `question` and `answer`).
    /// Pre-tokenized records name none (their text is in the ids).
    pub unused_text_fields: Vec<String>,
    /// The fields the record's shape reads, in its order (prompt fields,
    /// then the completion's), kept only on the first record of the file
    /// with each unused field (what [`UnusedField::beside`] reports),
    /// empty elsewhere so that a large file does not hold them per record.
    pub used_fields: Vec<String>,
}

/// A field that records hold text in but that is not trained on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UnusedField {
    /// Its name.
    pub name: String,
    /// How many records hold text in it.
    pub records: usize,
    /// Where the first of them is (`line 1`).
    pub first: String,
    /// The fields that first record's shape reads (prompt fields, then the
    /// completion's; `messages` or `text` for those shapes).
    pub beside: Vec<String>,
    /// Whether that record is prompt/completion (a template can take the
    /// field into its prompt).
    pub prompted: bool,
}

/// Every text field that some records hold but none is trained on, in the
/// order first met.
pub fn unused_text_fields(records: &[SourceRecord]) -> Vec<UnusedField> {
    let mut fields: Vec<UnusedField> = Vec::new();
    for record in records {
        for name in &record.unused_text_fields {
            match fields.iter_mut().find(|f| &f.name == name) {
                Some(field) => field.records += 1,
                None => fields.push(UnusedField {
                    name: name.clone(),
                    records: 1,
                    first: record.location.clone(),
                    beside: record.used_fields.clone(),
                    prompted: matches!(
                        record.record,
                        Record::PromptCompletion { .. }
                            | Record::QuestionAnswer { .. }
                            | Record::Alpaca { .. }
                    ),
                }),
            }
        }
    }
    fields
}

/// Adds the unused fields of later records (`more`, from
/// [`unused_text_fields`] over them) to those of the records before.
pub(crate) fn merge_unused(into: &mut Vec<UnusedField>, more: Vec<UnusedField>) {
    for field in more {
        match into.iter_mut().find(|f| f.name == field.name) {
            Some(known) => known.records += field.records,
            None => into.push(field),
        }
    }
}

/// Field names that override the automatic recognition of record shapes.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FieldNames {
    /// When set (with `completion`), every record is prompt/completion with these names.
    pub prompt: Option<String>,
    /// See `prompt`.
    pub completion: Option<String>,
    /// The chat field; `messages` when unset.
    pub messages: Option<String>,
    /// When set, every record is raw text in this field; unset, a record
    /// whose only known field is `text` is raw text.
    pub text: Option<String>,
    /// When set (with `completion`), every record is prompt/completion with
    /// the prompt made from this template: `{field}` stands for the
    /// record's field (a string or a number), `{{` and `}}` for braces,
    /// `\n` for a newline.
    pub prompt_template: Option<String>,
}

impl FieldNames {
    fn messages(&self) -> &str {
        self.messages.as_deref().unwrap_or("messages")
    }
}

/// Reads every record of a JSONL file or a JSON array file.
///
/// JSONL is one object per line (blank lines allowed); a file whose first
/// non-blank character is `[` is a JSON array of objects.
///
/// A JSONL line longer than [`MAX_RECORD_BYTES`] is refused as soon as it is
/// seen, so a file without line breaks (`/dev/zero`, a binary file) cannot
/// grow memory without bound.
///
/// A `.parquet` file, a directory of Parquet shards (the HF hub's layout) or
/// an HF `datasets` directory (`save_to_disk`: Arrow files and
/// `state.json`) is read row by row, each row as the JSON object of its
/// columns (`columnar.rs`).
pub fn read_records(path: &Path, fields: &FieldNames) -> Result<Vec<SourceRecord>, DataError> {
    if let Some(files) = crate::columnar::columnar_files(path)? {
        let mut records = JsonRecords::new(path, fields);
        crate::columnar::read_rows(path, &files, &mut |location, value| {
            records.push_value(location, value).map(|()| true)
        })?;
        return records.finish();
    }
    let bytes = read_bounded(path)?;
    read_records_from_bytes(path, &bytes, fields)
}

/// Whether any record of `path` is text (not pre-tokenized), which then
/// needs a tokenizer: the first record decides, and only when it is
/// pre-tokenized are all records read, so a text data set is not read
/// whole to find out.
pub fn holds_text_records(path: &Path, fields: &FieldNames) -> Result<bool, DataError> {
    let is_text = |record: &SourceRecord| !matches!(record.record, Record::Tokenized { .. });
    let first = if let Some(files) = crate::columnar::columnar_files(path)? {
        let mut records = JsonRecords::new(path, fields);
        crate::columnar::read_rows(path, &files, &mut |location, value| {
            records.push_value(location, value).map(|()| false)
        })?;
        records.records.into_iter().next()
    } else {
        first_jsonl_record(path, fields)?
    };
    match first {
        Some(record) if is_text(&record) => Ok(true),
        _ => Ok(read_records(path, fields)?.iter().any(is_text)),
    }
}

/// The first record of a JSONL file, read a line at a time; `None` for a
/// JSON array (read whole), a bad record or a file without one.
fn first_jsonl_record(path: &Path, fields: &FieldNames) -> Result<Option<SourceRecord>, DataError> {
    use std::io::{BufRead, Read};
    let io = |err| DataError::Io {
        path: path.to_owned(),
        err,
        hint: "give an existing, readable JSONL or JSON file",
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut lines = std::io::BufReader::new(file).take(MAX_RECORD_BYTES as u64);
    let mut line = Vec::new();
    while lines.read_until(b'\n', &mut line).map_err(io)? > 0 {
        let text = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&line);
        match first_byte(text) {
            None => line.clear(),
            Some(b'[') => return Ok(None),
            // A bad first record is left to `read_records`, whose error
            // names its line.
            Some(_) => {
                let records = read_records_from_bytes(path, text, fields).ok();
                return Ok(records.and_then(|records| records.into_iter().next()));
            }
        }
    }
    Ok(None)
}

/// Records read one JSON object at a time, in file order.
pub(crate) struct JsonRecords<'a> {
    path: &'a Path,
    fields: &'a FieldNames,
    records: Vec<SourceRecord>,
    seen: Vec<String>,
}

impl<'a> JsonRecords<'a> {
    pub(crate) fn new(path: &'a Path, fields: &'a FieldNames) -> Self {
        Self {
            path,
            fields,
            records: Vec::new(),
            seen: Vec::new(),
        }
    }

    /// The record of the JSON object `value` (a columnar row), found at
    /// `location`.
    pub(crate) fn push_value(&mut self, location: String, value: Value) -> Result<(), DataError> {
        let text = value.to_string();
        let read = record_from_value(value, &text, self.fields)
            .map_err(|(m, h)| record_error(self.path, &location, m, &h))?;
        self.records
            .push(source_record(location, read, &mut self.seen));
        Ok(())
    }

    /// The records pushed since the last call (the `seen` fields kept).
    pub(crate) fn take(&mut self) -> Vec<SourceRecord> {
        std::mem::take(&mut self.records)
    }

    /// Records pushed and not taken.
    pub(crate) fn pending(&self) -> usize {
        self.records.len()
    }

    /// Every record, refused when there is none.
    pub(crate) fn finish(self) -> Result<Vec<SourceRecord>, DataError> {
        if self.records.is_empty() {
            return Err(DataError::File {
                path: self.path.to_owned(),
                message: "the data holds no records".into(),
                hint: "give a file with at least one record".into(),
            });
        }
        Ok(self.records)
    }
}

/// The longest JSONL record read, in bytes (a JSON array file is not
/// bounded: it is one value).
pub const MAX_RECORD_BYTES: usize = 64 << 20;

fn read_bounded(path: &Path) -> Result<Vec<u8>, DataError> {
    use std::io::Read;
    let io = |err| DataError::Io {
        path: path.to_owned(),
        err,
        hint: "give an existing, readable JSONL or JSON file",
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    let mut chunk = vec![0u8; 1 << 20];
    let (mut line_start, mut line) = (0usize, 1usize);
    loop {
        let read = file.read(&mut chunk).map_err(io)?;
        if read == 0 {
            return Ok(bytes);
        }
        let offset = bytes.len();
        bytes.extend_from_slice(&chunk[..read]);
        if first_byte(&bytes) == Some(b'[') {
            continue;
        }
        for (i, _) in chunk[..read]
            .iter()
            .enumerate()
            .filter(|(_, b)| **b == b'\n')
        {
            line_start = offset + i + 1;
            line += 1;
        }
        if bytes.len() - line_start > MAX_RECORD_BYTES {
            return Err(record_error(
                path,
                &format!("line {line}"),
                format!(
                    "longer than {} MiB without a line break",
                    MAX_RECORD_BYTES >> 20
                ),
                "give a JSONL file (one JSON object per line) or a JSON array; this does not look like either",
            ));
        }
    }
}

/// The first byte after a byte-order mark and whitespace.
pub(crate) fn first_byte(bytes: &[u8]) -> Option<u8> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    bytes.iter().copied().find(|b| !b.is_ascii_whitespace())
}

/// [`read_records`] on text already in memory; `path` names it in errors.
pub fn read_records_from_str(
    path: &Path,
    text: &str,
    fields: &FieldNames,
) -> Result<Vec<SourceRecord>, DataError> {
    read_records_from_bytes(path, text.as_bytes(), fields)
}

fn read_records_from_bytes(
    path: &Path,
    bytes: &[u8],
    fields: &FieldNames,
) -> Result<Vec<SourceRecord>, DataError> {
    // A byte-order mark (Windows editors write one) is not part of the JSON.
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let records = match first_byte(bytes) {
        None => Vec::new(),
        Some(b'[') => read_json_array(path, bytes, fields)?,
        Some(_) => read_jsonl(path, bytes, fields)?,
    };
    if records.is_empty() {
        return Err(DataError::File {
            path: path.to_owned(),
            message: "the file holds no records".into(),
            hint: "give a JSONL file (one JSON object per line) or a JSON array of objects".into(),
        });
    }
    Ok(records)
}

fn read_jsonl(
    path: &Path,
    bytes: &[u8],
    fields: &FieldNames,
) -> Result<Vec<SourceRecord>, DataError> {
    let (mut records, mut seen) = (Vec::new(), Vec::new());
    for (index, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if let Some(record) = jsonl_record(path, index + 1, line, fields, &mut seen)? {
            records.push(record);
        }
    }
    Ok(records)
}

/// The record of JSONL line `number` (1-based; `None` when blank);
/// `seen` carries the unused fields already named from one line to the
/// next.
pub(crate) fn jsonl_record(
    path: &Path,
    number: usize,
    line: &[u8],
    fields: &FieldNames,
    seen: &mut Vec<String>,
) -> Result<Option<SourceRecord>, DataError> {
    let location = format!("line {number}");
    let fail = |message: String, hint: &str| record_error(path, &location, message, hint);
    let text = std::str::from_utf8(line).map_err(|err| {
        fail(
            format!(
                "not valid UTF-8 (byte {} of the line)",
                err.valid_up_to() + 1
            ),
            "re-encode the file as UTF-8",
        )
    })?;
    if text.trim().is_empty() {
        return Ok(None);
    }
    let value: Value = serde_json::from_str(text).map_err(|err| {
        fail(
            format!("not valid JSON: {err}"),
            "every line of a JSONL file must be one complete JSON object",
        )
    })?;
    let read = record_from_value(value, text, fields).map_err(|(m, h)| fail(m, &h))?;
    Ok(Some(source_record(location, read, seen)))
}

fn read_json_array(
    path: &Path,
    bytes: &[u8],
    fields: &FieldNames,
) -> Result<Vec<SourceRecord>, DataError> {
    let text = std::str::from_utf8(bytes).map_err(|err| {
        let line = bytes[..err.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1;
        record_error(
            path,
            &format!("line {line}"),
            "not valid UTF-8".into(),
            "re-encode the file as UTF-8",
        )
    })?;
    // Each element's own text is kept beside its value: a template renders
    // numbers as the file writes them (see `render_template`).
    let elements: Vec<&RawValue> = serde_json::from_str(text).map_err(|err| {
        record_error(
            path,
            &format!("line {}", err.line()),
            format!("not a valid JSON array: {err}"),
            "a .json dataset must be one array of objects; use JSONL for one object per line",
        )
    })?;
    let mut seen = Vec::new();
    elements
        .into_iter()
        .enumerate()
        .map(|(index, element)| {
            let location = format!("element {index}");
            let source = element.get();
            let value: Value = serde_json::from_str(source).map_err(|err| {
                record_error(
                    path,
                    &location,
                    format!("not valid JSON: {err}"),
                    "a .json dataset must be one array of objects",
                )
            })?;
            let read = record_from_value(value, source, fields)
                .map_err(|(m, h)| record_error(path, &location, m, &h))?;
            Ok(source_record(location, read, &mut seen))
        })
        .collect()
}

pub(crate) fn record_error(path: &Path, location: &str, message: String, hint: &str) -> DataError {
    DataError::Record {
        path: PathBuf::from(path),
        location: location.to_owned(),
        message,
        hint: hint.to_owned(),
    }
}

type Refusal = (String, String);

const SHAPES_HINT: &str = "records must be {prompt, completion}, {question, answer}, {instruction, input, output}, {messages: [{role, content}]}, {text} or {input_ids, labels}; name other fields with --prompt-field/--completion-field/--messages-field/--dataset-text-field, or build the prompt from several with --prompt-template";

/// The record, and the text fields it holds that its shape leaves unused;
/// `source` is the record's JSON text, as the file holds it.
fn record_from_value(
    value: Value,
    source: &str,
    fields: &FieldNames,
) -> Result<(Record, Vec<String>, Vec<String>), Refusal> {
    let Value::Object(object) = value else {
        return Err((
            format!("expected a JSON object, found {}", json_kind(&value)),
            SHAPES_HINT.into(),
        ));
    };
    let (record, used) = record_from_object(&object, source, fields)?;
    if matches!(record, Record::Tokenized { .. }) {
        return Ok((record, Vec::new(), Vec::new()));
    }
    let unused = object
        .iter()
        .filter(|(name, value)| {
            !used.contains(name)
                && matches!(value, Value::String(text) if text.trim().contains(char::is_whitespace))
        })
        .map(|(name, _)| name.clone())
        .collect();
    Ok((record, unused, used))
}

/// A record read from a file, `used` kept only where it brings an unused
/// field `seen` had not met (see [`SourceRecord::used_fields`]).
fn source_record(
    location: String,
    (record, unused, used): (Record, Vec<String>, Vec<String>),
    seen: &mut Vec<String>,
) -> SourceRecord {
    let new: Vec<String> = unused
        .iter()
        .filter(|name| !seen.contains(name))
        .cloned()
        .collect();
    let keep = !new.is_empty();
    seen.extend(new);
    SourceRecord {
        location,
        record,
        unused_text_fields: unused,
        used_fields: if keep { used } else { Vec::new() },
    }
}

/// The prompt `template` renders from the record `object` (whose JSON text
/// is `source`).
///
/// A number is rendered as `source` writes it: `0.50`, `1e2`, `-0` and a
/// 23-digit integer stay as they are, where the parsed value would print
/// `0.5`, `100.0`, `-0.0` and `1.2345678901234568e22`.
fn render_template(
    object: &Map<String, Value>,
    source: &str,
    template: &PromptTemplate,
) -> Result<String, Refusal> {
    // The top-level fields' texts, parsed once a number needs one.
    let mut raw: Option<HashMap<String, &RawValue>> = None;
    let out = template.render(|name| match object.get(name) {
        Some(Value::Number(number)) => {
            if raw.is_none() {
                raw = serde_json::from_str(source).ok();
            }
            // The value itself should the text not parse as a map (it
            // did parse as one moments ago).
            Ok(raw
                .as_ref()
                .and_then(|fields| fields.get(name))
                .map(|text| text.get().to_owned())
                .unwrap_or_else(|| number.to_string()))
        }
        _ => string_field(object, name).map_err(|(m, _)| {
            (
                format!("--prompt-template: {m}"),
                "every field the template names must be a string or a number in every record"
                    .to_owned(),
            )
        }),
    })?;
    if out.trim().is_empty() {
        return Err((
            "--prompt-template renders an empty prompt".into(),
            "remove the record or fill its fields".into(),
        ));
    }
    Ok(out)
}

/// The record `object` holds, and the names of the fields it was read from.
fn record_from_object(
    object: &Map<String, Value>,
    source: &str,
    fields: &FieldNames,
) -> Result<(Record, Vec<String>), Refusal> {
    let from = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>();
    if let (Some(template), Some(completion)) = (&fields.prompt_template, &fields.completion) {
        let template = PromptTemplate::parse(template)
            .map_err(|m| (format!("--prompt-template: {m}"), SHAPES_HINT.to_owned()))?;
        let mut read = template.fields();
        read.push(completion.clone());
        let record = Record::PromptCompletion {
            prompt: render_template(object, source, &template)?,
            completion: text_field(object, completion)?,
        };
        return Ok((record, read));
    }
    if let (Some(prompt), Some(completion)) = (&fields.prompt, &fields.completion) {
        let record = Record::PromptCompletion {
            prompt: text_field(object, prompt)?,
            completion: text_field(object, completion)?,
        };
        return Ok((record, from(&[prompt, completion])));
    }
    if let Some(field) = &fields.text {
        let record = Record::Text {
            text: text_field(object, field)?,
        };
        return Ok((record, from(&[field])));
    }
    let has = |name: &str| object.contains_key(name);
    if has("input_ids") {
        return Ok((tokenized_record(object)?, from(&["input_ids", "labels"])));
    }
    if has(fields.messages()) {
        let record = chat_record(object, fields.messages())?;
        return Ok((record, from(&[fields.messages()])));
    }
    if has("instruction") || has("output") {
        let input = match object.get("input") {
            None | Some(Value::Null) => String::new(),
            Some(_) => string_field(object, "input")?,
        };
        let record = Record::Alpaca {
            instruction: text_field(object, "instruction")?,
            input,
            output: text_field(object, "output")?,
        };
        return Ok((record, from(&["instruction", "input", "output"])));
    }
    if has("question") || has("answer") {
        let record = Record::QuestionAnswer {
            question: text_field(object, "question")?,
            answer: text_field(object, "answer")?,
        };
        return Ok((record, from(&["question", "answer"])));
    }
    if has("prompt") || has("completion") {
        let record = Record::PromptCompletion {
            prompt: text_field(object, "prompt")?,
            completion: text_field(object, "completion")?,
        };
        return Ok((record, from(&["prompt", "completion"])));
    }
    if has("text") {
        let record = Record::Text {
            text: text_field(object, "text")?,
        };
        return Ok((record, from(&["text"])));
    }
    let names: Vec<&str> = object.keys().map(String::as_str).collect();
    Err((
        format!(
            "no known record shape; the record has fields: {}",
            names.join(", ")
        ),
        SHAPES_HINT.into(),
    ))
}

fn string_field(object: &Map<String, Value>, name: &str) -> Result<String, Refusal> {
    match object.get(name) {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(other) => Err((
            format!(
                "field `{name}` must be a string, found {}",
                json_kind(other)
            ),
            "quote the value".into(),
        )),
        None => {
            let names: Vec<&str> = object.keys().map(String::as_str).collect();
            Err((
                format!(
                    "field `{name}` is missing (the record has fields: {})",
                    names.join(", ")
                ),
                SHAPES_HINT.into(),
            ))
        }
    }
}

/// A string field that must hold some text.
fn text_field(object: &Map<String, Value>, name: &str) -> Result<String, Refusal> {
    let text = string_field(object, name)?;
    if text.trim().is_empty() {
        return Err((
            format!("field `{name}` is empty"),
            "remove the record or fill the field".into(),
        ));
    }
    Ok(text)
}

fn chat_record(object: &Map<String, Value>, field: &str) -> Result<Record, Refusal> {
    let Some(Value::Array(items)) = object.get(field) else {
        return Err((
            format!("field `{field}` must be an array of {{role, content}} objects"),
            SHAPES_HINT.into(),
        ));
    };
    let mut messages = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let Value::Object(message) = item else {
            return Err((
                format!("`{field}[{index}]` must be an object with `role` and `content`"),
                SHAPES_HINT.into(),
            ));
        };
        let within = |(m, h): Refusal| (format!("`{field}[{index}]`: {m}"), h);
        let role = text_field(message, "role").map_err(within)?;
        if !matches!(role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err((
                format!("`{field}[{index}].role` is `{role}`"),
                "roles are system, user, assistant or tool".into(),
            ));
        }
        let content = string_field(message, "content").map_err(within)?;
        messages.push(Message { role, content });
    }
    match messages.last() {
        Some(last) if last.role == "assistant" && !last.content.trim().is_empty() => {
            Ok(Record::Chat { messages })
        }
        Some(_) => Err((
            format!("the last message of `{field}` must be a non-empty assistant turn"),
            "the loss is on the final assistant response; end every conversation with one".into(),
        )),
        None => Err((
            format!("field `{field}` is empty"),
            "remove the record or add messages".into(),
        )),
    }
}

fn tokenized_record(object: &Map<String, Value>) -> Result<Record, Refusal> {
    let input_ids: Vec<u32> = int_array(object, "input_ids")?
        .into_iter()
        .enumerate()
        .map(|(i, id)| {
            u32::try_from(id).map_err(|_| {
                (
                    format!("`input_ids[{i}]` is {id}; token ids are 0..2^32"),
                    "check the tokenization".to_owned(),
                )
            })
        })
        .collect::<Result<_, _>>()?;
    if input_ids.is_empty() {
        return Err((
            "field `input_ids` is empty".into(),
            "remove the record".into(),
        ));
    }
    let labels = match object.get("labels") {
        None | Some(Value::Null) => None,
        Some(_) => {
            let labels = int_array(object, "labels")?;
            if labels.len() != input_ids.len() {
                return Err((
                    format!(
                        "`labels` has {} entries for {} `input_ids`",
                        labels.len(),
                        input_ids.len()
                    ),
                    "labels are aligned with input_ids (-100 where there is no loss)".into(),
                ));
            }
            Some(labels)
        }
    };
    Ok(Record::Tokenized { input_ids, labels })
}

fn int_array(object: &Map<String, Value>, name: &str) -> Result<Vec<i64>, Refusal> {
    let Some(Value::Array(items)) = object.get(name) else {
        return Err((
            format!("field `{name}` must be an array of integers"),
            "pre-tokenized records are {input_ids: [..], labels: [..]}".into(),
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_i64().ok_or_else(|| {
                (
                    format!("`{name}[{i}]` is {}, not an integer", json_kind(item)),
                    "pre-tokenized records hold integers only".to_owned(),
                )
            })
        })
        .collect()
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
