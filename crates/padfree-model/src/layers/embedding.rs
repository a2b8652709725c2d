use crate::tensor::{Int, Tensor, select_rows};
use crate::weights::table::Param;

/// Token embedding: a row of `[V, C]` per token id.
#[derive(Debug, Clone)]
pub struct Embedding<'a> {
    /// `[V, C]`.
    weight: &'a Param,
}

impl<'a> Embedding<'a> {
    /// The embedding table `weight` (`[V, C]`).
    pub fn new(weight: &'a Param) -> Self {
        Self { weight }
    }

    /// `[N]` ids (already checked against the vocabulary) `-> [N, C]`.
    pub fn forward(&self, ids: Tensor<1, Int>) -> Tensor<2> {
        select_rows(&self.weight.value, ids)
    }
}
