//! A linear layer's product `y = x W^T` (HF's `[O, C]` weight) as one host
//! op: the output and both gradients (`dx = dy W`, `dW = dy^T x`) written
//! once each, straight from the inputs' buffers (`kernels/gemm.rs`), and
//! `dW` not computed at all for a frozen weight (LoRA's base, a frozen
//! head). burn's matmul computes the same products with the same gemm
//! kernels, but zeroes and then copies every output first (see
//! `gemm.rs`); it stays the oracle and the GPU's f32 path. `cube.rs` is
//! the GPU's `--bf16` op (16-bit operands on burn's matmul).
//!
//! # Shapes
//! `N` rows, `C` input width, `O` output width.

use std::sync::OnceLock;

use burn::tensor::FloatDType;

use super::attention::{cpu_only, is_cpu};
use super::bf16::{load, round_in_place, rounded_copy, store};
use super::gemm::{View, product};
use super::gemm_bf16::{self, View16, Weight16};
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::shared16::SharedInput16;
use crate::precision::HalfFloat;
use crate::tensor::{Tensor, linear, with_host_values};

#[cfg(feature = "cube")]
mod cube;
#[cfg(feature = "cube")]
pub use cube::F16_TARGET;
#[cfg(feature = "cube")]
pub(crate) use cube::{HalfGrad, half_copy, product as half_product, transposed};

/// `x W^T`: `[N, C]`, `[O, C]` -> `[N, O]`, differentiable in both.
///
/// On a GPU this is [`composed_linear`] (burn's matmul).
pub fn fused_linear(x: Tensor<2>, w: Tensor<2>) -> Result<Tensor<2>, UnsupportedTensor> {
    if !is_cpu(&x.device()) {
        return Ok(composed_linear(x, w));
    }
    apply::<_, 2, 2, 2>(Linear::default(), [x, w])
}

/// The oracle, and the GPU path: burn's `x.matmul(w^T)`.
pub fn composed_linear(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    linear(x, &w)
}

/// `x W^T` with bf16 operands and f32 accumulation (`--bf16`), as
/// autocast computes a linear layer: `x` and `dy` rounded to bf16 as the
/// products read them, `W` taken from `weight16`, its bf16 copy (made once
/// per optimizer step by the model) or `w` rounded as it is read; the
/// output rounded to bf16 (kept as f32), both gradients f32. `w` is still
/// an input: its gradient goes to the f32 master weight. The op keeps `x`
/// as it is (shared with the other layers that read it). `[N, C]`, `[O,
/// C]` -> `[N, O]`.
///
/// # Panics
/// When `weight16` does not hold `O * C` values (a bug in the caller).
pub fn bf16_linear(
    x: Tensor<2>,
    w: Tensor<2>,
    weight16: Weight16,
) -> Result<Tensor<2>, UnsupportedTensor> {
    bf16_op::<false>(x, w, weight16)
}

/// [`bf16_linear`] keeping `x` for the backward pass as bf16 (half its
/// memory), for an input no other op keeps (the MLP's `down_proj` after
/// SwiGLU). Exact when `x` holds bf16 values already, as SwiGLU's rounded
/// output does; otherwise the gradient of `W` sees `x` rounded, as the
/// forward product did.
pub fn bf16_linear_storing_input(
    x: Tensor<2>,
    w: Tensor<2>,
    weight16: Weight16,
) -> Result<Tensor<2>, UnsupportedTensor> {
    bf16_op::<true>(x, w, weight16)
}

fn bf16_op<const STORES_INPUT: bool>(
    x: Tensor<2>,
    w: Tensor<2>,
    weight16: Weight16,
) -> Result<Tensor<2>, UnsupportedTensor> {
    bf16_on_the_cpu(&x)?;
    let master = master_handle(&w, &weight16).filter(|_| STORES_INPUT);
    let op =
        Bf16Linear::<STORES_INPUT>::new(weight16, master, gemm_bf16::rounds_shared_operands_once());
    apply::<_, 2, 2, 2>(op, [x, w])
}

/// The bf16 linear ops' refusal off the CPU (a GPU's are `half_*`).
fn bf16_on_the_cpu(x: &Tensor<2>) -> Result<(), UnsupportedTensor> {
    cpu_only(
        &x.device(),
        "bf16 matmuls run on the CPU only in this build",
    )
}

/// Whether a linear op's gradients read input `index` (0: `x`, 1: `W`),
/// given which of them the graph tracks (`None`: not told yet, so yes):
/// `x` only for `dW`, `W` only for `dx`. A frozen layer under LoRA (the
/// default adapters leave `gate_proj` and `up_proj` frozen) needs not its
/// input.
fn read_by_gradients(tracked: Option<[bool; 2]>, index: usize) -> bool {
    tracked.is_none_or(|tracked| tracked[1 - index])
}

/// [`bf16_linear`] over an input other layers read too (`shared`, one
/// handle for all of them): kept once, as bf16, for all their backward
/// passes; the same output and gradients. `x` holds bf16 values (the
/// rounded norm's output: storing it is then exact).
pub fn bf16_linear_sharing_input(
    x: Tensor<2>,
    w: Tensor<2>,
    weight16: Weight16,
    shared: &SharedInput16,
) -> Result<Tensor<2>, UnsupportedTensor> {
    bf16_on_the_cpu(&x)?;
    let master = master_handle(&w, &weight16);
    let op = Bf16SharedLinear {
        weight16,
        master,
        shared: shared.clone(),
        tracked: None,
    };
    apply::<_, 2, 2, 2>(op, [x, w])
}

/// The bf16 linear op over a [`SharedInput16`].
#[derive(Debug, Clone)]
struct Bf16SharedLinear {
    weight16: Weight16,
    master: Option<Tensor<2>>,
    shared: SharedInput16,
    /// Which of `x` and `W` the graph tracks: a frozen `W` (LoRA leaves
    /// `gate_proj` and `up_proj` without adapters) makes no `dW`, so its
    /// op stores nothing; the group's store is made only if a reader that
    /// trains asks for it.
    tracked: Option<[bool; 2]>,
}

impl HostOp<2> for Bf16SharedLinear {
    /// Neither gradient reads the output.
    const KEEPS_OUTPUT: bool = false;
    /// `x` comes back from the shared store, `W` from its copy or master.
    const KEEPS_INPUTS: bool = false;

    fn tracking(self, tracked: [bool; 2]) -> Self {
        Self {
            tracked: Some(tracked),
            ..self
        }
    }

    fn forward(&self, [x, w]: [HostTensor<'_>; 2]) -> HostOutput {
        let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
        let makes_dw = read_by_gradients(self.tracked, 0);
        // The store where `dW` needs it or another reader made it; else
        // `x` itself, which the product rounds as it packs: the same
        // values (`x` holds bf16 values), so the same bits.
        let x16 = if makes_dw || self.shared.is_stored() {
            let stored = self.shared.stored(x.values);
            assert_eq!(stored.len(), n * c, "a shared input of another shape");
            View16::bf16(stored, n, c)
        } else {
            View16::f32(x.values, n, c)
        };
        let mut values = gemm_bf16::product(x16, self.weight16.view(w.values, o, c).t());
        round_in_place(&mut values);
        HostOutput {
            values,
            shape: vec![n, o],
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [x, w]: [HostTensor<'_>; 2],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
        needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
        let weight = (&self.weight16, self.master.as_ref(), w.values);
        bf16_gradients(d_out, [n, c, o], needed, weight, |dy| {
            gemm_bf16::product(dy.t(), View16::bf16(self.shared.values(), n, c))
        })
    }
}

/// Both gradients of a bf16 linear layer (`[N, C]` input, `[O, C]`
/// weight): `dx = dy W` with `weight` = (its bf16 copy, or the master
/// handle, or the kept master values), and `dW = dy^T x` from `dw`, given
/// `dy` as the products read it (each only where `needed`).
fn bf16_gradients(
    d_out: &[f32],
    [n, c, o]: [usize; 3],
    needed: [bool; 2],
    (weight16, master, w): (&Weight16, Option<&Tensor<2>>, &[f32]),
    dw: impl FnOnce(View16<'_>) -> Vec<f32>,
) -> [Vec<f32>; 2] {
    let mut shared = Vec::new();
    let dy = bf16_dy(d_out, [n, o], needed == [true, true], &mut shared);
    let dx = if needed[0] {
        bf16_dx(dy, weight16, master, w, [o, c])
    } else {
        Vec::new()
    };
    let dw = if needed[1] { dw(dy) } else { Vec::new() };
    [dx, dw]
}

/// A handle on the master weight `w` (`[O, C]`) for an op that keeps no
/// input and reads the weight rounded (`Weight16::Master`, no copy) in its
/// backward pass; the model holds the weight anyway.
///
/// # Panics
/// When `weight16` does not hold `O * C` values (a bug in the caller).
pub(crate) fn master_handle(w: &Tensor<2>, weight16: &Weight16) -> Option<Tensor<2>> {
    let [o, c] = w.dims();
    assert!(
        weight16.holds(o * c),
        "bf16 product: weight copy of another shape"
    );
    matches!(weight16, Weight16::Master).then(|| w.clone().detach())
}

/// `dy` (`[N, O]`) as a backward pass's bf16 products read it: rounded
/// once into `buffer` where both of them (`both`) read it and the body
/// would widen it for each.
pub(crate) fn bf16_dy<'a>(
    d_out: &'a [f32],
    [n, o]: [usize; 2],
    both: bool,
    buffer: &'a mut Vec<f32>,
) -> View16<'a> {
    if both && gemm_bf16::rounds_shared_operands_once() {
        *buffer = rounded_copy(d_out);
        View16::rounded(buffer, n, o)
    } else {
        View16::f32(d_out, n, o)
    }
}

/// `dx = dy W` with `W` (`[O, C]`) from its bf16 copy, or the master
/// weight rounded: `master`'s values where the op keeps no input, else
/// `w` (the kept input's values).
pub(crate) fn bf16_dx(
    dy: View16<'_>,
    weight16: &Weight16,
    master: Option<&Tensor<2>>,
    w: &[f32],
    [o, c]: [usize; 2],
) -> Vec<f32> {
    match master {
        Some(master) => with_host_values(master.clone(), |w| {
            gemm_bf16::product(dy, View16::f32(w, o, c))
        }),
        None => gemm_bf16::product(dy, weight16.view(w, o, c)),
    }
}

/// The oracle of [`bf16_linear`]: burn's f32 matmul of the bf16-rounded
/// operands, its output rounded (each rounding in the graph as the
/// identity's gradient, so the gradients are those of the rounded product;
/// `dy` is not rounded here, which the tests allow for).
pub fn composed_bf16_linear(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    round_tensor(linear(round_tensor(x), &round_tensor(w)))
}

/// `x` with its values rounded to bf16 (still f32), differentiable as the
/// identity (the straight-through gradient of rounding).
pub(crate) fn round_tensor(x: Tensor<2>) -> Tensor<2> {
    let dims = x.dims();
    let device = x.device();
    let values = crate::tensor::with_host_values(x.clone(), |v| {
        v.iter()
            .map(|&x| super::bf16::rounded(x))
            .collect::<Vec<f32>>()
    });
    let rounded = crate::tensor::float_tensor(values, dims, &device);
    // x + (rounded - x) with the difference off the graph.
    x.clone() + (rounded - x.detach())
}

/// `x W^T` on a GPU under `--bf16` (`cube.rs`): `x` and `dy` cast to the
/// 16-bit float of `weight16` (`[O, C]`, the weight's copy on the device,
/// bf16 or f16), products accumulated in f32; `w`'s gradient in f32.
/// `[N, C]`, `[O, C]` -> `[N, O]`.
pub fn half_linear(
    x: Tensor<2>,
    w: Tensor<2>,
    weight16: &Tensor<2>,
) -> Result<Tensor<2>, UnsupportedTensor> {
    #[cfg(feature = "cube")]
    return cube::half_linear(x, w, weight16);
    #[cfg(not(feature = "cube"))]
    {
        let _ = (x, w, weight16);
        Err(UnsupportedTensor(
            "padfree was built without its GPU kernels (feature `wgpu` or `cuda`)".into(),
        ))
    }
}

/// `x` with its values rounded to `half` (still f32), differentiable as
/// the identity: the GPU's counterpart of [`round_tensor`], for oracles and
/// composed paths.
pub fn round_to_half<const D: usize>(x: Tensor<D>, half: HalfFloat) -> Tensor<D> {
    let rounded = x.clone().detach().cast(half.dtype()).cast(FloatDType::F32);
    x.clone() + (rounded - x.detach())
}

/// The oracle of [`half_linear`]: burn's f32 matmul of the operands
/// rounded to `half`, the output rounded too in bf16 (as the op's is).
pub fn composed_half_linear(x: Tensor<2>, w: Tensor<2>, half: HalfFloat) -> Tensor<2> {
    let y = linear(round_to_half(x, half), &round_to_half(w, half));
    match half {
        HalfFloat::Bf16 => round_to_half(y, half),
        HalfFloat::F16 => y,
    }
}

/// The f32 linear op; `tracked`: which of `x` and `W` the graph wants a
/// gradient of (`W` frozen: no `dW`, so `x` is not kept; `x` off the
/// graph: no `dx`, so `W` is not kept).
#[derive(Debug, Clone, Default)]
struct Linear {
    tracked: Option<[bool; 2]>,
}

/// The bf16 linear op; `STORES_INPUT`: `x` kept as bf16 in `saved`
/// rather than as the input tensor.
#[derive(Debug, Clone)]
struct Bf16Linear<const STORES_INPUT: bool> {
    /// `[O, C]`: the weight's bf16 copy, or the master weight rounded.
    weight16: Weight16,
    /// The master weight, when it is read rounded by an op that keeps no
    /// input (`STORES_INPUT`).
    master: Option<Tensor<2>>,
    /// Whether `x` is scanned for bf16 values: on the widened body, which
    /// reads such an operand in place (the packed bodies round as they
    /// pack, and a scan would be a pass for nothing).
    scans_input: bool,
    /// What the forward pass's scan found: `x` holding bf16 values only
    /// (the rounded norm's output, attention's output), so that the
    /// backward pass reads the kept `x`, the tensor the forward pass read,
    /// in place without scanning it again.
    input_rounded: OnceLock<bool>,
    /// Which of `x` and `W` the graph tracks (as the f32 op's).
    tracked: Option<[bool; 2]>,
}

impl<const STORES_INPUT: bool> Bf16Linear<STORES_INPUT> {
    fn new(weight16: Weight16, master: Option<Tensor<2>>, scans_input: bool) -> Self {
        Self {
            weight16,
            master,
            scans_input,
            input_rounded: OnceLock::new(),
            tracked: None,
        }
    }
}

impl<const STORES_INPUT: bool> HostOp<2> for Bf16Linear<STORES_INPUT> {
    /// Neither gradient reads the output.
    const KEEPS_OUTPUT: bool = false;
    /// `W`'s values come from its copy; `x` from `saved` when stored.
    const KEEPS_INPUTS: bool = !STORES_INPUT;

    fn tracking(self, tracked: [bool; 2]) -> Self {
        Self {
            tracked: Some(tracked),
            ..self
        }
    }

    fn keeps_input(&self, index: usize) -> bool {
        read_by_gradients(self.tracked, index)
    }

    fn forward(&self, [x, w]: [HostTensor<'_>; 2]) -> HostOutput {
        let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
        // The widened body reads `x` in place when it holds bf16 values,
        // which it has to scan for: scanned once here, on all threads, and
        // the answer kept for the backward pass. (The product scanned it on
        // one thread, in each pass: at 2,870 rows SmolLM2-135M's `x W^T`
        // products ran 10-22% slower than f32's, 0-7% with `x` known
        // rounded.)
        let x16 = if self.scans_input {
            let x16 = View16::f32_or_rounded(x.values, n, c);
            if !STORES_INPUT {
                // Set once: an op's forward pass runs once.
                let _ = self.input_rounded.set(x16.reads_rounded());
            }
            x16
        } else {
            View16::f32(x.values, n, c)
        };
        let mut values = gemm_bf16::product(x16, self.weight16.view(w.values, o, c).t());
        round_in_place(&mut values);
        HostOutput {
            values,
            shape: vec![n, o],
            saved: if STORES_INPUT {
                store(x.values)
            } else {
                Vec::new()
            },
        }
    }

    fn backward(
        &self,
        [x, w]: [HostTensor<'_>; 2],
        _output: &[f32],
        saved: &[f32],
        d_out: &[f32],
        needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
        let weight = (&self.weight16, self.master.as_ref(), w.values);
        bf16_gradients(d_out, [n, c, o], needed, weight, |dy| {
            let loaded;
            let x_view = if STORES_INPUT {
                // Stored as bf16: its widened values are rounded already.
                loaded = load(saved, n * c);
                View16::rounded(&loaded, n, c)
            } else if self.input_rounded.get() == Some(&true) {
                View16::rounded(x.values, n, c)
            } else {
                View16::f32(x.values, n, c)
            };
            gemm_bf16::product(dy.t(), x_view)
        })
    }
}

impl HostOp<2> for Linear {
    /// Neither gradient reads the output.
    const KEEPS_OUTPUT: bool = false;

    fn tracking(self, tracked: [bool; 2]) -> Self {
        Self {
            tracked: Some(tracked),
        }
    }

    fn keeps_input(&self, index: usize) -> bool {
        read_by_gradients(self.tracked, index)
    }

    fn forward(&self, [x, w]: [HostTensor<'_>; 2]) -> HostOutput {
        let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
        HostOutput {
            values: product(
                View::row_major(x.values, n, c),
                View::row_major(w.values, o, c).t(),
            ),
            shape: vec![n, o],
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [x, w]: [HostTensor<'_>; 2],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
        needed: [bool; 2],
    ) -> [Vec<f32>; 2] {
        let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
        let dy = View::row_major(d_out, n, o);
        let dx = if needed[0] {
            product(dy, View::row_major(w.values, o, c))
        } else {
            Vec::new()
        };
        let dw = if needed[1] {
            product(dy.t(), View::row_major(x.values, n, c))
        } else {
            Vec::new()
        };
        [dx, dw]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{assert_within, random};
    use crate::tensor::{IntoHostVec, backward, cpu_device, float_tensor, frozen, grad, trainable};

    /// The op against burn's matmul: output and both gradients, the weight
    /// trainable and frozen. The same gemm kernels add the same products
    /// in the same order, so the values are expected equal; 1e-6 of the
    /// largest allows one rounding apart should gemm pick another split.
    #[test]
    fn op_matches_burns_matmul_trainable_or_frozen() {
        let device = cpu_device(true);
        for (n, c, o) in [(1, 3, 2), (37, 48, 29), (300, 64, 200)] {
            let (x0, w0, dy0) = (random(n * c, 1), random(o * c, 2), random(n * o, 3));
            for weight_trains in [true, false] {
                let run = |fused: bool| {
                    let x = trainable(float_tensor(x0.clone(), [n, c], &device));
                    let w = float_tensor(w0.clone(), [o, c], &device);
                    let w = if weight_trains {
                        trainable(w)
                    } else {
                        frozen(w)
                    };
                    let y = if fused {
                        fused_linear(x.clone(), w.clone()).expect("f32 on the CPU")
                    } else {
                        composed_linear(x.clone(), w.clone())
                    };
                    let dy = float_tensor(dy0.clone(), [n, o], &device);
                    let grads = backward(&(y.clone() * dy).sum());
                    let dx = grad(&x, &grads).expect("dx").into_vec();
                    let dw = grad(&w, &grads).map(IntoHostVec::into_vec);
                    (y.into_vec(), dx, dw)
                };
                let (ours, theirs) = (run(true), run(false));
                assert_eq!(ours.2.is_some(), weight_trains, "dW only when W trains");
                let mut pairs = vec![("y", ours.0, theirs.0), ("dx", ours.1, theirs.1)];
                if let (Some(a), Some(b)) = (ours.2, theirs.2) {
                    pairs.push(("dW", a, b));
                }
                for (what, a, b) in pairs {
                    assert_within(&format!("{what} [{n},{c},{o}]"), &a, &b, 1e-6);
                }
            }
        }
    }

    /// The bf16 op (keeping `x`, and storing it as bf16) against its
    /// oracle, burn's f32 matmul of the rounded operands with the output
    /// rounded, `dy` rounded to bf16 beforehand (as the op rounds it): the
    /// products are then the same sums of exact f32 products in another
    /// order, so 2e-6 of the largest value for the gradients; the outputs
    /// are rounded, so they agree exactly but where the sums straddle a
    /// rounding boundary (one bf16 step, 2^-8 relative: 1e-2 of the scale).
    #[test]
    fn bf16_op_matches_the_f32_product_of_rounded_operands() {
        use crate::kernels::bf16::{round_slice, rounded};
        let device = cpu_device(true);
        for (n, c, o) in [(1, 3, 2), (37, 48, 29), (300, 64, 200)] {
            let (x0, w0) = (random(n * c, 1), random(o * c, 2));
            let dy0: Vec<f32> = random(n * o, 3).into_iter().map(rounded).collect();
            let run = |fused: Option<bool>, from_copy: bool| {
                let x = trainable(float_tensor(x0.clone(), [n, c], &device));
                let w = trainable(float_tensor(w0.clone(), [o, c], &device));
                let weight16 = if from_copy {
                    Weight16::Copy(round_slice(&w0).into())
                } else {
                    Weight16::Master
                };
                let y = match fused {
                    Some(false) => bf16_linear(x.clone(), w.clone(), weight16),
                    Some(true) => bf16_linear_storing_input(x.clone(), w.clone(), weight16),
                    None => Ok(composed_bf16_linear(x.clone(), w.clone())),
                }
                .expect("f32 on the CPU");
                let dy = float_tensor(dy0.clone(), [n, o], &device);
                let grads = backward(&(y.clone() * dy).sum());
                let dx = grad(&x, &grads).expect("dx").into_vec();
                let dw = grad(&w, &grads).expect("dW").into_vec();
                (y.into_vec(), dx, dw)
            };
            let theirs = run(None, true);
            let ours = run(Some(false), true);
            // Storing `x` as bf16 changes nothing: the products round it
            // anyway; nor does reading the master weight rounded rather
            // than its bf16 copy: the same values.
            for stores in [false, true] {
                for from_copy in [false, true] {
                    let case = format!("storing x {stores}, from the copy {from_copy}");
                    assert_eq!(run(Some(stores), from_copy), ours, "{case}");
                }
            }
            // The outputs are rounded: equal, or one bf16 step apart where
            // the f32 sums differ in their last bits at a rounding tie.
            assert_within(&format!("y [{n},{c},{o}]"), &ours.0, &theirs.0, 1e-2);
            let exact = ours.0.iter().zip(&theirs.0).filter(|(a, b)| a == b).count();
            assert!(
                exact * 100 >= 99 * ours.0.len(),
                "y: {exact} of {} equal",
                ours.0.len()
            );
            assert_within(&format!("dx [{n},{c},{o}]"), &ours.1, &theirs.1, 2e-6);
            assert_within(&format!("dW [{n},{c},{o}]"), &ours.2, &theirs.2, 2e-6);
            // And it is not the f32 product: rounding changed the values.
            let f32_y = fused_linear(
                float_tensor(x0.clone(), [n, c], &device),
                float_tensor(w0.clone(), [o, c], &device),
            )
            .expect("f32")
            .into_vec();
            if c > 3 {
                assert_ne!(ours.0, f32_y, "bf16 rounding must show");
            }
        }
    }

    /// The f32 op (and the bf16 one) keeps `x` only for `dW` and `W` only
    /// for `dx`: a frozen layer under LoRA keeps no input (and the gradient
    /// tests above run a frozen `W` on the emptied `x`); before the op is
    /// told, both.
    #[test]
    fn the_f32_op_keeps_only_what_its_gradients_read() {
        let keeps = |tracked: Option<[bool; 2]>| {
            let op = match tracked {
                Some(tracked) => Linear::default().tracking(tracked),
                None => Linear::default(),
            };
            [op.keeps_input(0), op.keeps_input(1)]
        };
        assert_eq!(keeps(Some([true, false])), [false, true], "W frozen");
        assert_eq!(keeps(Some([false, true])), [true, false], "x off the graph");
        assert_eq!(keeps(Some([true, true])), [true, true]);
        assert_eq!(keeps(None), [true, true]);
        // The bf16 op that keeps its input as it is, likewise.
        let bf16 = Bf16Linear::<false>::new(Weight16::Master, None, false).tracking([true, false]);
        assert_eq!([bf16.keeps_input(0), bf16.keeps_input(1)], [false, true]);
    }

    /// Three bf16 layers over one input (q, k and v over a norm's rounded
    /// output), sharing one bf16 store of it or each keeping the f32
    /// tensor: the same outputs and gradients bit for bit (the input's and
    /// every weight's, from copies and from the master weights), and the
    /// store made once, by the first of them.
    #[test]
    fn layers_sharing_one_stored_input_are_the_layers_apart() {
        use crate::kernels::bf16::{round_slice, rounded};
        let device = cpu_device(true);
        let (n, c) = (53, 40);
        let outs = [24, 8, 8];
        let x0: Vec<f32> = random(n * c, 21).into_iter().map(rounded).collect();
        let w0: Vec<Vec<f32>> = (0..3).map(|k| random(outs[k] * c, 22 + k as u64)).collect();
        let run = |sharing: bool, from_copy: bool| {
            let x = trainable(float_tensor(x0.clone(), [n, c], &device));
            let shared = SharedInput16::default();
            let mut loss = None;
            let mut ws = Vec::new();
            for (k, &o) in outs.iter().enumerate() {
                let w = trainable(float_tensor(w0[k].clone(), [o, c], &device));
                let weight16 = if from_copy {
                    Weight16::Copy(round_slice(&w0[k]).into())
                } else {
                    Weight16::Master
                };
                let y = if sharing {
                    bf16_linear_sharing_input(x.clone(), w.clone(), weight16, &shared)
                } else {
                    bf16_linear(x.clone(), w.clone(), weight16)
                }
                .expect("f32 on the CPU");
                assert_eq!(shared.is_stored(), sharing, "stored by the first reader");
                let dy = float_tensor(random(n * o, 30 + k as u64), [n, o], &device);
                let term = (y * dy).sum();
                loss = Some(match loss {
                    Some(sum) => sum + term,
                    None => term,
                });
                ws.push(w);
            }
            let grads = backward(&loss.expect("three layers"));
            let mut out = vec![grad(&x, &grads).expect("dx").into_vec()];
            out.extend(ws.iter().map(|w| grad(w, &grads).expect("dW").into_vec()));
            out
        };
        for from_copy in [true, false] {
            let (ours, theirs) = (run(true, from_copy), run(false, from_copy));
            for (at, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(
                    a, b,
                    "gradient {at} (0: the input), from the copy {from_copy}"
                );
            }
        }
    }

    /// Readers whose weights are frozen (LoRA's `gate_proj` and `up_proj`)
    /// make no `dW`, so they leave the group's store unmade unless a
    /// reader that trains makes it: the same output and input gradient bit
    /// for bit as the layers apart, with every reader frozen (no store)
    /// and with the first frozen and the others trained (stored by the
    /// second).
    #[test]
    fn frozen_readers_store_nothing() {
        use crate::kernels::bf16::{round_slice, rounded};
        let device = cpu_device(true);
        let (n, c) = (37, 32);
        let outs = [16, 8, 8];
        let x0: Vec<f32> = random(n * c, 41).into_iter().map(rounded).collect();
        let w0: Vec<Vec<f32>> = (0..3).map(|k| random(outs[k] * c, 42 + k as u64)).collect();
        for trained in [[false, false, false], [false, true, true]] {
            let run = |sharing: bool| {
                let x = trainable(float_tensor(x0.clone(), [n, c], &device));
                let shared = SharedInput16::default();
                let mut loss = None;
                let mut ws = Vec::new();
                for (k, &o) in outs.iter().enumerate() {
                    let w = float_tensor(w0[k].clone(), [o, c], &device);
                    let w = if trained[k] { trainable(w) } else { w };
                    let weight16 = Weight16::Copy(round_slice(&w0[k]).into());
                    let y = if sharing {
                        bf16_linear_sharing_input(x.clone(), w.clone(), weight16, &shared)
                    } else {
                        bf16_linear(x.clone(), w.clone(), weight16)
                    }
                    .expect("f32 on the CPU");
                    if sharing {
                        let first_trained = trained.iter().position(|&t| t);
                        let stored = first_trained.is_some_and(|first| k >= first);
                        assert_eq!(shared.is_stored(), stored, "reader {k} of {trained:?}");
                    }
                    let dy = float_tensor(random(n * o, 50 + k as u64), [n, o], &device);
                    let term = (y.clone() * dy).sum();
                    loss = Some(match loss {
                        Some(sum) => sum + term,
                        None => term,
                    });
                    ws.push((y.into_vec(), w));
                }
                let grads = backward(&loss.expect("three layers"));
                let mut out = vec![grad(&x, &grads).expect("dx").into_vec()];
                for (k, (y, w)) in ws.iter().enumerate() {
                    out.push(y.clone());
                    if trained[k] {
                        out.push(grad(w, &grads).expect("dW").into_vec());
                    }
                }
                out
            };
            let (ours, theirs) = (run(true), run(false));
            assert_eq!(ours.len(), theirs.len());
            for (at, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(a, b, "value {at} (0: dx), trained {trained:?}");
            }
        }
    }

    /// The widened body's scan of `x`, forced on whatever body this CPU
    /// runs: the op gives the same bits with and without it, in both
    /// passes, for `x` rounded (found so, and read in place by the
    /// backward pass: debug builds assert it holds bf16 values) and not
    /// (found not to be, and scanned again by the backward product).
    #[test]
    fn the_input_is_scanned_once_and_changes_no_bit() {
        use crate::kernels::bf16::rounded;
        let (n, c, o) = (70, 48, 29);
        let w = random(o * c, 2);
        let dy = random(n * o, 3);
        for x_rounded in [true, false] {
            let x: Vec<f32> = random(n * c, 1)
                .into_iter()
                .map(|v| if x_rounded { rounded(v) } else { v })
                .collect();
            let (x_shape, w_shape) = ([n, c], [o, c]);
            let run = |scans: bool| {
                let op = Bf16Linear::<false>::new(Weight16::Master, None, scans);
                let inputs = || {
                    [
                        HostTensor {
                            values: &x,
                            shape: &x_shape,
                        },
                        HostTensor {
                            values: &w,
                            shape: &w_shape,
                        },
                    ]
                };
                let y = op.forward(inputs()).values;
                let [dx, dw] = op.backward(inputs(), &y, &[], &dy, [true, true]);
                (y, dx, dw, op.input_rounded.get().copied())
            };
            let (scanned, unscanned) = (run(true), run(false));
            assert_eq!(scanned.3, Some(x_rounded), "the scan's answer");
            assert_eq!(unscanned.3, None, "no scan");
            assert_eq!(scanned.0, unscanned.0, "output, x rounded: {x_rounded}");
            assert_eq!(scanned.1, unscanned.1, "dx, x rounded: {x_rounded}");
            assert_eq!(scanned.2, unscanned.2, "dW, x rounded: {x_rounded}");
        }
    }
}
