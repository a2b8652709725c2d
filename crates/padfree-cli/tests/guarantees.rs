//! What `padfree train` guarantees about the files it writes and reads
//! (docs/training.md, "What padfree guarantees"): checkpoints verified before
//! resume, the output directory locked and never inside the checkpoint it
//! resumes from, SIGTERM saving like Ctrl-C, every setting read back exactly,
//! and `kill -9` at any moment leaving only checkpoints that resume to the
//! uninterrupted run's bytes.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{first_records, padfree, scratch, stderr, tiny_config_with_shipped_vocab};

/// A tiny model on 24 shipped records: config and data paths.
fn setup(dir: &Path) -> (String, String) {
    let config = tiny_config_with_shipped_vocab(dir);
    let data = dir.join("train.jsonl");
    std::fs::write(&data, first_records(24)).expect("write data");
    (config, data.display().to_string())
}

/// `padfree train` flags: `steps` steps, a checkpoint every `save` steps.
fn train_args(config: &str, data: &str, out: &Path, steps: usize, save: usize) -> Vec<String> {
    [
        "train",
        "--config",
        config,
        "--data",
        data,
        "--max-steps",
        &steps.to_string(),
        "--per-device-train-batch-size",
        "4",
        "--learning-rate",
        "1e-3",
        "--max-grad-norm",
        // Its last digit was lost in trainer_state.json once.
        "9.042889614762931",
        "--logging-steps",
        "1",
        "--save-steps",
        &save.to_string(),
        "--output-dir",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

fn run(args: &[String]) -> Output {
    padfree(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn with(mut args: Vec<String>, extra: &[&str]) -> Vec<String> {
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

fn spawn(args: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_padfree"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs padfree")
}

/// Waits (at most a minute) until `ready` holds.
fn wait_for(what: &str, ready: impl Fn() -> bool) {
    let started = Instant::now();
    while !ready() {
        assert!(started.elapsed() < Duration::from_secs(60), "no {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The `checkpoint-N` directories in `out`, sorted.
fn checkpoints_in(out: &Path) -> Vec<PathBuf> {
    let mut checkpoints: Vec<PathBuf> = std::fs::read_dir(out)
        .expect("out")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("checkpoint-"))
        })
        .collect();
    checkpoints.sort();
    checkpoints
}

fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
}

#[test]
fn resuming_into_the_checkpoint_itself_is_refused_and_leaves_it_intact() {
    let guard = scratch("into-checkpoint");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("run");
    let output = run(&train_args(&config, &data, &out, 5, 2));
    assert!(output.status.success(), "{}", stderr(&output));
    let checkpoint = out.join("checkpoint-2");
    let before = read(&checkpoint.join("model.safetensors"));
    for target in [checkpoint.clone(), checkpoint.join("inner")] {
        let output = run(&with(
            train_args(&config, &data, &target, 5, 2),
            &[
                "--resume-from-checkpoint",
                &checkpoint.display().to_string(),
            ],
        ));
        assert!(!output.status.success());
        assert!(
            stderr(&output).contains("inside the checkpoint it resumes from"),
            "{}",
            stderr(&output)
        );
    }
    // A checkpoint as the output directory of a fresh run, too.
    let output = run(&with(
        train_args(&config, &data, &checkpoint, 5, 2),
        &["--overwrite-output-dir"],
    ));
    assert!(stderr(&output).contains("the output directory is a checkpoint"));
    assert!(read(&checkpoint.join("model.safetensors")) == before);
    // The run's own directory resumes, with the very same flags (the
    // 16-digit --max-grad-norm reads back exactly), and metrics.jsonl ends
    // up byte-identical to the straight run's.
    let straight_metrics = read(&out.join("metrics.jsonl"));
    let straight_model = read(&out.join("model.safetensors"));
    let output = run(&with(
        train_args(&config, &data, &out, 5, 2),
        &[
            "--resume-from-checkpoint",
            &checkpoint.display().to_string(),
        ],
    ));
    assert!(output.status.success(), "{}", stderr(&output));
    // Lines up to the checkpoint are the saved ones, byte for byte; later
    // lines differ only in their timing.
    let metrics = read(&out.join("metrics.jsonl"));
    let lines = |bytes: &[u8]| -> Vec<String> {
        String::from_utf8_lossy(bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    };
    let (now, then) = (lines(&metrics), lines(&straight_metrics));
    assert_eq!(now.len(), then.len());
    assert_eq!(now[..2], then[..2]);
    let untimed = |line: &str| {
        let mut record: serde_json::Value = serde_json::from_str(line).expect("json");
        record["tokens_per_second"] = serde_json::Value::Null;
        record
    };
    for (a, b) in now.iter().zip(&then).skip(2) {
        assert_eq!(untimed(a), untimed(b));
    }
    assert!(read(&out.join("model.safetensors")) == straight_model);
    // The run's top directory is not a checkpoint: say which ones are.
    let output = run(&with(
        train_args(&config, &data, &dir.join("other"), 5, 2),
        &["--resume-from-checkpoint", &out.display().to_string()],
    ));
    let message = stderr(&output);
    assert!(
        message.contains("this is not a checkpoint")
            && message.contains("checkpoints here: checkpoint-2, checkpoint-4"),
        "{message}"
    );
    // A directory that does not exist is said to be missing, and only that.
    let missing = dir.join("no-such-checkpoint");
    let output = run(&with(
        train_args(&config, &data, &dir.join("other"), 5, 2),
        &["--resume-from-checkpoint", &missing.display().to_string()],
    ));
    let message = stderr(&output);
    assert!(
        message.contains(&format!(
            "{}: the directory does not exist\nHINT: give a checkpoint-N directory",
            missing.display()
        )) && !message.contains("lacks"),
        "{message}"
    );
    // Another model than the checkpoint's is refused, not ignored.
    let mut other_model = train_args("small", &data, &dir.join("other"), 5, 2);
    other_model.extend([
        "--resume-from-checkpoint".to_owned(),
        checkpoint.display().to_string(),
    ]);
    let output = run(&other_model);
    assert!(
        stderr(&output).contains("of the checkpoint"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn damaged_checkpoints_are_refused_by_file() {
    let guard = scratch("damaged");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("run");
    let output = run(&train_args(&config, &data, &out, 5, 2));
    assert!(output.status.success(), "{}", stderr(&output));
    let resume = |from: &Path| {
        run(&with(
            train_args(&config, &data, &dir.join("resumed"), 5, 2),
            &[
                "--resume-from-checkpoint",
                &from.display().to_string(),
                "--overwrite-output-dir",
            ],
        ))
    };
    let fresh = |name: &str| {
        let copy = dir.join(name);
        std::fs::create_dir_all(&copy).expect("copy dir");
        for entry in std::fs::read_dir(out.join("checkpoint-4")).expect("checkpoint") {
            let entry = entry.expect("entry");
            std::fs::copy(entry.path(), copy.join(entry.file_name())).expect("copy");
        }
        copy
    };
    // Untouched: resumes.
    let output = resume(&fresh("intact"));
    assert!(output.status.success(), "{}", stderr(&output));
    // One byte flipped in the middle of either weights file.
    for file in ["optimizer.safetensors", "model.safetensors"] {
        let copy = fresh(&format!("flipped-{file}"));
        let mut bytes = read(&copy.join(file));
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x01;
        std::fs::write(copy.join(file), bytes).expect("write");
        let output = resume(&copy);
        assert!(!output.status.success());
        let message = stderr(&output);
        assert!(
            message.contains(file) && message.contains("contents differ"),
            "{message}"
        );
    }
    // The optimizer of an older checkpoint copied in.
    let copy = fresh("mixed");
    std::fs::copy(
        out.join("checkpoint-2/optimizer.safetensors"),
        copy.join("optimizer.safetensors"),
    )
    .expect("copy");
    let message = stderr(&resume(&copy));
    assert!(message.contains("optimizer.safetensors"), "{message}");
    // No integrity record: not a finished checkpoint.
    let copy = fresh("unrecorded");
    std::fs::remove_file(copy.join("integrity.json")).expect("remove");
    let message = stderr(&resume(&copy));
    assert!(message.contains("integrity.json: missing"), "{message}");
    // A NaN in a model's weights is refused at load, naming the tensor.
    let model = fresh("nan-model");
    let mut bytes = read(&model.join("model.safetensors"));
    let header = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let first_value = 8 + header;
    bytes[first_value..first_value + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(model.join("model.safetensors"), bytes).expect("write");
    let mut args = train_args(&config, &data, &dir.join("from-nan"), 2, 2);
    let at = args.iter().position(|a| a == "--config").expect("--config");
    args[at] = "--model".to_owned();
    args[at + 1] = model.display().to_string();
    let message = stderr(&run(&args));
    assert!(message.contains("holds NaN at element 0"), "{message}");
}

#[test]
fn two_runs_into_one_directory_the_second_is_refused_naming_the_first() {
    let guard = scratch("lock");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("run");
    let mut first = spawn(&train_args(&config, &data, &out, 100_000, 100_000));
    wait_for("first log line", || {
        std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|t| !t.is_empty())
    });
    let output = run(&with(
        train_args(&config, &data, &out, 5, 2),
        &["--overwrite-output-dir"],
    ));
    first.kill().ok();
    first.wait().ok();
    assert!(!output.status.success());
    let message = stderr(&output);
    // Its process, host and start as a UTC time (once a count of seconds).
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let named = format!(
        "another padfree run is writing here (process {} on {}, since 20",
        first.id(),
        host.trim()
    );
    let since = message
        .find(&named)
        .map(|at| &message[at + named.len() - 2..]);
    assert!(
        since.is_some_and(|since| since.len() > 24 && since[..24].ends_with(" UTC)")),
        "{message}"
    );
    // Once the first is gone, the lock goes with it.
    let output = run(&with(
        train_args(&config, &data, &out, 2, 2),
        &["--overwrite-output-dir"],
    ));
    assert!(output.status.success(), "{}", stderr(&output));
}

#[test]
fn sigterm_saves_the_last_finished_step_like_ctrl_c() {
    let guard = scratch("sigterm");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("run");
    let child = spawn(&with(
        train_args(&config, &data, &out, 100_000, 100_000),
        &["--save-strategy", "no"],
    ));
    wait_for("first log line", || {
        std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|t| !t.is_empty())
    });
    signal(&child, "TERM");
    let output = child.wait_with_output().expect("waits");
    assert_eq!(output.status.code(), Some(130), "{}", stderr(&output));
    assert!(stderr(&output).contains("SIGTERM"), "{}", stderr(&output));
    let checkpoints = checkpoints_in(&out);
    assert_eq!(checkpoints.len(), 1, "{checkpoints:?}");
    assert!(checkpoints[0].join("integrity.json").is_file());
}

/// `kill -9` while checkpoints are being written and between them: every
/// checkpoint left verifies and resumes to the uninterrupted run's bytes.
#[test]
fn kill_9_at_any_moment_leaves_only_checkpoints_that_resume_exactly() {
    let guard = scratch("kill-9");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let straight = dir.join("straight");
    let output = run(&train_args(&config, &data, &straight, 6, 1));
    assert!(output.status.success(), "{}", stderr(&output));
    let expected = read(&straight.join("model.safetensors"));
    let writing = |out: &Path| {
        std::fs::read_dir(out).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(".tmp-checkpoint-")
            })
        })
    };
    let mut during_write = 0;
    for (attempt, moment) in [
        "a checkpoint write",
        "step 3's checkpoint",
        "a checkpoint write",
    ]
    .iter()
    .enumerate()
    {
        let out = dir.join(format!("killed-{attempt}"));
        let mut child = spawn(&train_args(&config, &data, &out, 6, 1));
        match *moment {
            "step 3's checkpoint" => wait_for(moment, || out.join("checkpoint-3").is_dir()),
            _ => wait_for(moment, || {
                writing(&out) || out.join("checkpoint-5").is_dir()
            }),
        }
        if writing(&out) {
            during_write += 1;
        }
        child.kill().expect("kill -9");
        child.wait().ok();
        for checkpoint in &checkpoints_in(&out) {
            let resumed = dir.join(format!(
                "resumed-{attempt}-{}",
                checkpoint.file_name().expect("name").to_string_lossy()
            ));
            let output = run(&with(
                train_args(&config, &data, &resumed, 6, 1),
                &[
                    "--resume-from-checkpoint",
                    &checkpoint.display().to_string(),
                ],
            ));
            assert!(
                output.status.success(),
                "{}: {}",
                checkpoint.display(),
                stderr(&output)
            );
            assert!(
                read(&resumed.join("model.safetensors")) == expected,
                "{} resumed to other weights",
                checkpoint.display()
            );
        }
    }
    // Timing decides how many kills land inside a write; report it.
    eprintln!("{during_write} of 3 kills landed while a checkpoint was being written");
}

#[test]
fn rough_edges_get_a_clear_message_or_just_work() {
    let guard = scratch("rough-edges");
    let dir = guard.path();
    let (config, data) = setup(dir);
    // A UTF-8 byte-order mark before the first record is accepted.
    let bom = dir.join("bom.jsonl");
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend(first_records(24).into_bytes());
    std::fs::write(&bom, bytes).expect("write");
    let output = run(&train_args(
        &config,
        &bom.display().to_string(),
        &dir.join("bom"),
        1,
        1,
    ));
    assert!(output.status.success(), "{}", stderr(&output));
    // Raw `{text}` records (TRL's dataset_text_field), under another name.
    let corpus = dir.join("corpus.jsonl");
    let lines: String = first_records(12)
        .lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).expect("json");
            format!(
                "{}\n",
                serde_json::json!({"body": record["answer"].clone(), "id": 1})
            )
        })
        .collect();
    std::fs::write(&corpus, lines).expect("write");
    let output = run(&with(
        train_args(
            &config,
            &corpus.display().to_string(),
            &dir.join("text"),
            1,
            1,
        ),
        &["--dataset-text-field", "body"],
    ));
    assert!(output.status.success(), "{}", stderr(&output));
    // A negative number reaches validation instead of clap's "unexpected
    // argument '-0'".
    let output = run(&with(
        train_args(&config, &data, &dir.join("negative"), 1, 1),
        &["--warmup-ratio", "-0.5"],
    ));
    assert!(
        stderr(&output).contains("--warmup-ratio: -0.5 is outside [0, 1]"),
        "{}",
        stderr(&output)
    );
    // Every label masked: the hint is about labels, not --max-seq-len.
    let masked = dir.join("masked.jsonl");
    std::fs::write(
        &masked,
        "{\"input_ids\": [1, 2, 3], \"labels\": [-100, -100, -100]}\n",
    )
    .expect("write");
    let output = run(&train_args(
        &config,
        &masked.display().to_string(),
        &dir.join("masked"),
        1,
        1,
    ));
    let message = stderr(&output);
    assert!(
        message.contains("every label is -100") && !message.contains("--max-seq-len"),
        "{message}"
    );
    // A tokenizer directory: its tokenizer.json, or a message about
    // --tokenizer (not --data).
    let output = run(&with(
        train_args(&config, &data, &dir.join("tokenizer-dir"), 1, 1),
        &["--tokenizer", &dir.display().to_string()],
    ));
    let message = stderr(&output);
    assert!(
        message.contains("a directory without tokenizer.json") && !message.contains("--data"),
        "{message}"
    );
}

#[test]
fn input_memory_and_disk_are_bounded_before_any_work() {
    let guard = scratch("bounds");
    let dir = guard.path();
    let (config, data) = setup(dir);
    // A file without line breaks is refused after one record's bound, not
    // read until memory runs out.
    let started = Instant::now();
    let output = run(&train_args(&config, "/dev/zero", &dir.join("zero"), 1, 1));
    let message = stderr(&output);
    assert!(
        message.contains("/dev/zero:line 1: longer than 64 MiB without a line break"),
        "{message}"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
    // A model far beyond this machine's memory is refused with the figures
    // before anything is allocated (it used to abort in the allocator).
    let huge = dir.join("huge.json");
    std::fs::write(
        &huge,
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 4096, "hidden_size": 65536, "intermediate_size": 262144,
            "num_hidden_layers": 64, "num_attention_heads": 512, "num_key_value_heads": 512,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": true, "hidden_act": "silu"
        })
        .to_string(),
    )
    .expect("write");
    let output = run(&train_args(
        &huge.display().to_string(),
        &data,
        &dir.join("huge"),
        1,
        1,
    ));
    let message = stderr(&output);
    assert!(
        message.contains("more than this machine's") && message.contains("GiB of memory"),
        "{message}"
    );
    // A disk too small for the run's files is found before the first step,
    // with checkpoints and without.
    for strategy in ["steps", "no"] {
        let out = dir.join(format!("disk-{strategy}"));
        let output = Command::new(env!("CARGO_BIN_EXE_padfree"))
            .args(with(
                train_args(&config, &data, &out, 4, 2),
                &["--save-strategy", strategy],
            ))
            .env("PADFREE_ASSUME_FREE_BYTES", "1000")
            .output()
            .expect("runs padfree");
        let message = stderr(&output);
        assert!(
            !output.status.success() && message.contains("GiB are free"),
            "{message}"
        );
        assert!(!out.join("metrics.jsonl").exists(), "no step was taken");
    }
}

/// SIGTERM twice while a checkpoint is being written: the first asks to
/// stop and save, the second to quit; the write being done is finished
/// first, so the checkpoint is whole and no temporary is left.
#[test]
fn a_second_sigterm_during_a_checkpoint_write_finishes_it_before_quitting() {
    use std::io::BufRead;
    let guard = scratch("second-sigterm");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("run");
    let mut child = Command::new(env!("CARGO_BIN_EXE_padfree"))
        .args(train_args(&config, &data, &out, 6, 2))
        .env("PADFREE_WRITE_DELAY_MS", "1500")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs padfree");
    let (lines, seen) = std::sync::mpsc::channel::<String>();
    let reader = std::io::BufReader::new(child.stderr.take().expect("stderr"));
    let collector = std::thread::spawn(move || {
        let mut all = String::new();
        for line in reader.lines().map_while(Result::ok) {
            all.push_str(&line);
            all.push('\n');
            lines.send(line).ok();
        }
        all
    });
    let wait_line = |what: &str| {
        let started = Instant::now();
        loop {
            let left = Duration::from_secs(60).saturating_sub(started.elapsed());
            let line = seen
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no {what}"));
            if line.contains(what) {
                return;
            }
        }
    };
    wait_line("PADFREE_WRITE_DELAY_MS: writing");
    signal(&child, "TERM");
    wait_line("stopping after this step");
    signal(&child, "TERM");
    let status = child.wait().expect("waits");
    let text = collector.join().expect("stderr");
    assert_eq!(status.code(), Some(130), "{text}");
    assert!(
        text.contains("a checkpoint is being written; quitting as soon as it is complete")
            && text.contains("the write is complete: quitting"),
        "{text}"
    );
    let checkpoints = checkpoints_in(&out);
    assert_eq!(
        checkpoints,
        [out.join("checkpoint-2")],
        "whole, and nothing half-written beside it: {text}"
    );
    let leftovers: Vec<String> = std::fs::read_dir(&out)
        .expect("out")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert!(out.join("checkpoint-2/integrity.json").is_file());
}

/// A path a flag names that cannot be used is refused before any work,
/// naming the flag, with the operating system's reason once and a HINT.
#[test]
fn unusable_paths_are_refused_by_their_flag_with_the_reason_once() {
    let guard = scratch("paths");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let file = dir.join("a-file");
    std::fs::write(&file, b"").expect("write");
    let missing = dir.join("missing.jsonl").display().to_string();
    let under_file = file.join("out").display().to_string();
    let file_name = file.display().to_string();
    let cases: [(Vec<&str>, String); 4] = [
        (
            vec!["--eval-data", &missing],
            format!("--eval-data {missing}: No such file or directory (os error 2)"),
        ),
        (
            vec!["--output-dir", &under_file],
            format!("--output-dir {under_file}: cannot be created: Not a directory (os error 20)"),
        ),
        (
            vec!["--model", &missing],
            format!("--model {missing}: No such file or directory (os error 2)"),
        ),
        (
            vec!["--data", &file_name],
            "the file holds no records".to_owned(),
        ),
    ];
    let out = dir.join("out").display().to_string();
    for (flags, expected) in cases {
        // The case's flag in place of the default one (--model in place
        // of --config).
        let mut args: Vec<String> = vec!["train".into(), "--max-steps".into(), "1".into()];
        for (flag, default) in [
            ("--config", &config),
            ("--data", &data),
            ("--output-dir", &out),
        ] {
            let given = flags[0] == flag || (flag == "--config" && flags[0] == "--model");
            if !given {
                args.extend([flag.to_owned(), default.clone()]);
            }
        }
        args.extend(flags.iter().map(|s| (*s).to_owned()));
        let output = run(&args);
        let err = stderr(&output);
        assert!(!output.status.success(), "{flags:?}");
        assert!(err.contains(&expected), "{flags:?}: {err}");
        assert!(err.contains("\nHINT: "), "{flags:?}: {err}");
        assert!(
            !err.contains("--data names"),
            "a HINT about another flag: {err}"
        );
        assert!(
            err.matches("(os error").count() <= 1,
            "the reason is printed once: {err}"
        );
    }
}

/// A file named like a checkpoint in the output directory is refused
/// before training, with a HINT about it (not about disk space).
#[test]
fn a_file_in_the_way_of_a_checkpoint_is_refused_before_training() {
    let guard = scratch("in-the-way");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("run");
    std::fs::create_dir_all(&out).expect("mkdir");
    std::fs::write(out.join("checkpoint-1"), b"my notes").expect("write");
    let output = run(&with(
        train_args(&config, &data, &out, 2, 1),
        &["--overwrite-output-dir"],
    ));
    let err = stderr(&output);
    assert!(!output.status.success());
    assert!(
        err.contains("checkpoint-1: is a file, not a checkpoint directory")
            && err.contains("HINT: move or rename"),
        "{err}"
    );
    assert!(!err.contains("disk space"), "{err}");
    assert!(!String::from_utf8_lossy(&output.stdout).contains("training:"));
    assert_eq!(read(&out.join("checkpoint-1")), b"my notes");
}

/// An example no micro-batch can hold is named by its record, with one HINT
/// that says how far to raise the limit.
#[test]
fn an_example_longer_than_the_micro_batch_limit_is_named_by_its_record() {
    let guard = scratch("too-long");
    let dir = guard.path();
    let config = common::tiny_config_with_shipped_vocab(dir);
    let data = dir.join("ids.jsonl");
    let ids = |n: usize| {
        (0..n)
            .map(|i| (i % 50).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    std::fs::write(
        &data,
        format!(
            "{{\"input_ids\": [{}]}}\n{{\"input_ids\": [{}]}}\n\n{{\"input_ids\": [{}]}}\n",
            ids(10),
            ids(12),
            ids(40)
        ),
    )
    .expect("write");
    for multipack in [true, false] {
        let mut args = vec![
            "train".to_owned(),
            "--config".into(),
            config.clone(),
            "--data".into(),
            data.display().to_string(),
            "--max-tokens-per-batch".into(),
            "30".into(),
            "--output-dir".into(),
            dir.join(format!("out-{multipack}")).display().to_string(),
        ];
        if multipack {
            args.push("--multipack".into());
        }
        let output = run(&args);
        let err = stderr(&output);
        assert!(!output.status.success());
        assert!(
            err.contains(&format!(
                "{}:line 4: --max-tokens-per-batch: example 2 has 40 tokens",
                data.display()
            )),
            "{err}"
        );
        assert!(
            err.contains("raise --max-tokens-per-batch to at least 40"),
            "{err}"
        );
        assert_eq!(err.matches("HINT:").count(), 1, "{err}");
    }
}

/// Hints that fit: one-token examples are not told to train on inputs.
#[test]
fn one_token_examples_get_a_hint_that_fits() {
    let guard = scratch("one-token");
    let dir = guard.path();
    let data = dir.join("ids.jsonl");
    std::fs::write(&data, "{\"input_ids\": [5]}\n{\"input_ids\": [7]}\n").expect("write");
    for extra in [&[][..], &["--train-on-inputs"][..]] {
        let mut args: Vec<String> = [
            "train",
            "--config",
            "tiny",
            "--data",
            &data.display().to_string(),
            "--output-dir",
            &dir.join("out").display().to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let err = stderr(&run(&args));
        assert!(err.contains("every example is a single token"), "{err}");
        assert!(!err.contains("pass --train-on-inputs"), "{err}");
    }
}

/// What a run killed before its first checkpoint was whole leaves (found
/// under `mpirun`, the same in one process): `metrics.jsonl` and a
/// temporary checkpoint. A fresh start there says there is nothing to
/// resume and hints `--overwrite-output-dir`, which then trains and removes
/// the temporary.
#[test]
fn leftovers_from_before_the_first_checkpoint_are_named_not_resumed() {
    let guard = scratch("leftovers");
    let dir = guard.path();
    let (config, data) = setup(dir);
    let out = dir.join("run");
    std::fs::create_dir_all(out.join(".tmp-checkpoint-2-99999")).expect("mkdir");
    std::fs::write(out.join("metrics.jsonl"), "{\"step\": 1}\n").expect("write");
    let output = run(&train_args(&config, &data, &out, 2, 1));
    assert!(!output.status.success());
    let text = stderr(&output);
    assert!(
        text.contains(&format!(
            "--output-dir: {} holds only what a run that stopped before its first checkpoint left (.tmp-checkpoint-2-99999, metrics.jsonl): there is no checkpoint to resume",
            out.display()
        )),
        "{text}"
    );
    assert!(
        text.contains("HINT: pass --overwrite-output-dir to start afresh there (a temporary checkpoint is removed), or choose another --output-dir"),
        "{text}"
    );
    let output = run(&with(
        train_args(&config, &data, &out, 2, 1),
        &["--overwrite-output-dir"],
    ));
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(!out.join(".tmp-checkpoint-2-99999").exists());
    assert!(out.join("checkpoint-2").is_dir());
}
