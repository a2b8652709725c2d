//! The key of a cached data set, and the fingerprints it is made of.

use std::path::{Path, PathBuf};

use crate::error::DataError;
use crate::records::FieldNames;
use crate::tokenize::{TextTokenizer, TokenizeConfig};

/// The layout of an entry; a new one misses every older entry.
pub const FORMAT: &str = "padfree-data-cache 2";

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

/// The fingerprint of a data path: a file's bytes, or for a directory of
/// columnar files (Parquet shards, an HF `datasets` directory) each file's
/// name and bytes in the order they are read.
pub fn data_fingerprint(path: &Path) -> Result<Fingerprint, DataError> {
    if !path.is_dir() {
        return file_fingerprint(path);
    }
    let files = crate::columnar::columnar_files(path)?.ok_or_else(|| DataError::File {
        path: path.to_owned(),
        message: "a directory without data files".into(),
        hint: "give a data file, a directory of .parquet shards or an HF datasets directory".into(),
    })?;
    let (mut hash, mut len) = (Fnv::new(), 0u64);
    for file in files.paths() {
        let name = file.strip_prefix(path).unwrap_or(file);
        hash.bytes(name.to_string_lossy().as_bytes());
        let each = file_fingerprint(file)?;
        hash.u64(each.len);
        hash.u64(each.hash);
        len += each.len;
    }
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

/// FNV-1a, 64 bits, over 8-byte little-endian words (then the tail byte
/// by byte): a stable hash (the cache outlives the binary), fast enough
/// for a data file read once per start. Not cryptographic: the key guards
/// against changes, not against someone crafting a colliding file.
pub(super) struct Fnv(pub(super) u64);

impl Fnv {
    pub(super) fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    pub(super) fn u64(&mut self, value: u64) {
        self.0 ^= value;
        self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
    }

    /// Whole words of `bytes` (its length a multiple of 8).
    pub(super) fn words(&mut self, bytes: &[u8]) {
        for word in bytes.chunks_exact(8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.u64(u64::from_le_bytes(w));
        }
    }

    pub(super) fn bytes(&mut self, bytes: &[u8]) {
        let whole = bytes.len() / 8 * 8;
        self.words(&bytes[..whole]);
        for &byte in &bytes[whole..] {
            self.u64(u64::from(byte));
        }
    }
}
