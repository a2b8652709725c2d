//! The AMX-BF16 body of the bf16 products (Intel Sapphire Rapids and
//! later): both operands packed into bf16 pairs as for the `vdpbf16ps`
//! body (`packed.rs`: `B` in the same `[panel][pair][32]` panels, `A` row
//! by row), K padded with zeros to whole tiles, and a 32x32 micro-kernel
//! of four `tdpbf16ps` on 16x16 f32 tiles. AMX's intrinsics and its
//! `is_x86_feature_detected!` name are unstable in Rust 1.95, so the tile
//! instructions are `asm!` and the CPU is asked through CPUID and the
//! kernel's `arch_prctl` permission. Run only where [`has_amx_bf16`] holds
//! (`gemm_bf16::product_into_with` asserts it).
//!
//! The module is compiled on x86-64 only (`gemm_bf16/mod.rs`).
//!
//! An output value sums its K products in tile order (the hardware's
//! order within a tile, K blocks in turn), whatever the thread count.
#![allow(unsafe_code)]

use std::sync::OnceLock;

use super::operand::{Element, Values, View16, with_values};
use super::packed::{Blocking, NR, drive, interleave, pairs_of};
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
pub(super) fn amx(dst: &mut [f32], row_stride: usize, a: View16<'_>, b: View16<'_>, write: Write) {
    let blocking = Blocking {
        kc: KC,
        mr: MR,
        mc: MC,
        // Pairs a packed row holds: whole tiles, zeros past K.
        stride: |kc| kc.div_ceil(2).next_multiple_of(TILE_PAIRS),
    };
    drive(dst, row_stride, (a, b), write, blocking, |block| {
        let mut a_pack = Vec::new();
        let (i0, mc, stride) = (block.i0, block.mc, block.stride);
        // SAFETY: `amx` runs only where `has_amx_bf16()` holds, which
        // includes AVX512F, BW and VL.
        with_values!(a.values, v => unsafe {
            pack_a_avx512(v, a, (i0, mc), (block.k0, block.kc), stride, &mut a_pack)
        });
        let out = (block.rows, row_stride, block.add, block.factor);
        tiles(&a_pack, block.b_pack, mc, b.cols, stride, out);
    });
}

/// Rows `i0..i0 + mc`, K `k0..k0 + kc` of `a` (whose values are `v`) as
/// `[row][stride]` pairs of bf16 (even K in the low half), the layout an
/// `A` tile loads; zeros past the edges, rows to a whole micro-tile.
#[inline(always)]
fn pack_a<E: Element>(
    v: &[E],
    a: View16<'_>,
    (i0, mc): (usize, usize),
    (k0, kc): (usize, usize),
    stride: usize,
    out: &mut Vec<u32>,
) {
    let pairs = kc.div_ceil(2);
    out.clear();
    out.resize(mc.next_multiple_of(MR) * stride, 0);
    if a.col_stride == 1 {
        for (r, line) in out.chunks_exact_mut(stride).take(mc).enumerate() {
            let from = (i0 + r) * a.row_stride + k0;
            pairs_of(&v[from..from + kc], &mut line[..pairs]);
        }
    } else if a.row_stride == 1 {
        // Columns contiguous along M (`dy^T`, K the tokens): two K lines
        // at a time, read once, each row's pair into its line (16
        // consecutive pairs share a row's cache line).
        let mut pair = vec![0u32; mc];
        for p in 0..pairs {
            let from = (k0 + 2 * p) * a.col_stride + i0;
            let lo = &v[from..from + mc];
            let hi = (2 * p + 1 < kc).then(|| &v[from + a.col_stride..from + a.col_stride + mc]);
            interleave(lo, hi, &mut pair);
            for (line, &value) in out.chunks_exact_mut(stride).zip(&pair) {
                line[p] = value;
            }
        }
    } else {
        for (r, line) in out.chunks_exact_mut(stride).take(mc).enumerate() {
            for (p, slot) in line[..pairs].iter_mut().enumerate() {
                let at = |k: usize| (i0 + r) * a.row_stride + k * a.col_stride;
                let k = k0 + 2 * p;
                let hi = if k + 1 < k0 + kc {
                    v[at(k + 1)].bits()
                } else {
                    0
                };
                *slot = v[at(k)].bits() | (hi << 16);
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
    out: &mut Vec<u32>,
) {
    pack_a(v, a, rows, k, stride, out);
}

/// Every micro-tile of one row block: `rows` holds the block's output rows
/// (`row_stride` apart; the last may be short), `a_pack` the block's
/// `[row][stride]` pairs, `b_pack` every panel's `[stride][NR]`. The tiles
/// are configured on this thread for the block and released after it.
fn tiles(
    a_pack: &[u32],
    b_pack: &[u32],
    mc: usize,
    n: usize,
    stride: usize,
    (rows, row_stride, add, factor): (&mut [f32], usize, bool, f32),
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
    let mut tile = [0.0f32; MR * NR];
    let _tiles = Tiles::configure();
    for panel_j in 0..n.div_ceil(NR) {
        let b_panel = &b_pack[panel_j * stride * NR..(panel_j + 1) * stride * NR];
        let (col0, nc) = (panel_j * NR, NR.min(n - panel_j * NR));
        for panel_i in 0..mc.div_ceil(MR) {
            let a_panel = &a_pack[panel_i * MR * stride..(panel_i + 1) * MR * stride];
            // SAFETY: the tiles are configured (`_tiles`); the lengths were
            // checked above: `a_panel` holds `MR` rows of `stride` pairs,
            // `b_panel` `stride` rows of `NR`, `tile` `MR x NR` values, and
            // `stride` is a positive multiple of `TILE_PAIRS`.
            unsafe { micro(a_panel.as_ptr(), b_panel.as_ptr(), stride, &mut tile) };
            let (row0, mr) = (panel_i * MR, MR.min(mc - panel_i * MR));
            for r in 0..mr {
                let start = (row0 + r) * row_stride + col0;
                let out = &mut rows[start..start + nc];
                for (o, &v) in out.iter_mut().zip(&tile[r * NR..r * NR + nc]) {
                    *o = if add { *o + factor * v } else { v };
                }
            }
        }
    }
}

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

/// One 32x32 tile of `a b` into `c` (row-major, `NR` a row): `a` is `MR`
/// rows of `stride` pairs, `b` `stride` rows of `NR` columns' pairs; K in
/// steps of 16 pairs, four `tdpbf16ps` a step.
///
/// # Safety
/// The tiles are configured on this thread ([`Tiles::configure`]); `a`
/// is valid for `MR * stride` values, `b` for `stride * NR`; `stride` is a
/// positive multiple of `TILE_PAIRS`.
unsafe fn micro(a: *const u32, b: *const u32, stride: usize, c: &mut [f32; MR * NR]) {
    let steps = stride / TILE_PAIRS;
    let a_row_bytes = stride * 4;
    let b_row_bytes = NR * 4;
    let c_row_bytes = NR * 4;
    let c = c.as_mut_ptr();
    // SAFETY: the caller's bounds: the loads read 16 rows of 64 bytes at
    // `a` and `a + 16 rows` (`a_row_bytes` apart) and at `b` and `b + 64`
    // (`b_row_bytes` apart), `steps` times moving 64 bytes along `a`'s
    // rows and 16 rows down `b`; the stores write `c`'s 32 rows of 128.
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a} + {sa} * 1]",
            "tileloadd tmm5, [{a16} + {sa} * 1]",
            "tileloadd tmm6, [{b} + {sb} * 1]",
            "tileloadd tmm7, [{b} + {sb} * 1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a}, 64",
            "add {a16}, 64",
            "add {b}, {b_step}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c} + {sc} * 1], tmm0",
            "tilestored [{c} + {sc} * 1 + 64], tmm1",
            "tilestored [{c16} + {sc} * 1], tmm2",
            "tilestored [{c16} + {sc} * 1 + 64], tmm3",
            a = inout(reg) a => _,
            a16 = inout(reg) a.add(16 * stride) => _,
            b = inout(reg) b => _,
            steps = inout(reg) steps => _,
            sa = in(reg) a_row_bytes,
            sb = in(reg) b_row_bytes,
            b_step = in(reg) TILE_PAIRS * b_row_bytes,
            c = in(reg) c,
            c16 = in(reg) c.add(16 * NR),
            sc = in(reg) c_row_bytes,
            options(nostack)
        );
    }
}
