//! The training loop against its promises: padded and padding-free training
//! agree step by step, accumulation is normalised by the window's label
//! tokens, resume is bit-exact, and bad runs stop cleanly.

use std::path::Path;

use padfree_model::tensor::{IntoHostVec, cpu_device, cpu_device_with_checkpointing};
use padfree_model::{LlamaConfig, LlamaModel, ModelInput, causal_lm_loss};
use padfree_pack::flatten;
use padfree_train::checkpoint;
use padfree_train::outputs::{self, prepare_output_dir};
use padfree_train::{
    AttentionMode, Batching, EvalSet, EvalSettings, EvalStrategy, Observer, SaveStrategy,
    TrainConfig, TrainError, Trainer, Warmup,
};

mod common;
use common::{StopAfter, config, examples, scratch_dir};

fn model(seed: u64) -> LlamaModel {
    LlamaModel::init(&LlamaConfig::tiny(), seed, &cpu_device(true)).expect("tiny model")
}

fn trainer(config: TrainConfig, dir: &Path) -> Trainer {
    prepare_output_dir(dir, false, false).expect("output dir");
    Trainer::new(model(1), examples(40, 128, 3), config, dir, Vec::new()).expect("trainer")
}

fn params(model: &LlamaModel) -> Vec<Vec<f32>> {
    model
        .params()
        .into_iter()
        .map(|p| p.value.clone().into_vec())
        .collect()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// On the CPU the optimizer's master values are the model's weights from
/// the start, lent without a copy: a copy kept by the model until the
/// first update held every trained weight twice through step 1, whose
/// peak was the run's (SmolLM2-135M: 513 MiB above every later step).
/// Before any step, every value is with the model, as built.
#[test]
fn the_weights_are_held_once_from_the_first_step() {
    let dir = scratch_dir("held-once");
    let t = trainer(config(AttentionMode::Varlen, 2), dir.path());
    let optimizer = t.optimizer();
    assert!(!optimizer.is_empty());
    for index in 0..optimizer.len() {
        assert!(
            optimizer.values(index).is_empty(),
            "parameter {index}: the optimizer holds a copy of its own"
        );
    }
    assert_eq!(params(t.model()), params(&model(1)), "the weights as built");
}

#[test]
fn padded_and_padding_free_training_agree_over_20_steps() {
    let mut runs = Vec::new();
    for attention in [
        AttentionMode::Varlen,
        AttentionMode::VarlenPerLayer,
        AttentionMode::Padded,
    ] {
        let dir_guard = scratch_dir(&format!("equiv-{}", attention.name()));
        let dir = dir_guard.path();
        let mut t = trainer(config(attention, 20), dir);
        let summary = t.train(&mut ()).expect("trains");
        assert_eq!(summary.steps, 20);
        runs.push((
            attention,
            t.step_losses().to_vec(),
            params(t.model()),
            summary,
        ));
    }
    let (_, varlen_losses, varlen_params, varlen_summary) = &runs[0];
    assert!(
        varlen_losses[19] < varlen_losses[0],
        "the loss must fall: {varlen_losses:?}"
    );
    assert_eq!(varlen_summary.padded_tokens, 0);
    for (attention, losses, weights, summary) in &runs[1..] {
        // The per-layer variant runs the same kernels on the same boundaries.
        if *attention == AttentionMode::VarlenPerLayer {
            assert_eq!(
                losses, varlen_losses,
                "varlen-per-layer must be bit-identical"
            );
            continue;
        }
        // Padded rows sum the same products in a different order (longer
        // rows, masked keys), so f32 rounding differs by ~1e-7 relative per
        // op; Adam's normalised updates carry that over 20 steps to ~1e-5.
        for (step, (a, b)) in losses.iter().zip(varlen_losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs(),
                "step {}: padded {a} vs varlen {b}",
                step + 1
            );
        }
        let diff = max_abs_diff(weights, varlen_params);
        assert!(diff < 1e-4, "final weights differ by {diff}");
        assert!(
            summary.padded_tokens > 0,
            "the padded run must have fed pads"
        );
    }
}

#[test]
fn accumulation_is_normalised_by_the_window_label_tokens() {
    let one_batch = TrainConfig {
        batching: Batching::Examples(8),
        shuffle: false,
        max_steps: Some(1),
        ..config(AttentionMode::Varlen, 1)
    };
    let accumulated = TrainConfig {
        batching: Batching::Examples(2),
        gradient_accumulation_steps: 4,
        ..one_batch.clone()
    };
    let (dir_a, dir_b) = (scratch_dir("accum-a"), scratch_dir("accum-b"));
    let mut a = trainer(one_batch, dir_a.path());
    let mut b = trainer(accumulated, dir_b.path());
    let (ma, mb) = (a.train_step().expect("step"), b.train_step().expect("step"));
    assert_eq!(ma.label_tokens, mb.label_tokens);
    assert!(
        (ma.loss - mb.loss).abs() < 1e-6 * ma.loss,
        "{} vs {}",
        ma.loss,
        mb.loss
    );
    assert!((ma.grad_norm - mb.grad_norm).abs() < 1e-5 * ma.grad_norm);
    assert!(max_abs_diff(&params(a.model()), &params(b.model())) < 1e-6);

    // A mean of micro-batch means weighs tokens unequally here, so the test
    // can tell the two normalisations apart.
    let fresh = model(1);
    let data = examples(40, 128, 3);
    let micro_means: Vec<f64> = data[..8]
        .chunks(2)
        .map(|pair| {
            let batch = flatten(pair).expect("flatten");
            let input = ModelInput::Varlen(&batch);
            let loss = causal_lm_loss(fresh.forward(&input).expect("forward"), &input.targets())
                .expect("loss");
            f64::from(loss.mean().into_vec()[0])
        })
        .collect();
    let mean_of_means = micro_means.iter().sum::<f64>() / 4.0;
    assert!(
        (mean_of_means - ma.loss).abs() > 1e-4,
        "{mean_of_means} vs {}",
        ma.loss
    );
}

/// Asks to stop once `after` steps are done, as Ctrl-C does.

#[test]
fn resume_after_an_interruption_is_bit_exact() {
    let run = TrainConfig {
        gradient_accumulation_steps: 2,
        weight_decay: 0.1,
        ..config(AttentionMode::Varlen, 9)
    };
    let straight_dir_guard = scratch_dir("resume-straight");
    let straight_dir = straight_dir_guard.path();
    let mut straight = trainer(run.clone(), straight_dir);
    straight.train(&mut ()).expect("trains");

    let interrupted_dir_guard = scratch_dir("resume-interrupted");
    let interrupted_dir = interrupted_dir_guard.path();
    let mut first = trainer(run.clone(), interrupted_dir);
    let summary = first.train(&mut StopAfter(4, 0)).expect("trains");
    assert!(summary.interrupted);
    assert_eq!(summary.global_step, 4);
    let saved = interrupted_dir.join("checkpoint-4");
    assert!(
        saved.join("model.safetensors").is_file() && saved.join("optimizer.safetensors").is_file()
    );
    assert!(
        !interrupted_dir.join("model.safetensors").exists(),
        "an interrupted run writes no final model"
    );

    let weights = LlamaModel::from_hf_dir(&saved, &cpu_device(true)).expect("checkpoint loads");
    let mut resumed = Trainer::resume(
        weights,
        &checkpoint::verify(&saved).expect("verifies"),
        examples(40, 128, 3),
        run,
        interrupted_dir,
        Vec::new(),
    )
    .expect("resumes");
    assert_eq!(resumed.global_step(), 4);
    resumed.train(&mut ()).expect("trains");

    let bits = |losses: &[f64]| losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(resumed.step_losses()), bits(straight.step_losses()));
    let (pa, pb) = (params(resumed.model()), params(straight.model()));
    for (a, b) in pa.iter().zip(&pb) {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "weights differ"
        );
    }
    assert_eq!(
        resumed.optimizer(),
        straight.optimizer(),
        "AdamW moments and step differ"
    );
    // metrics.jsonl of the resumed run equals the uninterrupted one's.
    let metrics =
        |dir: &Path| std::fs::read_to_string(dir.join(outputs::METRICS_FILE)).expect("metrics");
    let strip_speed = |text: String| -> Vec<String> {
        text.lines()
            .map(|l| {
                let mut v: serde_json::Value = serde_json::from_str(l).expect("json line");
                v["tokens_per_second"] = serde_json::Value::Null;
                v.to_string()
            })
            .collect()
    };
    assert_eq!(
        strip_speed(metrics(interrupted_dir)),
        strip_speed(metrics(straight_dir))
    );
}

#[test]
fn resuming_with_other_settings_is_refused_by_name() {
    let run = TrainConfig {
        save_strategy: SaveStrategy::Steps(2),
        ..config(AttentionMode::Varlen, 3)
    };
    let dir_guard = scratch_dir("resume-mismatch");
    let dir = dir_guard.path();
    trainer(run.clone(), dir).train(&mut ()).expect("trains");
    let saved = dir.join("checkpoint-2");
    let changed = TrainConfig {
        learning_rate: 1e-3,
        ..run
    };
    let weights = LlamaModel::from_hf_dir(&saved, &cpu_device(true)).expect("loads");
    let err = Trainer::resume(
        weights,
        &checkpoint::verify(&saved).expect("verifies"),
        examples(40, 128, 3),
        changed,
        dir,
        Vec::new(),
    )
    .expect_err("refused");
    assert!(err.to_string().contains("learning_rate"), "{err}");
}

#[test]
fn a_non_finite_loss_stops_before_the_update_and_keeps_the_last_checkpoint() {
    let run = TrainConfig {
        learning_rate: 1e30,
        warmup: Warmup::Steps(0),
        max_grad_norm: 0.0,
        save_strategy: SaveStrategy::Steps(1),
        ..config(AttentionMode::Varlen, 5)
    };
    let dir_guard = scratch_dir("nan");
    let dir = dir_guard.path();
    let mut t = trainer(run, dir);
    let err = t.train(&mut ()).expect_err("must stop");
    let TrainError::NonFinite { step, .. } = &err else {
        panic!("unexpected error: {err}")
    };
    assert_eq!(*step, 2);
    assert!(err.to_string().contains("checkpoint-1"), "{err}");
    let kept = LlamaModel::from_hf_dir(&dir.join("checkpoint-1"), &cpu_device(false))
        .expect("checkpoint-1 intact");
    assert_eq!(kept.params().len(), t.model().params().len());
}

#[test]
fn the_output_directory_holds_an_hf_model_metrics_and_a_plot() {
    let dir_guard = scratch_dir("outputs");
    let dir = dir_guard.path();
    let run = TrainConfig {
        logging_steps: 2,
        save_strategy: SaveStrategy::Epoch,
        batching: Batching::Examples(16),
        ..config(AttentionMode::Varlen, 7)
    };
    let artifacts = vec![("tokenizer.json".to_owned(), b"{}".to_vec())];
    prepare_output_dir(dir, false, false).expect("fresh dir");
    let mut t = Trainer::new(model(1), examples(40, 128, 3), run, dir, artifacts).expect("trainer");
    let summary = t.train(&mut ()).expect("trains");
    // 40 examples in batches of 16: 3 steps per epoch, saved at steps 3 and 6.
    assert!(dir.join("checkpoint-3/tokenizer.json").is_file());
    assert!(dir.join("checkpoint-6/trainer_state.json").is_file());
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "metrics.jsonl",
        "loss.png",
        "train_results.json",
        "trainer_state.json",
    ] {
        assert!(dir.join(file).is_file(), "{file} missing");
    }
    let lines = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics");
    assert_eq!(lines.lines().count(), 4, "steps 2, 4, 6 and the last, 7");
    let saved = LlamaModel::from_hf_dir(dir, &cpu_device(false)).expect("final model loads");
    assert_eq!(max_abs_diff(&params(&saved), &params(t.model())), 0.0);
    assert!(summary.train_tokens_per_second > 0.0 && summary.peak_memory_bytes.is_some());
    assert!(
        prepare_output_dir(dir, false, false).is_err(),
        "a non-empty output dir needs --overwrite-output-dir"
    );
    assert!(prepare_output_dir(dir, true, false).is_ok());
}

#[test]
fn gradient_checkpointing_leaves_results_bit_identical() {
    let strategy = cpu_device_with_checkpointing().gradient_checkpointing_strategy();
    assert_eq!(
        format!("{strategy:?}"),
        "Some(Balanced)",
        "checkpointing must be on"
    );
    let run = config(AttentionMode::Varlen, 5);
    let plain_dir = scratch_dir("ckpt-plain");
    let mut plain = trainer(run.clone(), plain_dir.path());
    plain.train(&mut ()).expect("trains");
    let dir_guard = scratch_dir("ckpt-recompute");
    let dir = dir_guard.path();
    prepare_output_dir(dir, false, false).expect("output dir");
    let recomputing = LlamaModel::init(&LlamaConfig::tiny(), 1, &cpu_device_with_checkpointing())
        .expect("tiny model");
    let mut checkpointed =
        Trainer::new(recomputing, examples(40, 128, 3), run, dir, Vec::new()).expect("trainer");
    checkpointed.train(&mut ()).expect("trains");
    // Recomputation repeats the same operations on the same values.
    assert_eq!(checkpointed.step_losses(), plain.step_losses());
    assert_eq!(
        max_abs_diff(&params(checkpointed.model()), &params(plain.model())),
        0.0
    );
}

/// Per-layer recomputation (`Trainer::set_gradient_checkpointing`) trains
/// as the plain backward pass, padded and padding-free, with gradient
/// accumulation: the same losses (1e-5 relative) and weights after 5 steps
/// (1e-5 absolute on O(0.1) weights: the same operations, a few sums in
/// another order).
#[test]
fn per_layer_gradient_checkpointing_trains_as_the_plain_backward_pass() {
    for attention in [AttentionMode::Varlen, AttentionMode::Padded] {
        let run = TrainConfig {
            gradient_accumulation_steps: 2,
            ..config(attention, 5)
        };
        let plain_dir = scratch_dir("layer-ckpt-plain");
        let mut plain = trainer(run.clone(), plain_dir.path());
        plain.train(&mut ()).expect("trains");
        let dir = scratch_dir("layer-ckpt");
        let mut recomputing = trainer(run, dir.path());
        recomputing.set_gradient_checkpointing(true);
        assert!(recomputing.gradient_checkpointing());
        recomputing.train(&mut ()).expect("trains");
        for (a, b) in recomputing.step_losses().iter().zip(plain.step_losses()) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{attention:?}: loss {a} vs {b}"
            );
        }
        let diff = max_abs_diff(&params(recomputing.model()), &params(plain.model()));
        assert!(diff <= 1e-5, "{attention:?}: weights differ by {diff}");
    }
}

/// Evaluates on 16 held-out random examples every 2 steps, keeping the best.
fn best_model_eval(load_best_model_at_end: bool) -> EvalSet {
    EvalSet {
        examples: examples(16, 128, 99),
        settings: EvalSettings {
            strategy: EvalStrategy::Steps(2),
            batch_size: 8,
            load_best_model_at_end,
        },
    }
}

/// A run on random tokens fast enough to overfit: the held-out loss rises
/// from the first evaluation on (4.85 at step 2, 4.92 at step 12), so the
/// best model is a checkpoint, not the last step's.
fn overfitting_run() -> TrainConfig {
    TrainConfig {
        learning_rate: 1e-2,
        save_strategy: SaveStrategy::Steps(2),
        logging_steps: 2,
        ..config(AttentionMode::Varlen, 12)
    }
}

/// A fresh overfitting run that keeps its best model, writing into `dir`.
fn best_model_trainer(dir: &Path) -> Trainer {
    trainer(overfitting_run(), dir)
        .with_eval(best_model_eval(true))
        .expect("eval set")
}

#[test]
fn load_best_model_at_end_writes_the_evaluated_model_with_the_lowest_eval_loss() {
    let dir_guard = scratch_dir("best-model");
    let dir = dir_guard.path();
    let mut t = best_model_trainer(dir);
    let summary = t.train(&mut ()).expect("trains");
    let evals: Vec<(usize, f64)> = t
        .log_history()
        .iter()
        .filter_map(|r| Some((r.step, r.eval_loss?)))
        .collect();
    assert_eq!(
        evals.iter().map(|e| e.0).collect::<Vec<_>>(),
        [2, 4, 6, 8, 10, 12]
    );
    // The oracle: the first of the lowest eval losses.
    let (best_step, best_loss) = evals
        .iter()
        .copied()
        .fold(
            None,
            |best: Option<(usize, f64)>, (step, loss)| match best {
                Some((_, b)) if b <= loss => best,
                _ => Some((step, loss)),
            },
        )
        .expect("evaluated");
    assert!(
        best_step < 12,
        "this run must overfit for the test to load a checkpoint: {evals:?}"
    );
    let best = summary.best_model.clone().expect("tracked");
    assert_eq!(
        (best.step, best.eval_loss.to_bits()),
        (best_step, best_loss.to_bits())
    );
    let checkpoint = dir.join(format!("checkpoint-{best_step}"));
    // Named relative to the run directory (so a moved run still finds it),
    // resolved in the summary.
    assert_eq!(
        best.checkpoint.as_deref(),
        Some(Path::new(&format!("checkpoint-{best_step}")))
    );
    assert_eq!(
        summary.best_model_checkpoint.as_deref(),
        Some(checkpoint.as_path())
    );
    assert!(summary.best_model_loaded);
    // The final model is the checkpoint's, byte for byte, and evaluates to
    // the same loss bit for bit.
    let bytes = |dir: &Path| std::fs::read(dir.join("model.safetensors")).expect("model file");
    assert!(
        bytes(dir) == bytes(&checkpoint),
        "final model != {checkpoint:?}"
    );
    let again = t.evaluate().expect("evaluates").expect("eval set");
    assert_eq!(again.loss.to_bits(), best_loss.to_bits());
    // Both state files name it, as HF's trainer_state.json does.
    let state = checkpoint::read_state(dir).expect("final state");
    assert_eq!(state.best_model.as_ref(), Some(&best));
    let results: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(outputs::RESULTS_FILE)).expect("results"),
    )
    .expect("json");
    assert_eq!(
        results["best_model"]["step"].as_u64(),
        Some(best_step as u64)
    );

    // Without the flag the same run ends with the last step's weights.
    let last_dir = scratch_dir("best-model-off");
    let mut last = trainer(overfitting_run(), last_dir.path())
        .with_eval(best_model_eval(false))
        .expect("eval set");
    let summary = last.train(&mut ()).expect("trains");
    assert!(summary.best_model.is_none() && !summary.best_model_loaded);
    assert_eq!(
        last.evaluate()
            .expect("evaluates")
            .expect("eval set")
            .loss
            .to_bits(),
        evals[5].1.to_bits()
    );
    assert!(bytes(last_dir.path()) != bytes(&checkpoint));

    // Interrupted between evaluations and resumed, the run keeps its best
    // (saved in the checkpoint's state) and ends with the same final model.
    let resumed_guard = scratch_dir("best-model-resumed");
    let resumed_dir = resumed_guard.path();
    let mut first = best_model_trainer(resumed_dir);
    assert!(
        first
            .train(&mut StopAfter(7, 0))
            .expect("trains")
            .interrupted
    );
    let saved = resumed_dir.join("checkpoint-7");
    let weights = LlamaModel::from_hf_dir(&saved, &cpu_device(true)).expect("checkpoint loads");
    let mut resumed = Trainer::resume(
        weights,
        &checkpoint::verify(&saved).expect("verifies"),
        examples(40, 128, 3),
        overfitting_run(),
        resumed_dir,
        Vec::new(),
    )
    .expect("resumes")
    .with_eval(best_model_eval(true))
    .expect("eval set");
    let summary = resumed.train(&mut ()).expect("trains");
    assert_eq!(summary.best_model.as_ref().map(|b| b.step), Some(best_step));
    assert!(
        bytes(resumed_dir) == bytes(&checkpoint),
        "resumed final model differs"
    );
}

/// Deletes a checkpoint's weights once a later checkpoint is saved.
struct DamageAfterSave {
    victim: std::path::PathBuf,
}

impl Observer for DamageAfterSave {
    fn on_save(&mut self, dir: &Path) {
        if dir != self.victim && self.victim.join("model.safetensors").exists() {
            std::fs::remove_file(self.victim.join("model.safetensors")).expect("damage");
        }
    }
}

#[test]
fn a_best_checkpoint_that_cannot_be_read_back_leaves_the_last_model_and_fails_by_name() {
    let dir_guard = scratch_dir("best-model-damaged");
    let dir = dir_guard.path();
    let mut t = best_model_trainer(dir);
    let victim = dir.join("checkpoint-2");
    let err = t
        .train(&mut DamageAfterSave {
            victim: victim.clone(),
        })
        .expect_err("the best checkpoint is gone");
    let text = err.to_string();
    assert!(
        text.contains("checkpoint-2") && text.contains("the best model (step 2,"),
        "{text}"
    );
    assert!(
        text.contains("holds the last step's model") && text.contains("HINT: "),
        "{text}"
    );
    // The last step's model was written in full before the error.
    let saved = LlamaModel::from_hf_dir(dir, &cpu_device(false)).expect("final model loads");
    assert_eq!(max_abs_diff(&params(&saved), &params(t.model())), 0.0);
    assert!(dir.join(outputs::RESULTS_FILE).is_file());
}

#[test]
fn load_best_model_at_end_is_refused_where_the_best_could_not_be_loaded_back() {
    let dir_guard = scratch_dir("best-model-refused");
    for (save, eval, needs) in [
        (
            SaveStrategy::No,
            EvalStrategy::Steps(2),
            "--save-strategy is no",
        ),
        (
            SaveStrategy::Steps(3),
            EvalStrategy::Steps(2),
            "--save-steps 3 is not a multiple of --eval-steps 2",
        ),
        (
            SaveStrategy::Epoch,
            EvalStrategy::Steps(2),
            "are epoch and steps",
        ),
        (
            SaveStrategy::Steps(2),
            EvalStrategy::Epoch,
            "are steps and epoch",
        ),
    ] {
        let run = TrainConfig {
            save_strategy: save,
            ..config(AttentionMode::Varlen, 4)
        };
        let dir = dir_guard.path().join(format!("{save:?}-{eval:?}"));
        let err = trainer(run, &dir)
            .with_eval(EvalSet {
                settings: EvalSettings {
                    strategy: eval,
                    ..best_model_eval(true).settings
                },
                ..best_model_eval(true)
            })
            .expect_err("refused");
        let text = err.to_string();
        assert!(
            text.starts_with("--load-best-model-at-end: ") && text.contains(needs),
            "{text}"
        );
        assert!(text.contains("HINT: "), "{text}");
    }
    // HF's rule allows checkpoints on every other evaluation.
    let run = TrainConfig {
        save_strategy: SaveStrategy::Steps(4),
        ..config(AttentionMode::Varlen, 4)
    };
    assert!(
        trainer(run, &dir_guard.path().join("ok"))
            .with_eval(best_model_eval(true))
            .is_ok()
    );
}

/// Records the checkpoints the trainer removes.
#[derive(Default)]
struct Removals(Vec<std::path::PathBuf>);

impl Observer for Removals {
    fn on_remove(&mut self, dir: &Path) {
        self.0.push(dir.to_owned());
    }
}

fn checkpoints_left(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("checkpoint-") || name.starts_with(".tmp"))
        .collect();
    names.sort();
    names
}

#[test]
fn save_total_limit_removes_the_oldest_checkpoints_but_never_the_best() {
    // Checkpoints at steps 2, 4, 6, 8, 10 and the last, 12.
    let dir_guard = scratch_dir("limit");
    let dir = dir_guard.path();
    let run = TrainConfig {
        save_total_limit: Some(2),
        ..overfitting_run()
    };
    let mut t = trainer(run, dir);
    let mut removals = Removals::default();
    t.train(&mut removals).expect("trains");
    let names = |paths: &[std::path::PathBuf]| -> Vec<String> {
        paths
            .iter()
            .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(
        names(&removals.0),
        [
            "checkpoint-2",
            "checkpoint-4",
            "checkpoint-6",
            "checkpoint-8"
        ]
    );
    assert_eq!(checkpoints_left(dir), ["checkpoint-10", "checkpoint-12"]);

    // With the best model (step 2) and a limit of 1: the best and the newest
    // stay, and the final model is still the best one.
    let best_guard = scratch_dir("limit-best");
    let best_dir = best_guard.path();
    let run = TrainConfig {
        save_total_limit: Some(1),
        ..overfitting_run()
    };
    let mut t = trainer(run, best_dir)
        .with_eval(best_model_eval(true))
        .expect("eval set");
    let summary = t.train(&mut ()).expect("trains");
    assert_eq!(summary.best_model.map(|b| b.step), Some(2));
    assert_eq!(
        checkpoints_left(best_dir),
        ["checkpoint-12", "checkpoint-2"]
    );
    let bytes = |dir: &Path| std::fs::read(dir.join("model.safetensors")).expect("model file");
    assert!(bytes(best_dir) == bytes(&best_dir.join("checkpoint-2")));
}
