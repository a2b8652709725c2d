//! Per-layer gradient checkpointing (`model/checkpointing.rs`) against the
//! oracle, one forward pass on the graph and one backward
//! (`LlamaModel::loss_sum`): the same loss and the same gradient for every
//! trained tensor, full fine-tuning (tied and untied head) and LoRA with
//! dropout on an f32 and a GGUF-block base, in every attention layout, with
//! the head in one chunk and in chunks of 3 labelled rows. Every pass also
//! checks the buckets it reports complete: no later part adds to them, and
//! the buckets cover every trained tensor once.
//!
//! Tolerances: the loss 1e-5 relative (chunks add partial sums in another
//! order); gradients 1e-4 of each tensor's largest plus 1e-7 absolute, as
//! `equivalence.rs` (a tied embedding's gradient, and with chunks the
//! head's, is a sum of parts added in another order; everything else is the
//! same operations on the same values).

mod common;

use common::{assert_close, examples};
use padfree_model::tensor::{Gradients, IntoHostVec, backward, cpu_device, take_grad};
use padfree_model::{LlamaConfig, LlamaModel, LoraConfig, LoraTarget, ModelInput};
use padfree_pack::{flatten, pad};

/// The loss sum and every trained tensor's gradient of `loss / divisor`, one
/// forward and one backward pass.
fn oracle(model: &LlamaModel, input: &ModelInput<'_>, divisor: f64) -> (f32, Vec<Vec<f32>>) {
    let loss = model.loss_sum(input).expect("loss");
    let value = loss.sum.clone().into_vec()[0];
    let mut grads = backward(&loss.sum.div_scalar(divisor));
    let mut sums = zeros(model);
    add(model, &mut sums, &mut grads);
    (value, sums)
}

/// The same through per-layer recomputation, the parts summed; and how
/// many parts there were.
fn recomputed(
    model: &LlamaModel,
    input: &ModelInput<'_>,
    divisor: f64,
    head_chunk_rows: usize,
) -> (f32, Vec<Vec<f32>>, usize) {
    let mut sums = zeros(model);
    let mut parts = 0;
    // Per part: the trained tensors it reached, and the buckets then complete.
    let mut reached: Vec<(Vec<usize>, usize)> = Vec::new();
    let value = model
        .loss_backward_checkpointed(input, divisor, head_chunk_rows, |g, done| {
            reached.push((add(model, &mut sums, g), done));
            parts += 1;
        })
        .expect("checkpointed pass");
    assert_buckets_complete(model, &reached);
    (value, sums, parts)
}

/// The buckets partition the trained tensors, the count of complete ones
/// only grows, no part adds to a bucket an earlier part called complete,
/// and every bucket is complete after the last part (the embedding trains
/// in every model here).
fn assert_buckets_complete(model: &LlamaModel, reached: &[(Vec<usize>, usize)]) {
    let buckets = model.gradient_buckets();
    let mut covered: Vec<usize> = buckets.iter().flat_map(|b| b.clone()).collect();
    covered.sort_unstable();
    assert_eq!(covered, (0..model.trainable().len()).collect::<Vec<_>>());
    let mut complete = 0;
    for (part, (touched, done)) in reached.iter().enumerate() {
        assert!(*done >= complete, "part {part}: {done} after {complete}");
        for &param in touched {
            assert!(
                !buckets[..complete].iter().any(|b| b.contains(&param)),
                "part {part} adds to {}, whose bucket was complete",
                model.trainable()[param].name()
            );
        }
        complete = *done;
    }
    assert_eq!(complete, buckets.len(), "buckets left incomplete");
}

fn zeros(model: &LlamaModel) -> Vec<Vec<f32>> {
    model
        .trainable()
        .iter()
        .map(|p| vec![0.0; p.numel()])
        .collect()
}

/// Takes every trained tensor's gradient out of `part` (as the trainer
/// does) and adds it to its sum: the indices of those it held.
fn add(model: &LlamaModel, sums: &mut [Vec<f32>], part: &mut Gradients) -> Vec<usize> {
    let mut reached = Vec::new();
    for (index, (sum, p)) in sums.iter_mut().zip(model.trainable()).enumerate() {
        if let Some(g) = take_grad(&p.value, part) {
            for (s, v) in sum.iter_mut().zip(g.into_vec()) {
                *s += v;
            }
            reached.push(index);
        }
    }
    reached
}

fn assert_same(model: &LlamaModel, what: &str) {
    let batch = examples(&[9, 1, 14, 3, 6], 128, 21);
    let packed = flatten(&batch).expect("flattens");
    let padded = pad(&batch, 0, None).expect("pads");
    let labels: usize = batch.iter().map(|e| e.num_loss_tokens()).sum();
    let divisor = 2.0 * labels as f64;
    for (layout, input) in [
        ("varlen", ModelInput::Varlen(&packed)),
        ("varlen-per-layer", ModelInput::VarlenPerLayer(&packed)),
        ("padded", ModelInput::Padded(&padded)),
    ] {
        let (loss, grads) = oracle(model, &input, divisor);
        for chunk in [model.head_chunk_rows(), 3] {
            let (ours, our_grads, parts) = recomputed(model, &input, divisor, chunk);
            let case = format!("{what}, {layout}, head chunks of {chunk}");
            assert!(
                (ours - loss).abs() <= 1e-5 * loss.abs(),
                "{case}: loss {ours} vs {loss}"
            );
            // One part per head chunk, per layer, and the embedding when it trains.
            let layers = model.config().num_hidden_layers;
            let chunks = labels.div_ceil(chunk);
            assert!(
                parts == chunks + layers || parts == chunks + layers + 1,
                "{case}: {parts} parts"
            );
            for ((param, a), b) in model.trainable().into_iter().zip(&our_grads).zip(&grads) {
                assert!(
                    b.iter().any(|&v| v != 0.0),
                    "{case}: {} has no gradient to compare",
                    param.name()
                );
                assert_close(&format!("{case}: {}", param.name()), a, b, 1e-7, 1e-4);
            }
        }
    }
}

#[test]
fn full_fine_tuning_recomputed_layer_by_layer_gives_the_oracle_gradients() {
    let device = cpu_device(true);
    let untied = LlamaConfig::tiny();
    assert!(!untied.tie_word_embeddings);
    assert_same(
        &LlamaModel::init(&untied, 4, &device).expect("valid"),
        "untied",
    );
    let tied = LlamaConfig {
        tie_word_embeddings: true,
        ..LlamaConfig::tiny()
    };
    assert_same(&LlamaModel::init(&tied, 4, &device).expect("valid"), "tied");
}

#[test]
fn lora_with_dropout_recomputed_draws_the_same_masks() {
    let device = cpu_device(true);
    let lora = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.2,
        targets: LoraTarget::ALL.to_vec(),
    };
    let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/gguf/llama-tiny-q4.gguf");
    let file = padfree_model::gguf::GgufFile::open(&gguf).expect("fixture present");
    for (what, base) in [
        (
            "LoRA",
            LlamaModel::init(&LlamaConfig::tiny(), 4, &device).expect("valid"),
        ),
        (
            "QLoRA",
            LlamaModel::from_gguf_quantized(&file, &device).expect("loads"),
        ),
    ] {
        let mut model = base.with_lora(&lora, 9, "tiny").expect("valid lora");
        // A fresh B is zero, and so A's gradient: give B values.
        for param in model.trainable_mut() {
            if param.name().contains("lora_B") {
                param.value = padfree_model::tensor::trainable(
                    param.value.clone().inner().add_scalar(0.03).autodiff(),
                );
            }
        }
        // `assert_same`'s five examples, by arbitrary ids.
        model.set_lora_dropout(Some(padfree_model::DropoutDraw {
            seed: 77,
            examples: vec![40, 7, 41, 3, 12],
        }));
        assert_same(&model, what);
    }
}

#[test]
fn a_batch_without_labels_has_zero_loss_and_no_gradients() {
    let model = LlamaModel::init(&LlamaConfig::tiny(), 4, &cpu_device(true)).expect("valid");
    let mut batch = examples(&[5, 4], 128, 3);
    for example in &mut batch {
        *example =
            padfree_pack::Example::new(example.input_ids().to_vec(), vec![-100; example.len()])
                .expect("valid example");
    }
    let packed = flatten(&batch).expect("flattens");
    let mut parts = 0;
    let loss = model
        .loss_backward_checkpointed(&ModelInput::Varlen(&packed), 1.0, 8, |_, _| parts += 1)
        .expect("runs");
    assert_eq!((loss, parts), (0.0, 0));
}
