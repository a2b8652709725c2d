//! The AMX-BF16 body of the bf16 products (Intel Sapphire Rapids and
//! later): both operands packed into bf16 pairs (`B` in the `vdpbf16ps`
//! body's `[panel][pair][32]` panels, `packed.rs`; `A` tile by tile, each
//! 1 KiB in one piece), both on cache lines ([`Pack`]), K padded with
//! zeros to whole tiles, and a 32x32 micro-kernel of four `tdpbf16ps` on
//! 16x16 f32 tiles. AMX's intrinsics and its
//! `is_x86_feature_detected!` name are unstable in Rust 1.95, so the tile
//! instructions are `asm!` and the CPU is asked through CPUID and the
//! kernel's `arch_prctl` permission. Run only where [`has_amx_bf16`] holds
//! (`gemm_bf16::product_into_with` asserts it).
//!
//! The module is compiled on x86-64 only (`gemm_bf16/mod.rs`).
//!
//! An output value sums its K products in tile order (the hardware's
//! order within a tile, K blocks in turn) onto what the output held
//! (unless the sum is scaled), whatever the thread count and wherever its
//! row and column lie.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::operand::{Element, Values, View16, with_values};
use super::packed::{Blocking, NR, OperandB, Pack, drive, interleave, pairs_of};
use crate::kernels::gemm::Write;

/// Rows of a micro-tile: two `A` tiles of 16 rows (tiles 4 and 5).
const MR: usize = 32;
/// K pairs in a tile's row: 64 bytes, 32 bf16 values.
const TILE_PAIRS: usize = 16;
/// The largest K block: a thread's `A` block (128 x 1024 bf16, 256 KiB)
/// and a `B` panel (64 KiB) stay in L2 (2 MiB a core on Sapphire Rapids);
/// fewer K blocks write the output fewer times.
const KC: usize = 1024;
/// Output rows a thread takes at a time.
const MC: usize = MR * 4;

/// Whether this CPU and kernel run AMX-BF16 for this process: CPUID's
/// AMX-TILE and AMX-BF16 bits, AVX-512 for the packing, and Linux's
/// permission for the tile data (`ARCH_REQ_XCOMP_PERM`), asked once.
pub(super) fn has_amx_bf16() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(detect)
}

#[cfg(target_os = "linux")]
fn detect() -> bool {
    // SAFETY: CPUID leaves 0 and 7 exist on every x86-64 CPU (leaf 7 is
    // read only where leaf 0 says it is there); the intrinsics are
    // `unsafe fn`s in some Rust versions only.
    #[allow(unused_unsafe)]
    let (max_leaf, leaf7) = unsafe {
        (
            std::arch::x86_64::__cpuid(0).eax,
            std::arch::x86_64::__cpuid_count(7, 0),
        )
    };
    let (amx_bf16, amx_tile) = (1 << 22, 1 << 24);
    let amx = max_leaf >= 7 && leaf7.edx & amx_bf16 != 0 && leaf7.edx & amx_tile != 0;
    amx && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && tile_data_permitted()
}

#[cfg(not(target_os = "linux"))]
fn detect() -> bool {
    false
}

/// Asks Linux for the tile data state (XTILEDATA, 8 KiB a thread): it is
/// off until a process asks, and a tile instruction without it faults.
/// False on kernels before 5.16 and where a hypervisor hides it.
#[cfg(target_os = "linux")]
fn tile_data_permitted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: this `arch_prctl` only asks for a permission for the
    // process; it reads and writes none of our memory.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// The AMX body: pack, then 32x32 micro-tiles of `tdpbf16ps`.
pub(super) fn amx(
    dst: &mut [MaybeUninit<f32>],
    row_stride: usize,
    a: View16<'_>,
    b: OperandB<'_>,
    write: Write,
) {
    let n = b.cols();
    drive(
        dst,
        row_stride,
        (a, b),
        write,
        &BLOCKING,
        |block, a_pack| {
            let (i0, mc, stride) = (block.i0, block.mc, block.stride);
            // SAFETY: `amx` runs only where `has_amx_bf16()` holds, which
            // includes AVX512F, BW and VL.
            with_values!(a.values, v => unsafe {
                pack_a_avx512(v, a, (i0, mc), (block.k0, block.kc), stride, a_pack)
            });
            let out = (block.rows, row_stride, block.add, block.factor);
            // SAFETY: as above.
            unsafe { tiles_avx512(a_pack.values(), block.b_pack, mc, n, stride, out) };
        },
    );
}

/// How this body blocks its products: pairs a packed row holds are whole
/// tiles, zeros past K.
pub(super) static BLOCKING: Blocking = Blocking {
    kc: KC,
    mr: MR,
    mc: MC,
    stride: |kc| kc.div_ceil(2).next_multiple_of(TILE_PAIRS),
};

/// Pairs one K step of a micro-tile's `A` takes: its two tiles, 32 rows
/// of 16 pairs, one after the other (2 KiB).
const STEP: usize = MR * TILE_PAIRS;
/// Bytes a K step reads of `A` (both tiles) and of `B` (16 pair rows of
/// `NR` columns, both tiles); equal, so one prefetch distance serves both.
const A_STEP_BYTES: usize = STEP * 4;
const B_STEP_BYTES: usize = TILE_PAIRS * NR * 4;
const _: () = assert!(A_STEP_BYTES == B_STEP_BYTES);
/// How many K steps ahead the micro-kernel prefetches.
const PREFETCH_STEPS: usize = 2;

/// Where row `r` (of a row block), pair `p` lies in a packed `A`:
/// `[panel][step][row][16 pairs]`, so that a tile is 1 KiB in one piece
/// (rows 64 bytes apart) and a panel's K steps follow each other. Rows of
/// `stride` pairs one after the other put a wide K block's rows 2 KiB
/// apart: a tile's 16 rows then fell in two of L1's 64 sets and were
/// 16 streams to the prefetcher.
#[inline(always)]
fn a_at(r: usize, p: usize, stride: usize) -> usize {
    (r / MR) * MR * stride + (p / TILE_PAIRS) * STEP + (r % MR) * TILE_PAIRS + p % TILE_PAIRS
}

/// Rows `i0..i0 + mc`, K `k0..k0 + kc` of `a` (whose values are `v`) as
/// pairs of bf16 (even K in the low half) laid out as [`a_at`] says, the
/// tiles an `A` tile loads; zeros past the edges, rows to a whole
/// micro-tile.
///
/// The buffer is not zeroed first: every value is written, the padding
/// past K and past `mc` rows as zeros (`B`'s K padding is zero, and a
/// stale NaN times zero would be NaN). Zeroing it was 1.2 GB of `memset`
/// a SmolLM2-135M step of eight maths examples (traced).
#[inline(always)]
fn pack_a<E: Element>(
    v: &[E],
    a: View16<'_>,
    (i0, mc): (usize, usize),
    (k0, kc): (usize, usize),
    stride: usize,
    out: &mut Pack,
) {
    let pairs = kc.div_ceil(2);
    let padded = mc.next_multiple_of(MR);
    let out = out.unset(padded * stride);
    for r in 0..padded {
        let past_k = if r < mc { pairs } else { 0 };
        for p in past_k..stride {
            out[a_at(r, p, stride)] = 0;
        }
    }
    if a.col_stride == 1 {
        // A row's pairs in one vectorised pass, then cut into its steps
        // (the tail past K stays zero, written again).
        let mut line = vec![0u32; stride];
        for r in 0..mc {
            let from = (i0 + r) * a.row_stride + k0;
            pairs_of(&v[from..from + kc], &mut line[..pairs]);
            for (s, chunk) in line.as_chunks::<TILE_PAIRS>().0.iter().enumerate() {
                let to = a_at(r, s * TILE_PAIRS, stride);
                // (Arrays, so that the 64-byte copy is inlined, not a call.)
                out[to..to + TILE_PAIRS].as_chunks_mut::<TILE_PAIRS>().0[0] = *chunk;
            }
        }
    } else if a.row_stride == 1 {
        // Columns contiguous along M (`dy^T`, K the tokens): two K lines
        // at a time, read once, each row's pair into its place (the block's
        // rows of one step lie within a few KiB, in L1 for 16 pairs).
        let mut pair = vec![0u32; mc];
        for p in 0..pairs {
            let from = (k0 + 2 * p) * a.col_stride + i0;
            let lo = &v[from..from + mc];
            let hi = (2 * p + 1 < kc).then(|| &v[from + a.col_stride..from + a.col_stride + mc]);
            interleave(lo, hi, &mut pair);
            for (r, &value) in pair.iter().enumerate() {
                out[a_at(r, p, stride)] = value;
            }
        }
    } else {
        for r in 0..mc {
            for p in 0..pairs {
                let at = |k: usize| (i0 + r) * a.row_stride + k * a.col_stride;
                let k = k0 + 2 * p;
                let hi = if k + 1 < k0 + kc {
                    v[at(k + 1)].bits()
                } else {
                    0
                };
                out[a_at(r, p, stride)] = v[at(k)].bits() | (hi << 16);
            }
        }
    }
}

/// [`pack_a`] compiled for AVX-512 (the loops vectorise 16 wide).
///
/// # Safety
/// The CPU has AVX512F, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a_avx512<E: Element>(
    v: &[E],
    a: View16<'_>,
    rows: (usize, usize),
    k: (usize, usize),
    stride: usize,
    out: &mut Pack,
) {
    pack_a(v, a, rows, k, stride, out);
}

/// Every micro-tile of one row block: `rows` holds the block's output rows
/// (`row_stride` apart; the last may be short), `a_pack` the block's
/// panels ([`a_at`]), `b_pack` every panel's `[stride][NR]`. The tiles are
/// configured on this thread for the block and released after it.
///
/// Where the output is set, or added to unscaled (a later K block, or
/// gradients accumulated), the C tiles start from the output itself and
/// are stored back into it: a whole micro-tile is loaded and stored in
/// place, an edge one through a 32x32 copy. Every value therefore sums
/// its products onto what the output held, in one order wherever its row
/// and column lie (padded and flattened batches place rows differently).
/// A scaled sum (`factor` other than 1) is summed from zero and added
/// times `factor`, also the same for every tile.
#[inline(always)]
fn tiles(
    a_pack: &[u32],
    b_pack: &[u32],
    mc: usize,
    n: usize,
    stride: usize,
    (rows, row_stride, add, factor): (&mut [MaybeUninit<f32>], usize, bool, f32),
) {
    assert!(
        stride > 0
            && stride.is_multiple_of(TILE_PAIRS)
            && a_pack.len() == mc.next_multiple_of(MR) * stride
            && b_pack.len() == n.div_ceil(NR) * stride * NR,
        "bf16 AMX tiles: packs of {} and {} values for [{mc}, {n}], {stride} pairs",
        a_pack.len(),
        b_pack.len()
    );
    let in_place = !add || factor == 1.0;
    // Tile loads and stores that straddle cache lines cost several times
    // more: C goes through a tile-sized copy on a line unless the
    // output's rows lie on lines.
    let base = rows.as_ptr() as usize;
    let lined = |at: usize| (base + 4 * at).is_multiple_of(64) && row_stride.is_multiple_of(16);
    let mut tile = Lined([0.0f32; MR * NR]);
    let tile = &mut tile.0;
    let _tiles = Tiles::configure();
    for panel_j in 0..n.div_ceil(NR) {
        let b_panel = &b_pack[panel_j * stride * NR..(panel_j + 1) * stride * NR];
        let (col0, nc) = (panel_j * NR, NR.min(n - panel_j * NR));
        for panel_i in 0..mc.div_ceil(MR) {
            let a_panel = &a_pack[panel_i * MR * stride..(panel_i + 1) * MR * stride];
            let (row0, mr) = (panel_i * MR, MR.min(mc - panel_i * MR));
            let first = row0 * row_stride + col0;
            if in_place && mr == MR && nc == NR && lined(first) {
                let last = first + (MR - 1) * row_stride + NR;
                assert!(
                    last <= rows.len(),
                    "bf16 AMX tiles: output rows end at {}",
                    rows.len()
                );
                // SAFETY: the tiles are configured (`_tiles`); `a_panel`
                // holds `MR * stride` pairs, `b_panel` `stride * NR` (both
                // checked above); the output's 32 rows of 32 from `first`,
                // `row_stride` apart, lie within `rows` (just asserted);
                // `stride` is a positive multiple of `TILE_PAIRS`.
                unsafe {
                    micro(
                        a_panel.as_ptr(),
                        b_panel.as_ptr(),
                        stride,
                        (
                            rows[first..last].as_mut_ptr().cast::<f32>(),
                            row_stride,
                            add,
                        ),
                    );
                }
                continue;
            }
            let out_rows = || (0..mr).map(|r| (row0 + r) * row_stride + col0);
            if in_place && add {
                for (r, start) in out_rows().enumerate() {
                    for (t, o) in tile[r * NR..r * NR + nc]
                        .iter_mut()
                        .zip(&rows[start..start + nc])
                    {
                        // SAFETY: `add` only where the output holds values
                        // (`RowBlock::rows`).
                        *t = unsafe { o.assume_init() };
                    }
                }
            }
            // SAFETY: as above, with `tile`'s `MR` rows of `NR`.
            unsafe {
                micro(
                    a_panel.as_ptr(),
                    b_panel.as_ptr(),
                    stride,
                    (tile.as_mut_ptr(), NR, in_place && add),
                );
            }
            for (r, start) in out_rows().enumerate() {
                let out = &mut rows[start..start + nc];
                let tile = &tile[r * NR..r * NR + nc];
                if in_place {
                    for (o, &v) in out.iter_mut().zip(tile) {
                        o.write(v);
                    }
                } else {
                    for (o, &v) in out.iter_mut().zip(tile) {
                        // SAFETY: a scaled sum adds (`add`): the output holds values.
                        o.write(unsafe { o.assume_init() } + factor * v);
                    }
                }
            }
        }
    }
}

/// [`tiles`] compiled for AVX-512 (the copies of edge tiles and the
/// scaled sums vectorise 16 wide).
///
/// # Safety
/// The CPU has AMX-BF16 and AVX512F, BW and VL ([`has_amx_bf16`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn tiles_avx512(
    a_pack: &[u32],
    b_pack: &[u32],
    mc: usize,
    n: usize,
    stride: usize,
    out: (&mut [MaybeUninit<f32>], usize, bool, f32),
) {
    tiles(a_pack, b_pack, mc, n, stride, out);
}

/// A micro-tile's values on a cache line.
#[repr(C, align(64))]
struct Lined([f32; MR * NR]);

/// This thread's tile configuration, released when dropped (a thread that
/// holds tile state makes every context switch save 8 KiB more).
struct Tiles;

/// `LDTILECFG`'s 64 bytes: palette 1, each tile's rows and bytes a row.
/// (Its fields are read by the CPU, never by Rust.)
#[allow(dead_code)]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl Tiles {
    /// Tiles 0-7 as 16 rows of 64 bytes: C in 0-3 (16x16 f32), `A` in 4-5
    /// (16 rows of 16 pairs), `B` in 6-7 (16 pairs of 16 columns).
    fn configure() -> Self {
        let mut config = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        config.bytes_per_row[..8].fill(64);
        config.rows[..8].fill(16);
        // SAFETY: `amx` runs only where `has_amx_bf16()` holds; the
        // configuration is a valid palette-1 one, read from our memory.
        unsafe {
            std::arch::asm!(
                "ldtilecfg [{config}]",
                config = in(reg) &config,
                options(nostack, readonly, preserves_flags)
            );
        }
        Self
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: AMX is there (`configure` ran); releasing touches no memory.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// One 32x32 tile of `a b` into `c`: `a` is a panel of `MR` rows packed
/// as [`a_at`] says, `b` `stride` rows of `NR` columns' pairs; K in steps
/// of 16 pairs, four `tdpbf16ps` a step. `c` is 32 rows of 32 values,
/// `c_stride` values apart; its tiles start from its values where `load`
/// holds, from zero otherwise, and are stored back into it.
///
/// # Safety
/// The tiles are configured on this thread ([`Tiles::configure`]); `a`
/// is valid for `MR * stride` values, `b` for `stride * NR`, `c` for
/// writes of `(MR - 1) * c_stride + NR` values, and holds values there
/// when `load`; `stride` is a positive multiple of `TILE_PAIRS`.
unsafe fn micro(
    a: *const u32,
    b: *const u32,
    stride: usize,
    (c, c_stride, load): (*mut f32, usize, bool),
) {
    let steps = stride / TILE_PAIRS;
    let a_row_bytes = TILE_PAIRS * 4;
    let b_row_bytes = NR * 4;
    let c_row_bytes = c_stride * 4;
    // SAFETY: the caller's bounds. C's loads and stores cover 16 rows of
    // 64 bytes at `c`, `c + 64`, `c + 16 rows` and `c + 16 rows + 64`
    // (`c_row_bytes` apart): `c`'s 32 rows of 32 values. Each of the
    // `steps` steps loads `A_STEP_BYTES` at `a` (two tiles of 16 rows of
    // 64 bytes, one after the other) and `B_STEP_BYTES` at `b` (16 rows of
    // 128 bytes, a tile in each half), then moves both on: `MR * stride`
    // values of `a` and `stride * NR` of `b` in all. The prefetches read
    // nothing architecturally and never fault. Nothing between the two
    // `asm!` blocks touches the tiles (Rust never does).
    unsafe {
        if load {
            std::arch::asm!(
                "tileloadd tmm0, [{c} + {sc} * 1]",
                "tileloadd tmm1, [{c} + {sc} * 1 + 64]",
                "tileloadd tmm2, [{c16} + {sc} * 1]",
                "tileloadd tmm3, [{c16} + {sc} * 1 + 64]",
                c = in(reg) c,
                c16 = in(reg) c.add(16 * c_stride),
                sc = in(reg) c_row_bytes,
                options(nostack, readonly, preserves_flags)
            );
        } else {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem, preserves_flags)
            );
        }
        // Each step's two `A` tiles are 2 KiB in one piece (rows 64 bytes
        // apart); `B`'s 16 pair rows of 128 bytes hold both `B` tiles.
        // Each step first asks for the step after next's 32 + 32 lines in
        // L1 (`prefetcht0`, which never faults, past the packs too): a
        // tile load from L2 waits for its 16 lines, and the hardware's own
        // prefetchers leave that wait (model-shape products 6% faster in
        // 21 of 24 interleaved pairs; four steps ahead was no better).
        std::arch::asm!(
            "2:",
            ".set padfree_amx_ahead, {ahead}",
            ".rept {lines}",
            "prefetcht0 [{a} + padfree_amx_ahead]",
            "prefetcht0 [{b} + padfree_amx_ahead]",
            ".set padfree_amx_ahead, padfree_amx_ahead + 64",
            ".endr",
            "tileloadd tmm4, [{a} + {sa} * 1]",
            "tileloadd tmm5, [{a} + {sa} * 1 + 1024]",
            "tileloadd tmm6, [{b} + {sb} * 1]",
            "tileloadd tmm7, [{b} + {sb} * 1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a}, {a_step}",
            "add {b}, {b_step}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c} + {sc} * 1], tmm0",
            "tilestored [{c} + {sc} * 1 + 64], tmm1",
            "tilestored [{c16} + {sc} * 1], tmm2",
            "tilestored [{c16} + {sc} * 1 + 64], tmm3",
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            steps = inout(reg) steps => _,
            sa = in(reg) a_row_bytes,
            sb = in(reg) b_row_bytes,
            a_step = const A_STEP_BYTES,
            b_step = const B_STEP_BYTES,
            ahead = const PREFETCH_STEPS * A_STEP_BYTES,
            lines = const A_STEP_BYTES / 64,
            c = in(reg) c,
            c16 = in(reg) c.add(16 * c_stride),
            sc = in(reg) c_row_bytes,
            options(nostack)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::operand::test_layouts;
    use super::*;

    /// `A`'s packs are written whole (rows, K and their padding), so a
    /// buffer that held another shape's values, or NaNs, packs the same
    /// bits as a fresh one: row-major `A` (`x W^T`), column-major (`dy^T`)
    /// and strided both ways, row and K blocks with edges. The packing is
    /// plain Rust (the AVX-512 build compiles the same body), so this runs
    /// on every machine.
    #[test]
    fn a_packs_do_not_depend_on_what_the_buffer_held() {
        let (m, k) = (45, 77);
        let x: Vec<f32> = (0..2 * m * k).map(|i| i as f32 * 0.25 - 900.0).collect();
        for (name, a) in test_layouts(Values::F32(&x), m, k) {
            for (i0, mc) in [(0, m), (3, 33), (40, 5)] {
                for (k0, kc) in [(0, k), (4, 33), (10, 6)] {
                    let stride = (BLOCKING.stride)(kc);
                    let mut fresh = Pack::default();
                    pack_a(&x, a, (i0, mc), (k0, kc), stride, &mut fresh);
                    for stale_bits in [0xdead_beef, 0x7fc0_7fc0] {
                        let mut stale = Pack::default();
                        stale.unset(2 * m * stride + 99).fill(stale_bits);
                        pack_a(&x, a, (i0, mc), (k0, kc), stride, &mut stale);
                        assert_eq!(
                            fresh.values(),
                            stale.values(),
                            "{name} rows {i0}+{mc}, K {k0}+{kc}, over {stale_bits:#x}"
                        );
                    }
                    let values = fresh.values();
                    assert_eq!(values.len(), mc.next_multiple_of(MR) * stride);
                    // The pack holds A's values where they belong and zeros past
                    // its edges (the oracle reads the view element by element).
                    for r in 0..mc.next_multiple_of(MR) {
                        for p in 0..stride {
                            let bits = |kk: usize| {
                                if r < mc && kk < kc {
                                    u32::from(
                                        half::bf16::from_f32(a.widened(i0 + r, k0 + kk)).to_bits(),
                                    )
                                } else {
                                    0
                                }
                            };
                            assert_eq!(
                                values[a_at(r, p, stride)],
                                bits(2 * p) | (bits(2 * p + 1) << 16),
                                "{name} rows {i0}+{mc}, K {k0}+{kc}: row {r}, pair {p}"
                            );
                        }
                    }
                }
            }
        }
    }
}
