//! GGUF (llama.cpp's format, version 2 and 3): the header, the metadata, the
//! tensor directory, and dequantisation of the common tensor types to f32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::ModelError;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Any unsigned integer type.
    Uint(u64),
    /// Any signed integer type.
    Int(i64),
    /// f32 or f64.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of values.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            GgufValue::Uint(v) => Some(*v),
            GgufValue::Int(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            GgufValue::Float(v) => Some(*v),
            GgufValue::Uint(v) => Some(*v as f64),
            GgufValue::Int(v) => Some(*v as f64),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(values) => Some(values),
            _ => None,
        }
    }
}

/// How a tensor's values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// bfloat16.
    Bf16,
    /// Blocks of 32: f16 scale, 4-bit values offset by 8.
    Q4_0,
    /// Blocks of 32: f16 scale and minimum, 4-bit values.
    Q4_1,
    /// Blocks of 32: f16 scale, 8-bit values.
    Q8_0,
    /// Super-blocks of 256: 8 sub-blocks with 6-bit scales and minimums, 4-bit values.
    Q4K,
    /// Super-blocks of 256: 16 sub-blocks with 8-bit scales, 6-bit values.
    Q6K,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// (values per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q6K => (256, 210),
        }
    }
}

/// Where one tensor lies in the file.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    /// llama.cpp's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// ggml dimensions, innermost first (the reverse of PyTorch's shape).
    pub dims: Vec<u64>,
    /// Storage type.
    pub ggml_type: GgmlType,
    offset: u64,
}

impl GgufTensorInfo {
    /// The PyTorch/HF shape: ggml dimensions reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of values.
    pub fn numel(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// A GGUF file's header (metadata and tensor index), read once; each
/// tensor's data is read from the file when asked for, so loading a model
/// never holds the whole file beside what it keeps of it.
pub struct GgufFile {
    path: PathBuf,
    /// Bytes of the file on disk.
    len: u64,
    /// Metadata by key.
    pub metadata: HashMap<String, GgufValue>,
    /// Tensors by name.
    pub tensors: HashMap<String, GgufTensorInfo>,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .field("metadata", &self.metadata.len())
            .finish()
    }
}

/// A little-endian reader over the header that reports truncation as an error.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
    /// Set when a read needed bytes past the end of `bytes`: with more of
    /// the file, the header may parse.
    ran_out: bool,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], ModelError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| {
                self.ran_out = true;
                gguf_error(
                    self.path,
                    format!("truncated header: needs {n} bytes at offset {}", self.at),
                )
            })?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ModelError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, ModelError> {
        let len = self.u64()?;
        let len = usize::try_from(len)
            .map_err(|_| gguf_error(self.path, format!("string length {len}")))?;
        let at = self.at;
        String::from_utf8(self.take(len)?.to_vec())
            .map_err(|_| gguf_error(self.path, format!("string at offset {at} is not UTF-8")))
    }

    fn value(&mut self, type_id: u32, depth: usize) -> Result<GgufValue, ModelError> {
        Ok(match type_id {
            0 => GgufValue::Uint(u64::from(self.array::<1>()?[0])),
            1 => GgufValue::Int(i64::from(i8::from_le_bytes(self.array()?))),
            2 => GgufValue::Uint(u64::from(u16::from_le_bytes(self.array()?))),
            3 => GgufValue::Int(i64::from(i16::from_le_bytes(self.array()?))),
            4 => GgufValue::Uint(u64::from(self.u32()?)),
            5 => GgufValue::Int(i64::from(i32::from_le_bytes(self.array()?))),
            6 => GgufValue::Float(f64::from(f32::from_le_bytes(self.array()?))),
            7 => GgufValue::Bool(self.array::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 if depth == 0 => {
                let element_type = self.u32()?;
                let count = self.u64()?;
                // Each element takes at least one byte: a count beyond the file is corrupt.
                if count > (self.bytes.len() - self.at) as u64 {
                    self.ran_out = true;
                    return Err(gguf_error(
                        self.path,
                        format!("array of {count} elements at offset {}", self.at),
                    ));
                }
                let values = (0..count)
                    .map(|_| self.value(element_type, depth + 1))
                    .collect::<Result<_, _>>()?;
                GgufValue::Array(values)
            }
            10 => GgufValue::Uint(self.u64()?),
            11 => GgufValue::Int(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::Float(f64::from_le_bytes(self.array()?)),
            other => {
                return Err(gguf_error(
                    self.path,
                    format!("unknown metadata value type {other}"),
                ));
            }
        })
    }
}

fn gguf_error(path: &Path, message: String) -> ModelError {
    ModelError::Format {
        path: path.to_owned(),
        message,
        hint: "the file is not a valid GGUF file (or is truncated); download it again",
    }
}

impl GgufFile {
    /// Reads and indexes a GGUF file's header. The header's length is known
    /// only once it is parsed: the first 8 MiB are tried, then four times
    /// more until it parses or the whole file was read (a damaged file
    /// then gets the error its whole header gives).
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        Self::open_reading(path, 8 << 20)
    }

    /// [`Self::open`], trying the first `first` bytes first.
    fn open_reading(path: &Path, first: u64) -> Result<Self, ModelError> {
        use std::io::Read;
        let io = |err| ModelError::io(path, err);
        let len = std::fs::metadata(path).map_err(io)?.len();
        let mut prefix = len.min(first.max(1));
        loop {
            let mut bytes = Vec::with_capacity(prefix as usize);
            std::fs::File::open(path)
                .map_err(io)?
                .take(prefix)
                .read_to_end(&mut bytes)
                .map_err(io)?;
            let mut cursor = Cursor {
                bytes: &bytes,
                at: 0,
                path,
                ran_out: false,
            };
            match Self::header(&mut cursor, len) {
                Err(_) if cursor.ran_out && prefix < len => {
                    prefix = len.min(prefix.saturating_mul(4));
                }
                parsed => return parsed,
            }
        }
    }

    /// The header at the start of `bytes`, of a file of `len` bytes.
    #[cfg(test)]
    fn parse(path: &Path, bytes: &[u8], len: u64) -> Result<Self, ModelError> {
        let mut cursor = Cursor {
            bytes,
            at: 0,
            path,
            ran_out: false,
        };
        Self::header(&mut cursor, len)
    }

    fn header(cursor: &mut Cursor<'_>, len: u64) -> Result<Self, ModelError> {
        let path = cursor.path;
        if cursor.take(4)? != MAGIC {
            return Err(gguf_error(
                path,
                "does not start with the GGUF magic bytes".to_owned(),
            ));
        }
        let version = cursor.u32()?;
        if !(2..=3).contains(&version) {
            return Err(gguf_error(
                path,
                format!("GGUF version {version}; versions 2 and 3 are supported"),
            ));
        }
        let tensor_count = cursor.u64()?;
        let kv_count = cursor.u64()?;
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = cursor.string()?;
            let type_id = cursor.u32()?;
            metadata.insert(key, cursor.value(type_id, 0)?);
        }
        let mut tensors = HashMap::new();
        for _ in 0..tensor_count {
            let name = cursor.string()?;
            let n_dims = cursor.u32()?;
            if n_dims > 4 {
                return Err(gguf_error(
                    path,
                    format!("tensor `{name}` has {n_dims} dimensions"),
                ));
            }
            let dims = (0..n_dims)
                .map(|_| cursor.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let type_id = cursor.u32()?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| ModelError::Weights {
                path: path.to_owned(),
                tensor: name.clone(),
                message: format!("has ggml type {type_id}, which padfree cannot dequantize"),
                hint: "supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; requantize the model with llama.cpp's llama-quantize",
            })?;
            let offset = cursor.u64()?;
            tensors.insert(
                name.clone(),
                GgufTensorInfo {
                    name,
                    dims,
                    ggml_type,
                    offset,
                },
            );
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(GgufValue::as_u64)
            .filter(|&a| a > 0)
            .unwrap_or(DEFAULT_ALIGNMENT);
        let data_start = (cursor.at as u64).div_ceil(alignment) * alignment;
        Ok(Self {
            path: path.to_owned(),
            data_start: data_start as usize,
            len,
            metadata,
            tensors,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// The values of a tensor as f32, in row-major order of [`GgufTensorInfo::shape`].
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (ggml_type, data) = self.raw(name)?;
        Ok(dequantize(ggml_type, &data))
    }

    /// A tensor's stored bytes (whole blocks), read from the file, and their type.
    pub fn raw(&self, name: &str) -> Result<(GgmlType, Vec<u8>), ModelError> {
        let info = self.tensors.get(name).ok_or_else(|| ModelError::Weights {
            path: self.path.clone(),
            tensor: name.to_owned(),
            message: "is missing".to_owned(),
            hint: "the GGUF file is not a complete Llama-architecture model",
        })?;
        let numel = info.numel();
        let (block_values, block_bytes) = info.ggml_type.block();
        let corrupt = |message: String| ModelError::Weights {
            path: self.path.clone(),
            tensor: name.to_owned(),
            message,
            hint: "the GGUF file is corrupt or truncated; download it again",
        };
        if numel % block_values != 0 {
            return Err(corrupt(format!(
                "{numel} values do not fill whole {block_values}-value blocks"
            )));
        }
        let len = numel / block_values * block_bytes;
        let start = usize::try_from(info.offset)
            .ok()
            .and_then(|offset| offset.checked_add(self.data_start))
            .ok_or_else(|| corrupt(format!("offset {} is out of range", info.offset)))?;
        if start
            .checked_add(len)
            .is_none_or(|end| end as u64 > self.len)
        {
            return Err(corrupt(format!(
                "data at offset {} runs past the end of the file",
                info.offset
            )));
        }
        Ok((info.ggml_type, self.read_at(start as u64, len)?))
    }

    /// `len` bytes of the file from `start`.
    fn read_at(&self, start: u64, len: usize) -> Result<Vec<u8>, ModelError> {
        use std::io::{Read, Seek, SeekFrom};
        let io = |err| ModelError::io(&self.path, err);
        let mut file = std::fs::File::open(&self.path).map_err(io)?;
        file.seek(SeekFrom::Start(start)).map_err(io)?;
        let mut data = vec![0u8; len];
        file.read_exact(&mut data).map_err(io)?;
        Ok(data)
    }
}

/// Dequantizes whole blocks of `ggml_type` to f32 (llama.cpp's reference
/// dequantisation, `dequantize_row_*` in ggml-quants.c).
pub fn dequantize(ggml_type: GgmlType, data: &[u8]) -> Vec<f32> {
    let (block_values, block_bytes) = ggml_type.block();
    let mut out = vec![0.0; data.len() / block_bytes * block_values];
    dequantize_into(ggml_type, data, &mut out);
    out
}

/// [`dequantize`] into `out` (`data`'s whole blocks of values, in order):
/// the fused quantized matmul's tiles dequantise into their own buffers.
pub fn dequantize_into(ggml_type: GgmlType, data: &[u8], out: &mut [f32]) {
    let (block_values, block_bytes) = ggml_type.block();
    let blocks = data.chunks_exact(block_bytes);
    let outs = out.chunks_exact_mut(block_values);
    match ggml_type {
        GgmlType::F32 => blocks
            .zip(outs)
            .for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.zip(outs).for_each(|(b, o)| o[0] = f16(b, 0)),
        GgmlType::Bf16 => blocks
            .zip(outs)
            .for_each(|(b, o)| o[0] = half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::Q4_0 => blocks
            .zip(outs)
            .for_each(|(b, o)| o.copy_from_slice(&dequantize_q4_0(b))),
        GgmlType::Q4_1 => blocks
            .zip(outs)
            .for_each(|(b, o)| o.copy_from_slice(&dequantize_q4_1(b))),
        GgmlType::Q8_0 => blocks
            .zip(outs)
            .for_each(|(b, o)| o.copy_from_slice(&dequantize_q8_0(b))),
        GgmlType::Q4K => blocks
            .zip(outs)
            .for_each(|(b, o)| o.copy_from_slice(&dequantize_q4_k(b))),
        GgmlType::Q6K => blocks
            .zip(outs)
            .for_each(|(b, o)| o.copy_from_slice(&dequantize_q6_k(b))),
    }
}

fn f16(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// `d: f16, qs: [u8; 16]`; value `j` is the low nibble of `qs[j]` (j < 16)
/// or the high nibble of `qs[j - 16]`, minus 8, times `d`.
fn dequantize_q4_0(block: &[u8]) -> [f32; 32] {
    let d = f16(block, 0);
    let qs = &block[2..18];
    std::array::from_fn(|j| {
        let nibble = if j < 16 {
            qs[j] & 0x0F
        } else {
            qs[j - 16] >> 4
        };
        (f32::from(nibble) - 8.0) * d
    })
}

/// `d: f16, m: f16, qs: [u8; 16]`; value = nibble * d + m, nibbles as in Q4_0.
fn dequantize_q4_1(block: &[u8]) -> [f32; 32] {
    let (d, m) = (f16(block, 0), f16(block, 2));
    let qs = &block[4..20];
    std::array::from_fn(|j| {
        let nibble = if j < 16 {
            qs[j] & 0x0F
        } else {
            qs[j - 16] >> 4
        };
        f32::from(nibble) * d + m
    })
}

/// `d: f16, qs: [i8; 32]`; value = qs * d.
fn dequantize_q8_0(block: &[u8]) -> [f32; 32] {
    let d = f16(block, 0);
    std::array::from_fn(|j| f32::from(block[2 + j] as i8) * d)
}

/// The 6-bit scale and minimum of sub-block `j` (of 8) of a Q4_K super-block.
fn scale_min_k4(j: usize, scales: &[u8]) -> (f32, f32) {
    let (scale, min) = if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    };
    (f32::from(scale), f32::from(min))
}

/// `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: four groups of 64
/// values; each group's 32 bytes give the low nibbles to one sub-block and the
/// high nibbles to the next; value = d * scale * nibble - dmin * min.
fn dequantize_q4_k(block: &[u8]) -> Vec<f32> {
    let (d, dmin) = (f16(block, 0), f16(block, 2));
    let scales = &block[4..16];
    let qs = &block[16..144];
    let mut out = Vec::with_capacity(256);
    for group in 0..4 {
        let q = &qs[32 * group..32 * group + 32];
        let (scale_lo, min_lo) = scale_min_k4(2 * group, scales);
        let (scale_hi, min_hi) = scale_min_k4(2 * group + 1, scales);
        out.extend(
            q.iter()
                .map(|&b| d * scale_lo * f32::from(b & 0x0F) - dmin * min_lo),
        );
        out.extend(
            q.iter()
                .map(|&b| d * scale_hi * f32::from(b >> 4) - dmin * min_hi),
        );
    }
    out
}

/// `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`: two halves of 128
/// values; each value is 4 low bits from `ql` and 2 high bits from `qh`, minus
/// 32, times `d` and its 16-value sub-block's scale.
fn dequantize_q6_k(block: &[u8]) -> Vec<f32> {
    let ql = &block[0..128];
    let qh = &block[128..192];
    let scales = &block[192..208];
    let d = f16(block, 208);
    let mut out = vec![0.0f32; 256];
    for half_block in 0..2 {
        let ql = &ql[64 * half_block..];
        let qh = &qh[32 * half_block..];
        let sc = &scales[8 * half_block..];
        let y = &mut out[128 * half_block..128 * half_block + 128];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &value) in q.iter().enumerate() {
                let scale = f32::from(sc[is + 2 * k] as i8);
                y[l + 32 * k] = d * scale * (f32::from(value) - 32.0);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_and_q8_0_by_hand() {
        // d = 0.5 (f16 0x3800); nibbles 0..15 then 15..0.
        let mut block = vec![0x00, 0x38];
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let values = dequantize(GgmlType::Q4_0, &block);
        assert_eq!(values[0], -4.0);
        assert_eq!(values[15], 3.5);
        assert_eq!(values[16], 3.5);
        assert_eq!(values[31], -4.0);

        let mut block = vec![0x00, 0x40]; // d = 2.0
        block.extend((0..32).map(|j: i32| (j - 16) as i8 as u8));
        let values = dequantize(GgmlType::Q8_0, &block);
        assert_eq!(values[0], -32.0);
        assert_eq!(values[31], 30.0);
    }

    #[test]
    fn an_unknown_quantisation_is_named_with_its_tensor() {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend(3u32.to_le_bytes()); // version
        bytes.extend(1u64.to_le_bytes()); // tensors
        bytes.extend(0u64.to_le_bytes()); // metadata entries
        bytes.extend(12u64.to_le_bytes());
        bytes.extend(b"blk.0.attn_q");
        bytes.extend(1u32.to_le_bytes()); // dimensions
        bytes.extend(32u64.to_le_bytes());
        bytes.extend(6u32.to_le_bytes()); // Q5_0
        bytes.extend(0u64.to_le_bytes()); // offset
        let err = GgufFile::parse(Path::new("m.gguf"), &bytes, bytes.len() as u64)
            .expect_err("Q5_0 is not supported");
        let message = err.to_string();
        assert!(
            message.contains("blk.0.attn_q") && message.contains("ggml type 6"),
            "{message}"
        );
    }

    /// A header longer than the first read (the fixture's tokenizer alone
    /// is kilobytes) is read in growing prefixes and gives the same index
    /// and tensor bytes as one read of the whole file.
    #[test]
    fn a_header_longer_than_the_first_read_is_read_in_growing_prefixes() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf/llama-tiny-q4.gguf");
        let whole = GgufFile::open(&path).expect("opens");
        let len = std::fs::metadata(&path).expect("exists").len();
        assert!(whole.data_start > 64, "the header is longer than 64 bytes");
        let stepwise = GgufFile::open_reading(&path, 64).expect("opens in steps");
        assert_eq!(stepwise.data_start, whole.data_start);
        assert_eq!(stepwise.metadata.len(), whole.metadata.len());
        assert_eq!(stepwise.tensors.len(), whole.tensors.len());
        let bytes = std::fs::read(&path).expect("reads");
        for (name, info) in &whole.tensors {
            let (ggml_type, data) = stepwise.raw(name).expect("tensor");
            assert_eq!(ggml_type, info.ggml_type);
            let start = whole.data_start + info.offset as usize;
            assert_eq!(data, bytes[start..start + data.len()], "{name}");
        }
        assert!(len > whole.data_start as u64);
    }

    #[test]
    fn truncated_and_foreign_files_are_refused() {
        let path = Path::new("model.gguf");
        let err = GgufFile::parse(path, b"GGUF\x03\x00", 6).expect_err("truncated");
        assert!(err.to_string().contains("truncated"), "{err}");
        let err = GgufFile::parse(path, b"PK\x03\x04 not gguf", 15).expect_err("not gguf");
        assert!(err.to_string().contains("magic"), "{err}");
    }
}
