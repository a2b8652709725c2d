//! The fused cross-entropy kernel (`crate::cross_entropy_kernel`) as a
//! differentiable burn op.

use std::sync::Arc;

use burn::tensor::Tensor;

use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::cross_entropy_kernel;

/// `[1]`: the summed `-log softmax(logits)[target]` over the rows of
/// `logits` (`[K, V]`), `targets[k] < V`.
pub fn cross_entropy_sum(
    logits: Tensor<2>,
    targets: &[usize],
) -> Result<Tensor<1>, UnsupportedTensor> {
    let op = CrossEntropy {
        targets: Arc::new(targets.to_vec()),
    };
    apply(op, [logits])
}

#[derive(Debug, Clone)]
struct CrossEntropy {
    targets: Arc<Vec<usize>>,
}

fn vocab(logits: &HostTensor<'_>) -> usize {
    logits.shape.last().copied().unwrap_or(0)
}

impl HostOp<1> for CrossEntropy {
    /// Saves one log-sum-exp per row.
    fn forward(&self, [logits]: [HostTensor<'_>; 1]) -> HostOutput {
        let (loss, lse) =
            cross_entropy_kernel::forward(logits.values, &self.targets, vocab(&logits));
        HostOutput {
            values: vec![loss as f32],
            shape: vec![1],
            saved: lse,
        }
    }

    fn backward(
        &self,
        [logits]: [HostTensor<'_>; 1],
        _output: &[f32],
        lse: &[f32],
        d_out: &[f32],
    ) -> [Vec<f32>; 1] {
        let d_loss = d_out.first().copied().unwrap_or(0.0);
        [cross_entropy_kernel::backward(
            logits.values,
            &self.targets,
            lse,
            vocab(&logits),
            d_loss,
        )]
    }
}
