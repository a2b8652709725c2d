use std::ops::Range;

use crate::binpack::check_lengths;
use crate::error::PackError;

/// What a token budget bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BudgetKind {
    /// Real tokens: the sum of the lengths (padding-free batches).
    RealTokens,
    /// Fed tokens of a padded batch: examples times the longest length.
    PaddedTokens,
}

/// Cuts examples, in the order given, into consecutive batches of at most
/// `budget` tokens each (greedy: a batch closes when the next example would
/// not fit). Unlike bin packing it keeps the data order, so a shuffled order
/// stays shuffled.
///
/// Returns the ranges of `lengths` that form each batch.
pub fn batch_by_token_budget(
    lengths: &[usize],
    budget: usize,
    kind: BudgetKind,
) -> Result<Vec<Range<usize>>, PackError> {
    check_lengths(lengths, budget, "token budget")?;
    let mut batches = Vec::new();
    let mut start = 0;
    let mut tokens = 0usize;
    let mut longest = 0usize;
    for (index, &len) in lengths.iter().enumerate() {
        let cost_with = match kind {
            BudgetKind::RealTokens => tokens + len,
            BudgetKind::PaddedTokens => (index - start + 1) * longest.max(len),
        };
        if index > start && cost_with > budget {
            batches.push(start..index);
            start = index;
            tokens = 0;
            longest = 0;
        }
        tokens += len;
        longest = longest.max(len);
    }
    batches.push(start..lengths.len());
    Ok(batches)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_token_budget_keeps_order() {
        let batches =
            batch_by_token_budget(&[3, 4, 2, 5, 1], 7, BudgetKind::RealTokens).expect("batches");
        assert_eq!(batches, vec![0..2, 2..4, 4..5]);
    }

    #[test]
    fn padded_budget_counts_the_longest_times_the_rows() {
        // [1, 4] costs 2 * 4 = 8 <= 8; adding 1 would cost 3 * 4 = 12.
        let batches =
            batch_by_token_budget(&[1, 4, 1, 1, 1], 8, BudgetKind::PaddedTokens).expect("batches");
        assert_eq!(batches, vec![0..2, 2..5]);
    }

    #[test]
    fn an_example_over_budget_is_named() {
        assert_eq!(
            batch_by_token_budget(&[2, 9], 8, BudgetKind::RealTokens),
            Err(PackError::ExampleTooLong {
                index: 1,
                len: 9,
                limit: 8,
                limit_name: "token budget"
            })
        );
        assert_eq!(
            batch_by_token_budget(&[2], 0, BudgetKind::RealTokens),
            Err(PackError::ZeroCapacity {
                what: "token budget"
            })
        );
    }
}
