//! The one place that touches burn's tensor API beyond plain arithmetic.
//!
//! burn breaks its API between releases (0.22 moved from backend-generic
//! tensors to device dispatch); every call that is likely to move lives here,
//! so an upgrade changes this file and not the model. (The fused kernels
//! enter burn's autodiff through its extension crates in
//! `kernels/host_op.rs`, the other file an upgrade touches.)

pub use burn::tensor::{Bool, Device, Gradients, Int, Tensor, TensorData};

/// The CPU device (burn's Flex backend), with autodiff when `autodiff` is set.
pub fn cpu_device(autodiff: bool) -> Device {
    let device = Device::flex();
    if autodiff { device.autodiff() } else { device }
}

/// The CPU autodiff device with burn's balanced gradient checkpointing:
/// memory-bound activations are recomputed in the backward pass instead of
/// kept, compute-bound ones (matmuls) are kept.
pub fn cpu_device_with_checkpointing() -> Device {
    Device::flex().autodiff().gradient_checkpointing()
}

/// A float tensor from host values in row-major order.
pub fn float_tensor<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// An int tensor of token ids or indices.
pub fn int_tensor(values: &[u32], device: &Device) -> Tensor<1, Int> {
    let values: Vec<i64> = values.iter().map(|&v| i64::from(v)).collect();
    let len = values.len();
    Tensor::from_data(TensorData::new(values, [len]), device)
}

/// An int tensor of arbitrary shape.
pub fn int_tensor_nd<const D: usize>(
    values: Vec<i64>,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D, Int> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// A boolean tensor (true = masked out).
pub fn bool_tensor<const D: usize>(
    values: Vec<bool>,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D, Bool> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Values of a float tensor of any rank, row-major.
pub trait IntoHostVec {
    /// Copies the values to the host as f32.
    fn into_vec(self) -> Vec<f32>;
}

impl<const D: usize> IntoHostVec for Tensor<D> {
    /// On the CPU at most one copy: none when the tensor owns its f32
    /// buffer alone and that buffer was made from a `Vec<f32>` (what the
    /// fused kernels return), one otherwise. burn 0.22's own path copies a
    /// shared buffer, realigns the copy, then copies it again into a
    /// `Vec`: three copies of every gradient, 7% of a short-example step.
    fn into_vec(self) -> Vec<f32> {
        let tensor = if self.is_autodiff() {
            self.inner()
        } else {
            self
        };
        let on_cpu = tensor.device() == Device::flex();
        if on_cpu && tensor.dtype() == burn::tensor::DType::F32 {
            match tensor.try_into_primitive::<burn_flex::Flex>() {
                Ok(primitive) if primitive.is_unique() => {
                    return primitive
                        .into_data()
                        .try_into_vec::<f32>()
                        .expect("an f32 tensor's data is f32");
                }
                Ok(primitive) => {
                    if let Some(values) = primitive.as_slice::<f32>() {
                        return values.to_vec();
                    }
                    return Tensor::<D>::from_primitive::<burn_flex::Flex>(primitive)
                        .copied_to_vec();
                }
                Err(err) => panic!("a CPU tensor is a Flex tensor: {err:?}"),
            }
        }
        tensor.copied_to_vec()
    }
}

trait CopiedToVec {
    fn copied_to_vec(self) -> Vec<f32>;
}

impl<const D: usize> CopiedToVec for Tensor<D> {
    /// burn's own path, for other devices and dtypes.
    fn copied_to_vec(self) -> Vec<f32> {
        self.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap_or_default()
    }
}

/// The gradient of `leaf`, taken out of `grads`: the tensor is then its
/// buffer's only owner, so [`IntoHostVec::into_vec`] need not copy it.
pub fn take_grad<const D: usize>(leaf: &Tensor<D>, grads: &mut Gradients) -> Option<Tensor<D>> {
    leaf.grad_remove(grads)
}

/// Runs `f` on the values of a float tensor, row-major: a borrow of the
/// CPU buffer itself when it is contiguous f32 (an autodiff tensor's too,
/// through its inner tensor), else a copy. For adding a gradient into a
/// sum, or rounding the weights to bf16 once per step, where even
/// [`IntoHostVec`]'s one copy of a shared buffer is not needed.
pub fn with_host_values<const D: usize, R>(tensor: Tensor<D>, f: impl FnOnce(&[f32]) -> R) -> R {
    let tensor = if tensor.is_autodiff() {
        tensor.inner()
    } else {
        tensor
    };
    if let Ok(primitive) = tensor.clone().try_into_primitive::<burn_flex::Flex>()
        && let Some(values) = primitive.as_slice::<f32>()
    {
        return f(values);
    }
    f(&tensor.into_vec())
}

/// `x @ weight^T`: a linear layer with HF's `[out, in]` weight layout.
pub fn linear(x: Tensor<2>, weight: &Tensor<2>) -> Tensor<2> {
    x.matmul(weight.clone().transpose())
}

/// Softmax over the last dimension.
pub fn softmax_last<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    burn::tensor::activation::softmax(x, D - 1)
}

/// `x * sigmoid(x)`.
pub fn silu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    burn::tensor::activation::silu(x)
}

/// Rows of `table` at `indices`: `[N, C]` from `[V, C]`.
pub fn select_rows(table: &Tensor<2>, indices: Tensor<1, Int>) -> Tensor<2> {
    table.clone().select(0, indices)
}

/// `values[n, indices[n]]` for every row: `[N]` from `[N, V]`.
pub fn gather_columns(values: Tensor<2>, indices: Tensor<1, Int>) -> Tensor<1> {
    let rows = indices.dims()[0];
    values.gather(1, indices.reshape([rows, 1])).reshape([rows])
}

/// Sets masked elements (true) to `value`.
pub fn mask_fill<const D: usize>(x: Tensor<D>, mask: Tensor<D, Bool>, value: f32) -> Tensor<D> {
    x.mask_fill(mask, value)
}

/// Concatenates along `dim`.
pub fn cat<const D: usize>(parts: Vec<Tensor<D>>, dim: usize) -> Tensor<D> {
    Tensor::cat(parts, dim)
}

/// `length` entries of `dim` from `start`.
pub fn narrow<const D: usize>(x: Tensor<D>, dim: usize, start: usize, length: usize) -> Tensor<D> {
    x.narrow(dim, start, length)
}

/// A leaf whose gradient is kept by `backward`.
pub fn trainable<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    x.require_grad()
}

/// The same values off the graph: no gradient is computed for it, nor for
/// the matmul that would produce one (LoRA's frozen base).
pub fn frozen<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    // burn's `detach` keeps a leaf's `require_grad`; it must go too.
    x.detach().set_require_grad(false)
}

/// Gradients of everything reachable from a scalar.
pub fn backward(loss: &Tensor<1>) -> Gradients {
    loss.backward()
}

/// The gradient of a leaf, if it has one.
pub fn grad<const D: usize>(leaf: &Tensor<D>, grads: &Gradients) -> Option<Tensor<D>> {
    leaf.grad(grads)
}

/// `[1, 1, len, len]`, true where key `j` lies in the future of query `i`
/// (`j > i`). burn's `tril_mask` marks everything outside the lower triangle.
pub fn causal_mask(len: usize, device: &Device) -> Tensor<4, Bool> {
    Tensor::<4, Bool>::tril_mask([1, 1, len, len], 0, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_mask_hides_exactly_the_future() {
        let mask = causal_mask(3, &cpu_device(false));
        let values = mask.into_data().try_to_vec::<bool>().unwrap_or_default();
        assert_eq!(
            values,
            vec![false, true, true, false, false, true, false, false, false]
        );
    }

    /// Every way a tensor can reach `into_vec` gives its values in
    /// row-major order: sole owner of a buffer made from a `Vec` (taken
    /// without a copy), sole owner of a burn-made buffer, shared, a
    /// transposed view, an autodiff leaf, and a gradient taken out of its
    /// container.
    #[test]
    fn into_vec_gives_row_major_values_however_the_buffer_is_held() {
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        let device = cpu_device(false);
        let fresh = || float_tensor(values.clone(), [3, 4], &device);
        assert_eq!(fresh().into_vec(), values, "sole owner, Vec-made");
        assert_eq!((fresh() * 1.0).into_vec(), values, "sole owner, burn-made");
        let shared = fresh();
        let keep = shared.clone();
        assert_eq!(shared.into_vec(), values, "shared");
        assert_eq!(keep.into_vec(), values, "the other owner still sees them");
        let transposed: Vec<f32> = (0..4)
            .flat_map(|c| (0..3).map(move |r| r * 4 + c))
            .map(|i| values[i])
            .collect();
        assert_eq!(
            fresh().transpose().into_vec(),
            transposed,
            "transposed view"
        );
        let autodiff = cpu_device(true);
        let leaf = trainable(float_tensor(values.clone(), [3, 4], &autodiff));
        assert_eq!(leaf.clone().into_vec(), values, "autodiff leaf");
        let mut grads = backward(&(leaf.clone() * leaf.clone()).sum());
        let doubled: Vec<f32> = values.iter().map(|v| 2.0 * v).collect();
        let taken = take_grad(&leaf, &mut grads).map(IntoHostVec::into_vec);
        assert_eq!(taken, Some(doubled), "gradient taken out");
        assert!(take_grad(&leaf, &mut grads).is_none(), "taken once");
    }
}
