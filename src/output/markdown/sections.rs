//! The sections of `report.md` after the headline: the verdict, the OOM
//! risk, the allocator's figures, the forecast, the OOMs, the leaks, the
//! iterations and the advice.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::words::{confidence_phrase, forecaster_phrase, oom_sentence, plural, skill_phrase};
use crate::analysis::Analysis;
use crate::analysis::predict::{ForecasterKind, Risk};
use crate::analysis::summary::*;
use crate::units::bytes;

/// The allocator view: PyTorch's own figures per device, and how the
/// snapshot import went.
pub(crate) fn allocator_md(a: &Analysis) -> String {
    let mut md = String::from("\n## PyTorch allocator\n\n");
    md.push_str(
        "At the end of the trace, per device: segments, reserved, allocated, free and internal are the totals `_memory_viz.py segsum` prints for the snapshot; the internal share is of the free bytes. The last column is Σ(free gap)² / (Σ segment size)², which segsum does not print (metrics.parquet's `pytorch_fragmentation`). Despite that name it is not a fragmentation score: it rises as free memory gathers into fewer, larger ranges — 1 when all reserved memory is one free range, near 0 when the free memory lies in many small gaps or little is free.\n\n",
    );
    md.push_str("| device | segments | reserved | allocated (requested) | free | of which internal | free-range concentration Σgap²/(Σseg)² (1 = all reserved is one free range) |\n|---|---|---|---|---|---|---|\n");
    let details = a.snapshot_details();
    for p in &a.peaks {
        let f = last_row(a, p.pid).and_then(|r| r.alloc).unwrap_or_default();
        let totals = details.and_then(|d| d.totals.get(&p.pid.to_string()));
        let free = totals.map_or(f.reserved_bytes.saturating_sub(f.requested_bytes), |t| t.free);
        let internal = totals.map_or(f.allocated_bytes.saturating_sub(f.requested_bytes), |t| t.free_internal);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} ({:.1} % of free) | {:.3} |",
            a.who(p.pid),
            totals.map_or(f.segments, |t| t.segments),
            bytes(totals.map_or(f.reserved_bytes, |t| t.reserved)),
            bytes(totals.map_or(f.requested_bytes, |t| t.allocated)),
            bytes(free),
            bytes(internal),
            if free == 0 { 0.0 } else { 100.0 * internal as f64 / free as f64 },
            f.pytorch_fragmentation
        );
    }
    // A recording of PyTorch's allocator was not reconstructed from a final
    // state: its devices are listed for `whatif` only.
    let probed = details.and_then(|d| d.join.as_ref()).is_some_and(|j| j.probed);
    let entries: u64 = details.map_or(0, |d| d.entries());
    if details.is_some_and(|d| !d.reconstruction.is_empty()) && entries == 0 {
        md.push_str("\nImport: the snapshot holds no trace entries; its state at the one instant it was taken is all there is.\n");
    } else if let Some(recs) = details.map(|d| &d.reconstruction).filter(|r| !r.is_empty() && !probed) {
        md.push_str("\nImport: the trace was undone backwards from the final state, then replayed forwards.\n\n");
        md.push_str("| device | trace entries | alive before the first (segments, blocks) | final state | block sizes by rule, checked |\n|---|---|---|---|---|\n");
        for r in recs {
            let fc = &r.final_check;
            let verdict = if fc.exact() {
                format!("matches the snapshot ({} live blocks)", fc.blocks_expected)
            } else {
                format!(
                    "**differs**: {} blocks missing, {} unexpected, {} of another size, {} segment ranges differ",
                    fc.blocks_missing, fc.blocks_unexpected, fc.blocks_size_mismatch, fc.segment_ranges_mismatch
                )
            };
            let checked = if r.sizes_checked == 0 {
                "—".to_string()
            } else {
                format!("{} of {} agreed", r.sizes_agreed, r.sizes_checked)
            };
            let _ = writeln!(
                md,
                "| {} | {}{} | {}, {} | {} | {checked} |",
                r.device,
                r.entries,
                if r.inconsistent_entries > 0 {
                    format!(" ({} contradicted the state)", r.inconsistent_entries)
                } else {
                    String::new()
                },
                r.initial_segments,
                r.initial_blocks,
                verdict,
            );
        }
    }
    if let Some(ts) = details.map(|d| d.time_source.as_str())
        && ts != "time_us"
    {
        let _ = writeln!(md, "\nTime: {ts}.");
    }
    // Settings the snapshot did not record (older PyTorch writes none).
    if let Some(d) = details.filter(|d| d.join.is_none() && a.whatif.is_some()) {
        let recorded = d.allocator_settings.as_object().map_or(0, |m| m.len()) > d.inferred_settings.len();
        if d.inferred_settings.iter().any(|k| k == "expandable_segments") {
            let _ = writeln!(
                md,
                "\nSettings: the snapshot does not record `expandable_segments`, and its segments are expandable, so it \
                 was on when they were made: the replay below takes `expandable_segments:True`{}.",
                if recorded { "" } else { " and PyTorch's defaults for the other settings, which it records none of" }
            );
        } else if !recorded {
            let _ = writeln!(
                md,
                "\nSettings: the snapshot records no allocator settings (older PyTorch writes none): the replay below \
                 takes PyTorch's defaults."
            );
        }
    }
    md
}

/// What the score "now" describes: the state at the process's last
/// timestep (before its exit, for a process that exited), which for a
/// finished job is often a cache its tensors have left.
fn last_state(a: &Analysis, pid: u32) -> String {
    let Some(m) = last_row(a, pid).map(|r| &r.metrics).filter(|m| m.span_bytes > 0) else {
        return String::new();
    };
    format!(" (the last timestep's state: {} live in {} {})", bytes(m.live_bytes), bytes(m.span_bytes), held(a))
}

/// What a process's span is, in the report's words.
fn held(a: &Analysis) -> &'static str {
    if a.allocator_view { "reserved" } else { "of arenas" }
}

/// The verdict: OOM risk, the fragmentation level and its forecast, OOM
/// causes, leak — first thing.
pub(crate) fn verdict_md(a: &Analysis, s: &Summary) -> String {
    let mut md = String::new();
    md.push_str(&oom_risk_md(a));
    md.push_str(&level_at_peak_md(a));
    if let Some((class, _)) = s.oom_classes.first() {
        let parts: Vec<String> =
            s.oom_classes.iter().map(|(c, n)| format!("{n} {}", c.name().replace('_', " "))).collect();
        // Only when every OOM without a class failed inside PyTorch's cache:
        // `--capacity` would classify the others.
        let unknown = a.ooms.iter().filter(|o| o.class == crate::analysis::oom::OomClass::Unknown);
        let sentence = if *class == crate::analysis::oom::OomClass::Unknown
            && unknown.clone().all(|o| o.inside_pytorch_cache)
        {
            "the process ran PyTorch's caching allocator, so its requests failed inside PyTorch's cache, whose free \
             blocks this recording of cudaMalloc calls does not see: capacity or fragmentation cannot be told from it, \
             whatever `--capacity` says (record again with this version's probes on PyTorch's allocator, without \
             `--no-torch`, or take a memory snapshot)"
        } else if *class == crate::analysis::oom::OomClass::Unknown && a.allocator_view {
            "the free memory CUDA reported during the failed request is not in the trace (a snapshot's `oom` entry \
             holds it as `device_free`; a recording of PyTorch's allocator, when `record` read the `cudaMemGetInfo` \
             PyTorch makes as it fails), so capacity cannot be told from fragmentation, whatever `--capacity` says: \
             the CUDA context's own memory is in no trace"
        } else {
            oom_sentence(*class)
        };
        let _ = writeln!(md, "**{}: {}** — {sentence}.\n", plural(s.ooms, "OOM", "OOMs"), parts.join(", "));
    } else if let Some(why) = no_history(a) {
        let _ = writeln!(md, "OOMs, leaks, iterations and what-if cannot be judged from this file: {why}.\n");
    } else {
        let _ = writeln!(md, "No OOM in this trace.\n");
    }
    if s.leaking {
        let _ = writeln!(
            md,
            "**Leak**: the floor of live memory rose by {} across iterations (Leaks).\n",
            bytes(s.leaked_bytes.max(0) as u64)
        );
    }
    md
}

/// The headline fragmentation level: judged at the timestep where the
/// unit held the most (SPEC §6.10), with where that was.
fn level_at_peak_md(a: &Analysis) -> String {
    let Some(p) = headline_at_peak(a) else {
        return "Fragmentation level: not judged — no memory was held at any timestep.\n\n".to_string();
    };
    let (peaked, held) =
        if a.allocator_view { ("reserved memory", "reserved") } else { ("the arena span", "of arenas") };
    // A process that ran PyTorch's caching allocator, recorded at its
    // cudaMalloc calls: the level of its segments says nothing of the gaps
    // inside its cache, and is not given as its level.
    let level = if a.pytorch_processes.contains(&p.pid) {
        format!(
            "not measured inside PyTorch's cache — the process ran PyTorch's caching allocator, and this recording \
             of its cudaMalloc calls holds its segments, not the blocks inside them. Of the segments alone: {}",
            p.level.name()
        )
    } else {
        format!("**{}**", p.level.name())
    };
    let who = if a.peaks.len() > 1 { format!(" of {}", a.who(p.pid)) } else { String::new() };
    let when = if a.entry_order() {
        format!("step {}", p.step)
    } else {
        format!("step {}, {}", p.step, a.time_text((p.t_ns.saturating_sub(a.first_ts)) as f64 / 1e9))
    };
    format!(
        "Fragmentation level: {level} — fragmentation score {:.1} at the timestep where {peaked}{who} peaked \
         ({when}: {} live in {} {held}), when memory was scarcest. The score counts free blocks that a cache \
         keeps on purpose as gaps: on its own it does not say that memory will run out. Where the score heads from \
         the run's end is the forecast level, under Prediction.\n\n",
        p.score,
        bytes(p.live_bytes),
        bytes(p.span_bytes),
    )
}

/// The seed's forecast level (SPEC §6.8), from the run's end: the
/// Prediction section's first line.
fn forecast_level_md(a: &Analysis, p: &crate::analysis::ProcessPrediction) -> String {
    let pr = &p.prediction;
    let f = pr.forecast.as_deref().unwrap_or_default();
    let forecast: Vec<String> = f.iter().map(|v| format!("{v:.1}")).collect();
    let level = pr.risk.map_or("unknown", Risk::name);
    if let Some(m) = last_row(a, p.pid).map(|r| &r.metrics).filter(|_| ended_empty(a, p.pid)) {
        // The score of an emptied cache, and where it heads, are no
        // level of the program's.
        return format!(
            "Forecast level: not judged — nothing is live at the last timestep (every block was freed; {1} still \
             {held}), and the score of that empty state, {0:.1} ({level} by its scale), or a forecast of it, says \
             nothing of the program.\n\n",
            pr.current,
            bytes(m.span_bytes),
            held = held(a),
        );
    }
    format!(
        "Forecast level: {level} — fragmentation score {:.1} now{}, forecast {} over the next {} by {} ({}; {}, trend \
         {:+.2} per timestep).\n\n",
        pr.current,
        last_state(a, p.pid),
        forecast.join(" → "),
        plural(pr.horizon as u64, "timestep", "timesteps"),
        forecaster_phrase(pr.forecaster),
        skill_phrase(pr),
        confidence_phrase(pr),
        pr.trend,
    )
}

/// A snapshot that holds no trace history: only the state at one instant,
/// and why, as far as the file tells.
pub(crate) fn no_history(a: &Analysis) -> Option<String> {
    if a.has_history() {
        return None;
    }
    let d = a.snapshot_details()?;
    let entries = d.entries();
    Some(if a.peaks.is_empty() && entries == 0 {
        "it holds nothing: no segment and no trace entry (PyTorch had reserved no GPU memory when it was dumped)"
            .to_string()
    } else if d.layout == "bare list of segments" {
        "it holds no trace history, only the state at one instant: the file is a bare list of segments, as \
         `torch.cuda.memory_snapshot()` returns, which never holds one (`torch.cuda.memory._snapshot()` or \
         `_dump_snapshot` with memory history recording does)"
            .to_string()
    } else if entries == 0 {
        "it holds no trace history (no `alloc`/`free` entries, only the state at one instant: PyTorch's memory \
         history was not recording when it was dumped)"
            .to_string()
    } else {
        format!(
            "its trace holds {entries} entr{} and no allocation, so only the state at one instant: PyTorch keeps the \
             last entries of its memory history, one only when it is turned on with a bool \
             (`_record_memory_history(True)`, the older form, whose `trace_alloc_max_entries` is 1); \
             `_record_memory_history(max_entries=N)` keeps N",
            if entries == 1 { "y" } else { "ies" }
        )
    })
}

/// The OOM risk headline: one line, or one per device.
pub(crate) fn oom_risk_md(a: &Analysis) -> String {
    use crate::analysis::risk::OomRisk;
    let mut md = String::new();
    let Some(worst) = a.oom_risk.iter().max_by_key(|x| x.level) else {
        return "**OOM risk: UNKNOWN** — no device memory activity in this trace.\n\n".into();
    };
    let line = |x: &crate::analysis::risk::Assessment| -> String {
        match x.level {
            OomRisk::Oom => format!("{} — see OOMs below", x.reason),
            OomRisk::Unknown => format!("{}; pass `--capacity` to judge the headroom", x.reason),
            _ => {
                let c = x.capacity.map_or(String::new(), |c| format!(" (capacity {})", c.source.phrase()));
                format!("{}{c}", x.reason)
            }
        }
    };
    if a.oom_risk.len() == 1 {
        let _ = writeln!(md, "**OOM risk: {}** — {}.\n", worst.level.name().to_uppercase(), line(worst));
    } else {
        let _ = writeln!(
            md,
            "**OOM risk: {}** (the highest of {} devices):\n",
            worst.level.name().to_uppercase(),
            a.oom_risk.len()
        );
        for x in &a.oom_risk {
            let _ = writeln!(md, "- {}: **{}** — {}.", a.device_name(x.device.unwrap_or(0)), x.level.name(), line(x));
        }
        md.push('\n');
    }
    md
}

pub(crate) fn prediction_md(a: &Analysis) -> String {
    let mut md = String::from("\n## Prediction\n\n");
    let Some(p) = headline(a) else {
        md.push_str("No process with device memory activity.\n");
        return md;
    };
    let pr = &p.prediction;
    if a.predictions.len() > 1 {
        let unit = if a.unit() == "device" { "Device" } else { "Process" };
        let _ = writeln!(md, "{unit} {} (the highest risk of {}).\n", a.who(p.pid), a.predictions.len());
    }
    if pr.forecast.is_none() {
        let _ = writeln!(
            md,
            "Insufficient data: {}, the model needs at least {}.",
            plural(a.step_count as u64, "step", "steps"),
            pr.window + pr.horizon + 1
        );
        return md;
    }
    md.push_str(&forecast_level_md(a, p));
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(md, "| window / horizon | {} / {} timesteps |", pr.window, pr.horizon);
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
    if pr.flat_score() {
        let _ = writeln!(md, "| confidence | not rated: the score did not move at any cross-validation origin |");
    } else {
        let _ = writeln!(
            md,
            "| confidence | {:.2} ({}); the model's own {:.2} |",
            pr.confidence.unwrap_or(0.0),
            pr.forecaster.name(),
            pr.confidence_model.unwrap_or(0.0)
        );
    }
    let _ = writeln!(md, "| trend | {:+.3} points per timestep |", pr.trend);
    match p.lead_time {
        Some((steps, secs)) => {
            let _ = writeln!(
                md,
                "| warning lead time | the online OOM risk reached high {} ({}) before the first OOM |",
                plural(steps as u64, "step", "steps"),
                a.time_text(secs)
            );
        }
        None if a.ooms.iter().any(|o| o.pid == p.pid) => {
            let first = a.ooms.iter().filter(|o| o.pid == p.pid).map(|o| o.t_ns).min().unwrap_or(u64::MAX);
            let known = a.rows.iter().any(|r| {
                r.pid == p.pid
                    && r.t_ns < first
                    && r.oom_risk_online.is_some_and(|x| x != crate::analysis::risk::OomRisk::Unknown)
            });
            let _ = writeln!(
                md,
                "| warning lead time | {} |",
                if known {
                    "none: the online OOM risk did not reach high before the first OOM"
                } else {
                    "none: the capacity was not known before the first OOM (give `--capacity`), so no online OOM risk could be computed before it"
                }
            );
        }
        None => {}
    }
    if pr.cv_mae.is_some() {
        md.push_str(
            "\nHow to read it: at each origin (a past timestep), each forecaster saw only the timesteps before it and \
             predicted the next ones (the horizon); MAE is its mean absolute error there, in score points. The model: \
             a linear model of the window's metrics, trained by gradient descent; ridge: the same inputs, solved \
             directly with a penalty; persistence: no change; seasonal: the score one iteration earlier. Skill = 1 − \
             MAE ÷ persistence's MAE (above 0: better than no change); confidence = 1 − MAE ÷ 50, at least 0.1, not \
             rated where the score never moved.\n",
        );
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
    if pr.warnings.is_empty() && last_row(a, p.pid).is_some_and(|r| r.metrics.live_bytes == 0) {
        md.push_str(
            "\nNo fragmentation warnings (deterioration, trend): nothing is live at the last timestep, and where the \
             score of that empty state heads says nothing of the program.\n",
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

pub(crate) fn ooms_md(a: &Analysis) -> String {
    if a.ooms.is_empty() {
        return String::new();
    }
    let mut md = String::from("\n## OOMs\n\n");
    // The capacity of each device with an OOM, and where it comes from:
    // the same figures the OOM risk and the classes use.
    for x in a.oom_risk.iter().filter(|x| x.ooms > 0) {
        let whose = match x.device {
            Some(d) => a.device_name(d),
            None => "the device".to_string(),
        };
        let _ = match x.capacity {
            Some(c) => writeln!(md, "Capacity of {whose}: {}, {}.\n", bytes(c.bytes), c.source.phrase()),
            None if a.ooms.iter().any(|o| o.device_free.is_some() && x.covers(o.pid)) => {
                writeln!(
                    md,
                    "Capacity of {whose}: not known; the free memory below is what the OOM entries reported.\n"
                )
            }
            None if a.ooms.iter().all(|o| o.inside_pytorch_cache) => writeln!(
                md,
                "Capacity of {whose}: not known (`--capacity` gives the free device memory; the class cannot be told \
                 from this recording, see above).\n"
            ),
            None => writeln!(
                md,
                "Capacity of {whose}: not known (pass `--capacity`): free memory and classes cannot be computed.\n"
            ),
        };
    }
    // Time since the first event; in entry order (a snapshot without
    // time_us) the entry number, as 1 ns stands for one entry there.
    let (when, at): (&str, fn(u64) -> String) =
        if a.entry_order() { ("entry", |d| d.to_string()) } else { ("time (s)", |d| format!("{:.6}", d as f64 / 1e9)) };
    // Under PyTorch's allocator the free memory is CUDA's and the unused
    // bytes of its segments: the table says so, and gives CUDA's figure.
    let cached = a.allocator_view && a.ooms.iter().any(|o| o.cuda_free.is_some());
    // The largest range is the larger of the cache's largest gap and the
    // free memory outside it, taken as one (what `cudaMalloc` could still
    // give): with a cache, both are shown.
    let (free, ranges, rule) = if cached {
        (
            "free (CUDA + PyTorch's cache)",
            "largest gap in the cache | largest request that could fit (the larger of that gap and CUDA's free)",
            "|---|---|---|---|---|---|---|",
        )
    } else {
        ("device free", "largest free range", "|---|---|---|---|---|---|")
    };
    let _ = writeln!(md, "| {when} | {} | requested | {free} | {ranges} | class |\n{rule}", a.unit());
    let shown = 20;
    for o in a.ooms.iter().take(shown) {
        let gap = if cached { format!(" {} |", bytes(o.largest_gap)) } else { String::new() };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} |{gap} {} | {} |",
            at(o.t_ns - a.first_ts),
            a.who(o.pid),
            bytes(o.requested),
            o.device_free.map_or("unknown".into(), bytes),
            o.largest_free.map_or("unknown".into(), bytes),
            o.class.name()
        );
    }
    if a.ooms.len() > shown {
        let _ = writeln!(md, "\n… and {} more (all in report.json).", a.ooms.len() - shown);
    }
    let retried = a.ooms.iter().filter(|o| o.retries > 0).count();
    if retried > 0 {
        let calls: u64 = a.ooms.iter().map(|o| 1 + u64::from(o.retries)).sum();
        let how = if a.ooms.iter().any(|o| o.retries > 1) {
            "asked up to three times: PyTorch's allocator, which the process ran with `max_split_size_mb`, released \
             its cached blocks above that size and asked again, then its whole cache and asked once more, and those \
             asks failed too"
        } else {
            "asked twice: PyTorch's allocator, which the process ran, released its cache and asked once more, and \
             that failed too"
        };
        let _ = writeln!(
            md,
            "\n{} {how}. Each request is counted once ({calls} failed cudaMalloc calls in all).",
            if retried == 1 && a.ooms.len() == 1 {
                "The request was".to_string()
            } else {
                format!("{retried} of these requests were")
            }
        );
    }
    if !a.ooms_without_maps.is_empty() {
        let pids: Vec<String> = a.ooms_without_maps.iter().map(u32::to_string).collect();
        let _ = writeln!(
            md,
            "\nThe recording holds no copy of the memory map of {} {} (a process that ends moments after its first \
             CUDA call can exit before the recorder reads it): which libraries it loaded is unknown, so whether it \
             ran PyTorch's caching allocator is too. If it did, these OOMs are counted one per failed cudaMalloc, \
             though PyTorch asks again after releasing its cache (one request can count twice), and their class is \
             of PyTorch's segments, not its tensors.",
            if pids.len() == 1 { "process" } else { "processes" },
            pids.join(", ")
        );
    }
    let first = &a.ooms[0];
    if cached && let (Some(cuda), Some(free)) = (first.cuda_free, first.device_free) {
        let _ = writeln!(
            md,
            "\nAt the first OOM CUDA reported {} free (the figure in PyTorch's error message); PyTorch's segments held {} unused.",
            bytes(cuda),
            bytes(free.saturating_sub(cuda))
        );
    }
    if a.snapshot_details().is_some_and(|d| d.join.is_some()) {
        md.push_str(&oom_with_recording(a, first));
    }
    if let Some(site) = &first.request_site {
        let _ = writeln!(md, "\nThe first failed request came from `{site}`.");
    }
    if !first.top_sites.is_empty() {
        md.push_str(if a.allocator_view {
            "\nLive memory by call site at the first OOM, in the bytes its blocks held (the allocator's rounding \
             included: what the failed request could not use):\n\n| call site | bytes | blocks |\n|---|---|---|\n"
        } else {
            "\nLive memory by call site at the first OOM:\n\n| call site | bytes | blocks |\n|---|---|---|\n"
        });
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

/// The analysis's advice ([`crate::analysis::advice`]), each marked as
/// simulated or not.
pub(crate) fn advice_md(a: &Analysis) -> String {
    if a.advice.is_empty() {
        return String::new();
    }
    let mut md = String::from("\n## Advice\n\n");
    for i in &a.advice {
        let _ = writeln!(md, "- {}", i.text);
    }
    md
}

/// The join of a recording with the snapshot (`analyze --snapshot`): what
/// matched, and the device memory PyTorch's allocator did not hold.
pub(crate) fn join_md(a: &Analysis) -> String {
    let Some(j) = a.snapshot_details().and_then(|d| d.join.as_ref()) else { return String::new() };
    let mut md = String::new();
    if j.probed {
        md.push_str("\n## PyTorch's allocator, recorded\n\n");
        let _ = writeln!(
            md,
            "Recorded with the probes on PyTorch's caching allocator (pid {}): every tensor's block, inside the {} \
             segments PyTorch got from CUDA while recording (the device allocations a block was placed in). Block sizes \
             follow PyTorch's rounding and split rules on the recorded layout, under the process's \
             `PYTORCH_CUDA_ALLOC_CONF` ({}).\n",
            j.pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", "),
            j.segments_matched,
            a.snapshot_details()
                .map(|d| crate::allocator::Settings::from_snapshot(&d.allocator_settings).conf_entries())
                .filter(|e| !e.is_empty())
                .map_or_else(|| "unset: PyTorch's defaults".to_string(), |e| format!("`{}`", e.join(","))),
        );
        if j.blocks_without_segment > 0 {
            let why = if j.runtime_calls == Some(0) {
                "the recording holds no CUDA allocation of the process at all: PyTorch got every segment before the \
                 recording began (`record --pid` on a running program), or CUDA's runtime was not probed (`--lib` \
                 without `libcudart`)"
            } else {
                "PyTorch got their segments before the recording began (`record --pid` on a running program)"
            };
            let _ = writeln!(
                md,
                "{} in no recorded segment: {why}. Each counts as a segment of its own size, so reserved memory and \
                 the cache's free space are undercounted there.\n",
                plural(j.blocks_without_segment, "block lies", "blocks lie"),
            );
        }
    } else {
        md.push_str("\n## Recording and snapshot\n\n");
    }
    let _ = (!j.probed).then(|| writeln!(
        md,
        "Joined with the recording `{}` (pid {}): {} of the snapshot's {} segments matched a recorded `cudaMalloc` of the \
         same address and size, or the `cuMemMap`s that tile it. The recording's clock minus the snapshot's, the median over them: {:.6} s{}.\n",
        j.recording,
        j.pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", "),
        j.segments_matched,
        j.segments_total,
        j.clock_offset_ns as f64 / 1e9,
        j.clock_disagreement_ns.map_or(String::new(), |d| format!(
            " (the recording's own offset to wall time, the snapshot's clock, agrees to {})",
            a.time_text(d as f64 / 1e9)
        ))
    ));
    if j.outside.allocations == 0 && j.probed && j.runtime_calls == Some(0) {
        md.push_str(
            "No CUDA allocation outside PyTorch's allocator was recorded, nor any of its own: none was made while \
             recording, or CUDA's runtime was not probed, so the memory outside PyTorch's allocator is unknown.\n",
        );
        return md;
    }
    if j.outside.allocations == 0 {
        md.push_str(if j.pids.len() > 1 {
            "Every device allocation of these processes was PyTorch's.\n"
        } else {
            "Every device allocation of the process was PyTorch's.\n"
        });
        return md;
    }
    let _ = writeln!(
        md,
        "**{} outside PyTorch's allocator** in {}: device memory no snapshot shows (the math libraries' workspaces, \
         NCCL, extensions). It is in the figures above, at its own call site, `{}`.\n",
        bytes(j.outside.bytes),
        plural(j.outside.allocations, "allocation", "allocations"),
        crate::input::OUTSIDE
    );
    md.push_str("| library | allocations | bytes |\n|---|---|---|\n");
    for (library, n, b) in &j.outside.by_library {
        let _ = writeln!(md, "| {library} | {n} | {} |", bytes(*b));
    }
    md
}

/// At an OOM of a snapshot joined with its recording: what PyTorch's cache
/// held free, and what was held outside PyTorch, by library.
fn oom_with_recording(a: &Analysis, o: &crate::analysis::oom::OomDiagnosis) -> String {
    let cache_free = a
        .rows
        .iter()
        .find(|r| r.at_oom && r.pid == o.pid && r.t_ns == o.t_ns)
        .and_then(|r| r.alloc)
        .map(|f| f.reserved_bytes.saturating_sub(f.allocated_bytes));
    // What was held outside PyTorch then: the recording's allocations live
    // at that instant, by library.
    let mut by_library: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    if let Some(j) = a.snapshot_details().and_then(|d| d.join.as_ref()) {
        for s in
            j.outside.spans.iter().filter(|s| {
                s.unit.is_none_or(|u| u == o.pid) && s.from_ns <= o.t_ns && s.to_ns.is_none_or(|t| t > o.t_ns)
            })
        {
            let e = by_library.entry(s.library.as_str()).or_default();
            e.0 += s.bytes;
            e.1 += 1;
        }
    }
    let (held, n) = by_library.values().fold((0, 0), |(b, k), v| (b + v.0, k + v.1));
    let libraries: Vec<&str> = by_library.keys().copied().collect();
    let mut text = String::from("\nAt the first OOM ");
    match cache_free {
        Some(free) => {
            let _ = write!(text, "PyTorch had {} free in its cache (reserved minus allocated)", bytes(free));
        }
        None => text.push_str("PyTorch's cache is not known"),
    }
    if n == 0 {
        text.push_str("; nothing was held outside PyTorch's allocator.\n");
    } else {
        let _ = writeln!(
            text,
            "; {} was held outside PyTorch by {} ({}).",
            bytes(held),
            libraries.join(", "),
            plural(n, "allocation", "allocations")
        );
    }
    text
}
