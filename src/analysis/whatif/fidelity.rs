//! Fidelity: the recorded requests through the model, the recorded outcome
//! applied after each, so one wrong decision does not spoil the rest; does
//! the model put every block where PyTorch did ([`Fidelity`])?

use std::collections::BTreeMap;

use super::stream::{DeviceStream, Req, inferred_capacity, is_small_segment};
use crate::allocator::{Allocator, LARGE_BUFFER, MIN_BLOCK, SMALL_SIZE, Settings};
use crate::trace::event::EventKind;

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

pub(super) const KEPT_MISMATCHES: usize = 10;

/// Builds the initial state of a device into `a`; returns how many
/// initial events could not be placed.
///
/// A mapped stretch of an expandable segment belongs to the small pool
/// when every block alive in it is a small one (≤ 1 MiB, plus what the
/// split rule leaves on it), or, with none alive, when it is not a whole
/// number of 20 MiB pages. The first stretch of a stream and pool starts
/// its range (what lay below it before the trace is not known).
/// `capacity` sizes the ranges (9/8 of it, as PyTorch reserves).
pub(super) fn initial_state(a: &mut Allocator, d: &DeviceStream, capacity: Option<u64>) -> u64 {
    let init = || d.requests(0..d.initial);
    let mut blocks: Vec<(u64, u64)> =
        init().filter(|r| r.kind == EventKind::BlockAlloc).map(|r| (r.addr, r.size)).collect();
    blocks.sort_unstable();
    let mut bad = 0;
    for r in init() {
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
pub(super) fn follow_maps(
    a: &mut Allocator,
    pending: &mut Vec<Req>,
    small: bool,
    known: bool,
    capacity: Option<u64>,
) -> u64 {
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
pub(super) struct Pristine {
    pub(super) ranges: BTreeMap<u64, u64>,
}

impl Pristine {
    /// The initial segments (or mapped pages) of `d`.
    pub(super) fn of(d: &DeviceStream) -> Pristine {
        let ranges = d
            .requests(0..d.initial)
            .filter(|r| matches!(r.kind, EventKind::SegmentAlloc | EventKind::SegmentMap))
            .map(|r| (r.addr, r.addr.saturating_add(r.size)))
            .collect();
        Pristine { ranges }
    }

    pub(super) fn overlaps(&self, a: u64, b: u64) -> bool {
        self.ranges.range(..b).next_back().is_some_and(|(_, &end)| end > a)
    }

    /// [a, b) is known from now on.
    pub(super) fn reveal(&mut self, a: u64, b: u64) {
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
    if d.all().any(|r| r.kind == EventKind::SegmentMap) {
        f.not_measured = Some("expandable segments in a recording whose settings say they are off".into());
        return f;
    }
    let mut a = replay_start(&mut f, d, settings, None);
    let mut pristine = Pristine::of(d);
    let mut pending: Vec<Req> = Vec::new();
    for r in d.requests(d.initial..d.len()) {
        match r.kind {
            EventKind::SegmentAlloc => pending.push(r),
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
                    && f.inferred_capacity.is_some_and(|c| a.reserved + a.settings.segment_size(rounded) > c);
                f.ooms_same += u64::from(agrees);
                if !agrees {
                    keep(&mut f, &r, 0, 0, a.find_free(rounded, r.stream), OOM_NOT_IN_MODEL);
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
                            let want = a.settings.segment_size(rounded);
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
                follow_block(&mut f, &mut a, &mut pristine, &r, model_addr, model_size, why);
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
pub(super) fn fidelity_expandable(d: &DeviceStream, settings: &Settings, mut f: Fidelity) -> Fidelity {
    let capacity = inferred_capacity(d);
    let mut a = replay_start(&mut f, d, settings, capacity);
    let mut pristine = Pristine::of(d);
    let mut pending: Vec<Req> = Vec::new();
    for r in d.requests(d.initial..d.len()) {
        let small = a.settings.round(r.requested) <= SMALL_SIZE;
        match r.kind {
            EventKind::SegmentMap | EventKind::SegmentAlloc => pending.push(r),
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
                    keep(&mut f, &r, 0, 0, a.find_free(a.settings.round(r.requested), r.stream), OOM_NOT_IN_MODEL);
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
                follow_block(&mut f, &mut a, &mut pristine, &r, model_addr, model_size, why);
            }
            _ => {}
        }
    }
    f
}

/// The model in the recorded initial state, for a fidelity replay: what
/// could not be placed counts as desynchronised, and the recorded peak
/// starts at what was reserved then.
pub(super) fn replay_start(
    f: &mut Fidelity,
    d: &DeviceStream,
    settings: &Settings,
    capacity: Option<u64>,
) -> Allocator {
    let mut a = Allocator::new(settings.clone());
    f.desynchronised += initial_state(&mut a, d, capacity);
    f.recorded_peak_reserved = a.reserved;
    f.initial_reserved = a.reserved;
    a
}

pub(super) const OOM_NOT_IN_MODEL: &str = "PyTorch ran out of memory here, the model would not have";

/// Places the recorded block `r` in the model after its prediction
/// (`model_addr`, `model_size`, `why` it differs) and counts the outcome.
pub(super) fn follow_block(
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
pub(super) fn keep(
    f: &mut Fidelity,
    r: &Req,
    recorded_addr: u64,
    recorded_size: u64,
    model_addr: Option<u64>,
    why: &str,
) {
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

/// A device-level trace has no allocator decisions to check.
pub(super) fn device_level_fidelity(d: &DeviceStream) -> Fidelity {
    Fidelity {
        device: d.device,
        not_measured: Some(
            "a device-level trace: every cudaMalloc is a request, there are no allocator decisions to check".into(),
        ),
        recorded_ooms: d.all().filter(|r| r.kind == EventKind::Oom).count() as u64,
        ..Fidelity::default()
    }
}
