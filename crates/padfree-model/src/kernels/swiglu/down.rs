//! The MLP's tail as one op: `y = (silu(gate) * up) W^T`, SwiGLU and
//! `down_proj` together, keeping only `gate` and `up` for the backward
//! pass and making SwiGLU's output `h` again there. Apart, `down_proj`
//! kept `h` as its input beside SwiGLU's `gate` and `up`: a third of the
//! MLP's activations, `I` values a token and layer (f32, or bf16 under
//! `--bf16`). The backward pass makes `h` with the forward pass's kernel
//! and rounding, from the same `gate` and `up`, so the output and every
//! gradient are the pair's apart (`swiglu` then `fused_linear`;
//! `bf16_swiglu` then `bf16_linear_storing_input`) bit for bit (tested):
//! the price is one more SwiGLU pass over `[N, I]` a layer.
//!
//! CPU only, for a dense `down_proj` without an adapter
//! (`layers::Linear::forward_after_swiglu` chooses); a GPU, LoRA's
//! `down_proj` and a GGUF base keep the pair.
//!
//! # Shapes
//! `N` rows, `I` MLP width, `C` hidden size: `gate`, `up` and their
//! gradients `[N, I]`, `W` `[C, I]`, the output `[N, C]`.

use super::{backward as swiglu_backward, forward as swiglu_forward, forward_rounded};
use crate::kernels::attention::cpu_only;
use crate::kernels::bf16::{load, round_in_place, store};
use crate::kernels::gemm::{View, product};
use crate::kernels::gemm_bf16::{self, View16, Weight16};
use crate::kernels::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::kernels::linear::{bf16_dx, bf16_dy, master_handle};
use crate::tensor::Tensor;

/// `(silu(gate) * up) W^T` in f32, keeping `gate` and `up` (as the graph's
/// inputs) but not `silu(gate) * up`. `[N, I]`, `[N, I]`, `[C, I]` ->
/// `[N, C]`, differentiable in all three.
pub fn swiglu_down(
    gate: Tensor<2>,
    up: Tensor<2>,
    w: Tensor<2>,
) -> Result<Tensor<2>, UnsupportedTensor> {
    on_the_cpu(&gate)?;
    apply::<_, 3, 2, 2>(SwiGluDown, [gate, up, w])
}

/// [`swiglu_down`] under `--bf16`: `h` and the output rounded to bf16 as
/// [`super::bf16_swiglu`] and a bf16 linear layer round them, `W` read
/// from `weight16` (its copy, or the master weight rounded), `gate` and
/// `up` kept as bf16 (exact: they are bf16 linear layers' outputs).
///
/// # Panics
/// When `weight16` does not hold `C * I` values (a bug in the caller).
pub fn bf16_swiglu_down(
    gate: Tensor<2>,
    up: Tensor<2>,
    w: Tensor<2>,
    weight16: Weight16,
) -> Result<Tensor<2>, UnsupportedTensor> {
    on_the_cpu(&gate)?;
    // The op keeps no input: with no copy, the backward pass reads the
    // master weight from a handle of its own.
    let master = master_handle(&w, &weight16);
    apply::<_, 3, 2, 2>(Bf16SwiGluDown { weight16, master }, [gate, up, w])
}

fn on_the_cpu(x: &Tensor<2>) -> Result<(), UnsupportedTensor> {
    cpu_only(
        &x.device(),
        "SwiGLU and down_proj run as one op on the CPU only",
    )
}

#[derive(Debug, Clone)]
struct SwiGluDown;

impl HostOp<3> for SwiGluDown {
    /// No gradient reads the output.
    const KEEPS_OUTPUT: bool = false;

    fn forward(&self, [gate, up, w]: [HostTensor<'_>; 3]) -> HostOutput {
        let (n, i, c) = (gate.shape[0], gate.shape[1], w.shape[0]);
        let h = swiglu_forward(gate.values, up.values);
        HostOutput {
            values: product(
                View::row_major(&h, n, i),
                View::row_major(w.values, c, i).t(),
            ),
            shape: vec![n, c],
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [gate, up, w]: [HostTensor<'_>; 3],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
        needed: [bool; 3],
    ) -> [Vec<f32>; 3] {
        let (n, i, c) = (gate.shape[0], gate.shape[1], w.shape[0]);
        let dy = View::row_major(d_out, n, c);
        let dw = if needed[2] {
            let h = swiglu_forward(gate.values, up.values);
            product(dy.t(), View::row_major(&h, n, i))
        } else {
            Vec::new()
        };
        if !(needed[0] || needed[1]) {
            return [Vec::new(), Vec::new(), dw];
        }
        let dh = product(dy, View::row_major(w.values, c, i));
        let (d_gate, d_up) = swiglu_backward(gate.values, up.values, &dh);
        [d_gate, d_up, dw]
    }
}

#[derive(Debug, Clone)]
struct Bf16SwiGluDown {
    /// `[C, I]`: the weight's bf16 copy, or the master weight rounded.
    weight16: Weight16,
    /// The master weight, where it is read rounded (no copy).
    master: Option<Tensor<2>>,
}

impl HostOp<3> for Bf16SwiGluDown {
    /// No gradient reads the output.
    const KEEPS_OUTPUT: bool = false;
    /// `gate` and `up` come back from `saved`, `W` from its copy.
    const KEEPS_INPUTS: bool = false;

    fn forward(&self, [gate, up, w]: [HostTensor<'_>; 3]) -> HostOutput {
        let (n, i, c) = (gate.shape[0], gate.shape[1], w.shape[0]);
        let h = forward_rounded(gate.values, up.values);
        let mut values = gemm_bf16::product(
            View16::rounded(&h, n, i),
            self.weight16.view(w.values, c, i).t(),
        );
        round_in_place(&mut values);
        let mut saved = store(gate.values);
        saved.extend(store(up.values));
        HostOutput {
            values,
            shape: vec![n, c],
            saved,
        }
    }

    fn backward(
        &self,
        [gate, _, w]: [HostTensor<'_>; 3],
        _output: &[f32],
        saved: &[f32],
        d_out: &[f32],
        needed: [bool; 3],
    ) -> [Vec<f32>; 3] {
        let (n, i, c) = (gate.shape[0], gate.shape[1], w.shape[0]);
        let len = n * i;
        let (gate, up) = saved.split_at(len.div_ceil(2));
        let (gate, up) = (load(gate, len), load(up, len));
        let inputs_needed = needed[0] || needed[1];
        let mut shared = Vec::new();
        let dy = bf16_dy(d_out, [n, c], inputs_needed && needed[2], &mut shared);
        let dw = if needed[2] {
            let h = forward_rounded(&gate, &up);
            gemm_bf16::product(dy.t(), View16::rounded(&h, n, i))
        } else {
            Vec::new()
        };
        if !inputs_needed {
            return [Vec::new(), Vec::new(), dw];
        }
        let dh = bf16_dx(dy, &self.weight16, self.master.as_ref(), w.values, [c, i]);
        let (d_gate, d_up) = swiglu_backward(&gate, &up, &dh);
        [d_gate, d_up, dw]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::{round_slice, rounded};
    use crate::kernels::test_util::random;
    use crate::kernels::{bf16_linear_storing_input, bf16_swiglu, fused_linear, swiglu};
    use crate::tensor::{IntoHostVec, backward, cpu_device, float_tensor, frozen, grad, trainable};

    /// Output, `d gate`, `d up` and `dW` (empty where `W` is frozen).
    type Run = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

    /// The MLP's tail over `gate`, `up` `[n, i]` and `W` `[c, i]` under
    /// an upstream gradient: fused (`Some(weight16)` under bf16, its
    /// copy or the master weight) or as the pair apart.
    fn tail([n, i, c]: [usize; 3], bf16: Option<bool>, fused: bool, w_trains: bool) -> Run {
        let device = cpu_device(true);
        let round = |v: Vec<f32>| match bf16 {
            // A bf16 linear layer's outputs hold bf16 values.
            Some(_) => v.into_iter().map(rounded).collect(),
            None => v,
        };
        let (gate0, up0) = (round(random(n * i, 11)), round(random(n * i, 12)));
        let w0 = random(c * i, 13);
        let gate = trainable(float_tensor(gate0, [n, i], &device));
        let up = trainable(float_tensor(up0, [n, i], &device));
        let w = float_tensor(w0.clone(), [c, i], &device);
        let w = if w_trains { trainable(w) } else { frozen(w) };
        let weight16 = |from_copy: bool| {
            if from_copy {
                Weight16::Copy(round_slice(&w0).into())
            } else {
                Weight16::Master
            }
        };
        let y = match (bf16, fused) {
            (None, true) => swiglu_down(gate.clone(), up.clone(), w.clone()),
            (None, false) => {
                swiglu(gate.clone(), up.clone()).and_then(|h| fused_linear(h, w.clone()))
            }
            (Some(copy), true) => {
                bf16_swiglu_down(gate.clone(), up.clone(), w.clone(), weight16(copy))
            }
            (Some(copy), false) => bf16_swiglu(gate.clone(), up.clone())
                .and_then(|h| bf16_linear_storing_input(h, w.clone(), weight16(copy))),
        }
        .expect("f32 on the CPU");
        let dy = float_tensor(random(n * c, 14), [n, c], &device);
        let grads = backward(&(y.clone() * dy).sum());
        let dw = grad(&w, &grads)
            .map(IntoHostVec::into_vec)
            .unwrap_or_default();
        (
            y.into_vec(),
            grad(&gate, &grads).expect("d gate").into_vec(),
            grad(&up, &grads).expect("d up").into_vec(),
            dw,
        )
    }

    /// Fused, the tail gives the pair's output and gradients bit for bit,
    /// in f32 and under bf16 (weight from its copy and rounded from the
    /// master), with `W` training and frozen, on sizes that are not
    /// multiples of any vector or tile (and one row).
    #[test]
    fn the_fused_tail_is_swiglu_then_down_proj_bit_for_bit() {
        for shape in [[1, 7, 3], [37, 301, 45], [130, 96, 70]] {
            for bf16 in [None, Some(true), Some(false)] {
                for w_trains in [true, false] {
                    let case = format!("{shape:?}, bf16 {bf16:?}, W trains {w_trains}");
                    let ours = tail(shape, bf16, true, w_trains);
                    let theirs = tail(shape, bf16, false, w_trains);
                    assert_eq!(ours.0, theirs.0, "output, {case}");
                    assert_eq!(ours.1, theirs.1, "d gate, {case}");
                    assert_eq!(ours.2, theirs.2, "d up, {case}");
                    assert_eq!(ours.3, theirs.3, "dW, {case}");
                    assert_eq!(ours.3.is_empty(), !w_trains, "dW made, {case}");
                }
            }
        }
        // It bites: bf16 rounds, so the precisions differ.
        assert_ne!(
            tail([37, 301, 45], None, true, true).0,
            tail([37, 301, 45], Some(true), true, true).0
        );
    }

    /// What the bf16 op keeps: `gate` and `up` as bf16, half the f32 slots
    /// each, and no `h` (the pair kept `h` too, in `down_proj`).
    #[test]
    fn the_bf16_tail_keeps_gate_and_up_as_bf16_and_no_h() {
        let (n, i, c) = (5, 33, 4);
        let (gate, up, w) = (random(n * i, 1), random(n * i, 2), random(c * i, 3));
        let op = Bf16SwiGluDown {
            weight16: Weight16::Master,
            master: None,
        };
        let view = |values, shape| HostTensor { values, shape };
        let saved = op
            .forward([view(&gate, &[n, i]), view(&up, &[n, i]), view(&w, &[c, i])])
            .saved;
        assert_eq!(saved.len(), 2 * (n * i).div_ceil(2));
        const { assert!(!Bf16SwiGluDown::KEEPS_INPUTS && !Bf16SwiGluDown::KEEPS_OUTPUT) };
    }
}
