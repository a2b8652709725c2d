//! Property tests: the collator, the padded baseline, metadata derivation,
//! bin packing and rank distribution hold their invariants on random inputs,
//! and every fast path agrees with its slow reference in `padfree_pack::oracle`.

use padfree_pack::check::{
    check_bins_hold_each_example_once, check_distribution, check_packed_batch, check_packing,
    check_padded_batch,
};
use padfree_pack::oracle::{best_fit_decreasing, first_fit_decreasing};
use padfree_pack::{
    Balance, BatchMeta, BinPacking, BudgetKind, Example, IGNORE_INDEX, PackError, PackingConfig,
    batch_by_token_budget, distribute, flatten, pack_into_bins, pad, plan_epoch,
};
use proptest::prelude::*;

/// An example of 1..=max_len tokens whose labels mix token ids and -100.
fn example(max_len: usize) -> impl Strategy<Value = Example> {
    prop::collection::vec((0u32..50_000, prop::bool::weighted(0.3)), 1..=max_len).prop_map(
        |tokens| {
            let input_ids = tokens.iter().map(|&(id, _)| id).collect();
            let labels = tokens
                .iter()
                .map(|&(id, ignored)| if ignored { IGNORE_INDEX } else { i64::from(id) })
                .collect();
            Example::new(input_ids, labels).expect("generated examples are valid")
        },
    )
}

fn batch() -> impl Strategy<Value = Vec<Example>> {
    prop::collection::vec(example(40), 1..12)
}

fn balance() -> impl Strategy<Value = Balance> {
    prop_oneof![Just(Balance::Tokens), Just(Balance::Attention)]
}

/// What a batch of these lengths costs against a budget of `kind`.
fn budget_cost(lengths: &[usize], kind: BudgetKind) -> usize {
    match kind {
        BudgetKind::RealTokens => lengths.iter().sum(),
        BudgetKind::PaddedTokens => lengths.len() * lengths.iter().copied().max().unwrap_or(0),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn flattened_batch_matches_reference_and_its_own_metadata(examples in batch()) {
        let packed = flatten(&examples).expect("non-empty batch flattens");
        prop_assert_eq!(check_packed_batch(&examples, &packed), Ok(()));
    }

    #[test]
    fn padded_batch_holds_every_example_on_its_row(examples in batch(), pad_id in 0u32..10, multiple in prop::option::of(1usize..9)) {
        let padded = pad(&examples, pad_id, multiple).expect("non-empty batch pads");
        prop_assert_eq!(check_padded_batch(&examples, &padded, pad_id), Ok(()));
        let longest = examples.iter().map(Example::len).max().unwrap_or(0);
        prop_assert!(padded.seq_len() >= longest);
        prop_assert!(padded.seq_len() < longest + multiple.unwrap_or(1));
    }

    #[test]
    fn flattened_and_padded_batches_learn_the_same_targets(examples in batch()) {
        // The multiset of (example, position, target) is identical: padding-free
        // training sees exactly the supervision padded training sees.
        let packed = flatten(&examples).expect("flattens");
        let padded = pad(&examples, 0, None).expect("pads");
        let flat_targets = packed.next_token_targets();
        let padded_targets = padded.next_token_targets();
        for (range, example_index) in packed.meta().example_ranges().zip(0..) {
            let row = example_index * padded.seq_len();
            for (offset, t) in range.enumerate() {
                prop_assert_eq!(flat_targets[t], padded_targets[row + offset]);
            }
        }
        prop_assert_eq!(packed.num_loss_tokens(), padded.num_loss_tokens());
        prop_assert_eq!(packed.num_tokens(), padded.num_real_tokens());
    }

    #[test]
    fn derivation_from_arbitrary_position_ids_never_panics_and_is_consistent(positions in prop::collection::vec(0u32..6, 0..64)) {
        match BatchMeta::derive_from_position_ids(&positions) {
            Ok(meta) => {
                prop_assert_eq!(meta.total_tokens(), positions.len());
                for range in meta.example_ranges() {
                    for (offset, t) in range.enumerate() {
                        prop_assert_eq!(positions[t] as usize, offset);
                    }
                }
            }
            Err(PackError::EmptyBatch) => prop_assert!(positions.is_empty()),
            Err(PackError::InvalidPositionIds { index, .. }) => {
                let fine = index > 0 && (positions[index] == 0 || positions[index] == positions[index - 1] + 1);
                prop_assert!(!fine, "index {} was valid", index);
            }
            Err(other) => prop_assert!(false, "unexpected error {}", other),
        }
    }

    #[test]
    fn fast_bin_packing_equals_the_reference_and_never_overflows(
        lengths in prop::collection::vec(1usize..=64, 1..200),
        capacity in 64usize..300,
    ) {
        let ffd = pack_into_bins(&lengths, capacity, BinPacking::FirstFitDecreasing).expect("packs");
        prop_assert_eq!(check_packing(&lengths, &ffd, &first_fit_decreasing(&lengths, capacity)), Ok(()));
        let bfd = pack_into_bins(&lengths, capacity, BinPacking::BestFitDecreasing).expect("packs");
        prop_assert_eq!(check_packing(&lengths, &bfd, &best_fit_decreasing(&lengths, capacity)), Ok(()));
        // No packing can use fewer bins than the total over the capacity.
        let lower_bound = lengths.iter().sum::<usize>().div_ceil(capacity);
        prop_assert!(ffd.bins().len() >= lower_bound && bfd.bins().len() >= lower_bound);
        // Any-fit packings leave at most one bin half empty or emptier.
        let total: usize = lengths.iter().sum();
        prop_assert!((ffd.bins().len() - 1) * capacity < 2 * total);
        prop_assert!((bfd.bins().len() - 1) * capacity < 2 * total);
    }

    #[test]
    fn distribution_deals_every_bin_once_and_balances(
        lengths in prop::collection::vec(1usize..=64, 1..200),
        world_size in 1usize..9,
        balance in balance(),
        seed in any::<u64>(),
    ) {
        let bins = pack_into_bins(&lengths, 64, BinPacking::FirstFitDecreasing).expect("packs").into_bins();
        let distribution = distribute(&bins, world_size, balance, seed).expect("distributes");
        prop_assert_eq!(check_distribution(&bins, &distribution, balance), Ok(()));
        prop_assert_eq!(distribution.num_steps(), bins.len().div_ceil(world_size));
        prop_assert!(distribution.rank_imbalance(balance) >= 1.0 - 1e-12);
        prop_assert!(distribution.step_imbalance(balance) >= 1.0 - 1e-12);
    }

    #[test]
    fn epoch_plans_lose_no_example_and_are_deterministic(
        lengths in prop::collection::vec(1usize..=100, 1..150),
        world_size in 1usize..5,
        bins_per_rank in 1usize..4,
        best_fit in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let config = PackingConfig {
            capacity: 128,
            algorithm: if best_fit { BinPacking::BestFitDecreasing } else { BinPacking::FirstFitDecreasing },
            world_size,
            bins_per_rank,
            balance: Balance::Tokens,
            seed,
        };
        let plan = plan_epoch(&lengths, &config).expect("plans");
        prop_assert_eq!(check_bins_hold_each_example_once(&lengths, plan.bins(), 128), Ok(()));
        prop_assert_eq!(check_distribution(plan.bins(), plan.distribution(), Balance::Tokens), Ok(()));
        let mut seen: Vec<usize> = (0..world_size).flat_map(|rank| plan.rank_batches(rank)).flatten().collect();
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        let efficiency = plan.report().efficiency;
        prop_assert!(efficiency > 0.0 && efficiency <= 1.0);
        prop_assert_eq!(plan_epoch(&lengths, &config).expect("plans"), plan);
    }

    #[test]
    fn token_budget_batches_cover_in_order_and_respect_the_budget(
        lengths in prop::collection::vec(1usize..=50, 1..100),
        budget in 50usize..200,
        padded in any::<bool>(),
    ) {
        let kind = if padded { BudgetKind::PaddedTokens } else { BudgetKind::RealTokens };
        let batches = batch_by_token_budget(&lengths, budget, kind).expect("batches");
        let mut next = 0;
        for range in &batches {
            prop_assert_eq!(range.start, next);
            prop_assert!(!range.is_empty());
            next = range.end;
            let part = &lengths[range.clone()];
            prop_assert!(budget_cost(part, kind) <= budget);
        }
        prop_assert_eq!(next, lengths.len());
        // Greedy: each batch but the last could not take the next example.
        for pair in batches.windows(2) {
            let with_next = &lengths[pair[0].start..=pair[0].end];
            prop_assert!(budget_cost(with_next, kind) > budget);
        }
    }
}
