//! Kernel outputs written in full, never zeroed first.
//!
//! `vec![0.0; n]` is `calloc`, which zeroes memory that `malloc` reused
//! (the binary keeps freed memory in the heap, `padfree-cli`'s
//! `allocator.rs`): in a `--bf16` step of SmolLM2-135M on eight maths
//! examples, the widening of kept bf16 activations, SwiGLU's and RMSNorm's
//! outputs and gradients zeroed about 2 GB (traced: `calloc` of 64 KiB or
//! more, by caller), then wrote every value again. These kernels write
//! each value of their outputs exactly once, so they take their buffers
//! from here.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

/// `len` values that `write` sets, in a fresh vector.
///
/// # Safety
/// `write` sets every one of the `len` values it is handed
/// ([`MaybeUninit::write`]) unless it panics.
pub(crate) unsafe fn fresh<T>(len: usize, write: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    // SAFETY: the caller's contract.
    unsafe { fresh_in(Vec::new(), len, write) }
}

/// [`fresh`] in `buffer`'s room (its values dropped; it grows if short).
///
/// # Safety
/// As [`fresh`].
pub(crate) unsafe fn fresh_in<T>(
    mut buffer: Vec<T>,
    len: usize,
    write: impl FnOnce(&mut [MaybeUninit<T>]),
) -> Vec<T> {
    buffer.clear();
    buffer.reserve_exact(len);
    // A panic in `write` leaves the length at zero: nothing unwritten is
    // ever read or dropped.
    write(&mut buffer.spare_capacity_mut()[..len]);
    // SAFETY: `write` set all `len` values (the caller's contract), within
    // the capacity reserved above.
    unsafe { buffer.set_len(len) };
    buffer
}

/// A shared slice made chunk by chunk on rayon's threads, without a pass
/// of zeros over memory first: each chunk is set to `T::default()` as it is
/// handed out (a cache-sized chunk, just before its writer stores into it,
/// so the zeros cost no trip to memory), and the slice is whole only once
/// every chunk was handed out ([`Self::finish`] checks it). For `--bf16`'s
/// weight copies, made again by the optimizer's update after the backward
/// pass freed last step's (`precision::CopyToWrite`).
pub struct FreshArc<T> {
    values: Arc<[MaybeUninit<T>]>,
    /// Values of the chunks handed out so far.
    handed_out: AtomicUsize,
}

impl<T: Copy + Default + Send + Sync> FreshArc<T> {
    /// Room for `len` values (allocated, not written).
    pub fn new(len: usize) -> Self {
        Self {
            values: Arc::new_uninit_slice(len),
            handed_out: AtomicUsize::new(0),
        }
    }

    /// Its values in chunks of `size` (the last may be shorter), each set
    /// to `T::default()` as it is handed out, for the writer to overwrite.
    /// Only the last call's chunks count towards [`Self::finish`].
    ///
    /// # Panics
    /// When `size` is 0.
    pub fn par_chunks_mut(
        &mut self,
        size: usize,
    ) -> impl IndexedParallelIterator<Item = &mut [T]> + '_ {
        *self.handed_out.get_mut() = 0;
        let handed_out = &self.handed_out;
        let values = Arc::get_mut(&mut self.values).expect("a fresh slice is never shared");
        values.par_chunks_mut(size).map(move |chunk| {
            chunk.fill(MaybeUninit::new(T::default()));
            handed_out.fetch_add(chunk.len(), Ordering::Relaxed);
            // SAFETY: every value of the chunk was just written.
            unsafe { &mut *(std::ptr::from_mut::<[MaybeUninit<T>]>(chunk) as *mut [T]) }
        })
    }

    /// The values, once every chunk was handed out.
    ///
    /// # Panics
    /// When some were never handed out (the writer stopped short: a bug in
    /// the caller), rather than hand out values nobody wrote.
    pub fn finish(self) -> Arc<[T]> {
        let handed_out = self.handed_out.into_inner();
        assert!(
            handed_out == self.values.len(),
            "a fresh slice of {} values had {handed_out} handed out",
            self.values.len()
        );
        // SAFETY: one call of `par_chunks_mut` hands each of its disjoint
        // chunks out at most once, setting every value of it, and the count
        // (reset by each call) reached the slice's length: every value is set.
        unsafe { self.values.assume_init() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector holds what `write` set, at the asked length, in a fresh
    /// vector and in a reused one longer or shorter than asked.
    #[test]
    fn the_vector_holds_what_was_written() {
        let set = |out: &mut [MaybeUninit<u64>]| {
            for (i, slot) in out.iter_mut().enumerate() {
                slot.write(3 * i as u64);
            }
        };
        for len in [0, 1, 10, 4096] {
            let want: Vec<u64> = (0..len as u64).map(|i| 3 * i).collect();
            // SAFETY: `set` writes every value it is handed.
            let out = unsafe { fresh(len, set) };
            assert_eq!(out, want, "{len} values");
            for reused in [vec![7u64; 3], vec![9u64; 5000]] {
                // SAFETY: as above.
                let out = unsafe { fresh_in(reused, len, set) };
                assert_eq!(out, want, "{len} values in a reused buffer");
            }
        }
    }

    /// Written through its chunks on rayon's threads, the slice holds what
    /// was written; a chunk handed out and not written holds the default;
    /// chunks never handed out make `finish` refuse.
    #[test]
    fn a_fresh_arc_holds_what_its_chunks_were_given() {
        for (len, size) in [(0, 4), (1, 4), (10, 4), (4096, 1000), (4096, 4096)] {
            let mut fresh = FreshArc::<u32>::new(len);
            fresh
                .par_chunks_mut(size)
                .enumerate()
                .for_each(|(i, chunk)| {
                    if i != 1 {
                        for (j, v) in chunk.iter_mut().enumerate() {
                            *v = (i * size + j) as u32 + 7;
                        }
                    }
                });
            let got = fresh.finish();
            let want: Vec<u32> = (0..len)
                .map(|k| if k / size == 1 { 0 } else { k as u32 + 7 })
                .collect();
            assert_eq!(&got[..], &want[..], "{len} values in chunks of {size}");
        }
        let mut short = FreshArc::<u32>::new(10);
        short
            .par_chunks_mut(4)
            .take(2)
            .for_each(|chunk| chunk.fill(1));
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| short.finish()));
        assert!(refused.is_err(), "two of three chunks handed out");
    }
}
