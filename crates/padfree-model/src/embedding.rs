use crate::param::Param;
use crate::tensor::{Int, Tensor, select_rows};

/// Token embedding: a row of `[V, C]` per token id.
#[derive(Debug, Clone)]
pub struct Embedding {
    /// `[V, C]`.
    pub(crate) weight: Param,
}

impl Embedding {
    pub(crate) fn new(weight: Param) -> Self {
        Self { weight }
    }

    /// `[N]` ids (already checked against the vocabulary) `-> [N, C]`.
    pub fn forward(&self, ids: Tensor<1, Int>) -> Tensor<2> {
        select_rows(&self.weight.value, ids)
    }
}
