//! Outputs of `analyze`: `metrics.parquet` (one row per process and step),
//! `report.json` (for machines: stable keys), `report.md` (for people), the
//! stdout summary, and for batches `summary.parquet`, `summary.csv` and
//! `summary.md`. Every file is written to a temporary name and renamed, so
//! a file that exists is complete.

use std::fmt::Write as _;
use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result};
use polars::prelude::*;
use serde::Serialize;
use serde_json::json;

use crate::analyze::{Analysis, Row};
use crate::trace::{FORMAT_VERSION, write_atomic};

/// Score statistics over a process's step rows (OOM rows excluded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ScoreStats {
    pub final_: f64,
    pub mean: f64,
    pub p95: f64,
    pub max: f64,
}

impl ScoreStats {
    pub fn of(scores: &[f64]) -> ScoreStats {
        if scores.is_empty() {
            return ScoreStats::default();
        }
        let mut sorted = scores.to_vec();
        sorted.sort_by(f64::total_cmp);
        // Nearest-rank percentile.
        let rank = ((0.95 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        ScoreStats {
            final_: scores[scores.len() - 1],
            mean: scores.iter().sum::<f64>() / scores.len() as f64,
            p95: sorted[rank - 1],
            max: sorted[sorted.len() - 1],
        }
    }

    fn json(&self) -> serde_json::Value {
        json!({"final": r6(self.final_), "mean": r6(self.mean), "p95": r6(self.p95), "max": r6(self.max)})
    }
}

/// Rounds to 6 decimals so reports are stable across platforms.
pub fn r6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Figures of one analysed trace that summaries and reports share.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub name: String,
    pub source: String,
    pub events: u64,
    pub processes: usize,
    pub duration_s: f64,
    pub peak_live_bytes: u64,
    pub score: ScoreStats,
    pub ooms: u64,
    pub anomalies: u64,
}

impl Summary {
    pub fn of(a: &Analysis) -> Summary {
        // Combined: the worst process at each step, so one bad rank shows.
        let scores = combined_scores(&a.rows);
        Summary {
            name: a.trace.name.clone(),
            source: a.trace.source().map_or("unknown", |s| s.name()).to_string(),
            events: a.events,
            processes: a.peaks.len(),
            duration_s: (a.last_ts - a.first_ts) as f64 / 1e9,
            peak_live_bytes: a.peak_live_total,
            score: ScoreStats::of(&scores),
            ooms: a.ooms.len() as u64,
            anomalies: a.anomalies.total(),
        }
    }
}

/// Per step, the highest score over processes.
fn combined_scores(rows: &[Row]) -> Vec<f64> {
    let mut out: Vec<f64> = Vec::new();
    let mut current = u32::MAX;
    for r in rows.iter().filter(|r| !r.at_oom) {
        if r.step != current || out.is_empty() {
            current = r.step;
            out.push(r.metrics.score);
        } else if let Some(last) = out.last_mut() {
            *last = last.max(r.metrics.score);
        }
    }
    out
}

fn process_scores(rows: &[Row], pid: u32) -> Vec<f64> {
    rows.iter().filter(|r| r.pid == pid && !r.at_oom).map(|r| r.metrics.score).collect()
}

/// Human-readable bytes: 1.50 GiB.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// Writes `metrics.parquet`, `report.json` and `report.md` into `out`.
pub fn write_trace_outputs(a: &Analysis, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    write_metrics(&a.rows, &out.join("metrics.parquet"))?;
    let report = report_json(a);
    write_atomic(&out.join("report.json"), &serde_json::to_vec_pretty(&report)?)?;
    write_atomic(&out.join("report.md"), report_md(a).as_bytes())?;
    Ok(())
}

fn write_metrics(rows: &[Row], path: &Path) -> Result<()> {
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

fn metrics_json(m: &crate::metrics::Metrics) -> serde_json::Value {
    json!({
        "external_fragmentation": r6(m.external_fragmentation),
        "kernel_unusable_index": r6(m.kernel_unusable_index),
        "small_alloc_ratio": r6(m.small_alloc_ratio),
        "size_cv": r6(m.size_cv),
        "large_gap_ratio": r6(m.large_gap_ratio),
        "utilization": r6(m.utilization),
        "score": r6(m.score),
        "live_bytes": m.live_bytes,
        "live_blocks": m.live_blocks,
        "gap_count": m.gap_count,
        "largest_gap": m.largest_gap,
        "span_bytes": m.span_bytes,
    })
}

fn last_row(a: &Analysis, pid: u32) -> Option<&Row> {
    a.rows.iter().rev().find(|r| r.pid == pid && !r.at_oom)
}

/// `report.json`.
pub fn report_json(a: &Analysis) -> serde_json::Value {
    let s = Summary::of(a);
    let meta = a.trace.meta.as_ref();
    let processes: Vec<_> = a
        .peaks
        .iter()
        .map(|p| {
            json!({
                "pid": p.pid,
                "peak_live_bytes": p.bytes,
                "peak_t_ns": p.t_ns,
                "score": ScoreStats::of(&process_scores(&a.rows, p.pid)).json(),
                "ooms": a.ooms.iter().filter(|o| o.pid == p.pid).count(),
                "final": last_row(a, p.pid).map(|r| metrics_json(&r.metrics)),
            })
        })
        .collect();
    json!({
        "format_version": FORMAT_VERSION,
        "tool_version": env!("CARGO_PKG_VERSION"),
        "trace": {
            "name": a.trace.name,
            "path": a.trace.dir.display().to_string(),
            "source": s.source,
            "parts": a.trace.parts.len(),
            "skipped_parts": a.trace.skipped.iter().map(|(p, why)| json!({"path": p.display().to_string(), "reason": why})).collect::<Vec<_>>(),
            "has_metadata": meta.is_some(),
            "lost_events": meta.map_or(0, |m| m.lost_events),
            "capacity_bytes": meta.and_then(|m| m.capacity_bytes),
        },
        "events": {
            "total": a.events,
            "by_kind": a.counts_by_kind.iter().map(|(k, n)| (k.clone(), json!(n))).collect::<serde_json::Map<String, serde_json::Value>>(),
            "failed_allocs": a.failed_allocs,
            "ooms": a.ooms.len(),
            "first_ts_ns": a.first_ts,
            "last_ts_ns": a.last_ts,
            "duration_s": r6(s.duration_s),
        },
        "anomalies": a.anomalies,
        "steps": {
            "spec": a.options.step.to_string(),
            "count": a.step_count,
            "rows": a.rows.len(),
        },
        "config": a.options.metrics,
        "summary": {
            "processes": s.processes,
            "peak_live_bytes": s.peak_live_bytes,
            "score": s.score.json(),
        },
        "processes": processes,
    })
}

/// `report.md`: the verdict first, then the tables.
pub fn report_md(a: &Analysis) -> String {
    let s = Summary::of(a);
    let mut md = String::new();
    let _ = writeln!(md, "# fragscope report: {}\n", s.name);
    let _ = writeln!(
        md,
        "**Fragmentation score now {:.1} / 100** (mean {:.1}, p95 {:.1}, max {:.1}) · peak live {} · {} OOM{} · {} process{}\n",
        s.score.final_,
        s.score.mean,
        s.score.p95,
        s.score.max,
        bytes(s.peak_live_bytes),
        s.ooms,
        if s.ooms == 1 { "" } else { "s" },
        s.processes,
        if s.processes == 1 { "" } else { "es" },
    );
    let _ = writeln!(md, "| trace | |\n|---|---|");
    let _ = writeln!(md, "| source | {} |", s.source);
    let _ = writeln!(md, "| events | {} over {:.3} s |", s.events, s.duration_s);
    let _ = writeln!(md, "| steps | {} ({}), {} rows |", a.step_count, a.options.step, a.rows.len());
    let _ = writeln!(md, "| parts | {} read, {} skipped |", a.trace.parts.len(), a.trace.skipped.len());
    if let Some(m) = &a.trace.meta {
        if m.lost_events > 0 {
            let _ = writeln!(
                md,
                "| lost events | **{}** (the recorder dropped events; numbers may be off) |",
                m.lost_events
            );
        }
        if let Some(c) = m.capacity_bytes {
            let _ = writeln!(md, "| capacity | {} |", bytes(c));
        }
    } else {
        let _ = writeln!(md, "| metadata | trace.json missing (interrupted recording?) |");
    }

    let _ = writeln!(md, "\n## Processes\n");
    let _ = writeln!(md, "| pid | peak live | score final | mean | p95 | max | E | K | S | C | L | U | OOMs |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for p in &a.peaks {
        let st = ScoreStats::of(&process_scores(&a.rows, p.pid));
        let m = last_row(a, p.pid).map(|r| r.metrics).unwrap_or_default();
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {} |",
            p.pid,
            bytes(p.bytes),
            st.final_,
            st.mean,
            st.p95,
            st.max,
            m.external_fragmentation,
            m.kernel_unusable_index,
            m.small_alloc_ratio,
            m.size_cv,
            m.large_gap_ratio,
            m.utilization,
            a.ooms.iter().filter(|o| o.pid == p.pid).count()
        );
    }
    let _ = writeln!(
        md,
        "\nE external fragmentation, K unusable-free-space index, S small-allocation ratio, C size CV, L large-gap ratio, U utilization — at the last step.\n"
    );

    let _ = writeln!(md, "## Events by kind\n\n| kind | count |\n|---|---|");
    for (k, n) in &a.counts_by_kind {
        let _ = writeln!(md, "| {k} | {n} |");
    }
    let _ = writeln!(md, "| failed allocations | {} |", a.failed_allocs);

    let an = &a.anomalies;
    let _ = writeln!(md, "\n## Anomalies\n");
    if an.total() == 0 {
        let _ = writeln!(md, "None.");
    } else {
        let _ = writeln!(md, "| anomaly | count |\n|---|---|");
        for (name, n, why) in [
            (
                "unknown_free",
                an.unknown_free,
                "free of an address never allocated in the trace (allocated before recording?)",
            ),
            ("double_free", an.double_free, "free of an address already freed"),
            ("overlap", an.overlap, "allocation overlapping live blocks (their frees were lost)"),
            ("out_of_order", an.out_of_order, "rows out of time order (sorted before replay)"),
            ("unknown_kind", an.unknown_kind, "rows with a kind this version does not know (ignored)"),
        ] {
            if n > 0 {
                let _ = writeln!(md, "| {name} | {n} — {why} |");
            }
        }
    }
    md
}

/// A few lines for stdout.
pub fn stdout_summary(a: &Analysis, out: &Path) -> String {
    let s = Summary::of(a);
    format!(
        "{}: {} events, {} process{}, {:.3} s, {} steps\n  score final {:.1}, mean {:.1}, p95 {:.1}, max {:.1}; peak live {}; {} OOM{}; {} anomal{}\n  wrote {}\n",
        s.name,
        s.events,
        s.processes,
        if s.processes == 1 { "" } else { "es" },
        s.duration_s,
        a.step_count,
        s.score.final_,
        s.score.mean,
        s.score.p95,
        s.score.max,
        bytes(s.peak_live_bytes),
        s.ooms,
        if s.ooms == 1 { "" } else { "s" },
        s.anomalies,
        if s.anomalies == 1 { "y" } else { "ies" },
        out.display()
    )
}

/// One row of the batch summary: a trace's figures or its error.
pub type SummaryRow = (String, std::result::Result<Summary, String>);

/// Writes `summary.parquet`, `summary.csv` and `summary.md`, worst first.
pub fn write_batch_summary(rows: &[SummaryRow], out: &Path) -> Result<()> {
    let mut rows: Vec<&SummaryRow> = rows.iter().collect();
    rows.sort_by(|a, b| {
        let key = |r: &SummaryRow| r.1.as_ref().map_or(f64::INFINITY, |s| s.score.p95);
        key(b).total_cmp(&key(a)).then_with(|| a.0.cmp(&b.0))
    });
    let ok = |f: fn(&Summary) -> f64| rows.iter().map(|r| r.1.as_ref().ok().map(f)).collect::<Vec<Option<f64>>>();
    let oku = |f: fn(&Summary) -> u64| rows.iter().map(|r| r.1.as_ref().ok().map(f)).collect::<Vec<Option<u64>>>();
    let mut df = DataFrame::new_infer_height(vec![
        Column::new("trace".into(), rows.iter().map(|r| r.0.clone()).collect::<Vec<String>>()),
        Column::new(
            "status".into(),
            rows.iter().map(|r| if r.1.is_ok() { "ok" } else { "error" }).collect::<Vec<&str>>(),
        ),
        Column::new("error".into(), rows.iter().map(|r| r.1.as_ref().err().cloned()).collect::<Vec<Option<String>>>()),
        Column::new(
            "source".into(),
            rows.iter().map(|r| r.1.as_ref().ok().map(|s| s.source.clone())).collect::<Vec<Option<String>>>(),
        ),
        Column::new("events".into(), oku(|s| s.events)),
        Column::new("processes".into(), oku(|s| s.processes as u64)),
        Column::new("duration_s".into(), ok(|s| s.duration_s)),
        Column::new("peak_live_bytes".into(), oku(|s| s.peak_live_bytes)),
        Column::new("score_final".into(), ok(|s| s.score.final_)),
        Column::new("score_mean".into(), ok(|s| s.score.mean)),
        Column::new("score_p95".into(), ok(|s| s.score.p95)),
        Column::new("score_max".into(), ok(|s| s.score.max)),
        Column::new("ooms".into(), oku(|s| s.ooms)),
        Column::new("anomalies".into(), oku(|s| s.anomalies)),
    ])?;
    write_parquet(&mut df, &out.join("summary.parquet"))?;

    let mut csv = csv::Writer::from_writer(Vec::new());
    csv.write_record([
        "trace",
        "status",
        "error",
        "source",
        "events",
        "processes",
        "duration_s",
        "peak_live_bytes",
        "score_final",
        "score_mean",
        "score_p95",
        "score_max",
        "ooms",
        "anomalies",
    ])?;
    let mut md = String::from("# fragscope batch summary\n\nWorst first (by p95 score); failed traces on top.\n\n");
    md.push_str("| trace | status | events | peak live | score final | p95 | max | OOMs | anomalies |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|\n");
    for (name, r) in rows.iter().map(|r| (&r.0, &r.1)) {
        match r {
            Ok(s) => {
                csv.write_record([
                    name.clone(),
                    "ok".into(),
                    String::new(),
                    s.source.clone(),
                    s.events.to_string(),
                    s.processes.to_string(),
                    format!("{:.6}", s.duration_s),
                    s.peak_live_bytes.to_string(),
                    format!("{:.6}", s.score.final_),
                    format!("{:.6}", s.score.mean),
                    format!("{:.6}", s.score.p95),
                    format!("{:.6}", s.score.max),
                    s.ooms.to_string(),
                    s.anomalies.to_string(),
                ])?;
                let _ = writeln!(
                    md,
                    "| {name} | ok | {} | {} | {:.1} | {:.1} | {:.1} | {} | {} |",
                    s.events,
                    bytes(s.peak_live_bytes),
                    s.score.final_,
                    s.score.p95,
                    s.score.max,
                    s.ooms,
                    s.anomalies
                );
            }
            Err(e) => {
                let mut rec = vec![name.clone(), "error".into(), e.clone()];
                rec.resize(14, String::new());
                csv.write_record(rec)?;
                let _ =
                    writeln!(md, "| {name} | **error**: {} | | | | | | | |", e.replace('|', "\\|").replace('\n', " "));
            }
        }
    }
    let csv = csv.into_inner().context("cannot finish summary.csv")?;
    write_atomic(&out.join("summary.csv"), &csv)?;
    write_atomic(&out.join("summary.md"), md.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_stats_nearest_rank() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        let s = ScoreStats::of(&v);
        assert_eq!((s.final_, s.p95, s.max), (20.0, 19.0, 20.0));
        assert!((s.mean - 10.5).abs() < 1e-12);
        assert_eq!(ScoreStats::of(&[]), ScoreStats::default());
    }

    #[test]
    fn human_bytes() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(3 << 30), "3.00 GiB");
    }
}
