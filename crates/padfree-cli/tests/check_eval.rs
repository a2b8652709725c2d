//! `padfree check` on tiny Qwen2/Qwen3 models (HF fixtures) and on
//! SmolLM2-135M, `train --verify-packing`, and evaluation during training.

mod common;

use std::path::{Path, PathBuf};

use common::{padfree, padfree_in_repo, repo, scratch, stderr, tiny_config_with_shipped_vocab};

/// Records of token ids below `vocab` (the Qwen fixtures have no tokenizer).
fn token_id_data(dir: &Path, vocab: u32) -> String {
    let mut text = String::new();
    let mut state = 7_u32;
    for record in 0..12 {
        let len = 3 + (record * 7) % 30;
        let ids: Vec<String> = (0..len)
            .map(|_| {
                state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                ((state >> 8) % vocab).to_string()
            })
            .collect();
        text.push_str(&format!("{{\"input_ids\": [{}]}}\n", ids.join(", ")));
    }
    let path = dir.join("ids.jsonl");
    std::fs::write(&path, text).expect("write data");
    path.display().to_string()
}

#[test]
fn check_is_green_on_tiny_qwen2_and_qwen3_and_names_the_fault_when_packing_is_naive() {
    let dir = scratch("check-qwen");
    let data = token_id_data(dir.path(), 128);
    for family in ["qwen2-tiny", "qwen3-tiny", "llama-tiny"] {
        let model = repo("fixtures/hf").join(family).display().to_string();
        let args = [
            "check",
            "--model",
            &model,
            "--data",
            &data,
            "--per-device-train-batch-size",
            "4",
            "--batches",
            "3",
        ];
        let output = padfree(&args);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{family}: {}{stdout}",
            stderr(&output)
        );
        assert!(
            stdout.contains("packing check passed: 3 micro-batch(es), 12 examples"),
            "{family}: {stdout}"
        );
        assert_eq!(stdout.matches("MISMATCH").count(), 0, "{stdout}");
        assert_eq!(stdout.matches(" ok\n").count(), 3 * 8, "{stdout}");

        let mut broken = args.to_vec();
        broken.extend(["--inject-fault", "naive-packing"]);
        let output = padfree(&broken);
        assert!(!output.status.success(), "{family}: naive packing passed");
        let err = stderr(&output);
        assert!(
            err.contains("packing check failed in micro-batch 1: logits: padded vs padding-free")
                && err.contains("ids.jsonl:line ")
                && err.contains("first at decoder layer 0 "),
            "{family}: {err}"
        );
        assert!(
            String::from_utf8_lossy(&output.stdout).contains("MISMATCH"),
            "{family}"
        );
    }
}

#[test]
fn train_verify_packing_checks_before_the_first_step() {
    let dir = scratch("verify-packing");
    let config = tiny_config_with_shipped_vocab(dir.path());
    let out = dir.path().join("run");
    let output = padfree(&[
        "train",
        "--config",
        &config,
        "--data",
        &repo("data/gsm-symbolic/train.jsonl").display().to_string(),
        "--max-steps",
        "2",
        "--save-strategy",
        "no",
        "--verify-packing",
        "--verify-packing-batches",
        "2",
        "--output-dir",
        &out.display().to_string(),
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}{stdout}", stderr(&output));
    let checked = stdout
        .find("packing check passed: 2 micro-batch(es)")
        .expect("the check ran");
    let trained = stdout.find("training: 2 optimizer steps").expect("trained");
    assert!(checked < trained, "{stdout}");
}

fn run_with_eval(dir: &Path, name: &str, extra: &[&str]) -> (PathBuf, String) {
    let config = tiny_config_with_shipped_vocab(dir);
    let eval = dir.join("eval.jsonl");
    let text = std::fs::read_to_string(repo("data/gsm-symbolic/eval.jsonl")).expect("eval split");
    let first: String = text.lines().take(20).map(|l| format!("{l}\n")).collect();
    std::fs::write(&eval, first).expect("write eval data");
    let out = dir.join(name);
    let mut args = vec![
        "train",
        "--config",
        &config,
        "--data",
        "data/gsm-symbolic/train.jsonl",
        "--eval-data",
        eval.to_str().expect("utf-8"),
        "--eval-steps",
        "2",
        "--per-device-eval-batch-size",
        "6",
        "--max-steps",
        "4",
        "--logging-steps",
        "3",
        "--learning-rate",
        "1e-3",
        "--output-dir",
        out.to_str().expect("utf-8"),
    ];
    args.extend(extra);
    let output = padfree_in_repo(&args);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{}{stdout}", stderr(&output));
    (out, stdout)
}

fn eval_losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).expect("json line");
            Some((record["step"].as_u64()?, record.get("eval_loss")?.as_f64()?))
        })
        .collect()
}

#[test]
fn evaluation_is_logged_summarised_plotted_and_the_same_padded() {
    let dir = scratch("eval");
    let (out, stdout) = run_with_eval(dir.path(), "varlen", &[]);
    // Steps 2 and 4 evaluate; step 2 is no logging step but gets a line.
    let losses = eval_losses(&out);
    assert_eq!(
        losses.iter().map(|(step, _)| *step).collect::<Vec<_>>(),
        vec![2, 4],
        "{losses:?}"
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    assert_eq!(metrics.lines().count(), 3, "steps 2, 3, 4: {metrics}");
    for (_, loss) in &losses {
        assert!(loss.is_finite() && *loss > 0.0 && *loss < 9.0, "{loss}");
    }
    assert!(stdout.contains("'eval_loss': "), "{stdout}");
    assert!(stdout.contains("eval_perplexity          = "), "{stdout}");
    let results: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("train_results.json")).expect("results"),
    )
    .expect("json");
    assert_eq!(results["eval_loss"].as_f64(), Some(losses[1].1));
    let perplexity = results["eval_perplexity"].as_f64().expect("perplexity");
    assert!((perplexity - losses[1].1.exp()).abs() < 1e-9 * perplexity);
    assert!(out.join("loss.png").exists());

    // Padded training and evaluation: the same eval loss to f32 rounding
    // (the two runs' weights differ by rounding only).
    let (padded, _) = run_with_eval(dir.path(), "padded", &["--padding-free", "false"]);
    for ((step, a), (_, b)) in losses.iter().zip(eval_losses(&padded)) {
        assert!(
            (a - b).abs() <= 1e-5 * a,
            "step {step}: padding-free {a} vs padded {b}"
        );
    }
}

#[test]
fn load_best_model_at_end_writes_the_best_checkpoint_as_the_final_model() {
    let dir = scratch("best");
    let (out, stdout) = run_with_eval(
        dir.path(),
        "best",
        &[
            "--load-best-model-at-end",
            "--metric-for-best-model",
            "loss",
            "--save-steps",
            "2",
        ],
    );
    let losses = eval_losses(&out);
    let &(best_step, best_loss) = losses
        .iter()
        .fold(None, |best: Option<&(u64, f64)>, e| match best {
            Some(b) if b.1 <= e.1 => best,
            _ => Some(e),
        })
        .expect("evaluated");
    assert!(stdout.contains("; the final model is the one with the lowest eval_loss"));
    assert!(
        stdout.contains(&format!(
            "best model               = step {best_step}, eval_loss {best_loss:.4}"
        )),
        "{stdout}"
    );
    let results: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("train_results.json")).expect("results"),
    )
    .expect("json");
    assert_eq!(results["best_model"]["step"].as_u64(), Some(best_step));
    // Step 2 has a checkpoint; the last step (4) is the final model itself.
    let model = |dir: &Path| std::fs::read(dir.join("model.safetensors")).expect("model");
    let checkpoint_2 = model(&out.join("checkpoint-2"));
    assert_eq!(model(&out) == checkpoint_2, best_step == 2, "{losses:?}");
    assert_eq!(
        results["best_model_loaded"].as_bool().unwrap_or(false),
        best_step == 2
    );
}

#[test]
fn load_best_model_at_end_without_a_checkpoint_for_every_evaluation_is_refused() {
    for (extra, needs) in [
        (
            &["--save-strategy", "no"][..],
            "--load-best-model-at-end: needs checkpoints to load the best model from",
        ),
        (
            &["--save-steps", "3"][..],
            "--save-steps 3 is not a multiple of --eval-steps 2",
        ),
        (
            &["--eval-strategy", "no"][..],
            "--load-best-model-at-end needs evaluation",
        ),
    ] {
        let mut args = vec![
            "train",
            "--config",
            "tiny",
            "--eval-data",
            "data/gsm-symbolic/eval.jsonl",
            "--eval-steps",
            "2",
            "--load-best-model-at-end",
        ];
        args.extend(extra);
        let output = padfree(&args);
        assert!(!output.status.success());
        let err = stderr(&output);
        assert!(err.contains(needs) && err.contains("HINT: "), "{err}");
    }
}

#[test]
fn an_eval_strategy_without_eval_data_is_refused() {
    let output = padfree(&[
        "train",
        "--config",
        "tiny",
        "--eval-strategy",
        "steps",
        "--max-steps",
        "1",
    ]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("HINT: give --eval-data"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn check_runs_on_smollm2_135m() {
    let Some(gguf) = common::smollm2_gguf() else {
        return;
    };
    let output = padfree_in_repo(&[
        "check",
        "--model",
        gguf.to_str().expect("utf-8"),
        "--data",
        "data/gsm-symbolic/eval.jsonl",
        "--use-chat-template",
        // Short examples keep it to seconds; the figure for full
        // batches is in the README.
        "--max-seq-len",
        "48",
        "--train-on-inputs",
        "--per-device-train-batch-size",
        "3",
        "--batches",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}{stdout}", stderr(&output));
    assert!(
        stdout.contains("packing check passed: 1 micro-batch(es), 3 examples"),
        "{stdout}"
    );
}

#[test]
fn check_on_batches_of_one_example_says_isolation_was_not_tested() {
    let dir = scratch("check-one");
    let config = tiny_config_with_shipped_vocab(dir.path());
    let args = [
        "check",
        "--config",
        &config,
        "--data",
        "data/gsm-symbolic/eval.jsonl",
        "--per-device-train-batch-size",
        "1",
        "--batches",
        "2",
    ];
    let output = padfree_in_repo(&args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let err = stderr(&output);
    assert!(!output.status.success(), "{stdout}");
    // The two isolation rows of each batch, not run, and said why.
    assert_eq!(
        stdout
            .matches("not run (a batch of one example has no other example to keep apart)")
            .count(),
        4,
        "{stdout}"
    );
    assert!(!stdout.contains("packing check passed"), "{stdout}");
    assert!(
        err.contains("packing check incomplete")
            && err.contains("HINT: check batches of at least 2"),
        "{err}"
    );
    // Training with --verify-packing warns and trains: nothing differed.
    let out = dir.path().join("out");
    let output = padfree_in_repo(&[
        "train",
        "--config",
        &config,
        "--data",
        "data/gsm-symbolic/eval.jsonl",
        "--per-device-train-batch-size",
        "1",
        "--max-steps",
        "1",
        "--verify-packing",
        "--output-dir",
        out.to_str().expect("utf-8"),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("warning: --verify-packing: a batch of one example"),
        "{}",
        stderr(&output)
    );
}

/// Evaluation runs off the autodiff graph: a forward pass that is never
/// run backward used to keep every batch's activations (the logits of
/// every labelled row) alive until the weights changed, so one evaluation
/// of the shipped eval split held them all. Peak memory with and without
/// evaluation, of the same run.
#[test]
fn evaluation_keeps_nothing_for_a_backward_pass() {
    let dir = scratch("eval-memory");
    let config = tiny_config_with_shipped_vocab(dir.path());
    let peak = |name: &str, extra: &[&str]| -> (u64, Option<f64>) {
        let out = dir.path().join(name);
        let mut args = vec![
            "train",
            "--config",
            &config,
            "--data",
            "data/gsm-symbolic/eval.jsonl",
            "--max-steps",
            "1",
            "--eval-data",
            "data/gsm-symbolic/eval.jsonl",
            "--output-dir",
            out.to_str().expect("utf-8"),
        ];
        args.extend(extra);
        let output = padfree_in_repo(&args);
        assert!(output.status.success(), "{}", stderr(&output));
        let results: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("train_results.json")).expect("results"),
        )
        .expect("json");
        (
            results["peak_memory_bytes"].as_u64().expect("VmHWM"),
            results["eval_loss"].as_f64(),
        )
    };
    let (without, _) = peak("no-eval", &["--eval-strategy", "no"]);
    let (with, eval_loss) = peak("eval", &["--eval-steps", "1"]);
    assert!(
        eval_loss.is_some(),
        "the run must evaluate for this to test anything"
    );
    // 200 examples, about 14,500 labelled rows of 4096 logits (f32), kept
    // across batches: measured 357 MiB against 47 MiB before; now 54 MiB
    // against 48 MiB, with the same eval loss to the bit.
    let mib = |b: u64| b as f64 / 1048576.0;
    assert!(
        with < without + (48 << 20),
        "peak with evaluation {:.0} MiB, without {:.0} MiB",
        mib(with),
        mib(without)
    );
}
