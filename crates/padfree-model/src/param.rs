use crate::tensor::Tensor;

/// One trainable tensor with its Hugging Face name and shape.
///
/// Every parameter is held as a matrix: vectors (norm weights, HF shape `[C]`)
/// as `[1, C]`, which broadcasts over `[N, C]` activations. `hf_shape` is what
/// safetensors files hold.
#[derive(Debug, Clone)]
pub struct Param {
    name: String,
    hf_shape: Vec<usize>,
    /// The values, `[rows, cols]`.
    pub value: Tensor<2>,
}

impl Param {
    pub(crate) fn new(name: String, hf_shape: Vec<usize>, value: Tensor<2>) -> Self {
        Self {
            name,
            hf_shape,
            value,
        }
    }

    /// The Hugging Face tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shape in Hugging Face files.
    pub fn hf_shape(&self) -> &[usize] {
        &self.hf_shape
    }

    /// Number of values.
    pub fn numel(&self) -> usize {
        self.hf_shape.iter().product()
    }
}
