//! The fused varlen attention kernel (`crate::varlen_kernel`) as a
//! differentiable burn op.

use std::sync::Arc;

use burn::tensor::Tensor;

use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::varlen_kernel::{self, AttentionDims, Qkv};

/// Fused causal attention of every example of a flattened batch.
///
/// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]`, `cu_seqlens`: `B + 1` offsets
/// -> `[T, H, D]`.
pub fn varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    cu_seqlens: &[u32],
    scale: f32,
) -> Result<Tensor<3>, UnsupportedTensor> {
    let [_, num_heads, head_dim] = q.dims();
    let op = VarlenAttention {
        cu_seqlens: Arc::new(cu_seqlens.iter().map(|&offset| offset as usize).collect()),
        dims: AttentionDims {
            num_heads,
            num_kv_heads: k.dims()[1],
            head_dim,
        },
        scale,
    };
    apply(op, [q, k, v])
}

#[derive(Debug, Clone)]
struct VarlenAttention {
    cu_seqlens: Arc<Vec<usize>>,
    dims: AttentionDims,
    scale: f32,
}

impl HostOp<3> for VarlenAttention {
    /// Saves one log-sum-exp per row and head, `[T, H]`, not the `[L, L]`
    /// probabilities.
    fn forward(&self, [q, k, v]: [HostTensor<'_>; 3]) -> HostOutput {
        let inputs = Qkv {
            q: q.values,
            k: k.values,
            v: v.values,
        };
        let forward = varlen_kernel::forward(inputs, &self.cu_seqlens, self.dims, self.scale);
        HostOutput {
            values: forward.out,
            shape: q.shape.to_vec(),
            saved: forward.lse,
        }
    }

    fn backward(
        &self,
        [q, k, v]: [HostTensor<'_>; 3],
        output: &[f32],
        lse: &[f32],
        d_out: &[f32],
    ) -> [Vec<f32>; 3] {
        let inputs = Qkv {
            q: q.values,
            k: k.values,
            v: v.values,
        };
        let grads = varlen_kernel::backward(
            inputs,
            output,
            lse,
            d_out,
            &self.cu_seqlens,
            self.dims,
            self.scale,
        );
        [grads.dq, grads.dk, grads.dv]
    }
}
