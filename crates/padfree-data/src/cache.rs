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
//! Reading the records (JSON parsing) still happens on every start: the
//! cache saves the tokenization, which is most of a cold start.

use std::path::{Path, PathBuf};

use padfree_pack::Example;
use serde::{Deserialize, Serialize};

use crate::error::DataError;
use crate::records::{FieldNames, SourceRecord};
use crate::tokenize::{DataReport, TextTokenizer, TokenizeConfig, TokenizedDataset};

/// The layout of an entry; a new one misses every older entry.
pub const FORMAT: &str = "padfree-data-cache 1";

/// Where the tokenized data sets are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataCache {
    dir: PathBuf,
}

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
}

impl std::fmt::Display for CacheUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reused(dir) => write!(f, "reused {} (not tokenized again)", dir.display()),
            Self::Built(dir) => write!(f, "built {}", dir.display()),
            Self::Rebuilt(dir, why) => write!(f, "rebuilt {} ({why})", dir.display()),
            Self::NotWritten(dir, why) => write!(
                f,
                "not written ({why}): the next start tokenizes again\nHINT: point --data-cache-dir at a writable directory, or pass --no-data-cache; the cache would be {}",
                dir.display()
            ),
        }
    }
}

/// What decides a data set's examples, besides the records' own text.
#[derive(Debug, Clone, Copy)]
pub struct CacheKeyParts<'a> {
    /// The data's bytes: [`content_fingerprint`] or [`file_fingerprint`].
    pub content: Fingerprint,
    /// How the records were read.
    pub fields: &'a FieldNames,
    /// `None` when every record is pre-tokenized.
    pub tokenizer: Option<&'a TextTokenizer>,
    /// How records become examples.
    pub config: &'a TokenizeConfig,
}

/// The length and a hash of some bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    /// Bytes hashed.
    pub len: u64,
    /// FNV-1a over them (8 bytes a step).
    pub hash: u64,
}

/// The fingerprint of `bytes`.
pub fn content_fingerprint(bytes: &[u8]) -> Fingerprint {
    let mut hash = Fnv::new();
    hash.bytes(bytes);
    Fingerprint {
        len: bytes.len() as u64,
        hash: hash.0,
    }
}

/// The fingerprint of the file at `path`, read in blocks (the same as
/// [`content_fingerprint`] of its bytes).
pub fn file_fingerprint(path: &Path) -> Result<Fingerprint, DataError> {
    use std::io::Read;
    let io = |err| DataError::Io {
        path: path.to_owned(),
        err,
        hint: "give an existing, readable data file",
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut hash = Fnv::new();
    let mut block = vec![0u8; 8 << 20];
    let (mut len, mut filled) = (0u64, 0usize);
    loop {
        let read = file.read(&mut block[filled..]).map_err(io)?;
        if read == 0 {
            break;
        }
        len += read as u64;
        filled += read;
        // Whole blocks only, so that 8-byte words fall where they do in
        // one pass over the bytes.
        if filled == block.len() {
            hash.words(&block);
            filled = 0;
        }
    }
    hash.bytes(&block[..filled]);
    Ok(Fingerprint { len, hash: hash.0 })
}

/// The key of a data set: hex of a hash of [`FORMAT`] and every part.
pub fn cache_key(parts: &CacheKeyParts<'_>) -> Result<String, DataError> {
    let mut hash = Fnv::new();
    hash.bytes(FORMAT.as_bytes());
    hash.u64(parts.content.len);
    hash.u64(parts.content.hash);
    // Debug prints every field by name: a field added later changes keys,
    // which only costs a rebuild.
    hash.bytes(format!("{:?}", parts.fields).as_bytes());
    hash.bytes(format!("{:?}", parts.config).as_bytes());
    match parts.tokenizer {
        Some(tokenizer) => {
            let files = tokenizer.hf_files().map_err(|message| DataError::File {
                path: PathBuf::from(tokenizer.source_name()),
                message: format!(
                    "the tokenizer could not be serialised for the data cache key: {message}"
                ),
                hint: "pass --no-data-cache".into(),
            })?;
            for (name, bytes) in files {
                hash.bytes(name.as_bytes());
                hash.u64(bytes.len() as u64);
                hash.bytes(&bytes);
            }
        }
        None => hash.bytes(b"no tokenizer"),
    }
    Ok(format!("{:016x}", hash.0))
}

impl DataCache {
    /// A cache in `dir` (made when first written).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
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
    pub fn tokenize(
        &self,
        path: &Path,
        records: &[SourceRecord],
        parts: &CacheKeyParts<'_>,
    ) -> Result<(TokenizedDataset, CacheUse), DataError> {
        let key = cache_key(parts)?;
        let entry = self.dir.join(&key);
        let mut rebuilt = None;
        if entry.exists() {
            match read_entry(&entry, &key) {
                Ok((examples, locations, report)) => {
                    let dataset = TokenizedDataset {
                        source: path.to_owned(),
                        examples,
                        locations,
                        report,
                    };
                    return Ok((dataset, CacheUse::Reused(entry)));
                }
                Err(why) => rebuilt = Some(why),
            }
        }
        let dataset =
            crate::tokenize::tokenize_records(path, records, parts.tokenizer, parts.config)?;
        let written = write_entry(&self.dir, &key, &dataset, path);
        let used = match (written, rebuilt) {
            (Err(why), _) => CacheUse::NotWritten(entry, why),
            (Ok(()), Some(why)) => CacheUse::Rebuilt(entry, why),
            (Ok(()), None) => CacheUse::Built(entry),
        };
        Ok((dataset, used))
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

/// The entry's examples, or why it cannot be trusted.
fn read_entry(entry: &Path, key: &str) -> Result<(Vec<Example>, Vec<String>, DataReport), String> {
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
    // Example by example from blocks of the files, each hashed as read: no
    // whole file in memory beside the examples; nothing is returned unless
    // every checksum agrees at the end.
    let mut examples = Vec::with_capacity(manifest.examples);
    let offset = |reader: &mut HashedReader| -> Result<usize, String> {
        let mut word = [0u8; 8];
        word.copy_from_slice(reader.take(8)?);
        Ok(usize::try_from(u64::from_le_bytes(word)).unwrap_or(usize::MAX))
    };
    let mut start = offset(&mut offsets)?;
    if start != 0 {
        return Err(format!("{OFFSETS} starts at {start}, not 0"));
    }
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
        examples.push(example);
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
    Ok((examples, manifest.locations, manifest.report))
}

/// Writes the entry `key` of `dataset` into `dir` through a temporary
/// directory renamed into place; an entry another process finished first
/// is kept. Gives why it could not.
fn write_entry(
    dir: &Path,
    key: &str,
    dataset: &TokenizedDataset,
    path: &Path,
) -> Result<(), String> {
    let entry = dir.join(key);
    std::fs::create_dir_all(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
    // Unique to this process and call: threads of one process may write
    // the same entry too.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".tmp-{key}-{}-{call}", std::process::id()));
    let result = fill(&tmp, key, dataset, path).and_then(|()| place(&tmp, &entry, key));
    if tmp.exists() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
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

fn fill(tmp: &Path, key: &str, dataset: &TokenizedDataset, path: &Path) -> Result<(), String> {
    std::fs::create_dir(tmp).map_err(|err| format!("{}: {err}", tmp.display()))?;
    // Streamed through one block each, hashed as written: a cold start
    // holds no second copy of the tokens.
    let mut ids = HashedFile::create(&tmp.join(IDS))?;
    let mut labels = HashedFile::create(&tmp.join(LABELS))?;
    let mut offsets = HashedFile::create(&tmp.join(OFFSETS))?;
    offsets.put(&0u64.to_le_bytes())?;
    let mut end = 0u64;
    for example in &dataset.examples {
        for id in example.input_ids() {
            ids.put(&id.to_le_bytes())?;
        }
        for &label in example.labels() {
            let label =
                i32::try_from(label).map_err(|_| format!("label {label} does not fit 32 bits"))?;
            labels.put(&label.to_le_bytes())?;
        }
        end += example.len() as u64;
        offsets.put(&end.to_le_bytes())?;
    }
    let manifest = Manifest {
        format: FORMAT.to_owned(),
        key: key.to_owned(),
        built_from: path.display().to_string(),
        examples: dataset.examples.len(),
        tokens: end as usize,
        report: dataset.report.clone(),
        locations: dataset.locations.clone(),
        checksums: Checksums {
            ids: ids.finish()?,
            labels: labels.finish()?,
            offsets: offsets.finish()?,
        },
    };
    let manifest = serde_json::to_vec(&manifest).map_err(|err| err.to_string())?;
    // The manifest last: a reader of a whole entry finds it whole.
    let mut file = HashedFile::create(&tmp.join(MANIFEST))?;
    file.put(&manifest)?;
    file.finish()?;
    Ok(())
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

/// FNV-1a, 64 bits, over 8-byte little-endian words (then the tail byte
/// by byte): a stable hash (the cache outlives the binary), fast enough
/// for a data file read once per start. Not cryptographic: the key guards
/// against changes, not against someone crafting a colliding file.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn u64(&mut self, value: u64) {
        self.0 ^= value;
        self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
    }

    /// Whole words of `bytes` (its length a multiple of 8).
    fn words(&mut self, bytes: &[u8]) {
        for word in bytes.chunks_exact(8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.u64(u64::from_le_bytes(w));
        }
    }

    fn bytes(&mut self, bytes: &[u8]) {
        let whole = bytes.len() / 8 * 8;
        self.words(&bytes[..whole]);
        for &byte in &bytes[whole..] {
            self.u64(u64::from(byte));
        }
    }
}
