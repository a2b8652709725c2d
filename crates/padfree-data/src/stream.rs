//! Records a chunk at a time, so a cold start holds one chunk of records
//! (and the examples of none: they go to the cache entry as they are made).
//!
//! JSONL is read a line at a time; Parquet and Arrow a row group or record
//! batch at a time (`columnar.rs`). A JSON array file is one JSON value: it
//! is read whole, then handed out in chunks.

use std::io::{BufRead, Read};
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
    let chunk = chunk.max(1);
    if let Some(files) = crate::columnar::columnar_files(path)? {
        // The fraction is of the files read: 0 until the end for one file.
        let count = files.paths().len();
        let several = count > 1;
        let mut records = JsonRecords::new(path, fields);
        let (mut done, mut file_at, mut last) = (0, 0usize, None::<String>);
        crate::columnar::read_rows(path, &files, &mut |location, value| {
            // In a directory, a row's location starts with its file's name.
            let name = location.split(", ").next().map(str::to_owned);
            if several && last.is_some() && name != last {
                file_at += 1;
            }
            last = name;
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
            Ok(true)
        })?;
        let rest = records.pending();
        let rest_records = records.take();
        if done + rest == 0 {
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
    let io = |err| DataError::Io {
        path: path.to_owned(),
        err,
        hint: "give an existing, readable JSONL or JSON file",
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let total = file.metadata().map_err(io)?.len().max(1);
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    if starts_array(path)? {
        let records = read_records(path, fields)?;
        let count = records.len();
        let chunks = count.div_ceil(chunk);
        let mut records = records.into_iter();
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
    let (mut number, mut done, mut read) = (0usize, 0usize, 0u64);
    let mut line = Vec::new();
    loop {
        line.clear();
        let got = (&mut reader)
            .take(MAX_RECORD_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(io)?;
        if got == 0 {
            break;
        }
        number += 1;
        read += got as u64;
        if line.len() - usize::from(line.ends_with(b"\n")) > MAX_RECORD_BYTES {
            return Err(record_error(
                path,
                &format!("line {number}"),
                format!(
                    "longer than {} MiB without a line break",
                    MAX_RECORD_BYTES >> 20
                ),
                "give a JSONL file (one JSON object per line) or a JSON array; this does not look like either",
            ));
        }
        let mut text: &[u8] = &line;
        if number == 1 {
            text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
        }
        let text = text.strip_suffix(b"\n").unwrap_or(text);
        if let Some(record) = jsonl_record(path, number, text, fields, &mut seen)? {
            part.push(record);
        }
        if part.len() == chunk {
            done += chunk;
            let progress = ReadProgress {
                records: done,
                fraction: read as f64 / total as f64,
            };
            each(
                std::mem::replace(&mut part, Vec::with_capacity(chunk)),
                progress,
            )?;
        }
    }
    if done + part.len() == 0 {
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

/// Whether the file's first non-blank character (past a byte-order mark
/// and however much leading whitespace) is `[`: a JSON array.
fn starts_array(path: &Path) -> Result<bool, DataError> {
    let io = |err| DataError::Io {
        path: path.to_owned(),
        err,
        hint: "give an existing, readable JSONL or JSON file",
    };
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
