//! The CubeCL body of the cross-entropy over labelled rows, forward and
//! backward: the log-sum-exp of each row in one pass over its logits, a
//! workgroup per row (each thread an online maximum and sum over every
//! `threads`-th logit, coalesced; the threads' maxima, then their rescaled
//! sums, meet through shared memory in a fixed order), the row's loss
//! beside it, and in the backward pass the
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
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_op::{
    CubeOp, apply, contiguous_primitive, empty_like, grid, row_groups, workgroup_index,
    workgroup_max, workgroup_sum,
};
use crate::kernels::host_op::UnsupportedTensor;
use crate::kernels::linear::{HalfGrad, half_copy, half_product, transposed};
use crate::precision::HalfFloat;
use crate::tensor::{Device, float_tensor};
use burn_backend::ops::FloatTensorOps;
use burn_backend::{DType, FloatDType, Slice, TensorMetadata};

#[cube(launch)]
fn forward_kernel(
    logits: &Tensor<f32>,
    targets: &Tensor<f32>,
    loss: &mut Tensor<f32>,
    lse: &mut Tensor<f32>,
    #[comptime] vocab: usize,
    #[comptime] threads: usize,
) {
    let row = workgroup_index();
    if row >= lse.len() {
        terminate!();
    }
    let lane = UNIT_POS_X as usize;
    let base = row * vocab;
    // Each thread an online log-sum-exp over every `CUBE_DIM_X`-th logit
    // (neighbouring threads, neighbouring logits). Stands for minus
    // infinity: WGSL refuses an infinite constant.
    let mut m = f32::new(-1.0e30);
    let mut sum = 0.0f32;
    let mut v = lane;
    while v < vocab {
        let x = logits[base + v];
        if x > m {
            sum *= (m - x).exp();
            m = x;
        }
        sum += (x - m).exp();
        v += CUBE_DIM_X as usize;
    }
    // The row's maximum, then every thread's sum rescaled to it.
    let row_max = workgroup_max(m, threads);
    let total = workgroup_sum(sum * (m - row_max).exp(), threads);
    if lane == 0 {
        let row_lse = row_max + total.ln();
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

/// The targets, as the kernels read them: `[K]` f32 on `device`.
fn targets_tensor(targets: &[usize], device: &Device) -> Result<CubeTensor, UnsupportedTensor> {
    let values: Vec<f32> = targets.iter().map(|&t| t as f32).collect();
    contiguous_primitive(&float_tensor(
        values,
        [targets.len()],
        &device.clone().inner(),
    ))
}

/// `[1]`: the summed loss of the rows of `logits` (`[K, V]`, `K > 0`) on a
/// CubeCL device; `targets[k] < V`.
pub(super) fn cross_entropy_sum(
    logits: BurnTensor<2>,
    targets: &[usize],
    device: &Device,
) -> Result<BurnTensor<1>, UnsupportedTensor> {
    let targets = targets_tensor(targets, device)?;
    let rows: BurnTensor<1> = apply(&CrossEntropy { targets }, [logits])?;
    Ok(rows.sum())
}

/// `[1]`: the summed loss of the rows of `x head^T` (`x`: `[K, C]`, `K >
/// 0`; `head`: `[V, C]`) on a CubeCL device, the logits made `chunk_rows`
/// rows at a time and dropped once their rows' log-sum-exps are known;
/// the backward pass makes each chunk's logits again. No `[K, V]` tensor
/// exists, forward or backward: at most one `[chunk_rows, V]` chunk of
/// logits and one of their gradient.
///
/// With `head16` (`--bf16` on a GPU: the head's 16-bit copy, off the graph)
/// the chunks' products take 16-bit operands as the linear layers' do
/// (`kernels/linear/cube.rs`): `x` cast once and kept so, the logits
/// written in f32 (rounded to bf16 in bf16, as autocast's head output is),
/// each chunk's `d_logits` cast (scaled in f16) for `dx` and `d_head`.
pub(super) fn head_cross_entropy_sum(
    x: BurnTensor<2>,
    head: BurnTensor<2>,
    head16: Option<&BurnTensor<2>>,
    targets: &[usize],
    chunk_rows: usize,
    device: &Device,
) -> Result<BurnTensor<1>, UnsupportedTensor> {
    let targets = targets_tensor(targets, device)?;
    let head16 = head16.map(half_copy).transpose()?;
    let op = HeadCrossEntropy {
        targets,
        chunk_rows: chunk_rows.max(1),
        head16,
    };
    let rows: BurnTensor<1> = apply(&op, [x, head])?;
    Ok(rows.sum())
}

/// `(loss, lse)`, `[K]` each, of contiguous `logits` `[K, V]`.
fn forward(logits: &CubeTensor, targets: &CubeTensor) -> (CubeTensor, CubeTensor) {
    let (rows, vocab) = (logits.meta.shape()[0], logits.meta.shape()[1]);
    let loss = empty_like(logits, vec![rows]);
    let lse = empty_like(logits, vec![rows]);
    let (count, dim, threads) = row_groups(logits, rows);
    forward_kernel::launch(
        &logits.client,
        count,
        dim,
        logits.clone().into_tensor_arg(),
        targets.clone().into_tensor_arg(),
        loss.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        vocab,
        threads,
    );
    (loss, lse)
}

/// `d_logits` `[K, V]` of contiguous `logits`, given each row's `d_loss`.
fn backward(
    logits: &CubeTensor,
    targets: &CubeTensor,
    lse: &CubeTensor,
    d_loss: &CubeTensor,
) -> CubeTensor {
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
        d_loss.clone().into_tensor_arg(),
        d_logits.clone().into_tensor_arg(),
        vocab,
    );
    d_logits
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
        let (loss, lse) = forward(&logits, &self.targets);
        let saved = Saved {
            logits,
            targets: self.targets.clone(),
            lse,
        };
        (loss, saved)
    }

    fn backward(saved: &Saved, d_loss: CubeTensor) -> [CubeTensor; 1] {
        let d_loss = into_contiguous(d_loss);
        [backward(&saved.logits, &saved.targets, &saved.lse, &d_loss)]
    }
}

/// The head and the loss in one op, chunked (see [`head_cross_entropy_sum`]).
struct HeadCrossEntropy {
    targets: CubeTensor,
    chunk_rows: usize,
    /// The head's 16-bit copy and its float, under `--bf16`.
    head16: Option<(CubeTensor, HalfFloat)>,
}

/// What its backward pass reads: the rows' hidden states and the head
/// (kept anyway: the head is a weight, `x` the final norm's output), the
/// targets and each row's log-sum-exp; no logits.
#[derive(Debug, Clone)]
struct HeadSaved {
    /// f32, or 16-bit with `half`.
    x: CubeTensor,
    /// The head, or its 16-bit copy with `half`.
    head: CubeTensor,
    targets: CubeTensor,
    lse: CubeTensor,
    chunk_rows: usize,
    half: Option<HalfFloat>,
}

/// Rows `[start, end)` of a contiguous tensor, contiguous.
fn rows_of(tensor: &CubeTensor, start: usize, end: usize) -> CubeTensor {
    let mut slices = vec![Slice::new(start as isize, Some(end as isize), 1)];
    slices.extend((1..tensor.meta.shape().len()).map(|_| Slice::from(..)));
    into_contiguous(CubeBackend::float_slice(tensor.clone(), &slices))
}

/// `[start, end)` of every chunk of `chunk_rows` rows of `rows`.
fn chunks(rows: usize, chunk_rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..rows)
        .step_by(chunk_rows)
        .map(move |start| (start, (start + chunk_rows).min(rows)))
}

/// A chunk's logits, `x[start..end] head^T`, contiguous f32: of 16-bit
/// operands under `half` (rounded to bf16 in bf16).
fn chunk_logits(
    x: &CubeTensor,
    head_t: &CubeTensor,
    start: usize,
    end: usize,
    half: Option<HalfFloat>,
) -> CubeTensor {
    let rows = rows_of(x, start, end);
    match half {
        None => into_contiguous(CubeBackend::float_matmul(rows, head_t.clone())),
        Some(half) => {
            let logits = half_product(rows, head_t.clone());
            if half == HalfFloat::Bf16 {
                return cast(cast(logits, half.storage()), DType::F32);
            }
            logits
        }
    }
}

impl CubeOp<2> for HeadCrossEntropy {
    type Saved = HeadSaved;

    fn forward(&self, [x, head]: [CubeTensor; 2]) -> (CubeTensor, HeadSaved) {
        let half = self.head16.as_ref().map(|(_, half)| *half);
        let (x, head) = match &self.head16 {
            Some((head16, half)) => (cast(x, half.storage()), head16.clone()),
            None => (x, head),
        };
        let head_t = transposed(&head);
        let (mut losses, mut lses) = (Vec::new(), Vec::new());
        for (start, end) in chunks(x.meta.shape()[0], self.chunk_rows) {
            let logits = chunk_logits(&x, &head_t, start, end, half);
            let (loss, lse) = forward(&logits, &rows_of(&self.targets, start, end));
            losses.push(loss);
            lses.push(lse);
        }
        let saved = HeadSaved {
            x,
            head,
            targets: self.targets.clone(),
            lse: CubeBackend::float_cat(lses, 0),
            chunk_rows: self.chunk_rows,
            half,
        };
        (CubeBackend::float_cat(losses, 0), saved)
    }

    fn backward(saved: &HeadSaved, d_loss: CubeTensor) -> [CubeTensor; 2] {
        let HeadSaved {
            x,
            head,
            targets,
            lse,
            chunk_rows,
            half,
        } = saved;
        let d_loss = into_contiguous(d_loss);
        let head_t = transposed(head);
        let mut dx = Vec::new();
        let mut d_head = CubeBackend::float_zeros(head.shape(), &head.device, FloatDType::F32);
        for (start, end) in chunks(x.meta.shape()[0], *chunk_rows) {
            let logits = chunk_logits(x, &head_t, start, end, *half);
            let d_logits = backward(
                &logits,
                &rows_of(targets, start, end),
                &rows_of(lse, start, end),
                &rows_of(&d_loss, start, end),
            );
            drop(logits);
            let part = match half {
                None => {
                    dx.push(CubeBackend::float_matmul(d_logits.clone(), head.clone()));
                    CubeBackend::float_matmul(transposed(&d_logits), rows_of(x, start, end))
                }
                Some(half) => {
                    let d_logits = HalfGrad::new(d_logits, *half);
                    dx.push(d_logits.times(head.clone()));
                    d_logits.transposed_times(rows_of(x, start, end))
                }
            };
            d_head = CubeBackend::float_add(d_head, part);
        }
        [CubeBackend::float_cat(dx, 0), d_head]
    }
}
