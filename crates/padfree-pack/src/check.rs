//! Invariant checks shared by the property tests and the fuzz target. Each
//! returns a description of the first violation it finds.

use crate::binpack::{Bin, Packing};
use crate::distribute::{Balance, Distribution};
use crate::example::{Example, IGNORE_INDEX};
use crate::flatten::PackedBatch;
use crate::meta::BatchMeta;
use crate::oracle;
use crate::pad::PaddedBatch;

fn ensure(condition: bool, message: impl FnOnce() -> String) -> Result<(), String> {
    if condition { Ok(()) } else { Err(message()) }
}

/// A flattened batch agrees with Hugging Face's algorithm, its metadata agrees
/// with its `position_ids` and `seq_idx`, and no label crosses an example
/// boundary.
pub fn check_packed_batch(examples: &[Example], batch: &PackedBatch) -> Result<(), String> {
    let raw: Vec<(Vec<u32>, Vec<i64>)> = examples
        .iter()
        .map(|e| (e.input_ids().to_vec(), e.labels().to_vec()))
        .collect();
    let reference = oracle::flatten_like_hugging_face(&raw);
    ensure(batch.input_ids() == reference.input_ids, || {
        "input_ids differ from the reference".into()
    })?;
    ensure(batch.labels() == reference.labels, || {
        "labels differ from the reference".into()
    })?;
    ensure(batch.position_ids() == reference.position_ids, || {
        "position_ids differ from the reference".into()
    })?;
    ensure(batch.seq_idx() == reference.seq_idx, || {
        "seq_idx differs from the reference".into()
    })?;
    ensure(batch.meta().cu_seqlens() == reference.cu_seqlens, || {
        "cu_seqlens differ from the reference".into()
    })?;
    ensure(batch.meta().max_seqlen() == reference.max_seqlen, || {
        "max_seqlen differs from the reference".into()
    })?;

    let derived = BatchMeta::derive_from_position_ids(batch.position_ids())
        .map_err(|err| format!("metadata cannot be derived from position_ids: {err}"))?;
    ensure(&derived == batch.meta(), || {
        format!(
            "derived metadata {derived:?} differs from the collator's {:?}",
            batch.meta()
        )
    })?;
    let (hf_cu, hf_max) = oracle::cu_seqlens_from_position_ids(batch.position_ids());
    ensure(
        hf_cu == batch.meta().cu_seqlens() && hf_max == batch.meta().max_seqlen(),
        || "metadata differs from Hugging Face's per-layer derivation".into(),
    )?;
    check_meta_against_seq_idx(batch)?;
    check_no_label_crosses_a_boundary(batch)?;

    let counted = batch
        .labels()
        .iter()
        .filter(|&&l| l != IGNORE_INDEX)
        .count();
    ensure(counted == batch.num_loss_tokens(), || {
        format!(
            "num_loss_tokens {} but {counted} labels count",
            batch.num_loss_tokens()
        )
    })?;
    let from_examples: usize = examples.iter().map(Example::num_loss_tokens).sum();
    ensure(from_examples == counted, || {
        format!("examples have {from_examples} loss tokens, the batch {counted}")
    })?;
    ensure(
        batch.num_tokens() == examples.iter().map(Example::len).sum::<usize>(),
        || "token total differs from the sum of the lengths".into(),
    )
}

fn check_meta_against_seq_idx(batch: &PackedBatch) -> Result<(), String> {
    ensure(batch.meta().num_examples() == batch.num_examples(), || {
        "example count".into()
    })?;
    for (example, range) in batch.meta().example_ranges().enumerate() {
        for t in range.clone() {
            ensure(batch.seq_idx()[t] as usize == example, || {
                format!(
                    "token {t} is in example {example}'s range but seq_idx says {}",
                    batch.seq_idx()[t]
                )
            })?;
            ensure(batch.position_ids()[t] as usize == t - range.start, || {
                format!("token {t}: position_id does not count from the example start")
            })?;
        }
    }
    Ok(())
}

fn check_no_label_crosses_a_boundary(batch: &PackedBatch) -> Result<(), String> {
    let targets = batch.next_token_targets();
    for (t, &target) in targets.iter().enumerate() {
        let next_in_same_example =
            t + 1 < batch.num_tokens() && batch.seq_idx()[t + 1] == batch.seq_idx()[t];
        ensure(target == IGNORE_INDEX || next_in_same_example, || {
            format!("position {t} learns a label of the next example")
        })?;
    }
    Ok(())
}

/// A padded batch holds every example on its own row, pads masked and ignored.
pub fn check_padded_batch(
    examples: &[Example],
    batch: &PaddedBatch,
    pad_id: u32,
) -> Result<(), String> {
    let seq_len = batch.seq_len();
    ensure(batch.batch_size() == examples.len(), || "row count".into())?;
    for (row, example) in examples.iter().enumerate() {
        let cells = row * seq_len..(row + 1) * seq_len;
        let len = example.len();
        ensure(
            &batch.input_ids()[cells.start..cells.start + len] == example.input_ids(),
            || format!("row {row}: input_ids"),
        )?;
        ensure(
            &batch.labels()[cells.start..cells.start + len] == example.labels(),
            || format!("row {row}: labels"),
        )?;
        for (column, cell) in cells.enumerate() {
            let real = column < len;
            ensure((batch.attention_mask()[cell] == 1) == real, || {
                format!("row {row}: mask at {column}")
            })?;
            ensure(real || batch.input_ids()[cell] == pad_id, || {
                format!("row {row}: pad id at {column}")
            })?;
            ensure(real || batch.labels()[cell] == IGNORE_INDEX, || {
                format!("row {row}: pad label at {column}")
            })?;
        }
    }
    let real: usize = examples.iter().map(Example::len).sum();
    ensure(batch.num_real_tokens() == real, || {
        "real token count".into()
    })?;
    let loss: usize = examples.iter().map(Example::num_loss_tokens).sum();
    let counted = batch
        .next_token_targets()
        .iter()
        .filter(|&&l| l != IGNORE_INDEX)
        .count();
    ensure(batch.num_loss_tokens() == loss && counted == loss, || {
        "loss token count".into()
    })
}

/// A packing holds every example exactly once and no bin over capacity, and it
/// agrees bin for bin with the obvious reference algorithm.
pub fn check_packing(
    lengths: &[usize],
    packing: &Packing,
    reference: &[Vec<usize>],
) -> Result<(), String> {
    check_bins_hold_each_example_once(lengths, packing.bins(), packing.capacity())?;
    let bins: Vec<Vec<usize>> = packing
        .bins()
        .iter()
        .map(|b| b.examples().to_vec())
        .collect();
    ensure(bins == reference, || {
        "bins differ from the reference algorithm's".into()
    })
}

/// Every example in exactly one bin, no bin empty or over capacity, token
/// counts right.
pub fn check_bins_hold_each_example_once(
    lengths: &[usize],
    bins: &[Bin],
    capacity: usize,
) -> Result<(), String> {
    let mut seen = vec![false; lengths.len()];
    for (index, bin) in bins.iter().enumerate() {
        ensure(!bin.examples().is_empty(), || {
            format!("bin {index} is empty")
        })?;
        let tokens: usize = bin.examples().iter().map(|&e| lengths[e]).sum();
        ensure(tokens == bin.tokens(), || {
            format!("bin {index} miscounts its tokens")
        })?;
        ensure(tokens <= capacity, || {
            format!("bin {index} holds {tokens} > {capacity}")
        })?;
        for &example in bin.examples() {
            ensure(!std::mem::replace(&mut seen[example], true), || {
                format!("example {example} is in two bins")
            })?;
        }
    }
    ensure(seen.iter().all(|&s| s), || "an example was lost".into())
}

/// Every bin dealt exactly once, at most `A` bins per rank per step, empty
/// slots only in one step, and (with one bin per rank per step) the ranks'
/// totals of the balanced cost within one bin's cost of each other (the
/// bound of the longest-processing-time rule).
pub fn check_distribution(
    bins: &[Bin],
    distribution: &Distribution,
    balance: Balance,
) -> Result<(), String> {
    let mut dealt = vec![false; bins.len()];
    let mut steps_with_gaps = 0;
    for step in distribution.steps() {
        ensure(step.len() == distribution.world_size(), || {
            "step width".into()
        })?;
        let per_rank = distribution.bins_per_rank();
        ensure(step.iter().all(|bins| bins.len() <= per_rank), || {
            format!("a rank holds more than {per_rank} bins in a step")
        })?;
        if step.iter().any(|bins| bins.len() < per_rank) {
            steps_with_gaps += 1;
        }
        for &bin in step.iter().flatten() {
            ensure(!std::mem::replace(&mut dealt[bin], true), || {
                format!("bin {bin} dealt twice")
            })?;
        }
    }
    ensure(dealt.iter().all(|&d| d), || "a bin was not dealt".into())?;
    ensure(steps_with_gaps <= 1, || {
        format!("{steps_with_gaps} steps have idle ranks")
    })?;
    let (totals, largest) = match balance {
        Balance::Tokens => (
            distribution.rank_tokens(),
            bins.iter().map(|b| b.tokens() as u64).max().unwrap_or(0),
        ),
        Balance::Attention => (
            distribution.rank_attention_cost(),
            bins.iter().map(Bin::attention_cost).max().unwrap_or(0),
        ),
    };
    let spread = totals.iter().max().unwrap_or(&0) - totals.iter().min().unwrap_or(&0);
    ensure(
        distribution.bins_per_rank() > 1 || spread <= largest,
        || format!("rank totals spread {spread} > largest bin {largest}"),
    )
}
