//! A scenario's replay: the requests through the model alone under some
//! settings, from the same initial state, with fresh addresses for new
//! segments ([`simulate`], [`Outcome`]), and the capacity a stream's own
//! cache flushes imply ([`inferred_capacity`]).

use std::collections::{BTreeMap, HashMap};

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

/// Runs the requests of `d` through the model under `settings`.
pub fn simulate(d: &DeviceStream, settings: &Settings, capacity: Option<u64>, name: &str, conf: &[String]) -> Outcome {
    simulate_into(d, settings, capacity, name, conf, None)
}

/// [`simulate`], also sending the scenario's events to `sink`: the initial
/// state as recorded, then each request at its recorded time with the
/// simulated address (`block_alloc`, `block_free`; `oom` for a request
/// the scenario cannot serve) after the segment changes it caused.
pub fn simulate_into(
    d: &DeviceStream,
    settings: &Settings,
    capacity: Option<u64>,
    name: &str,
    conf: &[String],
    sink: Option<&mut dyn FnMut(Event)>,
) -> Outcome {
    // Under a per-process memory fraction the allocator sees that much of
    // the device.
    replay(d, settings, settings.limit(capacity), false, name, conf, sink)
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
    let capacity = budget;
    let mut a = Allocator::new(settings.clone());
    initial_state(&mut a, d, capacity);
    let ev = |ts_ns: u64, kind: EventKind, addr: u64, size: u64, requested: Option<u64>, stream: u64| Event {
        ts_ns,
        pid: d.device,
        device: Some(d.device as i32),
        stream: Some(stream),
        extra: crate::trace::event::Extra { requested, ..Default::default() },
        ..Event::new(ts_ns, d.device, kind, addr, size)
    };
    if let Some(sink) = sink.as_mut() {
        for r in &d.events[..d.initial] {
            let requested = (r.kind == EventKind::BlockAlloc).then_some(r.requested);
            sink(ev(r.ts_ns, r.kind, r.addr, r.size, requested, r.stream));
        }
    }
    // The segment changes, always: a segment the model frees gives its
    // addresses back to the driver (below), and a sink gets them.
    a.log = Some(Vec::new());
    // Fresh device addresses above everything the recording used, and
    // above the ranges of its expandable segments.
    let top = d.events.iter().map(|r| r.addr.saturating_add(r.size)).max().unwrap_or(0).max(a.top());
    let mut next = top.div_ceil(1 << 30).saturating_add(1) << 30;
    // The driver's choice of address decides best fit's ties between equal
    // free blocks (lowest address first), and a driver hands a process's
    // n-th cudaMalloc much the same address from run to run (ascending,
    // then from below once a region fills). So the n-th new segment takes
    // the address the recording's n-th segment got, where it overlaps none
    // handed out before; else a fresh address above everything.
    let recorded_at: Vec<(u64, u64)> = if settings.expandable_segments {
        Vec::new()
    } else {
        d.events[d.initial..].iter().filter(|r| r.kind == EventKind::SegmentAlloc).map(|r| (r.addr, r.size)).collect()
    };
    // What the device has handed out and not had back (a `cudaFree` gives
    // its range back: the driver hands it out again, as the recording's
    // addresses after an `empty_cache()` show).
    let handed: std::cell::RefCell<BTreeMap<u64, u64>> = d.events[..d.initial]
        .iter()
        .filter(|r| matches!(r.kind, EventKind::SegmentAlloc | EventKind::SegmentMap))
        .map(|r| (r.addr, r.size))
        .collect::<BTreeMap<u64, u64>>()
        .into();
    let mut nth = 0usize;
    let mut device = |size: u64| {
        let mut handed = handed.borrow_mut();
        let free_at = |at: u64, handed: &BTreeMap<u64, u64>| {
            let end = at.saturating_add(size);
            handed.range(..end).next_back().is_none_or(|(&s, &len)| s.saturating_add(len) <= at)
        };
        let at = match recorded_at.get(nth) {
            Some(&(at, _)) if free_at(at, &handed) => at,
            _ => {
                let at = next;
                next = next.saturating_add(size.div_ceil(1 << 21) << 21);
                at
            }
        };
        nth += 1;
        handed.insert(at, size);
        at
    };
    let mut out = Outcome { name: name.into(), conf: conf.to_vec(), ..Outcome::default() };
    let mut peak = (a.reserved, a.allocated);
    out.peak_allocated_bytes = a.allocated;
    // Recorded block address → simulated one (initial blocks are where
    // they were).
    let mut placed: ahash::AHashMap<u64, u64> =
        d.events[..d.initial].iter().filter(|r| r.kind == EventKind::BlockAlloc).map(|r| (r.addr, r.addr)).collect();
    let mut classes: std::collections::BTreeMap<OomClass, u64> = Default::default();
    let trace = &d.events[d.initial..];
    let mut sampler = Sampler::new(trace.len());
    // What the recording had reserved, to tell its releases apart.
    let mut rec_reserved = d.initial_reserved();
    // This request's own event, sent after the segment changes it caused.
    let mut pending: Vec<Event> = Vec::new();
    let logging = sink.is_some();
    for (i, r) in trace.iter().enumerate() {
        match r.kind {
            EventKind::SegmentAlloc | EventKind::SegmentMap => rec_reserved += r.size,
            EventKind::SegmentFree | EventKind::SegmentUnmap => rec_reserved = rec_reserved.saturating_sub(r.size),
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
                if trace.get(i + 1).is_none_or(|n| !is_release(n.kind)) =>
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
                        let run: u64 =
                            trace[..=i].iter().rev().take_while(|n| is_release(n.kind)).map(|n| n.size).sum();
                        let before = rec_reserved + run;
                        match trace[i + 1..].iter().find(|n| !is_release(n.kind)) {
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
            EventKind::BlockAlloc | EventKind::Oom => match a.malloc(r.requested, r.stream, capacity, &mut device) {
                Ok(p) => {
                    out.segment_allocs += u64::from(p.new_segment.is_some());
                    out.allocations += 1;
                    if logging {
                        pending.push(ev(r.ts_ns, EventKind::BlockAlloc, p.addr, p.size, Some(r.requested), r.stream));
                    }
                    if r.kind == EventKind::Oom {
                        // It failed in the recording, so nothing tells how
                        // long it would have lived: served, then freed at
                        // once (its segment stays cached). The instant it
                        // is held counts in the peaks: the memory it took
                        // was allocated, not cached.
                        note_peak(&mut peak, &mut out.peak_allocated_bytes, a.reserved, a.allocated);
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
                        return out;
                    }
                    out.oom_times.push(r.ts_ns);
                    if logging {
                        pending.push(ev(r.ts_ns, EventKind::Oom, 0, r.requested, Some(r.requested), r.stream));
                    }
                    let cap = capacity.unwrap_or(u64::MAX);
                    let rounded = a.settings.round(r.requested);
                    let free = cap.saturating_sub(a.allocated);
                    let largest = a.largest_free().max(cap.saturating_sub(reserved));
                    *classes.entry(OomClass::of(rounded, Some(free), Some(largest))).or_default() += 1;
                    placed.remove(&r.addr);
                }
            },
            EventKind::BlockFree => {
                if let Some(at) = placed.remove(&r.addr)
                    && let Some(size) = a.free(at)
                    && logging
                {
                    pending.push(ev(r.ts_ns, EventKind::BlockFree, at, size, Some(r.requested), r.stream));
                }
            }
            _ => {}
        }
        let log = a.take_log();
        for &(kind, addr, _) in &log {
            if kind == EventKind::SegmentFree {
                handed.borrow_mut().remove(&addr);
            }
        }
        if let Some(sink) = sink.as_mut() {
            for (kind, addr, size) in log {
                sink(ev(r.ts_ns, kind, addr, size, None, r.stream));
            }
            for e in pending.drain(..) {
                sink(e);
            }
        }
        // While reserved stays at its peak, the most allocated: the bytes
        // held beyond the need when memory was fullest (the first instant
        // of the peak can be long before the demand that keeps it).
        note_peak(&mut peak, &mut out.peak_allocated_bytes, a.reserved, a.allocated);
        sampler.add(&mut out.series, (r.ts_ns, a.reserved, a.allocated));
    }
    sampler.finish(&mut out.series);
    out.peak_reserved_bytes = peak.0;
    out.reserved_minus_allocated_at_peak = peak.0 - peak.1;
    out.flushes = a.flushes;
    let mut classes: Vec<(OomClass, u64)> = classes.into_iter().collect();
    classes.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    out.oom_classes = classes.into_iter().map(|(c, n)| (c.name().to_string(), n)).collect();
    out
}

/// A device-level recording as it happened: live bytes are what is
/// reserved (no cache), its failed allocations are its OOMs.
pub(super) fn as_recorded(d: &DeviceStream) -> Outcome {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let (mut now, mut peak) = (0u64, 0u64);
    let mut out = Outcome { name: "recorded".into(), ..Outcome::default() };
    let mut sampler = Sampler::new(d.events.len());
    for r in &d.events {
        match r.kind {
            EventKind::BlockAlloc => {
                now += r.size;
                if let Some(old) = live.insert(r.addr, r.size) {
                    now -= old;
                }
                peak = peak.max(now);
                out.allocations += 1;
                out.segment_allocs += 1;
            }
            EventKind::BlockFree => now -= live.remove(&r.addr).unwrap_or(0),
            EventKind::Oom => {
                out.ooms += 1;
                out.oom_times.push(r.ts_ns);
            }
            _ => {}
        }
        sampler.add(&mut out.series, (r.ts_ns, now, now));
    }
    sampler.finish(&mut out.series);
    out.peak_reserved_bytes = peak;
    out.peak_allocated_bytes = peak;
    if out.ooms > 0 {
        out.oom_classes = vec![("recorded failures".into(), out.ooms)];
    }
    out
}

/// Keeps the peak of reserved memory and, while reserved stays at its
/// peak, the most allocated (`peak`), and the peak of allocated memory.
fn note_peak(peak: &mut (u64, u64), peak_allocated: &mut u64, reserved: u64, allocated: u64) {
    if reserved > peak.0 || (reserved == peak.0 && allocated > peak.1) {
        *peak = (reserved, allocated);
    }
    *peak_allocated = (*peak_allocated).max(allocated);
}
