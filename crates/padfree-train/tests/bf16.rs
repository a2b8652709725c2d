//! `--bf16` training: its losses track f32's, padded and padding-free bf16
//! runs agree, the weights' bf16 copies are made once per optimizer step
//! (never per micro-batch), and a resumed bf16 run is bit-exact.

use std::path::Path;

use padfree_model::tensor::{IntoHostVec, cpu_device};
use padfree_model::{LlamaConfig, LlamaModel, Precision};
use padfree_train::checkpoint;
use padfree_train::outputs::prepare_output_dir;
use padfree_train::{AttentionMode, Observer, TrainConfig, Trainer};

mod common;
use common::{StopAfter, examples, scratch_dir};

fn config(attention: AttentionMode, precision: Precision, steps: usize) -> TrainConfig {
    TrainConfig {
        precision,
        ..common::config(attention, steps)
    }
}

fn trainer(config: TrainConfig, dir: &Path) -> Trainer {
    prepare_output_dir(dir, false, false).expect("output dir");
    let model = LlamaModel::init(&LlamaConfig::tiny(), 1, &cpu_device(true)).expect("tiny model");
    Trainer::new(model, examples(40, 128, 3), config, dir, Vec::new()).expect("trainer")
}

fn losses(config: TrainConfig, name: &str) -> Vec<f64> {
    let dir = scratch_dir(name);
    let mut t = trainer(config, dir.path());
    t.train(&mut ()).expect("trains");
    t.step_losses().to_vec()
}

/// Every weight's bits, in parameter order.
fn weight_bits(model: &LlamaModel) -> Vec<Vec<u32>> {
    model
        .params()
        .into_iter()
        .map(|p| {
            p.value
                .clone()
                .into_vec()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect()
}

/// How many bf16 copies the model holds, each checked to be its weight
/// rounded (the final weights, after a run).
fn copies_of_the_weights(model: &LlamaModel) -> usize {
    let mut checked = 0;
    for (index, param) in model.params().into_iter().enumerate() {
        if let Some(copy) = model.bf16_copy_values(index) {
            let rounded: Vec<f32> = param
                .value
                .clone()
                .into_vec()
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            assert_eq!(
                copy,
                rounded,
                "{}: the copy is not of the final weights",
                param.name()
            );
            checked += 1;
        }
    }
    checked
}

/// bf16 rounds every matmul operand to 8 mantissa bits (relative error up
/// to 2^-9, about 2e-3); averaged over a loss of many tokens and 20 Adam
/// steps the losses moved 2.4e-4 relative at most when this was written:
/// each step within 2e-3 of f32's (one operand's rounding), and not equal.
#[test]
fn bf16_losses_track_f32_losses_over_20_steps() {
    let f32_losses = losses(
        config(AttentionMode::Varlen, Precision::F32, 20),
        "bf16-f32",
    );
    let bf16_losses = losses(
        config(AttentionMode::Varlen, Precision::Bf16, 20),
        "bf16-bf16",
    );
    assert!(
        bf16_losses[19] < bf16_losses[0],
        "the loss must fall: {bf16_losses:?}"
    );
    let worst = bf16_losses
        .iter()
        .zip(&f32_losses)
        .map(|(b, f)| (b - f).abs() / f.abs())
        .fold(0.0, f64::max);
    eprintln!("bf16 vs f32 losses: worst relative difference {worst:e}");
    for (step, (b, f)) in bf16_losses.iter().zip(&f32_losses).enumerate() {
        assert!(
            (b - f).abs() <= 2e-3 * f.abs(),
            "step {}: bf16 {b} vs f32 {f}",
            step + 1
        );
    }
    assert_ne!(bf16_losses, f32_losses, "bf16 must not be f32 exactly");
}

/// Padded rows group tokens differently; the kernels are the same, so the
/// bf16 runs agree as f32's do (see `training.rs`), to 1e-4 relative.
#[test]
fn padded_and_padding_free_bf16_training_agree() {
    let varlen = losses(
        config(AttentionMode::Varlen, Precision::Bf16, 10),
        "bf16-varlen",
    );
    let padded = losses(
        config(AttentionMode::Padded, Precision::Bf16, 10),
        "bf16-padded",
    );
    for (step, (a, b)) in padded.iter().zip(&varlen).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "step {}: padded {a} vs varlen {b}",
            step + 1
        );
    }
}

/// Counts micro-batches per step (2 with accumulation) and checks the
/// copies after every step.
struct CopiesChecked {
    steps: usize,
}

impl Observer for CopiesChecked {
    fn on_step(&mut self, metrics: &padfree_train::StepMetrics, _total: usize) {
        self.steps = metrics.step;
    }
}

#[test]
fn bf16_copies_are_made_once_per_optimizer_step_from_the_updated_weights() {
    let dir = scratch_dir("bf16-copies");
    let run = TrainConfig {
        gradient_accumulation_steps: 2,
        ..config(AttentionMode::Varlen, Precision::Bf16, 5)
    };
    let mut t = trainer(run, dir.path());
    assert_eq!(t.model().bf16_refreshes(), 1, "made when training starts");
    let mut observer = CopiesChecked { steps: 0 };
    t.train(&mut observer).expect("trains");
    assert_eq!(observer.steps, 5);
    // Once at the start and once after each of the 5 updates; 10
    // micro-batches made none.
    assert_eq!(t.model().bf16_refreshes(), 1 + 5);
    let model = t.model();
    // Copies only for the `vdpbf16ps` body: where the products widen to
    // f32 they read the f32 weights rounded and the model keeps none; the
    // refreshes above are counted either way.
    let copies = Precision::cpu_has_bf16_instructions();
    assert_eq!(model.bf16_reads_weight_copies(), copies);
    let checked = copies_of_the_weights(model);
    assert_eq!(
        checked > 0,
        copies,
        "copies where the body reads them, none elsewhere"
    );
}

/// With host copies of the weights, the trainer lets go of them between
/// each step's last forward pass and its backward pass, and the update
/// makes them again (`LlamaModel::release_bf16_copies`); without copies
/// the products read the f32 weights rounded, the same values. The two
/// train the same bits on every machine (the copies forced either way,
/// whatever this CPU's body would choose), with gradient accumulation so
/// that a micro-batch before the last runs with the copies held.
#[test]
fn bf16_copies_let_go_of_in_the_backward_pass_train_the_same_bits() {
    let run = TrainConfig {
        gradient_accumulation_steps: 2,
        ..config(AttentionMode::Varlen, Precision::Bf16, 4)
    };
    let train = |copies: bool| {
        let dir = scratch_dir(if copies {
            "bf16-released"
        } else {
            "bf16-no-copies"
        });
        prepare_output_dir(dir.path(), false, false).expect("output dir");
        let model = LlamaModel::init(&LlamaConfig::tiny(), 1, &cpu_device(true))
            .and_then(|m| m.with_precision(Precision::Bf16))
            .expect("tiny model")
            .with_bf16_weight_copies(copies);
        let mut t = Trainer::new(
            model,
            examples(40, 128, 3),
            run.clone(),
            dir.path(),
            Vec::new(),
        )
        .expect("trainer");
        t.train(&mut ()).expect("trains");
        assert_eq!(t.model().bf16_reads_weight_copies(), copies);
        let losses: Vec<u64> = t.step_losses().iter().map(|l| l.to_bits()).collect();
        let weights = weight_bits(t.model());
        // The last update made every copy again, of the final weights.
        let made = copies_of_the_weights(t.model());
        let layers = LlamaConfig::tiny().num_hidden_layers;
        assert_eq!(made, if copies { 7 * layers + 1 } else { 0 });
        (losses, weights)
    };
    let (released, read_rounded) = (train(true), train(false));
    assert_eq!(released.0, read_rounded.0, "step losses");
    assert!(released.1 == read_rounded.1, "final weights differ");
}

#[test]
fn resume_of_a_bf16_run_is_bit_exact() {
    let run = TrainConfig {
        gradient_accumulation_steps: 2,
        ..config(AttentionMode::Varlen, Precision::Bf16, 7)
    };
    let straight_dir = scratch_dir("bf16-straight");
    let mut straight = trainer(run.clone(), straight_dir.path());
    straight.train(&mut ()).expect("trains");

    let dir = scratch_dir("bf16-interrupted");
    let mut first = trainer(run.clone(), dir.path());
    assert!(
        first
            .train(&mut StopAfter(3, 0))
            .expect("trains")
            .interrupted
    );
    let saved = dir.path().join("checkpoint-3");
    let weights = LlamaModel::from_hf_dir(&saved, &cpu_device(true)).expect("checkpoint loads");
    // The checkpoint holds the f32 master weights, not the bf16 copies.
    assert_eq!(weights.precision(), Precision::F32);
    let mut resumed = Trainer::resume(
        weights,
        &checkpoint::verify(&saved).expect("verifies"),
        examples(40, 128, 3),
        run.clone(),
        dir.path(),
        Vec::new(),
    )
    .expect("resumes");
    resumed.train(&mut ()).expect("trains");
    let bits = |losses: &[f64]| losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(resumed.step_losses()), bits(straight.step_losses()));
    assert!(
        weight_bits(resumed.model()) == weight_bits(straight.model()),
        "weights differ"
    );

    // Resuming the bf16 run in f32 is refused by name.
    let weights = LlamaModel::from_hf_dir(&saved, &cpu_device(true)).expect("checkpoint loads");
    let refused = Trainer::resume(
        weights,
        &checkpoint::verify(&saved).expect("verifies"),
        examples(40, 128, 3),
        TrainConfig {
            precision: Precision::F32,
            ..run
        },
        dir.path(),
        Vec::new(),
    );
    let Err(err) = refused else {
        panic!("a bf16 checkpoint resumed in f32");
    };
    assert!(err.to_string().contains("`precision`"), "{err}");
}
