//! `fragscope compare A B`: did memory get better or worse from A to B?
//!
//! Both inputs (trace directories or snapshot pickles) are analysed with the
//! same options; the figures of [`crate::analysis::summary::Summary`] are set side by
//! side with absolute and relative deltas. Every metric where lower is
//! better gets a verdict, with a tolerance below which it is "same" (scores
//! 1 point, external fragmentation 0.01, bytes 2 % of A but at least 1 MiB,
//! OOM counts and risk levels exactly); allocation count and rate are shown
//! but judged by nobody. The verdict weighs, in order, the OOMs, the leak
//! verdicts and the memory needed to fit (`needs`, replayed under each
//! run's settings): the first of them that changed decides better or
//! worse, and the others are listed after it. Only where none changed do
//! the other metrics decide (better, worse, mixed or same), so the
//! fragmentation scores break ties only. compare.md opens with the
//! verdict, the memory needed, the leak verdicts and the call sites whose
//! bytes at the peak changed most; the segments only in one snapshot come
//! last, with a caveat where the two share no segment (addresses of two
//! processes never match: the lists then say something only of two
//! snapshots of one process).
//!
//! `compare.png` draws both MDTPs side by side on the same address scale
//! (the larger of the two collapsed footprints) with each trace's time
//! normalised to its own duration. Where both runs have iterations, each
//! MDTP starts where its steps do (after the last idle stretch of five
//! steady iterations before its last boundary: a training run spends most
//! of its time before its first step) and the chart below sets their
//! iterations side by side: the peak and the floor of live memory of each
//! complete iteration, by its number. Otherwise it draws both combined
//! score curves over normalised time. For two snapshots, the segments only in A and only
//! in B, keyed by (device, address, size) as PyTorch's own `compare` keys
//! them, and the call sites whose live bytes changed most between the two
//! peaks.

mod picture;

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;
use serde_json::json;

use self::picture::{busy_from, compose, iteration_peaks};
use crate::analysis::predict::Risk;
use crate::analysis::stages::Stage;
use crate::analysis::summary::Summary;
use crate::analysis::{Analysis, Options};
use crate::input::Loaded;
use crate::output::plot::Image;
use crate::units::bytes;

/// How a metric is shown and judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    Bytes,
    Score,
    Ratio,
    Count,
    Rate,
    /// The fragmentation level (SPEC §6.8).
    Risk,
    /// The OOM risk ([`crate::analysis::risk`]); `unknown` compares as n/a.
    OomRisk,
    /// The leak verdict: 1 leaking, 0 not leaking; cannot tell as n/a.
    Leak,
}

/// The metrics compared, in table order: key (for `--fail-if-worse`),
/// label, unit, judged (lower is better) or informational.
pub const METRICS: &[(&str, &str, Unit, bool)] = &[
    ("needs", "memory needed to fit", Unit::Bytes, true),
    ("leaking", "leak verdict", Unit::Leak, true),
    ("peak_live", "peak live bytes", Unit::Bytes, true),
    ("peak_reserved", "peak reserved (span) bytes", Unit::Bytes, true),
    ("allocs", "allocations", Unit::Count, false),
    ("alloc_rate", "allocations per second", Unit::Rate, false),
    ("mean_score", "mean score", Unit::Score, true),
    ("p95_score", "p95 score", Unit::Score, true),
    ("max_score", "max score", Unit::Score, true),
    ("final_score", "final score", Unit::Score, true),
    ("ext_frag_at_peak", "external fragmentation at peak", Unit::Ratio, true),
    ("ooms", "OOMs", Unit::Count, true),
    ("leaked", "leaked bytes", Unit::Bytes, true),
    ("oom_risk", "OOM risk", Unit::OomRisk, true),
    ("risk", "fragmentation level", Unit::Risk, true),
];

fn value(s: &Summary, key: &str) -> f64 {
    match key {
        "peak_live" => s.peak_live_bytes as f64,
        "peak_reserved" => s.peak_reserved_bytes as f64,
        "allocs" => s.allocs as f64,
        "alloc_rate" => s.alloc_rate,
        "mean_score" => s.score.mean,
        "p95_score" => s.score.p95,
        "max_score" => s.score.max,
        "final_score" => s.score.final_,
        "ext_frag_at_peak" => s.ext_frag_at_peak,
        // Unknown for a snapshot of one instant: not compared.
        "ooms" if !s.history => f64::NAN,
        "ooms" => s.ooms as f64,
        "leaked" => s.leaked_bytes.max(0) as f64,
        "needs" => s.needs_bytes.map_or(f64::NAN, |b| b as f64),
        "leaking" => s.leaking_known().map_or(f64::NAN, |l| if l { 1.0 } else { 0.0 }),
        "risk" => s.risk.map_or(f64::NAN, |r| Risk::ALL.iter().position(|x| *x == r).unwrap_or(0) as f64),
        "oom_risk" => match s.oom_risk {
            crate::analysis::risk::OomRisk::Unknown => f64::NAN,
            r => crate::analysis::risk::OomRisk::ALL.iter().position(|x| *x == r).unwrap_or(0) as f64,
        },
        _ => f64::NAN,
    }
}

/// The metrics that decide the verdict, in order, before any other.
const DECISIVE: [&str; 3] = ["ooms", "leaking", "needs"];

/// The change below which a judged metric is "same".
fn tolerance(unit: Unit, a: f64) -> f64 {
    match unit {
        Unit::Score => 1.0,
        Unit::Ratio => 0.01,
        Unit::Bytes => (0.02 * a.abs()).max(1048576.0),
        Unit::Count | Unit::Rate | Unit::Risk | Unit::OomRisk | Unit::Leak => 0.0,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Judgement {
    Better,
    Worse,
    Same,
    Info,
}

#[derive(Clone, Debug, Serialize)]
pub struct MetricRow {
    pub key: &'static str,
    pub label: &'static str,
    pub unit: Unit,
    pub a: f64,
    pub b: f64,
    pub delta: f64,
    /// (b − a) / a, None when a is 0.
    pub relative: Option<f64>,
    pub judgement: Judgement,
}

/// `--fail-if-worse METRIC:DELTA`.
#[derive(Clone, Debug, PartialEq)]
pub struct Gate {
    pub key: String,
    pub delta: f64,
    pub percent: bool,
}

impl std::str::FromStr for Gate {
    type Err = String;
    fn from_str(s: &str) -> Result<Gate, String> {
        let keys: Vec<&str> = METRICS.iter().map(|m| m.0).collect();
        let (key, delta) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}`: expected METRIC:DELTA, e.g. p95_score:5 or peak_live:10%"))?;
        if !keys.contains(&key) {
            return Err(format!("`{key}`: unknown metric; one of {}", keys.join(", ")));
        }
        let delta = delta.trim();
        let (num, percent) = match delta.strip_suffix('%') {
            Some(n) => (n.trim().parse::<f64>().map_err(|e| format!("`{delta}`: {e}"))?, true),
            None => match delta.parse::<f64>() {
                Ok(n) => (n, false),
                Err(_) => (
                    parse_size::Config::new()
                        .with_binary()
                        .parse_size(delta)
                        .map_err(|e| format!("`{delta}`: {e} (examples: 5, 10%, 512MiB)"))? as f64,
                    false,
                ),
            },
        };
        if !(num >= 0.0 && num.is_finite()) {
            return Err(format!("`{delta}`: the allowed change must be a non-negative number"));
        }
        Ok(Gate { key: key.to_string(), delta: num, percent })
    }
}

impl Gate {
    /// Whether B is worse than A by more than allowed; the reason if so.
    pub fn tripped(&self, rows: &[MetricRow]) -> Option<String> {
        let r = rows.iter().find(|r| r.key == self.key)?;
        if !r.delta.is_finite() {
            return None;
        }
        let allowed = if self.percent { r.a.abs() * self.delta / 100.0 } else { self.delta };
        (r.delta > allowed).then(|| {
            format!(
                "{} rose from {} to {} (allowed: +{})",
                r.label,
                show(r.unit, r.a),
                show(r.unit, r.b),
                match (self.percent, r.unit) {
                    (true, _) => format!("{} %", self.delta),
                    (false, Unit::Risk | Unit::OomRisk) => format!("{} level(s)", self.delta),
                    (false, unit) => show(unit, self.delta),
                }
            )
        })
    }
}

fn show(unit: Unit, v: f64) -> String {
    // A level compare could not take: as analyze names it.
    match unit {
        Unit::OomRisk if !v.is_finite() => return "unknown".into(),
        Unit::Risk if !v.is_finite() => return "not judged".into(),
        Unit::Leak if !v.is_finite() => return "cannot tell".into(),
        _ if !v.is_finite() => return "n/a".into(),
        _ => {}
    }
    match unit {
        Unit::Bytes => bytes(v.max(0.0) as u64),
        Unit::Score => format!("{v:.1}"),
        Unit::Ratio => format!("{v:.3}"),
        Unit::Count => format!("{v:.0}"),
        Unit::Rate => format!("{v:.1}/s"),
        Unit::Risk => Risk::ALL.get(v as usize).map_or("n/a".into(), |r| r.name().to_string()),
        Unit::OomRisk => {
            crate::analysis::risk::OomRisk::ALL.get(v as usize).map_or("n/a".into(), |r| r.name().to_string())
        }
        Unit::Leak => if v > 0.5 { "leaking" } else { "not leaking" }.into(),
    }
}

fn show_delta(unit: Unit, d: f64) -> String {
    // Not computed where a side has no value (as Δ % then).
    if !d.is_finite() {
        return "—".into();
    }
    let sign = if d < 0.0 { "−" } else { "+" };
    match unit {
        Unit::Bytes => format!("{sign}{}", bytes(d.abs() as u64)),
        Unit::Risk | Unit::OomRisk => format!("{sign}{:.0} level(s)", d.abs()),
        Unit::Leak if d > 0.0 => "now leaking".into(),
        Unit::Leak => "no longer leaking".into(),
        _ => format!("{sign}{}", show(unit, d.abs())),
    }
}

/// Snapshot-only parts of a comparison.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SnapshotDiff {
    /// (device, address, total_size).
    pub only_a: Vec<(u64, u64, u64)>,
    pub only_b: Vec<(u64, u64, u64)>,
    /// Segments in both (the same device, address and size).
    pub shared: usize,
    /// (call site, bytes at A's peak, bytes at B's peak), largest change first.
    pub sites: Vec<(String, u64, u64)>,
}

pub struct Comparison {
    pub a: Summary,
    pub b: Summary,
    pub rows: Vec<MetricRow>,
    pub verdict: String,
    pub snapshot: Option<SnapshotDiff>,
    /// Each stage of either side ([`crate::analysis::stages`]), matched by
    /// device and path: A's in its tree order, then those only in B.
    pub stages: Vec<StageDelta>,
    /// Where both runs have iterations: the (floor, peak) of live memory of
    /// each complete iteration of A and of B, as compare.png draws them.
    pub iterations: Option<(Vec<(u64, u64)>, Vec<(u64, u64)>)>,
    pub image: Image,
}

/// One stage in A and B.
#[derive(Clone, Debug, Serialize)]
pub struct StageDelta {
    pub device: u32,
    pub path: Vec<String>,
    pub a: Option<Stage>,
    pub b: Option<Stage>,
}

impl StageDelta {
    /// B − A of a figure, where both sides have the stage.
    pub fn delta(&self, f: impl Fn(&Stage) -> u64) -> Option<i128> {
        Some(f(self.b.as_ref()?) as i128 - f(self.a.as_ref()?) as i128)
    }
}

/// The stages of A and B matched by device and path.
pub fn stage_deltas(a: &[Stage], b: &[Stage]) -> Vec<StageDelta> {
    let find = |list: &[Stage], s: &Stage| list.iter().find(|x| x.device == s.device && x.path == s.path).cloned();
    let mut out: Vec<StageDelta> = a
        .iter()
        .map(|s| StageDelta { device: s.device, path: s.path.clone(), a: Some(s.clone()), b: find(b, s) })
        .collect();
    out.extend(b.iter().filter(|s| find(a, s).is_none()).map(|s| StageDelta {
        device: s.device,
        path: s.path.clone(),
        a: None,
        b: Some(s.clone()),
    }));
    out
}

/// Compares two analyses' summaries.
pub fn compare_summaries(a: &Summary, b: &Summary) -> (Vec<MetricRow>, String) {
    let rows: Vec<MetricRow> = METRICS
        .iter()
        .map(|&(key, label, unit, judged)| {
            let (va, vb) = (value(a, key), value(b, key));
            let delta = vb - va;
            let judgement = if !judged || !delta.is_finite() {
                Judgement::Info
            } else if delta.abs() <= tolerance(unit, va) {
                Judgement::Same
            } else if delta > 0.0 {
                Judgement::Worse
            } else {
                Judgement::Better
            };
            MetricRow {
                key,
                label,
                unit,
                a: va,
                b: vb,
                delta,
                relative: (va != 0.0 && delta.is_finite()).then(|| delta / va),
                judgement,
            }
        })
        .collect();
    let list = |j: Judgement| -> Vec<String> {
        rows.iter()
            .filter(|r| r.judgement == j)
            .map(|r| format!("{} {}", r.label, show_delta(r.unit, r.delta)))
            .collect()
    };
    let (worse, better) = (list(Judgement::Worse), list(Judgement::Better));
    // What users weigh, in order: OOMs, then the leak verdicts, then the
    // memory needed. The first that changed decides; the scores only
    // break a tie.
    let decides = DECISIVE
        .iter()
        .filter_map(|k| rows.iter().find(|r| r.key == *k))
        .find(|r| matches!(r.judgement, Judgement::Worse | Judgement::Better));
    if let Some(r) = decides {
        let (word, other_word, other) =
            if r.judgement == Judgement::Worse { ("worse", "better", &better) } else { ("better", "worse", &worse) };
        let mut why = format!("{} {}", r.label, show_delta(r.unit, r.delta));
        let same = list(r.judgement);
        let rest: Vec<&str> = same.iter().filter(|t| !t.starts_with(r.label)).map(String::as_str).collect();
        if !rest.is_empty() {
            why = format!("{why}; also {word} on {}", rest.join(", "));
        }
        if !other.is_empty() {
            why = format!(
                "{why}; {other_word} on {} (weighed after OOMs, leaks and the memory needed)",
                other.join(", ")
            );
        }
        return (rows, format!("{word}: {why}"));
    }
    let verdict = match (worse.is_empty(), better.is_empty()) {
        (true, true) => "same: no judged metric changed beyond its tolerance".to_string(),
        (false, true) => format!("worse: {}", worse.join(", ")),
        (true, false) => format!("better: {}", better.join(", ")),
        (false, false) => format!("mixed: worse on {}; better on {}", worse.join(", "), better.join(", ")),
    };
    (rows, verdict)
}

/// Loads and analyses both inputs, with MDTPs on one address scale.
pub fn compare(a: &Path, b: &Path, opts: &Options, size: (u32, u32)) -> Result<Comparison> {
    let open = |path| crate::input::open(path, opts.device).and_then(crate::input::allocator_view);
    let (Loaded { trace: ta, events: ea, out_of_order: oa }, Loaded { trace: tb, events: eb, out_of_order: ob }) =
        (open(a)?, open(b)?);
    let extent = |events: &crate::trace::event::Events| {
        let fp = crate::analysis::replay::Footprint::build(events);
        let mut pids: Vec<u32> = events.pid.iter().collect();
        pids.sort_unstable();
        pids.dedup();
        pids.iter().map(|&p| fp.regions(p).iter().map(|r| r.1 - r.0).sum::<u64>()).max().unwrap_or(1)
    };
    let scale = extent(&ea).max(extent(&eb)).max(1);
    let (w, h) = size;
    let top = h * 2 / 3;
    let plot = crate::output::plot::PlotConfig {
        width: (w / 2).max(200),
        height: top.max(150),
        time_window: None,
        addr_window: Some((0, scale)),
        pid: None,
        normalised_time: true,
        view: false,
        ..crate::output::plot::PlotConfig::default()
    };
    let opts = Options { layout: true, ..opts.clone() };
    let aa = crate::analysis::analyze_events(ta, &ea, oa, &opts)?;
    let ab = crate::analysis::analyze_events(tb, &eb, ob, &opts)?;
    let (sa, sb) = (Summary::of(&aa), Summary::of(&ab));
    let (rows, verdict) = compare_summaries(&sa, &sb);
    let snapshot = (aa.allocator_view && ab.allocator_view).then(|| snapshot_diff(&aa, &ea, &ab, &eb));
    // Both with iterations: each MDTP from its run's first iteration.
    let iterations = iteration_peaks(&aa).zip(iteration_peaks(&ab));
    let aligned = iterations.is_some();
    let mdtp = |an: &Analysis, ev: &crate::trace::event::Events| -> Result<Image> {
        let time_window = busy_from(an, ev).filter(|_| aligned).map(|t| (t.saturating_sub(an.first_ts), u64::MAX));
        let pictures = crate::output::plot::render(an, &crate::output::plot::PlotConfig { time_window, ..plot })?;
        pictures.map(|p| p.mdtp).ok_or_else(|| anyhow!("{}: no MDTP was drawn", an.trace.name))
    };
    let image = compose(&aa, &mdtp(&aa, &ea)?, &ab, &mdtp(&ab, &eb)?, iterations.as_ref(), (w, h))?;
    let stages = stage_deltas(&aa.stages.stages, &ab.stages.stages);
    Ok(Comparison { a: sa, b: sb, rows, verdict, snapshot, stages, iterations, image })
}

fn segment_table(a: &Analysis) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = a
        .snapshot_details()
        .map_or(&[][..], |d| d.segments.as_slice())
        .iter()
        .map(|s| (s.device, s.address, s.total_size))
        .collect();
    out.sort_unstable();
    out
}

fn snapshot_diff(
    a: &Analysis,
    ea: &crate::trace::event::Events,
    b: &Analysis,
    eb: &crate::trace::event::Events,
) -> SnapshotDiff {
    let (sa, sb) = (segment_table(a), segment_table(b));
    let only_a = sa.iter().filter(|s| sb.binary_search(s).is_err()).copied().collect();
    let only_b = sb.iter().filter(|s| sa.binary_search(s).is_err()).copied().collect();
    let at_peak = |an: &Analysis, ev: &crate::trace::event::Events| -> Vec<crate::analysis::sites::SiteBytes> {
        an.trace.stacks.as_ref().map_or_else(Vec::new, |st| crate::analysis::sites::sites_at_peak(ev, st))
    };
    let (pa, pb) = (at_peak(a, ea), at_peak(b, eb));
    let mut sites: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    for s in &pa {
        sites.entry(s.site.clone()).or_default().0 = s.bytes;
    }
    for s in &pb {
        sites.entry(s.site.clone()).or_default().1 = s.bytes;
    }
    let mut sites: Vec<(String, u64, u64)> =
        sites.into_iter().filter(|(_, (x, y))| x != y).map(|(k, (x, y))| (k, x, y)).collect();
    sites.sort_by(|x, y| (y.2 as i128 - y.1 as i128).abs().cmp(&(x.2 as i128 - x.1 as i128).abs()).then(x.0.cmp(&y.0)));
    sites.truncate(20);
    let shared = sa.iter().filter(|s| sb.binary_search(s).is_ok()).count();
    SnapshotDiff { only_a, only_b, shared, sites }
}

pub fn to_json(c: &Comparison, gates: &[(Gate, Option<String>)]) -> serde_json::Value {
    let side = |s: &Summary| {
        json!({
            "name": s.name,
            "source": s.source,
            "events": s.events,
            "oom_classes": s.oom_classes.iter().map(|(k, n)| (k.name().to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "oom_risk": s.oom_risk.name(),
            "fragmentation_level": s.risk.map(Risk::name),
        })
    };
    json!({
        "a": side(&c.a),
        "b": side(&c.b),
        "verdict": c.verdict,
        "metrics": c.rows,
        "gates": gates.iter().map(|(g, why)| json!({
            "metric": g.key, "allowed": g.delta, "percent": g.percent, "tripped": why.is_some(), "why": why,
        })).collect::<Vec<_>>(),
        "snapshot": c.snapshot,
        // compare.png's lower chart, where both runs have iterations.
        "iterations": c.iterations.as_ref().map(|(a, b)| {
            let side = |v: &[(u64, u64)]| v.iter().map(|(f, p)| json!({"floor_bytes": f, "peak_bytes": p})).collect::<Vec<_>>();
            json!({"a": side(a), "b": side(b)})
        }),
        "stages": c.stages.iter().map(|d| json!({
            "device": d.device,
            "path": d.path,
            "a": d.a,
            "b": d.b,
            "delta_peak_allocated_bytes": d.delta(|s| s.peak_allocated_bytes),
            "delta_added_bytes": d.delta(|s| s.added_bytes),
            "delta_held_at_end_bytes": d.delta(|s| s.held_at_end_bytes.unwrap_or(0)),
            "delta_net_at_end_bytes": d.a.as_ref().zip(d.b.as_ref()).and_then(|(a, b)| Some(b.net_at_end_bytes? - a.net_at_end_bytes?)),
        })).collect::<Vec<_>>(),
    })
}

/// One only-in list of segments (device, address, size) for compare.md:
/// count and total first, then only the largest, so the lists do not bury
/// the verdict (compare.json has them all).
fn segments_md(side: &str, list: &[(u64, u64, u64)]) -> String {
    let total: u64 = list.iter().map(|s| s.2).sum();
    let mut t = format!("\n## Segments only in {side}: {}, {}\n\n", list.len(), bytes(total));
    if list.is_empty() {
        return t;
    }
    let mut largest: Vec<&(u64, u64, u64)> = list.iter().collect();
    largest.sort_by(|x, y| y.2.cmp(&x.2).then(x.cmp(y)));
    largest.truncate(SEGMENTS_SHOWN);
    if list.len() > largest.len() {
        let _ = writeln!(
            t,
            "The {} largest; all {} are in compare.json (`snapshot.only_{}`).\n",
            largest.len(),
            list.len(),
            side.to_lowercase()
        );
    }
    t.push_str("| device | address | size |\n|---|---|---|\n");
    for (d, a, z) in largest {
        let _ = writeln!(t, "| {d} | {a:#x} | {} |", bytes(*z));
    }
    t
}

/// compare.md's stages: each one's peak allocated, added and held at end
/// in A and B, and the change.
fn stages_md(stages: &[StageDelta]) -> String {
    if stages.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "\n## Memory per stage\n\nEach `record_function` range of A and B (report.md of each explains the figures).\n\n| stage | peak allocated A → B | Δ | added A → B | Δ | held at end A → B | Δ |\n|---|---|---|---|---|---|---|\n",
    );
    let side = |s: &Option<Stage>, f: &dyn Fn(&Stage) -> Option<u64>| {
        s.as_ref().map_or("—".to_string(), |s| f(s).map_or("—".to_string(), bytes))
    };
    let delta = |d: Option<i128>| d.map_or("—".to_string(), |d| show_delta(Unit::Bytes, d as f64));
    for d in stages {
        let indent = "\u{a0}\u{a0}".repeat(d.path.len().saturating_sub(1));
        let mark = if d.path.len() > 1 { "└ " } else { "" };
        let only = match (&d.a, &d.b) {
            (Some(_), None) => " (only in A)",
            (None, Some(_)) => " (only in B)",
            _ => "",
        };
        let held = |s: &Stage| s.held_at_end_bytes;
        let _ = writeln!(
            md,
            "| {indent}{mark}`{}`{only} | {} → {} | {} | {} → {} | {} | {} → {} | {} |",
            d.path.last().map_or("", String::as_str),
            side(&d.a, &|s| Some(s.peak_allocated_bytes)),
            side(&d.b, &|s| Some(s.peak_allocated_bytes)),
            delta(d.delta(|s| s.peak_allocated_bytes)),
            side(&d.a, &|s| Some(s.added_bytes)),
            side(&d.b, &|s| Some(s.added_bytes)),
            delta(d.delta(|s| s.added_bytes)),
            side(&d.a, &held),
            side(&d.b, &held),
            delta(d.a.as_ref().and_then(held).zip(d.b.as_ref().and_then(held)).map(|(x, y)| y as i128 - x as i128)),
        );
    }
    md
}

/// Segments listed in compare.md per only-in list (the largest).
const SEGMENTS_SHOWN: usize = 20;

pub fn to_md(c: &Comparison, gates: &[(Gate, Option<String>)]) -> String {
    let mut md = format!("# fragscope compare: {} → {}\n\n", c.a.name, c.b.name);
    let word = c.verdict.split(':').next().unwrap_or("").to_uppercase();
    let rest = c.verdict.split_once(": ").map_or("", |x| x.1);
    let _ = writeln!(md, "**Verdict: {word}** — {rest}.\n");
    // The first screen: what decides, then where the bytes moved.
    let row = |key: &str| c.rows.iter().find(|r| r.key == key);
    if let Some(r) = row("needs").filter(|r| r.a.is_finite() || r.b.is_finite()) {
        let _ = writeln!(
            md,
            "- **Memory needed to fit** (replayed under each run's settings): A {}, B {} ({}).",
            show(r.unit, r.a),
            show(r.unit, r.b),
            show_delta(r.unit, r.delta)
        );
    }
    if let Some(r) = row("leaking") {
        let _ = writeln!(md, "- **Leak verdicts:** A {}, B {}.", show(r.unit, r.a), show(r.unit, r.b));
    }
    if let Some(s) = c.snapshot.as_ref().filter(|s| !s.sites.is_empty()) {
        md.push_str("\n## Call sites whose live bytes changed most between the peaks\n\n| call site | A at peak | B at peak | Δ |\n|---|---|---|---|\n");
        for (site, x, y) in &s.sites {
            let _ = writeln!(
                md,
                "| `{site}` | {} | {} | {} |",
                bytes(*x),
                bytes(*y),
                show_delta(Unit::Bytes, *y as f64 - *x as f64)
            );
        }
    }
    md.push_str(&stages_md(&c.stages));
    md.push_str("\n## Metrics\n\n| metric | A | B | Δ | Δ % | |\n|---|---|---|---|---|---|\n");
    for r in &c.rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            r.label,
            show(r.unit, r.a),
            show(r.unit, r.b),
            show_delta(r.unit, r.delta),
            r.relative.map_or("—".into(), |x| format!("{:+.1} %", 100.0 * x).replacen('-', "−", 1)),
            match r.judgement {
                Judgement::Better => "better",
                Judgement::Worse => "**worse**",
                Judgement::Same => "same",
                Judgement::Info => "",
            }
        );
    }
    let classes = |s: &Summary| {
        if s.oom_classes.is_empty() {
            "none".to_string()
        } else {
            s.oom_classes.iter().map(|(k, n)| format!("{n} {}", k.name())).collect::<Vec<_>>().join(", ")
        }
    };
    let _ = writeln!(md, "\nOOM classes — A: {}; B: {}.", classes(&c.a), classes(&c.b));
    let _ = writeln!(
        md,
        "\nTolerances: scores ±1 point, external fragmentation ±0.01, bytes ±2 % of A (at least 1 MiB), OOM counts and risk levels exact. Allocation count and rate are not judged."
    );
    if !gates.is_empty() {
        md.push_str("\n## Gates\n\n");
        for (g, why) in gates {
            let _ = writeln!(
                md,
                "- `{}:{}{}` — {}",
                g.key,
                g.delta,
                if g.percent { "%" } else { "" },
                why.as_deref().map_or("passed".to_string(), |w| format!("**tripped**: {w}"))
            );
        }
    }
    if let Some(s) = &c.snapshot {
        // Addresses of two processes never match: segment lists say
        // something only where the two share a segment (two snapshots of
        // one process).
        if s.shared == 0 && !(s.only_a.is_empty() && s.only_b.is_empty()) {
            md.push_str(
                "\nThe two snapshots share no segment. If they are of different processes, whose addresses never \
                 match, the lists below say nothing; they tell what changed only between two snapshots of one \
                 process.\n",
            );
        }
        md.push_str(&segments_md("A", &s.only_a));
        md.push_str(&segments_md("B", &s.only_b));
    }
    md
}

/// `fragscope compare`: writes compare.md, compare.json, compare.png;
/// returns whether a gate tripped.
pub fn run(a: &Path, b: &Path, out: &Path, opts: &Options, size: (u32, u32), gates: &[Gate]) -> Result<bool> {
    if size.0 < 400 || size.1 < 300 {
        bail!("--size {}x{} is too small for compare.png (at least 400x300)", size.0, size.1);
    }
    let c = compare(a, b, opts, size)?;
    let checked: Vec<(Gate, Option<String>)> = gates.iter().map(|g| (g.clone(), g.tripped(&c.rows))).collect();
    let existed = out.is_dir();
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let names = ["compare.json", "compare.md", "compare.png"];
    let written = crate::trace::write_atomic(&out.join(names[0]), &serde_json::to_vec_pretty(&to_json(&c, &checked))?)
        .and_then(|()| crate::trace::write_atomic(&out.join(names[1]), to_md(&c, &checked).as_bytes()))
        .and_then(|()| c.image.write_png(&out.join(names[2])));
    if let Err(e) = written {
        // No comparison half written (a full disk, say).
        crate::trace::discard(out, &names, !existed);
        return Err(e);
    }
    println!("{} → {}: {}", c.a.name, c.b.name, c.verdict);
    let mut tripped = false;
    for (g, why) in &checked {
        if let Some(w) = why {
            eprintln!("gate: --fail-if-worse {}: {w}", g.key);
            tripped = true;
        }
    }
    println!("  wrote {}", out.display());
    Ok(tripped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &'static str, unit: Unit, a: f64, b: f64) -> MetricRow {
        MetricRow { key, label: key, unit, a, b, delta: b - a, relative: None, judgement: Judgement::Info }
    }

    #[test]
    fn long_segment_lists_show_count_total_and_the_largest() {
        let list: Vec<(u64, u64, u64)> = (0..25u64).map(|i| (0, 0x1000 * i, (i + 1) << 20)).collect();
        let md = segments_md("A", &list);
        assert!(md.contains("## Segments only in A: 25, 325.00 MiB"), "{md}");
        assert!(md.contains("all 25 are in compare.json (`snapshot.only_a`)"), "{md}");
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| 0 |")).collect();
        assert_eq!(rows.len(), SEGMENTS_SHOWN);
        assert!(rows[0].ends_with("| 25.00 MiB |") && rows[19].ends_with("| 6.00 MiB |"), "{md}");
        let short = segments_md("B", &list[..3]);
        assert!(!short.contains("compare.json") && short.lines().filter(|l| l.starts_with("| 0 |")).count() == 3);
        assert!(segments_md("B", &[]).contains("only in B: 0, 0 B"));
    }

    #[test]
    fn a_level_gates_allowance_reads_in_levels() {
        let g: Gate = "oom_risk:1".parse().unwrap();
        let why = g.tripped(&[row("oom_risk", Unit::OomRisk, 1.0, 3.0)]).unwrap();
        assert!(why.ends_with("(allowed: +1 level(s))"), "{why}");
    }

    #[test]
    fn gates_parse_and_trip_on_absolute_and_relative_deltas() {
        let g: Gate = "p95_score:5".parse().unwrap();
        assert_eq!(g, Gate { key: "p95_score".into(), delta: 5.0, percent: false });
        let p: Gate = "peak_live:10%".parse().unwrap();
        assert!(p.percent && p.delta == 10.0);
        let s: Gate = "peak_live:512MiB".parse().unwrap();
        assert_eq!(s.delta, 536870912.0);
        assert!("nope:5".parse::<Gate>().is_err());
        assert!("p95_score".parse::<Gate>().is_err());
        assert!("p95_score:-1".parse::<Gate>().is_err());
        let rows = [row("p95_score", Unit::Score, 40.0, 44.0), row("peak_live", Unit::Bytes, 1000.0, 1150.0)];
        assert!(g.tripped(&rows).is_none());
        assert!(p.tripped(&rows).is_some());
        let tight: Gate = "p95_score:3.9".parse().unwrap();
        assert!(tight.tripped(&rows).unwrap().contains("rose from 40.0 to 44.0"));
    }
}
