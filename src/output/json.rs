//! `report.json`: the analysis for machines, with stable keys and figures
//! rounded to 6 decimals.

use serde_json::json;

use crate::analysis::predict::Risk;
use crate::analysis::summary::*;
use crate::analysis::{Analysis, ProcessPrediction};
use crate::trace::FORMAT_VERSION;
use crate::units::r6;

pub(crate) fn score_json(s: &ScoreStats) -> serde_json::Value {
    json!({"final": r6(s.final_), "mean": r6(s.mean), "p95": r6(s.p95), "max": r6(s.max)})
}

pub(crate) fn metrics_json(m: &crate::analysis::metrics::Metrics) -> serde_json::Value {
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

/// `config`: the metric constants, and under `predict` the predictor's
/// settings (SPEC §6's numbers, and `cv_origins` and `retrain_every` as a
/// run may lower or raise them for speed).
fn config_json(a: &Analysis) -> serde_json::Value {
    let mut config = json!(a.options.metrics);
    config["predict"] = json!(a.options.predict);
    config
}

/// `report.json`.
/// `panels_not_drawn`: processes the MDTP had no room for.
pub fn report_json(a: &Analysis, panels_not_drawn: usize) -> serde_json::Value {
    let s = Summary::of(a);
    let at_peaks = at_peaks(a);
    let meta = a.trace.meta.as_ref();
    let history = a.has_history();
    let processes: Vec<_> = a
        .peaks
        .iter()
        .map(|p| {
            let at_peak = at_peaks.iter().find(|x| x.pid == p.pid);
            let mut j = json!({
                "pid": p.pid,
                "peak_live_bytes": p.bytes,
                "peak_t_ns": p.t_ns,
                "score": score_json(&ScoreStats::of(&process_scores(&a.rows, p.pid))),
                // A snapshot without history recorded no OOMs: none known.
                "ooms": history.then(|| a.ooms.iter().filter(|o| o.pid == p.pid).count()),
                "fragmentation_level": at_peak.map(|x| x.level.name()),
                "fragmentation_at_peak": at_peak.map(|x| json!({
                    "score": r6(x.score),
                    "step": x.step,
                    "t_ns": x.t_ns,
                    "live_bytes": x.live_bytes,
                    "held_bytes": x.span_bytes,
                })),
                "oom_risk": a.oom_risk.iter().find(|x| x.covers(p.pid)).map(|x| x.level.name()),
                "final": last_row(a, p.pid).map(|r| metrics_json(&r.metrics)),
            });
            // One device of a process that used several: `pid` is the
            // unit's id (as in rows, OOMs and leaks), these say which.
            if let Some((pid, device)) = a.trace.units.get(&p.pid) {
                j["process"] = json!(pid);
                j["device"] = json!(device);
            }
            j
        })
        .collect();
    // The long arrays go in by move: a `Value` inside `json!` is copied.
    let ooms = a
        .ooms
        .iter()
        .map(|o| {
            let mut j = json!({
                "t_ns": o.t_ns,
                "pid": o.pid,
                "requested": o.requested,
                "device_free": o.device_free,
                "cuda_free": o.cuda_free,
                // Counted only from a device-level recording's failed calls: a
                // snapshot's one `oom` entry does not say how often PyTorch asked.
                "retries": (!a.allocator_view).then_some(o.retries),
                "inside_pytorch_cache": o.inside_pytorch_cache,
                "largest_free": o.largest_free,
                "largest_gap": o.largest_gap,
                "live_bytes": o.live_bytes,
                "class": o.class.name(),
            });
            j["top_blocks"] = o.top_blocks.iter().map(|b| json!({"addr": b.0, "size": b.1})).collect();
            j
        })
        .collect::<Vec<_>>();
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
            // Processes (replay units) that ran PyTorch's caching allocator,
            // by their recorded maps: a device-level recording holds only
            // their segments.
            "pytorch_processes": a.pytorch_processes,
            // Processes with OOMs whose maps the recorder could not copy
            // (they exited first): whether they ran PyTorch's allocator,
            // whose retries would count an OOM twice, is unknown.
            "ooms_without_maps": a.ooms_without_maps,
            // False for a snapshot of one instant (no trace history): its
            // OOM counts are then null, not 0.
            "history": history,
        },
        "events": {
            "total": a.events,
            "by_kind": a.counts_by_kind.present().map(|(k, n)| (k.name().to_string(), json!(n))).collect::<serde_json::Map<String, serde_json::Value>>(),
            "failed_allocs": a.failed_allocs,
            "recovered_allocs": a.recovered_allocs,
            "null_frees": a.null_frees,
            "ooms": history.then_some(a.ooms.len()),
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
        "config": config_json(a),
        "summary": {
            "processes": s.processes,
            "peak_live_bytes": s.peak_live_bytes,
            // Over several processes or devices: their sum at one instant.
            "peak_live_is": match (s.history, s.processes) {
                (false, _) => Some("the most live at any event of a snapshot of one instant (its peak is not in it)"),
                (_, 0) => None,
                (_, 1) => Some("the one process's or device's"),
                _ => Some("summed over the processes or devices at one instant"),
            },
            "score": score_json(&s.score),
            "oom_risk": s.oom_risk.name(),
            "fragmentation_level": s.risk.map(Risk::name),
            "leaking": s.leaking_known(),
            "leak_verdict": s.leak_verdict.map(|v| v.name()),
        },
        "oom_risk": a.oom_risk.iter().map(|x| {
          let mut j = json!({
            "device": x.device,
            "level": x.level.name(),
            "reason": x.reason,
            "capacity_bytes": x.capacity.map(|c| c.bytes),
            "capacity_source": x.capacity.map(|c| c.source),
            "capacity_upper_bytes": x.capacity.and_then(|c| c.upper),
            "peak_bytes": x.peak_bytes,
            "peak_is": x.peak_what,
            "headroom_bytes": x.headroom_bytes,
            "leak_iterations_left": x.leak_iterations_left,
            "raised_by_leak": x.raised_by_leak,
            "largest_request_bytes": x.largest_request_bytes,
            "room_now_bytes": x.room_now_bytes,
            "trend_bytes_per_step": history.then(|| r6(x.trend_bytes_per_step)),
            "ooms": history.then_some(x.ooms),
            "fragmentation_level": x.fragmentation_level.map(Risk::name),
          });
          // The processes (replay units) on this GPU, when a device-level
          // recording's processes were on several.
          if let Some(m) = &x.members {
              j["units"] = json!(m);
          }
          j
        }).collect::<Vec<_>>(),
        "prediction": headline(a).map(prediction_json),
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
            "before_trace": it.before_trace,
        })).collect::<Vec<_>>(),
    });
    report["processes"] = processes.into();
    report["ooms"] = ooms.into();
    report["leaks"] = a.leaks.iter().map(leak_json).collect();
    report["advice"] = json!(a.advice);
    if let Some(crate::trace::details::Details::Record(d)) = a.trace.meta.as_ref().map(|m| &m.details)
        && !d.devices.is_empty()
    {
        report["devices_by_process"] = json!(d.devices);
    }
    if !a.trace.units.is_empty() {
        // The replay units that are one process's GPU: a process that used
        // several, or the processes of a recording of PyTorch's allocator.
        report["units"] = a
            .trace
            .units
            .iter()
            .map(|(id, (pid, device))| (id.to_string(), json!({"pid": pid, "device": device})))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    if let Some(j) = a.snapshot_details().and_then(|d| d.join.as_ref()) {
        report["join"] = json!({
            "recording": j.recording,
            "pids": j.pids,
            // The blocks are the recording's own (probes on PyTorch's allocator).
            "probed": j.probed,
            "blocks_without_segment": j.blocks_without_segment,
            // Probed recordings: CUDA's allocation and free calls recorded
            // beneath the blocks (0: none made, or the runtime not probed).
            "runtime_calls": j.runtime_calls,
            "segments_matched": j.segments_matched,
            "segments_total": j.segments_total,
            "clock_offset_ns": j.clock_offset_ns,
            "clock_disagreement_ns": j.clock_disagreement_ns,
            "outside": {
                "allocations": j.outside.allocations,
                "bytes": j.outside.bytes,
                "by_library": j.outside.by_library.iter()
                    .map(|(l, n, b)| json!({"library": l, "allocations": n, "bytes": b}))
                    .collect::<Vec<_>>(),
            },
        });
    }
    if !a.exits.is_empty() {
        report["released_at_exit"] = json!(a.exits);
    }
    if panels_not_drawn > 0 {
        report["plots"] = json!({"panels_not_drawn": panels_not_drawn});
    }
    if !a.kernels.is_empty() {
        report["kernels"] = json!(a.kernels);
    }
    if a.allocator_view {
        report["stages"] = json!(a.stages.stages);
    }
    if let Some(h) = a.trace.meta.as_ref().and_then(|m| m.details.snapshot()).and_then(|d| d.host.as_ref()) {
        let mut h = serde_json::to_value(h).unwrap_or_default();
        if let Some(m) = h.as_object_mut() {
            m.remove("series");
        }
        report["host_memory"] = h;
    }
    if let Some(c) = &a.settings_check {
        report["settings_check"] = json!(c);
    }
    if let Some(c) = &a.class {
        report["class"] = json!(c);
    }
    if let Some(d) = &a.decision {
        report["decision"] = json!(d);
        report["capacity"] = json!(d.capacity);
    }
    if let Some(w) = &a.whatif {
        report["memory_needed"] = crate::output::whatif::memory_needed_json(w);
        report["flushes"] =
            json!(w.fidelity.iter().map(|f| {
            let fl = w.flushes.iter().find(|(d, _)| *d == f.device).map(|x| x.1).unwrap_or_default();
            json!({"unit": f.device, "count": fl.count, "at_least": fl.at_least, "gc_releases": fl.gc_releases,
                   "oversize_releases": fl.oversize_releases})
        }).collect::<Vec<_>>());
        report["whatif"] = crate::output::whatif::json(w);
    } else if let Some(why) = &a.whatif_not_run {
        report["whatif_not_run"] = json!(why);
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
    }
    report
}

/// One series' leak verdict, with its exact floors: per complete
/// iteration (the warm-up first, `warmup: true`), or the six windows of
/// the fallback rule.
pub(crate) fn leak_json(l: &crate::analysis::leak::LeakReport) -> serde_json::Value {
    let iterations = l.method == crate::analysis::leak::Method::Iterations;
    json!({
        "pid": l.pid,
        "verdict": l.verdict.name(),
        "reason": l.reason,
        "leaking": l.leaking,
        "method": l.method,
        // Null where no floors were taken (a snapshot of one instant, too
        // few events): a 0 would read as no growth.
        "floor_early_bytes": (!l.floors.is_empty()).then_some(l.floor_early_bytes),
        "floor_late_bytes": (!l.floors.is_empty()).then_some(l.floor_late_bytes),
        "growth_bytes": (!l.floors.is_empty()).then_some(l.growth_bytes),
        "growth_per_iteration_bytes": l.growth_per_iteration_bytes,
        "growth_per_iteration_method": iterations.then_some("median of the rises from one iteration's floor to the next, after the warm-up"),
        "fluctuation_bytes": l.fluctuation_bytes,
        // Only a leak has a rate: a rise that may be one pass's is no rate
        // of anything.
        "rate_bytes_per_s": l.rate().map(r6),
        "floors": l.floors.iter().enumerate().map(|(i, f)| json!({
            "index": i,
            "warmup": iterations && i == 0,
            "start_t_ns": f.start_t_ns,
            "end_t_ns": f.end_t_ns,
            "bytes": f.bytes,
            "at_t_ns": f.at_t_ns,
        })).collect::<Vec<_>>(),
        "released_after_last_iteration": l.released_after.map(|(t, b)| json!({"t_ns": t, "bytes": b})),
        "live_at_end_bytes": l.live_at_end_bytes,
        "live_at_end_requested_bytes": l.live_at_end_requested_bytes,
        "live_at_end_blocks": l.live_at_end_blocks,
        "held_at_exit": l.held_at_exit.map(|(bytes, blocks)| json!({"bytes": bytes, "blocks": blocks})),
        "by_size": l.by_size,
        "top_sites": l.top_sites,
        "allocated_once": l.allocated_once,
    })
}

/// The allocator view's figures per device at the end, and what the
/// snapshot import recorded (PyTorch's totals, the reconstruction check).
pub(crate) fn allocator_json(a: &Analysis) -> serde_json::Value {
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
    let d = a.snapshot_details();
    json!({
        "devices": devices,
        "snapshot": {
            "file": d.map(|d| &d.snapshot),
            "layout": d.map(|d| &d.layout),
            "time_source": d.map(|d| &d.time_source),
            "allocator_settings": d.map(|d| &d.allocator_settings),
            "totals": d.map(|d| &d.totals),
            "reconstruction": d.map(|d| &d.reconstruction),
        },
    })
}

pub(crate) fn prediction_json(p: &ProcessPrediction) -> serde_json::Value {
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
        "confidence": pr.confidence.filter(|_| !pr.flat_score()).map(r6),
        "confidence_model": pr.confidence_model.map(r6),
        "trend": r6(pr.trend),
        "forecast_level": pr.risk.map(Risk::name),
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
