//! bf16 values: the one rounding every bf16 path uses (round to nearest
//! even, NaN kept as a quiet NaN, as `half` and PyTorch round), widening
//! back to f32 (exact), rounding a slice, and storing activations for the
//! backward pass as bf16 (two to an f32 slot), vectorised and on rayon's
//! threads for long ones.
//!
//! Why our own loop and not `half::bf16::from_f32` per value: `half`'s
//! branchy version does not vectorise; this one does, and the tests check
//! it is bit-for-bit `half`'s.
//!
//! Stored and widened activations are written into buffers never zeroed
//! first (`fresh.rs`), which is this module's only `unsafe`.

#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use half::bf16;
use rayon::prelude::*;

use super::fresh::fresh;
use super::simd::dispatch;

/// Slices of at least this many values are rounded, widened or scanned
/// on rayon's threads (here and in the widened gemm body).
pub(crate) const PARALLEL_VALUES: usize = 1 << 16;

/// `x` rounded to bf16 (nearest, ties to even). Public for loops that
/// round as they write (the optimizer's update of `--bf16`'s copies).
#[inline(always)]
pub fn round(x: f32) -> bf16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = ((bits >> 16) | 0x40) as u16;
    // A select, not a branch, so that loops of it vectorise.
    bf16::from_bits(if x.is_nan() { nan } else { rounded })
}

/// `x` rounded to bf16 and widened again: the f32 that a bf16 matmul
/// operand holds.
#[inline(always)]
pub(crate) fn rounded(x: f32) -> f32 {
    widen(round(x))
}

/// The f32 of the same value (exact).
#[inline(always)]
pub(crate) fn widen(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// Zero exactly when rounding `x` to bf16 leaves it as it is ([`rounded`]:
/// the low 16 bits clear, and a NaN quiet already).
#[inline(always)]
pub(crate) fn unrounded_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    let signalling = x.is_nan() && bits & 0x0040_0000 == 0;
    (bits & 0xFFFF) | u32::from(signalling)
}

/// Whether every value of `slice` is a bf16 value already. Reads 64
/// values at a time (a loop that vectorises) and stops at the first 64
/// holding one that is not: on unrounded data, the first.
#[inline(always)]
pub(crate) fn slice_is_rounded(slice: &[f32]) -> bool {
    slice
        .chunks(64)
        .all(|chunk| chunk.iter().fold(0, |acc, &x| acc | unrounded_bits(x)) == 0)
}

/// Whether every value of `values` is a bf16 value already, so that a
/// product may read it where it lies; long slices on rayon's threads.
/// One scan of an activation that several products read (a linear
/// layer's input, in its forward and its backward pass), where each
/// product scanned it on one thread.
pub(crate) fn holds_bf16_values(values: &[f32]) -> bool {
    if values.len() >= PARALLEL_VALUES {
        values.par_chunks(PARALLEL_VALUES / 4).all(|chunk| {
            dispatch(
                #[inline(always)]
                || slice_is_rounded(chunk),
            )
        })
    } else {
        dispatch(
            #[inline(always)]
            || slice_is_rounded(values),
        )
    }
}

/// Every value of `values` rounded to bf16.
pub(crate) fn round_slice(values: &[f32]) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; values.len()];
    round_into(values, &mut out);
    out
}

/// `out[i] = round(values[i])`.
///
/// # Panics
/// When the lengths differ (a bug in the caller).
pub(crate) fn round_into(values: &[f32], out: &mut [bf16]) {
    assert_eq!(values.len(), out.len(), "bf16 rounding: lengths");
    let body = |(src, dst): (&[f32], &mut [bf16])| {
        dispatch(
            #[inline(always)]
            || {
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = round(s);
                }
            },
        );
    };
    zip_chunks(values, out, body);
}

/// `body` over `src` and `dst` (as long) in matching chunks, on rayon's
/// threads where they hold [`PARALLEL_VALUES`] values or more.
fn zip_chunks<S: Sync, D: Send>(
    src: &[S],
    dst: &mut [D],
    body: impl Fn((&[S], &mut [D])) + Sync + Send,
) {
    if src.len() >= PARALLEL_VALUES {
        src.par_chunks(PARALLEL_VALUES)
            .zip(dst.par_chunks_mut(PARALLEL_VALUES))
            .for_each(body);
    } else {
        body((src, dst));
    }
}

/// `values` rounded in place (kept as f32): an output that autocast would
/// have made bf16.
pub(crate) fn round_in_place(values: &mut [f32]) {
    let body = |chunk: &mut [f32]| {
        dispatch(
            #[inline(always)]
            || {
                for v in chunk.iter_mut() {
                    *v = rounded(*v);
                }
            },
        );
    };
    if values.len() >= PARALLEL_VALUES {
        values.par_chunks_mut(PARALLEL_VALUES).for_each(body);
    } else {
        body(values);
    }
}

/// A copy of `values` rounded to bf16 (kept as f32): an operand two
/// products read, rounded once ([`super::gemm_bf16::View16::rounded`]).
pub(crate) fn rounded_copy(values: &[f32]) -> Vec<f32> {
    let mut out = values.to_vec();
    round_in_place(&mut out);
    out
}

/// `values` rounded to bf16 and stored two to an f32 slot (bit for bit,
/// low half first): how a host op's `saved` buffer (f32 slots) keeps an
/// activation for the backward pass in half the memory.
pub(crate) fn store(values: &[f32]) -> Vec<f32> {
    let body = |(src, dst): (&[f32], &mut [MaybeUninit<f32>])| {
        dispatch(
            #[inline(always)]
            || {
                let mut pairs = src.chunks_exact(2);
                for (d, pair) in dst.iter_mut().zip(&mut pairs) {
                    let bits = u32::from(round(pair[0]).to_bits())
                        | (u32::from(round(pair[1]).to_bits()) << 16);
                    d.write(f32::from_bits(bits));
                }
                if let ([last], Some(d)) = (pairs.remainder(), dst.last_mut()) {
                    d.write(f32::from_bits(u32::from(round(*last).to_bits())));
                }
            },
        );
    };
    // SAFETY: `body` sets every slot of its `dst`: one per pair of `src`
    // and the last for a lone value, and each `dst` holds
    // `src.len().div_ceil(2)` slots (the chunks of `values` are even but
    // for the last, and `dst`'s chunks half theirs).
    unsafe {
        fresh(values.len().div_ceil(2), |out| {
            if values.len() >= PARALLEL_VALUES {
                values
                    .par_chunks(PARALLEL_VALUES)
                    .zip(out.par_chunks_mut(PARALLEL_VALUES / 2))
                    .for_each(body);
            } else {
                body((values, out));
            }
        })
    }
}

/// `values` widened to f32 (exact).
pub(crate) fn widen_slice(values: &[bf16]) -> Vec<f32> {
    let body = |(src, dst): (&[bf16], &mut [MaybeUninit<f32>])| {
        dispatch(
            #[inline(always)]
            || {
                for (d, &s) in dst.iter_mut().zip(src) {
                    d.write(widen(s));
                }
            },
        );
    };
    // SAFETY: `body` sets every slot of its `dst`, which holds as many
    // values as its `src` (chunks of the same length of slices of the same
    // length).
    unsafe { fresh(values.len(), |out| zip_chunks(values, out, body)) }
}

/// The `len` values [`store`] kept in `stored`, widened to f32.
///
/// # Panics
/// When `stored` holds fewer than `len` values (a bug in the caller).
pub(crate) fn load(stored: &[f32], len: usize) -> Vec<f32> {
    assert!(
        2 * stored.len() >= len,
        "bf16 load: {} slots for {len} values",
        stored.len()
    );
    let body = |(src, dst): (&[f32], &mut [MaybeUninit<f32>])| {
        dispatch(
            #[inline(always)]
            || {
                // Whole pairs in a loop without a branch, so that it vectorises
                // (`chunks_mut(2)` with an optional high half stayed scalar: 1.8%
                // of a `medium` `--bf16` step in the attention's backward).
                let last = src.get(dst.len() / 2);
                let mut pairs = dst.chunks_exact_mut(2);
                for (pair, s) in (&mut pairs).zip(src) {
                    let bits = s.to_bits();
                    pair[0].write(f32::from_bits(bits << 16));
                    pair[1].write(f32::from_bits(bits & 0xFFFF_0000));
                }
                if let ([lo], Some(s)) = (pairs.into_remainder(), last) {
                    lo.write(f32::from_bits(s.to_bits() << 16));
                }
            },
        );
    };
    // SAFETY: `body` sets every slot of its `dst`, two per value of `src`
    // (one for the last of an odd `len`): each `dst` chunk holds at most
    // twice its `src` chunk's values (asserted above for the whole).
    unsafe {
        fresh(len, |out| {
            if len >= PARALLEL_VALUES {
                stored
                    .par_chunks(PARALLEL_VALUES / 2)
                    .zip(out.par_chunks_mut(PARALLEL_VALUES))
                    .for_each(body);
            } else {
                body((stored, out));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use padfree_pack::SplitMix64;

    /// Bit for bit `half`'s rounding (which is PyTorch's): every edge (ties
    /// both ways, the largest finite values rounding to infinity,
    /// subnormals, signed zeros, infinities, NaNs with any payload) and
    /// four million random bit patterns.
    #[test]
    fn rounding_is_halfs_to_the_bit() {
        let mut patterns: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0x7F80_0001,
            0xFF80_0001,
            0x7FFF_FFFF,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F7F_8000,
            0x0000_0001,
            0x0000_8000,
            0x0001_8000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x3F80_7FFF,
        ];
        let mut rng = SplitMix64::new(7);
        patterns.extend((0..4_000_000).map(|_| rng.next_u64() as u32));
        for bits in patterns {
            let x = f32::from_bits(bits);
            let ours = round(x);
            let theirs = bf16::from_f32(x);
            if x.is_nan() {
                assert!(ours.is_nan(), "{bits:#010x}: NaN stays NaN");
                assert_eq!(
                    ours.to_bits(),
                    theirs.to_bits(),
                    "{bits:#010x}: NaN payload"
                );
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#010x}");
            }
        }
    }

    #[test]
    fn slices_round_and_widen_like_single_values() {
        let values: Vec<f32> = (0..PARALLEL_VALUES * 2 + 37)
            .map(|i| (i as f32 * 0.731).sin() * 1e3)
            .collect();
        let halves = round_slice(&values);
        for (h, &v) in halves.iter().zip(&values) {
            assert_eq!(h.to_bits(), bf16::from_f32(v).to_bits());
        }
        let widened: Vec<f32> = halves.iter().map(|&h| widen(h)).collect();
        for (w, (h, &v)) in widened.iter().zip(halves.iter().zip(&values)) {
            assert_eq!(w.to_bits(), h.to_f32().to_bits(), "widening is exact");
            assert_eq!(w.to_bits(), rounded(v).to_bits());
        }
        // The slice's widening (on rayon's threads at this length) too.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&widen_slice(&halves)), bits(&widened));
        assert_eq!(bits(&widen_slice(&halves[..37])), bits(&widened[..37]));
        // Rounding is idempotent: a rounded value is its own rounding.
        assert_eq!(round_slice(&widened), halves);
        let mut in_place = values.clone();
        round_in_place(&mut in_place);
        assert_eq!(in_place, widened);
        // Stored two to a slot and loaded back: the rounded values, odd
        // lengths included, NaN payloads and signs kept.
        for len in [0, 1, 2, 7, values.len()] {
            let mut some = values[..len].to_vec();
            if len > 3 {
                some[1] = f32::from_bits(0xFFC0_1234);
                some[2] = -0.0;
            }
            let loaded = load(&store(&some), len);
            let want: Vec<u32> = some.iter().map(|&v| rounded(v).to_bits()).collect();
            let got: Vec<u32> = loaded.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "length {len}");
        }
    }

    /// The in-place test agrees with rounding itself on every kind of
    /// value: zeros, infinities, subnormals, quiet and signalling NaNs
    /// with their low bits clear or not, and a spread of ordinary ones.
    #[test]
    fn a_value_is_found_rounded_exactly_when_rounding_keeps_it() {
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x0001_0000,
            0x0000_0001,
            0x7FC0_0000,
            0x7FC0_0001,
            0x7F81_0000,
            0x7F80_0001,
            0xFFA0_0000,
            0x3F80_0000,
            0x3F80_8000,
            0x3F81_8000,
        ];
        bits.extend((0..5000u32).map(|i| i.wrapping_mul(2_654_435_761)));
        bits.extend((0..5000u32).map(|i| i.wrapping_mul(2_654_435_761) & 0xFFFF_0000));
        for b in bits {
            let x = f32::from_bits(b);
            assert_eq!(
                unrounded_bits(x) == 0,
                rounded(x).to_bits() == b,
                "{b:#010x}"
            );
        }
    }

    /// The scan of a whole activation, on rayon's threads when long:
    /// true for rounded values; false for one unrounded value anywhere,
    /// the last of a long slice included (a parallel `all` that missed a
    /// chunk would say true); true for the empty slice.
    #[test]
    fn a_slice_holds_bf16_values_only_when_every_value_is_one() {
        let mut rng = SplitMix64::new(5);
        for len in [
            0,
            1,
            63,
            64,
            65,
            PARALLEL_VALUES - 1,
            PARALLEL_VALUES * 3 + 17,
        ] {
            let values: Vec<f32> = (0..len)
                .map(|_| rounded(rng.standard_normal() as f32))
                .collect();
            assert!(holds_bf16_values(&values), "{len} rounded values");
            for at in [0, len / 2, len.saturating_sub(1)] {
                if len == 0 {
                    continue;
                }
                let mut one_off = values.clone();
                one_off[at] = f32::from_bits(one_off[at].to_bits() | 1);
                assert!(
                    !holds_bf16_values(&one_off),
                    "{len} values, unrounded at {at}"
                );
            }
        }
    }
}
