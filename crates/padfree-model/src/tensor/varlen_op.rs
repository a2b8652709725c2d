//! The fused varlen attention kernel as a burn operation: forward through
//! [`crate::varlen_kernel`], backward registered with burn's autodiff graph
//! as a backend extension on the Flex backend.
//!
//! This file and `mod.rs` are the only ones that touch burn; this one also
//! touches its extension API (`burn-autodiff`'s `Backward`, `burn-flex`'s
//! tensors), which breaks more often than the tensor API.

use std::sync::Arc;

use burn::tensor::{Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::tensor::FloatTensor;
use burn_flex::{Flex, FlexTensor};

/// A tracked tensor of the autodiff-decorated Flex backend (the checkpointing
/// strategy is a type parameter of the backend, not of its tensors).
pub(super) type AutodiffTensor = FloatTensor<Autodiff<Flex>>;

use crate::varlen_kernel::{self, AttentionDims, ForwardOutput, Qkv};

/// Why a tensor could not go through the fused kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsupportedTensor(pub String);

/// Fused causal attention of every example of a flattened batch.
///
/// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]`, `cu_seqlens`: `B + 1` offsets
/// -> `[T, H, D]`. Differentiable when the inputs are on an autodiff device
/// (with or without gradient checkpointing).
pub fn varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    cu_seqlens: &[u32],
    scale: f32,
) -> Result<Tensor<3>, UnsupportedTensor> {
    let [_, num_heads, head_dim] = q.dims();
    let dims = AttentionDims {
        num_heads,
        num_kv_heads: k.dims()[1],
        head_dim,
    };
    let call = Call {
        cu_seqlens: Arc::new(cu_seqlens.iter().map(|&offset| offset as usize).collect()),
        dims,
        scale,
    };
    if !q.is_autodiff() {
        let [q, k, v] = [q, k, v].map(|t| t.try_into_primitive::<Flex>());
        let (q, k, v) = (unsupported(q)?, unsupported(k)?, unsupported(v)?);
        let (out, _) = call.forward(&q, &k, &v)?;
        return Ok(Tensor::from_primitive::<Flex>(out));
    }
    match q.gradient_checkpointing_strategy() {
        Some(burn::tensor::GradientCheckpointingStrategy::Balanced) => {
            let [q, k, v] =
                [q, k, v].map(|t| t.try_into_primitive::<Autodiff<Flex, BalancedCheckpointing>>());
            let out = tracked::<BalancedCheckpointing>(
                &call,
                [unsupported(q)?, unsupported(k)?, unsupported(v)?],
            )?;
            Ok(Tensor::from_primitive::<
                Autodiff<Flex, BalancedCheckpointing>,
            >(out))
        }
        _ => {
            let [q, k, v] =
                [q, k, v].map(|t| t.try_into_primitive::<Autodiff<Flex, NoCheckpointing>>());
            let out = tracked::<NoCheckpointing>(
                &call,
                [unsupported(q)?, unsupported(k)?, unsupported(v)?],
            )?;
            Ok(Tensor::from_primitive::<Autodiff<Flex, NoCheckpointing>>(
                out,
            ))
        }
    }
}

pub(super) fn unsupported<T, E: std::fmt::Debug>(
    result: Result<T, E>,
) -> Result<T, UnsupportedTensor> {
    result.map_err(|err| UnsupportedTensor(format!("{err:?}")))
}

/// What stays the same between forward and backward.
#[derive(Debug, Clone)]
struct Call {
    cu_seqlens: Arc<Vec<usize>>,
    dims: AttentionDims,
    scale: f32,
}

impl Call {
    /// The output tensor and the saved row log-sum-exps.
    fn forward(
        &self,
        q: &FlexTensor,
        k: &FlexTensor,
        v: &FlexTensor,
    ) -> Result<(FlexTensor, Vec<f32>), UnsupportedTensor> {
        let shape = q.layout().shape().clone();
        let (q, k, v) = (q.to_contiguous(), k.to_contiguous(), v.to_contiguous());
        let inputs = Qkv {
            q: f32_values(&q)?,
            k: f32_values(&k)?,
            v: f32_values(&v)?,
        };
        let ForwardOutput { out, lse } =
            varlen_kernel::forward(inputs, &self.cu_seqlens, self.dims, self.scale);
        Ok((FlexTensor::from_data(TensorData::new(out, shape)), lse))
    }
}

/// The values of a contiguous f32 tensor.
pub(super) fn f32_values(tensor: &FlexTensor) -> Result<&[f32], UnsupportedTensor> {
    tensor.as_slice::<f32>().ok_or_else(|| {
        UnsupportedTensor(format!(
            "the fused attention takes contiguous f32 tensors, got {:?}",
            tensor.dtype()
        ))
    })
}

/// What the backward pass keeps: the inputs, the output and the row
/// log-sum-exps (`[T, H]`), not the `[L, L]` probabilities.
#[derive(Debug, Clone)]
struct Saved {
    call: Call,
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    out: FlexTensor,
    lse: Arc<Vec<f32>>,
}

#[derive(Debug)]
struct VarlenAttentionBackward;

impl Backward<Flex, 3> for VarlenAttentionBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<Flex>(&ops.node).to_contiguous();
        let saved = ops.state;
        let (q, k, v, out) = (
            saved.q.to_contiguous(),
            saved.k.to_contiguous(),
            saved.v.to_contiguous(),
            saved.out.to_contiguous(),
        );
        // The forward pass checked every one of these; a failure here is a bug.
        let slices = (
            f32_values(&q),
            f32_values(&k),
            f32_values(&v),
            f32_values(&out),
            f32_values(&d_out),
        );
        let (Ok(q_values), Ok(k_values), Ok(v_values), Ok(out_values), Ok(d_out_values)) = slices
        else {
            panic!("fused attention backward: inputs are no longer contiguous f32");
        };
        let inputs = Qkv {
            q: q_values,
            k: k_values,
            v: v_values,
        };
        let gradients = varlen_kernel::backward(
            inputs,
            out_values,
            &saved.lse,
            d_out_values,
            &saved.call.cu_seqlens,
            saved.call.dims,
            saved.call.scale,
        );
        let [q_node, k_node, v_node] = ops.parents;
        let outputs = [
            (q_node, gradients.dq, q.layout().shape().clone()),
            (k_node, gradients.dk, k.layout().shape().clone()),
            (v_node, gradients.dv, v.layout().shape().clone()),
        ];
        for (node, values, shape) in outputs {
            if let Some(node) = node {
                grads.register::<Flex>(
                    node.id,
                    FlexTensor::from_data(TensorData::new(values, shape)),
                );
            }
        }
    }
}

fn tracked<C: CheckpointStrategy>(
    call: &Call,
    inputs: [AutodiffTensor; 3],
) -> Result<AutodiffTensor, UnsupportedTensor> {
    let [(q, q_node), (k, k_node), (v, v_node)] = inputs.map(AutodiffTensor::into_parts);
    let (out, lse) = call.forward(&q, &k, &v)?;
    // Compute-bound: gradient checkpointing keeps the output rather than
    // recomputing it.
    Ok(
        match VarlenAttentionBackward
            .prepare::<C>([q_node, k_node, v_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    call: call.clone(),
                    q,
                    k,
                    v,
                    out: out.clone(),
                    lse: Arc::new(lse),
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        },
    )
}
