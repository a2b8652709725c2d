//! `padfree check` and `padfree train --verify-packing`: the packing check
//! (`padfree_model::check`) on the first micro-batches a run would train on,
//! as a table; an error naming the example, its record and the layer when a
//! comparison fails.

use std::time::Instant;

use anyhow::bail;
use padfree_data::DataSet;
use padfree_model::LlamaModel;
use padfree_model::check::{BatchCheck, Fault, ONE_EXAMPLE, Tolerances, check_batch};
use padfree_pack::Example;
use padfree_train::{TrainConfig, TrainPlan};

use super::load::{Loaded, load, with_record};
use crate::args::CheckJob;

/// Runs `padfree check`: a check that could not test isolation (every
/// batch held one example) is incomplete, and fails.
pub fn run(job: &CheckJob) -> anyhow::Result<()> {
    let Loaded { model, dataset, .. } = load(&job.train, None)?;
    let lengths = dataset.examples.lengths();
    let config = job.train.train_config(&lengths);
    let model = model.with_precision(config.precision)?;
    if config.precision == padfree_model::Precision::Bf16 {
        println!(
            "precision: bf16 matmuls ({}), f32 accumulation",
            model.bf16_matmul_body()
        );
    }
    let outcome = verify_packing(&model, &dataset, &config, 0, job.batches, job.fault)?;
    if !outcome.isolation_tested {
        bail!(
            "packing check incomplete: {ONE_EXAMPLE}, so whether examples are kept apart was not tested (only padded vs padding-free vs alone on single examples)\nHINT: check batches of at least 2 examples: --per-device-train-batch-size 2 or more, or a larger --max-tokens-per-batch"
        );
    }
    Ok(())
}

/// What a packing check that found no mismatch covered.
pub struct CheckOutcome {
    /// Whether some batch held two examples or more, so that keeping
    /// examples apart was tested.
    pub isolation_tested: bool,
}

/// Checks `rank`'s first `batches` micro-batches of the plan `config` makes
/// for `dataset`, printing a table per batch. A failure names the example's
/// record as `file:line N`.
pub fn verify_packing(
    model: &LlamaModel,
    dataset: &DataSet,
    config: &TrainConfig,
    rank: usize,
    batches: usize,
    fault: Fault,
) -> anyhow::Result<CheckOutcome> {
    let lengths = dataset.examples.lengths();
    let plan = TrainPlan::new(&lengths, config)
        .map_err(|err| with_record(err, &dataset.source, &dataset.locations))?;
    let picked: Vec<&Vec<usize>> = plan
        .steps()
        .iter()
        .flat_map(|step| step.rank_batches(rank))
        .take(batches)
        .collect();
    let tolerances = Tolerances::default();
    println!(
        "packing check: padding-free vs padded vs one example at a time, {} micro-batch(es){}",
        picked.len(),
        match fault {
            Fault::None => "",
            Fault::NaivePacking => " (fault injected: naive packing)",
        }
    );
    let started = Instant::now();
    let mut examples_checked = 0;
    let mut isolation_tested = false;
    for (number, indices) in picked.iter().enumerate() {
        let examples: Vec<Example> = indices
            .iter()
            .map(|&i| dataset.examples.get(i).map(std::borrow::Cow::into_owned))
            .collect::<Result<_, _>>()?;
        let batch_started = Instant::now();
        let check = check_batch(model, &examples, &tolerances, fault)?;
        examples_checked += examples.len();
        isolation_tested |= check.tested_isolation();
        print_table(
            number + 1,
            picked.len(),
            &check,
            batch_started.elapsed().as_secs_f64(),
        );
        if let Some(mismatch) = check.mismatch {
            let record = mismatch
                .example
                .and_then(|e| indices.get(e))
                .map(|&i| {
                    format!(
                        " at {}:{} (dataset example {i})",
                        dataset.source.display(),
                        dataset.locations.get(i).map_or("", String::as_str)
                    )
                })
                .unwrap_or_default();
            bail!(
                "packing check failed in micro-batch {}: {}{record}, first at {}\nHINT: padding-free training would not compute what padded training computes on this batch; report it with this output, and train with --padding-free false meanwhile",
                number + 1,
                mismatch.quantity,
                mismatch.layer,
            );
        }
    }
    if isolation_tested {
        println!(
            "packing check passed: {} micro-batch(es), {examples_checked} examples, {:.1} s\n",
            picked.len(),
            started.elapsed().as_secs_f64(),
        );
    } else {
        println!(
            "packing check: no mismatch in {} micro-batch(es) of one example each ({:.1} s), but isolation NOT TESTED\n",
            picked.len(),
            started.elapsed().as_secs_f64(),
        );
    }
    Ok(CheckOutcome { isolation_tested })
}

fn print_table(number: usize, of: usize, check: &BatchCheck, seconds: f64) {
    println!(
        "\nmicro-batch {number} of {of}: {} examples, {} real tokens ({} padded), {} label tokens, {seconds:.1} s",
        check.examples, check.tokens, check.padded_tokens, check.label_tokens
    );
    println!(
        "  {:<46} {:>10} {:>10} {:>10}  {:<40} verdict",
        "quantity", "max |diff|", "rel", "bound", "worst at"
    );
    for row in &check.rows {
        if let Some(why) = row.not_run {
            println!(
                "  {:<46} {:>10} {:>10} {:>10}  {:<40} not run ({why})",
                row.quantity, "-", "-", "-", "-"
            );
            continue;
        }
        let bound = match (row.bound.is_finite(), row.at_least) {
            (false, _) => "-".to_owned(),
            (true, false) => format!("{:.2e}", row.bound),
            (true, true) => format!(">{:.2e}", row.bound),
        };
        println!(
            "  {:<46} {:>10.2e} {:>10.2e} {:>10}  {:<40} {}",
            row.quantity,
            row.max_abs,
            row.max_rel(),
            bound,
            row.worst,
            if row.passed() { "ok" } else { "MISMATCH" }
        );
    }
}
