//! A cold start written to the cache as it is tokenized: the records read a
//! chunk at a time (`stream.rs`), each chunk tokenized on the cache's
//! threads and its examples appended to the new entry, so a cold start
//! holds one chunk of records and no examples. An MPI rank's share is
//! built the same way from its range of the records.

use std::ops::Range;
use std::path::Path;

use super::entry::{CacheUse, EntryTail, EntryWriter, RecordError, open_entry, share, write_entry};
use super::key::{CacheKeyParts, cache_key};
use crate::error::DataError;
use crate::records::{UnusedField, merge_unused, unused_text_fields};
use crate::stream::ReadProgress;
use crate::tokenize::{Tally, thread_pool, tokenize_waves};

/// Records read and tokenized at a time: a few megabytes of text.
pub const CHUNK_RECORDS: usize = 16_384;

/// Builds the entry for the data file `path` and `parts` in `dir` from its
/// records, read `chunk` at a time and tokenized on `threads` threads;
/// nothing is held but one chunk of records and the examples' locations.
/// The entry is placed when whole. An entry already whole is left as it is
/// ([`CacheUse::Reused`]). `progress` hears how far the reading got after
/// every chunk.
pub(super) fn build_entry(
    (dir, threads): (&Path, usize),
    path: &Path,
    parts: &CacheKeyParts<'_>,
    chunk: usize,
    progress: &mut dyn FnMut(ReadProgress),
) -> Result<CacheUse, DataError> {
    let key = cache_key(parts)?;
    let entry = dir.join(&key);
    let rebuilt = match entry.exists().then(|| open_entry(&entry, &key)) {
        Some(Ok(_)) => return Ok(CacheUse::Reused(entry)),
        Some(Err(why)) => Some(why),
        None => None,
    };
    let mut writer = match EntryWriter::create(dir, &key) {
        Ok(writer) => writer,
        Err(why) => return Ok(CacheUse::NotWritten(entry, why)),
    };
    let streamed = stream_into(
        &mut writer,
        (path, parts, threads, chunk),
        0..usize::MAX,
        progress,
    );
    let (tally, unused) = match streamed {
        Ok(Streamed::Into(tally, unused, _)) => (tally, unused),
        Ok(Streamed::NotWritten(why)) => return Ok(CacheUse::NotWritten(entry, why)),
        Err(err) => return Err(err),
    };
    let tail = EntryTail {
        report: tally.finish(path, parts.config)?,
        single_tokens: 0,
        error: None,
        unused_fields: unused,
    };
    Ok(match (writer.finish(tail, path), rebuilt) {
        (Err(why), _) => CacheUse::NotWritten(entry, why),
        (Ok(()), Some(why)) => CacheUse::Rebuilt(entry, why),
        (Ok(()), None) => CacheUse::Built(entry),
    })
}

/// Builds the share entry `share_key` of `dir` from the records `range`
/// of `path` (an MPI rank's share, in file order), as [`build_entry`]
/// builds a whole one: streamed, nothing held. Its report keeps the counts
/// for the join; a bad record in the range (the first met) is kept in the
/// share instead of examples, for every rank to report. Gives why the
/// share could not be written.
pub(super) fn build_share(
    (dir, threads): (&Path, usize),
    path: &Path,
    parts: &CacheKeyParts<'_>,
    (range, share_key): (Range<usize>, &str),
    progress: &mut dyn FnMut(ReadProgress),
) -> Result<(), String> {
    let mut writer = EntryWriter::create(dir, share_key)?;
    let asked = range.clone();
    let streamed = stream_into(
        &mut writer,
        (path, parts, threads, CHUNK_RECORDS),
        range,
        progress,
    );
    match streamed {
        Ok(Streamed::Into(tally, unused, handed)) => {
            if handed != asked.len() {
                return Err(format!(
                    "{}: records {}..{} asked for, {handed} read",
                    path.display(),
                    asked.start,
                    asked.end
                ));
            }
            let (report, single_tokens) = tally.into_counts();
            let tail = EntryTail {
                report,
                single_tokens,
                error: None,
                unused_fields: unused,
            };
            writer.finish(tail, path)
        }
        Ok(Streamed::NotWritten(why)) => Err(why),
        Err(DataError::Record {
            location,
            message,
            hint,
            ..
        }) => {
            // The examples before the bad record are of no use: dropped.
            drop(writer);
            let error = Err(RecordError {
                location,
                message,
                hint,
            });
            write_entry(dir, share_key, &share(&error), path)
        }
        Err(other) => Err(other.to_string()),
    }
}

/// What [`stream_into`] did.
enum Streamed {
    /// Every record of the range went in: their counts, the unused text
    /// fields, and how many records.
    Into(Tally, Vec<UnusedField>, usize),
    /// The writer failed (why).
    NotWritten(String),
}

/// Reads the records `range` of `path` `chunk` at a time, tokenizes each
/// chunk on `threads` threads and appends its examples to `writer`.
fn stream_into(
    writer: &mut EntryWriter,
    (path, parts, threads, chunk): (&Path, &CacheKeyParts<'_>, usize, usize),
    range: Range<usize>,
    progress: &mut dyn FnMut(ReadProgress),
) -> Result<Streamed, DataError> {
    let pool = thread_pool(path, threads)?;
    let mut tally = Tally::default();
    let mut unused: Vec<UnusedField> = Vec::new();
    let mut not_written = None;
    let read = crate::stream::for_each_record_chunk_in(
        path,
        parts.fields,
        range,
        chunk,
        &mut |records, read| {
            merge_unused(&mut unused, unused_text_fields(&records));
            tokenize_waves(
                path,
                &records,
                (parts.tokenizer, parts.config),
                &pool,
                &mut |wave, _| {
                    for part in &wave {
                        tally.add(part);
                        writer
                            .append(&part.examples, &part.locations)
                            .map_err(|why| {
                                not_written = Some(why.clone());
                                DataError::File {
                                    path: path.to_owned(),
                                    message: why,
                                    hint: "the cache entry could not be written".into(),
                                }
                            })?;
                    }
                    Ok(())
                },
            )?;
            progress(read);
            Ok(())
        },
    );
    if let Some(why) = not_written {
        return Ok(Streamed::NotWritten(why));
    }
    Ok(Streamed::Into(tally, unused, read?))
}
