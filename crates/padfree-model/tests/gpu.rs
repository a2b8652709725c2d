//! padfree on a GPU (feature `wgpu`; CI runs it on Mesa's lavapipe, a
//! Vulkan device in software): the CubeCL varlen attention, RMSNorm,
//! SwiGLU and cross-entropy against their composed oracles and the CPU kernels, output and every
//! input gradient; the
//! HF fixtures on the device against transformers; the model's fused loss
//! on the device against the same model on the CPU.
//!
//! The device is `PADFREE_TEST_DEVICE` (default `vulkan`). These tests never
//! skip: a machine without a Vulkan driver fails them with the HINT of the
//! device that did not open.
//!
//! Tolerances: the GPU sums dot products one element at a time in f32
//! (the kernel) or in its matmul's tiles (burn), the CPU in eight lanes or in
//! gemm's order; the same 1e-5 absolute plus 1e-4 relative as the CPU's
//! kernel tests leaves ~10x over the differences seen, and a wrong mask or
//! a missing term moves results at the 1e-2 level.
#![cfg(feature = "wgpu")]

mod common;

use common::gpu::{attention_and_grads, gpu, head_loss_and_grads, on_gpu, random};
use common::{assert_close, examples, host, param_grads};
use padfree_model::kernels::{
    AdamWStep, AttentionRows, CausalMasks, RopeTables, adamw_groups_fit, add_pairs_groups_fit,
    composed_adamw_update, composed_add_pairs, composed_cross_entropy_sum, composed_rms_norm,
    composed_rope, composed_sums_of_squares, composed_swiglu, composed_varlen_attention,
    cross_entropy_sum, fused_adamw_update, fused_adamw_update_group, fused_add_pairs,
    fused_sums_of_squares, head_cross_entropy_sum, per_row_varlen_attention, rms_norm, rope,
    sums_of_squares_groups_fit, swiglu, tiled_by_head_varlen_attention, varlen_attention,
};
use padfree_model::tensor::{
    Device, IntoHostVec, Tensor, backward, cpu_device, float_tensor, grad, int_tensor_nd, trainable,
};
use padfree_model::{LlamaConfig, LlamaModel, ModelInput};
use padfree_pack::{BatchMeta, flatten, pad};

const ATOL: f32 = 1e-5;
const RTOL: f32 = 1e-4;

/// Which CubeCL attention kernels a case runs.
#[derive(Clone, Copy)]
enum Kernels {
    /// The tiled kernels, a workgroup taking a group's query heads together.
    Tiled,
    /// The tiled kernels with one query head a workgroup.
    TiledByHead,
    /// The per-row kernels.
    PerRow,
}

/// The tiled CubeCL kernel against the per-row CubeCL kernel and the
/// composed oracle on the GPU, and the host kernel on the CPU, for ragged
/// examples; and against the tiled kernels with one query head a
/// workgroup bit for bit (the group's heads share the staged keys, each
/// thread's sums are unchanged).
fn kernel_case(heads: usize, kv_heads: usize, head_dim: usize, lengths: &[usize]) {
    let gpu = gpu().autodiff();
    let cpu = cpu_device(true);
    let meta = BatchMeta::from_lengths(lengths.to_vec()).expect("valid lengths");
    let t: usize = lengths.iter().sum();
    let q_shape = [t, heads, head_dim];
    let kv_shape = [t, kv_heads, head_dim];
    let values = [
        random(t * heads * head_dim, 1, 1.0),
        random(t * kv_heads * head_dim, 2, 1.0),
        random(t * kv_heads * head_dim, 3, 1.0),
        random(t * heads * head_dim, 4, 1.0),
    ];
    let scale = 1.0 / (head_dim as f32).sqrt();
    let fused_on = |device: &Device, kernels: Kernels| {
        let rows = AttentionRows::new(meta.cu_seqlens_shared(), device);
        attention_and_grads(device, &values, [q_shape, kv_shape], move |q, k, v| {
            let out = match kernels {
                Kernels::Tiled => varlen_attention(q, k, v, &rows, scale),
                Kernels::TiledByHead => tiled_by_head_varlen_attention(q, k, v, &rows, scale),
                Kernels::PerRow => per_row_varlen_attention(q, k, v, &rows, scale),
            };
            out.expect("the kernel takes these")
        })
    };
    let tiled = fused_on(&gpu, Kernels::Tiled);
    let by_head = fused_on(&gpu, Kernels::TiledByHead);
    let per_row = fused_on(&gpu, Kernels::PerRow);
    let masks = CausalMasks::new(meta.seq_lens(), &gpu);
    let oracle = attention_and_grads(&gpu, &values, [q_shape, kv_shape], |q, k, v| {
        composed_varlen_attention(q, k, v, &meta, &masks)
    });
    let on_cpu = fused_on(&cpu, Kernels::Tiled);
    let what = format!("H={heads} Hkv={kv_heads} D={head_dim} lengths {lengths:?}");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, ours, theirs) in [
        ("output", &tiled.0, &by_head.0),
        ("dq", &tiled.1[0], &by_head.1[0]),
        ("dk", &tiled.1[1], &by_head.1[1]),
        ("dv", &tiled.1[2], &by_head.1[2]),
    ] {
        let differ = bits(ours)
            .iter()
            .zip(bits(theirs))
            .filter(|(a, b)| **a != *b)
            .count();
        assert_eq!(
            differ, 0,
            "{what}: {name}, heads together vs one head a workgroup: {differ} values differ"
        );
    }
    for (name, (out, grads)) in [
        ("per-row kernel", &per_row),
        ("composed oracle", &oracle),
        ("CPU", &on_cpu),
    ] {
        assert_close(
            &format!("{what}: output vs {name}"),
            &tiled.0,
            out,
            ATOL,
            RTOL,
        );
        for (i, grad) in ["dq", "dk", "dv"].iter().enumerate() {
            assert_close(
                &format!("{what}: {grad} vs {name}"),
                &tiled.1[i],
                &grads[i],
                ATOL,
                RTOL,
            );
        }
    }
}

/// Output and both input gradients of `sum(y * probe)` through `op` on
/// `device`, for inputs of `shapes` (random values) and `y` `[N, C]`.
fn two_input_op_and_grads(
    device: &Device,
    shapes: [[usize; 2]; 2],
    op: impl Fn(Tensor<2>, Tensor<2>) -> Tensor<2>,
) -> (Vec<f32>, [Vec<f32>; 2]) {
    let leaf = |shape: [usize; 2], seed| {
        trainable(float_tensor(
            random(shape[0] * shape[1], seed, 2.0),
            shape,
            device,
        ))
    };
    let (a, b) = (leaf(shapes[0], 11), leaf(shapes[1], 12));
    let y = op(a.clone(), b.clone());
    let [rows, cols] = [y.dims()[0], y.dims()[1]];
    let probe = float_tensor(random(rows * cols, 13, 1.0), [rows, cols], device);
    let grads = backward(&(y.clone() * probe).sum());
    let g = |t: &Tensor<2>| grad(t, &grads).expect("a gradient").into_vec();
    (y.into_vec(), [g(&a), g(&b)])
}

/// A two-input CubeCL kernel (`fused` on the GPU) against its composed
/// oracle on the GPU and the host kernel (`fused` on the CPU): the output
/// and both gradients, for each of `cases` (input shapes).
fn two_input_case(
    names: [&str; 2],
    cases: &[[[usize; 2]; 2]],
    fused: impl Fn(Tensor<2>, Tensor<2>) -> Tensor<2>,
    oracle: impl Fn(Tensor<2>, Tensor<2>) -> Tensor<2>,
) {
    let (gpu, cpu) = (gpu().autodiff(), cpu_device(true));
    for &shapes in cases {
        let (gpu_y, gpu_grads) = two_input_op_and_grads(&gpu, shapes, &fused);
        let (oracle_y, oracle_grads) = two_input_op_and_grads(&gpu, shapes, &oracle);
        let (cpu_y, cpu_grads) = two_input_op_and_grads(&cpu, shapes, &fused);
        let what = format!("{names:?} of shapes {shapes:?}");
        assert_close(
            &format!("{what}: y vs oracle"),
            &gpu_y,
            &oracle_y,
            ATOL,
            RTOL,
        );
        assert_close(&format!("{what}: y vs CPU"), &gpu_y, &cpu_y, ATOL, RTOL);
        for (i, name) in names.iter().enumerate() {
            let what = format!("{what}: d{name}");
            let (ours, oracle, cpu) = (&gpu_grads[i], &oracle_grads[i], &cpu_grads[i]);
            assert_close(&format!("{what} vs oracle"), ours, oracle, ATOL, RTOL);
            assert_close(&format!("{what} vs CPU"), ours, cpu, ATOL, RTOL);
        }
    }
}

/// The CubeCL RMSNorm: `dweight` sums over every row; SmolLM2's width
/// (more channels than a workgroup's threads), an odd one (fewer), a single
/// row.
#[test]
fn cubecl_rms_norm_matches_the_oracle_and_the_cpu() {
    let eps = 1e-5;
    two_input_case(
        ["x", "weight"],
        &[[[37, 576], [1, 576]], [[5, 63], [1, 63]], [[1, 8], [1, 8]]],
        |x, w| rms_norm(x, w, eps).expect("the kernel takes these"),
        |x, w| composed_rms_norm(x, w, eps),
    );
}

/// More rows than one grid dimension holds (65,535 workgroups): the rows
/// past it are laid on the grid's second dimension. `y` and `dx` against
/// the oracle; not `dweight`, a sum over 65,537 rows whose f32 rounding
/// depends on the order (the oracle and the CPU kernel differ there by
/// 0.1-0.8% themselves).
#[test]
fn cubecl_rms_norm_takes_more_rows_than_a_grid_dimension() {
    let (gpu, eps, shapes) = (gpu().autodiff(), 1e-5, [[65_537, 2], [1, 2]]);
    let (y, [dx, _]) = two_input_op_and_grads(&gpu, shapes, |x, w| {
        rms_norm(x, w, eps).expect("the kernel takes these")
    });
    let (oracle_y, [oracle_dx, _]) =
        two_input_op_and_grads(&gpu, shapes, |x, w| composed_rms_norm(x, w, eps));
    assert_close("65,537 rows: y", &y, &oracle_y, ATOL, RTOL);
    assert_close("65,537 rows: dx", &dx, &oracle_dx, ATOL, RTOL);
}

/// The fused AdamW kernel over five steps, with and without weight decay,
/// against the composed oracle on the device and torch's formula in f64 on
/// the host, for shapes that fill no whole workgroup (and one element),
/// the gradient contiguous and as a transposed view.
/// The kernel may contract a product and a sum into one FMA where the
/// oracle rounds twice: they agree to a few f32 roundings (1e-6 relative
/// of the largest value), where a wrong or missing term (no bias
/// correction, eps inside the square root, the decay on the step) moves
/// values at 1e-4 to 1e-3 of it.
#[test]
fn cubecl_adamw_matches_the_oracle_and_torchs_formula() {
    let device = gpu();
    for (case, [rows, cols]) in [[37usize, 91], [1, 1], [3, 300]].into_iter().enumerate() {
        for decay in [1.0 - 1e-3 * 0.1, 1.0] {
            let n = rows * cols;
            let seed = 10 * case as u64;
            let upload = |v: &[f32]| float_tensor(v.to_vec(), [rows, cols], &device);
            let p0 = random(n, seed + 1, 1.0);
            let m0 = random(n, seed + 2, 0.01);
            let v0: Vec<f32> = random(n, seed + 3, 0.01).iter().map(|x| x * x).collect();
            let start = || [upload(&p0), upload(&m0), upload(&v0)];
            let (mut fused, mut oracle) = (start(), start());
            let mut exact: Vec<[f64; 3]> = (0..n)
                .map(|i| [p0[i].into(), m0[i].into(), v0[i].into()])
                .collect();
            let (beta1, beta2, eps, lr) = (0.9f64, 0.999f64, 1e-8f64, 1e-3f64);
            for t in 1..=5 {
                let g = random(n, seed + 100 + t, 0.1);
                let step = AdamWStep {
                    grad_scale: 0.5,
                    decay: decay as f32,
                    one_minus_beta1: (1.0 - beta1) as f32,
                    beta2: beta2 as f32,
                    one_minus_beta2: (1.0 - beta2) as f32,
                    bias_correction2_sqrt: (1.0 - beta2.powi(t as i32)).sqrt() as f32,
                    eps: eps as f32,
                    step_size: (lr / (1.0 - beta1.powi(t as i32))) as f32,
                };
                // Odd steps: the gradient as a transposed view (strides
                // [1, rows]), as a matmul's backward may give it.
                let grad = if t % 2 == 1 {
                    let transposed: Vec<f32> =
                        (0..n).map(|k| g[(k % rows) * cols + k / rows]).collect();
                    float_tensor(transposed, [cols, rows], &device).transpose()
                } else {
                    upload(&g)
                };
                fused = fused_adamw_update(&fused, &grad, &step).expect("a CubeCL device");
                oracle = composed_adamw_update(oracle, &grad, &step);
                for (i, [p, m, v]) in exact.iter_mut().enumerate() {
                    let g = 0.5 * f64::from(g[i]);
                    *p *= decay;
                    *m += (g - *m) * (1.0 - beta1);
                    *v = *v * beta2 + g * g * (1.0 - beta2);
                    let denom = v.sqrt() / (1.0 - beta2.powi(t as i32)).sqrt() + eps;
                    *p -= lr / (1.0 - beta1.powi(t as i32)) * *m / denom;
                }
            }
            let fused: Vec<Vec<f32>> = fused.into_iter().map(IntoHostVec::into_vec).collect();
            let oracle: Vec<Vec<f32>> = oracle.into_iter().map(IntoHostVec::into_vec).collect();
            for (k, name) in ["values", "exp_avg", "exp_avg_sq"].into_iter().enumerate() {
                let what = format!("[{rows}, {cols}], decay {decay}: {name}");
                let exact: Vec<f32> = exact.iter().map(|e| e[k] as f32).collect();
                assert_close(
                    &format!("{what} vs the oracle"),
                    &fused[k],
                    &oracle[k],
                    0.0,
                    1e-6,
                );
                assert_close(&format!("{what} vs f64"), &fused[k], &exact, 0.0, 1e-6);
            }
        }
    }
}

/// AdamW's group launch (four parameters a launch, the rest one each)
/// against a launch a parameter, over three steps, for ten parameters of
/// other shapes (one element, a row, shapes that fill no workgroup), the
/// gradients contiguous and as transposed views. The same expression per element: the same bits,
/// where a parameter read from another's buffer, or an element of the
/// group's grid mapped to the wrong offset, would differ everywhere.
#[test]
fn cubecl_adamw_group_is_a_launch_a_parameter_bit_for_bit() {
    let device = gpu();
    let shapes = [
        [37usize, 91],
        [1, 1],
        [3, 300],
        [64, 64],
        [1, 577],
        [129, 5],
        [2, 2],
        [300, 7],
        [11, 13],
        [5, 1],
    ];
    let state = |seed: u64, [rows, cols]: [usize; 2]| {
        let n = rows * cols;
        let v: Vec<f32> = random(n, seed + 3, 0.01).iter().map(|x| x * x).collect();
        [
            float_tensor(random(n, seed + 1, 1.0), [rows, cols], &device),
            float_tensor(random(n, seed + 2, 0.01), [rows, cols], &device),
            float_tensor(v, [rows, cols], &device),
        ]
    };
    let mut grouped: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(i, &shape)| state(10 * i as u64, shape))
        .collect();
    // Otherwise both sides would be a launch a parameter.
    assert_eq!(
        adamw_groups_fit(&grouped[0][0]),
        Some(true),
        "this device binds too few buffers for AdamW's group launch"
    );
    let mut single = grouped.clone();
    for t in 1..=3u64 {
        let grads: Vec<Tensor<2>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &[rows, cols])| {
                let g = random(rows * cols, 500 + 10 * t + i as u64, 0.1);
                if (i as u64 + t) % 2 == 1 {
                    float_tensor(g, [cols, rows], &device).transpose()
                } else {
                    float_tensor(g, [rows, cols], &device)
                }
            })
            .collect();
        let step = AdamWStep {
            grad_scale: 0.5,
            decay: 0.9999,
            one_minus_beta1: 0.1,
            beta2: 0.999,
            one_minus_beta2: 0.001,
            bias_correction2_sqrt: (1.0f64 - 0.999f64.powi(t as i32)).sqrt() as f32,
            eps: 1e-8,
            step_size: (1e-3 / (1.0 - 0.9f64.powi(t as i32))) as f32,
        };
        grouped = fused_adamw_update_group(&grouped, &grads, &step).expect("a CubeCL device");
        single = single
            .iter()
            .zip(&grads)
            .map(|(state, grad)| fused_adamw_update(state, grad, &step).expect("a CubeCL device"))
            .collect();
    }
    assert_eq!(grouped.len(), shapes.len());
    for (i, (g, s)) in grouped.into_iter().zip(single).enumerate() {
        for (k, (g, s)) in g.into_iter().zip(s).enumerate() {
            let (g, s) = (g.into_vec(), s.into_vec());
            let differ = g
                .iter()
                .zip(&s)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "parameter {i} {:?}, state {k}: {differ} values differ",
                shapes[i]
            );
        }
    }
    assert!(
        fused_adamw_update_group(
            &[],
            &[],
            &AdamWStep {
                grad_scale: 1.0,
                decay: 1.0,
                one_minus_beta1: 0.1,
                beta2: 0.999,
                one_minus_beta2: 0.001,
                bias_correction2_sqrt: 1.0,
                eps: 1e-8,
                step_size: 1e-3,
            }
        )
        .expect("nothing to do")
        .is_empty()
    );
}

/// Gradient accumulation's sums of nineteen pairs (two launches of eight,
/// three alone) against burn's `add` a pair at a time and the host's f32
/// sums, bit for bit: one addition per element either way. A group that
/// reads one pair's element from another's buffer, or at the wrong
/// offset, differs. Shapes include an empty pair inside a group, one
/// element, a transposed view on either side (gradients arrive so) and a
/// broadcast row; the sums written into fresh buffers and in place into
/// the gradients.
#[test]
fn cubecl_gradient_sums_in_groups_are_burns_adds_bit_for_bit() {
    let device = gpu();
    let shapes = [
        [1usize, 1],
        [37, 91],
        [0, 5],
        [300, 100],
        [91, 37],
        [1, 8193],
        [64, 129],
        [2, 2],
        [5000, 7],
        [17, 17],
        [64, 50],
        [3, 3],
        [100, 100],
        [1, 2],
        [8191, 1],
        [40, 60],
        [3, 4],
        [9, 2],
        [2, 9],
    ];
    let make_pairs = || -> Vec<(Tensor<2>, Tensor<2>)> {
        shapes
            .into_iter()
            .enumerate()
            .map(|(i, [rows, cols])| {
                let seed = 900 + 2 * i as u64;
                let plain =
                    |seed| float_tensor(random(rows * cols, seed, 1.0), [rows, cols], &device);
                let transposed = |seed| {
                    float_tensor(random(rows * cols, seed, 1.0), [cols, rows], &device).transpose()
                };
                match i {
                    // A transposed view as the running sum, then as the
                    // gradient (in a group the second call writes in place).
                    4 => (transposed(seed), plain(seed + 1)),
                    12 => (plain(seed), transposed(seed + 1)),
                    // A row broadcast over every row (never written in place).
                    17 => (
                        plain(seed),
                        float_tensor(random(cols, seed + 1, 1.0), [1, cols], &device)
                            .expand([rows, cols]),
                    ),
                    _ => (plain(seed), plain(seed + 1)),
                }
            })
            .collect()
    };
    let pairs = make_pairs();
    assert_eq!(
        add_pairs_groups_fit(&pairs[0].0),
        Some(true),
        "this device binds too few buffers for the group launch"
    );
    // Sums into fresh buffers (this test holds every `b`), then the same
    // pairs made again and handed over, so that the second group (and the
    // last pairs but the broadcast) writes into its gradients in place.
    let grouped = fused_add_pairs(pairs.clone()).expect("a CubeCL device");
    let in_place = fused_add_pairs(make_pairs()).expect("a CubeCL device");
    let burns = composed_add_pairs(pairs.clone());
    assert_eq!(grouped.len(), pairs.len());
    assert_eq!(in_place.len(), pairs.len());
    for (i, (((sum, written), burn), (a, b))) in grouped
        .iter()
        .zip(&in_place)
        .zip(&burns)
        .zip(&pairs)
        .enumerate()
    {
        assert_eq!(sum.dims(), a.dims(), "pair {i}");
        assert_eq!(written.dims(), a.dims(), "pair {i}");
        let written = written.clone().into_vec();
        let (sum, burn) = (sum.clone().into_vec(), burn.clone().into_vec());
        assert!(
            written
                .iter()
                .zip(&sum)
                .all(|(w, s)| w.to_bits() == s.to_bits()),
            "pair {i}: in place differs from fresh"
        );
        let host: Vec<f32> = a
            .clone()
            .into_vec()
            .iter()
            .zip(b.clone().into_vec())
            .map(|(x, y)| x + y)
            .collect();
        for (j, ((s, o), h)) in sum.iter().zip(&burn).zip(&host).enumerate() {
            assert!(
                s.to_bits() == o.to_bits() && s.to_bits() == h.to_bits(),
                "pair {i} {:?}, element {j}: grouped {s}, burn's add {o}, host {h}",
                a.dims()
            );
        }
    }
}

/// The sums of squares of nineteen tensors (two launches of eight, three
/// alone) against each tensor's own launch bit for bit, and f64 sums: the
/// same blocks, threads and tree, so the same partials; a group that
/// reads one tensor's blocks from another's buffer or writes a partial at
/// the wrong offset differs by whole blocks' sums. Shapes include empty
/// tensors (no blocks, inside a group), one element, blocks straddling a
/// tensor's end, a transposed view and a broadcast row.
#[test]
fn cubecl_sums_of_squares_in_groups_are_each_tensors_own() {
    let device = gpu();
    let mut tensors = Vec::new();
    for (seed, [rows, cols]) in [
        [1usize, 1],
        [37, 91],
        [0, 5],
        [300, 100],
        [8192, 3],
        [1, 8192],
        [1, 8193],
        [64, 129],
        [2, 2],
        [0, 1],
        [5000, 7],
        [17, 17],
        [3, 3],
        [100, 100],
        [1, 2],
        [8191, 1],
    ]
    .into_iter()
    .enumerate()
    {
        tensors.push(float_tensor(
            random(rows * cols, 800 + seed as u64, 1.0),
            [rows, cols],
            &device,
        ));
    }
    tensors.insert(
        3,
        float_tensor(random(91 * 37, 820, 1.0), [91, 37], &device).transpose(),
    );
    tensors.insert(
        9,
        float_tensor(random(50, 821, 1.0), [1, 50], &device).expand([64, 50]),
    );
    tensors.push(float_tensor(random(12, 822, 1.0), [3, 4], &device));
    assert_eq!(tensors.len(), 19);
    assert_eq!(
        sums_of_squares_groups_fit(&tensors[0]),
        Some(true),
        "this device binds too few buffers for the group launch"
    );
    let grouped = fused_sums_of_squares(&tensors)
        .expect("a CubeCL device")
        .into_vec();
    assert_eq!(grouped.len(), tensors.len());
    for (i, (t, &g)) in tensors.iter().zip(&grouped).enumerate() {
        let own = fused_sums_of_squares(std::slice::from_ref(t))
            .expect("a CubeCL device")
            .into_vec()[0];
        assert_eq!(
            g.to_bits(),
            own.to_bits(),
            "tensor {i}: grouped {g} vs alone {own}"
        );
        let exact: f64 = t
            .clone()
            .into_vec()
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum();
        assert!(
            (f64::from(g) - exact).abs() <= 1e-6 * exact.max(1.0),
            "tensor {i}: {g} vs f64 {exact}"
        );
    }
}

/// The gradient norm's per-tensor sums of squares: one element, shapes
/// within one block and over several (with a partial last block), a
/// transposed view (read in place), a broadcast row (made contiguous
/// first) and an empty tensor, against f64 sums on the host and the
/// composed oracle. f32 sums in blocks of 8,192 and a tree: within 1e-6
/// of the f64 sum; a dropped partial block or a wrong offset is off by
/// 1e-2 or more.
#[test]
fn cubecl_sums_of_squares_match_f64_and_the_oracle() {
    let device = gpu();
    let shapes = [[1usize, 1], [37, 91], [300, 1000], [8192, 3], [0, 5]];
    let mut tensors = Vec::new();
    let mut exact = Vec::new();
    for (seed, [rows, cols]) in shapes.into_iter().enumerate() {
        let values = random(rows * cols, 700 + seed as u64, 1.0);
        exact.push(
            values
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>(),
        );
        tensors.push(float_tensor(values, [rows, cols], &device));
    }
    // A transposed view (read in place), and a row broadcast to 64 rows
    // (stride 0: copied into a contiguous buffer first).
    let values = random(91 * 37, 710, 1.0);
    exact.push(
        values
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>(),
    );
    tensors.push(float_tensor(values, [91, 37], &device).transpose());
    let values = random(50, 711, 1.0);
    exact.push(
        64.0 * values
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>(),
    );
    tensors.push(float_tensor(values, [1, 50], &device).expand([64, 50]));
    let fused = fused_sums_of_squares(&tensors)
        .expect("a CubeCL device")
        .into_vec();
    let oracle = composed_sums_of_squares(&tensors)
        .expect("tensors")
        .into_vec();
    assert_eq!(fused.len(), tensors.len());
    for (i, ((&f, &o), &e)) in fused.iter().zip(&oracle).zip(&exact).enumerate() {
        let bound = 1e-6 * e.max(1.0);
        assert!(
            (f64::from(f) - e).abs() <= bound,
            "tensor {i}: fused {f} vs f64 {e}"
        );
        assert!(
            (f64::from(o) - e).abs() <= bound,
            "tensor {i}: oracle {o} vs f64 {e}"
        );
    }
    assert!(fused_sums_of_squares(&[]).is_none());
}

/// The CubeCL SwiGLU gate: SmolLM2's intermediate width, an odd shape.
#[test]
fn cubecl_swiglu_matches_the_oracle_and_the_cpu() {
    two_input_case(
        ["gate", "up"],
        &[[[17, 1536], [17, 1536]], [[3, 7], [3, 7]]],
        |gate, up| swiglu(gate, up).expect("the kernel takes these"),
        composed_swiglu,
    );
}

/// The summed loss and `d_logits` of `loss * 0.7` through `loss_of` on
/// `device`, for logits `[K, V]` (random, scale 3) and `targets`.
fn loss_and_grad(
    device: &Device,
    (rows, vocab): (usize, usize),
    loss_of: impl Fn(Tensor<2>) -> Tensor<1>,
) -> (Vec<f32>, Vec<f32>) {
    let logits = trainable(float_tensor(
        random(rows * vocab, 21, 3.0),
        [rows, vocab],
        device,
    ));
    let loss = loss_of(logits.clone());
    let grads = backward(&(loss.clone() * 0.7));
    (
        loss.into_vec(),
        grad(&logits, &grads).expect("a gradient").into_vec(),
    )
}

/// The CubeCL cross-entropy against the composed oracle on the GPU and the
/// host kernel on the CPU: the summed loss and `d_logits`, for SmolLM2's
/// vocabulary, an odd one, and one row; targets at both ends of the
/// vocabulary.
#[test]
fn cubecl_cross_entropy_matches_the_oracle_and_the_cpu() {
    let (gpu, cpu) = (gpu().autodiff(), cpu_device(true));
    // Llama 3's vocabulary (128,256) is past lavapipe's 65,535 loop
    // iterations for one invocation a row; a workgroup a row loops 501 times.
    for (rows, vocab) in [(9, 49152), (5, 37), (1, 8), (2, 128_256)] {
        let targets: Vec<usize> = (0..rows).map(|k| (k * 7919) % vocab).collect();
        let targets = [&targets[..rows - 1], &[vocab - 1]].concat();
        let fused = |device: &Device| {
            loss_and_grad(device, (rows, vocab), |logits| {
                cross_entropy_sum(logits, &targets).expect("the kernel takes these")
            })
        };
        let (gpu_loss, gpu_grad) = fused(&gpu);
        let ids: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
        let (oracle_loss, oracle_grad) = loss_and_grad(&gpu, (rows, vocab), |logits| {
            composed_cross_entropy_sum(logits, int_tensor_nd(ids.clone(), [rows], &gpu))
        });
        let (cpu_loss, cpu_grad) = fused(&cpu);
        let what = format!("[K, V] = [{rows}, {vocab}]");
        assert_close(
            &format!("{what}: loss vs oracle"),
            &gpu_loss,
            &oracle_loss,
            ATOL,
            RTOL,
        );
        assert_close(
            &format!("{what}: loss vs CPU"),
            &gpu_loss,
            &cpu_loss,
            ATOL,
            RTOL,
        );
        assert_close(
            &format!("{what}: d_logits vs oracle"),
            &gpu_grad,
            &oracle_grad,
            ATOL,
            RTOL,
        );
        assert_close(
            &format!("{what}: d_logits vs CPU"),
            &gpu_grad,
            &cpu_grad,
            ATOL,
            RTOL,
        );
    }
}

/// The LM head and the cross-entropy in one op on the GPU, its logits made
/// in chunks of rows and never kept, against the unchunked head product and
/// fused cross-entropy on the GPU and the same on the CPU: chunks of one
/// row, of rows that do not divide `K`, one chunk of all rows, one larger
/// than `K`.
#[test]
fn the_head_and_cross_entropy_in_chunks_match_the_whole_logits() {
    let (gpu, cpu) = (gpu().autodiff(), cpu_device(true));
    let (rows, channels, vocab) = (11, 24, 301);
    let targets: Vec<usize> = (0..rows).map(|k| (k * 7919) % vocab).collect();
    let whole = |x: Tensor<2>, head: Tensor<2>| {
        cross_entropy_sum(x.matmul(head.transpose()), &targets).expect("the kernel takes these")
    };
    let shape = [rows, channels, vocab];
    let (oracle_loss, oracle_grads) = head_loss_and_grads(&gpu, shape, whole);
    let (cpu_loss, cpu_grads) = head_loss_and_grads(&cpu, shape, whole);
    for chunk_rows in [1, 4, rows, 64] {
        let (loss, grads) = head_loss_and_grads(&gpu, shape, |x, head| {
            head_cross_entropy_sum(x, head, None, &targets, chunk_rows).expect("the op takes these")
        });
        let what = format!("chunks of {chunk_rows} rows");
        assert_close(
            &format!("{what}: loss vs whole"),
            &loss,
            &oracle_loss,
            ATOL,
            RTOL,
        );
        assert_close(
            &format!("{what}: loss vs CPU"),
            &loss,
            &cpu_loss,
            ATOL,
            RTOL,
        );
        for (i, name) in ["dx", "dhead"].iter().enumerate() {
            let what = format!("{what}: {name}");
            assert_close(
                &format!("{what} vs whole"),
                &grads[i],
                &oracle_grads[i],
                ATOL,
                RTOL,
            );
            assert_close(
                &format!("{what} vs CPU"),
                &grads[i],
                &cpu_grads[i],
                ATOL,
                RTOL,
            );
        }
    }
}

/// The CubeCL RoPE against the composed form on the GPU and the host
/// kernel on the CPU, output and `dx`: positions restarting per example as
/// in a flattened batch, SmolLM2's head shape (9 x 64) and a small odd one.
#[test]
fn cubecl_rope_matches_the_composed_form_and_the_cpu() {
    let (gpu, cpu) = (gpu().autodiff(), cpu_device(true));
    for (lengths, heads, d) in [(vec![5usize, 1, 40], 9usize, 64usize), (vec![3, 2], 3, 6)] {
        let positions: Vec<u32> = lengths.iter().flat_map(|&l| 0..l as u32).collect();
        let n = positions.len();
        let tables = RopeTables::new(&positions, d, 100_000.0);
        let run = |device: &Device, fused: bool| {
            // The `[N, 1, D]` tables, each pair's value twice.
            let (cos, sin) = tables.values();
            let widen = |half: &[f32]| -> Vec<f32> {
                half.chunks(d / 2)
                    .flat_map(|row| row.iter().chain(row).copied())
                    .collect()
            };
            let cos = float_tensor(widen(cos), [n, 1, d], device);
            let sin = float_tensor(widen(sin), [n, 1, d], device);
            let x = trainable(float_tensor(
                random(n * heads * d, 41, 1.0),
                [n, heads, d],
                device,
            ));
            let y = if fused {
                rope(x.clone(), &tables, &cos, &sin).expect("the kernel takes these")
            } else {
                composed_rope(x.clone(), &cos, &sin)
            };
            let probe = float_tensor(random(n * heads * d, 42, 1.0), [n, heads, d], device);
            let grads = backward(&(y.clone() * probe).sum());
            (y.into_vec(), grad(&x, &grads).expect("dx").into_vec())
        };
        let ours = run(&gpu, true);
        let what = format!("{n} tokens of {heads} x {d}");
        for (name, (y, dx)) in [("composed", run(&gpu, false)), ("CPU", run(&cpu, true))] {
            assert_close(&format!("{what}: y vs {name}"), &ours.0, &y, ATOL, RTOL);
            assert_close(&format!("{what}: dx vs {name}"), &ours.1, &dx, ATOL, RTOL);
        }
    }
}

#[test]
fn cubecl_attention_matches_the_oracle_head_size_64_with_grouped_heads() {
    kernel_case(4, 2, 64, &[5, 1, 9, 3]);
}

#[test]
fn cubecl_attention_matches_the_oracle_head_size_128() {
    kernel_case(2, 1, 128, &[7, 2, 6]);
}

#[test]
fn cubecl_attention_matches_the_oracle_on_padded_rows() {
    // The padded baseline goes through the same kernel with every row one
    // sequence of `L` tokens: here 3 rows of 6.
    kernel_case(4, 4, 32, &[6, 6, 6]);
}

/// Past one block of the tiled kernels ([`BLOCK_ROWS`] = 64 rows) and past
/// one key tile: an example of 150 rows (three blocks, the last partial)
/// among many short ones and ones of length 1, lengths that are not
/// multiples of a block or a tile; GQA 4:1 at head size 64.
#[test]
fn tiled_attention_spans_blocks_and_tiles_gqa_4_to_1_head_size_64() {
    assert_eq!(padfree_model::kernels::BLOCK_ROWS, 64);
    kernel_case(8, 2, 64, &[3, 150, 1, 2, 7, 1, 65, 64, 1, 5]);
}

/// GQA 8:1 at head size 128 (fewer key rows a tile), a block boundary
/// inside an example (70) and one exactly a block (64).
#[test]
fn tiled_attention_gqa_8_to_1_head_size_128() {
    kernel_case(8, 1, 128, &[70, 1, 64, 9]);
}

#[test]
fn a_head_size_past_the_kernels_limit_is_refused_not_miscomputed() {
    let gpu = gpu();
    let d = 512;
    let meta = BatchMeta::from_lengths(vec![2]).expect("valid");
    let rows = AttentionRows::new(meta.cu_seqlens_shared(), &gpu);
    let q = float_tensor(vec![0.0; 2 * d], [2, 1, d], &gpu);
    let err = varlen_attention(q.clone(), q.clone(), q, &rows, 1.0).expect_err("refused");
    assert!(err.0.contains("head size 512"), "{}", err.0);
}

#[test]
fn llama_on_the_gpu_matches_transformers() {
    common::check_against_transformers("llama-tiny", &gpu().autodiff());
}

#[test]
fn mistral_on_the_gpu_matches_transformers() {
    common::check_against_transformers("mistral-tiny", &gpu().autodiff());
}

#[test]
fn qwen2_on_the_gpu_matches_transformers() {
    common::check_against_transformers("qwen2-tiny", &gpu().autodiff());
}

#[test]
fn qwen3_on_the_gpu_matches_transformers() {
    common::check_against_transformers("qwen3-tiny", &gpu().autodiff());
}

/// The model's training loss (CubeCL attention, composed cross-entropy,
/// RMSNorm and SwiGLU on the device) against the same weights on the CPU
/// (the fused host kernels), flattened and padded: loss and every gradient.
#[test]
fn the_models_loss_and_gradients_on_the_gpu_match_the_cpu() {
    let config = LlamaConfig {
        initializer_range: 0.2,
        ..LlamaConfig::tiny()
    };
    let cpu_model = LlamaModel::init(&config, 5, &cpu_device(true)).expect("valid");
    let gpu_model = on_gpu(&cpu_model);
    assert!(!gpu_model.on_cpu());
    let batch = examples(&[23, 1, 40, 2, 11], config.vocab_size as u32, 9);
    let flat = flatten(&batch).expect("flattens");
    let padded = pad(&batch, 0, None).expect("pads");
    for input in [ModelInput::Varlen(&flat), ModelInput::Padded(&padded)] {
        let run = |model: &LlamaModel| {
            let loss = model.loss_sum(&input).expect("loss");
            let value = loss.sum.clone().into_vec();
            let grads = backward(&loss.sum);
            (value, param_grads(model, &grads))
        };
        let (gpu_loss, gpu_grads) = run(&gpu_model);
        let (cpu_loss, cpu_grads) = run(&cpu_model);
        let what = match input {
            ModelInput::Padded(_) => "padded",
            _ => "flattened",
        };
        assert_close(&format!("{what}: loss"), &gpu_loss, &cpu_loss, 0.0, 1e-5);
        for ((name, g), (_, c)) in gpu_grads.iter().zip(&cpu_grads) {
            assert_close(&format!("{what}: {name}"), g, c, ATOL, RTOL);
        }
    }
    // Evaluation's forward pass off the graph on the device too.
    let logits = gpu_model
        .without_autodiff()
        .forward(&ModelInput::Varlen(&flat))
        .expect("forward");
    let cpu_logits = cpu_model
        .without_autodiff()
        .forward(&ModelInput::Varlen(&flat))
        .expect("forward");
    assert_close("logits", &host(logits), &host(cpu_logits), 2e-5, 1e-4);
}

/// Per-layer checkpointing (`--gradient-checkpointing`) on the device: the
/// layer inputs kept off the graph there, each layer recomputed, the head
/// in chunks of 5 rows; the summed parts are the gradients of one plain
/// backward pass (1e-4 of each tensor's largest plus 1e-6: the chunks and
/// the segments add in another order, in the device's f32).
#[test]
fn per_layer_checkpointing_on_the_gpu_gives_the_same_gradients() {
    let config = LlamaConfig::tiny();
    let model = LlamaModel::init(&config, 3, &gpu().autodiff()).expect("valid");
    let batch = examples(&[17, 30, 4], config.vocab_size as u32, 2);
    let flat = flatten(&batch).expect("flattens");
    let input = ModelInput::Varlen(&flat);
    let loss = model.loss_sum(&input).expect("loss");
    let plain = param_grads(&model, &backward(&loss.sum));
    let mut sums: Vec<Vec<f32>> = model
        .params()
        .iter()
        .map(|p| vec![0.0; p.numel()])
        .collect();
    let recomputed_loss = model
        .loss_backward_checkpointed(&input, 1.0, 5, |part, _| {
            for (sum, (_, g)) in sums.iter_mut().zip(param_grads(&model, part)) {
                for (s, v) in sum.iter_mut().zip(g) {
                    *s += v;
                }
            }
        })
        .expect("checkpointed pass");
    let value = host(loss.sum)[0];
    assert!(
        (recomputed_loss - value).abs() <= 1e-5 * value.abs(),
        "{recomputed_loss} vs {value}"
    );
    for ((name, b), a) in plain.iter().zip(&sums) {
        assert_close(name, a, b, 1e-6, 1e-4);
    }
}

/// Gradient checkpointing on the device (the kernel keeps its output and
/// log-sum-exp; burn recomputes the memory-bound ops) gives the gradients
/// of plain autodiff.
#[test]
fn gradient_checkpointing_on_the_gpu_gives_the_same_gradients() {
    let config = LlamaConfig::tiny();
    let plain = LlamaModel::init(&config, 3, &gpu().autodiff()).expect("valid");
    let checkpointed =
        LlamaModel::init(&config, 3, &gpu().autodiff().gradient_checkpointing()).expect("valid");
    let batch = examples(&[17, 30, 4], config.vocab_size as u32, 2);
    let flat = flatten(&batch).expect("flattens");
    let input = ModelInput::Varlen(&flat);
    let run = |model: &LlamaModel| {
        let loss = model.loss_sum(&input).expect("loss");
        param_grads(model, &backward(&loss.sum))
    };
    for ((name, a), (_, b)) in run(&plain).iter().zip(run(&checkpointed)) {
        assert_close(name, a, &b, 1e-6, 1e-5);
    }
}
