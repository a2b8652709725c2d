//! Columnar data in: a Parquet file, a directory of Parquet shards (the HF
//! hub's `data/train-00000-of-00002.parquet` layout), or an HF `datasets`
//! directory written by `save_to_disk` (Arrow IPC files listed in
//! `state.json`). Each row becomes the JSON object of its columns
//! (a null column is left out), read as a JSONL line is read:
//! the same record shapes and `--*-field` names. A batch of rows at a time,
//! so no file is held whole beside its records.
//!
//! Locations name the file (for a directory), the row group or record
//! batch, and the row in it (0-based, as Parquet and Arrow count).

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use arrow_schema::{ArrowError, DataType};
use serde_json::Value;

use crate::error::DataError;

/// The columnar files of a data path, in the order their rows are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ColumnarFiles {
    /// Parquet files.
    Parquet(Vec<PathBuf>),
    /// Arrow IPC files (stream or file format).
    Arrow(Vec<PathBuf>),
}

impl ColumnarFiles {
    /// The files.
    pub(crate) fn paths(&self) -> &[PathBuf] {
        match self {
            Self::Parquet(files) | Self::Arrow(files) => files,
        }
    }
}

const HINT: &str = "give a JSONL or JSON file, a .parquet file, a directory of .parquet shards, or an HF datasets directory (save_to_disk)";

/// What `path` holds when it is columnar; `None` for a JSONL/JSON file.
pub(crate) fn columnar_files(path: &Path) -> Result<Option<ColumnarFiles>, DataError> {
    let io = |err| DataError::Io {
        path: path.to_owned(),
        err,
        hint: HINT,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_dir() {
        return Ok(match extension(path) {
            Some("parquet") => Some(ColumnarFiles::Parquet(vec![path.to_owned()])),
            Some("arrow") => Some(ColumnarFiles::Arrow(vec![path.to_owned()])),
            _ => None,
        });
    }
    // An HF `datasets` directory: its Arrow files in `state.json`'s order.
    let state = path.join("state.json");
    if state.is_file() {
        let text = std::fs::read_to_string(&state).map_err(|err| DataError::Io {
            path: state.clone(),
            err,
            hint: HINT,
        })?;
        let names = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|state| {
                state["_data_files"].as_array().map(|files| {
                    files
                        .iter()
                        .filter_map(|f| f["filename"].as_str().map(|n| path.join(n)))
                        .collect::<Vec<_>>()
                })
            });
        return match names {
            Some(files) if !files.is_empty() => Ok(Some(ColumnarFiles::Arrow(files))),
            _ => Err(DataError::File {
                path: state,
                message: "lists no data files (`_data_files`)".into(),
                hint: "give the directory datasets' save_to_disk wrote, unchanged".into(),
            }),
        };
    }
    let mut found = Vec::new();
    shards(path, &mut found).map_err(io)?;
    found.sort();
    let parquet: Vec<PathBuf> = found
        .iter()
        .filter(|f| extension(f) == Some("parquet"))
        .cloned()
        .collect();
    let arrow: Vec<PathBuf> = found
        .iter()
        .filter(|f| extension(f) == Some("arrow"))
        .cloned()
        .collect();
    match (parquet.is_empty(), arrow.is_empty()) {
        (false, true) => Ok(Some(ColumnarFiles::Parquet(parquet))),
        (true, false) => Ok(Some(ColumnarFiles::Arrow(arrow))),
        (false, false) => Err(DataError::File {
            path: path.to_owned(),
            message: "holds both .parquet and .arrow files".into(),
            hint: "give one format's directory".into(),
        }),
        (true, true) => Err(DataError::File {
            path: path.to_owned(),
            message: "a directory without .parquet or .arrow files".into(),
            hint: HINT.into(),
        }),
    }
}

fn extension(path: &Path) -> Option<&str> {
    path.extension().and_then(|e| e.to_str())
}

/// Every file under `dir` (the hub nests shards in `data/`), skipping
/// hidden entries (`.cache`, `.git`).
fn shards(dir: &Path, found: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            shards(&path, found)?;
        } else {
            found.push(path);
        }
    }
    Ok(())
}

/// Where each row goes: its location and its JSON object.
/// Takes a row's location and JSON object; `false` stops the reading.
pub(crate) type RowSink<'a> = dyn FnMut(String, Value) -> Result<bool, DataError> + 'a;

/// Reads every row of `files` (of the data path `path`) into `records`.
pub(crate) fn read_rows(
    path: &Path,
    files: &ColumnarFiles,
    records: &mut RowSink<'_>,
) -> Result<(), DataError> {
    let several = files.paths().len() > 1 || path.is_dir();
    for file in files.paths() {
        // In a directory, the location names the file.
        let prefix = if several {
            let name = file.strip_prefix(path).unwrap_or(file);
            format!("{}, ", name.display())
        } else {
            String::new()
        };
        let fail = |message: String, hint: &str| DataError::File {
            path: file.clone(),
            message,
            hint: hint.to_owned(),
        };
        let opened = open(file)?;
        match files {
            ColumnarFiles::Parquet(_) => {
                use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
                let builder = ParquetRecordBatchReaderBuilder::try_new(opened)
                    .map_err(|err| fail(format!("not a readable Parquet file: {err}"), HINT))?;
                let groups: Vec<usize> = builder
                    .metadata()
                    .row_groups()
                    .iter()
                    .map(|g| usize::try_from(g.num_rows()).unwrap_or(0))
                    .collect();
                let reader = builder
                    .build()
                    .map_err(|err| fail(format!("not a readable Parquet file: {err}"), HINT))?;
                let mut row = 0usize;
                for batch in reader {
                    let batch = batch.map_err(|err| {
                        fail(
                            format!("a row group could not be read: {err}"),
                            "padfree reads Snappy-compressed or uncompressed Parquet; re-save others with pyarrow's default (Snappy)",
                        )
                    })?;
                    let more = rows(path, &batch, records, |i| {
                        let (group, in_group) = group_of(&groups, row + i);
                        format!("{prefix}row group {group}, row {in_group}")
                    })?;
                    if !more {
                        return Ok(());
                    }
                    row += batch.num_rows();
                }
            }
            ColumnarFiles::Arrow(_) => {
                for (index, batch) in arrow_batches(opened, file)?.enumerate() {
                    let batch = batch.map_err(|err| {
                        fail(format!("a record batch could not be read: {err}"), HINT)
                    })?;
                    let more = rows(path, &batch, records, |i| {
                        format!("{prefix}record batch {index}, row {i}")
                    })?;
                    if !more {
                        return Ok(());
                    }
                }
            }
        }
    }
    Ok(())
}

fn open(file: &Path) -> Result<File, DataError> {
    File::open(file).map_err(|err| DataError::Io {
        path: file.to_owned(),
        err,
        hint: HINT,
    })
}

/// How many rows `files` hold: a Parquet file's from its metadata, an
/// Arrow file's from its batches (decoded, not converted to records).
pub(crate) fn count_rows(files: &ColumnarFiles) -> Result<usize, DataError> {
    let mut count = 0usize;
    for file in files.paths() {
        let fail = |message: String| DataError::File {
            path: file.clone(),
            message,
            hint: HINT.to_owned(),
        };
        let opened = open(file)?;
        match files {
            ColumnarFiles::Parquet(_) => {
                let builder =
                    parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(opened)
                        .map_err(|err| fail(format!("not a readable Parquet file: {err}")))?;
                let rows = builder.metadata().file_metadata().num_rows();
                count += usize::try_from(rows).unwrap_or(0);
            }
            ColumnarFiles::Arrow(_) => {
                for batch in arrow_batches(opened, file)? {
                    let batch = batch
                        .map_err(|err| fail(format!("a record batch could not be read: {err}")))?;
                    count += batch.num_rows();
                }
            }
        }
    }
    Ok(count)
}

type Batches = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>>>;

/// The record batches of an Arrow IPC file, in the stream format (what
/// `datasets` writes) or the file format.
fn arrow_batches(mut file: File, path: &Path) -> Result<Batches, DataError> {
    use std::io::{Read, Seek};
    let mut magic = [0u8; 6];
    // A file shorter than the magic is not the file format; the stream
    // reader then says what is wrong.
    let probed = file
        .read_exact(&mut magic)
        .and_then(|()| file.rewind())
        .or_else(|_| file.rewind());
    probed.map_err(|err| DataError::Io {
        path: path.to_owned(),
        err,
        hint: HINT,
    })?;
    let fail = |err: String| DataError::File {
        path: path.to_owned(),
        message: format!("not a readable Arrow IPC file: {err}"),
        hint: HINT.into(),
    };
    if &magic == b"ARROW1" {
        let reader = arrow_ipc::reader::FileReader::try_new(file, None)
            .map_err(|err| fail(err.to_string()))?;
        return Ok(Box::new(reader));
    }
    let reader = arrow_ipc::reader::StreamReader::try_new(std::io::BufReader::new(file), None)
        .map_err(|err| fail(err.to_string()))?;
    Ok(Box::new(reader))
}

/// Row group and row in it of row `row` of a file whose groups hold `groups` rows.
fn group_of(groups: &[usize], mut row: usize) -> (usize, usize) {
    for (group, &rows) in groups.iter().enumerate() {
        if row < rows {
            return (group, row);
        }
        row -= rows;
    }
    (groups.len(), row)
}

/// The rows of `batch` as JSON objects into `records`; `location(i)` names
/// row `i`. `false` when `records` stopped the reading.
fn rows(
    path: &Path,
    batch: &RecordBatch,
    records: &mut RowSink<'_>,
    location: impl Fn(usize) -> String,
) -> Result<bool, DataError> {
    let schema = batch.schema();
    for row in 0..batch.num_rows() {
        let mut object = serde_json::Map::new();
        for (field, column) in schema.fields().iter().zip(batch.columns()) {
            let value = json_value(column.as_ref(), row).map_err(|message| DataError::Record {
                path: path.to_owned(),
                location: location(row),
                message: format!("column `{}`: {message}", field.name()),
                hint: "padfree reads string, integer, float, boolean, list and struct columns"
                    .into(),
            })?;
            // A null column is no field, as a JSONL record leaves it out.
            if !value.is_null() {
                object.insert(field.name().clone(), value);
            }
        }
        if !records(location(row), Value::Object(object))? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Row `row` of `array` as JSON: strings, integers, floats, booleans, and
/// lists and structs of them (a struct's null fields left out).
fn json_value(array: &dyn Array, row: usize) -> Result<Value, String> {
    use arrow_array::types::{
        Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type,
        UInt32Type, UInt64Type,
    };
    if array.is_null(row) {
        return Ok(Value::Null);
    }
    let float = |v: f64| {
        serde_json::Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| format!("{v} is not a number JSON can hold"))
    };
    Ok(match array.data_type() {
        DataType::Utf8 => Value::from(array.as_string::<i32>().value(row)),
        DataType::LargeUtf8 => Value::from(array.as_string::<i64>().value(row)),
        DataType::Utf8View => Value::from(array.as_string_view().value(row)),
        DataType::Boolean => Value::from(array.as_boolean().value(row)),
        DataType::Int8 => Value::from(array.as_primitive::<Int8Type>().value(row)),
        DataType::Int16 => Value::from(array.as_primitive::<Int16Type>().value(row)),
        DataType::Int32 => Value::from(array.as_primitive::<Int32Type>().value(row)),
        DataType::Int64 => Value::from(array.as_primitive::<Int64Type>().value(row)),
        DataType::UInt8 => Value::from(array.as_primitive::<UInt8Type>().value(row)),
        DataType::UInt16 => Value::from(array.as_primitive::<UInt16Type>().value(row)),
        DataType::UInt32 => Value::from(array.as_primitive::<UInt32Type>().value(row)),
        DataType::UInt64 => Value::from(array.as_primitive::<UInt64Type>().value(row)),
        DataType::Float32 => float(f64::from(array.as_primitive::<Float32Type>().value(row)))?,
        DataType::Float64 => float(array.as_primitive::<Float64Type>().value(row))?,
        DataType::List(_) => list(array.as_list::<i32>().value(row).as_ref())?,
        DataType::LargeList(_) => list(array.as_list::<i64>().value(row).as_ref())?,
        DataType::Struct(fields) => {
            let parts = array.as_struct();
            let mut object = serde_json::Map::new();
            for (field, column) in fields.iter().zip(parts.columns()) {
                let value = json_value(column.as_ref(), row)?;
                if !value.is_null() {
                    object.insert(field.name().clone(), value);
                }
            }
            Value::Object(object)
        }
        other => return Err(format!("its type {other} is not read")),
    })
}

fn list(items: &dyn Array) -> Result<Value, String> {
    (0..items.len())
        .map(|i| json_value(items, i))
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}
