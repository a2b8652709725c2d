//! The token embedding's lookup as a host op: the table's rows gathered,
//! and in the backward pass each token's output gradient added to its
//! row of a zero table gradient, in token order. The oracle is burn's
//! `select` ([`crate::tensor::select_rows`]), which the GPU keeps.
//!
//! burn's `select` makes the same sums, but its backward pass takes the
//! `[V, C]` gradient from `float_empty`, zeroes it on one thread, and
//! copies it once more to its alignment; the trainer then copied it again
//! to take it as a host vector. At SmolLM2's 49,152 x 576 table that was
//! three passes of 113 MB a step (traced), ~2% of a step of four short
//! examples, and two of the table's size alive at once. Here each thread
//! writes its own rows once: a row's sum (or zero) in its buffer, which
//! the trainer takes as it is.
//!
//! # Shapes
//! `N` tokens, `V` vocabulary, `C` hidden size: the table `[V, C]`, `ids`
//! `[N]`, the output `[N, C]`.

#![allow(unsafe_code)]

use std::mem::MaybeUninit;
use std::sync::Arc;

use rayon::prelude::*;

use super::attention::is_cpu;
use super::fresh::fresh;
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::simd::dispatch;
use crate::tensor::{Tensor, int_tensor, select_rows};

/// Table rows per rayon task of the backward pass.
const ROWS_PER_TASK: usize = 1024;

/// `[N, C]`: row `ids[n]` of `table` for every token. Differentiable in
/// `table`; ids are checked against the vocabulary by the caller (an id
/// past it is an error here, not a panic).
pub fn embedding(table: &Tensor<2>, ids: &[u32]) -> Result<Tensor<2>, UnsupportedTensor> {
    let device = table.device();
    if !is_cpu(&device) {
        return Ok(select_rows(table, int_tensor(ids, &device)));
    }
    let vocab = table.dims()[0];
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(UnsupportedTensor(format!(
            "token id {id} in an embedding table of {vocab} rows"
        )));
    }
    let ids = Arc::new(ids.iter().map(|&id| id as usize).collect());
    apply::<_, 1, 2, 2>(Lookup { ids }, [table.clone()])
}

/// The oracle: burn's `select` of the same rows.
pub fn composed_embedding(table: &Tensor<2>, ids: &[u32]) -> Tensor<2> {
    select_rows(table, int_tensor(ids, &table.device()))
}

#[derive(Debug, Clone)]
struct Lookup {
    /// `[N]`, each below `V`.
    ids: Arc<Vec<usize>>,
}

impl HostOp<1> for Lookup {
    const KEEPS_OUTPUT: bool = false;
    const KEEPS_INPUTS: bool = false;

    fn forward(&self, [table]: [HostTensor<'_>; 1]) -> HostOutput {
        let width = table.shape[1];
        HostOutput {
            values: gather(table.values, &self.ids, width),
            shape: vec![self.ids.len(), width],
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [table]: [HostTensor<'_>; 1],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
        _needed: [bool; 1],
    ) -> [Vec<f32>; 1] {
        let [vocab, width] = [table.shape[0], table.shape[1]];
        [scatter_add(d_out, &self.ids, [vocab, width])]
    }

    const ADDS_INTO_REGISTERED: bool = true;

    /// A table tied to the LM head has the head's gradient registered by
    /// now: the batch's rows are added into it in place, and no second
    /// `[V, C]` buffer is made.
    fn backward_adding(
        &self,
        [table]: [HostTensor<'_>; 1],
        d_out: &[f32],
        [registered]: [Option<Vec<f32>>; 1],
    ) -> [Vec<f32>; 1] {
        let [vocab, width] = [table.shape[0], table.shape[1]];
        [match registered {
            Some(mut gradient) => {
                #[cfg(test)]
                tests::ADDED_INTO.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                scatter_add_into(&mut gradient, d_out, &self.ids, [vocab, width]);
                gradient
            }
            None => scatter_add(d_out, &self.ids, [vocab, width]),
        }]
    }
}

// ---- the host kernel ----

/// `[N, C]`: row `ids[n]` of `table` (`[V, C]`) for every `n`.
///
/// # Panics
/// When an id is past the table (the op checks them first).
fn gather(table: &[f32], ids: &[usize], width: usize) -> Vec<f32> {
    let rows_per_task = (1 << 14) / width.max(1) + 1;
    let body = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(rows_per_task * width.max(1))
            .zip(ids.par_chunks(rows_per_task))
            .for_each(|(out, ids)| {
                for (row, &id) in out.chunks_mut(width).zip(ids) {
                    for (o, &v) in row.iter_mut().zip(&table[id * width..(id + 1) * width]) {
                        o.write(v);
                    }
                }
            });
    };
    // SAFETY: the chunks of `width` values pair with `ids` one to one
    // (`ids.len() * width` values in all), and each is written in full
    // from a row of `width` values (a short table panics in the slice).
    unsafe { fresh(ids.len() * width, body) }
}

/// `[V, C]`: row `v` is `0 + d_out[n0] + d_out[n1] + ...` over the tokens
/// `n0 < n1 < ...` with id `v` (summed in token order, as burn's `select`
/// sums them), zero for an id no token has.
///
/// # Panics
/// When an id is past the vocabulary or `d_out` is not `[N, C]`.
fn scatter_add(d_out: &[f32], ids: &[usize], [vocab, width]: [usize; 2]) -> Vec<f32> {
    assert_eq!(d_out.len(), ids.len() * width, "embedding: d_out's shape");
    let body = |out: &mut [MaybeUninit<f32>]| {
        // The rows no token has (most of a vocabulary) are written as zeros
        // in one pass: with a zeroed sum copied into each, at baseline
        // SIMD, the table's gradient took 2.3% of a `medium` `--bf16` step
        // (32k ids, short chat).
        for_each_row_sum(
            out,
            d_out,
            ids,
            [vocab, width],
            #[inline(always)]
            |row, sum| match sum {
                Some(sum) => {
                    for (o, &s) in row.iter_mut().zip(sum) {
                        o.write(s);
                    }
                }
                None => {
                    for o in row.iter_mut() {
                        o.write(0.0);
                    }
                }
            },
        );
    };
    // SAFETY: every chunk of `width` values (one table row, `vocab * width`
    // values in all) is written in full, from `sum` (`width` long) or as
    // zeros.
    unsafe { fresh(vocab * width, body) }
}

/// `f(row, sum)` for every row of the `[V, C]` table `out`: `sum` is
/// `0 + d_out[n0] + d_out[n1] + ...` over the tokens with the row's id, in
/// token order, `None` for an id no token has. Tasks of [`ROWS_PER_TASK`]
/// rows on rayon's threads, each compiled for the CPU's SIMD; every
/// value's sum runs in token order whatever the threads or the SIMD, so
/// the bits are the same.
fn for_each_row_sum<T: Send>(
    out: &mut [T],
    d_out: &[f32],
    ids: &[usize],
    [vocab, width]: [usize; 2],
    f: impl Fn(&mut [T], Option<&[f32]>) + Sync,
) {
    let (order, starts) = tokens_by_id(ids, vocab);
    out.par_chunks_mut(ROWS_PER_TASK * width.max(1))
        .enumerate()
        .for_each(|(task, rows)| {
            dispatch(
                #[inline(always)]
                || {
                    let mut sum = vec![0.0f32; width];
                    for (at, row) in rows.chunks_mut(width).enumerate() {
                        let v = task * ROWS_PER_TASK + at;
                        let tokens = &order[starts[v]..starts[v + 1]];
                        if tokens.is_empty() {
                            f(row, None);
                            continue;
                        }
                        sum.fill(0.0);
                        for &n in tokens {
                            for (s, &g) in sum.iter_mut().zip(&d_out[n * width..(n + 1) * width]) {
                                *s += g;
                            }
                        }
                        f(row, Some(&sum));
                    }
                },
            )
        });
}

/// The tokens of each id together, in token order within an id:
/// `(order, starts)`, the tokens of id `v` being
/// `order[starts[v]..starts[v + 1]]`.
fn tokens_by_id(ids: &[usize], vocab: usize) -> (Vec<usize>, Vec<usize>) {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&n| ids[n]);
    let starts = (0..=vocab)
        .map(|v| order.partition_point(|&n| ids[n] < v))
        .collect();
    (order, starts)
}

/// `gradient[v] = (0 + d_out[n0] + d_out[n1] + ...) + gradient[v]` for
/// every id `v` a token has, the sum [`scatter_add`] makes added as burn
/// adds a second gradient to a registered one (so the same bits); rows no
/// token has are left as they are (burn's `0 + g` would turn a `-0.0`
/// into `0.0`, the one difference, which no update can see).
///
/// # Panics
/// When an id is past the vocabulary, or `d_out` is not `[N, C]` or
/// `gradient` not `[V, C]`.
fn scatter_add_into(
    gradient: &mut [f32],
    d_out: &[f32],
    ids: &[usize],
    [vocab, width]: [usize; 2],
) {
    assert_eq!(d_out.len(), ids.len() * width, "embedding: d_out's shape");
    assert_eq!(
        gradient.len(),
        vocab * width,
        "embedding: the registered gradient's shape"
    );
    for_each_row_sum(
        gradient,
        d_out,
        ids,
        [vocab, width],
        #[inline(always)]
        |row, sum| {
            if let Some(sum) = sum {
                // `g + s` is `s + g` to the bit (IEEE addition commutes).
                for (r, &s) in row.iter_mut().zip(sum) {
                    *r += s;
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{IntoHostVec, backward, cpu_device, float_tensor, grad, trainable};

    /// Backward passes that added into a registered gradient.
    pub(super) static ADDED_INTO: std::sync::atomic::AtomicUsize =
        std::sync::atomic::AtomicUsize::new(0);

    /// How the tied test's rows are looked up.
    #[derive(Clone, Copy)]
    enum Rows {
        Fused,
        Composed,
        /// Off the graph: the head's part of the gradient alone.
        Detached,
    }

    /// The gradient of a table tied to a head (`h table^T` after the
    /// lookup, as a tied LM head reads it).
    fn tied_gradient(
        values: &[f32],
        ids: &[u32],
        [vocab, width]: [usize; 2],
        how: Rows,
    ) -> Vec<f32> {
        let device = cpu_device(true);
        let table = trainable(float_tensor(values.to_vec(), [vocab, width], &device));
        let rows = match how {
            Rows::Fused => embedding(&table, ids).expect("ids within the table"),
            Rows::Composed => composed_embedding(&table, ids),
            Rows::Detached => composed_embedding(&table, ids).detach(),
        };
        let logits = rows.mul_scalar(0.5).matmul(table.clone().transpose());
        let grads = backward(&logits.clone().mul(logits).sum());
        grad(&table, &grads).expect("the table trains").into_vec()
    }

    /// A tied table: the head's gradient is registered first, the lookup
    /// adds its rows into it in place, and the sum is burn's `select` and
    /// matmul's bit for bit (the registered one here a transposed view,
    /// which is copied out first).
    #[test]
    fn a_tied_tables_rows_are_added_into_the_heads_gradient() {
        let shape = [ROWS_PER_TASK + 29, 6];
        let width = shape[1];
        let values: Vec<f32> = (0..shape[0] * width)
            .map(|i| ((i * 6151 % 1000) as f32 - 500.0) / 83.0)
            .collect();
        let ids: Vec<u32> = vec![5, 0, 5, ROWS_PER_TASK as u32 + 28, 9, 5];
        let before = ADDED_INTO.load(std::sync::atomic::Ordering::Relaxed);
        let ours = tied_gradient(&values, &ids, shape, Rows::Fused);
        assert!(
            ADDED_INTO.load(std::sync::atomic::Ordering::Relaxed) > before,
            "the lookup added into the head's gradient"
        );
        let theirs = tied_gradient(&values, &ids, shape, Rows::Composed);
        assert_eq!(ours.len(), theirs.len());
        let differing = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
        assert_eq!(
            differing, 0,
            "values of the tied table's gradient that differ"
        );
        // It bites: an untouched row holds the head's part alone, a looked-up
        // one both (the lookup's part is not zero).
        let only_head = tied_gradient(&values, &ids, shape, Rows::Detached);
        assert_eq!(ours[width..2 * width], only_head[width..2 * width]);
        assert_ne!(ours[5 * width..6 * width], only_head[5 * width..6 * width]);
    }

    /// The table and its gradient through the op and through burn's
    /// `select`, on ids with repeats (the same rows summed, in token
    /// order, as `select` sums them) and ids no token has: the same bits.
    #[test]
    fn lookup_and_gradient_are_selects_bit_for_bit() {
        let device = cpu_device(true);
        let (vocab, width) = (2 * ROWS_PER_TASK + 37, 5);
        let values: Vec<f32> = (0..vocab * width)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 97.0)
            .collect();
        let ids: Vec<u32> = vec![3, 0, 3, 2 * ROWS_PER_TASK as u32 + 36, 3, 1025, 0, 7];
        let d_out: Vec<f32> = (0..ids.len() * width)
            .map(|i| ((i * 104_729 % 2000) as f32 - 1000.0) / 131.0)
            .collect();
        let run = |fused: bool| {
            let table = trainable(float_tensor(values.clone(), [vocab, width], &device));
            let out = if fused {
                embedding(&table, &ids).expect("ids within the table")
            } else {
                composed_embedding(&table, &ids)
            };
            let upstream = float_tensor(d_out.clone(), [ids.len(), width], &device);
            let loss = (out.clone() * upstream).sum();
            let grads = backward(&loss);
            let table_grad = grad(&table, &grads).expect("the table trains");
            (out.into_vec(), table_grad.into_vec())
        };
        let (ours, theirs) = (run(true), run(false));
        assert_eq!(ours.0, theirs.0, "the gathered rows");
        assert_eq!(ours.1, theirs.1, "the table's gradient");
        // It bites: the repeated id's row is the sum of its three tokens.
        let row3 = &ours.1[3 * width..4 * width];
        let expected: Vec<f32> = (0..width)
            .map(|j| 0.0 + d_out[j] + d_out[2 * width + j] + d_out[4 * width + j])
            .collect();
        assert_eq!(row3, expected.as_slice());
        assert!(ours.1[width..2 * width].iter().all(|&g| g == 0.0));
    }

    /// An id past the table is an error, not a panic.
    #[test]
    fn an_id_past_the_table_is_refused() {
        let device = cpu_device(true);
        let table = trainable(float_tensor(vec![0.0; 8], [4, 2], &device));
        let err = embedding(&table, &[1, 4]).expect_err("id 4 of 4 rows");
        assert!(err.0.contains("token id 4"), "{}", err.0);
    }
}
