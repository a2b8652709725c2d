//! `padfree train` end to end: bad input gets a clear error and a non-zero
//! exit; a tiny run writes an HF model and reports; resuming through the CLI
//! continues bit-identically; SmolLM2-135M fine-tunes from its GGUF.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{
    data_line, first_records, padfree, repo, scratch, stderr, tiny_config_with_shipped_vocab,
    two_steps, two_steps_in,
};

/// A `tiny` config with the shipped vocabulary and the first `records` of
/// the shipped training data, written into `dir`.
fn tiny_model_and_data(dir: &Path, records: usize) -> (String, PathBuf) {
    let config = tiny_config_with_shipped_vocab(dir);
    let data = dir.join("train.jsonl");
    std::fs::write(&data, first_records(records)).expect("write data");
    (config, data)
}

#[test]
fn bad_data_files_name_the_file_line_and_field() {
    let dir_guard = scratch("bad-data");
    let dir = dir_guard.path();
    let config = tiny_config_with_shipped_vocab(dir);
    let out = dir.join("out").display().to_string();
    let cases: [(&str, &[u8], &str); 3] = [
        (
            "broken.jsonl",
            b"{\"question\": \"q\", \"answer\": \"a\"}\n{\"question\": \"q\"\n",
            "broken.jsonl:line 2: not valid JSON",
        ),
        (
            "missing.jsonl",
            b"{\"question\": \"q\"}\n",
            "missing.jsonl:line 1: field `answer` is missing",
        ),
        (
            "latin1.jsonl",
            b"{\"question\": \"caf\xe9\", \"answer\": \"a\"}\n",
            "latin1.jsonl:line 1: not valid UTF-8",
        ),
    ];
    for (name, bytes, expected) in cases {
        let data = dir.join(name);
        std::fs::write(&data, bytes).expect("write data");
        let output = padfree(&[
            "train",
            "--config",
            &config,
            "--data",
            &data.display().to_string(),
            "--output-dir",
            &out,
        ]);
        assert!(!output.status.success(), "{name} must fail");
        assert!(
            stderr(&output).contains(expected),
            "{name}: {}",
            stderr(&output)
        );
    }
    assert!(
        !dir.join("out").exists(),
        "nothing written for a refused run"
    );
}

#[test]
fn a_tokenizer_larger_than_the_model_vocabulary_is_refused() {
    let dir_guard = scratch("vocab");
    let dir = dir_guard.path();
    let tokenizer = repo("data/gsm-symbolic/tokenizer.json")
        .display()
        .to_string();
    // A config.json states its vocabulary: a larger tokenizer is refused.
    let config = dir.join("config.json");
    let mut spec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tiny_config_with_shipped_vocab(dir)).expect("config"),
    )
    .expect("json");
    spec["vocab_size"] = 128.into();
    std::fs::write(&config, spec.to_string()).expect("write config");
    let output = padfree(&[
        "train",
        "--config",
        &config.display().to_string(),
        "--tokenizer",
        &tokenizer,
        "--output-dir",
        &dir.join("o").display().to_string(),
    ]);
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(
        err.contains("the tokenizer has 4096 tokens but the model's vocabulary has 128"),
        "{err}"
    );
    assert!(err.contains("HINT:"), "{err}");
    // A preset smaller than the tokenizer (128 tokens for `tiny`) grows to
    // hold it: the shipped one when none is given.
    let output = padfree(&[
        "train",
        "--config",
        "tiny",
        "--max-steps",
        "1",
        "--output-dir",
        &dir.join("preset").display().to_string(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("vocabulary: 4096 tokens, from the tokenizer")
            && stdout.contains("vocab 4096"),
        "{stdout}"
    );
}

#[test]
fn conflicting_or_invalid_flags_are_refused() {
    let cases: [(&[&str], &str); 15] = [
        (&["train", "--fp16"], "HINT: use --bf16"),
        (
            &["train", "--max-seq-len", "1"],
            "--max-seq-len 1: an example needs at least 2 tokens",
        ),
        (
            &["bench", "--modes", "padded,varlen,padded"],
            "--modes: `padded` is given twice (the 3rd entry",
        ),
        (
            &["train", "--completion-field", "answer"],
            "--prompt-field <PROMPT_FIELD>|--prompt-template <PROMPT_TEMPLATE>",
        ),
        (
            &[
                "train",
                "--prompt-template",
                "{passage",
                "--completion-field",
                "answer",
            ],
            "--prompt-template \"{passage\": `{passage` is not closed",
        ),
        (
            &["train", "--model", "no-such-model"],
            "--model no-such-model: No such file or directory",
        ),
        (
            &["train", "--padding-free", "false", "--attention", "varlen"],
            "--padding-free false",
        ),
        (
            &["train", "--per-device-train-batch-size", "0"],
            "--per-device-train-batch-size: must be at least 1",
        ),
        (
            &["train", "--adam-beta2", "1.5"],
            "--adam-beta2: 1.5 is outside [0, 1)",
        ),
        (
            &["bench", "--peer", "--peer-python", "python3"],
            "cannot be used with",
        ),
        (&["bench", "--repeats", "0"], "--repeats"),
        (
            &["train", "--multipack", "--no-shuffle"],
            "--no-shuffle: multipack",
        ),
        (
            &["train", "--save-total-limit", "0"],
            "--save-total-limit: must be at least 1",
        ),
        (
            &[
                "train",
                "--eval-data",
                "held-out.jsonl",
                "--eval-steps",
                "0",
            ],
            "--eval-steps: is 0",
        ),
        (
            &["train", "--verify-packing", "--verify-packing-batches", "0"],
            "--verify-packing-batches must be at least 1",
        ),
    ];
    for (args, expected) in cases {
        let output = padfree(args);
        assert!(!output.status.success(), "{args:?}");
        assert!(
            stderr(&output).contains(expected),
            "{args:?}: {}",
            stderr(&output)
        );
    }
}

/// Multipack, padding-free and padded, through the binary: the plan's
/// figures in the log, the packing efficiency in every metrics row, the
/// same examples (same real tokens) in both modes.
#[test]
fn multipack_trains_padded_and_padding_free_on_the_same_bins() {
    let dir_guard = scratch("multipack");
    let dir = dir_guard.path();
    let (config, data) = tiny_model_and_data(dir, 40);
    let (config, data) = (config.as_str(), data.display().to_string());
    let mut real_tokens = Vec::new();
    for padding_free in ["true", "false"] {
        let out = dir.join(padding_free).display().to_string();
        let output = padfree(&[
            "train",
            "--config",
            config,
            "--data",
            &data,
            "--multipack",
            "--max-tokens-per-batch",
            "600",
            "--multipack-balance",
            "attention",
            "--padding-free",
            padding_free,
            "--max-steps",
            "4",
            "--logging-steps",
            "1",
            "--save-strategy",
            "no",
            "--output-dir",
            &out,
        ]);
        assert!(output.status.success(), "{}", stderr(&output));
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            stdout
                .contains("multipack (best-fit decreasing, balance attention): bins of 600 tokens"),
            "{stdout}"
        );
        assert!(stdout.contains("packing efficiency"), "{stdout}");
        let metrics =
            std::fs::read_to_string(Path::new(&out).join("metrics.jsonl")).expect("metrics");
        let rows: Vec<serde_json::Value> = metrics
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        assert_eq!(rows.len(), 4);
        for row in &rows {
            let efficiency = row["packing_efficiency"]
                .as_f64()
                .expect("packing_efficiency");
            assert!(efficiency > 0.0 && efficiency <= 1.0, "{row}");
        }
        let results: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(Path::new(&out).join("train_results.json")).expect("results"),
        )
        .expect("json");
        real_tokens.push(results["real_tokens"].as_u64().expect("real_tokens"));
    }
    assert_eq!(real_tokens[0], real_tokens[1]);
}

#[test]
fn save_total_limit_keeps_the_newest_checkpoints() {
    let dir_guard = scratch("limit");
    let dir = dir_guard.path();
    let (config, data) = tiny_model_and_data(dir, 8);
    let out = dir.join("out");
    let output = padfree(&[
        "train",
        "--config",
        &config,
        "--data",
        data.to_str().expect("utf-8"),
        "--max-steps",
        "4",
        "--per-device-train-batch-size",
        "2",
        "--save-steps",
        "1",
        "--save-total-limit",
        "2",
        "--output-dir",
        out.to_str().expect("utf-8"),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let removed = format!(
        "removed {} (--save-total-limit)",
        out.join("checkpoint-1").display()
    );
    assert!(stdout.contains(&removed), "{stdout}");
    let mut left: Vec<String> = std::fs::read_dir(&out)
        .expect("out")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("checkpoint-"))
        .collect();
    left.sort();
    // Steps 1-4 were saved (the last one too, as HF does); 1 and 2 were removed.
    assert_eq!(left, ["checkpoint-3", "checkpoint-4"]);
}

#[test]
fn a_tiny_run_writes_an_hf_model_and_resumes_bit_identically() {
    let dir_guard = scratch("tiny-run");
    let dir = dir_guard.path();
    let (config, data) = tiny_model_and_data(dir, 24);
    let (config, data) = (config.as_str(), data.display().to_string());
    let common = [
        "train",
        "--config",
        config,
        "--data",
        &data,
        "--max-steps",
        "6",
        "--per-device-train-batch-size",
        "4",
        "--learning-rate",
        "1e-3",
        "--logging-steps",
        "2",
        "--save-steps",
        "3",
        "--gradient-accumulation-steps",
        "2",
    ];
    let straight = dir.join("straight").display().to_string();
    let output = padfree(&[&common[..], &["--output-dir", &straight]].concat());
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("train_tokens_per_second"), "{stdout}");
    assert!(stdout.contains("'loss': "), "log lines missing: {stdout}");
    for file in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "metrics.jsonl",
        "loss.png",
        "train_results.json",
        "checkpoint-3/optimizer.safetensors",
    ] {
        assert!(Path::new(&straight).join(file).is_file(), "{file} missing");
    }
    // A second run into the same directory needs --overwrite-output-dir.
    let again = padfree(&[&common[..], &["--output-dir", &straight]].concat());
    assert!(!again.status.success() && stderr(&again).contains("--overwrite-output-dir"));

    let resumed = dir.join("resumed").display().to_string();
    let checkpoint = Path::new(&straight)
        .join("checkpoint-3")
        .display()
        .to_string();
    let output = padfree(
        &[
            &common[..],
            &[
                "--output-dir",
                &resumed,
                "--resume-from-checkpoint",
                &checkpoint,
            ],
        ]
        .concat(),
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let losses = |dir: &str| -> Vec<u64> {
        let state: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(Path::new(dir).join("trainer_state.json")).expect("state"),
        )
        .expect("json");
        state["step_losses"]
            .as_array()
            .expect("losses")
            .iter()
            .map(|l| l.as_f64().expect("f64").to_bits())
            .collect()
    };
    assert_eq!(losses(&resumed), losses(&straight));
    let weights =
        |dir: &str| std::fs::read(Path::new(dir).join("model.safetensors")).expect("weights");
    assert!(
        weights(&resumed) == weights(&straight),
        "final weights differ after resume"
    );
}

#[test]
fn smollm2_fine_tunes_from_its_gguf() {
    let Some(gguf) = common::smollm2_gguf() else {
        return;
    };
    let dir_guard = scratch("smollm2");
    let dir = dir_guard.path();
    let data = common::chat_data(dir);
    let out = dir.join("out");
    let output = padfree(&[
        "train",
        "--model",
        &gguf.display().to_string(),
        "--data",
        &data.display().to_string(),
        "--use-chat-template",
        "--max-steps",
        "3",
        "--per-device-train-batch-size",
        "2",
        "--learning-rate",
        "1e-4",
        "--logging-steps",
        "1",
        "--save-strategy",
        "no",
        "--output-dir",
        &out.display().to_string(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("trainer_state.json")).expect("state"),
    )
    .expect("json");
    let losses: Vec<f64> = state["step_losses"]
        .as_array()
        .expect("losses")
        .iter()
        .filter_map(|l| l.as_f64())
        .collect();
    println!("SmolLM2 fine-tuning losses: {losses:?}");
    assert_eq!(losses.len(), 3);
    // A pretrained model starts far below the uniform loss ln(49152) = 10.8,
    // and three steps on the same two examples lower it.
    assert!(losses[0] < 5.0, "{losses:?}");
    assert!(losses[2] < losses[0], "{losses:?}");
    let tokenizer: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("tokenizer_config.json")).expect("tokenizer config"),
    )
    .expect("json");
    assert!(
        tokenizer["chat_template"].is_string(),
        "the chat template travels with the model"
    );
}

/// `padfree bench` of the tiny config on 24 shipped records, 1 warm-up and
/// 2 timed steps of 4 examples, 1 thread, plus `extra` flags. Returns the
/// scratch guard, the output directory and the process output.
fn bench(name: &str, extra: &[&str]) -> (tempfile::TempDir, PathBuf, std::process::Output) {
    let dir_guard = scratch(name);
    let dir = dir_guard.path();
    let (config, data) = tiny_model_and_data(dir, 24);
    let out = dir.join("out");
    let (data, out_arg) = (data.display().to_string(), out.display().to_string());
    let mut args = vec!["bench", "--config", &config, "--data", &data];
    args.extend(common::QUICK_BENCH);
    args.extend(["--threads", "1", "--output-dir", &out_arg]);
    args.extend_from_slice(extra);
    let output = padfree(&args);
    (dir_guard, out, output)
}

#[test]
fn bench_runs_every_mode_on_the_same_batches_and_writes_the_report() {
    let (_guard, out, output) = bench("bench", &["--repeats", "2"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    for expected in [
        "round 2 of 2",
        "real tokens/s, 2 runs",
        "padfree, padded",
        "metadata derived in every layer",
        "metadata from the collator",
        "% of ideal",
        "losses agree on fixed batches (tolerance 1e-4 relative, the padded vs padding-free training tests'",
    ] {
        assert!(
            stdout.contains(expected),
            "`{expected}` missing from:\n{stdout}"
        );
    }
    for file in ["bench.md", "bench.json", "bench.png"] {
        assert!(out.join(file).is_file(), "{file} missing");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("bench.json")).expect("json"))
            .expect("valid json");
    let results = report["results"].as_array().expect("results");
    assert_eq!(results.len(), 3, "one median run per mode");
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 6, "every mode twice");
    let field = |r: &serde_json::Value, name: &str| r[name].as_f64().unwrap_or(f64::NAN);
    // MFU is against the faster of the calibrations before and after the runs.
    let peak = &report["peak"];
    let (before, after) = (
        field(peak, "calibrated_before"),
        field(peak, "calibrated_after"),
    );
    assert!(before > 0.0 && after > 0.0, "{peak}");
    assert_eq!(
        field(peak, "calibrated_gflops"),
        before.max(after),
        "{peak}"
    );
    let (padded, varlen) = (&results[0], &results[2]);
    assert_eq!(
        field(padded, "real_tokens"),
        field(varlen, "real_tokens"),
        "the same timed batches"
    );
    assert!(
        field(padded, "fed_tokens") > field(padded, "real_tokens"),
        "the padded run fed pads"
    );
    assert_eq!(field(varlen, "fed_tokens"), field(varlen, "real_tokens"));
    // Every step's wall time, the warm-up's too, and the timed ones sum to
    // the runtime.
    for run in runs {
        let seconds: Vec<f64> = run["step_seconds"]
            .as_array()
            .expect("step_seconds")
            .iter()
            .map(|s| s.as_f64().expect("seconds"))
            .collect();
        assert_eq!(
            seconds.len(),
            run["step_losses"].as_array().expect("losses").len()
        );
        assert!(seconds.iter().all(|&s| s > 0.0), "{seconds:?}");
        let timed: f64 = seconds
            [seconds.len() - run["timed_steps"].as_u64().expect("steps") as usize..]
            .iter()
            .sum();
        assert!((timed - field(run, "train_runtime")).abs() < 1e-9, "{run}");
    }
    let losses = |r: &serde_json::Value| -> Vec<f64> {
        r["step_losses"]
            .as_array()
            .expect("losses")
            .iter()
            .filter_map(|l| l.as_f64())
            .collect()
    };
    assert_eq!(losses(varlen).len(), 3, "warm-up step plus two timed steps");
    for (a, b) in losses(padded).iter().zip(losses(varlen)) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "padded {a} vs varlen {b}");
    }
}

/// `padfree bench --modes ...-multipack`: the rows on multipack bins, padded
/// and padding-free on the same bins, beside the fixed-batch row.
#[test]
fn bench_has_multipack_rows() {
    let (_guard, out, output) = bench(
        "bench-multipack",
        &["--modes", "varlen,varlen-multipack,padded-multipack"],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    for expected in [
        "padfree, padding-free, multipack bins",
        "padfree, padded, multipack bins",
        "padding-free on multipack bins vs on fixed batches",
    ] {
        assert!(
            stdout.contains(expected),
            "`{expected}` missing from:\n{stdout}"
        );
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("bench.json")).expect("json"))
            .expect("valid json");
    let results = report["results"].as_array().expect("results");
    let field = |r: &serde_json::Value, name: &str| r[name].as_f64().unwrap_or(f64::NAN);
    let (packed, padded_packed) = (&results[1], &results[2]);
    assert_eq!(packed["mode"], "varlen-multipack");
    assert_eq!(
        field(packed, "real_tokens"),
        field(padded_packed, "real_tokens"),
        "the same bins"
    );
    assert!(field(padded_packed, "fed_tokens") > field(padded_packed, "real_tokens"));
}

/// The HF peer runs in the user's environment: without the malloc tunables
/// padfree sets for itself (that would tune the peer too), with the user's
/// own. A stand-in "python" records its environment and answers as the
/// peer script does.
#[test]
fn the_peer_runs_without_padfrees_malloc_tuning() {
    let dir_guard = scratch("peer-env");
    let dir = dir_guard.path();
    let (config, data) = tiny_model_and_data(dir, 8);
    let env_log = dir.join("peer-env.txt");
    let fake_python = dir.join("python");
    let result = r#"{"mode":"hf-x","timed_steps":1,"train_runtime":1.0,"real_tokens":1,"fed_tokens":1,"samples":1,"real_tokens_per_second":1.0,"fed_tokens_per_second":1.0,"samples_per_second":1.0,"padding_fraction":0.0,"peak_memory_bytes":null,"final_loss":1.0,"step_losses":[1.0,1.0]}"#;
    std::fs::write(
        &fake_python,
        format!(
            "#!/bin/sh\nenv > '{}'\nwhile [ $# -gt 0 ]; do if [ \"$1\" = --out ]; then echo '{result}' > \"$2\"; fi; shift; done\n",
            env_log.display()
        ),
    )
    .expect("write the stand-in");
    let made_executable = Command::new("chmod")
        .arg("+x")
        .arg(&fake_python)
        .status()
        .expect("chmod");
    assert!(made_executable.success());
    let out = dir.join("out");
    let output = Command::new(env!("CARGO_BIN_EXE_padfree"))
        .args([
            "bench",
            "--config",
            &config,
            "--data",
            &data.display().to_string(),
            "--modes",
            "varlen",
            "--max-steps",
            "1",
            "--timing-warmup-steps",
            "1",
            "--threads",
            "1",
            "--peer-python",
            &fake_python.display().to_string(),
            "--output-dir",
            &out.display().to_string(),
        ])
        .env("GLIBC_TUNABLES", "glibc.cpu.x86_rep_movsb_threshold=4096")
        .env_remove("PADFREE_MALLOC")
        .output()
        .expect("run padfree");
    assert!(output.status.success(), "{}", stderr(&output));
    let env = std::fs::read_to_string(&env_log).expect("the peer ran");
    assert!(!env.contains("PADFREE_MALLOC"), "{env}");
    assert!(
        env.lines()
            .any(|line| line == "GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=4096"),
        "the user's tunables, alone:\n{env}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("MFU vs calibration"), "{stdout}");
}

#[test]
fn bench_keeps_the_runs_that_finished_when_one_fails_and_checks_its_directory_first() {
    // The HF peer cannot start (`false` is its Python): the padfree row that
    // finished is still reported, the failure beside it, and the command fails.
    let (_guard, out, output) = bench(
        "bench-failing",
        &["--modes", "varlen", "--peer-python", "false"],
    );
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(
        err.contains("2 of the runs failed (hf-padded, hf-flattening)"),
        "{err}"
    );
    let report = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
    assert!(report.contains("padfree, padding-free, metadata from the collator"));
    assert!(report.contains("## Runs that failed") && report.contains("`hf-padded`"));
    assert!(out.join("bench.json").is_file() && out.join("bench.png").is_file());

    // An output directory that cannot be written is refused before a run.
    let dir = scratch("bench-unwritable");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").expect("write");
    let target = file.join("out").display().to_string();
    let output = padfree(&["bench", "--config", "tiny", "--output-dir", &target]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains(&format!("--output-dir {target}: cannot be created")),
        "{}",
        stderr(&output)
    );
    assert!(!String::from_utf8_lossy(&output.stdout).contains("running"));
}

#[test]
fn text_fields_no_record_shape_uses_are_named_and_a_template_maps_them() {
    let dir_guard = scratch("unused-fields");
    let dir = dir_guard.path();
    let config = tiny_config_with_shipped_vocab(dir);
    let data = dir.join("asdiv.jsonl");
    let records: String = (0..8)
        .map(|i| {
            format!(
                "{{\"passage\": \"Ann has {i} apples and buys 2 more.\", \"question\": \"How many apples?\", \"answer\": \"{}\", \"id\": \"nluds-{i}\"}}\n",
                i + 2
            )
        })
        .collect();
    std::fs::write(&data, records).expect("write");
    let train = |name: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--config",
            &config,
            "--data",
            data.to_str().expect("utf-8"),
            "--max-steps",
            "1",
        ];
        let out = dir.join(name).display().to_string();
        args.extend(["--output-dir", &out]);
        args.extend(extra);
        let output = padfree(&args);
        assert!(output.status.success(), "{}", stderr(&output));
        stderr(&output)
    };
    let err = train("plain", &[]);
    assert!(
        err.contains(&format!(
            "warning: {}: field `passage` holds text in 8 of 8 records (the first at line 1), but their record shape does not use it",
            data.display()
        )) && err.contains(r"HINT: to train on it, build the prompt from it with --prompt-template (e.g. --prompt-template '{passage}\n{question}' --completion-field answer), "),
        "{err}"
    );
    assert!(!err.contains("`id`"), "{err}");
    let err = train(
        "template",
        &[
            "--prompt-template",
            r"{passage}\n{question}",
            "--completion-field",
            "answer",
        ],
    );
    assert!(!err.contains("warning"), "{err}");
    // A template that leaves the field out: the HINT adds it to that
    // template, rather than proposing one that drops `{question}`.
    let err = train(
        "partial-template",
        &[
            "--prompt-template",
            "Q: {question}",
            "--completion-field",
            "answer",
        ],
    );
    assert!(
        err.contains(
            r"(e.g. --prompt-template 'Q: {question}\n{passage}' --completion-field answer)"
        ),
        "{err}"
    );
    // `question` left out by --prompt-field: not '{question}\n{question}'.
    std::fs::write(
        &data,
        "{\"prompt\": \"How many?\", \"completion\": \"3\", \"question\": \"a side note\"}\n"
            .repeat(4),
    )
    .expect("write");
    let err = train(
        "question-unused",
        &[
            "--prompt-field",
            "prompt",
            "--completion-field",
            "completion",
        ],
    );
    assert!(
        err.contains(
            r"(e.g. --prompt-template '{question}\n{prompt}' --completion-field completion)"
        ),
        "{err}"
    );
}

#[test]
fn a_tokenizer_that_is_not_the_models_own_is_warned_about() {
    let dir_guard = scratch("other-tokenizer");
    let dir = dir_guard.path();
    let (config, data) = tiny_model_and_data(dir, 8);
    let model = dir.join("model");
    let data = data.display().to_string();
    let first = padfree(&[
        "train",
        "--config",
        &config,
        "--data",
        &data,
        "--max-steps",
        "1",
        "--output-dir",
        model.to_str().expect("utf-8"),
    ]);
    assert!(first.status.success(), "{}", stderr(&first));
    // The shipped tokenizer with its ids reversed: same size, other tokens.
    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("tokenizer.json")).expect("tokenizer"),
    )
    .expect("json");
    let vocab = json["model"]["vocab"].as_object_mut().expect("vocab");
    let size = vocab.len() as u64;
    for id in vocab.values_mut() {
        *id = serde_json::json!(size - 1 - id.as_u64().expect("id"));
    }
    let other = dir.join("reversed/tokenizer.json");
    std::fs::create_dir_all(other.parent().expect("dir")).expect("mkdir");
    std::fs::write(&other, json.to_string()).expect("write");
    let run = |tokenizer: &Path, name: &str| {
        let output = padfree(&[
            "train",
            "--model",
            model.to_str().expect("utf-8"),
            "--tokenizer",
            tokenizer.to_str().expect("utf-8"),
            "--data",
            &data,
            "--max-steps",
            "1",
            "--output-dir",
            dir.join(name).to_str().expect("utf-8"),
        ]);
        assert!(output.status.success(), "{}", stderr(&output));
        stderr(&output)
    };
    let err = run(&other, "other");
    assert!(
        err.contains("is not the model's own tokenizer")
            && err.contains("4096 of the 4096 ids they share stand for other tokens")
            && err.contains("HINT: leave out --tokenizer"),
        "{err}"
    );
    assert!(!run(&model.join("tokenizer.json"), "own").contains("warning"));
}

/// `--bf16` through the binary: the log says what computes the products and
/// what is saved in f32, the run trains, the saved model is f32, and
/// `padfree check --bf16` passes on the same model and data.
#[test]
fn bf16_trains_says_so_and_checks() {
    let dir_guard = scratch("bf16");
    let dir = dir_guard.path();
    let (config, data) = tiny_model_and_data(dir, 24);
    let (config, data) = (config.as_str(), data.display().to_string());
    let out = dir.join("out").display().to_string();
    let output = padfree(&[
        "train",
        "--config",
        config,
        "--data",
        &data,
        "--bf16",
        "--max-steps",
        "3",
        "--logging-steps",
        "1",
        "--save-strategy",
        "no",
        "--output-dir",
        &out,
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("precision: bf16 matmul operands, f32 accumulation (")
            && stdout.contains("checkpoints and the final model in f32"),
        "{stdout}"
    );
    let header = std::fs::read(dir.join("out/model.safetensors")).expect("final model");
    let tensors = safetensors::SafeTensors::deserialize(&header).expect("safetensors");
    assert!(
        tensors
            .tensors()
            .iter()
            .all(|(_, t)| t.dtype() == safetensors::Dtype::F32),
        "the final model is f32"
    );
    let output = padfree(&["check", "--config", config, "--data", &data, "--bf16"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("precision: bf16 matmuls ("), "{stdout}");
}

/// `--prompt-template` trains on a number field as the file writes it: a
/// record with a 23-digit integer, trailing zeros, exponents and negative
/// numbers trains to bit-equal losses with the same text written out by
/// hand as `{prompt, completion}` (once the template printed
/// `1.2345678901234568e+22`, `0.5`, `100.0`: other tokens, other losses).
#[test]
fn a_prompt_template_trains_on_numbers_as_the_file_writes_them() {
    let dir_guard = scratch("template-numbers");
    let dir = dir_guard.path();
    let config = tiny_config_with_shipped_vocab(dir);
    let numbers = [
        "12345678901234567890123",
        "0.50",
        "2.500",
        "1e2",
        "-3",
        "-0.25e-3",
        "6.02E+23",
        "-0",
    ];
    let (mut templated, mut by_hand) = (String::new(), String::new());
    for (i, number) in numbers.iter().enumerate() {
        let question = format!("What is {i} more than the number?");
        templated.push_str(&format!(
            "{{\"big\": {number}, \"question\": \"{question}\", \"answer\": \"{i}\"}}\n"
        ));
        by_hand.push_str(&format!(
            "{{\"prompt\": \"big={number} {question}\", \"completion\": \"{i}\"}}\n"
        ));
    }
    let losses = |name: &str, text: &str, extra: &[&str]| {
        let data = dir.join(format!("{name}.jsonl"));
        std::fs::write(&data, text).expect("write data");
        two_steps(&config, &data, &dir.join(name), extra).1
    };
    let templated = losses(
        "templated",
        &templated,
        &[
            "--prompt-template",
            "big={big} {question}",
            "--completion-field",
            "answer",
        ],
    );
    assert_eq!(templated.len(), 2);
    assert_eq!(templated, losses("by-hand", &by_hand, &[]));
}

/// The second start with the same data, tokenizer and settings reads the
/// examples back from the tokenized-data cache (and trains bit-identically);
/// a setting that shapes the examples builds another entry; with
/// --no-data-cache nothing is cached.
#[test]
fn the_second_start_reads_the_tokenized_data_from_the_cache() {
    let dir_guard = scratch("data-cache");
    let dir = dir_guard.path();
    let config = tiny_config_with_shipped_vocab(dir);
    let data = dir.join("data.jsonl");
    std::fs::write(&data, first_records(40)).expect("write data");
    let cache = dir.join("cache");
    let run = |name: &str, extra: &[&str]| two_steps(&config, &data, &dir.join(name), extra);
    let cache_dir = cache.to_str().expect("utf-8");
    let (first, first_losses) = run("first", &["--data-cache-dir", cache_dir]);
    assert!(
        first.contains("data cache: ") && first.contains(": built "),
        "{first}"
    );
    let (second, second_losses) = run("second", &["--data-cache-dir", cache_dir]);
    assert!(second.contains(": reused "), "{second}");
    assert_eq!(second_losses, first_losses);
    // The data report is the same whether tokenized or read back.
    assert_eq!(data_line(&first), data_line(&second));
    let (shorter, _) = run(
        "shorter",
        &["--data-cache-dir", cache_dir, "--max-seq-len", "64"],
    );
    assert!(shorter.contains(": built "), "{shorter}");
    let entries = std::fs::read_dir(&cache).expect("the cache").count();
    assert_eq!(entries, 2, "one entry per max_seq_len");
    let (off, off_losses) = run("off", &["--no-data-cache"]);
    assert!(!off.contains("data cache"), "{off}");
    assert_eq!(off_losses, first_losses);
    assert_eq!(std::fs::read_dir(&cache).expect("the cache").count(), 2);
}

/// `padfree pack --data` plans a real data set: its records tokenized as
/// `train` tokenizes them, through the same cache entry (same tokenizer,
/// vocabulary and `--max-seq-len`), the plan over the real lengths.
#[test]
fn pack_plans_a_data_file_through_trains_cache() {
    let dir_guard = scratch("pack-data");
    let dir = dir_guard.path();
    let config = tiny_config_with_shipped_vocab(dir);
    let data = dir.join("data.jsonl");
    std::fs::write(&data, first_records(60)).expect("write data");
    let cache = dir.join("cache");
    let cache_dir = cache.to_str().expect("utf-8");
    let pack = padfree(&[
        "pack",
        "--data",
        data.to_str().expect("utf-8"),
        "--max-seq-len",
        "512",
        "--capacity",
        "1024",
        "--world-size",
        "2",
        "--data-cache-dir",
        cache_dir,
    ]);
    assert!(pack.status.success(), "{}", stderr(&pack));
    let shown = String::from_utf8_lossy(&pack.stdout).into_owned();
    assert!(shown.contains(": built "), "{shown}");
    assert!(
        shown.contains("Dataset: 60 examples, the examples of"),
        "{shown}"
    );
    assert!(shown.contains("3. Multipack"), "{shown}");
    // The tiny config's 512 positions cap train's --max-seq-len at 512, and
    // its vocabulary is the tokenizer's: the same entry.
    let (trained, _) = two_steps(
        &config,
        &data,
        &dir.join("run"),
        &["--data-cache-dir", cache_dir],
    );
    assert!(trained.contains(": reused "), "{trained}");
    let refused = padfree(&["pack", "--data", "x.jsonl", "--lengths", "y.txt"]);
    assert!(!refused.status.success());
}

/// The same records as JSONL, Parquet, Parquet shards and an HF `datasets`
/// directory train bit-identically (fixtures from
/// `scripts/make_columnar_fixtures.py`), each through its own cache entry.
#[test]
fn jsonl_parquet_and_hf_datasets_train_the_same() {
    let dir_guard = scratch("columnar");
    let dir = dir_guard.path();
    let config = tiny_config_with_shipped_vocab(dir);
    let cache = dir.join("cache");
    let cache_dir = cache.to_str().expect("utf-8");
    let losses = |form: &str| {
        let data = repo(&format!("fixtures/data/columnar/{form}"));
        let (said, losses) = two_steps(
            &config,
            &data,
            &dir.join(form),
            &["--data-cache-dir", cache_dir],
        );
        assert!(said.contains("40 records -> 40 examples"), "{form}: {said}");
        losses
    };
    let jsonl = losses("gsm40.jsonl");
    assert_eq!(jsonl.len(), 2);
    for form in ["gsm40.parquet", "gsm40-shards", "gsm40-hf"] {
        assert_eq!(losses(form), jsonl, "{form}");
    }
    assert_eq!(std::fs::read_dir(&cache).expect("cache").count(), 4);
}

/// A cold start is tokenized by a helper process on every core, started
/// without padfree's malloc tuning (`commands/data/helper.rs`): the same
/// examples (losses, data report) as tokenizing in this process, with the
/// cache or without it (then through a temporary hand-over that is
/// removed); the unused-field warning is said on the warm start too (kept
/// in the cache entry, since the records are no more read); a bad record
/// found while tokenizing is the run's error, naming its line.
#[test]
fn a_cold_start_is_tokenized_by_a_helper_on_every_core() {
    let dir_guard = scratch("cold-start");
    let dir = dir_guard.path();
    let config = tiny_config_with_shipped_vocab(dir);
    let data = dir.join("data.jsonl");
    let mut text = first_records(40);
    text.push_str("{\"question\": \"1 + 1?\", \"answer\": \"2\", \"note\": \"an easy one\"}\n");
    std::fs::write(&data, text).expect("write data");
    let handovers = dir.join("tmp");
    std::fs::create_dir(&handovers).expect("tmp");
    let run = |name: &str, env: &[(&str, &std::ffi::OsStr)], extra: &[&str]| {
        let mut env = env.to_vec();
        env.push(("TMPDIR", handovers.as_os_str()));
        let run = two_steps_in(&env, &config, &data, &dir.join(name), extra);
        let line = data_line(&run.stdout);
        (run.stdout, run.stderr, line, run.losses)
    };
    let cache = dir.join("cache");
    let cache = cache.to_str().expect("utf-8");
    let (said, warned, cold_line, losses) = run("cold", &[], &["--data-cache-dir", cache]);
    assert!(said.contains("tokenized by a helper process on "), "{said}");
    assert!(warned.contains("field `note`"), "{warned}");
    assert!(
        cold_line.contains("41 records -> 41 examples"),
        "{cold_line}"
    );
    let (said, warned, warm_line, warm) = run("warm", &[], &["--data-cache-dir", cache]);
    assert!(said.contains(": reused "), "{said}");
    assert!(
        warned.contains("field `note`"),
        "the warm start warns too: {warned}"
    );
    assert_eq!((&warm_line, &warm), (&cold_line, &losses));
    let (said, warned, here_line, here) = run(
        "here",
        &[("PADFREE_MALLOC", std::ffi::OsStr::new("system"))],
        &["--no-data-cache"],
    );
    assert!(!said.contains("helper process"), "{said}");
    assert!(warned.contains("field `note`"), "{warned}");
    assert_eq!((&here_line, &here), (&cold_line, &losses));
    let (_, _, handed_line, handed) = run("handed-over", &[], &["--no-data-cache"]);
    assert_eq!((&handed_line, &handed), (&cold_line, &losses));
    let left: Vec<_> = std::fs::read_dir(&handovers).expect("tmp").collect();
    assert!(left.is_empty(), "the hand-over is removed: {left:?}");

    let bad = dir.join("bad.jsonl");
    let mut text = first_records(3);
    text.push_str("{\"input_ids\": [1, 99999]}\n");
    std::fs::write(&bad, text).expect("write data");
    let output = padfree(&[
        "train",
        "--config",
        &config,
        "--data",
        bad.to_str().expect("utf-8"),
        "--max-steps",
        "1",
        "--output-dir",
        dir.join("bad").to_str().expect("utf-8"),
        "--data-cache-dir",
        cache,
    ]);
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(
        err.contains("line 4")
            && err.contains("outside the model's vocabulary")
            && err.contains("HINT"),
        "{err}"
    );
    assert!(!dir.join("bad").join("model.safetensors").exists());
}

/// `padfree bench --attention-alone` on the CPU: the attention op timed by
/// itself on the varlen mode's micro-batches (2 timed of 4 examples), the
/// tiled and per-row rows (on the CPU both the host kernel), nothing
/// trained; `--bf16` says the 16-bit row needs a GPU and leaves it out.
#[test]
fn bench_times_the_attention_alone() {
    let (_guard, out, output) = bench("bench-attention", &["--attention-alone", "--bf16"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("this device has none"), "{stdout}");
    assert!(!out.join("bench.json").exists(), "nothing trained");
    let (kernels, timings) = common::attention_rows(&out);
    assert_eq!(kernels, ["tiled f32", "per-row f32"]);
    for t in &timings {
        assert_eq!(t["calls"], 2, "{t}");
        assert!(t["ms_per_call"].as_f64().expect("ms") > 0.0, "{t}");
        assert!(t["gflops"].as_f64().expect("rate") > 0.0, "{t}");
    }
    let md = std::fs::read_to_string(out.join("attention.md")).expect("markdown");
    assert!(md.contains("| per-row f32 | 2 |"), "{md}");
    assert!(md.contains("untimed pass"), "{md}");
}
