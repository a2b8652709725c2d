//! What every batch layout hands a model: the rows it runs on. The flattened
//! and the padded batch both implement it, so a consumer that only needs
//! ids, positions and targets takes either without matching on the layout.

use crate::{PackedBatch, PaddedBatch};

/// The token rows of a batch, whatever its layout.
///
/// # Shapes
/// `N` rows: `T` for a flattened batch, `B * L` (row-major) for a padded one.
pub trait TokenRows {
    /// `[N]` token ids.
    fn input_ids(&self) -> &[u32];
    /// `[N]` position of every row inside its sequence.
    fn position_ids(&self) -> &[u32];
    /// `[N]` the token every row predicts, -100 where none.
    fn next_token_targets(&self) -> Vec<i64>;
    /// The longest sequence a row belongs to (`L`).
    fn max_seqlen(&self) -> usize;
}

impl TokenRows for PackedBatch {
    fn input_ids(&self) -> &[u32] {
        PackedBatch::input_ids(self)
    }
    fn position_ids(&self) -> &[u32] {
        PackedBatch::position_ids(self)
    }
    fn next_token_targets(&self) -> Vec<i64> {
        PackedBatch::next_token_targets(self)
    }
    fn max_seqlen(&self) -> usize {
        self.meta().max_seqlen()
    }
}

impl TokenRows for PaddedBatch {
    fn input_ids(&self) -> &[u32] {
        PaddedBatch::input_ids(self)
    }
    fn position_ids(&self) -> &[u32] {
        PaddedBatch::position_ids(self)
    }
    fn next_token_targets(&self) -> Vec<i64> {
        PaddedBatch::next_token_targets(self)
    }
    fn max_seqlen(&self) -> usize {
        self.seq_len()
    }
}
