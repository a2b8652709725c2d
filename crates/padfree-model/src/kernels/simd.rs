//! Run-time SIMD for the host kernels, without `unsafe`.
//!
//! A kernel body runs inside [`dispatch`], which calls it from a function
//! compiled for the best instruction set this CPU has (AVX-512 or AVX2+FMA
//! on x86-64, through `pulp::Arch`, already in the tree for gemm); the body
//! and the helpers here are `#[inline(always)]`, so LLVM vectorises them for
//! that set. The binary itself stays built for baseline x86-64 and runs on
//! every machine.
//!
//! Results do not depend on the instruction set: Rust never fuses a multiply
//! and an add on its own, and every sum here has a fixed order (eight
//! independent lanes, then the lanes in order), so an AVX-512 machine and an
//! AVX2 one compute the same bits. `PADFREE_SIMD=avx2` or `=baseline`
//! ([`level`]) runs the lower versions on a CPU that has more: CI runs the
//! kernel and trainer tests at each level, and
//! `padfree-train/tests/simd_levels.rs` trains the same bits at each.

/// Runs `body` compiled for this process's instruction set ([`level`]:
/// the best available, or lower where `PADFREE_SIMD` says so); also the
/// optimizer's host update in padfree-train, as `kernels::simd_dispatch`.
#[inline(always)]
pub fn dispatch<R>(body: impl FnOnce() -> R) -> R {
    arch().dispatch(body)
}

/// The instruction sets [`dispatch`] compiles a body for, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The binary's baseline (x86-64: SSE2), or a CPU that is not x86-64.
    Baseline,
    /// AVX2 and FMA (x86-64-v3).
    Avx2,
    /// AVX-512 F, BW, CD, DQ and VL (x86-64-v4).
    Avx512,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Self; 3] = [Self::Baseline, Self::Avx2, Self::Avx512];

    /// The name in logs, and in `PADFREE_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }

    /// The level a `PADFREE_SIMD` value names, if any.
    pub fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|level| level.name() == name)
    }
}

/// The level this process's kernels run: [`level_for`] of `PADFREE_SIMD`
/// and the CPU, decided once. `PADFREE_SIMD=avx2` (or `baseline`) runs
/// the code an AVX2 machine (or any x86-64) runs, on a CPU that has more,
/// so that one machine tests every version of each kernel; `padfree`'s
/// bf16 bodies that need AVX-512 (`gemm_bf16`) are then not chosen
/// either. The `gemm` crate's f32 kernels choose their own.
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let setting = std::env::var("PADFREE_SIMD").ok();
        level_for(setting.as_deref(), detected())
    })
}

/// Whether `PADFREE_SIMD` holds this process below what its CPU has (for
/// a note in the log).
pub fn capped() -> bool {
    level() < detected()
}

/// The level for a `PADFREE_SIMD` setting on a CPU that runs `detected`
/// at best: the setting where the CPU has it, `detected` for anything
/// else (unset, `best`, a level above the CPU's, a typo).
pub fn level_for(setting: Option<&str>, detected: Level) -> Level {
    setting
        .and_then(Level::named)
        .map_or(detected, |wanted| wanted.min(detected))
}

/// The best level this CPU runs.
pub fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    match pulp::Arch::new() {
        pulp::Arch::V4(_) => Level::Avx512,
        pulp::Arch::V3(_) => Level::Avx2,
        _ => Level::Baseline,
    }
    #[cfg(not(target_arch = "x86_64"))]
    Level::Baseline
}

/// pulp's dispatcher for [`level`].
#[inline(always)]
fn arch() -> pulp::Arch {
    #[cfg(target_arch = "x86_64")]
    {
        match level() {
            Level::Avx512 => pulp::Arch::new(),
            Level::Avx2 => pulp::x86::V3::try_new().map_or(pulp::Arch::Scalar, pulp::Arch::V3),
            Level::Baseline => pulp::Arch::Scalar,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    pulp::Arch::new()
}

/// `e^x` in f32 without a libm call, so that loops of it vectorise:
/// Cody-Waite reduction `x = n ln 2 + r`, `|r| <= ln 2 / 2`, Cephes' degree-6
/// polynomial for `e^r` (relative error about 1e-7), and `2^n` from the
/// exponent bits. Inputs are clamped to the normal range: below about -87.3
/// it returns the smallest normal (~1.2e-38) instead of a subnormal or 0.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
    // (no `round` call, which baseline x86-64 has no instruction for).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.33, 88.72);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    e_r * scale
}

/// Dot product in eight independent lanes, so it vectorises without
/// reassociating a single running sum.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `sum(a * b * c)`, each product `(a * b) * c`, in eight independent
/// lanes as [`dot`] (RMSNorm's backward: `sum(dy * weight * x)` per row).
#[inline(always)]
pub(crate) fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a_chunks, b_chunks, c_chunks) = (a.chunks_exact(8), b.chunks_exact(8), c.chunks_exact(8));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .zip(c_chunks.remainder())
        .map(|((x, y), z)| x * y * z)
        .sum();
    for ((x, y), z) in a_chunks.zip(b_chunks).zip(c_chunks) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane] * z[lane];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `sum(e^(x - shift))` over `row`, in eight lanes (vectorised exp and sum).
#[inline(always)]
pub(crate) fn sum_exp(row: &[f32], shift: f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|&x| exp(x - shift)).sum();
    for chunk in chunks {
        for lane in 0..8 {
            lanes[lane] += exp(chunk[lane] - shift);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// The largest value of `row` (`-inf` when empty), in sixteen lanes: a
/// single running maximum does not vectorise.
#[inline(always)]
pub(crate) fn max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for chunk in chunks {
        for lane in 0..16 {
            lanes[lane] = lanes[lane].max(chunk[lane]);
        }
    }
    lanes.iter().copied().fold(tail, f32::max)
}

/// Every `x` of `row` replaced by `e^(x - shift)`; returns their sum, in
/// sixteen lanes (the softmax's numerators and denominator in one pass).
#[inline(always)]
pub(crate) fn exp_in_place(row: &mut [f32], shift: f32) -> f32 {
    let mut lanes = [0.0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for chunk in &mut chunks {
        for lane in 0..16 {
            chunk[lane] = exp(chunk[lane] - shift);
            lanes[lane] += chunk[lane];
        }
    }
    // The tail through one padded chunk, so that its exponentials are
    // vectorised too (scalar ones cost as much as a long row's body).
    let rest = chunks.into_remainder();
    let mut chunk = [shift; 16];
    chunk[..rest.len()].copy_from_slice(rest);
    for x in &mut chunk {
        *x = exp(*x - shift);
    }
    for (lane, (x, &e)) in rest.iter_mut().zip(&chunk).enumerate() {
        *x = e;
        lanes[lane] += e;
    }
    lanes.iter().sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_the_library_to_a_few_ulps() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let ours = f64::from(exp(x));
            let exact = f64::from(x).exp();
            worst = worst.max((ours - exact).abs() / exact);
            x += 0.013;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1.2e-38 && exp(-1000.0) > 0.0);
        assert!(exp(f32::MIN) >= 0.0);
    }

    /// Every body handed to `dispatch` in the workspace's sources is a
    /// closure written there with `#[inline(always)]`. A body LLVM does not inline stays a
    /// function of its own, built for the baseline: RMSNorm's and the
    /// embedding gradient's bodies ran SSE code that way inside
    /// `dispatch`, with the same bits, so no level test could tell.
    #[test]
    fn dispatched_closures_are_inlined() {
        fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for entry in std::fs::read_dir(dir).expect("a source folder").flatten() {
                let path = entry.path();
                if path.is_dir() {
                    sources(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    out.push(path);
                }
            }
        }
        let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        for krate in std::fs::read_dir(&crates)
            .expect("the workspace's crates")
            .flatten()
        {
            let src = krate.path().join("src");
            if src.is_dir() {
                sources(&src, &mut files);
            }
        }
        let (mut calls, mut bare) = (0, Vec::new());
        for file in &files {
            let text = std::fs::read_to_string(file).expect("a source file");
            for (at, _) in text.match_indices("dispatch(") {
                let after = text[at + "dispatch(".len()..].trim_start();
                // This scan's own strings, and `dispatch` itself handing on
                // its caller's body.
                if after.starts_with('"') || after.starts_with("body)") {
                    continue;
                }
                calls += 1;
                // A closure without the attribute, or a body passed by name
                // (a closure variable, which cannot carry it).
                if !after.starts_with("#[inline(always)]") {
                    let line = text[..at].lines().count();
                    bare.push(format!("{}:{line}", file.display()));
                }
            }
        }
        assert!(
            calls > 20,
            "found only {calls} dispatch calls: the scan is broken"
        );
        assert!(
            bare.is_empty(),
            "closures not #[inline(always)] in dispatch: {bare:?}"
        );
    }

    /// `PADFREE_SIMD` lowers the level where the CPU has the one asked
    /// for, and never raises it; anything else leaves the CPU's best.
    #[test]
    fn the_level_is_the_setting_capped_by_the_cpu() {
        use Level::{Avx2, Avx512, Baseline};
        let cases = [
            (None, Avx512, Avx512),
            (Some("baseline"), Avx512, Baseline),
            (Some("avx2"), Avx512, Avx2),
            (Some("avx512"), Avx512, Avx512),
            (Some("avx512"), Avx2, Avx2),
            (Some("avx2"), Baseline, Baseline),
            (Some("AVX2"), Avx512, Avx512),
            (Some("best"), Avx2, Avx2),
            (Some(""), Baseline, Baseline),
        ];
        for (setting, cpu, expected) in cases {
            assert_eq!(level_for(setting, cpu), expected, "{setting:?} on {cpu:?}");
        }
        assert!(level() <= detected());
        assert_eq!(capped(), level() < detected());
    }

    /// The helpers give the same bits inlined into the dispatched body
    /// (this CPU's level) as in plain code. `run` is an `#[inline(always)]`
    /// function: as a closure called from both places it was not inlined
    /// into `dispatch`, so both sides ran the same baseline code.
    #[test]
    fn dispatched_code_computes_what_plain_code_does() {
        #[inline(always)]
        fn run(a: &[f32], b: &[f32]) -> [f32; 5] {
            let mut e = a.to_vec();
            let sum = exp_in_place(&mut e, 0.5);
            [dot(a, b), dot3(a, b, a), sum_exp(a, 0.5), max(a), sum]
        }
        let a: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..67).map(|i| (i as f32 * 0.11).cos()).collect();
        let plain = run(&a, &b);
        let dispatched = dispatch(
            #[inline(always)]
            || run(&a, &b),
        );
        for (p, d) in plain.iter().zip(&dispatched) {
            assert_eq!(p.to_bits(), d.to_bits());
        }
    }

    /// The lane-wise reductions against plain loops: the maximum exactly
    /// (any order gives it), the exponentials bit for bit, and their sum
    /// within f32 reordering.
    #[test]
    fn lane_reductions_match_plain_loops() {
        for n in [0usize, 1, 15, 16, 17, 67, 300] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let plain_max = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&a).to_bits(), plain_max.to_bits(), "max of {n}");
            let mut e = a.clone();
            let sum = exp_in_place(&mut e, plain_max);
            let mut plain_sum = 0.0f64;
            for (x, y) in a.iter().zip(&e) {
                assert_eq!(y.to_bits(), exp(x - plain_max).to_bits());
                plain_sum += f64::from(*y);
            }
            assert!(
                (f64::from(sum) - plain_sum).abs() <= 1e-6 * plain_sum.max(1.0),
                "sum of {n}"
            );
        }
    }

    /// The eight-lane products against f64 sums: within f32 reordering, at
    /// lengths with and without a tail.
    #[test]
    fn lane_products_match_f64_sums() {
        for n in [0usize, 1, 7, 8, 9, 67, 576] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| 0.5 + (i as f32 * 0.11).cos()).collect();
            let c: Vec<f32> = (0..n).map(|i| (i as f32 * 0.23).cos() - 0.2).collect();
            let (mut two, mut three, mut size) = (0.0f64, 0.0f64, 0.0f64);
            for ((&x, &y), &z) in a.iter().zip(&b).zip(&c) {
                two += f64::from(x) * f64::from(y);
                three += f64::from(x) * f64::from(y) * f64::from(z);
                size += (f64::from(x) * f64::from(y) * f64::from(z)).abs() + f64::from(x * y).abs();
            }
            let tolerance = 1e-6 * size.max(1.0);
            assert!(
                (f64::from(dot(&a, &b)) - two).abs() <= tolerance,
                "dot of {n}"
            );
            assert!(
                (f64::from(dot3(&a, &b, &c)) - three).abs() <= tolerance,
                "dot3 of {n}"
            );
        }
    }
}
