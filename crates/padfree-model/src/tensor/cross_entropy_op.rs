//! The fused cross-entropy kernel as a burn operation with its own backward
//! pass (burn's backend-extension API, as `varlen_op.rs`).

use std::sync::Arc;

use burn::tensor::{Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_flex::{Flex, FlexTensor};

use super::varlen_op::{AutodiffTensor, UnsupportedTensor, f32_values, unsupported};
use crate::cross_entropy_kernel;

/// `[1]`: the summed `-log softmax(logits)[target]` over the rows of
/// `logits` (`[K, V]`), `targets[k] < V`. Differentiable on an autodiff
/// device (with or without gradient checkpointing).
pub fn cross_entropy_sum(
    logits: Tensor<2>,
    targets: &[usize],
) -> Result<Tensor<1>, UnsupportedTensor> {
    let targets = Arc::new(targets.to_vec());
    if !logits.is_autodiff() {
        let logits = unsupported(logits.try_into_primitive::<Flex>())?;
        let (loss, _) = forward(&logits, &targets)?;
        return Ok(Tensor::from_primitive::<Flex>(loss));
    }
    match logits.gradient_checkpointing_strategy() {
        Some(burn::tensor::GradientCheckpointingStrategy::Balanced) => {
            type Backend = Autodiff<Flex, BalancedCheckpointing>;
            let logits = unsupported(logits.try_into_primitive::<Backend>())?;
            let loss = tracked::<BalancedCheckpointing>(logits, targets)?;
            Ok(Tensor::from_primitive::<Backend>(loss))
        }
        _ => {
            type Backend = Autodiff<Flex, NoCheckpointing>;
            let logits = unsupported(logits.try_into_primitive::<Backend>())?;
            let loss = tracked::<NoCheckpointing>(logits, targets)?;
            Ok(Tensor::from_primitive::<Backend>(loss))
        }
    }
}

/// The `[1]` loss tensor and each row's log-sum-exp.
fn forward(
    logits: &FlexTensor,
    targets: &[usize],
) -> Result<(FlexTensor, Vec<f32>), UnsupportedTensor> {
    let vocab = vocab_of(logits);
    let logits = logits.to_contiguous();
    let (loss, lse) = cross_entropy_kernel::forward(f32_values(&logits)?, targets, vocab);
    Ok((
        FlexTensor::from_data(TensorData::new(vec![loss as f32], [1])),
        lse,
    ))
}

fn vocab_of(logits: &FlexTensor) -> usize {
    logits.layout().shape().last().copied().unwrap_or(0)
}

/// Kept for the backward pass: the logits (which the head's matmul keeps
/// anyway), the targets and one log-sum-exp per row.
#[derive(Debug, Clone)]
struct Saved {
    logits: FlexTensor,
    targets: Arc<Vec<usize>>,
    lse: Arc<Vec<f32>>,
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl Backward<Flex, 1> for CrossEntropyBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_loss = grads.consume::<Flex>(&ops.node).to_contiguous();
        let [logits_node] = ops.parents;
        let Some(node) = logits_node else {
            return;
        };
        let saved = ops.state;
        let logits = saved.logits.to_contiguous();
        // The forward pass checked both; a failure here is a bug.
        let (Ok(values), Ok(d_loss)) = (f32_values(&logits), f32_values(&d_loss)) else {
            panic!("cross-entropy backward: tensors are no longer contiguous f32");
        };
        let vocab = vocab_of(&logits);
        let d_logits = cross_entropy_kernel::backward(
            values,
            &saved.targets,
            &saved.lse,
            vocab,
            d_loss.first().copied().unwrap_or(0.0),
        );
        let shape = logits.layout().shape().clone();
        grads.register::<Flex>(
            node.id,
            FlexTensor::from_data(TensorData::new(d_logits, shape)),
        );
    }
}

fn tracked<C: CheckpointStrategy>(
    logits: AutodiffTensor,
    targets: Arc<Vec<usize>>,
) -> Result<AutodiffTensor, UnsupportedTensor> {
    let (logits, node) = logits.into_parts();
    let (loss, lse) = forward(&logits, &targets)?;
    Ok(
        match CrossEntropyBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    logits,
                    targets,
                    lse: Arc::new(lse),
                },
                loss,
            ),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        },
    )
}
