//! Arbitrary bytes become a batch of raw examples (possibly invalid) and
//! packing parameters; nothing may panic, and every batch that is accepted
//! must pass the same invariant checks as the property tests.
#![no_main]

use libfuzzer_sys::fuzz_target;
use padfree_pack::check::{check_bins_hold_each_example_once, check_distribution, check_packed_batch, check_padded_batch};
use padfree_pack::{
    Balance, BatchMeta, BinPacking, BudgetKind, PackingConfig, batch_by_token_budget, examples_from_raw, flatten, pad,
    plan_epoch,
};

/// Reads bytes as little numbers; runs out gracefully.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        let Some((&first, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        first
    }
    fn small(&mut self) -> usize {
        usize::from(self.byte())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut bytes = Bytes(data);
    let num_examples = bytes.small() % 10;
    let raw: Vec<(Vec<u32>, Vec<i64>)> = (0..num_examples)
        .map(|_| {
            let len = bytes.small() % 24;
            // Occasionally misalign labels to exercise validation.
            let label_len = if bytes.byte() == 0xFF { len + 1 } else { len };
            let ids: Vec<u32> = (0..len).map(|_| u32::from(bytes.byte())).collect();
            let labels = (0..label_len)
                .map(|_| match bytes.byte() {
                    0 => -100,
                    1 => -1,
                    b => i64::from(b),
                })
                .collect();
            (ids, labels)
        })
        .collect();

    if let Ok(examples) = examples_from_raw(raw) {
        match flatten(&examples) {
            Ok(batch) => {
                if let Err(violation) = check_packed_batch(&examples, &batch) {
                    panic!("flatten: {violation}");
                }
            }
            Err(_) => assert!(examples.is_empty()),
        }
        let pad_id = u32::from(bytes.byte());
        let multiple = match bytes.small() % 4 {
            0 => None,
            m => Some(m * 3 - 3),
        };
        if let Ok(padded) = pad(&examples, pad_id, multiple) {
            if let Err(violation) = check_padded_batch(&examples, &padded, pad_id) {
                panic!("pad: {violation}");
            }
        }
    }

    let positions: Vec<u32> = (0..bytes.small() % 32).map(|_| u32::from(bytes.byte() % 5)).collect();
    let _ = BatchMeta::derive_from_position_ids(&positions);

    let lengths: Vec<usize> = (0..bytes.small()).map(|_| bytes.small() % 40).collect();
    let capacity = bytes.small();
    let budget_kind = if bytes.byte() % 2 == 0 { BudgetKind::RealTokens } else { BudgetKind::PaddedTokens };
    let _ = batch_by_token_budget(&lengths, capacity, budget_kind);
    let config = PackingConfig {
        capacity,
        algorithm: if bytes.byte() % 2 == 0 { BinPacking::FirstFitDecreasing } else { BinPacking::BestFitDecreasing },
        world_size: bytes.small() % 9,
        balance: if bytes.byte() % 2 == 0 { Balance::Tokens } else { Balance::Attention },
        seed: u64::from(bytes.byte()),
    };
    if let Ok(plan) = plan_epoch(&lengths, &config) {
        if let Err(violation) = check_bins_hold_each_example_once(&lengths, plan.bins(), capacity)
            .and_then(|()| check_distribution(plan.bins(), plan.distribution(), config.balance))
        {
            panic!("plan_epoch: {violation}");
        }
    }
});
