//! The passes that follow the replay's walk: iterations, leak verdicts
//! and the forecast of each series, and the helpers they share.

use super::*;

/// The iterations of every pid of the trace that the replay keeps a
/// process for ([`replay::tracks`]), by pid. Which of them end up with
/// device memory is known only after the replay this runs beside;
/// [`keep_iterations`] drops the others.
pub(super) fn detect_iterations(
    events: &Events,
    allocator_view: bool,
    snapshot_stacks: Option<&crate::trace::Stacks>,
    annotations: &[crate::trace::details::Annotation],
    rebuilt: &ahash::AHashMap<u32, usize>,
) -> ahash::AHashMap<u32, Iterations> {
    let replayed = |i: usize| events.kind[i].is_some_and(|k| replay::tracks(k, allocator_view));
    let by_pid = crate::analysis::iterations::rows_by_pid(events);
    by_pid
        .iter()
        .filter(|(_, rows)| rows.rows().iter().any(replayed))
        .filter_map(|(&pid, rows)| {
            crate::analysis::iterations::detect(
                events,
                pid,
                rows.rows(),
                snapshot_stacks,
                annotations,
                rebuilt.get(&pid).copied(),
            )
            .map(|it| (pid, it))
        })
        .collect()
}

/// The iterations of the processes with device memory (`peaks`, in their
/// order), and each row's iteration.
pub(super) fn keep_iterations(
    mut detected: ahash::AHashMap<u32, Iterations>,
    peaks: &[Peak],
    rows: &mut [Row],
) -> Vec<Iterations> {
    let iterations: Vec<Iterations> = peaks.iter().filter_map(|p| detected.remove(&p.pid)).collect();
    for r in rows.iter_mut() {
        r.iteration = iterations.iter().find(|it| it.pid == r.pid).and_then(|it| it.index_at(r.t_ns));
    }
    iterations
}

/// The leak verdict of each process with device memory, from its exact
/// floors ([`leak`]), with the call sites of its growth and of what it
/// allocated once (traces with stacks).
pub(super) fn find_leaks(
    events: &Events,
    peaks: &[Peak],
    iterations: &[Iterations],
    floors: &ahash::AHashMap<u32, leak::IterationFloors>,
    replay: &mut Replay,
    allocator_view: bool,
    stacks: Option<&crate::trace::Stacks>,
    ooms: &[OomDiagnosis],
) -> Vec<LeakReport> {
    let exits = replay.exits().to_vec();
    peaks
        .iter()
        .map(|p| {
            let live = replay.live_blocks(p.pid);
            let oom_times: Vec<u64> = ooms.iter().filter(|o| o.pid == p.pid).map(|o| o.t_ns).collect();
            let requested = replay.allocator_figures(p.pid).map(|f| f.requested_bytes);
            let mut report = crate::analysis::leak::detect(&crate::analysis::leak::Input {
                pid: p.pid,
                events,
                allocator_view,
                live: &live,
                peak: p.bytes,
                iterations: iterations
                    .iter()
                    .find(|it| it.pid == p.pid)
                    .and_then(|it| floors.get(&p.pid).map(|f| (it, f))),
                stacks,
                oom_times: &oom_times,
                exited: exits.iter().rev().find(|x| x.pid == p.pid).map(|x| (x.bytes, x.blocks)),
            });
            report.live_at_end_requested_bytes = requested;
            report
        })
        .collect()
}

/// The iteration period in steps of the process's regular rows, when it
/// spans at least one step.
pub(super) fn period_steps(it: &Iterations, rows: &[Row]) -> Option<usize> {
    let period_ns = it.period_s? * 1e9;
    let mut t: Vec<u64> = rows.iter().filter(|r| r.pid == it.pid && !r.at_oom).map(|r| r.t_ns).collect();
    t.dedup();
    let mut gaps: Vec<u64> = t.windows(2).map(|w| w[1] - w[0]).filter(|&g| g > 0).collect();
    if gaps.is_empty() {
        return None;
    }
    gaps.sort_unstable();
    let step = gaps[gaps.len() / 2] as f64;
    let p = (period_ns / step).round();
    (p >= 1.0).then_some(p as usize)
}

/// Live bytes, and free bytes inside the arenas (span − live: gaps and
/// alignment slack), summed over every process: the device's view.
pub(super) fn pids_now(replay: &mut Replay, on_gpu: impl Fn(u32) -> bool) -> (u64, u64) {
    let pids: Vec<u32> = replay.pids().filter(|&p| on_gpu(p)).collect();
    pids.into_iter()
        .map(|p| replay.metrics(p))
        .fold((0, 0), |(l, g), m| (l + m.live_bytes, g + (m.span_bytes - m.live_bytes).min(m.span_bytes)))
}

/// `f` over `items` on up to as many threads as the machine has cores (a
/// plain thread each, taking the next item as it is done), in order.
pub(super) fn map_in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<R>> = items.iter().map(|_| None).collect();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break done };
                        done.push((i, f(item)));
                    }
                })
            })
            .collect();
        for w in workers {
            for (i, r) in w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)) {
                out[i] = Some(r);
            }
        }
    });
    out.into_iter().map(|r| r.expect("every item was mapped")).collect()
}

/// Runs the predictor and the online backtest on one process's regular
/// rows: the rows' indices, the prediction and the backtest.
pub(super) fn predict_series(
    pid: u32,
    rows: &[Row],
    cfg: &PredictConfig,
    period: Option<usize>,
) -> (Vec<usize>, Prediction, crate::analysis::predict::Backtest) {
    let idx: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].pid == pid && !rows[i].at_oom).collect();
    let series: Vec<crate::analysis::predict::Step> = idx
        .iter()
        .map(|&i| {
            let m = &rows[i].metrics;
            let [e, k, s, c, l, u] = m.features();
            [e, k, s, c, l, u, m.score]
        })
        .collect();
    let (mut prediction, backtest) = crate::analysis::predict::predict_with_backtest(&series, cfg, period);
    // Nothing live at the last timestep: the program has released all it
    // held (a job's teardown, after an OOM or at its end), and where the
    // score of that empty cache heads warns of nothing.
    if idx.last().is_some_and(|&i| rows[i].metrics.live_bytes == 0) {
        prediction.warnings.clear();
    }
    (idx, prediction, backtest)
}

/// Writes a process's backtest (from [`predict_series`]) into its rows.
pub(super) fn apply_prediction(
    pid: u32,
    idx: Vec<usize>,
    prediction: Prediction,
    backtest: crate::analysis::predict::Backtest,
    rows: &mut [Row],
) -> ProcessPrediction {
    for (k, &i) in idx.iter().enumerate() {
        rows[i].forecast = backtest.forecasts[k].clone();
        rows[i].risk_online = backtest.risk[k];
    }
    ProcessPrediction { pid, prediction, lead_time: None }
}

/// Steps and seconds from the first row where the online OOM risk of
/// `pid` reached high to its first OOM.
pub(super) fn lead_time(pid: u32, rows: &[Row], ooms: &[OomDiagnosis]) -> Option<(u32, f64)> {
    let first = ooms.iter().find(|o| o.pid == pid)?;
    let oom_step = rows.iter().find(|r| r.at_oom && r.pid == pid && r.t_ns == first.t_ns)?.step;
    rows.iter()
        .filter(|r| r.pid == pid && !r.at_oom)
        .take_while(|r| r.t_ns < first.t_ns)
        .find(|r| r.oom_risk_online.is_some_and(|risk| risk >= risk::OomRisk::High))
        .map(|r| (oom_step.saturating_sub(r.step), (first.t_ns - r.t_ns) as f64 / 1e9))
}
