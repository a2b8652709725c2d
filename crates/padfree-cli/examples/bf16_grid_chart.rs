//! Draws the bf16 grid (`scripts/bench_bf16.sh`, every cell run in f32 and
//! with `--bf16`) as PNG line charts over the batch size, one line per
//! model and data set: padfree `--bf16` over padfree f32 (real tokens/s),
//! padfree `--bf16` over HF's fastest mode in the cell (f32 or
//! `bf16=True`, padded or flattening), and padfree's peak memory in bf16
//! over f32.
//!
//! ```sh
//! cargo run --release --example bf16_grid_chart -- runs/bf16-grid docs/benchmarks/2026-12-04-bf16-grid
//! ```
//! writes `<prefix>-over-f32.png`, `<prefix>-over-hf.png` and `<prefix>-memory.png`.

use std::path::Path;

use anyhow::{Context, Result, bail};
use padfree_plot::{Series, line_chart_png};
use serde_json::Value;

const MODELS: [(&str, &str); 2] = [("smollm2", "SmolLM2-135M"), ("medium", "medium")];
const DATA: [(&str, &str); 2] = [("shipped", "maths"), ("short", "short chat")];
const BATCHES: [u32; 3] = [4, 8, 16];

fn report(dir: &Path) -> Result<Option<Value>> {
    let path = dir.join("bench.json");
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    Ok(Some(
        serde_json::from_str(&text).with_context(|| path.display().to_string())?,
    ))
}

fn results(report: &Value) -> Vec<Value> {
    report["results"].as_array().cloned().unwrap_or_default()
}

fn number(row: &Value, field: &str) -> f64 {
    row[field].as_f64().unwrap_or(f64::NAN)
}

/// `(bf16 / f32, bf16 / HF fastest, bf16 peak / f32 peak)` of one cell,
/// if both of its runs are there.
fn cell(grid: &Path, name: &str) -> Result<Option<[f64; 3]>> {
    let (Some(f32), Some(bf16)) = (
        report(&grid.join(format!("{name}-f32")))?,
        report(&grid.join(format!("{name}-bf16")))?,
    ) else {
        return Ok(None);
    };
    let ours = |report: &Value| results(report).into_iter().find(|r| r["mode"] == "varlen");
    let (Some(ours32), Some(ours16)) = (ours(&f32), ours(&bf16)) else {
        return Ok(None);
    };
    let hf_fastest = [&f32, &bf16]
        .into_iter()
        .flat_map(results)
        .filter(|r| r["mode"].as_str().is_some_and(|m| m.starts_with("hf-")))
        .map(|r| number(&r, "real_tokens_per_second"))
        .fold(f64::NAN, f64::max);
    let speed = |r: &Value| number(r, "real_tokens_per_second");
    let memory = |r: &Value| number(r, "peak_memory_bytes");
    Ok(Some([
        speed(&ours16) / speed(&ours32),
        speed(&ours16) / hf_fastest,
        memory(&ours16) / memory(&ours32),
    ]))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [grid, prefix] = args.as_slice() else {
        bail!("usage: bf16_grid_chart GRID_DIR OUTPUT_PREFIX");
    };
    let mut charts: [Vec<Series>; 3] = Default::default();
    for (model, model_name) in MODELS {
        for (data, data_name) in DATA {
            let mut lines: [Vec<(f64, f64)>; 3] = Default::default();
            for batch in BATCHES {
                if let Some(ratios) = cell(Path::new(grid), &format!("{model}-{data}-b{batch}"))? {
                    for (line, ratio) in lines.iter_mut().zip(ratios) {
                        line.push((f64::from(batch), ratio));
                    }
                }
            }
            // A model and data set not run (a partial grid) gets no legend entry.
            if lines[0].is_empty() {
                continue;
            }
            for (chart, points) in charts.iter_mut().zip(lines) {
                chart.push(Series {
                    label: format!("{model_name}, {data_name}"),
                    points,
                });
            }
        }
    }
    let [over_f32, over_hf, memory] = charts;
    for (name, title, series) in [
        (
            "over-f32",
            "padfree --bf16 / padfree f32, real tokens/s",
            over_f32,
        ),
        (
            "over-hf",
            "padfree --bf16 / HF fastest mode, real tokens/s",
            over_hf,
        ),
        ("memory", "padfree peak memory, --bf16 / f32", memory),
    ] {
        let png = line_chart_png(title, "examples per batch", "ratio", &series)
            .map_err(anyhow::Error::msg)?;
        let path = format!("{prefix}-{name}.png");
        std::fs::write(&path, png).with_context(|| path.clone())?;
        println!("wrote {path}");
    }
    Ok(())
}
