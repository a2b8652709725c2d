//! Matrix products of bf16 operands with f32 accumulation, the matmuls of
//! `--bf16`: an operand is a bf16 buffer, or an f32 one rounded to bf16
//! (`kernels/bf16.rs`, nearest-even) as it is read, so that a gradient
//! need not be rounded into a second buffer first.
//!
//! Three bodies, chosen once per process ([`body`]):
//! - `amx-bf16` (Intel Sapphire Rapids and later, where Linux grants the
//!   tile state): the same packing, K padded to whole tiles, and a 32x32
//!   micro-kernel of four `tdpbf16ps` on 16x16 f32 tiles (`amx.rs`, in
//!   `asm!`: AMX's intrinsics and feature name are unstable in Rust 1.95).
//!   Chosen first where it is there.
//! - `avx512-bf16`: BLIS-style packing of both operands into bf16 pairs and
//!   a 14x32 micro-kernel of `vdpbf16ps` (AMD Zen 4 and later, Intel Cooper
//!   Lake and later; an `A` contiguous along K is kept row by row, which
//!   the micro-kernel reads as well as BLIS's panels: `Layout`; an `A`
//!   contiguous along M, `dy^T`, packed for every row block at once, two
//!   token lines at a time: `pack_a_lines`), K in
//!   blocks of at most 512 (split evenly), rows of the output in blocks of
//!   112 on rayon's threads. Each output value sums its
//!   K products in one fixed order whatever the thread count, so results do
//!   not depend on it.
//! - `widened` (every other CPU, Intel's by default, and the oracle): the
//!   bf16 operands widened to f32 (exactly) and multiplied by the f32 gemm
//!   (`kernels/gemm.rs`). The result is then the f32 product of the
//!   bf16-rounded operands, which is what the fast body computes up to the
//!   order of its f32 sums.
//!
//! Intel's cores have AVX512-BF16 too, but run `vdpbf16ps` on one port
//! beside two f32 FMA units: measured there, the fast body ran at half the
//! widened body's speed, so [`choose`] takes the widened body on Intel
//! (`PADFREE_BF16_MATMUL=avx512-bf16` forces the other).
//!
//! `PADFREE_BF16_MATMUL=widened` forces the portable body (A/B runs, and to
//! rule the fast bodies out when results look wrong), `=avx512-bf16` and
//! `=amx` the fast ones where the CPU has the instructions.
//!
//! Its rooms: `operand.rs` (the views the products read, and the element
//! types they hold), `widened.rs` (the portable body), `packed.rs` (the
//! `vdpbf16ps` body, packing and micro-kernel), `amx.rs` (the tile body);
//! the last two allow `unsafe` for this kernel, and every call checks the
//! bounds of what it reads and writes first. `skinny.rs` has the LM
//! head's three products for a few labelled rows: on a packed body (AMX,
//! `vdpbf16ps`) its products with their operands arranged so that both
//! threads work and no head-sized pack is made (the packed path's bits),
//! on the widened body the weight
//! streamed row by row through f32 FMAs instead of packed (the same
//! rounded values, f32 sums in a fixed order; the widened body is the
//! oracle of both).
//!
//! # Shapes
//! `[M, K] x [K, N] -> [M, N]`.

#[cfg(target_arch = "x86_64")]
mod amx;
mod operand;
mod packed;
pub(crate) mod skinny;
mod widened;

use std::sync::{Arc, OnceLock};

use half::bf16;

pub(crate) use self::operand::View16;
use self::packed::OperandB;
use super::gemm::Write;

/// Which body computes the products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// `tdpbf16ps` on AMX tiles (AMX-BF16).
    Amx,
    /// `vdpbf16ps` (AVX512-BF16).
    Avx512Bf16,
    /// Widened to f32, the f32 gemm: every CPU, and the oracle.
    Widened,
}

impl Body {
    /// The name in logs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Amx => "amx-bf16",
            Self::Avx512Bf16 => "avx512-bf16",
            Self::Widened => "widened to f32",
        }
    }

    /// Whether this CPU can run the body.
    pub fn available(self) -> bool {
        match self {
            Self::Widened => true,
            Self::Avx512Bf16 => has_avx512_bf16(),
            Self::Amx => has_amx_bf16(),
        }
    }
}

/// AMX-BF16 with the tile state granted, where this process runs its
/// AVX-512 code (`PADFREE_SIMD=avx2` rules the bf16 bodies out, as on a
/// CPU without them: `kernels/simd.rs`).
fn has_amx_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        runs_avx512() && amx::has_amx_bf16()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this process runs its AVX-512 code ([`super::simd::level`]).
fn runs_avx512() -> bool {
    super::simd::level() == super::simd::Level::Avx512
}

/// AVX512-BF16 (with F, BW and VL), where this process runs its AVX-512
/// code.
fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        runs_avx512()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The body this process uses ([`choose`]), decided once.
pub fn body() -> Body {
    choice().0
}

/// Why this process multiplies bf16 values in f32 (the widened body), for
/// a one-line note in the log; `None` when it runs bf16 instructions.
pub fn widened_because() -> Option<&'static str> {
    choice().1
}

fn choice() -> (Body, Option<&'static str>) {
    static CHOICE: OnceLock<(Body, Option<&'static str>)> = OnceLock::new();
    *CHOICE.get_or_init(|| {
        let forced = std::env::var("PADFREE_BF16_MATMUL").ok();
        let (body, why) = choose(
            forced.as_deref(),
            Cpu {
                amx_bf16: Body::Amx.available(),
                avx512_bf16: Body::Avx512Bf16.available(),
                intel: packed::cpu_is_intel(),
            },
        );
        // The CPU's bf16 bodies were ruled out by the cap, not missing.
        let capped = super::simd::capped() && forced.as_deref() != Some("widened");
        let why = why.map(|why| {
            if capped {
                "PADFREE_SIMD holds padfree's kernels below AVX-512, which the bf16 bodies need: --bf16 rounds as bf16 does but multiplies in f32"
            } else {
                why
            }
        });
        (body, why)
    })
}

/// What [`choose`] reads of the CPU.
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    /// AMX-BF16 with the tile state granted by the kernel.
    pub amx_bf16: bool,
    /// AVX512-BF16 (with F, BW and VL).
    pub avx512_bf16: bool,
    /// CPUID's vendor is Intel.
    pub intel: bool,
}

/// The body for a `PADFREE_BF16_MATMUL` setting (`widened`,
/// `avx512-bf16`, `amx`; unset or anything else: by the CPU) and a CPU,
/// and why when it is the widened one. From the CPU alone (as
/// `choice` reads it: `PADFREE_SIMD` below AVX-512 hides the bf16
/// bodies), never from a timing, so that every process on a machine (a
/// resumed run) with the same settings computes the same bits. AMX first where it is there: on the same Intel Xeon
/// (family 6, model 207) with the tile state granted, its body ran the
/// 1024^3 product at 648-847 GFLOP/s against the f32 gemm's 181-298
/// (docs/benchmarks/2026-12-05-bf16-amx.md).
///
/// Intel's cores run `vdpbf16ps` on one port where they have two FMA
/// units, so it promises no more FLOPs a cycle than f32 FMA; measured on
/// an Intel Xeon (family 6, model 207, 2 cores, no AMX exposed) the
/// `vdpbf16ps` body ran the 1024^3 calibration product at 127.5 GFLOP/s
/// against the widened body's 259.7, and SmolLM2-135M trained at 128-130
/// real tokens/s against 165 (f32: 214-237). On AMD Zen 4 the same body
/// ran 1.66x f32 (docs/benchmarks/2026-12-03-bf16.md).
pub fn choose(forced: Option<&str>, cpu: Cpu) -> (Body, Option<&'static str>) {
    let Cpu {
        amx_bf16,
        avx512_bf16: has_avx512_bf16,
        intel,
    } = cpu;
    match forced {
        Some("widened") => {
            return (
                Body::Widened,
                Some(
                    "PADFREE_BF16_MATMUL=widened: --bf16 rounds as bf16 does but multiplies in f32",
                ),
            );
        }
        Some("avx512-bf16") if has_avx512_bf16 => return (Body::Avx512Bf16, None),
        Some("amx") if amx_bf16 => return (Body::Amx, None),
        _ => {}
    }
    if amx_bf16 {
        (Body::Amx, None)
    } else if !has_avx512_bf16 {
        (
            Body::Widened,
            Some(
                "this CPU has no AVX512-BF16: --bf16 rounds as bf16 does but multiplies in f32, so it runs no faster than f32",
            ),
        )
    } else if intel && forced != Some("avx512-bf16") {
        (
            Body::Widened,
            Some(
                "Intel CPUs run vdpbf16ps on one port beside two FMA units (measured at half the widened body's speed): --bf16 rounds as bf16 does but multiplies in f32; PADFREE_BF16_MATMUL=avx512-bf16 forces vdpbf16ps",
            ),
        )
    } else {
        (Body::Avx512Bf16, None)
    }
}

/// Where a `--bf16` product reads a weight: its bf16 copy, made once per
/// optimizer step, or the f32 master weight itself, rounded as it is read
/// (the same values). Which one the model makes is
/// [`reads_weight_copies`]'s answer.
#[derive(Debug, Clone)]
pub enum Weight16 {
    /// The bf16 copy, `[O, C]` like the weight.
    Copy(Arc<[bf16]>),
    /// The master weight, rounded as the product reads it.
    Master,
}

impl Weight16 {
    /// The copy where there is one, else the master weight rounded.
    pub fn of(copy: Option<&Arc<[bf16]>>) -> Self {
        copy.map_or(Self::Master, |copy| Self::Copy(copy.clone()))
    }

    /// The weight `[rows, cols]` as a product reads it: the copy, or
    /// `master` (the f32 weight's values) rounded.
    ///
    /// # Panics
    /// When the values read are fewer than `rows * cols` (a bug in the caller).
    pub(crate) fn view<'a>(&'a self, master: &'a [f32], rows: usize, cols: usize) -> View16<'a> {
        match self {
            Self::Copy(copy) => View16::bf16(copy, rows, cols),
            Self::Master => View16::f32(master, rows, cols),
        }
    }

    /// Whether a copy holds `len` values (a master weight always does).
    pub(crate) fn holds(&self, len: usize) -> bool {
        match self {
            Self::Copy(copy) => copy.len() == len,
            Self::Master => true,
        }
    }
}

/// Whether `--bf16`'s products read a bf16 copy of each weight (made once
/// per optimizer step): by default yes for the `vdpbf16ps` and AMX bodies,
/// which pack bf16 values straight from it; no for the widened body, which
/// would widen the copy to f32 again in every product, so it reads the f32
/// master weight rounded, the same values, without the copy's pass over
/// every weight each step and its 2 bytes a weight.
/// `PADFREE_BF16_WEIGHT_COPIES=0` (or `=1`) decides instead
/// ([`weight_copies_for`]).
pub fn reads_weight_copies() -> bool {
    let setting = std::env::var("PADFREE_BF16_WEIGHT_COPIES").ok();
    weight_copies_for(setting.as_deref(), body())
}

/// Whether products on `body` read weight copies, for a
/// `PADFREE_BF16_WEIGHT_COPIES` setting: `0` no, `1` yes, unset or anything
/// else the body's default. Without copies the packed bodies round the f32
/// weights as they pack them: the same bits, 2 bytes a weight less (on the
/// AMX machine of `docs/benchmarks/2026-12-05-bf16-attention-tiles.md`,
/// SmolLM2-135M's peak 250-260 MiB lower, its steps 0-8% slower).
pub fn weight_copies_for(setting: Option<&str>, body: Body) -> bool {
    match setting {
        Some("0") => false,
        Some("1") => true,
        _ => body != Body::Widened,
    }
}

/// Whether an f32 operand that two products read is best rounded once
/// into a buffer of its own first ([`View16::rounded`]): with the widened
/// body, which would otherwise widen it into a fresh buffer for each
/// product; the packed bodies round as they pack, at no extra pass.
pub(crate) fn rounds_shared_operands_once() -> bool {
    body() == Body::Widened
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
    if body == Body::Widened {
        check(a, b);
        return widened::widened_new(a, b);
    }
    product_with_buffer(body, a, b, Vec::new())
}

/// [`product_with`] by a packed body into `buffer`'s room (its values
/// dropped): the body sets every value, so it is never zeroed first.
///
/// # Panics
/// As [`product_into_with`].
fn product_with_buffer(body: Body, a: View16<'_>, b: View16<'_>, buffer: Vec<f32>) -> Vec<f32> {
    check(a, b);
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if m == 0 || n == 0 || k == 0 {
        let mut out = buffer;
        out.clear();
        out.resize(m * n, 0.0);
        return out;
    }
    packed::fresh(buffer, m, n, |dst| {
        packed_body(body, dst, n, a, OperandB::View(b), Write::Set);
    })
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
    product_into_b(body, dst, row_stride, a, (b, None), write);
}

/// [`product_into_with`] where `B` may be packed already (`packed`, of
/// the view `b`, for `body`).
fn product_into_b(
    body: Body,
    dst: &mut [f32],
    row_stride: usize,
    a: View16<'_>,
    (b, packed): (View16<'_>, Option<&packed::PackedB>),
    write: Write,
) {
    check(a, b);
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    check_destination(dst, row_stride, m, n);
    if k == 0 {
        if write == Write::Set {
            for row in dst.chunks_mut(row_stride).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    match body {
        Body::Widened => widened::widened(dst, row_stride, a, b, write),
        Body::Avx512Bf16 | Body::Amx => {
            let b = packed.map_or(OperandB::View(b), OperandB::Packed);
            packed_body(body, packed::as_uninit(dst), row_stride, a, b, write);
        }
    }
}

/// A packed body's product, `B` a view or packed already.
fn packed_body(
    body: Body,
    dst: &mut [std::mem::MaybeUninit<f32>],
    row_stride: usize,
    a: View16<'_>,
    b: OperandB<'_>,
    write: Write,
) {
    match body {
        Body::Widened => unreachable!("the widened body packs nothing"),
        Body::Avx512Bf16 => {
            assert!(has_avx512_bf16(), "bf16 gemm: this CPU has no AVX512-BF16");
            packed::packed(dst, row_stride, a, b, write);
        }
        Body::Amx => {
            assert!(has_amx_bf16(), "bf16 gemm: this CPU has no AMX-BF16");
            #[cfg(target_arch = "x86_64")]
            amx::amx(dst, row_stride, a, b, write);
        }
    }
}

/// `B` of several products, prepared once: packed for the body (the
/// head's weight, which every chunk of the cross-entropy's rows reads
/// twice: packing it per product was a third of the head's time), or the
/// view itself for the widened body, which packs nothing. The products
/// are the same bits as [`product_into_with`]'s.
pub(crate) struct PreparedB<'a> {
    view: View16<'a>,
    body: Body,
    packed: Option<packed::PackedB>,
}

/// `b` prepared for this process's body.
pub(crate) fn prepare(b: View16<'_>) -> PreparedB<'_> {
    prepare_with(body(), b)
}

/// `b` prepared for `body`.
///
/// # Panics
/// When `body` is not available on this CPU, or the view runs past its
/// values (a bug in the caller).
pub(crate) fn prepare_with(body: Body, b: View16<'_>) -> PreparedB<'_> {
    check_bounds(b);
    let blocking = match body {
        Body::Widened => None,
        Body::Avx512Bf16 => {
            assert!(has_avx512_bf16(), "bf16 gemm: this CPU has no AVX512-BF16");
            Some(&packed::BLOCKING)
        }
        #[cfg(target_arch = "x86_64")]
        Body::Amx => {
            assert!(has_amx_bf16(), "bf16 gemm: this CPU has no AMX-BF16");
            Some(&amx::BLOCKING)
        }
        #[cfg(not(target_arch = "x86_64"))]
        Body::Amx => panic!("bf16 gemm: this CPU has no AMX-BF16"),
    };
    PreparedB {
        view: b,
        body,
        packed: blocking
            .filter(|_| b.rows > 0 && b.cols > 0)
            .map(|blocking| packed::PackedB::new(b, blocking)),
    }
}

/// [`product_into`] with `B` prepared ([`prepare`]).
///
/// # Panics
/// As [`product_into_with`].
pub(crate) fn product_into_prepared(
    dst: &mut [f32],
    row_stride: usize,
    a: View16<'_>,
    b: &PreparedB<'_>,
    write: Write,
) {
    product_into_b(
        b.body,
        dst,
        row_stride,
        a,
        (b.view, b.packed.as_ref()),
        write,
    );
}

/// The bodies this CPU runs, which a kernel's tests run; a NOTE on stderr
/// names each one it cannot run, so a log says what went untested.
#[cfg(test)]
pub(crate) fn test_bodies() -> Vec<Body> {
    let all = [Body::Widened, Body::Avx512Bf16, Body::Amx];
    let available: Vec<Body> = all.into_iter().filter(|b| b.available()).collect();
    for body in all.iter().filter(|b| !b.available()) {
        eprintln!(
            "NOTE: this CPU cannot run the {} body: not tested here",
            body.name()
        );
    }
    available
}

/// `dst` holds `m` rows of `n` values, `row_stride` apart (`m >= 1`).
fn check_destination(dst: &[f32], row_stride: usize, m: usize, n: usize) {
    assert!(
        n <= row_stride && dst.len() >= (m - 1) * row_stride + n,
        "bf16 gemm: destination of {} values for [{m}, {n}] rows of {row_stride}",
        dst.len()
    );
}

fn check(a: View16<'_>, b: View16<'_>) {
    assert_eq!(
        a.cols, b.rows,
        "bf16 gemm: [{}, {}] x [{}, {}]",
        a.rows, a.cols, b.rows, b.cols
    );
    check_bounds(a);
    check_bounds(b);
}

/// `view`'s last element lies within its values.
fn check_bounds(view: View16<'_>) {
    super::gemm::check_bounds(
        "bf16 gemm",
        (view.rows, view.cols),
        (view.row_stride, view.col_stride),
        view.values.len(),
    );
}

#[cfg(test)]
mod tests {
    /// The choice from the CPU and the setting: AMX first where it is
    /// there, `vdpbf16ps` only with the instructions and on Intel only
    /// when forced; widened always says why.
    #[test]
    fn the_body_is_chosen_from_the_cpu_and_the_setting() {
        use super::{Body, Cpu, choose};
        let cpu = |amx_bf16, avx512_bf16, intel| Cpu {
            amx_bf16,
            avx512_bf16,
            intel,
        };
        let cases = [
            // (setting, AMX-BF16, AVX512-BF16, Intel) -> body
            (None, false, true, false, Body::Avx512Bf16),
            (None, false, true, true, Body::Widened),
            (None, false, false, false, Body::Widened),
            (None, false, false, true, Body::Widened),
            (None, true, true, true, Body::Amx),
            (Some("auto"), false, true, true, Body::Widened),
            (Some("auto"), true, true, true, Body::Amx),
            (Some("avx512-bf16"), false, true, true, Body::Avx512Bf16),
            (Some("avx512-bf16"), true, true, true, Body::Avx512Bf16),
            (Some("avx512-bf16"), false, false, false, Body::Widened),
            (Some("amx"), false, true, true, Body::Widened),
            (Some("amx"), true, true, true, Body::Amx),
            (Some("widened"), false, true, false, Body::Widened),
            (Some("widened"), true, true, true, Body::Widened),
        ];
        for (setting, amx, has, intel, expected) in cases {
            let (body, why) = choose(setting, cpu(amx, has, intel));
            let case = format!("{setting:?}, AMX {amx}, AVX512-BF16 {has}, Intel {intel}");
            assert_eq!(body, expected, "{case}");
            assert_eq!(why.is_some(), body == Body::Widened, "{case}: {why:?}");
        }
        assert!(
            choose(None, cpu(false, false, true))
                .1
                .is_some_and(|w| w.contains("no AVX512-BF16"))
        );
        assert!(
            choose(None, cpu(false, true, true))
                .1
                .is_some_and(|w| w.contains("Intel"))
        );
    }

    /// A process held below AVX-512 (`PADFREE_SIMD=avx2`, as CI runs
    /// these tests a second time) never chooses a body that needs it, as
    /// on a CPU without it; at AVX-512 each is there exactly when the CPU
    /// has it.
    #[test]
    fn the_bf16_bodies_need_the_avx512_level() {
        use super::super::simd::{Level, level};
        use super::{Body, runs_avx512};
        assert_eq!(runs_avx512(), level() == Level::Avx512);
        if level() < Level::Avx512 {
            assert!(!Body::Amx.available() && !Body::Avx512Bf16.available());
            assert_eq!(super::body(), Body::Widened);
            assert!(super::widened_because().is_some());
        } else {
            #[cfg(target_arch = "x86_64")]
            assert_eq!(Body::Amx.available(), super::amx::has_amx_bf16());
        }
    }

    use half::bf16;

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
        super::test_bodies()
    }

    /// `PADFREE_BF16_WEIGHT_COPIES` decides where it says 0 or 1; unset or
    /// anything else leaves the body's default (copies but for the widened
    /// body).
    #[test]
    fn weight_copies_follow_the_setting_then_the_body() {
        for body in [Body::Amx, Body::Avx512Bf16, Body::Widened] {
            assert!(!weight_copies_for(Some("0"), body));
            assert!(weight_copies_for(Some("1"), body));
            for setting in [None, Some(""), Some("yes")] {
                assert_eq!(weight_copies_for(setting, body), body != Body::Widened);
            }
        }
    }

    /// The bodies other than the oracle this CPU runs.
    fn fast_bodies() -> Vec<Body> {
        bodies()
            .into_iter()
            .filter(|&b| b != Body::Widened)
            .collect()
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
                (33, 33, 17),
                (113, 513, 65),
                (230, 1100, 97),
                (300, 200, 200),
                (70, 2100, 40),
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

    /// Operands with neither stride 1 (every other value of a wider
    /// matrix): the packings' value-by-value branches, which no layer's
    /// layout takes, against the triple loop in every body.
    #[test]
    fn every_body_reads_views_strided_both_ways() {
        for (m, k, n) in [(5, 7, 3), (40, 70, 35), (33, 1100, 20)] {
            let x = random(m * 2 * k, 41);
            let w = round_slice(&random(k * 2 * n, 42));
            fn strided(view: View16<'_>, row_stride: usize) -> View16<'_> {
                View16 {
                    row_stride,
                    col_stride: 2,
                    ..view
                }
            }
            let a = strided(View16::f32(&x, m, k), 2 * k);
            let b = strided(View16::bf16(&w, k, n), 2 * n);
            let want: Vec<f32> = naive(a, b).iter().map(|&v| v as f32).collect();
            for body in bodies() {
                let got = product_with(body, a, b);
                assert_within(
                    &format!("{body:?} strided [{m},{k},{n}]"),
                    &got,
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
        let (m, k, n) = (301, 2090, 150);
        let x = random(m * k, 4);
        let w = round_slice(&random(n * k, 5));
        let (a, b) = (View16::f32(&x, m, k), View16::bf16(&w, n, k).t());
        let stride = n + 5;
        for body in fast_bodies() {
            for write in [Write::Set, Write::Add(-0.5)] {
                let run = |body| {
                    let mut dst = vec![0.25f32; m * stride];
                    product_into_with(body, &mut dst, stride, a, b, write);
                    dst
                };
                let (fast, oracle) = (run(body), run(Body::Widened));
                assert_within(&format!("{body:?} {write:?}"), &fast, &oracle, 2e-6);
                for i in 0..m {
                    assert_eq!(&fast[i * stride + n..(i + 1) * stride], &[0.25; 5]);
                }
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
        // (The widened body's f32 gemm splits K by threads, as burn's does.)
        for body in fast_bodies() {
            let threaded = product_with(body, a, b);
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .expect("a one-thread pool");
            let single = pool.install(|| product_with(body, a, b));
            assert_eq!(threaded, single, "{body:?}");
        }
    }

    /// A row's result does not depend on where the row lies: in a whole
    /// micro-tile or an edge one, its output on a cache line or not (the
    /// AMX body stores whole tiles in place only there). Padded and
    /// flattened batches place an example's rows differently and their
    /// results are compared bit for bit. Every write mode, edge columns,
    /// two K blocks, output rows of 112 values (whole lines) of which the
    /// product sets 70, each holding a value of its row and column first.
    #[test]
    fn a_rows_result_does_not_depend_on_where_it_lies() {
        let (m, k, n, stride) = (70, 2100, 70, 112);
        // (rows moved, values off a cache line)
        let places = [(0, 0), (3, 0), (0, 5), (5, 3), (32, 0)];
        let x = random((m + 32) * k, 51);
        let w = round_slice(&random(n * k, 52));
        let b = View16::bf16(&w, n, k).t();
        for body in fast_bodies() {
            for write in [Write::Set, Write::Add(1.0), Write::Add(-0.5)] {
                // Rows `shift..shift + m` of `x`; output row `r` is `x`'s
                // row `r + shift`.
                let run = |(shift, off): (usize, usize)| {
                    let a = View16::f32(&x[shift * k..(shift + m) * k], m, k);
                    let mut buf = vec![0.0f32; 16 + off + m * stride];
                    let at = buf.as_ptr().align_offset(64).min(15) + off;
                    let dst = &mut buf[at..at + m * stride];
                    for (i, d) in dst.iter_mut().enumerate() {
                        let (r, c) = (i / stride + shift, i % stride);
                        *d = (r % 7) as f32 * 0.25 + c as f32 * 0.125;
                    }
                    product_into_with(body, dst, stride, a, b, write);
                    dst.to_vec()
                };
                let first = run(places[0]);
                for (shift, off) in places {
                    let moved = run((shift, off));
                    for r in 0..m - shift {
                        assert_eq!(
                            moved[r * stride..(r + 1) * stride],
                            first[(r + shift) * stride..(r + shift + 1) * stride],
                            "{body:?} {write:?}: row {} moved by {shift} rows, {off} values off a line",
                            r + shift
                        );
                    }
                }
            }
        }
    }

    /// The widened body reads an operand of bf16 values in place, said so
    /// (`View16::rounded`) or found so (f32 values that are bf16 already),
    /// and computes what it computes on a widened copy: the same bits, for
    /// `x W^T`, `dy W` and `dy^T x` layouts, over several K blocks (K >
    /// 4096) and several column blocks of B, into a fresh buffer and into
    /// one set or added to; and within 1e-5 of the largest value (K up to
    /// 4200 f32 sums) of the f64 triple loop.
    #[test]
    fn rounded_operands_are_read_in_place_with_the_same_result() {
        use crate::kernels::bf16::rounded;
        for (m, k, n) in [(3, 4200, 1100), (70, 300, 45), (1, 1, 1)] {
            let x: Vec<f32> = random(m * k, 21).into_iter().map(rounded).collect();
            let w = round_slice(&random(n * k, 22));
            let dy: Vec<f32> = random(m * n, 23).into_iter().map(rounded).collect();
            let cases = [
                ("x W^T", (&x, m, k), View16::bf16(&w, n, k).t()),
                ("dy W", (&dy, m, n), View16::bf16(&w, n, k)),
            ];
            for (what, (a_values, rows, cols), b) in cases {
                let said = View16::rounded(a_values, rows, cols);
                let found = View16::f32(a_values, rows, cols);
                // A bf16 copy of the same values is always widened.
                let a16 = round_slice(a_values);
                let copied = View16::bf16(&a16, rows, cols);
                let want = product_with(Body::Widened, copied, b);
                for (how, a) in [("said", said), ("found", found)] {
                    assert_eq!(
                        product_with(Body::Widened, a, b),
                        want,
                        "{what} {how} [{m},{k},{n}]"
                    );
                    for write in [Write::Set, Write::Add(0.5)] {
                        let mut ours = vec![0.75f32; rows * b.cols];
                        let mut theirs = ours.clone();
                        product_into_with(Body::Widened, &mut ours, b.cols, a, b, write);
                        product_into_with(Body::Widened, &mut theirs, b.cols, copied, b, write);
                        assert_eq!(ours, theirs, "{what} {how} {write:?} [{m},{k},{n}]");
                    }
                }
                let exact: Vec<f32> = naive(copied, b).iter().map(|&v| v as f32).collect();
                assert_within(&format!("{what} [{m},{k},{n}]"), &want, &exact, 1e-5);
            }
            // dy^T x: both operands transposed or strided, both rounded.
            let (a, b) = (View16::rounded(&dy, m, n).t(), View16::f32(&x, m, k));
            let (dy16, x16) = (round_slice(&dy), round_slice(&x));
            let copied = (View16::bf16(&dy16, m, n).t(), View16::bf16(&x16, m, k));
            assert_eq!(
                product_with(Body::Widened, a, b),
                product_with(Body::Widened, copied.0, copied.1),
                "dy^T x [{m},{k},{n}]"
            );
        }
    }

    /// The product into a fresh buffer (written once, never zeroed) is the
    /// product set into a buffer, bit for bit, for every body, with one
    /// column block or several, one K block or several, edge tiles, `x W^T`
    /// and `dy^T x` layouts; the packed bodies' fresh buffer is handed in
    /// holding NaNs, so a value they left unwritten would show.
    #[test]
    fn a_fresh_product_is_the_product_set_into_a_buffer() {
        for (m, k, n) in [(5, 5000, 40), (4, 4100, 1100), (9, 33, 17), (70, 2100, 45)] {
            let x = random(m * k, 31);
            let w = round_slice(&random(n * k, 32));
            for (a, b) in [
                (View16::f32(&x, m, k), View16::bf16(&w, n, k).t()),
                (View16::f32(&x, k, m).t(), View16::bf16(&w, k, n)),
            ] {
                for body in bodies() {
                    let mut set = vec![f32::NAN; m * n];
                    product_into_with(body, &mut set, n, a, b, Write::Set);
                    let case = format!("{body:?} [{m},{k},{n}]");
                    assert_eq!(product_with(body, a, b), set, "{case}");
                    if body != Body::Widened {
                        // Into room that held NaNs: a value left unwritten shows.
                        let stale = vec![f32::NAN; m * n + 64];
                        let fresh = product_with_buffer(body, a, b, stale);
                        assert_eq!(fresh, set, "{case}, room of NaNs");
                    }
                }
            }
        }
    }

    /// `B` prepared once gives the bits of `B` packed in each product, for
    /// the head's two layouts (`x W^T`, `dy W`), over several K blocks of
    /// both packed bodies (K 2,100 > 1,024 and 512), in every write mode,
    /// one `B` for several `A`s of different row counts (the head's chunks),
    /// and an empty `A`. Each product runs after a bigger one, so the
    /// threads' reused packing buffers hold stale values of another shape.
    #[test]
    fn a_prepared_b_gives_the_products_of_b_packed_each_time() {
        let (k, n) = (2100, 70);
        let w = round_slice(&random(n * k, 61));
        let big = random(300 * 300, 62);
        for body in bodies() {
            for (name, b) in [
                ("W^T", View16::bf16(&w, n, k).t()),
                ("W", View16::bf16(&w, k, n)),
            ] {
                let prepared = prepare_with(body, b);
                for m in [45, 1, 0, 33] {
                    let x = random(m * b.rows, 63 + m as u64);
                    let a = View16::f32(&x, m, b.rows);
                    for write in [Write::Set, Write::Add(1.0), Write::Add(-0.5)] {
                        let run = |prepared: Option<&PreparedB<'_>>| {
                            let _ = product_with(
                                body,
                                View16::f32(&big, 300, 300),
                                View16::f32(&big, 300, 300),
                            );
                            let mut dst = vec![0.25f32; m * (b.cols + 3)];
                            match prepared {
                                Some(p) => product_into_prepared(&mut dst, b.cols + 3, a, p, write),
                                None => product_into_with(body, &mut dst, b.cols + 3, a, b, write),
                            }
                            dst
                        };
                        assert_eq!(
                            run(Some(&prepared)),
                            run(None),
                            "{body:?} {name} [{m}, {}] {write:?}",
                            b.rows
                        );
                    }
                }
            }
        }
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
