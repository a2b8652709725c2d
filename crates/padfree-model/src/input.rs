//! A batch as the model takes it: the layout chooses the attention strategy.

use padfree_pack::{PackedBatch, PaddedBatch, TokenRows};

/// A batch as the model takes it; the variant chooses the attention strategy.
#[derive(Debug, Clone, Copy)]
pub enum ModelInput<'a> {
    /// Padding-free with the collator's boundaries (`varlen`).
    Varlen(&'a PackedBatch),
    /// Padding-free, boundaries derived in every layer (`varlen-per-layer`).
    VarlenPerLayer(&'a PackedBatch),
    /// Padded `[B, L]` with an attention mask (`padded`).
    Padded(&'a PaddedBatch),
}

impl ModelInput<'_> {
    /// The batch's rows, whatever the layout.
    pub fn rows(&self) -> &dyn TokenRows {
        match *self {
            ModelInput::Varlen(batch) | ModelInput::VarlenPerLayer(batch) => batch,
            ModelInput::Padded(batch) => batch,
        }
    }

    /// `[N]` token ids of the rows the model runs on (`N = T` or `B * L`).
    pub fn input_ids(&self) -> &[u32] {
        self.rows().input_ids()
    }

    /// `[N]` the label every row predicts, -100 where none.
    pub fn targets(&self) -> Vec<i64> {
        self.rows().next_token_targets()
    }
}
