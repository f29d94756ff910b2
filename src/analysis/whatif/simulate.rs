//! A scenario's replay: the requests through the model alone under some
//! settings, from the same initial state, with fresh addresses for new
//! segments ([`simulate`], giving an [`Outcome`]), and a device-level
//! recording as it happened ([`as_recorded`]).

use std::collections::HashMap;

use super::replay::{Checkpoints, Outcome, Sampler, replay, replay_keeping};
use super::stream::DeviceStream;
use crate::allocator::Settings;
use crate::trace::event::{Event, EventKind};

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
    let mut sampler = Sampler::new(d.len());
    for r in d.all() {
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
