use crate::kernels::{UnsupportedTensor, embedding};
use crate::tensor::Tensor;
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
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor<2>, UnsupportedTensor> {
        embedding(&self.weight.value, ids)
    }
}
