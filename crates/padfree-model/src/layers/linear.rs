use crate::lora::Adapter;
use crate::tensor::{Tensor, linear};
use crate::weights::table::Param;

/// A linear layer without bias, HF's `[O, C]` weight, and its LoRA adapter
/// when it has one.
#[derive(Debug, Clone)]
pub struct Linear<'a> {
    /// `[O, C]`; frozen when an adapter trains beside it.
    pub(crate) weight: &'a Param,
    pub(crate) adapter: Option<Adapter<'a>>,
}

impl<'a> Linear<'a> {
    /// `weight` (`[O, C]`) with `adapter`.
    pub fn new(weight: &'a Param, adapter: Option<Adapter<'a>>) -> Self {
        Self { weight, adapter }
    }

    /// `x W^T (+ the adapter's update)`: `[N, C] -> [N, O]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        match &self.adapter {
            None => linear(x, &self.weight.value),
            Some(adapter) => linear(x.clone(), &self.weight.value) + adapter.forward(x),
        }
    }
}
