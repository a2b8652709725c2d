//! Slow, obvious reference implementations. Every fast path of the crate is
//! tested against one of these; they are written for clarity, not speed, and
//! follow the published algorithms step by step.

use crate::example::IGNORE_INDEX;

/// A flattened batch as plain vectors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReferenceFlat {
    /// `[T]`
    pub input_ids: Vec<u32>,
    /// `[T]`
    pub labels: Vec<i64>,
    /// `[T]`
    pub position_ids: Vec<u32>,
    /// `[T]`
    pub seq_idx: Vec<u32>,
    /// `[B + 1]`
    pub cu_seqlens: Vec<u32>,
    /// `L`
    pub max_seqlen: usize,
}

/// Hugging Face `DataCollatorWithFlattening.__call__` with
/// `separator_id = -100`, `return_flash_attn_kwargs` and `return_seq_idx`,
/// transcribed statement by statement: per example, append the input ids,
/// append `[separator] + labels[1:]`, append `range(len)`, append the running
/// total to `cu_seq_lens`, keep the maximum length.
pub fn flatten_like_hugging_face(examples: &[(Vec<u32>, Vec<i64>)]) -> ReferenceFlat {
    let mut flat = ReferenceFlat {
        input_ids: vec![],
        labels: vec![],
        position_ids: vec![],
        seq_idx: vec![],
        cu_seqlens: vec![0],
        max_seqlen: 0,
    };
    for (index, (input_ids, labels)) in examples.iter().enumerate() {
        flat.input_ids.extend(input_ids.iter().copied());
        flat.labels.push(IGNORE_INDEX);
        flat.labels.extend(labels.iter().skip(1).copied());
        for position in 0..input_ids.len() {
            flat.position_ids.push(position as u32);
            flat.seq_idx.push(index as u32);
        }
        let last = *flat.cu_seqlens.last().unwrap_or(&0);
        flat.cu_seqlens.push(last + input_ids.len() as u32);
        flat.max_seqlen = flat.max_seqlen.max(input_ids.len());
    }
    flat
}

/// What Hugging Face's flash-attention path does in every layer without the
/// collator's metadata (`prepare_fa2_from_position_ids`): example starts are
/// the indices where the position is 0, followed by the total; the longest
/// example is the largest position plus one.
pub fn cu_seqlens_from_position_ids(position_ids: &[u32]) -> (Vec<u32>, usize) {
    let mut cu_seqlens: Vec<u32> = (0..position_ids.len())
        .filter(|&t| position_ids[t] == 0)
        .map(|t| t as u32)
        .collect();
    cu_seqlens.push(position_ids.len() as u32);
    let max_seqlen = position_ids.iter().max().map_or(0, |&p| p as usize + 1);
    (cu_seqlens, max_seqlen)
}

/// First-fit decreasing, by scanning every open bin for every example.
/// Returns the example indices of each bin, bins in opening order.
pub fn first_fit_decreasing(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    fit_decreasing(lengths, capacity, |rooms, len| {
        (0..rooms.len()).find(|&bin| rooms[bin] >= len)
    })
}

/// Best-fit decreasing, by scanning every open bin for the one with the least
/// room that fits (the lowest index among equals).
pub fn best_fit_decreasing(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    fit_decreasing(lengths, capacity, |rooms, len| {
        (0..rooms.len())
            .filter(|&bin| rooms[bin] >= len)
            .min_by_key(|&bin| (rooms[bin], bin))
    })
}

fn fit_decreasing(
    lengths: &[usize],
    capacity: usize,
    choose: impl Fn(&[usize], usize) -> Option<usize>,
) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    // Stable sort: equal lengths keep their index order.
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]));
    let mut bins: Vec<Vec<usize>> = vec![];
    let mut rooms: Vec<usize> = vec![];
    for example in order {
        let len = lengths[example];
        let bin = match choose(&rooms, len) {
            Some(bin) => bin,
            None => {
                bins.push(vec![]);
                rooms.push(capacity);
                bins.len() - 1
            }
        };
        bins[bin].push(example);
        rooms[bin] -= len;
    }
    bins
}
