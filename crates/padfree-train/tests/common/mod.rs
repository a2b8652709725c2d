//! Helpers shared by the trainer's integration tests.

use padfree_pack::{Example, SplitMix64};

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
