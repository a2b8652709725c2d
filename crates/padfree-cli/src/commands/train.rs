//! `padfree train`: loads model, tokenizer and data, runs the trainer with a
//! progress bar, and reports.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Context, anyhow, bail};
use indicatif::{ProgressBar, ProgressStyle};
use padfree_data::{
    FieldNames, Record, SourceRecord, TextTokenizer, TokenizeConfig, read_records,
    read_records_from_str, tokenize_records, unused_text_fields,
};
use padfree_model::check::Fault;
use padfree_model::gguf::GgufFile;
use padfree_model::tensor::{cpu_device, cpu_device_with_checkpointing};
use padfree_model::{LlamaConfig, LlamaModel, tokenizer_from_gguf};
use padfree_train::checkpoint;
use padfree_train::outputs::{
    LOSS_PLOT_FILE, METRICS_FILE, RESULTS_FILE, check_free_space, check_output_dir_outside,
    lock_output_dir, prepare_output_dir,
};
use padfree_train::{
    Batching, EvalSet, EvalStrategy, LogRecord, Observer, StepMetrics, TrainConfig, TrainError,
    Trainer,
};

use crate::args::{ModelSource, TrainJob, is_gguf};

/// `println!` on the lead rank only (the only process, or rank 0 under MPI).
macro_rules! say {
    ($($arg:tt)*) => {
        if crate::ranks::is_lead() {
            println!($($arg)*);
        }
    };
}

/// A warning on standard error, from the lead rank only.
macro_rules! warn {
    ($($arg:tt)*) => {
        if crate::ranks::is_lead() {
            eprintln!("warning: {}", format!($($arg)*));
        }
    };
}

const EMBEDDED_DATA_NAME: &str = "<built-in>/data/gsm-symbolic/train.jsonl";
const EMBEDDED_DATA: &str = include_str!("../../../../data/gsm-symbolic/train.jsonl");
const EMBEDDED_EVAL_DATA_NAME: &str = "<built-in>/data/gsm-symbolic/eval.jsonl";
const EMBEDDED_EVAL_DATA: &str = include_str!("../../../../data/gsm-symbolic/eval.jsonl");
const EMBEDDED_TOKENIZER: &[u8] = include_bytes!("../../../../data/gsm-symbolic/tokenizer.json");
const EMBEDDED_TOKENIZER_CONFIG: &str =
    include_str!("../../../../data/gsm-symbolic/tokenizer_config.json");

/// Exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
pub const INTERRUPTED_EXIT: u8 = 130;

/// The multipack plan's figures, first epoch (and the spread over epochs).
fn print_packing(trainer: &Trainer, config: &TrainConfig) {
    let Batching::Multipack(multipack) = config.batching else {
        return;
    };
    let reports = trainer.plan().packing();
    let Some(first) = reports.first() else {
        return;
    };
    say!(
        "multipack ({}, balance {}): bins of {} tokens; per step {} rank(s) x {} micro-batch(es)",
        multipack.packer.name(),
        multipack.balance.name(),
        multipack.capacity,
        config.world_size,
        config.gradient_accumulation_steps
    );
    for line in first.to_string().lines() {
        say!("  epoch 1: {line}");
    }
    if reports.len() > 1 {
        let efficiency: Vec<f64> = reports.iter().map(|r| r.efficiency).collect();
        let low = efficiency.iter().copied().fold(f64::INFINITY, f64::min);
        let high = efficiency.iter().copied().fold(0.0, f64::max);
        say!(
            "  {} epochs planned: packing efficiency {:.2}%-{:.2}%",
            reports.len(),
            100.0 * low,
            100.0 * high
        );
    }
}

/// Runs the job; `Ok(true)` when it was interrupted.
pub fn run(job: &TrainJob) -> anyhow::Result<bool> {
    if job.embedded_default {
        say!(
            "padfree train: no --model/--config/--tokenizer/--data given, so this is the built-in demo:"
        );
        say!(
            "  the `small` preset (random init) on the shipped maths word problems with the shipped tokenizer;"
        );
        say!(
            "  unless given, --max-steps 100 --learning-rate 1e-3 --warmup-steps 10 --logging-steps 10,"
        );
        say!("  other flags at their HF TrainingArguments defaults\n");
    }
    let comm = crate::ranks::communicator()?;
    let (rank, world_size) = (comm.rank(), comm.world_size());
    if rank == 0 {
        check_output_dir_outside(&job.output_dir, job.resume_from_checkpoint.as_deref())?;
    }
    if world_size > 1 {
        if job.output_dir_defaulted {
            bail!(
                "running as {world_size} ranks: every rank must write to the same place\nHINT: give --output-dir"
            );
        }
        say!(
            "data-parallel: {world_size} ranks over {}, {} threads each",
            comm.backend(),
            rayon::current_num_threads()
        );
    }
    // Before anything of the checkpoint is read (`load` reads its weights).
    let verified = job
        .resume_from_checkpoint
        .as_deref()
        .map(checkpoint::verify)
        .transpose()?;
    let Loaded {
        model,
        tokenizer,
        dataset,
        eval_dataset,
    } = load(job)?;

    let resuming = job.resume_from_checkpoint.is_some();
    // Held to the end of the run, taken before the directory is checked:
    // no other run can slip in between the check and the first write. Taken
    // after loading, so a run refused for its data creates nothing.
    let _lock = if rank == 0 {
        let lock = lock_output_dir(&job.output_dir)?;
        prepare_output_dir(&job.output_dir, job.overwrite_output_dir, resuming)?;
        Some(lock)
    } else {
        None
    };
    // No rank looks into the directory before rank 0 has checked it.
    comm.barrier()?;
    let artifacts = match &tokenizer {
        Some(tokenizer) => tokenizer
            .hf_files()
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .map(|(name, bytes)| (name.to_owned(), bytes))
            .collect(),
        None => Vec::new(),
    };
    let lengths: Vec<usize> = dataset.examples.iter().map(|e| e.len()).collect();
    let mut config = job.train_config(&lengths);
    config.world_size = world_size;
    if let Some(batches) = job.verify_packing {
        // Every rank checks its own first batches; after a resume, the
        // first of the run (the check proves the code on this data, not a
        // step).
        let outcome =
            super::check::verify_packing(&model, &dataset, &config, rank, batches, Fault::None)?;
        if !outcome.isolation_tested {
            warn!(
                "--verify-packing: {}, so keeping examples apart was not tested; training goes on (batches of one example are not packed)\nHINT: `padfree check --per-device-train-batch-size 2` (or more) tests it",
                padfree_model::check::ONE_EXAMPLE
            );
        }
    }
    let (source, locations) = (dataset.source, dataset.locations);
    let mut trainer = match &verified {
        Some(dir) => Trainer::resume_on(
            comm,
            model,
            dir,
            dataset.examples,
            config.clone(),
            &job.output_dir,
            artifacts,
        ),
        None => Trainer::new_on(
            comm,
            model,
            dataset.examples,
            config.clone(),
            &job.output_dir,
            artifacts,
        ),
    }
    .map_err(|err| with_record(err, &source, &locations))?;
    if let (Some(eval), Some(eval_dataset)) = (&job.eval, eval_dataset) {
        let eval = eval.settings;
        say!(
            "evaluation: {} examples in batches of {}, {}{}",
            eval_dataset.examples.len(),
            eval.batch_size,
            match eval.strategy {
                EvalStrategy::Steps(every) => format!("every {every} steps"),
                EvalStrategy::Epoch => "at the end of every epoch".to_owned(),
            },
            if eval.load_best_model_at_end {
                "; the final model is the one with the lowest eval_loss"
            } else {
                ""
            }
        );
        trainer = trainer.with_eval(EvalSet {
            examples: eval_dataset.examples,
            settings: eval,
        })?;
    }
    if rank == 0 {
        check_free_space(&job.output_dir, trainer.bytes_to_write())?;
    }
    print_packing(&trainer, &config);
    say!(
        "training: {} optimizer steps ({} from step {}), attention {}{}, output {}",
        trainer.plan().len(),
        trainer.plan().len() - trainer.global_step(),
        trainer.global_step(),
        job.train.attention.name(),
        if job.gradient_checkpointing {
            ", gradient checkpointing"
        } else {
            ""
        },
        job.output_dir.display()
    );
    let mut progress = Progress::new(
        trainer.plan().len(),
        trainer.global_step(),
        rank,
        trainer.last_checkpoint(),
    )?;
    let summary = trainer.train(&mut progress)?;
    progress.bar.finish_and_clear();
    say!("\n***** train metrics *****\n{summary}");
    if summary.interrupted {
        match trainer.last_checkpoint() {
            Some(dir) => say!(
                "\ninterrupted after step {}: saved {}\nresume with: --resume-from-checkpoint {}",
                summary.global_step,
                dir.display(),
                dir.display()
            ),
            None => say!("\ninterrupted before the first step: nothing saved"),
        }
        return Ok(true);
    }
    let out = &job.output_dir;
    let which = match (&summary.best_model, summary.best_model_loaded) {
        (Some(best), true) => format!(
            " (the best: step {}, eval_loss {:.4}, from {})",
            best.step,
            best.eval_loss,
            summary
                .best_model_checkpoint
                .as_deref()
                .map_or_else(String::new, |dir| dir.display().to_string())
        ),
        (Some(_), false) => " (the best: the last step's)".to_owned(),
        (None, _) => String::new(),
    };
    say!(
        "\nwrote {} (model.safetensors{which}, config.json, tokenizer files), {}, {}, {}",
        out.display(),
        out.join(METRICS_FILE).display(),
        out.join(RESULTS_FILE).display(),
        out.join(LOSS_PLOT_FILE).display()
    );
    Ok(false)
}

/// What a training or benchmark run starts from.
pub struct Loaded {
    pub model: LlamaModel,
    pub tokenizer: Option<TextTokenizer>,
    pub dataset: padfree_data::TokenizedDataset,
    /// The held-out set, with an eval strategy.
    pub eval_dataset: Option<padfree_data::TokenizedDataset>,
}

/// Loads the model, tokenizer and data of `job`, printing what was loaded.
pub fn load(job: &TrainJob) -> anyhow::Result<Loaded> {
    let (data_name, records) = read_data(
        "data",
        job.data.as_deref(),
        (EMBEDDED_DATA_NAME, EMBEDDED_DATA),
        &job.fields,
    )?;
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
        Some(_)
            if job.tokenizer.is_some()
                || records
                    .iter()
                    .any(|r| !matches!(r.record, Record::Tokenized { .. })) =>
        {
            Some(match &job.tokenizer {
                Some(path) => load_tokenizer_file(path)?,
                None => embedded_tokenizer()?,
            })
        }
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
    let model = load_model(job, preset_vocab)?;
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
    warn_unused_fields(&data_name, &records);
    let dataset = tokenize_records(&data_name, &records, tokenizer.as_ref(), &tokenize)?;
    say!("data: {}: {}", data_name.display(), dataset.report);
    let eval_dataset = match &job.eval {
        Some(eval) => {
            let (name, records) = read_data(
                "eval-data",
                eval.data.as_deref(),
                (EMBEDDED_EVAL_DATA_NAME, EMBEDDED_EVAL_DATA),
                &job.fields,
            )?;
            warn_unused_fields(&name, &records);
            let eval_dataset = tokenize_records(&name, &records, tokenizer.as_ref(), &tokenize)?;
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

/// The records of `path` (given by `--flag`), or without one those of the
/// shipped file `embedded` (its name and text), with the name they are
/// reported under.
fn read_data(
    flag: &str,
    path: Option<&Path>,
    (embedded_name, embedded_text): (&str, &str),
    fields: &FieldNames,
) -> anyhow::Result<(PathBuf, Vec<SourceRecord>)> {
    Ok(match path {
        Some(path) => {
            match std::fs::metadata(path) {
                Ok(meta) if meta.is_dir() => bail!(
                    "--{flag} {}: a directory, not a data file\nHINT: give a JSONL file (one JSON object per line) or a JSON array",
                    path.display()
                ),
                Ok(_) => {}
                Err(err) => bail!(
                    "--{flag} {}: {err}\nHINT: give an existing, readable JSONL or JSON file",
                    path.display()
                ),
            }
            (path.to_owned(), read_records(path, fields)?)
        }
        None => (
            PathBuf::from(embedded_name),
            read_records_from_str(Path::new(embedded_name), embedded_text, fields)?,
        ),
    })
}

/// Names the text fields of `file` that no record's shape trains on.
fn warn_unused_fields(file: &Path, records: &[SourceRecord]) {
    for field in unused_text_fields(records) {
        warn!(
            "{}: field `{}` holds text in {} of {} records (the first at {}), but their record shape does not use it: it is not trained on\nHINT: to train on it, build the prompt from it with --prompt-template (e.g. --prompt-template '{{{}}}\\n{{question}}' --completion-field answer), name it with --prompt-field/--completion-field or --dataset-text-field, or drop it from the file to silence this",
            file.display(),
            field.name,
            field.records,
            records.len(),
            field.first,
            field.name
        );
    }
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
    let own = load_tokenizer_file(&own_file)?;
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
fn load_model(job: &TrainJob, preset_vocab: Option<usize>) -> anyhow::Result<LlamaModel> {
    let device = if job.gradient_checkpointing {
        cpu_device_with_checkpointing()
    } else {
        cpu_device(true)
    };
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
    Ok(match &job.model {
        ModelSource::HfDir(dir) => {
            check_memory(&LlamaConfig::from_hf_file(&dir.join("config.json"))?)?;
            LlamaModel::from_hf_dir(dir, &device)?
        }
        ModelSource::Gguf(path) => LlamaModel::from_gguf(path, &device)?,
        ModelSource::Init(name) => {
            let mut config = init_config(name)?;
            if let Some(vocab) = preset_vocab {
                config.vocab_size = vocab;
            }
            check_memory(&config)?;
            LlamaModel::init(&config, job.train.seed, &device)?
        }
    })
}

/// Refuses, before allocating it, a model whose training state alone (f32
/// weights, gradients and AdamW's two moments: 16 bytes a parameter) would
/// not fit in this machine's memory, instead of an allocator abort later.
fn check_memory(config: &LlamaConfig) -> anyhow::Result<()> {
    let needed = 16.0 * config.num_parameters() as f64;
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map(|kib| kib * 1024.0);
    if let Some(total) = total
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

fn embedded_tokenizer() -> anyhow::Result<TextTokenizer> {
    Ok(TextTokenizer::from_bytes(
        "<built-in>/data/gsm-symbolic/tokenizer.json",
        EMBEDDED_TOKENIZER,
        Some(EMBEDDED_TOKENIZER_CONFIG.to_owned()),
    )?)
}

fn load_tokenizer_file(path: &Path) -> anyhow::Result<TextTokenizer> {
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

/// The progress bar, log lines and Ctrl-C.
struct Progress {
    bar: ProgressBar,
    signals: Arc<Mutex<Signals>>,
    rank: usize,
    /// A test hook: `PADFREE_WRITE_DELAY_MS=N` waits N ms as each write
    /// begins (after saying so on stderr), so a test can signal during it.
    write_delay: Option<std::time::Duration>,
}

/// What Ctrl-C (SIGTERM, SIGHUP) has asked for, and what is being written.
///
/// The first signal stops training after the current step and saves it. A
/// second one quits at once, unless a checkpoint or the final model is
/// being written: then it quits as soon as that is complete, so no save is
/// lost half-way. A third one during the write abandons it (its temporary
/// directory is removed at the next start). The handler and the trainer
/// change this under one lock, so a write cannot begin between the
/// handler's look and its exit.
#[derive(Debug, Default)]
struct Signals {
    stop: bool,
    writing: bool,
    quit_after_write: bool,
    last_saved: Option<PathBuf>,
}

impl Signals {
    fn last_saved(&self) -> String {
        match &self.last_saved {
            Some(dir) => format!("; resume with --resume-from-checkpoint {}", dir.display()),
            None => String::new(),
        }
    }
}

fn lock(signals: &Mutex<Signals>) -> std::sync::MutexGuard<'_, Signals> {
    signals.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Progress {
    fn new(
        total_steps: usize,
        done: usize,
        rank: usize,
        resumed_from: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let bar = if crate::ranks::is_lead() {
            ProgressBar::new(total_steps as u64)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}",
            )?
            .progress_chars("=> "),
        );
        bar.set_position(done as u64);
        let signals = Arc::new(Mutex::new(Signals {
            last_saved: resumed_from.map(Path::to_owned),
            ..Signals::default()
        }));
        let shared = Arc::clone(&signals);
        ctrlc::set_handler(move || {
            let mut signals = lock(&shared);
            if !signals.stop {
                signals.stop = true;
                eprintln!(
                    "\nCtrl-C or SIGTERM: stopping after this step and saving a checkpoint (again: quit without saving)"
                );
            } else if signals.writing && !signals.quit_after_write {
                signals.quit_after_write = true;
                eprintln!(
                    "\nCtrl-C again: a checkpoint is being written; quitting as soon as it is complete (a third time: abandon it)"
                );
            } else if signals.writing {
                eprintln!(
                    "\nCtrl-C a third time: quitting, abandoning the checkpoint being written (its temporary directory is removed at the next start){}",
                    signals.last_saved()
                );
                std::process::exit(i32::from(INTERRUPTED_EXIT));
            } else {
                // Every file is written through a temporary and a rename, and
                // nothing is being written: nothing half-written remains.
                eprintln!("\nCtrl-C again: quitting now{}", signals.last_saved());
                std::process::exit(i32::from(INTERRUPTED_EXIT));
            }
        })
        .context("installing the Ctrl-C handler")?;
        let write_delay = std::env::var("PADFREE_WRITE_DELAY_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .map(std::time::Duration::from_millis);
        Ok(Self {
            bar,
            signals,
            rank,
            write_delay,
        })
    }
}

impl Progress {
    /// A line above the bar; printed plainly when the bar is hidden (output
    /// not a terminal), where indicatif would drop it.
    fn line(&self, text: &str) {
        if self.bar.is_hidden() {
            say!("{text}");
        } else {
            self.bar.println(text);
        }
    }
}

impl Observer for Progress {
    fn on_step(&mut self, metrics: &StepMetrics, _total_steps: usize) {
        if crate::ranks::injected_fault(self.rank, metrics.step) {
            eprintln!(
                "rank {}: PADFREE_FAULT: exiting after step {}",
                self.rank, metrics.step
            );
            std::process::exit(1);
        }
        self.bar.set_position(metrics.step as u64);
        self.bar.set_message(format!(
            "{:.2} it/s, {:.0} tok/s, loss {:.4}",
            1.0 / metrics.seconds.max(1e-9),
            metrics.real_tokens as f64 / metrics.seconds.max(1e-9),
            metrics.loss
        ));
    }

    fn on_log(&mut self, record: &LogRecord) {
        self.line(&record.to_string());
    }

    fn on_save(&mut self, dir: &Path) {
        lock(&self.signals).last_saved = Some(dir.to_owned());
        self.line(&format!("saved {}", dir.display()));
    }

    fn on_writing(&mut self, writing: bool) {
        let mut signals = lock(&self.signals);
        signals.writing = writing;
        if !writing && signals.quit_after_write {
            eprintln!(
                "the write is complete: quitting (second Ctrl-C){}",
                signals.last_saved()
            );
            std::process::exit(i32::from(INTERRUPTED_EXIT));
        }
        drop(signals);
        if let (true, Some(delay)) = (writing, self.write_delay) {
            eprintln!("PADFREE_WRITE_DELAY_MS: writing");
            std::thread::sleep(delay);
        }
    }

    fn on_note(&mut self, note: &str) {
        self.line(&format!("note: {note}"));
    }

    fn on_remove(&mut self, dir: &Path) {
        self.line(&format!("removed {} (--save-total-limit)", dir.display()));
    }

    fn stop_requested(&self) -> bool {
        lock(&self.signals).stop
    }
}
