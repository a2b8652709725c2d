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
}
