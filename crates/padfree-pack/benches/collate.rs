//! Collator throughput: padding-free `flatten` against the padded baseline,
//! and the cost of deriving batch metadata in a layer against receiving it.
//! Throughput is counted in real (non-pad) tokens for every variant.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use padfree_pack::{
    BatchMeta, BinPacking, flatten, pack_into_bins, pad, synthetic_examples, synthetic_lengths,
};

const VOCAB: u32 = 32_000;

fn collators(c: &mut Criterion) {
    let mut group = c.benchmark_group("collate");
    for batch_size in [8usize, 64] {
        let lengths = synthetic_lengths(batch_size, 256, 2048, 7);
        let examples = synthetic_examples(&lengths, VOCAB, 7);
        let real_tokens: usize = lengths.iter().sum();
        group.throughput(Throughput::Elements(real_tokens as u64));
        group.bench_with_input(
            BenchmarkId::new("flatten", batch_size),
            &examples,
            |b, ex| b.iter(|| flatten(black_box(ex))),
        );
        group.bench_with_input(BenchmarkId::new("pad", batch_size), &examples, |b, ex| {
            b.iter(|| pad(black_box(ex), 0, Some(8)))
        });
    }
    group.finish();
}

fn metadata(c: &mut Criterion) {
    let lengths = synthetic_lengths(64, 256, 2048, 11);
    let examples = synthetic_examples(&lengths, VOCAB, 11);
    let batch = flatten(&examples).expect("valid batch");
    let mut group = c.benchmark_group("batch_meta");
    group.throughput(Throughput::Elements(batch.num_tokens() as u64));
    group.bench_function("from_collator_lengths", |b| {
        b.iter(|| BatchMeta::from_lengths(black_box(&lengths).iter().copied()))
    });
    group.bench_function("derived_from_position_ids", |b| {
        b.iter(|| BatchMeta::derive_from_position_ids(black_box(batch.position_ids())))
    });
    group.finish();
}

fn packing(c: &mut Criterion) {
    let lengths = synthetic_lengths(100_000, 256, 4096, 3);
    let mut group = c.benchmark_group("bin_packing_100k_examples");
    group.throughput(Throughput::Elements(lengths.len() as u64));
    group.sample_size(10);
    for (name, algorithm) in [
        ("first_fit_decreasing", BinPacking::FirstFitDecreasing),
        ("best_fit_decreasing", BinPacking::BestFitDecreasing),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| pack_into_bins(black_box(&lengths), 8192, algorithm))
        });
    }
    group.finish();
}

criterion_group!(benches, collators, metadata, packing);
criterion_main!(benches);
