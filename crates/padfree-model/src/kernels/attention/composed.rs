//! The slow, obvious oracle of the attention kernels: burn ops, one example
//! (or one padded row) at a time, masks made once per batch.

use std::collections::BTreeMap;

use padfree_pack::BatchMeta;

use crate::tensor::{Bool, Device, Tensor, cat, causal_mask, mask_fill, narrow, softmax_last};

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

/// Added to scores of masked positions before the softmax. The most negative
/// finite f32, as transformers uses: `-inf` would turn into NaN in backward
/// wherever `0 * inf` appears.
const MASKED: f32 = f32::MIN;

/// The slow, obvious varlen attention: each example attends causally to
/// itself only, one small attention per example from burn ops, so the work
/// is the sum of squared lengths, not `T^2`.
///
/// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]` -> `[T, H, D]`.
pub fn composed_varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    meta: &BatchMeta,
    masks: &CausalMasks,
) -> Tensor<3> {
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
            let out = composed_core(rows(&q), rows(&k), rows(&v), masks.get(len, &device));
            // [1, H, len, D] -> [len, H, D]
            out.squeeze_dim::<3>(0).swap_dims(0, 1)
        })
        .collect();
    cat(outputs, 0)
}

/// The slow, obvious padded attention: `B` rows of `L` tokens with a
/// `[B, 1, L, L]` mask, true where a query may not see a key (the future, or
/// a pad).
///
/// `q`: `[B * L, H, D]`, `k`, `v`: `[B * L, Hkv, D]` -> `[B * L, H, D]`.
pub fn composed_padded_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    batch_size: usize,
    seq_len: usize,
    mask: Tensor<4, Bool>,
) -> Tensor<3> {
    let [_, heads, head_dim] = q.dims();
    let rows = |t: Tensor<3>| {
        let heads = t.dims()[1];
        t.reshape([batch_size, seq_len, heads, head_dim])
            .swap_dims(1, 2)
    };
    let out = composed_core(rows(q), rows(k), rows(v), mask);
    out.swap_dims(1, 2)
        .reshape([batch_size * seq_len, heads, head_dim])
}

/// Scaled dot-product attention with grouped key/value heads.
///
/// `q`: `[b, H, l, D]`, `k`, `v`: `[b, Hkv, l, D]`, `mask`: `[b, 1, l, l]`
/// (true = hidden) -> `[b, H, l, D]`.
fn composed_core(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Tensor<4, Bool>) -> Tensor<4> {
    let [b, h, l, head_dim] = q.dims();
    let group = h / k.dims()[1];
    let k = repeat_kv(k, group);
    let v = repeat_kv(v, group);
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    let scores = mask_fill(scores, mask.expand([b, h, l, l]), MASKED);
    softmax_last(scores).matmul(v)
}

/// `[b, Hkv, l, D] -> [b, Hkv * group, l, D]`, each key/value head serving
/// its group of query heads (HF's `repeat_kv`).
fn repeat_kv(x: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return x;
    }
    let [b, hkv, l, d] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .repeat_dim(2, group)
        .reshape([b, hkv * group, l, d])
}
