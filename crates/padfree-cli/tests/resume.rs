//! What a resumed run keeps, refuses and reports (docs/training.md, "What
//! padfree guarantees", the evaluation and resume rows): the final model
//! after a resume with fewer flags, the best model of a moved run, another
//! held-out set, another run's checkpoints in the output directory, the
//! final checkpoint and extending a finished run, whole-run results.

mod common;

use std::path::Path;
use std::process::Output;

use common::{first_records, padfree, random_ids, scratch, stderr};

/// A run that overfits: evaluated every 2 steps, checkpointed every 2, 12
/// steps; the held-out loss rises after its first evaluations.
fn overfitting_args<S: AsRef<str>>(dir: &Path, out: &Path, extra: &[S]) -> Vec<String> {
    let train = random_ids(&dir.join("train.jsonl"), 40, 7);
    let mut args: Vec<String> = [
        "train",
        "--config",
        "tiny",
        "--data",
        &train,
        "--max-steps",
        "12",
        "--per-device-train-batch-size",
        "4",
        "--learning-rate",
        "1e-2",
        "--logging-steps",
        "2",
        "--save-steps",
        "2",
        "--output-dir",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| s.as_ref().to_owned()));
    args
}

fn with_eval(dir: &Path, seed: u32) -> Vec<String> {
    let eval = random_ids(&dir.join(format!("eval-{seed}.jsonl")), 10, seed);
    [
        "--eval-data",
        &eval,
        "--eval-steps",
        "2",
        "--load-best-model-at-end",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// `args` with the value after `flag` replaced.
fn set(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    let at = args
        .iter()
        .position(|a| a == flag)
        .expect("the flag is there");
    args[at + 1] = value.to_owned();
    args
}

fn run(args: &[String]) -> (Output, String) {
    let output = padfree(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (output, stdout)
}

fn succeeds(args: &[String]) -> String {
    let (output, stdout) = run(args);
    assert!(output.status.success(), "{}{stdout}", stderr(&output));
    stdout
}

fn resume_from(mut args: Vec<String>, checkpoint: &Path) -> Vec<String> {
    args.push("--resume-from-checkpoint".into());
    args.push(checkpoint.display().to_string());
    args
}

fn model(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors")).expect("model file")
}

fn results(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("train_results.json")).expect("results"))
        .expect("json")
}

fn checkpoints(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(out)
        .expect("out")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-") || n.starts_with(".tmp"))
        .collect();
    names.sort();
    names
}

#[test]
fn a_moved_run_resumes_to_its_best_model_and_fewer_flags_end_with_the_last_steps() {
    let guard = scratch("resume-best");
    let dir = guard.path();
    let first = dir.join("first");
    let mut flags = with_eval(dir, 99);
    succeeds(&overfitting_args(dir, &first, &flags));
    let straight = results(&first);
    let best_step = straight["best_model"]["step"]
        .as_u64()
        .expect("a best model");
    assert!(
        best_step < 10,
        "the run must overfit for this test to mean something: best at step {best_step}"
    );
    assert_eq!(
        straight["best_model"]["checkpoint"].as_str(),
        Some(format!("checkpoint-{best_step}").as_str()),
        "named in the run directory, not by an absolute path"
    );
    // The last step is saved too (HF's habit): every even step.
    assert_eq!(checkpoints(&first).len(), 6);

    // Moved: the best checkpoint is found beside the resumed one.
    let moved = dir.join("moved");
    std::fs::rename(&first, &moved).expect("move the run");
    let stdout = succeeds(&resume_from(
        overfitting_args(dir, &moved, &flags),
        &moved.join("checkpoint-10"),
    ));
    let best = moved.join(format!("checkpoint-{best_step}"));
    assert!(model(&moved) == model(&best), "{stdout}");
    assert!(
        stdout.contains(&format!("loaded from {}", best.display())),
        "{stdout}"
    );

    // Resumed without --eval-data and --load-best-model-at-end: the final
    // model is the last step's, said so, and the summary says which step
    // its eval loss belongs to.
    flags.clear();
    let stdout = succeeds(&resume_from(
        overfitting_args(dir, &moved, &flags),
        &moved.join("checkpoint-10"),
    ));
    assert!(model(&moved) == model(&moved.join("checkpoint-12")));
    assert!(model(&moved) != model(&best));
    assert!(
        stdout.contains(&format!(
            "note: the resumed run kept its best model (step {best_step}"
        )) && stdout.contains("the final model is the last step's"),
        "{stdout}"
    );
    assert!(
        stdout.contains("(step 10; the final model, step 12, was not evaluated)"),
        "{stdout}"
    );

    // train_results.json covers the whole run, the resumed part labelled.
    let resumed = results(&moved);
    for field in ["real_tokens", "padded_tokens", "train_loss", "global_step"] {
        assert_eq!(resumed[field], straight[field], "{field}");
    }
    assert_eq!(resumed["resumed"]["from_step"].as_u64(), Some(10));
    assert_eq!(resumed["resumed"]["steps"].as_u64(), Some(2));
    assert!(
        resumed["resumed"]["real_tokens"].as_u64() < straight["real_tokens"].as_u64(),
        "{resumed}"
    );
    assert!(stdout.contains("(whole run, steps 1-12)"), "{stdout}");
}

#[test]
fn another_held_out_set_is_refused_on_resume() {
    let guard = scratch("resume-eval");
    let dir = guard.path();
    let out = dir.join("run");
    succeeds(&overfitting_args(dir, &out, &with_eval(dir, 99)));
    let (output, _) = run(&resume_from(
        overfitting_args(dir, &out, &with_eval(dir, 5)),
        &out.join("checkpoint-4"),
    ));
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(
        err.contains("--eval-data: the resumed run was evaluated on another held-out set")
            && err.contains("HINT: resume with the run's own --eval-data"),
        "{err}"
    );
    // The same set in another order is the same set (the loss is a sum).
    let eval = dir.join("eval-99.jsonl");
    let text = std::fs::read_to_string(&eval).expect("eval");
    let reversed: String = text.lines().rev().map(|l| format!("{l}\n")).collect();
    let shuffled = dir.join("eval-reversed.jsonl");
    std::fs::write(&shuffled, reversed).expect("write");
    let mut same = with_eval(dir, 99);
    same[1] = shuffled.display().to_string();
    succeeds(&resume_from(
        overfitting_args(dir, &out, &same),
        &out.join("checkpoint-4"),
    ));
    // Without --load-best-model-at-end too: the eval curve would mix sets.
    let mut other = with_eval(dir, 5);
    other.pop();
    let (output, _) = run(&resume_from(
        overfitting_args(dir, &out, &other),
        &out.join("checkpoint-4"),
    ));
    assert!(stderr(&output).contains("another held-out set"));
}

#[test]
fn an_older_runs_checkpoints_are_neither_counted_nor_removed_by_a_new_run() {
    let guard = scratch("resume-rotation");
    let dir = guard.path();
    let out = dir.join("run");
    // The older run: checkpoints 4 and 5 are left.
    let older = overfitting_args::<&str>(dir, &out, &[]);
    succeeds(&set(set(older, "--max-steps", "5"), "--save-steps", "1"));
    for step in 1..=3 {
        std::fs::remove_dir_all(out.join(format!("checkpoint-{step}"))).expect("remove");
    }
    let stale = model(&out.join("checkpoint-5"));
    // The new run overwrites the directory with a limit of 1.
    let newer = overfitting_args(
        dir,
        &out,
        &["--overwrite-output-dir", "--save-total-limit", "1"],
    );
    let stdout = succeeds(&set(set(newer, "--max-steps", "2"), "--save-steps", "1"));
    assert_eq!(
        checkpoints(&out),
        ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    );
    assert!(model(&out.join("checkpoint-5")) == stale);
    assert!(
        stdout.contains("note: checkpoint-4, checkpoint-5 in")
            && stdout.contains("belong to another run"),
        "{stdout}"
    );
    // The older run's final model was there until this one finished.
    assert!(
        stdout.contains("holds another run's final model and reports"),
        "{stdout}"
    );
    assert!(stdout.contains(&format!(
        "removed {} (--save-total-limit)",
        out.join("checkpoint-1").display()
    )));
}

#[test]
fn a_finished_run_can_be_extended_from_its_final_checkpoint_and_nothing_else_changes_steps() {
    let guard = scratch("resume-extend");
    let dir = guard.path();
    let out = dir.join("run");
    let args = set(
        set(overfitting_args::<&str>(dir, &out, &[]), "--max-steps", "3"),
        "--save-steps",
        "2",
    );
    succeeds(&args);
    // The last step is saved too, not only every --save-steps.
    assert_eq!(checkpoints(&out), ["checkpoint-2", "checkpoint-3"]);
    let longer = set(args.clone(), "--max-steps", "5");
    let stdout = succeeds(&resume_from(longer, &out.join("checkpoint-3")));
    assert!(
        stdout.contains("note: extending the finished run of 3 steps to 5"),
        "{stdout}"
    );
    assert_eq!(results(&out)["global_step"].as_u64(), Some(5));
    // Mid-run, another --max-steps is still refused: not the same run.
    let (output, _) = run(&resume_from(
        set(args, "--max-steps", "5"),
        &out.join("checkpoint-2"),
    ));
    let err = stderr(&output);
    assert!(
        !output.status.success()
            && err
                .contains("only a finished run (resumed from its last checkpoint) can be extended"),
        "{err}"
    );
}

#[test]
fn evaluation_covers_the_final_model_whatever_the_strategy() {
    let guard = scratch("resume-final-eval");
    let dir = guard.path();
    let eval = random_ids(&dir.join("eval.jsonl"), 6, 3);
    let steps_of = |out: &Path| -> Vec<u64> {
        std::fs::read_to_string(out.join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .filter_map(|line| {
                let record: serde_json::Value = serde_json::from_str(line).expect("json");
                record.get("eval_loss")?;
                record["step"].as_u64()
            })
            .collect()
    };
    // 40 examples in batches of 4: 10 steps an epoch, cut at 4 by
    // --max-steps; HF evaluates a last epoch cut short.
    let out = dir.join("epoch");
    succeeds(&set(
        overfitting_args(
            dir,
            &out,
            &["--eval-data", &eval, "--eval-strategy", "epoch"],
        ),
        "--max-steps",
        "4",
    ));
    assert_eq!(steps_of(&out), [4]);
    // --eval-steps past the end: the final evaluation, and a note.
    let out = dir.join("steps");
    let stdout = succeeds(&overfitting_args(
        dir,
        &out,
        &["--eval-data", &eval, "--eval-steps", "500"],
    ));
    assert_eq!(steps_of(&out), [12]);
    assert!(
        stdout.contains("note: --eval-steps 500 is past the run's last step (12)"),
        "{stdout}"
    );
    assert!(stdout.contains("(step 12: the final model)"), "{stdout}");
}

#[test]
fn a_preset_whose_vocabulary_grew_resumes_with_the_same_flags() {
    let guard = scratch("resume-preset");
    let dir = guard.path();
    let data = dir.join("train.jsonl");
    std::fs::write(&data, first_records(12)).expect("write data");
    let out = dir.join("run");
    let args: Vec<String> = [
        "train",
        "--config",
        "tiny",
        "--data",
        data.to_str().expect("utf-8"),
        "--max-steps",
        "3",
        "--per-device-train-batch-size",
        "4",
        "--save-steps",
        "2",
        "--output-dir",
        out.to_str().expect("utf-8"),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let stdout = succeeds(&args);
    assert!(
        stdout.contains("vocabulary: 4096 tokens")
            && stdout.contains("grows to hold the tokenizer"),
        "{stdout}"
    );
    succeeds(&resume_from(args.clone(), &out.join("checkpoint-2")));
    // Another preset is still refused by its shape.
    let other = set(args, "--config", "small");
    let (output, _) = run(&resume_from(other, &out.join("checkpoint-2")));
    assert!(
        stderr(&output).contains("of the checkpoint"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn a_run_resumed_into_another_directory_keeps_its_best_model_where_it_is() {
    let guard = scratch("resume-elsewhere");
    let dir = guard.path();
    let first = dir.join("first");
    let flags = with_eval(dir, 99);
    succeeds(&overfitting_args(dir, &first, &flags));
    let best_step = results(&first)["best_model"]["step"]
        .as_u64()
        .expect("a best model");
    assert!(
        best_step < 10,
        "the run must overfit: best at step {best_step}"
    );
    let best = first.join(format!("checkpoint-{best_step}"));
    // Resumed from the first run's checkpoint into a new directory: the
    // best stays in the first run's, and the new state names it there.
    let second = dir.join("second");
    succeeds(&resume_from(
        overfitting_args(dir, &second, &flags),
        &first.join("checkpoint-10"),
    ));
    assert!(model(&second) == model(&best));
    assert_eq!(checkpoints(&second), ["checkpoint-12"]);
    // Resumed again from the new directory's own checkpoint (the finished
    // run, no steps left): the best is still found.
    let stdout = succeeds(&resume_from(
        overfitting_args(dir, &second, &flags),
        &second.join("checkpoint-12"),
    ));
    assert!(model(&second) == model(&best), "{stdout}");
    assert!(
        stdout.contains("no steps (resumed at step 12, the run's end)"),
        "{stdout}"
    );
}

/// The epoch of a step is the fraction of the epoch's examples trained so
/// far, continuous across a resume that re-plans the rest of the epoch for
/// another accumulation: 40 examples in micro-batches of 2, 2 a step (10
/// steps an epoch), resumed after step 3 (12 examples: 0.3) with 1 a step.
/// By steps, step 4 logged 4/17 = 0.235 (3 earlier steps plus 14 new ones
/// in the epoch): backwards.
#[test]
fn the_epoch_stays_continuous_across_a_re_planned_resume() {
    let dir_guard = scratch("epoch-replanned");
    let dir = dir_guard.path();
    let out = dir.join("out");
    let mut args = overfitting_args(
        dir,
        &out,
        &[
            "--gradient-accumulation-steps",
            "2",
            "--num-train-epochs",
            "2",
        ],
    );
    let at = args.iter().position(|a| a == "--max-steps").expect("flag");
    args.drain(at..at + 2);
    let args = set(args, "--per-device-train-batch-size", "2");
    let args = set(set(args, "--logging-steps", "1"), "--save-steps", "3");
    // The whole run with accumulation 2, then from its checkpoint-3 with 1.
    succeeds(&args);
    let resumed_out = dir.join("resumed");
    let again = set(args, "--output-dir", &resumed_out.display().to_string());
    let again = set(
        resume_from(again, &out.join("checkpoint-3")),
        "--gradient-accumulation-steps",
        "1",
    );
    succeeds(&again);
    let metrics = std::fs::read_to_string(resumed_out.join("metrics.jsonl")).expect("metrics");
    let epochs: Vec<(u64, f64)> = metrics
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("json"))
        .filter(|row| row.get("loss").is_some())
        .map(|row| {
            let step = row["step"].as_u64().expect("step");
            (step, row["epoch"].as_f64().expect("epoch"))
        })
        .collect();
    // 3 steps of 4 examples, then 14 of 2 to the end of epoch 0, 20 of 2
    // in epoch 1.
    assert_eq!(epochs.len(), 3 + 14 + 20, "{epochs:?}");
    for (i, &(step, epoch)) in epochs.iter().enumerate() {
        assert_eq!(step, i as u64 + 1, "{epochs:?}");
        let examples = if i < 3 { 4 * (i + 1) } else { 12 + 2 * (i - 2) };
        let want = examples as f64 / 40.0;
        assert!(
            (epoch - want).abs() < 1e-9,
            "step {step}: epoch {epoch}, want {want}"
        );
    }
}
