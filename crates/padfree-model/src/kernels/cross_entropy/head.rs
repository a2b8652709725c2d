//! The LM head and its cross-entropy in one host op: the logits made a
//! chunk of rows at a time, and each chunk's gradients (`dx = dz W`,
//! `dW += dz^T x` with `dz = softmax - one_hot`) made at once in the
//! forward pass, so that no `[K, V]` tensor outlives its chunk.
//!
//! Through [`super::cross_entropy_sum`] of a [`super::super::linear`]
//! product (the oracle here) the graph keeps the `[K, V]` logits for the
//! backward pass and makes `[K, V]` of their gradient there, both at the
//! step's memory peak, when every decoder activation is still held: at
//! SmolLM2's 49,152 tokens of vocabulary and ~1,570 labelled rows (batch
//! 16 on the shipped maths data) that is 2 x 309 MB. This op keeps `dx` (`[K, C]`) and, when the head trains, `dW`
//! (`[V, C]`, 113 MB at SmolLM2) instead, and one chunk of logits
//! (`HEAD_CHUNK_BYTES`) while it runs. The loss is the last op of the
//! graph, so its upstream gradient is one scalar: the backward pass only
//! scales what the forward pass made. The products are those of the
//! unfused path (same FLOPs; `dW` added chunk by chunk), in f32 or, under
//! `--bf16`, with bf16 operands as [`super::super::bf16_linear`] makes
//! them (the logits rounded to bf16, `dz` rounded as the products read
//! it: before the upstream scale, where the unfused path rounds after it;
//! the two agree exactly when that scale is a power of two). The GPU's
//! counterpart (`cube.rs`) keeps no gradient and makes the logits again in
//! its backward pass: a GPU has memory bandwidth to spare and
//! less memory; here one more head product would add ~4% to a SmolLM2
//! step's FLOPs (`2 K V C` on `6 x` the parameters per token, with about
//! half the tokens labelled).
//!
//! # Shapes
//! `K` labelled rows, `C` hidden size, `V` vocabulary: `x` `[K, C]`, the
//! head `[V, C]`, `targets` `[K]`.

use std::sync::Arc;

use rayon::prelude::*;

use super::super::bf16::{round_in_place, rounded, rounded_copy};
use super::super::gemm::{self, View, Write};
use super::super::gemm_bf16::{self, View16, Weight16, skinny};
use super::super::host_op::{HostOp, HostOutput, HostTensor};
use super::super::simd;
use super::{ROWS_PER_TASK, log_sum_exp};

/// The loss and the gradients the forward pass made.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HeadLoss {
    /// Summed `-log softmax(x W^T)[target]` over the rows.
    pub loss: f64,
    /// `dW` (`[V, C]`) then `dx` (`[K, C]`), each of the loss itself
    /// (upstream gradient 1) and empty unless asked: one buffer, which the
    /// backward pass hands on as `dW`'s (no copy of the head's size).
    pub grads: Vec<f32>,
    /// How many of `grads` are `dW`'s.
    pub dw_len: usize,
}

#[cfg(test)]
impl HeadLoss {
    /// `[V, C]`, or empty.
    pub fn dw(&self) -> &[f32] {
        &self.grads[..self.dw_len]
    }

    /// `[K, C]`, or empty.
    pub fn dx(&self) -> &[f32] {
        &self.grads[self.dw_len..]
    }
}

/// The head's operands: f32, or `--bf16`'s head (its bf16 copy, or the
/// f32 head rounded as it is read).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Head<'a> {
    F32(&'a [f32]),
    /// `[V, C]`; `x` and `dz` are rounded as they are read too.
    Bf16(View16<'a>),
}

/// The summed loss of `x W^T` against `targets`, and (as `grads` asks:
/// `[dx, dW]`) its gradients, `chunk_rows` rows at a time; under `--bf16`
/// by the few-rows products (`gemm_bf16::skinny`, no head-sized pack) when
/// `kernel_rows` (the batch's labelled rows) are few and fit one chunk.
///
/// # Panics
/// When a slice is shorter than its shape, or a target is `>= vocab`
/// (callers check labels against the vocabulary first).
pub(crate) fn head_loss(
    x: &[f32],
    head: Head<'_>,
    targets: &[usize],
    [hidden, vocab]: [usize; 2],
    (chunk_rows, kernel_rows): (usize, usize),
    grads: [bool; 2],
) -> HeadLoss {
    let rows = targets.len();
    let chunk_rows = chunk_rows.clamp(1, rows.max(1));
    let dw_len = if grads[1] { vocab * hidden } else { 0 };
    let dx_len = if grads[0] { rows * hidden } else { 0 };
    if rows == 0 {
        // No labelled row: zero loss and gradients, and nothing to pack.
        return HeadLoss {
            loss: 0.0,
            grads: vec![0.0; dw_len + dx_len],
            dw_len,
        };
    }
    // By the batch's labelled rows, not this call's: an example checked
    // alone must run its batch's kernel, or bf16's rounding of every
    // layer's `dy` turns the kernels' different sum orders into gradients
    // 1.6e-2 apart (`padfree check --bf16`). (On a packed body, AMX or
    // `vdpbf16ps`, the few rows' products are the packed ones with their
    // operands swapped, the same bits.)
    if let Head::Bf16(w) = head
        && rows <= chunk_rows
        && skinny::fits(kernel_rows.max(1), w)
    {
        return head_loss_skinny(x, w, targets, [hidden, vocab], [dw_len, dx_len], grads);
    }
    // Only here, past the streamed products, which make their own: made
    // before them, these were a second head-sized `dW` (108 MiB on
    // SmolLM2-135M) alive beside theirs, and zeroed for nothing.
    let mut logits = vec![0.0f32; chunk_rows * vocab];
    let mut losses = vec![0.0f64; chunk_rows];
    let mut out = vec![0.0f32; dw_len + dx_len];
    let mut loss = 0.0f64;
    let (dw, dx) = out.split_at_mut(dw_len);
    let rounds = matches!(head, Head::Bf16(_));
    // Under --bf16 the head's weight is packed once for all the chunks, as
    // `B` of `x W^T` and, when `dx` is asked, of `dz W` (two packs of the
    // head's size, held while the chunks run; packed for every product the
    // packing was 34.6 ms of a 56 MiB head each time). With one chunk
    // (short batches) each pack is made when its product comes and the
    // first dropped before the second is made: held together they were
    // the forward pass's most (54 MiB more on SmolLM2-135M).
    let one_chunk = rows <= chunk_rows;
    let mut weight = match head {
        Head::F32(w) => Weight::F32(w),
        Head::Bf16(w) => Weight::Bf16 {
            wt: Some(gemm_bf16::prepare(w.t())),
            w: None,
            head: w,
        },
    };
    for (at, start) in (0..rows).step_by(chunk_rows).enumerate() {
        let n = chunk_rows.min(rows - start);
        let xc = &x[start * hidden..(start + n) * hidden];
        let z = &mut logits[..n * vocab];
        match &weight {
            Weight::F32(w) => gemm::product_into(
                z,
                vocab,
                View::row_major(xc, n, hidden),
                View::row_major(w, vocab, hidden).t(),
                Write::Set,
            ),
            Weight::Bf16 { wt, .. } => gemm_bf16::product_into_prepared(
                z,
                vocab,
                View16::f32(xc, n, hidden),
                wt.as_ref()
                    .expect("the pack of W^T outlives every chunk but the only one"),
                Write::Set,
            ),
        }
        if let (true, Weight::Bf16 { wt, .. }) = (one_chunk, &mut weight) {
            *wt = None;
        }
        let softmax = grads[0] || grads[1];
        let targets = &targets[start..start + n];
        z.par_chunks_mut(ROWS_PER_TASK * vocab)
            .zip(losses[..n].par_chunks_mut(ROWS_PER_TASK))
            .zip(targets.par_chunks(ROWS_PER_TASK))
            .for_each(|((z, losses), targets)| {
                let rows = z.chunks_exact_mut(vocab).zip(losses.iter_mut());
                for ((row, loss), &target) in rows.zip(targets) {
                    *loss = softmax_row(row, target, rounds, softmax);
                }
            });
        // In row order, so the sum does not depend on the threads.
        loss += losses[..n].iter().sum::<f64>();
        let z = &logits[..n * vocab];
        if grads[0] {
            let dst = &mut dx[start * hidden..(start + n) * hidden];
            match &mut weight {
                Weight::F32(w) => gemm::product_into(
                    dst,
                    hidden,
                    View::row_major(z, n, vocab),
                    View::row_major(w, vocab, hidden),
                    Write::Set,
                ),
                Weight::Bf16 { w, head, .. } => gemm_bf16::product_into_prepared(
                    dst,
                    hidden,
                    View16::f32(z, n, vocab),
                    w.get_or_insert_with(|| gemm_bf16::prepare(*head)),
                    Write::Set,
                ),
            }
        }
        if grads[1] {
            let write = if at == 0 { Write::Set } else { Write::Add(1.0) };
            match head {
                Head::F32(_) => gemm::product_into(
                    dw,
                    hidden,
                    View::row_major(z, n, vocab).t(),
                    View::row_major(xc, n, hidden),
                    write,
                ),
                Head::Bf16(_) => gemm_bf16::product_into(
                    dw,
                    hidden,
                    View16::f32(z, n, vocab).t(),
                    View16::f32(xc, n, hidden),
                    write,
                ),
            }
        }
    }
    HeadLoss {
        loss,
        grads: out,
        dw_len,
    }
}

/// [`head_loss`] under `--bf16` for a few labelled rows, in one chunk:
/// the products make no head-sized pack (`gemm_bf16::skinny`: on a
/// packed body, AMX or `vdpbf16ps`, its products with the weight as `A`,
/// elsewhere the weight streamed through FMAs), and `dW` is written once
/// into a buffer that is never zeroed, `dx` appended behind it.
fn head_loss_skinny(
    x: &[f32],
    w: View16<'_>,
    targets: &[usize],
    [hidden, vocab]: [usize; 2],
    [dw_len, dx_len]: [usize; 2],
    grads: [bool; 2],
) -> HeadLoss {
    let x = rounded_copy(x);
    let tiles = skinny::Tiles::of_this_process();
    let mut z = skinny::x_wt(&x, w, tiles);
    let softmax = grads[0] || grads[1];
    let mut losses = vec![0.0f64; targets.len()];
    z.par_chunks_mut(vocab)
        .zip(losses.par_iter_mut())
        .zip(targets.par_iter())
        .for_each(|((row, loss), &target)| {
            *loss = softmax_row(row, target, true, softmax);
        });
    // In row order, so the sum does not depend on the threads.
    let loss = losses.iter().sum::<f64>();
    if softmax {
        // `dz` as both products read it.
        round_in_place(&mut z);
    }
    let mut out = if grads[1] {
        skinny::dzt_x(&z, &x, [vocab, hidden], dw_len + dx_len, tiles)
    } else {
        Vec::with_capacity(dx_len)
    };
    if grads[0] {
        out.extend_from_slice(&skinny::dz_w(&z, w, tiles));
    }
    HeadLoss {
        loss,
        grads: out,
        dw_len,
    }
}

/// The head's weight as [`head_loss`]'s chunks read it: f32, or under
/// `--bf16` prepared once as `W^T` (for the logits) and, when `dx` is
/// asked, as `W` (for `dz W`).
// One value a call, on the stack: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Weight<'a> {
    F32(&'a [f32]),
    /// `wt` for `x W^T`, dropped after it when there is one chunk; `w` for
    /// `dz W`, made when first needed.
    Bf16 {
        wt: Option<gemm_bf16::PreparedB<'a>>,
        w: Option<gemm_bf16::PreparedB<'a>>,
        head: View16<'a>,
    },
}

/// One row of logits: rounded to bf16 when `rounds` (as the bf16 linear
/// op rounds its output), then, when `softmax`, overwritten by
/// `softmax - one_hot(target)`; returns the row's `lse - z[target]`.
fn softmax_row(row: &mut [f32], target: usize, rounds: bool, softmax: bool) -> f64 {
    simd::dispatch(
        #[inline(always)]
        || {
            if rounds {
                for z in row.iter_mut() {
                    *z = rounded(*z);
                }
            }
        },
    );
    let lse = log_sum_exp(row);
    let loss = f64::from(lse - row[target]);
    if softmax {
        simd::dispatch(
            #[inline(always)]
            || {
                for z in row.iter_mut() {
                    *z = simd::exp(*z - lse);
                }
            },
        );
        row[target] -= 1.0;
    }
    loss
}

/// The op in burn's graph: inputs `[x, head]`, output the `[1]` loss; it
/// keeps only what its forward pass made (`dx` then `dW`).
#[derive(Debug, Clone)]
pub(super) struct HeadCrossEntropy {
    pub targets: Arc<Vec<usize>>,
    /// `--bf16`: where the products read the head (its bf16 copy, made
    /// once per optimizer step, or the f32 head rounded).
    pub head16: Option<Weight16>,
    pub chunk_rows: usize,
    /// The labelled rows the kernel is chosen by ([`head_loss`]).
    pub kernel_rows: usize,
    /// Which gradients to make, `[x, head]`: those the graph tracks, as
    /// `host_op` tells the op before its forward pass.
    pub grads: [bool; 2],
}

impl HostOp<2> for HeadCrossEntropy {
    const KEEPS_OUTPUT: bool = false;
    const KEEPS_INPUTS: bool = false;

    fn tracking(self, grads: [bool; 2]) -> Self {
        Self { grads, ..self }
    }

    fn forward(&self, [x, w]: [HostTensor<'_>; 2]) -> HostOutput {
        let (hidden, vocab) = (x.shape[1], w.shape[0]);
        let head = match &self.head16 {
            Some(w16) => Head::Bf16(w16.view(w.values, vocab, hidden)),
            None => Head::F32(w.values),
        };
        let HeadLoss { loss, grads, .. } = head_loss(
            x.values,
            head,
            &self.targets,
            [hidden, vocab],
            (self.chunk_rows, self.kernel_rows),
            self.grads,
        );
        HostOutput {
            values: vec![loss as f32],
            shape: vec![1],
            saved: grads,
        }
    }

    fn backward(
        &self,
        inputs: [HostTensor<'_>; 2],
        output: &[f32],
        saved: &[f32],
        d_out: &[f32],
        needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        self.backward_owned(inputs, output, saved.to_vec(), d_out, needed)
    }

    /// The saved gradients scaled by the upstream one, `dW` in place in
    /// the buffer the forward pass made (`dx`, small, copied out of it).
    fn backward_owned(
        &self,
        [x, w]: [HostTensor<'_>; 2],
        _output: &[f32],
        mut saved: Vec<f32>,
        d_out: &[f32],
        needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        let d_loss = d_out.first().copied().unwrap_or(0.0);
        let lens = [x.shape, w.shape].map(|shape| shape.iter().product::<usize>());
        let made = [0, 1].map(|i| if self.grads[i] { lens[i] } else { 0 });
        // The graph asks for the gradients of the inputs it tracks, the
        // ones `tracking` named: a gradient asked for and not made is a
        // bug, never a zero.
        assert!(
            saved.len() == made[0] + made[1] && (0..2).all(|i| !needed[i] || self.grads[i]),
            "head cross-entropy: a gradient the forward pass did not make is needed"
        );
        let scale = |values: &mut [f32]| values.par_iter_mut().for_each(|g| *g *= d_loss);
        let mut dx = if needed[0] {
            saved[made[1]..].to_vec()
        } else {
            Vec::new()
        };
        scale(&mut dx);
        saved.truncate(if needed[1] { made[1] } else { 0 });
        scale(&mut saved);
        [dx, saved]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round_slice;
    use crate::kernels::test_util::{assert_within, random};
    use crate::kernels::{bf16_linear, cross_entropy_sum, fused_linear};
    use crate::tensor::{
        IntoHostVec, Tensor, backward, cpu_device, float_tensor, frozen, grad, trainable,
    };

    /// Loss and gradients through the op, or through the unfused oracle
    /// (the linear op, then the cross-entropy op), with `d_loss` upstream.
    fn run(
        [k, c, v]: [usize; 3],
        bf16: bool,
        fused: Option<usize>,
        head_trains: bool,
        d_loss: f32,
    ) -> (f32, Vec<f32>, Option<Vec<f32>>) {
        let device = cpu_device(true);
        let (x0, w0) = (random(k * c, 11), random(v * c, 12));
        let targets: Vec<usize> = (0..k).map(|i| (i * 7 + 3) % v).collect();
        let leaf = trainable(float_tensor(x0, [k, c], &device));
        // Made by an op, as the model's hidden states are: tracked, not a
        // leaf (burn's `is_require_grad` is false for it).
        let x = leaf.clone().mul_scalar(1.0);
        let w = float_tensor(w0.clone(), [v, c], &device);
        let w = if head_trains { trainable(w) } else { frozen(w) };
        // The op reads the f32 head rounded, the oracle its bf16 copy: the
        // same values.
        let copy = bf16.then(|| Weight16::Copy(round_slice(&w0).into()));
        let loss: Tensor<1> = match fused {
            Some(chunk_rows) => super::super::host_head_cross_entropy_sum(
                x.clone(),
                w.clone(),
                bf16.then_some(Weight16::Master),
                &targets,
                chunk_rows,
                k,
            )
            .expect("the op runs on the CPU"),
            None => {
                let logits = match copy {
                    Some(copy) => bf16_linear(x.clone(), w.clone(), copy),
                    None => fused_linear(x.clone(), w.clone()),
                }
                .expect("the linear op runs on the CPU");
                cross_entropy_sum(logits, &targets).expect("the loss op runs on the CPU")
            }
        };
        let value = loss.clone().into_vec()[0];
        let grads = backward(&loss.mul_scalar(d_loss));
        let dx = grad(&leaf, &grads).expect("dx").into_vec();
        let dw = grad(&w, &grads).map(IntoHostVec::into_vec);
        (value, dx, dw)
    }

    /// The op against the unfused oracle: loss, `dx` and `dW`, head
    /// trainable and frozen, chunks of 1 row, of a row count that does not
    /// divide `K`, and of more rows than `K`. f32: the same products, `dW`
    /// added over chunks in another order and the upstream scale applied
    /// after rather than before the products (1e-5 of the largest value).
    /// bf16: the upstream scale is a power of two, so rounding `dz` before
    /// or after it is the same; 1e-5 likewise.
    #[test]
    fn op_matches_the_linear_then_cross_entropy_oracle() {
        for &bf16 in &[false, true] {
            for shape in [[5, 8, 11], [37, 48, 300]] {
                for head_trains in [true, false] {
                    let d_loss = if bf16 { 0.25 } else { 1.0 / 3.0 };
                    let oracle = run(shape, bf16, None, head_trains, d_loss);
                    for chunk_rows in [1, 7, 64] {
                        let case = format!(
                            "{shape:?} bf16 {bf16} head trains {head_trains} chunk {chunk_rows}"
                        );
                        let ours = run(shape, bf16, Some(chunk_rows), head_trains, d_loss);
                        assert!(
                            (ours.0 - oracle.0).abs() <= 1e-5 * oracle.0.abs(),
                            "{case}: loss {} vs {}",
                            ours.0,
                            oracle.0
                        );
                        assert_within(&format!("{case}: dx"), &ours.1, &oracle.1, 1e-5);
                        assert_eq!(ours.2.is_some(), head_trains, "{case}: dW iff it trains");
                        if let (Some(a), Some(b)) = (&ours.2, &oracle.2) {
                            assert_within(&format!("{case}: dW"), a, b, 1e-5);
                        }
                    }
                }
            }
        }
    }

    /// Under `--bf16`, a few rows in one chunk take the streamed products
    /// (`gemm_bf16::skinny`), the same rows in two chunks the packed ones:
    /// the same loss and gradients within f32 sums in another order
    /// (1e-5), for the weight as a bf16 copy and as f32 rounded as read,
    /// and for every choice of gradients (`[dW | dx]` laid out alike).
    #[test]
    fn few_rows_streamed_match_the_chunked_products() {
        let (k, c, v) = (20, 72, 1100);
        let (x, w) = (random(k * c, 21), random(v * c, 22));
        let copy = round_slice(&w);
        let targets: Vec<usize> = (0..k).map(|i| (i * 53 + 1) % v).collect();
        for (name, head) in [
            ("copy", View16::bf16(&copy, v, c)),
            ("master", View16::f32(&w, v, c)),
        ] {
            assert!(
                skinny::fits(k, head),
                "the case takes the streamed products"
            );
            for grads in [[true, true], [true, false], [false, true], [false, false]] {
                let case = format!("{name}, gradients {grads:?}");
                let streamed = head_loss(&x, Head::Bf16(head), &targets, [c, v], (k, k), grads);
                let chunked = head_loss(&x, Head::Bf16(head), &targets, [c, v], (k - 1, k), grads);
                assert!(
                    (streamed.loss - chunked.loss).abs() <= 1e-5 * chunked.loss.abs(),
                    "{case}: loss {} vs {}",
                    streamed.loss,
                    chunked.loss
                );
                assert_eq!(streamed.dw_len, chunked.dw_len, "{case}: dW's length");
                assert_eq!(streamed.grads.len(), chunked.grads.len(), "{case}: length");
                for (made, what, ours, theirs) in [
                    (grads[0], "dx", streamed.dx(), chunked.dx()),
                    (grads[1], "dW", streamed.dw(), chunked.dw()),
                ] {
                    if made {
                        assert_within(&format!("{case}: {what}"), ours, theirs, 1e-5);
                    } else {
                        assert!(ours.is_empty(), "{case}: {what} not asked, none made");
                    }
                }
            }
        }
    }

    /// The kernel follows the batch's labelled rows, not the call's: the
    /// same few rows give the packed path's bits whenever the batch has
    /// more rows than the streamed products take (an example checked
    /// alone), and the streamed path's when it has few: other bits, but
    /// on a packed body (AMX, `vdpbf16ps`) the same.
    #[test]
    fn the_kernel_is_chosen_by_the_batchs_rows() {
        let (k, c, v) = (6, 72, 900);
        let (x, w) = (random(k * c, 31), random(v * c, 32));
        let targets: Vec<usize> = (0..k).map(|i| (i * 37 + 5) % v).collect();
        let head = Head::Bf16(View16::f32(&w, v, c));
        let run = |batch_rows| head_loss(&x, head, &targets, [c, v], (k, batch_rows), [true, true]);
        let bits = |h: &HeadLoss| {
            let mut b: Vec<u32> = h.grads.iter().map(|g| g.to_bits()).collect();
            let loss = h.loss.to_bits();
            b.extend([(loss >> 32) as u32, loss as u32]);
            b
        };
        let packed = bits(&run(skinny::rows_taken() + 1));
        assert_eq!(
            packed,
            bits(&run(skinny::rows_taken() + 40)),
            "packed for any large batch"
        );
        assert_eq!(
            bits(&run(k)),
            bits(&run(skinny::rows_taken())),
            "streamed for any small batch"
        );
        if skinny::Tiles::of_this_process() != skinny::Tiles::No {
            // On a packed body (AMX, `vdpbf16ps`) both paths run its
            // products, operands swapped for few rows: the same sums in
            // the same order.
            assert_eq!(
                packed,
                bits(&run(k)),
                "on a packed body the two paths agree"
            );
        } else {
            assert_ne!(packed, bits(&run(k)), "the two kernels are told apart");
        }
    }

    /// The host kernel against the textbook loss and gradients in f64, one
    /// row at a time: `dW[v] = sum_k (p_kv - [t_k = v]) x_k`.
    #[test]
    fn kernel_matches_the_f64_definition() {
        let (k, c, v) = (9, 6, 13);
        let (x, w) = (random(k * c, 3), random(v * c, 4));
        let targets: Vec<usize> = (0..k).map(|i| (i * 5) % v).collect();
        let ours = head_loss(&x, Head::F32(&w), &targets, [c, v], (4, k), [true, true]);
        let (mut loss, mut dx, mut dw) = (0.0f64, vec![0.0f64; k * c], vec![0.0f64; v * c]);
        for (row, &t) in targets.iter().enumerate() {
            let xr = &x[row * c..(row + 1) * c];
            let z: Vec<f64> = (0..v)
                .map(|j| {
                    let wr = &w[j * c..(j + 1) * c];
                    xr.iter()
                        .zip(wr)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum()
                })
                .collect();
            let norm: f64 = z.iter().map(|z| z.exp()).sum();
            loss += norm.ln() - z[t];
            for (j, &zj) in z.iter().enumerate() {
                let dz = zj.exp() / norm - f64::from(u8::from(j == t));
                for i in 0..c {
                    dx[row * c + i] += dz * f64::from(w[j * c + i]);
                    dw[j * c + i] += dz * f64::from(xr[i]);
                }
            }
        }
        assert!(
            (ours.loss - loss).abs() <= 1e-5 * loss,
            "{} vs {loss}",
            ours.loss
        );
        let narrow = |v: Vec<f64>| v.into_iter().map(|v| v as f32).collect::<Vec<_>>();
        assert_within("dx", ours.dx(), &narrow(dx), 1e-5);
        assert_within("dW", ours.dw(), &narrow(dw), 1e-5);
        // Without gradients: the same loss, nothing else made.
        let bare = head_loss(&x, Head::F32(&w), &targets, [c, v], (4, k), [false, false]);
        assert_eq!(bare.loss, ours.loss);
        assert!(bare.dx().is_empty() && bare.dw().is_empty());
    }
}
