//! LoRA adapters: a fresh adapter changes nothing, only adapters get
//! gradients, padded == flattened == one at a time for the adapters'
//! gradients, merging gives the adapted model, and the adapter files round
//! trip bit-exactly.
//!
//! Tolerances as `equivalence.rs` (the same sums in f32 over different
//! shapes): 1e-5 absolute for O(1) logits, 1e-4 of each tensor's largest
//! gradient plus 1e-7 absolute. Merging adds `scale * B A` to `W` once in
//! f32 instead of computing `x A^T B^T` separately: the logits differ by
//! rounding of O(1e-7) per product, 1e-5 absolute.

mod common;

use common::{assert_close, examples, host};
use padfree_model::tensor::{IntoHostVec, backward, cpu_device, float_tensor, grad, trainable};
use padfree_model::{
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, DropoutDraw, LlamaConfig, LlamaModel, LoraConfig, LoraTarget,
    ModelInput, causal_lm_loss,
};
use padfree_pack::{Example, SplitMix64, flatten, pad};

fn lora(targets: &[LoraTarget]) -> LoraConfig {
    LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: targets.to_vec(),
    }
}

/// The tiny model on the autodiff CPU device with adapters on `targets`
/// (see [`with_adapters`]).
fn adapted(targets: &[LoraTarget], seed: u64) -> LlamaModel {
    let base = LlamaModel::init(&LlamaConfig::tiny(), 7, &cpu_device(true)).expect("valid config");
    with_adapters(base, targets, seed)
}

/// `base` with adapters on `targets`, every `B` filled with N(0, 0.05) so
/// the adapters change the outputs (a fresh `B` is zero, and with it `A`'s
/// gradient).
fn with_adapters(base: LlamaModel, targets: &[LoraTarget], seed: u64) -> LlamaModel {
    with_lora_config(base, &lora(targets), seed)
}

/// [`with_adapters`] with the adapters' settings `lora`.
fn with_lora_config(base: LlamaModel, lora: &LoraConfig, seed: u64) -> LlamaModel {
    let device = base.device().clone();
    let mut model = base.with_lora(lora, seed, "tiny").expect("valid lora");
    let mut rng = SplitMix64::new(seed);
    for param in model.trainable_mut() {
        if param.name().contains("lora_B") {
            let dims = param.value.dims();
            let values = (0..dims[0] * dims[1])
                .map(|_| 0.05 * rng.standard_normal() as f32)
                .collect();
            param.value = trainable(float_tensor(values, dims, &device));
        }
    }
    model
}

fn adapter_grads(model: &LlamaModel, input: &ModelInput<'_>) -> Vec<(String, Vec<f32>)> {
    let logits = model.forward(input).expect("forward");
    let loss = causal_lm_loss(logits, &input.targets()).expect("loss");
    let grads = backward(&loss.sum);
    for param in model.params() {
        assert!(
            grad(&param.value, &grads).is_none(),
            "{}: a frozen weight got a gradient",
            param.name()
        );
    }
    model
        .trainable()
        .into_iter()
        .map(|p| {
            let g = grad(&p.value, &grads)
                .map(IntoHostVec::into_vec)
                .unwrap_or_else(|| panic!("{}: an adapter got no gradient", p.name()));
            (p.name().to_owned(), g)
        })
        .collect()
}

#[test]
fn a_fresh_adapter_leaves_the_logits_bit_identical() {
    let device = cpu_device(false);
    let base = LlamaModel::init(&LlamaConfig::tiny(), 7, &device).expect("valid config");
    let adapted = base
        .clone()
        .with_lora(&lora(&LoraTarget::ALL), 3, "tiny")
        .expect("valid lora");
    let batch = flatten(&examples(&[9, 4, 13], 128, 5)).expect("flattens");
    let input = ModelInput::Varlen(&batch);
    assert_eq!(
        host(base.forward(&input).expect("forward")),
        host(adapted.forward(&input).expect("forward"))
    );
    // PEFT's initialisation: A in ±1/sqrt(C), not all zero; B zero.
    let c = LlamaConfig::tiny().hidden_size as f32;
    for param in adapted.trainable() {
        let values = param.value.clone().into_vec();
        if param.name().contains("lora_B") {
            assert!(values.iter().all(|&v| v == 0.0), "{}", param.name());
        } else if param.name().contains("q_proj") {
            let bound = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(bound <= 1.0 / c.sqrt() && bound > 0.5 / c.sqrt(), "{bound}");
        }
    }
}

#[test]
fn the_adapters_list_peft_names_and_shapes() {
    let model = adapted(&[LoraTarget::QProj, LoraTarget::DownProj], 1);
    let listed: Vec<(String, Vec<usize>)> = model
        .trainable()
        .iter()
        .map(|p| (p.name().to_owned(), p.hf_shape().to_vec()))
        .collect();
    let config = LlamaConfig::tiny();
    let (c, q, i) = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.intermediate_size,
    );
    let prefix = "base_model.model.model.layers";
    assert_eq!(listed.len(), 4 * config.num_hidden_layers);
    assert_eq!(
        listed[..4],
        [
            (
                format!("{prefix}.0.self_attn.q_proj.lora_A.weight"),
                vec![4, c]
            ),
            (
                format!("{prefix}.0.self_attn.q_proj.lora_B.weight"),
                vec![q, 4]
            ),
            (
                format!("{prefix}.0.mlp.down_proj.lora_A.weight"),
                vec![4, i]
            ),
            (
                format!("{prefix}.0.mlp.down_proj.lora_B.weight"),
                vec![c, 4]
            ),
        ]
    );
    let lora = lora(&[LoraTarget::QProj, LoraTarget::DownProj]);
    let counted: usize = model.trainable().iter().map(|p| p.numel()).sum();
    assert_eq!(lora.num_parameters(&config), counted);
}

/// The adapters' gradients summed over each example fed alone.
fn one_at_a_time(model: &LlamaModel, examples: &[Example]) -> Vec<Vec<f32>> {
    let mut sums: Vec<Vec<f32>> = Vec::new();
    for example in examples {
        let one = flatten(std::slice::from_ref(example)).expect("flattens");
        let grads = adapter_grads(model, &ModelInput::Varlen(&one));
        if sums.is_empty() {
            sums = grads.iter().map(|(_, g)| vec![0.0; g.len()]).collect();
        }
        for (sum, (_, g)) in sums.iter_mut().zip(grads) {
            sum.iter_mut().zip(g).for_each(|(s, v)| *s += v);
        }
    }
    sums
}

#[test]
fn padded_flattened_and_one_at_a_time_agree_on_adapter_gradients() {
    let model = adapted(&LoraTarget::ALL, 2);
    let examples: Vec<Example> = examples(&[7, 1, 12, 2, 5], 128, 9);
    let packed = flatten(&examples).expect("flattens");
    let padded = pad(&examples, 0, None).expect("pads");
    let flat = adapter_grads(&model, &ModelInput::Varlen(&packed));
    let padded = adapter_grads(&model, &ModelInput::Padded(&padded));
    let alone = one_at_a_time(&model, &examples);
    for (((name, flat), (_, padded)), alone) in flat.iter().zip(&padded).zip(&alone) {
        let scale = flat.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{name}: zero gradient");
        assert_close(&format!("{name}: padded vs flat"), padded, flat, 1e-7, 1e-4);
        assert_close(&format!("{name}: alone vs flat"), alone, flat, 1e-7, 1e-4);
    }
}

/// LoRA dropout keys each token's mask by (example, position in it): a
/// batch padded or flattened, its examples alone, in another order or split
/// in two micro-batches give the same adapter gradients as the flattened
/// batch (1e-4 of each tensor's largest plus 1e-7: only the grouping of
/// rows differs), with dropout 0.3. The masks do act: another step's seed,
/// or one example under another id, changes the gradients by more than 1%.
/// (Keyed by the row's index, padding moved the masks: padded and
/// flattened runs differed by 1e-3 relative.)
#[test]
fn dropout_masks_follow_the_token_not_its_row() {
    let base = LlamaModel::init(&LlamaConfig::tiny(), 7, &cpu_device(true)).expect("valid config");
    let lora = LoraConfig {
        dropout: 0.3,
        ..lora(&LoraTarget::ALL)
    };
    let mut model = with_lora_config(base, &lora, 2);
    let batch: Vec<Example> = examples(&[7, 1, 12, 2, 5], 128, 9);
    let ids: Vec<u64> = vec![30, 4, 17, 9, 22];
    let mut grads = |examples: &[Example], ids: &[u64], seed: u64, padded: bool| {
        model.set_lora_dropout(Some(DropoutDraw {
            seed,
            examples: ids.to_vec(),
        }));
        let grads = if padded {
            let batch = pad(examples, 0, None).expect("pads");
            adapter_grads(&model, &ModelInput::Padded(&batch))
        } else {
            let batch = flatten(examples).expect("flattens");
            adapter_grads(&model, &ModelInput::Varlen(&batch))
        };
        grads.into_iter().map(|(_, g)| g).collect::<Vec<_>>()
    };
    let sum = |parts: Vec<Vec<Vec<f32>>>| {
        let mut sums = parts[0].clone();
        for part in &parts[1..] {
            for (s, g) in sums.iter_mut().zip(part) {
                s.iter_mut().zip(g).for_each(|(s, v)| *s += v);
            }
        }
        sums
    };
    let flat = grads(&batch, &ids, 5, false);
    let padded = grads(&batch, &ids, 5, true);
    let alone = sum((0..batch.len())
        .map(|i| grads(&batch[i..=i], &ids[i..=i], 5, false))
        .collect());
    let reversed: Vec<Example> = batch.iter().rev().cloned().collect();
    let reversed_ids: Vec<u64> = ids.iter().rev().copied().collect();
    let reversed = grads(&reversed, &reversed_ids, 5, true);
    let split = sum(vec![
        grads(&batch[..2], &ids[..2], 5, false),
        grads(&batch[2..], &ids[2..], 5, true),
    ]);
    let other_seed = grads(&batch, &ids, 6, false);
    let mut renamed = ids.clone();
    renamed[2] = 99;
    let renamed = grads(&batch, &renamed, 5, false);
    let names: Vec<String> = model
        .trainable()
        .iter()
        .map(|p| p.name().to_owned())
        .collect();
    let distance = |a: &[f32], b: &[f32]| {
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        a.iter()
            .zip(b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
            / scale
    };
    let (mut seed_moved, mut id_moved) = (0.0f32, 0.0f32);
    for (at, name) in names.iter().enumerate() {
        let flat = &flat[at];
        assert!(flat.iter().any(|&v| v != 0.0), "{name}: zero gradient");
        for (what, ours) in [
            ("padded", &padded[at]),
            ("one at a time", &alone[at]),
            ("reversed and padded", &reversed[at]),
            ("in two micro-batches", &split[at]),
        ] {
            assert_close(
                &format!("{name}: {what} vs flattened"),
                ours,
                flat,
                1e-7,
                1e-4,
            );
        }
        seed_moved = seed_moved.max(distance(&other_seed[at], flat));
        id_moved = id_moved.max(distance(&renamed[at], flat));
    }
    assert!(
        seed_moved > 1e-2,
        "another seed moved the gradients by {seed_moved}"
    );
    assert!(
        id_moved > 1e-2,
        "another example id moved the gradients by {id_moved}"
    );
}

#[test]
fn the_merged_model_gives_the_adapted_logits() {
    let model = adapted(&LoraTarget::ALL, 4).without_autodiff();
    let merged = model.merged();
    assert!(merged.lora_config().is_none());
    let batch = flatten(&examples(&[9, 4, 13], 128, 5)).expect("flattens");
    let input = ModelInput::Varlen(&batch);
    let ours = host(model.forward(&input).expect("forward"));
    let base = host(
        LlamaModel::init(&LlamaConfig::tiny(), 7, &cpu_device(false))
            .expect("valid config")
            .forward(&input)
            .expect("forward"),
    );
    let theirs = host(merged.forward(&input).expect("forward"));
    assert_close("merged vs adapted logits", &theirs, &ours, 1e-5, 0.0);
    // The adapters do change the model, so the comparison means something.
    let (moved, _) = common::max_diff(&ours, &base);
    assert!(
        moved > 1e-3,
        "the adapters moved the logits by only {moved}"
    );
}

#[test]
fn adapter_files_round_trip_bit_exactly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = adapted(
        &[LoraTarget::QProj, LoraTarget::VProj, LoraTarget::UpProj],
        5,
    );
    model.save_adapter(dir.path()).expect("saves");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(ADAPTER_CONFIG)).expect("written"),
    )
    .expect("json");
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    assert_eq!(
        config["target_modules"],
        serde_json::json!(["q_proj", "v_proj", "up_proj"])
    );
    assert_eq!(config["base_model_name_or_path"], "tiny");
    assert!(dir.path().join(ADAPTER_WEIGHTS).is_file());

    let mut loaded = LlamaModel::init(&LlamaConfig::tiny(), 7, &cpu_device(true)).expect("valid");
    let base = loaded.load_adapter(dir.path()).expect("loads");
    assert_eq!(base.as_deref(), Some("tiny"));
    assert_eq!(loaded.lora_config(), model.lora_config());
    for (a, b) in loaded.trainable().iter().zip(model.trainable()) {
        assert_eq!(a.name(), b.name());
        assert_eq!(a.value.clone().into_vec(), b.value.clone().into_vec());
    }
    // Adapters of another shape are refused by tensor name.
    let mut wider = LlamaConfig::tiny();
    wider.intermediate_size *= 2;
    let mut other = LlamaModel::init(&wider, 7, &cpu_device(true)).expect("valid");
    let err = other
        .load_adapter(dir.path())
        .expect_err("refused")
        .to_string();
    assert!(err.contains("up_proj.lora_B.weight"), "{err}");
}

/// The same PEFT adapter under bf16 autocast (HF's Trainer with
/// `bf16=True`: `scripts/make_peft_reference.py --bf16`): padfree's
/// `--bf16` LoRA against it. Both round every matmul operand (base, `A`,
/// `B`, activations) and the attention's inputs and output to bf16; they
/// differ where autocast rounds and padfree does not (each op's output
/// before the next: the adapter's scaled product before it is added to
/// the base's, RoPE and SiLU after each step; the attention's
/// probabilities), each 2^-9 relative. So bf16's tolerances, as for the
/// full model's HF bf16 fixture (`bf16.rs`): logits within 2e-2 (seen
/// 4.4e-3; PEFT's own bf16 and f32 logits lie 3.4e-3 from ours and as far
/// from each other, so on this tiny model the fixture bounds the error),
/// the mean loss 2e-4 relative (seen 3.5e-5), every adapter gradient
/// within 3e-2 of its largest value (seen at most 1.5%, layer 1's
/// `gate_proj` A).
#[test]
fn peft_adapters_match_peft_under_bf16_autocast() {
    use padfree_model::Precision;
    use safetensors::SafeTensors;
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/peft/llama-tiny-lora");
    let f32_bytes = std::fs::read(fixture.join("expected.safetensors")).expect("fixture present");
    let f32_expected = SafeTensors::deserialize(&f32_bytes).expect("valid fixture");
    let bytes = std::fs::read(fixture.join("expected-bf16.safetensors")).expect("bf16 fixture");
    let expected = SafeTensors::deserialize(&bytes).expect("valid fixture");
    let labels = common::ints(&f32_expected, "labels");
    let batch = flatten(&common::fixture_examples(&f32_expected, &labels)).expect("flattens");

    let mut model = LlamaModel::from_hf_dir(&common::fixture_dir("llama-tiny"), &cpu_device(true))
        .expect("loads the base");
    model.load_adapter(&fixture).expect("loads PEFT's adapter");
    let model = model.with_precision(Precision::Bf16).expect("bf16 LoRA");
    let input = ModelInput::Varlen(&batch);
    let logits = model.forward(&input).expect("forward");
    let ours = host(logits.clone());
    let theirs = common::floats(&expected, "logits");
    let (diff, _) = common::max_diff(&ours, &theirs);
    let (f32_diff, _) = common::max_diff(&ours, &common::floats(&f32_expected, "logits"));
    eprintln!("logits: max diff {diff:e} from PEFT bf16, {f32_diff:e} from PEFT f32");
    assert_close("logits vs PEFT bf16", &ours, &theirs, 2e-2, 0.0);
    let mean = causal_lm_loss(logits, &input.targets())
        .expect("loss")
        .mean();
    let loss = host(mean.clone())[0];
    let (peft_bf16, peft_f32) = (
        common::floats(&expected, "loss")[0],
        common::floats(&f32_expected, "loss")[0],
    );
    eprintln!("loss: ours {loss}, PEFT bf16 {peft_bf16}, PEFT f32 {peft_f32}");
    assert!(
        loss != peft_f32,
        "bf16 must not give PEFT's f32 loss exactly"
    );
    assert!(
        (loss - peft_bf16).abs() <= 2e-4 * peft_bf16.abs(),
        "loss {loss} vs PEFT bf16 {peft_bf16}"
    );
    let grads = backward(&mean);
    let mut compared = 0;
    for param in model.trainable() {
        let ours = grad(&param.value, &grads)
            .expect("adapter gradient")
            .into_vec();
        let theirs = common::floats(&expected, &format!("grad.{}", param.name()));
        let (diff, scale) = common::max_diff(&ours, &theirs);
        eprintln!("{}: max diff {diff:.3e} of {scale:.3e}", param.name());
        assert_close(
            &format!("{}: gradient vs PEFT bf16", param.name()),
            &ours,
            &theirs,
            1e-7,
            3e-2,
        );
        compared += 1;
    }
    assert_eq!(compared, 2 * 7 * 2, "A and B of 7 modules in 2 layers");
}

/// PEFT's own adapter (`scripts/make_peft_reference.py`: every linear layer
/// of the tiny Llama fixture, `B` random), loaded by padfree: the logits,
/// loss and every adapter gradient PEFT computed on the same flattened
/// batch. Logits within 1e-4 of their scale (the issue's bound; seen:
/// about 1e-6), loss 1e-5 relative, gradients as the HF fixtures (1e-4 of
/// each tensor's largest plus 1e-7). Written back, the adapter file holds
/// PEFT's tensors bit for bit.
#[test]
fn peft_adapters_load_and_match_peft() {
    use safetensors::SafeTensors;
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/peft/llama-tiny-lora");
    let bytes = std::fs::read(fixture.join("expected.safetensors")).expect("fixture present");
    let expected = SafeTensors::deserialize(&bytes).expect("valid fixture");
    let labels = common::ints(&expected, "labels");
    let examples = common::fixture_examples(&expected, &labels);
    let batch = flatten(&examples).expect("flattens");

    let mut model = LlamaModel::from_hf_dir(&common::fixture_dir("llama-tiny"), &cpu_device(true))
        .expect("loads the base");
    let base = model.load_adapter(&fixture).expect("loads PEFT's adapter");
    assert_eq!(base.as_deref(), Some("fixtures/hf/llama-tiny"));
    assert_eq!(
        model.lora_config().map(|c| (c.r, c.alpha, c.targets.len())),
        Some((4, 8.0, 7))
    );
    let input = ModelInput::Varlen(&batch);
    let logits = model.forward(&input).expect("forward");
    let theirs = common::floats(&expected, "logits");
    let scale = theirs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert_close(
        "logits vs PEFT",
        &host(logits.clone()),
        &theirs,
        1e-4 * scale,
        0.0,
    );
    let loss = causal_lm_loss(logits, &input.targets()).expect("loss");
    let mean = loss.mean();
    assert_close(
        "mean loss vs PEFT",
        &host(mean.clone()),
        &common::floats(&expected, "loss"),
        0.0,
        1e-5,
    );
    let grads = backward(&mean);
    for param in model.trainable() {
        let ours = grad(&param.value, &grads)
            .expect("adapter gradient")
            .into_vec();
        let theirs = common::floats(&expected, &format!("grad.{}", param.name()));
        assert_close(
            &format!("{}: gradient vs PEFT", param.name()),
            &ours,
            &theirs,
            1e-7,
            1e-4,
        );
    }

    let dir = tempfile::tempdir().expect("temp dir");
    model.save_adapter(dir.path()).expect("saves");
    let peft_bytes = std::fs::read(fixture.join(ADAPTER_WEIGHTS)).expect("fixture present");
    let peft_file = SafeTensors::deserialize(&peft_bytes).expect("valid");
    let our_bytes = std::fs::read(dir.path().join(ADAPTER_WEIGHTS)).expect("written");
    let ours = SafeTensors::deserialize(&our_bytes).expect("valid");
    let mut names: Vec<&str> = peft_file.names();
    let mut our_names: Vec<&str> = ours.names();
    names.sort_unstable();
    our_names.sort_unstable();
    assert_eq!(names, our_names, "tensor names differ from PEFT's");
    for name in names {
        let (a, b) = (
            peft_file.tensor(name).expect("listed"),
            ours.tensor(name).expect("listed"),
        );
        assert_eq!((a.shape(), a.data()), (b.shape(), b.data()), "{name}");
    }

    // For the reverse direction with PEFT itself (`make_peft_reference.py
    // --check DIR`): the adapter as padfree writes it and padfree's logits.
    if let Some(out) = std::env::var_os("PADFREE_PEFT_CHECK_DIR") {
        let out = std::path::PathBuf::from(out);
        model.save_adapter(&out).expect("saves");
        let logits = model.without_autodiff().forward(&input).expect("forward");
        let ids: Vec<i64> = batch.input_ids().iter().map(|&i| i64::from(i)).collect();
        let positions: Vec<i64> = batch.position_ids().iter().map(|&i| i64::from(i)).collect();
        let logit_values = host(logits.clone());
        let to_bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let logit_bytes: Vec<u8> = logit_values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let (id_bytes, pos_bytes) = (to_bytes(&ids), to_bytes(&positions));
        use safetensors::tensor::{Dtype, TensorView};
        let views = vec![
            (
                "input_ids",
                TensorView::new(Dtype::I64, vec![ids.len()], &id_bytes).expect("view"),
            ),
            (
                "position_ids",
                TensorView::new(Dtype::I64, vec![ids.len()], &pos_bytes).expect("view"),
            ),
            (
                "logits",
                TensorView::new(Dtype::F32, logits.dims().to_vec(), &logit_bytes).expect("view"),
            ),
        ];
        let file = safetensors::serialize(views, None).expect("serialises");
        std::fs::write(out.join("logits.safetensors"), file).expect("written");
    }
}

/// QLoRA: the tiny Llama with every projection in GGUF blocks
/// (`fixtures/gguf/llama-tiny-q4.gguf`: Q4_0, Q4_1, Q8_0), kept in its
/// blocks and multiplied by the fused kernel, against the same file
/// dequantised to f32, with the same adapters: logits (1e-5 absolute, O(1)
/// values: the same products summed in gemm's order vs burn's), the summed
/// loss (1e-5 relative) and every adapter gradient (1e-4 of each tensor's
/// largest plus 1e-7), padded and flattened alike. The quantized base holds
/// fewer bytes, and merging it gives the adapted logits.
#[test]
fn a_base_kept_in_gguf_blocks_trains_as_its_dequantised_copy() {
    use padfree_model::gguf::GgufFile;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/gguf/llama-tiny-q4.gguf");
    let file = GgufFile::open(&path).expect("fixture present");
    let device = cpu_device(true);
    let quantized = with_adapters(
        LlamaModel::from_gguf_quantized(&file, &device).expect("loads"),
        &LoraTarget::ALL,
        6,
    );
    let dense = with_adapters(
        LlamaModel::from_gguf_file(&file, &device).expect("loads"),
        &LoraTarget::ALL,
        6,
    );
    assert!(quantized.is_quantized() && !dense.is_quantized());
    assert!(
        quantized.weight_bytes() * 2 < dense.weight_bytes(),
        "{} vs {} bytes",
        quantized.weight_bytes(),
        dense.weight_bytes()
    );

    let examples = examples(&[7, 1, 12, 2, 5], 128, 13);
    let packed = flatten(&examples).expect("flattens");
    let padded = pad(&examples, 0, None).expect("pads");
    for input in [ModelInput::Varlen(&packed), ModelInput::Padded(&padded)] {
        let logits = |model: &LlamaModel| host(model.forward(&input).expect("forward"));
        assert_close(
            "logits: blocks vs f32",
            &logits(&quantized),
            &logits(&dense),
            1e-5,
            0.0,
        );
        let ours = adapter_grads(&quantized, &input);
        let theirs = adapter_grads(&dense, &input);
        for ((name, a), (_, b)) in ours.iter().zip(&theirs) {
            assert_close(&format!("{name}: blocks vs f32"), a, b, 1e-7, 1e-4);
        }
    }
    let input = ModelInput::Varlen(&packed);
    let merged = quantized.merged();
    assert_close(
        "merged blocks vs adapted",
        &host(merged.forward(&input).expect("forward")),
        &host(quantized.forward(&input).expect("forward")),
        1e-5,
        0.0,
    );
}

/// `--bf16` with LoRA and QLoRA: the tiny Llama of the GGUF fixture with
/// adapters on every projection, its base dense (f32 dequantised) or kept
/// in its blocks. Per base: padded, flattened and one-at-a-time passes run
/// the same bf16 kernels and agree as f32's do (logits 1e-5, loss 1e-5
/// relative, adapter gradients 1e-4 of each tensor's largest plus 1e-7:
/// only the grouping of rows differs); the bf16 logits are f32's up to
/// bf16 rounding through two layers (5e-2 of their scale, as full
/// fine-tuning's test) and not f32's exactly; the base's copies are made
/// once and are the rounded base, the adapters' are the rounded adapters
/// and are made again by `refresh_bf16_weights`, the base's not.
#[test]
fn bf16_adapters_on_dense_and_quantized_bases_agree_across_layouts() {
    use common::{max_diff, real_rows};
    use padfree_model::Precision;
    use padfree_model::gguf::GgufFile;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/gguf/llama-tiny-q4.gguf");
    let file = GgufFile::open(&path).expect("fixture present");
    let device = cpu_device(true);
    let bases = [
        LlamaModel::from_gguf_file(&file, &device).expect("loads"),
        LlamaModel::from_gguf_quantized(&file, &device).expect("loads"),
    ];
    for base in bases {
        let quantized = base.is_quantized();
        let f32_model = with_adapters(base, &LoraTarget::ALL, 6);
        let mut model = f32_model
            .clone()
            .with_precision(Precision::Bf16)
            .expect("bf16 LoRA on the CPU");
        let vocab = model.config().vocab_size;
        let examples = examples(&[7, 1, 12, 2, 5], vocab as u32, 13);
        let packed = flatten(&examples).expect("flattens");
        let padded = pad(&examples, 0, None).expect("pads");
        let varlen_input = ModelInput::Varlen(&packed);
        let padded_input = ModelInput::Padded(&padded);
        let case = |what: &str| format!("{what} (quantized base {quantized})");

        let logits = |model: &LlamaModel, input: &ModelInput<'_>| {
            host(model.without_autodiff().forward(input).expect("forward"))
        };
        let varlen = logits(&model, &varlen_input);
        let padded_rows = real_rows(
            &logits(&model, &padded_input),
            &examples,
            padded.seq_len(),
            vocab,
        );
        assert_close(&case("padded vs varlen"), &padded_rows, &varlen, 1e-5, 0.0);
        let alone: Vec<f32> = examples
            .iter()
            .flat_map(|e| {
                let one = flatten(std::slice::from_ref(e)).expect("flattens");
                logits(&model, &ModelInput::Varlen(&one))
            })
            .collect();
        assert_close(&case("one at a time vs varlen"), &alone, &varlen, 1e-5, 0.0);
        let (diff, scale) = max_diff(&varlen, &logits(&f32_model, &varlen_input));
        assert!(diff > 0.0, "{}", case("bf16 logits equal f32's"));
        assert!(
            diff <= 5e-2 * scale,
            "{}: {diff:e} of {scale:e}",
            case("bf16 vs f32 logits")
        );

        let loss = |input: &ModelInput<'_>| -> f32 {
            let logits = model.forward(input).expect("forward");
            let loss = causal_lm_loss(logits, &input.targets()).expect("loss");
            loss.sum.into_vec()[0]
        };
        let (l_varlen, l_padded) = (loss(&varlen_input), loss(&padded_input));
        assert!(
            (l_varlen - l_padded).abs() <= 1e-5 * l_varlen.abs(),
            "{}: {l_varlen} vs {l_padded}",
            case("loss")
        );
        let ours = adapter_grads(&model, &varlen_input);
        let theirs = adapter_grads(&model, &padded_input);
        let alone = one_at_a_time(&model, &examples);
        for (((name, a), (_, b)), c) in ours.iter().zip(&theirs).zip(&alone) {
            assert!(a.iter().any(|&g| g != 0.0), "{name}: no gradient flowed");
            assert_close(&case(&format!("{name} padded")), b, a, 1e-7, 1e-4);
            assert_close(&case(&format!("{name} alone")), c, a, 1e-7, 1e-4);
        }

        // The copies: base once, adapters once per refresh.
        let rounded = |v: Vec<f32>| -> Vec<f32> {
            v.iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect()
        };
        let mut base_copies = 0;
        for (index, param) in model.params().into_iter().enumerate() {
            if let Some(copy) = model.bf16_copy_values(index) {
                assert_eq!(
                    copy,
                    rounded(param.value.clone().into_vec()),
                    "{}",
                    param.name()
                );
                base_copies += 1;
            }
        }
        // Dense: 7 projections in each of 2 layers and the head; in blocks
        // only the head (the projections are dequantised per tile).
        let layers = model.config().num_hidden_layers;
        assert_eq!(base_copies, if quantized { 1 } else { 7 * layers + 1 });
        assert_eq!(model.bf16_refreshes(), 1);
        let copied = (0..model.params().len())
            .find(|&i| model.bf16_copy_values(i).is_some())
            .expect("a base weight with a copy");
        let before = model.bf16_copy_values(copied);
        for param in model.trainable_mut() {
            let dims = param.value.dims();
            let values = param
                .value
                .clone()
                .into_vec()
                .iter()
                .map(|v| v * 2.0 + 1e-3)
                .collect();
            param.value = trainable(float_tensor(values, dims, &device));
        }
        model.refresh_bf16_weights();
        assert_eq!(model.bf16_refreshes(), 2);
        assert_eq!(
            model.bf16_copy_values(copied),
            before,
            "the base's copy is kept"
        );
        for (index, param) in model.trainable().into_iter().enumerate() {
            assert_eq!(
                model.adapter_bf16_copy_values(index),
                Some(rounded(param.value.clone().into_vec())),
                "{}",
                param.name()
            );
        }
    }
}
