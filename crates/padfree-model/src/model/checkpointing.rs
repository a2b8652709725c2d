//! Per-layer gradient checkpointing (`--gradient-checkpointing`): the
//! forward pass runs off the autodiff graph and keeps only each decoder
//! layer's input; the backward pass then goes from the loss to the
//! embedding one segment at a time, recomputing one layer's forward on the
//! graph, running its backward, and dropping it before the next.
//!
//! What a micro-batch holds at its peak is then `L + 1` states of `[T, C]`
//! plus one layer's activations, instead of every layer's (the same
//! trade-off as torch's `checkpoint` around each decoder layer, which HF's
//! `gradient_checkpointing_enable` makes): about a third more compute, for
//! activations that no longer grow with depth. burn's own balanced
//! checkpointing keeps the outputs of compute-bound ops, which every fused
//! kernel and the quantized matmul are, and measured no saving
//! (docs/benchmarks/2026-12-01-lora.md).
//!
//! The LM head runs in chunks of labelled rows, each with its own backward
//! pass and its loss in the one op that never keeps the logits
//! (`LlamaModel::head_loss_sum`); a chunk's final norm and hidden states
//! stay within [`HEAD_CHUNK_BYTES`]' rows.
//!
//! Each part also says how many of [`LlamaModel::gradient_buckets`] are
//! then complete (no later part adds to them): data-parallel training
//! starts exchanging those while the backward pass goes on (PyTorch DDP's
//! buckets, here one per segment).
//!
//! The gradients are those of [`LlamaModel::loss_sum`] (the oracle, tested
//! against in `tests/checkpointing.rs`), in another summation order: the
//! head's gradient is a sum over chunks, a tied embedding's a sum of the
//! head's and the embedding's parts, each handed over separately.
//!
//! # Shapes
//! `T` tokens of the batch (rows: `B * L` when padded), `C` hidden size,
//! `K` labelled rows, `V` vocabulary, `L` decoder layers.

use crate::error::ModelError;
use crate::input::ModelInput;
use crate::loss::{HEAD_CHUNK_BYTES, LabelRows};
use crate::tensor::{Gradients, Tensor, backward, take_grad, trainable};
use crate::weights::table::index;

use std::ops::Range;

use super::LlamaModel;

impl LlamaModel {
    /// Labelled rows whose logits fill [`HEAD_CHUNK_BYTES`] (at least 1).
    pub fn head_chunk_rows(&self) -> usize {
        (HEAD_CHUNK_BYTES / (4 * self.config.vocab_size.max(1))).max(1)
    }

    /// The trained tensors (ranges of [`Self::trainable`]'s indices) in the
    /// groups whose gradients [`Self::loss_backward_checkpointed`] completes
    /// one after another, in that order: the final norm with an untied
    /// head, each decoder layer from the last to the first, the embedding
    /// (a tied head's gradient has a part from the head and one from the
    /// embedding, so it completes last). With LoRA, each layer's adapters.
    /// Every trained tensor is in exactly one bucket.
    pub fn gradient_buckets(&self) -> Vec<Range<usize>> {
        let layers = self.config.num_hidden_layers;
        match &self.lora {
            Some(lora) => {
                let per_layer = 2 * lora.config.targets.len();
                (0..layers)
                    .rev()
                    .map(|layer| layer * per_layer..(layer + 1) * per_layer)
                    .collect()
            }
            None => {
                let per_layer = self.layer_tensors.len();
                let mut buckets = Vec::with_capacity(layers + 2);
                buckets.push(index::final_norm(layers, per_layer)..self.params.len());
                for layer in (0..layers).rev() {
                    let start = index::layer_start(layer, per_layer);
                    buckets.push(start..start + per_layer);
                }
                buckets.push(index::EMBEDDING..index::EMBEDDING + 1);
                buckets
            }
        }
    }

    /// Forward and backward of one batch with per-layer recomputation: the
    /// summed loss (as [`Self::loss_sum`]'s `sum`) is returned, and the
    /// gradients of `loss_sum / divisor` arrive in parts, each segment's
    /// [`Gradients`] lent to `take` once (a parameter may appear in
    /// several parts: add them), with the number of leading
    /// [`Self::gradient_buckets`] complete once that part is added (it
    /// only grows; a batch without labels hands over no part). The
    /// container is lent mutably, and the segment's input gradient is
    /// already out of it, so `take` may take every gradient out
    /// ([`take_grad`]): each is then its buffer's only owner, and sums
    /// (the GPU's in-place group additions, the host's) need no copy.
    /// The LoRA dropout masks are the model's
    /// (its dropout draw), the same in the forward pass and the recomputation.
    /// The head runs on `head_chunk_rows` labelled rows at a time
    /// ([`Self::head_chunk_rows`] keeps a chunk's logits to
    /// [`HEAD_CHUNK_BYTES`]).
    pub fn loss_backward_checkpointed(
        &self,
        input: &ModelInput<'_>,
        divisor: f64,
        head_chunk_rows: usize,
        mut take: impl FnMut(&mut Gradients, usize),
    ) -> Result<f32, ModelError> {
        let layers = self.config.num_hidden_layers;
        // The inputs of every layer and of the final norm, `L + 1` of
        // `[T, C]`, off the graph (the weights shared, not copied).
        let off = self.off_graph(self.lora.as_ref().and_then(|lora| lora.dropout.clone()));
        let mut states: Vec<Tensor<2>> = Vec::with_capacity(layers + 1);
        off.with_layout(input, |rope, layout, rows| {
            let mut x = off.embed(input)?;
            for layer in 0..layers {
                let next = off.layer(layer, rows)?.forward(x.clone(), rope, layout)?;
                states.push(x);
                x = next;
            }
            states.push(x);
            Ok(())
        })?;

        // The head, chunk by chunk, from the last state.
        let last = states
            .pop()
            .ok_or_else(|| bug("the final norm's input is missing"))?;
        let [rows, _] = last.dims();
        let labels = LabelRows::new(&input.targets(), rows, self.config.vocab_size)?;
        if labels.is_empty() {
            // Nothing is predicted: zero loss, zero gradients.
            return Ok(0.0);
        }
        // The final norm's (and an untied head's) bucket, with full
        // fine-tuning; LoRA trains nothing outside the layers.
        let head_buckets = usize::from(self.lora.is_none());
        let leaf = trainable(Tensor::from_inner(last));
        let mut loss_sum = 0.0f32;
        let mut upstream: Option<Tensor<2>> = None;
        let chunks = labels.chunks(head_chunk_rows);
        let last_chunk = chunks.len().saturating_sub(1);
        for (at, chunk) in chunks.into_iter().enumerate() {
            let kept = leaf.clone().select(0, chunk.rows_tensor(&self.device));
            let normed = self.final_norm().forward(kept)?;
            let loss = self.head_loss_sum(normed, &chunk)?;
            loss_sum += loss.value();
            let mut gradients = backward(&loss.sum.div_scalar(divisor));
            upstream = add(upstream, take_grad(&leaf, &mut gradients));
            take(
                &mut gradients,
                if at == last_chunk { head_buckets } else { 0 },
            );
        }

        // The layers, last to first, each recomputed on the graph.
        self.with_layout(input, |rope, layout, rows| {
            for layer in (0..layers).rev() {
                let (Some(g), Some(state)) = (upstream.take(), states.pop()) else {
                    return Err(bug("a layer's input or upstream gradient is missing"));
                };
                let leaf = trainable(Tensor::from_inner(state));
                let out = self
                    .layer(layer, rows)?
                    .forward(leaf.clone(), rope, layout)?;
                // d(sum(out * g))/d(out) = g: the upstream gradient seeds
                // this segment's backward pass.
                let mut gradients = backward(&(out * Tensor::from_inner(g)).sum());
                upstream = take_grad(&leaf, &mut gradients);
                take(&mut gradients, head_buckets + layers - layer);
            }
            Ok(())
        })?;

        // The embedding, when it trains.
        if self.params[index::EMBEDDING].value.is_require_grad()
            && let Some(g) = upstream
        {
            let mut gradients = backward(&(self.embed(input)? * Tensor::from_inner(g)).sum());
            take(&mut gradients, head_buckets + layers + 1);
        }
        Ok(loss_sum)
    }
}

/// `sum + part`, either of which may be missing.
fn add(sum: Option<Tensor<2>>, part: Option<Tensor<2>>) -> Option<Tensor<2>> {
    match (sum, part) {
        (Some(sum), Some(part)) => Some(sum + part),
        (sum, part) => sum.or(part),
    }
}

fn bug(message: &str) -> ModelError {
    ModelError::Config {
        field: "gradient_checkpointing",
        message: message.to_owned(),
        hint: "this is a bug in padfree; please report it",
    }
}
