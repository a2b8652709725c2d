//! `padfree bench --attention-alone`: the varlen attention op by itself,
//! forward and backward, on the device, over the micro-batches the varlen
//! mode trains on (the data's examples in their order,
//! `--per-device-train-batch-size` at a time) with the model's head shape:
//! the tiled kernels, the per-row kernels they replaced (on a GPU; on the
//! CPU both rows are the host kernel), on a GPU with grouped heads the
//! tiled kernels with one query head a workgroup (the layout before a
//! workgroup took a group's heads together), and under `--bf16` on a GPU
//! the tiled kernels reading 16-bit inputs. Writes `attention.md` and
//! `attention.json` into the output directory.
//!
//! Each call is timed from its inputs' upload to a scalar of its
//! gradients read back (which waits for the device); the inputs are random
//! (the attention's cost does not depend on the values). Before any row is
//! timed, every row runs every micro-batch once untimed, so no row's time
//! holds kernel compilation.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use padfree_model::kernels::{
    AttentionRows, half_varlen_attention, per_row_varlen_attention, tiled_by_head_varlen_attention,
    varlen_attention,
};
use padfree_model::tensor::{Device, IntoHostVec, Tensor, backward, float_tensor, grad, trainable};
use padfree_model::{HalfFloat, LlamaConfig, ModelError};
use padfree_pack::{BatchMeta, SplitMix64};
use padfree_train::checkpoint::write_atomically;
use serde::Serialize;

use crate::args::{BenchJob, BenchMode};
use crate::commands::load::load;

/// One kernel's timing over the timed micro-batches.
#[derive(Debug, Clone, Serialize)]
pub struct KernelTiming {
    /// `tiled f32`, `per-row f32`, `tiled f32, a head a workgroup`, `tiled f16`, ...
    pub kernel: String,
    /// Micro-batches timed (after the warm-up ones).
    pub calls: usize,
    /// Seconds of all timed calls, forward and backward, one layer each.
    pub seconds: f64,
    /// Mean milliseconds of one layer's forward and backward.
    pub ms_per_call: f64,
    /// The same for every layer of a step: `ms_per_call x layers`.
    pub ms_per_step: f64,
    /// Attention FLOPs per second: `6 H D sum(L^2)` a call (forward and
    /// backward, as `padfree_model::flops` counts the attention).
    pub gflops: f64,
}

#[derive(Debug, Clone, Serialize)]
struct AttentionReport {
    device: String,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
    batch: usize,
    tokens_per_call: f64,
    timings: Vec<KernelTiming>,
}

#[derive(Debug, Clone, Copy)]
enum Kernel {
    Tiled,
    PerRow,
    TiledByHead,
    Half(HalfFloat),
}

impl Kernel {
    fn name(self) -> String {
        match self {
            Self::Tiled => "tiled f32".into(),
            Self::PerRow => "per-row f32".into(),
            Self::TiledByHead => "tiled f32, a head a workgroup".into(),
            Self::Half(half) => format!("tiled {}", half.name()),
        }
    }
}

/// Runs the attention alone for `job`'s model, data and device.
pub fn run(job: &BenchJob) -> anyhow::Result<()> {
    let train = job.train_job(BenchMode {
        attention: padfree_train::AttentionMode::Varlen,
        multipack: false,
        ranks: 1,
    })?;
    let loaded = load(&train, None)?;
    let config = loaded.model.config().clone();
    let device = loaded.model.device().clone().inner();
    let lengths = loaded.dataset.examples.lengths();
    let batch = job.per_device_train_batch_size.max(1);
    let batches: Vec<Vec<usize>> = lengths
        .chunks(batch)
        .map(<[usize]>::to_vec)
        .take(job.timing_warmup_steps + job.max_steps)
        .collect();
    if batches.len() <= job.timing_warmup_steps {
        anyhow::bail!(
            "the data holds {} micro-batches of {batch}, none left after {} warm-up ones\nHINT: lower --timing-warmup-steps or --per-device-train-batch-size",
            batches.len(),
            job.timing_warmup_steps
        );
    }
    let mut kernels = vec![Kernel::Tiled, Kernel::PerRow];
    if job.device.is_gpu() && config.num_attention_heads > config.num_key_value_heads {
        kernels.push(Kernel::TiledByHead);
    }
    if job.precision == padfree_model::Precision::Bf16 {
        match padfree_model::device::half_float(&device) {
            Some(half) => kernels.push(Kernel::Half(half)),
            None => println!(
                "--bf16: the 16-bit attention runs on a GPU with bf16 or f16; this device has none, so its row is left out"
            ),
        }
    }
    let timed = &batches[job.timing_warmup_steps..];
    let squares: f64 = timed
        .iter()
        .flatten()
        .map(|&l| (l as f64) * (l as f64))
        .sum();
    let tokens: usize = timed.iter().flatten().sum();
    let flops = 6.0 * (config.num_attention_heads * config.head_dim) as f64 * squares;
    // Every row first runs every micro-batch once, untimed: kernels compiled
    // for a shape (the runtime's own reductions and casts of the harness)
    // are compiled there, for all rows alike. Without it the first row paid
    // for them: on an H200 the tiled f32 row read 255 ms a call, then the
    // 16-bit row, on the same shapes, 4.6 ms.
    for &kernel in &kernels {
        for (i, lengths) in batches.iter().enumerate() {
            one_call(&config, &device, lengths, kernel, i as u64)
                .with_context(|| format!("attention alone, {} (untimed pass)", kernel.name()))?;
        }
    }
    let mut timings = Vec::new();
    for kernel in kernels {
        let mut seconds = 0.0;
        for (i, lengths) in batches.iter().enumerate() {
            let took = one_call(&config, &device, lengths, kernel, i as u64)
                .with_context(|| format!("attention alone, {}", kernel.name()))?;
            if i >= job.timing_warmup_steps {
                seconds += took;
            }
        }
        let calls = timed.len();
        let ms_per_call = 1e3 * seconds / calls as f64;
        let timing = KernelTiming {
            kernel: kernel.name(),
            calls,
            seconds,
            ms_per_call,
            ms_per_step: ms_per_call * config.num_hidden_layers as f64,
            gflops: flops / seconds / 1e9,
        };
        println!(
            "attention alone, {}: {:.3} ms a layer's forward and backward ({:.1} ms a step of {} layers), {:.1} GFLOP/s",
            timing.kernel,
            timing.ms_per_call,
            timing.ms_per_step,
            config.num_hidden_layers,
            timing.gflops
        );
        timings.push(timing);
    }
    let report = AttentionReport {
        device: job.device.to_string(),
        heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        layers: config.num_hidden_layers,
        batch,
        tokens_per_call: tokens as f64 / timed.len() as f64,
        timings,
    };
    write_report(&job.output_dir, &report)
}

/// One layer's attention, forward and backward, on `lengths`: seconds from
/// the inputs' upload to a scalar of the gradients on the host.
fn one_call(
    config: &LlamaConfig,
    device: &Device,
    lengths: &[usize],
    kernel: Kernel,
    seed: u64,
) -> anyhow::Result<f64> {
    let meta = BatchMeta::from_lengths(lengths.to_vec())?;
    let t: usize = lengths.iter().sum();
    let (h, hkv, d) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let mut rng = SplitMix64::new(seed);
    let mut random =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.standard_normal() as f32).collect() };
    let (q0, k0, v0, w0) = (
        random(t * h * d),
        random(t * hkv * d),
        random(t * hkv * d),
        random(t * h * d),
    );
    let autodiff = device.clone().autodiff();
    let start = Instant::now();
    let leaf = |v: Vec<f32>, heads: usize| trainable(float_tensor(v, [t, heads, d], &autodiff));
    let (q, k, v) = (leaf(q0, h), leaf(k0, hkv), leaf(v0, hkv));
    let weights = float_tensor(w0, [t, h, d], &autodiff);
    let rows = AttentionRows::new(meta.cu_seqlens_shared(), &autodiff);
    let scale = 1.0 / (d as f32).sqrt();
    let out = match kernel {
        Kernel::Tiled => varlen_attention(q.clone(), k.clone(), v.clone(), &rows, scale),
        Kernel::PerRow => per_row_varlen_attention(q.clone(), k.clone(), v.clone(), &rows, scale),
        Kernel::TiledByHead => {
            tiled_by_head_varlen_attention(q.clone(), k.clone(), v.clone(), &rows, scale)
        }
        Kernel::Half(half) => {
            half_varlen_attention(q.clone(), k.clone(), v.clone(), &rows, scale, half, false)
        }
    }
    .map_err(ModelError::from)?;
    let grads = backward(&(out * weights).sum());
    let g = |x: &Tensor<3>| grad(x, &grads).map(|g| g.sum());
    let sum = match (g(&q), g(&k), g(&v)) {
        (Some(a), Some(b), Some(c)) => a + b + c,
        _ => anyhow::bail!("the attention gave no gradient"),
    };
    let _ = sum.into_vec();
    Ok(start.elapsed().as_secs_f64())
}

fn write_report(dir: &Path, report: &AttentionReport) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = format!(
        "# The varlen attention alone ({}, {} heads / {} kv heads, head size {}, {} layers)\n\n\
         {:.0} tokens a micro-batch of {} examples; one layer's forward and backward a call, \
         from the inputs' upload to a scalar of the gradients read back, after an untimed \
         pass of every row over every micro-batch (kernel compilation falls there).\n\n\
         | kernel | calls | ms a call | ms a step (all layers) | GFLOP/s |\n| --- | ---: | ---: | ---: | ---: |\n",
        report.device,
        report.heads,
        report.kv_heads,
        report.head_dim,
        report.layers,
        report.tokens_per_call,
        report.batch
    );
    for t in &report.timings {
        md.push_str(&format!(
            "| {} | {} | {:.3} | {:.1} | {:.1} |\n",
            t.kernel, t.calls, t.ms_per_call, t.ms_per_step, t.gflops
        ));
    }
    write_atomically(&dir.join("attention.md"), md.as_bytes())?;
    write_atomically(
        &dir.join("attention.json"),
        &serde_json::to_vec_pretty(report)?,
    )?;
    println!("wrote {}", dir.join("attention.md").display());
    Ok(())
}
