//! Hugging Face weights: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`, with HF tensor names.
//!
//! Read and written by the parameter table (`table.rs`); the model hands
//! over its parameters and never lets this file see the model type.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{TensorView, View};
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use super::gguf::GgmlType;
use super::quantized::QuantMatrix;
use super::table::ParamSpec;
use crate::error::ModelError;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// The bytes of every weight file of a checkpoint directory.
pub(crate) struct WeightFiles {
    files: Vec<(PathBuf, Vec<u8>)>,
}

impl WeightFiles {
    /// Reads `model.safetensors`, or every shard of the index, in `dir`.
    pub(crate) fn read(dir: &Path) -> Result<Self, ModelError> {
        let files = weight_files(dir)?
            .into_iter()
            .map(|path| {
                std::fs::read(&path)
                    .map(|bytes| (path.clone(), bytes))
                    .map_err(|err| ModelError::io(&path, err))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { files })
    }

    /// Reads the one safetensors file at `path`.
    pub(crate) fn read_file(path: &Path) -> Result<Self, ModelError> {
        let bytes = std::fs::read(path).map_err(|err| ModelError::io(path, err))?;
        Ok(Self {
            files: vec![(path.to_owned(), bytes)],
        })
    }

    /// Parses every file's header once.
    pub(crate) fn parse(&self) -> Result<Checkpoint<'_>, ModelError> {
        Checkpoint::parse(&self.files)
    }
}

/// A tensor of a frozen base as held: f32, or its own F16/BF16 bytes.
pub(crate) enum Held {
    F32(Vec<f32>),
    Half(QuantMatrix),
}

/// Every tensor of `specs` from the weight files of `dir`, one file in
/// memory at a time (a frozen base's weights are held at 2 bytes, and the
/// file being read comes on top of them, never all files at once). The
/// matrices `keep_half` names stay in their bytes when the file has them in
/// F16 or BF16; the rest become f32.
pub(crate) fn read_frozen(
    dir: &Path,
    specs: &[ParamSpec],
    keep_half: impl Fn(&ParamSpec) -> bool,
) -> Result<HashMap<String, Held>, ModelError> {
    const WRONG_CONFIG: &str =
        "the checkpoint does not match config.json; use the config.json saved with these weights";
    let paths = weight_files(dir)?;
    let mut held = HashMap::with_capacity(specs.len());
    for path in &paths {
        let file = vec![(
            path.clone(),
            std::fs::read(path).map_err(|err| ModelError::io(path, err))?,
        )];
        let checkpoint = Checkpoint::parse(&file)?;
        for spec in specs
            .iter()
            .filter(|s| checkpoint.location.contains_key(&s.hf_name))
        {
            let tensor = match keep_half(spec)
                .then(|| checkpoint.read_half(spec))
                .transpose()?
            {
                Some(Some(half)) => Held::Half(half),
                _ => Held::F32(checkpoint.read(spec)?),
            };
            held.insert(spec.hf_name.clone(), tensor);
        }
    }
    if let Some(spec) = specs.iter().find(|s| !held.contains_key(&s.hf_name)) {
        return Err(ModelError::Weights {
            path: paths.first().cloned().unwrap_or_default(),
            tensor: spec.hf_name.clone(),
            message: "is missing".to_owned(),
            hint: WRONG_CONFIG,
        });
    }
    Ok(held)
}

/// Every weight file of a checkpoint, parsed once, and which file holds which
/// tensor.
pub(crate) struct Checkpoint<'a> {
    files: Vec<(&'a Path, SafeTensors<'a>)>,
    /// Tensor name -> index into `files`.
    location: HashMap<String, usize>,
}

/// The paths of a checkpoint's weight files: the shards of the index, or the single file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index_path = dir.join(INDEX_FILE);
    let names = if index_path.exists() {
        shard_names(&index_path)?
    } else {
        vec![SINGLE_FILE.to_owned()]
    };
    Ok(names.iter().map(|name| dir.join(name)).collect())
}

impl<'a> Checkpoint<'a> {
    fn parse(files: &'a [(PathBuf, Vec<u8>)]) -> Result<Self, ModelError> {
        let mut parsed = Vec::with_capacity(files.len());
        let mut location = HashMap::new();
        for (file_index, (path, bytes)) in files.iter().enumerate() {
            let tensors = SafeTensors::deserialize(bytes).map_err(|err| format_error(path, err))?;
            for name in tensors.names() {
                location.insert(name.to_owned(), file_index);
            }
            parsed.push((path.as_path(), tensors));
        }
        Ok(Self {
            files: parsed,
            location,
        })
    }

    /// The tensor of `spec` as f32, checked against its shape.
    pub(crate) fn read(&self, spec: &ParamSpec) -> Result<Vec<f32>, ModelError> {
        const WRONG_CONFIG: &str = "the checkpoint does not match config.json; use the config.json saved with these weights";
        self.read_named(&spec.hf_name, &spec.hf_shape, WRONG_CONFIG)
    }

    /// The tensor `name` as f32, checked against `shape`; `wrong_config`
    /// says what to do when it is missing or shaped otherwise.
    pub(crate) fn read_named(
        &self,
        name: &str,
        shape: &[usize],
        wrong_config: &'static str,
    ) -> Result<Vec<f32>, ModelError> {
        let (path, view) = self.view(name, shape, wrong_config)?;
        to_f32(view.dtype(), view.data()).ok_or_else(|| ModelError::Weights {
            path: path.to_owned(),
            tensor: name.to_owned(),
            message: format!("has dtype {:?}", view.dtype()),
            hint: "padfree reads F32, F16 and BF16 weights; convert the checkpoint first",
        })
    }

    /// The matrix of `spec` in its own 2-byte values when it is F16 or BF16
    /// (a frozen LoRA base held at 2 bytes a weight), `None` for other dtypes.
    fn read_half(&self, spec: &ParamSpec) -> Result<Option<QuantMatrix>, ModelError> {
        const WRONG_CONFIG: &str = "the checkpoint does not match config.json; use the config.json saved with these weights";
        let (path, view) = self.view(&spec.hf_name, &spec.hf_shape, WRONG_CONFIG)?;
        let ggml_type = match view.dtype() {
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::Bf16,
            _ => return Ok(None),
        };
        let [rows, cols] = spec.matrix_shape();
        // Safetensors and GGUF both store them little-endian, row-major.
        QuantMatrix::new(ggml_type, rows, cols, view.data().to_vec())
            .map(Some)
            .ok_or_else(|| ModelError::Weights {
                path: path.to_owned(),
                tensor: spec.hf_name.clone(),
                message: format!(
                    "holds {} bytes for {rows} x {cols} values",
                    view.data().len()
                ),
                hint: "the file is damaged; download or save it again",
            })
    }

    /// The file holding `name` and its view, checked against `shape`.
    fn view(
        &self,
        name: &str,
        shape: &[usize],
        wrong_config: &'static str,
    ) -> Result<(&'a Path, TensorView<'a>), ModelError> {
        let mismatch = |path: &Path, message: String| ModelError::Weights {
            path: path.to_owned(),
            tensor: name.to_owned(),
            message,
            hint: wrong_config,
        };
        let first = self.files.first().map_or(Path::new(""), |(path, _)| path);
        let missing = |path: &Path| mismatch(path, "is missing".to_owned());
        let file_index = *self.location.get(name).ok_or_else(|| missing(first))?;
        let (path, tensors) = &self.files[file_index];
        let view = tensors.tensor(name).map_err(|_| missing(path))?;
        if view.shape() != shape {
            let message = format!("has shape {:?}, the config needs {shape:?}", view.shape());
            return Err(mismatch(path, message));
        }
        Ok((path, view))
    }
}

fn shard_names(index_path: &Path) -> Result<Vec<String>, ModelError> {
    let text =
        std::fs::read_to_string(index_path).map_err(|err| ModelError::io(index_path, err))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).map_err(|err| ModelError::Format {
            path: index_path.to_owned(),
            message: err.to_string(),
            hint: "the index must be the JSON transformers writes for sharded checkpoints",
        })?;
    let map = index
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| ModelError::Format {
            path: index_path.to_owned(),
            message: "has no `weight_map` object".to_owned(),
            hint: "the index must be the JSON transformers writes for sharded checkpoints",
        })?;
    let mut names: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

fn format_error(path: &Path, err: safetensors::SafeTensorError) -> ModelError {
    ModelError::Format {
        path: path.to_owned(),
        message: format!("not a valid safetensors file: {err}"),
        hint: "the file may be truncated or not a safetensors file; download or save it again",
    }
}

fn to_f32(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    let words = |size: usize| data.chunks_exact(size);
    match dtype {
        Dtype::F32 => Some(
            words(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        Dtype::F16 => Some(
            words(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        Dtype::BF16 => Some(
            words(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        _ => None,
    }
}

/// Writes `config.json` and `model.safetensors` (f32) into `dir`, each to a
/// temporary file first and renamed into place, so an interrupted save never
/// leaves a half-written file under the final name.
///
/// `tensors`: HF name, HF shape and values of every parameter, in table order.
pub(crate) fn write_hf_dir<'a>(
    dir: &Path,
    config_json: &serde_json::Value,
    tensors: impl Iterator<Item = (&'a str, &'a [usize], Box<dyn Fn() -> Vec<f32> + 'a>)>,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|err| ModelError::io(dir, err))?;
    let config = serde_json::to_vec_pretty(config_json).unwrap_or_default();
    write_atomically(&dir.join("config.json"), &config)?;

    write_f32_file(&dir.join(SINGLE_FILE), tensors, Some(("format", "pt")))
}

/// One f32 tensor of a file being written, its values made only when its
/// turn comes: the writer holds one tensor's bytes at a time, not the file's.
struct LazyF32<'a> {
    shape: Vec<usize>,
    values: Box<dyn Fn() -> Vec<f32> + 'a>,
}

impl View for LazyF32<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(
            (self.values)()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        )
    }
    fn data_len(&self) -> usize {
        4 * self.shape.iter().product::<usize>()
    }
}

/// Writes a safetensors file of f32 tensors `(name, shape, values)` to
/// `path` through a temporary file renamed into place, one tensor in memory
/// at a time (a whole-file buffer doubled the memory of a save: 1 GiB more
/// on rank 0 for SmolLM2-135M's weights). `values` is called once, when the
/// tensor is written, and must give `shape`'s product of values. The bytes
/// are those [`serialize_f32`] gives (tested).
pub fn write_f32_file<'a>(
    path: &Path,
    tensors: impl Iterator<Item = (&'a str, &'a [usize], Box<dyn Fn() -> Vec<f32> + 'a>)>,
    metadata: Option<(&str, &str)>,
) -> Result<(), ModelError> {
    let views: Vec<(&str, LazyF32<'a>)> = tensors
        .map(|(name, shape, values)| {
            (
                name,
                LazyF32 {
                    shape: shape.to_vec(),
                    values,
                },
            )
        })
        .collect();
    let metadata = metadata.map(|(key, value)| HashMap::from([(key.to_owned(), value.to_owned())]));
    safetensors::serialize_to_file(views, metadata, path).map_err(|err| match err {
        SafeTensorError::IoError(err) => ModelError::io(path, err),
        err => ModelError::Format {
            path: path.to_owned(),
            message: err.to_string(),
            hint: "this is a bug in padfree; please report it",
        },
    })
}

/// A safetensors file of f32 tensors (name, shape, values), the bytes of
/// `path` (named in errors).
pub(crate) fn serialize_f32<'a>(
    path: &Path,
    tensors: impl Iterator<Item = (&'a str, &'a [usize], Vec<f32>)>,
) -> Result<Vec<u8>, ModelError> {
    let tensors: Vec<(&str, &[usize], Vec<u8>)> = tensors
        .map(|(name, shape, values)| {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name, shape, bytes)
        })
        .collect();
    let views: BTreeMap<&str, TensorView<'_>> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            let view = TensorView::new(Dtype::F32, shape.to_vec(), bytes).map_err(|err| {
                ModelError::Format {
                    path: path.to_owned(),
                    message: format!("tensor `{name}`: {err}"),
                    hint: "this is a bug in padfree; please report it",
                }
            })?;
            Ok((*name, view))
        })
        .collect::<Result<_, ModelError>>()?;
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize(views, Some(metadata)).map_err(|err| ModelError::Format {
        path: path.to_owned(),
        message: err.to_string(),
        hint: "this is a bug in padfree; please report it",
    })
}

/// Writes `bytes` to `path` through a temporary file in the same directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = path.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
    std::fs::write(&temp, bytes).map_err(|err| ModelError::io(&temp, err))?;
    std::fs::rename(&temp, path).map_err(|err| ModelError::io(path, err))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streaming writer against the whole-buffer serialiser: the same
    /// bytes, tensors given out of name order, one of them empty.
    #[test]
    fn streamed_file_is_the_serialised_buffer() {
        let tensors: Vec<(&str, Vec<usize>, Vec<f32>)> = vec![
            ("model.norm.weight", vec![3], vec![1.0, -2.5, 3.25]),
            ("lm_head.weight", vec![2, 2], vec![0.5, 0.25, -0.125, 8.0]),
            ("empty", vec![0, 4], vec![]),
        ];
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("x.safetensors");
        write_f32_file(
            &path,
            tensors.iter().map(|(name, shape, values)| {
                let values: Box<dyn Fn() -> Vec<f32>> = Box::new(move || values.clone());
                (*name, shape.as_slice(), values)
            }),
            Some(("format", "pt")),
        )
        .expect("writes");
        let buffer = serialize_f32(
            &path,
            tensors
                .iter()
                .map(|(name, shape, values)| (*name, shape.as_slice(), values.clone())),
        )
        .expect("serialises");
        assert_eq!(std::fs::read(&path).expect("reads"), buffer);
        // Nothing but the file is left in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).expect("lists").count(), 1);
    }
}
