//! A micro-batch as the model takes it: flattened by the collator (the
//! boundaries computed once, in `padfree-pack`), or padded. Training and
//! evaluation collate through this one place.

use padfree_model::ModelInput;
use padfree_pack::{Example, PackedBatch, PaddedBatch, flatten, pad};

use crate::config::AttentionMode;
use crate::error::TrainError;

/// A micro-batch as the attention mode wants it: flattened by the collator,
/// or padded. Training and evaluation collate through this one place.
pub(crate) enum Collated {
    /// Flattened; with the boundaries derived in every layer when `per_layer`.
    Packed { batch: PackedBatch, per_layer: bool },
    /// Padded on the right.
    Padded(PaddedBatch),
}

impl Collated {
    pub(crate) fn new(batch: &[Example], attention: AttentionMode) -> Result<Self, TrainError> {
        Ok(match attention {
            AttentionMode::Varlen => Self::Packed {
                batch: flatten(batch)?,
                per_layer: false,
            },
            AttentionMode::VarlenPerLayer => Self::Packed {
                batch: flatten(batch)?,
                per_layer: true,
            },
            // The pad id is never attended to nor learned; any id will do.
            AttentionMode::Padded => Self::Padded(pad(batch, 0, None)?),
        })
    }

    pub(crate) fn input(&self) -> ModelInput<'_> {
        match self {
            Self::Packed {
                batch,
                per_layer: false,
            } => ModelInput::Varlen(batch),
            Self::Packed {
                batch,
                per_layer: true,
            } => ModelInput::VarlenPerLayer(batch),
            Self::Padded(batch) => ModelInput::Padded(batch),
        }
    }
}
