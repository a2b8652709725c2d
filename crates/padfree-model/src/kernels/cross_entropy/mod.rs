//! Fused cross-entropy over the vocabulary on host slices: the loss of every
//! labelled row in one pass, and in the backward pass the gradient of the
//! logits, `softmax - one_hot`, in one more.
//!
//! Composed from tensor ops the same loss is some ten passes over the
//! `[K, V]` logits (max, subtract, exp, sum, log, gather, and their
//! backward: expand, scatter, multiply, add), each allocating a `[K, V]`
//! buffer; with `V` in the thousands they dominate the head's cost. Rows are
//! independent and split over rayon's threads.
//!
//! This file holds the differentiable burn op ([`cross_entropy_sum`]), the
//! host kernel, and the composed oracle ([`composed_cross_entropy_sum`]);
//! `head.rs` the LM head and the loss in one host op that never holds the
//! `[K, V]` logits ([`host_head_cross_entropy_sum`]: the CPU's training
//! path); `cube.rs` the CubeCL bodies for GPUs.
//!
//! # Shapes
//! `K` labelled rows, `V` vocabulary. `logits`, `d_logits`: `[K, V]`;
//! `targets`, `lse`: `[K]`.

use std::sync::Arc;

use crate::tensor::{Int, Tensor, gather_columns, int_tensor_nd};

use super::attention::is_cpu;
use super::gemm_bf16::Weight16;

use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::simd;
use rayon::prelude::*;

#[cfg(feature = "cube")]
mod cube;
mod head;

// ---- the differentiable burn op ----

/// `[1]`: the summed `-log softmax(logits)[target]` over the rows of
/// `logits` (`[K, V]`), `targets[k] < V`.
pub fn cross_entropy_sum(
    logits: Tensor<2>,
    targets: &[usize],
) -> Result<Tensor<1>, UnsupportedTensor> {
    let device = logits.device();
    if !is_cpu(&device) {
        return gpu_cross_entropy_sum(logits, targets, &device);
    }
    let op = CrossEntropy {
        targets: Arc::new(targets.to_vec()),
    };
    apply(op, [logits])
}

/// Rows of logits one chunk of the GPU's head cross-entropy makes for a
/// vocabulary of `vocab`: 2^25 floats (128 MiB of f32) a chunk, enough rows
/// that each chunk's matmul fills a GPU (682 at SmolLM2's 49,152).
pub fn head_chunk_rows(vocab: usize) -> usize {
    ((1usize << 25) / vocab.max(1)).max(1)
}

/// Summed cross-entropy of the rows of `x head^T` (`x`: `[K, C]`, `head`:
/// `[V, C]`, `targets[k] < V`) -> `[1]`. On a GPU, the LM head and the loss
/// in one op (`cube.rs`) that makes the logits `chunk_rows` rows at a time,
/// keeps none of them (only each row's log-sum-exp) and makes them again
/// chunk by chunk in the backward pass: no `[K, V]` tensor ever exists, for
/// one more head product. Elsewhere (the CPU, a build without GPU kernels)
/// [`cross_entropy_sum`] of the product.
///
/// `head16` (`--bf16` on a GPU): the head's 16-bit copy on the device (bf16
/// or f16); the chunks' products then take 16-bit operands, `x` cast once
/// (`cube.rs`), the loss and its softmax in f32. Refused off a GPU.
pub fn head_cross_entropy_sum(
    x: Tensor<2>,
    head: Tensor<2>,
    head16: Option<&Tensor<2>>,
    targets: &[usize],
    chunk_rows: usize,
) -> Result<Tensor<1>, UnsupportedTensor> {
    let device = x.device();
    #[cfg(feature = "cube")]
    if !is_cpu(&device) && !targets.is_empty() {
        return cube::head_cross_entropy_sum(x, head, head16, targets, chunk_rows, &device);
    }
    if head16.is_some() {
        return Err(UnsupportedTensor(
            "the 16-bit head tensor with cross-entropy runs on a GPU (the CPU's bf16 head copy \
             goes to host_head_cross_entropy_sum)"
                .into(),
        ));
    }
    if is_cpu(&device) {
        return host_head_cross_entropy_sum(x, head, None, targets, chunk_rows, targets.len());
    }
    cross_entropy_sum(x.matmul(head.transpose()), targets)
}

/// Summed cross-entropy of the rows of `x head^T` (`x`: `[K, C]`, `head`:
/// `[V, C]`, `targets[k] < V`) -> `[1]` on the CPU, in one op (`head.rs`):
/// the logits made `chunk_rows` rows at a time and their gradients with
/// them, so that the graph keeps `dx` and `dW` rather than `[K, V]`
/// logits. `head16` (`--bf16`): the head's bf16 copy (`[V, C]`), or the
/// head rounded as it is read; the products then take bf16 operands as
/// `bf16_linear`'s do. Gradients are
/// made for the inputs that track one (none for a frozen head).
///
/// `kernel_rows`: the labelled row count the kernel is chosen by (the
/// batch's: an example computed alone runs its batch's kernel).
///
/// # Panics
/// When `head16` does not hold `V * C` values (a bug in the caller).
pub fn host_head_cross_entropy_sum(
    x: Tensor<2>,
    head: Tensor<2>,
    head16: Option<Weight16>,
    targets: &[usize],
    chunk_rows: usize,
    kernel_rows: usize,
) -> Result<Tensor<1>, UnsupportedTensor> {
    let [vocab, hidden] = head.dims();
    if let Some(w16) = &head16 {
        assert!(
            w16.holds(vocab * hidden),
            "head cross-entropy: the head's bf16 copy has another shape"
        );
    }
    if !is_cpu(&x.device()) {
        return Err(UnsupportedTensor(
            "the host head cross-entropy runs on the CPU".into(),
        ));
    }
    if x.dims()[0] != targets.len() || targets.iter().any(|&t| t >= vocab) {
        return Err(UnsupportedTensor(format!(
            "head cross-entropy: {} rows for {} targets below {vocab}",
            x.dims()[0],
            targets.len()
        )));
    }
    let op = head::HeadCrossEntropy {
        targets: Arc::new(targets.to_vec()),
        head16,
        chunk_rows,
        kernel_rows,
        // Set from the graph by `apply` (`HostOp::tracking`).
        grads: [false; 2],
    };
    apply(op, [x, head])
}

/// The CubeCL body (`cube.rs`), or with no row, or in a build without GPU
/// kernels, [`composed_cross_entropy_sum`].
fn gpu_cross_entropy_sum(
    logits: Tensor<2>,
    targets: &[usize],
    device: &crate::tensor::Device,
) -> Result<Tensor<1>, UnsupportedTensor> {
    #[cfg(feature = "cube")]
    if !targets.is_empty() {
        return cube::cross_entropy_sum(logits, targets, device);
    }
    let targets: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
    let len = targets.len();
    Ok(composed_cross_entropy_sum(
        logits,
        int_tensor_nd(targets, [len], device),
    ))
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
        let (loss, lse) = forward(logits.values, &self.targets, vocab(&logits));
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
        _needed: [bool; 1],
    ) -> [Vec<f32>; 1] {
        let d_loss = d_out.first().copied().unwrap_or(0.0);
        [backward(
            logits.values,
            &self.targets,
            lse,
            vocab(&logits),
            d_loss,
        )]
    }
}

// ---- the host kernel ----

/// Rows per rayon task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// Summed `-log softmax(logits)[target]` over the rows, accumulated in f64,
/// and each row's log-sum-exp (kept for the backward pass).
pub fn forward(logits: &[f32], targets: &[usize], vocab: usize) -> (f64, Vec<f32>) {
    let mut lse = vec![0.0f32; targets.len()];
    let loss = lse
        .par_chunks_mut(ROWS_PER_TASK)
        .zip(logits.par_chunks(ROWS_PER_TASK * vocab))
        .zip(targets.par_chunks(ROWS_PER_TASK))
        .map(|((lse, logits), targets)| {
            let mut loss = 0.0f64;
            for ((lse, row), &target) in lse.iter_mut().zip(logits.chunks_exact(vocab)).zip(targets)
            {
                *lse = log_sum_exp(row);
                loss += f64::from(*lse - row[target]);
            }
            loss
        })
        .sum();
    (loss, lse)
}

/// `d_logits = d_loss * (softmax(logits) - one_hot(target))`.
pub fn backward(
    logits: &[f32],
    targets: &[usize],
    lse: &[f32],
    vocab: usize,
    d_loss: f32,
) -> Vec<f32> {
    let mut d_logits = vec![0.0f32; logits.len()];
    d_logits
        .par_chunks_mut(ROWS_PER_TASK * vocab)
        .zip(logits.par_chunks(ROWS_PER_TASK * vocab))
        .zip(
            targets
                .par_chunks(ROWS_PER_TASK)
                .zip(lse.par_chunks(ROWS_PER_TASK)),
        )
        .for_each(|((d_rows, rows), (targets, lse))| {
            let rows = d_rows.chunks_exact_mut(vocab).zip(rows.chunks_exact(vocab));
            for ((d_row, row), (&target, &lse)) in rows.zip(targets.iter().zip(lse)) {
                simd::dispatch(
                    #[inline(always)]
                    || {
                        for (d, &x) in d_row.iter_mut().zip(row) {
                            *d = d_loss * simd::exp(x - lse);
                        }
                    },
                );
                d_row[target] -= d_loss;
            }
        });
    d_logits
}

/// `max + ln(sum(exp(x - max)))`, the maximum subtracted for stability.
fn log_sum_exp(row: &[f32]) -> f32 {
    simd::dispatch(
        #[inline(always)]
        || {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            max + simd::sum_exp(row, max).ln()
        },
    )
}

// ---- the composed oracle (burn ops) ----

/// `[1]`: the same sum from burn ops: slow and obvious, the oracle of the
/// fused kernel. `logits`: `[K, V]`, `targets`: `[K]`.
pub fn composed_cross_entropy_sum(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let rows = logits.dims()[0];
    // log p = x - logsumexp(x), with the row maximum subtracted for stability.
    let max = logits.clone().max_dim(1).detach();
    let shifted = logits - max;
    let log_norm = shifted.clone().exp().sum_dim(1).log().reshape([rows]);
    let picked = gather_columns(shifted, targets);
    (log_norm - picked).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VOCAB: usize = 7;

    fn logits(rows: usize) -> Vec<f32> {
        (0..rows * VOCAB)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7)
            .collect()
    }

    /// The textbook definition in f64, one row at a time.
    fn oracle(logits: &[f32], targets: &[usize]) -> f64 {
        logits
            .chunks(VOCAB)
            .zip(targets)
            .map(|(row, &t)| {
                let norm: f64 = row.iter().map(|&x| f64::from(x).exp()).sum();
                -(f64::from(row[t]).exp() / norm).ln()
            })
            .sum()
    }

    #[test]
    fn loss_matches_the_textbook_definition() {
        // More rows than one task, so the split over tasks is exercised.
        let targets: Vec<usize> = (0..40).map(|i| i % VOCAB).collect();
        let logits = logits(40);
        let (loss, _) = forward(&logits, &targets, VOCAB);
        let expected = oracle(&logits, &targets);
        assert!(
            (loss - expected).abs() < 1e-4 * expected,
            "{loss} vs {expected}"
        );
    }

    #[test]
    fn gradient_matches_central_differences() {
        let targets: Vec<usize> = vec![3, 0, 6, 2, 2];
        let logits = logits(5);
        let (_, lse) = forward(&logits, &targets, VOCAB);
        let d_loss = 0.5;
        let grad = backward(&logits, &targets, &lse, VOCAB, d_loss);
        let step = 1e-3;
        for index in 0..logits.len() {
            let mut plus = logits.clone();
            let mut minus = logits.clone();
            plus[index] += step;
            minus[index] -= step;
            // The step as f32 rounded it, so the quotient is exact to O(step^2).
            let width = f64::from(plus[index]) - f64::from(minus[index]);
            let numeric =
                f64::from(d_loss) * (oracle(&plus, &targets) - oracle(&minus, &targets)) / width;
            let got = f64::from(grad[index]);
            assert!(
                (got - numeric).abs() < 1e-4,
                "logit {index}: {got} vs {numeric}"
            );
        }
    }
}
