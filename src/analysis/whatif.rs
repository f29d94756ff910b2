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
//! free matched to its allocation) run through the model alone from the
//! same initial state; new segments get fresh addresses. Without a
//! capacity (`--capacity`) nothing can run out, so OOMs are only counted
//! with one.

use std::collections::HashMap;

use crate::analysis::allocator::{Allocator, Refused, Settings, segment_size};
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
    pub first_mismatches: Vec<Mismatch>,
    /// Why fidelity was not measured, when it was not.
    pub not_measured: Option<String>,
}

const KEPT_MISMATCHES: usize = 10;

fn is_small_segment(size: u64) -> bool {
    size == crate::analysis::allocator::SMALL_BUFFER
}

/// Builds the initial state of a device into `a`; returns how many
/// initial events could not be placed.
fn initial_state(a: &mut Allocator, d: &DeviceStream) -> u64 {
    let mut bad = 0;
    for r in &d.events[..d.initial] {
        match r.kind {
            EventKind::SegmentAlloc | EventKind::SegmentMap => {
                a.add_segment(r.addr, r.size, r.stream, is_small_segment(r.size))
            }
            EventKind::BlockAlloc => bad += u64::from(!a.take_exact(r.addr, r.size)),
            _ => {}
        }
    }
    bad
}

/// Replays a device's recording through the model under `settings` (the
/// snapshot's own), following the recording after each decision.
pub fn fidelity(d: &DeviceStream, settings: &Settings) -> Fidelity {
    let mut f = Fidelity { device: d.device, ..Fidelity::default() };
    if settings.expandable_segments || d.events.iter().any(|r| r.kind == EventKind::SegmentMap) {
        f.not_measured = Some("expandable segments are not modelled yet".into());
        return f;
    }
    let mut a = Allocator::new(settings.clone());
    f.desynchronised += initial_state(&mut a, d);
    f.recorded_peak_reserved = a.reserved;
    f.initial_reserved = a.reserved;
    let mut pending: Vec<Req> = Vec::new();
    for r in &d.events[d.initial..] {
        match r.kind {
            EventKind::SegmentAlloc => pending.push(*r),
            EventKind::SegmentFree => {
                pending.retain(|p| p.addr != r.addr);
                f.desynchronised += u64::from(!a.release_segment(r.addr));
            }
            EventKind::BlockFree => f.desynchronised += u64::from(a.free(r.addr).is_none()),
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
                                probe.add_segment(
                                    seg.addr,
                                    seg.size,
                                    seg.stream,
                                    rounded <= crate::analysis::allocator::SMALL_SIZE,
                                );
                                probe.take(seg.addr, rounded)
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
                for p in pending.drain(..) {
                    a.add_segment(p.addr, p.size, p.stream, is_small_segment(p.size));
                }
                let followed = a.take_exact(r.addr, r.size);
                f.desynchronised += u64::from(!followed);
                f.recorded_peak_reserved = f.recorded_peak_reserved.max(a.reserved);
                let same = model_addr == Some(r.addr);
                f.same_address += u64::from(same);
                f.same_size += u64::from(same && model_size == Some(r.size));
                if !same && f.first_mismatches.len() < KEPT_MISMATCHES {
                    f.first_mismatches.push(Mismatch {
                        allocation: f.allocations,
                        t_ns: r.ts_ns,
                        requested: r.requested,
                        stream: r.stream,
                        recorded_addr: r.addr,
                        recorded_size: r.size,
                        model_addr,
                        why: why.into(),
                    });
                }
                f.allocations += 1;
            }
            _ => {}
        }
    }
    f
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
    /// Reserved minus allocated at the peak of reserved.
    pub reserved_minus_allocated_at_peak: u64,
    pub segment_allocs: u64,
    pub ooms: u64,
    pub oom_classes: Vec<(String, u64)>,
    /// Allocations the recording made that the scenario served.
    pub allocations: u64,
}

/// Runs the requests of `d` through the model under `settings`.
pub fn simulate(d: &DeviceStream, settings: &Settings, capacity: Option<u64>, name: &str, conf: &[String]) -> Outcome {
    let mut a = Allocator::new(settings.clone());
    initial_state(&mut a, d);
    // Fresh device addresses above everything the recording used.
    let top = d.events.iter().map(|r| r.addr.saturating_add(r.size)).max().unwrap_or(0);
    let mut next = top.div_ceil(1 << 30).saturating_add(1) << 30;
    let mut device = |size: u64| {
        let at = next;
        next = next.saturating_add(size.div_ceil(1 << 21) << 21);
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
    for r in &d.events[d.initial..] {
        match r.kind {
            EventKind::BlockAlloc => match a.malloc(r.requested, r.stream, capacity, &mut device) {
                Ok(p) => {
                    placed.insert(r.addr, p.addr);
                    out.segment_allocs += u64::from(p.new_segment.is_some());
                    out.allocations += 1;
                }
                Err(Refused::OutOfMemory { reserved, .. }) => {
                    out.ooms += 1;
                    let cap = capacity.unwrap_or(u64::MAX);
                    let rounded = a.settings.round(r.requested);
                    let free = cap.saturating_sub(a.allocated);
                    let largest = a.largest_free().max(cap.saturating_sub(reserved));
                    *classes.entry(OomClass::of(rounded, Some(free), Some(largest))).or_default() += 1;
                    placed.remove(&r.addr);
                }
            },
            EventKind::BlockFree => {
                if let Some(at) = placed.remove(&r.addr) {
                    a.free(at);
                }
            }
            _ => {}
        }
        if a.reserved > peak.0 {
            peak = (a.reserved, a.allocated);
        }
        out.peak_allocated_bytes = out.peak_allocated_bytes.max(a.allocated);
    }
    out.peak_reserved_bytes = peak.0;
    out.reserved_minus_allocated_at_peak = peak.0 - peak.1;
    let mut classes: Vec<(OomClass, u64)> = classes.into_iter().collect();
    classes.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    out.oom_classes = classes.into_iter().map(|(c, n)| (c.name().to_string(), n)).collect();
    out
}

/// The default sweep: `max_split_size_mb` at up to three values taken from
/// the large requests (their median, 90th percentile and largest, rounded
/// up to a power of two MiB above 20), `roundup_power2_divisions:4`, and
/// with a capacity `garbage_collection_threshold:0.8`.
pub fn default_sweep(d: &[DeviceStream], capacity: Option<u64>) -> Vec<Vec<String>> {
    let mut large: Vec<u64> = d
        .iter()
        .flat_map(|s| s.events.iter())
        .filter(|r| r.kind == EventKind::BlockAlloc && r.requested > crate::analysis::allocator::SMALL_SIZE)
        .map(|r| r.requested)
        .collect();
    large.sort_unstable();
    let mut splits: Vec<u64> = [0.5, 0.9, 1.0]
        .iter()
        .filter_map(|q| large.get(((large.len() as f64 - 1.0) * q).round() as usize).copied())
        .map(|b| b.div_ceil(1 << 20).next_power_of_two().max(32))
        .collect();
    splits.sort_unstable();
    splits.dedup();
    let mut sweep: Vec<Vec<String>> = splits.into_iter().map(|mb| vec![format!("max_split_size_mb:{mb}")]).collect();
    sweep.push(vec!["roundup_power2_divisions:4".into()]);
    if capacity.is_some() {
        sweep.push(vec!["garbage_collection_threshold:0.8".into()]);
    }
    sweep
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn req(kind: EventKind, addr: u64, size: u64, requested: u64) -> Req {
        Req { ts_ns: 0, kind, addr, size, requested, stream: 0 }
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
        let d = DeviceStream { device: 0, initial: 0, events };
        let o = simulate(&d, &Settings::default(), None, "recorded", &[]);
        assert_eq!((o.allocations, o.ooms), (8, 0));
        assert!(o.peak_reserved_bytes >= 50 * MIB && o.peak_allocated_bytes >= 32 * MIB, "{o:?}");
        let tight = simulate(&d, &Settings::default(), Some(40 * MIB), "tight", &[]);
        assert!(tight.ooms > 0 && tight.peak_reserved_bytes <= 40 * MIB, "{tight:?}");
    }
}
