//! `fragscope whatif`: the recorded requests of a PyTorch snapshot replayed
//! through the allocator model ([`crate::analysis::allocator`]) — first
//! against the recording itself (fidelity: does the model put every block
//! where PyTorch did?), then under other `PYTORCH_CUDA_ALLOC_CONF`
//! settings (scenarios).
//!
//! Fidelity. Starting from the reconstructed state before the first trace
//! entry, at each allocation the model says which free block it would take
//! (or that it needs a new segment, of which size); the recorded outcome is
//! then applied, so one wrong decision does not spoil the rest. A segment
//! PyTorch asked for is taken from the recording (the driver chose its
//! address) and its size is checked against the model's.
//!
//! Scenarios. The same requests (requested size, stream, in order; each
//! free matched to its allocation; the requests that failed with an `oom`
//! entry too, freed at once when a scenario serves them, since nothing
//! tells how long they would have lived) run through the model alone from the same initial state; new
//! segments get fresh addresses. The program's own `empty_cache()` calls
//! (a run of `segment_free` entries, unless an `oom` follows or the next
//! segment would not have fit the capacity without it: then it was the
//! allocator's release before a retry) are replayed. Without a capacity (`--capacity`, or one inferred
//! from an `oom` entry) nothing can run out, so OOMs are only counted with
//! one.

use std::collections::{BTreeMap, HashMap};

use crate::analysis::allocator::{Allocator, LARGE_BUFFER, MIN_BLOCK, Refused, SMALL_SIZE, Settings, segment_size};
use crate::analysis::oom::OomClass;
use crate::trace::event::{Event, EventKind};

/// One recorded event of one device, as the model needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Req {
    pub ts_ns: u64,
    pub kind: EventKind,
    pub addr: u64,
    /// Block or segment size.
    pub size: u64,
    pub requested: u64,
    pub stream: u64,
    /// `oom` events: the free device memory CUDA reported.
    pub device_free: Option<u64>,
}

impl Req {
    pub fn of(e: &Event) -> Req {
        Req {
            ts_ns: e.ts_ns,
            kind: e.kind,
            addr: e.addr,
            size: e.size,
            requested: e.extra.requested.unwrap_or(e.size),
            stream: e.stream.unwrap_or(0),
            device_free: e.extra.device_free,
        }
    }
}

/// The events of one device: the reconstructed initial state (its first
/// `initial` events: segments, then live blocks), then the trace.
#[derive(Clone, Debug, Default)]
pub struct DeviceStream {
    pub device: u32,
    pub initial: usize,
    pub events: Vec<Req>,
    /// The times PyTorch released its whole cache because the device was
    /// full, and the capacity they imply.
    pub flushes: Flushes,
}

/// Cache flushes: runs of `segment_free` that PyTorch's allocator made
/// itself (their stack is the allocation's, not `empty_cache`'s) right
/// before the segment it made room for. Each says the device was full:
/// the capacity is below what was reserved then plus that segment, and at
/// least the most that was ever reserved with a new segment that fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Flushes {
    pub count: u64,
    pub segments_freed: u64,
    pub bytes_freed: u64,
    /// The capacity interval [lo, hi] they imply, when consistent.
    pub capacity: Option<(u64, u64)>,
}

/// A decision the model got wrong.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Mismatch {
    /// Index of the allocation among the device's trace allocations.
    pub allocation: u64,
    pub t_ns: u64,
    pub requested: u64,
    pub stream: u64,
    pub recorded_addr: u64,
    pub recorded_size: u64,
    /// None: the model would have asked for a new segment PyTorch did not.
    pub model_addr: Option<u64>,
    pub why: String,
    /// The state before the first trace entry decides it: the memory
    /// involved lies where only the reconstruction says where blocks end
    /// (see [`Fidelity::unknowable_before_trace`]).
    pub before_trace: bool,
}

/// How faithful the model is to one recording.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Fidelity {
    pub device: u32,
    pub allocations: u64,
    pub same_address: u64,
    /// Allocations whose block size (after the split rule) agrees too.
    pub same_size: u64,
    pub segments_requested: u64,
    pub segments_same_size: u64,
    /// Segments PyTorch asked for where the model found a free block, and
    /// the reverse.
    pub segments_only_recorded: u64,
    pub segments_only_model: u64,
    pub recorded_peak_reserved: u64,
    /// Reserved before the first trace entry (the reconstructed state).
    pub initial_reserved: u64,
    /// Events the model could not follow (a recorded block not inside a
    /// free block of the model, a free of a block it does not hold).
    pub desynchronised: u64,
    /// Allocations placed elsewhere than PyTorch placed them where the
    /// memory involved (the recorded block, or the model's choice) lies in
    /// a segment alive before the first trace entry and not yet allocated
    /// by the trace: the boundaries there are the reconstruction's guess (a
    /// ring buffer lost them), so the state before the trace decides.
    pub unknowable_before_trace: u64,
    /// Allocations placed elsewhere for the model's own rules.
    pub model_mismatches: u64,
    pub first_mismatches: Vec<Mismatch>,
    /// Why fidelity was not measured, when it was not.
    pub not_measured: Option<String>,
    /// `oom` entries in the recording, and those where the model would
    /// have run out of memory too.
    pub recorded_ooms: u64,
    pub ooms_same: u64,
    /// The device's capacity, inferred from the first `oom` entry: the
    /// free memory CUDA reported plus what was reserved then.
    pub inferred_capacity: Option<u64>,
}

const KEPT_MISMATCHES: usize = 10;

fn is_small_segment(size: u64) -> bool {
    size == crate::analysis::allocator::SMALL_BUFFER
}

/// Builds the initial state of a device into `a`; returns how many
/// initial events could not be placed.
///
/// A mapped stretch of an expandable segment belongs to the small pool
/// when every block alive in it is a small one (≤ 1 MiB, plus what the
/// split rule leaves on it), or, with none alive, when it is not a whole
/// number of 20 MiB pages. The first stretch of a stream and pool starts
/// its range (what lay below it before the trace is not known).
/// `capacity` sizes the ranges (9/8 of it, as PyTorch reserves).
fn initial_state(a: &mut Allocator, d: &DeviceStream, capacity: Option<u64>) -> u64 {
    let init = &d.events[..d.initial];
    let mut blocks: Vec<(u64, u64)> =
        init.iter().filter(|r| r.kind == EventKind::BlockAlloc).map(|r| (r.addr, r.size)).collect();
    blocks.sort_unstable();
    let mut bad = 0;
    for r in init {
        match r.kind {
            EventKind::SegmentAlloc => {
                bad += u64::from(!a.add_segment(r.addr, r.size, r.stream, is_small_segment(r.size)))
            }
            EventKind::SegmentMap => {
                let from = blocks.partition_point(|b| b.0 < r.addr);
                let to = blocks.partition_point(|b| b.0 < r.addr.saturating_add(r.size));
                let inside = &blocks[from..to];
                let small = if inside.is_empty() {
                    r.size % LARGE_BUFFER != 0
                } else {
                    inside.iter().all(|b| b.1 < SMALL_SIZE + MIN_BLOCK)
                };
                bad += u64::from(!a.map_exact(r.addr, r.size, r.stream, small, capacity));
            }
            EventKind::BlockAlloc => bad += u64::from(!a.take_exact(r.addr, r.size)),
            _ => {}
        }
    }
    a.take_log();
    bad
}

/// Follows the recording's mappings (`segment_map`) in the model, in the
/// pool of the request that asked for them (`small`; when `known` is
/// false, a guess: the pool of the stream's range they fall in comes
/// first). Returns how many could not be followed.
fn follow_maps(a: &mut Allocator, pending: &mut Vec<Req>, small: bool, known: bool, capacity: Option<u64>) -> u64 {
    let mut bad = 0;
    for p in pending.drain(..) {
        let ok = match p.kind {
            EventKind::SegmentMap => {
                let pool = if known { small } else { a.range_pool_at(p.addr, p.stream).unwrap_or(small) };
                a.map_exact(p.addr, p.size, p.stream, pool, capacity)
            }
            _ => a.add_segment(p.addr, p.size, p.stream, is_small_segment(p.size)),
        };
        bad += u64::from(!ok);
    }
    bad
}

/// Memory whose block boundaries only the reconstruction of the state
/// before the first trace entry gives: the segments alive then, less what
/// the trace has since allocated (an allocation reveals its block).
#[derive(Clone, Debug, Default)]
struct Pristine {
    ranges: BTreeMap<u64, u64>,
}

impl Pristine {
    /// The initial segments (or mapped pages) of `d`.
    fn of(d: &DeviceStream) -> Pristine {
        let ranges = d.events[..d.initial]
            .iter()
            .filter(|r| matches!(r.kind, EventKind::SegmentAlloc | EventKind::SegmentMap))
            .map(|r| (r.addr, r.addr.saturating_add(r.size)))
            .collect();
        Pristine { ranges }
    }

    fn overlaps(&self, a: u64, b: u64) -> bool {
        self.ranges.range(..b).next_back().is_some_and(|(_, &end)| end > a)
    }

    /// [a, b) is known from now on.
    fn reveal(&mut self, a: u64, b: u64) {
        let hit: Vec<(u64, u64)> =
            self.ranges.range(..b).rev().take_while(|x| *x.1 > a).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in hit {
            self.ranges.remove(&s);
            if s < a {
                self.ranges.insert(s, a);
            }
            if e > b {
                self.ranges.insert(b, e);
            }
        }
    }
}

/// Replays a device's recording through the model under `settings` (the
/// snapshot's own), following the recording after each decision.
pub fn fidelity(d: &DeviceStream, settings: &Settings) -> Fidelity {
    let mut f = Fidelity { device: d.device, ..Fidelity::default() };
    if settings.expandable_segments {
        return fidelity_expandable(d, settings, f);
    }
    if d.events.iter().any(|r| r.kind == EventKind::SegmentMap) {
        f.not_measured = Some("expandable segments in a recording whose settings say they are off".into());
        return f;
    }
    let mut a = replay_start(&mut f, d, settings, None);
    let mut pristine = Pristine::of(d);
    let mut pending: Vec<Req> = Vec::new();
    for r in &d.events[d.initial..] {
        match r.kind {
            EventKind::SegmentAlloc => pending.push(*r),
            EventKind::SegmentFree => {
                pending.retain(|p| p.addr != r.addr);
                f.desynchronised += u64::from(!a.release_segment(r.addr));
            }
            EventKind::BlockFree => f.desynchronised += u64::from(a.free(r.addr).is_none()),
            EventKind::Oom => {
                f.recorded_ooms += 1;
                if f.inferred_capacity.is_none() {
                    f.inferred_capacity = r.device_free.map(|free| free + a.reserved);
                }
                // Would the model have failed too? No free block, and no
                // room for a new segment (the recording has already
                // released the cache before its `oom` entry).
                let rounded = a.settings.round(r.requested);
                let agrees = a.find_free(rounded, r.stream).is_none()
                    && f.inferred_capacity.is_some_and(|c| a.reserved + segment_size(rounded) > c);
                f.ooms_same += u64::from(agrees);
                if !agrees {
                    keep(&mut f, r, 0, 0, a.find_free(rounded, r.stream), OOM_NOT_IN_MODEL);
                }
            }
            EventKind::BlockAlloc => {
                let rounded = a.settings.round(r.requested);
                let (model_addr, model_size, why) = match a.find_free(rounded, r.stream) {
                    Some(at) => {
                        let size = a.would_take(at, rounded);
                        if !pending.is_empty() {
                            f.segments_only_recorded += 1;
                        }
                        (Some(at), size, "a different free block")
                    }
                    None => match pending.first() {
                        Some(seg) => {
                            let want = segment_size(rounded);
                            f.segments_requested += 1;
                            f.segments_same_size += u64::from(want == seg.size);
                            let size = if want == seg.size {
                                let mut probe = a.clone();
                                probe
                                    .add_segment(seg.addr, seg.size, seg.stream, rounded <= SMALL_SIZE)
                                    .then(|| probe.take(seg.addr, rounded))
                                    .flatten()
                            } else {
                                None
                            };
                            (Some(seg.addr), size, "a new segment of another size")
                        }
                        None => {
                            f.segments_only_model += 1;
                            (None, None, "a new segment, where PyTorch found a free block")
                        }
                    },
                };
                // Follow the recording.
                f.desynchronised += follow_maps(&mut a, &mut pending, rounded <= SMALL_SIZE, true, None);
                follow_block(&mut f, &mut a, &mut pristine, r, model_addr, model_size, why);
            }
            _ => {}
        }
    }
    f
}

/// [`fidelity`] of a recording made with expandable segments. At each
/// allocation the model says which free block it would take, or which
/// pages it would map first (`segment_map`: address and size) and where
/// the block then goes; the recorded mappings and block are then applied.
/// A mapping PyTorch made counts as a segment requested; "same size" means
/// the model maps the same pages.
///
/// The device's capacity, read off the recording's first `oom` entry (see
/// [`inferred_capacity`]), bounds the model from the start: PyTorch
/// mapped within it all along, and it sizes the ranges.
fn fidelity_expandable(d: &DeviceStream, settings: &Settings, mut f: Fidelity) -> Fidelity {
    let capacity = inferred_capacity(d);
    let mut a = replay_start(&mut f, d, settings, capacity);
    let mut pristine = Pristine::of(d);
    let mut pending: Vec<Req> = Vec::new();
    for r in &d.events[d.initial..] {
        let small = a.settings.round(r.requested) <= SMALL_SIZE;
        match r.kind {
            EventKind::SegmentMap | EventKind::SegmentAlloc => pending.push(*r),
            EventKind::SegmentUnmap | EventKind::SegmentFree => {
                // A release (the program's `empty_cache()` or the
                // allocator's before a retry) after mappings of a request
                // that then failed: those come first.
                f.desynchronised += follow_maps(&mut a, &mut pending, small, false, capacity);
                let done = if r.kind == EventKind::SegmentFree {
                    a.release_segment(r.addr)
                } else {
                    a.unmap_exact(r.addr, r.size) == r.size
                };
                f.desynchronised += u64::from(!done);
            }
            EventKind::BlockFree => f.desynchronised += u64::from(a.free(r.addr).is_none()),
            EventKind::Oom => {
                f.desynchronised += follow_maps(&mut a, &mut pending, small, true, capacity);
                f.recorded_ooms += 1;
                f.inferred_capacity = capacity;
                let mut probe = a.clone();
                let mut nowhere = |_| u64::MAX / 2;
                let agrees = capacity.is_some() && probe.malloc(r.requested, r.stream, capacity, &mut nowhere).is_err();
                f.ooms_same += u64::from(agrees);
                if !agrees {
                    keep(&mut f, r, 0, 0, a.find_free(a.settings.round(r.requested), r.stream), OOM_NOT_IN_MODEL);
                }
            }
            EventKind::BlockAlloc => {
                let rounded = a.settings.round(r.requested);
                let (model_addr, model_size, why) = match a.find_free(rounded, r.stream) {
                    Some(at) => {
                        f.segments_only_recorded += u64::from(!pending.is_empty());
                        (Some(at), a.would_take(at, rounded), "a different free block")
                    }
                    None => {
                        // What would the model map? A new range goes where
                        // the recording's first mapping is.
                        let mut probe = a.clone();
                        probe.log = Some(Vec::new());
                        let first = pending.first().map_or(u64::MAX / 2, |p| p.addr);
                        let mut device = |_| first;
                        let recorded: Vec<(u64, u64)> = pending.iter().map(|p| (p.addr, p.size)).collect();
                        f.segments_requested += u64::from(!recorded.is_empty());
                        match probe.malloc(r.requested, r.stream, capacity, &mut device) {
                            Ok(p) => {
                                let maps: Vec<(u64, u64)> = probe
                                    .take_log()
                                    .into_iter()
                                    .filter(|m| m.0 == EventKind::SegmentMap)
                                    .map(|m| (m.1, m.2))
                                    .collect();
                                if recorded.is_empty() {
                                    f.segments_only_model += u64::from(!maps.is_empty());
                                    (Some(p.addr), Some(p.size), "new pages mapped, where PyTorch found a free block")
                                } else {
                                    f.segments_same_size += u64::from(maps == recorded);
                                    let why = if maps == recorded { "a different block" } else { "other pages mapped" };
                                    (Some(p.addr), Some(p.size), why)
                                }
                            }
                            Err(_) => (None, None, "the model ran out of memory here"),
                        }
                    }
                };
                f.desynchronised += follow_maps(&mut a, &mut pending, rounded <= SMALL_SIZE, true, capacity);
                follow_block(&mut f, &mut a, &mut pristine, r, model_addr, model_size, why);
            }
            _ => {}
        }
    }
    f
}

/// The model in the recorded initial state, for a fidelity replay: what
/// could not be placed counts as desynchronised, and the recorded peak
/// starts at what was reserved then.
fn replay_start(f: &mut Fidelity, d: &DeviceStream, settings: &Settings, capacity: Option<u64>) -> Allocator {
    let mut a = Allocator::new(settings.clone());
    f.desynchronised += initial_state(&mut a, d, capacity);
    f.recorded_peak_reserved = a.reserved;
    f.initial_reserved = a.reserved;
    a
}

const OOM_NOT_IN_MODEL: &str = "PyTorch ran out of memory here, the model would not have";

/// Places the recorded block `r` in the model after its prediction
/// (`model_addr`, `model_size`, `why` it differs) and counts the outcome.
fn follow_block(
    f: &mut Fidelity,
    a: &mut Allocator,
    pristine: &mut Pristine,
    r: &Req,
    model_addr: Option<u64>,
    model_size: Option<u64>,
    why: &str,
) {
    f.desynchronised += u64::from(!a.take_exact(r.addr, r.size));
    f.recorded_peak_reserved = f.recorded_peak_reserved.max(a.reserved);
    let same = model_addr == Some(r.addr);
    f.same_address += u64::from(same);
    f.same_size += u64::from(same && model_size == Some(r.size));
    if !same {
        let end = r.addr.saturating_add(r.size);
        let before_trace = pristine.overlaps(r.addr, end)
            || model_addr.is_some_and(|m| pristine.overlaps(m, m.saturating_add(model_size.unwrap_or(r.size))));
        if before_trace {
            f.unknowable_before_trace += 1;
        } else {
            f.model_mismatches += 1;
        }
        keep(f, r, r.addr, r.size, model_addr, why);
        if let Some(m) = f.first_mismatches.last_mut()
            && m.allocation == f.allocations
        {
            m.before_trace = before_trace;
        }
    }
    // The replay follows the recording: the boundary it reveals is known.
    pristine.reveal(r.addr, r.addr.saturating_add(r.size));
    f.allocations += 1;
}

/// Keeps a mismatch at the current allocation, up to [`KEPT_MISMATCHES`].
fn keep(f: &mut Fidelity, r: &Req, recorded_addr: u64, recorded_size: u64, model_addr: Option<u64>, why: &str) {
    if f.first_mismatches.len() < KEPT_MISMATCHES {
        f.first_mismatches.push(Mismatch {
            allocation: f.allocations,
            t_ns: r.ts_ns,
            requested: r.requested,
            stream: r.stream,
            recorded_addr,
            recorded_size,
            model_addr,
            why: why.into(),
            before_trace: false,
        });
    }
}

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
struct Sampler {
    every: usize,
    seen: usize,
    best: Option<(u64, u64, u64)>,
}

impl Sampler {
    fn new(samples: usize) -> Sampler {
        Sampler { every: samples.div_ceil(SERIES_POINTS).max(1), seen: 0, best: None }
    }

    fn add(&mut self, out: &mut Vec<(u64, u64, u64)>, point: (u64, u64, u64)) {
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

    fn finish(&mut self, out: &mut Vec<(u64, u64, u64)>) {
        if let Some(b) = self.best.take() {
            out.push(b);
        }
    }
}

/// The capacity a recording's first `oom` entry implies: the free memory
/// CUDA reported plus what the recording had reserved then.
pub fn inferred_capacity(d: &DeviceStream) -> Option<u64> {
    let mut reserved: u64 = 0;
    for r in &d.events {
        match r.kind {
            EventKind::SegmentAlloc | EventKind::SegmentMap => reserved += r.size,
            EventKind::SegmentFree | EventKind::SegmentUnmap => reserved = reserved.saturating_sub(r.size),
            EventKind::Oom => {
                if let Some(free) = r.device_free {
                    return Some(free + reserved);
                }
            }
            _ => {}
        }
    }
    None
}

/// Whether an event gives memory back to the device.
fn is_release(kind: EventKind) -> bool {
    matches!(kind, EventKind::SegmentFree | EventKind::SegmentUnmap)
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
    mut sink: Option<&mut dyn FnMut(Event)>,
) -> Outcome {
    // Under a per-process memory fraction the allocator sees that much of
    // the device.
    let capacity = settings.limit(capacity);
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
        a.log = Some(Vec::new());
    }
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
    let mut handed: BTreeMap<u64, u64> = d.events[..d.initial]
        .iter()
        .filter(|r| matches!(r.kind, EventKind::SegmentAlloc | EventKind::SegmentMap))
        .map(|r| (r.addr, r.size))
        .collect();
    let mut nth = 0usize;
    let mut device = |size: u64| {
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
    let mut placed: HashMap<u64, u64> =
        d.events[..d.initial].iter().filter(|r| r.kind == EventKind::BlockAlloc).map(|r| (r.addr, r.addr)).collect();
    let mut classes: std::collections::BTreeMap<OomClass, u64> = Default::default();
    let trace = &d.events[d.initial..];
    let mut sampler = Sampler::new(trace.len());
    // What the recording had reserved, to tell its releases apart.
    let mut rec_reserved: u64 = d.events[..d.initial]
        .iter()
        .filter(|r| matches!(r.kind, EventKind::SegmentAlloc | EventKind::SegmentMap))
        .map(|r| r.size)
        .sum();
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
                let run: u64 = trace[..=i].iter().rev().take_while(|n| is_release(n.kind)).map(|n| n.size).sum();
                let before = rec_reserved + run;
                let allocators = match trace[i + 1..].iter().find(|n| !is_release(n.kind)) {
                    Some(n) if n.kind == EventKind::Oom => true,
                    Some(n) if matches!(n.kind, EventKind::SegmentAlloc | EventKind::SegmentMap) => {
                        capacity.is_some_and(|c| before + n.size > c)
                    }
                    _ => false,
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
                        // once (its segment stays cached).
                        a.free(p.addr);
                    } else {
                        placed.insert(r.addr, p.addr);
                    }
                }
                Err(Refused::OutOfMemory { reserved, .. }) => {
                    out.ooms += 1;
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
        if let Some(sink) = sink.as_mut() {
            for (kind, addr, size) in a.take_log() {
                sink(ev(r.ts_ns, kind, addr, size, None, r.stream));
            }
            for e in pending.drain(..) {
                sink(e);
            }
        }
        // While reserved stays at its peak, the most allocated: the bytes
        // held beyond the need when memory was fullest (the first instant
        // of the peak can be long before the demand that keeps it).
        if a.reserved > peak.0 || (a.reserved == peak.0 && a.allocated > peak.1) {
            peak = (a.reserved, a.allocated);
        }
        out.peak_allocated_bytes = out.peak_allocated_bytes.max(a.allocated);
        sampler.add(&mut out.series, (r.ts_ns, a.reserved, a.allocated));
    }
    sampler.finish(&mut out.series);
    out.peak_reserved_bytes = peak.0;
    out.reserved_minus_allocated_at_peak = peak.0 - peak.1;
    let mut classes: Vec<(OomClass, u64)> = classes.into_iter().collect();
    classes.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    out.oom_classes = classes.into_iter().map(|(c, n)| (c.name().to_string(), n)).collect();
    out
}

/// The default sweep: `expandable_segments:True`, `max_split_size_mb` at up to four values taken from
/// the large requests (their 10th percentile, median, 90th percentile and largest, rounded
/// up to a power of two MiB above 20), `roundup_power2_divisions:4`, and
/// with a capacity `garbage_collection_threshold:0.8` under a per-process
/// memory fraction of 0.99 (PyTorch collects garbage only under one below 1).
pub fn default_sweep(d: &[DeviceStream], recorded: &Settings, capacity: Option<u64>) -> Vec<Vec<String>> {
    let mut large: Vec<u64> = d
        .iter()
        .flat_map(|s| s.events.iter())
        .filter(|r| r.kind == EventKind::BlockAlloc && r.requested > crate::analysis::allocator::SMALL_SIZE)
        .map(|r| r.requested)
        .collect();
    large.sort_unstable();
    // A threshold only helps when it lies below the large requests that
    // split cached blocks: from the small end of them (the tenth
    // percentile) to the largest.
    let mut splits: Vec<u64> = [0.1, 0.5, 0.9, 1.0]
        .iter()
        .filter_map(|q| large.get(((large.len() as f64 - 1.0) * q).round() as usize).copied())
        .map(|b| b.div_ceil(1 << 20).next_power_of_two().max(32))
        .collect();
    splits.sort_unstable();
    splits.dedup();
    // A recording made with expandable segments: what plain segments
    // would have done instead.
    let flip = if recorded.expandable_segments { "expandable_segments:False" } else { "expandable_segments:True" };
    let mut sweep: Vec<Vec<String>> = vec![vec![flip.into()]];
    sweep.extend(splits.into_iter().map(|mb| vec![format!("max_split_size_mb:{mb}")]));
    sweep.push(vec!["roundup_power2_divisions:4".into()]);
    // Garbage collection acts only under a per-process memory fraction
    // below 1: tried with one of 0.99 (nearly the whole device), never
    // alone.
    if capacity.is_some() {
        sweep.push(vec!["garbage_collection_threshold:0.8".into(), "per_process_memory_fraction:0.99".into()]);
    }
    sweep
}

/// One scenario over every device: sums of the devices' outcomes (each
/// device has its own memory), and the outcomes.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub conf: Vec<String>,
    pub peak_reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub reserved_minus_allocated_at_peak: u64,
    pub segment_allocs: u64,
    pub ooms: u64,
    pub devices: Vec<Outcome>,
    /// What the reader must know about how it replays (a setting that has
    /// no effect as given).
    pub note: Option<String>,
}

impl Scenario {
    pub fn of(name: &str, conf: &[String], devices: Vec<Outcome>) -> Scenario {
        let sum = |f: fn(&Outcome) -> u64| devices.iter().map(f).sum();
        Scenario {
            name: name.into(),
            conf: conf.to_vec(),
            peak_reserved_bytes: sum(|o| o.peak_reserved_bytes),
            peak_allocated_bytes: sum(|o| o.peak_allocated_bytes),
            reserved_minus_allocated_at_peak: sum(|o| o.reserved_minus_allocated_at_peak),
            segment_allocs: sum(|o| o.segment_allocs),
            ooms: sum(|o| o.ooms),
            devices,
            note: None,
        }
    }
}

/// Why settings replay otherwise than they read, if they do.
fn settings_note(s: &Settings, capacity_known: bool) -> Option<String> {
    if s.garbage_collection_threshold.is_some() && s.collects_garbage().is_none() {
        return Some(
            "`garbage_collection_threshold` acts only under a per-process memory fraction below 1 \
             (`torch.cuda.set_per_process_memory_fraction`): PyTorch collects garbage only then, so it replays as if \
             unset"
                .into(),
        );
    }
    (s.per_process_memory_fraction.is_some() && !capacity_known).then(|| {
        "a per-process memory fraction needs the device's capacity (`--capacity`): without one it limits nothing here"
            .into()
    })
}

/// A lower peak reserved counts only beyond this share of the recorded
/// scenario's (and 2 MiB): smaller differences are noise of the model.
const SIGNIFICANT: f64 = 0.01;

/// The scenario with the fewest OOMs, then the lowest peak reserved; the
/// recorded settings unless another is better by more than noise. Without
/// a capacity no scenario can run out of memory, so a recording's OOMs
/// cannot be compared with them.
fn recommend(scenarios: &[Scenario], capacity_known: bool, unreproduced: Option<&str>) -> (usize, String) {
    let Some(rec) = scenarios.first() else { return (0, "no scenario ran".into()) };
    if !capacity_known && rec.ooms > 0 {
        return (
            0,
            format!(
                "the recording's {} OOM(s) cannot be compared with the scenarios: without a capacity (`--capacity`) no scenario can run out of memory",
                rec.ooms
            ),
        );
    }
    if let Some(why) = unreproduced {
        return (
            0,
            format!(
                "the replay does not reproduce the recorded OOMs ({why}), so it cannot say which setting avoids them"
            ),
        );
    }
    let best = (1..scenarios.len()).min_by_key(|&i| (scenarios[i].ooms, scenarios[i].peak_reserved_bytes));
    let Some(b) = best else { return (0, "no other scenario ran".into()) };
    let s = &scenarios[b];
    if s.ooms < rec.ooms {
        return (
            b,
            format!(
                "{} OOM(s) instead of {}, peak reserved {}",
                s.ooms,
                rec.ooms,
                crate::units::bytes(s.peak_reserved_bytes)
            ),
        );
    }
    let margin = ((rec.peak_reserved_bytes as f64 * SIGNIFICANT) as u64).max(2 << 20);
    let lower = s.ooms == rec.ooms && s.peak_reserved_bytes + margin < rec.peak_reserved_bytes;
    // With OOMs that nothing removes, a setting that only reserves less
    // is a secondary saving, never the recommendation.
    if rec.ooms > 0 {
        return (
            0,
            format!(
                "no scenario has fewer OOMs than the recorded settings' {}{}",
                rec.ooms,
                if lower {
                    format!(
                        "; `{}` reserves {} less at the peak, a secondary saving that does not remove them",
                        s.name,
                        crate::units::bytes(rec.peak_reserved_bytes - s.peak_reserved_bytes)
                    )
                } else {
                    String::new()
                }
            ),
        );
    }
    if lower {
        return (
            b,
            format!(
                "peak reserved {} instead of {} ({} less), same OOMs ({})",
                crate::units::bytes(s.peak_reserved_bytes),
                crate::units::bytes(rec.peak_reserved_bytes),
                crate::units::bytes(rec.peak_reserved_bytes - s.peak_reserved_bytes),
                s.ooms
            ),
        );
    }
    (
        0,
        format!(
            "no scenario has fewer OOMs ({}) or a peak reserved lower by more than 1 % than the recorded settings' {}",
            rec.ooms,
            crate::units::bytes(rec.peak_reserved_bytes)
        ),
    )
}

/// The `PYTORCH_CUDA_ALLOC_CONF` line of a scenario's entries: the
/// recorded settings stay, unless the scenario sets the key.
pub fn conf_line(recorded: &[String], conf: &[String]) -> String {
    if conf.is_empty() {
        return "PyTorch's caching allocator with its default settings".into();
    }
    let key = |e: &String| e.split(':').next().unwrap_or_default().to_string();
    let keys: Vec<String> = conf.iter().map(key).collect();
    let kept = recorded.iter().filter(|e| !keys.contains(&key(e)));
    let line: Vec<&String> = kept.chain(conf).collect();
    // The fraction is a Python call, not an environment entry.
    let fraction = "per_process_memory_fraction";
    let env: Vec<&str> = line.iter().filter(|e| key(e) != fraction).map(|e| e.as_str()).collect();
    let call = line
        .iter()
        .find(|e| key(e) == fraction)
        .and_then(|e| e.split_once(':'))
        .map(|(_, f)| format!("torch.cuda.set_per_process_memory_fraction({})", f.trim()));
    match (env.is_empty(), call) {
        (false, Some(call)) => format!("PYTORCH_CUDA_ALLOC_CONF={} and {call}", env.join(",")),
        (true, Some(call)) => call,
        (_, None) => format!("PYTORCH_CUDA_ALLOC_CONF={}", env.join(",")),
    }
}

/// What `whatif` found for a set of devices: the model's fidelity per
/// device, every scenario (the recorded settings first) and the
/// recommended one (an index into `scenarios`, 0: keep the recorded
/// settings) with why.
#[derive(Clone, Debug)]
pub struct Whatif {
    pub fidelity: Vec<Fidelity>,
    pub scenarios: Vec<Scenario>,
    pub recommended: (usize, String),
    /// The capacity given (`--capacity`), else the one inferred from an
    /// `oom` entry (then `capacity_inferred`).
    pub capacity: Option<u64>,
    pub capacity_inferred: bool,
    pub source: Source,
    /// The recorded settings that differ from PyTorch's defaults, as
    /// `PYTORCH_CUDA_ALLOC_CONF` entries: a recommendation keeps them.
    pub recorded_conf: Vec<String>,
    /// The inferred capacity comes from cache flushes, not an `oom` entry.
    pub capacity_from_flushes: bool,
    /// Each device's cache flushes, where it had any.
    pub flushes: Vec<(u32, Flushes)>,
    /// Why the replay cannot be trusted about the recorded OOMs, when it
    /// cannot: a snapshot's model does not fail where the recording failed,
    /// or a device-level trace's failed requests would have fit by its own
    /// count. No setting is then said to avoid them.
    pub unreproduced: Option<String>,
}

impl Whatif {
    /// Allocations placed where PyTorch placed them, over all devices.
    pub fn same_address(&self) -> (u64, u64) {
        let measured = self.fidelity.iter().filter(|f| f.not_measured.is_none());
        measured.fold((0, 0), |(s, n), f| (s + f.same_address, n + f.allocations))
    }

    /// Recorded events the fidelity replay could not follow, over every
    /// device measured.
    pub fn desynchronised(&self) -> u64 {
        self.fidelity.iter().filter(|f| f.not_measured.is_none()).map(|f| f.desynchronised).sum()
    }

    /// The `PYTORCH_CUDA_ALLOC_CONF` line to use, "keep the current
    /// settings", or, when the recorded settings ran out of memory and no
    /// scenario removes an OOM, that no setting tried helps.
    pub fn recommendation(&self) -> String {
        let (i, _) = &self.recommended;
        if *i == 0 {
            if self.scenarios.first().is_some_and(|s| s.ooms > 0) && self.capacity.is_none() {
                "none: which setting avoids the OOMs cannot be told without a capacity".into()
            } else if self.unreproduced.is_some() {
                "none: the replay does not reproduce the recorded OOMs".into()
            } else if self.scenarios.first().is_some_and(|s| s.ooms > 0) {
                "no allocator setting tried removes the OOMs: change the program".into()
            } else {
                "keep the current settings".into()
            }
        } else {
            conf_line(&self.recorded_conf, &self.scenarios[*i].conf)
        }
    }
}

/// Parses each scenario's `PYTORCH_CUDA_ALLOC_CONF` entries on top of
/// `base`; the error names the bad entry.
pub fn settings_of(base: &Settings, confs: &[Vec<String>]) -> Result<Vec<(Vec<String>, Settings)>, String> {
    confs
        .iter()
        .map(|entries| {
            let mut s = base.clone();
            for e in entries {
                s.apply(e)?;
            }
            Ok((entries.clone(), s))
        })
        .collect()
}

/// What the requests are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A PyTorch snapshot: its caching allocator's decisions, replayable.
    Snapshot,
    /// A device-level trace (eBPF, synthetic): each `cudaMalloc` a request,
    /// no caching allocator in between.
    DeviceLevel,
}

/// Fidelity, then the recorded settings and each scenario (`confs`; the
/// default sweep when empty), run on threads. For a device-level trace the
/// first scenario is the recording as it happened, and the next one
/// PyTorch's caching allocator with its defaults. `unexplained`: for a
/// device-level trace, why its failed requests are not explained by its
/// own count (from the caller's OOM diagnosis), if they are not; a
/// snapshot's are checked here, by the fidelity replay.
pub fn run(
    devices: &[DeviceStream],
    recorded: &Settings,
    capacity: Option<u64>,
    confs: Vec<Vec<String>>,
    source: Source,
    unexplained: Option<String>,
) -> Result<Whatif, String> {
    let mut confs = if confs.is_empty() { default_sweep(devices, recorded, capacity) } else { confs };
    if source == Source::DeviceLevel {
        confs.insert(0, Vec::new());
    }
    let runs = settings_of(recorded, &confs)?;
    let started = std::time::Instant::now();
    // Each device's capacity: the one given, else inferred from its OOM.
    // Each device's capacity: the one given, else inferred from its OOM,
    // else the least its cache flushes allow (the cautious end: a setting
    // said to avoid OOMs must do so on the smallest device the recording
    // is consistent with).
    let capacities: Vec<Option<u64>> = devices
        .iter()
        .map(|d| capacity.or_else(|| inferred_capacity(d)).or_else(|| d.flushes.capacity.map(|c| c.0)))
        .collect();
    let from_flushes =
        capacity.is_none() && devices.iter().any(|d| inferred_capacity(d).is_none() && d.flushes.capacity.is_some());
    let run_all = |name: &str, conf: &[String], s: &Settings| -> Scenario {
        let outcomes = devices.iter().zip(&capacities).map(|(d, &c)| simulate(d, s, c, name, conf)).collect();
        let mut scenario = Scenario::of(name, conf, outcomes);
        scenario.note = settings_note(s, capacities.iter().all(Option::is_some));
        scenario
    };
    // Fidelity, the recorded settings and every scenario at once, on
    // threads: none depends on another.
    fn join<T>(h: std::thread::ScopedJoinHandle<'_, T>) -> T {
        h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
    let (fidelity, scenarios) = std::thread::scope(|scope| {
        let fidelity = scope.spawn(|| match source {
            Source::Snapshot => devices.iter().map(|d| fidelity(d, recorded)).collect::<Vec<Fidelity>>(),
            Source::DeviceLevel => devices.iter().map(device_level_fidelity).collect(),
        });
        let first = scope.spawn(|| match source {
            Source::Snapshot => run_all("recorded", &[], recorded),
            Source::DeviceLevel => Scenario::of("recorded", &[], devices.iter().map(as_recorded).collect()),
        });
        let others: Vec<_> = runs
            .iter()
            .map(|(conf, s)| {
                let run_all = &run_all;
                let name = if conf.is_empty() { "pytorch_defaults".to_string() } else { conf.join(",") };
                scope.spawn(move || run_all(&name, conf, s))
            })
            .collect();
        let mut scenarios = vec![join(first)];
        scenarios.extend(others.into_iter().map(join));
        (join(fidelity), scenarios)
    });
    tracing::debug!("whatif: fidelity and {} scenarios in {:.3} s", scenarios.len(), started.elapsed().as_secs_f64());
    let unreproduced = match source {
        Source::Snapshot => {
            let (same, recorded) = fidelity
                .iter()
                .filter(|f| f.not_measured.is_none())
                .fold((0, 0), |(s, n), f| (s + f.ooms_same, n + f.recorded_ooms));
            (same < recorded).then(|| {
                format!("the model under the recorded settings fails at {same} of the {recorded} recorded OOMs")
            })
        }
        Source::DeviceLevel => unexplained,
    };
    let mut recommended = recommend(&scenarios, capacities.iter().all(Option::is_some), unreproduced.as_deref());
    if source == Source::DeviceLevel && recommended.0 != 0 && scenarios[recommended.0].conf.is_empty() {
        recommended.1 = format!("{} with PyTorch's caching allocator as it comes", recommended.1);
    }
    let capacity_inferred = capacity.is_none() && capacities.iter().any(Option::is_some);
    let capacity = capacity.or_else(|| capacities.iter().flatten().copied().max());
    let recorded_conf = recorded.conf_entries();
    let flushes = devices.iter().map(|d| (d.device, d.flushes)).filter(|x| x.1.count > 0).collect();
    Ok(Whatif {
        fidelity,
        scenarios,
        recommended,
        capacity,
        capacity_inferred,
        capacity_from_flushes: from_flushes,
        flushes,
        source,
        recorded_conf,
        unreproduced,
    })
}

/// A device-level trace has no allocator decisions to check.
fn device_level_fidelity(d: &DeviceStream) -> Fidelity {
    Fidelity {
        device: d.device,
        not_measured: Some(
            "a device-level trace: every cudaMalloc is a request, there are no allocator decisions to check".into(),
        ),
        recorded_ooms: d.events.iter().filter(|r| r.kind == EventKind::Oom).count() as u64,
        ..Fidelity::default()
    }
}

/// A device-level recording as it happened: live bytes are what is
/// reserved (no cache), its failed allocations are its OOMs.
fn as_recorded(d: &DeviceStream) -> Outcome {
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

/// The request stream of each process of a device-level trace (eBPF,
/// synthetic): successful allocations, frees, and failed allocations as
/// requests that ran out of memory.
pub fn device_level_streams(events: &crate::trace::event::Events) -> Vec<DeviceStream> {
    let mut by: std::collections::BTreeMap<u32, DeviceStream> = Default::default();
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        let k = if kind.is_device_alloc() || (kind.is_alloc_request() && events.ret[i] != 0) {
            if events.ret[i] == 0 { EventKind::BlockAlloc } else { EventKind::Oom }
        } else if kind.releases_block() && events.ret[i] == 0 {
            EventKind::BlockFree
        } else {
            continue;
        };
        let pid = events.pid[i];
        let d = by.entry(pid).or_insert_with(|| DeviceStream { device: pid, ..DeviceStream::default() });
        d.events.push(Req {
            ts_ns: events.ts_ns[i],
            kind: k,
            addr: events.addr[i],
            size: events.size[i],
            requested: events.size[i],
            stream: 0,
            device_free: None,
        });
    }
    by.into_values().collect()
}

/// The request stream of each device of an imported snapshot (its time-
/// sorted events), with the reconstructed state before the first trace
/// entry: the first `initial_segments + initial_blocks` events of each
/// device.
pub fn streams(
    events: &crate::trace::event::Events,
    details: &crate::trace::details::SnapshotDetails,
    stacks: Option<&crate::trace::Stacks>,
) -> Vec<DeviceStream> {
    let mut by: std::collections::BTreeMap<u32, DeviceStream> = Default::default();
    for r in &details.reconstruction {
        by.insert(
            r.device,
            DeviceStream {
                device: r.device,
                initial: (r.initial_segments + r.initial_blocks) as usize,
                events: Vec::new(),
                flushes: Flushes::default(),
            },
        );
    }
    if let [only] = details.reconstruction.as_slice()
        && let Some(d) = by.get_mut(&only.device)
    {
        d.events.reserve_exact(events.len());
    }
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        let Some(d) = by.get_mut(&events.pid[i]) else { continue };
        let requested = events.requested.get(i).copied().filter(|&r| r != u64::MAX).unwrap_or(events.size[i]);
        d.events.push(Req {
            ts_ns: events.ts_ns[i],
            kind,
            addr: events.addr[i],
            size: events.size[i],
            requested,
            stream: events.stream.get(i).copied().unwrap_or(0),
            device_free: events.device_free.get(i).copied().filter(|&v| v != u64::MAX),
        });
    }
    // Segment frees made by the allocator, not by empty_cache(): with a
    // stack that has no `empty_cache` frame.
    let by_allocator = |i: usize| {
        let id = events.stack.get(i).copied().unwrap_or(crate::trace::event::NO_STACK);
        id != crate::trace::event::NO_STACK
            && stacks.is_some_and(|st| {
                st.frames_of(id).next().is_some() && !st.frames_of(id).any(|f| f.name == "empty_cache")
            })
    };
    let mut flagged: std::collections::BTreeMap<u32, Vec<bool>> = Default::default();
    for i in 0..events.len() {
        if events.kind[i] == Some(EventKind::SegmentFree) && by.contains_key(&events.pid[i]) {
            flagged.entry(events.pid[i]).or_default().push(by_allocator(i));
        }
    }
    let mut out: Vec<DeviceStream> = by.into_values().collect();
    for d in &mut out {
        d.flushes = find_flushes(d, flagged.get(&d.device).map_or(&[][..], |v| v.as_slice()));
    }
    out
}

/// The cache flushes of a device's stream; `by_allocator[k]`: whether its
/// k-th `segment_free` was made by the allocator (see [`Flushes`]).
fn find_flushes(d: &DeviceStream, by_allocator: &[bool]) -> Flushes {
    let mut f = Flushes::default();
    let mut reserved: u64 = 0;
    let (mut lo, mut hi) = (0u64, u64::MAX);
    let mut nth_free = 0usize;
    let mut run: Option<(u64, u64, u64, bool)> = None; // (reserved before, segments, bytes, by allocator)
    for (i, r) in d.events.iter().enumerate() {
        match r.kind {
            EventKind::SegmentFree => {
                let mine = by_allocator.get(nth_free).copied().unwrap_or(false);
                nth_free += 1;
                let e = run.get_or_insert((reserved, 0, 0, true));
                *e = (e.0, e.1 + 1, e.2 + r.size, e.3 && mine);
                reserved = reserved.saturating_sub(r.size);
            }
            EventKind::SegmentAlloc => {
                if i >= d.initial
                    && let Some((before, segments, bytes, true)) = run
                {
                    f.count += 1;
                    f.segments_freed += segments;
                    f.bytes_freed += bytes;
                    hi = hi.min((before + r.size).saturating_sub(1));
                }
                run = None;
                reserved += r.size;
                lo = lo.max(reserved);
            }
            EventKind::SegmentMap => {
                run = None;
                reserved += r.size;
                lo = lo.max(reserved);
            }
            EventKind::SegmentUnmap => reserved = reserved.saturating_sub(r.size),
            _ => run = None,
        }
    }
    f.capacity = (f.count > 0 && lo <= hi).then_some((lo, hi));
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn req(kind: EventKind, addr: u64, size: u64, requested: u64) -> Req {
        Req { ts_ns: 0, kind, addr, size, requested, stream: 0, device_free: None }
    }

    /// Ten 30 MiB blocks freed into the cache, then ten of 50 MiB, which
    /// cannot reuse them: garbage collection releases the cached ones, but
    /// only under a per-process memory fraction, as in PyTorch.
    #[test]
    fn garbage_collection_acts_only_under_a_memory_fraction() {
        let mut events = Vec::new();
        for i in 0..10 {
            events.push(req(EventKind::BlockAlloc, (i + 1) << 32, 30 * MIB, 30 * MIB));
        }
        for i in 0..10 {
            events.push(req(EventKind::BlockFree, (i + 1) << 32, 30 * MIB, 30 * MIB));
        }
        for i in 0..10 {
            events.push(req(EventKind::BlockAlloc, (i + 20) << 32, 50 * MIB, 50 * MIB));
        }
        let d = DeviceStream { device: 0, initial: 0, events, ..Default::default() };
        let peak = |entries: &[&str]| {
            let mut s = Settings::default();
            for e in entries {
                s.apply(e).unwrap();
            }
            simulate(&d, &s, Some(1 << 30), "s", &[]).peak_reserved_bytes
        };
        let plain = peak(&[]);
        assert_eq!(plain, 800 * MIB);
        assert_eq!(peak(&["garbage_collection_threshold:0.3"]), plain);
        // A fraction of 1 sets no limit, and no collection (PyTorch 2.11).
        assert_eq!(peak(&["garbage_collection_threshold:0.3", "per_process_memory_fraction:1.0"]), plain);
        let collected = peak(&["garbage_collection_threshold:0.3", "per_process_memory_fraction:0.99"]);
        assert!(collected < plain, "{collected}");
        // A fraction alone is a smaller device: 0.45 GiB, where the 500 MiB
        // of the second ten does not fit even with the cache released.
        let mut s = Settings::default();
        s.apply("per_process_memory_fraction:0.45").unwrap();
        assert!(simulate(&d, &s, Some(1 << 30), "s", &[]).ooms > 0);
        s.apply("per_process_memory_fraction:0.5").unwrap();
        assert_eq!(simulate(&d, &s, Some(1 << 30), "s", &[]).ooms, 0);
        let note = settings_note(
            &{
                let mut s = Settings::default();
                s.apply("garbage_collection_threshold:0.3").unwrap();
                s
            },
            true,
        );
        assert!(note.is_some_and(|n| n.contains("only under a per-process memory fraction")));
    }

    #[test]
    fn pristine_memory_shrinks_as_the_trace_allocates_in_it() {
        let mut p = Pristine { ranges: [(100, 200), (300, 400)].into_iter().collect() };
        assert!(p.overlaps(150, 160) && p.overlaps(50, 101) && !p.overlaps(200, 300));
        p.reveal(120, 130);
        assert_eq!(
            p.ranges.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
            vec![(100, 120), (130, 200), (300, 400)]
        );
        assert!(!p.overlaps(120, 130));
        p.reveal(150, 350);
        assert_eq!(
            p.ranges.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
            vec![(100, 120), (130, 150), (350, 400)]
        );
    }

    /// Twenty cached segments released by the allocator right before the
    /// 90 MiB one it needed room for: the device was full then. The
    /// program's own empty_cache() says nothing about the capacity.
    #[test]
    fn cache_flushes_bound_the_capacity() {
        let mut events = Vec::new();
        for i in 0..20 {
            events.push(req(EventKind::SegmentAlloc, (i + 1) << 32, 26 * MIB, 0));
        }
        for i in 0..20 {
            events.push(req(EventKind::SegmentFree, (i + 1) << 32, 26 * MIB, 0));
        }
        events.push(req(EventKind::SegmentAlloc, 40 << 32, 90 * MIB, 0));
        events.push(req(EventKind::BlockAlloc, 40 << 32, 90 * MIB, 90 * MIB));
        let d = DeviceStream { device: 0, initial: 0, events, ..Default::default() };
        let f = find_flushes(&d, &[true; 20]);
        assert_eq!((f.count, f.segments_freed, f.bytes_freed), (1, 20, 520 * MIB));
        assert_eq!(f.capacity, Some((520 * MIB, 610 * MIB - 1)));
        let program = find_flushes(&d, &[false; 20]);
        assert_eq!((program.count, program.capacity), (0, None));
    }

    #[test]
    fn a_fraction_is_advised_as_the_python_call_beside_the_environment_line() {
        let conf = ["garbage_collection_threshold:0.8".to_string(), "per_process_memory_fraction:1.0".to_string()];
        assert_eq!(
            conf_line(&["expandable_segments:True".to_string()], &conf),
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8 and torch.cuda.set_per_process_memory_fraction(1.0)"
        );
        assert_eq!(conf_line(&[], &conf[1..]), "torch.cuda.set_per_process_memory_fraction(1.0)");
        let mut s = Settings::default();
        for bad in ["per_process_memory_fraction:0", "per_process_memory_fraction:1.5", "per_process_memory_fraction:x"]
        {
            assert!(s.apply(bad).is_err(), "{bad}");
        }
    }

    /// A recording the model reproduces: a segment, two blocks in it, a
    /// free and a reuse of the hole.
    #[test]
    fn a_faithful_recording_matches_everywhere() {
        let base = 1 << 40;
        let d = DeviceStream {
            device: 0,
            initial: 0,
            events: vec![
                req(EventKind::SegmentAlloc, base, 20 * MIB, 0),
                req(EventKind::BlockAlloc, base, 4 * MIB, 4 * MIB),
                req(EventKind::BlockAlloc, base + 4 * MIB, 3 * MIB, 3 * MIB - 100),
                req(EventKind::BlockFree, base, 4 * MIB, 4 * MIB),
                req(EventKind::BlockAlloc, base, 2 * MIB, 2 * MIB),
            ],
            flushes: Flushes::default(),
        };
        let f = fidelity(&d, &Settings::default());
        assert_eq!((f.allocations, f.same_address, f.same_size), (3, 3, 3), "{f:?}");
        assert_eq!((f.segments_requested, f.segments_same_size, f.desynchronised), (1, 1, 0));
        // A block placed elsewhere than the model would is reported.
        let mut other = d.clone();
        other.events[4].addr = base + 7 * MIB;
        let f = fidelity(&other, &Settings::default());
        assert_eq!((f.same_address, f.first_mismatches.len()), (2, 1));
        assert_eq!(f.first_mismatches[0].model_addr, Some(base));
    }

    /// The same with expandable segments: pages mapped in a range, blocks
    /// in them; a wrong mapping and a wrong block are both reported.
    #[test]
    fn an_expandable_recording_is_checked_page_by_page() {
        let base = 1 << 40;
        let mut s = Settings::default();
        s.apply("expandable_segments:True").unwrap();
        let d = DeviceStream {
            device: 0,
            initial: 0,
            events: vec![
                req(EventKind::SegmentMap, base, 20 * MIB, 0),
                req(EventKind::BlockAlloc, base, 12 * MIB, 12 * MIB),
                // 12 MiB more: the free 8 MiB at the end and one more page.
                req(EventKind::SegmentMap, base + 20 * MIB, 20 * MIB, 0),
                req(EventKind::BlockAlloc, base + 12 * MIB, 12 * MIB, 12 * MIB),
                // Freed, then the cache released: the whole page inside
                // the free [12, 40) MiB is unmapped.
                req(EventKind::BlockFree, base + 12 * MIB, 12 * MIB, 12 * MIB),
                req(EventKind::SegmentUnmap, base + 20 * MIB, 20 * MIB, 0),
                req(EventKind::BlockAlloc, base + 12 * MIB, 2 * MIB, 2 * MIB),
            ],
            flushes: Flushes::default(),
        };
        let f = fidelity(&d, &s);
        assert!(f.not_measured.is_none(), "{f:?}");
        assert_eq!((f.allocations, f.same_address, f.same_size), (3, 3, 3), "{f:?}");
        assert_eq!((f.segments_requested, f.segments_same_size, f.desynchronised), (2, 2, 0), "{f:?}");
        // PyTorch mapping two pages where the model maps one.
        let mut other = d.clone();
        other.events[2].size = 40 * MIB;
        let f = fidelity(&other, &s);
        assert_eq!((f.segments_requested, f.segments_same_size, f.same_address), (2, 1, 3), "{f:?}");
        // A block placed elsewhere than the model would.
        let mut other = d.clone();
        other.events[6].addr = base + 14 * MIB;
        let f = fidelity(&other, &s);
        assert_eq!((f.same_address, f.first_mismatches.len()), (2, 1), "{f:?}");
        assert_eq!(f.first_mismatches[0].model_addr, Some(base + 12 * MIB));
        // An unmapping of pages that are not free cannot be followed.
        let mut other = d.clone();
        other.events[5].addr = base;
        assert_eq!(fidelity(&other, &s).desynchronised, 1, "a page a live block holds");
        // A corrupt recording: an empty mapping is not followed (and the
        // model's search for room does not hang on it).
        let mut other = d.clone();
        other.events.insert(2, req(EventKind::SegmentMap, base + 20 * MIB, 0, 0));
        let f = fidelity(&other, &s);
        assert!(f.desynchronised >= 1 && f.allocations == 3, "{f:?}");
    }

    /// A scenario's fresh addresses lie above the ranges of the recorded
    /// state: a range that grows far does not meet a new one, and nothing
    /// is released for want of an address.
    #[test]
    fn new_ranges_do_not_collide_with_recorded_ones() {
        let base = 1 << 40;
        let mut s = Settings::default();
        s.apply("expandable_segments:True").unwrap();
        let mut on_stream_1 = req(EventKind::BlockAlloc, base + 4 * MIB, 2 * MIB, 2 * MIB);
        on_stream_1.stream = 1;
        // The recording's addresses end near `base` (its blocks were
        // small); the scenario asks for 3 GiB on stream 0.
        let d = DeviceStream {
            device: 0,
            initial: 1,
            events: vec![
                req(EventKind::SegmentMap, base, 20 * MIB, 0),
                req(EventKind::BlockAlloc, base, 2 * MIB, 3 << 30),
                req(EventKind::BlockFree, base, 2 * MIB, 3 << 30),
                on_stream_1,
            ],
            flushes: Flushes::default(),
        };
        let mut kinds = Vec::new();
        let mut sink = |e: Event| kinds.push(e.kind);
        let o = simulate_into(&d, &s, None, "recorded", &[], Some(&mut sink));
        assert_eq!(o.ooms, 0);
        assert!(!kinds.contains(&EventKind::SegmentUnmap), "{kinds:?}");
        assert_eq!(
            o.peak_reserved_bytes,
            3100 * MIB,
            "3 GiB in 20 MiB pages (the first one recorded), then one page on stream 1"
        );
    }

    #[test]
    fn the_capacity_is_read_off_the_first_oom() {
        let base = 1 << 40;
        let mut oom = req(EventKind::Oom, 0, 0, 30 * MIB);
        oom.device_free = Some(12 * MIB);
        let mut later = oom;
        later.device_free = Some(1);
        let d = DeviceStream {
            device: 0,
            initial: 1,
            events: vec![
                req(EventKind::SegmentAlloc, base, 20 * MIB, 0),
                req(EventKind::SegmentMap, base + 40 * MIB, 40 * MIB, 0),
                req(EventKind::SegmentUnmap, base + 60 * MIB, 20 * MIB, 0),
                oom,
                later,
            ],
            flushes: Flushes::default(),
        };
        // 20 + 40 − 20 MiB reserved, 12 MiB free.
        assert_eq!(inferred_capacity(&d), Some(52 * MIB));
        // What the fidelity replay finds there too.
        assert_eq!(fidelity(&d, &Settings::default()).inferred_capacity, None, "a plain recording with a mapping");
        let plain = DeviceStream { events: vec![d.events[0], d.events[3]], ..d.clone() };
        assert_eq!(fidelity(&plain, &Settings::default()).inferred_capacity, inferred_capacity(&plain));
    }

    #[test]
    fn scenarios_count_segments_peaks_and_ooms() {
        let base = 1 << 40;
        let mut events = Vec::new();
        // Alternating 30 MiB and 1 MiB+ requests, the large ones freed.
        for i in 0..4u64 {
            events.push(req(EventKind::BlockAlloc, base + i * 100 * MIB, 30 * MIB, 30 * MIB));
            events.push(req(EventKind::BlockAlloc, base + i * 100 * MIB + 50 * MIB, 2 * MIB, 2 * MIB));
            events.push(req(EventKind::BlockFree, base + i * 100 * MIB, 30 * MIB, 30 * MIB));
        }
        let d = DeviceStream { device: 0, initial: 0, events, ..Default::default() };
        let o = simulate(&d, &Settings::default(), None, "recorded", &[]);
        assert_eq!((o.allocations, o.ooms), (8, 0));
        assert!(o.peak_reserved_bytes >= 50 * MIB && o.peak_allocated_bytes >= 32 * MIB, "{o:?}");
        let tight = simulate(&d, &Settings::default(), Some(40 * MIB), "tight", &[]);
        assert!(tight.ooms > 0 && tight.peak_reserved_bytes <= 40 * MIB, "{tight:?}");
    }

    #[test]
    fn slack_at_peak_is_taken_where_allocated_is_highest() {
        // 8 MiB opens a 20 MiB segment (12 MiB slack), then 6 MiB fits in
        // it: reserved stays at its peak while the slack falls to 6 MiB.
        let base = 1 << 40;
        let events = vec![
            req(EventKind::BlockAlloc, base, 8 * MIB, 8 * MIB),
            req(EventKind::BlockAlloc, base + 8 * MIB, 6 * MIB, 6 * MIB),
            req(EventKind::BlockFree, base, 8 * MIB, 8 * MIB),
            req(EventKind::BlockFree, base + 8 * MIB, 6 * MIB, 6 * MIB),
        ];
        let d = DeviceStream { device: 0, initial: 0, events, ..Default::default() };
        let o = simulate(&d, &Settings::default(), None, "recorded", &[]);
        assert_eq!((o.peak_reserved_bytes, o.peak_allocated_bytes), (20 * MIB, 14 * MIB));
        assert_eq!(o.reserved_minus_allocated_at_peak, 6 * MIB);
    }
}
