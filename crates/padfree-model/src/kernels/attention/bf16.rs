//! The varlen attention under `--bf16`: what autocast's bf16
//! `scaled_dot_product_attention` takes, computes and keeps.
//!
//! - Queries, keys and values are rounded to bf16 (nearest even) on the way
//!   in, as autocast casts them, and the output is rounded to bf16, as
//!   autocast's bf16 output is.
//! - The kernel is `products.rs`: its two products (five in the backward
//!   pass) on the bf16 gemm, the softmax's numerators, `P` and `dS`
//!   rounded to bf16 before the products that read them, as PyTorch's CPU
//!   flash attention does; the scores, the softmax, its log-sum-exp and
//!   every sum are f32.
//! - For the backward pass the op keeps `q`, `k`, `v` and its output as bf16
//!   (half their f32 bytes, and exact: they are bf16 values) plus the f32
//!   log-sum-exp, instead of the f32 input tensors. Its output is
//!   bf16-valued, and `o_proj` reads it for its own gradient: given an
//!   [`SharedInput16`] store, the op keeps its output there, once for both
//!   (`o_proj` through `kernels::bf16_linear_sharing_input`), where each
//!   kept a bf16 copy before (2 bytes a value of `[T, H, D]` a layer).
//! - `dO` is rounded to bf16 (the gradient of a bf16 output); the gradients
//!   leave in f32, and the projections round them to bf16 as their products
//!   read them (torch rounds them here, before RoPE's backward: a stated
//!   difference of one rounding).
//!
//! Tested: bit for bit the products kernel on rounded inputs (which is
//! tested against the f64 definition within the rounding's bound), and
//! through burn's autodiff against the composed oracle.
//!
//! # Shapes
//! `q`, `out`, `dq`: `[T, H, D]`; `k`, `v`, `dk`, `dv`: `[T, Hkv, D]`;
//! `lse`: `[T, H]`.

use super::host::Qkv;
use super::products;
use super::{AttentionRows, VarlenAttention};
use crate::kernels::bf16::{load, round_in_place, store, widen_slice};
use crate::kernels::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::kernels::shared16::SharedInput16;
use crate::tensor::Tensor;

/// [`super::varlen_attention`] under `--bf16` (see the module docs):
/// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]` -> `[T, H, D]`, bf16-valued.
/// With `output_store` the output is kept there (for the layer that
/// reads it too) instead of in the op's own state.
pub fn bf16_varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    rows: &AttentionRows,
    scale: f32,
    output_store: Option<SharedInput16>,
) -> Result<Tensor<3>, UnsupportedTensor> {
    if rows.blocks.is_some() {
        return Err(UnsupportedTensor(
            "bf16 attention runs on the CPU only in this build".into(),
        ));
    }
    let op = Bf16VarlenAttention {
        attention: VarlenAttention {
            cu_seqlens: rows.cu_seqlens.clone(),
            dims: super::dims_of(&q, &k),
            scale,
        },
        output_store,
    };
    apply(op, [q, k, v])
}

/// The f32 op's settings and kernel, with bf16 in, out and kept.
#[derive(Debug, Clone)]
struct Bf16VarlenAttention {
    attention: VarlenAttention,
    /// Where the output is kept when another op reads it too; `None`:
    /// in `saved`.
    output_store: Option<SharedInput16>,
}

/// `values` rounded to bf16, kept as f32.
fn rounded(values: &[f32]) -> Vec<f32> {
    let mut out = values.to_vec();
    round_in_place(&mut out);
    out
}

/// `[q, k, v, out, lse]` of `saved`: `q`, `k`, `v` and `out` as packed bf16
/// pairs (`len.div_ceil(2)` slots each; `out` empty where it is kept in
/// an [`SharedInput16`], `out_kept`), then the f32 `lse`.
fn split_saved(saved: &[f32], q_len: usize, kv_len: usize, out_kept: bool) -> [&[f32]; 5] {
    let (q, rest) = saved.split_at(q_len.div_ceil(2));
    let (k, rest) = rest.split_at(kv_len.div_ceil(2));
    let (v, rest) = rest.split_at(kv_len.div_ceil(2));
    let out_len = if out_kept { q_len.div_ceil(2) } else { 0 };
    let (out, lse) = rest.split_at(out_len);
    [q, k, v, out, lse]
}

impl HostOp<3> for Bf16VarlenAttention {
    /// All of it comes back from `saved`, in bf16.
    const KEEPS_OUTPUT: bool = false;
    const KEEPS_INPUTS: bool = false;

    fn forward(&self, [q, k, v]: [HostTensor<'_>; 3]) -> HostOutput {
        let shape = q.shape.to_vec();
        let (q, k, v) = (rounded(q.values), rounded(k.values), rounded(v.values));
        let VarlenAttention {
            cu_seqlens,
            dims,
            scale,
        } = &self.attention;
        let inputs = Qkv {
            q: &q,
            k: &k,
            v: &v,
        };
        let result = products::forward(inputs, cu_seqlens, *dims, *scale);
        let mut out = result.out;
        round_in_place(&mut out);
        let mut saved = store(&q);
        saved.extend(store(&k));
        saved.extend(store(&v));
        match &self.output_store {
            Some(kept) => kept.keep(&out),
            None => saved.extend(store(&out)),
        }
        saved.extend(result.lse);
        HostOutput {
            values: out,
            shape,
            saved,
        }
    }

    fn backward(
        &self,
        [q, k, _]: [HostTensor<'_>; 3],
        _output: &[f32],
        saved: &[f32],
        d_out: &[f32],
        _needed: [bool; 3],
    ) -> [Vec<f32>; 3] {
        let q_len: usize = q.shape.iter().product();
        let kv_len: usize = k.shape.iter().product();
        let out_kept = self.output_store.is_none();
        let [q16, k16, v16, out16, lse] = split_saved(saved, q_len, kv_len, out_kept);
        let out = match &self.output_store {
            Some(kept) => widen_slice(kept.values()),
            None => load(out16, q_len),
        };
        assert_eq!(
            out.len(),
            q_len,
            "bf16 attention: a kept output of another shape"
        );
        let (q, k, v) = (load(q16, q_len), load(k16, kv_len), load(v16, kv_len));
        let inputs = Qkv {
            q: &q,
            k: &k,
            v: &v,
        };
        // The gradient of a bf16 output is bf16.
        let d_out = rounded(d_out);
        let VarlenAttention {
            cu_seqlens,
            dims,
            scale,
        } = &self.attention;
        let grads = products::backward(inputs, (&out, lse, &d_out), cu_seqlens, *dims, *scale);
        [grads.dq, grads.dk, grads.dv]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::AttentionDims;
    use crate::kernels::bf16::rounded as round_one;
    use crate::kernels::{CausalMasks, composed_varlen_attention};
    use crate::tensor::{
        IntoHostVec, backward as run_backward, cpu_device, float_tensor, grad, trainable,
    };
    use padfree_pack::BatchMeta;

    /// Ragged examples (one of length 1), GQA 2:1, values of O(1) with
    /// bits below bf16's precision, so that rounding matters.
    fn case() -> (Vec<u32>, AttentionDims, [Vec<f32>; 3], Vec<f32>) {
        let dims = AttentionDims {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 10,
        };
        let lengths = [7, 1, 13];
        let t: usize = lengths.iter().sum();
        let cu = BatchMeta::from_lengths(lengths)
            .expect("lengths")
            .cu_seqlens()
            .to_vec();
        let wave = |n: usize, seed: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as f32 * 0.731 + seed).sin() * 1.37) + 1e-4 * (i % 7) as f32)
                .collect()
        };
        let inputs = [
            wave(t * dims.q_row(), 0.1),
            wave(t * dims.kv_row(), 1.7),
            wave(t * dims.kv_row(), 2.9),
        ];
        let d_out = wave(t * dims.q_row(), 4.3);
        (cu, dims, inputs, d_out)
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|x| x.to_bits()).collect()
    }

    /// Forward: bit for bit the products kernel (`products.rs`) on
    /// rounded inputs, its output rounded. Backward: the same kernel on the
    /// same rounded inputs, the rounded output and the rounded `d_out`, so
    /// bit for bit as well. And the op keeps nothing in f32 but the
    /// log-sum-exp.
    #[test]
    fn bf16_op_is_the_products_kernel_on_rounded_values() {
        let (cu, dims, [q, k, v], d_out) = case();
        let t = *cu.last().expect("offsets") as usize;
        let (qr, kr, vr) = (rounded(&q), rounded(&k), rounded(&v));
        let rounded_inputs = Qkv {
            q: &qr,
            k: &kr,
            v: &vr,
        };
        let kernel = products::forward(rounded_inputs, &cu, dims, 0.3);
        let expected_out: Vec<f32> = kernel.out.iter().map(|&x| round_one(x)).collect();

        // Kept in the op's own state, and in a store another op reads.
        for output_store in [None, Some(SharedInput16::default())] {
            let op = Bf16VarlenAttention {
                attention: VarlenAttention {
                    cu_seqlens: cu.clone().into(),
                    dims,
                    scale: 0.3,
                },
                output_store: output_store.clone(),
            };
            let q_shape = [t, dims.num_heads, dims.head_dim];
            let kv_shape = [t, dims.num_kv_heads, dims.head_dim];
            let output = op.forward([
                HostTensor {
                    values: &q,
                    shape: &q_shape,
                },
                HostTensor {
                    values: &k,
                    shape: &kv_shape,
                },
                HostTensor {
                    values: &v,
                    shape: &kv_shape,
                },
            ]);
            assert_eq!(output.shape, q_shape.to_vec());
            assert_eq!(
                bits(&output.values),
                bits(&expected_out),
                "forward differs from the products kernel on rounded inputs"
            );
            // q, k, v and out at 2 bytes a value, lse at 4; out in the
            // store instead where there is one, the output's bits.
            let (q_len, kv_len) = (t * dims.q_row(), t * dims.kv_row());
            let out_slots = if output_store.is_some() {
                0
            } else {
                q_len.div_ceil(2)
            };
            assert_eq!(
                output.saved.len(),
                out_slots + q_len.div_ceil(2) + 2 * kv_len.div_ceil(2) + t * dims.num_heads
            );
            if let Some(kept) = &output_store {
                assert_eq!(bits(&widen_slice(kept.values())), bits(&expected_out));
            }

            // KEEPS_INPUTS is false: the backward pass gets shapes, no values.
            let grads = op.backward(
                [
                    HostTensor {
                        values: &[],
                        shape: &q_shape,
                    },
                    HostTensor {
                        values: &[],
                        shape: &kv_shape,
                    },
                    HostTensor {
                        values: &[],
                        shape: &kv_shape,
                    },
                ],
                &[],
                &output.saved,
                &d_out,
                [true; 3],
            );
            let saved = (
                expected_out.as_slice(),
                kernel.lse.as_slice(),
                &rounded(&d_out)[..],
            );
            let expected = products::backward(rounded_inputs, saved, &cu, dims, 0.3);
            for (name, got, want) in [
                ("dq", &grads[0], &expected.dq),
                ("dk", &grads[1], &expected.dk),
                ("dv", &grads[2], &expected.dv),
            ] {
                assert_eq!(
                    bits(got),
                    bits(want),
                    "{name} differs from the products kernel on rounded values"
                );
            }
        }
        // Rounding mattered: the raw inputs hold bits below bf16's.
        for (raw, rounded) in [(&q, &qr), (&k, &kr), (&v, &vr)] {
            assert!(raw.iter().zip(rounded).any(|(a, b)| a != b));
        }
    }

    /// Through burn's autodiff: the op's output and gradients against the
    /// composed oracle (burn ops, one example at a time) on the rounded
    /// inputs; the output is bf16-valued.
    #[test]
    fn bf16_op_matches_the_composed_oracle_on_rounded_inputs() {
        let (cu, dims, [q, k, v], d_out) = case();
        let t = *cu.last().expect("offsets") as usize;
        let device = cpu_device(true);
        let q_shape = [t, dims.num_heads, dims.head_dim];
        let kv_shape = [t, dims.num_kv_heads, dims.head_dim];
        let rows = AttentionRows::new(cu.clone().into(), &device);
        let meta = BatchMeta::from_lengths([7, 1, 13]).expect("lengths");
        let masks = CausalMasks::new(meta.seq_lens(), &device);
        let scale = 1.0 / (dims.head_dim as f32).sqrt();

        let run = |bf16: bool| {
            let (qs, ks, vs) = if bf16 {
                (q.clone(), k.clone(), v.clone())
            } else {
                (rounded(&q), rounded(&k), rounded(&v))
            };
            let qt = trainable(float_tensor(qs, q_shape, &device));
            let kt = trainable(float_tensor(ks, kv_shape, &device));
            let vt = trainable(float_tensor(vs, kv_shape, &device));
            let out = if bf16 {
                bf16_varlen_attention(qt.clone(), kt.clone(), vt.clone(), &rows, scale, None)
                    .expect("CPU")
            } else {
                composed_varlen_attention(qt.clone(), kt.clone(), vt.clone(), &meta, &masks)
            };
            let grads =
                run_backward(&(out.clone() * float_tensor(d_out.clone(), q_shape, &device)).sum());
            let grad_of = |x: &Tensor<3>| grad(x, &grads).expect("gradient").into_vec();
            let grads = [grad_of(&qt), grad_of(&kt), grad_of(&vt)];
            (out.into_vec(), grads)
        };
        let (out16, grads16) = run(true);
        let (oracle_out, oracle_grads) = run(false);
        let largest_v = rounded(&v).iter().fold(0f32, |m, x| m.max(x.abs()));
        let mut worst_out = 0f32;
        for (a, b) in out16.iter().zip(&oracle_out) {
            assert_eq!(
                a.to_bits(),
                round_one(*a).to_bits(),
                "output not bf16-valued"
            );
            // The oracle keeps P and the output unrounded: rounding P moves
            // a value by at most 2^-8 of sum_j P_ij |v_j| <= max |v|, the
            // output's own rounding by 2^-8 of itself (2^-8 is bf16's unit
            // roundoff), plus f32 summation order.
            let error = (a - b).abs();
            assert!(
                error <= 2f32.powi(-8) * (b.abs() + largest_v) + 1e-6,
                "{a} vs {b}"
            );
            worst_out = worst_out.max(error / largest_v);
        }
        // Every gradient reads bf16 copies of P or dS (2^-8 relative each)
        // and of dO (2^-8), and dq and dk the softmax correction dO . O from
        // the rounded output (2^-8 relative on O): seen 6.8e-3 (dq), 5.1e-3
        // (dk) and 2.1e-3 (dv) of the largest value; the tolerance, 1e-2, is
        // the one dq and dk had before P and dS were rounded.
        let mut worst = Vec::new();
        for (name, got, want) in [
            ("dq", &grads16[0], &oracle_grads[0]),
            ("dk", &grads16[1], &oracle_grads[1]),
            ("dv", &grads16[2], &oracle_grads[2]),
        ] {
            let largest = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let mut share = 0f32;
            for (a, b) in got.iter().zip(want.iter()) {
                assert!((a - b).abs() <= 1e-2 * largest + 1e-7, "{name}: {a} vs {b}");
                share = share.max((a - b).abs() / largest);
            }
            worst.push((name, share));
        }
        eprintln!("largest errors: output {worst_out:e} of max |v|; gradients {worst:?}");
    }

    /// The attention and `o_proj` keeping the attention's output once (the
    /// kernel's store, which `o_proj` reads) or each its own bf16 copy:
    /// the same output and every gradient (q, k, v and `o_proj`'s weight,
    /// from its copy and from the master weight) bit for bit, and the
    /// store made by the attention's forward pass.
    #[test]
    fn the_attention_and_o_proj_keep_its_output_once() {
        use crate::kernels::bf16::round_slice;
        use crate::kernels::{Weight16, bf16_linear_sharing_input, bf16_linear_storing_input};
        let (cu, dims, [q, k, v], _) = case();
        let t = *cu.last().expect("offsets") as usize;
        let device = cpu_device(true);
        let q_shape = [t, dims.num_heads, dims.head_dim];
        let kv_shape = [t, dims.num_kv_heads, dims.head_dim];
        let rows = AttentionRows::new(cu.clone().into(), &device);
        let (width, o) = (dims.q_row(), 12);
        let w0: Vec<f32> = (0..o * width)
            .map(|i| (i as f32 * 0.377).cos() * 0.3 + 1e-5 * (i % 5) as f32)
            .collect();
        let dy: Vec<f32> = (0..t * o).map(|i| (i as f32 * 0.91).sin()).collect();
        let run = |sharing: bool, from_copy: bool| {
            let qt = trainable(float_tensor(q.clone(), q_shape, &device));
            let kt = trainable(float_tensor(k.clone(), kv_shape, &device));
            let vt = trainable(float_tensor(v.clone(), kv_shape, &device));
            let w = trainable(float_tensor(w0.clone(), [o, width], &device));
            let weight16 = || {
                if from_copy {
                    Weight16::Copy(round_slice(&w0).into())
                } else {
                    Weight16::Master
                }
            };
            let store = sharing.then(SharedInput16::default);
            let context = bf16_varlen_attention(
                qt.clone(),
                kt.clone(),
                vt.clone(),
                &rows,
                0.3,
                store.clone(),
            )
            .expect("CPU")
            .reshape([t, width]);
            if let Some(store) = &store {
                assert!(store.is_stored(), "kept by the attention's forward pass");
            }
            let y = match &store {
                Some(store) => bf16_linear_sharing_input(context, w.clone(), weight16(), store),
                None => bf16_linear_storing_input(context, w.clone(), weight16()),
            }
            .expect("CPU");
            let grads =
                run_backward(&(y.clone() * float_tensor(dy.clone(), [t, o], &device)).sum());
            let mut out = vec![y.into_vec()];
            out.extend([&qt, &kt, &vt].map(|x| grad(x, &grads).expect("gradient").into_vec()));
            out.push(grad(&w, &grads).expect("dW").into_vec());
            out
        };
        for from_copy in [true, false] {
            let (ours, theirs) = (run(true, from_copy), run(false, from_copy));
            for (at, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(
                    bits(a),
                    bits(b),
                    "{} differs, from the copy {from_copy}",
                    ["output", "dq", "dk", "dv", "dW"][at]
                );
            }
        }
    }
}
