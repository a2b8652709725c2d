//! `padfree train --use-peft` (docs/training.md, "LoRA"): only adapters
//! train and are saved (PEFT's files, in checkpoints and the final
//! output), a resumed LoRA run ends bit-identically to an uninterrupted
//! one, `--merge-adapter` writes the merged model, `padfree check` compares
//! the adapters' gradients, bad flags are refused by name, and SmolLM2-135M
//! trains LoRA adapters from its GGUF.

use std::path::Path;

mod common;
use common::{padfree, random_ids, scratch, stderr};

fn lora_args(data: &str, out: &Path) -> Vec<String> {
    [
        "train",
        "--config",
        "tiny",
        "--data",
        data,
        "--max-steps",
        "8",
        "--per-device-train-batch-size",
        "4",
        "--learning-rate",
        "1e-2",
        "--logging-steps",
        "1",
        "--save-steps",
        "4",
        "--output-dir",
        &out.display().to_string(),
    ]
    .iter()
    .chain(&common::LORA_FLAGS)
    .map(|s| (*s).to_owned())
    .collect()
}

fn succeeds(args: &[String]) -> String {
    let output = padfree(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{}{stdout}", stderr(&output));
    stdout
}

fn losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|record| record.get("loss").and_then(serde_json::Value::as_f64))
        .collect()
}

#[test]
fn lora_trains_saves_peft_files_and_resumes_bit_exactly() {
    let dir_guard = scratch("lora");
    let dir = dir_guard.path();
    let data = random_ids(&dir.join("train.jsonl"), 40, 3);
    let whole = dir.join("whole");
    let mut args = lora_args(&data, &whole);
    args.push("--merge-adapter".into());
    let stdout = succeeds(&args);
    assert!(stdout.contains("lora: r 4"), "{stdout}");

    // Only the adapters (and their moments) are the run's.
    for dir in [whole.clone(), whole.join("checkpoint-4")] {
        assert!(
            dir.join("adapter_model.safetensors").is_file(),
            "{}",
            dir.display()
        );
        assert!(
            dir.join("adapter_config.json").is_file(),
            "{}",
            dir.display()
        );
        assert!(!dir.join("model.safetensors").exists(), "{}", dir.display());
    }
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(whole.join("adapter_config.json")).expect("config"),
    )
    .expect("json");
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["target_modules"].as_array().map(Vec::len), Some(7));
    let merged = whole.join("merged");
    assert!(merged.join("model.safetensors").is_file());
    assert!(merged.join("config.json").is_file());

    assert_eq!(losses(&whole).len(), 8);

    // On one batch seen again every step, the adapters alone bring its
    // loss down (the 40 examples above are a new batch every step).
    let same = dir.join("same");
    let mut args = lora_args(&random_ids(&dir.join("four.jsonl"), 4, 9), &same);
    args.extend(["--save-strategy", "no"].map(str::to_owned));
    succeeds(&args);
    let same_losses = losses(&same);
    assert!(
        same_losses[7] < same_losses[0] - 0.05,
        "the LoRA run's loss did not fall: {same_losses:?}"
    );

    // Resumed from the middle (dropout masks, moments, schedule): the same
    // adapters at the end, bit for bit.
    let resumed = dir.join("resumed");
    let mut args = lora_args(&data, &resumed);
    args.push("--resume-from-checkpoint".into());
    args.push(whole.join("checkpoint-4").display().to_string());
    succeeds(&args);
    let read = |dir: &Path| std::fs::read(dir.join("adapter_model.safetensors")).expect("adapter");
    assert!(
        read(&whole) == read(&resumed),
        "the resumed LoRA run ended with other adapters"
    );

    // A LoRA checkpoint resumed without the LoRA flags is refused by name.
    let mut args = lora_args(&data, &dir.join("other"));
    let at = args.iter().position(|a| a == "--use-peft").expect("flag");
    args.drain(at..at + common::LORA_FLAGS.len());
    args.push("--resume-from-checkpoint".into());
    args.push(whole.join("checkpoint-4").display().to_string());
    let output = padfree(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("--use-peft"),
        "{}",
        stderr(&output)
    );

    // The merged model is a plain HF model padfree (and transformers) loads.
    let output = padfree(&[
        "check",
        "--model",
        &merged.display().to_string(),
        "--data",
        &data,
        "--per-device-train-batch-size",
        "3",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
}

/// `--bf16 --use-peft`: says what it keeps in which dtype, saves f32
/// adapters, tracks the f32 LoRA run (bf16 rounding of every product:
/// 2^-9 relative per operand, each step's loss within 2e-3 of f32's as in
/// full fine-tuning's test, and not equal), resumes bit-exactly; and QLoRA
/// (the tiny Q4 GGUF fixture, its projections kept in blocks) trains in
/// bf16 too.
#[test]
fn bf16_lora_tracks_f32_and_resumes_bit_exactly() {
    let dir_guard = scratch("lora-bf16");
    let dir = dir_guard.path();
    let data = random_ids(&dir.join("train.jsonl"), 40, 3);
    let f32_run = dir.join("f32");
    succeeds(&lora_args(&data, &f32_run));
    let whole = dir.join("whole");
    let mut args = lora_args(&data, &whole);
    args.push("--bf16".into());
    let stdout = succeeds(&args);
    assert!(
        stdout.contains("precision: bf16 matmul operands, f32 accumulation (")
            && stdout.contains(
                "the saved adapter in f32; the frozen base multiplied from a bf16 copy made once"
            ),
        "{stdout}"
    );
    let (f32_losses, bf16_losses) = (losses(&f32_run), losses(&whole));
    assert_eq!(bf16_losses.len(), 8);
    for (step, (b, f)) in bf16_losses.iter().zip(&f32_losses).enumerate() {
        assert!(
            (b - f).abs() <= 2e-3 * f.abs(),
            "step {}: bf16 {b} vs f32 {f}",
            step + 1
        );
    }
    assert_ne!(bf16_losses, f32_losses, "bf16 must not be f32 exactly");
    let read = |dir: &Path| std::fs::read(dir.join("adapter_model.safetensors")).expect("adapter");
    let saved = read(&whole);
    let tensors = safetensors::SafeTensors::deserialize(&saved).expect("safetensors");
    assert!(
        tensors
            .tensors()
            .iter()
            .all(|(_, t)| t.dtype() == safetensors::Dtype::F32),
        "the adapter is saved in f32"
    );

    let resumed = dir.join("resumed");
    let mut args = lora_args(&data, &resumed);
    args.extend(["--bf16", "--resume-from-checkpoint"].map(str::to_owned));
    args.push(whole.join("checkpoint-4").display().to_string());
    succeeds(&args);
    assert!(
        saved == read(&resumed),
        "the resumed bf16 LoRA run ended with other adapters"
    );

    let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf/llama-tiny-q4.gguf");
    // The fixture has no tokenizer of its own: a word-level one of its
    // 128 ids (the data are ids already), id 0 its EOS.
    let vocab: serde_json::Map<String, serde_json::Value> = (0..128)
        .map(|id| match id {
            0 => ("</s>".to_owned(), id.into()),
            _ => (format!("t{id}"), id.into()),
        })
        .collect();
    let tokenizer = dir.join("tokenizer.json");
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    std::fs::write(&tokenizer, json.to_string()).expect("tokenizer");
    let qlora = dir.join("qlora");
    let mut args = lora_args(&data, &qlora);
    let at = args.iter().position(|a| a == "--config").expect("flag");
    args.splice(
        at..at + 2,
        [
            "--model".to_owned(),
            gguf.display().to_string(),
            "--tokenizer".to_owned(),
            tokenizer.display().to_string(),
        ],
    );
    args.extend(["--bf16", "--save-strategy", "no"].map(str::to_owned));
    let stdout = succeeds(&args);
    assert!(
        stdout.contains("the frozen base's blocks dequantised to bf16 a tile at a time"),
        "{stdout}"
    );
    let q_losses = losses(&qlora);
    assert!(
        q_losses.len() == 8 && q_losses.iter().all(|l| l.is_finite()),
        "{q_losses:?}"
    );
}

#[test]
fn check_compares_the_adapters_gradients() {
    let dir_guard = scratch("lora-check");
    let dir = dir_guard.path();
    let data = random_ids(&dir.join("train.jsonl"), 12, 5);
    let output = padfree(&[
        "check",
        "--config",
        "tiny",
        "--data",
        &data,
        "--per-device-train-batch-size",
        "4",
        "--use-peft",
        "--lora-target-modules",
        "q_proj,down_proj",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{}{stdout}", stderr(&output));
    assert!(
        stdout.contains("lora_B"),
        "the adapters' gradients are not in the report:\n{stdout}"
    );
}

#[test]
fn bad_lora_flags_are_refused_by_name() {
    let dir_guard = scratch("lora-flags");
    let dir = dir_guard.path();
    let data = random_ids(&dir.join("train.jsonl"), 4, 5);
    let out = dir.join("out").display().to_string();
    let train = |flags: &[&str]| {
        let mut args = vec![
            "train",
            "--config",
            "tiny",
            "--data",
            &data,
            "--output-dir",
            &out,
        ];
        args.extend_from_slice(flags);
        padfree(&args)
    };
    for (flags, expected) in [
        (
            &["--use-peft", "--lora-target-modules", "q_proj,lm_head"][..],
            "`lm_head`",
        ),
        (&["--use-peft", "--lora-r", "0"][..], "--lora-r"),
        (
            &["--use-peft", "--lora-dropout", "1.5"][..],
            "--lora-dropout",
        ),
        (&["--lora-r", "8"][..], "--use-peft"),
        (
            &["--use-peft", "--lora-target-modules", "all-linear,q_proj"][..],
            "--lora-target-modules: `all-linear` stands alone in `all-linear,q_proj`",
        ),
        // Wider than `tiny`'s v_proj (2 kv heads of 16): named by its flag.
        (
            &["--use-peft", "--lora-r", "64"][..],
            "--lora-r: rank 64 is not between 1 and the width of the narrowest targeted layer, 32\nHINT: give --lora-r between 1",
        ),
    ] {
        let output = train(flags);
        assert!(!output.status.success(), "{flags:?} was accepted");
        assert!(
            stderr(&output).contains(expected),
            "{flags:?}: {}",
            stderr(&output)
        );
        assert!(!stderr(&output).contains("config field"), "{flags:?}");
    }
    // `-0` is 0, not "dropout -0".
    let output = train(&["--max-steps", "1", "--use-peft", "--lora-dropout", "-0"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout.contains(", dropout 0, on "), "{stdout}");
}

/// QLoRA on SmolLM2-135M from its Q4_1 GGUF: adapters on every linear
/// layer, the base's projections kept in their blocks and multiplied by the
/// fused kernel: three steps, the loss falls, adapter files out.
#[test]
fn smollm2_trains_lora_adapters_from_its_gguf() {
    let Some(gguf) = common::smollm2_gguf() else {
        return;
    };
    let dir_guard = scratch("lora-smollm2");
    let dir = dir_guard.path();
    let data = common::chat_data(dir);
    let out = dir.join("out");
    let stdout = succeeds(
        &[
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
            "1e-3",
            "--logging-steps",
            "1",
            "--save-strategy",
            "no",
            "--use-peft",
            "--lora-target-modules",
            "all-linear",
            "--output-dir",
            &out.display().to_string(),
        ]
        .map(str::to_owned),
    );
    assert!(stdout.contains("lora: r 16"), "{stdout}");
    // QLoRA: the base stays in its Q4_1 blocks; the step's memory is said.
    assert!(stdout.contains("kept in their GGUF blocks"), "{stdout}");
    assert!(stdout.contains("memory: about"), "{stdout}");
    assert!(out.join("adapter_model.safetensors").is_file());
    let losses = losses(&out);
    assert_eq!(losses.len(), 3, "{losses:?}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[2] < losses[0], "the loss did not fall: {losses:?}");
}

/// `--gradient-checkpointing` (per-layer recomputation) with LoRA and
/// dropout: the same losses as without (1e-5 relative: the same operations,
/// a few sums in another order), said in the log and in the memory line,
/// with a smaller activation estimate; and resuming a checkpointed run
/// without the flag is allowed.
#[test]
fn lora_with_gradient_checkpointing_trains_as_without() {
    let dir_guard = scratch("lora-gc");
    let dir = dir_guard.path();
    let data = random_ids(&dir.join("train.jsonl"), 40, 3);
    let plain = dir.join("plain");
    let plain_log = succeeds(&lora_args(&data, &plain));
    let recomputed = dir.join("recomputed");
    let mut args = lora_args(&data, &recomputed);
    args.push("--gradient-checkpointing".into());
    let log = succeeds(&args);
    assert!(log.contains(", gradient checkpointing"), "{log}");
    let activations = |log: &str| -> f64 {
        let line = log
            .lines()
            .find(|l| l.starts_with("memory: about"))
            .expect("memory line");
        let at = line.find("activations ").expect("activations") + "activations ".len();
        line[at..]
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .expect("a number")
    };
    assert!(
        activations(&log) <= activations(&plain_log),
        "{log}\n{plain_log}"
    );
    let (a, b) = (losses(&recomputed), losses(&plain));
    assert_eq!(a.len(), 8);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{a:?} vs {b:?}");
    }
    // The flag is not a setting of the run: a resume may drop it.
    let mut resume = lora_args(&data, &recomputed);
    resume.extend([
        "--resume-from-checkpoint".to_owned(),
        recomputed.join("checkpoint-4").display().to_string(),
        "--overwrite-output-dir".to_owned(),
    ]);
    succeeds(&resume);
}

/// `padfree bench --use-peft`: the padfree rows train adapters (with
/// per-layer checkpointing here), the report says so, and the HF peer's
/// folder gets the f32 base, PEFT's files of the initial adapters and a
/// settings entry naming them (the peer itself cannot start here: `false`
/// is its Python, so the command fails after the padfree row).
#[test]
fn bench_trains_adapters_and_exports_them_for_peft() {
    let dir_guard = scratch("lora-bench");
    let dir = dir_guard.path();
    let data = random_ids(&dir.join("train.jsonl"), 24, 5);
    let out = dir.join("out");
    let args: Vec<String> = [
        "bench",
        "--config",
        "tiny",
        "--data",
        &data,
        "--modes",
        "varlen",
        "--threads",
        "1",
        "--gradient-checkpointing",
        "--peer-python",
        "false",
        "--output-dir",
        &out.display().to_string(),
    ]
    .iter()
    .chain(&common::QUICK_BENCH)
    .chain(&common::LORA_FLAGS)
    .map(|s| (*s).to_owned())
    .collect();
    let output = padfree(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!output.status.success(), "the stand-in peer cannot run");
    let report = std::fs::read_to_string(out.join("bench.md")).expect("bench.md");
    assert!(report.contains("Training: LoRA r 4"), "{report}");
    assert!(
        report.contains("per-layer gradient checkpointing"),
        "{report}"
    );
    assert!(report.contains("metadata from the collator"), "{report}");
    let peer = out.join("peer");
    for file in [
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
    ] {
        assert!(peer.join(file).is_file(), "{file} missing");
    }
    assert!(peer.join("model/model.safetensors").is_file());
    let settings: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(peer.join("settings.json")).expect("settings"),
    )
    .expect("json");
    assert_eq!(settings["adapter"], "adapter");
}

/// Resuming a LoRA checkpoint: other LoRA flags are named with the
/// checkpoint's values (once the two configs were printed as Rust
/// structs), a missing `--use-peft` is said as such, and a preset's
/// checkpoint resumed without `--config` takes the base its
/// adapter_config.json names (once the default preset was loaded and the
/// adapters' shapes refused), ending with the uninterrupted run's adapter.
#[test]
fn a_lora_checkpoint_resumes_without_its_base_flag_and_names_other_flags() {
    let dir_guard = scratch("lora-resume-flags");
    let dir = dir_guard.path();
    let data = random_ids(&dir.join("train.jsonl"), 40, 3);
    let whole = dir.join("whole");
    succeeds(&lora_args(&data, &whole));
    let checkpoint = whole.join("checkpoint-4").display().to_string();
    let resumed = |name: &str, edit: &dyn Fn(&mut Vec<String>)| {
        let mut args = lora_args(&data, &dir.join(name));
        edit(&mut args);
        args.extend(["--resume-from-checkpoint".to_owned(), checkpoint.clone()]);
        padfree(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let set = |args: &mut Vec<String>, flag: &str, value: &str| {
        let at = args.iter().position(|a| a == flag).expect("flag");
        args[at + 1] = value.to_owned();
    };
    let drop_flag = |args: &mut Vec<String>, flag: &str, values: usize| {
        let at = args.iter().position(|a| a == flag).expect("flag");
        args.drain(at..=at + values);
    };
    let output = resumed("other-r", &|args| set(args, "--lora-r", "8"));
    let err = stderr(&output);
    assert!(
        !output.status.success()
            && err.contains(&format!(
                "--use-peft: other LoRA flags than the model's adapters were given: --lora-r 8 (the checkpoint's: {})",
                common::LORA_FLAGS[2]
            ))
            && !err.contains("LoraConfig"),
        "{err}"
    );
    let output = resumed("no-peft", &|args| {
        let at = args.iter().position(|a| a == "--use-peft").expect("flag");
        args.truncate(at);
    });
    assert!(
        stderr(&output).contains("the model carries LoRA adapters, but --use-peft is not given"),
        "{}",
        stderr(&output)
    );
    let output = resumed("no-config", &|args| drop_flag(args, "--config", 1));
    assert!(output.status.success(), "{}", stderr(&output));
    let adapter =
        |out: &Path| std::fs::read(out.join("adapter_model.safetensors")).expect("adapter");
    assert!(adapter(&dir.join("no-config")) == adapter(&whole));
}

/// A GGUF without a tokenizer (the tiny Q4 fixture) trains on pre-tokenized
/// records, which need none (once it was refused for the missing tokenizer
/// before any record was read), and says it wrote no tokenizer files; text
/// records are refused by file and line, naming --tokenizer.
#[test]
fn a_gguf_without_a_tokenizer_trains_on_token_ids() {
    let dir_guard = scratch("gguf-no-tokenizer");
    let dir = dir_guard.path();
    let gguf = common::repo("fixtures/gguf/llama-tiny-q4.gguf")
        .display()
        .to_string();
    let ids = random_ids(&dir.join("ids.jsonl"), 8, 3);
    let text = dir.join("text.jsonl");
    std::fs::write(&text, "{\"question\": \"a b\", \"answer\": \"c\"}\n").expect("write");
    let train = |data: &str, out: &str| {
        let out = dir.join(out).display().to_string();
        padfree(&[
            "train",
            "--model",
            &gguf,
            "--data",
            data,
            "--max-steps",
            "1",
            "--use-peft",
            "--output-dir",
            &out,
        ])
    };
    let output = train(&ids, "ids");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stdout.contains("(adapter_model.safetensors, adapter_config.json), "),
        "{stdout}"
    );
    let output = train(&text.display().to_string(), "text");
    assert!(
        !output.status.success()
            && stderr(&output).contains(&format!(
                "{}:line 1: a text record needs a tokenizer\nHINT: give --tokenizer",
                text.display()
            )),
        "{}",
        stderr(&output)
    );
}

/// `--load-best-model-at-end --merge-adapter` when the best checkpoint can
/// no longer be read: the output holds the last step's adapter (as
/// documented), and now its merged model too, said before the error (once
/// `merged/` was left out without a word).
#[test]
fn a_damaged_best_checkpoint_still_gets_the_last_steps_merged_model() {
    let dir_guard = scratch("lora-best-damaged");
    let dir = dir_guard.path();
    let train = random_ids(&dir.join("train.jsonl"), 40, 7);
    let eval = random_ids(&dir.join("eval.jsonl"), 10, 8);
    let args = |steps: &str, out: &Path| -> Vec<String> {
        [
            "train",
            "--config",
            "tiny",
            "--data",
            &train,
            "--eval-data",
            &eval,
            "--per-device-train-batch-size",
            "4",
            "--learning-rate",
            "0.3",
            "--logging-steps",
            "2",
            "--save-steps",
            "2",
            "--eval-steps",
            "2",
            "--load-best-model-at-end",
            "--use-peft",
            "--merge-adapter",
            "--max-steps",
            steps,
            "--output-dir",
            &out.display().to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    };
    let first = dir.join("first");
    succeeds(&args("8", &first));
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(first.join("trainer_state.json")).expect("state"),
    )
    .expect("json");
    let best = state["best_model"]["checkpoint"]
        .as_str()
        .expect("a best checkpoint");
    assert_ne!(
        best, "checkpoint-8",
        "the scenario needs a best model before the last step"
    );
    std::fs::remove_file(first.join(best).join("adapter_model.safetensors")).expect("damage");
    let out = dir.join("extended");
    let mut extended = args("10", &out);
    extended.extend([
        "--resume-from-checkpoint".to_owned(),
        first.join("checkpoint-8").display().to_string(),
    ]);
    let output = padfree(&extended.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "{stdout}");
    assert!(
        stderr(&output).contains("could not be loaded back, so"),
        "{}",
        stderr(&output)
    );
    assert!(
        stdout.contains(&format!(
            "wrote {} (the last step's adapters merged into the model's weights",
            out.join("merged").display()
        )),
        "{stdout}"
    );
    assert!(out.join("merged/model.safetensors").is_file());
    assert!(out.join("adapter_model.safetensors").is_file());
}

/// LoRA dropout (0.3, the CLI tests' `all-linear` adapters) keys each
/// token's mask by its example and its place in it, so padded and
/// padding-free training, and the step's examples split into two
/// accumulated micro-batches, train the same adapters. Padded: the same
/// losses and grad norms over 8 steps (1e-6 relative). Split: the same
/// losses (1e-6) and first grad norm (1e-6); later grad norms 1e-4, as 8
/// steps at lr 1e-2 amplify the split's other summation order (seen: 3e-8
/// at step 1, 1.3e-5 at step 5), while another mask moves even the first
/// by percent. Keyed by the row, padding moved the masks: the losses then
/// differed by up to 9.9e-4 relative and the grad norms by 7.6%.
#[test]
fn lora_dropout_is_the_same_padded_flattened_and_split() {
    let dir_guard = scratch("lora-dropout-layouts");
    let dir = dir_guard.path();
    let data = random_ids(&dir.join("train.jsonl"), 40, 3);
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let mut args = lora_args(&data, &out);
        // Each flag's value replaced where `lora_args` gives one.
        for pair in ["--lora-dropout", "0.3"].chunks(2).chain(extra.chunks(2)) {
            match args.iter().position(|a| a == pair[0]) {
                Some(at) => args[at + 1] = pair[1].to_owned(),
                None => args.extend(pair.iter().map(|s| (*s).to_owned())),
            }
        }
        succeeds(&args);
        let records: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .filter(|record: &serde_json::Value| record.get("loss").is_some())
            .collect();
        let field = |name: &str| -> Vec<f64> {
            records
                .iter()
                .map(|r| r[name].as_f64().expect("a number"))
                .collect()
        };
        (field("loss"), field("grad_norm"))
    };
    let flat = run("flat", &[]);
    assert_eq!(flat.0.len(), 8, "{flat:?}");
    for (what, extra) in [
        ("padded", &["--padding-free", "false"][..]),
        (
            "two micro-batches",
            &[
                "--per-device-train-batch-size",
                "2",
                "--gradient-accumulation-steps",
                "2",
            ][..],
        ),
    ] {
        let ours = run(what, extra);
        for (field, a, b) in [("loss", &ours.0, &flat.0), ("grad_norm", &ours.1, &flat.1)] {
            assert_eq!(a.len(), b.len(), "{what}");
            for (step, (x, y)) in a.iter().zip(b).enumerate() {
                let tolerance = if what == "padded" || field == "loss" || step == 0 {
                    1e-6
                } else {
                    1e-4
                };
                assert!(
                    (x - y).abs() <= tolerance * y.abs(),
                    "{what}: {field} {a:?} vs padding-free {b:?}"
                );
            }
        }
    }
}
