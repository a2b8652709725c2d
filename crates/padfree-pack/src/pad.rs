use crate::error::PackError;
use crate::example::{Example, IGNORE_INDEX};
use crate::meta::MAX_BATCH_TOKENS;

/// A batch padded on the right to a common length: the baseline that
/// padding-free training is measured against.
///
/// # Shapes
/// `input_ids`, `attention_mask`, `labels`, `position_ids`: `[B, L]`, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaddedBatch {
    input_ids: Vec<u32>,
    attention_mask: Vec<u8>,
    labels: Vec<i64>,
    position_ids: Vec<u32>,
    batch_size: usize,
    seq_len: usize,
    num_real_tokens: usize,
    num_loss_tokens: usize,
}

/// Pads every example on the right to the longest one (rounded up to
/// `pad_to_multiple_of` when given), as Hugging Face's padding collators do for
/// training.
///
/// Pad positions get `pad_id`, attention mask 0 and label -100. Position ids
/// are `0 .. L` on every row, as HF Llama uses when it is given no
/// `position_ids`; the mask keeps pad positions out of every real token's
/// attention, so their value does not matter.
pub fn pad(
    examples: &[Example],
    pad_id: u32,
    pad_to_multiple_of: Option<usize>,
) -> Result<PaddedBatch, PackError> {
    let longest = examples
        .iter()
        .map(Example::len)
        .max()
        .ok_or(PackError::EmptyBatch)?;
    let seq_len = round_up(longest, pad_to_multiple_of)?;
    let batch_size = examples.len();
    let fed = batch_size
        .checked_mul(seq_len)
        .filter(|&fed| fed <= MAX_BATCH_TOKENS)
        .ok_or(PackError::TooManyTokens {
            total: batch_size.saturating_mul(seq_len),
            max: MAX_BATCH_TOKENS,
        })?;

    let mut input_ids = vec![pad_id; fed];
    let mut attention_mask = vec![0u8; fed];
    let mut labels = vec![IGNORE_INDEX; fed];
    let mut num_real_tokens = 0;
    let mut num_loss_tokens = 0;
    for (row, example) in examples.iter().enumerate() {
        let start = row * seq_len;
        let real = start..start + example.len();
        input_ids[real.clone()].copy_from_slice(example.input_ids());
        attention_mask[real.clone()].fill(1);
        labels[real].copy_from_slice(example.labels());
        num_real_tokens += example.len();
        num_loss_tokens += example.num_loss_tokens();
    }
    // Bounded by MAX_BATCH_TOKENS above, so the cast is exact.
    let position_ids = (0..batch_size).flat_map(|_| 0..seq_len as u32).collect();
    Ok(PaddedBatch {
        input_ids,
        attention_mask,
        labels,
        position_ids,
        batch_size,
        seq_len,
        num_real_tokens,
        num_loss_tokens,
    })
}

fn round_up(len: usize, multiple: Option<usize>) -> Result<usize, PackError> {
    match multiple {
        None => Ok(len),
        Some(0) => Err(PackError::ZeroPadMultiple),
        Some(multiple) => {
            len.div_ceil(multiple)
                .checked_mul(multiple)
                .ok_or(PackError::TooManyTokens {
                    total: usize::MAX,
                    max: MAX_BATCH_TOKENS,
                })
        }
    }
}

impl PaddedBatch {
    /// `[B, L]` token ids, `pad_id` on pads.
    pub fn input_ids(&self) -> &[u32] {
        &self.input_ids
    }

    /// `[B, L]` 1 on real tokens, 0 on pads.
    pub fn attention_mask(&self) -> &[u8] {
        &self.attention_mask
    }

    /// `[B, L]` labels, -100 on pads.
    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// `[B, L]` `0 .. L` on every row.
    pub fn position_ids(&self) -> &[u32] {
        &self.position_ids
    }

    /// Rows, `B`.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Padded length, `L`.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Tokens the model is fed, pads included: `B * L`.
    pub fn num_fed_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Tokens that are not pads.
    pub fn num_real_tokens(&self) -> usize {
        self.num_real_tokens
    }

    /// Pad tokens.
    pub fn num_pad_tokens(&self) -> usize {
        self.num_fed_tokens() - self.num_real_tokens
    }

    /// Share of fed tokens that are pads, in `[0, 1)`.
    pub fn padding_fraction(&self) -> f64 {
        self.num_pad_tokens() as f64 / self.num_fed_tokens() as f64
    }

    /// Labels that count in the loss after the causal shift; equal to the
    /// flattened batch's count for the same examples.
    pub fn num_loss_tokens(&self) -> usize {
        self.num_loss_tokens
    }

    /// `[B, L]` the label each position predicts: every row shifted left by
    /// one, -100 in the last column.
    pub fn next_token_targets(&self) -> Vec<i64> {
        let mut targets = Vec::with_capacity(self.labels.len());
        for row in self.labels.chunks_exact(self.seq_len) {
            targets.extend_from_slice(&row[1..]);
            targets.push(IGNORE_INDEX);
        }
        targets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_on_the_right_with_mask_and_ignored_labels() {
        let examples = vec![
            Example::causal(vec![1, 2, 3]).expect("valid"),
            Example::causal(vec![4]).expect("valid"),
        ];
        let batch = pad(&examples, 0, None).expect("valid batch");
        assert_eq!((batch.batch_size(), batch.seq_len()), (2, 3));
        assert_eq!(batch.input_ids(), &[1, 2, 3, 4, 0, 0]);
        assert_eq!(batch.attention_mask(), &[1, 1, 1, 1, 0, 0]);
        assert_eq!(batch.labels(), &[1, 2, 3, 4, -100, -100]);
        assert_eq!(batch.position_ids(), &[0, 1, 2, 0, 1, 2]);
        assert_eq!(batch.num_pad_tokens(), 2);
        assert!((batch.padding_fraction() - 2.0 / 6.0).abs() < 1e-12);
        assert_eq!(batch.num_loss_tokens(), 2);
        assert_eq!(
            batch.next_token_targets(),
            vec![2, 3, -100, -100, -100, -100]
        );
    }

    #[test]
    fn rounds_the_length_up_to_a_multiple() {
        let examples = vec![Example::causal(vec![1, 2, 3, 4, 5]).expect("valid")];
        let batch = pad(&examples, 7, Some(4)).expect("valid batch");
        assert_eq!(batch.seq_len(), 8);
        assert_eq!(batch.input_ids(), &[1, 2, 3, 4, 5, 7, 7, 7]);
        assert_eq!(pad(&examples, 7, Some(0)), Err(PackError::ZeroPadMultiple));
        assert_eq!(pad(&examples, 7, Some(1)).expect("valid").seq_len(), 5);
    }

    #[test]
    fn empty_batch_is_an_error() {
        assert_eq!(pad(&[], 0, None), Err(PackError::EmptyBatch));
    }
}
