//! Matrix products of bf16 operands with f32 accumulation, the matmuls of
//! `--bf16`: an operand is a bf16 buffer, or an f32 one rounded to bf16
//! (`kernels/bf16.rs`, nearest-even) as it is read, so that a gradient
//! need not be rounded into a second buffer first.
//!
//! Two bodies, chosen once per process ([`body`]):
//! - `avx512-bf16`: BLIS-style packing of both operands into bf16 pairs and
//!   a 14x32 micro-kernel of `vdpbf16ps` (AMD Zen 4 and later, Intel Cooper
//!   Lake and later; an `A` contiguous along K is kept row by row, which
//!   the micro-kernel reads as well as BLIS's panels: `Layout`), K in
//!   blocks of at most 512 (split evenly), rows of the output in blocks of
//!   112 on rayon's threads. Each output value sums its
//!   K products in one fixed order whatever the thread count, so results do
//!   not depend on it.
//! - `widened` (every other CPU, and the oracle): the bf16 operands widened
//!   to f32 (exactly) and multiplied by the f32 gemm (`kernels/gemm.rs`).
//!   The result is then the f32 product of the bf16-rounded operands, which
//!   is what the fast body computes up to the order of its f32 sums.
//!
//! AMX-BF16 (Sapphire Rapids) is not here: its intrinsics and its
//! `is_x86_feature_detected!("amx-bf16")` are unstable in Rust 1.95, and no
//! machine of ours has AMX to test a hand-written `asm!` body on.
//!
//! `PADFREE_BF16_MATMUL=widened` forces the portable body (A/B runs, and to
//! rule the fast body out when results look wrong).
//!
//! The second module of the workspace that allows `unsafe`: the
//! micro-kernel's intrinsics and raw pointers. Every call checks the bounds
//! of what it reads and writes first.
//!
//! # Shapes
//! `[M, K] x [K, N] -> [M, N]`.
#![allow(unsafe_code)]

use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

use super::bf16::{round, rounded, widen};
use super::gemm::{self, Write};

/// Rows of a micro-tile: 14 x 2 accumulators plus two B registers fill 30
/// of AVX-512's 32 vector registers.
const MR: usize = 14;
/// Columns of a micro-tile: two 16-lane registers.
const NR: usize = 32;
/// The largest K block: A's block (112 x 512 bf16, 112 KiB) stays in L2.
const KC: usize = 512;
/// Output rows a thread takes at a time.
const MC: usize = MR * 8;
/// Products this small run on the calling thread (as `kernels/gemm.rs`).
const PARALLEL_OPS: usize = 192 * 192 * 192;
/// The widened body widens B in column blocks of at most this many values,
/// so that a vocabulary-sized weight is never widened whole.
const WIDENED_B_VALUES: usize = 1 << 22;
/// ... and K in blocks of at most this many, so that a vocabulary-sized
/// inner dimension (the head's `dy W`) still leaves wide column blocks.
const WIDENED_K: usize = 4096;

/// The values an operand reads.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Values<'a> {
    /// Rounded to bf16 as they are read.
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl Values<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }
}

/// A read-only matrix operand: element `(i, j)` at `i * row_stride + j * col_stride`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct View16<'a> {
    values: Values<'a>,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> View16<'a> {
    /// `values` as a row-major `[rows, cols]` matrix.
    ///
    /// # Panics
    /// When `values` holds fewer than `rows * cols` values (a bug in the caller).
    pub fn row_major(values: Values<'a>, rows: usize, cols: usize) -> Self {
        assert!(
            values.len() >= rows * cols,
            "bf16 gemm view: {} values for [{rows}, {cols}]",
            values.len()
        );
        Self {
            values,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// A row-major bf16 matrix.
    pub fn bf16(values: &'a [bf16], rows: usize, cols: usize) -> Self {
        Self::row_major(Values::Bf16(values), rows, cols)
    }

    /// A row-major f32 matrix, rounded to bf16 as it is read.
    pub fn f32(values: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::row_major(Values::F32(values), rows, cols)
    }

    /// The transpose, without a copy.
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Columns `start..start + len` of the view, without a copy.
    ///
    /// # Panics
    /// When the columns run past the view.
    pub fn columns(self, start: usize, len: usize) -> Self {
        assert!(
            start + len <= self.cols,
            "bf16 gemm view: columns {start}+{len} of {}",
            self.cols
        );
        let from = |len: usize| (start * self.col_stride).min(len);
        let values = match self.values {
            Values::F32(v) => Values::F32(&v[from(v.len())..]),
            Values::Bf16(v) => Values::Bf16(&v[from(v.len())..]),
        };
        Self {
            values,
            cols: len,
            ..self
        }
    }

    /// Element `(i, j)` as the f32 of its bf16 value (tests' oracle).
    #[cfg(test)]
    fn widened(&self, i: usize, j: usize) -> f32 {
        let at = i * self.row_stride + j * self.col_stride;
        match self.values {
            Values::F32(v) => rounded(v[at]),
            Values::Bf16(v) => widen(v[at]),
        }
    }
}

/// Which body computes the products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// `vdpbf16ps` (AVX512-BF16).
    Avx512Bf16,
    /// Widened to f32, the f32 gemm: every CPU, and the oracle.
    Widened,
}

impl Body {
    /// The name in logs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Avx512Bf16 => "avx512-bf16",
            Self::Widened => "widened to f32 (no AVX512-BF16)",
        }
    }

    /// Whether this CPU can run the body.
    pub fn available(self) -> bool {
        match self {
            Self::Widened => true,
            Self::Avx512Bf16 => has_avx512_bf16(),
        }
    }
}

fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The body this process uses: the fast one where the CPU has it, unless
/// `PADFREE_BF16_MATMUL=widened`.
pub fn body() -> Body {
    static BODY: OnceLock<Body> = OnceLock::new();
    *BODY.get_or_init(|| {
        let forced = std::env::var("PADFREE_BF16_MATMUL").is_ok_and(|v| v == "widened");
        if !forced && Body::Avx512Bf16.available() {
            Body::Avx512Bf16
        } else {
            Body::Widened
        }
    })
}

/// `a b` in a fresh row-major `[M, N]` buffer.
///
/// # Panics
/// When the inner dimensions differ (a bug in the caller).
pub(crate) fn product(a: View16<'_>, b: View16<'_>) -> Vec<f32> {
    product_with(body(), a, b)
}

/// `dst` (row-major, `row_stride` values a row) set to `a b`, or
/// `factor * a b` added to it, by this process's body.
///
/// # Panics
/// As [`product_into_with`].
pub(crate) fn product_into(
    dst: &mut [f32],
    row_stride: usize,
    a: View16<'_>,
    b: View16<'_>,
    write: Write,
) {
    product_into_with(body(), dst, row_stride, a, b, write);
}

/// [`product`] with a given body (tests and benchmarks compare them).
pub(crate) fn product_with(body: Body, a: View16<'_>, b: View16<'_>) -> Vec<f32> {
    let mut out = vec![0.0; a.rows * b.cols];
    product_into_with(body, &mut out, b.cols, a, b, Write::Set);
    out
}

/// `dst` (row-major, `row_stride` values a row) set to `a b`, or
/// `factor * a b` added to it, by `body`.
///
/// # Panics
/// When the inner dimensions differ, `dst` is too short (a bug in the
/// caller) or `body` is not available on this CPU.
pub(crate) fn product_into_with(
    body: Body,
    dst: &mut [f32],
    row_stride: usize,
    a: View16<'_>,
    b: View16<'_>,
    write: Write,
) {
    check(a, b);
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        n <= row_stride && dst.len() >= (m - 1) * row_stride + n,
        "bf16 gemm: destination of {} values for [{m}, {n}] rows of {row_stride}",
        dst.len()
    );
    if k == 0 {
        if write == Write::Set {
            for row in dst.chunks_mut(row_stride).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    match body {
        Body::Widened => widened(dst, row_stride, a, b, write),
        Body::Avx512Bf16 => {
            assert!(has_avx512_bf16(), "bf16 gemm: this CPU has no AVX512-BF16");
            packed(dst, row_stride, a, b, write);
        }
    }
}

fn check(a: View16<'_>, b: View16<'_>) {
    assert_eq!(
        a.cols, b.rows,
        "bf16 gemm: [{}, {}] x [{}, {}]",
        a.rows, a.cols, b.rows, b.cols
    );
    for view in [a, b] {
        if view.rows > 0 && view.cols > 0 {
            let last = (view.rows - 1) * view.row_stride + (view.cols - 1) * view.col_stride;
            assert!(
                last < view.values.len(),
                "bf16 gemm: view runs past its {} values",
                view.values.len()
            );
        }
    }
}

/// What an operand's elements are read as.
trait Element: Copy + Send + Sync {
    /// The bf16 bits of the element (rounded when it is f32).
    fn bits(self) -> u32;
    /// The f32 of its bf16 value.
    fn widened(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn bits(self) -> u32 {
        u32::from(round(self).to_bits())
    }
    #[inline(always)]
    fn widened(self) -> f32 {
        rounded(self)
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
    #[inline(always)]
    fn widened(self) -> f32 {
        widen(self)
    }
}

/// Runs `$body` with `$v` bound to the operand's slice, whichever element
/// type it holds (the body is compiled once for each).
macro_rules! with_values {
    ($values:expr, $v:ident => $body:expr) => {
        match $values {
            Values::F32($v) => $body,
            Values::Bf16($v) => $body,
        }
    };
}

/// The portable body: blocks of K and of B's columns widened (A's K block
/// once for all column blocks), each product by the f32 gemm.
fn widened(dst: &mut [f32], row_stride: usize, a: View16<'_>, b: View16<'_>, write: Write) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let kb = k.min(WIDENED_K);
    let nb = (WIDENED_B_VALUES / kb).clamp(64, n.max(64));
    for k0 in (0..k).step_by(kb) {
        let kc = kb.min(k - k0);
        let write = match write {
            Write::Set if k0 > 0 => Write::Add(1.0),
            other => other,
        };
        let a_block = widen_block(a, (0, m), (k0, kc));
        let a_view = a_block.view(m, kc);
        for j0 in (0..n).step_by(nb) {
            let cols = nb.min(n - j0);
            let b_block = widen_block(b, (k0, kc), (j0, cols));
            let b_view = b_block.view(kc, cols);
            gemm::product_into(&mut dst[j0..], row_stride, a_view, b_view, write);
        }
    }
}

/// A widened block, stored row-major or column-major as the view lies in
/// memory, so that it is read in order.
struct Widened {
    values: Vec<f32>,
    row_major: bool,
}

impl Widened {
    fn view(&self, rows: usize, cols: usize) -> gemm::View<'_> {
        if self.row_major {
            gemm::View::row_major(&self.values, rows, cols)
        } else {
            gemm::View::row_major(&self.values, cols, rows).t()
        }
    }
}

/// Rows `row0..row0 + rows` and columns `col0..col0 + cols` of `view`,
/// widened to f32.
fn widen_block(
    view: View16<'_>,
    (row0, rows): (usize, usize),
    (col0, cols): (usize, usize),
) -> Widened {
    let row_major = view.col_stride == 1 || view.row_stride != 1;
    let mut values = vec![0.0f32; rows * cols];
    // Each output line is one line of the view: contiguous on the layouts
    // the kernels use, strided otherwise.
    let (line_len, line_stride, step) = if row_major {
        (cols, view.row_stride, view.col_stride)
    } else {
        (rows, view.col_stride, view.row_stride)
    };
    let first = |line: usize| {
        if row_major {
            (row0 + line) * line_stride + col0 * step
        } else {
            (col0 + line) * line_stride + row0 * step
        }
    };
    with_values!(view.values, v => {
        let body = |(line, out): (usize, &mut [f32])| {
            let from = first(line);
            if step == 1 {
                for (o, &x) in out.iter_mut().zip(&v[from..from + line_len]) {
                    *o = x.widened();
                }
            } else {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = v[from + i * step].widened();
                }
            }
        };
        if rows * cols >= 1 << 16 {
            values.par_chunks_mut(line_len.max(1)).enumerate().for_each(body);
        } else {
            values.chunks_mut(line_len.max(1)).enumerate().for_each(body);
        }
    });
    Widened { values, row_major }
}

/// The fast body: pack, then micro-tiles of `vdpbf16ps`.
fn packed(dst: &mut [f32], row_stride: usize, a: View16<'_>, b: View16<'_>, write: Write) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let blocks = k.div_ceil(KC);
    // Even K blocks (576 is one block of 576, not 512 + 64), each even so
    // that only the last pair may be half empty.
    let kc_max = k.div_ceil(blocks).next_multiple_of(2);
    let parallel = m.saturating_mul(n).saturating_mul(k) >= PARALLEL_OPS && m > MR;
    // At least four row blocks a thread where M allows, so that threads
    // finish together (the head's few hundred rows are 5 blocks of 112).
    let mc_max = if parallel {
        (m.div_ceil(4 * rayon::current_num_threads()))
            .next_multiple_of(MR)
            .clamp(MR, MC)
    } else {
        MC
    };
    let region = (m - 1) * row_stride + n;
    let mut b_pack = Vec::new();
    for k0 in (0..k).step_by(kc_max) {
        let kc = kc_max.min(k - k0);
        with_values!(b.values, v => pack_b(v, b, k0, kc, &mut b_pack));
        // The first K block sets (or adds `factor` times); later ones add
        // theirs, times the same factor.
        let (add, factor) = match write {
            Write::Set if k0 == 0 => (false, 1.0),
            Write::Set => (true, 1.0),
            Write::Add(factor) => (true, factor),
        };
        let b_pack = &b_pack;
        let run = |(block, rows): (usize, &mut [f32])| {
            let i0 = block * mc_max;
            let mc = mc_max.min(m - i0);
            let mut a_pack = Vec::new();
            // SAFETY: `packed` runs only where `has_avx512_bf16()` holds.
            let layout = with_values!(a.values, v => unsafe {
                pack_a_avx512(v, a, (i0, mc), (k0, kc), &mut a_pack)
            });
            let out = (rows, row_stride, add, factor);
            match layout {
                Layout::Rows => tiles::<true>(&a_pack, b_pack, mc, n, kc, out),
                Layout::Panels => tiles::<false>(&a_pack, b_pack, mc, n, kc, out),
            }
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
fn pairs_of<E: Element>(line: &[E], out: &mut [u32]) {
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
fn interleave<E: Element>(lo: &[E], hi: Option<&[E]>, out: &mut [u32]) {
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
    out: &mut Vec<u32>,
) -> Layout {
    let pairs = kc.div_ceil(2);
    out.clear();
    out.resize(mc.div_ceil(MR) * pairs * MR, 0);
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
/// of `NR` columns: `[panel][pair][NR]` pairs of bf16, zeros past the
/// edges; panels on rayon's threads, each compiled for AVX-512.
fn pack_b<E: Element>(v: &[E], b: View16<'_>, k0: usize, kc: usize, out: &mut Vec<u32>) {
    let pairs = kc.div_ceil(2);
    let n = b.cols;
    out.clear();
    out.resize(n.div_ceil(NR) * pairs * NR, 0);
    let body = |(panel, dst): (usize, &mut [u32])| {
        // SAFETY: `packed` runs only where `has_avx512_bf16()` holds.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            pack_b_panel_avx512(v, b, (k0, kc), panel, dst);
        }
        #[cfg(not(target_arch = "x86_64"))]
        pack_b_panel(v, b, (k0, kc), panel, dst);
    };
    if n * kc >= 1 << 16 {
        out.par_chunks_mut(pairs * NR).enumerate().for_each(body);
    } else {
        out.chunks_mut(pairs * NR).enumerate().for_each(body);
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
    out: &mut Vec<u32>,
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
    use super::*;
    use crate::kernels::bf16::round_slice;
    use crate::kernels::test_util::{assert_within, random};

    /// The triple loop in f64 on the bf16 values.
    fn naive(a: View16<'_>, b: View16<'_>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] = (0..a.cols)
                    .map(|p| f64::from(a.widened(i, p)) * f64::from(b.widened(p, j)))
                    .sum();
            }
        }
        out
    }

    fn bodies() -> Vec<Body> {
        let all = [Body::Widened, Body::Avx512Bf16];
        let available: Vec<Body> = all.into_iter().filter(|b| b.available()).collect();
        if available.len() < all.len() {
            eprintln!("NOTE: this CPU has no AVX512-BF16: only the widened body was tested");
        }
        available
    }

    /// Every layout the linear layer uses (`x W^T` with `x` bf16 or f32,
    /// `dy W`, `dy^T x`), odd sizes on every edge of the tiles and K
    /// blocks, small and threaded, against the f64 triple loop on the same
    /// bf16 values. Both bodies sum K f32 products of bf16 values (exact
    /// in f32): what remains is the f32 summation, a few ulps of the
    /// magnitude, so 2e-6 of the largest value over K <= 1100.
    #[test]
    fn every_body_matches_the_triple_loop_on_bf16_values() {
        for body in bodies() {
            for (m, k, n) in [
                (1, 1, 1),
                (13, 7, 33),
                (15, 64, 31),
                (113, 513, 65),
                (230, 1100, 97),
                (300, 200, 200),
            ] {
                let x = random(m * k, 1);
                let w = random(n * k, 2);
                let (xh, wh) = (round_slice(&x), round_slice(&w));
                // x W^T: x f32 (rounded on reading) and bf16, W bf16.
                for a in [View16::f32(&x, m, k), View16::bf16(&xh, m, k)] {
                    let b = View16::bf16(&wh, n, k).t();
                    let want: Vec<f32> = naive(a, b).iter().map(|&v| v as f32).collect();
                    let got = product_with(body, a, b);
                    assert_within(&format!("{body:?} x W^T [{m},{k},{n}]"), &got, &want, 2e-6);
                }
                // dy W and dy^T x: dy f32, W and x bf16 (strided reads).
                let dy = random(m * n, 3);
                let (a, b) = (View16::f32(&dy, m, n), View16::bf16(&wh, n, k));
                let want: Vec<f32> = naive(a, b).iter().map(|&v| v as f32).collect();
                assert_within(
                    &format!("{body:?} dy W [{m},{k},{n}]"),
                    &product_with(body, a, b),
                    &want,
                    2e-6,
                );
                let (a, b) = (View16::f32(&dy, m, n).t(), View16::bf16(&xh, m, k));
                let want: Vec<f32> = naive(a, b).iter().map(|&v| v as f32).collect();
                assert_within(
                    &format!("{body:?} dy^T x [{m},{k},{n}]"),
                    &product_with(body, a, b),
                    &want,
                    2e-6,
                );
            }
        }
    }

    /// The fast body against its oracle, the widened one, at a linear
    /// layer's size (threads, several K blocks, every write mode into a
    /// wider destination, the columns beside it untouched).
    #[test]
    fn fast_body_matches_the_widened_oracle_in_every_write_mode() {
        if !Body::Avx512Bf16.available() {
            eprintln!("NOTE: this CPU has no AVX512-BF16: the fast body was not run");
            return;
        }
        let (m, k, n) = (301, 1030, 150);
        let x = random(m * k, 4);
        let w = round_slice(&random(n * k, 5));
        let (a, b) = (View16::f32(&x, m, k), View16::bf16(&w, n, k).t());
        let stride = n + 5;
        for write in [Write::Set, Write::Add(-0.5)] {
            let run = |body| {
                let mut dst = vec![0.25f32; m * stride];
                product_into_with(body, &mut dst, stride, a, b, write);
                dst
            };
            let (fast, oracle) = (run(Body::Avx512Bf16), run(Body::Widened));
            assert_within(&format!("{write:?}"), &fast, &oracle, 2e-6);
            for i in 0..m {
                assert_eq!(&fast[i * stride + n..(i + 1) * stride], &[0.25; 5]);
            }
        }
    }

    /// The fast body's results do not depend on the thread count (its sums
    /// have one order), so bf16 runs are reproducible across machines with
    /// the same CPU features.
    #[test]
    fn results_do_not_depend_on_threads() {
        let (m, k, n) = (400, 600, 130);
        let x = random(m * k, 6);
        let w = round_slice(&random(n * k, 7));
        let (a, b) = (View16::f32(&x, m, k), View16::bf16(&w, n, k).t());
        if !Body::Avx512Bf16.available() {
            eprintln!("NOTE: this CPU has no AVX512-BF16: the fast body was not run");
            return;
        }
        // (The widened body's f32 gemm splits K by threads, as burn's does.)
        let threaded = product_with(Body::Avx512Bf16, a, b);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a one-thread pool");
        let single = pool.install(|| product_with(Body::Avx512Bf16, a, b));
        assert_eq!(threaded, single);
    }

    #[test]
    fn empty_inner_dimension_gives_zeros() {
        for body in bodies() {
            let none: Vec<bf16> = Vec::new();
            let mut dst = vec![1.0f32; 6];
            product_into_with(
                body,
                &mut dst,
                2,
                View16::bf16(&none, 3, 0),
                View16::bf16(&none, 0, 2),
                Write::Set,
            );
            assert_eq!(dst, vec![0.0; 6]);
        }
    }
}
