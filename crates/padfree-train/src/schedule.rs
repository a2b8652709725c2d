use crate::config::SchedulerKind;

/// The learning rate of every optimizer step: Hugging Face's schedules
/// (`get_linear_schedule_with_warmup`, `get_cosine_schedule_with_warmup`,
/// `get_constant_schedule_with_warmup`) as functions of the step.
///
/// Step `k` (0-based) is taken with `base * factor(k)`, as in HF where the
/// scheduler is stepped after the optimizer: with warm-up the first step
/// uses a learning rate of 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub base: f64,
    /// The schedule after warm-up.
    pub kind: SchedulerKind,
    /// Steps of linear warm-up from 0.
    pub warmup_steps: usize,
    /// All optimizer steps of the run.
    pub total_steps: usize,
}

impl LrSchedule {
    /// The learning rate of step `k` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        self.base * self.factor(step)
    }

    fn factor(&self, step: usize) -> f64 {
        let (step, warmup, total) = (
            step as f64,
            self.warmup_steps as f64,
            self.total_steps as f64,
        );
        if step < warmup {
            return step / warmup.max(1.0);
        }
        let progress = (step - warmup) / (total - warmup).max(1.0);
        match self.kind {
            SchedulerKind::Constant => 1.0,
            SchedulerKind::Linear => ((total - step) / (total - warmup).max(1.0)).max(0.0),
            SchedulerKind::Cosine => {
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(kind: SchedulerKind) -> LrSchedule {
        LrSchedule {
            base: 2.0,
            kind,
            warmup_steps: 10,
            total_steps: 110,
        }
    }

    #[test]
    fn warmup_rises_linearly_from_zero() {
        let s = schedule(SchedulerKind::Linear);
        assert_eq!(s.lr(0), 0.0);
        assert_eq!(s.lr(5), 1.0);
        assert_eq!(s.lr(10), 2.0);
    }

    #[test]
    fn schedules_match_hugging_face_formulas() {
        // Values of transformers' lr_lambda at the same steps, times base 2.
        let linear = schedule(SchedulerKind::Linear);
        assert!((linear.lr(60) - 1.0).abs() < 1e-12);
        assert_eq!(linear.lr(110), 0.0);
        let cosine = schedule(SchedulerKind::Cosine);
        assert!((cosine.lr(60) - 1.0).abs() < 1e-12);
        assert!(
            (cosine.lr(35) - 2.0 * 0.5 * (1.0 + (std::f64::consts::PI * 0.25).cos())).abs() < 1e-12
        );
        assert!(cosine.lr(110).abs() < 1e-12);
        let constant = schedule(SchedulerKind::Constant);
        assert_eq!(constant.lr(100), 2.0);
        assert!((constant.lr(3) - 0.6).abs() < 1e-12);
    }
}
