use padfree_pack::BatchMeta;

use super::linear::{Linear, shared_input};
use super::norm::RmsNorm;
use super::rope::Rope;
use crate::error::ModelError;
use crate::kernels::{
    AttentionRows, CausalMasks, SharedInput16, bf16_varlen_attention, composed_padded_attention,
    composed_varlen_attention, half_varlen_attention, round_tensor, round_to_half,
    varlen_attention,
};
use crate::tensor::{Bool, Tensor};
use crate::weights::table::Param;

/// How attention is computed, for flattened and padded batches alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// padfree's fused kernel (`kernels/attention/`): one call per layer for the
    /// whole batch, with its own backward pass. The default.
    #[default]
    Fused,
    /// One attention per example (or per padded row, with a mask) built from
    /// burn tensor ops: slow, obvious, kept as the oracle the fused kernel is
    /// tested against (`kernels/attention/` too).
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
        /// The same boundaries as the fused kernel reads them (on a GPU,
        /// uploaded once for every layer).
        rows: &'a AttentionRows,
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
        rows: &'a AttentionRows,
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
pub struct Attention<'a> {
    /// `[H * D, C]`.
    pub(crate) q_proj: Linear<'a>,
    /// `[Hkv * D, C]`.
    pub(crate) k_proj: Linear<'a>,
    /// `[Hkv * D, C]`.
    pub(crate) v_proj: Linear<'a>,
    /// `[C, H * D]`.
    pub(crate) o_proj: Linear<'a>,
    /// `[1, H * D]`, Qwen2's query bias.
    pub(crate) q_bias: Option<&'a Param>,
    /// `[1, Hkv * D]`, Qwen2's key bias.
    pub(crate) k_bias: Option<&'a Param>,
    /// `[1, Hkv * D]`, Qwen2's value bias.
    pub(crate) v_bias: Option<&'a Param>,
    /// Qwen3's RMSNorm over each query head, `[1, D]`, before the rotation.
    pub(crate) q_norm: Option<RmsNorm<'a>>,
    /// Qwen3's RMSNorm over each key head, `[1, D]`.
    pub(crate) k_norm: Option<RmsNorm<'a>>,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
}

impl Attention<'_> {
    /// `[N, C] -> [N, C]`.
    pub fn forward(
        &self,
        x: Tensor<2>,
        rope: &Rope,
        layout: &AttentionLayout<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        let n = x.dims()[0];
        let (h, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // On a GPU under `--bf16` the three projections share one 16-bit
        // copy of their input for the backward pass (each would keep its
        // own otherwise: 6 bytes a value against f32's shared 4), but with
        // LoRA adapters, which read it in f32.
        let x = match self.q_proj.shared_half_input() {
            Some(half) => x.cast(half.dtype()),
            None => x,
        };
        let shared = shared_input(&[&self.q_proj, &self.k_proj, &self.v_proj], &x);
        let shared = shared.as_ref();
        let q = project(x.clone(), &self.q_proj, self.q_bias, shared)?;
        let k = project(x.clone(), &self.k_proj, self.k_bias, shared)?;
        let v = project(x, &self.v_proj, self.v_bias, shared)?.reshape([n, hkv, d]);
        let q = rope.apply(per_head_norm(q, h, d, self.q_norm.as_ref())?)?;
        let k = rope.apply(per_head_norm(k, hkv, d, self.k_norm.as_ref())?)?;
        let bf16 = self.o_proj.is_bf16();
        let half = self.o_proj.device_half();
        // Under `--bf16` the composed oracles take the values the fused
        // kernel takes (q, k, v rounded to bf16, or on a GPU to its 16-bit
        // float: autocast's attention inputs), and their output is rounded
        // as the fused op's is.
        let round = |x: Tensor<3>| match half {
            Some(half) => round_to_half(x, half),
            None => round_3d(x),
        };
        let composed_inputs = |q: Tensor<3>, k: Tensor<3>, v: Tensor<3>| {
            if bf16 {
                (round(q), round(k), round(v))
            } else {
                (q, k, v)
            }
        };
        let composed_output = |context: Tensor<3>| {
            let context = if bf16 { round(context) } else { context };
            self.heads_joined(context)
        };
        let (context, kept) = match layout {
            AttentionLayout::Varlen {
                rows,
                kernel: AttentionKernel::Fused,
                ..
            } => self.fused(q, k, v, rows)?,
            AttentionLayout::Varlen {
                meta,
                kernel: AttentionKernel::Composed,
                masks,
                ..
            } => {
                let (q, k, v) = composed_inputs(q, k, v);
                let context = composed_varlen_attention(q, k, v, meta, masks);
                (composed_output(context), None)
            }
            AttentionLayout::VarlenPerLayer {
                position_ids,
                kernel,
            } => {
                // Everything the collator would have handed over, derived again here.
                let meta = BatchMeta::derive_from_position_ids(position_ids).map_err(|source| {
                    ModelError::Pack {
                        what: "position_ids",
                        cause: source,
                    }
                })?;
                match kernel {
                    AttentionKernel::Fused => {
                        let rows = AttentionRows::new(meta.cu_seqlens_shared(), &q.device());
                        self.fused(q, k, v, &rows)?
                    }
                    AttentionKernel::Composed => {
                        let masks = CausalMasks::new(meta.seq_lens(), &q.device());
                        let (q, k, v) = composed_inputs(q, k, v);
                        let context = composed_varlen_attention(q, k, v, &meta, &masks);
                        (composed_output(context), None)
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
            } => {
                let (q, k, v) = composed_inputs(q, k, v);
                let context =
                    composed_padded_attention(q, k, v, *batch_size, *seq_len, (**mask).clone());
                (composed_output(context), None)
            }
        };
        if let Some(kept) = kept {
            // The kernel kept its output as bf16 for both.
            return self.o_proj.forward_sharing_input(context, Some(&kept));
        }
        if bf16 {
            // bf16-valued, so o_proj keeps it as bf16, exactly.
            return self.o_proj.forward_storing_input(context);
        }
        self.o_proj.forward(context)
    }

    /// The fused kernel: every example of the batch in one call, and
    /// under `--bf16` on the CPU the bf16 store its output is kept in for
    /// `o_proj` too, where `o_proj` reads nothing but its rounding.
    ///
    /// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]` -> `[T, H * D]`.
    fn fused(
        &self,
        q: Tensor<3>,
        k: Tensor<3>,
        v: Tensor<3>,
        rows: &AttentionRows,
    ) -> Result<(Tensor<2>, Option<SharedInput16>), ModelError> {
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let mut kept = None;
        let context = if let Some(half) = self.o_proj.device_half() {
            half_varlen_attention(q, k, v, rows, scale, half, false)?
        } else if self.o_proj.is_bf16() {
            kept = self
                .o_proj
                .reads_only_rounded_input()
                .then(SharedInput16::default);
            bf16_varlen_attention(q, k, v, rows, scale, kept.clone())?
        } else {
            varlen_attention(q, k, v, rows, scale)?
        };
        Ok((self.heads_joined(context), kept))
    }

    /// `[N, H, D] -> [N, H * D]`.
    fn heads_joined(&self, context: Tensor<3>) -> Tensor<2> {
        let rows = context.dims()[0];
        context.reshape([rows, self.num_heads * self.head_dim])
    }
}

/// `x @ weight^T (+ bias)`: `[N, C] -> [N, O]`, the bias `[1, O]` broadcast
/// over the rows.
fn project(
    x: Tensor<2>,
    weight: &Linear<'_>,
    bias: Option<&Param>,
    shared: Option<&SharedInput16>,
) -> Result<Tensor<2>, ModelError> {
    let y = weight.forward_sharing_input(x, shared)?;
    Ok(match bias {
        Some(bias) => y + bias.value.clone(),
        None => y,
    })
}

/// `[N, heads * D] -> [N, heads, D]`, each head through `norm` when there is one.
fn per_head_norm(
    x: Tensor<2>,
    heads: usize,
    d: usize,
    norm: Option<&RmsNorm<'_>>,
) -> Result<Tensor<3>, ModelError> {
    let n = x.dims()[0];
    Ok(match norm {
        Some(norm) => norm
            .forward(x.reshape([n * heads, d]))?
            .reshape([n, heads, d]),
        None => x.reshape([n, heads, d]),
    })
}

/// `x` rounded to bf16 (still f32), the gradient passed straight through.
fn round_3d(x: Tensor<3>) -> Tensor<3> {
    let [n, heads, d] = x.dims();
    round_tensor(x.reshape([n, heads * d])).reshape([n, heads, d])
}
