use std::ops::Range;

use padfree_pack::{BudgetKind, SplitMix64, batch_by_token_budget};

use crate::config::{Batching, TrainConfig};
use crate::error::TrainError;

/// One optimizer step: the micro-batches it accumulates over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedStep {
    /// The epoch it belongs to (0-based).
    pub epoch: usize,
    /// Its place in the epoch (0-based).
    pub index_in_epoch: usize,
    /// Steps in this epoch.
    pub steps_in_epoch: usize,
    /// Example indices of every micro-batch.
    pub micro_batches: Vec<Vec<usize>>,
}

impl PlannedStep {
    /// The epoch as HF logs it: fractional, reaching `e + 1` at the epoch's last step.
    pub fn epoch_progress(&self) -> f64 {
        self.epoch as f64 + (self.index_in_epoch + 1) as f64 / self.steps_in_epoch as f64
    }

    /// Whether this step ends its epoch.
    pub fn ends_epoch(&self) -> bool {
        self.index_in_epoch + 1 == self.steps_in_epoch
    }
}

/// Every step of a run, fixed before training from the seed and the example
/// lengths: the same config and data give the same plan, which is what lets a
/// resumed run continue on exactly the batches it would have seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainPlan {
    steps: Vec<PlannedStep>,
}

impl TrainPlan {
    /// Plans `max_steps` steps (repeating epochs as needed) or
    /// `num_train_epochs` epochs. A last window of an epoch with fewer than
    /// `gradient_accumulation_steps` micro-batches is still a step.
    pub fn new(lengths: &[usize], config: &TrainConfig) -> Result<Self, TrainError> {
        config.validate()?;
        if lengths.is_empty() {
            return Err(TrainError::Config {
                flag: "data",
                message: "no training example".into(),
                hint: "give a dataset with at least one example",
            });
        }
        let mut steps = Vec::new();
        for epoch in 0.. {
            let epoch_steps = epoch_steps(lengths, config, epoch)?;
            let wanted = match config.max_steps {
                Some(max_steps) => max_steps - steps.len(),
                None => {
                    let remaining = config.num_train_epochs - epoch as f64;
                    if remaining <= 0.0 {
                        break;
                    }
                    (remaining.min(1.0) * epoch_steps.len() as f64).ceil() as usize
                }
            };
            steps.extend(epoch_steps.into_iter().take(wanted));
            if config.max_steps.is_some_and(|max| steps.len() >= max) {
                break;
            }
        }
        Ok(Self { steps })
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

fn epoch_steps(
    lengths: &[usize],
    config: &TrainConfig,
    epoch: usize,
) -> Result<Vec<PlannedStep>, TrainError> {
    let order = epoch_order(lengths.len(), config, epoch);
    let micro_batches: Vec<Vec<usize>> = match config.batching {
        Batching::Examples(size) => order.chunks(size).map(<[usize]>::to_vec).collect(),
        Batching::TokenBudget(budget) => {
            let ordered: Vec<usize> = order.iter().map(|&i| lengths[i]).collect();
            let ranges: Vec<Range<usize>> =
                batch_by_token_budget(&ordered, budget, BudgetKind::RealTokens).map_err(|err| {
                    TrainError::Config {
                        flag: "max-tokens-per-batch",
                        message: err.to_string(),
                        hint: "raise the budget to at least --max-seq-len",
                    }
                })?;
            ranges.into_iter().map(|r| order[r].to_vec()).collect()
        }
    };
    let windows: Vec<Vec<Vec<usize>>> = micro_batches
        .chunks(config.gradient_accumulation_steps)
        .map(<[Vec<usize>]>::to_vec)
        .collect();
    let steps_in_epoch = windows.len();
    Ok(windows
        .into_iter()
        .enumerate()
        .map(|(index_in_epoch, micro_batches)| PlannedStep {
            epoch,
            index_in_epoch,
            steps_in_epoch,
            micro_batches,
        })
        .collect())
}

/// The example order of an epoch: a seeded shuffle, different every epoch.
fn epoch_order(count: usize, config: &TrainConfig, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..count).collect();
    if config.shuffle {
        let stream = (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        SplitMix64::new(config.seed ^ stream).shuffle(&mut order);
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
                .flat_map(|s| s.micro_batches.concat())
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
        assert_eq!(plan.steps()[0].micro_batches, vec![vec![0, 1, 2, 3]]);
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
        assert_eq!(plan.steps()[0].micro_batches, vec![vec![0, 1]]);
        let too_small = TrainConfig {
            batching: Batching::TokenBudget(5),
            ..budget
        };
        assert!(TrainPlan::new(&[4, 9], &too_small).is_err());
    }
}
