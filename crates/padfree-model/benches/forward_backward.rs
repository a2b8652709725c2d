//! Forward + backward throughput of the `small` preset on one ragged batch,
//! for each attention strategy. Throughput counts real (non-pad) tokens for
//! every strategy, so the padded baseline pays for its pads in the figure.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use padfree_model::tensor::{backward, cpu_device};
use padfree_model::{LlamaConfig, LlamaModel, ModelInput, causal_lm_loss};
use padfree_pack::{flatten, pad, synthetic_examples, synthetic_lengths};

fn step(model: &LlamaModel, input: &ModelInput<'_>) {
    let logits = model.forward(input).expect("forward");
    let loss = causal_lm_loss(logits, &input.targets()).expect("loss");
    black_box(backward(&loss.sum));
}

fn forward_backward(c: &mut Criterion) {
    let config = LlamaConfig::small();
    let model = LlamaModel::init(&config, 0, &cpu_device(true)).expect("valid preset");
    // 8 examples, median 128 tokens: a ragged fine-tuning batch.
    let lengths = synthetic_lengths(8, 128, 512, 1);
    let examples = synthetic_examples(&lengths, config.vocab_size as u32, 1);
    let packed = flatten(&examples).expect("flattens");
    let padded = pad(&examples, 0, None).expect("pads");
    eprintln!(
        "batch: {} examples, lengths {:?}, {} real tokens, padded {} x {} = {} fed ({:.1}% pads)",
        examples.len(),
        lengths,
        packed.num_tokens(),
        padded.batch_size(),
        padded.seq_len(),
        padded.num_fed_tokens(),
        100.0 * padded.padding_fraction()
    );

    let mut group = c.benchmark_group("small_forward_backward");
    group.sample_size(10);
    group.throughput(Throughput::Elements(packed.num_tokens() as u64));
    let inputs = [
        ("varlen", ModelInput::Varlen(&packed)),
        ("varlen-per-layer", ModelInput::VarlenPerLayer(&packed)),
        ("padded", ModelInput::Padded(&padded)),
    ];
    for (name, input) in inputs {
        group.bench_with_input(BenchmarkId::from_parameter(name), &input, |b, input| {
            b.iter(|| step(&model, input))
        });
    }
    group.finish();
}

criterion_group!(benches, forward_backward);
criterion_main!(benches);
