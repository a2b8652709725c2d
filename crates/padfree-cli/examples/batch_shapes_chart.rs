//! Draws the batch-shapes grid (`scripts/bench_batch_shapes.sh`) as two PNG
//! line charts over the batch size, one line per model and data set:
//! padfree padding-free's real tokens/s over HF's faster mode (padded or
//! flattening, whichever ran faster in the cell), and its MFU
//! against each cell's calibration matmul.
//!
//! ```sh
//! cargo run --release --example batch_shapes_chart -- runs/batch-shapes docs/benchmarks/2026-12-02-batch-shapes
//! ```
//! writes `<prefix>-speedup.png` and `<prefix>-mfu.png`.

use std::path::Path;

use anyhow::{Context, Result, bail};
use padfree_plot::{Series, line_chart_png};
use serde_json::Value;

const MODELS: [(&str, &str); 2] = [("smollm2", "SmolLM2-135M"), ("medium", "medium")];
const DATA: [(&str, &str); 2] = [("short", "short"), ("shipped", "shipped")];
const BATCHES: [u32; 3] = [4, 8, 16];

/// `(padfree / HF real tokens/s, padfree MFU %)` of one cell, if it ran.
fn cell(dir: &Path) -> Result<Option<(f64, f64)>> {
    let path = dir.join("bench.json");
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let report: Value = serde_json::from_str(&text).with_context(|| path.display().to_string())?;
    let peak = report["peak"]["calibrated_gflops"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let results = report["results"].as_array().cloned().unwrap_or_default();
    let row = |mode: &str| results.iter().find(|r| r["mode"] == mode).cloned();
    let speed = |r: &Value| r["real_tokens_per_second"].as_f64().unwrap_or(f64::NAN);
    // HF's faster mode in this cell: on short examples its padded run is
    // sometimes the faster one.
    let hf = [row("hf-flattening"), row("hf-padded")]
        .into_iter()
        .flatten()
        .max_by(|a, b| speed(a).total_cmp(&speed(b)));
    let (Some(ours), Some(hf)) = (row("varlen"), hf) else {
        return Ok(None);
    };
    let mfu = ours["model_flops"].as_f64().unwrap_or(f64::NAN)
        / ours["train_runtime"].as_f64().unwrap_or(f64::NAN)
        / 1e9
        / peak
        * 100.0;
    Ok(Some((speed(&ours) / speed(&hf), mfu)))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [grid, prefix] = args.as_slice() else {
        bail!("usage: batch_shapes_chart GRID_DIR OUTPUT_PREFIX");
    };
    let (mut speedups, mut mfus) = (Vec::new(), Vec::new());
    for (model, model_name) in MODELS {
        for (data, data_name) in DATA {
            let label = format!("{model_name}, {data_name}");
            let (mut speedup, mut mfu) = (Vec::new(), Vec::new());
            for batch in BATCHES {
                if let Some((ratio, share)) =
                    cell(&Path::new(grid).join(format!("{model}-{data}-b{batch}")))?
                {
                    speedup.push((f64::from(batch), ratio));
                    mfu.push((f64::from(batch), share));
                }
            }
            // A model and data set not run (a partial grid) gets no legend entry.
            if speedup.is_empty() {
                continue;
            }
            speedups.push(Series {
                label: label.clone(),
                points: speedup,
            });
            mfus.push(Series { label, points: mfu });
        }
    }
    for (name, title, y, series) in [
        (
            "speedup",
            "padfree padding-free / HF faster mode, real tokens/s",
            "ratio",
            speedups,
        ),
        (
            "mfu",
            "padfree padding-free MFU vs calibration matmul",
            "MFU %",
            mfus,
        ),
    ] {
        let png =
            line_chart_png(title, "examples per batch", y, &series).map_err(anyhow::Error::msg)?;
        let path = format!("{prefix}-{name}.png");
        std::fs::write(&path, png).with_context(|| path.clone())?;
        println!("wrote {path}");
    }
    Ok(())
}
