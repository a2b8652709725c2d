use crate::binpack::Bin;
use crate::error::PackError;
use crate::rng::SplitMix64;

/// What "equal share" means when bins are dealt to data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Balance {
    /// Equal real tokens: what the linear layers (most of the FLOPs at short
    /// lengths) and the loss cost.
    Tokens,
    /// Equal sum of squared example lengths: what causal attention costs, which
    /// dominates at long lengths.
    Attention,
}

impl Balance {
    fn cost(self, bin: &Bin) -> u64 {
        match self {
            Balance::Tokens => bin.tokens() as u64,
            Balance::Attention => bin.attention_cost(),
        }
    }
}

/// Bins dealt to `W` data-parallel ranks, `A` bins per rank per step (one
/// micro-batch per accumulation step).
///
/// `steps()[s][r]` holds the bins rank `r` trains on at step `s`: `A` of
/// them, or fewer in the last step when the bins do not divide evenly (a
/// rank may then have none and contributes no tokens; a loss normalised by
/// the global label-token count stays exact).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Distribution {
    steps: Vec<Vec<Vec<usize>>>,
    bins_per_rank: usize,
    rank_tokens: Vec<u64>,
    rank_attention: Vec<u64>,
    step_max: [u64; 2],
    step_sum: [u64; 2],
}

/// Deals bins to `world_size` ranks, one bin per rank per step, so that
/// every rank gets an equal share of the chosen cost, over the epoch and
/// within every step: [`distribute_steps`] with one bin per rank.
pub fn distribute(
    bins: &[Bin],
    world_size: usize,
    balance: Balance,
    seed: u64,
) -> Result<Distribution, PackError> {
    distribute_steps(bins, world_size, 1, balance, seed)
}

/// Deals bins to `world_size` ranks, `bins_per_rank` per rank per step.
///
/// Bins are sorted by cost (largest first) and cut into steps of
/// `world_size x bins_per_rank`, so the bins trained in one step cost about
/// the same and no rank waits long for the slowest. Within a step each bin,
/// largest first, goes to the rank with room and the least cost in this step
/// so far, ties to the least cost over the epoch so far, then the lowest rank
/// (longest-processing-time rule: the spread of the ranks' totals stays
/// within one bin's cost). The order of the steps is then shuffled by
/// `seed`, so training does not see the largest bins first. Deterministic for
/// a seed.
///
/// A step holds the same bins for every `world_size` with the same product
/// `world_size x bins_per_rank`: 2 ranks x 1 micro-batch and 1 rank x 2
/// accumulated micro-batches train on the same bins at every step.
pub fn distribute_steps(
    bins: &[Bin],
    world_size: usize,
    bins_per_rank: usize,
    balance: Balance,
    seed: u64,
) -> Result<Distribution, PackError> {
    if world_size == 0 {
        return Err(PackError::ZeroWorldSize);
    }
    if bins_per_rank == 0 {
        return Err(PackError::ZeroCapacity {
            what: "bins per rank per step",
        });
    }
    if bins.is_empty() {
        return Err(PackError::NoExamples);
    }
    let mut by_cost: Vec<usize> = (0..bins.len()).collect();
    by_cost.sort_by(|&a, &b| {
        let key = |bin: usize| (balance.cost(&bins[bin]), bins[bin].tokens());
        key(b).cmp(&key(a)).then(a.cmp(&b))
    });

    let mut epoch_load = vec![0u64; world_size];
    let mut steps: Vec<Vec<Vec<usize>>> = by_cost
        .chunks(world_size * bins_per_rank)
        .map(|group| {
            let mut step: Vec<Vec<usize>> = vec![Vec::new(); world_size];
            let mut step_load = vec![0u64; world_size];
            for &bin in group {
                let rank = (0..world_size)
                    .filter(|&rank| step[rank].len() < bins_per_rank)
                    .min_by_key(|&rank| (step_load[rank], epoch_load[rank], rank))
                    .unwrap_or(0);
                let cost = balance.cost(&bins[bin]);
                step[rank].push(bin);
                step_load[rank] += cost;
                epoch_load[rank] += cost;
            }
            step
        })
        .collect();
    SplitMix64::new(seed).shuffle(&mut steps);
    Ok(Distribution::measure(
        steps,
        bins,
        world_size,
        bins_per_rank,
    ))
}

impl Distribution {
    fn measure(
        steps: Vec<Vec<Vec<usize>>>,
        bins: &[Bin],
        world_size: usize,
        bins_per_rank: usize,
    ) -> Self {
        let mut rank_tokens = vec![0u64; world_size];
        let mut rank_attention = vec![0u64; world_size];
        let mut step_max = [0u64; 2];
        let mut step_sum = [0u64; 2];
        for step in &steps {
            for (kind, balance) in [Balance::Tokens, Balance::Attention]
                .into_iter()
                .enumerate()
            {
                let costs = step.iter().map(|rank_bins| {
                    rank_bins
                        .iter()
                        .map(|&bin| balance.cost(&bins[bin]))
                        .sum::<u64>()
                });
                step_max[kind] += costs.clone().max().unwrap_or(0);
                step_sum[kind] += costs.sum::<u64>();
            }
            for (rank, rank_bins) in step.iter().enumerate() {
                for &bin in rank_bins {
                    rank_tokens[rank] += bins[bin].tokens() as u64;
                    rank_attention[rank] += bins[bin].attention_cost();
                }
            }
        }
        Self {
            steps,
            bins_per_rank,
            rank_tokens,
            rank_attention,
            step_max,
            step_sum,
        }
    }

    /// `[S, W]`: the bins of every rank at every step.
    pub fn steps(&self) -> &[Vec<Vec<usize>>] {
        &self.steps
    }

    /// Number of steps, `S`; the same on every rank.
    pub fn num_steps(&self) -> usize {
        self.steps.len()
    }

    /// Number of ranks, `W`.
    pub fn world_size(&self) -> usize {
        self.rank_tokens.len()
    }

    /// Bins per rank per step, `A`.
    pub fn bins_per_rank(&self) -> usize {
        self.bins_per_rank
    }

    /// The bins of one rank, step by step (fewer than `A`, or none, only in
    /// the step holding the remainder).
    pub fn rank_bins(&self, rank: usize) -> impl Iterator<Item = &[usize]> + '_ {
        self.steps
            .iter()
            .map(move |step| step.get(rank).map_or(&[][..], Vec::as_slice))
    }

    /// Bin slots left empty (only in the step holding the remainder).
    pub fn empty_slots(&self) -> usize {
        self.steps
            .iter()
            .flatten()
            .map(|rank_bins| self.bins_per_rank - rank_bins.len())
            .sum()
    }

    /// `[W]` real tokens per rank over the epoch.
    pub fn rank_tokens(&self) -> &[u64] {
        &self.rank_tokens
    }

    /// `[W]` attention cost (sum of squared lengths) per rank over the epoch.
    pub fn rank_attention_cost(&self) -> &[u64] {
        &self.rank_attention
    }

    /// Max over mean of the ranks' epoch totals of `balance`'s cost; 1.0 is perfect.
    pub fn rank_imbalance(&self, balance: Balance) -> f64 {
        let totals = match balance {
            Balance::Tokens => &self.rank_tokens,
            Balance::Attention => &self.rank_attention,
        };
        max_over_mean(totals)
    }

    /// Sum over steps of the slowest rank's cost over the sum of the mean
    /// cost: the time data-parallel training spends waiting for stragglers,
    /// as a factor over perfect balance (1.0).
    pub fn step_imbalance(&self, balance: Balance) -> f64 {
        let kind = balance as usize;
        let mean_sum = self.step_sum[kind] as f64 / self.world_size() as f64;
        if mean_sum == 0.0 {
            return 1.0;
        }
        self.step_max[kind] as f64 / mean_sum
    }
}

fn max_over_mean(values: &[u64]) -> f64 {
    let sum: u64 = values.iter().sum();
    if sum == 0 {
        return 1.0;
    }
    let mean = sum as f64 / values.len() as f64;
    values.iter().copied().max().unwrap_or(0) as f64 / mean
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::binpack::{BinPacking, pack_into_bins};

    fn bins_of(lengths: &[usize], capacity: usize) -> Vec<Bin> {
        pack_into_bins(lengths, capacity, BinPacking::FirstFitDecreasing)
            .expect("packs")
            .into_bins()
    }

    #[test]
    fn every_bin_is_dealt_once_and_ranks_stay_in_step() {
        let bins = bins_of(&[5, 4, 3, 3, 2, 2, 1, 1, 1], 5);
        let distribution = distribute(&bins, 2, Balance::Tokens, 0).expect("distributes");
        let mut dealt: Vec<usize> = distribution
            .steps()
            .iter()
            .flatten()
            .flatten()
            .copied()
            .collect();
        dealt.sort_unstable();
        assert_eq!(dealt, (0..bins.len()).collect::<Vec<_>>());
        assert_eq!(distribution.num_steps(), bins.len().div_ceil(2));
        assert_eq!(
            distribution.empty_slots(),
            2 * distribution.num_steps() - bins.len()
        );
        let total: u64 = distribution.rank_tokens().iter().sum();
        assert_eq!(total, 22);
    }

    #[test]
    fn a_step_holds_the_same_bins_for_ranks_or_accumulation() {
        let lengths: Vec<usize> = (0..50).map(|i| 1 + (i * 7) % 19).collect();
        let bins = bins_of(&lengths, 24);
        let step_bins = |world: usize, per_rank: usize| -> Vec<Vec<usize>> {
            let distribution =
                distribute_steps(&bins, world, per_rank, Balance::Tokens, 5).expect("distributes");
            assert_eq!(
                distribution.num_steps(),
                bins.len().div_ceil(world * per_rank)
            );
            distribution
                .steps()
                .iter()
                .map(|step| {
                    assert!(step.iter().all(|rank_bins| rank_bins.len() <= per_rank));
                    let mut all: Vec<usize> = step.concat();
                    all.sort_unstable();
                    all
                })
                .collect()
        };
        let two_ranks = step_bins(2, 2);
        assert_eq!(two_ranks, step_bins(4, 1));
        assert_eq!(two_ranks, step_bins(1, 4));
        let mut dealt: Vec<usize> = two_ranks.concat();
        dealt.sort_unstable();
        assert_eq!(dealt, (0..bins.len()).collect::<Vec<_>>());
    }

    #[test]
    fn accumulated_bins_balance_within_a_step() {
        // Eight single-example bins (no two fit in 10) on 2 ranks x 2: steps
        // by cost {10, 9, 8, 7} and {6, 6, 6, 6}. Step 1: 10 -> r0; 9 -> r1
        // (0 < 10); 8 -> r1 (9 < 10); 7 -> r0 (r1 is full): 17 each. Step 2:
        // 12 each.
        let bins = bins_of(&[10, 9, 8, 7, 6, 6, 6, 6], 10);
        assert_eq!(bins.len(), 8);
        let distribution = distribute_steps(&bins, 2, 2, Balance::Tokens, 0).expect("distributes");
        assert_eq!(distribution.rank_tokens(), &[29, 29]);
        assert!((distribution.step_imbalance(Balance::Tokens) - 1.0).abs() < 1e-12);
        assert_eq!(distribution.empty_slots(), 0);
    }

    #[test]
    fn longest_processing_time_rule_balances_a_hand_worked_case() {
        // Four bins of one example each (no two fit together): 10, 9, 8, 7 on
        // 2 ranks. Steps by cost: {10, 9}, {8, 7}. Step 1: rank 0 gets 10,
        // rank 1 gets 9. Step 2: the lighter rank 1 gets 8, rank 0 gets 7.
        let bins = bins_of(&[10, 9, 8, 7], 10);
        let distribution = distribute(&bins, 2, Balance::Tokens, 0).expect("distributes");
        assert_eq!(distribution.rank_tokens(), &[17, 17]);
        assert!((distribution.rank_imbalance(Balance::Tokens) - 1.0).abs() < 1e-12);
        // Step maxima 10 and 8 against step means 9.5 and 7.5.
        assert!((distribution.step_imbalance(Balance::Tokens) - 18.0 / 17.0).abs() < 1e-12);
    }

    #[test]
    fn attention_balance_uses_squared_lengths() {
        // Two bins of 8 tokens: one example of 8 (cost 64), eight of 1 (cost 8).
        let mut lengths = vec![8];
        lengths.extend([1; 8]);
        let bins = bins_of(&lengths, 8);
        let distribution = distribute(&bins, 2, Balance::Attention, 3).expect("distributes");
        let mut costs = distribution.rank_attention_cost().to_vec();
        costs.sort_unstable();
        assert_eq!(costs, vec![8, 64]);
        assert!((distribution.rank_imbalance(Balance::Tokens) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn zero_world_size_and_no_bins_are_errors() {
        let bins = bins_of(&[1], 1);
        assert_eq!(
            distribute(&bins, 0, Balance::Tokens, 0),
            Err(PackError::ZeroWorldSize)
        );
        assert_eq!(
            distribute(&[], 2, Balance::Tokens, 0),
            Err(PackError::NoExamples)
        );
    }
}
