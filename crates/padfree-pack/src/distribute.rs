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

/// Bins dealt to `W` data-parallel ranks, one bin per rank per step.
///
/// `steps()[s][r]` is the bin rank `r` trains on at step `s`, or `None` in the
/// last step when the bins do not divide evenly (that rank contributes no
/// tokens; a loss normalised by the global label-token count stays exact).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Distribution {
    steps: Vec<Vec<Option<usize>>>,
    rank_tokens: Vec<u64>,
    rank_attention: Vec<u64>,
    step_max: [u64; 2],
    step_sum: [u64; 2],
}

/// Deals bins to `world_size` ranks so that every rank gets an equal share of
/// the chosen cost, over the epoch and within every step.
///
/// Bins are sorted by cost (largest first) and cut into steps of
/// `world_size`, so the bins trained side by side cost about the same and no
/// rank waits long for the slowest at each step. Within a step the largest bin
/// goes to the rank with the least accumulated cost (longest-processing-time
/// rule), which keeps the spread of the ranks' totals at most one bin's cost.
/// The order of the steps is then shuffled by `seed`, so training does not see
/// the largest bins first. Deterministic for a seed.
pub fn distribute(
    bins: &[Bin],
    world_size: usize,
    balance: Balance,
    seed: u64,
) -> Result<Distribution, PackError> {
    if world_size == 0 {
        return Err(PackError::ZeroWorldSize);
    }
    if bins.is_empty() {
        return Err(PackError::NoExamples);
    }
    let mut by_cost: Vec<usize> = (0..bins.len()).collect();
    by_cost.sort_by(|&a, &b| {
        let key = |bin: usize| (balance.cost(&bins[bin]), bins[bin].tokens());
        key(b).cmp(&key(a)).then(a.cmp(&b))
    });

    let mut load = vec![0u64; world_size];
    let mut steps: Vec<Vec<Option<usize>>> = by_cost
        .chunks(world_size)
        .map(|group| {
            let mut ranks: Vec<usize> = (0..world_size).collect();
            ranks.sort_by_key(|&rank| (load[rank], rank));
            let mut step = vec![None; world_size];
            for (&bin, &rank) in group.iter().zip(&ranks) {
                step[rank] = Some(bin);
                load[rank] += balance.cost(&bins[bin]);
            }
            step
        })
        .collect();
    SplitMix64::new(seed).shuffle(&mut steps);
    Ok(Distribution::measure(steps, bins, world_size))
}

impl Distribution {
    fn measure(steps: Vec<Vec<Option<usize>>>, bins: &[Bin], world_size: usize) -> Self {
        let mut rank_tokens = vec![0u64; world_size];
        let mut rank_attention = vec![0u64; world_size];
        let mut step_max = [0u64; 2];
        let mut step_sum = [0u64; 2];
        for step in &steps {
            for (kind, balance) in [Balance::Tokens, Balance::Attention]
                .into_iter()
                .enumerate()
            {
                let costs = step
                    .iter()
                    .map(|slot| slot.map_or(0, |bin| balance.cost(&bins[bin])));
                step_max[kind] += costs.clone().max().unwrap_or(0);
                step_sum[kind] += costs.sum::<u64>();
            }
            for (rank, slot) in step.iter().enumerate() {
                if let Some(bin) = *slot {
                    rank_tokens[rank] += bins[bin].tokens() as u64;
                    rank_attention[rank] += bins[bin].attention_cost();
                }
            }
        }
        Self {
            steps,
            rank_tokens,
            rank_attention,
            step_max,
            step_sum,
        }
    }

    /// `[S, W]`: the bin of every rank at every step.
    pub fn steps(&self) -> &[Vec<Option<usize>>] {
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

    /// The bins of one rank, in step order (`None` where it idles).
    pub fn rank_bins(&self, rank: usize) -> impl Iterator<Item = Option<usize>> + '_ {
        self.steps
            .iter()
            .map(move |step| step.get(rank).copied().flatten())
    }

    /// Slots in which a rank has no bin (only in the step holding the remainder).
    pub fn empty_slots(&self) -> usize {
        self.steps
            .iter()
            .flatten()
            .filter(|slot| slot.is_none())
            .count()
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
