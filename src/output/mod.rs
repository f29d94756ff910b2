//! The output stage: presents an [`crate::analysis::Analysis`], computes
//! nothing of its own. This module writes one trace's folder:
//! `metrics.parquet` (one row per process and step), `report.json`
//! ([`json`], for machines: stable keys), `report.md` ([`markdown`], for
//! people, with the stdout summary), the pictures ([`plot`]) and the
//! flamegraph. [`summary`] writes a batch's `summary.parquet`, `summary.csv`
//! and `summary.md`; [`compare`] sets two analyses side by side. Every file
//! is written to a temporary name and renamed, so a file that exists is
//! complete.

pub(crate) mod compare;
pub mod export;
pub mod html;
pub(crate) mod json;
pub(crate) mod markdown;
pub mod perfetto;
pub mod plot;
pub(crate) mod summary;
pub mod ticks;
pub(crate) mod whatif;

use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result};
use polars::prelude::*;

use crate::analysis::predict::Risk;
use crate::analysis::{Analysis, Row};
use crate::output::plot::PlotConfig;
use crate::trace::write_atomic;

pub use json::report_json;
pub use markdown::{report_md, stdout_summary};
pub use summary::{summarize, write_parts, write_summary_files};

/// Writes `metrics.parquet`, `report.json`, `report.md` and `report.html`
/// into `out`. With a plot configuration, also `mdtp.png` and
/// `timeline.png`.
pub fn write_trace_outputs(a: &Analysis, out: &Path, plot: Option<&PlotConfig>) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let pictures = plot.map(|cfg| plot::render(a, cfg)).transpose()?.flatten();
    let not_drawn = pictures.as_ref().map_or(0, |p| p.panels_not_drawn);
    let started = std::time::Instant::now();
    let lap = |what: &str| tracing::debug!("{what} written at {:.3} s", started.elapsed().as_secs_f64());
    write_metrics(&a.rows, a.options.predict.horizon, &out.join("metrics.parquet"))?;
    lap("metrics.parquet");
    let report = report_json(a, not_drawn);
    write_atomic(&out.join("report.json"), &serde_json::to_vec_pretty(&report)?)?;
    lap("report.json");
    write_atomic(&out.join("report.md"), report_md(a, not_drawn).as_bytes())?;
    lap("report.md");
    if let Some(p) = &pictures {
        p.mdtp.write_png(&out.join("mdtp.png"))?;
        p.timeline.write_png(&out.join("timeline.png"))?;
        lap("PNGs");
    }
    if let Some(folded) = &a.flamegraph {
        write_atomic(&out.join("flamegraph.folded"), folded.as_bytes())?;
        let title = format!("{}: live memory by stack (end, peak)", a.trace.name);
        let svg = flamegraph_svg(folded, &title).context("cannot render flamegraph.svg")?;
        if !svg.is_empty() {
            write_atomic(&out.join("flamegraph.svg"), &svg)?;
        }
    }
    // Last, from the files above: one self-contained page for CI artifacts.
    let html = html::report_html(out, &format!("fragscope report: {}", a.trace.name))?;
    write_atomic(&out.join("report.html"), html.as_bytes())?;
    lap("report.html");
    Ok(())
}

fn write_metrics(rows: &[Row], horizon: usize, path: &Path) -> Result<()> {
    let f = |get: fn(&Row) -> f64| rows.iter().map(get).collect::<Vec<f64>>();
    let u = |get: fn(&Row) -> u64| rows.iter().map(get).collect::<Vec<u64>>();
    let mut df = DataFrame::new_infer_height(vec![
        Column::new("step".into(), rows.iter().map(|r| r.step).collect::<Vec<u32>>()),
        Column::new("t_ns".into(), u(|r| r.t_ns)),
        Column::new("pid".into(), rows.iter().map(|r| r.pid).collect::<Vec<u32>>()),
        Column::new("at_oom".into(), rows.iter().map(|r| r.at_oom).collect::<Vec<bool>>()),
        Column::new("external_fragmentation".into(), f(|r| r.metrics.external_fragmentation)),
        Column::new("kernel_unusable_index".into(), f(|r| r.metrics.kernel_unusable_index)),
        Column::new("small_alloc_ratio".into(), f(|r| r.metrics.small_alloc_ratio)),
        Column::new("size_cv".into(), f(|r| r.metrics.size_cv)),
        Column::new("large_gap_ratio".into(), f(|r| r.metrics.large_gap_ratio)),
        Column::new("utilization".into(), f(|r| r.metrics.utilization)),
        Column::new("score".into(), f(|r| r.metrics.score)),
        Column::new("live_bytes".into(), u(|r| r.metrics.live_bytes)),
        Column::new("live_blocks".into(), u(|r| r.metrics.live_blocks)),
        Column::new("gap_count".into(), u(|r| r.metrics.gap_count)),
        Column::new("largest_gap".into(), u(|r| r.metrics.largest_gap)),
        Column::new("span_bytes".into(), u(|r| r.metrics.span_bytes)),
    ])?;
    for k in 0..horizon {
        let values: Vec<Option<f64>> =
            rows.iter().map(|r| r.forecast.as_ref().and_then(|f| f.get(k).copied())).collect();
        df.with_column(Column::new(format!("forecast_{}", k + 1).into(), values))?;
    }
    let risk: Vec<Option<&str>> = rows.iter().map(|r| r.risk_online.map(Risk::name)).collect();
    df.with_column(Column::new("risk_online".into(), risk))?;
    let iteration: Vec<Option<u32>> = rows.iter().map(|r| r.iteration).collect();
    df.with_column(Column::new("iteration".into(), iteration))?;
    if rows.iter().any(|r| r.alloc.is_some()) {
        let a = |get: fn(&crate::analysis::replay::AllocatorFigures) -> u64| -> Vec<Option<u64>> {
            rows.iter().map(|r| r.alloc.as_ref().map(get)).collect()
        };
        df.with_column(Column::new("reserved_bytes".into(), a(|x| x.reserved_bytes)))?;
        df.with_column(Column::new("allocated_bytes".into(), a(|x| x.allocated_bytes)))?;
        df.with_column(Column::new("requested_bytes".into(), a(|x| x.requested_bytes)))?;
        df.with_column(Column::new(
            "internal_fragmentation_bytes".into(),
            a(|x| x.allocated_bytes.saturating_sub(x.requested_bytes)),
        ))?;
        let pt: Vec<Option<f64>> = rows.iter().map(|r| r.alloc.map(|x| x.pytorch_fragmentation)).collect();
        df.with_column(Column::new("pytorch_fragmentation".into(), pt))?;
    } else if rows.iter().any(|r| r.reported_reserved.is_some()) {
        // A profiler trace: the reserved bytes it reported (no segments).
        let reserved: Vec<Option<u64>> = rows.iter().map(|r| r.reported_reserved).collect();
        df.with_column(Column::new("reserved_bytes".into(), reserved))?;
    }
    write_parquet(&mut df, path)
}

/// Writes a DataFrame as zstd Parquet through a temporary file.
pub fn write_parquet(df: &mut DataFrame, path: &Path) -> Result<()> {
    let tmp = path.with_extension("parquet.tmp");
    let file = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    ParquetWriter::new(file)
        .with_compression(ParquetCompression::Zstd(None))
        .finish(df)
        .map_err(anyhow::Error::from)
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// Renders folded lines as an SVG flamegraph (bytes as the count).
fn flamegraph_svg(folded: &str, title: &str) -> Result<Vec<u8>> {
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = title.to_string();
    opts.count_name = "bytes".to_string();
    let mut out = Vec::new();
    if folded.trim().is_empty() {
        return Ok(out);
    }
    inferno::flamegraph::from_lines(&mut opts, folded.lines(), &mut out)?;
    Ok(out)
}
