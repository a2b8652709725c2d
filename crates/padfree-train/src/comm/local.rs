//! `W` ranks as threads of one process.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use super::{CommError, Communicator, Flat, ring_order, shard_range, sum_in_rank_order};

/// `W` ranks as threads of one process: [`LocalGroup::new`] gives one
/// handle per rank, to be moved into its thread.
///
/// A rank whose handle is dropped (its thread returned early or panicked)
/// breaks the group: every collective then fails on every rank instead of
/// waiting for it, as a real launcher ends a job when one rank dies.
#[derive(Debug)]
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    state: Mutex<Round>,
    changed: Condvar,
}

/// One collective in flight: each rank's contribution, then the result.
#[derive(Debug, Default)]
struct Round {
    /// Rounds completed; a rank waits for this to move.
    generation: u64,
    arrived: usize,
    slots: Vec<Option<Vec<f64>>>,
    result: Vec<f64>,
    /// Ranks that have read the previous result.
    departed: usize,
    broken: Option<String>,
}

/// How long a rank waits for the others before calling the job stuck.
const PATIENCE: Duration = Duration::from_secs(600);

impl LocalGroup {
    /// Handles for ranks `0..world_size`.
    pub fn new(world_size: usize) -> Vec<LocalGroup> {
        let shared = Arc::new(Shared {
            world_size,
            state: Mutex::new(Round {
                slots: vec![None; world_size],
                departed: world_size,
                ..Round::default()
            }),
            changed: Condvar::new(),
        });
        (0..world_size)
            .map(|rank| LocalGroup {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    fn error(&self, message: String) -> CommError {
        CommError {
            rank: self.rank,
            world_size: self.shared.world_size,
            message,
            hint: "another rank stopped first: its own error is the cause".into(),
        }
    }

    /// Every rank contributes `values`; all get the sums in rank order.
    fn all_reduce(&self, values: &mut [f64]) -> Result<(), CommError> {
        let sum = self.round(values, Combine::Sum)?;
        values.copy_from_slice(&sum);
        Ok(())
    }

    /// Every rank's `values`, in rank order (exact: an f32 is an f64).
    fn all_gather(&self, values: &[f64]) -> Result<Vec<Vec<f64>>, CommError> {
        let lengths = self.round(&[values.len() as f64], Combine::Concat)?;
        let concat = self.round(values, Combine::Concat)?;
        let mut rest = concat.as_slice();
        Ok(lengths
            .iter()
            .map(|&n| {
                let (head, tail) = rest.split_at(n as usize);
                rest = tail;
                head.to_vec()
            })
            .collect())
    }

    /// The shards of the concatenation of `parts` every rank holds.
    fn shards(&self, parts: &mut [&mut [f32]]) -> Result<(Vec<Vec<f64>>, usize), CommError> {
        let flat = Flat::new(parts);
        let mut mine = Vec::new();
        flat.read(0..flat.len(), &mut mine);
        let wide: Vec<f64> = mine.iter().map(|&v| f64::from(v)).collect();
        Ok((self.all_gather(&wide)?, flat.len()))
    }

    /// One collective: every rank's contribution, combined once.
    fn round(&self, values: &[f64], combine: Combine) -> Result<Vec<f64>, CommError> {
        let shared = &*self.shared;
        // A poisoned lock only means a rank panicked while holding it; the
        // `broken` flag its handle's drop sets is what the others act on.
        let mut state = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
        // Wait until every rank has read the previous round's result.
        while state.departed < shared.world_size {
            if let Some(why) = &state.broken {
                return Err(self.error(why.clone()));
            }
            state = shared
                .changed
                .wait_timeout(state, PATIENCE)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if let Some(why) = &state.broken {
            return Err(self.error(why.clone()));
        }
        if state.arrived == 0 {
            state.slots.iter_mut().for_each(|slot| *slot = None);
        }
        state.slots[self.rank] = Some(values.to_vec());
        state.arrived += 1;
        let generation = state.generation;
        if state.arrived == shared.world_size {
            if combine == Combine::Sum
                && state
                    .slots
                    .iter()
                    .flatten()
                    .any(|slot| slot.len() != values.len())
            {
                let why = "ranks reduced buffers of different lengths".to_owned();
                state.broken = Some(why.clone());
                shared.changed.notify_all();
                return Err(self.error(why));
            }
            let slots = state.slots.iter().flatten().map(Vec::as_slice);
            state.result = match combine {
                Combine::Sum => sum_in_rank_order(slots, values.len()),
                Combine::Concat => slots.flatten().copied().collect(),
            };
            state.arrived = 0;
            state.departed = 0;
            state.generation += 1;
            shared.changed.notify_all();
        } else {
            while state.generation == generation {
                if let Some(why) = &state.broken {
                    return Err(self.error(why.clone()));
                }
                let (next, timeout) = shared
                    .changed
                    .wait_timeout(state, PATIENCE)
                    .unwrap_or_else(PoisonError::into_inner);
                state = next;
                if timeout.timed_out() && state.generation == generation {
                    return Err(self.error("the other ranks did not arrive".into()));
                }
            }
        }
        let result = state.result.clone();
        state.departed += 1;
        if state.departed == shared.world_size {
            shared.changed.notify_all();
        }
        Ok(result)
    }
}

/// How a round combines the ranks' contributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Combine {
    /// Element-wise, in rank order, in f64.
    Sum,
    /// One after the other, in rank order.
    Concat,
}

/// A rank leaves the group when its handle drops, at the end of its run or
/// on an error or panic: no later collective can complete, so the others'
/// fail at once instead of waiting for it.
impl Drop for LocalGroup {
    fn drop(&mut self) {
        let mut state = self
            .shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if state.broken.is_none() {
            state.broken = Some(format!("rank {} stopped", self.rank));
        }
        self.shared.changed.notify_all();
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world_size
    }
    /// Summed in f64 in rank order, then rounded once: every rank gets the
    /// same bits.
    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<(), CommError> {
        let mut wide: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
        self.all_reduce(&mut wide)?;
        for (value, sum) in values.iter_mut().zip(wide) {
            *value = sum as f32;
        }
        Ok(())
    }
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        self.all_reduce(values)
    }
    /// Every rank's whole buffer is gathered and this rank adds its shard
    /// in [`ring_order`], in f32: the bits the MPI ring computes.
    fn reduce_scatter_sum_f32(&self, parts: &mut [&mut [f32]]) -> Result<(), CommError> {
        let world = self.shared.world_size;
        let (all, len) = self.shards(parts)?;
        if all.iter().any(|buffer| buffer.len() != len) {
            return Err(self.error("ranks reduced buffers of different lengths".into()));
        }
        let own = shard_range(len, world, self.rank);
        let mut sum = vec![0.0f32; own.len()];
        for (k, rank) in ring_order(self.rank, world).enumerate() {
            for (total, &v) in sum.iter_mut().zip(&all[rank][own.clone()]) {
                *total = if k == 0 { v as f32 } else { *total + v as f32 };
            }
        }
        Flat::new(parts).write(own.start, &sum);
        Ok(())
    }
    fn all_gather_f32(&self, parts: &mut [&mut [f32]]) -> Result<(), CommError> {
        let world = self.shared.world_size;
        let (all, len) = self.shards(parts)?;
        let mut flat = Flat::new(parts);
        for (rank, buffer) in all.iter().enumerate() {
            let shard = shard_range(len, world, rank);
            let values: Vec<f32> = buffer[shard.clone()].iter().map(|&v| v as f32).collect();
            flat.write(shard.start, &values);
        }
        Ok(())
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.all_reduce(&mut [])
    }
    fn backend(&self) -> &'static str {
        "threads of one process"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_the_same_sums_round_after_round() {
        let handles = LocalGroup::new(3);
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|scope| {
            let threads: Vec<_> = handles
                .into_iter()
                .map(|comm| {
                    scope.spawn(move || {
                        (0..20)
                            .map(|round| {
                                let mut values = vec![comm.rank() as f32 + round as f32, 1.0];
                                comm.all_reduce_sum_f32(&mut values).expect("reduces");
                                values
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("joins"))
                .collect()
        });
        for round in 0..20 {
            let expected = vec![3.0 + 3.0 * round as f32, 3.0];
            for rank in &results {
                assert_eq!(rank[round], expected);
            }
        }
    }

    /// Runs `f` on `world` ranks as threads; every rank's result, in order.
    fn on_ranks<R: Send>(world: usize, f: impl Fn(LocalGroup) -> R + Sync) -> Vec<R> {
        std::thread::scope(|scope| {
            let f = &f;
            let threads: Vec<_> = LocalGroup::new(world)
                .into_iter()
                .map(|comm| scope.spawn(move || f(comm)))
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("joins"))
                .collect()
        })
    }

    /// The ring's reduce-scatter and all-gather over parts of uneven
    /// lengths (shards cutting across them) against the sum written out in
    /// ring order, and against gather-and-add within f32 rounding.
    #[test]
    fn ring_reduce_scatter_then_all_gather_is_an_all_reduce_in_ring_order() {
        let world = 3;
        let value =
            |rank: usize, i: usize| ((rank * 7919 + i * 104_729) % 1000) as f32 / 7.0 - 60.0;
        let lengths = [5usize, 1, 0, 11];
        let total: usize = lengths.iter().sum();
        let results = on_ranks(world, |comm| {
            let mut parts: Vec<Vec<f32>> = Vec::new();
            let mut i = 0;
            for &n in &lengths {
                parts.push((i..i + n).map(|k| value(comm.rank(), k)).collect());
                i += n;
            }
            let mut wide: Vec<f32> = parts.concat();
            let mut views: Vec<&mut [f32]> = parts.iter_mut().map(Vec::as_mut_slice).collect();
            comm.reduce_scatter_sum_f32(&mut views)
                .expect("reduce-scatter");
            comm.all_gather_f32(&mut views).expect("all-gather");
            comm.all_reduce_sum_f32(&mut wide).expect("all-reduce");
            (parts.concat(), wide)
        });
        for (ring, gathered) in &results {
            assert_eq!(ring, &results[0].0, "every rank gets the same bits");
            for i in 0..total {
                let shard = (0..world)
                    .find(|&r| shard_range(total, world, r).contains(&i))
                    .expect("a shard holds every element");
                let mut order = ring_order(shard, world);
                let first = order.next().expect("one rank at least");
                let expected = order.fold(value(first, i), |acc, r| acc + value(r, i));
                assert_eq!(ring[i].to_bits(), expected.to_bits(), "element {i}");
                assert!((ring[i] - gathered[i]).abs() <= 1e-5 * gathered[i].abs().max(1.0));
            }
        }
    }

    #[test]
    fn shards_cover_the_buffer_once_in_rank_order() {
        for (len, world) in [(10, 3), (2, 4), (0, 2), (12, 4)] {
            let shards: Vec<_> = (0..world).map(|r| shard_range(len, world, r)).collect();
            assert_eq!(shards[0].start, 0);
            assert_eq!(shards[world - 1].end, len);
            for pair in shards.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
                assert!(pair[0].len() >= pair[1].len() && pair[0].len() <= pair[1].len() + 1);
            }
        }
        assert_eq!(ring_order(1, 3).collect::<Vec<_>>(), vec![2, 0, 1]);
    }

    #[test]
    fn a_rank_that_dies_breaks_the_others_collectives() {
        let mut handles = LocalGroup::new(2);
        let survivor = handles.pop().expect("two handles");
        let dying = handles.pop().expect("two handles");
        let outcome = std::thread::scope(|scope| {
            let failing = scope.spawn(move || {
                let _comm = dying;
                panic!("rank 0 fails on its data");
            });
            let waiting = scope.spawn(move || survivor.all_reduce_sum_f32(&mut [1.0]));
            let outcome = waiting.join().expect("the survivor returns");
            assert!(failing.join().is_err());
            outcome
        });
        let err = outcome.expect_err("the survivor must not hang or succeed");
        assert!(err.to_string().contains("rank 0 stopped"), "{err}");
    }

    #[test]
    fn ranks_holding_different_inputs_are_named_by_every_rank() {
        let verdicts = |values: [u64; 3]| -> Vec<Result<(), String>> {
            std::thread::scope(|scope| {
                let threads: Vec<_> = LocalGroup::new(3)
                    .into_iter()
                    .map(|comm| {
                        scope.spawn(move || {
                            let own = values[comm.rank()];
                            crate::comm::check_same_on_every_rank(
                                &comm,
                                &[("settings", 7), ("training data", own)],
                            )
                            .map_err(|e| e.to_string())
                        })
                    })
                    .collect();
                threads
                    .into_iter()
                    .map(|t| t.join().expect("joins"))
                    .collect()
            })
        };
        // High bits matter as much as low ones.
        let same = 0xfedc_ba98_7654_3210;
        assert!(verdicts([same; 3]).iter().all(Result::is_ok));
        for verdict in verdicts([same, same, same ^ (1 << 63)]) {
            let message = verdict.expect_err("rank 2 differs");
            assert!(
                message.contains("disagree on training data: rank(s) 2 hold"),
                "{message}"
            );
        }
    }
}
