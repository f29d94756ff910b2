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

use crate::analyze::{Analysis, ProcessPrediction, Row};
use crate::oom::OomClass;
use crate::predict::{ForecasterKind, Risk};
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
    /// The highest forecast risk over processes (None: insufficient data).
    pub risk: Option<Risk>,
    /// OOM counts per class, most frequent first.
    pub oom_classes: Vec<(OomClass, u64)>,
    pub leaking: bool,
    pub leaked_bytes: i64,
    /// Successful allocations (device or allocator blocks) and their rate.
    pub allocs: u64,
    pub alloc_rate: f64,
    /// Highest Σ over processes of the arena span (device view) or of the
    /// reserved segments (allocator view), over the steps.
    pub peak_reserved_bytes: u64,
    /// External fragmentation (Σ gaps / Σ span) at the step with the most
    /// live bytes.
    pub ext_frag_at_peak: f64,
    /// The grouping features ([`crate::cluster::FEATURES`]).
    pub features: [f64; crate::cluster::FEATURES.len()],
    /// UTC day of the recording (`start_wall_ns` of trace.json), else of the
    /// trace's last modification: the `date` partition of summary.parquet.
    pub date: String,
}

impl Summary {
    pub fn of(a: &Analysis) -> Summary {
        // Combined: the worst process at each step, so one bad rank shows.
        let scores = combined_scores(&a.rows);
        let steps = step_totals(&a.rows);
        let duration = (a.last_ts - a.first_ts) as f64 / 1e9;
        let allocs = a
            .counts_by_kind
            .iter()
            .filter(|(k, _)| matches!(k.as_str(), "alloc" | "alloc_async" | "alloc_managed" | "block_alloc"))
            .map(|(_, n)| n)
            .sum::<u64>()
            .saturating_sub(a.failed_allocs);
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
            risk: a.predictions.iter().filter_map(|p| p.prediction.risk).max(),
            oom_classes: oom_classes(a),
            leaking: a.leaks.iter().any(|l| l.leaking),
            leaked_bytes: a.leaks.iter().filter(|l| l.leaking).map(|l| l.growth_bytes).sum(),
            allocs,
            alloc_rate: if duration > 0.0 { allocs as f64 / duration } else { 0.0 },
            peak_reserved_bytes: steps.iter().map(|s| s.1).max().unwrap_or(0),
            ext_frag_at_peak: steps
                .iter()
                .max_by_key(|s| s.0)
                .map_or(0.0, |s| if s.1 == 0 { 0.0 } else { s.2 / s.1 as f64 }),
            features: features(a),
            date: trace_date(a),
        }
    }
}

/// The grouping features of a trace: mean score components over its rows,
/// the share of its OOMs in each class (0 without OOMs), leak rate.
fn features(a: &Analysis) -> [f64; crate::cluster::FEATURES.len()] {
    let rows: Vec<&Row> = a.rows.iter().filter(|r| !r.at_oom).collect();
    let mut f = [0.0; crate::cluster::FEATURES.len()];
    if !rows.is_empty() {
        for r in &rows {
            for (x, v) in f.iter_mut().zip(r.metrics.features()) {
                *x += v;
            }
        }
        for x in f.iter_mut().take(6) {
            *x /= rows.len() as f64;
        }
    }
    let total = a.ooms.len().max(1) as f64;
    let share = |c: OomClass| a.ooms.iter().filter(|o| o.class == c).count() as f64 / total;
    f[6] = share(OomClass::Capacity);
    f[7] = share(OomClass::Fragmentation);
    f[8] = share(OomClass::AllocatorPolicy);
    let leaked: i64 = a.leaks.iter().filter(|l| l.leaking).map(|l| l.growth_bytes).sum();
    f[9] = if a.peak_live_total == 0 { 0.0 } else { leaked.max(0) as f64 / a.peak_live_total as f64 };
    f
}

/// YYYY-MM-DD (UTC) of a trace's recording.
fn trace_date(a: &Analysis) -> String {
    let when = a
        .trace
        .meta
        .as_ref()
        .and_then(|m| m.start_wall_ns)
        .map(|ns| std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns))
        .or_else(|| std::fs::metadata(&a.trace.dir).and_then(|m| m.modified()).ok())
        .unwrap_or_else(std::time::SystemTime::now);
    humantime::format_rfc3339_seconds(when).to_string().chars().take(10).collect()
}

/// Per step, over processes: (Σ live bytes, Σ span, Σ gap bytes).
fn step_totals(rows: &[Row]) -> Vec<(u64, u64, f64)> {
    let mut out: Vec<(u64, u64, f64)> = Vec::new();
    let mut current = u32::MAX;
    for r in rows.iter().filter(|r| !r.at_oom) {
        let m = &r.metrics;
        let add = (m.live_bytes, m.span_bytes, m.external_fragmentation * m.span_bytes as f64);
        match out.last_mut() {
            Some(last) if r.step == current => {
                last.0 += add.0;
                last.1 += add.1;
                last.2 += add.2;
            }
            _ => {
                current = r.step;
                out.push(add);
            }
        }
    }
    out
}

fn oom_classes(a: &Analysis) -> Vec<(OomClass, u64)> {
    let mut counts: std::collections::BTreeMap<OomClass, u64> = Default::default();
    for o in &a.ooms {
        *counts.entry(o.class).or_default() += 1;
    }
    let mut v: Vec<(OomClass, u64)> = counts.into_iter().collect();
    v.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    v
}

/// The prediction of the process with the highest risk (the first on ties).
fn headline(a: &Analysis) -> Option<&ProcessPrediction> {
    a.predictions.iter().reduce(|best, p| if p.prediction.risk > best.prediction.risk { p } else { best })
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
    write_metrics(&a.rows, a.options.predict.horizon, &out.join("metrics.parquet"))?;
    let report = report_json(a);
    write_atomic(&out.join("report.json"), &serde_json::to_vec_pretty(&report)?)?;
    write_atomic(&out.join("report.md"), report_md(a).as_bytes())?;
    for (name, pixels, w, h) in &a.images {
        crate::plot::write_png(pixels, *w, *h, &out.join(name))?;
    }
    if let Some(folded) = &a.flamegraph {
        write_atomic(&out.join("flamegraph.folded"), folded.as_bytes())?;
        let title = format!("{}: live memory by stack (end, peak)", a.trace.name);
        let svg = crate::flame::svg(folded, &title).context("cannot render flamegraph.svg")?;
        if !svg.is_empty() {
            write_atomic(&out.join("flamegraph.svg"), &svg)?;
        }
    }
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
        let a = |get: fn(&crate::replay::AllocatorFigures) -> u64| -> Vec<Option<u64>> {
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
                "risk": a.predictions.iter().find(|q| q.pid == p.pid).and_then(|q| q.prediction.risk).map(Risk::name),
                "final": last_row(a, p.pid).map(|r| metrics_json(&r.metrics)),
            })
        })
        .collect();
    let mut report = json!({
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
            "risk": s.risk.map(Risk::name),
            "leaking": s.leaking,
        },
        "processes": processes,
        "prediction": headline(a).map(prediction_json),
        "ooms": a.ooms.iter().map(|o| json!({
            "t_ns": o.t_ns,
            "pid": o.pid,
            "requested": o.requested,
            "device_free": o.device_free,
            "largest_free": o.largest_free,
            "largest_gap": o.largest_gap,
            "live_bytes": o.live_bytes,
            "class": o.class.name(),
            "top_blocks": o.top_blocks.iter().map(|b| json!({"addr": b.0, "size": b.1})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "oom_classes": s.oom_classes.iter().map(|(c, n)| (c.name().to_string(), json!(n))).collect::<serde_json::Map<String, serde_json::Value>>(),
        "capacity_bytes": a.capacity,
        "iterations": a.iterations.iter().map(|it| json!({
            "pid": it.pid,
            "count": it.count,
            "complete": it.complete,
            "period_s": it.period_s.map(r6),
            "warmup_end_t_ns": it.warmup_end_t_ns,
            "source": it.source.name(),
            "boundaries_t_ns": it.boundaries_t_ns,
        })).collect::<Vec<_>>(),
        "leaks": a.leaks.iter().map(|l| json!({
            "pid": l.pid,
            "verdict": l.verdict.name(),
            "reason": l.reason,
            "leaking": l.leaking,
            "floor_early_bytes": l.floor_early_bytes,
            "floor_late_bytes": l.floor_late_bytes,
            "growth_bytes": l.growth_bytes,
            "rate_bytes_per_s": r6(l.rate_bytes_per_s),
            "live_at_end_bytes": l.live_at_end_bytes,
            "live_at_end_blocks": l.live_at_end_blocks,
            "by_size": l.by_size,
        })).collect::<Vec<_>>(),
    });
    if !a.exits.is_empty() {
        report["released_at_exit"] = json!(a.exits);
    }
    if a.panels_not_drawn > 0 {
        report["plots"] = json!({"panels_not_drawn": a.panels_not_drawn});
    }
    if !a.kernels.is_empty() {
        report["kernels"] = json!(a.kernels);
    }
    if !a.alloc_stacks.is_empty() {
        report["alloc_stacks"] = json!(a.alloc_stacks);
    }
    if a.allocator_view {
        report["view"] = json!("allocator");
        report["allocator"] = allocator_json(a);
        for (o, j) in a.ooms.iter().zip(report["ooms"].as_array_mut().into_iter().flatten()) {
            j["request_site"] = json!(o.request_site);
            j["top_sites"] = json!(o.top_sites);
        }
        for (l, j) in a.leaks.iter().zip(report["leaks"].as_array_mut().into_iter().flatten()) {
            j["top_sites"] = json!(l.top_sites);
            j["allocated_once"] = json!(l.allocated_once);
        }
    }
    report
}

/// The allocator view's figures per device at the end, and what the
/// snapshot import recorded (PyTorch's totals, the reconstruction check).
fn allocator_json(a: &Analysis) -> serde_json::Value {
    let devices: Vec<_> = a
        .peaks
        .iter()
        .map(|p| {
            let f = last_row(a, p.pid).and_then(|r| r.alloc).unwrap_or_default();
            json!({
                "device": p.pid,
                "reserved_bytes": f.reserved_bytes,
                "allocated_bytes": f.allocated_bytes,
                "requested_bytes": f.requested_bytes,
                "internal_fragmentation_bytes": f.allocated_bytes.saturating_sub(f.requested_bytes),
                "pytorch_fragmentation": r6(f.pytorch_fragmentation),
                "peak_reserved_bytes": a.rows.iter().filter(|r| r.pid == p.pid).filter_map(|r| r.alloc).map(|x| x.reserved_bytes).max(),
            })
        })
        .collect();
    let details = a.trace.meta.as_ref().map(|m| &m.details);
    let pick = |k: &str| details.and_then(|d| d.get(k)).cloned().unwrap_or(serde_json::Value::Null);
    json!({
        "devices": devices,
        "snapshot": {
            "file": pick("snapshot"),
            "layout": pick("layout"),
            "time_source": pick("time_source"),
            "allocator_settings": pick("allocator_settings"),
            "totals": pick("totals"),
            "reconstruction": pick("reconstruction"),
        },
    })
}

fn prediction_json(p: &ProcessPrediction) -> serde_json::Value {
    let pr = &p.prediction;
    json!({
        "pid": p.pid,
        "window": pr.window,
        "horizon": pr.horizon,
        "status": if pr.forecast.is_some() { "ok" } else { "insufficient data" },
        "current": r6(pr.current),
        "forecast": pr.forecast.as_ref().map(|f| f.iter().map(|v| r6(*v)).collect::<Vec<_>>()),
        "forecaster": pr.forecast.as_ref().map(|_| pr.forecaster.name()),
        "skill": pr.skill.map(r6),
        "model_forecast": pr.model_forecast.as_ref().map(|f| f.iter().map(|v| r6(*v)).collect::<Vec<_>>()),
        "confidence": pr.confidence.map(r6),
        "confidence_model": pr.confidence_model.map(r6),
        "trend": r6(pr.trend),
        "risk": pr.risk.map(Risk::name),
        "warnings": pr.warnings,
        "cv_mae": pr.cv_mae.as_ref().map(|c| json!({
            "model": r6(c.model),
            "persistence": r6(c.persistence),
            "seasonal": c.seasonal.map(r6),
            "seasonal_origins": c.seasonal_origins,
            "seasonal_reason": c.seasonal_reason,
            "ridge": c.ridge.map(r6),
            "ridge_lambda": c.ridge_lambda,
            "ridge_reason": c.ridge_reason,
            "origins": c.origins,
        })),
        "lead_time_steps": p.lead_time.map(|l| l.0),
        "lead_time_s": p.lead_time.map(|l| r6(l.1)),
    })
}

/// `report.md`: the verdict first, then the tables.
pub fn report_md(a: &Analysis) -> String {
    let s = Summary::of(a);
    let mut md = String::new();
    let _ = writeln!(md, "# fragscope report: {}\n", s.name);
    md.push_str(&verdict_md(a, &s));
    let _ = writeln!(
        md,
        "Fragmentation score now {:.1} / 100 (mean {:.1}, p95 {:.1}, max {:.1}) · peak live {} · {} OOM{} · {}{}.\n",
        s.score.final_,
        s.score.mean,
        s.score.p95,
        s.score.max,
        bytes(s.peak_live_bytes),
        s.ooms,
        if s.ooms == 1 { "" } else { "s" },
        s.processes,
        match (a.allocator_view, s.processes == 1) {
            (true, true) => " device",
            (true, false) => " devices",
            (false, true) => " process",
            (false, false) => " processes",
        },
    );
    let _ = writeln!(md, "| trace | |\n|---|---|");
    let _ = writeln!(md, "| source | {} |", s.source);
    if a.entry_order() {
        let _ = writeln!(
            md,
            "| events | {} over {} (no timestamps: time is entry order) |",
            s.events,
            a.time_text(s.duration_s)
        );
    } else {
        let _ = writeln!(md, "| events | {} over {:.3} s |", s.events, s.duration_s);
    }
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

    let _ = writeln!(md, "\n## {}\n", if a.allocator_view { "Devices" } else { "Processes" });
    let _ =
        writeln!(md, "| {} | peak live | score final | mean | p95 | max | E | K | S | C | L | U | OOMs |", a.unit());
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for p in &a.peaks {
        let st = ScoreStats::of(&process_scores(&a.rows, p.pid));
        let m = last_row(a, p.pid).map(|r| r.metrics).unwrap_or_default();
        let [e, k, small, cv, l, u] = m.features();
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {} |",
            p.pid,
            bytes(p.bytes),
            st.final_,
            st.mean,
            st.p95,
            st.max,
            e,
            k,
            small,
            cv,
            l,
            u,
            a.ooms.iter().filter(|o| o.pid == p.pid).count()
        );
    }
    let _ = writeln!(
        md,
        "\nE external fragmentation, K unusable-free-space index, S small-allocation ratio, C size CV, L large-gap ratio, U utilization — at the last step.\n"
    );
    if a.panels_not_drawn > 0 {
        let _ = writeln!(
            md,
            "The MDTP draws the {} processes with the highest peak live bytes: +{} processes not drawn (`--max-panels`, `--pid`); every process is in metrics.parquet and report.json.\n",
            a.peaks.len() - a.panels_not_drawn,
            a.panels_not_drawn
        );
    }
    if !a.exits.is_empty() {
        let bytes_total: u64 = a.exits.iter().map(|x| x.bytes).sum();
        let _ = writeln!(
            md,
            "Released at exit: {} process{} ended holding {} in {} blocks; the driver frees it, so it is neither live nor leaked afterwards (all in report.json).\n",
            a.exits.len(),
            if a.exits.len() == 1 { "" } else { "es" },
            bytes(bytes_total),
            a.exits.iter().map(|x| x.blocks).sum::<u64>()
        );
    }

    let _ = writeln!(md, "## Events by kind\n\n| kind | count |\n|---|---|");
    for (k, n) in &a.counts_by_kind {
        let _ = writeln!(md, "| {k} | {n} |");
    }
    let _ = writeln!(md, "| failed allocations | {} |", a.failed_allocs);

    if a.allocator_view {
        md.push_str(&allocator_md(a));
    }
    if !a.kernels.is_empty() {
        let _ = writeln!(
            md,
            "\n## Kernels\n\nLaunches by kernel (symbols from the traced processes' files, demangled):\n\n| kernel | launches | failed |\n|---|---|---|"
        );
        for k in a.kernels.iter().take(15) {
            let _ = writeln!(md, "| `{}` | {} | {} |", k.name.replace('|', "\\|"), k.launches, k.failed);
        }
        if a.kernels.len() > 15 {
            let _ = writeln!(md, "\n{} more in report.json.", a.kernels.len() - 15);
        }
    }
    if !a.alloc_stacks.is_empty() {
        let _ = writeln!(
            md,
            "\n## Allocation call stacks\n\nDevice memory allocated by call stack (`record --stacks`; innermost first, all in report.json):\n\n| bytes | allocations | stack |\n|---|---|---|"
        );
        for st in a.alloc_stacks.iter().take(10) {
            let frames: Vec<String> =
                st.frames.iter().take(8).map(|f| format!("`{}`", f.replace('|', "\\|"))).collect();
            let _ = writeln!(md, "| {} | {} | {} |", bytes(st.bytes), st.allocations, frames.join(" ← "));
        }
    }
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
            (
                "outside_segment",
                an.outside_segment,
                "blocks outside every live segment, or taken away by a segment free",
            ),
        ] {
            if n > 0 {
                let _ = writeln!(md, "| {name} | {n} — {why} |");
            }
        }
    }
    md.push_str(&iterations_md(a));
    md.push_str(&prediction_md(a));
    md.push_str(&ooms_md(a));
    md.push_str(&leaks_md(a));
    md.push_str(&advice_md(a, &s));
    md
}

/// The allocator view: PyTorch's own figures per device, and how the
/// snapshot import went.
fn allocator_md(a: &Analysis) -> String {
    let mut md = String::from("\n## PyTorch allocator\n\n");
    md.push_str(
        "At the end of the trace, per device (the totals `_memory_viz.py segsum` prints for the snapshot):\n\n",
    );
    md.push_str("| device | segments | reserved | allocated (requested) | free | of which internal | PyTorch fragmentation Σgap²/Σseg² |\n|---|---|---|---|---|---|---|\n");
    let details = a.trace.meta.as_ref().map(|m| &m.details);
    for p in &a.peaks {
        let f = last_row(a, p.pid).and_then(|r| r.alloc).unwrap_or_default();
        let totals = details.and_then(|d| d.get("totals")).and_then(|t| t.get(p.pid.to_string()));
        let n = |k: &str| totals.and_then(|t| t.get(k)).and_then(|v| v.as_u64());
        let free = n("free").unwrap_or(f.reserved_bytes.saturating_sub(f.requested_bytes));
        let internal = n("free_internal").unwrap_or(f.allocated_bytes.saturating_sub(f.requested_bytes));
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} ({:.1} %) | {:.3e} |",
            p.pid,
            n("segments").map_or("?".into(), |x| x.to_string()),
            bytes(n("reserved").unwrap_or(f.reserved_bytes)),
            bytes(n("allocated").unwrap_or(f.requested_bytes)),
            bytes(free),
            bytes(internal),
            if free == 0 { 0.0 } else { 100.0 * internal as f64 / free as f64 },
            f.pytorch_fragmentation
        );
    }
    if let Some(recs) = details.and_then(|d| d.get("reconstruction")).and_then(|r| r.as_array()) {
        md.push_str("\nImport: the trace was undone backwards from the final state, then replayed forwards.\n\n");
        md.push_str("| device | trace entries | alive before the first (segments, blocks) | final state | block sizes by rule, checked |\n|---|---|---|---|---|\n");
        for r in recs {
            let g = |k: &str| r.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
            let fc = r.get("final_check");
            let f = |k: &str| fc.and_then(|x| x.get(k)).and_then(|v| v.as_u64()).unwrap_or(0);
            let exact =
                f("blocks_missing") + f("blocks_unexpected") + f("blocks_size_mismatch") + f("segment_ranges_mismatch")
                    == 0
                    && f("segment_bytes_expected") == f("segment_bytes_replayed");
            let verdict = if exact {
                format!("matches the snapshot ({} live blocks)", f("blocks_expected"))
            } else {
                format!(
                    "**differs**: {} blocks missing, {} unexpected, {} of another size, {} segment ranges differ",
                    f("blocks_missing"),
                    f("blocks_unexpected"),
                    f("blocks_size_mismatch"),
                    f("segment_ranges_mismatch")
                )
            };
            let _ = writeln!(
                md,
                "| {} | {}{} | {}, {} | {} | {} of {} agreed |",
                g("device"),
                g("entries"),
                if g("inconsistent_entries") > 0 {
                    format!(" ({} contradicted the state)", g("inconsistent_entries"))
                } else {
                    String::new()
                },
                g("initial_segments"),
                g("initial_blocks"),
                verdict,
                g("sizes_agreed"),
                g("sizes_checked")
            );
        }
    }
    if let Some(ts) = details.and_then(|d| d.get("time_source")).and_then(|v| v.as_str())
        && ts != "time_us"
    {
        let _ = writeln!(md, "\nTime: {ts}.");
    }
    md
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// What the dominant OOM class means, in one sentence.
fn oom_sentence(class: OomClass) -> &'static str {
    match class {
        OomClass::Fragmentation => "enough memory was free, but no single free range could hold the request",
        OomClass::Capacity => "the requests exceeded the free device memory",
        OomClass::AllocatorPolicy => "a free range large enough existed, but the allocator did not use it",
        OomClass::Unknown => "the device capacity is unknown: pass --capacity to classify them",
    }
}

/// The verdict: risk, score and forecast, OOM causes, leak — first thing.
fn verdict_md(a: &Analysis, s: &Summary) -> String {
    let mut md = String::new();
    match headline(a) {
        Some(p) if p.prediction.forecast.is_some() => {
            let pr = &p.prediction;
            let f = pr.forecast.as_deref().unwrap_or_default();
            let forecast: Vec<String> = f.iter().map(|v| format!("{v:.1}")).collect();
            let _ = writeln!(
                md,
                "**Risk: {}** — fragmentation score {:.1} now, forecast {} over the next {} by {} ({}; confidence {:.2}, trend {:+.2} per step).\n",
                pr.risk.map_or("unknown", Risk::name).to_uppercase(),
                pr.current,
                forecast.join(" → "),
                plural(pr.horizon as u64, "step", "steps"),
                forecaster_phrase(pr.forecaster),
                skill_phrase(pr),
                pr.confidence.unwrap_or(0.0),
                pr.trend,
            );
        }
        _ => {
            let _ = writeln!(
                md,
                "**Risk: insufficient data** — too few steps for the predictor (it needs window + horizon + 1).\n"
            );
        }
    }
    if let Some((class, _)) = s.oom_classes.first() {
        let parts: Vec<String> =
            s.oom_classes.iter().map(|(c, n)| format!("{n} {}", c.name().replace('_', " "))).collect();
        let _ =
            writeln!(md, "**{}: {}** — {}.\n", plural(s.ooms, "OOM", "OOMs"), parts.join(", "), oom_sentence(*class));
    } else {
        let _ = writeln!(md, "No OOM in this trace.\n");
    }
    if s.leaking {
        let _ = writeln!(
            md,
            "**Leak**: the floor of live memory rose by {} and never came back.\n",
            bytes(s.leaked_bytes.max(0) as u64)
        );
    }
    md
}

/// The forecaster, for the headline.
fn forecaster_phrase(f: ForecasterKind) -> &'static str {
    match f {
        ForecasterKind::Model => "the model",
        ForecasterKind::Persistence => "\"no change\" (persistence)",
        ForecasterKind::Seasonal => "the seasonal baseline (one iteration earlier)",
        ForecasterKind::Ridge => "the ridge baseline",
    }
}

/// Whether the forecaster beats "no change", with its skill.
fn skill_phrase(pr: &crate::predict::Prediction) -> String {
    match (pr.forecaster, pr.skill) {
        (ForecasterKind::Persistence, _) => "nothing forecast better than no change".into(),
        (_, Some(s)) if s > 0.0 => format!("beats no change, skill {s:+.2}"),
        (_, Some(s)) => format!("does not beat no change, skill {s:+.2}"),
        (_, None) => "not validated: too few steps to compare with no change".into(),
    }
}

fn prediction_md(a: &Analysis) -> String {
    let mut md = String::from("\n## Prediction\n\n");
    let Some(p) = headline(a) else {
        md.push_str("No process with device memory activity.\n");
        return md;
    };
    let pr = &p.prediction;
    if a.predictions.len() > 1 {
        let _ = writeln!(md, "Process {} (the highest risk of {}).\n", p.pid, a.predictions.len());
    }
    if pr.forecast.is_none() {
        let _ = writeln!(
            md,
            "Insufficient data: {} steps, the model needs at least {}.",
            a.step_count,
            pr.window + pr.horizon + 1
        );
        return md;
    }
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(md, "| window / horizon | {} / {} steps |", pr.window, pr.horizon);
    if let Some(cv) = &pr.cv_mae {
        let or_why = |v: Option<f64>, why: &Option<String>| match v {
            Some(v) => format!("{v:.2}"),
            None => format!("none ({})", why.as_deref().unwrap_or("not evaluated")),
        };
        let _ = writeln!(
            md,
            "| cross-validated MAE (score points, {} origins) | model {:.2} · persistence {:.2} · seasonal {} · ridge {} |",
            cv.origins,
            cv.model,
            cv.persistence,
            or_why(cv.seasonal, &cv.seasonal_reason),
            or_why(cv.ridge, &cv.ridge_reason),
        );
    }
    let _ = writeln!(md, "| forecaster | {} (the lowest cross-validated MAE) |", pr.forecaster.name());
    let _ = writeln!(md, "| skill against \"no change\" | {} |", skill_phrase(pr));
    let _ = writeln!(
        md,
        "| confidence | {:.2} ({}); the model's own {:.2} |",
        pr.confidence.unwrap_or(0.0),
        pr.forecaster.name(),
        pr.confidence_model.unwrap_or(0.0)
    );
    let _ = writeln!(md, "| trend | {:+.3} points per step |", pr.trend);
    match p.lead_time {
        Some((steps, secs)) => {
            let _ = writeln!(
                md,
                "| warning lead time | risk reached high {} ({}) before the first OOM |",
                plural(steps as u64, "step", "steps"),
                a.time_text(secs)
            );
        }
        None if a.ooms.iter().any(|o| o.pid == p.pid) => {
            let _ =
                writeln!(md, "| warning lead time | none: the online risk did not reach high before the first OOM |");
        }
        None => {}
    }
    if let Some(cv) = &pr.cv_mae
        && pr.forecaster != ForecasterKind::Model
    {
        let _ = writeln!(
            md,
            "\nThe model does **not** beat {} here (MAE {:.2} vs {:.2}): the forecast above is {}'s, not the model's.",
            pr.forecaster.name(),
            cv.model,
            cv.best().1,
            pr.forecaster.name()
        );
    }
    if !pr.warnings.is_empty() {
        md.push_str("\nWarnings:\n\n");
        for w in &pr.warnings {
            let _ = writeln!(md, "- {w}");
        }
    }
    md
}

fn ooms_md(a: &Analysis) -> String {
    if a.ooms.is_empty() {
        return String::new();
    }
    let mut md = String::from("\n## OOMs\n\n");
    if a.capacity.is_none() {
        md.push_str("Device capacity unknown (pass `--capacity`): free memory and classes cannot be computed.\n\n");
    }
    md.push_str(
        "| time (s) | pid | requested | device free | largest free range | class |\n|---|---|---|---|---|---|\n",
    );
    if a.allocator_view {
        md = md.replace("| pid |", "| device |");
    }
    let shown = 20;
    for o in a.ooms.iter().take(shown) {
        let _ = writeln!(
            md,
            "| {:.6} | {} | {} | {} | {} | {} |",
            (o.t_ns - a.first_ts) as f64 / 1e9,
            o.pid,
            bytes(o.requested),
            o.device_free.map_or("unknown".into(), bytes),
            o.largest_free.map_or("unknown".into(), bytes),
            o.class.name()
        );
    }
    if a.ooms.len() > shown {
        let _ = writeln!(md, "\n… and {} more (all in report.json).", a.ooms.len() - shown);
    }
    let first = &a.ooms[0];
    if let Some(site) = &first.request_site {
        let _ = writeln!(md, "\nThe first failed request came from `{site}`.");
    }
    if !first.top_sites.is_empty() {
        md.push_str("\nLive memory by call site at the first OOM:\n\n| call site | bytes | blocks |\n|---|---|---|\n");
        for t in &first.top_sites {
            let _ = writeln!(md, "| `{}` | {} | {} |", t.site, bytes(t.bytes), t.blocks);
        }
    }
    md.push_str("\nLargest live blocks at the first OOM:\n\n| address | size |\n|---|---|\n");
    for (addr, size) in &first.top_blocks {
        let _ = writeln!(md, "| {addr:#x} | {} |", bytes(*size));
    }
    md
}

fn leaks_md(a: &Analysis) -> String {
    let mut md = String::from("\n## Leaks\n\n");
    let _ =
        writeln!(md, "| {} | verdict | floor compared | growth rate | alive at end |\n|---|---|---|---|---|", a.unit());
    for l in &a.leaks {
        let verdict = match l.verdict {
            crate::leak::Verdict::Leaking => "**leaking**",
            v => v.name(),
        };
        let floors =
            if l.floor_early_bytes == 0 && l.floor_late_bytes == 0 && l.verdict == crate::leak::Verdict::CannotTell {
                "—".to_string()
            } else {
                format!("{} → {}", bytes(l.floor_early_bytes), bytes(l.floor_late_bytes))
            };
        let rate = if l.leaking { format!("{}/s", bytes(l.rate_bytes_per_s.max(0.0) as u64)) } else { "—".into() };
        let _ = writeln!(
            md,
            "| {} | {verdict} | {floors} | {rate} | {} in {} |",
            l.pid,
            bytes(l.live_at_end_bytes),
            plural(l.live_at_end_blocks, "block", "blocks")
        );
    }
    md.push('\n');
    for l in &a.leaks {
        let _ = writeln!(md, "- {} {}: {}.", a.unit(), l.pid, l.reason);
    }
    if let Some(l) = a.leaks.iter().find(|l| l.leaking) {
        let _ = writeln!(
            md,
            "\nBlocks alive at the end in {} {}, by size:\n\n| size | blocks | bytes |\n|---|---|---|",
            if a.allocator_view { "device" } else { "process" },
            l.pid
        );
        for g in &l.by_size {
            let _ = writeln!(md, "| {} | {} | {} |", bytes(g.size), g.count, bytes(g.bytes));
        }
        if !l.top_sites.is_empty() {
            md.push_str("\nAllocated after the second quarter and still alive at the end, by call site:\n\n| call site | bytes | blocks |\n|---|---|---|\n");
            for t in &l.top_sites {
                let _ = writeln!(md, "| `{}` | {} | {} |", t.site, bytes(t.bytes), t.blocks);
            }
        }
    }
    for l in a.leaks.iter().filter(|l| !l.allocated_once.is_empty()) {
        let _ = writeln!(
            md,
            "\nAllocated once, in the warm-up (or only) iteration of {} {}, and alive at the end — state such as weights, optimizer moments or caches, not leaks:\n\n| call site | bytes | blocks |\n|---|---|---|",
            a.unit(),
            l.pid
        );
        for t in &l.allocated_once {
            let _ = writeln!(md, "| `{}` | {} | {} |", t.site, bytes(t.bytes), t.blocks);
        }
    }
    md
}

fn iterations_md(a: &Analysis) -> String {
    let mut md = String::from("\n## Iterations\n\n");
    if a.iterations.is_empty() {
        md.push_str(if a.trace.stacks.is_some() {
            "None found: no profiler annotations and no optimizer step in the call stacks (a snapshot's layers repeat \
             as regularly as iterations, so its allocation sequence is not used). Leak verdicts fall back to comparing \
             quarters of the trace, and say so.\n"
        } else {
            "None found: no profiler annotations, and no period in the allocation sequence (a period needs five \
             repetitions that give their memory back). Leak verdicts fall back to comparing quarters of the trace, and \
             say so.\n"
        });
        return md;
    }
    let _ = writeln!(
        md,
        "| {} | iterations | complete | period | warm-up ends | found from |\n|---|---|---|---|---|---|",
        a.unit()
    );
    for it in &a.iterations {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            it.pid,
            it.count,
            it.complete,
            it.period_s.map_or("—".into(), |p| a.time_text(p)),
            it.warmup_end_t_ns.map_or("—".into(), |t| a.time_text(t.saturating_sub(a.first_ts) as f64 / 1e9)),
            it.source.name()
        );
    }
    if a.iterations.iter().all(|it| it.complete < 4) {
        md.push_str(
            "\nFewer than four complete iterations: one iteration (plus warm-up) cannot show a leak or a trend across \
             iterations.\n",
        );
    }
    md
}

/// Advice that follows from the numbers.
fn advice_md(a: &Analysis, s: &Summary) -> String {
    let mut items: Vec<String> = Vec::new();
    let frag: Vec<_> = a.ooms.iter().filter(|o| o.class == OomClass::Fragmentation).collect();
    if let Some(o) = frag.first() {
        let free = o.device_free.unwrap_or(0);
        let largest = o.largest_free.unwrap_or(0);
        if a.trace.source() == Some(crate::trace::Source::PytorchSnapshot) {
            items.push(format!(
                "Fragmentation OOMs: a request of {} failed with {} free but at most {} contiguous. Set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` so segments grow in place instead of leaving holes, or `max_split_size_mb:{}` so blocks larger than that are never split.",
                bytes(o.requested),
                bytes(free),
                bytes(largest),
                (largest >> 20).max(20)
            ));
        } else {
            items.push(format!(
                "Fragmentation OOMs: a request of {} failed with {} free but at most {} contiguous. Allocate long-lived buffers first and together, reuse buffers of equal size, or use a pooling allocator that can map physical memory into a fresh range (CUDA's stream-ordered pools, or VMM-based expandable segments).",
                bytes(o.requested),
                bytes(free),
                bytes(largest)
            ));
        }
    }
    if let Some(o) = a.ooms.iter().find(|o| o.class == OomClass::Capacity) {
        items.push(format!(
            "Capacity OOMs: a request of {} met only {} free; live memory peaked at {}{}. Defragmenting will not help: reduce the batch, checkpoint activations or offload.",
            bytes(o.requested),
            bytes(o.device_free.unwrap_or(0)),
            bytes(s.peak_live_bytes),
            a.capacity.map_or(String::new(), |c| format!(" of {}", bytes(c)))
        ));
    }
    if s.leaking {
        items.push(format!(
            "Live memory that never returns to its floor grew by {}: look at the blocks alive at the end (Leaks).",
            bytes(s.leaked_bytes.max(0) as u64)
        ));
    }
    if a.ooms.is_empty() && s.risk >= Some(Risk::High) {
        items.push("No OOM yet, but the forecast risk is high: the free space is scattered in gaps; a larger request will not find room.".into());
    }
    if items.is_empty() {
        return String::new();
    }
    let mut md = String::from("\n## Advice\n\n");
    for i in items {
        let _ = writeln!(md, "- {i}");
    }
    md
}

/// A few lines for stdout.
pub fn stdout_summary(a: &Analysis, out: &Path) -> String {
    let s = Summary::of(a);
    format!(
        "{}: {} events, {} {}, {:.3} s, {} steps; risk {}\n  score final {:.1}, mean {:.1}, p95 {:.1}, max {:.1}; peak live {}; {} OOM{}; {} anomal{}\n  wrote {}\n",
        s.name,
        s.events,
        s.processes,
        match (a.allocator_view, s.processes == 1) {
            (true, true) => "device",
            (true, false) => "devices",
            (false, true) => "process",
            (false, false) => "processes",
        },
        s.duration_s,
        a.step_count,
        s.risk.map_or("insufficient data", Risk::name),
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

/// The columns of the batch summary, in order (csv and Parquet).
const SUMMARY_COLUMNS: &[&str] = &[
    "trace",
    "status",
    "error",
    "source",
    "date",
    "events",
    "processes",
    "duration_s",
    "peak_live_bytes",
    "peak_reserved_bytes",
    "allocs",
    "score_final",
    "score_mean",
    "score_p95",
    "score_max",
    "ext_frag_at_peak",
    "ooms",
    "oom_class",
    "risk",
    "leaking",
    "leaked_bytes",
    "anomalies",
    "cluster",
    "cluster_label",
];

/// One summary row's values as text (csv) — `None` for nulls.
fn summary_cells(
    name: &str,
    r: &std::result::Result<Summary, String>,
    cluster: Option<&(usize, String)>,
) -> Vec<Option<String>> {
    let mut v: Vec<Option<String>> = vec![Some(name.to_string())];
    match r {
        Ok(s) => {
            v.extend([
                Some("ok".into()),
                None,
                Some(s.source.clone()),
                Some(s.date.clone()),
                Some(s.events.to_string()),
                Some(s.processes.to_string()),
                Some(format!("{:.6}", s.duration_s)),
                Some(s.peak_live_bytes.to_string()),
                Some(s.peak_reserved_bytes.to_string()),
                Some(s.allocs.to_string()),
                Some(format!("{:.6}", s.score.final_)),
                Some(format!("{:.6}", s.score.mean)),
                Some(format!("{:.6}", s.score.p95)),
                Some(format!("{:.6}", s.score.max)),
                Some(format!("{:.6}", s.ext_frag_at_peak)),
                Some(s.ooms.to_string()),
                s.oom_classes.first().map(|c| c.0.name().to_string()),
                s.risk.map(|r| r.name().to_string()),
                Some(s.leaking.to_string()),
                Some(s.leaked_bytes.max(0).to_string()),
                Some(s.anomalies.to_string()),
            ]);
        }
        Err(e) => {
            v.extend([Some("error".into()), Some(e.clone()), Some("unknown".into()), Some(today())]);
            v.resize(SUMMARY_COLUMNS.len() - 2, None);
        }
    }
    v.push(cluster.map(|c| c.0.to_string()));
    v.push(cluster.map(|c| c.1.clone()));
    v
}

fn today() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string().chars().take(10).collect()
}

/// A DataFrame of summary rows with typed columns, without the partition
/// columns (`source`, `date`) that the dataset's folders hold.
fn summary_frame(
    rows: &[(&str, &std::result::Result<Summary, String>, Option<&(usize, String)>)],
) -> Result<DataFrame> {
    let ok = |f: fn(&Summary) -> f64| rows.iter().map(|r| r.1.as_ref().ok().map(f)).collect::<Vec<Option<f64>>>();
    let oku = |f: fn(&Summary) -> u64| rows.iter().map(|r| r.1.as_ref().ok().map(f)).collect::<Vec<Option<u64>>>();
    let text = |f: fn(&Summary) -> Option<String>| {
        rows.iter().map(|r| r.1.as_ref().ok().and_then(f)).collect::<Vec<Option<String>>>()
    };
    Ok(DataFrame::new_infer_height(vec![
        Column::new("trace".into(), rows.iter().map(|r| r.0.to_string()).collect::<Vec<String>>()),
        Column::new(
            "status".into(),
            rows.iter().map(|r| if r.1.is_ok() { "ok" } else { "error" }).collect::<Vec<&str>>(),
        ),
        Column::new("error".into(), rows.iter().map(|r| r.1.as_ref().err().cloned()).collect::<Vec<Option<String>>>()),
        Column::new("events".into(), oku(|s| s.events)),
        Column::new("processes".into(), oku(|s| s.processes as u64)),
        Column::new("duration_s".into(), ok(|s| s.duration_s)),
        Column::new("peak_live_bytes".into(), oku(|s| s.peak_live_bytes)),
        Column::new("peak_reserved_bytes".into(), oku(|s| s.peak_reserved_bytes)),
        Column::new("allocs".into(), oku(|s| s.allocs)),
        Column::new("score_final".into(), ok(|s| s.score.final_)),
        Column::new("score_mean".into(), ok(|s| s.score.mean)),
        Column::new("score_p95".into(), ok(|s| s.score.p95)),
        Column::new("score_max".into(), ok(|s| s.score.max)),
        Column::new("ext_frag_at_peak".into(), ok(|s| s.ext_frag_at_peak)),
        Column::new("ooms".into(), oku(|s| s.ooms)),
        Column::new("oom_class".into(), text(|s| s.oom_classes.first().map(|c| c.0.name().to_string()))),
        Column::new("risk".into(), text(|s| s.risk.map(|r| r.name().to_string()))),
        Column::new(
            "leaking".into(),
            rows.iter().map(|r| r.1.as_ref().ok().map(|s| s.leaking)).collect::<Vec<Option<bool>>>(),
        ),
        Column::new("leaked_bytes".into(), oku(|s| s.leaked_bytes.max(0) as u64)),
        Column::new("anomalies".into(), oku(|s| s.anomalies)),
        Column::new("cluster".into(), rows.iter().map(|r| r.2.map(|c| c.0 as u32)).collect::<Vec<Option<u32>>>()),
        Column::new(
            "cluster_label".into(),
            rows.iter().map(|r| r.2.map(|c| c.1.clone())).collect::<Vec<Option<String>>>(),
        ),
    ])?)
}

/// Writes the batch summary, worst first: `summary.parquet` — a
/// hive-partitioned dataset (`summary.parquet/source=S/date=D/part-0.parquet`)
/// that DuckDB, Spark or polars query in place —, `summary.csv` (one flat
/// file, every column) and `summary.md`. `clusters` (aligned with `rows`)
/// and `grouping` come from [`crate::cluster`] when the batch has enough
/// traces.
pub fn write_batch_summary(
    rows: &[SummaryRow],
    out: &Path,
    clusters: &[Option<(usize, String)>],
    grouping: Option<&crate::cluster::Clustering>,
) -> Result<()> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |r: &SummaryRow| r.1.as_ref().map_or(f64::INFINITY, |s| s.score.p95);
        key(&rows[b]).total_cmp(&key(&rows[a])).then_with(|| rows[a].0.cmp(&rows[b].0))
    });
    let cluster_of = |i: usize| clusters.get(i).and_then(|c| c.as_ref());

    // The dataset, one folder per (source, date), through a staging folder.
    let mut parts: std::collections::BTreeMap<(String, String), Vec<usize>> = Default::default();
    for &i in &order {
        let (source, date) = match &rows[i].1 {
            Ok(s) => (s.source.clone(), s.date.clone()),
            Err(_) => ("unknown".to_string(), today()),
        };
        parts.entry((source, date)).or_default().push(i);
    }
    let dataset = out.join("summary.parquet");
    let staging = out.join(".summary.parquet.partial");
    let _ = std::fs::remove_dir_all(&staging);
    for ((source, date), idx) in &parts {
        let dir = staging.join(format!("source={}", partition_value(source))).join(format!("date={date}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let part: Vec<_> = idx.iter().map(|&i| (rows[i].0.as_str(), &rows[i].1, cluster_of(i))).collect();
        write_parquet(&mut summary_frame(&part)?, &dir.join("part-0.parquet"))?;
    }
    if dataset.is_dir() {
        std::fs::remove_dir_all(&dataset).with_context(|| format!("cannot replace {}", dataset.display()))?;
    } else if dataset.exists() {
        std::fs::remove_file(&dataset).with_context(|| format!("cannot replace {}", dataset.display()))?;
    }
    std::fs::rename(&staging, &dataset).with_context(|| format!("cannot write {}", dataset.display()))?;

    let mut csv = csv::Writer::from_writer(Vec::new());
    csv.write_record(SUMMARY_COLUMNS)?;
    for &i in &order {
        let cells = summary_cells(&rows[i].0, &rows[i].1, cluster_of(i));
        csv.write_record(cells.into_iter().map(|c| c.unwrap_or_default()))?;
    }
    let csv = csv.into_inner().context("cannot finish summary.csv")?;
    write_atomic(&out.join("summary.csv"), &csv)?;
    write_atomic(&out.join("summary.md"), summary_md(rows, &order, clusters, grouping).as_bytes())?;
    Ok(())
}

/// A partition value safe in a folder name.
fn partition_value(v: &str) -> String {
    v.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect()
}

fn summary_md(
    rows: &[SummaryRow],
    order: &[usize],
    clusters: &[Option<(usize, String)>],
    grouping: Option<&crate::cluster::Clustering>,
) -> String {
    let mut md = String::from("# fragscope batch summary\n\nWorst first (by p95 score); failed traces on top.\n\n");
    md.push_str("| trace | status | risk | score final | p95 | max | OOMs | OOM class | peak live | group |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for &i in order {
        let (name, r) = (&rows[i].0, &rows[i].1);
        let group = clusters.get(i).and_then(|c| c.as_ref()).map_or(String::new(), |c| c.1.clone());
        match r {
            Ok(s) => {
                let _ = writeln!(
                    md,
                    "| {name} | ok | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {group} |",
                    s.risk.map_or("n/a", Risk::name),
                    s.score.final_,
                    s.score.p95,
                    s.score.max,
                    s.ooms,
                    s.oom_classes.first().map_or("—", |c| c.0.name()),
                    bytes(s.peak_live_bytes),
                );
            }
            Err(e) => {
                let _ = writeln!(
                    md,
                    "| {name} | **error**: {} | | | | | | | | |",
                    e.replace('|', "\\|").replace('\n', " ")
                );
            }
        }
    }
    match grouping {
        Some(g) => {
            let _ = writeln!(
                md,
                "\n## Groups\n\nk-means on the standardised features ({}), projected on the principal components that carry 90 % of their variance; k = {} chosen by the gap statistic (the smallest k with Gap(k) ≥ Gap(k+1) − s(k+1)).\n",
                crate::cluster::FEATURES.join(", "),
                g.k
            );
            md.push_str(
                "| group | traces | what stands out (z-score of the centroid) | examples |\n|---|---|---|---|\n",
            );
            for (c, label) in g.labels.iter().enumerate() {
                let members: Vec<&str> = (0..rows.len())
                    .filter(|&i| clusters.get(i).and_then(|x| x.as_ref()).is_some_and(|x| x.0 == c))
                    .map(|i| rows[i].0.as_str())
                    .collect();
                let mut top: Vec<(usize, f64)> = g.centroids[c].iter().copied().enumerate().collect();
                top.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()));
                let stand: Vec<String> = top
                    .iter()
                    .take(3)
                    .filter(|t| t.1.abs() > 0.5)
                    .map(|t| format!("{} {:+.1}", crate::cluster::FEATURES[t.0], t.1))
                    .collect();
                let _ = writeln!(
                    md,
                    "| {label} | {} | {} | {}{} |",
                    members.len(),
                    if stand.is_empty() { "nothing".to_string() } else { stand.join(", ") },
                    members.iter().take(5).copied().collect::<Vec<_>>().join(", "),
                    if members.len() > 5 { ", …" } else { "" }
                );
            }
            md.push_str("\n| k | Gap(k) | s(k) |\n|---|---|---|\n");
            for (k, (gap, sk)) in g.gaps.iter().enumerate() {
                let _ = writeln!(md, "| {} | {gap:.3} | {sk:.3} |", k + 1);
            }
        }
        None => {
            let _ = writeln!(md, "\nGroups: not computed (fewer than {} analysed traces).", crate::cluster::MIN_TRACES);
        }
    }
    md
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
