//! The same training, bit for bit, at every SIMD level this CPU runs.
//!
//! padfree's host kernels are compiled once per instruction set and chosen
//! at run time (`padfree_model::kernels::simd_dispatch`), and their sums
//! have a fixed order, so an AVX-512 machine, an AVX2 one and a baseline
//! x86-64 one should train the same bits: a checkpoint resumes the same
//! wherever it goes. `PADFREE_SIMD` caps the level a process runs, so one
//! machine runs every version: this test trains the same short f32 and
//! `--bf16` runs in a child process at each level and compares the bits
//! of every step's loss and every final weight.
//!
//! The `--bf16` runs force the widened body (`PADFREE_BF16_MATMUL`) at
//! every level: the AMX and `vdpbf16ps` bodies need AVX-512 and sum in
//! another order (their own tests compare them with the widened body).
//! The `gemm` crate's f32 kernels choose their own instruction set; they
//! are the same in every child.

use std::process::Command;

use padfree_model::kernels::{SimdLevel, simd_detected};
use padfree_model::tensor::{IntoHostVec, cpu_device};
use padfree_model::{LlamaConfig, LlamaModel, Precision};
use padfree_train::outputs::prepare_output_dir;
use padfree_train::{AttentionMode, TrainConfig, Trainer};

mod common;
use common::{examples, scratch_dir};

/// The test, which runs itself as the child.
const TEST: &str = "every_simd_level_trains_the_same_bits";
/// Set in the child's environment: train and print the digest.
const CHILD: &str = "PADFREE_SIMD_LEVELS_CHILD";
/// The line the child prints its digest on.
const DIGEST: &str = "SIMD-LEVEL-DIGEST";

/// Widths that are not multiples of the vector lanes (16 f32 values), so
/// that every kernel's remainder runs too: hidden 72 (3 heads of 24 over
/// one key/value head), MLP 100, vocabulary 131.
fn model_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 131,
        hidden_size: 72,
        intermediate_size: 100,
        num_attention_heads: 3,
        num_key_value_heads: 1,
        head_dim: 24,
        ..LlamaConfig::tiny()
    }
}

/// FNV-1a over `bits`, as 16 hex digits.
fn fnv(bits: impl IntoIterator<Item = u64>) -> u64 {
    bits.into_iter().fold(0xcbf2_9ce4_8422_2325, |hash, word| {
        word.to_le_bytes().iter().fold(hash, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    })
}

/// Six steps of `precision` training from a seeded model: each step's
/// loss and every final weight, hashed, and the last loss.
fn train_digest(precision: Precision) -> (u64, f64) {
    let dir = scratch_dir(&format!("simd-levels-{}", precision.name()));
    prepare_output_dir(dir.path(), false, false).expect("output dir");
    let model = LlamaModel::init(&model_config(), 7, &cpu_device(true)).expect("model");
    let config = TrainConfig {
        precision,
        ..common::config(AttentionMode::Varlen, 6)
    };
    let mut t = Trainer::new(model, examples(40, 131, 11), config, dir.path(), Vec::new())
        .expect("trainer");
    t.train(&mut ()).expect("trains");
    let losses = t.step_losses().to_vec();
    let weights: Vec<u64> = t
        .model()
        .params()
        .into_iter()
        .flat_map(|p| p.value.clone().into_vec())
        .map(|w| u64::from(w.to_bits()))
        .collect();
    let bits = losses.iter().map(|l| l.to_bits()).chain(weights);
    (fnv(bits), *losses.last().expect("six steps"))
}

/// The child's part, in a process with `PADFREE_SIMD` set: prints the
/// digests of an f32 and a `--bf16` run.
fn print_the_bits_of_this_level() {
    let level = padfree_model::kernels::simd_level().name();
    let (f32_digest, f32_loss) = train_digest(Precision::F32);
    let (bf16_digest, bf16_loss) = train_digest(Precision::Bf16);
    println!(
        "{DIGEST} {level} f32 {f32_digest:016x} bf16 {bf16_digest:016x} (last losses {f32_loss} and {bf16_loss})"
    );
}

#[test]
fn every_simd_level_trains_the_same_bits() {
    if std::env::var_os(CHILD).is_some() {
        print_the_bits_of_this_level();
        return;
    }
    let levels: Vec<SimdLevel> = SimdLevel::ALL
        .into_iter()
        .filter(|&l| l <= simd_detected())
        .collect();
    if levels.len() < 2 {
        eprintln!("NOTE: this CPU runs one SIMD level only: nothing to compare");
    }
    let exe = std::env::current_exe().expect("this test's executable");
    let mut digests = Vec::new();
    for level in &levels {
        let out = Command::new(&exe)
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env("PADFREE_SIMD", level.name())
            .env("PADFREE_BF16_MATMUL", "widened")
            .output()
            .expect("runs the child");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the child at {} failed:\n{stdout}\n{}",
            level.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        // The harness prints the test's name on the same line first.
        let line = stdout
            .lines()
            .find_map(|l| l.find(DIGEST).map(|at| l[at..].to_owned()))
            .unwrap_or_else(|| panic!("no digest from the child at {}:\n{stdout}", level.name()));
        eprintln!("{line}");
        let mut words = line.split_whitespace();
        assert_eq!(words.nth(1), Some(level.name()), "the child ran {line}");
        let bits: Vec<&str> = words.take(4).collect();
        digests.push((level.name(), bits.join(" ")));
    }
    for (name, digest) in &digests[1..] {
        assert_eq!(
            digest, &digests[0].1,
            "{name} trained other bits than {}",
            digests[0].0
        );
    }
}
