//! Data-parallel training against one process: `W` ranks (threads of this
//! process, through `LocalGroup`, the arithmetic every launcher shares) on a
//! multipack plan give the losses and weights of one rank accumulating over
//! the same bins, bit-identically run to run, with the exchange after the
//! backward pass or overlapped with it; resume continues exactly; a rank
//! that dies stops the others instead of hanging them.

use std::path::Path;

use padfree_model::tensor::{IntoHostVec, cpu_device};
use padfree_model::{LlamaConfig, LlamaModel};

use padfree_train::checkpoint;
use padfree_train::outputs::prepare_output_dir;
use padfree_train::{
    BalanceBy, Batching, Communicator, LocalGroup, Multipack, Observer, Packer, SaveStrategy,
    StepMetrics, TrainConfig, TrainError, Trainer, Warmup,
};

mod common;
use common::{StopAfter, examples, scratch_dir};

fn config(world_size: usize, accumulation: usize, steps: usize) -> TrainConfig {
    TrainConfig {
        batching: Batching::Multipack(Multipack {
            capacity: 80,
            packer: Packer::BestFit,
            balance: BalanceBy::Tokens,
        }),
        world_size,
        gradient_accumulation_steps: accumulation,
        learning_rate: 3e-3,
        warmup: Warmup::Steps(1),
        max_steps: Some(steps),
        logging_steps: 1,
        save_strategy: SaveStrategy::No,
        seed: 11,
        ..TrainConfig::default()
    }
}

/// What a run leaves: every step's loss and the final weights.
#[derive(Debug, Clone, PartialEq)]
struct Outcome {
    losses: Vec<f64>,
    weights: Vec<Vec<f32>>,
}

fn outcome(trainer: &Trainer) -> Outcome {
    Outcome {
        losses: trainer.step_losses().to_vec(),
        weights: trainer
            .model()
            .params()
            .into_iter()
            .map(|p| p.value.clone().into_vec())
            .collect(),
    }
}

fn fresh_model() -> LlamaModel {
    LlamaModel::init(&LlamaConfig::tiny(), 1, &cpu_device(true)).expect("tiny model")
}

/// Runs `config` on `comms.len()` ranks, one thread each, into `dir`;
/// `build` makes each rank's trainer. Returns every rank's outcome.
fn run_ranks(
    comms: Vec<LocalGroup>,
    build: impl Fn(Box<dyn Communicator>) -> Result<Trainer, TrainError> + Sync,
) -> Vec<Result<Outcome, TrainError>> {
    std::thread::scope(|scope| {
        let threads: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let build = &build;
                scope.spawn(move || {
                    let mut trainer = build(Box::new(comm))?;
                    trainer.train(&mut ())?;
                    Ok(outcome(&trainer))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("rank thread"))
            .collect()
    })
}

fn train(world: usize, accumulation: usize, steps: usize, dir: &Path) -> Vec<Outcome> {
    train_with(config(world, accumulation, steps), dir)
}

fn train_with(config: TrainConfig, dir: &Path) -> Vec<Outcome> {
    train_ranks(config, dir, false)
}

/// `config` on its world size of ranks into `dir`, with per-layer
/// recomputation or without; every rank's outcome.
fn train_ranks(config: TrainConfig, dir: &Path, checkpointed: bool) -> Vec<Outcome> {
    let world = config.world_size;
    prepare_output_dir(dir, true, false).expect("output dir");
    // One rank is a group of one: every collective is the identity.
    run_ranks(LocalGroup::new(world), |comm| {
        let mut trainer = Trainer::new_on(
            comm,
            fresh_model(),
            examples(60, 128, 5),
            config.clone(),
            dir,
            Vec::new(),
        )?;
        trainer.set_gradient_checkpointing(checkpointed);
        Ok(trainer)
    })
    .into_iter()
    .map(|r| r.expect("rank trains"))
    .collect()
}

/// Largest |a - b| over largest |b|, per tensor.
fn relative_difference(a: &[f32], b: &[f32]) -> f64 {
    let scale = b
        .iter()
        .fold(0.0f64, |m, &x| m.max(f64::from(x).abs()))
        .max(1e-30);
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs())
        .fold(0.0, f64::max)
        / scale
}

/// Every step's loss and every final tensor within 1e-6 relative of the
/// reference: only the order of the gradient sums differs.
fn assert_matches(what: &str, ours: &Outcome, reference: &Outcome) {
    assert_eq!(ours.losses.len(), reference.losses.len(), "{what}");
    for (step, (a, b)) in ours.losses.iter().zip(&reference.losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "{what}, step {}: loss {a} vs {b}",
            step + 1
        );
    }
    for (index, (a, b)) in ours.weights.iter().zip(&reference.weights).enumerate() {
        let diff = relative_difference(a, b);
        assert!(diff <= 1e-6, "{what}, parameter {index}: relative {diff:e}");
    }
}

#[test]
fn ranks_match_one_process_accumulating_over_the_same_bins() {
    let dir = scratch_dir("reference");
    let reference = train(1, 4, 5, dir.path()).remove(0);
    for (world, accumulation) in [(2, 2), (4, 1)] {
        let dir = scratch_dir("ranks");
        let ranks = train(world, accumulation, 5, dir.path());
        // Every rank ends with the same weights, bit for bit.
        for rank in &ranks[1..] {
            assert_eq!(rank, &ranks[0], "{world} ranks disagree");
        }
        assert_eq!(ranks[0].losses.len(), 5);
        assert_matches(&format!("{world} ranks"), &ranks[0], &reference);
    }
}

/// Three ranks (shards that cut across tensors, one element longer on some
/// ranks): the ring with whole moments, the ring with ZeRO stage 1 and
/// gather-and-add all give one process's losses and weights within f32
/// rounding, and every rank the same bits.
#[test]
fn ring_sharded_optimizer_and_gather_agree_with_one_process() {
    let dir = scratch_dir("reference-3");
    let reference = train(1, 3, 5, dir.path()).remove(0);
    let ring = train(3, 1, 5, scratch_dir("ring").path());
    let variants = [
        ("ring", ring[0].clone()),
        ("ZeRO stage 1", {
            let runs = train_with(
                TrainConfig {
                    zero_stage: 1,
                    ..config(3, 1, 5)
                },
                scratch_dir("zero").path(),
            );
            for rank in &runs[1..] {
                assert_eq!(rank, &runs[0], "ZeRO ranks disagree");
            }
            runs[0].clone()
        }),
        ("gather", {
            let runs = train_with(
                TrainConfig {
                    ddp_exchange: padfree_train::Exchange::Gather,
                    ..config(3, 1, 5)
                },
                scratch_dir("gather").path(),
            );
            runs[0].clone()
        }),
    ];
    for rank in &ring[1..] {
        assert_eq!(rank, &ring[0], "ring ranks disagree");
    }
    for (what, ours) in &variants {
        assert_matches(what, ours, &reference);
    }
    // Sharding changes the norm's order of additions only: it may match
    // the ring's bits, and must match them to rounding.
    let (ring, zero) = (&variants[0].1, &variants[1].1);
    for (a, b) in zero.losses.iter().zip(&ring.losses) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
    }
}

/// `config` with per-layer recomputation on every rank.
fn train_checkpointed(config: TrainConfig, dir: &Path) -> Vec<Outcome> {
    train_ranks(config, dir, true)
}

/// The exchange overlapped with the recomputed backward pass, one bucket per
/// layer (3 ranks, 2 micro-batches each, so the overlapped last
/// micro-batch adds to an earlier one's sums): one process's losses and
/// weights within f32 rounding, every rank the same bits, the same bits run
/// to run. The per-bucket ring adds most elements in another rank order
/// than the whole-buffer ring, so its bits differ from the plain
/// exchange's: the overlapped path is the one that ran.
#[test]
fn the_exchange_overlapped_with_the_backward_pass_agrees_with_one_process() {
    let reference =
        train_checkpointed(config(1, 6, 4), scratch_dir("overlap-reference").path()).remove(0);
    let plain = train_checkpointed(config(3, 2, 4), scratch_dir("overlap-plain").path());
    let overlapped = TrainConfig {
        ddp_overlap: true,
        ..config(3, 2, 4)
    };
    let first = train_checkpointed(overlapped.clone(), scratch_dir("overlap-a").path());
    let second = train_checkpointed(overlapped, scratch_dir("overlap-b").path());
    for rank in &first[1..] {
        assert!(rank == &first[0], "overlapped ranks disagree");
    }
    assert!(first[0] == second[0], "two overlapped runs differ");
    let ours = &first[0];
    assert!(
        ours.weights != plain[0].weights,
        "the overlapped run has the plain exchange's bits"
    );
    assert_eq!(ours.losses.len(), 4);
    assert_matches("overlap", ours, &reference);
}

/// Without recomputation the backward pass returns every gradient at once:
/// the overlap is refused with what to add.
#[test]
fn the_overlap_without_gradient_checkpointing_is_refused() {
    let dir = scratch_dir("overlap-refused");
    prepare_output_dir(dir.path(), true, false).expect("output dir");
    let config = TrainConfig {
        ddp_overlap: true,
        ..config(2, 1, 2)
    };
    let results = run_ranks(LocalGroup::new(2), |comm| {
        Trainer::new_on(
            comm,
            fresh_model(),
            examples(60, 128, 5),
            config.clone(),
            dir.path(),
            Vec::new(),
        )
    });
    for result in results {
        let err = result.expect_err("refused").to_string();
        assert!(err.contains("--gradient-checkpointing"), "{err}");
    }
}

#[test]
fn the_same_world_size_twice_is_bit_identical() {
    let (a, b) = (scratch_dir("twice-a"), scratch_dir("twice-b"));
    let first = train(2, 1, 4, a.path()).remove(0);
    let second = train(2, 1, 4, b.path()).remove(0);
    let bits =
        |o: &Outcome| -> Vec<u32> { o.weights.iter().flatten().map(|x| x.to_bits()).collect() };
    assert_eq!(bits(&first), bits(&second));
    assert_eq!(
        first.losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        second
            .losses
            .iter()
            .map(|l| l.to_bits())
            .collect::<Vec<_>>()
    );
}

#[test]
fn resume_on_two_ranks_continues_exactly() {
    let straight_dir = scratch_dir("resume-straight");
    let straight = train(2, 1, 4, straight_dir.path()).remove(0);

    let dir = scratch_dir("resume-cut");
    prepare_output_dir(dir.path(), true, false).expect("output dir");
    let saving = TrainConfig {
        save_strategy: SaveStrategy::Steps(2),
        ..config(2, 1, 4)
    };
    // Stop both ranks after step 2, as Ctrl-C does: a checkpoint is written.
    let stopped = std::thread::scope(|scope| {
        let threads: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .map(|comm| {
                let saving = saving.clone();
                let dir = dir.path();
                scope.spawn(move || {
                    let mut trainer = Trainer::new_on(
                        Box::new(comm),
                        fresh_model(),
                        examples(60, 128, 5),
                        saving,
                        dir,
                        Vec::new(),
                    )
                    .expect("trainer");
                    let summary = trainer.train(&mut StopAfter(2, 0)).expect("trains");
                    (summary.interrupted, trainer.global_step())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("rank"))
            .collect::<Vec<_>>()
    });
    assert_eq!(stopped, vec![(true, 2), (true, 2)]);
    let checkpoint = dir.path().join("checkpoint-2");
    let resumed = run_ranks(LocalGroup::new(2), |comm| {
        let weights = LlamaModel::from_hf_dir(&checkpoint, &cpu_device(true)).expect("loads");
        Trainer::resume_on(
            comm,
            weights,
            &checkpoint::verify(&checkpoint).expect("verifies"),
            examples(60, 128, 5),
            saving.clone(),
            dir.path(),
            Vec::new(),
        )
    });
    for rank in resumed {
        let rank = rank.expect("resumes and trains");
        assert_eq!(
            rank.losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            straight
                .losses
                .iter()
                .map(|l| l.to_bits())
                .collect::<Vec<_>>()
        );
        assert_eq!(rank.weights, straight.weights);
    }
}

/// Stops a run after a step, as Ctrl-C does (a checkpoint is written), and
/// keeps the notes told at the start.
#[derive(Default)]
struct StopAt {
    step: Option<usize>,
    reached: usize,
    notes: Vec<String>,
}

impl Observer for StopAt {
    fn on_step(&mut self, metrics: &StepMetrics, _total: usize) {
        self.reached = metrics.step;
    }
    fn on_note(&mut self, note: &str) {
        self.notes.push(note.to_owned());
    }
    fn stop_requested(&self) -> bool {
        self.step.is_some_and(|step| self.reached >= step)
    }
}

/// One process resumed from `checkpoint` with `config` into `dir`.
fn resume_one(checkpoint: &Path, config: &TrainConfig, dir: &Path) -> Trainer {
    let weights = LlamaModel::from_hf_dir(checkpoint, &cpu_device(true)).expect("loads");
    Trainer::resume(
        weights,
        &checkpoint::verify(checkpoint).expect("verifies"),
        examples(60, 128, 5),
        config.clone(),
        dir,
        Vec::new(),
    )
    .expect("resumes")
}

/// A run of 1 x 2 micro-batches per step resumed after step 2 with 1: the
/// rest is re-planned, said in a note, the steps after the cut train on
/// the examples the first two did not (each once per epoch: `plan.rs`),
/// and `trainer_state.json` keeps the earlier layout, so the re-planned
/// run's own checkpoint resumes it bit-identically.
#[test]
fn another_number_of_micro_batches_re_plans_the_rest_and_resumes_exactly() {
    let saving = |accumulation: usize| TrainConfig {
        save_strategy: SaveStrategy::Steps(2),
        ..config(1, accumulation, 6)
    };
    let first = scratch_dir("replan-first");
    prepare_output_dir(first.path(), true, false).expect("output dir");
    let mut trainer = Trainer::new(
        fresh_model(),
        examples(60, 128, 5),
        saving(2),
        first.path(),
        Vec::new(),
    )
    .expect("trainer");
    let mut stop = StopAt {
        step: Some(2),
        ..StopAt::default()
    };
    assert!(trainer.train(&mut stop).expect("trains").interrupted);
    let cut = first.path().join("checkpoint-2");

    // Re-planned for 1 micro-batch per step, straight to the end.
    let straight = scratch_dir("replan-straight");
    prepare_output_dir(straight.path(), true, false).expect("output dir");
    let mut replanned = resume_one(&cut, &saving(1), straight.path());
    let mut observer = StopAt::default();
    replanned.train(&mut observer).expect("trains");
    assert!(
        observer
            .notes
            .iter()
            .any(|n| n.contains("planned for the new layout")),
        "{:?}",
        observer.notes
    );
    let reference = outcome(&replanned);
    assert_eq!(reference.losses.len(), 6);
    assert_eq!(reference.losses[..2], trainer.step_losses()[..2]);
    let state = replanned.state();
    assert_eq!(
        state.earlier_layouts,
        vec![padfree_train::EarlierLayout {
            world_size: 1,
            gradient_accumulation_steps: 2,
            until_step: 2,
        }]
    );

    // Its checkpoint-4 resumed on the same layout: the same steps, bit for bit.
    let again = scratch_dir("replan-again");
    prepare_output_dir(again.path(), true, false).expect("output dir");
    let mut resumed = resume_one(
        &straight.path().join("checkpoint-4"),
        &saving(1),
        again.path(),
    );
    let mut observer = StopAt::default();
    resumed.train(&mut observer).expect("trains");
    assert!(observer.notes.is_empty(), "{:?}", observer.notes);
    assert!(
        outcome(&resumed) == reference,
        "the re-planned run did not resume exactly"
    );
}

#[test]
fn a_rank_that_dies_stops_the_others_with_an_error() {
    let dir = scratch_dir("dies");
    prepare_output_dir(dir.path(), true, false).expect("output dir");
    struct DieAt(usize);
    impl Observer for DieAt {
        fn on_step(&mut self, metrics: &StepMetrics, _total: usize) {
            assert!(metrics.step < self.0, "rank dies at step {}", metrics.step);
        }
    }
    let started = std::time::Instant::now();
    let results = std::thread::scope(|scope| {
        let threads: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .map(|comm| {
                let dir = dir.path();
                scope.spawn(move || {
                    let rank = comm.rank();
                    let mut trainer = Trainer::new_on(
                        Box::new(comm),
                        fresh_model(),
                        examples(60, 128, 5),
                        config(2, 1, 6),
                        dir,
                        Vec::new(),
                    )
                    .expect("trainer");
                    let mut dies = DieAt(if rank == 1 { 2 } else { usize::MAX });
                    trainer.train(&mut dies).map(|_| ())
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join()).collect::<Vec<_>>()
    });
    assert!(results[1].is_err(), "rank 1 panicked");
    let survivor = results[0].as_ref().expect("rank 0 returns");
    let err = survivor
        .as_ref()
        .expect_err("rank 0 cannot finish without rank 1");
    assert!(err.to_string().contains("rank 1 stopped"), "{err}");
    assert!(started.elapsed().as_secs() < 60);
}
