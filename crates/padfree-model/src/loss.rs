use padfree_pack::IGNORE_INDEX;

use crate::error::ModelError;
use crate::tensor::{Tensor, gather_columns, int_tensor_nd};

/// The summed cross-entropy of a batch and the number of label tokens in it.
///
/// A sum, not a mean: a trainer adds the sums of every micro-batch of an
/// accumulation window (and every rank) and divides once by the total count,
/// so every label token weighs the same however the batches were cut.
#[derive(Debug, Clone)]
pub struct LossSum {
    /// `[1]`: sum of `-log p(target)` over the counted tokens.
    pub sum: Tensor<1>,
    /// Tokens whose target is not -100.
    pub num_tokens: usize,
}

impl LossSum {
    /// The mean over this batch alone; for reporting.
    pub fn mean(&self) -> Tensor<1> {
        self.sum.clone().div_scalar(self.num_tokens.max(1) as f64)
    }
}

/// Causal-LM cross-entropy with ignore index -100.
///
/// `targets[n]` is the token row `n` predicts (already shifted, as
/// `next_token_targets()` of a batch gives). Only the rows with a target are
/// normalised, so pads and prompt tokens cost no softmax.
///
/// # Shapes
/// `logits`: `[N, V]`; `targets`: `[N]`.
pub fn causal_lm_loss(logits: Tensor<2>, targets: &[i64]) -> Result<LossSum, ModelError> {
    let [rows, vocab] = logits.dims();
    if targets.len() != rows {
        return Err(ModelError::Batch(format!(
            "{} targets for {rows} rows of logits",
            targets.len()
        )));
    }
    let mut kept_rows = Vec::new();
    let mut kept_targets = Vec::new();
    for (row, &target) in targets.iter().enumerate() {
        if target == IGNORE_INDEX {
            continue;
        }
        if target < 0 || target as u64 >= vocab as u64 {
            return Err(ModelError::TokenOutOfVocab {
                index: row,
                id: target as u64,
                vocab_size: vocab,
            });
        }
        kept_rows.push(row as i64);
        kept_targets.push(target);
    }
    let num_tokens = kept_rows.len();
    if num_tokens == 0 {
        // Keep the graph connected so backward still runs on an all-ignored batch.
        return Ok(LossSum {
            sum: logits.sum().mul_scalar(0.0),
            num_tokens,
        });
    }
    let device = logits.device();
    let kept = logits.select(0, int_tensor_nd(kept_rows, [num_tokens], &device));
    // log p = x - logsumexp(x), with the row maximum subtracted for stability.
    let max = kept.clone().max_dim(1).detach();
    let shifted = kept - max;
    let log_norm = shifted.clone().exp().sum_dim(1).log().reshape([num_tokens]);
    let picked = gather_columns(shifted, int_tensor_nd(kept_targets, [num_tokens], &device));
    Ok(LossSum {
        sum: (log_norm - picked).sum(),
        num_tokens,
    })
}
