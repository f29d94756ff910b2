//! The analysis of one trace: load → replay → metric rows per (process,
//! step) → iterations, forecasts, OOM diagnoses, leaks, call sites. It
//! returns data ([`Analysis`]); [`crate::output`] presents it.
//!
//! Timesteps (SPEC §4): a row describes the state after applying every
//! event with `ts_ns <= t_ns`. By default about 1000 equal-duration steps
//! span the trace (one per event when it has fewer); `--step 10ms` sets the
//! duration, `--step 5000ev` a fixed event count (then `t_ns` is the time
//! of the step's last event). Every OOM event (a device allocation that
//! failed with CUDA's out-of-memory code, or an `oom` event) adds a row
//! flagged `at_oom` at its instant, describing the state the failed request
//! saw: every event before it in time order, none after.

pub mod advice;
pub mod classes;
pub mod cluster;
pub mod decision;
pub(crate) mod flame;
pub mod iterations;
pub mod kernels;
pub mod layout;
pub mod leak;
pub(crate) mod livemap;
pub mod metrics;
pub mod oom;
mod options;
mod passes;
pub mod predict;
pub mod replay;
pub(crate) mod result;
pub mod risk;
pub(crate) mod risk_series;
pub mod settings_check;
pub mod sites;
pub mod stages;
pub(crate) mod summary;
pub mod whatif;

pub use options::{Options, StepSpec};
pub use result::{Analysis, ProcessPrediction, Row};
use std::path::Path;

use anyhow::{Result, bail};

use self::passes::*;
use crate::analysis::iterations::Iterations;
use crate::analysis::leak::LeakReport;
use crate::analysis::metrics::Metrics;
use crate::analysis::oom::OomDiagnosis;
use crate::analysis::predict::{PredictConfig, Prediction};
use crate::analysis::replay::{Footprint, Peak, Replay};
use crate::input::Loaded;
use crate::trace::Trace;
use crate::trace::column::Packed;
use crate::trace::event::Events;

/// More rows than this is a mistake on the command line, not a wish.
const MAX_STEPS: u64 = 20_000_000;
const AUTO_STEPS: u64 = 1000;

/// Step ends as (index one past the step's last event, t_ns).
pub fn step_bounds(spec: StepSpec, ts: &Packed) -> Result<Vec<(usize, u64)>> {
    let n = ts.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let (t0, t1) = (ts.at(0), ts.at(n - 1));
    let by_time = |d: u64, count: u64| -> Vec<(usize, u64)> {
        (1..=count)
            .map(|k| {
                let t = t0.saturating_add(k.saturating_mul(d)).min(t1.max(t0 + d.min(1)));
                let t = if k == count { t1 } else { t };
                (ts.partition_point(|x| x <= t), t)
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
                    (end, ts.at(end - 1))
                })
                .collect()
        }
    })
}

/// Loads and analyses one trace directory or snapshot pickle.
pub fn analyze_path(dir: &Path, opts: &Options) -> Result<Analysis> {
    analyze_loaded(crate::input::allocator_view(crate::input::open(dir, opts.device)?)?, opts)
}

/// Analyses a loaded input.
pub fn analyze_loaded(loaded: Loaded, opts: &Options) -> Result<Analysis> {
    let Loaded { trace, events, out_of_order } = loaded;
    let start = std::time::Instant::now();
    let mut analysis = analyze_events(trace, &events, out_of_order, opts)?;
    if let Some(model) = &opts.classes {
        let at = std::time::Instant::now();
        analysis.class = Some(classes::classify(model, &analysis));
        // scripts/bench-classes reads this line.
        tracing::info!("{}: classified in {:.3} ms", analysis.trace.name, at.elapsed().as_secs_f64() * 1e3);
    }
    tracing::info!("{}: replayed in {:.3} s", analysis.trace.name, start.elapsed().as_secs_f64());
    Ok(analysis)
}

/// Replays time-sorted `events` and produces the rows.
pub fn analyze_events(trace: Trace, events: &Events, out_of_order: u64, opts: &Options) -> Result<Analysis> {
    opts.metrics.validate()?;
    let capacity = opts.capacity.or_else(|| trace.meta.as_ref().and_then(|m| m.capacity_bytes));
    let bounds = step_bounds(opts.step, &events.ts_ns)?;
    let gpus = risk_series::Gpus::of(&trace);
    let start = std::time::Instant::now();
    let footprint = Footprint::build(events);
    tracing::debug!("footprint in {:.3} s", start.elapsed().as_secs_f64());
    use crate::trace::event::EventKind::{BlockAlloc, SegmentAlloc, SegmentMap};
    let allocator_view = events.kind.iter().any(|k| matches!(k, Some(BlockAlloc | SegmentAlloc | SegmentMap)));
    let mut replay = if allocator_view {
        Replay::allocator(opts.metrics, &footprint)
    } else if opts.brute_force {
        Replay::reference(opts.metrics, &footprint)
    } else {
        Replay::new(opts.metrics, &footprint)
    };
    let stacks = trace.stacks.clone();
    // A device-level recording's processes that ran PyTorch's caching
    // allocator: their failed cudaMallocs are retried once, and their OOMs
    // cannot be classified from the segments.
    let pytorch = if allocator_view { Default::default() } else { pytorch_units(&trace) };
    // Only those that can be placed among their device's events.
    let annotations: Vec<crate::trace::details::Annotation> = trace.meta.as_ref().map_or_else(Vec::new, |m| {
        m.details.annotations().iter().filter(|a| m.details.placeable(a)).cloned().collect()
    });
    let annotations = annotations.as_slice();
    // Call-site iterations are a snapshot's (allocator view); a device-level
    // trace, with recorded stacks or not, uses its period.
    let snapshot_stacks = stacks.as_deref().filter(|_| allocator_view);
    // Per device of a snapshot: how many of its first events rebuild what
    // was alive before its first entry (none: the device held nothing).
    let rebuilt: ahash::AHashMap<u32, usize> = trace
        .meta
        .as_ref()
        .and_then(|m| m.details.snapshot())
        .filter(|_| allocator_view)
        .map(|d| {
            d.reconstruction.iter().map(|r| (r.device, (r.initial_segments + r.initial_blocks) as usize)).collect()
        })
        .unwrap_or_default();
    // Iterations and the pictures' block lives only read the events, so
    // they are found on a second core while the replay walks them (on a
    // 10 M-event trace the period search replays live bytes on its own,
    // 0.35 s, and the lives take 0.23 s; the walk 1.2 s).
    let (Walk { mut rows, ooms, counts, failed_allocs, recovered, null_frees }, (detected, floors, lives, stages)) =
        std::thread::scope(|scope| {
            let beside = scope.spawn(|| {
                let started = std::time::Instant::now();
                let found = detect_iterations(events, allocator_view, snapshot_stacks, annotations, &rebuilt);
                tracing::debug!("iterations in {:.3} s (beside the replay)", started.elapsed().as_secs_f64());
                // The leak rule's exact floors read only the events and the
                // iterations: found here too, off the replay's path.
                let started = std::time::Instant::now();
                let floors: ahash::AHashMap<u32, leak::IterationFloors> = found
                    .iter()
                    .map(|(&pid, it)| (pid, leak::iteration_floors(events, pid, allocator_view, it)))
                    .collect();
                tracing::debug!("iteration floors in {:.3} s (beside the replay)", started.elapsed().as_secs_f64());
                let started = std::time::Instant::now();
                let lives = opts.layout.then(|| layout::Lives::of(events));
                tracing::debug!("layout in {:.3} s (beside the replay)", started.elapsed().as_secs_f64());
                // Memory per stage: a snapshot's annotated ranges.
                let started = std::time::Instant::now();
                let stages = if allocator_view {
                    stages::find(events, annotations, &opts.metrics)
                } else {
                    stages::Stages::default()
                };
                tracing::debug!("stages in {:.3} s (beside the replay)", started.elapsed().as_secs_f64());
                (found, floors, lives, stages)
            });
            let context =
                OomContext { allocator_view, capacity, stacks: stacks.as_deref(), gpus: &gpus, pytorch: &pytorch };
            let walked = walk(events, &bounds, &mut replay, &context);
            (walked, beside.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
        });
    for _ in 0..counts.unknown {
        replay.note_unknown_kind();
    }
    let peaks = replay.peaks();
    let peak_total = replay.peak_total();
    let iterations = keep_iterations(detected, &peaks, &mut rows);
    if let Some(m) = trace.meta.as_ref() {
        fill_reported_reserved(m.details.reserved_series(), &mut rows);
    }

    let started = std::time::Instant::now();
    // Each process's series is forecast on its own: a trace of several
    // ranks uses the cores it is given.
    let forecasts = map_in_parallel(&peaks, |p| {
        let period = iterations.iter().find(|it| it.pid == p.pid).and_then(|it| period_steps(it, &rows));
        predict_series(p.pid, &rows, &opts.predict, period)
    });
    let predictions: Vec<ProcessPrediction> = peaks
        .iter()
        .zip(forecasts)
        .map(|(p, (idx, prediction, backtest))| apply_prediction(p.pid, idx, prediction, backtest, &mut rows))
        .collect();
    tracing::debug!("predictor and backtest in {:.3} s", started.elapsed().as_secs_f64());
    let mut leaks =
        find_leaks(events, &peaks, &iterations, &floors, &mut replay, allocator_view, stacks.as_deref(), &ooms);
    // Entry order: a nanosecond stands for one entry, so no rate per second.
    if let Some(m) = &trace.meta {
        leaks.iter_mut().filter(|l| m.details.untimed(l.pid)).for_each(|l| l.rate_bytes_per_s = 0.0);
    }
    let exits = replay.exits().to_vec();
    let mut anomalies = replay.finish();
    anomalies.out_of_order = out_of_order;

    // A recording's processes with OOMs and no copy of their maps: the
    // libraries they loaded, PyTorch's allocator among them, are unknown.
    let ooms_without_maps: Vec<u32> = match trace.meta.as_ref().and_then(|m| m.details.record()) {
        Some(_) if !allocator_view => {
            let maps = trace.dir.join("maps");
            let mut pids: Vec<u32> = ooms
                .iter()
                .map(|o| trace.units.get(&o.pid).map_or(o.pid, |u| u.0))
                .filter(|pid| !maps.join(pid.to_string()).is_file())
                .collect();
            pids.sort_unstable();
            pids.dedup();
            pids
        }
        _ => Vec::new(),
    };
    // One pass from the end: each process's last regular row.
    let ended_empty: Vec<u32> = {
        let mut seen: ahash::AHashSet<u32> = Default::default();
        let mut empty: Vec<u32> = rows
            .iter()
            .rev()
            .filter(|r| !r.at_oom && seen.insert(r.pid))
            .filter(|r| r.metrics.live_bytes == 0 && r.metrics.span_bytes > 0)
            .map(|r| r.pid)
            .collect();
        empty.sort_unstable();
        empty
    };
    let mut analysis = Analysis {
        ended_empty,
        trace,
        events: events.len() as u64,
        counts_by_kind: counts,
        failed_allocs,
        null_frees,
        recovered_allocs: recovered,
        first_ts: events.ts_ns.first().unwrap_or(0),
        last_ts: events.ts_ns.last().unwrap_or(0),
        step_count: bounds.len(),
        rows,
        ooms,
        predictions,
        leaks,
        oom_risk: Vec::new(),
        capacity,
        anomalies,
        exits,
        iterations,
        peaks,
        peak_live_total: peak_total,
        options: opts.clone(),
        layout: None,
        allocator_view,
        flamegraph: stacks.as_ref().map(|st| crate::analysis::flame::folded(events, st)),
        kernels: Vec::new(),
        alloc_stacks: Vec::new(),
        whatif: None,
        whatif_not_run: None,
        pytorch_processes: {
            let mut p: Vec<u32> = pytorch.keys().copied().collect();
            p.sort_unstable();
            p
        },
        ooms_without_maps,
        advice: Vec::new(),
        decision: None,
        stages,
        settings_check: None,
        class: None,
    };
    analysis.settings_check = analysis
        .trace
        .meta
        .as_ref()
        .and_then(|m| m.details.snapshot())
        .filter(|_| allocator_view)
        .map(|d| settings_check::check(d, analysis.trace.source() == Some(crate::trace::Source::Ebpf)));
    // The allocator settings' what-if: for a snapshot, and for a
    // device-level trace with OOMs.
    let snapshot = analysis.trace.meta.as_ref().and_then(|m| m.details.snapshot()).filter(|_| allocator_view);
    // A device-level recording of PyTorch's processes holds its segments,
    // not the program's requests: replaying those through a model of the
    // same allocator says nothing about its settings.
    if opts.whatif && snapshot.is_none() && analysis.ooms.iter().any(|o| pytorch.contains_key(&o.pid)) {
        analysis.whatif_not_run = Some(
            "the failing process ran PyTorch's caching allocator (it mapped `libc10_cuda.so`), so this recording's \
             cudaMallocs are PyTorch's segments (and any allocation made outside it), not the program's tensor \
             requests: replaying them through a model of that allocator says nothing about \
             `PYTORCH_CUDA_ALLOC_CONF`. This recording holds no block events of PyTorch's allocator (an older \
             `record`, `--no-torch`, or a library without its symbols): record again with this version, without \
             `--no-torch` (its probes on PyTorch's allocator see every tensor), or dump a memory snapshot, to replay \
             the settings"
                .into(),
        );
    }
    // A snapshot without trace history has no requests to replay.
    if opts.whatif
        && analysis.whatif_not_run.is_none()
        && analysis.has_history()
        && (snapshot.is_some() || (!allocator_view && !analysis.ooms.is_empty()))
    {
        let started = std::time::Instant::now();
        let (streams, settings, source) = match snapshot {
            Some(d) => (
                whatif::streams(events, d, stacks.as_deref()),
                crate::allocator::Settings::from_snapshot(&d.allocator_settings),
                whatif::Source::Snapshot,
            ),
            None => (
                whatif::device_level_streams(events, &pytorch),
                crate::allocator::Settings::default(),
                whatif::Source::DeviceLevel,
            ),
        };
        tracing::debug!("whatif: request streams in {:.3} s", started.elapsed().as_secs_f64());
        // The default sweep cannot fail to parse; an error would be a bug.
        // A failure that a free range large enough would have served, by
        // the trace's own count, means memory the trace does not see: the
        // replay cannot reproduce it.
        let odd = analysis.ooms.iter().filter(|o| o.class == oom::OomClass::AllocatorPolicy).count();
        let unexplained = (odd > 0).then(|| {
            format!(
                "{odd} of the {} failed requests had a free range large enough by this trace's own count: memory it does not see, such as the CUDA context or another process, was in use",
                analysis.ooms.len()
            )
        });
        // The replay holds PyTorch's requests alone. A device's total that
        // a recording gives (NVML) is shared with what lies outside
        // PyTorch (libraries' workspaces, another tenant, the CUDA
        // context): not what those requests had. Only a capacity given is
        // taken; else the `oom` entries say what the process had (CUDA's
        // free memory, which a recording of the allocator reads too).
        let capacity = match source {
            whatif::Source::Snapshot => opts.capacity,
            whatif::Source::DeviceLevel => capacity,
        };
        analysis.whatif = whatif::run(&streams, &settings, capacity, opts.confs.clone(), source, unexplained)
            .map_err(|e| tracing::warn!("whatif: {e}"))
            .ok();
        tracing::debug!("whatif in {:.3} s", started.elapsed().as_secs_f64());
    }
    if analysis.trace.source() == Some(crate::trace::Source::Ebpf) {
        let trace = &analysis.trace;
        // (A probed recording's view and a join keep it in their `join`.)
        let at_entry = trace.meta.as_ref().is_some_and(|m| m.details.launches_at_entry());
        analysis.kernels =
            crate::analysis::kernels::kernel_table(&trace.dir, events, !at_entry, |id| trace.process_of(id));
        if let Some(st) = &stacks {
            analysis.alloc_stacks = sites::allocation_stacks(events, st);
        }
    }
    // The state at one instant (a snapshot without history, or a device
    // of one whose trace holds no entry: nothing of it in the history
    // kept, a ring buffer's on another device): nothing happened in it to
    // judge.
    let history = analysis.has_history();
    let empty: Vec<u32> = analysis
        .snapshot_details()
        .filter(|d| d.join.is_none())
        .map(|d| d.reconstruction.iter().filter(|r| r.entries == 0).map(|r| r.device).collect())
        .unwrap_or_default();
    for l in analysis.leaks.iter_mut().filter(|l| !history || empty.contains(&l.pid)) {
        l.verdict = leak::Verdict::CannotTell;
        l.leaking = false;
        l.reason = if history {
            format!("the snapshot's trace holds no entry for device {}, only its state at one instant", l.pid)
        } else {
            "the snapshot holds no trace history, only the state at one instant".into()
        };
    }
    // The OOM risk, after the what-if (a capacity its cache flushes imply
    // counts too) and the leaks (a leak raises it).
    let flushes: Vec<(u32, u64, u64, bool)> = analysis
        .whatif
        .iter()
        .flat_map(|w| w.flushes.iter())
        .filter_map(|(d, f)| f.releases_bound().map(|(lo, hi, gc)| (*d, lo, hi, gc)))
        .collect();
    let needed: Vec<(u32, u64)> = analysis
        .whatif
        .iter()
        .filter(|w| w.source == whatif::Source::Snapshot && w.untestable.is_none() && w.unreproduced.is_none())
        .flat_map(|w| {
            w.fidelity
                .iter()
                .enumerate()
                .filter_map(|(j, f)| Some((f.device, w.scenarios.first()?.needed.get(j)?.fits_from_bytes?)))
        })
        .collect();
    analysis.oom_risk = risk_series::evaluate(
        &risk_series::Inputs {
            events,
            allocator_view,
            peaks: &analysis.peaks,
            peak_live_total: analysis.peak_live_total,
            ooms: &analysis.ooms,
            given: opts.capacity,
            recorded: analysis.trace.meta.as_ref().and_then(|m| m.capacity_bytes),
            flushes: &flushes,
            gpus: &gpus,
            fragmentation: analysis.predictions.iter().map(|p| (p.pid, p.prediction.risk)).collect(),
            leaks: analysis
                .leaks
                .iter()
                .filter(|l| l.leaking)
                .map(|l| (l.pid, l.growth_per_iteration_bytes.and_then(|g| u64::try_from(g).ok())))
                .collect(),
            needed: &needed,
        },
        &mut analysis.rows,
    );
    // A capacity below what the trace itself held is a smaller device, or
    // a typo (`--capacity 2500` for 2500MiB): said, not refused.
    if let Some(c) = opts.capacity
        && let Some(x) = analysis.oom_risk.iter().filter(|x| x.peak_bytes > c).max_by_key(|x| x.peak_bytes)
    {
        tracing::warn!(
            "{}: --capacity {} is below the {} ({}){} held: judged as a smaller device",
            analysis.trace.name,
            crate::units::bytes(c),
            crate::units::bytes(x.peak_bytes),
            x.peak_what,
            x.device.map_or(String::new(), |d| format!(" device {d}"))
        );
    }
    for p in &mut analysis.predictions {
        p.lead_time = lead_time(p.pid, &analysis.rows, &analysis.ooms);
    }
    analysis.advice = advice::advise(&analysis, events);
    let site_stacks = stacks.as_deref();
    let decided = decision::decide(&analysis, opts.capacity, &|| {
        site_stacks.map_or_else(Vec::new, |st| {
            let mut s = sites::sites_at_peak(events, st);
            s.truncate(5);
            s
        })
    });
    for c in &decided.capacity.contradictions {
        tracing::warn!("{}: {c}", analysis.trace.name);
    }
    analysis.decision = Some(decided);
    if !analysis.peaks.is_empty() {
        analysis.layout = lives.map(|l| l.with(footprint));
    }
    Ok(analysis)
}

/// The replay units of a device-level recording that ran PyTorch's
/// caching allocator: the processes whose recorded maps hold
/// `libc10_cuda.so`, and each unit (process on one GPU) of those that used
/// several GPUs.
pub(crate) fn pytorch_units(trace: &Trace) -> oom::PytorchUnits {
    let pids = crate::trace::symbols::pytorch_processes(&trace.dir);
    // With `max_split_size_mb`, PyTorch first releases only its cached
    // blocks above that size and asks again, then its whole cache and asks
    // a third time.
    let asks_again = |pid: u32| -> u8 {
        let settings = crate::input::recorded_settings(trace, pid, |_, _| {});
        if settings.max_split_size.is_some() { 2 } else { 1 }
    };
    let units =
        trace.units.iter().filter(|(_, (pid, _))| pids.contains(pid)).map(|(&u, &(pid, _))| (u, asks_again(pid)));
    let mut all: oom::PytorchUnits = pids.iter().map(|&pid| (pid, asks_again(pid))).collect();
    all.extend(units);
    all
}

/// What the walk over the events gathers.
struct Walk {
    rows: Vec<Row>,
    ooms: Vec<OomDiagnosis>,
    counts: crate::trace::event::KindCounts,
    failed_allocs: u64,
    /// Failed cudaMallocs that PyTorch's allocator then served after
    /// releasing its cache: no OOM ([`oom::Retries`]).
    recovered: u64,
    /// `cudaFree`s of a null pointer, which free nothing.
    null_frees: u64,
}

/// What the walk needs to diagnose an OOM.
#[derive(Clone, Copy)]
struct OomContext<'a> {
    allocator_view: bool,
    capacity: Option<u64>,
    stacks: Option<&'a crate::trace::Stacks>,
    gpus: &'a risk_series::Gpus,
    /// The units that ran PyTorch's caching allocator ([`pytorch_units`]).
    pytorch: &'a oom::PytorchUnits,
}

/// Applies every event to the replay, with a row per process at the end
/// of each step and a row and a diagnosis at each OOM.
fn walk(events: &Events, bounds: &[(usize, u64)], replay: &mut Replay, context: &OomContext<'_>) -> Walk {
    // PyTorch's second asks (none for a snapshot: the set is empty).
    let mut retries = oom::Retries::of(context.pytorch.clone());
    let mut w = Walk {
        rows: Vec::with_capacity(bounds.len() + 16),
        ooms: Vec::new(),
        counts: Default::default(),
        failed_allocs: 0,
        recovered: 0,
        null_frees: 0,
    };
    let mut pids: Vec<u32> = Vec::new();
    // Processes whose `exit` was applied, and those with a row: a process
    // gets no row after its exit once it has one, so that its last state,
    // its score "now" and its forecast are of the process while it ran,
    // not of the nothing its exit left.
    let mut exited: ahash::AHashSet<u32> = Default::default();
    let mut rowed: ahash::AHashSet<u32> = Default::default();
    let row = |step: usize, t_ns: u64, pid: u32, at_oom: bool, replay: &mut Replay| Row {
        step: step as u32,
        t_ns,
        pid,
        at_oom,
        metrics: replay.metrics(pid),
        forecast: None,
        risk_online: None,
        oom_risk_online: None,
        alloc: replay.allocator_figures(pid),
        iteration: None,
        reported_reserved: None,
    };
    let mut i = 0usize;
    for (step, &(end, t_ns)) in bounds.iter().enumerate() {
        while i < end {
            let kind = events.kind[i];
            w.counts.add(kind);
            if kind == Some(crate::trace::event::EventKind::Free) && events.addr.at(i) == 0 {
                w.null_frees += 1;
            } else if kind == Some(crate::trace::event::EventKind::Exit) {
                exited.insert(events.pid[i]);
            } else if !exited.is_empty() {
                // A pid seen again after its exit is a new process.
                exited.remove(&events.pid[i]);
            }
            // Only kinds the replay reads, or that can be a failed request
            // or an OOM, are made into an event (a trace is often a third
            // launches).
            let wanted = kind.is_some_and(|k| replay.reads(k) || k.is_alloc_request() || k.can_run_out_of_memory());
            if wanted && let Some(e) = events.get(i) {
                replay.apply(&e);
                if e.ret != 0 && e.kind.is_alloc_request() {
                    w.failed_allocs += 1;
                }
                // PyTorch's second ask of the request that just failed: a
                // failed one is that OOM again, a served one means the
                // failure was no OOM (the cache's release made room).
                let ask = retries.see(e.kind, e.pid, e.size, e.ret);
                if ask == oom::Ask::Retry
                    && let Some(first) = w.ooms.iter_mut().rev().find(|o| o.pid == e.pid)
                {
                    first.retries += 1;
                } else if ask == oom::Ask::Recovered
                    && let Some(at) = w.ooms.iter().rposition(|o| o.pid == e.pid)
                {
                    let gone = w.ooms.remove(at);
                    if let Some(row) = w.rows.iter().rposition(|r| r.at_oom && r.pid == e.pid && r.t_ns == gone.t_ns) {
                        w.rows.remove(row);
                    }
                    // Every failed call of that request was served in the end.
                    w.recovered += 1 + u64::from(gone.retries);
                } else if e.is_oom() {
                    let r = row(step, e.ts_ns, e.pid, true, replay);
                    let mut d = diagnose_oom(&e, &r.metrics, replay, context);
                    if context.pytorch.contains_key(&e.pid) {
                        // The request failed inside PyTorch's cache, whose
                        // gaps the segments do not show: no class.
                        d.class = oom::OomClass::Unknown;
                        d.inside_pytorch_cache = true;
                    }
                    w.ooms.push(d);
                    w.rows.push(r);
                }
            }
            i += 1;
        }
        if pids.len() != replay.pids().count() {
            pids = replay.pids().collect();
        }
        for &pid in &pids {
            if exited.contains(&pid) && rowed.contains(&pid) {
                continue;
            }
            rowed.insert(pid);
            let r = row(step, t_ns, pid, false, replay);
            w.rows.push(r);
        }
    }
    w
}

/// The diagnosis of the failed request `e`, the replay standing just after it.
fn diagnose_oom(
    e: &crate::trace::event::Event,
    metrics: &Metrics,
    replay: &mut Replay,
    context: &OomContext<'_>,
) -> OomDiagnosis {
    use crate::analysis::oom::{Device, Process, Request, diagnose};
    let OomContext { allocator_view, capacity, stacks, gpus, .. } = *context;
    let device = if allocator_view {
        Device::Allocator { cuda_free: e.extra.device_free }
    } else {
        // The processes that share this GPU (every process when their
        // GPUs are not known).
        let gpu = gpus.of_unit.get(&e.pid);
        let (live_total, gaps_total) = pids_now(replay, |p| gpu.is_none() || gpus.of_unit.get(&p) == gpu);
        // A recording's GPU, of its own size, when no one size is known.
        let capacity = capacity.or_else(|| gpu.and_then(|g| gpus.totals.get(g).copied()));
        Device::Shared { capacity, live_total, gaps_total }
    };
    let blocks = replay.live_blocks(e.pid);
    let process = Process {
        live_bytes: metrics.live_bytes,
        span_bytes: metrics.span_bytes,
        largest_gap: metrics.largest_gap,
        live_blocks: &blocks,
    };
    let mut diagnosis = diagnose(Request { t_ns: e.ts_ns, pid: e.pid, size: e.size }, device, process);
    if let Some(st) = stacks {
        diagnosis.request_site = e.extra.stack.and_then(|id| sites::call_site(st, id));
        diagnosis.top_sites = sites::top_sites(st, &replay.live_blocks_detailed(e.pid), 10);
    }
    diagnosis
}

/// Each row's reserved bytes from the producer's reported series: per
/// process, the sum over its devices of the latest sample at or before
/// the row. Rows before a process's first sample stay None; a device not
/// yet reported on counts nothing (the profiler reports a device's
/// reserved bytes with its first memory event there).
fn fill_reported_reserved(series: &[crate::trace::details::ReservedSample], rows: &mut [Row]) {
    if series.is_empty() {
        return;
    }
    let mut samples = series.to_vec();
    samples.sort_by_key(|s| s.t_ns);
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| rows[i].t_ns);
    let mut now: std::collections::BTreeMap<(u32, i32), u64> = std::collections::BTreeMap::new();
    let mut next = 0;
    for i in order {
        while next < samples.len() && samples[next].t_ns <= rows[i].t_ns {
            let s = samples[next];
            now.insert((s.pid, s.device), s.bytes);
            next += 1;
        }
        let pid = rows[i].pid;
        let mut devices = now.range((pid, i32::MIN)..=(pid, i32::MAX)).peekable();
        if devices.peek().is_some() {
            rows[i].reported_reserved = Some(devices.map(|(_, &b)| b).sum());
        }
    }
}

#[cfg(test)]
mod tests;
