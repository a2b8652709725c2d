use std::collections::BTreeSet;

use crate::error::PackError;

/// Which bin a packing puts the next (longest remaining) example into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinPacking {
    /// The first open bin with room (multipack's choice).
    FirstFitDecreasing,
    /// The open bin with the least room that still fits, which leaves large
    /// gaps for later examples and usually needs no more bins than first fit.
    BestFitDecreasing,
}

/// A group of examples that fits one token capacity: one micro-batch of
/// padding-free training.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bin {
    examples: Vec<usize>,
    tokens: usize,
    attention_cost: u64,
}

impl Bin {
    fn new() -> Self {
        Self {
            examples: Vec::new(),
            tokens: 0,
            attention_cost: 0,
        }
    }

    fn push(&mut self, example: usize, len: usize) {
        self.examples.push(example);
        self.tokens += len;
        self.attention_cost = self.attention_cost.saturating_add(attention_cost(len));
    }

    /// Renames the examples through `names` (example `k` becomes `names[k]`).
    pub(crate) fn rename_examples(&mut self, names: &[usize]) {
        for example in &mut self.examples {
            *example = names[*example];
        }
    }

    /// Indices of the examples in this bin, in the order they were placed.
    pub fn examples(&self) -> &[usize] {
        &self.examples
    }

    /// Real tokens in the bin.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Sum of squared example lengths: proportional to the causal attention
    /// work of a varlen kernel on this bin.
    pub fn attention_cost(&self) -> u64 {
        self.attention_cost
    }
}

/// The attention work of one example of `len` tokens, up to a constant.
pub(crate) fn attention_cost(len: usize) -> u64 {
    let len = len as u64;
    len.saturating_mul(len)
}

/// The result of packing example lengths into bins of one capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    bins: Vec<Bin>,
    capacity: usize,
    total_tokens: usize,
}

impl Packing {
    /// The bins, in the order they were opened.
    pub fn bins(&self) -> &[Bin] {
        &self.bins
    }

    /// Consumes the packing, giving its bins.
    pub fn into_bins(self) -> Vec<Bin> {
        self.bins
    }

    /// Token capacity of every bin.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Real tokens in all bins together.
    pub fn total_tokens(&self) -> usize {
        self.total_tokens
    }

    /// Real tokens over the capacity of the bins used, in `(0, 1]`.
    pub fn efficiency(&self) -> f64 {
        self.total_tokens as f64 / (self.bins.len() as f64 * self.capacity as f64)
    }
}

/// Validates lengths for packing under `limit` tokens (`limit_name` says which limit).
pub(crate) fn check_lengths(
    lengths: &[usize],
    limit: usize,
    limit_name: &'static str,
) -> Result<(), PackError> {
    if limit == 0 {
        return Err(PackError::ZeroCapacity { what: limit_name });
    }
    if lengths.is_empty() {
        return Err(PackError::NoExamples);
    }
    for (index, &len) in lengths.iter().enumerate() {
        if len == 0 {
            return Err(PackError::ZeroLength { index });
        }
        if len > limit {
            return Err(PackError::ExampleTooLong {
                index,
                len,
                limit,
                limit_name,
            });
        }
    }
    Ok(())
}

/// Example indices, longest first; equal lengths keep their input order, so
/// the caller decides ties (by shuffling first, as [`crate::plan_epoch`] does).
pub(crate) fn longest_first(lengths: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    order
}

/// Packs examples of these lengths into as few bins of `capacity` tokens as
/// the algorithm finds, in `O(N log N)`.
///
/// Fails if the capacity is 0, there are no examples, or an example is empty or
/// longer than the capacity (the error names it).
pub fn pack_into_bins(
    lengths: &[usize],
    capacity: usize,
    algorithm: BinPacking,
) -> Result<Packing, PackError> {
    check_lengths(lengths, capacity, "bin capacity")?;
    let order = longest_first(lengths);
    let assignment = match algorithm {
        BinPacking::FirstFitDecreasing => first_fit(&order, lengths, capacity),
        BinPacking::BestFitDecreasing => best_fit(&order, lengths, capacity),
    };
    Ok(collect_bins(&order, lengths, capacity, &assignment))
}

/// Builds bins from `assignment[k]`, the bin of the `k`-th example of `order`.
pub(crate) fn collect_bins(
    order: &[usize],
    lengths: &[usize],
    capacity: usize,
    assignment: &[usize],
) -> Packing {
    let num_bins = assignment.iter().max().map_or(0, |&last| last + 1);
    let mut bins: Vec<Bin> = (0..num_bins).map(|_| Bin::new()).collect();
    for (&example, &bin) in order.iter().zip(assignment) {
        bins[bin].push(example, lengths[example]);
    }
    Packing {
        bins,
        capacity,
        total_tokens: lengths.iter().sum(),
    }
}

/// First fit with a max-segment tree over the bins' free room: the leftmost
/// bin with room is found in `O(log N)`. Unopened bins have full room and lie
/// to the right of every opened one, so "leftmost with room" opens a new bin
/// exactly when no open one fits.
fn first_fit(order: &[usize], lengths: &[usize], capacity: usize) -> Vec<usize> {
    let mut tree = MaxTree::new(order.len(), capacity);
    order
        .iter()
        .map(|&example| {
            let len = lengths[example];
            let bin = tree.leftmost_at_least(len);
            tree.subtract(bin, len);
            bin
        })
        .collect()
}

/// Best fit with the open bins ordered by (free room, index).
fn best_fit(order: &[usize], lengths: &[usize], capacity: usize) -> Vec<usize> {
    let mut open: BTreeSet<(usize, usize)> = BTreeSet::new();
    let mut num_bins = 0;
    order
        .iter()
        .map(|&example| {
            let len = lengths[example];
            let (room, bin) = match open.range((len, 0)..).next().copied() {
                Some(found) => {
                    open.remove(&found);
                    found
                }
                None => {
                    num_bins += 1;
                    (capacity, num_bins - 1)
                }
            };
            if room > len {
                open.insert((room - len, bin));
            }
            bin
        })
        .collect()
}

/// A complete binary tree whose leaves are the free room of bins `0 .. n` and
/// whose inner nodes hold the maximum below them.
struct MaxTree {
    leaves: usize,
    nodes: Vec<usize>,
}

impl MaxTree {
    fn new(n: usize, room: usize) -> Self {
        let leaves = n.next_power_of_two().max(1);
        let mut nodes = vec![0; 2 * leaves];
        nodes[leaves..leaves + n].fill(room);
        for node in (1..leaves).rev() {
            nodes[node] = nodes[2 * node].max(nodes[2 * node + 1]);
        }
        Self { leaves, nodes }
    }

    /// Leftmost leaf with at least `need`; the caller guarantees one exists
    /// (there are as many leaves as examples, each example fits an empty bin).
    fn leftmost_at_least(&self, need: usize) -> usize {
        let mut node = 1;
        while node < self.leaves {
            node = if self.nodes[2 * node] >= need {
                2 * node
            } else {
                2 * node + 1
            };
        }
        node - self.leaves
    }

    fn subtract(&mut self, leaf: usize, amount: usize) {
        let mut node = leaf + self.leaves;
        self.nodes[node] -= amount;
        while node > 1 {
            node /= 2;
            self.nodes[node] = self.nodes[2 * node].max(self.nodes[2 * node + 1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(packing: &Packing) -> Vec<Vec<usize>> {
        packing
            .bins()
            .iter()
            .map(|bin| bin.examples().to_vec())
            .collect()
    }

    #[test]
    fn first_and_best_fit_place_as_worked_by_hand() {
        // Longest first: 5, 4, 3, 3, 2, 1 into capacity 7.
        // Both: [5,2] [4,3] [3,1].
        let lengths = [3, 5, 2, 4, 1, 3];
        let ffd = pack_into_bins(&lengths, 7, BinPacking::FirstFitDecreasing).expect("packs");
        assert_eq!(contents(&ffd), vec![vec![1, 2], vec![3, 0], vec![5, 4]]);
        let bfd = pack_into_bins(&lengths, 7, BinPacking::BestFitDecreasing).expect("packs");
        assert_eq!(contents(&bfd), vec![vec![1, 2], vec![3, 0], vec![5, 4]]);
        assert!((ffd.efficiency() - 18.0 / 21.0).abs() < 1e-12);

        // Best fit puts the last example into the fuller bin, first fit into the first.
        let lengths = [7, 4, 4, 1];
        let ffd = pack_into_bins(&lengths, 10, BinPacking::FirstFitDecreasing).expect("packs");
        let bfd = pack_into_bins(&lengths, 10, BinPacking::BestFitDecreasing).expect("packs");
        assert_eq!(contents(&ffd), vec![vec![0, 3], vec![1, 2]]);
        assert_eq!(contents(&bfd), vec![vec![0], vec![1, 2, 3]]);
    }

    #[test]
    fn bins_report_tokens_and_attention_cost() {
        let packing = pack_into_bins(&[3, 4], 10, BinPacking::BestFitDecreasing).expect("packs");
        assert_eq!(packing.bins().len(), 1);
        assert_eq!(packing.bins()[0].tokens(), 7);
        assert_eq!(packing.bins()[0].attention_cost(), 25);
    }

    #[test]
    fn bad_lengths_are_named() {
        assert_eq!(
            pack_into_bins(&[1], 0, BinPacking::FirstFitDecreasing),
            Err(PackError::ZeroCapacity {
                what: "bin capacity"
            })
        );
        assert_eq!(
            pack_into_bins(&[], 4, BinPacking::FirstFitDecreasing),
            Err(PackError::NoExamples)
        );
        assert_eq!(
            pack_into_bins(&[2, 0], 4, BinPacking::FirstFitDecreasing),
            Err(PackError::ZeroLength { index: 1 })
        );
        let err = pack_into_bins(&[2, 9], 4, BinPacking::BestFitDecreasing)
            .expect_err("example 1 is too long");
        assert_eq!(
            err,
            PackError::ExampleTooLong {
                index: 1,
                len: 9,
                limit: 4,
                limit_name: "bin capacity"
            }
        );
        assert!(err.to_string().contains("example 1 has 9 tokens"));
    }
}
