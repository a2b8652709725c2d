//! Records a chunk at a time, so a cold start holds one chunk of records
//! (and the examples of none: they go to the cache entry as they are made).
//!
//! JSONL is read a line at a time; Parquet and Arrow a row group or record
//! batch at a time (`columnar.rs`). A JSON array file is one JSON value: it
//! is read whole, then handed out in chunks.

use std::io::{BufRead, Read};
use std::ops::Range;
use std::path::Path;

use crate::error::DataError;
use crate::records::{
    FieldNames, JsonRecords, MAX_RECORD_BYTES, SourceRecord, first_byte, jsonl_record,
    read_records, record_error,
};

/// How far through the data a chunk reached.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadProgress {
    /// Records read so far.
    pub records: usize,
    /// The fraction of the data read (of its bytes for JSONL, of its files
    /// for a directory of Parquet or Arrow files, of the chunks of a JSON
    /// array; 0 until the end for a single Parquet or Arrow file), for an
    /// estimate of the time left.
    pub fraction: f64,
}

/// Reads the records of `path` as [`crate::read_records`] does, handing
/// them to `each` in file order, at most `chunk` at a time; the number of
/// records. Errors (a bad record, no record at all) are
/// [`crate::read_records`]'s.
pub fn for_each_record_chunk(
    path: &Path,
    fields: &FieldNames,
    chunk: usize,
    each: &mut dyn FnMut(Vec<SourceRecord>, ReadProgress) -> Result<(), DataError>,
) -> Result<usize, DataError> {
    for_each_record_chunk_in(path, fields, 0..usize::MAX, chunk, each)
}

/// [`for_each_record_chunk`] for the records numbered `range` (0-based, in
/// file order; an MPI rank's share): the number handed to `each`, fewer
/// than the range when the file ends first. Records before the range are
/// passed over: a JSONL line unparsed (whether it is a record is all that
/// is looked at, as [`count_records`] does), a Parquet or Arrow row
/// converted but not checked; the reading stops at the range's end. A bad
/// record outside the range is not this call's error.
pub fn for_each_record_chunk_in(
    path: &Path,
    fields: &FieldNames,
    range: Range<usize>,
    chunk: usize,
    each: &mut dyn FnMut(Vec<SourceRecord>, ReadProgress) -> Result<(), DataError>,
) -> Result<usize, DataError> {
    let chunk = chunk.max(1);
    if let Some(files) = crate::columnar::columnar_files(path)? {
        // The fraction is of the files read: 0 until the end for one file.
        let count = files.paths().len();
        let several = count > 1;
        let mut records = JsonRecords::new(path, fields);
        let (mut done, mut file_at, mut last) = (0, 0usize, None::<String>);
        let mut index = 0usize;
        crate::columnar::read_rows(path, &files, &mut |location, value| {
            // In a directory, a row's location starts with its file's name.
            let name = location.split(", ").next().map(str::to_owned);
            if several && last.is_some() && name != last {
                file_at += 1;
            }
            last = name;
            index += 1;
            if !range.contains(&(index - 1)) {
                return Ok(index < range.end);
            }
            records.push_value(location, value)?;
            if records.pending() == chunk {
                done += chunk;
                let fraction = (file_at as f64 / count as f64).min(1.0);
                each(
                    records.take(),
                    ReadProgress {
                        records: done,
                        fraction,
                    },
                )?;
            }
            Ok(index < range.end)
        })?;
        let rest = records.pending();
        let rest_records = records.take();
        if index == 0 && !range.is_empty() {
            return records.finish().map(|_| 0);
        }
        if rest > 0 {
            done += rest;
            each(
                rest_records,
                ReadProgress {
                    records: done,
                    fraction: 1.0,
                },
            )?;
        }
        return Ok(done);
    }
    if starts_array(path)? {
        let records = read_records(path, fields)?;
        let count = range.end.min(records.len()).saturating_sub(range.start);
        let chunks = count.div_ceil(chunk);
        let mut records = records.into_iter().skip(range.start).take(count);
        for at in 0..chunks {
            let part: Vec<SourceRecord> = records.by_ref().take(chunk).collect();
            let progress = ReadProgress {
                records: ((at + 1) * chunk).min(count),
                fraction: (at + 1) as f64 / chunks as f64,
            };
            each(part, progress)?;
        }
        return Ok(count);
    }
    let (mut seen, mut part) = (Vec::new(), Vec::with_capacity(chunk));
    let mut done = 0usize;
    // Records met so far, in the range or not.
    let mut index = 0usize;
    let mut lines = JsonlLines::open(path)?;
    while index < range.end {
        let Some((number, text)) = lines.next_line()? else {
            break;
        };
        if index < range.start {
            index += usize::from(is_record_line(text));
            continue;
        }
        if let Some(record) = jsonl_record(path, number, text, fields, &mut seen)? {
            part.push(record);
            index += 1;
        }
        if part.len() == chunk {
            done += chunk;
            let progress = ReadProgress {
                records: done,
                fraction: lines.fraction(),
            };
            each(
                std::mem::replace(&mut part, Vec::with_capacity(chunk)),
                progress,
            )?;
        }
    }
    if index == 0 && !range.is_empty() {
        return Err(DataError::File {
            path: path.to_owned(),
            message: "the file holds no records".into(),
            hint: "give a JSONL file (one JSON object per line) or a JSON array of objects".into(),
        });
    }
    if !part.is_empty() {
        done += part.len();
        each(
            part,
            ReadProgress {
                records: done,
                fraction: 1.0,
            },
        )?;
    }
    Ok(done)
}

/// Whether a JSONL line (without its line break) is a record, good or
/// bad, rather than blank: what [`jsonl_record`] decides before parsing.
fn is_record_line(line: &[u8]) -> bool {
    std::str::from_utf8(line).map_or(true, |text| !text.trim().is_empty())
}

/// How many records `path` holds, as [`for_each_record_chunk`] would hand
/// out, without reading them where that can be done: a JSONL file's lines
/// are looked at as [`for_each_record_chunk_in`] passes them over, a
/// Parquet file's row count is in its metadata, an Arrow file's batches
/// are counted undecoded; a JSON array is parsed whole. What ranks cut
/// their shares from; a bad record is found by the share that holds it.
pub fn count_records(path: &Path, fields: &FieldNames) -> Result<usize, DataError> {
    if let Some(files) = crate::columnar::columnar_files(path)? {
        return crate::columnar::count_rows(&files);
    }
    if starts_array(path)? {
        return Ok(read_records(path, fields)?.len());
    }
    let (mut lines, mut count) = (JsonlLines::open(path)?, 0usize);
    while let Some((_, text)) = lines.next_line()? {
        count += usize::from(is_record_line(text));
    }
    Ok(count)
}

/// A JSONL file read a line at a time, each line without its line break
/// (the first without a byte-order mark). A line longer than
/// [`MAX_RECORD_BYTES`] is refused by its number as soon as it is seen, so
/// a file without line breaks (`/dev/zero`, a binary file) cannot grow
/// memory without bound.
struct JsonlLines<'a> {
    path: &'a Path,
    reader: std::io::BufReader<std::fs::File>,
    line: Vec<u8>,
    /// The last line's number, from 1.
    number: usize,
    /// Bytes read so far, and the file's size (at least 1).
    read: u64,
    total: u64,
}

impl<'a> JsonlLines<'a> {
    fn open(path: &'a Path) -> Result<Self, DataError> {
        let file = std::fs::File::open(path).map_err(|err| io_error(path, err))?;
        let total = file.metadata().map_err(|err| io_error(path, err))?.len();
        Ok(Self {
            path,
            reader: std::io::BufReader::with_capacity(1 << 20, file),
            line: Vec::new(),
            number: 0,
            read: 0,
            total: total.max(1),
        })
    }

    /// The next line and its number, or `None` at the end of the file.
    fn next_line(&mut self) -> Result<Option<(usize, &[u8])>, DataError> {
        self.line.clear();
        let got = (&mut self.reader)
            .take(MAX_RECORD_BYTES as u64 + 1)
            .read_until(b'\n', &mut self.line)
            .map_err(|err| io_error(self.path, err))?;
        if got == 0 {
            return Ok(None);
        }
        self.number += 1;
        self.read += got as u64;
        let mut text: &[u8] = &self.line;
        text = text.strip_suffix(b"\n").unwrap_or(text);
        if text.len() > MAX_RECORD_BYTES {
            return Err(record_error(
                self.path,
                &format!("line {}", self.number),
                format!(
                    "longer than {} MiB without a line break",
                    MAX_RECORD_BYTES >> 20
                ),
                "give a JSONL file (one JSON object per line) or a JSON array; this does not look like either",
            ));
        }
        if self.number == 1 {
            text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
        }
        Ok(Some((self.number, text)))
    }

    /// The fraction of the file's bytes read.
    fn fraction(&self) -> f64 {
        self.read as f64 / self.total as f64
    }
}

fn io_error(path: &Path, err: std::io::Error) -> DataError {
    DataError::Io {
        path: path.to_owned(),
        err,
        hint: "give an existing, readable JSONL or JSON file",
    }
}

/// Whether the file's first non-blank character (past a byte-order mark
/// and however much leading whitespace) is `[`: a JSON array.
fn starts_array(path: &Path) -> Result<bool, DataError> {
    let io = |err| io_error(path, err);
    let mut reader = std::io::BufReader::new(std::fs::File::open(path).map_err(io)?);
    let mut first = true;
    loop {
        let buffer = reader.fill_buf().map_err(io)?;
        if buffer.is_empty() {
            return Ok(false);
        }
        let mut bytes = buffer;
        if first {
            bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
            first = false;
        }
        if let Some(byte) = first_byte(bytes) {
            return Ok(byte == b'[');
        }
        let used = buffer.len();
        reader.consume(used);
    }
}
