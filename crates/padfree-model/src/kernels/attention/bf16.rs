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
//!   log-sum-exp, instead of the f32 input tensors. Its output is bf16-valued,
//!   so `o_proj` keeps it as bf16 too (`Linear::forward_storing_input`).
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
use crate::kernels::bf16::{load, round_in_place, store};
use crate::kernels::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::tensor::Tensor;

/// [`super::varlen_attention`] under `--bf16` (see the module docs):
/// `q`: `[T, H, D]`, `k`, `v`: `[T, Hkv, D]` -> `[T, H, D]`, bf16-valued.
pub fn bf16_varlen_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    rows: &AttentionRows,
    scale: f32,
) -> Result<Tensor<3>, UnsupportedTensor> {
    if rows.blocks.is_some() {
        return Err(UnsupportedTensor(
            "bf16 attention runs on the CPU only in this build".into(),
        ));
    }
    let op = Bf16VarlenAttention(VarlenAttention {
        cu_seqlens: rows.cu_seqlens.clone(),
        dims: super::dims_of(&q, &k),
        scale,
    });
    apply(op, [q, k, v])
}

/// The f32 op's settings and kernel, with bf16 in, out and kept.
#[derive(Debug, Clone)]
struct Bf16VarlenAttention(VarlenAttention);

/// `values` rounded to bf16, kept as f32.
fn rounded(values: &[f32]) -> Vec<f32> {
    let mut out = values.to_vec();
    round_in_place(&mut out);
    out
}

/// `[q, k, v, out, lse]` of `saved`: `q`, `k`, `v` and `out` as packed bf16
/// pairs (`len.div_ceil(2)` slots each), then the f32 `lse`.
fn split_saved(saved: &[f32], q_len: usize, kv_len: usize) -> [&[f32]; 5] {
    let (q, rest) = saved.split_at(q_len.div_ceil(2));
    let (k, rest) = rest.split_at(kv_len.div_ceil(2));
    let (v, rest) = rest.split_at(kv_len.div_ceil(2));
    let (out, lse) = rest.split_at(q_len.div_ceil(2));
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
        } = &self.0;
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
        saved.extend(store(&out));
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
        let [q16, k16, v16, out16, lse] = split_saved(saved, q_len, kv_len);
        let (q, k, v, out) = (
            load(q16, q_len),
            load(k16, kv_len),
            load(v16, kv_len),
            load(out16, q_len),
        );
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
        } = &self.0;
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

        let op = Bf16VarlenAttention(VarlenAttention {
            cu_seqlens: cu.clone().into(),
            dims,
            scale: 0.3,
        });
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
        // q, k, v and out at 2 bytes a value, lse at 4.
        let (q_len, kv_len) = (t * dims.q_row(), t * dims.kv_row());
        assert_eq!(
            output.saved.len(),
            2 * q_len.div_ceil(2) + 2 * kv_len.div_ceil(2) + t * dims.num_heads
        );

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
                bf16_varlen_attention(qt.clone(), kt.clone(), vt.clone(), &rows, scale)
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
}
