//! A linear layer's product `y = x W^T` (HF's `[O, C]` weight) as one host
//! op: the output and both gradients (`dx = dy W`, `dW = dy^T x`) written
//! once each, straight from the inputs' buffers (`kernels/gemm.rs`), and
//! `dW` not computed at all for a frozen weight (LoRA's base, a frozen
//! head). burn's matmul computes the same products with the same gemm
//! kernels, but zeroes and then copies every output first (see
//! `gemm.rs`); it stays the oracle and the GPU's path.
//!
//! # Shapes
//! `N` rows, `C` input width, `O` output width.

use super::attention::is_cpu;
use super::gemm::{View, product};
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::tensor::{Tensor, linear};

/// `x W^T`: `[N, C]`, `[O, C]` -> `[N, O]`, differentiable in both.
///
/// On a GPU this is [`composed_linear`] (burn's matmul).
pub fn fused_linear(x: Tensor<2>, w: Tensor<2>) -> Result<Tensor<2>, UnsupportedTensor> {
    if !is_cpu(&x.device()) {
        return Ok(composed_linear(x, w));
    }
    apply::<_, 2, 2, 2>(Linear, [x, w])
}

/// The oracle, and the GPU path: burn's `x.matmul(w^T)`.
pub fn composed_linear(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    linear(x, &w)
}

#[derive(Debug, Clone)]
struct Linear;

impl HostOp<2> for Linear {
    /// Neither gradient reads the output.
    const KEEPS_OUTPUT: bool = false;

    fn forward(&self, [x, w]: [HostTensor<'_>; 2]) -> HostOutput {
        let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
        HostOutput {
            values: product(
                View::row_major(x.values, n, c),
                View::row_major(w.values, o, c).t(),
            ),
            shape: vec![n, o],
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [x, w]: [HostTensor<'_>; 2],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
        needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
        let dy = View::row_major(d_out, n, o);
        let dx = if needed[0] {
            product(dy, View::row_major(w.values, o, c))
        } else {
            Vec::new()
        };
        let dw = if needed[1] {
            product(dy.t(), View::row_major(x.values, n, c))
        } else {
            Vec::new()
        };
        [dx, dw]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{assert_within, random};
    use crate::tensor::{IntoHostVec, backward, cpu_device, float_tensor, frozen, grad, trainable};

    /// The op against burn's matmul: output and both gradients, the weight
    /// trainable and frozen. The same gemm kernels add the same products
    /// in the same order, so the values are expected equal; 1e-6 of the
    /// largest allows one rounding apart should gemm pick another split.
    #[test]
    fn op_matches_burns_matmul_trainable_or_frozen() {
        let device = cpu_device(true);
        for (n, c, o) in [(1, 3, 2), (37, 48, 29), (300, 64, 200)] {
            let (x0, w0, dy0) = (random(n * c, 1), random(o * c, 2), random(n * o, 3));
            for weight_trains in [true, false] {
                let run = |fused: bool| {
                    let x = trainable(float_tensor(x0.clone(), [n, c], &device));
                    let w = float_tensor(w0.clone(), [o, c], &device);
                    let w = if weight_trains {
                        trainable(w)
                    } else {
                        frozen(w)
                    };
                    let y = if fused {
                        fused_linear(x.clone(), w.clone()).expect("f32 on the CPU")
                    } else {
                        composed_linear(x.clone(), w.clone())
                    };
                    let dy = float_tensor(dy0.clone(), [n, o], &device);
                    let grads = backward(&(y.clone() * dy).sum());
                    let dx = grad(&x, &grads).expect("dx").into_vec();
                    let dw = grad(&w, &grads).map(IntoHostVec::into_vec);
                    (y.into_vec(), dx, dw)
                };
                let (ours, theirs) = (run(true), run(false));
                assert_eq!(ours.2.is_some(), weight_trains, "dW only when W trains");
                let mut pairs = vec![("y", ours.0, theirs.0), ("dx", ours.1, theirs.1)];
                if let (Some(a), Some(b)) = (ours.2, theirs.2) {
                    pairs.push(("dW", a, b));
                }
                for (what, a, b) in pairs {
                    assert_within(&format!("{what} [{n},{c},{o}]"), &a, &b, 1e-6);
                }
            }
        }
    }
}
