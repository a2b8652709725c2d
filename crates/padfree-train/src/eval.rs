//! Evaluation during training: the held-out loss of the model as it stands,
//! computed the way training computes it (the same collator and attention
//! mode), with no backward pass.
//!
//! `eval_loss` is the mean cross-entropy per label token over the whole eval
//! set (summed over batches and ranks, divided once by the total count), so
//! it does not depend on how the set was cut into batches, nor on padding.

use std::time::Instant;

use padfree_model::LlamaModel;
use padfree_pack::Example;

use crate::collate::Collated;
use crate::comm::Communicator;
use crate::config::{AttentionMode, SaveStrategy};
use crate::error::TrainError;
use crate::workers::on_workers;

/// When to evaluate (HF `eval_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalStrategy {
    /// After every `N`th optimizer step.
    Steps(usize),
    /// After the last step of every epoch.
    Epoch,
}

/// When and how to evaluate, whatever the held-out data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalSettings {
    /// When (HF `eval_strategy`, `eval_steps`).
    pub strategy: EvalStrategy,
    /// Examples per eval batch (HF `per_device_eval_batch_size`).
    pub batch_size: usize,
    /// Whether the final model is the one with the lowest eval loss rather
    /// than the last step's (HF `load_best_model_at_end` with
    /// `metric_for_best_model="eval_loss"`); see [`check_best_model`].
    pub load_best_model_at_end: bool,
}

impl EvalSettings {
    /// Refuses settings that cannot work, with checkpoints saved by `save`.
    pub fn validate(&self, save: SaveStrategy) -> Result<(), TrainError> {
        if self.batch_size == 0 {
            return Err(TrainError::Config {
                flag: "per-device-eval-batch-size",
                message: "is 0".into(),
                hint: "give at least 1",
            });
        }
        if self.strategy == EvalStrategy::Steps(0) {
            return Err(TrainError::Config {
                flag: "eval-steps",
                message: "is 0".into(),
                hint: "give at least 1",
            });
        }
        if self.load_best_model_at_end {
            check_best_model(self.strategy, save)?;
        }
        Ok(())
    }
}

/// A held-out set and when to evaluate on it.
#[derive(Debug, Clone)]
pub struct EvalSet {
    /// The examples, tokenized as the training set is.
    pub examples: Vec<Example>,
    /// When and how.
    pub settings: EvalSettings,
}

impl EvalSet {
    /// Checks the data and the settings.
    pub fn validate(&self, save: SaveStrategy) -> Result<(), TrainError> {
        if self.examples.is_empty() {
            return Err(TrainError::Config {
                flag: "eval-data",
                message: "holds no example".into(),
                hint: "give a file with at least one record that keeps a label token",
            });
        }
        self.settings.validate(save)
    }
}

/// Refuses `--load-best-model-at-end` where an evaluated model could not be
/// loaded back. HF's rule, so a config that works there works here: the
/// save strategy is the eval strategy, and with `steps` every checkpoint
/// step is an eval step (`save_steps` a multiple of `eval_steps`). The
/// candidates are then every checkpoint plus the last step's model when it
/// is evaluated.
fn check_best_model(eval: EvalStrategy, save: SaveStrategy) -> Result<(), TrainError> {
    let refuse = |message: String, hint: &'static str| TrainError::Config {
        flag: "load-best-model-at-end",
        message,
        hint,
    };
    match (eval, save) {
        (EvalStrategy::Epoch, SaveStrategy::Epoch) => Ok(()),
        (EvalStrategy::Steps(eval), SaveStrategy::Steps(save)) if save.is_multiple_of(eval) => {
            Ok(())
        }
        (EvalStrategy::Steps(eval), SaveStrategy::Steps(save)) => Err(refuse(
            format!(
                "needs every checkpoint to be evaluated, but --save-steps {save} is not a multiple of --eval-steps {eval}"
            ),
            "give --save-steps a multiple of --eval-steps (the same number is simplest)",
        )),
        (_, SaveStrategy::No) => Err(refuse(
            "needs checkpoints to load the best model from, but --save-strategy is no".into(),
            "give --save-strategy the same value as --eval-strategy",
        )),
        (eval, save) => Err(refuse(
            format!(
                "needs the save and eval strategies to match, but they are {} and {}",
                match save {
                    SaveStrategy::Epoch => "epoch",
                    _ => "steps",
                },
                match eval {
                    EvalStrategy::Epoch => "epoch",
                    EvalStrategy::Steps(_) => "steps",
                }
            ),
            "give --save-strategy the same value as --eval-strategy",
        )),
    }
}

/// One evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// Mean cross-entropy per label token.
    pub loss: f64,
    /// Label tokens it was taken over.
    pub label_tokens: usize,
    /// Wall time.
    pub seconds: f64,
}

impl EvalResult {
    /// `exp(eval_loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// The loss of `model` on `examples` in batches of `batch_size`: with
/// several ranks, each takes every `W`th batch and the sums are added.
pub fn evaluate(
    model: &LlamaModel,
    examples: &[Example],
    batch_size: usize,
    attention: AttentionMode,
    comm: &dyn Communicator,
) -> Result<EvalResult, TrainError> {
    let started = Instant::now();
    // No backward pass: off the autodiff graph, so no batch's activations
    // outlive it.
    let model = &model.without_autodiff();
    let mut sums = [0.0_f64, 0.0];
    for batch in examples
        .chunks(batch_size.max(1))
        .skip(comm.rank())
        .step_by(comm.world_size().max(1))
    {
        // On the CPU inside rayon's pool, as a training step: the
        // forward pass's parallel calls then start without a hand-over.
        let (loss, tokens) = on_workers(!model.on_cpu(), || loss_sum(model, batch, attention))?;
        sums[0] += loss;
        sums[1] += tokens as f64;
    }
    if comm.world_size() > 1 {
        comm.all_reduce_sum_f64(&mut sums)?;
    }
    let label_tokens = sums[1] as usize;
    Ok(EvalResult {
        loss: sums[0] / label_tokens.max(1) as f64,
        label_tokens,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The summed loss of one batch and its label tokens; the graph is dropped
/// unused (no backward pass).
fn loss_sum(
    model: &LlamaModel,
    batch: &[Example],
    attention: AttentionMode,
) -> Result<(f64, usize), TrainError> {
    let collated = Collated::new(batch, attention)?;
    let input = collated.input();
    let loss = model.loss_sum(&input)?;
    let value = loss.value();
    Ok((f64::from(value), loss.num_tokens))
}

#[cfg(test)]
mod tests {
    use padfree_model::LlamaConfig;
    use padfree_model::tensor::cpu_device;
    use padfree_pack::synthetic_prompted_examples;

    use super::*;
    use crate::comm::SingleProcess;

    #[test]
    fn the_eval_loss_is_the_same_padded_and_padding_free_in_any_batch_size() {
        let config = LlamaConfig {
            initializer_range: 0.1,
            ..LlamaConfig::tiny()
        };
        let model = LlamaModel::init(&config, 3, &cpu_device(true)).expect("valid");
        let examples = synthetic_prompted_examples(&[9, 1, 14, 3, 6, 22, 2], 128, 4, 3);
        let reference = evaluate(&model, &examples, 3, AttentionMode::Varlen, &SingleProcess)
            .expect("evaluates");
        let labels: usize = examples.iter().map(Example::num_loss_tokens).sum();
        assert_eq!(reference.label_tokens, labels);
        assert!(
            reference.loss > 1.0 && reference.loss < 10.0,
            "{reference:?}"
        );
        for (batch, mode) in [
            (3, AttentionMode::Padded),
            (1, AttentionMode::Varlen),
            (7, AttentionMode::Padded),
            (2, AttentionMode::VarlenPerLayer),
        ] {
            let other =
                evaluate(&model, &examples, batch, mode, &SingleProcess).expect("evaluates");
            assert_eq!(other.label_tokens, labels);
            assert!(
                (other.loss - reference.loss).abs() <= 1e-6 * reference.loss,
                "{mode:?} in batches of {batch}: {} vs {}",
                other.loss,
                reference.loss
            );
        }
    }
}
