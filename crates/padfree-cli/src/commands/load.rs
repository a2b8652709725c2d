//! What a run starts from, for `train`, `check` and `bench`: the model
//! (a preset, an HF directory, a GGUF file or a checkpoint), its tokenizer
//! and the tokenized data, each refused by its flag when unusable, with
//! warnings for what would be silently lost (unused text fields, a
//! tokenizer that is not the model's own).

use std::path::Path;

use anyhow::{Context, anyhow, bail};
use padfree_data::{TextTokenizer, TokenizeConfig, holds_text_records};
use padfree_model::device::{DeviceChoice, open_device};
use padfree_model::gguf::GgufFile;
use padfree_model::kernels::{self, kernel_bodies};
use padfree_model::lora::peft::read_config as read_adapter_config;
use padfree_model::tensor::{Device, cpu_device};
use padfree_model::{LlamaConfig, LlamaModel, LoraConfig, is_adapter_dir, tokenizer_from_gguf};
use padfree_train::{Communicator, TrainError};

use super::data::{
    EMBEDDED_DATA, EMBEDDED_DATA_NAME, EMBEDDED_EVAL_DATA, EMBEDDED_EVAL_DATA_NAME, data_set,
};
use crate::args::{ModelSource, TrainJob, is_gguf};

const EMBEDDED_TOKENIZER: &[u8] = include_bytes!("../../../../data/gsm-symbolic/tokenizer.json");
const EMBEDDED_TOKENIZER_CONFIG: &str =
    include_str!("../../../../data/gsm-symbolic/tokenizer_config.json");

/// What a training or benchmark run starts from.
pub struct Loaded {
    pub model: LlamaModel,
    pub tokenizer: Option<TextTokenizer>,
    pub dataset: padfree_data::DataSet,
    /// The held-out set, with an eval strategy.
    pub eval_dataset: Option<padfree_data::DataSet>,
}

/// Loads the model, tokenizer and data of `job`, printing what was loaded;
/// `comm`: the ranks of a data-parallel job, which share the tokenization
/// of a cold start through the data cache.
pub fn load(job: &TrainJob, comm: Option<&dyn Communicator>) -> anyhow::Result<Loaded> {
    // First: a device that cannot be opened is refused before any work.
    let device = training_device(job)?;
    // Whether the data needs a tokenizer; a text data file's first record
    // says so, without the file read whole here (`data_set` may leave it
    // to a helper process).
    let text_data = match &job.data {
        Some(path) => {
            super::data::exists("data", path)?;
            holds_text_records(path, &job.fields)?
        }
        None => true,
    };
    let resuming = job.resume_from_checkpoint.is_some();
    // A preset's vocabulary grows to hold the tokenizer (the given one, else
    // the shipped one, unless the data is all token ids); it never shrinks,
    // so a preset keeps the size its benchmarks were measured at. On resume
    // the same rule says what the checkpoint's model must be.
    let preset = match &job.model {
        ModelSource::Init(name) => LlamaConfig::named(name).map(|config| (name, config)),
        _ => None,
    };
    let preset_tokenizer = match preset {
        Some(_) if job.tokenizer.is_some() || text_data => Some(match &job.tokenizer {
            Some(path) => load_tokenizer_file(path)?,
            None => embedded_tokenizer()?,
        }),
        _ => None,
    };
    let preset_vocab = match (&preset, &preset_tokenizer) {
        (Some((name, config)), Some(tokenizer)) if tokenizer.vocab_size() > config.vocab_size => {
            if !resuming {
                say!(
                    "vocabulary: {} tokens, from the tokenizer {} (the preset `{name}` has {}; it grows to hold the tokenizer)",
                    tokenizer.vocab_size(),
                    tokenizer.source_name(),
                    config.vocab_size
                );
            }
            Some(tokenizer.vocab_size())
        }
        _ => None,
    };
    let model = load_model(job, &device, preset_vocab)?;
    let config = model.config().clone();
    say!(
        "model: {} ({} layers, hidden {}, {} heads / {} kv heads, vocab {}, {:.1}M parameters)",
        describe_model(job),
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
        config.num_parameters() as f64 / 1e6
    );
    let tokenizer = match preset_tokenizer {
        // On resume the checkpoint's own tokenizer files (the same tokens).
        Some(tokenizer) if !resuming => Some(tokenizer),
        _ => load_tokenizer(job, config.vocab_size)?,
    };
    if let Some(tokenizer) = &tokenizer {
        check_vocabularies(tokenizer, &config)?;
        warn_if_not_the_models_tokenizer(job, tokenizer)?;
        say!(
            "tokenizer: {} ({} tokens)",
            tokenizer.source_name(),
            tokenizer.vocab_size()
        );
    }
    let max_seq_len = job.max_seq_len.min(config.max_position_embeddings);
    let tokenize = TokenizeConfig {
        train_on_inputs: job.train_on_inputs,
        use_chat_template: job.use_chat_template,
        max_seq_len,
        overlong: job.overlong,
        vocab_limit: config.vocab_size,
    };
    let (data_name, dataset) = data_set(
        (
            "data",
            job.data.as_deref(),
            (EMBEDDED_DATA_NAME, EMBEDDED_DATA),
        ),
        (job.data_cache.as_ref(), &job.fields),
        comm,
        tokenizer.as_ref(),
        &tokenize,
    )?;
    say!("data: {}: {}", data_name.display(), dataset.report);
    let eval_dataset = match &job.eval {
        Some(eval) => {
            let (name, eval_dataset) = data_set(
                (
                    "eval-data",
                    eval.data.as_deref(),
                    (EMBEDDED_EVAL_DATA_NAME, EMBEDDED_EVAL_DATA),
                ),
                (job.data_cache.as_ref(), &job.fields),
                comm,
                tokenizer.as_ref(),
                &tokenize,
            )?;
            say!("eval data: {}: {}", name.display(), eval_dataset.report);
            Some(eval_dataset)
        }
        None => None,
    };
    Ok(Loaded {
        model,
        tokenizer,
        dataset,
        eval_dataset,
    })
}

/// A trainer error that names an example by its index, named by its record
/// (`file:line N`) instead.
pub fn with_record(err: TrainError, source: &Path, locations: &[String]) -> anyhow::Error {
    if let TrainError::ExampleTooLong { index, .. } = &err
        && let Some(location) = locations.get(*index)
    {
        return anyhow!("{}:{location}: {err}", source.display());
    }
    err.into()
}

/// Warns when `--tokenizer` maps ids to other tokens than the model's own
/// tokenizer (a GGUF's, an HF directory's or a checkpoint's): the model
/// would read every id as another token.
fn warn_if_not_the_models_tokenizer(job: &TrainJob, given: &TextTokenizer) -> anyhow::Result<()> {
    if job.tokenizer.is_none() {
        return Ok(());
    }
    let own_file = match (&job.resume_from_checkpoint, &job.model) {
        (Some(dir), _) => Some(dir.join("tokenizer.json")),
        (None, ModelSource::Gguf(path)) => Some(path.clone()),
        (None, ModelSource::HfDir(dir)) => Some(dir.join("tokenizer.json")),
        (None, ModelSource::Init(_)) => None,
    };
    let Some(own_file) = own_file.filter(|f| f.is_file()) else {
        return Ok(());
    };
    // A model without a readable tokenizer of its own (a GGUF file written
    // without one) has nothing to compare the given one with.
    let Ok(own) = load_tokenizer_file(&own_file) else {
        return Ok(());
    };
    let difference = given.differences_from(&own);
    if let (true, Some((id, ours, theirs))) = (difference.disagrees(), &difference.first) {
        warn!(
            "--tokenizer {} is not the model's own tokenizer ({}): {} of the {} ids they share stand for other tokens (id {id} is {ours:?} here, {theirs:?} to the model); vocabularies {} and {}\nHINT: leave out --tokenizer to use the model's own, or give the one it was trained with",
            given.source_name(),
            own.source_name(),
            difference.differing,
            difference.sizes.0.min(difference.sizes.1),
            difference.sizes.0,
            difference.sizes.1
        );
    }
    Ok(())
}

fn describe_model(job: &TrainJob) -> String {
    if let Some(dir) = &job.resume_from_checkpoint {
        return format!("{} (resumed)", dir.display());
    }
    match &job.model {
        ModelSource::HfDir(path) | ModelSource::Gguf(path) => path.display().to_string(),
        ModelSource::Init(name) => format!("{name} (random init, seed {})", job.train.seed),
    }
}

/// `preset_vocab`: the vocabulary size a preset takes (from the tokenizer).
/// The autodiff device of `--device` (each data-parallel rank its own
/// adapter, unless the flag names one), opened and named in the log with
/// the body every kernel runs there.
fn training_device(job: &TrainJob) -> anyhow::Result<Device> {
    let device = match job.device {
        DeviceChoice::Cpu => cpu_device(true),
        choice => {
            let choice = match crate::ranks::local_rank() {
                Some((rank, size)) if size > 1 => choice.with_default_index(rank),
                _ => choice,
            };
            let opened = open_device(choice)?;
            println_rank(&format!(
                "device: {} = {}",
                opened.choice, opened.description
            ));
            opened.device.autodiff()
        }
    };
    if job.device.is_gpu() {
        let bodies: Vec<String> = kernel_bodies(&device)
            .into_iter()
            .map(|(kernel, body)| format!("{kernel}: {body}"))
            .collect();
        say!("kernels: {}", bodies.join("; "));
    }
    Ok(device)
}

/// Every rank says which adapter it opened.
fn println_rank(line: &str) {
    match crate::ranks::local_rank() {
        Some((rank, size)) if size > 1 => println!("[local rank {rank}] {line}"),
        _ => println!("{line}"),
    }
}

fn load_model(
    job: &TrainJob,
    device: &Device,
    preset_vocab: Option<usize>,
) -> anyhow::Result<LlamaModel> {
    let device = device.clone();
    if let Some(dir) = &job.resume_from_checkpoint
        && is_adapter_dir(dir)
    {
        // A LoRA checkpoint holds the adapters; the frozen base comes from
        // --model, or from where the adapter config says it was.
        let base = match (&job.model, job.model_given) {
            (source, true) => source.clone(),
            (source, false) => match read_adapter_config(dir)?.1 {
                Some(path) if Path::new(&path).exists() => {
                    ModelSource::from_model_path(Path::new(&path))
                }
                // A preset's adapters name the preset (`tiny`).
                Some(name) if LlamaConfig::named(&name).is_some() => ModelSource::Init(name),
                Some(other) => bail!(
                    "{}: the adapters' base model `{other}` (adapter_config.json's base_model_name_or_path) is neither a file nor a preset\nHINT: give the base model the adapters were trained on with --model (or --config for a preset)",
                    dir.display()
                ),
                None => source.clone(),
            },
        };
        let mut model = load_base(job, &base, &device, preset_vocab)?;
        model
            .load_adapter(dir)
            .with_context(|| format!("loading the adapters of the checkpoint {}", dir.display()))?;
        return Ok(model);
    }
    if let Some(dir) = &job.resume_from_checkpoint {
        let model = LlamaModel::from_hf_dir(dir, &device)
            .with_context(|| format!("loading the checkpoint {}", dir.display()))?;
        if job.model_given {
            let given = match &job.model {
                ModelSource::HfDir(path) => LlamaConfig::from_hf_file(&path.join("config.json"))?,
                ModelSource::Gguf(path) => LlamaModel::from_gguf(path, &cpu_device(false))?
                    .config()
                    .clone(),
                ModelSource::Init(name) => {
                    let mut config = init_config(name)?;
                    if let Some(vocab) = preset_vocab {
                        config.vocab_size = vocab;
                    }
                    config
                }
            };
            if let Some(difference) = shape_difference(&given, model.config()) {
                bail!(
                    "{}: {difference} of the checkpoint {}\nHINT: the checkpoint holds the model: give the run's own --model/--config, or leave them out",
                    describe_model(&TrainJob {
                        resume_from_checkpoint: None,
                        ..job.clone()
                    }),
                    dir.display()
                );
            }
        }
        return Ok(model);
    }
    let model = load_base(job, &job.model, &device, preset_vocab)?;
    // On resume the checkpoint's adapters are loaded instead (above).
    match job.train.lora.as_ref() {
        Some(lora) if job.resume_from_checkpoint.is_none() => {
            let base = match &job.model {
                ModelSource::HfDir(path) | ModelSource::Gguf(path) => std::path::absolute(path)
                    .unwrap_or_else(|_| path.clone())
                    .display()
                    .to_string(),
                ModelSource::Init(name) => name.clone(),
            };
            let model = model.with_lora(lora, job.train.seed, &base)?;
            say!(
                "lora: r {}, alpha {}, dropout {}, on {} ({:.2}M trainable parameters; the model's {:.1}M are frozen)",
                lora.r,
                lora.alpha,
                lora.dropout,
                lora.targets
                    .iter()
                    .map(|t| t.module())
                    .collect::<Vec<_>>()
                    .join(","),
                lora.num_parameters(model.config()) as f64 / 1e6,
                model.config().num_parameters() as f64 / 1e6
            );
            Ok(model)
        }
        _ => Ok(model),
    }
}

/// The model `source` names, its memory checked first (for LoRA training
/// when the run has adapters).
fn load_base(
    job: &TrainJob,
    source: &ModelSource,
    device: &Device,
    preset_vocab: Option<usize>,
) -> anyhow::Result<LlamaModel> {
    let lora = job.train.lora.as_ref();
    Ok(match source {
        // LoRA on a base in F16 or BF16 files: the projections stay in
        // their 2 bytes a weight, multiplied by the CPU's fused kernel.
        ModelSource::HfDir(dir)
            if lora.is_some() && !job.dequantize_base && kernels::on_cpu(device) =>
        {
            let config = LlamaConfig::from_hf_file(&dir.join("config.json"))?;
            let bytes = if declares_half(dir) { 2.0 } else { 4.0 };
            check_memory(&config, lora, bytes)?;
            let model = LlamaModel::from_hf_dir_frozen(dir, device)?;
            if model.is_quantized() {
                say!(
                    "base: the decoder layers' projections kept in their 16-bit values and frozen: {:.1} MiB of weights held ({:.1} MiB in f32)",
                    model.weight_bytes() as f64 / 1048576.0,
                    4.0 * model.config().num_parameters() as f64 / 1048576.0
                );
            }
            model
        }
        ModelSource::HfDir(dir) => {
            check_memory(
                &LlamaConfig::from_hf_file(&dir.join("config.json"))?,
                lora,
                4.0,
            )?;
            LlamaModel::from_hf_dir(dir, device)?
        }
        // QLoRA: adapters on a base kept in its GGUF blocks, multiplied by
        // the CPU's fused kernel.
        ModelSource::Gguf(path)
            if lora.is_some() && !job.dequantize_base && kernels::on_cpu(device) =>
        {
            let file = GgufFile::open(path)?;
            let model = LlamaModel::from_gguf_quantized(&file, device)?;
            let dense = 4 * model.config().num_parameters();
            say!(
                "base: the decoder layers' projections kept in their GGUF blocks and frozen: {:.1} MiB of weights held ({:.1} MiB in f32)",
                model.weight_bytes() as f64 / 1048576.0,
                dense as f64 / 1048576.0
            );
            model
        }
        ModelSource::Gguf(path) => LlamaModel::from_gguf(path, device)?,
        ModelSource::Init(name) => {
            let mut config = init_config(name)?;
            if let Some(vocab) = preset_vocab {
                config.vocab_size = vocab;
            }
            check_memory(&config, lora, 4.0)?;
            LlamaModel::init(&config, job.train.seed, device)?
        }
    })
}

/// Whether `config.json` says the weights are 16-bit (transformers'
/// `torch_dtype`, or `dtype` since transformers 5).
fn declares_half(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .is_some_and(|config| {
            ["torch_dtype", "dtype"].iter().any(|key| {
                matches!(
                    config.get(key).and_then(serde_json::Value::as_str),
                    Some("bfloat16" | "float16")
                )
            })
        })
}

/// Refuses, before allocating it, a model whose training state alone (f32
/// weights, gradients and AdamW's two moments: 16 bytes a parameter; with
/// LoRA, 4 bytes a frozen weight and 16 an adapter's) would not fit in this
/// machine's memory, instead of an allocator abort later.
/// `frozen_bytes`: bytes a frozen weight is held in (4, or 2 for a 16-bit base).
fn check_memory(
    config: &LlamaConfig,
    lora: Option<&LoraConfig>,
    frozen_bytes: f64,
) -> anyhow::Result<()> {
    let needed = match lora {
        Some(lora) => {
            frozen_bytes * config.num_parameters() as f64
                + 16.0 * lora.num_parameters(config) as f64
        }
        None => 16.0 * config.num_parameters() as f64,
    };
    if let Some(total) = machine_memory()
        && needed > total
    {
        bail!(
            "the model has {:.1}M parameters: training needs at least {:.1} GiB for its weights, gradients and AdamW's moments (f32), more than this machine's {:.1} GiB of memory\nHINT: choose a smaller model or --config, or a machine with more memory",
            config.num_parameters() as f64 / 1e6,
            needed / 1073741824.0,
            total / 1073741824.0
        );
    }
    Ok(())
}

/// This machine's memory in bytes (Linux's `MemTotal`).
pub fn machine_memory() -> Option<f64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map(|kib| kib * 1024.0)
}

/// The config of `--config NAME`: a preset or a config.json.
fn init_config(name: &str) -> anyhow::Result<LlamaConfig> {
    Ok(match LlamaConfig::named(name) {
        Some(config) => config,
        None if Path::new(name).is_file() => LlamaConfig::from_hf_file(Path::new(name))?,
        None => {
            bail!(
                "--config {name}: neither a preset ({}) nor a config.json file",
                LlamaConfig::PRESETS.join(", ")
            )
        }
    })
}

/// The first size in which two models differ, in words.
fn shape_difference(given: &LlamaConfig, saved: &LlamaConfig) -> Option<String> {
    [
        ("vocabulary", given.vocab_size, saved.vocab_size),
        ("hidden size", given.hidden_size, saved.hidden_size),
        (
            "MLP width",
            given.intermediate_size,
            saved.intermediate_size,
        ),
        ("layers", given.num_hidden_layers, saved.num_hidden_layers),
        (
            "heads",
            given.num_attention_heads,
            saved.num_attention_heads,
        ),
        (
            "key/value heads",
            given.num_key_value_heads,
            saved.num_key_value_heads,
        ),
    ]
    .into_iter()
    .find(|(_, a, b)| a != b)
    .map(|(what, a, b)| format!("{what} {a}, not the {b}"))
}

/// --tokenizer, else the model's own, else (for the demo or a random-init
/// model) the shipped one; `None` only for pre-tokenized data with no tokenizer anywhere.
fn load_tokenizer(job: &TrainJob, vocab_size: usize) -> anyhow::Result<Option<TextTokenizer>> {
    if let Some(path) = &job.tokenizer {
        return load_tokenizer_file(path).map(Some);
    }
    if let Some(dir) = &job.resume_from_checkpoint
        && dir.join("tokenizer.json").is_file()
    {
        return load_tokenizer_file(&dir.join("tokenizer.json")).map(Some);
    }
    match &job.model {
        // A GGUF without tokenizer metadata (`tokenizer.ggml.model`) can
        // still train on pre-tokenized records; text ones are refused when
        // they are tokenized, naming --tokenizer.
        ModelSource::Gguf(path) if GgufFile::open(path)?.get("tokenizer.ggml.model").is_none() => {
            Ok(None)
        }
        ModelSource::Gguf(path) => load_tokenizer_file(path).map(Some),
        ModelSource::HfDir(dir) if dir.join("tokenizer.json").is_file() => {
            load_tokenizer_file(&dir.join("tokenizer.json")).map(Some)
        }
        ModelSource::HfDir(_) => Ok(None),
        // A randomly initialised model has no tokenizer of its own: the
        // shipped one, when the model's vocabulary can hold it (a smaller
        // model can still train on pre-tokenized data).
        ModelSource::Init(_) => {
            let shipped = embedded_tokenizer()?;
            Ok((shipped.vocab_size() <= vocab_size).then_some(shipped))
        }
    }
}

pub(super) fn embedded_tokenizer() -> anyhow::Result<TextTokenizer> {
    Ok(TextTokenizer::from_bytes(
        "<built-in>/data/gsm-symbolic/tokenizer.json",
        EMBEDDED_TOKENIZER,
        Some(EMBEDDED_TOKENIZER_CONFIG.to_owned()),
    )?)
}

pub(super) fn load_tokenizer_file(path: &Path) -> anyhow::Result<TextTokenizer> {
    if path.is_dir() {
        let inside = path.join("tokenizer.json");
        if !inside.is_file() {
            bail!(
                "--tokenizer {}: a directory without tokenizer.json\nHINT: give a tokenizer.json (with tokenizer_config.json beside it) or a .gguf file",
                path.display()
            );
        }
        return Ok(TextTokenizer::from_file(&inside)?);
    }
    if !path.is_file() {
        bail!(
            "--tokenizer {}: no such file\nHINT: give a tokenizer.json (with tokenizer_config.json beside it) or a .gguf file",
            path.display()
        );
    }
    if !is_gguf(path) {
        return Ok(TextTokenizer::from_file(path)?);
    }
    let file = GgufFile::open(path)?;
    let tokenizer = tokenizer_from_gguf(&file)?;
    let token_of = |key: &str| -> Option<String> {
        let id = file.get(key)?.as_u64()?;
        tokenizer.id_to_token(u32::try_from(id).ok()?)
    };
    let eos = token_of("tokenizer.ggml.eos_token_id");
    let bos = token_of("tokenizer.ggml.bos_token_id");
    let template = file
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .map(str::to_owned);
    Ok(TextTokenizer::new(
        tokenizer,
        &path.display().to_string(),
        eos.as_deref(),
        bos.as_deref(),
        template.as_deref(),
    )?)
}

fn check_vocabularies(tokenizer: &TextTokenizer, config: &LlamaConfig) -> anyhow::Result<()> {
    if tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "{}: the tokenizer has {} tokens but the model's vocabulary has {}\nHINT: use the tokenizer that belongs to the model (--tokenizer), or a model config with vocab_size >= {}",
            tokenizer.source_name(),
            tokenizer.vocab_size(),
            config.vocab_size,
            tokenizer.vocab_size()
        );
    }
    Ok(())
}
