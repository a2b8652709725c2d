//! The AVX512-BF16 body of the bf16 products: BLIS-style packing of both
//! operands into bf16 pairs and a 14x32 micro-kernel of `vdpbf16ps`. Run
//! only where `has_avx512_bf16()` holds (`gemm_bf16::product_into_with`
//! asserts it).
#![allow(unsafe_code)]

use std::cell::Cell;
use std::mem::MaybeUninit;
use std::thread::LocalKey;

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
    /// `len` values from a cache line on, each to be written: what the
    /// buffer held before (zeros where it grew). The packs write every
    /// value they hand out: zeroing `B`'s first was 272 MB a SmolLM2 step
    /// of short examples (traced).
    pub(super) fn unset(&mut self, len: usize) -> &mut [u32] {
        const LINE: usize = 64 / std::mem::size_of::<u32>();
        if self.buf.len() < len + LINE - 1 {
            // A fresh buffer rather than a grown one: nothing to copy.
            self.buf = vec![0; len + LINE - 1];
        }
        self.start = self.buf.as_ptr().align_offset(64).min(LINE - 1);
        self.len = len;
        &mut self.buf[self.start..self.start + len]
    }

    /// No values (the buffer kept).
    pub(super) fn clear(&mut self) {
        self.len = 0;
    }

    /// The values [`Pack::unset`] handed out.
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
    dst: &mut [MaybeUninit<f32>],
    row_stride: usize,
    a: View16<'_>,
    b: OperandB<'_>,
    write: Write,
) {
    let n = b.cols();
    let whole_a = packs_a_whole(a);
    drive_with(
        dst,
        row_stride,
        (a, b),
        write,
        &BLOCKING,
        |(k0, kc, _), whole| {
            if whole_a {
                with_values!(a.values, v => pack_a_lines(v, a, (k0, kc), whole));
            }
        },
        |block, a_pack, whole| {
            let (mc, kc) = (block.mc, block.kc);
            let out = (block.rows, row_stride, block.add, block.factor);
            if whole_a {
                // The block's panels of the K block's pack of every row
                // (row blocks start on whole panels: `run_k_block`).
                let panel = kc.div_ceil(2) * MR;
                let first = block.i0 / MR * panel;
                let panels = &whole[first..first + mc.div_ceil(MR) * panel];
                return tiles::<false>(panels, block.b_pack, mc, n, kc, out);
            }
            // SAFETY: `packed` runs only where `has_avx512_bf16()` holds.
            let layout = with_values!(a.values, v => unsafe {
                pack_a_avx512(v, a, (block.i0, block.mc), (block.k0, block.kc), a_pack)
            });
            match layout {
                Layout::Rows => tiles::<true>(a_pack.values(), block.b_pack, mc, n, kc, out),
                Layout::Panels => tiles::<false>(a_pack.values(), block.b_pack, mc, n, kc, out),
            }
        },
    );
}

/// Whether [`packed`] packs `a` a K block at a time for every row block
/// at once ([`pack_a_lines`]): an `A` whose columns are contiguous along M
/// (`dy^T` in `dy^T x`, K the tokens) and whose pack of one K block fits
/// what a thread keeps ([`KEPT_PACK_VALUES`]; the head's `dz^T` does not,
/// and its row blocks pack their own rows as before).
fn packs_a_whole(a: View16<'_>) -> bool {
    a.col_stride != 1
        && a.row_stride == 1
        && a.rows > MR
        && a.rows.div_ceil(MR) * MR * KC.div_ceil(2) <= KEPT_PACK_VALUES
}

/// How this body blocks its products.
pub(super) static BLOCKING: Blocking = Blocking {
    kc: KC,
    mr: MR,
    mc: MC,
    stride: |kc| kc.div_ceil(2),
};

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
    /// The block's output rows, `row_stride` apart (the last may be short):
    /// uninitialised until the first K block of a product set fresh
    /// ([`fresh`]); a body writes every value of its rows' `N` columns
    /// before it reads any, and reads only when `add`.
    pub rows: &'a mut [MaybeUninit<f32>],
    /// Whether the product is added (times `factor`) rather than set.
    pub add: bool,
    pub factor: f32,
}

/// The blocking both packed bodies share: K in even blocks (576 is one
/// block of 576, not 512 + 64; each even, so that only the last pair may be
/// half empty), `B` packed once a K block ([`PackedB`], or this thread's
/// reused pack), then the output's row blocks on rayon's threads (`body`
/// packs its rows of `A` and runs its tiles). The first K block sets the
/// output (or adds `factor` times it); later ones add theirs, times the
/// same factor.
pub(super) fn drive(
    dst: &mut [MaybeUninit<f32>],
    row_stride: usize,
    (a, b): (View16<'_>, OperandB<'_>),
    write: Write,
    blocking: &Blocking,
    body: impl Fn(RowBlock<'_>, &mut Pack) + Sync,
) {
    drive_with(
        dst,
        row_stride,
        (a, b),
        write,
        blocking,
        |_, _| {},
        |block, a_pack, _| body(block, a_pack),
    );
}

/// [`drive`], with `prologue` run once a K block `(k0, kc, stride)`
/// before its row blocks, into a buffer the thread keeps, which `body`
/// then reads beside its own pack (empty where `prologue` wrote nothing).
#[allow(clippy::too_many_arguments)]
pub(super) fn drive_with(
    dst: &mut [MaybeUninit<f32>],
    row_stride: usize,
    (a, b): (View16<'_>, OperandB<'_>),
    write: Write,
    blocking: &Blocking,
    mut prologue: impl FnMut((usize, usize, usize), &mut Pack),
    body: impl Fn(RowBlock<'_>, &mut Pack, &[u32]) + Sync,
) {
    let n = b.cols();
    let mut run = |k_block, b_pack: &[u32]| {
        with_reused(&K_BLOCK_PACK, |shared| {
            shared.clear();
            prologue(k_block, shared);
            let shared = shared.values();
            run_k_block(
                dst,
                row_stride,
                (a, n),
                k_block,
                b_pack,
                write,
                blocking,
                &|block: RowBlock<'_>, a_pack: &mut Pack| body(block, a_pack, shared),
            );
        });
    };
    match b {
        OperandB::View(view) => with_reused(&B_PACK, |pack| {
            for (k0, kc, stride) in k_blocks(a.cols, blocking) {
                with_values!(view.values, v => pack_b(v, view, (k0, kc), stride, pack));
                run((k0, kc, stride), pack.values());
            }
        }),
        OperandB::Packed(packed) => {
            assert!(
                std::ptr::eq(packed.blocking, blocking) && packed.k == a.cols,
                "bf16 gemm: B packed for another body or K ({} for {})",
                packed.k,
                a.cols
            );
            for (k0, kc, stride, pack) in &packed.blocks {
                run((*k0, *kc, *stride), pack.values());
            }
        }
    }
}

/// `B` of a product as [`drive`] takes it: a view it packs, or packed
/// already.
#[derive(Clone, Copy)]
pub(super) enum OperandB<'a> {
    View(View16<'a>),
    Packed(&'a PackedB),
}

impl OperandB<'_> {
    /// N, the columns of `B` and of the product.
    pub(super) fn cols(self) -> usize {
        match self {
            Self::View(b) => b.cols,
            Self::Packed(b) => b.n,
        }
    }
}

/// `[K, N]` packed once, every K block, for several products that read it
/// (the head's weight, over the cross-entropy's chunks of rows).
pub(crate) struct PackedB {
    /// The body's blocking it was packed for.
    blocking: &'static Blocking,
    pub(super) k: usize,
    pub(super) n: usize,
    /// `(k0, kc, stride, panels)` of each K block, in order.
    blocks: Vec<(usize, usize, usize, Pack)>,
}

impl PackedB {
    /// `b` packed as [`drive`] packs it for `blocking`'s body.
    pub(super) fn new(b: View16<'_>, blocking: &'static Blocking) -> Self {
        let blocks = k_blocks(b.rows, blocking)
            .map(|(k0, kc, stride)| {
                let mut pack = Pack::default();
                with_values!(b.values, v => pack_b(v, b, (k0, kc), stride, &mut pack));
                (k0, kc, stride, pack)
            })
            .collect();
        Self {
            blocking,
            k: b.rows,
            n: b.cols,
            blocks,
        }
    }
}

/// `(k0, kc, stride)` of each K block of a product with inner size `k`.
fn k_blocks(k: usize, blocking: &Blocking) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let blocks = k.div_ceil(blocking.kc);
    let kc_max = k.div_ceil(blocks.max(1)).next_multiple_of(2);
    (0..k).step_by(kc_max.max(1)).map(move |k0| {
        let kc = kc_max.min(k - k0);
        (k0, kc, (blocking.stride)(kc))
    })
}

/// One K block of [`drive`]: every row block of the output against the
/// block's packed `B` (`n` columns).
#[allow(clippy::too_many_arguments)]
fn run_k_block(
    dst: &mut [MaybeUninit<f32>],
    row_stride: usize,
    (a, n): (View16<'_>, usize),
    (k0, kc, stride): (usize, usize, usize),
    b_pack: &[u32],
    write: Write,
    blocking: &Blocking,
    body: &(impl Fn(RowBlock<'_>, &mut Pack) + Sync),
) {
    let (m, k) = (a.rows, a.cols);
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
    let (add, factor) = match write {
        Write::Set if k0 == 0 => (false, 1.0),
        Write::Set => (true, 1.0),
        Write::Add(factor) => (true, factor),
    };
    let run = |(block, rows): (usize, &mut [MaybeUninit<f32>])| {
        let i0 = block * mc_max;
        let block = RowBlock {
            i0,
            mc: mc_max.min(m - i0),
            k0,
            kc,
            stride,
            b_pack,
            rows,
            add,
            factor,
        };
        with_reused(&A_PACK, |a_pack| body(block, a_pack));
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

thread_local! {
    /// Each thread's packing buffers, kept between products: a fresh one
    /// for the head's 56 MiB `B` took its pages from the kernel (faults,
    /// zeroed pages) in every product, 34.6 ms against 14.8 ms reused.
    static B_PACK: Cell<Pack> = Cell::new(Pack::default());
    static A_PACK: Cell<Pack> = Cell::new(Pack::default());
    /// What [`drive_with`]'s prologue packs for a K block's row blocks.
    static K_BLOCK_PACK: Cell<Pack> = Cell::new(Pack::default());
}

/// `f` on this thread's buffer in `slot`, taken out while `f` runs (a
/// product that a rayon thread runs while it waits inside another finds
/// the slot empty and packs into a fresh buffer), then put back unless it
/// grew past [`KEPT_PACK_VALUES`].
fn with_reused<R>(slot: &'static LocalKey<Cell<Pack>>, f: impl FnOnce(&mut Pack) -> R) -> R {
    let mut pack = slot.take();
    let result = f(&mut pack);
    if pack.buf.capacity() <= KEPT_PACK_VALUES {
        slot.set(pack);
    }
    result
}

/// The largest pack a thread keeps (16 MiB): a layer's weights and a K
/// block of activations are a few MiB; a bigger operand (an untied head's
/// weight read through a view) is packed afresh rather than held for the
/// rest of the run.
const KEPT_PACK_VALUES: usize = 4 << 20;

/// `out[p] = line[2p] | line[2p + 1] << 16` as bf16 bits (the last pair's
/// high half zero when `line` is odd): one row's K pairs, vectorised.
#[inline(always)]
pub(super) fn pairs_of<E: Element>(line: &[E], out: &mut [u32]) {
    if cfg!(target_endian = "little") {
        // A pair is its two halves in memory order, low first: rounding
        // each value into its half is an element-wise loop, which
        // vectorises; building pairs from two lanes of `line` did not (it
        // was a scalar loop for f32 values).
        let halves: &mut [u16] = bytemuck::cast_slice_mut(out);
        let (values, past) = halves.split_at_mut(line.len().min(halves.len()));
        for (half, value) in values.iter_mut().zip(line) {
            *half = value.bits() as u16;
        }
        if let Some(high) = past.first_mut().filter(|_| line.len() % 2 == 1) {
            *high = 0;
        }
        return;
    }
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    // Every value is written below, the rows past `mc` as zeros: zeroing
    // the whole pack first wrote each real value twice (a `memset` of
    // every `A` a step).
    let out = out.unset(mc.div_ceil(MR) * pairs * MR);
    if a.col_stride == 1 {
        let (real, pad) = out.split_at_mut(mc * pairs);
        for (r, line) in real.chunks_exact_mut(pairs).enumerate() {
            let from = (i0 + r) * a.row_stride + k0;
            pairs_of(&v[from..from + kc], line);
        }
        pad.fill(0);
        return Layout::Rows;
    }
    zero_panel_pad(out, mc, pairs);
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

/// Zeros in the last panel's rows past `mc` (`[panel][pair][MR]`), which
/// no row of `A` fills.
#[inline(always)]
fn zero_panel_pad(out: &mut [u32], mc: usize, pairs: usize) {
    let filled = mc % MR;
    if filled == 0 {
        return;
    }
    for group in out[mc / MR * pairs * MR..].chunks_exact_mut(MR) {
        group[filled..].fill(0);
    }
}

/// K `k0..k0 + kc` of every column of `b` (whose values are `v`) as panels
/// of `NR` columns: `[panel][pair][NR]` pairs of bf16, `stride` pairs a
/// panel (at least `kc / 2`: the AMX body pads K to whole tiles), zeros
/// past the edges; a `B` with rows along N by [`pack_b_rows`], any other
/// a panel at a time; on rayon's threads, compiled for AVX-512 (every CPU
/// that runs a packed body has it).
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
    let out = out.unset(n.div_ceil(NR) * stride * NR);
    if b.col_stride == 1 {
        pack_b_rows(v, b, (k0, kc), stride, out);
        return;
    }
    let body = |(panel, dst): (usize, &mut [u32])| {
        // K's padding to whole tiles, then the pairs (each value written).
        let (dst, padding) = dst.split_at_mut(pairs * NR);
        padding.fill(0);
        // SAFETY: the packed bodies run only where AVX512F, BW and VL are
        // (`has_avx512_bf16()` or `amx::has_amx_bf16()`).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            if b.col_stride != 1 && b.row_stride == 1 && (panel + 1) * NR <= b.cols {
                pack_b_columns_avx512(v, b, (k0, kc), panel, dst);
            } else {
                pack_b_panel_avx512(v, b, (k0, kc), panel, dst);
            }
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

/// K pairs a task of [`pack_b_rows`] takes: 32 K rows, a panel's 4 KiB.
const ROWS_TASK_PAIRS: usize = 16;

/// [`pack_b`] of a `B` whose rows are contiguous along N (`W` in `dy W`,
/// `x` in `dy^T x`) into `out`, every panel: two K rows at a time, each
/// read once from end to end and cut into every panel's pair row. A panel
/// at a time ([`pack_b_panel`], its oracle) read 64 bytes of each K row,
/// rows a weight's width apart, a stride the prefetcher does not follow
/// across pages: 6.1% of the samples of a `medium` `--bf16` step of
/// eight short examples (4.6% after). Packing `medium`'s `[1408, 512]`
/// and `[512, 1408]` weights from L3 took 0.33-0.57 ms against 0.76-1.21
/// (24 weights in turn, 2 threads); from memory both took 1.4-2.2 ms.
/// Tasks of [`ROWS_TASK_PAIRS`] pairs on rayon's threads, each compiled
/// for AVX-512 (as [`pack_b`]'s panels).
fn pack_b_rows<E: Element>(
    v: &[E],
    b: View16<'_>,
    (k0, kc): (usize, usize),
    stride: usize,
    out: &mut [u32],
) {
    assert!(b.col_stride == 1, "bf16 pack: rows along N");
    let pairs = kc.div_ceil(2);
    // K's padding to whole tiles zeroed here, the pairs by the tasks.
    let panels = out.chunks_exact_mut(stride * NR).map(|panel| {
        let (body, padding) = panel.split_at_mut(pairs * NR);
        padding.fill(0);
        body
    });
    by_tasks(panels, NR, pairs, b.cols * kc >= 1 << 16, |p0, pieces| {
        // SAFETY: as in `pack_b`: the packed bodies run only where AVX512F,
        // BW and VL are.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            rows_into_panels_avx512(v, b, (k0, kc), p0, pieces);
        }
        #[cfg(not(target_arch = "x86_64"))]
        rows_into_panels(v, b, (k0, kc), p0, pieces);
    });
}

/// `run(p0, pieces)` for each task of [`ROWS_TASK_PAIRS`] pairs, from pair
/// `p0`: `pieces` its pairs of every one of `panels` (`width` values a
/// pair), each its own `&mut` slice; on rayon's threads when `parallel`.
fn by_tasks<'a>(
    panels: impl Iterator<Item = &'a mut [u32]>,
    width: usize,
    pairs: usize,
    parallel: bool,
    run: impl Fn(usize, &mut [&'a mut [u32]]) + Sync,
) {
    let mut tasks: Vec<Vec<&mut [u32]>> = (0..pairs.div_ceil(ROWS_TASK_PAIRS))
        .map(|_| Vec::new())
        .collect();
    for panel in panels {
        for (task, piece) in tasks
            .iter_mut()
            .zip(panel.chunks_mut(ROWS_TASK_PAIRS * width))
        {
            task.push(piece);
        }
    }
    let run = |(task, mut pieces): (usize, Vec<&'a mut [u32]>)| {
        run(task * ROWS_TASK_PAIRS, &mut pieces);
    };
    if parallel {
        tasks.into_par_iter().enumerate().for_each(run);
    } else {
        tasks.into_iter().enumerate().for_each(run);
    }
}

/// One task of [`pack_b_rows`]: pairs `p0..` (as many as `pieces[0]`
/// holds) of every panel, `pieces[panel]` the panel's pair rows from `p0`.
#[inline(always)]
fn rows_into_panels<E: Element>(
    v: &[E],
    b: View16<'_>,
    (k0, kc): (usize, usize),
    p0: usize,
    pieces: &mut [&mut [u32]],
) {
    let n = b.cols;
    let task_pairs = pieces.first().map_or(0, |piece| piece.len() / NR);
    for q in 0..task_pairs {
        let p = p0 + q;
        let from = (k0 + 2 * p) * b.row_stride;
        let lo = &v[from..from + n];
        let hi = (2 * p + 1 < kc).then(|| &v[from + b.row_stride..from + b.row_stride + n]);
        for (panel, piece) in pieces.iter_mut().enumerate() {
            let (first, cols) = (panel * NR, NR.min(n - panel * NR));
            let group = &mut piece[q * NR..(q + 1) * NR];
            interleave(
                &lo[first..first + cols],
                hi.map(|hi| &hi[first..first + cols]),
                &mut group[..cols],
            );
            // Only the last panel has padding: an unguarded `fill` called
            // `memset` with nothing to set every 64 values packed (1% of a
            // `medium` `--bf16` step of eight short examples; `medium`'s
            // weights packed 1.3-1.6x faster without it, one thread, from
            // cache). The lengths stay run-time values: with the constant
            // `NR` the loop above was unrolled into scalar code, twice as
            // slow.
            if cols < NR {
                group[cols..].fill(0);
            }
        }
    }
}

/// [`rows_into_panels`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX512F, BW and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn rows_into_panels_avx512<E: Element>(
    v: &[E],
    b: View16<'_>,
    k: (usize, usize),
    p0: usize,
    pieces: &mut [&mut [u32]],
) {
    rows_into_panels(v, b, k, p0, pieces);
}

/// K `k0..k0 + kc` of every row of an `A` whose columns are contiguous
/// along M (`dy^T`, K the tokens) as [`pack_a`] packs a row block in
/// [`Layout::Panels`], all row blocks' panels one after another (zeros in
/// the last panel's rows past M): two K lines at a time, each read once
/// from end to end, turned into pairs across the whole line and cut into
/// every panel. A row block at a time ([`pack_a`], its oracle), each pair
/// read a block's width of two lines a token's width apart and was turned
/// `MR` values at a time (4-wide and scalar code): 19.6% of the samples of
/// `medium`'s `gate_proj` weight gradient at 1,500 tokens. Tasks of
/// [`ROWS_TASK_PAIRS`] pairs on rayon's threads, compiled for AVX-512.
fn pack_a_lines<E: Element>(v: &[E], a: View16<'_>, (k0, kc): (usize, usize), out: &mut Pack) {
    assert!(
        a.row_stride == 1 && a.col_stride != 1,
        "bf16 pack: columns along M"
    );
    let (m, pairs) = (a.rows, kc.div_ceil(2));
    let out = out.unset(m.div_ceil(MR) * pairs * MR);
    let panels = out.chunks_exact_mut(pairs * MR);
    by_tasks(panels, MR, pairs, m * kc >= 1 << 16, |p0, pieces| {
        // SAFETY: the packed bodies run only where AVX512F, BW and VL are.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            lines_into_panels_avx512(v, a, (k0, kc), p0, pieces);
        }
        #[cfg(not(target_arch = "x86_64"))]
        lines_into_panels(v, a, (k0, kc), p0, pieces);
    });
}

/// One task of [`pack_a_lines`]: pairs `p0..` (as many as `pieces[0]`
/// holds) of every panel, `pieces[panel]` the panel's pairs from `p0`.
#[inline(always)]
fn lines_into_panels<E: Element>(
    v: &[E],
    a: View16<'_>,
    (k0, kc): (usize, usize),
    p0: usize,
    pieces: &mut [&mut [u32]],
) {
    let m = a.rows;
    let task_pairs = pieces.first().map_or(0, |piece| piece.len() / MR);
    // One pair row of every panel; the rows past M stay zero.
    let mut line = vec![0u32; m.next_multiple_of(MR)];
    for q in 0..task_pairs {
        let p = p0 + q;
        let from = (k0 + 2 * p) * a.col_stride;
        let lo = &v[from..from + m];
        let hi = (2 * p + 1 < kc).then(|| &v[from + a.col_stride..from + a.col_stride + m]);
        interleave(lo, hi, &mut line[..m]);
        for (piece, rows) in pieces.iter_mut().zip(line.chunks_exact(MR)) {
            piece[q * MR..(q + 1) * MR].copy_from_slice(rows);
        }
    }
}

/// [`lines_into_panels`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX512F, BW and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn lines_into_panels_avx512<E: Element>(
    v: &[E],
    a: View16<'_>,
    k: (usize, usize),
    p0: usize,
    pieces: &mut [&mut [u32]],
) {
    lines_into_panels(v, a, k, p0, pieces);
}

/// Panel `panel` of [`pack_b`] into `dst` (for a `B` with rows along N,
/// the oracle of [`pack_b_rows`]).
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
    if cols < NR {
        // The last panel's columns past N are zeros.
        for group in dst.chunks_exact_mut(NR) {
            group[cols..].fill(0);
        }
    }
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

/// [`pack_b_panel`] of a whole panel of a `B` whose columns are
/// contiguous along K (`W^T`: every forward product reads its weight so),
/// 16 columns' 16 pairs at a time turned in registers. The portable path
/// wrote each pair to its own place 128 bytes after the last: 4.7x the
/// time of packing `W` itself (10.8 ms against 2.3 ms for SmolLM2's head).
/// [`pack_b_panel`] is its oracle (tested).
///
/// # Safety
/// The CPU has AVX512F, BW and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_b_columns_avx512<E: Element>(
    v: &[E],
    b: View16<'_>,
    (k0, kc): (usize, usize),
    panel: usize,
    dst: &mut [u32],
) {
    use std::arch::x86_64::{
        __m512i, _mm512_loadu_si512, _mm512_setzero_si512, _mm512_shuffle_i32x4,
        _mm512_storeu_si512, _mm512_unpackhi_epi32, _mm512_unpackhi_epi64, _mm512_unpacklo_epi32,
        _mm512_unpacklo_epi64,
    };
    let pairs = kc.div_ceil(2);
    let first = panel * NR;
    assert!(
        b.row_stride == 1 && first + NR <= b.cols && dst.len() == pairs * NR,
        "bf16 pack: a whole panel of columns along K"
    );
    // Pairs in whole blocks of 16 (every pair of both values); the rest as
    // the portable path packs them.
    let whole = kc / 2 / 16 * 16;
    let mut block = [[0u32; 16]; 16];
    for c0 in [0, 16] {
        for p0 in (0..whole).step_by(16) {
            for (i, row) in block.iter_mut().enumerate() {
                let from = (first + c0 + i) * b.col_stride + k0 + 2 * p0;
                pairs_of(&v[from..from + 32], row);
            }
            let mut r = [_mm512_setzero_si512(); 16];
            for (r, row) in r.iter_mut().zip(&block) {
                // SAFETY: `row` holds 16 values, 64 bytes.
                *r = unsafe { _mm512_loadu_si512(row.as_ptr().cast::<__m512i>()) };
            }
            // Column `j` of rows 4m..4m+4 into lane `j / 4` of `u[4m + j % 4]`.
            let mut t = [_mm512_setzero_si512(); 16];
            for k in 0..8 {
                t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
                t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
            }
            let mut u = [_mm512_setzero_si512(); 16];
            for m in 0..4 {
                u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
                u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
                u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
                u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
            }
            // Output row `q` (column `q` of the block) gathers lane `q / 4`
            // of `u[q % 4]`, `u[4 + q % 4]`, `u[8 + q % 4]`, `u[12 + q % 4]`.
            for c in 0..4 {
                let x = _mm512_shuffle_i32x4::<0x44>(u[c], u[4 + c]);
                let y = _mm512_shuffle_i32x4::<0xee>(u[c], u[4 + c]);
                let z = _mm512_shuffle_i32x4::<0x44>(u[8 + c], u[12 + c]);
                let w = _mm512_shuffle_i32x4::<0xee>(u[8 + c], u[12 + c]);
                let rows = [
                    _mm512_shuffle_i32x4::<0x88>(x, z),
                    _mm512_shuffle_i32x4::<0xdd>(x, z),
                    _mm512_shuffle_i32x4::<0x88>(y, w),
                    _mm512_shuffle_i32x4::<0xdd>(y, w),
                ];
                for (lane, row) in rows.into_iter().enumerate() {
                    let at = (p0 + 4 * lane + c) * NR + c0;
                    let out = &mut dst[at..at + 16];
                    // SAFETY: `out` holds 16 values, 64 bytes.
                    unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast::<__m512i>(), row) };
                }
            }
        }
    }
    if whole < pairs {
        // At most 16 pairs are left (16 when K ends in a lone value).
        let mut line = [0u32; 16];
        let line = &mut line[..pairs - whole];
        for c in 0..NR {
            let from = (first + c) * b.col_stride + k0 + 2 * whole;
            pairs_of(&v[from..from + kc - 2 * whole], line);
            scatter::<NR>(line, &mut dst[whole * NR..], c);
        }
    }
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
    (rows, row_stride, add, factor): (&mut [MaybeUninit<f32>], usize, bool, f32),
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
                micro_tile::<ROWS>(a_panel, b_panel, as_uninit(&mut tile), NR, false, 1.0);
                for r in 0..mr {
                    let out = &mut rows[start + r * row_stride..start + r * row_stride + nc];
                    for (o, &v) in out.iter_mut().zip(&tile[r * NR..r * NR + nc]) {
                        let sum = if add {
                            // SAFETY: `add` only where the output holds values
                            // (`RowBlock::rows`).
                            unsafe { o.assume_init() + factor * v }
                        } else {
                            v
                        };
                        o.write(sum);
                    }
                }
            }
        }
    }
}

/// `values` as output a body writes to: it writes only f32 values there.
pub(super) fn as_uninit(values: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; the slice stays
    // initialised, as the bodies write only initialised values into it.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len()) }
}

/// A fresh row-major `[m, n]` product: `run` sets every value of
/// `out`'s spare room (its first K block writes each before any is read),
/// never zeroed first: zeroing fresh outputs was ~700 MB a SmolLM2 step of
/// short examples, 5-12% of its time. `out`'s values are dropped first
/// (tests hand in a buffer of NaNs, so that a value left unwritten shows).
pub(super) fn fresh(
    out: Vec<f32>,
    m: usize,
    n: usize,
    run: impl FnOnce(&mut [MaybeUninit<f32>]),
) -> Vec<f32> {
    // SAFETY: `run` writes all `m * n` values (a product set with
    // `Write::Set` writes every value of its `[m, n]` rows, `n` apart, in
    // its first K block: `RowBlock::rows`).
    unsafe { crate::kernels::fresh::fresh_in(out, m * n, run) }
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
    dst: &mut [MaybeUninit<f32>],
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
                dst.as_mut_ptr().cast::<f32>(),
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
/// layout) and `b` `pairs * NR` values; `c` is valid for writes of `MR`
/// rows of `NR` values `ldc` apart, and holds values there when `add`.
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
    use super::{MR, NR, Pack, pack_a, pack_b};
    use crate::kernels::gemm_bf16::View16;
    use crate::kernels::gemm_bf16::operand::{Values, test_layouts};
    use half::bf16;

    /// Whether this CPU runs the packing (AVX-512), with a NOTE where not.
    fn packing_runs_here() -> bool {
        let runs = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl");
        if !runs {
            eprintln!(
                "NOTE: no AVX-512 on this CPU: the packed bodies and their packing do not run here"
            );
        }
        runs
    }

    /// The pack of a `W^T` (columns along K) turned in registers equals
    /// the portable pack, panel by panel: K blocks that are whole blocks of
    /// 16 pairs, odd, shorter than one block, offset; N with a last panel
    /// short (packed the portable way); bf16 and f32 values (rounded).
    #[test]
    fn columns_along_k_pack_as_the_portable_path_does() {
        if !packing_runs_here() {
            return;
        }
        let (k, n) = (200, 70);
        let w32: Vec<f32> = (0..k * n)
            .map(|i| ((i * 37) % 1001) as f32 * 0.37 - 150.0)
            .collect();
        let w16: Vec<bf16> = w32.iter().map(|&x| bf16::from_f32(x)).collect();
        for (k0, kc) in [
            (0usize, 200usize),
            (0, 64),
            (3, 97),
            (10, 31),
            (0, 1),
            (40, 160),
        ] {
            let pairs = kc.div_ceil(2);
            let stride = pairs.next_multiple_of(16);
            let check = |fast: &[u32], portable: &dyn Fn(usize, &mut [u32])| {
                for (panel, got) in fast.chunks(stride * NR).enumerate() {
                    let mut want = vec![0u32; stride * NR];
                    portable(panel, &mut want[..pairs * NR]);
                    assert_eq!(got, &want[..], "K {k0}+{kc}, panel {panel}");
                }
            };
            let mut pack = Pack::default();
            let b = View16::bf16(&w16, n, k).t();
            pack_b(&w16, b, (k0, kc), stride, &mut pack);
            check(pack.values(), &|panel, dst| {
                super::pack_b_panel(&w16, b, (k0, kc), panel, dst)
            });
            let b = View16::f32(&w32, n, k).t();
            pack_b(&w32, b, (k0, kc), stride, &mut pack);
            check(pack.values(), &|panel, dst| {
                super::pack_b_panel(&w32, b, (k0, kc), panel, dst)
            });
        }
    }

    /// The pack of a `B` whose rows lie along N (`W` in `dy W`), two K
    /// rows at a time across every panel, equals the portable pack panel
    /// by panel, K's padding zero: K blocks odd, offset, shorter than a
    /// task or several tasks long; N a whole number of panels or with a
    /// short last one; bf16 and f32 values (rounded); large enough to run
    /// on rayon's threads and not.
    #[test]
    fn rows_along_n_pack_as_the_portable_path_does() {
        if !packing_runs_here() {
            return;
        }
        for (k, n) in [(150usize, 70usize), (600, 128), (64, 1)] {
            let w32: Vec<f32> = (0..k * n)
                .map(|i| ((i * 53) % 997) as f32 * 0.41 - 170.0)
                .collect();
            let w16: Vec<bf16> = w32.iter().map(|&x| bf16::from_f32(x)).collect();
            for (k0, kc) in [(0, k), (3, 97.min(k - 3)), (1, 31), (0, 1), (k - 40, 40)] {
                let pairs = kc.div_ceil(2);
                for stride in [pairs, pairs.next_multiple_of(16)] {
                    let check = |fast: &[u32], portable: &dyn Fn(usize, &mut [u32])| {
                        assert_eq!(fast.len(), n.div_ceil(NR) * stride * NR);
                        for (panel, got) in fast.chunks(stride * NR).enumerate() {
                            let mut want = vec![0u32; stride * NR];
                            portable(panel, &mut want[..pairs * NR]);
                            assert_eq!(got, &want[..], "[{k}, {n}] K {k0}+{kc}, panel {panel}");
                        }
                    };
                    let mut pack = Pack::default();
                    pack.unset(n.div_ceil(NR) * stride * NR).fill(0xdead_beef);
                    let b = View16::bf16(&w16, k, n);
                    pack_b(&w16, b, (k0, kc), stride, &mut pack);
                    check(pack.values(), &|panel, dst| {
                        super::pack_b_panel(&w16, b, (k0, kc), panel, dst)
                    });
                    let b = View16::f32(&w32, k, n);
                    pack_b(&w32, b, (k0, kc), stride, &mut pack);
                    check(pack.values(), &|panel, dst| {
                        super::pack_b_panel(&w32, b, (k0, kc), panel, dst)
                    });
                }
            }
        }
    }

    /// The pack of every row of an `A` with columns along M (`dy^T`) at
    /// once is the row blocks' packs ([`super::pack_a`], the oracle) one
    /// after another: M a multiple of `MR` or not, odd, offset and
    /// multi-task K blocks, bf16 and f32 values, a buffer full of garbage
    /// first (the rows past M must come out zero).
    #[test]
    fn lines_of_a_pack_as_its_row_blocks_do() {
        if !packing_runs_here() {
            return;
        }
        use super::{Layout, pack_a_lines};
        for (m, k) in [(150usize, 600usize), (MR * 5, 70), (MR + 1, 33), (400, 1)] {
            // `dy` is `[K, M]`; `A = dy^T`.
            let d32: Vec<f32> = (0..k * m)
                .map(|i| ((i * 61) % 991) as f32 * 0.37 - 150.0)
                .collect();
            let d16: Vec<bf16> = d32.iter().map(|&x| bf16::from_f32(x)).collect();
            let blocks = [
                (0, k.min(512)),
                (3, 97.min(k.saturating_sub(3))),
                (1, 31),
                (0, 1),
                (k.saturating_sub(40), 40),
            ];
            for (k0, kc) in blocks {
                if k0 + kc > k || kc == 0 {
                    continue;
                }
                let pairs = kc.div_ceil(2);
                let check = |got: &[u32], oracle: &dyn Fn(usize, usize, &mut Pack) -> Layout| {
                    assert_eq!(got.len(), m.div_ceil(MR) * pairs * MR);
                    // Row blocks of two panels, the last short.
                    for i0 in (0..m).step_by(2 * MR) {
                        let mc = (2 * MR).min(m - i0);
                        let mut want = Pack::default();
                        let layout = oracle(i0, mc, &mut want);
                        assert!(matches!(layout, Layout::Panels));
                        let from = i0 / MR * pairs * MR;
                        assert_eq!(
                            &got[from..from + want.values().len()],
                            want.values(),
                            "[{m}] K {k0}+{kc}, rows {i0}+{mc}"
                        );
                    }
                };
                let mut pack = Pack::default();
                pack.unset(m.div_ceil(MR) * pairs * MR).fill(0xdead_beef);
                let a = View16::bf16(&d16, k, m).t();
                pack_a_lines(&d16, a, (k0, kc), &mut pack);
                check(pack.values(), &|i0, mc, out| {
                    pack_a(&d16, a, i0, mc, k0, kc, out)
                });
                pack.unset(m.div_ceil(MR) * pairs * MR).fill(0xdead_beef);
                let a = View16::f32(&d32, k, m).t();
                pack_a_lines(&d32, a, (k0, kc), &mut pack);
                check(pack.values(), &|i0, mc, out| {
                    pack_a(&d32, a, i0, mc, k0, kc, out)
                });
            }
        }
    }

    /// `B`'s pack writes every value it hands out, K's padding and the
    /// columns past N included, so a reused buffer's stale values never
    /// reach a product: the same pack from a fresh buffer and from one
    /// full of another shape's values and of garbage, for `W` (rows along
    /// N), `W^T` (columns along K) and a view strided both ways, odd K and
    /// N, K padded to whole tiles or not.
    #[test]
    fn b_packs_do_not_depend_on_what_the_buffer_held() {
        if !packing_runs_here() {
            return;
        }
        let (k, n) = (77, 45);
        let w: Vec<bf16> = (0..2 * k * n)
            .map(|i| bf16::from_f32(i as f32 * 0.5 - 300.0))
            .collect();
        for (name, b) in test_layouts(Values::Bf16(&w), k, n) {
            for (k0, kc) in [(0, k), (4, 33), (10, 6)] {
                for stride in [kc.div_ceil(2), kc.div_ceil(2).next_multiple_of(16)] {
                    let mut fresh = Pack::default();
                    pack_b(&w, b, (k0, kc), stride, &mut fresh);
                    let mut stale = Pack::default();
                    pack_b(
                        &w,
                        View16::bf16(&w, 2 * k, n),
                        (0, 2 * k),
                        2 * k,
                        &mut stale,
                    );
                    stale
                        .unset(n.div_ceil(NR) * stride * NR + 99)
                        .fill(0xdead_beef);
                    pack_b(&w, b, (k0, kc), stride, &mut stale);
                    assert_eq!(
                        fresh.values(),
                        stale.values(),
                        "{name} K {k0}+{kc}, {stride} pairs a panel"
                    );
                    assert_eq!(fresh.values().len(), n.div_ceil(NR) * stride * NR);
                }
            }
        }
    }

    /// `A`'s pack writes every value it hands out, the rows past the
    /// block's last (to whole micro-tiles) and K's odd half included: the
    /// same pack and layout from a fresh buffer and from one full of
    /// garbage, for `x` (rows along K), `dy^T` (lines along M) and a view
    /// strided both ways, blocks of whole micro-tiles and not, odd K.
    #[test]
    fn a_packs_do_not_depend_on_what_the_buffer_held() {
        let (m, k) = (45, 77);
        let w: Vec<bf16> = (0..2 * m * k)
            .map(|i| bf16::from_f32(i as f32 * 0.25 - 500.0))
            .collect();
        for (name, a) in test_layouts(Values::Bf16(&w), m, k) {
            for (i0, mc) in [(0, m), (3, 2 * MR), (30, 15), (44, 1)] {
                for (k0, kc) in [(0, k), (4, 33), (10, 6)] {
                    let mut fresh = Pack::default();
                    let layout = pack_a(&w, a, i0, mc, k0, kc, &mut fresh);
                    let mut stale = Pack::default();
                    stale.unset(2 * m * k).fill(0xdead_beef);
                    let again = pack_a(&w, a, i0, mc, k0, kc, &mut stale);
                    let what = format!("{name}, rows {i0}+{mc}, K {k0}+{kc}");
                    assert_eq!(layout, again, "{what}");
                    assert_eq!(fresh.values(), stale.values(), "{what}");
                    assert_eq!(fresh.values().len(), mc.div_ceil(MR) * kc.div_ceil(2) * MR);
                    // The rows past `mc` hold zeros: the micro-tile adds
                    // their products into rows it never stores.
                    let filled = mc % MR;
                    if filled > 0 {
                        let pairs = kc.div_ceil(2);
                        let last = &fresh.values()[mc / MR * pairs * MR..];
                        let pad: Vec<u32> = match layout {
                            super::Layout::Rows => last[filled * pairs..].to_vec(),
                            super::Layout::Panels => last
                                .chunks_exact(MR)
                                .flat_map(|g| g[filled..].to_vec())
                                .collect(),
                        };
                        assert!(pad.iter().all(|&v| v == 0), "{what}: padding");
                    }
                }
            }
        }
    }

    /// A pack's values start on a cache line and are as many as asked,
    /// also when the buffer is reused for another size (tile loads off a
    /// line cost six times as much; `malloc` aligns to 16 bytes).
    #[test]
    fn a_pack_hands_out_values_on_a_cache_line() {
        let mut pack = Pack::default();
        for len in [1, 15, 16, 1000, 4096, 3, 70_000] {
            let values = pack.unset(len);
            assert_eq!(values.len(), len);
            assert_eq!(values.as_ptr() as usize % 64, 0, "{len} values");
            values.fill(7);
            assert_eq!(pack.values().len(), len);
            assert!(pack.values().iter().all(|&v| v == 7));
        }
    }
}
