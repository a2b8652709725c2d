/// A small, fast, seedable generator (Steele, Lea and Flood's SplitMix64).
///
/// Kept in the crate, not taken from a random-number crate, because the data
/// order of a training run is part of its reproducibility: a dependency update
/// must never change which examples a seed puts together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose whole output is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0 .. bound` (Lemire's multiply-and-reject, so
    /// without modulo bias). `bound` must be positive.
    pub fn below(&mut self, bound: u64) -> u64 {
        debug_assert!(bound > 0, "below(0) has no valid result");
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let wide = u128::from(self.next_u64()) * u128::from(bound);
            if (wide as u64) >= threshold {
                return (wide >> 64) as u64;
            }
        }
    }

    /// A standard normal sample (Box-Muller on two uniforms in (0, 1]).
    pub fn standard_normal(&mut self) -> f64 {
        let mut uniform = || ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let (u1, u2) = (uniform(), uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Fisher-Yates shuffle in place.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_first_outputs_for_seed_zero() {
        // The published SplitMix64 reference output for seed 0.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn shuffle_is_a_permutation_fixed_by_the_seed() {
        let mut a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        SplitMix64::new(7).shuffle(&mut a);
        SplitMix64::new(7).shuffle(&mut b);
        assert_eq!(a, b);
        assert_ne!(a, (0..100).collect::<Vec<_>>());
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn standard_normal_has_mean_zero_and_variance_one() {
        let mut rng = SplitMix64::new(11);
        let samples: Vec<f64> = (0..100_000).map(|_| rng.standard_normal()).collect();
        let mean = samples.iter().sum::<f64>() / samples.len() as f64;
        let variance =
            samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / samples.len() as f64;
        // Standard errors at 100k samples: 0.003 for the mean, 0.0045 for the variance.
        assert!(mean.abs() < 0.015, "mean {mean}");
        assert!((variance - 1.0).abs() < 0.025, "variance {variance}");
    }

    #[test]
    fn below_stays_in_range() {
        let mut rng = SplitMix64::new(3);
        for bound in 1..50u64 {
            for _ in 0..20 {
                assert!(rng.below(bound) < bound);
            }
        }
    }
}
