use padfree_pack::IGNORE_INDEX;

use crate::error::ModelError;
use crate::kernels::{
    composed_cross_entropy_sum, head_chunk_rows, head_cross_entropy_sum,
    host_head_cross_entropy_sum as host_head_cross_entropy_sum_op,
};
use crate::tensor::{Device, Int, IntoHostVec, Tensor, int_tensor_nd};

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
    /// The sum's value on the host (NaN if it cannot be read).
    pub fn value(&self) -> f32 {
        self.sum
            .clone()
            .into_vec()
            .first()
            .copied()
            .unwrap_or(f32::NAN)
    }

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
    let labels = LabelRows::new(targets, rows, vocab)?;
    if labels.is_empty() {
        return Ok(LossSum::empty(logits));
    }
    let device = logits.device();
    let kept = logits.select(0, labels.rows_tensor(&device));
    Ok(LossSum {
        sum: composed_cross_entropy_sum(kept, labels.targets_tensor(&device)),
        num_tokens: labels.len(),
    })
}

/// The most logits (4 bytes each) one chunk of the LM head computes at once
/// on the CPU (`kernels/cross_entropy/head.rs`), and the labelled rows per
/// head pass under gradient checkpointing (`model/checkpointing.rs`).
pub const HEAD_CHUNK_BYTES: usize = 64 << 20;

/// The rows of a batch that carry a label, and those labels.
///
/// Found once per batch: the loss and the model's "logits only where a
/// label is" path both work on these rows alone.
#[derive(Debug, Clone, Default)]
pub struct LabelRows {
    rows: Vec<i64>,
    targets: Vec<i64>,
    /// The labelled rows of the batch these rows belong to, when they are
    /// one example of it computed alone (`check`'s one-at-a-time pass):
    /// the head picks its kernel by the batch's count, so that the example
    /// runs the kernel its batch runs.
    batch_rows: Option<usize>,
}

impl LabelRows {
    /// Checks `targets` (`[N]`, -100 = none) against `rows` and the vocabulary.
    pub fn new(targets: &[i64], rows: usize, vocab: usize) -> Result<Self, ModelError> {
        if targets.len() != rows {
            return Err(ModelError::TargetCount {
                targets: targets.len(),
                rows,
            });
        }
        let mut labels = Self::default();
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
            labels.rows.push(row as i64);
            labels.targets.push(target);
        }
        Ok(labels)
    }

    /// These rows as one example of a batch with `batch_rows` labelled
    /// rows (see the field).
    pub(crate) fn in_batch_of(self, batch_rows: Option<usize>) -> Self {
        Self { batch_rows, ..self }
    }

    /// The row count the head chooses its kernel by: the batch's, else
    /// these rows'.
    pub(crate) fn kernel_rows(&self) -> usize {
        self.batch_rows.unwrap_or(self.rows.len())
    }

    /// Number of label tokens, `K`.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when no row has a label.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The labels in runs of at most `rows` (at least 1), in order, each
    /// choosing its head kernel by the whole batch's rows (gradient
    /// checkpointing's head passes run what the plain pass runs).
    pub(crate) fn chunks(&self, rows: usize) -> Vec<LabelRows> {
        let rows = rows.max(1);
        self.rows
            .chunks(rows)
            .zip(self.targets.chunks(rows))
            .map(|(r, t)| LabelRows {
                rows: r.to_vec(),
                targets: t.to_vec(),
                batch_rows: Some(self.kernel_rows()),
            })
            .collect()
    }

    /// `[K]` indices of the labelled rows.
    pub(crate) fn rows_tensor(&self, device: &Device) -> Tensor<1, Int> {
        int_tensor_nd(self.rows.clone(), [self.rows.len()], device)
    }

    /// `[K]` the labels of those rows.
    pub(crate) fn targets_tensor(&self, device: &Device) -> Tensor<1, Int> {
        int_tensor_nd(self.targets.clone(), [self.targets.len()], device)
    }
}

impl LossSum {
    /// A zero loss that keeps the graph connected, so backward still runs on
    /// a batch without labels.
    pub(crate) fn empty(anything: Tensor<2>) -> Self {
        Self {
            sum: anything.sum().mul_scalar(0.0),
            num_tokens: 0,
        }
    }
}

/// Summed cross-entropy of the labelled rows' hidden states `kept` (`[K,
/// C]`) through the LM head `head` (`[V, C]`) in one op, the logits made in
/// chunks of rows and never kept (`kernels/cross_entropy`): the GPU's path.
pub(crate) fn fused_head_cross_entropy_sum(
    kept: Tensor<2>,
    head: Tensor<2>,
    head16: Option<&Tensor<2>>,
    labels: &LabelRows,
) -> Result<LossSum, ModelError> {
    let targets: Vec<usize> = labels.targets.iter().map(|&t| t as usize).collect();
    let chunk_rows = head_chunk_rows(head.dims()[0]);
    let sum = head_cross_entropy_sum(kept, head, head16, &targets, chunk_rows)?;
    Ok(LossSum {
        sum,
        num_tokens: labels.len(),
    })
}

/// Summed cross-entropy of the labelled rows' hidden states `kept` (`[K,
/// C]`) through the LM head `head` (`[V, C]`, and under `--bf16` where its
/// products read it: `Weight16`) in one host op that makes the gradients with the logits, a chunk
/// of [`HEAD_CHUNK_BYTES`] at a time (`kernels/cross_entropy/head.rs`):
/// the CPU's path.
pub(crate) fn host_head_cross_entropy_sum(
    kept: Tensor<2>,
    head: Tensor<2>,
    head16: Option<crate::kernels::Weight16>,
    labels: &LabelRows,
) -> Result<LossSum, ModelError> {
    let targets: Vec<usize> = labels.targets.iter().map(|&t| t as usize).collect();
    let chunk_rows = (HEAD_CHUNK_BYTES / (4 * head.dims()[0].max(1))).max(1);
    let sum = host_head_cross_entropy_sum_op(
        kept,
        head,
        head16,
        &targets,
        chunk_rows,
        labels.kernel_rows(),
    )?;
    Ok(LossSum {
        sum,
        num_tokens: labels.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head's kernel is chosen by the batch's labelled rows: a batch's
    /// own count, an example's lent count, and every chunk of either
    /// (gradient checkpointing's head passes) the count of what it came
    /// from.
    #[test]
    fn chunks_and_lone_examples_choose_by_the_batchs_rows() {
        let targets: Vec<i64> = (0..50)
            .map(|i| if i % 5 == 0 { IGNORE_INDEX } else { i })
            .collect();
        let labels = LabelRows::new(&targets, 50, 100).expect("valid labels");
        assert_eq!(labels.len(), 40);
        assert_eq!(labels.kernel_rows(), 40);
        for chunk in labels.chunks(7) {
            assert!(chunk.len() <= 7);
            assert_eq!(chunk.kernel_rows(), 40, "a chunk chooses as its batch");
        }
        let alone = LabelRows::new(&targets[..10], 10, 100)
            .expect("valid labels")
            .in_batch_of(Some(40));
        assert_eq!(alone.len(), 8);
        assert_eq!(
            alone.kernel_rows(),
            40,
            "an example alone chooses as its batch"
        );
        assert!(alone.chunks(3).iter().all(|c| c.kernel_rows() == 40));
    }
}
