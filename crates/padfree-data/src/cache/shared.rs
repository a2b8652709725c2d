//! Ranks sharing a cold start: each tokenizes its share of the records
//! into a share entry, every rank joins the shares, rank 0 writes the whole
//! entry.

use std::path::Path;

use super::entry::{
    CacheUse, RecordError, join_shares, read_entry, share, share_error, whole, write_entry,
};
use super::key::{CacheKeyParts, cache_key};
use crate::error::DataError;
use crate::records::SourceRecord;
use crate::tokenize::{TokenizedDataset, TokenizedPart};

/// Writes a rank's share of the records (their range, in file order) into
/// the share entry named by the key given, in another process.
pub type ShareWriter<'a> = dyn Fn(std::ops::Range<usize>, &str) -> Result<(), String> + 'a;

/// Tokenizes `records`, a rank's share, on `threads` threads and writes
/// them into the share entry `share_key` of `dir`; a bad record is kept in
/// the share, for every rank to report.
pub(super) fn write_share(
    dir: &Path,
    path: &Path,
    records: &[SourceRecord],
    parts: &CacheKeyParts<'_>,
    share_key: &str,
    threads: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<(), String> {
    let pool = crate::tokenize::thread_pool(path, threads).map_err(|err| err.to_string())?;
    let mut joined: Option<TokenizedPart> = None;
    let tokenized = crate::tokenize::tokenize_waves(
        path,
        records,
        (parts.tokenizer, parts.config),
        &pool,
        &mut |wave, done| {
            for part in wave {
                match &mut joined {
                    None => joined = Some(part),
                    Some(all) => all.append(part),
                }
            }
            progress(done);
            Ok(())
        },
    );
    let part = match tokenized {
        Ok(()) => Ok(joined.unwrap_or_default()),
        // A bad record goes to the other ranks in the share; any other
        // error leaves every rank on its own.
        Err(DataError::Record {
            location,
            message,
            hint,
            ..
        }) => Err(RecordError {
            location,
            message,
            hint,
        }),
        Err(other) => return Err(other.to_string()),
    };
    write_entry(dir, share_key, &share(&part), path)
}

/// The ranks of a data-parallel job, as the cache needs them to share a
/// cold start (the trainer's communicator, seen from the data crate).
pub trait Ranks {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// How many ranks.
    fn world_size(&self) -> usize;
    /// Waits for every rank.
    fn barrier(&self) -> Result<(), String>;
    /// Whether `mine` holds on every rank.
    fn all(&self, mine: bool) -> Result<bool, String>;
}

/// A collective call among the ranks that failed.
fn collective_error(dir: &Path, err: String) -> DataError {
    DataError::File {
        path: dir.to_owned(),
        message: format!("the ranks could not share the data cache: {err}"),
        hint: "check that every rank runs, or pass --no-data-cache".into(),
    }
}

/// Ranks building a shared cold start without holding it: the `records`
/// of `path` (their count) cut into contiguous shares in file order, each
/// rank's share streamed into a share entry by `share_writer` (a helper on
/// the rank's cores) or by the rank on `threads` threads, then rank 0
/// joins the share entries file to file into the whole entry while the
/// others wait. `true` when the entry was placed (every rank then opens
/// it); `false` when the ranks could not share (then [`tokenize_shared`]).
/// A bad record is every rank's error, the first in file order.
pub(super) fn build_shared(
    (dir, threads): (&Path, usize),
    path: &Path,
    records: usize,
    parts: &CacheKeyParts<'_>,
    (ranks, share_writer): (&dyn Ranks, Option<&ShareWriter<'_>>),
) -> Result<bool, DataError> {
    let collective = |err: String| collective_error(dir, err);
    let (world, rank) = (ranks.world_size(), ranks.rank());
    let key = cache_key(parts)?;
    let range = |r: usize| records * r / world..records * (r + 1) / world;
    let share_keys: Vec<String> = (0..world)
        .map(|r| format!("{key}-share-{r}-of-{world}"))
        .collect();
    let wrote = share_writer.is_some_and(|write| write(range(rank), &share_keys[rank]).is_ok())
        || super::build::build_share(
            (dir, threads),
            path,
            parts,
            (range(rank), &share_keys[rank]),
            &mut |_| {},
        )
        .is_ok();
    ranks.barrier().map_err(collective)?;
    // Every share's bad record, read by every rank: the same error on all.
    let errors: Result<Vec<Option<RecordError>>, String> = share_keys
        .iter()
        .map(|share| share_error(&dir.join(share), share))
        .collect();
    let shared = ranks.all(wrote && errors.is_ok()).map_err(collective)?;
    let remove_mine = || {
        let _ = std::fs::remove_dir_all(dir.join(&share_keys[rank]));
    };
    if !shared {
        ranks.barrier().map_err(collective)?;
        remove_mine();
        return Ok(false);
    }
    if let Some(error) = errors.ok().into_iter().flatten().flatten().next() {
        ranks.barrier().map_err(collective)?;
        remove_mine();
        return Err(DataError::Record {
            path: path.to_owned(),
            location: error.location,
            message: error.message,
            hint: error.hint,
        });
    }
    let joined = if rank == 0 {
        join_shares(dir, &key, &share_keys, (path, parts.config))
    } else {
        Ok(Ok(()))
    };
    // Waits for rank 0's join: no share is removed while it reads them.
    let placed = ranks
        .all(matches!(joined, Ok(Ok(()))))
        .map_err(collective)?;
    remove_mine();
    // A data set with no example left: rank 0's error, which ends the job.
    let _written_or_why = joined?;
    Ok(placed)
}

/// `DataCache::tokenize` (`alone`) as one of several ranks that see this cache
/// directory: an entry every rank can read is read; else each rank
/// tokenizes its share of the records (contiguous, in file order) into
/// a share entry, every rank joins the shares, and rank 0 writes the
/// whole entry; each rank removes its share. A bad record is every rank's
/// error (the first in file order). Ranks that do not see one
/// another's shares (no shared directory) each tokenize everything.
pub(super) fn tokenize_shared(
    dir: &Path,
    path: &Path,
    records: &[SourceRecord],
    parts: &CacheKeyParts<'_>,
    (ranks, share_writer): (&dyn Ranks, Option<&ShareWriter<'_>>),
    progress: &mut dyn FnMut(usize, usize),
    alone: impl FnOnce(&mut dyn FnMut(usize, usize)) -> Result<(TokenizedDataset, CacheUse), DataError>,
) -> Result<(TokenizedDataset, CacheUse), DataError> {
    let collective = |err: String| collective_error(dir, err);
    let (world, rank) = (ranks.world_size(), ranks.rank());
    let key = cache_key(parts)?;
    let entry = dir.join(&key);
    let found = entry
        .exists()
        .then(|| read_entry(&entry, &key))
        .and_then(Result::ok);
    let all_found = ranks.all(found.is_some()).map_err(collective)?;
    if all_found && let Some(read) = found {
        return Ok((read.into_dataset(path), CacheUse::Reused(entry)));
    }
    drop(found);
    // This rank's share: records [n r / W, n (r + 1) / W).
    let range = |r: usize| records.len() * r / world..records.len() * (r + 1) / world;
    let share_key = |r: usize| format!("{key}-share-{r}-of-{world}");
    let mine = &records[range(rank)];
    // Another process may write this rank's share (a helper on every core
    // of the rank's own); else, or when it could not, this one does.
    let wrote = share_writer.is_some_and(|write| write(range(rank), &share_key(rank)).is_ok())
        || write_share(dir, path, mine, parts, &share_key(rank), 1, &mut |done| {
            progress(done, mine.len())
        })
        .is_ok();
    ranks.barrier().map_err(collective)?;
    let mut shares = Vec::with_capacity(world);
    for r in 0..world {
        let read = read_entry(&dir.join(share_key(r)), &share_key(r));
        match read {
            Ok(read) => shares.push(read),
            Err(_) => break,
        }
    }
    let shared = ranks
        .all(wrote && shares.len() == world)
        .map_err(collective)?;
    // Every rank has read the shares before each removes its own (on
    // nodes with a cache of their own, too).
    ranks.barrier().map_err(collective)?;
    let _ = std::fs::remove_dir_all(dir.join(share_key(rank)));
    if !shared {
        return alone(progress);
    }
    let mut joined = Vec::with_capacity(world);
    for read in shares {
        if let Some(error) = read.error {
            return Err(DataError::Record {
                path: path.to_owned(),
                location: error.location,
                message: error.message,
                hint: error.hint,
            });
        }
        joined.push(crate::tokenize::TokenizedPart {
            examples: read.examples,
            locations: read.locations,
            report: read.report,
            single_tokens: read.single_tokens,
        });
    }
    let mut dataset = crate::tokenize::finish_parts(path, joined, parts.config)?;
    dataset.unused_fields = crate::records::unused_text_fields(records);
    if rank != 0 {
        return Ok((dataset, CacheUse::Shared(entry, world)));
    }
    let used = match write_entry(dir, &key, &whole(&dataset), path) {
        Ok(()) => CacheUse::Shared(entry, world),
        Err(why) => CacheUse::NotWritten(entry, why),
    };
    Ok((dataset, used))
}
