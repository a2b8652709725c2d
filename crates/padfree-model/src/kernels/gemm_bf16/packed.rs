//! The AVX512-BF16 body of the bf16 products: BLIS-style packing of both
//! operands into bf16 pairs and a 14x32 micro-kernel of `vdpbf16ps`. Run
//! only where `has_avx512_bf16()` holds (`gemm_bf16::product_into_with`
//! asserts it).
#![allow(unsafe_code)]

use rayon::prelude::*;

use super::operand::{Element, Values, View16, with_values};
use crate::kernels::gemm::Write;

/// Rows of a micro-tile: 14 x 2 accumulators plus two B registers fill 30
/// of AVX-512's 32 vector registers.
const MR: usize = 14;
/// Columns of a micro-tile: two 16-lane registers.
pub(super) const NR: usize = 32;
/// The largest K block: A's block (112 x 512 bf16, 112 KiB) stays in L2.
const KC: usize = 512;
/// Output rows a thread takes at a time.
const MC: usize = MR * 8;
/// Products this small run on the calling thread (as `kernels/gemm.rs`).
const PARALLEL_OPS: usize = 192 * 192 * 192;

/// A packing buffer whose values start on a 64-byte cache line. A tile
/// or vector load that straddles two lines costs two: `tileloadd` of a
/// 1 KiB tile measured 17-20 ns from an L1-resident buffer 16 or 32
/// bytes off a line against 2.8-3.0 ns on one (Xeon model 207), and
/// `malloc` hands out 16-byte alignment only.
#[derive(Default)]
pub(super) struct Pack {
    buf: Vec<u32>,
    start: usize,
    len: usize,
}

impl Pack {
    /// `len` zeros from a cache line on, to be written.
    pub(super) fn zeroed(&mut self, len: usize) -> &mut [u32] {
        const LINE: usize = 64 / std::mem::size_of::<u32>();
        self.buf.clear();
        self.buf.resize(len + LINE - 1, 0);
        // `align_offset` may say `usize::MAX` where it cannot tell; the
        // values are then used where they lie (slower, as correct).
        self.start = self.buf.as_ptr().align_offset(64).min(LINE - 1);
        self.len = len;
        &mut self.buf[self.start..self.start + len]
    }

    /// The values [`Pack::zeroed`] handed out.
    pub(super) fn values(&self) -> &[u32] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// Whether CPUID's vendor string is Intel's (`GenuineIntel`).
pub(super) fn cpu_is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU; the intrinsic is
        // an `unsafe fn` in some Rust versions only.
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let vendor = [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes);
        vendor.concat() == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The fast body: pack, then micro-tiles of `vdpbf16ps`.
pub(super) fn packed(
    dst: &mut [f32],
    row_stride: usize,
    a: View16<'_>,
    b: View16<'_>,
    write: Write,
) {
    let blocking = Blocking {
        kc: KC,
        mr: MR,
        mc: MC,
        stride: |kc| kc.div_ceil(2),
    };
    drive(dst, row_stride, (a, b), write, blocking, |block| {
        let mut a_pack = Pack::default();
        // SAFETY: `packed` runs only where `has_avx512_bf16()` holds.
        let layout = with_values!(a.values, v => unsafe {
            pack_a_avx512(v, a, (block.i0, block.mc), (block.k0, block.kc), &mut a_pack)
        });
        let (mc, n, kc) = (block.mc, b.cols, block.kc);
        let out = (block.rows, row_stride, block.add, block.factor);
        match layout {
            Layout::Rows => tiles::<true>(a_pack.values(), block.b_pack, mc, n, kc, out),
            Layout::Panels => tiles::<false>(a_pack.values(), block.b_pack, mc, n, kc, out),
        }
    });
}

/// How a packed body blocks a product.
pub(super) struct Blocking {
    /// The largest K block.
    pub kc: usize,
    /// Rows of the micro-tile (row blocks are multiples of it).
    pub mr: usize,
    /// The largest row block a thread takes.
    pub mc: usize,
    /// The pairs a packed panel row holds for a K block of `kc` values.
    pub stride: fn(usize) -> usize,
}

/// One row block of one K block, as [`drive`] hands it to a body.
pub(super) struct RowBlock<'a> {
    /// The block's first row and its row count.
    pub i0: usize,
    pub mc: usize,
    /// The K block's first index and its length.
    pub k0: usize,
    pub kc: usize,
    /// Pairs a packed row holds ([`Blocking::stride`]).
    pub stride: usize,
    /// Every panel of `B` for this K block ([`pack_b`]).
    pub b_pack: &'a [u32],
    /// The block's output rows, `row_stride` apart (the last may be short).
    pub rows: &'a mut [f32],
    /// Whether the product is added (times `factor`) rather than set.
    pub add: bool,
    pub factor: f32,
}

/// The blocking both packed bodies share: K in even blocks (576 is one
/// block of 576, not 512 + 64; each even, so that only the last pair may be
/// half empty), `B` packed once a K block, then the output's row blocks on
/// rayon's threads (`body` packs its rows of `A` and runs its tiles). The
/// first K block sets the output (or adds `factor` times it); later ones add
/// theirs, times the same factor.
pub(super) fn drive(
    dst: &mut [f32],
    row_stride: usize,
    (a, b): (View16<'_>, View16<'_>),
    write: Write,
    blocking: Blocking,
    body: impl Fn(RowBlock<'_>) + Sync,
) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let blocks = k.div_ceil(blocking.kc);
    let kc_max = k.div_ceil(blocks).next_multiple_of(2);
    let parallel = m.saturating_mul(n).saturating_mul(k) >= PARALLEL_OPS && m > blocking.mr;
    // At least four row blocks a thread where M allows, so that threads
    // finish together (the head's few hundred rows are 5 blocks of 112).
    let mc_max = if parallel {
        (m.div_ceil(4 * rayon::current_num_threads()))
            .next_multiple_of(blocking.mr)
            .clamp(blocking.mr, blocking.mc)
    } else {
        blocking.mc
    };
    let region = (m - 1) * row_stride + n;
    let mut b_pack = Pack::default();
    for k0 in (0..k).step_by(kc_max) {
        let kc = kc_max.min(k - k0);
        let stride = (blocking.stride)(kc);
        with_values!(b.values, v => pack_b(v, b, (k0, kc), stride, &mut b_pack));
        let (add, factor) = match write {
            Write::Set if k0 == 0 => (false, 1.0),
            Write::Set => (true, 1.0),
            Write::Add(factor) => (true, factor),
        };
        let b_pack = b_pack.values();
        let run = |(block, rows): (usize, &mut [f32])| {
            let i0 = block * mc_max;
            body(RowBlock {
                i0,
                mc: mc_max.min(m - i0),
                k0,
                kc,
                stride,
                b_pack,
                rows,
                add,
                factor,
            });
        };
        let region = &mut dst[..region];
        if parallel {
            region
                .par_chunks_mut(mc_max * row_stride)
                .enumerate()
                .for_each(run);
        } else {
            region
                .chunks_mut(mc_max * row_stride)
                .enumerate()
                .for_each(run);
        }
    }
}

/// `out[p] = line[2p] | line[2p + 1] << 16` as bf16 bits (the last pair's
/// high half zero when `line` is odd): one row's K pairs, vectorised.
#[inline(always)]
pub(super) fn pairs_of<E: Element>(line: &[E], out: &mut [u32]) {
    let mut two = line.chunks_exact(2);
    for (o, pair) in out.iter_mut().zip(&mut two) {
        *o = pair[0].bits() | (pair[1].bits() << 16);
    }
    if let ([last], Some(o)) = (two.remainder(), out.get_mut(line.len() / 2)) {
        *o = last.bits();
    }
}

/// `out[c] = lo[c] | hi[c] << 16` (or `lo` alone): two K lines interleaved, vectorised.
#[inline(always)]
pub(super) fn interleave<E: Element>(lo: &[E], hi: Option<&[E]>, out: &mut [u32]) {
    match hi {
        Some(hi) => {
            for ((o, l), h) in out.iter_mut().zip(lo).zip(hi) {
                *o = l.bits() | (h.bits() << 16);
            }
        }
        None => {
            for (o, l) in out.iter_mut().zip(lo) {
                *o = l.bits();
            }
        }
    }
}

/// `line`'s values to every `WIDTH`-th slot of `panel` from `slot`: a
/// row's pairs into its column of a packed panel.
#[inline(always)]
fn scatter<const WIDTH: usize>(line: &[u32], panel: &mut [u32], slot: usize) {
    assert!(slot < WIDTH, "bf16 pack: slot {slot} of {WIDTH}");
    for (group, &value) in panel.chunks_exact_mut(WIDTH).zip(line) {
        group[slot] = value;
    }
}

/// How [`pack_a`] laid out a row block: either way `MR` rows of the block
/// take `pairs * MR` consecutive values, so a panel is the same slice.
#[derive(Clone, Copy)]
enum Layout {
    /// `[row][pair]`: each row's pairs in order, as a row-major bf16 `A`
    /// already holds them. The micro-kernel reads row `i`'s pair `p` at
    /// `i * pairs + p`.
    Rows,
    /// `[panel][pair][MR]`: the `MR` rows' pair `p` side by side (BLIS's
    /// packing), read at `p * MR + i`.
    Panels,
}

/// Rows `i0..i0 + mc`, K `k0..k0 + kc` of `a` (whose values are `v`) as
/// pairs of bf16 (even K in the low half), zeros past the edges, in the
/// [`Layout`] that reads `a` in order: rows for an `A` contiguous along K
/// (`x`: each row converted in one vectorised pass, no scatter into
/// panels, whose stores were most of this function's time), panels
/// otherwise.
#[inline(always)]
fn pack_a<E: Element>(
    v: &[E],
    a: View16<'_>,
    i0: usize,
    mc: usize,
    k0: usize,
    kc: usize,
    out: &mut Pack,
) -> Layout {
    let pairs = kc.div_ceil(2);
    let out = out.zeroed(mc.div_ceil(MR) * pairs * MR);
    if a.col_stride == 1 {
        for (r, line) in out.chunks_exact_mut(pairs).take(mc).enumerate() {
            let from = (i0 + r) * a.row_stride + k0;
            pairs_of(&v[from..from + kc], line);
        }
        return Layout::Rows;
    }
    if a.col_stride != 1 && a.row_stride == 1 {
        // Columns contiguous along M (`dy^T`, K the tokens): two K lines at
        // a time, each read once across the whole block, then cut into the
        // panels. A panel at a time would read `MR` values of each line,
        // one page apart for a wide `dy`: TLB misses dominated the pack.
        for p in 0..pairs {
            let from = (k0 + 2 * p) * a.col_stride + i0;
            let lo = &v[from..from + mc];
            let hi = (2 * p + 1 < kc).then(|| &v[from + a.col_stride..from + a.col_stride + mc]);
            for (panel, dst) in out.chunks_exact_mut(pairs * MR).enumerate() {
                let (r0, rows) = (panel * MR, MR.min(mc - panel * MR));
                interleave(
                    &lo[r0..r0 + rows],
                    hi.map(|hi| &hi[r0..r0 + rows]),
                    &mut dst[p * MR..p * MR + rows],
                );
            }
        }
        return Layout::Panels;
    }
    // Neither stride 1: value by value.
    for (panel, dst) in out.chunks_mut(pairs * MR).enumerate() {
        let first = i0 + panel * MR;
        for r in 0..MR.min(mc - panel * MR) {
            for p in 0..pairs {
                let at = |k: usize| (first + r) * a.row_stride + k * a.col_stride;
                let k = k0 + 2 * p;
                let hi = if 2 * p + 1 < kc {
                    v[at(k + 1)].bits()
                } else {
                    0
                };
                dst[p * MR + r] = v[at(k)].bits() | (hi << 16);
            }
        }
    }
    Layout::Panels
}

/// K `k0..k0 + kc` of every column of `b` (whose values are `v`) as panels
/// of `NR` columns: `[panel][pair][NR]` pairs of bf16, `stride` pairs a
/// panel (at least `kc / 2`: the AMX body pads K to whole tiles), zeros
/// past the edges; panels on rayon's threads, each compiled for AVX-512
/// (every CPU that runs a packed body has it).
pub(super) fn pack_b<E: Element>(
    v: &[E],
    b: View16<'_>,
    (k0, kc): (usize, usize),
    stride: usize,
    out: &mut Pack,
) {
    let pairs = kc.div_ceil(2);
    assert!(
        stride >= pairs,
        "bf16 pack: {stride} pairs a panel for {pairs}"
    );
    let n = b.cols;
    let out = out.zeroed(n.div_ceil(NR) * stride * NR);
    let body = |(panel, dst): (usize, &mut [u32])| {
        let dst = &mut dst[..pairs * NR];
        // SAFETY: the packed bodies run only where AVX512F, BW and VL are
        // (`has_avx512_bf16()` or `amx::has_amx_bf16()`).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            pack_b_panel_avx512(v, b, (k0, kc), panel, dst);
        }
        #[cfg(not(target_arch = "x86_64"))]
        pack_b_panel(v, b, (k0, kc), panel, dst);
    };
    if n * kc >= 1 << 16 {
        out.par_chunks_mut(stride * NR).enumerate().for_each(body);
    } else {
        out.chunks_mut(stride * NR).enumerate().for_each(body);
    }
}

/// Panel `panel` of [`pack_b`] into `dst`.
#[inline(always)]
fn pack_b_panel<E: Element>(
    v: &[E],
    b: View16<'_>,
    (k0, kc): (usize, usize),
    panel: usize,
    dst: &mut [u32],
) {
    let pairs = kc.div_ceil(2);
    let first = panel * NR;
    let cols = NR.min(b.cols - first);
    if b.col_stride == 1 {
        // Rows contiguous along N (`W`, `x`): two K rows at a time.
        for (p, group) in dst.chunks_exact_mut(NR).enumerate() {
            let from = (k0 + 2 * p) * b.row_stride + first;
            let hi = (2 * p + 1 < kc).then(|| &v[from + b.row_stride..from + b.row_stride + cols]);
            interleave(&v[from..from + cols], hi, &mut group[..cols]);
        }
    } else if b.row_stride == 1 {
        // Columns contiguous along K (`W^T`): a column's pairs.
        let mut line = vec![0u32; pairs];
        for c in 0..cols {
            let from = (first + c) * b.col_stride + k0;
            pairs_of(&v[from..from + kc], &mut line);
            scatter::<NR>(&line, dst, c);
        }
    } else {
        for c in 0..cols {
            for p in 0..pairs {
                let at = |k: usize| k * b.row_stride + (first + c) * b.col_stride;
                let k = k0 + 2 * p;
                let hi = if 2 * p + 1 < kc {
                    v[at(k + 1)].bits()
                } else {
                    0
                };
                dst[p * NR + c] = v[at(k)].bits() | (hi << 16);
            }
        }
    }
}

/// [`pack_a`] compiled for AVX-512 (the loops vectorise 16 wide).
///
/// # Safety
/// The CPU has AVX512F, BW and VL (every CPU with AVX512-BF16 has).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a_avx512<E: Element>(
    v: &[E],
    a: View16<'_>,
    (i0, mc): (usize, usize),
    (k0, kc): (usize, usize),
    out: &mut Pack,
) -> Layout {
    pack_a(v, a, i0, mc, k0, kc, out)
}

/// [`pack_b_panel`] compiled for AVX-512.
///
/// # Safety
/// As [`pack_a_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_b_panel_avx512<E: Element>(
    v: &[E],
    b: View16<'_>,
    k: (usize, usize),
    panel: usize,
    dst: &mut [u32],
) {
    pack_b_panel(v, b, k, panel, dst);
}

/// Every micro-tile of one row block: `rows` holds the block's output rows
/// (`row_stride` apart; the last may be short), `a_pack` the block in the
/// layout `ROWS` names ([`Layout::Rows`] when true).
fn tiles<const ROWS: bool>(
    a_pack: &[u32],
    b_pack: &[u32],
    mc: usize,
    n: usize,
    kc: usize,
    (rows, row_stride, add, factor): (&mut [f32], usize, bool, f32),
) {
    let pairs = kc.div_ceil(2);
    let mut tile = [0.0f32; MR * NR];
    for panel_j in 0..n.div_ceil(NR) {
        let b_panel = &b_pack[panel_j * pairs * NR..(panel_j + 1) * pairs * NR];
        let (col0, nc) = (panel_j * NR, NR.min(n - panel_j * NR));
        for panel_i in 0..mc.div_ceil(MR) {
            let a_panel = &a_pack[panel_i * pairs * MR..(panel_i + 1) * pairs * MR];
            let (row0, mr) = (panel_i * MR, MR.min(mc - panel_i * MR));
            let start = row0 * row_stride + col0;
            if mr == MR && nc == NR {
                micro_tile::<ROWS>(
                    a_panel,
                    b_panel,
                    &mut rows[start..start + (MR - 1) * row_stride + NR],
                    row_stride,
                    add,
                    factor,
                );
            } else {
                micro_tile::<ROWS>(a_panel, b_panel, &mut tile, NR, false, 1.0);
                for r in 0..mr {
                    let out = &mut rows[start + r * row_stride..start + r * row_stride + nc];
                    for (o, &v) in out.iter_mut().zip(&tile[r * NR..r * NR + nc]) {
                        *o = if add { *o + factor * v } else { v };
                    }
                }
            }
        }
    }
}

/// One `MR x NR` tile: `dst` (rows `ldc` apart) set to `a b` or `factor a b`
/// added to it; `a` (`MR` rows, laid out as `ROWS` says) and `b` packed
/// panels of the same number of pairs.
///
/// # Panics
/// When the panels or `dst` are too short (a bug in the caller).
#[inline]
fn micro_tile<const ROWS: bool>(
    a: &[u32],
    b: &[u32],
    dst: &mut [f32],
    ldc: usize,
    add: bool,
    factor: f32,
) {
    let pairs = a.len() / MR;
    assert!(
        a.len() == pairs * MR && b.len() == pairs * NR && dst.len() > (MR - 1) * ldc + NR - 1,
        "bf16 micro-tile: panels of {} and {} values, destination of {}",
        a.len(),
        b.len(),
        dst.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `packed` runs only where `has_avx512_bf16()` holds; the
        // lengths were checked above: `pairs * MR` values of `a` (either
        // layout), `pairs * NR` of `b` are read, `MR` rows of `NR` values
        // `ldc` apart are written.
        unsafe {
            micro_avx512_bf16::<ROWS>(
                pairs,
                a.as_ptr(),
                b.as_ptr(),
                dst.as_mut_ptr(),
                ldc,
                add,
                factor,
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pairs, ldc, add, factor);
        unreachable!("the packed bf16 body runs only on x86-64");
    }
}

/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `a` holds `pairs * MR` (either
/// layout) and `b` `pairs * NR` values; `c` is valid for `MR` rows of `NR` values `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_avx512_bf16<const ROWS: bool>(
    pairs: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    add: bool,
    factor: f32,
) {
    use std::arch::x86_64::{
        __m512bh, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_loadu_si512,
        _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
    };
    // SAFETY: the caller's bounds; the transmutes reinterpret 512 bits of
    // packed bf16 pairs as the `__m512bh` they are.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..pairs {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
            // Row `i`'s pair `p`: `[row][pair]` or `[pair][MR]`.
            let (ap, step) = if ROWS {
                (a.add(p), pairs)
            } else {
                (a.add(p * MR), 1)
            };
            for (i, row) in acc.iter_mut().enumerate() {
                let value = *ap.add(i * step) as i32;
                let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(value));
                row[0] = _mm512_dpbf16_ps(row[0], pair, b0);
                row[1] = _mm512_dpbf16_ps(row[1], pair, b1);
            }
        }
        let f = _mm512_set1_ps(factor);
        for (i, row) in acc.iter().enumerate() {
            for (h, &v) in row.iter().enumerate() {
                let ptr = c.add(i * ldc + 16 * h);
                let v = if add {
                    _mm512_fmadd_ps(v, f, _mm512_loadu_ps(ptr))
                } else {
                    v
                };
                _mm512_storeu_ps(ptr, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pack;

    /// A pack's values start on a cache line, are as many as asked and all
    /// zero, also when the buffer is reused for another size (tile loads
    /// off a line cost six times as much; `malloc` aligns to 16 bytes).
    #[test]
    fn a_pack_hands_out_zeros_on_a_cache_line() {
        let mut pack = Pack::default();
        for len in [1, 15, 16, 1000, 4096, 3, 70_000] {
            let values = pack.zeroed(len);
            assert_eq!(values.len(), len);
            assert!(values.iter().all(|&v| v == 0), "{len} values");
            assert_eq!(values.as_ptr() as usize % 64, 0, "{len} values");
            values.fill(7);
            assert_eq!(pack.values().len(), len);
            assert!(pack.values().iter().all(|&v| v == 7));
        }
    }
}
