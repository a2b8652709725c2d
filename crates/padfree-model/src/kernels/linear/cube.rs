//! `--bf16` on a GPU: a linear layer's products with 16-bit operands and
//! f32 accumulation, as autocast computes them, on burn's CubeCL matmul
//! (which accumulates 16-bit operands in f32 and can write f32).
//!
//! - **Forward**: `x` cast to the 16-bit float (`bf16`, or `f16` where the
//!   runtime has no bf16), times the weight's 16-bit copy (made once per
//!   optimizer step by the model, `precision.rs`), the product written in
//!   f32. In bf16 the output is then rounded to bf16, as autocast's is; in
//!   f16 it stays f32 (an activation past f16's 65,504 would overflow).
//! - **Kept for the backward pass**: the 16-bit `x` (half its f32 bytes)
//!   and the weight's copy; the f32 `x` is not held by this op. An `x`
//!   given in 16 bits already is kept as given: the attention's and the
//!   MLP's projections cast their shared input once, so one 16-bit copy
//!   serves all of them. `dx` leaves in f32 either way (burn's cast
//!   passes it on as the cast's input type).
//! - **Backward**: `dy` cast to the 16-bit float, then `dx = dy W` and
//!   `dW = dy^T x`, both 16-bit products written in f32. In f16 `dy` is
//!   first scaled by the power of two that puts its largest magnitude in
//!   `[2^13, 2^14)` ([`F16_TARGET`]) and the products are scaled back in
//!   f32: a per-op loss scale, computed on the device (no read-back), so
//!   that small gradients neither flush to zero nor large ones overflow
//!   (bf16 has f32's range and needs none). A power of two, because
//!   scaling by one commutes with rounding: an example's gradients do not
//!   depend on the other examples of its batch (which set the largest
//!   magnitude), as `padfree check` requires.
//!
//! The oracle is burn's f32 matmul of the operands rounded to the same
//! 16-bit float (`tests/gpu_half.rs`).
//!
//! # Shapes
//! `x`: `[N, C]`, `w` and its copy: `[O, C]`, `y`, `dy`: `[N, O]`.

use burn::tensor::{DType, Tensor as BurnTensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

use crate::kernels::cube_op::{CubeOp, apply, contiguous_primitive, empty_like};
use crate::kernels::host_op::UnsupportedTensor;
use crate::precision::HalfFloat;
use crate::tensor::Tensor as ModelTensor;

/// Where f16's scaled output gradient puts its largest magnitude: in
/// `[F16_TARGET / 2, F16_TARGET)`, 2^14 being a factor of 4 under f16's
/// largest finite value and 38 binades above its smallest subnormal.
pub const F16_TARGET: f32 = 16_384.0;

/// The smallest largest magnitude a scale is made for (about 2^-100):
/// the scale, at most 2^113, stays finite in f32.
const SMALLEST: f32 = 1e-30;

/// `scale = 2^k` with `largest[0] * scale` in `[F16_TARGET / 2,
/// F16_TARGET)`, and `unscale = 2^-k`, by doubling and halving (every step
/// exact; at most ~113 steps from [`SMALLEST`], well under lavapipe's loop
/// limit), on one thread: a power of two so that scaling commutes with
/// f16's rounding, and the products of a row do not depend on which
/// other rows share its batch.
#[cube(launch)]
fn power_of_two_scale_kernel(
    largest: &Tensor<f32>,
    scale: &mut Tensor<f32>,
    unscale: &mut Tensor<f32>,
    target: f32,
) {
    if ABSOLUTE_POS == 0 {
        let m = largest[0];
        let mut s = 1.0f32;
        let mut u = 1.0f32;
        while m * s < target * 0.5 {
            s *= 2.0;
            u *= 0.5;
        }
        while m * s >= target {
            s *= 0.5;
            u *= 2.0;
        }
        scale[0] = s;
        unscale[0] = u;
    }
}

/// `(scale, unscale)`, `[1]` each, of `largest` (`[1]`, positive): see
/// [`power_of_two_scale_kernel`].
fn power_of_two_scale(largest: CubeTensor) -> (CubeTensor, CubeTensor) {
    let largest = into_contiguous(largest);
    let (scale, unscale) = (empty_like(&largest, vec![1]), empty_like(&largest, vec![1]));
    power_of_two_scale_kernel::launch(
        &largest.client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        largest.clone().into_tensor_arg(),
        scale.clone().into_tensor_arg(),
        unscale.clone().into_tensor_arg(),
        F16_TARGET,
    );
    (scale, unscale)
}

/// `x W^T` with `weight16` (`[O, C]`, bf16 or f16, off the graph) as the
/// product's weight; `w` (f32, `[O, C]`) receives the gradient.
pub(crate) fn half_linear(
    x: ModelTensor<2>,
    w: ModelTensor<2>,
    weight16: &ModelTensor<2>,
) -> Result<ModelTensor<2>, UnsupportedTensor> {
    let (w16, half) = half_copy(weight16)?;
    apply(&HalfLinear { w16, half }, [x, w])
}

/// A weight's 16-bit copy (off the graph) as the kernels read it, and its
/// float; anything else is refused.
pub(crate) fn half_copy(
    copy: &ModelTensor<2>,
) -> Result<(CubeTensor, HalfFloat), UnsupportedTensor> {
    let half = HalfFloat::of(copy.dtype()).ok_or_else(|| {
        UnsupportedTensor(format!(
            "a 16-bit weight copy was expected, not {:?}",
            copy.dtype()
        ))
    })?;
    Ok((contiguous_primitive(copy)?, half))
}

/// The op: the weight's 16-bit copy and its float.
struct HalfLinear {
    w16: CubeTensor,
    half: HalfFloat,
}

/// What the backward pass reads: the 16-bit `x` and weight.
#[derive(Debug, Clone)]
struct Saved {
    x16: CubeTensor,
    w16: CubeTensor,
    half: HalfFloat,
}

/// `a @ b` of 16-bit operands, accumulated and written in f32.
pub(crate) fn product(a: CubeTensor, b: CubeTensor) -> CubeTensor {
    match matmul(a, b, None, MatmulStrategy::default(), DType::F32) {
        Ok(out) => out,
        // burn's own matmul op panics the same way on a setup error.
        Err(err) => panic!("16-bit matmul: {err:?}"),
    }
}

/// A CubeCL primitive as a (plain) tensor, for burn's ops on it.
fn wrap<const D: usize>(t: CubeTensor) -> BurnTensor<D> {
    BurnTensor::from_primitive::<CubeBackend>(t)
}

fn unwrap<const D: usize>(t: BurnTensor<D>) -> CubeTensor {
    match t.try_into_primitive::<CubeBackend>() {
        Ok(t) => t,
        Err(err) => unreachable!("a CubeCL tensor stays one: {err:?}"),
    }
}

/// `t^T` (a view).
pub(crate) fn transposed(t: &CubeTensor) -> CubeTensor {
    unwrap(wrap::<2>(t.clone()).transpose())
}

impl CubeOp<2> for HalfLinear {
    type Saved = Saved;

    fn forward(&self, [x, _w]: [CubeTensor; 2]) -> (CubeTensor, Saved) {
        // An input cast already (shared by the layer's projections) is kept
        // as it is; `cast` returns a tensor of the same type unchanged.
        let x16 = cast(x, self.half.storage());
        let mut y = product(x16.clone(), transposed(&self.w16));
        if self.half == HalfFloat::Bf16 {
            y = cast(cast(y, DType::BF16), DType::F32);
        }
        let saved = Saved {
            x16,
            w16: self.w16.clone(),
            half: self.half,
        };
        (y, saved)
    }

    fn backward(saved: &Saved, d_out: CubeTensor) -> [CubeTensor; 2] {
        let dy = HalfGrad::new(d_out, saved.half);
        [
            dy.times(saved.w16.clone()),
            dy.transposed_times(saved.x16.clone()),
        ]
    }
}

/// An output gradient cast to a 16-bit float for the products of a
/// backward pass, scaled first in f16 (see the module docs): products
/// through it come back in f32, unscaled.
pub(crate) struct HalfGrad {
    dy16: CubeTensor,
    /// The power of two `dy` was scaled by, inverted, `[1, 1]` on the
    /// device, in f16.
    unscale: Option<BurnTensor<2>>,
}

impl HalfGrad {
    /// `dy` (f32, `[N, O]`) as the products read it.
    pub(crate) fn new(dy: CubeTensor, half: HalfFloat) -> Self {
        let dy = wrap::<2>(dy);
        let (dy, unscale) = match half {
            HalfFloat::Bf16 => (dy, None),
            HalfFloat::F16 => {
                // An all-zero `dy` keeps a finite scale (and zero products).
                let largest = dy.clone().abs().max().clamp_min(SMALLEST);
                let (scale, unscale) = power_of_two_scale(unwrap(largest));
                (
                    dy * wrap::<1>(scale).unsqueeze::<2>(),
                    Some(wrap::<1>(unscale).unsqueeze::<2>()),
                )
            }
        };
        Self {
            dy16: cast(unwrap(dy), half.storage()),
            unscale,
        }
    }

    fn unscaled(&self, product: CubeTensor) -> CubeTensor {
        match &self.unscale {
            Some(unscale) => unwrap(wrap::<2>(product) * unscale.clone()),
            None => product,
        }
    }

    /// `dy w`, f32: `w` 16-bit, `[O, C]` -> `[N, C]`.
    pub(crate) fn times(&self, w: CubeTensor) -> CubeTensor {
        self.unscaled(product(self.dy16.clone(), w))
    }

    /// `dy^T x`, f32: `x` 16-bit, `[N, C]` -> `[O, C]`.
    pub(crate) fn transposed_times(&self, x: CubeTensor) -> CubeTensor {
        self.unscaled(product(transposed(&self.dy16), x))
    }
}
