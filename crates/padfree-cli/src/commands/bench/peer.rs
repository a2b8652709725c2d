//! The Hugging Face peer of `padfree bench`: the initial weights, batches
//! and settings exported for `bench/hf_peer/hf_peer.py`, its environment
//! (`.venv-peer/`, made by `bench/hf_peer/setup.sh`), and its runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use padfree_train::checkpoint::write_atomically;
use padfree_train::{AttentionMode, Trainer};

use crate::args::BenchMode;

use super::ModeResult;
use crate::args::BenchJob;
use crate::commands::load;

/// The repository the peer's script lives in: `PADFREE_REPO`, else the
/// working directory when it holds the script (a binary carried to another
/// machine, run in a copy of the repository), else the one it was built from.
pub(super) fn repository() -> PathBuf {
    if let Some(dir) = std::env::var_os("PADFREE_REPO") {
        return PathBuf::from(dir);
    }
    if Path::new("bench/hf_peer/hf_peer.py").is_file() {
        return PathBuf::from(".");
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python of `.venv-peer/`, made by `bench/hf_peer/setup.sh` if missing.
pub(super) fn environment() -> anyhow::Result<PathBuf> {
    let root = repository();
    let python = root.join(".venv-peer/bin/python");
    if python.is_file() {
        return Ok(python);
    }
    let setup = root.join("bench/hf_peer/setup.sh");
    println!(
        "making {} with {} (torch and transformers from PyPI; several GB, minutes) ...",
        root.join(".venv-peer").display(),
        setup.display()
    );
    let status = Command::new("bash")
        .arg(&setup)
        .status()
        .with_context(|| format!("running {}", setup.display()))?;
    if !status.success() || !python.is_file() {
        bail!(
            "{} failed ({status})\nHINT: it needs python3 with venv and pip, and PyPI; or pass --peer-python with an environment that has torch 2.15 and transformers 5.24",
            setup.display()
        );
    }
    Ok(python)
}

/// Exports the initial weights, batches and settings every padfree mode
/// trains with, for the HF peer: `model/` (the base in f32), `adapter/`
/// (PEFT's files of the initial adapters, with `--use-peft`),
/// `batches.jsonl`, `settings.json`; returns the folder.
pub(super) fn export(args: &BenchJob, output_dir: &Path) -> anyhow::Result<PathBuf> {
    let peer_dir = output_dir.join("peer");
    let job = args.train_job(BenchMode {
        attention: AttentionMode::Varlen,
        multipack: false,
        ranks: 1,
    })?;
    let loaded = load::load(&job, None)?;
    // A GGUF base in f32, dequantised from its blocks: what HF trains on.
    loaded.model.save_hf_dir(&peer_dir.join("model"))?;
    // The adapters every padfree mode starts from, for PEFT to load.
    if args.lora.is_some() {
        loaded.model.save_adapter(&peer_dir.join("adapter"))?;
    }
    let examples = loaded.dataset.examples.clone();
    let trainer = Trainer::new(
        loaded.model,
        loaded.dataset.examples,
        job.train.clone(),
        &peer_dir,
        Vec::new(),
    )?;
    let mut lines = String::new();
    for step in trainer.plan().steps() {
        let mut batch: Vec<serde_json::Value> = Vec::new();
        for i in step.examples() {
            let example = examples.get(i)?;
            batch.push(
                serde_json::json!({"input_ids": example.input_ids(), "labels": example.labels()}),
            );
        }
        lines.push_str(&serde_json::json!({ "examples": batch }).to_string());
        lines.push('\n');
    }
    write_atomically(&peer_dir.join("batches.jsonl"), lines.as_bytes())?;
    let c = &job.train;
    let settings = serde_json::json!({
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "learning_rate": c.learning_rate, "weight_decay": c.weight_decay,
        "adam_beta1": c.adam_beta1, "adam_beta2": c.adam_beta2, "adam_epsilon": c.adam_epsilon,
        "max_grad_norm": c.max_grad_norm, "seed": c.seed, "threads": args.threads,
        "timing_warmup_steps": args.timing_warmup_steps,
        "adapter": args.lora.as_ref().map(|_| "adapter"),
    });
    write_atomically(
        &peer_dir.join("settings.json"),
        &serde_json::to_vec_pretty(&settings)?,
    )?;
    Ok(peer_dir)
}

/// One run of the HF peer (`padded` or `flattening`).
pub(super) fn run_mode(
    args: &BenchJob,
    python: &Path,
    peer_dir: &Path,
    mode: &str,
) -> anyhow::Result<ModeResult> {
    let script = repository().join("bench/hf_peer/hf_peer.py");
    println!("running HF transformers, {mode} ...");
    let out = peer_dir.join(format!("result-{mode}.json"));
    let mut command = Command::new(python);
    // HF runs in the user's environment, without padfree's malloc tuning.
    crate::allocator::user_environment(&mut command);
    let output = command
        .arg(&script)
        .args([
            "--peer-dir",
            &peer_dir.display().to_string(),
            "--mode",
            mode,
            "--out",
            &out.display().to_string(),
            // HF on the machine's CUDA GPU when padfree ran on a GPU.
            "--device",
            if args.device.is_gpu() { "cuda" } else { "cpu" },
        ])
        // HF's Trainer in bf16=True when padfree runs --bf16.
        .args((args.precision == padfree_model::Precision::Bf16).then_some("--bf16"))
        .env("OMP_NUM_THREADS", args.threads.to_string())
        .output()
        .with_context(|| format!("starting {}", python.display()))?;
    if !output.status.success() {
        bail!(
            "the HF peer ({mode}) failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
    Ok(serde_json::from_str::<ModeResult>(&text)?)
}
