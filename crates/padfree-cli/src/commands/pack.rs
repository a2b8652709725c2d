//! `padfree pack`: the collator and the packing plan, shown on one dataset.

use std::time::Instant;

use anyhow::Context;
use padfree_pack::{
    Balance, BinPacking, Example, PackingConfig, flatten, pad, plan_epoch, synthetic_examples,
};

use padfree_data::TokenizeConfig;

use super::data::data_set;
use super::load::{embedded_tokenizer, load_tokenizer_file};
use crate::args::{PackData, PackJob};

/// Token ids of the synthetic examples are drawn below a Llama-sized vocabulary.
const VOCAB_SIZE: u32 = 32_000;
const PAD_ID: u32 = 0;

pub fn run(config: &PackJob) -> anyhow::Result<()> {
    println!("padfree pack: the padding-free collator and multipack packing\n");
    show_collator_example()?;
    let examples = match &config.data {
        Some(data) => data_examples(data, config.max_seq_len)?,
        None => synthetic_examples(&config.lengths, VOCAB_SIZE, config.seed),
    };
    let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
    println!("Dataset: {} examples, {}", examples.len(), config.source);
    compare_padded_and_flattened(&examples, config.per_device_train_batch_size)?;
    show_packing_plans(config, &lengths)
}

/// The examples of `data`, tokenized as `padfree train` tokenizes them
/// (through the same cache), with what was read said as `train` says it.
fn data_examples(data: &PackData, max_seq_len: usize) -> anyhow::Result<Vec<Example>> {
    let tokenizer = match &data.tokenizer {
        Some(path) => load_tokenizer_file(path)?,
        None => embedded_tokenizer()?,
    };
    println!(
        "tokenizer: {} ({} tokens)",
        tokenizer.source_name(),
        tokenizer.vocab_size()
    );
    let config = TokenizeConfig {
        train_on_inputs: data.train_on_inputs,
        use_chat_template: data.use_chat_template,
        max_seq_len,
        overlong: data.overlong,
        vocab_limit: tokenizer.vocab_size(),
    };
    let (name, dataset) = data_set(
        ("data", Some(&data.path), ("", "")),
        (data.cache.as_ref(), &data.fields),
        None,
        Some(&tokenizer),
        &config,
    )?;
    println!("data: {}: {}", name.display(), dataset.report);
    Ok(dataset.examples.into_examples()?)
}

/// Hugging Face's own test case for `DataCollatorWithFlattening`.
fn show_collator_example() -> anyhow::Result<()> {
    let examples = [
        vec![10, 11, 12],
        vec![20, 21, 22, 23, 24, 25],
        vec![30, 31, 32, 33, 34, 35, 36],
    ]
    .into_iter()
    .map(Example::causal)
    .collect::<Result<Vec<_>, _>>()?;
    let batch = flatten(&examples)?;
    println!("1. The collator flattens three examples into one row (no padding):");
    println!("   input_ids    {:?}", batch.input_ids());
    println!("   labels       {:?}", batch.labels());
    println!("   position_ids {:?}", batch.position_ids());
    println!("   seq_idx      {:?}", batch.seq_idx());
    println!(
        "   cu_seqlens   {:?}   max_seqlen {}   (computed once, here, for every layer)",
        batch.meta().cu_seqlens(),
        batch.meta().max_seqlen()
    );
    println!(
        "   {} tokens, {} of them count in the loss: the first label of each example is -100\n",
        batch.num_tokens(),
        batch.num_loss_tokens()
    );
    Ok(())
}

/// Collates the whole dataset in data order both ways and reports what the
/// model would be fed, and how fast each collator ran here.
fn compare_padded_and_flattened(examples: &[Example], batch_size: usize) -> anyhow::Result<()> {
    let (mut real, mut fed_padded, mut loss_flat, mut loss_padded) =
        (0usize, 0usize, 0usize, 0usize);
    let started = Instant::now();
    for chunk in examples.chunks(batch_size) {
        let batch = flatten(chunk).context("flattening a batch")?;
        real += batch.num_tokens();
        loss_flat += batch.num_loss_tokens();
    }
    let flatten_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for chunk in examples.chunks(batch_size) {
        let batch = pad(chunk, PAD_ID, None).context("padding a batch")?;
        fed_padded += batch.num_fed_tokens();
        loss_padded += batch.num_loss_tokens();
    }
    let pad_seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        loss_flat == loss_padded,
        "loss token counts differ: {loss_flat} vs {loss_padded}"
    );

    let pads = fed_padded - real;
    println!(
        "2. Batches of {batch_size} examples in data order ({} batches):",
        examples.len().div_ceil(batch_size)
    );
    println!(
        "   padded:       feeds {fed_padded:>10} tokens, {pads} of them pads (padding fraction {:.1}%)",
        100.0 * pads as f64 / fed_padded as f64
    );
    println!(
        "   padding-free: feeds {real:>10} tokens, all real; {loss_flat} count in the loss either way"
    );
    println!(
        "   ideal speed-up of padding-free (fed padded / real): {:.2}x",
        fed_padded as f64 / real as f64
    );
    println!(
        "   collator throughput here: flatten {:.0} M real tokens/s, pad {:.0} M real tokens/s\n",
        real as f64 / flatten_seconds / 1e6,
        real as f64 / pad_seconds / 1e6
    );
    Ok(())
}

fn show_packing_plans(config: &PackJob, lengths: &[usize]) -> anyhow::Result<()> {
    println!(
        "3. Multipack: bins of {} tokens dealt to {} ranks, one bin per rank per step",
        config.capacity, config.world_size
    );
    println!(
        "   {:<4} {:<9} {:>6} {:>10} {:>6} {:>10} {:>10} {:>10} {:>10}",
        "",
        "balance",
        "bins",
        "efficiency",
        "steps",
        "rank tok",
        "rank attn",
        "step tok",
        "step attn"
    );
    for &algorithm in &config.algorithms {
        for &balance in &config.balances {
            let plan = plan_epoch(
                lengths,
                &PackingConfig {
                    capacity: config.capacity,
                    algorithm,
                    world_size: config.world_size,
                    bins_per_rank: 1,
                    balance,
                    seed: config.seed,
                },
            )?;
            let report = plan.report();
            println!(
                "   {:<4} {:<9} {:>6} {:>9.2}% {:>6} {:>10.4} {:>10.4} {:>10.4} {:>10.4}",
                match algorithm {
                    BinPacking::FirstFitDecreasing => "FFD",
                    BinPacking::BestFitDecreasing => "BFD",
                },
                match balance {
                    Balance::Tokens => "tokens",
                    Balance::Attention => "attention",
                },
                report.num_bins,
                100.0 * report.efficiency,
                report.num_steps,
                report.rank_token_imbalance,
                report.rank_attention_imbalance,
                report.step_token_imbalance,
                report.step_attention_imbalance,
            );
        }
    }
    println!("   efficiency = real tokens / capacity of the bins used;");
    println!(
        "   rank = max/mean of the ranks' epoch totals; step = sum of per-step maxima / sum of per-step means (1 is perfect)"
    );
    Ok(())
}
