use std::fmt;

use crate::binpack::{Bin, BinPacking, check_lengths, pack_into_bins};
use crate::distribute::{Balance, Distribution, distribute_steps};
use crate::error::PackError;
use crate::rng::SplitMix64;

/// How an epoch's examples become per-rank micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackingConfig {
    /// Token capacity of one micro-batch (one bin) on one rank.
    pub capacity: usize,
    /// Bin-packing algorithm.
    pub algorithm: BinPacking,
    /// Data-parallel ranks, `W`.
    pub world_size: usize,
    /// Bins (micro-batches) per rank per step, `A`: gradient accumulation.
    pub bins_per_rank: usize,
    /// What ranks get equal shares of.
    pub balance: Balance,
    /// Fixes the tie-breaks between equal lengths and the order of the steps;
    /// use a different seed per epoch for a different epoch.
    pub seed: u64,
}

/// One epoch packed and dealt to ranks: multipack-style distributed sampling.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochPlan {
    bins: Vec<Bin>,
    distribution: Distribution,
    report: PackingReport,
}

/// The figures by which a packing plan is judged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PackingReport {
    /// Examples packed, `N`.
    pub num_examples: usize,
    /// Real tokens packed.
    pub total_tokens: usize,
    /// Bins (micro-batches) used.
    pub num_bins: usize,
    /// Token capacity of a bin.
    pub capacity: usize,
    /// Real tokens over the capacity of the bins used.
    pub efficiency: f64,
    /// Ranks, `W`.
    pub world_size: usize,
    /// Steps every rank takes.
    pub num_steps: usize,
    /// Bin slots left empty in the step holding the remainder.
    pub empty_slots: usize,
    /// Max over mean of the ranks' real-token totals.
    pub rank_token_imbalance: f64,
    /// Max over mean of the ranks' attention-cost totals.
    pub rank_attention_imbalance: f64,
    /// Straggler factor in tokens: sum of per-step maxima over sum of per-step means.
    pub step_token_imbalance: f64,
    /// Straggler factor in attention cost.
    pub step_attention_imbalance: f64,
}

/// Shuffles (by seed), packs and distributes one epoch of examples with these
/// lengths.
pub fn plan_epoch(lengths: &[usize], config: &PackingConfig) -> Result<EpochPlan, PackError> {
    // Validate in the caller's order, so that an error names the caller's index.
    check_lengths(lengths, config.capacity, "bin capacity")?;
    if config.world_size == 0 {
        return Err(PackError::ZeroWorldSize);
    }
    let mut shuffled: Vec<usize> = (0..lengths.len()).collect();
    SplitMix64::new(config.seed).shuffle(&mut shuffled);
    let shuffled_lengths: Vec<usize> = shuffled.iter().map(|&example| lengths[example]).collect();

    let packing = pack_into_bins(&shuffled_lengths, config.capacity, config.algorithm)?;
    let efficiency = packing.efficiency();
    let total_tokens = packing.total_tokens();
    let mut bins = packing.into_bins();
    for bin in &mut bins {
        bin.rename_examples(&shuffled);
    }
    // A different stream from the shuffle's, so the two choices are independent.
    let distribution = distribute_steps(
        &bins,
        config.world_size,
        config.bins_per_rank,
        config.balance,
        !config.seed,
    )?;
    let report = PackingReport {
        num_examples: lengths.len(),
        total_tokens,
        num_bins: bins.len(),
        capacity: config.capacity,
        efficiency,
        world_size: config.world_size,
        num_steps: distribution.num_steps(),
        empty_slots: distribution.empty_slots(),
        rank_token_imbalance: distribution.rank_imbalance(Balance::Tokens),
        rank_attention_imbalance: distribution.rank_imbalance(Balance::Attention),
        step_token_imbalance: distribution.step_imbalance(Balance::Tokens),
        step_attention_imbalance: distribution.step_imbalance(Balance::Attention),
    };
    Ok(EpochPlan {
        bins,
        distribution,
        report,
    })
}

impl EpochPlan {
    /// The bins; examples are named by their index in the caller's lengths.
    pub fn bins(&self) -> &[Bin] {
        &self.bins
    }

    /// Which rank trains on which bin at which step.
    pub fn distribution(&self) -> &Distribution {
        &self.distribution
    }

    /// Efficiency and balance figures.
    pub fn report(&self) -> &PackingReport {
        &self.report
    }

    /// The micro-batches of one rank, step by step: per step, the example
    /// indices of each of its bins (fewer bins, or none, only in the step
    /// holding the remainder).
    pub fn rank_steps(&self, rank: usize) -> Vec<Vec<Vec<usize>>> {
        self.distribution
            .rank_bins(rank)
            .map(|bins| {
                bins.iter()
                    .map(|&bin| self.bins[bin].examples().to_vec())
                    .collect()
            })
            .collect()
    }

    /// The micro-batches of one rank, in order, over the whole epoch.
    pub fn rank_batches(&self, rank: usize) -> Vec<Vec<usize>> {
        self.rank_steps(rank).into_iter().flatten().collect()
    }
}

impl fmt::Display for PackingReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} examples, {} real tokens -> {} bins of {} tokens: packing efficiency {:.2}%",
            self.num_examples,
            self.total_tokens,
            self.num_bins,
            self.capacity,
            100.0 * self.efficiency
        )?;
        writeln!(
            f,
            "{} ranks x {} steps ({} empty slots); rank imbalance (max/mean) tokens {:.4}, attention {:.4}",
            self.world_size,
            self.num_steps,
            self.empty_slots,
            self.rank_token_imbalance,
            self.rank_attention_imbalance
        )?;
        write!(
            f,
            "straggler factor per step (sum of max / sum of mean) tokens {:.4}, attention {:.4}",
            self.step_token_imbalance, self.step_attention_imbalance
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(seed: u64) -> PackingConfig {
        PackingConfig {
            capacity: 16,
            algorithm: BinPacking::BestFitDecreasing,
            world_size: 3,
            bins_per_rank: 1,
            balance: Balance::Tokens,
            seed,
        }
    }

    #[test]
    fn every_example_lands_on_exactly_one_rank_step() {
        let lengths: Vec<usize> = (0..40).map(|i| 1 + (i * 7) % 13).collect();
        let plan = plan_epoch(&lengths, &config(1)).expect("plans");
        let mut seen: Vec<usize> = (0..3)
            .flat_map(|rank| plan.rank_batches(rank))
            .flatten()
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..40).collect::<Vec<_>>());
        for rank in 0..3 {
            for batch in plan.rank_batches(rank) {
                assert!(batch.iter().map(|&e| lengths[e]).sum::<usize>() <= 16);
            }
        }
        assert_eq!(plan.report().num_examples, 40);
        assert_eq!(plan.report().total_tokens, lengths.iter().sum::<usize>());
    }

    #[test]
    fn same_seed_same_plan_other_seed_other_order() {
        let lengths: Vec<usize> = (0..60).map(|i| 1 + (i * 5) % 11).collect();
        assert_eq!(
            plan_epoch(&lengths, &config(9)),
            plan_epoch(&lengths, &config(9))
        );
        let a = plan_epoch(&lengths, &config(9)).expect("plans");
        let b = plan_epoch(&lengths, &config(10)).expect("plans");
        assert_ne!(a.rank_batches(0), b.rank_batches(0));
    }

    #[test]
    fn errors_name_the_callers_index() {
        let err = plan_epoch(&[3, 4, 40, 2], &config(5)).expect_err("example 2 is too long");
        assert!(matches!(
            err,
            PackError::ExampleTooLong {
                index: 2,
                len: 40,
                ..
            }
        ));
        let zero_world = PackingConfig {
            world_size: 0,
            ..config(0)
        };
        assert_eq!(plan_epoch(&[1], &zero_world), Err(PackError::ZeroWorldSize));
    }
}
