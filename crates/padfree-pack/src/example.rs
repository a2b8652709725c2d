use crate::error::{ExampleError, PackError};

/// The label value that contributes no loss (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// One tokenized training example.
///
/// `labels[t]` is the token expected at position `t` (Hugging Face's
/// convention: labels are aligned with `input_ids`; the model shifts them by
/// one so that position `t - 1` predicts `labels[t]`). A label of
/// [`IGNORE_INDEX`] contributes no loss.
///
/// The invariants (non-empty, aligned, labels either a token id or -100) hold
/// for every value of this type: they are checked once in [`Example::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    input_ids: Vec<u32>,
    labels: Vec<i64>,
}

impl Example {
    /// Validates and builds an example.
    pub fn new(input_ids: Vec<u32>, labels: Vec<i64>) -> Result<Self, ExampleError> {
        if input_ids.is_empty() {
            return Err(ExampleError::Empty);
        }
        if input_ids.len() != labels.len() {
            return Err(ExampleError::LengthMismatch {
                input_ids: input_ids.len(),
                labels: labels.len(),
            });
        }
        if let Some((position, &label)) = labels
            .iter()
            .enumerate()
            .find(|&(_, &label)| label < 0 && label != IGNORE_INDEX)
        {
            return Err(ExampleError::InvalidLabel { position, label });
        }
        Ok(Self { input_ids, labels })
    }

    /// An example that learns every token (labels = input_ids), as in
    /// pre-training or `--train-on-inputs`.
    pub fn causal(input_ids: Vec<u32>) -> Result<Self, ExampleError> {
        let labels = input_ids.iter().map(|&id| i64::from(id)).collect();
        Self::new(input_ids, labels)
    }

    /// Token ids, `[len]`.
    pub fn input_ids(&self) -> &[u32] {
        &self.input_ids
    }

    /// Labels aligned with [`Self::input_ids`], `[len]`.
    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// Number of tokens; never 0.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Always false: an example has at least one token. Present for API
    /// symmetry with collections.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Labels that count in the causal loss: every non-ignored label except
    /// the first, which no position of this example predicts.
    pub fn num_loss_tokens(&self) -> usize {
        self.labels[1..]
            .iter()
            .filter(|&&label| label != IGNORE_INDEX)
            .count()
    }
}

/// Validates raw `(input_ids, labels)` pairs, naming the index of the first
/// bad one.
pub fn examples_from_raw<I>(raw: I) -> Result<Vec<Example>, PackError>
where
    I: IntoIterator<Item = (Vec<u32>, Vec<i64>)>,
{
    raw.into_iter()
        .enumerate()
        .map(|(index, (input_ids, labels))| {
            Example::new(input_ids, labels).map_err(|source| PackError::InvalidExample {
                index,
                cause: source,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_empty_mismatched_and_negative_labels() {
        assert_eq!(Example::new(vec![], vec![]), Err(ExampleError::Empty));
        assert_eq!(
            Example::new(vec![1, 2], vec![1]),
            Err(ExampleError::LengthMismatch {
                input_ids: 2,
                labels: 1
            })
        );
        assert_eq!(
            Example::new(vec![1, 2, 3], vec![1, -1, 3]),
            Err(ExampleError::InvalidLabel {
                position: 1,
                label: -1
            })
        );
    }

    #[test]
    fn loss_tokens_skip_the_first_label_and_ignored_ones() {
        let example = Example::new(vec![5, 6, 7, 8], vec![5, -100, 7, 8]).expect("valid example");
        assert_eq!(example.num_loss_tokens(), 2);
        let single = Example::causal(vec![9]).expect("valid example");
        assert_eq!(single.num_loss_tokens(), 0);
    }

    #[test]
    fn raw_errors_name_the_example_index() {
        let err = examples_from_raw(vec![(vec![1], vec![1]), (vec![], vec![])])
            .expect_err("second example is empty");
        assert_eq!(
            err,
            PackError::InvalidExample {
                index: 1,
                cause: ExampleError::Empty
            }
        );
        assert!(err.to_string().starts_with("example 1: input_ids is empty"));
    }
}
