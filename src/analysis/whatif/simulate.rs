//! A scenario's replay: the requests through the model alone under some
//! settings, from the same initial state, with fresh addresses for new
//! segments ([`simulate`], [`Outcome`]), and the capacity a stream's own
//! cache flushes imply ([`inferred_capacity`]).

use std::collections::HashMap;

use super::replay::{Checkpoints, replay, replay_keeping};
use super::stream::DeviceStream;
use crate::allocator::Settings;
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

/// Runs the requests of `d` through the model under `settings`.
pub fn simulate(d: &DeviceStream, settings: &Settings, capacity: Option<u64>, name: &str, conf: &[String]) -> Outcome {
    simulate_into(d, settings, capacity, name, conf, None)
}

/// [`simulate`], and where the scenario runs with no budget, the
/// checkpoints the memory needed's replays start from (see
/// [`super::replay`]).
pub(super) fn simulate_keeping(
    d: &DeviceStream,
    settings: &Settings,
    capacity: Option<u64>,
    name: &str,
    conf: &[String],
) -> (Outcome, Option<Checkpoints>) {
    match settings.limit(capacity) {
        Some(_) => (simulate(d, settings, capacity, name, conf), None),
        None => {
            let (o, kept) = replay_keeping(d, settings, name, conf);
            (o, Some(kept))
        }
    }
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
pub(super) fn note_peak(peak: &mut (u64, u64), peak_allocated: &mut u64, reserved: u64, allocated: u64) {
    if reserved > peak.0 || (reserved == peak.0 && allocated > peak.1) {
        *peak = (reserved, allocated);
    }
    *peak_allocated = (*peak_allocated).max(allocated);
}
