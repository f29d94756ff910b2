//! One replay of a device's requests through the model ([`replay`]), and
//! its checkpoints ([`Checkpoints`]): the state between two requests,
//! kept while replaying with no budget so that a replay under a budget
//! can start where the budget first matters instead of at the start.
//!
//! Where the budget changes no decision before reserved memory reaches it
//! ([`budget_free`]: no expandable segments, whose ranges span a share of
//! the budget; no garbage collection, which acts at a share of it; no
//! release whose maker the trace cannot tell, which is judged by it), a
//! replay under budget B is the replay with none, request for request,
//! until reserved memory would pass B. A checkpoint at which reserved had
//! never passed B is therefore a state the replay under B reaches too. The
//! memory needed ([`super::needed`]) bisects over budgets near the peak, so
//! each of its replays starts late in the trace, and one that fails stops
//! soon after.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::fidelity::initial_state;
use super::stream::{DeviceStream, Release, is_release};
use crate::allocator::{Allocator, Refused, Settings};
use crate::analysis::oom::OomClass;
use crate::trace::event::{Event, EventKind};

/// What one setting did with the requests.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Outcome {
    pub name: String,
    /// The `PYTORCH_CUDA_ALLOC_CONF` entries on top of the recorded
    /// settings (empty for `recorded`).
    pub conf: Vec<String>,
    pub peak_reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    /// Reserved minus allocated at the peak of reserved: the least of it
    /// while reserved is at its peak (where allocated is highest).
    pub reserved_minus_allocated_at_peak: u64,
    pub segment_allocs: u64,
    pub ooms: u64,
    /// Requests that found the device full and released cached memory to
    /// make room (each a device-wide synchronisation); a request that then
    /// failed counts too.
    pub flushes: u64,
    pub oom_classes: Vec<(String, u64)>,
    /// Requests (allocations and recorded OOMs) the scenario served.
    pub allocations: u64,
    /// Reserved and allocated bytes over time, at most [`SERIES_POINTS`]
    /// points (each the highest reserved of its stretch of requests), and
    /// the times of the OOMs: for whatif.png.
    #[serde(skip)]
    pub series: Vec<(u64, u64, u64)>,
    #[serde(skip)]
    pub oom_times: Vec<u64>,
}

/// Points of [`Outcome::series`] at most.
pub const SERIES_POINTS: usize = 2000;

/// Keeps the highest reserved of each stretch of `every` samples.
#[derive(Clone)]
pub(super) struct Sampler {
    pub(super) every: usize,
    pub(super) seen: usize,
    pub(super) best: Option<(u64, u64, u64)>,
}

impl Sampler {
    pub(super) fn new(samples: usize) -> Sampler {
        Sampler { every: samples.div_ceil(SERIES_POINTS).max(1), seen: 0, best: None }
    }

    pub(super) fn add(&mut self, out: &mut Vec<(u64, u64, u64)>, point: (u64, u64, u64)) {
        if self.best.is_none_or(|b| point.1 > b.1) {
            self.best = Some(point);
        }
        self.seen += 1;
        if self.seen % self.every == 0
            && let Some(b) = self.best.take()
        {
            out.push(b);
        }
    }

    pub(super) fn finish(&mut self, out: &mut Vec<(u64, u64, u64)>) {
        if let Some(b) = self.best.take() {
            out.push(b);
        }
    }
}

/// Keeps the peak of reserved memory and, while reserved stays at its
/// peak, the most allocated (`peak`), and the peak of allocated memory.
pub(super) fn note_peak(peak: &mut (u64, u64), peak_allocated: &mut u64, reserved: u64, allocated: u64) {
    if reserved > peak.0 || (reserved == peak.0 && allocated > peak.1) {
        *peak = (reserved, allocated);
    }
    *peak_allocated = (*peak_allocated).max(allocated);
}

/// Checkpoints kept per replay at most (one every this share of the
/// trace): each costs a copy of the model's state.
const CHECKPOINTS: usize = 16;

/// Whether a replay under any budget follows the replay with none until
/// reserved memory would pass the budget (see the module's docs).
pub(super) fn budget_free(d: &DeviceStream, settings: &Settings) -> bool {
    !settings.expandable_segments
        && settings.collects_garbage().is_none()
        && !d.releases.values().any(|r| *r == Release::Unknown)
}

/// States of a replay with no budget, each with the most it had reserved
/// so far. Empty when the replay's settings are not [`budget_free`].
#[derive(Clone, Default)]
pub struct Checkpoints {
    taken: Vec<(u64, State)>,
}

impl Checkpoints {
    /// The most reserved before each checkpoint.
    #[cfg(test)]
    pub(super) fn most(&self) -> Vec<u64> {
        self.taken.iter().map(|(m, _)| *m).collect()
    }

    /// The latest state a replay under `budget` reaches too.
    fn for_budget(&self, budget: u64) -> Option<&State> {
        self.taken.iter().rev().find(|(most, _)| *most <= budget).map(|(_, s)| s)
    }
}

/// Where the model's new segments go: the address the recording's n-th
/// segment got, where it overlaps nothing handed out before; else a fresh
/// address above everything.
#[derive(Clone)]
struct Driver {
    recorded_at: Arc<[(u64, u64)]>,
    /// What the device has handed out and not had back.
    handed: BTreeMap<u64, u64>,
    next: u64,
    nth: usize,
}

impl Driver {
    fn give(&mut self, size: u64) -> u64 {
        let end_free = |at: u64, handed: &BTreeMap<u64, u64>| {
            let end = at.saturating_add(size);
            handed.range(..end).next_back().is_none_or(|(&s, &len)| s.saturating_add(len) <= at)
        };
        let at = match self.recorded_at.get(self.nth) {
            Some(&(at, _)) if end_free(at, &self.handed) => at,
            _ => {
                let at = self.next;
                self.next = self.next.saturating_add(size.div_ceil(1 << 21) << 21);
                at
            }
        };
        self.nth += 1;
        self.handed.insert(at, size);
        at
    }
}

/// The replay's state between two requests.
#[derive(Clone)]
struct State {
    /// The index in the trace (after the initial state) of the next
    /// request.
    at: usize,
    a: Allocator,
    driver: Driver,
    out: Outcome,
    /// Reserved at its peak, and the most allocated while it was there.
    peak: (u64, u64),
    /// Recorded block address → simulated one.
    placed: ahash::AHashMap<u64, u64>,
    classes: BTreeMap<OomClass, u64>,
    sampler: Sampler,
    /// What the recording had reserved, to tell its releases apart.
    rec_reserved: u64,
}

fn event(
    d: &DeviceStream,
    ts_ns: u64,
    kind: EventKind,
    addr: u64,
    size: u64,
    requested: Option<u64>,
    stream: u64,
) -> Event {
    Event {
        ts_ns,
        pid: d.device,
        device: Some(d.device as i32),
        stream: Some(stream),
        extra: crate::trace::event::Extra { requested, ..Default::default() },
        ..Event::new(ts_ns, d.device, kind, addr, size)
    }
}

/// The state before the trace's first request: the recorded initial
/// state, sent to `sink` too.
fn start(
    d: &DeviceStream,
    settings: &Settings,
    budget: Option<u64>,
    name: &str,
    conf: &[String],
    sink: &mut Option<&mut dyn FnMut(Event)>,
) -> State {
    let mut a = Allocator::new(settings.clone());
    initial_state(&mut a, d, budget);
    if let Some(sink) = sink.as_mut() {
        for r in d.requests(0..d.initial) {
            let requested = (r.kind == EventKind::BlockAlloc).then_some(r.requested);
            sink(event(d, r.ts_ns, r.kind, r.addr, r.size, requested, r.stream));
        }
    }
    // The segment changes, always: a segment the model frees gives its
    // addresses back to the driver (below), and a sink gets them.
    a.log = Some(Vec::new());
    // Fresh device addresses above everything the recording used, and
    // above the ranges of its expandable segments.
    let top = d.extent().top.max(a.top());
    let next = top.div_ceil(1 << 30).saturating_add(1) << 30;
    // The driver's choice of address decides best fit's ties between equal
    // free blocks (lowest address first), and a driver hands a process's
    // n-th cudaMalloc much the same address from run to run (ascending,
    // then from below once a region fills). So the n-th new segment takes
    // the address the recording's n-th segment got, where it overlaps none
    // handed out before; else a fresh address above everything.
    let recorded_at: Arc<[(u64, u64)]> =
        if settings.expandable_segments { Arc::new([]) } else { d.extent().segments.clone() };
    // What the device has handed out and not had back (a `cudaFree` gives
    // its range back: the driver hands it out again, as the recording's
    // addresses after an `empty_cache()` show).
    let handed = d
        .requests(0..d.initial)
        .filter(|r| matches!(r.kind, EventKind::SegmentAlloc | EventKind::SegmentMap))
        .map(|r| (r.addr, r.size))
        .collect();
    let mut out = Outcome { name: name.into(), conf: conf.to_vec(), ..Outcome::default() };
    out.peak_allocated_bytes = a.allocated;
    State {
        at: 0,
        peak: (a.reserved, a.allocated),
        driver: Driver { recorded_at, handed, next, nth: 0 },
        out,
        // Initial blocks are where they were.
        placed: d
            .requests(0..d.initial)
            .filter(|r| r.kind == EventKind::BlockAlloc)
            .map(|r| (r.addr, r.addr))
            .collect(),
        classes: BTreeMap::new(),
        sampler: Sampler::new(d.len() - d.initial),
        rec_reserved: d.initial_reserved(),
        a,
    }
}

/// Runs the requests of `d` through the model under `settings` with
/// `budget` bytes for the allocator to reserve (None: no limit); with
/// `stop_at_oom`, only until the first request that fails.
pub(super) fn replay(
    d: &DeviceStream,
    settings: &Settings,
    budget: Option<u64>,
    stop_at_oom: bool,
    name: &str,
    conf: &[String],
    mut sink: Option<&mut dyn FnMut(Event)>,
) -> Outcome {
    let state = start(d, settings, budget, name, conf, &mut sink);
    run(d, state, budget, stop_at_oom, sink, None)
}

/// [`replay`] with no budget, keeping [`Checkpoints`] where the settings
/// allow them.
pub(super) fn replay_keeping(
    d: &DeviceStream,
    settings: &Settings,
    name: &str,
    conf: &[String],
) -> (Outcome, Checkpoints) {
    let mut kept = Checkpoints::default();
    let state = start(d, settings, None, name, conf, &mut None);
    let keep = budget_free(d, settings).then_some(&mut kept);
    (run(d, state, None, false, None, keep), kept)
}

/// [`replay`] under `budget` until the first request that fails, from the
/// latest of `from`'s checkpoints it reaches too (from the start when
/// none).
pub(super) fn replay_from(d: &DeviceStream, settings: &Settings, budget: u64, from: &Checkpoints) -> Outcome {
    match from.for_budget(budget) {
        Some(state) => run(d, state.clone(), Some(budget), true, None, None),
        None => replay(d, settings, Some(budget), true, "needed", &[], None),
    }
}

/// The replay from `state` on.
fn run(
    d: &DeviceStream,
    mut state: State,
    capacity: Option<u64>,
    stop_at_oom: bool,
    mut sink: Option<&mut dyn FnMut(Event)>,
    mut keep: Option<&mut Checkpoints>,
) -> Outcome {
    let len = d.len() - d.initial;
    let every = len.div_ceil(CHECKPOINTS).max(1);
    // This request's own event, sent after the segment changes it caused.
    let mut pending: Vec<Event> = Vec::new();
    let logging = sink.is_some();
    while let Some(r) = d.get(d.initial + state.at) {
        let i = state.at;
        if let Some(kept) = keep.as_mut()
            && i > 0
            && i % every == 0
        {
            // A later state reached by as little reserved memory serves
            // every budget the earlier one did.
            if kept.taken.last().is_some_and(|(most, _)| *most == state.peak.0) {
                kept.taken.pop();
            }
            kept.taken.push((state.peak.0, state.clone()));
        }
        let State { a, driver, out, peak, placed, classes, sampler, rec_reserved, .. } = &mut state;
        match r.kind {
            EventKind::SegmentAlloc | EventKind::SegmentMap => *rec_reserved += r.size,
            EventKind::SegmentFree | EventKind::SegmentUnmap => *rec_reserved = rec_reserved.saturating_sub(r.size),
            _ => {}
        }
        match r.kind {
            // The end of a run of `segment_free`s that the program's
            // `empty_cache()` made, which every scenario replays at the same
            // point. The allocator's own release before a retry comes only
            // when the device is full: an `oom` follows, or a new segment
            // that would not have fit beside what was reserved before the
            // run.
            // (With expandable segments the release is a run of
            // `segment_unmap`s, and the new memory a `segment_map`.)
            EventKind::SegmentFree | EventKind::SegmentUnmap
                if d.get(d.initial + i + 1).is_none_or(|n| !is_release(n.kind)) =>
            {
                // The allocator's own releases are never replayed: the
                // model releases when its own budget is reached. Where
                // the trace cannot tell who released, the release was the
                // allocator's if the budget could not have held the next
                // segment beside what was reserved before it.
                let allocators = match d.releases.get(&(d.initial + i)) {
                    Some(Release::Program) => false,
                    Some(r) if r.by_allocator() => true,
                    _ => {
                        let run: u64 = d
                            .requests(d.initial..d.initial + i + 1)
                            .rev()
                            .take_while(|n| is_release(n.kind))
                            .map(|n| n.size)
                            .sum();
                        let before = *rec_reserved + run;
                        match d.requests(d.initial + i + 1..d.len()).find(|n| !is_release(n.kind)) {
                            Some(n) if n.kind == EventKind::Oom => true,
                            Some(n) if matches!(n.kind, EventKind::SegmentAlloc | EventKind::SegmentMap) => {
                                capacity.is_some_and(|c| before + n.size > c)
                            }
                            _ => false,
                        }
                    }
                };
                if !allocators {
                    a.release_cache();
                }
            }
            // A request the recording served, or one that failed there
            // (an `oom` entry): the scenario may serve either.
            EventKind::BlockAlloc | EventKind::Oom => {
                match a.malloc(r.requested, r.stream, capacity, &mut |size| driver.give(size)) {
                    Ok(p) => {
                        out.segment_allocs += u64::from(p.new_segment.is_some());
                        out.allocations += 1;
                        if logging {
                            pending.push(event(
                                d,
                                r.ts_ns,
                                EventKind::BlockAlloc,
                                p.addr,
                                p.size,
                                Some(r.requested),
                                r.stream,
                            ));
                        }
                        if r.kind == EventKind::Oom {
                            // It failed in the recording, so nothing tells
                            // how long it would have lived: served, then
                            // freed at once (its segment stays cached). The
                            // instant it is held counts in the peaks: the
                            // memory it took was allocated, not cached.
                            note_peak(peak, &mut out.peak_allocated_bytes, a.reserved, a.allocated);
                            sampler.add(&mut out.series, (r.ts_ns, a.reserved, a.allocated));
                            a.free(p.addr);
                        } else {
                            placed.insert(r.addr, p.addr);
                        }
                    }
                    Err(Refused::OutOfMemory { reserved, .. }) => {
                        out.ooms += 1;
                        if stop_at_oom {
                            out.flushes = a.flushes;
                            return std::mem::take(out);
                        }
                        out.oom_times.push(r.ts_ns);
                        if logging {
                            pending.push(event(
                                d,
                                r.ts_ns,
                                EventKind::Oom,
                                0,
                                r.requested,
                                Some(r.requested),
                                r.stream,
                            ));
                        }
                        let cap = capacity.unwrap_or(u64::MAX);
                        let rounded = a.settings.round(r.requested);
                        let free = cap.saturating_sub(a.allocated);
                        let largest = a.largest_free().max(cap.saturating_sub(reserved));
                        *classes.entry(OomClass::of(rounded, Some(free), Some(largest))).or_default() += 1;
                        placed.remove(&r.addr);
                    }
                }
            }
            EventKind::BlockFree => {
                if let Some(at) = placed.remove(&r.addr)
                    && let Some(size) = a.free(at)
                    && logging
                {
                    pending.push(event(d, r.ts_ns, EventKind::BlockFree, at, size, Some(r.requested), r.stream));
                }
            }
            _ => {}
        }
        let log = a.take_log();
        for &(kind, addr, _) in &log {
            if kind == EventKind::SegmentFree {
                driver.handed.remove(&addr);
            }
        }
        if let Some(sink) = sink.as_mut() {
            for (kind, addr, size) in log {
                sink(event(d, r.ts_ns, kind, addr, size, None, r.stream));
            }
            for e in pending.drain(..) {
                sink(e);
            }
        }
        // While reserved stays at its peak, the most allocated: the bytes
        // held beyond the need when memory was fullest (the first instant
        // of the peak can be long before the demand that keeps it).
        note_peak(peak, &mut out.peak_allocated_bytes, a.reserved, a.allocated);
        sampler.add(&mut out.series, (r.ts_ns, a.reserved, a.allocated));
        state.at += 1;
    }
    let State { a, mut out, peak, classes, mut sampler, .. } = state;
    sampler.finish(&mut out.series);
    out.peak_reserved_bytes = peak.0;
    out.reserved_minus_allocated_at_peak = peak.0 - peak.1;
    out.flushes = a.flushes;
    let mut classes: Vec<(OomClass, u64)> = classes.into_iter().collect();
    classes.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    out.oom_classes = classes.into_iter().map(|(c, n)| (c.name().to_string(), n)).collect();
    out
}
