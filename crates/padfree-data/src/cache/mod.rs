//! The tokenized-data cache: a data set tokenized once is read back on the
//! next start instead of tokenized again (HF `datasets`' fingerprinted
//! cache, for padfree's examples).
//!
//! A cached data set is a directory named by its key, a hash of everything
//! that decides its examples: the data's bytes (length and content), the
//! tokenizer (its `tokenizer.json`, `tokenizer_config.json` and chat
//! template, as written beside a saved model), the field names and prompt
//! template, `max_seq_len`, the overlong policy, `train_on_inputs`,
//! `use_chat_template`, the vocabulary limit, and [`FORMAT`]. Change any of
//! them and the key changes: the old entry is not read. In it:
//!
//! - `ids.u32`, `labels.i32`: every example's input ids and labels, end to
//!   end, little-endian;
//! - `offsets.u64`: where each example starts, and the end;
//! - `dataset.json`: the format, the key, the report, each example's record
//!   location, the counts and a checksum of each of the three files.
//!
//! A reader trusts an entry only when all of that agrees; anything else (a
//! truncated or edited file, another format) is a miss, said in a note, and
//! the entry is built anew. A writer fills a temporary directory beside the
//! entries and renames it into place, so another process (an MPI rank, a
//! second run) sees a whole entry or none; when two build the same entry
//! at once, the first rename wins and the other keeps its own result.
//!
//! Three ways in: [`DataCache::tokenize`] tokenizes records already read
//! (or reads the entry back whole); [`DataCache::build`] (`build.rs`) reads
//! the data file a chunk of records at a time and appends each chunk's
//! examples to the new entry, holding neither the records nor the
//! examples; [`DataCache::open`] checks a whole entry and hands out a
//! [`DataSet`] whose examples are read from the entry's files a step at a
//! time. `dataset.json` keeps the unused-field warnings too, so a start
//! that reads the entry reads no record.

mod build;
mod entry;
mod key;
mod shared;

use std::path::{Path, PathBuf};

use padfree_pack::ExampleSet;

pub use self::build::CHUNK_RECORDS;
pub use self::entry::CacheUse;
use self::entry::{open_entry, read_entry, whole, write_entry};
pub use self::key::{
    CacheKeyParts, FORMAT, Fingerprint, cache_key, content_fingerprint, data_fingerprint,
    file_fingerprint,
};
pub use self::shared::{Ranks, ShareWriter};
use crate::dataset::DataSet;
use crate::error::DataError;
use crate::records::SourceRecord;
use crate::stream::ReadProgress;
use crate::tokenize::TokenizedDataset;

/// Where the tokenized data sets are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataCache {
    dir: PathBuf,
    threads: usize,
}

/// What the cache holds for a data set: `D` is a [`TokenizedDataset`]
/// read back ([`DataCache::look_up`]) or a [`DataSet`] that reads its
/// examples from the entry ([`DataCache::open`]).
#[derive(Debug)]
pub enum Lookup<D> {
    /// A whole entry (in this directory).
    Hit(D, PathBuf),
    /// No entry.
    Miss,
    /// An entry that cannot be trusted (why); it is rebuilt when written.
    Broken(String),
}

impl DataCache {
    /// A cache in `dir` (made when first written).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            threads: 1,
        }
    }

    /// Tokenizes a missing entry on `threads` threads
    /// ([`crate::tokenize_in_parallel`]); 1 unless told.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// Where the cache lives unless told: `$PADFREE_DATA_CACHE`, else
    /// `$XDG_CACHE_HOME/padfree/data`, else `$HOME/.cache/padfree/data` (as
    /// HF keeps `~/.cache/huggingface/datasets`); `None` without a home.
    pub fn default_dir() -> Option<PathBuf> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(dir) = var("PADFREE_DATA_CACHE") {
            return Some(PathBuf::from(dir));
        }
        if let Some(dir) = var("XDG_CACHE_HOME") {
            return Some(PathBuf::from(dir).join("padfree").join("data"));
        }
        var("HOME").map(|home| {
            PathBuf::from(home)
                .join(".cache")
                .join("padfree")
                .join("data")
        })
    }

    /// The directory of the cache.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The examples of `records` (read from `path`) as [`crate::tokenize_records`]
    /// makes them: read back from the cache when an entry for `parts` is
    /// whole, else tokenized and written.
    /// `progress` hears (records tokenized, records) while it tokenizes.
    pub fn tokenize(
        &self,
        path: &Path,
        records: &[SourceRecord],
        parts: &CacheKeyParts<'_>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(TokenizedDataset, CacheUse), DataError> {
        let key = cache_key(parts)?;
        let entry = self.dir.join(&key);
        let rebuilt = match self.look_up(path, parts)? {
            Lookup::Hit(dataset, entry) => return Ok((dataset, CacheUse::Reused(entry))),
            Lookup::Miss => None,
            Lookup::Broken(why) => Some(why),
        };
        let dataset = if self.threads > 1 {
            crate::tokenize::tokenize_in_parallel(
                path,
                records,
                parts.tokenizer,
                parts.config,
                self.threads,
                progress,
            )?
        } else {
            crate::tokenize::tokenize_with_progress(
                path,
                records,
                parts.tokenizer,
                parts.config,
                progress,
            )?
        };
        let written = write_entry(&self.dir, &key, &whole(&dataset), path);
        let used = match (written, rebuilt) {
            (Err(why), _) => CacheUse::NotWritten(entry, why),
            (Ok(()), Some(why)) => CacheUse::Rebuilt(entry, why),
            (Ok(()), None) => CacheUse::Built(entry),
        };
        Ok((dataset, used))
    }

    /// Builds the entry for the data file `path` and `parts` from its
    /// records, read a chunk at a time ([`CHUNK_RECORDS`]) and tokenized
    /// on the cache's threads ([`Self::with_threads`]); nothing is held
    /// but one chunk of records and the examples' locations (`build.rs`).
    /// The entry is placed when whole; read it back with [`Self::open`].
    /// An entry already whole is left as it is ([`CacheUse::Reused`]).
    /// `progress` hears how far the reading got after every chunk.
    pub fn build(
        &self,
        path: &Path,
        parts: &CacheKeyParts<'_>,
        progress: &mut dyn FnMut(ReadProgress),
    ) -> Result<CacheUse, DataError> {
        self.build_in_chunks(path, parts, CHUNK_RECORDS, progress)
    }

    /// [`Self::build`] reading `chunk` records at a time.
    pub fn build_in_chunks(
        &self,
        path: &Path,
        parts: &CacheKeyParts<'_>,
        chunk: usize,
        progress: &mut dyn FnMut(ReadProgress),
    ) -> Result<CacheUse, DataError> {
        build::build_entry((&self.dir, self.threads), path, parts, chunk, progress)
    }

    /// The entry for `parts`, if one is whole, read as the data set of
    /// `path`; nothing is tokenized or written.
    pub fn look_up(
        &self,
        path: &Path,
        parts: &CacheKeyParts<'_>,
    ) -> Result<Lookup<TokenizedDataset>, DataError> {
        let key = cache_key(parts)?;
        let entry = self.dir.join(&key);
        if !entry.exists() {
            return Ok(Lookup::Miss);
        }
        Ok(match read_entry(&entry, &key) {
            Ok(read) => Lookup::Hit(read.into_dataset(path), entry),
            Err(why) => Lookup::Broken(why),
        })
    }

    /// The entry for `parts`, if one is whole, as the data set of `path`
    /// whose examples are read from the entry's files when a step asks for
    /// them: the whole entry is read once to check it, and only the
    /// offsets are kept (8 bytes an example, nothing a token).
    pub fn open(
        &self,
        path: &Path,
        parts: &CacheKeyParts<'_>,
    ) -> Result<Lookup<DataSet>, DataError> {
        let key = cache_key(parts)?;
        let entry = self.dir.join(&key);
        if !entry.exists() {
            return Ok(Lookup::Miss);
        }
        let opened = match open_entry(&entry, &key) {
            Ok(opened) => opened,
            Err(why) => return Ok(Lookup::Broken(why)),
        };
        let read = opened.entry;
        let examples =
            match ExampleSet::from_source(opened.offsets, std::sync::Arc::new(opened.tokens)) {
                Ok(examples) => examples.with_counts(opened.fingerprint, opened.loss_tokens),
                Err(err) => return Ok(Lookup::Broken(err.to_string())),
            };
        let dataset = DataSet {
            source: path.to_owned(),
            examples,
            locations: read.locations,
            report: read.report,
            unused_fields: read.unused_fields,
        };
        Ok(Lookup::Hit(dataset, entry))
    }

    /// [`Self::tokenize`] as one of several ranks that see this cache
    /// directory: an entry every rank can read is read; else each rank
    /// tokenizes its share of the records (contiguous, in file order) into
    /// a share entry, every rank joins the shares, and rank 0 writes the
    /// whole entry; each rank removes its share. A bad record is every rank's
    /// error (the first in file order). Ranks that do not see one
    /// another's shares (no shared directory) each tokenize everything.
    /// `progress` hears (records tokenized, records of this rank's share).
    /// `share_writer`, when given, writes this rank's share in another
    /// process (a helper tokenizing on every core); if it fails, the rank
    /// tokenizes its share itself.
    pub fn tokenize_on_ranks(
        &self,
        path: &Path,
        records: &[SourceRecord],
        parts: &CacheKeyParts<'_>,
        (ranks, share_writer): (&dyn Ranks, Option<&ShareWriter<'_>>),
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(TokenizedDataset, CacheUse), DataError> {
        shared::tokenize_shared(
            &self.dir,
            path,
            records,
            parts,
            (ranks, share_writer),
            progress,
            |progress| self.tokenize(path, records, parts, progress),
        )
    }

    /// Ranks sharing a cold start without holding it: the `records` of the
    /// data file `path` (their count, [`crate::count_records`]) cut into
    /// contiguous shares in file order, each rank's written by
    /// `share_writer` (a helper on the rank's cores) or by the rank on the
    /// cache's threads ([`Self::build_share`]), rank 0 joining the share
    /// entries file to file into the whole entry while the others wait.
    /// `true` when the entry was placed: every rank then reads it with
    /// [`Self::open`]; `false` when the ranks could not share (then
    /// [`Self::tokenize_on_ranks`]). A bad record is every rank's error.
    pub fn build_on_ranks(
        &self,
        path: &Path,
        records: usize,
        parts: &CacheKeyParts<'_>,
        (ranks, share_writer): (&dyn Ranks, Option<&ShareWriter<'_>>),
    ) -> Result<bool, DataError> {
        shared::build_shared(
            (&self.dir, self.threads),
            path,
            records,
            parts,
            (ranks, share_writer),
        )
    }

    /// Streams the records `range` of the data file `path` (a rank's
    /// share, in file order) on the cache's threads into the share entry
    /// `share_key`, as [`Self::build`] streams a whole entry: a
    /// [`ShareWriter`]'s work. A bad record in the range is kept in the
    /// share for every rank to report. `progress` hears how far the
    /// reading got. Gives why the share could not be written.
    pub fn build_share(
        &self,
        path: &Path,
        parts: &CacheKeyParts<'_>,
        (range, share_key): (std::ops::Range<usize>, &str),
        progress: &mut dyn FnMut(ReadProgress),
    ) -> Result<(), String> {
        build::build_share(
            (&self.dir, self.threads),
            path,
            parts,
            (range, share_key),
            progress,
        )
    }
}
