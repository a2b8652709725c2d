//! The CubeCL body of the cross-entropy over labelled rows, forward and
//! backward: the log-sum-exp of each row in one pass over its logits (an
//! online maximum), the row's loss beside it, and in the backward pass the
//! gradient of the logits, `d_loss * (softmax - one_hot)`, one element per
//! invocation; where burn's composed ops take some ten passes over `[K, V]`
//! (max, subtract, exp, sum, log, gather and their backward), each with a
//! `[K, V]` buffer. Only the `[K]` log-sum-exps are kept for backward, no
//! probabilities.
//!
//! # Shapes
//! `K` labelled rows, `V` vocabulary. `logits`, `d_logits`: `[K, V]`;
//! `targets` (as f32: exact below 2^24), `lse`, `loss`, `d_loss`: `[K]`.

use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_op::{CubeOp, apply, empty_like, grid};
use crate::kernels::host_op::UnsupportedTensor;
use crate::tensor::{Device, float_tensor};

#[cube(launch)]
fn forward_kernel(
    logits: &Tensor<f32>,
    targets: &Tensor<f32>,
    loss: &mut Tensor<f32>,
    lse: &mut Tensor<f32>,
    #[comptime] vocab: usize,
) {
    let row = ABSOLUTE_POS;
    if row < lse.len() {
        let base = row * vocab;
        // Stands for minus infinity: WGSL refuses an infinite constant.
        let mut m = f32::new(-1.0e30);
        let mut sum = 0.0f32;
        for v in 0..vocab {
            let x = logits[base + v];
            if x > m {
                sum *= (m - x).exp();
                m = x;
            }
            sum += (x - m).exp();
        }
        let row_lse = m + sum.ln();
        let target = u32::cast_from(targets[row]) as usize;
        lse[row] = row_lse;
        loss[row] = row_lse - logits[base + target];
    }
}

#[cube(launch)]
fn backward_kernel(
    logits: &Tensor<f32>,
    targets: &Tensor<f32>,
    lse: &Tensor<f32>,
    d_loss: &Tensor<f32>,
    d_logits: &mut Tensor<f32>,
    #[comptime] vocab: usize,
) {
    let i = ABSOLUTE_POS;
    if i < d_logits.len() {
        let row = i / vocab;
        let column = i % vocab;
        let mut g = (logits[i] - lse[row]).exp();
        if column == u32::cast_from(targets[row]) as usize {
            g -= 1.0f32;
        }
        d_logits[i] = g * d_loss[row];
    }
}

/// `[1]`: the summed loss of the rows of `logits` (`[K, V]`, `K > 0`) on a
/// CubeCL device; `targets[k] < V`.
pub(super) fn cross_entropy_sum(
    logits: BurnTensor<2>,
    targets: &[usize],
    device: &Device,
) -> Result<BurnTensor<1>, UnsupportedTensor> {
    let values: Vec<f32> = targets.iter().map(|&t| t as f32).collect();
    let targets = float_tensor(values, [targets.len()], &device.clone().inner())
        .try_into_primitive::<CubeBackend>()
        .map(into_contiguous)
        .map_err(|err| UnsupportedTensor(format!("{err:?}")))?;
    let rows: BurnTensor<1> = apply(&CrossEntropy { targets }, [logits])?;
    Ok(rows.sum())
}

/// The op: the rows' targets on the device.
struct CrossEntropy {
    targets: CubeTensor,
}

/// What the backward pass reads: the logits (the head's output, kept by
/// the matmul's backward anyway), the targets, each row's log-sum-exp.
#[derive(Debug, Clone)]
struct Saved {
    logits: CubeTensor,
    targets: CubeTensor,
    lse: CubeTensor,
}

impl CubeOp<1> for CrossEntropy {
    type Saved = Saved;

    fn forward(&self, [logits]: [CubeTensor; 1]) -> (CubeTensor, Saved) {
        let (rows, vocab) = (logits.meta.shape()[0], logits.meta.shape()[1]);
        let loss = empty_like(&logits, vec![rows]);
        let lse = empty_like(&logits, vec![rows]);
        let (count, dim) = grid(&logits, rows);
        forward_kernel::launch(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            self.targets.clone().into_tensor_arg(),
            loss.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            vocab,
        );
        let saved = Saved {
            logits,
            targets: self.targets.clone(),
            lse,
        };
        (loss, saved)
    }

    fn backward(saved: &Saved, d_loss: CubeTensor) -> [CubeTensor; 1] {
        let Saved {
            logits,
            targets,
            lse,
        } = saved;
        let d_loss = into_contiguous(d_loss);
        let (rows, vocab) = (logits.meta.shape()[0], logits.meta.shape()[1]);
        let d_logits = empty_like(logits, vec![rows, vocab]);
        let (count, dim) = grid(logits, rows * vocab);
        backward_kernel::launch(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            d_loss.into_tensor_arg(),
            d_logits.clone().into_tensor_arg(),
            vocab,
        );
        [d_logits]
    }
}
