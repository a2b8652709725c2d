//! A cold start written to the cache as it is tokenized: the records read a
//! chunk at a time (`stream.rs`), each chunk tokenized on the cache's
//! threads and its examples appended to the new entry, so a cold start
//! holds one chunk of records and no examples.

use std::path::Path;

use super::entry::{CacheUse, EntryTail, EntryWriter, open_entry};
use super::key::{CacheKeyParts, cache_key};
use crate::error::DataError;
use crate::records::{UnusedField, merge_unused, unused_text_fields};
use crate::stream::{ReadProgress, for_each_record_chunk};
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
    let pool = thread_pool(path, threads)?;
    let mut tally = Tally::default();
    let mut unused: Vec<UnusedField> = Vec::new();
    let mut not_written = None;
    let read = for_each_record_chunk(path, parts.fields, chunk, &mut |records, read| {
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
                                path: entry.clone(),
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
    });
    if let Some(why) = not_written {
        return Ok(CacheUse::NotWritten(entry, why));
    }
    read?;
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
