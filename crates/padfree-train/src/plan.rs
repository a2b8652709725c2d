use std::ops::Range;

use padfree_pack::{
    BudgetKind, PackingConfig, PackingReport, SplitMix64, batch_by_token_budget, plan_epoch,
};

use serde::{Deserialize, Serialize};

use crate::config::{Batching, Multipack, TrainConfig};
use crate::error::TrainError;

/// A layout of ranks a run trained on before it was resumed on another
/// number of micro-batches per step: `W x A` for the steps before
/// `until_step` (after the previous one's). `trainer_state.json` keeps them
/// (`earlier_layouts`), so that every later resume plans the same steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EarlierLayout {
    /// `W`.
    pub world_size: usize,
    /// `A`.
    pub gradient_accumulation_steps: usize,
    /// The first step planned for the next layout.
    pub until_step: usize,
}

/// One optimizer step: the micro-batches it accumulates over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedStep {
    /// The epoch it belongs to (0-based).
    pub epoch: usize,
    /// Its place in the epoch (0-based).
    pub index_in_epoch: usize,
    /// Steps in this epoch.
    pub steps_in_epoch: usize,
    /// Examples of this epoch trained by the end of this step (this
    /// step's included), whatever layouts the epoch's steps were planned
    /// for.
    pub examples_through: usize,
    /// Examples in an epoch (every epoch trains each example once).
    pub epoch_examples: usize,
    /// `[W]`: every rank's micro-batches (example indices), in order; at
    /// most `A` each, fewer (or none) only in an epoch's last step.
    pub ranks: Vec<Vec<Vec<usize>>>,
}

impl PlannedStep {
    /// The micro-batches of one rank.
    pub fn rank_batches(&self, rank: usize) -> &[Vec<usize>] {
        self.ranks.get(rank).map_or(&[][..], Vec::as_slice)
    }

    /// Every micro-batch of the step, rank by rank: what one process with
    /// `W x A` accumulation steps would train on.
    pub fn all_batches(&self) -> impl Iterator<Item = &Vec<usize>> + '_ {
        self.ranks.iter().flatten()
    }

    /// Every example of the step, rank by rank.
    pub fn examples(&self) -> Vec<usize> {
        self.all_batches().flatten().copied().collect()
    }

    /// The epoch, fractional: `e` plus the fraction of the epoch's examples
    /// trained by the end of this step, reaching `e + 1` at the epoch's last
    /// step. HF logs the fraction of the epoch's steps, which is the same
    /// when every step holds as many examples; by examples it also stays
    /// continuous when a resume re-plans the rest of an epoch for another
    /// layout (by steps it went from 3/9 back to 4/14).
    pub fn epoch_progress(&self) -> f64 {
        self.epoch as f64 + self.examples_through as f64 / self.epoch_examples.max(1) as f64
    }

    /// Whether this step ends its epoch.
    pub fn ends_epoch(&self) -> bool {
        self.index_in_epoch + 1 == self.steps_in_epoch
    }
}

/// Every step of a run, fixed before training from the seed and the example
/// lengths: the same config and data give the same plan, which is what lets a
/// resumed run continue on exactly the batches it would have seen.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainPlan {
    steps: Vec<PlannedStep>,
    packing: Vec<PackingReport>,
}

impl TrainPlan {
    /// Plans `max_steps` steps (repeating epochs as needed) or
    /// `num_train_epochs` epochs. A last window of an epoch with fewer than
    /// `gradient_accumulation_steps` micro-batches is still a step.
    pub fn new(lengths: &[usize], config: &TrainConfig) -> Result<Self, TrainError> {
        Self::with_history(lengths, config, &[])
    }

    /// The plan of a run resumed on other numbers of micro-batches per
    /// step: the steps before each of `earlier`'s `until_step` are that
    /// layout's; from there the rest of the epoch under way (its examples
    /// no earlier step trained on, by index) is planned afresh for the next
    /// layout, and so is every later epoch. Each epoch still trains every
    /// example once. Without `earlier`, [`Self::new`].
    pub fn with_history(
        lengths: &[usize],
        config: &TrainConfig,
        earlier: &[EarlierLayout],
    ) -> Result<Self, TrainError> {
        config.validate()?;
        if lengths.is_empty() {
            return Err(TrainError::Config {
                flag: "data",
                message: "no training example".into(),
                hint: "give a dataset with at least one example",
            });
        }
        check_lengths(lengths, config.batching)?;
        let mut done = Vec::new();
        for layout in earlier {
            let config = TrainConfig {
                world_size: layout.world_size,
                gradient_accumulation_steps: layout.gradient_accumulation_steps,
                ..config.clone()
            };
            config.validate()?;
            let mut steps = Self::after(lengths, &config, done)?.steps;
            steps.truncate(layout.until_step);
            done = steps;
        }
        Self::after(lengths, config, done)
    }

    /// `done` (steps already planned, perhaps for another layout), then
    /// `config`'s steps from where they stop.
    fn after(
        lengths: &[usize],
        config: &TrainConfig,
        mut steps: Vec<PlannedStep>,
    ) -> Result<Self, TrainError> {
        // The epoch `done` stops in, and what of it `done` trained on.
        let mut trained = vec![false; lengths.len()];
        let first_epoch = match steps.last() {
            None => 0,
            Some(last) if last.ends_epoch() => last.epoch + 1,
            Some(last) => {
                for step in steps.iter().filter(|s| s.epoch == last.epoch) {
                    for example in step.examples() {
                        trained[example] = true;
                    }
                }
                last.epoch
            }
        };
        let mut packing = Vec::new();
        for epoch in first_epoch.. {
            let (done_in_epoch, trained) = if epoch == first_epoch {
                let done = steps.iter().filter(|s| s.epoch == epoch).count();
                (done, trained.as_slice())
            } else {
                (0, &[][..])
            };
            let (mut epoch_steps, report) = epoch_steps(lengths, config, epoch, trained)?;
            let in_epoch = done_in_epoch + epoch_steps.len();
            for step in &mut epoch_steps {
                step.index_in_epoch += done_in_epoch;
            }
            // The epoch's count includes its steps on the earlier layout.
            for step in steps.iter_mut().filter(|s| s.epoch == epoch) {
                step.steps_in_epoch = in_epoch;
            }
            for step in &mut epoch_steps {
                step.steps_in_epoch = in_epoch;
            }
            let wanted = match config.max_steps {
                Some(max_steps) => max_steps.saturating_sub(steps.len()),
                None => {
                    let remaining = config.num_train_epochs - epoch as f64;
                    if remaining <= 0.0 {
                        break;
                    }
                    let epoch_total = (remaining.min(1.0) * in_epoch as f64).ceil() as usize;
                    epoch_total.saturating_sub(done_in_epoch)
                }
            };
            steps.extend(epoch_steps.into_iter().take(wanted));
            packing.extend(report);
            if config.max_steps.is_some_and(|max| steps.len() >= max) {
                break;
            }
        }
        count_examples(&mut steps, lengths.len());
        Ok(Self { steps, packing })
    }

    /// The multipack planner's figures for every epoch the plan reaches into
    /// (empty without multipack).
    pub fn packing(&self) -> &[PackingReport] {
        &self.packing
    }

    /// All steps, in order.
    pub fn steps(&self) -> &[PlannedStep] {
        &self.steps
    }

    /// Number of optimizer steps.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Always false for a plan that was built.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

/// Refuses, by its index in the data set (not its place in a shuffled
/// epoch), the first example that no micro-batch can hold.
fn check_lengths(lengths: &[usize], batching: Batching) -> Result<(), TrainError> {
    let (limit, what) = match batching {
        Batching::Examples(_) => return Ok(()),
        Batching::TokenBudget(budget) => (budget, "token budget"),
        Batching::Multipack(multipack) => (multipack.capacity, "bin capacity"),
    };
    let longest = lengths.iter().copied().max().unwrap_or(0);
    match lengths.iter().position(|&len| len > limit) {
        Some(index) => Err(TrainError::ExampleTooLong {
            flag: "max-tokens-per-batch",
            what,
            index,
            len: lengths[index],
            limit,
            longest,
        }),
        None => Ok(()),
    }
}

/// One epoch's steps over the examples not marked in `trained` (by index;
/// empty: none is).
fn epoch_steps(
    lengths: &[usize],
    config: &TrainConfig,
    epoch: usize,
    trained: &[bool],
) -> Result<(Vec<PlannedStep>, Option<PackingReport>), TrainError> {
    let untrained = |i: &usize| !trained.get(*i).copied().unwrap_or(false);
    if let Batching::Multipack(multipack) = config.batching {
        // The rest of an epoch is packed on its own, its indices mapped back.
        let rest: Vec<usize> = (0..lengths.len()).filter(untrained).collect();
        let rest_lengths: Vec<usize> = rest.iter().map(|&i| lengths[i]).collect();
        let (mut ranks_per_step, report) =
            multipack_epoch(&rest_lengths, config, multipack, epoch)?;
        for example in ranks_per_step.iter_mut().flatten().flatten().flatten() {
            *example = rest[*example];
        }
        return Ok((into_steps(ranks_per_step, epoch), Some(report)));
    }
    // The epoch's order, less what was trained: the rest keeps its place.
    let order: Vec<usize> = epoch_order(lengths.len(), config, epoch)
        .into_iter()
        .filter(untrained)
        .collect();
    let micro_batches: Vec<Vec<usize>> = match config.batching {
        Batching::Examples(size) => order.chunks(size).map(<[usize]>::to_vec).collect(),
        Batching::TokenBudget(budget) => {
            let ordered: Vec<usize> = order.iter().map(|&i| lengths[i]).collect();
            let ranges: Vec<Range<usize>> =
                batch_by_token_budget(&ordered, budget, BudgetKind::RealTokens)?;
            ranges.into_iter().map(|r| order[r].to_vec()).collect()
        }
        Batching::Multipack(_) => unreachable!("handled above"),
    };
    // Consecutive micro-batches dealt round-robin: micro-batch k of a step
    // goes to rank k mod W.
    let world = config.world_size;
    let ranks_per_step = micro_batches
        .chunks(config.global_micro_batches())
        .map(|window| {
            let mut ranks = vec![Vec::new(); world];
            for (k, batch) in window.iter().enumerate() {
                ranks[k % world].push(batch.clone());
            }
            ranks
        })
        .collect();
    Ok((into_steps(ranks_per_step, epoch), None))
}

/// `[W]` micro-batches of every rank in one step (example indices).
type RankBatches = Vec<Vec<Vec<usize>>>;

/// One epoch packed by the multipack planner: bins of at most `capacity`
/// real tokens, `W x A` of them per step, balanced between ranks.
fn multipack_epoch(
    lengths: &[usize],
    config: &TrainConfig,
    multipack: Multipack,
    epoch: usize,
) -> Result<(Vec<RankBatches>, PackingReport), TrainError> {
    let plan = plan_epoch(
        lengths,
        &PackingConfig {
            capacity: multipack.capacity,
            algorithm: multipack.packer.algorithm(),
            world_size: config.world_size,
            bins_per_rank: config.gradient_accumulation_steps,
            balance: multipack.balance.balance(),
            seed: epoch_seed(config.seed, epoch),
        },
    )?;
    let per_rank: Vec<Vec<Vec<Vec<usize>>>> = (0..config.world_size)
        .map(|rank| plan.rank_steps(rank))
        .collect();
    let steps = plan.report().num_steps;
    let ranks_per_step = (0..steps)
        .map(|step| per_rank.iter().map(|rank| rank[step].clone()).collect())
        .collect();
    Ok((ranks_per_step, *plan.report()))
}

/// Each step's `examples_through` and `epoch_examples`.
fn count_examples(steps: &mut [PlannedStep], epoch_examples: usize) {
    let mut through = 0;
    let mut epoch = None;
    for step in steps {
        if epoch != Some(step.epoch) {
            (epoch, through) = (Some(step.epoch), 0);
        }
        through += step.all_batches().map(Vec::len).sum::<usize>();
        step.examples_through = through;
        step.epoch_examples = epoch_examples;
    }
}

fn into_steps(ranks_per_step: Vec<RankBatches>, epoch: usize) -> Vec<PlannedStep> {
    let steps_in_epoch = ranks_per_step.len();
    ranks_per_step
        .into_iter()
        .enumerate()
        .map(|(index_in_epoch, ranks)| PlannedStep {
            epoch,
            index_in_epoch,
            steps_in_epoch,
            // Counted once the plan is whole (`count_examples`).
            examples_through: 0,
            epoch_examples: 0,
            ranks,
        })
        .collect()
}

/// The seed of one epoch's shuffle: a different stream every epoch.
fn epoch_seed(seed: u64, epoch: usize) -> u64 {
    seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The example order of an epoch: a seeded shuffle, different every epoch.
fn epoch_order(count: usize, config: &TrainConfig, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..count).collect();
    if config.shuffle {
        SplitMix64::new(epoch_seed(config.seed, epoch)).shuffle(&mut order);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(batch: usize, accumulation: usize) -> TrainConfig {
        TrainConfig {
            batching: Batching::Examples(batch),
            gradient_accumulation_steps: accumulation,
            num_train_epochs: 2.0,
            ..TrainConfig::default()
        }
    }

    #[test]
    fn every_epoch_sees_every_example_once_in_a_new_order() {
        let lengths = vec![5; 10];
        let plan = TrainPlan::new(&lengths, &config(3, 2)).expect("plans");
        // 4 micro-batches per epoch (3,3,3,1) -> 2 steps per epoch.
        assert_eq!(plan.len(), 4);
        let epoch = |e: usize| -> Vec<usize> {
            plan.steps()
                .iter()
                .filter(|s| s.epoch == e)
                .flat_map(PlannedStep::examples)
                .collect()
        };
        let (first, second) = (epoch(0), epoch(1));
        for order in [&first, &second] {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        }
        assert_ne!(first, second);
        assert_eq!(plan.steps()[1].epoch_progress(), 1.0);
        assert!(plan.steps()[1].ends_epoch());
    }

    #[test]
    fn max_steps_repeats_epochs_and_no_shuffle_keeps_file_order() {
        let cfg = TrainConfig {
            max_steps: Some(5),
            shuffle: false,
            ..config(4, 1)
        };
        let plan = TrainPlan::new(&[3; 8], &cfg).expect("plans");
        assert_eq!(plan.len(), 5);
        assert_eq!(plan.steps()[0].ranks, vec![vec![vec![0, 1, 2, 3]]]);
        assert_eq!(plan.steps()[4].epoch, 2);
        assert_eq!(plan, TrainPlan::new(&[3; 8], &cfg).expect("plans"));
    }

    #[test]
    fn fractional_epochs_and_token_budgets() {
        let cfg = TrainConfig {
            num_train_epochs: 1.5,
            ..config(1, 1)
        };
        assert_eq!(TrainPlan::new(&[2; 4], &cfg).expect("plans").len(), 6);
        let budget = TrainConfig {
            batching: Batching::TokenBudget(10),
            shuffle: false,
            ..config(1, 1)
        };
        let plan = TrainPlan::new(&[4, 4, 4, 9], &budget).expect("plans");
        assert_eq!(plan.steps()[0].ranks, vec![vec![vec![0, 1]]]);
        let too_small = TrainConfig {
            batching: Batching::TokenBudget(5),
            ..budget
        };
        assert!(TrainPlan::new(&[4, 9], &too_small).is_err());
    }

    fn multipack(capacity: usize, world: usize, accumulation: usize) -> TrainConfig {
        TrainConfig {
            batching: Batching::Multipack(Multipack {
                capacity,
                packer: crate::config::Packer::BestFit,
                balance: crate::config::BalanceBy::Tokens,
            }),
            world_size: world,
            gradient_accumulation_steps: accumulation,
            num_train_epochs: 2.0,
            ..TrainConfig::default()
        }
    }

    /// The same micro-batches on the same ranks, step by step (the epoch's
    /// step count may differ: it counts the new layout's steps too).
    fn assert_same_batches(ours: &[PlannedStep], theirs: &[PlannedStep]) {
        assert_eq!(ours.len(), theirs.len());
        for (a, b) in ours.iter().zip(theirs) {
            assert_eq!(
                (a.epoch, a.index_in_epoch, &a.ranks),
                (b.epoch, b.index_in_epoch, &b.ranks)
            );
        }
    }

    /// Every epoch of `plan` trains every example of `0..n` once, and its
    /// fractional epoch rises step by step to `e + 1`.
    fn assert_each_epoch_whole(plan: &TrainPlan, n: usize, epochs: usize) {
        for epoch in 0..epochs {
            let steps: Vec<&PlannedStep> =
                plan.steps().iter().filter(|s| s.epoch == epoch).collect();
            let mut seen: Vec<usize> = steps.iter().flat_map(|s| s.examples()).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "epoch {epoch}");
            for (index, step) in steps.iter().enumerate() {
                assert_eq!(step.index_in_epoch, index, "epoch {epoch}");
                assert_eq!(step.steps_in_epoch, steps.len(), "epoch {epoch}");
            }
            let progress: Vec<f64> = steps.iter().map(|s| s.epoch_progress()).collect();
            assert!(
                progress.windows(2).all(|w| w[0] < w[1]) && progress[0] > epoch as f64,
                "epoch {epoch}: {progress:?}"
            );
            assert_eq!(progress.last().copied(), Some(epoch as f64 + 1.0));
        }
    }

    /// A run of 2 ranks x 2 bins resumed mid-epoch on 3 x 1, and that on
    /// 1 x 4: the earlier steps are the earlier layouts' own, the rest of
    /// each epoch is planned for the new layout over the examples not yet
    /// trained on, and every epoch still trains every example once. Cut at
    /// an epoch's end, the next epochs are a fresh plan's.
    #[test]
    fn a_plan_resumed_on_another_layout_keeps_every_epoch_whole() {
        let lengths = ragged(101);
        let first = multipack(80, 2, 2);
        let plain = TrainPlan::new(&lengths, &first).expect("plans");
        let per_epoch = plain.steps().iter().filter(|s| s.epoch == 0).count();
        assert!(per_epoch > 4, "{per_epoch} steps an epoch");
        let cut = per_epoch / 2;
        let history = [EarlierLayout {
            world_size: 2,
            gradient_accumulation_steps: 2,
            until_step: cut,
        }];
        let second = multipack(80, 3, 1);
        let resumed = TrainPlan::with_history(&lengths, &second, &history).expect("plans");
        assert_same_batches(&resumed.steps()[..cut], &plain.steps()[..cut]);
        // The earlier steps' epochs are the ones they were logged with.
        for (ours, theirs) in resumed.steps()[..cut].iter().zip(plain.steps()) {
            assert_eq!(ours.epoch_progress(), theirs.epoch_progress());
        }
        assert!(resumed.steps()[cut..].iter().all(|s| s.ranks.len() == 3));
        assert_each_epoch_whole(&resumed, lengths.len(), 2);
        let fresh = TrainPlan::new(&lengths, &second).expect("plans");
        let epoch = |plan: &TrainPlan, e: usize| -> Vec<PlannedStep> {
            plan.steps()
                .iter()
                .filter(|s| s.epoch == e)
                .cloned()
                .collect()
        };
        assert_eq!(epoch(&resumed, 1), epoch(&fresh, 1));

        // Twice: the second layout's steps up to a cut of their own, then 1 x 4.
        let again = [
            history[0],
            EarlierLayout {
                world_size: 3,
                gradient_accumulation_steps: 1,
                until_step: cut + 3,
            },
        ];
        let third = multipack(80, 1, 4);
        let twice = TrainPlan::with_history(&lengths, &third, &again).expect("plans");
        assert_same_batches(&twice.steps()[..cut + 3], &resumed.steps()[..cut + 3]);
        assert_each_epoch_whole(&twice, lengths.len(), 2);

        // Cut where an epoch ends: the next epoch is a fresh plan's.
        let at_end = [EarlierLayout {
            until_step: per_epoch,
            ..history[0]
        }];
        let ended = TrainPlan::with_history(&lengths, &second, &at_end).expect("plans");
        assert_eq!(epoch(&ended, 1), epoch(&fresh, 1));
        assert_each_epoch_whole(&ended, lengths.len(), 2);
    }

    /// Fixed batches keep the epoch's order: the rest of it is the
    /// untrained examples in their shuffled places, cut into the new
    /// layout's micro-batches; `max_steps` still bounds the whole run.
    #[test]
    fn fixed_batches_resumed_on_another_layout_keep_the_order() {
        let layout = |world: usize, accumulation: usize| TrainConfig {
            world_size: world,
            max_steps: Some(9),
            ..config(2, accumulation)
        };
        let lengths = vec![5; 20];
        let plain = TrainPlan::new(&lengths, &layout(1, 2)).expect("plans");
        let history = [EarlierLayout {
            world_size: 1,
            gradient_accumulation_steps: 2,
            until_step: 2,
        }];
        let resumed = TrainPlan::with_history(&lengths, &layout(3, 1), &history).expect("plans");
        assert_eq!(resumed.len(), 9);
        assert_same_batches(&resumed.steps()[..2], &plain.steps()[..2]);
        let order = |plan: &TrainPlan| -> Vec<usize> {
            plan.steps()
                .iter()
                .filter(|s| s.epoch == 0)
                .flat_map(PlannedStep::examples)
                .collect()
        };
        assert_eq!(order(&resumed), order(&plain));
        assert_each_epoch_whole(&resumed, 20, 1);
    }

    fn ragged(n: usize) -> Vec<usize> {
        (0..n).map(|i| 3 + (i * 37 + i * i) % 29).collect()
    }

    #[test]
    fn multipack_trains_every_example_once_per_epoch_within_capacity() {
        let lengths = ragged(101);
        for (world, accumulation) in [(1, 1), (1, 3), (2, 2), (4, 1), (3, 2)] {
            let cfg = multipack(64, world, accumulation);
            let plan = TrainPlan::new(&lengths, &cfg).expect("plans");
            // Steps known up front: ceil(bins / (W x A)) per epoch.
            assert_eq!(plan.packing().len(), 2);
            let expected: usize = plan
                .packing()
                .iter()
                .map(|r| r.num_bins.div_ceil(world * accumulation))
                .sum();
            assert_eq!(plan.len(), expected);
            for epoch in 0..2 {
                let mut seen: Vec<usize> = plan
                    .steps()
                    .iter()
                    .filter(|s| s.epoch == epoch)
                    .flat_map(PlannedStep::examples)
                    .collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..101).collect::<Vec<_>>(), "epoch {epoch}");
            }
            for step in plan.steps() {
                assert_eq!(step.ranks.len(), world);
                for rank in &step.ranks {
                    assert!(rank.len() <= accumulation);
                    for bin in rank {
                        assert!(!bin.is_empty());
                        assert!(bin.iter().map(|&i| lengths[i]).sum::<usize>() <= 64);
                    }
                }
            }
        }
    }

    /// The planner's efficiency and imbalance figures against the same
    /// quantities counted directly from the steps.
    #[test]
    fn multipack_figures_match_a_count_of_the_plan() {
        let lengths = ragged(157);
        let (world, accumulation) = (3, 2);
        let plan = TrainPlan::new(&lengths, &multipack(80, world, accumulation)).expect("plans");
        let report = plan.packing()[0];
        let epoch: Vec<&PlannedStep> = plan.steps().iter().filter(|s| s.epoch == 0).collect();
        let bins: Vec<&Vec<usize>> = epoch.iter().flat_map(|s| s.all_batches()).collect();
        let tokens = |bin: &Vec<usize>| bin.iter().map(|&i| lengths[i]).sum::<usize>();
        let total: usize = bins.iter().map(|b| tokens(b)).sum();
        assert_eq!(report.num_bins, bins.len());
        assert_eq!(report.total_tokens, total);
        let efficiency = total as f64 / (bins.len() * 80) as f64;
        assert!((report.efficiency - efficiency).abs() < 1e-12);
        let mut rank_totals = vec![0usize; world];
        let (mut sum_max, mut sum_mean) = (0.0, 0.0);
        for step in &epoch {
            let per_rank: Vec<usize> = (0..world)
                .map(|r| step.rank_batches(r).iter().map(tokens).sum())
                .collect();
            for (total, t) in rank_totals.iter_mut().zip(&per_rank) {
                *total += t;
            }
            sum_max += *per_rank.iter().max().expect("ranks") as f64;
            sum_mean += per_rank.iter().sum::<usize>() as f64 / world as f64;
        }
        let mean = rank_totals.iter().sum::<usize>() as f64 / world as f64;
        let rank_imbalance = *rank_totals.iter().max().expect("ranks") as f64 / mean;
        assert!((report.rank_token_imbalance - rank_imbalance).abs() < 1e-12);
        assert!((report.step_token_imbalance - sum_max / sum_mean).abs() < 1e-12);
        // Best-fit decreasing on these lengths fills bins well and the
        // dealing keeps ranks level.
        assert!(report.efficiency > 0.9, "{}", report.efficiency);
        assert!(
            report.step_token_imbalance < 1.1,
            "{}",
            report.step_token_imbalance
        );
    }

    #[test]
    fn multipack_steps_are_the_same_for_ranks_or_accumulation() {
        let lengths = ragged(90);
        let examples_per_step = |world: usize, accumulation: usize| -> Vec<Vec<usize>> {
            let plan =
                TrainPlan::new(&lengths, &multipack(50, world, accumulation)).expect("plans");
            plan.steps()
                .iter()
                .map(|s| {
                    let mut e = s.examples();
                    e.sort_unstable();
                    e
                })
                .collect()
        };
        assert_eq!(examples_per_step(2, 1), examples_per_step(1, 2));
        assert_eq!(examples_per_step(4, 1), examples_per_step(1, 4));
        assert_eq!(examples_per_step(2, 2), examples_per_step(4, 1));
    }

    #[test]
    fn consecutive_batches_are_dealt_round_robin_to_ranks() {
        let cfg = TrainConfig {
            world_size: 2,
            shuffle: false,
            max_steps: Some(1),
            ..config(2, 2)
        };
        let plan = TrainPlan::new(&[1; 8], &cfg).expect("plans");
        assert_eq!(
            plan.steps()[0].ranks,
            vec![vec![vec![0, 1], vec![4, 5]], vec![vec![2, 3], vec![6, 7]]]
        );
    }
}
