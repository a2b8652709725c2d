//! Helpers shared by the trainer's integration tests.
#![allow(dead_code)]

use padfree_pack::{Example, SplitMix64};
use padfree_train::{
    AttentionMode, Batching, Observer, SaveStrategy, StepMetrics, TrainConfig, Warmup,
};

/// A fresh directory under the system temp dir, removed (with all it holds)
/// when the returned guard is dropped.
pub fn scratch_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("padfree-train-{name}-"))
        .tempdir()
        .expect("scratch dir")
}

/// Ragged examples whose first third is a prompt (label -100).
pub fn examples(count: usize, vocab: u32, seed: u64) -> Vec<Example> {
    let mut rng = SplitMix64::new(seed);
    (0..count)
        .map(|_| {
            let len = 4 + rng.below(36) as usize;
            let ids: Vec<u32> = (0..len)
                .map(|_| rng.below(u64::from(vocab)) as u32)
                .collect();
            let labels = ids
                .iter()
                .enumerate()
                .map(|(t, &id)| if t < len / 3 { -100 } else { i64::from(id) })
                .collect();
            Example::new(ids, labels).expect("valid example")
        })
        .collect()
}

/// Asks the trainer to stop after step `.0` (`.1`: the last step seen),
/// as Ctrl-C would.
pub struct StopAfter(pub usize, pub usize);

impl Observer for StopAfter {
    fn on_step(&mut self, metrics: &StepMetrics, _total: usize) {
        self.1 = metrics.step;
    }
    fn stop_requested(&self) -> bool {
        self.1 >= self.0
    }
}

/// The tests' short run: batches of 4, a high learning rate with 2 warm-up
/// steps, `steps` steps, nothing saved.
pub fn config(attention: AttentionMode, steps: usize) -> TrainConfig {
    TrainConfig {
        attention,
        batching: Batching::Examples(4),
        learning_rate: 3e-3,
        warmup: Warmup::Steps(2),
        max_steps: Some(steps),
        logging_steps: 5,
        save_strategy: SaveStrategy::No,
        seed: 7,
        ..TrainConfig::default()
    }
}
