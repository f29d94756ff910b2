//! `whatif.json` and `whatif.md`: the allocator model's fidelity to the
//! recording, each scenario's outcome, and the recommendation.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::json;

mod png;

pub use self::png::render_png;
use crate::analysis::whatif::{Scenario, Source, Whatif};
use crate::units::bytes;

/// `whatif.json` / `whatif.md` of one input.
#[derive(Clone, Debug)]
pub struct Report {
    pub input: String,
    pub recorded_settings: serde_json::Value,
    pub whatif: Whatif,
    /// The input's replay units that are one process's GPU (a recording
    /// of PyTorch's allocator with several), for their names.
    pub units: std::collections::BTreeMap<u32, (u32, i32)>,
}

impl Report {
    pub fn new(input: &Path, recorded_settings: serde_json::Value, whatif: Whatif) -> Report {
        Report { input: input.display().to_string(), recorded_settings, whatif, units: Default::default() }
    }

    pub fn headline(&self) -> String {
        format!("{}: {}", self.input, headline(&self.whatif))
    }

    pub fn json(&self) -> serde_json::Value {
        let mut j = json(&self.whatif);
        j["input"] = json!(self.input);
        j["allocator_settings"] = self.recorded_settings.clone();
        j
    }

    pub fn markdown(&self) -> String {
        let w = &self.whatif;
        let mut md = format!("# fragscope whatif: {}\n\n", self.input);
        let _ = writeln!(md, "**Recommendation: {}** — {}.\n", recommendation_md(w), w.recommended.1);
        md.push_str(&sections_md(w, "##", &|d| crate::trace::unit_label(&self.units, d)));
        md
    }
}

/// One line: the fidelity and the recommendation.
pub fn headline(w: &Whatif) -> String {
    let (same, n) = w.same_address();
    let lost = w.desynchronised();
    let mut seen = Vec::new();
    if n > 0 {
        let measured = w.fidelity.iter().filter(|f| f.not_measured.is_none());
        let (before, model) =
            measured.fold((0, 0), |(b, m), f| (b + f.unknowable_before_trace, m + f.model_mismatches));
        let elsewhere = if before + model == 0 {
            String::new()
        } else {
            format!(" — of the others, {before} decided by the state before the trace, {model} by the model's rules")
        };
        seen.push(format!(
            "placed {same} of {n} allocations where PyTorch did ({:.1} %){elsewhere}",
            100.0 * same as f64 / n as f64
        ));
    }
    if lost > 0 {
        seen.push(format!("lost step with {lost} recorded event(s)"));
    }
    let fidelity =
        if seen.is_empty() { "fidelity not measured".to_string() } else { format!("model {}", seen.join(", ")) };
    format!("{fidelity}; recommendation: {} ({})", w.recommendation(), w.recommended.1)
}

/// What each device's requests need, per scenario (`memory_needed` in
/// `report.json` and `whatif.json`): one entry per unit, each scenario as
/// `whatif` writes it (`recorded` for the run's own settings).
pub fn memory_needed_json(w: &Whatif) -> serde_json::Value {
    let units = w.fidelity.iter().enumerate().map(|(j, f)| {
        let settings: Vec<serde_json::Value> = w
            .scenarios
            .iter()
            .filter_map(|s| Some((s, s.needed.get(j)?)))
            .map(|(s, n)| {
                json!({
                    "conf": s.name,
                    "fits_from_bytes": n.fits_from_bytes,
                    "flushes_at_fits_from": n.flushes_at_fits_from,
                    "no_flush_from_bytes": n.no_flush_from_bytes,
                    "precision_bytes": n.precision_bytes,
                    "peak_allocated_bytes": n.peak_allocated_bytes,
                })
            })
            .collect();
        json!({
            "unit": f.device,
            "span": span_of(w, j),
            "excludes": EXCLUDES,
            "settings": settings,
        })
    });
    serde_json::Value::Array(units.collect())
}

/// What one device's cache releases were, as PyTorch counts them.
pub fn flushes_sentence(w: &Whatif, d: u32, f: &crate::analysis::whatif::Flushes) -> String {
    let mut t = format!("Cache releases on device {d}: ");
    if f.count > 0 {
        let _ = write!(
            t,
            "PyTorch {} {}{} to retry a request its budget refused ({} segments or pages, {}; one retry comes before \
             each OOM, releasing nothing if the cache was empty) — each release calls `cudaFree`, which synchronizes \
             the device. This is `num_alloc_retries` in `torch.cuda.memory_stats()`.",
            w.release_phrase(),
            if f.at_least { "at least " } else { "" },
            crate::units::plural(f.count, "time", "times"),
            f.segments_freed,
            bytes(f.bytes_freed),
        );
    } else {
        t.push_str("no retry (`num_alloc_retries` 0).");
    }
    if f.gc_releases > 0 {
        let _ = write!(
            t,
            " Garbage collection (`garbage_collection_threshold`) released blocks {} before the budget was reached: \
             no retry.",
            crate::units::plural(f.gc_releases, "time", "times")
        );
    }
    if f.oversize_releases > 0 {
        let _ = write!(
            t,
            " It released only its cached blocks above `max_split_size_mb` {} (not counted as retries).",
            crate::units::plural(f.oversize_releases, "time", "times")
        );
    }
    if let Some((lo, hi)) = f.capacity {
        let _ = write!(t, " So its budget lies between {} and {} (inferred from the retries).", bytes(lo), bytes(hi));
    }
    t
}

/// The memory needed per scenario and device, as a table.
fn needed_md(w: &Whatif, name: &dyn Fn(u32) -> String) -> String {
    let mut md = String::new();
    for (j, f) in w.fidelity.iter().enumerate() {
        let rows: Vec<(&Scenario, &crate::analysis::whatif::Needed)> =
            w.scenarios.iter().filter_map(|s| Some((s, s.needed.get(j)?))).collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(
            md,
            "Memory needed on {} ({}; it leaves out {EXCLUDES}). The budget is what PyTorch's allocator may \
             reserve: CUDA's free memory at start plus its own reserve, or `per_process_memory_fraction` × the \
             device's total.\n",
            name(f.device),
            span_of(w, j)
        );
        md.push_str(
            "| scenario | fits from (no OOM) | cache releases there | never releases from |\n|---|---|---|---|\n",
        );
        for (s, n) in rows {
            let label = if s.conf.is_empty() {
                "recorded settings".to_string()
            } else {
                crate::analysis::whatif::scenario_label(&w.recorded_conf, &s.conf)
            };
            let _ = writeln!(
                md,
                "| {label} | {} | {} | {} |",
                n.fits_from_bytes.map_or("not found (not monotone in the budget)".into(), |b| format!(
                    "{} (to {})",
                    bytes(b),
                    bytes(n.precision_bytes)
                )),
                n.flushes_at_fits_from,
                bytes(n.no_flush_from_bytes)
            );
        }
        md.push('\n');
    }
    md
}

/// What the memory needed leaves out.
pub const EXCLUDES: &str = "the CUDA context, allocations made outside PyTorch's allocator (cuBLAS workspaces and \
                            other libraries'), and other processes on the device";

/// Over what span a device's memory needed holds.
pub fn span_of(w: &Whatif, j: usize) -> String {
    match w.fidelity.get(j).map(|f| f.initial_reserved) {
        Some(0) | None => "from the recorded requests, every one from the first".into(),
        Some(before) => format!(
            "from the recorded requests of the trace's window (a ring buffer): the {} reserved before its first entry \
             is carried in as it was",
            bytes(before)
        ),
    }
}

/// The figures of `whatif.json` (also `whatif` in `report.json`).
pub fn json(w: &Whatif) -> serde_json::Value {
    let scenario = |s: &Scenario| {
        let classes: serde_json::Map<String, serde_json::Value> = s
            .devices
            .iter()
            .flat_map(|o| o.oom_classes.iter())
            .fold(std::collections::BTreeMap::<String, u64>::new(), |mut m, (c, n)| {
                *m.entry(c.clone()).or_default() += n;
                m
            })
            .into_iter()
            .map(|(c, n)| (c, json!(n)))
            .collect();
        json!({
            "name": s.name,
            "label": crate::analysis::whatif::scenario_label(&w.recorded_conf, &s.conf).replace('`', ""),
            "conf": s.conf,
            "peak_reserved_bytes": s.peak_reserved_bytes,
            "peak_allocated_bytes": s.peak_allocated_bytes,
            "reserved_minus_allocated_at_peak": s.reserved_minus_allocated_at_peak,
            "segment_allocs": s.segment_allocs,
            "ooms": s.ooms,
            "oom_classes": classes,
            // The same figures at the budget interval's high end, where
            // the budget is known only as one (the figures above are at
            // its low end).
            "at_budget_high": s.at_high.as_deref().map(|h| json!({
                "peak_reserved_bytes": h.peak_reserved_bytes,
                "peak_allocated_bytes": h.peak_allocated_bytes,
                "reserved_minus_allocated_at_peak": h.reserved_minus_allocated_at_peak,
                "segment_allocs": h.segment_allocs,
                "ooms": h.ooms,
                "flushes": h.flushes,
                "devices": h.devices,
            })),
            "devices": s.devices,
            "note": s.note,
            "unchecked_pair": s.unchecked_pair,
        })
    };
    let recorded = &w.scenarios[0];
    json!({
        "capacity_bytes": w.capacity,
        "capacity_source": match (w.capacity, w.capacity_inferred, w.capacity_from_flushes) {
            (None, _, _) => None,
            (Some(_), true, true) if w.capacity_from_collection => {
                Some("inferred from garbage collection's releases (the least budget they allow)")
            }
            (Some(_), true, true) => Some("inferred from cache flushes (the least capacity they allow)"),
            (Some(_), true, false) => Some("inferred from an oom entry (free memory CUDA reported + reserved then)"),
            (Some(_), false, _) => Some("--capacity"),
        },
        "memory_needed": memory_needed_json(w),
        "cache_flushes": w.flushes.iter().map(|(d, f)| json!({
            "device": d,
            "count": f.count,
            "at_least": f.at_least,
            "gc_releases": f.gc_releases,
            "oversize_releases": f.oversize_releases,
            "segments_freed": f.segments_freed,
            "bytes_freed": f.bytes_freed,
            "capacity_lo_bytes": f.capacity.map(|c| c.0),
            "capacity_hi_bytes": f.capacity.map(|c| c.1),
        })).collect::<Vec<_>>(),
        "model": "PyTorch CUDACachingAllocator (the native allocator of 2.4-2.5, checked against real 2.11 runs; expandable segments included); see src/allocator/",
        "fidelity": w.fidelity.iter().zip(&recorded.devices).enumerate().map(|(j, (f, o))| json!({
            "device": f.device,
            "allocations": f.allocations,
            "same_address": f.same_address,
            "same_block_size": f.same_size,
            "segments_requested": f.segments_requested,
            "segments_same_size": f.segments_same_size,
            "segments_only_recorded": f.segments_only_recorded,
            "segments_only_model": f.segments_only_model,
            "recorded_peak_reserved_bytes": f.recorded_peak_reserved,
            "simulated_peak_reserved_bytes": o.peak_reserved_bytes,
            "desynchronised_events": f.desynchronised,
            "unknowable_before_trace": f.unknowable_before_trace,
            "model_mismatches": f.model_mismatches,
            "recorded_ooms": f.recorded_ooms,
            "ooms_same": f.ooms_same,
            "simulated_ooms": o.ooms,
            "inferred_capacity_bytes": f.inferred_capacity,
            "capacity_bytes": w.capacities.get(j).copied().flatten(),
            "first_mismatches": f.first_mismatches,
            "not_measured": f.not_measured,
        })).collect::<Vec<_>>(),
        "scenarios": w.scenarios.iter().map(scenario).collect::<Vec<_>>(),
        "recommendation": {"conf": w.recommendation(), "reason": w.recommended.1},
        "unreproduced_ooms": w.unreproduced,
        "untestable": w.untestable,
    })
}

/// The fidelity and scenario sections, headed at `level` ("##", "###").
/// `name` gives a device's label (its number, or a recording's unit).
pub fn sections_md(w: &Whatif, level: &str, name: &dyn Fn(u32) -> String) -> String {
    let mut md = format!("{level} Fidelity: the model against the recording\n\n");
    if w.source == Source::DeviceLevel {
        md.push_str("Not measured: a device-level trace (eBPF or synthetic) has no caching allocator's decisions to check — every cudaMalloc is a request. The first scenario is the recording as it happened; the others put PyTorch's caching allocator, modelled, between the program and the device.\n");
        return md + &scenarios_md(w, level, name);
    }
    md.push_str("Under the snapshot's own settings, from the state before the first trace entry, the model chose a block for every allocation; the recorded choice was then applied.");
    if w.recorded_conf.iter().any(|e| e.replace(" ", "") == "expandable_segments:True") {
        md.push_str(" With expandable segments a segment asked is the pages one request mapped (`segment_map`), and the same size means the same pages.");
    }
    md.push_str("\n\n");
    md.push_str("| device | allocations | at PyTorch's address | elsewhere: before the trace / model | same block size | segments asked (same size) | segments only PyTorch / only model | peak reserved recorded → simulated |\n|---|---|---|---|---|---|---|---|\n");
    for (f, o) in w.fidelity.iter().zip(&w.scenarios[0].devices) {
        if let Some(why) = &f.not_measured {
            let _ = writeln!(md, "| {} | — | not measured: {why} | | | | | |", name(f.device));
            continue;
        }
        // No allocation: no share of them to give.
        let pct = |x: u64| {
            if f.allocations == 0 {
                "—".to_string()
            } else {
                format!("{x} ({:.1} %)", 100.0 * x as f64 / f.allocations as f64)
            }
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} / {} | {} | {} ({}) | {} / {} | {} → {} |",
            name(f.device),
            f.allocations,
            pct(f.same_address),
            f.unknowable_before_trace,
            f.model_mismatches,
            pct(f.same_size),
            f.segments_requested,
            f.segments_same_size,
            f.segments_only_recorded,
            f.segments_only_model,
            bytes(f.recorded_peak_reserved),
            bytes(o.peak_reserved_bytes)
        );
    }
    for f in w.fidelity.iter().filter(|f| f.not_measured.is_none() && f.desynchronised > 0) {
        let _ = writeln!(
            md,
            "\n**Device {}: the model lost step with the recording at {} event(s)** (a recorded block that was not inside a free block of the model, a free of a block it did not hold, a segment it could not place). The figures above and the scenarios below come from a replay that did not follow the recording there: read them as rough.",
            name(f.device),
            f.desynchronised
        );
    }
    let mismatches: Vec<_> =
        w.fidelity.iter().flat_map(|f| f.first_mismatches.iter().map(move |m| (f.device, m))).collect();
    if !mismatches.is_empty() {
        md.push_str("\nFirst mismatches (all in whatif.json):\n\n| device | allocation | requested | recorded | model | why |\n|---|---|---|---|---|---|\n");
        for (d, m) in mismatches.iter().take(10) {
            let _ = writeln!(
                md,
                "| {} | #{} | {} | {:#x} ({}) | {} | {} |",
                name(*d),
                m.allocation,
                bytes(m.requested),
                m.recorded_addr,
                bytes(m.recorded_size),
                m.model_addr.map_or("new segment".into(), |a| format!("{a:#x}")),
                m.why
            );
        }
    }
    md + &scenarios_md(w, level, name)
}

/// A scenario's figures in one row: over all devices, or one device's.
struct Figures {
    reserved: u64,
    allocated: u64,
    spare: u64,
    segments: u64,
    ooms: u64,
}

/// What a row says of a capacity: the inferred one's source.
fn capacity_source(w: &Whatif) -> &'static str {
    match (w.capacity_inferred, w.capacity_from_flushes) {
        (true, true) if w.capacity_from_collection => {
            " (inferred from garbage collection's releases: the least budget they allow; PyTorch collects only above \
             its threshold's share of the budget)"
        }
        (true, true) => " (inferred from cache flushes: the least capacity they allow)",
        (true, false) => " (inferred from an `oom` entry: the free memory CUDA reported plus what was reserved then)",
        (false, _) => "",
    }
}

fn scenarios_md(w: &Whatif, level: &str, name: &dyn Fn(u32) -> String) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "\n{level} Scenarios\n");
    let several = w.fidelity.len() > 1;
    // "device 1" for a snapshot's device; "pid 4242", or "pid 4242 on
    // GPU 0" for a unit of a recording.
    let name = |d: u32| match w.source {
        Source::Snapshot => format!("device {}", name(d)),
        Source::DeviceLevel => format!("pid {}", name(d)),
    };
    let known: Vec<(u32, u64)> =
        w.fidelity.iter().zip(&w.capacities).filter_map(|(f, c)| c.map(|c| (f.device, c))).collect();
    let unknown: Vec<String> =
        w.fidelity.iter().zip(&w.capacities).filter(|(_, c)| c.is_none()).map(|(f, _)| name(f.device)).collect();
    let text = match w.capacity {
        // Several devices, not all of one known capacity: each says its own.
        Some(_) if several && (!unknown.is_empty() || known.iter().any(|k| k.1 != known[0].1)) => {
            // Each inferred capacity from its own device's `oom` entry or
            // cache flushes.
            let each: Vec<String> = known
                .iter()
                .map(|(d, c)| {
                    let from = match w.fidelity.iter().find(|f| f.device == *d) {
                        _ if !w.capacity_inferred => "",
                        Some(f) if f.inferred_capacity.is_some() => " (inferred from its `oom` entry)",
                        _ => " (inferred from its cache flushes: the least capacity they allow)",
                    };
                    format!("{}: {}{from}", name(*d), bytes(*c))
                })
                .collect();
            let mut t = format!(
                "Capacity of {}: a segment beyond it is refused after the cache is released, and the request fails.",
                each.join("; ")
            );
            for (d, c) in &known {
                if let Some(f) = w.fidelity.iter().find(|f| f.device == *d && f.initial_reserved > *c) {
                    let _ = write!(
                        t,
                        " On {} the state before the first trace entry already reserves {} (more than the capacity): scenarios only refuse new segments.",
                        name(*d),
                        bytes(f.initial_reserved)
                    );
                }
            }
            if !unknown.is_empty() {
                let list = match unknown.split_last() {
                    Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
                    _ => unknown.join(""),
                };
                let _ = write!(
                    t,
                    " No capacity is known for {list}: no scenario can run out of memory there, so OOMs there are not judged (give `--capacity`)."
                );
            }
            t
        }
        Some(c) => {
            let start: u64 = w.fidelity.iter().map(|f| f.initial_reserved).max().unwrap_or(0);
            let mut t = format!(
                "Capacity {} per device{}: a segment beyond it is refused after the cache is released, and the request fails.",
                bytes(c),
                capacity_source(w)
            );
            if start > c {
                let _ = write!(
                    t,
                    " The state before the first trace entry already reserves {} (more than the capacity): scenarios only refuse new segments.",
                    bytes(start)
                );
            }
            t
        }
        None => "No capacity given (`--capacity`): nothing runs out of memory, so the scenarios differ only in the memory they reserve, and their OOMs are not judged.".into(),
    };
    let _ = writeln!(md, "{text}\n");
    let intervals: Vec<String> = w
        .flushes
        .iter()
        .filter_map(|(d, f)| f.releases_bound().filter(|c| c.1 > c.0).map(|(lo, hi, _)| (d, lo, hi)))
        .map(|(d, lo, hi)| {
            if several {
                format!("{}: {}–{}", name(*d), bytes(lo), bytes(hi))
            } else {
                format!("{}–{}", bytes(lo), bytes(hi))
            }
        })
        .collect();
    if w.scenarios.iter().any(|s| s.at_high.is_some()) && !intervals.is_empty() {
        let _ = writeln!(
            md,
            "{} bound the budget only to an interval ({}): every scenario was replayed at both ends. \
             A figure that reads a–b depends on where in that interval the budget lies; a single figure is the \
             same at both ends.\n",
            if w.capacity_from_collection { "Garbage collection's releases" } else { "The cache releases" },
            intervals.join("; ")
        );
    }
    for (d, f) in &w.flushes {
        let _ = writeln!(md, "{}\n", flushes_sentence(w, *d, f));
    }
    md.push_str(&needed_md(w, &name));
    if several {
        // Peaks summed over devices would be set against one device's
        // capacity: a table per device instead.
        for (j, f) in w.fidelity.iter().enumerate() {
            let _ = writeln!(md, "{}{}:\n", name(f.device)[..1].to_uppercase(), &name(f.device)[1..]);
            let figures = |s: &Scenario| {
                let o = &s.devices[j];
                Figures {
                    reserved: o.peak_reserved_bytes,
                    allocated: o.peak_allocated_bytes,
                    spare: o.reserved_minus_allocated_at_peak,
                    segments: o.segment_allocs,
                    ooms: o.ooms,
                }
            };
            let recording = (w.source == Source::Snapshot && f.not_measured.is_none())
                .then_some((f.recorded_peak_reserved, f.recorded_ooms));
            scenario_table(&mut md, w, &figures, recording, w.capacities.get(j).is_some_and(Option::is_some));
            md.push('\n');
        }
    } else {
        let figures = |s: &Scenario| Figures {
            reserved: s.peak_reserved_bytes,
            allocated: s.peak_allocated_bytes,
            spare: s.reserved_minus_allocated_at_peak,
            segments: s.segment_allocs,
            ooms: s.ooms,
        };
        // A snapshot's recorded row gives what the recording did, and the
        // model's replay beside it where the two differ.
        // The recording's figures beside the model's where the fidelity was
        // measured (not: a "recorded" peak of 0 B).
        let measured: Vec<_> = w.fidelity.iter().filter(|f| f.not_measured.is_none()).collect();
        let recording = (w.source == Source::Snapshot && !measured.is_empty()).then(|| {
            measured.iter().fold((0u64, 0u64), |(r, o), f| (r + f.recorded_peak_reserved, o + f.recorded_ooms))
        });
        scenario_table(&mut md, w, &figures, recording, w.capacity.is_some());
    }
    // One note once, naming every row it is about (a setting the recording
    // ran with gives every row the same note).
    let mut notes: Vec<(&str, Vec<String>)> = Vec::new();
    for s in w.scenarios.iter() {
        let Some(note) = s.note.as_deref() else { continue };
        let who = if s.conf.is_empty() {
            "recorded settings".to_string()
        } else {
            crate::analysis::whatif::scenario_label(&w.recorded_conf, &s.conf)
        };
        match notes.iter_mut().find(|n| n.0 == note) {
            Some(n) => n.1.push(who),
            None => notes.push((note, vec![who])),
        }
    }
    for (note, who) in notes {
        let _ = writeln!(md, "\nNote on {}: {note}.", who.join(", "));
    }
    md.push_str("\nReserved − allocated at peak: while reserved was at its peak, what it held beyond the most that was allocated then.\n");
    md.push_str("\nNot modelled: CUDA graph pools, pending `record_stream` events. Every scenario starts from the recorded state before the first trace entry.\n");
    md
}

/// The scenarios' rows, with `figures` of each: the recorded row gives
/// what the recording did (`recording`: its peak reserved and OOMs) and
/// the model's replay beside it where the two differ. Without a capacity
/// nothing can run out of memory, so a scenario's 0 would read as a
/// verdict: it says "not judged".
fn scenario_table(
    md: &mut String,
    w: &Whatif,
    figures: &dyn Fn(&Scenario) -> Figures,
    recording: Option<(u64, u64)>,
    capacity_known: bool,
) {
    md.push_str("| scenario | peak reserved | peak allocated | reserved − allocated at peak | segments allocated | OOMs |\n|---|---|---|---|---|---|\n");
    for (i, s) in w.scenarios.iter().enumerate() {
        let f = figures(s);
        // At both ends of the budget interval, where it is one: "a–b"
        // where they differ.
        let h = s.at_high.as_deref().map(figures);
        let size = |lo: u64, hi: Option<u64>| range(lo, hi, bytes);
        let count = |lo: u64, hi: Option<u64>| range(lo, hi, |n| n.to_string());
        let model_reserved = size(f.reserved, h.as_ref().map(|h| h.reserved));
        let model_ooms = count(f.ooms, h.as_ref().map(|h| h.ooms));
        let (reserved, ooms) = match recording.filter(|_| i == 0) {
            Some((r, o)) => (
                if model_reserved == bytes(r) {
                    model_reserved
                } else {
                    format!("{} (model: {model_reserved})", bytes(r))
                },
                if model_ooms == o.to_string() { model_ooms } else { format!("{o} (model: {model_ooms})") },
            ),
            None if !capacity_known
                && !(i == 0 && s.conf.is_empty())
                && !crate::analysis::whatif::is_recorded(&w.recorded_conf, &s.conf) =>
            {
                (model_reserved, "not judged".to_string())
            }
            None => (model_reserved, model_ooms),
        };
        let _ = writeln!(
            md,
            "| {} | {reserved} | {} | {} | {} | {ooms} |",
            match (s.conf.is_empty(), s.name.as_str()) {
                (true, "recorded") if w.source == Source::DeviceLevel =>
                    "as recorded (cudaMalloc per request)".to_string(),
                (true, "recorded") => "recorded settings".to_string(),
                (true, _) => "PyTorch's caching allocator, default settings".to_string(),
                (false, _) => crate::analysis::whatif::scenario_label(&w.recorded_conf, &s.conf),
            },
            size(f.allocated, h.as_ref().map(|h| h.allocated)),
            size(f.spare, h.as_ref().map(|h| h.spare)),
            count(f.segments, h.as_ref().map(|h| h.segments)),
        );
    }
}

/// A figure at the low end of the budget interval and, where it differs,
/// at the high end: "a–b", the smaller first.
fn range(lo: u64, hi: Option<u64>, show: impl Fn(u64) -> String) -> String {
    match hi.filter(|&h| h != lo) {
        Some(h) => format!("{}–{}", show(lo.min(h)), show(lo.max(h))),
        None => show(lo),
    }
}

/// The recommendation for Markdown: a setting line in code, a sentence as
/// it is.
pub(crate) fn recommendation_md(w: &crate::analysis::whatif::Whatif) -> String {
    crate::analysis::whatif::conf_md(&w.recommendation())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::whatif::{Fidelity, Outcome, Scenario, Source, scenario_label};

    fn whatif(desynchronised: u64) -> Whatif {
        let recorded = Scenario::of("recorded", &[], vec![Outcome { name: "recorded".into(), ..Default::default() }]);
        Whatif {
            fidelity: vec![Fidelity {
                device: 0,
                allocations: 10,
                same_address: 9,
                desynchronised,
                ..Default::default()
            }],
            scenarios: vec![recorded],
            recommended: (0, "no setting does better".into()),
            capacity: None,
            capacity_inferred: false,
            capacity_from_flushes: false,
            capacity_from_collection: false,
            flushes: Vec::new(),
            retry_times: Vec::new(),
            source: Source::Snapshot,
            recorded_conf: Vec::new(),
            unreproduced: None,
            untestable: None,
            capacities: vec![None],
        }
    }

    /// Events the fidelity replay could not follow are in the headline and
    /// the markdown, not only in `whatif.json`; a replay that followed
    /// everything says nothing about it.
    #[test]
    fn a_replay_that_lost_step_says_so() {
        let (lost, kept) = (whatif(2), whatif(0));
        assert!(headline(&lost).contains("lost step with 2 recorded event(s)"), "{}", headline(&lost));
        assert!(!headline(&kept).contains("lost step"), "{}", headline(&kept));
        assert!(
            sections_md(&lost, "##", &|d| d.to_string())
                .contains("Device 0: the model lost step with the recording at 2 event(s)")
        );
        assert!(!sections_md(&kept, "##", &|d| d.to_string()).contains("lost step"));
        assert_eq!(json(&lost)["fidelity"][0]["desynchronised_events"], 2);
        // No allocation to place, but a state that could not be built.
        let mut early = whatif(3);
        early.fidelity[0].allocations = 0;
        assert!(headline(&early).starts_with("model lost step with 3 recorded event(s);"), "{}", headline(&early));
    }

    /// The recorded row shows what the recording did, and the model's
    /// replay beside it only where the two differ.
    #[test]
    fn the_recorded_row_shows_the_recording() {
        let mut w = whatif(0);
        w.fidelity[0].recorded_peak_reserved = 434 << 20;
        w.fidelity[0].recorded_ooms = 1;
        w.scenarios[0].peak_reserved_bytes = 414 << 20;
        let md = sections_md(&w, "##", &|d| d.to_string());
        assert!(md.contains("| recorded settings | 434.00 MiB (model: 414.00 MiB) |"), "{md}");
        assert!(md.contains("| 1 (model: 0) |"), "{md}");
        w.scenarios[0].peak_reserved_bytes = 434 << 20;
        w.scenarios[0].ooms = 1;
        let md = sections_md(&w, "##", &|d| d.to_string());
        assert!(md.contains("| recorded settings | 434.00 MiB |") && !md.contains("(model:"), "{md}");
    }

    /// A scenario changes the recorded settings: its row names what it
    /// keeps of them, and a setting it changes is not named twice.
    #[test]
    fn a_scenario_row_names_the_recorded_settings_it_keeps() {
        let recorded = vec!["max_split_size_mb:64".to_string()];
        let conf = |e: &str| vec![e.to_string()];
        assert_eq!(
            scenario_label(&recorded, &conf("roundup_power2_divisions:4")),
            "`roundup_power2_divisions:4` + recorded `max_split_size_mb:64`"
        );
        assert_eq!(scenario_label(&recorded, &conf("max_split_size_mb:128")), "`max_split_size_mb:128`");
        assert_eq!(
            scenario_label(&recorded, &conf("max_split_size_mb:64")),
            "`max_split_size_mb:64` (the recorded settings)"
        );
        assert_eq!(scenario_label(&[], &conf("expandable_segments:True")), "`expandable_segments:True`");
    }

    /// Several devices: a table each, named as the trace names them (a
    /// snapshot's devices, a recording's processes), and each device's
    /// capacity or its absence said.
    #[test]
    fn several_devices_get_a_table_each_under_their_own_names() {
        let mut w = whatif(0);
        let o = |d: u64| Outcome { name: "recorded".into(), peak_reserved_bytes: d << 20, ..Default::default() };
        w.scenarios = vec![Scenario::of("recorded", &[], vec![o(100), o(200)])];
        let f = |device: u32, mib: u64| Fidelity { device, recorded_peak_reserved: mib << 20, ..Default::default() };
        w.fidelity = vec![f(0, 100), f(1, 200)];
        w.capacities = vec![None, Some(1 << 30)];
        w.capacity = Some(1 << 30);
        w.capacity_inferred = true;
        let md = sections_md(&w, "##", &|d| d.to_string());
        assert!(md.contains("Device 0:") && md.contains("Device 1:"), "{md}");
        assert!(md.contains("| recorded settings | 200.00 MiB |") && !md.contains("300.00 MiB"), "{md}");
        assert!(md.contains("device 1: 1.00 GiB (inferred from its cache flushes"), "{md}");
        assert!(md.contains("No capacity is known for device 0"), "{md}");
        w.source = Source::DeviceLevel;
        let md = sections_md(&w, "##", &|d| (4242 + d).to_string());
        assert!(md.contains("Pid 4243:") && !md.contains("Device 4243"), "{md}");
    }
}
