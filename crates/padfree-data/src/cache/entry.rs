//! An entry of the cache on disk: its files, written whole through a
//! temporary directory and a rename, and read back in blocks with every
//! checksum checked.

use std::path::{Path, PathBuf};

use padfree_pack::Example;
use serde::{Deserialize, Serialize};

use super::key::{FORMAT, Fnv};
use crate::error::DataError;
use crate::records::UnusedField;
use crate::tokenize::{DataReport, TokenizedDataset, TokenizedPart};

/// What the cache did for one data set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheUse {
    /// Read back from this entry; the data was not tokenized.
    Reused(PathBuf),
    /// Tokenized and written to this entry.
    Built(PathBuf),
    /// The entry could not be trusted (why) and was built anew.
    Rebuilt(PathBuf, String),
    /// Tokenized, but the entry could not be written (why); the run goes on.
    NotWritten(PathBuf, String),
    /// Built by this many ranks, each tokenizing its share of the records.
    Shared(PathBuf, usize),
}

impl std::fmt::Display for CacheUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reused(dir) => write!(f, "reused {} (not tokenized again)", dir.display()),
            Self::Built(dir) => write!(f, "built {}", dir.display()),
            Self::Shared(dir, ranks) => write!(
                f,
                "built {} by {ranks} ranks, each tokenizing its share of the records",
                dir.display()
            ),
            Self::Rebuilt(dir, why) => write!(f, "rebuilt {} ({why})", dir.display()),
            Self::NotWritten(dir, why) => write!(
                f,
                "not written ({why}): the next start tokenizes again\nHINT: point --data-cache-dir at a writable directory, or pass --no-data-cache; the cache would be {}",
                dir.display()
            ),
        }
    }
}

/// `dataset.json`.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    key: String,
    /// The file the entry was first built from (for people; a copy of the
    /// same bytes elsewhere reuses it).
    built_from: String,
    examples: usize,
    tokens: usize,
    report: DataReport,
    locations: Vec<String>,
    checksums: Checksums,
    /// A rank's share only: its examples dropped for one token.
    #[serde(default)]
    single_tokens: usize,
    /// A rank's share only: its first bad record.
    #[serde(default)]
    error: Option<RecordError>,
    /// Text fields no record's shape trains on (a whole data set only).
    #[serde(default)]
    unused_fields: Vec<UnusedField>,
}

/// A bad record, as a rank's share keeps it for the other ranks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RecordError {
    pub(super) location: String,
    pub(super) message: String,
    pub(super) hint: String,
}

/// What an entry holds: a whole data set, or a rank's share of one.
pub(super) struct Contents<'a> {
    pub(super) examples: &'a [Example],
    pub(super) locations: &'a [String],
    pub(super) unused_fields: &'a [UnusedField],
    pub(super) report: DataReport,
    pub(super) single_tokens: usize,
    pub(super) error: Option<RecordError>,
}

/// An entry read back.
pub(super) struct Entry {
    pub(super) examples: Vec<Example>,
    pub(super) locations: Vec<String>,
    pub(super) unused_fields: Vec<UnusedField>,
    pub(super) report: DataReport,
    pub(super) single_tokens: usize,
    pub(super) error: Option<RecordError>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Checksums {
    ids: String,
    labels: String,
    offsets: String,
}

const MANIFEST: &str = "dataset.json";
const IDS: &str = "ids.u32";
const LABELS: &str = "labels.i32";
const OFFSETS: &str = "offsets.u64";

impl Entry {
    /// The data set it holds, as read from `path`.
    pub(super) fn into_dataset(self, path: &Path) -> TokenizedDataset {
        TokenizedDataset {
            source: path.to_owned(),
            examples: self.examples,
            locations: self.locations,
            report: self.report,
            unused_fields: self.unused_fields,
        }
    }
}

/// The entry's examples, or why it cannot be trusted.
pub(super) fn read_entry(entry: &Path, key: &str) -> Result<Entry, String> {
    let mut examples = Vec::new();
    let walked = walk_entry(entry, key, &mut |example| {
        examples.push(example);
        Ok(())
    })?;
    Ok(walked.into_entry(examples))
}

/// An entry opened: its examples are read from its files when asked for.
pub(super) struct Opened {
    pub(super) offsets: Vec<u64>,
    pub(super) entry: Entry,
    pub(super) tokens: EntryTokens,
    /// The examples' fingerprint and loss tokens, counted while checked.
    pub(super) fingerprint: u64,
    pub(super) loss_tokens: Vec<u32>,
}

/// The entry's examples read from its files when asked for (a step's at a
/// time), after the same checks as [`read_entry`]: nothing of the tokens is
/// held but the offsets, and what the run asks of every example (its
/// fingerprint, loss tokens) is counted during the check.
pub(super) fn open_entry(entry: &Path, key: &str) -> Result<Opened, String> {
    let mut fingerprint = padfree_pack::Fingerprint::default();
    let mut loss_tokens = Vec::new();
    let mut walked = walk_entry(entry, key, &mut |example| {
        fingerprint.add(&example);
        loss_tokens.push(u32::try_from(example.num_loss_tokens()).unwrap_or(u32::MAX));
        Ok(())
    })?;
    let tokens = EntryTokens::open(entry)?;
    let offsets = std::mem::take(&mut walked.offsets);
    Ok(Opened {
        offsets,
        entry: walked.into_entry(Vec::new()),
        tokens,
        fingerprint: fingerprint.finish(),
        loss_tokens,
    })
}

/// An entry's `ids.u32` and `labels.i32`, read a range at a time.
#[derive(Debug)]
pub(super) struct EntryTokens {
    files: std::sync::Mutex<(std::fs::File, std::fs::File)>,
    dir: PathBuf,
}

impl EntryTokens {
    fn open(entry: &Path) -> Result<Self, String> {
        let open = |name: &str| {
            std::fs::File::open(entry.join(name))
                .map_err(|err| format!("{name} could not be read: {err}"))
        };
        Ok(Self {
            files: std::sync::Mutex::new((open(IDS)?, open(LABELS)?)),
            dir: entry.to_owned(),
        })
    }
}

impl padfree_pack::TokenSource for EntryTokens {
    fn tokens(&self, range: std::ops::Range<u64>) -> Result<(Vec<u32>, Vec<i64>), String> {
        use std::io::{Read, Seek, SeekFrom};
        let n =
            usize::try_from(range.end.saturating_sub(range.start)).map_err(|e| e.to_string())?;
        let mut files = self
            .files
            .lock()
            .map_err(|_| "a reader of the entry panicked".to_owned())?;
        let read = |file: &mut std::fs::File| -> Result<Vec<u8>, String> {
            let mut bytes = vec![0u8; 4 * n];
            file.seek(SeekFrom::Start(4 * range.start))
                .and_then(|_| file.read_exact(&mut bytes))
                .map_err(|err| format!("{}: {err}", self.dir.display()))?;
            Ok(bytes)
        };
        let ids = read(&mut files.0)?;
        let labels = read(&mut files.1)?;
        Ok((
            ids.chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            labels
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
        ))
    }
}

/// The bad record a share entry keeps, if any (its manifest alone read),
/// or why the share cannot be read.
pub(super) fn share_error(entry: &Path, key: &str) -> Result<Option<RecordError>, String> {
    let manifest = std::fs::read(entry.join(MANIFEST))
        .map_err(|err| format!("{MANIFEST} could not be read: {err}"))?;
    let manifest: Manifest = serde_json::from_slice(&manifest)
        .map_err(|err| format!("{MANIFEST} is not whole: {err}"))?;
    if manifest.key != key {
        return Err(format!("{MANIFEST} names key {}", manifest.key));
    }
    Ok(manifest.error)
}

/// Joins the share entries `shares` of `dir` (in file order, none with a
/// bad record) into the entry `key`, example by example, each share
/// checked as it is read: no share is held. The unused text fields are
/// the shares' own, merged in file order. Gives why it could not.
pub(super) fn join_shares(
    dir: &Path,
    key: &str,
    shares: &[String],
    (path, config): (&Path, &crate::tokenize::TokenizeConfig),
) -> Result<Result<(), String>, DataError> {
    let mut unused_fields: Vec<UnusedField> = Vec::new();
    let mut writer = match EntryWriter::create(dir, key) {
        Ok(writer) => writer,
        Err(why) => return Ok(Err(why)),
    };
    let mut tally = crate::tokenize::Tally::default();
    for share in shares {
        let mut appended = Ok(());
        let walked = walk_entry(&dir.join(share), share, &mut |example| {
            tally.add_length(example.len());
            appended = writer.append(std::slice::from_ref(&example), &[]);
            appended.clone()
        });
        let walked = match (walked, appended) {
            (Ok(walked), Ok(())) => walked,
            (Err(why), _) | (_, Err(why)) => return Ok(Err(format!("{share}: {why}"))),
        };
        tally.add_counts(&walked.manifest.report, walked.manifest.single_tokens);
        crate::records::merge_unused(&mut unused_fields, walked.manifest.unused_fields);
        if let Err(why) = writer.append(&[], &walked.manifest.locations) {
            return Ok(Err(why));
        }
    }
    let tail = EntryTail {
        report: tally.finish(path, config)?,
        single_tokens: 0,
        error: None,
        unused_fields,
    };
    Ok(writer.finish(tail, path))
}

/// An entry walked through: its manifest and offsets.
struct Walked {
    manifest: Manifest,
    offsets: Vec<u64>,
}

impl Walked {
    fn into_entry(self, examples: Vec<Example>) -> Entry {
        Entry {
            examples,
            locations: self.manifest.locations,
            report: self.manifest.report,
            single_tokens: self.manifest.single_tokens,
            error: self.manifest.error,
            unused_fields: self.manifest.unused_fields,
        }
    }
}

/// Checks the entry's manifest, hands every example to `each` as read
/// from blocks of the files (each block hashed as read: no whole file in
/// memory), and compares every checksum at the end; the entry is trusted
/// only if all of that agrees.
fn walk_entry(
    entry: &Path,
    key: &str,
    each: &mut dyn FnMut(Example) -> Result<(), String>,
) -> Result<Walked, String> {
    let manifest = std::fs::read(entry.join(MANIFEST))
        .map_err(|err| format!("{MANIFEST} could not be read: {err}"))?;
    let manifest: Manifest = serde_json::from_slice(&manifest)
        .map_err(|err| format!("{MANIFEST} is not whole: {err}"))?;
    if manifest.format != FORMAT {
        return Err(format!(
            "written as `{}`, this padfree reads `{FORMAT}`",
            manifest.format
        ));
    }
    if manifest.key != key {
        return Err(format!("{MANIFEST} names key {}", manifest.key));
    }
    if manifest.locations.len() != manifest.examples {
        return Err(format!(
            "{MANIFEST} lists {} locations for {} examples",
            manifest.locations.len(),
            manifest.examples
        ));
    }
    let mut ids = HashedReader::open(&entry.join(IDS), 4 * manifest.tokens as u64)?;
    let mut labels = HashedReader::open(&entry.join(LABELS), 4 * manifest.tokens as u64)?;
    let mut offsets = HashedReader::open(&entry.join(OFFSETS), 8 * (manifest.examples as u64 + 1))?;
    let mut kept = Vec::with_capacity(manifest.examples + 1);
    let offset = |reader: &mut HashedReader| -> Result<usize, String> {
        let mut word = [0u8; 8];
        word.copy_from_slice(reader.take(8)?);
        Ok(usize::try_from(u64::from_le_bytes(word)).unwrap_or(usize::MAX))
    };
    let mut start = offset(&mut offsets)?;
    if start != 0 {
        return Err(format!("{OFFSETS} starts at {start}, not 0"));
    }
    kept.push(0);
    for at in 0..manifest.examples {
        let end = offset(&mut offsets)?;
        if end < start || end > manifest.tokens {
            return Err(format!("example {at}'s offsets run past the data"));
        }
        let input_ids = ids
            .take(4 * (end - start))?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let example_labels = labels
            .take(4 * (end - start))?
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect();
        let example = Example::new(input_ids, example_labels)
            .map_err(|err| format!("example {at}: {err}"))?;
        each(example)?;
        kept.push(end as u64);
        start = end;
    }
    if start != manifest.tokens {
        return Err(format!(
            "the examples end at token {start} of {}",
            manifest.tokens
        ));
    }
    let sums = Checksums {
        ids: ids.finish()?,
        labels: labels.finish()?,
        offsets: offsets.finish()?,
    };
    if sums != manifest.checksums {
        return Err("a file's checksum differs from the one written (changed or damaged)".into());
    }
    Ok(Walked {
        manifest,
        offsets: kept,
    })
}

/// Writes the entry `key` of `dataset` into `dir` through a temporary
/// directory renamed into place; an entry another process finished first
/// is kept. Gives why it could not.
pub(super) fn write_entry(
    dir: &Path,
    key: &str,
    contents: &Contents<'_>,
    path: &Path,
) -> Result<(), String> {
    let mut writer = EntryWriter::create(dir, key)?;
    writer.append(contents.examples, contents.locations)?;
    writer.finish(
        EntryTail {
            report: contents.report.clone(),
            single_tokens: contents.single_tokens,
            error: contents.error.clone(),
            unused_fields: contents.unused_fields.to_vec(),
        },
        path,
    )
}

/// An entry being written, examples appended as they are made: in a
/// temporary directory beside the entries until [`EntryWriter::finish`]
/// renames it into place; dropped unfinished, it is removed.
pub(super) struct EntryWriter {
    tmp: Temporary,
    entry: PathBuf,
    key: String,
    // Streamed through one block each, hashed as written: no second copy
    // of the tokens is held.
    ids: HashedFile,
    labels: HashedFile,
    offsets: HashedFile,
    end: u64,
    locations: Vec<String>,
}

/// A temporary directory, removed when dropped unless renamed away.
struct Temporary(PathBuf);

impl Drop for Temporary {
    fn drop(&mut self) {
        if self.0.exists() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// What the manifest says besides the examples.
pub(super) struct EntryTail {
    pub(super) report: DataReport,
    pub(super) single_tokens: usize,
    pub(super) error: Option<RecordError>,
    pub(super) unused_fields: Vec<UnusedField>,
}

impl EntryWriter {
    /// A new temporary for the entry `key` of `dir`.
    pub(super) fn create(dir: &Path, key: &str) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
        // Unique to this process and call: threads of one process may write
        // the same entry too.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let call = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".tmp-{key}-{}-{call}", std::process::id()));
        std::fs::create_dir(&tmp).map_err(|err| format!("{}: {err}", tmp.display()))?;
        let tmp = Temporary(tmp);
        let mut offsets = HashedFile::create(&tmp.0.join(OFFSETS))?;
        offsets.put(&0u64.to_le_bytes())?;
        Ok(Self {
            entry: dir.join(key),
            key: key.to_owned(),
            ids: HashedFile::create(&tmp.0.join(IDS))?,
            labels: HashedFile::create(&tmp.0.join(LABELS))?,
            offsets,
            tmp,
            end: 0,
            locations: Vec::new(),
        })
    }

    /// Appends `examples`, the next in file order, found at `locations`.
    pub(super) fn append(
        &mut self,
        examples: &[Example],
        locations: &[String],
    ) -> Result<(), String> {
        for example in examples {
            for id in example.input_ids() {
                self.ids.put(&id.to_le_bytes())?;
            }
            for &label in example.labels() {
                let label = i32::try_from(label)
                    .map_err(|_| format!("label {label} does not fit 32 bits"))?;
                self.labels.put(&label.to_le_bytes())?;
            }
            self.end += example.len() as u64;
            self.offsets.put(&self.end.to_le_bytes())?;
        }
        self.locations.extend_from_slice(locations);
        Ok(())
    }

    /// Writes the manifest and renames the whole entry into place.
    pub(super) fn finish(self, tail: EntryTail, path: &Path) -> Result<(), String> {
        let manifest = Manifest {
            format: FORMAT.to_owned(),
            key: self.key.clone(),
            built_from: path.display().to_string(),
            examples: self.locations.len(),
            tokens: self.end as usize,
            report: tail.report,
            locations: self.locations,
            checksums: Checksums {
                ids: self.ids.finish()?,
                labels: self.labels.finish()?,
                offsets: self.offsets.finish()?,
            },
            single_tokens: tail.single_tokens,
            error: tail.error,
            unused_fields: tail.unused_fields,
        };
        let manifest = serde_json::to_vec(&manifest).map_err(|err| err.to_string())?;
        // The manifest last: a reader of a whole entry finds it whole.
        let mut file = HashedFile::create(&self.tmp.0.join(MANIFEST))?;
        file.put(&manifest)?;
        file.finish()?;
        place(&self.tmp.0, &self.entry, &self.key)
    }
}

/// Renames the whole temporary `tmp` to `entry`. An entry already there is
/// kept when it reads whole (another process wrote the same examples
/// first), and replaced when it does not (the damaged one this replaces).
fn place(tmp: &Path, entry: &Path, key: &str) -> Result<(), String> {
    let mut last = String::new();
    // A few rounds: another process may be replacing the same damaged entry.
    for _ in 0..4 {
        match std::fs::rename(tmp, entry) {
            Ok(()) => return Ok(()),
            Err(err) if entry.exists() => {
                if read_entry(entry, key).is_ok() {
                    return Ok(());
                }
                last = format!("{}: {err}", entry.display());
                match std::fs::remove_dir_all(entry) {
                    Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                        last = format!("{}: {err}", entry.display());
                    }
                    _ => {}
                }
            }
            Err(err) => return Err(format!("{}: {err}", entry.display())),
        }
    }
    Err(last)
}

/// The contents of a whole data set.
pub(super) fn whole(dataset: &TokenizedDataset) -> Contents<'_> {
    Contents {
        examples: &dataset.examples,
        locations: &dataset.locations,
        unused_fields: &dataset.unused_fields,
        report: dataset.report.clone(),
        single_tokens: 0,
        error: None,
    }
}

/// The contents of a rank's share: its examples, or its first bad record.
pub(super) fn share(part: &Result<TokenizedPart, RecordError>) -> Contents<'_> {
    match part {
        Ok(part) => Contents {
            examples: &part.examples,
            locations: &part.locations,
            unused_fields: &[],
            report: part.report.clone(),
            single_tokens: part.single_tokens,
            error: None,
        },
        Err(error) => Contents {
            examples: &[],
            locations: &[],
            unused_fields: &[],
            report: DataReport::default(),
            single_tokens: 0,
            error: Some(error.clone()),
        },
    }
}

/// A file written in blocks and hashed as [`content_fingerprint`] hashes
/// its bytes (blocks are whole 8-byte words).
struct HashedFile {
    path: PathBuf,
    file: std::fs::File,
    hash: Fnv,
    block: Vec<u8>,
}

impl HashedFile {
    const BLOCK: usize = 1 << 20;

    fn create(path: &Path) -> Result<Self, String> {
        let file =
            std::fs::File::create(path).map_err(|err| format!("{}: {err}", path.display()))?;
        Ok(Self {
            path: path.to_owned(),
            file,
            hash: Fnv::new(),
            block: Vec::with_capacity(Self::BLOCK),
        })
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), String> {
        let mut rest = bytes;
        while !rest.is_empty() {
            let take = (Self::BLOCK - self.block.len()).min(rest.len());
            self.block.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.block.len() == Self::BLOCK {
                self.hash.words(&self.block);
                self.write_block()?;
            }
        }
        Ok(())
    }

    fn write_block(&mut self) -> Result<(), String> {
        use std::io::Write;
        self.file
            .write_all(&self.block)
            .map_err(|err| format!("{}: {err}", self.path.display()))?;
        self.block.clear();
        Ok(())
    }

    /// Writes the rest and syncs; gives the checksum.
    fn finish(mut self) -> Result<String, String> {
        self.hash.bytes(&self.block);
        self.write_block()?;
        self.file
            .sync_all()
            .map_err(|err| format!("{}: {err}", self.path.display()))?;
        Ok(format!("{:016x}", self.hash.0))
    }
}

/// A file read in the writer's blocks, each hashed as [`HashedFile`]
/// hashed it, and handed out a few bytes at a time.
struct HashedReader {
    path: PathBuf,
    file: std::fs::File,
    hash: Fnv,
    /// Read, not yet handed out: `buffer[at..]`.
    buffer: Vec<u8>,
    at: usize,
    left: u64,
}

impl HashedReader {
    /// The file at `path`, which must hold `len` bytes.
    fn open(path: &Path, len: u64) -> Result<Self, String> {
        let name = path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let file =
            std::fs::File::open(path).map_err(|err| format!("{name} could not be read: {err}"))?;
        let size = file
            .metadata()
            .map_err(|err| format!("{name} could not be read: {err}"))?
            .len();
        if size != len {
            return Err(format!(
                "{name} holds {size} bytes where {MANIFEST} says {len} (cut short?)"
            ));
        }
        Ok(Self {
            path: path.to_owned(),
            file,
            hash: Fnv::new(),
            buffer: Vec::new(),
            at: 0,
            left: len,
        })
    }

    /// The next `n` bytes.
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        use std::io::Read;
        while self.buffer.len() - self.at < n {
            if self.left == 0 {
                return Err(format!("{} ends early", self.path.display()));
            }
            self.buffer.drain(..self.at);
            self.at = 0;
            let block = (HashedFile::BLOCK as u64).min(self.left) as usize;
            let from = self.buffer.len();
            self.buffer.resize(from + block, 0);
            self.file
                .read_exact(&mut self.buffer[from..])
                .map_err(|err| format!("{}: {err}", self.path.display()))?;
            if block == HashedFile::BLOCK {
                self.hash.words(&self.buffer[from..]);
            } else {
                self.hash.bytes(&self.buffer[from..]);
            }
            self.left -= block as u64;
        }
        self.at += n;
        Ok(&self.buffer[self.at - n..self.at])
    }

    /// The checksum of the whole file (all of it read and hashed).
    fn finish(mut self) -> Result<String, String> {
        if self.left > 0 || self.at != self.buffer.len() {
            let rest = self.left as usize + self.buffer.len() - self.at;
            self.take(rest)?;
        }
        Ok(format!("{:016x}", self.hash.0))
    }
}
