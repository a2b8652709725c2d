//! The course of a run: its examples, the plan of every step's batches
//! over them and the learning rate along it. Fixed before step 1; a resume
//! on another layout plans it again from where the saved run stopped.

use padfree_pack::ExampleSet;

use crate::config::{TrainConfig, Warmup};
use crate::error::TrainError;
use crate::plan::{EarlierLayout, PlannedStep, TrainPlan};
use crate::schedule::LrSchedule;

#[derive(Debug)]
pub(super) struct Course {
    pub(super) examples: ExampleSet,
    pub(super) data_fingerprint: u64,
    pub(super) plan: TrainPlan,
    pub(super) schedule: LrSchedule,
    /// The layouts the steps before this one's were planned for (a run
    /// resumed on another `W x A`).
    pub(super) earlier_layouts: Vec<EarlierLayout>,
}

impl Course {
    /// The course over `examples`, whose fingerprint is `data_fingerprint`
    /// (`identity::fingerprint`, computed once by the trainer).
    pub(super) fn new(
        examples: ExampleSet,
        data_fingerprint: u64,
        config: &TrainConfig,
    ) -> Result<Self, TrainError> {
        let plan = TrainPlan::new(&examples.lengths(), config)?;
        let schedule = schedule_for(config, plan.len());
        Ok(Self {
            data_fingerprint,
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
        self.plan = TrainPlan::with_history(&self.examples.lengths(), config, &earlier)?;
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
