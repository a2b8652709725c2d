//! Draws `PADFREE_MEMORY_TRACE=1` logs of `padfree train` (one line per
//! phase of every step: collated, forward, backward, gradients taken,
//! update, values back) as a PNG line chart: for each log, the most
//! buffers alive at once in each phase, phase after phase, so that where a
//! step's peak falls, and how two runs differ there, can be seen.
//!
//! ```sh
//! PADFREE_MEMORY_TRACE=1 padfree train ... 2> f32.log
//! cargo run --release --example memory_trace_chart -- out.png "SmolLM2 maths b16" f32=f32.log bf16=bf16.log
//! ```

use anyhow::{Context, Result, bail};
use padfree_plot::{Series, line_chart_png};

/// `(phase, buffers alive at its end, the most alive during it)` of every
/// trace line in `text`, MiB.
fn phases(text: &str) -> Vec<(String, f64, f64)> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("memory ")?;
            let (phase, rest) = rest.split_once(" buffers ")?;
            let (live, rest) = rest.split_once(" MiB, at most ")?;
            let (most, _) = rest.split_once(" MiB")?;
            Some((
                phase.trim().to_owned(),
                live.trim().parse().ok()?,
                most.trim().parse().ok()?,
            ))
        })
        .collect()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [output, title, logs @ ..] = args.as_slice() else {
        bail!("usage: memory_trace_chart OUTPUT.png TITLE LABEL=LOG...");
    };
    if logs.is_empty() {
        bail!("no LABEL=LOG given");
    }
    let mut series = Vec::new();
    for log in logs {
        let (label, path) = log
            .split_once('=')
            .with_context(|| format!("`{log}`: expected LABEL=LOG"))?;
        let text = std::fs::read_to_string(path).with_context(|| path.to_owned())?;
        let phases = phases(&text);
        if phases.is_empty() {
            bail!("{path}: no `memory` lines (was PADFREE_MEMORY_TRACE=1 set?)");
        }
        series.push(Series {
            label: format!("{label}: most alive in the phase"),
            points: phases
                .iter()
                .enumerate()
                .map(|(at, (_, _, most))| (at as f64, *most))
                .collect(),
        });
    }
    let png = line_chart_png(
        title,
        "phase, six a step (collated ... values back)",
        "MiB of buffers of 4 KiB or more",
        &series,
    )
    .map_err(anyhow::Error::msg)?;
    std::fs::write(output, png).with_context(|| output.clone())?;
    println!("wrote {output}");
    Ok(())
}
