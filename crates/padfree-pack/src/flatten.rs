use crate::error::PackError;
use crate::example::{Example, IGNORE_INDEX};
use crate::meta::BatchMeta;

/// A batch flattened into one row with no padding: the input of padding-free
/// training.
///
/// Built only by [`flatten`], so its vectors always agree with each other and
/// with [`Self::meta`].
///
/// # Shapes
/// `input_ids`, `labels`, `position_ids`, `seq_idx`: `[T]`; `meta.cu_seqlens`: `[B + 1]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    input_ids: Vec<u32>,
    labels: Vec<i64>,
    position_ids: Vec<u32>,
    seq_idx: Vec<u32>,
    meta: BatchMeta,
    num_loss_tokens: usize,
}

/// The padding-free collator.
///
/// Concatenates the examples into one row. As Hugging Face's
/// `DataCollatorWithFlattening` with its default `separator_id = -100`, the
/// first label of every example becomes -100: after the causal shift, the last
/// token of one example would otherwise learn to predict the first token of the
/// next. `position_ids` restart at 0 for every example, and the boundary
/// metadata is computed here, once, for every layer of the model to share.
pub fn flatten(examples: &[Example]) -> Result<PackedBatch, PackError> {
    let meta = BatchMeta::from_lengths(examples.iter().map(Example::len))?;
    let total = meta.total_tokens();
    let mut input_ids = Vec::with_capacity(total);
    let mut labels = Vec::with_capacity(total);
    let mut position_ids = Vec::with_capacity(total);
    let mut seq_idx = Vec::with_capacity(total);
    let mut num_loss_tokens = 0;
    for (index, example) in examples.iter().enumerate() {
        input_ids.extend_from_slice(example.input_ids());
        labels.push(IGNORE_INDEX);
        labels.extend_from_slice(&example.labels()[1..]);
        // Both casts are bounded by the total, which `from_lengths` kept under i32::MAX.
        position_ids.extend(0..example.len() as u32);
        seq_idx.extend(std::iter::repeat_n(index as u32, example.len()));
        num_loss_tokens += example.num_loss_tokens();
    }
    Ok(PackedBatch {
        input_ids,
        labels,
        position_ids,
        seq_idx,
        meta,
        num_loss_tokens,
    })
}

impl PackedBatch {
    /// `[T]` token ids.
    pub fn input_ids(&self) -> &[u32] {
        &self.input_ids
    }

    /// `[T]` labels, aligned with `input_ids`; -100 at the first token of every example.
    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// `[T]` position of every token inside its example, restarting at 0.
    pub fn position_ids(&self) -> &[u32] {
        &self.position_ids
    }

    /// `[T]` index of the example every token belongs to.
    pub fn seq_idx(&self) -> &[u32] {
        &self.seq_idx
    }

    /// Boundaries of the examples, computed once by the collator.
    pub fn meta(&self) -> &BatchMeta {
        &self.meta
    }

    /// Tokens in the batch, `T`; all of them real.
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Examples in the batch, `B`.
    pub fn num_examples(&self) -> usize {
        self.meta.num_examples()
    }

    /// Labels that count in the loss after the causal shift. A trainer sums
    /// these over accumulation steps and ranks to normalise the loss.
    pub fn num_loss_tokens(&self) -> usize {
        self.num_loss_tokens
    }

    /// `[T]` the label each position predicts: `labels` shifted left by one,
    /// -100 at the end. Because the first label of every example is -100, no
    /// position predicts a token of another example.
    pub fn next_token_targets(&self) -> Vec<i64> {
        let mut targets = Vec::with_capacity(self.labels.len());
        targets.extend_from_slice(&self.labels[1..]);
        targets.push(IGNORE_INDEX);
        targets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of Hugging Face's own test of `DataCollatorWithFlattening`
    /// (transformers `tests/trainer/test_data_collator.py`,
    /// `test_data_collator_with_flattening`): three examples without labels, so
    /// labels are the input ids with the first of each example set to -100.
    #[test]
    fn matches_hugging_face_documented_example() {
        let examples = vec![
            Example::causal(vec![10, 11, 12]).expect("valid"),
            Example::causal(vec![20, 21, 22, 23, 24, 25]).expect("valid"),
            Example::causal(vec![30, 31, 32, 33, 34, 35, 36]).expect("valid"),
        ];
        let batch = flatten(&examples).expect("valid batch");
        assert_eq!(
            batch.input_ids(),
            &[
                10, 11, 12, 20, 21, 22, 23, 24, 25, 30, 31, 32, 33, 34, 35, 36
            ]
        );
        assert_eq!(
            batch.position_ids(),
            &[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6]
        );
        assert_eq!(
            batch.labels(),
            &[
                -100, 11, 12, -100, 21, 22, 23, 24, 25, -100, 31, 32, 33, 34, 35, 36
            ]
        );
        // HF's cu_seq_lens_q/k and max_length_q/k with return_flash_attn_kwargs=True,
        // and its seq_idx with return_seq_idx=True.
        assert_eq!(batch.meta().cu_seqlens(), &[0, 3, 9, 16]);
        assert_eq!(batch.meta().max_seqlen(), 7);
        assert_eq!(
            batch.seq_idx(),
            &[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]
        );
        assert_eq!(batch.num_tokens(), 16);
        assert_eq!(batch.num_loss_tokens(), 13);
    }

    #[test]
    fn given_labels_keep_their_ignores_and_lose_their_first() {
        let examples = vec![
            Example::new(vec![1, 2, 3], vec![-100, -100, 3]).expect("valid"),
            Example::new(vec![4, 5], vec![4, 5]).expect("valid"),
        ];
        let batch = flatten(&examples).expect("valid batch");
        assert_eq!(batch.labels(), &[-100, -100, 3, -100, 5]);
        assert_eq!(batch.num_loss_tokens(), 2);
        assert_eq!(batch.next_token_targets(), vec![-100, 3, -100, 5, -100]);
    }

    #[test]
    fn empty_batch_is_an_error() {
        assert_eq!(flatten(&[]), Err(PackError::EmptyBatch));
    }
}
