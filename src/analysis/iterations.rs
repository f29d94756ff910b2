//! Iterations: where the training or inference steps of each process (or
//! device, for snapshots) begin. A leak can only be told from memory that
//! keeps growing *across* iterations, the seasonal forecast needs the
//! period, and a reader wants to know how much of a run a trace holds.
//!
//! Sources, the first that finds anything wins:
//! 1. **Annotations** (PyTorch snapshots' `external_annotations`, from
//!    `record_function` ranges): `ProfilerStep#N` ranges are iterations;
//!    otherwise each `Optimizer.step#…` range ends one.
//! 2. **Call sites** (snapshots, whose stacks hold Python frames): allocations and frees made inside
//!    the optimizer's `step` come in one burst per iteration; each burst
//!    ends one. A frame is the optimizer's step when it is a function named
//!    `step`, or the `wrapper`/`_use_grad` that `torch/optim/optimizer.py`
//!    puts around every optimizer's `step` (`zero_grad` is not a step).
//! 3. **Periodicity** (device-level traces: eBPF, with or without native
//!    stacks, and synthetic; a transformer's layers repeat within one
//!    iteration as regularly as iterations do, so snapshots do not use it): an
//!    *anchor* — a kernel launch address, or an allocation of one exact
//!    size, that comes back at near-constant spacing (coefficient of
//!    variation of the gaps ≤ 0.25, at least five times, 8 events apart or
//!    more), the one at whose spacing live memory best repeats itself
//!    (autocorrelation ≥ 0.3) — cuts the series into periods; each period's highest live
//!    memory is an iteration's peak (after its lowest point, when the
//!    period opens with the previous iteration's descent; the last time
//!    the highest level is reached). Between two
//!    peaks separated by a valley (live memory comes down from the first,
//!    or, after a first iteration that keeps all it allocated, rises above
//!    its level and comes back to it) lies one iteration start: the moment
//!    live memory leaves its
//!    lowest level in that stretch for the last time (the first allocation
//!    request of that last flat run at the floor, or the event that leaves
//!    it). The anchor keeps its place in the iteration, so starts lie on
//!    one side of it; a start found on the other side (the warm-up's low
//!    point before optimizer state is allocated) is looked for again on
//!    the usual side. Iterations give back what they took: when the level at each
//!    start rises by more than half the climb in between (median), the
//!    repetition is accumulation — the layers of one forward pass — and no
//!    iterations are claimed. After the last anchor, an iteration the trace
//!    cut short counts
//!    once the stretch reaches as far past the anchor as starts usually
//!    lie and live memory rises there. Where live memory is flat there are
//!    no peaks, and no iterations are claimed: a run that goes on after
//!    memory is full, every request failing, has its iterations counted
//!    only up to there.
//!
//! 4. **Launches** (device-level traces whose live memory does not repeat:
//!    a recording of a program whose allocator caches, as PyTorch's does,
//!    sees its segments allocated once and kept; and a recording's
//!    allocator view, the probes on PyTorch's allocator, whose stacks hold
//!    no Python frame to find a step in): the kernel launch sequence
//!    repeats once per iteration; see [`from_launches`].
//!
//! An iteration runs from one boundary to the next; the stretch before the
//! first boundary and after the last is partial. Where a snapshot's device
//! had nothing alive before its first event (the recording began with the
//! program), its first event starts the first iteration, set-up included,
//! when iterations end at optimizer steps (sources 1 and 2). `complete` counts the
//! iterations with both ends in the trace; the first complete one is taken
//! as warm-up (`warmup_end_t_ns` is its end).

use ahash::AHashMap;
use serde::Serialize;

use crate::trace::details::Annotation;
use crate::trace::event::{EventKind, Events, NO_STACK};
use crate::trace::{Frame, Stacks};

/// How the iterations were found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IterationSource {
    Annotations,
    CallSites,
    Periodicity,
    Launches,
}

impl IterationSource {
    pub fn name(self) -> &'static str {
        match self {
            IterationSource::Annotations => "annotations",
            IterationSource::CallSites => "call-sites",
            IterationSource::Periodicity => "periodicity",
            IterationSource::Launches => "launches",
        }
    }
}

/// The iterations of one series.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Iterations {
    pub pid: u32,
    /// Iterations seen, partial ones included where the source counts them
    /// (an optimizer step seen once is one iteration).
    pub count: usize,
    /// Iterations with both their start and their end in the trace.
    pub complete: usize,
    /// Median time between boundaries, the warm-up left out when two or
    /// more complete iterations follow it.
    pub period_s: Option<f64>,
    /// End of the first complete iteration (the warm-up).
    pub warmup_end_t_ns: Option<u64>,
    pub source: IterationSource,
    /// Iteration starts (ns, the trace's clock), ascending.
    pub boundaries_t_ns: Vec<u64>,
    /// Steps the annotations name that began before the trace's first
    /// entry, where something was alive before it (PyTorch keeps the last
    /// entries of its history, and its annotations reach further back):
    /// not counted, since the trace holds none of their events.
    pub before_trace: usize,
}

impl Iterations {
    fn new(pid: u32, count: usize, mut boundaries: Vec<u64>, source: IterationSource) -> Iterations {
        boundaries.sort_unstable();
        boundaries.dedup();
        let complete = boundaries.len().saturating_sub(1);
        // The steady period: the warm-up (set-up, first allocations) is
        // left out when two or more iterations follow it.
        let mut gaps: Vec<u64> = boundaries.windows(2).map(|w| w[1] - w[0]).collect();
        if gaps.len() >= 3 {
            gaps.remove(0);
        }
        gaps.sort_unstable();
        let n = gaps.len();
        let period_s = (n > 0).then(|| {
            let median = if n % 2 == 1 { gaps[n / 2] as f64 } else { (gaps[n / 2 - 1] + gaps[n / 2]) as f64 / 2.0 };
            median / 1e9
        });
        let warmup_end_t_ns = boundaries.get(1).copied().filter(|_| complete >= 1);
        Iterations {
            pid,
            count,
            complete,
            period_s,
            warmup_end_t_ns,
            source,
            boundaries_t_ns: boundaries,
            before_trace: 0,
        }
    }

    /// The iteration holding instant `t` (0 from the first boundary), None
    /// before the first boundary.
    pub fn index_at(&self, t: u64) -> Option<u32> {
        self.boundaries_t_ns.partition_point(|&b| b <= t).checked_sub(1).map(|i| i as u32)
    }

    /// The complete iterations as [start, end) spans.
    pub fn spans(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.boundaries_t_ns.windows(2).map(|w| (w[0], w[1]))
    }
}

mod anchor;
mod rows;

use crate::trace::event::Row;
use anchor::anchor;
pub use rows::{RowList, Rows, by_pid as rows_by_pid};

/// Finds the iterations of series `pid` (a process, or a device of an
/// imported snapshot) from its events (`rows`: the indices of its rows,
/// in order), annotations, and the stacks of a snapshot (None for a
/// device-level trace: then the period is looked for).
pub fn detect(
    events: &Events,
    pid: u32,
    rows: Rows<'_>,
    stacks: Option<&Stacks>,
    annotations: &[Annotation],
    rebuilt: Option<usize>,
) -> Option<Iterations> {
    // A series with nothing alive before its first event began in the
    // trace (a snapshot whose recording started with the program): the
    // stretch before its first optimizer step's end is a whole iteration,
    // the first, with the program's set-up.
    let begins = rows.first().map(|i| events.ts_ns.at(i)).filter(|_| rebuilt == Some(0));
    // Where something was alive before it, the trace is a window on the
    // run (PyTorch's history keeps its last entries): steps that began
    // before its first entry are not in it. Its first entry is its first
    // row that is PyTorch's (a joined recording's allocations from outside
    // it may come earlier).
    let window = rows
        .iter()
        .find(|&i| stacks.is_none_or(|st| !outside_row(events, st, i)))
        .map(|i| events.ts_ns.at(i))
        .filter(|_| rebuilt.is_some_and(|n| n > 0));
    // A snapshot's allocations repeat per layer as much as per iteration,
    // so only its optimizer steps count; and only those the trace recorded,
    // not the blocks rebuilt from its final state (all at its first
    // instant: the optimizer's moments made by steps before it began).
    from_annotations(pid, annotations, begins, window).or_else(|| match stacks {
        // A recording's allocator view (the probes on PyTorch's allocator)
        // has native frames at most, where no optimizer step can show:
        // its kernel launches repeat once per iteration, as a device-level
        // recording's do (not its blocks, which repeat per layer too).
        Some(st) => {
            from_optimizer_steps(events, pid, after_rebuilt(events, rows, st, rebuilt.unwrap_or(0)), st, begins)
                .or_else(
                    || if st.frames.iter().any(Frame::is_python) { None } else { from_launches(events, pid, rows) },
                )
        }
        None => from_periodicity(events, pid, rows).or_else(|| from_launches(events, pid, rows)),
    })
}

/// The rows after the first `rebuilt` of a snapshot's device (what was
/// alive before its first entry), counting as the what-if's streams do:
/// not the allocations a joined recording adds from outside PyTorch,
/// which may be stamped before them.
fn after_rebuilt<'a>(events: &Events, rows: Rows<'a>, stacks: &Stacks, rebuilt: usize) -> Rows<'a> {
    if rebuilt == 0 {
        return rows;
    }
    // Only the rows up to the rebuilt ones are asked.
    let mut seen = 0;
    for (k, i) in rows.iter().enumerate() {
        if seen == rebuilt {
            return rows.from_position(k);
        }
        if !outside_row(events, stacks, i) {
            seen += 1;
        }
    }
    rows.from_position(rows.len())
}

/// Whether row `i` is an allocation a joined recording adds from outside
/// PyTorch (by its stack).
fn outside_row(events: &Events, stacks: &Stacks, i: usize) -> bool {
    events.stack.get(i).is_some_and(|&id| crate::input::is_outside(stacks, id))
}

/// Whether annotation `a` marks a step: a `ProfilerStep#N` range or the
/// end of an `Optimizer.step#…` range (what [`from_annotations`] reads).
pub fn marks_step(a: &Annotation) -> bool {
    a.name.starts_with("ProfilerStep#") || (a.name.starts_with("Optimizer.step#") && a.stage == "END")
}

fn from_annotations(
    pid: u32,
    annotations: &[Annotation],
    begins: Option<u64>,
    window: Option<u64>,
) -> Option<Iterations> {
    let all: Vec<&Annotation> = annotations.iter().filter(|a| a.device == pid).collect();
    let inside = |a: &&Annotation| window.is_none_or(|w| a.t_ns >= w);
    let before = |step: &dyn Fn(&Annotation) -> bool| all.iter().filter(|a| step(a) && !inside(a)).count();
    let mine: Vec<&Annotation> = all.iter().copied().filter(inside).collect();
    let profiler: Vec<&&Annotation> = mine.iter().filter(|a| a.name.starts_with("ProfilerStep#")).collect();
    let starts: Vec<u64> = profiler.iter().filter(|a| a.stage == "START").map(|a| a.t_ns).collect();
    if !starts.is_empty() {
        let mut boundaries = starts.clone();
        // The last step's end closes it, when it is in the trace.
        if let Some(end) = profiler.iter().filter(|a| a.stage == "END").map(|a| a.t_ns).max()
            && end > *starts.iter().max().unwrap_or(&0)
        {
            boundaries.push(end);
        }
        let mut it = Iterations::new(pid, starts.len(), boundaries, IterationSource::Annotations);
        it.before_trace = before(&|a| a.name.starts_with("ProfilerStep#") && a.stage == "START");
        return Some(it);
    }
    let step_end = |a: &Annotation| a.name.starts_with("Optimizer.step#") && a.stage == "END";
    let ends: Vec<u64> = mine.iter().filter(|a| step_end(a)).map(|a| a.t_ns).collect();
    (!ends.is_empty()).then(|| {
        let mut it = Iterations::new(pid, ends.len(), with_start(begins, ends), IterationSource::Annotations);
        it.before_trace = before(&step_end);
        it
    })
}

/// Iteration ends, with the series' first instant as the first start when
/// it began in the trace (before the first end).
fn with_start(begins: Option<u64>, mut ends: Vec<u64>) -> Vec<u64> {
    if let Some(t) = begins.filter(|&t| ends.iter().all(|&e| t < e)) {
        ends.push(t);
    }
    ends
}

/// A frame of an optimizer's `step`: `torch.optim.Optimizer`'s wrapper
/// around every subclass's `step` (a hand-written optimizer that subclasses
/// it too), or a `step` in a file under an `optim/` folder. Other `step`s
/// are not (a diffusion scheduler's, an LR scheduler's, a game's).
fn is_step_frame(f: &Frame) -> bool {
    let file = f.filename.replace('\\', "/");
    let in_optim = file.contains("/optim/") || file.starts_with("optim/");
    (file.ends_with("optim/optimizer.py") && (f.name == "wrapper" || f.name == "_use_grad"))
        || (f.name == "step" && in_optim && !file.ends_with("lr_scheduler.py"))
}

/// Events of `pid` between two optimizer-step events that end one burst
/// and start the next.
const BURST_GAP: usize = 64;

fn from_optimizer_steps(
    events: &Events,
    pid: u32,
    rows: Rows<'_>,
    stacks: &Stacks,
    begins: Option<u64>,
) -> Option<Iterations> {
    if events.stack.is_empty() {
        return None;
    }
    let mut in_step: AHashMap<u32, bool> = AHashMap::new();
    // Per burst: its last step event, and the time of the pid's first
    // event after it (where the next iteration begins).
    let mut bursts: Vec<(usize, Option<u64>)> = Vec::new();
    let mut since_step = usize::MAX;
    for i in rows.iter() {
        let id = events.stack[i];
        let step = id != NO_STACK && *in_step.entry(id).or_insert_with(|| stacks.frames_of(id).any(is_step_frame));
        if step {
            match bursts.last_mut() {
                Some(b) if since_step <= BURST_GAP => *b = (i, None),
                _ => bursts.push((i, None)),
            }
            since_step = 0;
        } else {
            if since_step == 0
                && let Some(b) = bursts.last_mut()
            {
                b.1 = Some(events.ts_ns.at(i));
            }
            since_step = since_step.saturating_add(1);
        }
    }
    if bursts.is_empty() {
        return None;
    }
    let ends = bursts.iter().map(|&(last, after)| after.unwrap_or(events.ts_ns.at(last) + 1)).collect();
    Some(Iterations::new(pid, bursts.len(), with_start(begins, ends), IterationSource::CallSites))
}

/// The largest coefficient of variation of an anchor's gaps.
const ANCHOR_MAX_CV: f64 = 0.25;
/// The fewest times an anchor must come back.
const ANCHOR_MIN_COUNT: usize = 5;
/// The least correlation of live memory with itself one period later.
const MIN_AUTOCORRELATION: f64 = 0.3;

/// A level of live memory as the periodicity series stores it: bytes
/// divided by the series' grain (the greatest common divisor of its block
/// sizes), in 4 bytes where every level fits, else 8. Dividing by a common
/// factor keeps every comparison; sums and ratios read the bytes back.
trait Level: Copy + Ord {
    const ZERO: Self;
    fn of(units: u64) -> Option<Self>;
    fn bytes(self, grain: u64) -> u64;
}

impl Level for u32 {
    const ZERO: u32 = 0;
    fn of(units: u64) -> Option<u32> {
        u32::try_from(units).ok()
    }
    fn bytes(self, grain: u64) -> u64 {
        u64::from(self) * grain
    }
}

impl Level for u64 {
    const ZERO: u64 = 0;
    fn of(units: u64) -> Option<u64> {
        Some(units)
    }
    fn bytes(self, grain: u64) -> u64 {
        self * grain
    }
}

/// The live device bytes of `pid` after each of its events, in units of
/// `grain`; None when a level does not fit `V`.
fn live_series<V: Level>(events: &Events, idx: Rows<'_>, grain: u64) -> Option<Vec<V>> {
    let mut live = Vec::with_capacity(idx.len());
    let mut blocks: AHashMap<u64, u64> = AHashMap::new();
    let mut now = 0u64;
    for i in idx.iter() {
        if let Some(kind) = events.kind[i]
            && events.ret[i] == 0
        {
            if kind == EventKind::Exit {
                blocks.clear();
                now = 0;
            } else if kind.creates_block()
                && let size @ 1.. = events.size.at(i)
            {
                if let Some(old) = blocks.insert(events.addr.at(i), size) {
                    now -= old;
                }
                now += size;
            } else if kind.releases_block()
                && let Some(size) = blocks.remove(&events.addr.at(i))
            {
                now -= size;
            }
        }
        live.push(V::of(now / grain)?);
    }
    Some(live)
}

fn from_periodicity(events: &Events, pid: u32, rows: Rows<'_>) -> Option<Iterations> {
    // The series: the pid's events, and its live device bytes after each.
    let idx = rows;
    if idx.len() < 16 {
        return None;
    }
    // Every level is a sum of block sizes: a multiple of their greatest
    // common divisor (512 for CUDA's and PyTorch's rounding). Stored in
    // those units, a long series takes 4 bytes an event where it took 8.
    let mut grain = 0u64;
    for i in idx.iter() {
        if events.kind[i].is_some_and(EventKind::creates_block) && events.ret[i] == 0 && events.size.at(i) > 0 {
            grain = gcd(grain, events.size.at(i));
            if grain == 1 {
                break;
            }
        }
    }
    let grain = grain.max(1);
    match live_series::<u32>(events, idx, grain) {
        Some(live) => periodicity_in(events, pid, idx, &live, grain),
        None => periodicity_in(events, pid, idx, &live_series::<u64>(events, idx, grain)?, grain),
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// [`from_periodicity`] on the series `live`, in units of `grain`.
fn periodicity_in<V: Level>(events: &Events, pid: u32, idx: Rows<'_>, live: &[V], grain: u64) -> Option<Iterations> {
    let anchors = anchor(events, idx, live, grain)?;
    // One peak per stretch the anchors cut (the stretch before the first
    // anchor too, unless live memory is flat there); between two peaks
    // lies one iteration start.
    let mut peaks = Vec::with_capacity(anchors.len() + 1);
    let mut lo = 0;
    for &a in &anchors {
        // The highest point; but a stretch that opens with the previous
        // iteration's descent has its highest point at its start, which is
        // no peak: then the highest point after its lowest.
        let stretch = &live[lo..=a];
        let (min, max) = (*stretch.iter().min()?, *stretch.iter().max()?);
        // The last time it is reached: a temporary of the previous
        // iteration's tail can reach the level of an iteration whose
        // requests mostly failed.
        let mut at = stretch.iter().rposition(|&v| v == max)?;
        if stretch[0] == max {
            let min_at = stretch.iter().position(|&v| v == min)?;
            let after = *stretch[min_at..].iter().max()?;
            at = min_at + stretch[min_at..].iter().rposition(|&v| v == after)?;
        }
        if stretch[at] > min {
            peaks.push(lo + at);
        }
        lo = a + 1;
    }
    let is_request = |j: usize| events.kind[idx.get(j)].is_some_and(EventKind::is_alloc_request);
    // The start between two peaks: the run at the lowest level, and in it an
    // allocation request (one that failed leaves the level unchanged), else
    // the event that leaves it.
    let start_between = |lo: usize, hi: usize| -> Option<usize> {
        let floor = live[lo..=hi].iter().copied().min()?;
        let last = (lo..=hi).rev().find(|&j| live[j] == floor)?;
        let mut run = last;
        while run > lo && live[run - 1] == floor {
            run -= 1;
        }
        Some((run..=last).find(|&j| is_request(j)).unwrap_or(last + 1).min(hi))
    };
    // Only a valley separates two iterations: live memory must come down
    // from the first peak (the first period of a run that is still loading
    // its weights only climbs).
    // A first iteration that keeps everything it allocated (state that
    // lives on) ends at its peak level, not below it: that counts as a
    // valley too when live memory, after the peak, rose above that level
    // and came back to it before the climb to the next peak (temporaries
    // given back), which loading alone never does.
    let valley = |w: &[usize]| -> bool {
        let stretch = &live[w[0] + 1..=w[1]];
        let floor = stretch.iter().copied().min().unwrap_or(V::ZERO);
        if live[w[0]] > floor {
            return true;
        }
        let Some(last) = stretch.iter().rposition(|&v| v == floor) else { return false };
        live[w[0]] == floor && stretch[..last].iter().any(|&v| v > floor)
    };
    // Each pair of peaks with a valley between them, the anchor that lies
    // between them, and the start found there.
    let mut found: Vec<(usize, usize, usize, usize)> = peaks
        .windows(2)
        .filter(|w| w[0] < w[1] && valley(w))
        .filter_map(|w| {
            let a = anchors[anchors.partition_point(|&a| a < w[0])];
            start_between(w[0] + 1, w[1]).map(|st| (w[0], a, w[1], st))
        })
        .collect();
    // The anchor holds its place in the iteration, so starts lie on one
    // side of it. Where one does not, its stretch held a lower point that
    // is not a start: state allocated late in the warm-up (optimizer
    // moments after the first backward) lifts the level at which the next
    // iteration begins above the first iteration's lowest point. Such a
    // start is looked for again on the usual side of the anchor.
    let after = found.iter().filter(|f| f.3 > f.1).count();
    if after * 2 != found.len() {
        let usual_after = after * 2 > found.len();
        for f in &mut found {
            if (f.3 > f.1) != usual_after {
                let redo = if usual_after { start_between(f.1 + 1, f.2) } else { start_between(f.0 + 1, f.1) };
                if let Some(st) = redo {
                    f.3 = st;
                }
            }
        }
    }
    let mut starts: Vec<usize> = found.iter().map(|f| f.3).collect();
    // After the last anchor the trace may have cut the last iteration
    // short: its start counts once the stretch reaches as far past the
    // anchor as starts usually lie, and live memory rises there.
    if let (Some(&last_anchor), Some(&last_peak)) = (anchors.last(), peaks.last()) {
        let mut offsets: Vec<usize> =
            starts.iter().filter_map(|&st| anchors.iter().rev().find(|&&a| a < st).map(|&a| st - a)).collect();
        offsets.sort_unstable();
        if let Some(&offset) = offsets.get(offsets.len() / 2)
            && last_peak <= last_anchor
            && live.len() - 1 >= last_anchor + offset
        {
            let lo = last_peak + 1;
            let min = *live[lo..].iter().min()?;
            let min_at = lo + live[lo..].iter().rposition(|&v| v == min)?;
            if live[min_at..].iter().any(|&v| v > min)
                && let Some(st) = start_between(lo, live.len() - 1)
            {
                starts.push(st);
            }
        }
    }
    // An iteration gives back what it took: from one start to the next the
    // level at the start rises by far less than the climb in between. The
    // layers of one forward pass repeat as regularly, but each keeps its
    // activations: that is accumulation, not iterations.
    let mut ratios: Vec<f64> = starts
        .windows(2)
        .filter_map(|w| {
            let (base, next) = (live[w[0].saturating_sub(1)].bytes(grain), live[w[1].saturating_sub(1)].bytes(grain));
            let peak = live[w[0]..w[1]].iter().max()?.bytes(grain);
            (peak > base).then(|| next.saturating_sub(base) as f64 / (peak - base) as f64)
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    if ratios.get(ratios.len() / 2).is_none_or(|&r| r > 0.5) {
        return None;
    }
    let boundaries: Vec<u64> = starts.iter().map(|&j| events.ts_ns.at(idx.get(j))).collect();
    (boundaries.len() >= 2).then(|| Iterations::new(pid, boundaries.len(), boundaries, IterationSource::Periodicity))
}

/// The fewest times the launch sequence must repeat to count as
/// iterations.
const LAUNCH_MIN_REPEATS: usize = 4;
/// The least share of launches that the launch one period later repeats.
const LAUNCH_MIN_MATCH: f64 = 0.6;
/// Fewer launches than this say nothing about a period.
const LAUNCH_MIN_COUNT: usize = 64;

/// Iterations from the kernel launches alone, for a device-level trace
/// whose live memory does not repeat (PyTorch's cache keeps its segments,
/// so a recording of a cached run sees memory rise once and stay): the
/// sequence of launched kernels repeats once per iteration. An anchor is a
/// kernel that comes back at near-constant spacing in the launch sequence
/// (coefficient of variation of its gaps ≤ 0.25, the first gap left out:
/// the first iteration sets things up), at least four times, eight
/// launches apart or more. Its launches cut the sequence into periods, and
/// it is an iteration's when each period repeats the one before: at least
/// 60 % of its launches (median over the periods) are the same kernels at
/// the same place, counted from the period's start or from its end (the
/// layers within one iteration repeat too, but no kernel that runs once
/// per layer comes back at constant spacing across iterations). Of the anchors, the one whose
/// period repeats the most launches, then the one seen most often; each of
/// its launches opens an iteration.
fn from_launches(events: &Events, pid: u32, rows: Rows<'_>) -> Option<Iterations> {
    if rows.len() <= u32::MAX as usize {
        from_launches_in::<u32>(events, pid, rows)
    } else {
        from_launches_in::<usize>(events, pid, rows)
    }
}

/// [`from_launches`], with launch positions and kernel ids stored as `P`:
/// a recording of a cached run is mostly launches, and this held three
/// 8-byte values for each.
fn from_launches_in<P: Row>(events: &Events, pid: u32, rows: Rows<'_>) -> Option<Iterations> {
    let is_launch = |i: usize| events.kind[i] == Some(EventKind::Launch) && events.ret[i] == 0;
    // The launch sequence as kernel ids (the kernel's address: `addrs`),
    // and each kernel's positions in it.
    let mut ids: AHashMap<u64, P> = AHashMap::new();
    let (mut addrs, mut positions): (Vec<u64>, Vec<Vec<P>>) = (Vec::new(), Vec::new());
    let mut kernels: Vec<P> = Vec::new();
    for i in rows.iter().filter(|&i| is_launch(i)) {
        let id = *ids.entry(events.addr.at(i)).or_insert_with(|| {
            addrs.push(events.addr.at(i));
            positions.push(Vec::new());
            P::at(addrs.len() - 1)
        });
        positions[id.index()].push(P::at(kernels.len()));
        kernels.push(id);
    }
    if kernels.len() < LAUNCH_MIN_COUNT {
        return None;
    }
    // How much of one period's launch sequence the next repeats: the
    // stretches between consecutive launches of `kernel`, each compared
    // with the next, launch by launch, aligned at their starts and at their
    // ends (a step that launches a few more kernels shifts only what comes
    // after them); the median over at most 64 pairs.
    let same = |x: P, y: P| x.index() == y.index();
    let repeats = |pos: &[P]| -> f64 {
        let pairs = pos.len().saturating_sub(2);
        let stride = pairs.div_ceil(64).max(1);
        let mut shares: Vec<f64> = (0..pairs)
            .step_by(stride)
            .map(|i| {
                let (p0, p1, p2) = (pos[i].index(), pos[i + 1].index(), pos[i + 2].index());
                let (a, b) = (&kernels[p0..p1], &kernels[p1..p2]);
                let matched = (0..a.len())
                    .filter(|&o| {
                        let tail = a.len() - 1 - o;
                        (o < b.len() && same(a[o], b[o])) || (tail < b.len() && same(a[o], b[b.len() - 1 - tail]))
                    })
                    .count();
                matched as f64 / a.len().max(b.len()) as f64
            })
            .collect();
        shares.sort_by(f64::total_cmp);
        shares.get(shares.len() / 2).copied().unwrap_or(0.0)
    };
    let mut best: Option<(f64, usize, u64, usize)> = None;
    // In address order, so that the result does not depend on the map's.
    let mut candidates: Vec<usize> = (0..addrs.len()).collect();
    candidates.sort_unstable_by_key(|&id| addrs[id]);
    for id in candidates {
        let (kernel, pos) = (addrs[id], &positions[id]);
        if pos.len() < LAUNCH_MIN_REPEATS {
            continue;
        }
        let gaps: Vec<f64> = pos.windows(2).map(|w| (w[1].index() - w[0].index()) as f64).collect();
        let steady = if gaps.len() >= 3 { &gaps[1..] } else { &gaps[..] };
        let mean = steady.iter().sum::<f64>() / steady.len() as f64;
        if mean < 8.0 || mean * LAUNCH_MIN_REPEATS as f64 > kernels.len() as f64 + mean {
            continue;
        }
        let sd = (steady.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / steady.len() as f64).sqrt();
        if sd / mean > ANCHOR_MAX_CV {
            continue;
        }
        let mut sorted: Vec<usize> = pos.windows(2).map(|w| w[1].index() - w[0].index()).collect();
        sorted.sort_unstable();
        let period = sorted[sorted.len() / 2];
        if period >= kernels.len() {
            continue;
        }
        // Each anchor's own periods: another kernel of the same period
        // cuts the sequence elsewhere.
        let m = repeats(pos);
        if m < LAUNCH_MIN_MATCH {
            continue;
        }
        let candidate = (m, pos.len(), kernel, id);
        let better = best.is_none_or(|b| {
            candidate.0.total_cmp(&b.0).then(candidate.1.cmp(&b.1)).then(b.2.cmp(&candidate.2)).is_gt()
        });
        if better {
            best = Some(candidate);
        }
    }
    let (_, count, _, id) = best?;
    // The anchor's launches, found again in the series: their times.
    let mut opens = positions[id].iter().map(|k| k.index()).peekable();
    let mut boundaries: Vec<u64> = Vec::with_capacity(count);
    for (k, i) in rows.iter().filter(|&i| is_launch(i)).enumerate() {
        if opens.next_if_eq(&k).is_some() {
            boundaries.push(events.ts_ns.at(i));
        }
    }
    Some(Iterations::new(pid, count, boundaries, IterationSource::Launches))
}

#[cfg(test)]
mod tests;
