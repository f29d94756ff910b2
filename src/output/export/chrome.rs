//! `export --format chrome`: Trace Event JSON (`chrome://tracing`,
//! Perfetto's UI): per process, counters of live bytes, reserved bytes,
//! the score and its components and the online forecast; OOM instants with
//! their class; iteration slices; leak markers.

use std::io::Write;

use anyhow::{Context, Result};
use serde_json::json;

use crate::analysis::Analysis;
use crate::output::export::common::{
    Exporter, Paths, Source, Window, Written, iteration_spans, leak_marker_ns, timeline_pids,
};

/// The Trace Event JSON format.
pub(crate) struct Chrome;

impl Exporter for Chrome {
    fn needs_analysis(&self) -> bool {
        true
    }

    fn write(&self, paths: &Paths, source: Source<'_>, window: Window, out: &mut dyn Write) -> Result<Written> {
        let bytes = serde_json::to_vec(&chrome(source.analysis()?, window))?;
        out.write_all(&bytes).with_context(|| format!("cannot write {}", paths.output.display()))?;
        Ok(Written { what: "Trace Event JSON".into(), detail: String::new() })
    }
}

/// Trace Event JSON of an analysis: per process (device, for snapshots)
/// the counters `memory` (live and, in the allocator view, reserved
/// bytes), `fragmentation` (the score and its six components) and
/// `forecast` (the online backtest's next H scores); OOM instants with
/// their class; one slice per iteration; a marker per leak verdict at the
/// end. Timestamps are µs from the first event.
pub fn chrome(a: &Analysis, window: Window) -> serde_json::Value {
    let us = |t: u64| t.saturating_sub(a.first_ts) as f64 / 1000.0;
    let mut out = Vec::new();
    for pid in timeline_pids(a) {
        out.push(json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": format!("{} {}", a.unit(), a.who(pid))}}));
    }
    for r in a.rows.iter().filter(|r| window.contains(r.t_ns)) {
        let ts = us(r.t_ns);
        let m = &r.metrics;
        let mut memory = json!({"live_bytes": m.live_bytes});
        if let Some(reserved) = r.reserved_bytes() {
            memory["reserved_bytes"] = json!(reserved);
        }
        out.push(json!({"ph": "C", "name": "memory", "pid": r.pid, "tid": 0, "ts": ts, "args": memory}));
        let [e, k, sm, c, l, u] = m.features();
        out.push(json!({"ph": "C", "name": "fragmentation", "pid": r.pid, "tid": 0, "ts": ts, "args": {
            "score": m.score, "external_fragmentation": e, "kernel_unusable_index": k, "small_alloc_ratio": sm,
            "size_cv": c, "large_gap_ratio": l, "utilization": u,
        }}));
        if let Some(f) = &r.forecast {
            let args: serde_json::Map<String, serde_json::Value> =
                f.iter().enumerate().map(|(i, v)| (format!("score_t+{}", i + 1), json!(v))).collect();
            out.push(json!({"ph": "C", "name": "forecast", "pid": r.pid, "tid": 0, "ts": ts, "args": args}));
        }
    }
    for o in a.ooms.iter().filter(|o| window.contains(o.t_ns)) {
        out.push(json!({"ph": "i", "s": "p", "name": format!("OOM ({})", o.class.name()), "pid": o.pid, "tid": 0,
        "ts": us(o.t_ns), "args": {
            "class": o.class.name(), "requested_bytes": o.requested, "live_bytes": o.live_bytes,
            "largest_gap_bytes": o.largest_gap, "device_free_bytes": o.device_free, "site": o.request_site,
        }}));
    }
    for it in iteration_spans(a, window) {
        out.push(json!({"ph": "X", "name": format!("iteration {}", it.number), "cat": "iteration", "pid": it.pid,
            "tid": 1, "ts": us(it.start_ns), "dur": (it.end_ns - it.start_ns) as f64 / 1000.0, "args": {"source": it.source}}));
    }
    let end = leak_marker_ns(a, window);
    for l in &a.leaks {
        out.push(json!({"ph": "i", "s": "p", "name": format!("leak: {}", l.verdict.name()), "pid": l.pid, "tid": 0,
            "ts": us(end), "args": {"verdict": l.verdict.name(), "reason": l.reason, "growth_bytes": l.growth_bytes,
            "rate_bytes_per_s": l.rate()}}));
    }
    json!({
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "fragscope", "trace": a.trace.name},
    })
}
