//! The exchange overlapped with the backward pass (`ddp_overlap`): the
//! recomputed backward pass (`LlamaModel::loss_backward_checkpointed`)
//! completes the gradient sums bucket by bucket
//! (`LlamaModel::gradient_buckets`), and each bucket is all-reduced over the
//! ring while the pass goes on, as PyTorch DDP's buckets are. The oracle is
//! the plain exchange after the backward pass (`grads.rs`), which it must
//! match to f32 rounding (`tests/data_parallel.rs`).

use std::time::Instant;

use padfree_model::LlamaModel;
use padfree_model::tensor::{Gradients, take_grad};
use padfree_pack::Example;

use crate::AttentionMode;
use crate::collate::Collated;
use crate::comm::Communicator;
use crate::error::TrainError;
use crate::grads::{add_on_host, ring_all_reduce};

/// An overlapped micro-batch: its loss and tokens, and how its exchange
/// went. (The time spent in the all-reduces while the backward pass ran is
/// not reported: it is mostly waiting for the other ranks to reach the same
/// bucket.)
pub(crate) struct Overlapped {
    /// The summed loss of its label tokens.
    pub(crate) loss_sum: f64,
    /// Tokens fed to the model.
    pub(crate) fed_tokens: usize,
    /// Seconds of exchange left after the backward pass had finished.
    pub(crate) exposed_seconds: f64,
}

/// The window's last micro-batch with its exchange overlapped: the
/// checkpointed forward and backward run on rayon's pool, and as each of
/// [`LlamaModel::gradient_buckets`] completes, its sums (every micro-batch
/// of the window added) move to this thread, which all-reduces them over
/// the ring in bucket order while later segments are recomputed. The
/// exchange stays on the calling thread, the one MPI was initialised on
/// (funneled threading). Every rank runs the same buckets in the same
/// order whatever its data, so the messages pair up; a rank whose pass
/// fails stops handing over and reports the error (the job then ends, as
/// for any failed rank).
pub(crate) fn forward_backward_overlapped(
    model: &LlamaModel,
    attention: AttentionMode,
    batch: &[Example],
    window_label_tokens: usize,
    sums: &mut Vec<Vec<f32>>,
    comm: &dyn Communicator,
) -> Result<Overlapped, TrainError> {
    let buckets = model.gradient_buckets();
    let numels: Vec<usize> = model.trainable().iter().map(|p| p.numel()).collect();
    let (sender, receiver) = std::sync::mpsc::channel::<(usize, Vec<Vec<f32>>)>();
    let mut pass: Option<Result<(f32, usize), TrainError>> = None;
    let mut backward_done: Option<Instant> = None;
    let mut exchanged: Vec<Option<Vec<Vec<f32>>>> = vec![None; buckets.len()];
    let mut ring: Result<(), TrainError> = Ok(());
    let mut exchange_done = Instant::now();
    let (pass_slot, done_slot, buckets_ref) = (&mut pass, &mut backward_done, &buckets);
    let lent = &mut *sums;
    rayon::in_place_scope(|scope| {
        scope.spawn(move |_| {
            let mut handover = Handover {
                sums: lent,
                buckets: buckets_ref,
                numels: &numels,
                sender,
                sent: 0,
            };
            let result =
                checkpointed_pass(model, attention, batch, window_label_tokens, &mut handover);
            if result.is_ok() {
                handover.complete(buckets_ref.len());
            }
            *done_slot = Some(Instant::now());
            *pass_slot = Some(result);
        });
        // Ends when the pass has handed every bucket over (or failed).
        for (bucket, mut parts) in receiver.iter() {
            if let Err(err) = ring_all_reduce(comm, &mut parts) {
                ring = Err(err);
                break;
            }
            exchange_done = Instant::now();
            exchanged[bucket] = Some(parts);
        }
    });
    let pass = pass.ok_or_else(|| TrainError::Config {
        flag: "ddp-overlap",
        message: "the backward pass ended without a result".into(),
        hint: "this is a bug in padfree; please report it",
    })??;
    ring?;
    for (bucket, parts) in buckets.iter().zip(exchanged) {
        let parts = parts.ok_or_else(|| TrainError::Config {
            flag: "ddp-overlap",
            message: "a bucket of gradients was not exchanged".into(),
            hint: "this is a bug in padfree; please report it",
        })?;
        for (index, part) in bucket.clone().zip(parts) {
            sums[index] = part;
        }
    }
    let exposed_seconds = backward_done
        .map(|done| exchange_done.saturating_duration_since(done).as_secs_f64())
        .unwrap_or(0.0);
    let (loss_sum, fed_tokens) = pass;
    Ok(Overlapped {
        loss_sum: f64::from(loss_sum),
        fed_tokens,
        exposed_seconds,
    })
}

/// The sums of a step on the host, with the buckets already complete handed
/// to the exchanging thread.
struct Handover<'a> {
    sums: &'a mut Vec<Vec<f32>>,
    buckets: &'a [std::ops::Range<usize>],
    numels: &'a [usize],
    sender: std::sync::mpsc::Sender<(usize, Vec<Vec<f32>>)>,
    /// Buckets handed over so far.
    sent: usize,
}

impl Handover<'_> {
    /// Hands over buckets up to `complete`; a tensor no micro-batch reached
    /// goes as zeros.
    fn complete(&mut self, complete: usize) {
        for bucket in self.sent..complete.min(self.buckets.len()) {
            let parts = self.buckets[bucket]
                .clone()
                .map(|index| {
                    let sum = std::mem::take(&mut self.sums[index]);
                    if sum.is_empty() {
                        vec![0.0; self.numels[index]]
                    } else {
                        sum
                    }
                })
                .collect();
            // A closed receiver means the exchange failed; that error is
            // the one reported.
            let _ = self.sender.send((bucket, parts));
            self.sent = bucket + 1;
        }
    }
}

/// The trainer's checkpointed pass, each part added to the sums and each
/// completed bucket handed over: the summed loss and the tokens fed.
fn checkpointed_pass(
    model: &LlamaModel,
    attention: AttentionMode,
    batch: &[Example],
    window_label_tokens: usize,
    handover: &mut Handover<'_>,
) -> Result<(f32, usize), TrainError> {
    let collated = Collated::new(batch, attention)?;
    let input = collated.input();
    let fed_tokens = input.input_ids().len();
    let trainable = model.trainable();
    let take = |gradients: &mut Gradients, complete: usize| {
        for (index, param) in trainable.iter().enumerate() {
            if let Some(g) = take_grad(&param.value, gradients) {
                add_on_host(&mut handover.sums[index], g);
            }
        }
        handover.complete(complete);
    };
    let loss_sum = model.loss_backward_checkpointed(
        &input,
        window_label_tokens as f64,
        model.head_chunk_rows(),
        take,
    )?;
    Ok((loss_sum, fed_tokens))
}

/// The overlapped exchange's buckets, all-reduced one after another
/// without a backward pass to wait for (a rank with no micro-batch in a
/// step): the same messages, in the same order, as its peers send.
pub(crate) fn all_reduce_by_bucket(
    comm: &dyn Communicator,
    buckets: &[std::ops::Range<usize>],
    sums: &mut [Vec<f32>],
) -> Result<(), TrainError> {
    for bucket in buckets {
        ring_all_reduce(comm, &mut sums[bucket.clone()])?;
    }
    Ok(())
}
