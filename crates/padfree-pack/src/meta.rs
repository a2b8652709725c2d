use std::ops::Range;
use std::sync::Arc;

use crate::error::PackError;

/// The largest flattened batch: varlen attention kernels (flash-attention and
/// friends) take `cu_seqlens` as int32.
pub const MAX_BATCH_TOKENS: usize = i32::MAX as usize;

/// Where every example of a flattened batch begins and ends.
///
/// This is what a varlen attention needs to keep each example to itself. The
/// collator ([`crate::flatten`]) computes it once per batch and the model passes
/// `&BatchMeta` down to every layer; no layer derives it again. The fields are
/// private so that a value always satisfies its invariants: `cu_seqlens` starts
/// at 0, increases strictly, ends at the total token count, and `max_seqlen` is
/// the longest difference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchMeta {
    /// `[B + 1]`: cumulative example lengths, `0 .. T`. Shared, not copied:
    /// a kernel that keeps the offsets for its backward pass holds another
    /// reference to these very values, in this one integer type.
    cu_seqlens: Arc<[u32]>,
    /// Longest example, `L`.
    max_seqlen: usize,
}

impl BatchMeta {
    /// Metadata of a batch whose examples have these lengths, in order.
    pub fn from_lengths<I>(lengths: I) -> Result<Self, PackError>
    where
        I: IntoIterator<Item = usize>,
    {
        let lengths = lengths.into_iter();
        let mut cu_seqlens = Vec::with_capacity(lengths.size_hint().0 + 1);
        cu_seqlens.push(0u32);
        let mut total = 0usize;
        let mut max_seqlen = 0usize;
        for (index, len) in lengths.enumerate() {
            if len == 0 {
                return Err(PackError::ZeroLength { index });
            }
            total = total.saturating_add(len);
            if total > MAX_BATCH_TOKENS {
                return Err(PackError::TooManyTokens {
                    total,
                    max: MAX_BATCH_TOKENS,
                });
            }
            max_seqlen = max_seqlen.max(len);
            cu_seqlens.push(to_u32(total));
        }
        if cu_seqlens.len() == 1 {
            return Err(PackError::EmptyBatch);
        }
        Ok(Self {
            cu_seqlens: cu_seqlens.into(),
            max_seqlen,
        })
    }

    /// Derives the metadata from `position_ids` alone, as an attention layer
    /// must when the collator does not hand it over (the reference system's
    /// slower variant: one `O(T)` scan per layer per step).
    ///
    /// An example starts wherever the position is 0; inside an example each
    /// position must be the previous plus one.
    ///
    /// # Shapes
    /// `position_ids`: `[T]`.
    pub fn derive_from_position_ids(position_ids: &[u32]) -> Result<Self, PackError> {
        let Some(&first) = position_ids.first() else {
            return Err(PackError::EmptyBatch);
        };
        if first != 0 {
            return Err(PackError::InvalidPositionIds {
                index: 0,
                found: first,
                expected: "0".to_owned(),
            });
        }
        if position_ids.len() > MAX_BATCH_TOKENS {
            return Err(PackError::TooManyTokens {
                total: position_ids.len(),
                max: MAX_BATCH_TOKENS,
            });
        }
        let mut cu_seqlens = vec![0u32];
        let mut max_seqlen = 1usize;
        let mut start = 0usize;
        for (index, pair) in position_ids.windows(2).enumerate() {
            let (previous, position) = (pair[0], pair[1]);
            let index = index + 1;
            if position == 0 {
                max_seqlen = max_seqlen.max(index - start);
                cu_seqlens.push(to_u32(index));
                start = index;
            } else if Some(position) != previous.checked_add(1) {
                return Err(PackError::InvalidPositionIds {
                    index,
                    found: position,
                    expected: format!("0 or {}", u64::from(previous) + 1),
                });
            }
        }
        max_seqlen = max_seqlen.max(position_ids.len() - start);
        cu_seqlens.push(to_u32(position_ids.len()));
        Ok(Self {
            cu_seqlens: cu_seqlens.into(),
            max_seqlen,
        })
    }

    /// `[B + 1]`: `cu_seqlens[i] .. cu_seqlens[i + 1]` are the tokens of example `i`.
    pub fn cu_seqlens(&self) -> &[u32] {
        &self.cu_seqlens
    }

    /// The same offsets as [`Self::cu_seqlens`], as a shared handle (a
    /// reference count, no copy) for a kernel that keeps them until its
    /// backward pass.
    pub fn cu_seqlens_shared(&self) -> Arc<[u32]> {
        Arc::clone(&self.cu_seqlens)
    }

    /// Length of the longest example, `L`.
    pub fn max_seqlen(&self) -> usize {
        self.max_seqlen
    }

    /// Number of examples, `B`.
    pub fn num_examples(&self) -> usize {
        self.cu_seqlens.len() - 1
    }

    /// Number of tokens, `T`.
    pub fn total_tokens(&self) -> usize {
        self.cu_seqlens.last().map_or(0, |&total| total as usize)
    }

    /// Token range of every example, in order.
    pub fn example_ranges(&self) -> impl ExactSizeIterator<Item = Range<usize>> + '_ {
        self.cu_seqlens
            .windows(2)
            .map(|pair| pair[0] as usize..pair[1] as usize)
    }

    /// Length of every example, in order.
    pub fn seq_lens(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        self.example_ranges().map(|range| range.len())
    }
}

/// Callers have already bounded `value` by [`MAX_BATCH_TOKENS`].
fn to_u32(value: usize) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_give_cumulative_offsets() {
        let meta = BatchMeta::from_lengths([3, 6, 7]).expect("valid lengths");
        assert_eq!(meta.cu_seqlens(), &[0, 3, 9, 16]);
        assert_eq!(meta.max_seqlen(), 7);
        assert_eq!(meta.num_examples(), 3);
        assert_eq!(meta.total_tokens(), 16);
        assert_eq!(meta.seq_lens().collect::<Vec<_>>(), vec![3, 6, 7]);
    }

    #[test]
    fn lengths_reject_empty_and_zero() {
        assert_eq!(BatchMeta::from_lengths([]), Err(PackError::EmptyBatch));
        assert_eq!(
            BatchMeta::from_lengths([2, 0]),
            Err(PackError::ZeroLength { index: 1 })
        );
    }

    #[test]
    fn derivation_finds_restarts_at_zero() {
        let meta = BatchMeta::derive_from_position_ids(&[0, 1, 2, 0, 0, 1]).expect("valid");
        assert_eq!(meta.cu_seqlens(), &[0, 3, 4, 6]);
        assert_eq!(meta.max_seqlen(), 3);
        let single = BatchMeta::derive_from_position_ids(&[0]).expect("valid");
        assert_eq!(single.cu_seqlens(), &[0, 1]);
        assert_eq!(single.max_seqlen(), 1);
    }

    #[test]
    fn derivation_rejects_positions_that_are_not_examples() {
        assert_eq!(
            BatchMeta::derive_from_position_ids(&[]),
            Err(PackError::EmptyBatch)
        );
        assert!(matches!(
            BatchMeta::derive_from_position_ids(&[1, 2]),
            Err(PackError::InvalidPositionIds { index: 0, .. })
        ));
        assert!(matches!(
            BatchMeta::derive_from_position_ids(&[0, 1, 3]),
            Err(PackError::InvalidPositionIds {
                index: 2,
                found: 3,
                ..
            })
        ));
        assert!(matches!(
            BatchMeta::derive_from_position_ids(&[0, u32::MAX]),
            Err(PackError::InvalidPositionIds { index: 1, .. })
        ));
    }
}
