use std::collections::BTreeMap;

use padfree_pack::BatchMeta;

use crate::error::ModelError;
use crate::param::Param;
use crate::rope::Rope;
use crate::tensor::{
    Bool, Device, Tensor, cat, causal_mask, linear, mask_fill, narrow, softmax_last,
    varlen_attention,
};

/// A causal mask (`[1, 1, len, len]`) for every distinct example length of a
/// batch, built once per forward pass and shared by every layer.
#[derive(Debug, Clone)]
pub struct CausalMasks {
    by_len: BTreeMap<usize, Tensor<4, Bool>>,
}

impl CausalMasks {
    /// Masks for examples of these lengths.
    pub fn new(lengths: impl IntoIterator<Item = usize>, device: &Device) -> Self {
        let mut by_len = BTreeMap::new();
        for len in lengths {
            by_len
                .entry(len)
                .or_insert_with(|| causal_mask(len, device));
        }
        Self { by_len }
    }

    /// The mask of an example of `len` tokens (built on demand if the batch
    /// did not announce that length).
    fn get(&self, len: usize, device: &Device) -> Tensor<4, Bool> {
        self.by_len
            .get(&len)
            .cloned()
            .unwrap_or_else(|| causal_mask(len, device))
    }
}

/// How attention is computed, for flattened and padded batches alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// padfree's fused kernel (`varlen_kernel`): one call per layer for the
    /// whole batch, with its own backward pass. The default.
    #[default]
    Fused,
    /// One attention per example (or per padded row, with a mask) built from
    /// burn tensor ops: slow, obvious, kept as the oracle the fused kernel is
    /// tested against.
    Composed,
}

/// How the rows of a forward pass are grouped into sequences that may attend
/// to each other. Built once per forward pass and handed to every layer.
#[derive(Debug, Clone)]
pub enum AttentionLayout<'a> {
    /// One flattened row; the collator's boundaries keep each example to itself.
    Varlen {
        /// The collator's boundaries.
        meta: &'a BatchMeta,
        /// Fused or composed.
        kernel: AttentionKernel,
        /// Causal masks of the batch's example lengths (composed kernel only).
        masks: &'a CausalMasks,
    },
    /// One flattened row; every layer derives the boundaries from the
    /// `position_ids` itself (the reference system's slower variant, kept to
    /// measure what computing them once saves).
    VarlenPerLayer {
        /// The batch's positions, restarting at 0 for every example.
        position_ids: &'a [u32],
        /// Fused or composed.
        kernel: AttentionKernel,
    },
    /// `B` rows of `L` tokens, padded on the right.
    Padded {
        /// Rows, `B`.
        batch_size: usize,
        /// Padded length, `L`.
        seq_len: usize,
        /// Fused or composed, and what each needs.
        kernel: PaddedAttention<'a>,
    },
}

/// How attention over padded rows is computed.
#[derive(Debug, Clone)]
pub enum PaddedAttention<'a> {
    /// The fused kernel with every row taken as one sequence of `L` tokens,
    /// pads included. Pads sit after every real token of their row (right
    /// padding), so causal attention never shows a real token a pad; what
    /// the pads compute is never read by a real token nor by the loss. Pads
    /// still cost their full share, as padding does.
    Fused {
        /// `B` sequences of `L` tokens.
        rows: &'a BatchMeta,
    },
    /// Composed burn ops with a `[B, 1, L, L]` mask, true where a query may
    /// not see a key (the future, or a pad); boxed, as a tensor handle is
    /// large next to a reference.
    Composed {
        /// Causal and padding mask.
        mask: Box<Tensor<4, Bool>>,
    },
}

/// Grouped-query causal self-attention.
#[derive(Debug, Clone)]
pub struct Attention {
    /// `[H * D, C]`.
    pub(crate) q_proj: Param,
    /// `[Hkv * D, C]`.
    pub(crate) k_proj: Param,
    /// `[Hkv * D, C]`.
    pub(crate) v_proj: Param,
    /// `[C, H * D]`.
    pub(crate) o_proj: Param,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
}

/// Added to scores of masked positions before the softmax. The most negative
/// finite f32, as transformers uses: `-inf` would turn into NaN in backward
/// wherever `0 * inf` appears.
const MASKED: f32 = f32::MIN;

impl Attention {
    /// `[N, C] -> [N, C]`.
    pub fn forward(
        &self,
        x: Tensor<2>,
        rope: &Rope,
        layout: &AttentionLayout<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        let n = x.dims()[0];
        let (h, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = rope.apply(linear(x.clone(), &self.q_proj.value).reshape([n, h, d]));
        let k = rope.apply(linear(x.clone(), &self.k_proj.value).reshape([n, hkv, d]));
        let v = linear(x, &self.v_proj.value).reshape([n, hkv, d]);
        let context = match layout {
            AttentionLayout::Varlen {
                meta,
                kernel: AttentionKernel::Fused,
                ..
            } => self.fused(q, k, v, meta)?,
            AttentionLayout::Varlen {
                meta,
                kernel: AttentionKernel::Composed,
                masks,
            } => self.varlen(q, k, v, meta, masks),
            AttentionLayout::VarlenPerLayer {
                position_ids,
                kernel,
            } => {
                // Everything the collator would have handed over, derived again here.
                let meta = BatchMeta::derive_from_position_ids(position_ids)
                    .map_err(|err| ModelError::Batch(format!("position_ids: {err}")))?;
                match kernel {
                    AttentionKernel::Fused => self.fused(q, k, v, &meta)?,
                    AttentionKernel::Composed => {
                        let masks = CausalMasks::new(meta.seq_lens(), &q.device());
                        self.varlen(q, k, v, &meta, &masks)
                    }
                }
            }
            AttentionLayout::Padded {
                kernel: PaddedAttention::Fused { rows },
                ..
            } => self.fused(q, k, v, rows)?,
            AttentionLayout::Padded {
                batch_size,
                seq_len,
                kernel: PaddedAttention::Composed { mask },
            } => self.padded(q, k, v, *batch_size, *seq_len, (**mask).clone()),
        };
        Ok(linear(context, &self.o_proj.value))
    }

    /// The fused kernel: every example of the batch in one call.
    ///
    /// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]` -> `[T, H * D]`.
    fn fused(
        &self,
        q: Tensor<3>,
        k: Tensor<3>,
        v: Tensor<3>,
        meta: &BatchMeta,
    ) -> Result<Tensor<2>, ModelError> {
        let total = q.dims()[0];
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let context = varlen_attention(q, k, v, meta.cu_seqlens(), scale).map_err(|err| {
            ModelError::Batch(format!(
                "{}\nHINT: use the composed attention (AttentionKernel::Composed) for this tensor type",
                err.0
            ))
        })?;
        Ok(context.reshape([total, self.num_heads * self.head_dim]))
    }

    /// Each example attends causally to itself only: one small attention per
    /// example, so the work is the sum of squared lengths, not `T^2`.
    ///
    /// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]` -> `[T, H * D]`.
    fn varlen(
        &self,
        q: Tensor<3>,
        k: Tensor<3>,
        v: Tensor<3>,
        meta: &BatchMeta,
        masks: &CausalMasks,
    ) -> Tensor<2> {
        let total = q.dims()[0];
        let device = q.device();
        let outputs: Vec<Tensor<3>> = meta
            .example_ranges()
            .map(|range| {
                let len = range.len();
                let rows = |t: &Tensor<3>| {
                    narrow(t.clone(), 0, range.start, len)
                        .swap_dims(0, 1)
                        .unsqueeze_dim::<4>(0)
                };
                let out = self.core(rows(&q), rows(&k), rows(&v), masks.get(len, &device));
                // [1, H, len, D] -> [len, H, D]
                out.squeeze_dim::<3>(0).swap_dims(0, 1)
            })
            .collect();
        cat(outputs, 0).reshape([total, self.num_heads * self.head_dim])
    }

    /// `q`: `[B * L, H, D]`, `k`, `v`: `[B * L, Hkv, D]` -> `[B * L, H * D]`.
    fn padded(
        &self,
        q: Tensor<3>,
        k: Tensor<3>,
        v: Tensor<3>,
        batch_size: usize,
        seq_len: usize,
        mask: Tensor<4, Bool>,
    ) -> Tensor<2> {
        let rows = |t: Tensor<3>| {
            let heads = t.dims()[1];
            t.reshape([batch_size, seq_len, heads, self.head_dim])
                .swap_dims(1, 2)
        };
        let out = self.core(rows(q), rows(k), rows(v), mask);
        out.swap_dims(1, 2)
            .reshape([batch_size * seq_len, self.num_heads * self.head_dim])
    }

    /// Scaled dot-product attention with grouped key/value heads.
    ///
    /// `q`: `[b, H, l, D]`, `k`, `v`: `[b, Hkv, l, D]`, `mask`: `[b, 1, l, l]`
    /// (true = hidden) -> `[b, H, l, D]`.
    fn core(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Tensor<4, Bool>) -> Tensor<4> {
        let [b, h, l, _] = q.dims();
        let k = self.repeat_kv(k);
        let v = self.repeat_kv(v);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
        let scores = mask_fill(scores, mask.expand([b, h, l, l]), MASKED);
        softmax_last(scores).matmul(v)
    }

    /// `[b, Hkv, l, D] -> [b, H, l, D]`, each key/value head serving its group
    /// of query heads (HF's `repeat_kv`).
    fn repeat_kv(&self, x: Tensor<4>) -> Tensor<4> {
        let group = self.num_heads / self.num_kv_heads;
        if group == 1 {
            return x;
        }
        let [b, hkv, l, d] = x.dims();
        x.unsqueeze_dim::<5>(2)
            .repeat_dim(2, group)
            .reshape([b, hkv * group, l, d])
    }
}
