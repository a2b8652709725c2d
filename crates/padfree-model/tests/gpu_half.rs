//! `--bf16` on a GPU (feature `wgpu`; CI runs it on Mesa's lavapipe, whose
//! WGSL has `shader-f16` but no bf16, so the 16-bit float under test is
//! f16 there; on CUDA it is bf16): the 16-bit linear op, the 16-bit
//! attention and the 16-bit head with the cross-entropy in chunks against
//! their oracles (f32 products of the same rounded operands), the model in
//! 16-bit against itself in f32, flattened against padded, a LoRA layer
//! in 16 bits against its oracle.
//!
//! The device is `PADFREE_TEST_DEVICE` (default `vulkan`); never skipped:
//! a device without a 16-bit float fails the first test.
#![cfg(feature = "wgpu")]

mod common;

use common::gpu::{attention_and_grads, gpu, head_loss_and_grads, on_gpu, random};
use common::{assert_close, examples, param_grads};
use padfree_model::device::half_float;
use padfree_model::kernels::{
    AttentionRows, CausalMasks, composed_half_linear, composed_varlen_attention, cross_entropy_sum,
    half_varlen_attention, head_cross_entropy_sum, round_to_half, varlen_attention,
};
use padfree_model::tensor::{
    Device, IntoHostVec, Tensor, backward, cpu_device, float_tensor, grad, trainable,
};
use padfree_model::{HalfFloat, LlamaConfig, LlamaModel, LoraConfig, ModelInput, Precision};
use padfree_pack::{BatchMeta, flatten, pad};

/// The 16-bit float of the device under test; a device without one fails.
fn half() -> HalfFloat {
    let half = half_float(&gpu()).expect("the device under test has a 16-bit float");
    eprintln!("16-bit float: {}", half.name());
    half
}

/// `values` rounded to `half` (through the device's cast).
fn rounded(values: &[f32], half: HalfFloat, device: &Device) -> Vec<f32> {
    let t = float_tensor(values.to_vec(), [values.len()], &device.clone().inner());
    round_to_half(t, half).into_vec()
}

#[test]
fn lavapipe_multiplies_in_f16_and_cuda_in_bf16() {
    let expected = match std::env::var("PADFREE_TEST_DEVICE").as_deref() {
        Ok(name) if name.starts_with("cuda") => HalfFloat::Bf16,
        _ => HalfFloat::F16,
    };
    assert_eq!(half(), expected);
    assert_eq!(
        half_float(&cpu_device(false)),
        None,
        "the CPU has its own bf16"
    );
}

/// The 16-bit linear op against its oracle, burn's f32 matmul of the
/// operands rounded to the same float: `y`, `dx`, `dW` for `sum(y * dy)`.
///
/// `dy` holds values of the 16-bit float whose largest magnitude is a power
/// of two, so the op's f16 scaling (to 2^14) is exact and both sides sum
/// the same exact products of 16-bit values in f32, in different orders:
/// the GPU tests' 1e-5 + 1e-4 relative. `tiny` scales `dy` to 2^-26: f16
/// flushes values below 2^-24 to zero, so without the per-op scaling `dx`
/// and `dW` would come out zero.
#[test]
fn half_linear_matches_the_f32_product_of_rounded_operands() {
    let half = half();
    let device = gpu().autodiff();
    for (n, c, o) in [(1, 3, 2), (37, 48, 29), (300, 64, 200)] {
        for tiny in [false, true] {
            let (x0, w0) = (random(n * c, 1, 1.0), random(o * c, 2, 0.3));
            let mut dy0 = rounded(&random(n * o, 3, 0.5), half, &device);
            let top = if tiny { 2f32.powi(-26) } else { 2.0 };
            dy0[0] = 4.0;
            for v in &mut dy0 {
                *v = (*v / 4.0).clamp(-1.0, 1.0) * top;
            }
            let run = |fused: bool| {
                let x = trainable(float_tensor(x0.clone(), [n, c], &device));
                let w = trainable(float_tensor(w0.clone(), [o, c], &device));
                let y = if fused {
                    let copy = w.clone().inner().cast(half.dtype());
                    padfree_model::kernels::half_linear(x.clone(), w.clone(), &copy)
                        .expect("the GPU op")
                } else {
                    composed_half_linear(x.clone(), w.clone(), half)
                };
                let dy = float_tensor(dy0.clone(), [n, o], &device);
                let grads = backward(&(y.clone() * dy).sum());
                let g = |t: &Tensor<2>| grad(t, &grads).expect("a gradient").into_vec();
                (y.into_vec(), g(&x), g(&w))
            };
            let (ours, theirs) = (run(true), run(false));
            let what = format!("[{n},{c},{o}] dy up to {top:e}");
            // bf16 rounds the output on both sides: one bf16 step apart at
            // a rounding tie.
            let y_tolerance = match half {
                HalfFloat::F16 => 1e-4,
                HalfFloat::Bf16 => 2f32.powi(-7),
            };
            assert_close(&format!("{what}: y"), &ours.0, &theirs.0, 1e-5, y_tolerance);
            assert_close(&format!("{what}: dx"), &ours.1, &theirs.1, 0.0, 1e-4);
            assert_close(&format!("{what}: dW"), &ours.2, &theirs.2, 0.0, 1e-4);
            assert!(ours.1.iter().any(|&v| v != 0.0), "{what}: dx is not zero");
            // And the operands were rounded: not the f32 product.
            let x = float_tensor(x0.clone(), [n, c], &device);
            let w = float_tensor(w0.clone(), [o, c], &device);
            let exact = x.matmul(w.transpose()).into_vec();
            if c > 3 {
                assert_ne!(ours.0, exact, "{what}: 16-bit rounding must show");
            }
        }
    }
}

/// The tiled kernels reading 16-bit `q`, `k`, `v` against the per-row
/// kernel on the same rounded values, the composed oracle on the GPU and
/// the CPU's f32 kernel, both given the rounded inputs, their outputs
/// rounded.
///
/// Tolerances: the gradients are f32 sums of the same rounded values, but
/// the op's backward pass reads its rounded output where the oracles use
/// their own (`delta = rowsum(dO * O)`): 1e-5 + 1e-3 relative. The
/// outputs are rounded to 16 bits on both sides and differ by at most one
/// 16-bit step where the f32 sums straddle a rounding boundary (2^-11
/// relative in f16, 2^-8 in bf16), so at least 98% of them are equal.
fn half_attention_case(heads: usize, kv_heads: usize, head_dim: usize, lengths: &[usize]) {
    let half = half();
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
    let rows = AttentionRows::new(meta.cu_seqlens_shared(), &gpu);
    let ours = |per_row: bool| {
        attention_and_grads(&gpu, &values, [q_shape, kv_shape], |q, k, v| {
            half_varlen_attention(q, k, v, &rows, scale, half, per_row).expect("the GPU op")
        })
    };
    let tiled = ours(false);
    let per_row = ours(true);
    let round = |x: Tensor<3>| round_to_half(x, half);
    let masks = CausalMasks::new(meta.seq_lens(), &gpu);
    let oracle = attention_and_grads(&gpu, &values, [q_shape, kv_shape], |q, k, v| {
        round(composed_varlen_attention(
            round(q),
            round(k),
            round(v),
            &meta,
            &masks,
        ))
    });
    // The CPU's f32 kernel on the values rounded here (on the GPU).
    let rounded_values = [
        rounded(&values[0], half, &gpu),
        rounded(&values[1], half, &gpu),
        rounded(&values[2], half, &gpu),
        values[3].clone(),
    ];
    let cpu_rows = AttentionRows::new(meta.cu_seqlens_shared(), &cpu);
    let mut on_cpu = attention_and_grads(&cpu, &rounded_values, [q_shape, kv_shape], |q, k, v| {
        varlen_attention(q, k, v, &cpu_rows, scale).expect("the CPU kernel")
    });
    // Its f32 output rounded as the op rounds its own.
    on_cpu.0 = rounded(&on_cpu.0, half, &gpu);
    let step = match half {
        HalfFloat::F16 => 2f32.powi(-10),
        HalfFloat::Bf16 => 2f32.powi(-7),
    };
    let what = format!(
        "{} H={heads} Hkv={kv_heads} D={head_dim} lengths {lengths:?}",
        half.name()
    );
    for (name, (out, grads), output_tolerance) in [
        ("per-row kernel", &per_row, step),
        ("composed oracle", &oracle, step),
        ("CPU on rounded inputs", &on_cpu, step),
    ] {
        assert_close(
            &format!("{what}: output vs {name}"),
            &tiled.0,
            out,
            1e-5,
            output_tolerance,
        );
        // From the same rounded inputs the f32 outputs agree to ~1e-6, so
        // their 16-bit roundings are equal but at rare ties; from inputs
        // not rounded alike they would differ in most places.
        let equal = tiled.0.iter().zip(out).filter(|(a, b)| a == b).count();
        assert!(
            equal * 100 >= 98 * out.len(),
            "{what}: output vs {name}: only {equal} of {} equal",
            out.len()
        );
        for (i, grad) in ["dq", "dk", "dv"].iter().enumerate() {
            assert_close(
                &format!("{what}: {grad} vs {name}"),
                &tiled.1[i],
                &grads[i],
                1e-5,
                1e-3,
            );
        }
    }
    // The CPU's kernel on the unrounded inputs differs: rounding showed.
    let cpu_rows = AttentionRows::new(meta.cu_seqlens_shared(), &cpu);
    let exact = attention_and_grads(&cpu, &values, [q_shape, kv_shape], |q, k, v| {
        varlen_attention(q, k, v, &cpu_rows, scale).expect("the CPU kernel")
    });
    assert_ne!(tiled.0, exact.0, "{what}: 16-bit inputs must show");
}

#[test]
fn half_attention_spans_blocks_and_tiles_gqa_4_to_1_head_size_64() {
    half_attention_case(4, 1, 64, &[3, 150, 1, 2, 7, 1, 65, 64, 1, 5]);
}

#[test]
fn half_attention_gqa_8_to_1_head_size_128() {
    half_attention_case(8, 1, 128, &[70, 1, 64, 9]);
}

/// The tiny model under `--bf16` on the GPU: its weights' 16-bit copies are
/// made once per refresh; flattened, padded and one example at a time give
/// the same loss and gradients (flattened and padded: the same kernels on
/// the same rows, 1e-4 relative for matmuls tiled differently over more
/// rows; one at a time: 3e-4, as an example's small output gradients
/// reach f16's subnormals sooner beside a larger one (1.5e-4 seen), where
/// a scale of f16's gradients that is not a power of two gives 8.4e-4, and
/// `padfree check` fails); against the same model in
/// f32, the loss within 1% and every gradient within 5% of its tensor's
/// largest (f16 rounds every product's operands to 11 bits; measured
/// differences are printed).
#[test]
fn the_model_in_16_bit_on_the_gpu_tracks_f32_and_flattened_matches_padded() {
    let config = LlamaConfig {
        initializer_range: 0.2,
        ..LlamaConfig::tiny()
    };
    let cpu_model = LlamaModel::init(&config, 5, &cpu_device(true)).expect("valid");
    let model = on_gpu(&cpu_model);
    let half_model = model
        .clone()
        .with_precision(Precision::Bf16)
        .expect("16-bit on this GPU");
    assert_eq!(half_model.half_float(), Some(half()));
    assert_eq!(half_model.bf16_refreshes(), 1);
    let batch = examples(&[23, 1, 40, 2, 11], config.vocab_size as u32, 9);
    let flat = flatten(&batch).expect("flattens");
    let padded = pad(&batch, 0, None).expect("pads");
    let run = |model: &LlamaModel, input: &ModelInput<'_>| {
        let loss = model.loss_sum(input).expect("loss");
        let value = loss.sum.clone().into_vec();
        let grads = backward(&loss.sum);
        (value, param_grads(model, &grads))
    };
    let (flat_loss, flat_grads) = run(&half_model, &ModelInput::Varlen(&flat));
    let (padded_loss, padded_grads) = run(&half_model, &ModelInput::Padded(&padded));
    let (f32_loss, f32_grads) = run(&model, &ModelInput::Varlen(&flat));
    eprintln!("loss: 16-bit flattened {flat_loss:?}, padded {padded_loss:?}, f32 {f32_loss:?}");
    assert_close(
        "loss flattened vs padded",
        &flat_loss,
        &padded_loss,
        0.0,
        1e-4,
    );
    assert_close("loss 16-bit vs f32", &flat_loss, &f32_loss, 0.0, 1e-2);
    assert_ne!(flat_loss, f32_loss, "16-bit products must show in the loss");
    // Each example alone, its gradients summed: the same as the batch's,
    // because f16's per-product scale is a power of two (which commutes
    // with rounding) although each batch sets its own.
    let mut alone: Vec<(String, Vec<f32>)> = Vec::new();
    for example in &batch {
        let one = flatten(std::slice::from_ref(example)).expect("flattens");
        let (_, grads) = run(&half_model, &ModelInput::Varlen(&one));
        if alone.is_empty() {
            alone = grads;
        } else {
            for ((_, sum), (_, g)) in alone.iter_mut().zip(&grads) {
                sum.iter_mut().zip(g).for_each(|(s, v)| *s += v);
            }
        }
    }
    let mut worst = 0.0f32;
    for (((name, a), (_, b)), (_, c)) in flat_grads.iter().zip(&padded_grads).zip(&f32_grads) {
        assert_close(&format!("{name}: flattened vs padded"), a, b, 1e-6, 1e-4);
        assert_close(&format!("{name}: 16-bit vs f32"), a, c, 1e-6, 5e-2);
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(c).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(diff / scale.max(f32::MIN_POSITIVE));
    }
    eprintln!("largest gradient difference 16-bit vs f32: {worst:.2e} of its tensor's scale");
    let mut worst_alone = 0.0f32;
    for ((_, a), (_, b)) in flat_grads.iter().zip(&alone) {
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        worst_alone = worst_alone.max(diff / scale.max(f32::MIN_POSITIVE));
    }
    eprintln!("largest gradient difference flattened vs one at a time: {worst_alone:.2e}");
    for ((name, a), (_, b)) in flat_grads.iter().zip(&alone) {
        assert_close(
            &format!("{name}: flattened vs one at a time"),
            a,
            b,
            1e-6,
            3e-4,
        );
    }
    // The copies are made again only when asked (once per optimizer step).
    let mut half_model = half_model;
    half_model.refresh_bf16_weights();
    assert_eq!(half_model.bf16_refreshes(), 2);
}

/// A LoRA layer under `--bf16` on the GPU (`half_lora_linear`: the base
/// from its 16-bit device copy by the 16-bit linear op, the adapter's
/// low-rank products from rounded operands, dropout on) against its
/// oracle, every product burn's f32 matmul of the rounded operands
/// (`composed_half_linear`): `y`, `dx`, `dA`, `dB` for `sum(y * dy)`, at
/// the 16-bit linear op's tolerances (the base's product is that op; the
/// adapter's are the oracle's own ops). And the rounding shows: the f32
/// LoRA layer differs. A model with adapters switches to 16 bits on the
/// GPU (the adapters make no copies) and its loss tracks f32's.
#[test]
fn lora_in_16_bit_on_the_gpu_matches_its_rounded_oracle() {
    use padfree_model::kernels::dropout::{DropoutMask, RowKeys};
    use padfree_model::kernels::{LoraFactors, LoraLayer, composed_lora_linear, half_lora_linear};
    let half = half();
    let device = gpu().autodiff();
    let (n, c, o, r) = (37, 48, 29, 4);
    let (x0, w0) = (random(n * c, 1, 1.0), random(o * c, 2, 0.3));
    let (a0, b0) = (random(r * c, 5, 0.3), random(o * r, 6, 0.3));
    let dy0 = rounded(&random(n * o, 3, 0.5), half, &device);
    let factors = LoraFactors {
        scale: 2.0,
        dropout: Some(DropoutMask {
            p: 0.25,
            seed: 9,
            rows: RowKeys::indexed(n),
        }),
    };
    let run = |how: usize| {
        let x = trainable(float_tensor(x0.clone(), [n, c], &device));
        let w = float_tensor(w0.clone(), [o, c], &device);
        let a = trainable(float_tensor(a0.clone(), [r, c], &device));
        let b = trainable(float_tensor(b0.clone(), [o, r], &device));
        let layer = LoraLayer {
            w: w.clone(),
            quantized: None,
            a: a.clone(),
            b: b.clone(),
            factors: factors.clone(),
        };
        let y = match how {
            0 => {
                let copy = w.clone().inner().cast(half.dtype());
                half_lora_linear(x.clone(), layer, &copy).expect("the GPU layer")
            }
            1 => {
                let dropped = padfree_model::kernels::dropout::composed_dropout(
                    x.clone(),
                    factors.dropout.clone().expect("a mask"),
                );
                let down = composed_half_linear(dropped, a.clone(), half);
                composed_half_linear(x.clone(), w, half)
                    + composed_half_linear(down, b.clone(), half).mul_scalar(factors.scale)
            }
            _ => composed_lora_linear(x.clone(), layer),
        };
        let dy = float_tensor(dy0.clone(), [n, o], &device);
        let grads = backward(&(y.clone() * dy).sum());
        let g = |t: &Tensor<2>| grad(t, &grads).expect("a gradient").into_vec();
        (y.into_vec(), [g(&x), g(&a), g(&b)])
    };
    let (ours, oracle, full) = (run(0), run(1), run(2));
    let y_tolerance = match half {
        HalfFloat::F16 => 1e-4,
        HalfFloat::Bf16 => 2f32.powi(-7),
    };
    assert_close("LoRA y", &ours.0, &oracle.0, 1e-5, y_tolerance);
    for (i, name) in ["dx", "dA", "dB"].iter().enumerate() {
        assert_close(&format!("LoRA {name}"), &ours.1[i], &oracle.1[i], 0.0, 1e-4);
        assert!(ours.1[i].iter().any(|&v| v != 0.0), "{name} is not zero");
    }
    assert_ne!(
        ours.0, full.0,
        "16-bit rounding must show against the f32 layer"
    );

    let config = LlamaConfig::tiny();
    let cpu_model = LlamaModel::init(&config, 5, &cpu_device(true)).expect("valid");
    let lora = LoraConfig::trl_defaults();
    let model = on_gpu(&cpu_model)
        .with_lora(&lora, 1, "tiny")
        .expect("adapters");
    let half_model = model
        .clone()
        .with_precision(Precision::Bf16)
        .expect("LoRA in 16 bits on a GPU");
    assert_eq!(half_model.half_float(), Some(half));
    assert_eq!(
        half_model.bf16_refreshes(),
        0,
        "the adapters make no copies"
    );
    let batch = flatten(&examples(&[5, 9, 3], config.vocab_size as u32, 4)).expect("valid");
    let loss = |m: &LlamaModel| {
        m.loss_sum(&ModelInput::Varlen(&batch))
            .expect("a loss")
            .sum
            .into_vec()[0]
    };
    let (l16, l32) = (loss(&half_model), loss(&model));
    assert!(
        (l16 - l32).abs() <= 1e-2 * l32.abs() && l16 != l32,
        "16-bit LoRA loss {l16} vs f32 {l32}"
    );
}

/// The LM head with the cross-entropy in chunks of rows under `--bf16` on
/// the GPU (16-bit `x` and head copy, f32 logits and softmax) against the
/// whole logits of the oracle's 16-bit product (`composed_half_linear`)
/// through the cross-entropy kernel: the loss to the GPU tests' 1e-5 +
/// 1e-4 (the same f32 sums of the same rounded products); `dx` and `dhead`
/// to 2e-3 of their largest, because the op rounds each chunk's
/// `d_logits` to 16 bits for its products (scaled in f16), as autocast's
/// backward does, where the oracle multiplies them in f32.
#[test]
fn the_16_bit_head_and_cross_entropy_in_chunks_match_the_whole_16_bit_logits() {
    let half = half();
    let gpu = gpu().autodiff();
    let (rows, channels, vocab) = (11, 24, 301);
    let targets: Vec<usize> = (0..rows).map(|k| (k * 7919) % vocab).collect();
    let shape = [rows, channels, vocab];
    let (oracle_loss, oracle_grads) = head_loss_and_grads(&gpu, shape, |x, head| {
        cross_entropy_sum(composed_half_linear(x, head, half), &targets).expect("the kernel")
    });
    let (f32_loss, _) = head_loss_and_grads(&gpu, shape, |x, head| {
        head_cross_entropy_sum(x, head, None, &targets, rows).expect("the f32 op")
    });
    for chunk_rows in [1, 4, rows, 64] {
        let (loss, grads) = head_loss_and_grads(&gpu, shape, |x, head| {
            let head16 = head.clone().inner().cast(half.dtype());
            head_cross_entropy_sum(x, head, Some(&head16), &targets, chunk_rows)
                .expect("the op takes these")
        });
        let what = format!("{} chunks of {chunk_rows} rows", half.name());
        assert_close(&format!("{what}: loss"), &loss, &oracle_loss, 1e-5, 1e-4);
        assert_ne!(loss, f32_loss, "{what}: the 16-bit operands must show");
        for (i, name) in ["dx", "dhead"].iter().enumerate() {
            assert_close(
                &format!("{what}: {name}"),
                &grads[i],
                &oracle_grads[i],
                0.0,
                2e-3,
            );
        }
    }
}
