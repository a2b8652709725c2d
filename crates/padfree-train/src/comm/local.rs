//! `W` ranks as threads of one process.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use super::{CommError, Communicator, sum_in_rank_order};

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
            if state
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
            state.result = sum_in_rank_order(
                state.slots.iter().flatten().map(Vec::as_slice),
                values.len(),
            );
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
        values.copy_from_slice(&state.result);
        state.departed += 1;
        if state.departed == shared.world_size {
            shared.changed.notify_all();
        }
        Ok(())
    }
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
