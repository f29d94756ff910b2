//! `fragscope analyze`: load → replay → metric rows per (process, step) →
//! outputs ([`crate::report`]). Also the batch driver over many traces.
//!
//! Timesteps (SPEC §4): a row describes the state after applying every
//! event with `ts_ns <= t_ns`. By default about 1000 equal-duration steps
//! span the trace (one per event when it has fewer); `--step 10ms` sets the
//! duration, `--step 5000ev` a fixed event count (then `t_ns` is the time
//! of the step's last event). Every OOM event (a device allocation that
//! failed with CUDA's out-of-memory code, or an `oom` event) adds a row
//! flagged `at_oom` at its instant, describing the state the failed request
//! saw: every event before it in time order, none after.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{Context, Result, bail};

use crate::event::Events;
use crate::metrics::{Metrics, MetricsConfig};
use crate::replay::{Anomalies, Footprint, Peak, Replay};
use crate::trace::Trace;

/// How the trace is cut into timesteps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum StepSpec {
    /// About this many equal-duration steps (fewer for shorter traces).
    #[default]
    Auto,
    /// Steps of this many nanoseconds.
    Duration(u64),
    /// Steps of this many events.
    Events(u64),
}

/// More rows than this is a mistake on the command line, not a wish.
const MAX_STEPS: u64 = 20_000_000;
const AUTO_STEPS: u64 = 1000;

impl FromStr for StepSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "auto" {
            return Ok(StepSpec::Auto);
        }
        if let Some(n) = s.strip_suffix("ev") {
            return match n.trim().parse::<u64>() {
                Ok(n) if n > 0 => Ok(StepSpec::Events(n)),
                _ => Err(format!("`{s}`: expected a positive event count such as 5000ev")),
            };
        }
        match humantime::parse_duration(s) {
            Ok(d) if d.as_nanos() > 0 => Ok(StepSpec::Duration(d.as_nanos().min(u64::MAX as u128) as u64)),
            _ => Err(format!("`{s}`: expected a duration (10ms, 1s, 500us) or an event count (5000ev)")),
        }
    }
}

impl std::fmt::Display for StepSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepSpec::Auto => write!(f, "auto"),
            StepSpec::Duration(ns) => write!(f, "{}", humantime::format_duration(std::time::Duration::from_nanos(*ns))),
            StepSpec::Events(n) => write!(f, "{n}ev"),
        }
    }
}

/// Step ends as (index one past the step's last event, t_ns).
pub fn step_bounds(spec: StepSpec, ts: &[u64]) -> Result<Vec<(usize, u64)>> {
    let n = ts.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let (t0, t1) = (ts[0], ts[n - 1]);
    let by_time = |d: u64, count: u64| -> Vec<(usize, u64)> {
        (1..=count)
            .map(|k| {
                let t = t0.saturating_add(k.saturating_mul(d)).min(t1.max(t0 + d.min(1)));
                let t = if k == count { t1 } else { t };
                (ts.partition_point(|&x| x <= t), t)
            })
            .collect()
    };
    Ok(match spec {
        StepSpec::Auto => {
            let count = AUTO_STEPS.min(n as u64);
            let d = (t1 - t0).div_ceil(count).max(1);
            let count = count.min((t1 - t0).div_ceil(d).max(1));
            by_time(d, count)
        }
        StepSpec::Duration(d) => {
            let count = (t1 - t0).div_ceil(d).max(1);
            if count > MAX_STEPS {
                bail!("--step {spec} gives {count} steps over this trace (limit {MAX_STEPS}); choose a longer step");
            }
            by_time(d, count)
        }
        StepSpec::Events(e) => {
            let count = (n as u64).div_ceil(e);
            if count > MAX_STEPS {
                bail!("--step {spec} gives {count} steps over this trace (limit {MAX_STEPS}); choose a longer step");
            }
            (1..=count)
                .map(|k| {
                    let end = (k * e).min(n as u64) as usize;
                    (end, ts[end - 1])
                })
                .collect()
        }
    })
}

/// Analysis options shared by every trace of a run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    pub metrics: MetricsConfig,
    pub step: StepSpec,
    /// Recompute every metric from the full live set at each row (slow).
    pub brute_force: bool,
}

/// One metric row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Row {
    pub step: u32,
    pub t_ns: u64,
    pub pid: u32,
    pub at_oom: bool,
    pub metrics: Metrics,
}

/// An OOM event and the state it saw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OomEvent {
    pub t_ns: u64,
    pub pid: u32,
    pub requested: u64,
    pub metrics: Metrics,
}

/// Everything `analyze` computed for one trace.
#[derive(Clone, Debug)]
pub struct Analysis {
    pub trace: Trace,
    pub events: u64,
    pub counts_by_kind: Vec<(String, u64)>,
    pub failed_allocs: u64,
    pub first_ts: u64,
    pub last_ts: u64,
    pub step_count: usize,
    pub rows: Vec<Row>,
    pub ooms: Vec<OomEvent>,
    pub anomalies: Anomalies,
    pub peaks: Vec<Peak>,
    /// Peak of the live bytes summed over processes.
    pub peak_live_total: u64,
    pub options: Options,
}

/// Loads and analyses one trace directory.
pub fn analyze_path(dir: &Path, opts: &Options) -> Result<Analysis> {
    let start = std::time::Instant::now();
    let trace = Trace::open(dir)?;
    let (events, out_of_order) = trace.load_events()?;
    tracing::info!("{}: loaded {} events in {:.3} s", trace.name, events.len(), start.elapsed().as_secs_f64());
    let start = std::time::Instant::now();
    let analysis = analyze_events(trace, &events, out_of_order, opts)?;
    tracing::info!("{}: replayed in {:.3} s", analysis.trace.name, start.elapsed().as_secs_f64());
    Ok(analysis)
}

/// Replays time-sorted `events` and produces the rows.
pub fn analyze_events(trace: Trace, events: &Events, out_of_order: u64, opts: &Options) -> Result<Analysis> {
    opts.metrics.validate()?;
    let bounds = step_bounds(opts.step, &events.ts_ns)?;
    let start = std::time::Instant::now();
    let footprint = Footprint::build(events);
    tracing::debug!("footprint in {:.3} s", start.elapsed().as_secs_f64());
    let mut replay = Replay::new(opts.metrics, &footprint);

    let mut counts = [0u64; crate::event::EventKind::ALL.len()];
    let mut unknown_kind = 0u64;
    let mut failed_allocs = 0u64;
    let mut rows = Vec::with_capacity(bounds.len() + 16);
    let mut ooms = Vec::new();
    let mut pids: Vec<u32> = Vec::new();

    let row_metrics = |replay: &Replay, pid: u32| {
        if opts.brute_force { replay.metrics_from_scratch(pid) } else { replay.metrics(pid) }
    };

    let mut i = 0usize;
    for (step, &(end, t_ns)) in bounds.iter().enumerate() {
        while i < end {
            let Some(e) = events.get(i) else {
                unknown_kind += 1;
                i += 1;
                continue;
            };
            counts[e.kind as usize] += 1;
            replay.apply(&e);
            if e.ret != 0 && e.kind.is_alloc_request() {
                failed_allocs += 1;
            }
            if e.is_oom() {
                let metrics = row_metrics(&replay, e.pid);
                rows.push(Row { step: step as u32, t_ns: e.ts_ns, pid: e.pid, at_oom: true, metrics });
                ooms.push(OomEvent { t_ns: e.ts_ns, pid: e.pid, requested: e.size, metrics });
            }
            i += 1;
        }
        if pids.len() != replay.pids().count() {
            pids = replay.pids().collect();
        }
        for &pid in &pids {
            rows.push(Row { step: step as u32, t_ns, pid, at_oom: false, metrics: row_metrics(&replay, pid) });
        }
    }
    for _ in 0..unknown_kind {
        replay.note_unknown_kind();
    }
    let peaks = replay.peaks();
    let peak_total = replay.peak_total();
    let mut anomalies = replay.finish();
    anomalies.out_of_order = out_of_order;

    let counts_by_kind = crate::event::EventKind::ALL
        .iter()
        .filter(|k| counts[**k as usize] > 0)
        .map(|k| (k.name().to_string(), counts[*k as usize]))
        .collect();
    Ok(Analysis {
        trace,
        events: events.len() as u64,
        counts_by_kind,
        failed_allocs,
        first_ts: events.ts_ns.first().copied().unwrap_or(0),
        last_ts: events.ts_ns.last().copied().unwrap_or(0),
        step_count: bounds.len(),
        rows,
        ooms,
        anomalies,
        peaks,
        peak_live_total: peak_total,
        options: *opts,
    })
}

/// The traces named on the command line: trace directories, or
/// directories of trace directories. `batch` is true when the output should
/// be one folder per trace plus a summary.
pub fn discover(paths: &[PathBuf]) -> Result<(Vec<PathBuf>, bool)> {
    let mut found = Vec::new();
    let mut batch = paths.len() > 1;
    for p in paths {
        if p.is_dir() && !Trace::is_trace_dir(p) {
            let mut subs: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("cannot read {}", p.display()))?
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|s| s.is_dir() && Trace::is_trace_dir(s))
                .collect();
            if subs.is_empty() {
                bail!("{}: neither a trace (no events-NNNNN.parquet) nor a directory of traces", p.display());
            }
            subs.sort();
            found.extend(subs);
            batch = true;
        } else {
            found.push(p.clone());
        }
    }
    Ok((found, batch))
}
