//! The course of a run: its examples, the plan of every step's batches
//! over them and the learning rate along it. Fixed before step 1; a resume
//! on another layout plans it again from where the saved run stopped.

use padfree_pack::Example;

use super::identity::fingerprint;
use crate::config::{TrainConfig, Warmup};
use crate::error::TrainError;
use crate::plan::{EarlierLayout, PlannedStep, TrainPlan};
use crate::schedule::LrSchedule;

#[derive(Debug)]
pub(super) struct Course {
    pub(super) examples: Vec<Example>,
    pub(super) data_fingerprint: u64,
    pub(super) plan: TrainPlan,
    pub(super) schedule: LrSchedule,
    /// The layouts the steps before this one's were planned for (a run
    /// resumed on another `W x A`).
    pub(super) earlier_layouts: Vec<EarlierLayout>,
}

impl Course {
    pub(super) fn new(examples: Vec<Example>, config: &TrainConfig) -> Result<Self, TrainError> {
        let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
        let plan = TrainPlan::new(&lengths, config)?;
        let schedule = schedule_for(config, plan.len());
        Ok(Self {
            data_fingerprint: fingerprint(&examples),
            examples,
            plan,
            schedule,
            earlier_layouts: Vec::new(),
        })
    }

    /// Plans the run anew as resumed after `earlier` layouts (the steps
    /// each took, then `config`'s from there), with the learning-rate
    /// schedule over the new total.
    pub(super) fn replan(
        &mut self,
        config: &TrainConfig,
        earlier: Vec<EarlierLayout>,
    ) -> Result<(), TrainError> {
        let lengths: Vec<usize> = self.examples.iter().map(Example::len).collect();
        self.plan = TrainPlan::with_history(&lengths, config, &earlier)?;
        self.schedule = schedule_for(config, self.plan.len());
        self.earlier_layouts = earlier;
        Ok(())
    }

    /// Step `step` (1-based) of the plan.
    pub(super) fn step(&self, step: usize) -> &PlannedStep {
        &self.plan.steps()[step - 1]
    }

    /// The epoch reached after `global_step` steps, as a fraction.
    pub(super) fn epoch_after(&self, global_step: usize) -> f64 {
        global_step
            .checked_sub(1)
            .map_or(0.0, |i| self.plan.steps()[i].epoch_progress())
    }
}

/// The learning-rate schedule of `config` over `total_steps`.
fn schedule_for(config: &TrainConfig, total_steps: usize) -> LrSchedule {
    let warmup_steps = match config.warmup {
        Warmup::Steps(steps) => steps,
        Warmup::Ratio(ratio) => (ratio * total_steps as f64).ceil() as usize,
    };
    LrSchedule {
        base: config.learning_rate,
        kind: config.lr_scheduler_type,
        warmup_steps,
        total_steps,
    }
}
