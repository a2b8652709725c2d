use crate::example::Example;
use crate::rng::SplitMix64;

/// Example lengths shaped like instruction-tuning data: log-normal around
/// `median` tokens with a long right tail (sigma 0.6 gives a 90th percentile
/// about 2.2x the median, roughly what maths word-problem datasets show),
/// clamped to `1 ..= max_len`. For demos and benchmarks before real data is
/// at hand; deterministic for a seed.
pub fn synthetic_lengths(count: usize, median: usize, max_len: usize, seed: u64) -> Vec<usize> {
    const SIGMA: f64 = 0.6;
    let mut rng = SplitMix64::new(seed);
    let log_median = (median.max(1) as f64).ln();
    (0..count)
        .map(|_| {
            let len = (log_median + SIGMA * rng.standard_normal()).exp().round();
            (len as usize).clamp(1, max_len.max(1))
        })
        .collect()
}

/// Examples of the given lengths with arbitrary token ids below `vocab_size`
/// (at least 1) that learn every token.
pub fn synthetic_examples(lengths: &[usize], vocab_size: u32, seed: u64) -> Vec<Example> {
    let mut rng = SplitMix64::new(seed);
    let vocab = u64::from(vocab_size.max(1));
    lengths
        .iter()
        .filter_map(|&len| {
            let ids = (0..len).map(|_| rng.below(vocab) as u32).collect();
            Example::causal(ids).ok()
        })
        .collect()
}

/// Like [`synthetic_examples`], but the first `len / prompt_divisor` tokens
/// of every example are a prompt without labels (-100), as in instruction
/// tuning, so label masking is exercised.
pub fn synthetic_prompted_examples(
    lengths: &[usize],
    vocab_size: u32,
    seed: u64,
    prompt_divisor: usize,
) -> Vec<Example> {
    synthetic_examples(lengths, vocab_size, seed)
        .into_iter()
        .filter_map(|example| {
            let ids = example.input_ids().to_vec();
            let prompt = ids.len() / prompt_divisor.max(1);
            let labels = ids
                .iter()
                .enumerate()
                .map(|(t, &id)| if t < prompt { -100 } else { i64::from(id) })
                .collect();
            Example::new(ids, labels).ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_centre_on_the_median_and_respect_the_bounds() {
        let mut lengths = synthetic_lengths(10_001, 200, 1000, 42);
        assert!(lengths.iter().all(|&len| (1..=1000).contains(&len)));
        lengths.sort_unstable();
        let median = lengths[lengths.len() / 2];
        assert!((180..=220).contains(&median), "median {median}");
        assert_eq!(
            synthetic_lengths(5, 200, 1000, 1),
            synthetic_lengths(5, 200, 1000, 1)
        );
    }

    #[test]
    fn examples_have_the_requested_lengths() {
        let examples = synthetic_examples(&[3, 1, 7], 10, 0);
        let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
        assert_eq!(lengths, vec![3, 1, 7]);
        assert!(
            examples
                .iter()
                .flat_map(|e| e.input_ids())
                .all(|&id| id < 10)
        );
    }
}
