//! Model FLOPs of a training step, and the machine's peak to hold them to
//! (model FLOP utilisation, MFU).
//!
//! Counted as useful work, the same for every attention mode: a padded batch
//! does more arithmetic (on pads) for the same model FLOPs, so its MFU is
//! lower, as it should be. Forward and backward together are three times the
//! forward pass (the backward pass of a matmul is two matmuls of its size).
//!
//! - Layers: `6 x P x T`, with `P` the matmul parameters of the decoder
//!   layers (q, k, v, o, gate, up, down; from the parameter table) and `T`
//!   the real tokens.
//! - LM head: `6 x V x C x K`, `K` the rows that get logits (the labelled
//!   ones; `LlamaModel::loss_sum` computes no others).
//! - Attention: `6 x layers x H x D x sum(len^2)`: per head and example of
//!   `len` tokens, `q k^T` over the causal triangle is `len^2 / 2` dot
//!   products of `D` multiply-adds (`D x len^2` FLOPs), `p v` the same, and
//!   the backward pass twice the forward.
//!
//! Embedding lookups, norms, RoPE, the softmax and the optimizer are left
//! out: they are memory-bound and small next to the matmuls (PaLM's
//! convention).

use std::time::Instant;

use crate::config::LlamaConfig;
use crate::tensor::{Tensor, cpu_device, float_tensor};
use crate::weights::table::param_specs;

/// Matmul parameters of the decoder layers, `P` (norm vectors excluded).
pub fn layer_matmul_params(config: &LlamaConfig) -> usize {
    param_specs(config)
        .iter()
        .filter(|spec| spec.hf_name.starts_with("model.layers.") && spec.hf_shape.len() == 2)
        .map(|spec| spec.numel())
        .sum()
}

/// What a training step processed, for its model FLOPs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepWork {
    /// Real (non-pad) tokens, `T`.
    pub real_tokens: usize,
    /// Sum over examples of the squared example length.
    pub sum_squared_lengths: u64,
    /// Rows that carry a label (and so get logits), `K`.
    pub label_tokens: usize,
}

/// Model FLOPs of a training step (forward and backward) that did `work`.
pub fn training_flops(config: &LlamaConfig, work: StepWork) -> f64 {
    let layers = 6.0 * layer_matmul_params(config) as f64 * work.real_tokens as f64;
    let head = 6.0 * (config.vocab_size * config.hidden_size) as f64 * work.label_tokens as f64;
    let attention = 6.0
        * (config.num_hidden_layers * config.num_attention_heads * config.head_dim) as f64
        * work.sum_squared_lengths as f64;
    layers + head + attention
}

/// GFLOP/s of an `n x n` by `n x n` f32 matmul through the same backend the
/// model runs on (burn's Flex, gemm), best of `repeats` after one warm-up,
/// on the calling thread pool.
pub fn calibrate_matmul_gflops(n: usize, repeats: usize) -> f64 {
    let device = cpu_device(false);
    let values = |seed: usize| -> Vec<f32> {
        (0..n * n)
            .map(|i| ((i * 7 + seed * 13) % 17) as f32 / 17.0 - 0.5)
            .collect()
    };
    let a: Tensor<2> = float_tensor(values(1), [n, n], &device);
    let b: Tensor<2> = float_tensor(values(2), [n, n], &device);
    let mut best = f64::INFINITY;
    for round in 0..=repeats {
        let started = Instant::now();
        // Reading the result back makes sure the product was computed.
        let product = a.clone().matmul(b.clone()).into_data();
        let seconds = started.elapsed().as_secs_f64();
        std::hint::black_box(product);
        if round > 0 {
            best = best.min(seconds);
        }
    }
    2.0 * (n as f64).powi(3) / best.max(1e-12) / 1e9
}

/// GFLOP/s of an `n x n` by `n x n` product with bf16 operands and f32
/// accumulation through `--bf16`'s kernel (`kernels/gemm_bf16/`: the
/// AVX512-BF16 body where the CPU has it), best of `repeats` after one
/// warm-up, on the calling thread pool: the peak `--bf16` runs' MFU is
/// also measured against.
pub fn calibrate_bf16_matmul_gflops(n: usize, repeats: usize) -> f64 {
    use crate::kernels::gemm_bf16::{View16, product};
    let values = |seed: usize| -> Vec<f32> {
        (0..n * n)
            .map(|i| ((i * 7 + seed * 13) % 17) as f32 / 17.0 - 0.5)
            .collect()
    };
    let a = crate::kernels::bf16::round_slice(&values(1));
    let b = crate::kernels::bf16::round_slice(&values(2));
    let mut best = f64::INFINITY;
    for round in 0..=repeats {
        let started = Instant::now();
        let out = product(View16::bf16(&a, n, n), View16::bf16(&b, n, n));
        let seconds = started.elapsed().as_secs_f64();
        std::hint::black_box(out);
        if round > 0 {
            best = best.min(seconds);
        }
    }
    2.0 * (n as f64).powi(3) / best.max(1e-12) / 1e9
}

/// The vector units and clock this process runs on, where the OS says.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuPeak {
    /// f32 FLOPs per cycle per core: 2 FMA units x lanes x 2.
    pub flops_per_cycle: f64,
    /// What the lanes are (`AVX-512`, `AVX2+FMA`, ...).
    pub vector_isa: &'static str,
    /// Clock in GHz (`cpu MHz` of /proc/cpuinfo: the nominal or current one).
    pub ghz: f64,
}

impl CpuPeak {
    /// The running CPU's, or `None` where its clock or vector width is not
    /// known (not x86-64, no /proc/cpuinfo).
    pub fn detect() -> Option<Self> {
        let (flops_per_cycle, vector_isa) = vector_flops_per_cycle()?;
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        let mhz: f64 = cpuinfo
            .lines()
            .find(|line| line.starts_with("cpu MHz"))?
            .split(':')
            .nth(1)?
            .trim()
            .parse()
            .ok()?;
        Some(Self {
            flops_per_cycle,
            vector_isa,
            ghz: mhz / 1000.0,
        })
    }

    /// Theoretical peak GFLOP/s of `threads` cores.
    pub fn gflops(&self, threads: usize) -> f64 {
        self.flops_per_cycle * self.ghz * threads as f64
    }
}

/// Assumes two FMA units per core, as on every x86-64 server core since
/// Haswell / Zen 2 (some AVX-512 parts have one 512-bit unit: their peak is
/// half of this, so an MFU against it is a lower bound).
#[cfg(target_arch = "x86_64")]
fn vector_flops_per_cycle() -> Option<(f64, &'static str)> {
    if std::arch::is_x86_feature_detected!("avx512f") {
        Some((2.0 * 16.0 * 2.0, "AVX-512"))
    } else if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        Some((2.0 * 8.0 * 2.0, "AVX2+FMA"))
    } else {
        Some((2.0 * 4.0, "SSE2"))
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn vector_flops_per_cycle() -> Option<(f64, &'static str)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_follow_the_stated_formula() {
        let config = LlamaConfig::tiny();
        let (c, i, v) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
        );
        let (h, hkv, d) = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        );
        let per_layer = c * h * d * 2 + c * hkv * d * 2 + 3 * c * i;
        assert_eq!(
            layer_matmul_params(&config),
            config.num_hidden_layers * per_layer
        );
        // Two examples of 3 and 5 tokens, 6 labelled rows.
        let work = StepWork {
            real_tokens: 8,
            sum_squared_lengths: 9 + 25,
            label_tokens: 6,
        };
        let expected = 6.0 * (config.num_hidden_layers * per_layer * 8) as f64
            + 6.0 * (v * c * 6) as f64
            + 6.0 * (config.num_hidden_layers * h * d * 34) as f64;
        assert_eq!(training_flops(&config, work), expected);
    }

    #[test]
    fn the_calibration_matmul_measures_a_positive_rate() {
        let gflops = calibrate_matmul_gflops(64, 2);
        assert!(gflops.is_finite() && gflops > 0.0, "{gflops}");
    }
}
