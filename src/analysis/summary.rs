//! The figures of one analysed trace that reports, batch summaries, gates
//! and `compare` share ([`Summary`]), and the score statistics behind them.

use serde::Serialize;

use crate::analysis::leak::Verdict;
use crate::analysis::oom::OomClass;
use crate::analysis::predict::Risk;
use crate::analysis::result::{Analysis, ProcessPrediction, Row};

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
    /// False for a snapshot of one instant: `ooms` is then unknown, not 0
    /// (written as null).
    pub history: bool,
    pub anomalies: u64,
    /// The highest fragmentation level over units, each judged at the
    /// timestep where it held the most ([`AtPeak`]; None: no unit ever
    /// held memory).
    pub risk: Option<Risk>,
    /// The highest OOM risk over devices ([`crate::analysis::risk`]).
    pub oom_risk: crate::analysis::risk::OomRisk,
    /// OOM counts per class, most frequent first.
    pub oom_classes: Vec<(OomClass, u64)>,
    /// Some process's verdict is "leaking".
    pub leaking: bool,
    /// The trace's leak verdict: "leaking" if any process's is, else
    /// "cannot tell" if any process's is, else "not leaking" (None: no
    /// process was judged).
    pub leak_verdict: Option<Verdict>,
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
    /// The memory the job needs: the most any one device's requests need
    /// to fit under the recorded settings (`fits_from_bytes`, replayed;
    /// None where no replay ran).
    pub needs_bytes: Option<u64>,
    /// The trace's class and its confidence under `--classes`.
    pub class: Option<(String, f64)>,
    /// The grouping features ([`crate::analysis::cluster::FEATURES`]).
    pub features: [f64; crate::analysis::cluster::FEATURES.len()],
    /// UTC day of the recording (`start_wall_ns` of trace.json), else of the
    /// trace's last modification: the `date` partition of summary.parquet.
    pub date: String,
}

impl Summary {
    /// The fragmentation level as the batch summary writes it (None: no
    /// unit ever held memory).
    pub fn level_name(&self) -> Option<&'static str> {
        self.risk.map(Risk::name)
    }

    /// "Leaking?" as report.json's summary and the batch summary answer
    /// it: true, false only where every process judged is "not leaking",
    /// None where one cannot tell (or none was judged).
    pub fn leaking_known(&self) -> Option<bool> {
        match self.leak_verdict? {
            Verdict::Leaking => Some(true),
            Verdict::NotLeaking => Some(false),
            Verdict::CannotTell => None,
        }
    }

    pub fn of(a: &Analysis) -> Summary {
        // Combined: the worst process at each step, so one bad rank shows.
        let scores = combined_scores(&a.rows);
        let steps = step_totals(&a.rows);
        let duration = (a.last_ts - a.first_ts) as f64 / 1e9;
        use crate::trace::event::EventKind::{Alloc, AllocAsync, AllocManaged, BlockAlloc};
        let allocs = [Alloc, AllocAsync, AllocManaged, BlockAlloc]
            .into_iter()
            .map(|k| a.counts_by_kind.get(k))
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
            history: a.has_history(),
            anomalies: a.anomalies.total(),
            risk: at_peaks(a).iter().map(|p| p.level).max(),
            oom_risk: a.oom_risk.iter().map(|x| x.level).max().unwrap_or(crate::analysis::risk::OomRisk::Unknown),
            oom_classes: crate::analysis::decision::oom_classes(a),
            leaking: a.leaks.iter().any(|l| l.leaking),
            leak_verdict: [Verdict::Leaking, Verdict::CannotTell, Verdict::NotLeaking]
                .into_iter()
                .find(|v| a.leaks.iter().any(|l| l.verdict == *v)),
            leaked_bytes: a.leaks.iter().filter(|l| l.leaking).map(|l| l.growth_bytes).sum(),
            allocs,
            alloc_rate: if duration > 0.0 { allocs as f64 / duration } else { 0.0 },
            peak_reserved_bytes: steps.iter().map(|s| s.1).max().unwrap_or(0),
            ext_frag_at_peak: steps
                .iter()
                .max_by_key(|s| s.0)
                .map_or(0.0, |s| if s.1 == 0 { 0.0 } else { s.2 / s.1 as f64 }),
            needs_bytes: needs_bytes(a),
            class: a.class.as_ref().map(|c| (c.trace.name.clone(), c.trace.confidence)),
            features: features(a),
            date: trace_date(a),
        }
    }
}

/// The most any one device's requests need to fit under the recorded
/// settings (the first screen's figure).
pub(crate) fn needs_bytes(a: &Analysis) -> Option<u64> {
    a.decision.as_ref()?.memory.iter().filter_map(|m| m.recorded.as_ref()?.fits_from_bytes).max()
}

/// The grouping features of a trace: mean score components over its rows,
/// the share of its OOMs in each class (0 without OOMs), leak rate.
pub(crate) fn features(a: &Analysis) -> [f64; crate::analysis::cluster::FEATURES.len()] {
    features_of(a, None)
}

/// The grouping features of one unit (`pid`), or of the whole trace (None):
/// the unit's rows, OOMs and leak, against its own peak.
pub(crate) fn features_of(a: &Analysis, pid: Option<u32>) -> [f64; crate::analysis::cluster::FEATURES.len()] {
    let mine = |p: u32| pid.is_none_or(|u| u == p);
    let rows: Vec<&Row> = a.rows.iter().filter(|r| !r.at_oom && mine(r.pid)).collect();
    let mut f = [0.0; crate::analysis::cluster::FEATURES.len()];
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
    let ooms: Vec<OomClass> = a.ooms.iter().filter(|o| mine(o.pid)).map(|o| o.class).collect();
    let total = ooms.len().max(1) as f64;
    let share = |c: OomClass| ooms.iter().filter(|o| **o == c).count() as f64 / total;
    f[6] = share(OomClass::Capacity);
    f[7] = share(OomClass::Fragmentation);
    f[8] = share(OomClass::AllocatorPolicy);
    let leaked: i64 = a.leaks.iter().filter(|l| l.leaking && mine(l.pid)).map(|l| l.growth_bytes).sum();
    let peak = match pid {
        None => a.peak_live_total,
        Some(u) => a.peaks.iter().filter(|p| p.pid == u).map(|p| p.bytes).max().unwrap_or(0),
    };
    f[9] = if peak == 0 { 0.0 } else { leaked.max(0) as f64 / peak as f64 };
    f
}

/// YYYY-MM-DD (UTC) of a trace's recording.
pub(crate) fn trace_date(a: &Analysis) -> String {
    let when = a
        .trace
        .meta
        .as_ref()
        .and_then(|m| m.start_wall_ns)
        .map(|ns| std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns))
        .or(a.trace.modified)
        .unwrap_or_else(std::time::SystemTime::now);
    humantime::format_rfc3339_seconds(when).to_string().chars().take(10).collect()
}

/// Per step, over processes: (Σ live bytes, Σ span, Σ gap bytes).
pub(crate) fn step_totals(rows: &[Row]) -> Vec<(u64, u64, f64)> {
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

/// The prediction of the process with the highest risk (the first on
/// ties), among those with something live at their last timestep when
/// any has.
pub(crate) fn headline(a: &Analysis) -> Option<&ProcessPrediction> {
    let key = |p: &ProcessPrediction| (!ended_empty(a, p.pid), p.prediction.risk);
    a.predictions.iter().reduce(|best, p| if key(p) > key(best) { p } else { best })
}

/// A unit's fragmentation at the timestep where it held the most (its
/// reserved memory in an allocator view, its arena span otherwise): the
/// moment memory was scarcest (SPEC §6.10). The headline fragmentation
/// level is judged here, not at the run's end, where a job's last free
/// leaves an empty cache that scores near 100.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AtPeak {
    pub pid: u32,
    pub step: u32,
    pub t_ns: u64,
    pub score: f64,
    pub live_bytes: u64,
    /// Reserved (allocator view) or the arena span (device view).
    pub span_bytes: u64,
    pub level: Risk,
}

/// [`AtPeak`] for each unit that ever held memory, in the order of their
/// first timestep. Of the timesteps at the most held (a cache stays at its
/// peak for long), the one with the most live: where free memory was
/// least; then the earliest.
pub(crate) fn at_peaks(a: &Analysis) -> Vec<AtPeak> {
    let mut out: Vec<AtPeak> = Vec::new();
    for r in a.rows.iter().filter(|r| !r.at_oom && r.metrics.span_bytes > 0) {
        let here = AtPeak {
            pid: r.pid,
            step: r.step,
            t_ns: r.t_ns,
            score: r.metrics.score,
            live_bytes: r.metrics.live_bytes,
            span_bytes: r.metrics.span_bytes,
            level: Risk::of(r.metrics.score),
        };
        match out.iter_mut().find(|p| p.pid == r.pid) {
            Some(p) if (r.metrics.span_bytes, r.metrics.live_bytes) > (p.span_bytes, p.live_bytes) => *p = here,
            Some(_) => {}
            None => out.push(here),
        }
    }
    out
}

/// The unit whose level at its peak is the highest (the first on ties).
pub(crate) fn headline_at_peak(a: &Analysis) -> Option<AtPeak> {
    at_peaks(a).into_iter().reduce(|best, p| if p.level > best.level { p } else { best })
}

/// Whether `pid` had released all it held by its last timestep (a job's
/// teardown): its score is then of an empty cache.
pub(crate) fn ended_empty(a: &Analysis, pid: u32) -> bool {
    a.ended_empty.binary_search(&pid).is_ok()
}

/// Per step, the highest score over processes.
pub(crate) fn combined_scores(rows: &[Row]) -> Vec<f64> {
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

pub(crate) fn process_scores(rows: &[Row], pid: u32) -> Vec<f64> {
    rows.iter().filter(|r| r.pid == pid && !r.at_oom).map(|r| r.metrics.score).collect()
}

/// One row of the batch summary: a trace's figures or its error.
pub type SummaryRow = (String, std::result::Result<Summary, String>);

pub(crate) fn last_row(a: &Analysis, pid: u32) -> Option<&Row> {
    a.rows.iter().rev().find(|r| r.pid == pid && !r.at_oom)
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
}
