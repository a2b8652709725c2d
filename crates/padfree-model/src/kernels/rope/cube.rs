//! The CubeCL body of the rotary embedding, forward and back, one
//! invocation per element: `out[i] = x[i] c_i + r[i] s_i` with `r = (-x2,
//! x1)` (rotate-half), and for the gradient its transpose, `dx[i] = g[i]
//! c_i + r'[i] s_i` with `r' = (g2, -g1)`. One read of `x` (two of its floats)
//! and one write per element, where the composed form takes two slices, a
//! negation, a concatenation, two products and a sum (each a fresh `[N, H,
//! D]` tensor). It keeps neither its input nor its output: the rotation is
//! linear and its tables are constants. The products and sums are the
//! composed form's own, in its order (`x1 c + (-x2) s`).
//!
//! # Shapes
//! `x`, `out` and their gradients: `[N, H, D]`; `cos`, `sin`: `[N, 1, D]`
//! (each pair's value twice, as the composed form broadcasts them); all
//! contiguous f32.

use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_op::{CubeOp, apply, contiguous_primitive, empty_like, grid};
use crate::kernels::host_op::UnsupportedTensor;

#[cube(launch)]
fn turn_kernel(
    x: &Tensor<f32>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<f32>,
    #[comptime] heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] back: bool,
) {
    let at = ABSOLUTE_POS;
    if at < out.len() {
        let half = head_dim / 2;
        let i = at % head_dim;
        let t = at / (heads * head_dim);
        let table = t * head_dim + i;
        // The partner of element `i` in its pair, signed as rotate-half
        // has it forward; its transpose (back) is the opposite sign.
        let forward = if i < half {
            -x[at + half]
        } else {
            x[at - half]
        };
        let partner = if back { -forward } else { forward };
        out[at] = x[at] * cos[table] + partner * sin[table];
    }
}

/// `x` (`[N, H, D]`) turned by the tables, forward or back.
fn turn(x: &CubeTensor, cos: &CubeTensor, sin: &CubeTensor, back: bool) -> CubeTensor {
    let shape = x.meta.shape().to_vec();
    let (heads, head_dim) = (shape[1], shape[2]);
    let out = empty_like(x, shape.clone());
    let (count, dim) = grid(x, shape.iter().product());
    turn_kernel::launch(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        cos.clone().into_tensor_arg(),
        sin.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        heads,
        head_dim,
        back,
    );
    out
}

/// The differentiable op on a CubeCL device: `x` `[N, H, D]`, the `[N, 1,
/// D]` tables -> `[N, H, D]`.
pub(super) fn rope(
    x: BurnTensor<3>,
    cos: &BurnTensor<3>,
    sin: &BurnTensor<3>,
) -> Result<BurnTensor<3>, UnsupportedTensor> {
    let rope = Rope {
        cos: contiguous_primitive(cos)?,
        sin: contiguous_primitive(sin)?,
    };
    apply(&rope, [x])
}

/// The op: the tables, constants of the batch.
struct Rope {
    cos: CubeTensor,
    sin: CubeTensor,
}

/// What the backward pass reads: the tables only.
#[derive(Debug, Clone)]
struct Saved {
    cos: CubeTensor,
    sin: CubeTensor,
}

impl CubeOp<1> for Rope {
    type Saved = Saved;

    fn forward(&self, [x]: [CubeTensor; 1]) -> (CubeTensor, Saved) {
        let out = turn(&x, &self.cos, &self.sin, false);
        let saved = Saved {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
        };
        (out, saved)
    }

    fn backward(saved: &Saved, d_out: CubeTensor) -> [CubeTensor; 1] {
        let d_out = burn_cubecl::kernel::into_contiguous(d_out);
        [turn(&d_out, &saved.cos, &saved.sin, true)]
    }
}
