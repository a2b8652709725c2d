//! How a resumed run continues the saved one, in the words the user is
//! told before the steps start.

use crate::config::TrainConfig;
use crate::plan::TrainPlan;
use crate::state::Continuation;

/// The note a resumed run gives for `continuation`, planned as `plan`
/// under `config`; `None` when it continues the saved run exactly.
pub(super) fn continuation_note(
    continuation: &Continuation,
    config: &TrainConfig,
    plan: &TrainPlan,
) -> Option<String> {
    match *continuation {
        Continuation::Extends { saved } => {
            let total = plan.len();
            Some(format!(
                "extending the finished run of {saved} steps to {total}: its steps are the first {saved} of the longer plan, but the learning-rate schedule is recomputed over {total} steps, so this is not one uninterrupted {total}-step run"
            ))
        }
        Continuation::Relaid { ref saved } => Some(format!(
            "resuming a run saved as {saved} on {}: every step trains the same examples and the optimizer state is re-cut, but the ranks' gradients are added in another order, so the losses match the saved layout's to f32 rounding, not bit for bit",
            crate::state::layout(config)
        )),
        Continuation::Replanned { ref saved, at_step } => {
            let step = at_step.checked_sub(1).map(|i| &plan.steps()[i]);
            let place = match step {
                Some(step) if !step.ends_epoch() => format!(
                    "the rest of epoch {} (the examples its first {} steps did not train on) and every later epoch are planned",
                    step.epoch + 1,
                    step.index_in_epoch + 1
                ),
                _ => "every epoch from here is planned".to_owned(),
            };
            Some(format!(
                "resuming a run saved as {saved} after step {at_step} on {}: another number of micro-batches per step, so {place} for the new layout; the run now has {} steps and its learning-rate schedule is recomputed over them: not bit-identical to any uninterrupted run",
                crate::state::layout(config),
                plan.len()
            ))
        }
        Continuation::Exact => None,
    }
}
