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
pub(crate) mod floors;
pub mod html;
pub(crate) mod json;
pub(crate) mod markdown;
pub mod plot;
pub(crate) mod summary;
pub mod ticks;
pub mod view;
pub(crate) mod whatif;

use std::path::Path;

use crate::trace::table::Columns;
use anyhow::{Context, Result};

use crate::analysis::predict::Risk;
use crate::analysis::{Analysis, Row};
use crate::output::plot::PlotConfig;
use crate::trace::write_atomic;

pub use json::report_json;
pub use markdown::{report_md, stdout_summary};
pub use summary::{summarize, write_parts, write_summary_files};

/// Writes `metrics.parquet`, `report.json`, `report.md` and `report.html`
/// into `out`. With a plot configuration, also `mdtp.png` and
/// `timeline.png`, and `floors.png` where a leak verdict rests on
/// iterations.
pub fn write_trace_outputs(a: &Analysis, out: &Path, plot: Option<&PlotConfig>) -> Result<()> {
    let existed = out.is_dir();
    // The pictures first: a run that fails there (`--pid` of no process,
    // say) has written nothing, and leaves an earlier run's report as it
    // was.
    let pictures = plot.map(|cfg| plot::render(a, cfg)).transpose()?.flatten();
    let written = write_outputs(a, out, plot, pictures);
    if written.is_err() {
        // A run that fails while writing (a full disk, say) leaves no
        // report: what it wrote would read as a complete analysis beside
        // what it did not, and the earlier run's is partly replaced.
        remove_outputs(out, !existed);
    }
    written
}

/// What [`write_trace_outputs`] writes into a trace's folder.
const OUTPUT_FILES: [&str; 9] = [
    "metrics.parquet",
    "report.json",
    "report.md",
    "mdtp.png",
    "timeline.png",
    "floors.png",
    "flamegraph.folded",
    "flamegraph.svg",
    "report.html",
];

/// Removes a trace folder's outputs, its view among them, and the folder
/// itself when this run created it and it is left empty.
fn remove_outputs(out: &Path, created: bool) {
    let _ = std::fs::remove_dir_all(out.join("view"));
    crate::trace::discard(out, &OUTPUT_FILES, created);
}

fn write_outputs(a: &Analysis, out: &Path, plot: Option<&PlotConfig>, pictures: Option<plot::Pictures>) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
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
    // The optional files an earlier run into the same folder left would
    // show another analysis, in the folder and inside report.html: gone
    // before this run writes its own.
    for name in &OUTPUT_FILES[3..8] {
        let old = out.join(name);
        if old.is_file() {
            std::fs::remove_file(&old).with_context(|| format!("cannot remove the old {}", old.display()))?;
        }
    }
    if let Some(p) = &pictures {
        p.mdtp.write_png(&out.join("mdtp.png"))?;
        p.timeline.write_png(&out.join("timeline.png"))?;
        lap("PNGs");
    }
    if let Some(cfg) = plot
        && let Some((pixels, height)) = floors::render(a, cfg.width)?
    {
        plot::write_png(&pixels, cfg.width, height, &out.join("floors.png"))?;
        lap("floors.png");
    }
    if let Some(folded) = &a.flamegraph {
        write_atomic(&out.join("flamegraph.folded"), folded.as_bytes())?;
        let title = format!("{}: live memory by stack (end, peak)", a.trace.name);
        let svg = flamegraph_svg(folded, &title).context("cannot render flamegraph.svg")?;
        if !svg.is_empty() {
            write_atomic(&out.join("flamegraph.svg"), &svg)?;
        }
    }
    // The explorable view, or none: a view left from an earlier run would
    // show another analysis.
    let view = match plot {
        Some(cfg) if cfg.view => view::write_view(a, out, cfg)?,
        _ => None,
    };
    if view.is_none() && out.join("view").is_dir() {
        std::fs::remove_dir_all(out.join("view"))
            .with_context(|| format!("cannot remove the old {}", out.join("view").display()))?;
    }
    lap("view");
    // Last, from the files above: one self-contained page for CI artifacts.
    let html = html::report_html(out, &format!("fragscope report: {}", a.trace.name))?;
    write_atomic(&out.join("report.html"), html.as_bytes())?;
    lap("report.html");
    Ok(())
}

fn write_metrics(rows: &[Row], horizon: usize, path: &Path) -> Result<()> {
    use arrow_array::{BooleanArray, Float64Array, StringArray, UInt32Array, UInt64Array};
    let f = |get: fn(&Row) -> f64| Float64Array::from_iter_values(rows.iter().map(get));
    let u = |get: fn(&Row) -> u64| UInt64Array::from_iter_values(rows.iter().map(get));
    let mut c = Columns::new();
    c.push("step", UInt32Array::from_iter_values(rows.iter().map(|r| r.step)))
        .push("t_ns", u(|r| r.t_ns))
        .push("pid", UInt32Array::from_iter_values(rows.iter().map(|r| r.pid)))
        .push("at_oom", BooleanArray::from_iter(rows.iter().map(|r| Some(r.at_oom))))
        .push("external_fragmentation", f(|r| r.metrics.external_fragmentation))
        .push("kernel_unusable_index", f(|r| r.metrics.kernel_unusable_index))
        .push("small_alloc_ratio", f(|r| r.metrics.small_alloc_ratio))
        .push("size_cv", f(|r| r.metrics.size_cv))
        .push("large_gap_ratio", f(|r| r.metrics.large_gap_ratio))
        .push("utilization", f(|r| r.metrics.utilization))
        .push("score", f(|r| r.metrics.score))
        .push("live_bytes", u(|r| r.metrics.live_bytes))
        .push("live_blocks", u(|r| r.metrics.live_blocks))
        .push("gap_count", u(|r| r.metrics.gap_count))
        .push("largest_gap", u(|r| r.metrics.largest_gap))
        .push("span_bytes", u(|r| r.metrics.span_bytes));
    for k in 0..horizon {
        let values = Float64Array::from_iter(rows.iter().map(|r| r.forecast.as_ref().and_then(|f| f.get(k).copied())));
        c.push(format!("forecast_{}", k + 1), values);
    }
    c.push("fragmentation_level_online", StringArray::from_iter(rows.iter().map(|r| r.risk_online.map(Risk::name))));
    c.push("oom_risk_online", StringArray::from_iter(rows.iter().map(|r| r.oom_risk_online.map(|x| x.name()))));
    c.push("iteration", UInt32Array::from_iter(rows.iter().map(|r| r.iteration)));
    if rows.iter().any(|r| r.alloc.is_some()) {
        let a = |get: fn(&crate::analysis::replay::AllocatorFigures) -> u64| {
            UInt64Array::from_iter(rows.iter().map(|r| r.alloc.as_ref().map(get)))
        };
        c.push("reserved_bytes", a(|x| x.reserved_bytes))
            .push("allocated_bytes", a(|x| x.allocated_bytes))
            .push("requested_bytes", a(|x| x.requested_bytes))
            .push("internal_fragmentation_bytes", a(|x| x.allocated_bytes.saturating_sub(x.requested_bytes)))
            .push(
                "pytorch_fragmentation",
                Float64Array::from_iter(rows.iter().map(|r| r.alloc.map(|x| x.pytorch_fragmentation))),
            );
    } else if rows.iter().any(|r| r.reported_reserved.is_some()) {
        // A profiler trace: the reserved bytes it reported (no segments).
        c.push("reserved_bytes", UInt64Array::from_iter(rows.iter().map(|r| r.reported_reserved)));
    }
    c.write(path)
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
