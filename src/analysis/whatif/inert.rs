//! Scenarios that replay alike: a `max_split_size_mb` that no block of a
//! device's replay can reach, or a `roundup_power2_divisions` that rounds
//! every request as plain rounding does, changes no decision of the
//! model, so the scenario with it replays exactly as the one without it,
//! and is not replayed twice ([`replay_key`]).
//!
//! Rounding: the model reads `roundup_power2_divisions` only to round a
//! requested size, and rounds only the requests of the stream (the blocks
//! carried in from before the trace keep their recorded sizes). When each
//! of them rounds alike with and without it, every replay is the same.
//! Requests of a power of two, common in real training runs, round alike
//! under `roundup_power2_divisions:4`.
//!
//! The default sweep picks its split thresholds from the large requests'
//! sizes, rounded up to a power of two MiB ([`super::default_sweep`]), so
//! its highest threshold lies at or above the largest request and is
//! usually reached by no block: on every synthetic trace with OOMs of the
//! batch benchmark, that scenario's figures were those of PyTorch's
//! defaults. Its replays (at the budget, at the high end of an interval,
//! and the memory needed's bisection) were a seventh of the what-if's
//! work there.
//!
//! Why a threshold M no block reaches is inert, with plain segments
//! (`expandable_segments` off) and no expandable range carried in from
//! before the trace (the model, [`crate::allocator`]):
//! - Every block lies inside a segment, so it is never larger than its
//!   segment. A segment is carried in from before the trace, or made for
//!   a request (`segment_size` of the rounded request, which is at least
//!   the rounded request). Neither the rounding nor the segment size
//!   depends on M. So when every segment carried in, and the segment
//!   that every request of the stream would get, is below M, every block
//!   and every rounded request of the replay is below M, whatever the
//!   budget and whichever requests are served.
//! - M acts only through blocks or requests at or above it: best fit
//!   skips a free block at or above M for a request below it, and serves
//!   a request at or above M only from a block wasting less than
//!   `max_non_split_rounding`; a block is split only for a request below
//!   M; and a request that finds the device full first releases the
//!   cached segments at or above M (`release_available`), which finds
//!   none, and so goes on to release the whole cache as without M.
//! - Garbage collection, the rounding, the budget and the releases the
//!   trace records do not read M.

use super::stream::DeviceStream;
use crate::allocator::Settings;
use crate::trace::event::EventKind;

/// The settings a scenario replays as on these devices: `settings`
/// without `roundup_power2_divisions` when it rounds no request of any
/// device otherwise than plain rounding does, and without
/// `max_split_size_mb` (and its `max_non_split_rounding_mb`) when no
/// block of any device's replay can reach the threshold. Two scenarios
/// whose keys are equal replay alike, request for request, at every
/// budget.
pub(super) fn replay_key(devices: &[DeviceStream], settings: &Settings) -> Settings {
    let mut key = settings.clone();
    let plain = Settings { roundup_power2_divisions: Settings::default().roundup_power2_divisions, ..settings.clone() };
    if devices.iter().all(|d| requests(d).all(|r| settings.round(r) == plain.round(r))) {
        key.roundup_power2_divisions = plain.roundup_power2_divisions;
    }
    if let Some(m) = settings.max_split_size
        && devices.iter().all(|d| below_split(d, settings, m))
    {
        (key.max_split_size, key.max_non_split_rounding) = (None, None);
    }
    key
}

/// The requested sizes the replay rounds: every allocation after the
/// state carried in, and every request the recording failed.
fn requests<'a>(d: &'a DeviceStream) -> impl Iterator<Item = u64> + 'a {
    d.requests(d.initial..d.len())
        .filter(|r| matches!(r.kind, EventKind::BlockAlloc | EventKind::Oom))
        .map(|r| r.requested)
}

/// Whether every segment of `d`'s replay under `settings` is below `m`,
/// whatever the budget (see the module's docs).
fn below_split(d: &DeviceStream, settings: &Settings, m: u64) -> bool {
    if settings.expandable_segments {
        return false;
    }
    let carried = d.requests(0..d.initial).all(|r| match r.kind {
        EventKind::SegmentMap | EventKind::SegmentUnmap => false,
        EventKind::SegmentAlloc => r.size < m,
        _ => true,
    });
    carried && requests(d).all(|r| settings.segment_size(settings.round(r)) < m)
}

#[cfg(test)]
mod tests {
    use super::super::stream::{Req, Requests};
    use super::super::{Outcome, Source, needed, run, simulate};
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Allocations of sizes up to `largest`, two in five freed again later,
    /// and a few requests the recording failed (`oom`).
    fn stream(seed: u64, largest: u64) -> DeviceStream<'static> {
        sized(seed, |x| 1 + x % largest)
    }

    /// [`stream`] with the sizes `size` makes of a random number.
    fn sized(seed: u64, size: impl Fn(u64) -> u64) -> DeviceStream<'static> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let (mut events, mut live) = (Vec::new(), Vec::new());
        for i in 0..1500u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let req =
                |kind, addr, size| Req { ts_ns: i, kind, addr, size, requested: size, stream: 0, device_free: None };
            if live.len() > 4 && (x >> 33) % 5 < 2 {
                let at = live.swap_remove(((x >> 20) as usize) % live.len());
                events.push(req(EventKind::BlockFree, at, 0));
            } else {
                let size = size(x >> 24);
                let kind = if (x >> 8).is_multiple_of(97) { EventKind::Oom } else { EventKind::BlockAlloc };
                events.push(req(kind, (i + 1) << 32, size));
                if kind == EventKind::BlockAlloc {
                    live.push((i + 1) << 32);
                }
            }
        }
        DeviceStream { device: 0, initial: 0, requests: Requests::Built(events), ..Default::default() }
    }

    /// An outcome's figures, its name and settings aside.
    fn figures(o: Outcome) -> Outcome {
        Outcome { name: String::new(), conf: Vec::new(), ..o }
    }

    /// A threshold above every segment replays as none at every budget
    /// (through OOMs and cache releases) and needs the same memory; one
    /// that a segment reaches is kept, and on some of these streams it
    /// changes the replay, so the comparison can tell them apart.
    #[test]
    fn a_threshold_no_segment_reaches_replays_as_none() {
        let plain = Settings::default();
        let mut changed = 0;
        for seed in 0..8 {
            let d = stream(seed, [40, 90][seed as usize % 2] * MIB);
            let largest = d.all().map(|r| plain.segment_size(plain.round(r.requested))).max().unwrap_or(0);
            let peak = simulate(&d, &plain, None, "s", &[]).peak_reserved_bytes;
            let budgets = [None, Some(peak / 3), Some(peak / 2), Some(peak * 3 / 4)];
            for m in [largest + 2 * MIB, largest + 1, largest, largest - 2 * MIB, 32 * MIB] {
                let split = Settings { max_split_size: Some(m), ..plain.clone() };
                let key = replay_key(std::slice::from_ref(&d), &split);
                let same = budgets
                    .iter()
                    .all(|&b| figures(simulate(&d, &split, b, "s", &[])) == figures(simulate(&d, &plain, b, "s", &[])));
                if m > largest {
                    assert_eq!(key, plain, "seed {seed}, threshold {m}");
                    assert!(same, "seed {seed}, threshold {m}: replays differ");
                    assert_eq!(needed(&d, &split, None), needed(&d, &plain, None), "seed {seed}");
                } else {
                    assert_eq!(key, split, "seed {seed}, threshold {m}");
                    changed += usize::from(!same);
                }
            }
        }
        assert!(changed > 0, "no threshold a segment reaches changed a replay");
        // Expandable segments, or a recorded expandable range, keep it.
        let d = stream(1, 40 * MIB);
        let expandable = Settings { max_split_size: Some(1 << 40), expandable_segments: true, ..plain.clone() };
        assert_eq!(replay_key(std::slice::from_ref(&d), &expandable), expandable);
        let mut mapped = vec![Req {
            ts_ns: 0,
            kind: EventKind::SegmentMap,
            addr: 1 << 40,
            size: 20 * MIB,
            requested: 0,
            stream: 0,
            device_free: None,
        }];
        mapped.extend(d.all());
        let d = DeviceStream { device: 0, initial: 1, requests: Requests::Built(mapped), ..Default::default() };
        let split = Settings { max_split_size: Some(1 << 40), ..plain.clone() };
        assert_eq!(replay_key(std::slice::from_ref(&d), &split), split);
    }

    /// Requests of a power of two round alike under
    /// `roundup_power2_divisions:4`: the setting replays as none. Sizes
    /// between powers of two round otherwise, and the setting is kept.
    #[test]
    fn a_rounding_that_rounds_every_request_alike_replays_as_none() {
        let plain = Settings::default();
        let mut four = plain.clone();
        four.apply("roundup_power2_divisions:4").unwrap();
        for seed in 0..4 {
            let d = sized(seed, |x| 1 << (16 + x % 11));
            assert_eq!(replay_key(std::slice::from_ref(&d), &four), plain, "seed {seed}");
            let peak = simulate(&d, &plain, None, "s", &[]).peak_reserved_bytes;
            for b in [None, Some(peak / 3), Some(peak * 3 / 4)] {
                assert_eq!(figures(simulate(&d, &four, b, "s", &[])), figures(simulate(&d, &plain, b, "s", &[])));
            }
            let d = sized(seed, |x| (3 << 20) + x % (60 << 20));
            assert_eq!(replay_key(std::slice::from_ref(&d), &four), four, "seed {seed}");
            assert_ne!(figures(simulate(&d, &four, None, "s", &[])), figures(simulate(&d, &plain, None, "s", &[])));
        }
    }

    /// A scenario that replays as the recorded settings takes their
    /// figures under its own name and settings.
    #[test]
    fn a_scenario_replayed_alike_is_named_as_itself() {
        let d = stream(3, 40 * MIB);
        let peak = simulate(&d, &Settings::default(), None, "s", &[]).peak_reserved_bytes;
        let confs = vec![vec!["max_split_size_mb:1024".to_string()], vec!["max_split_size_mb:32".to_string()]];
        let w =
            run(std::slice::from_ref(&d), &Settings::default(), Some(peak / 2), confs, Source::Snapshot, None).unwrap();
        let (recorded, inert, reached) = (&w.scenarios[0], &w.scenarios[1], &w.scenarios[2]);
        assert_eq!(
            (inert.name.as_str(), &inert.conf[..]),
            ("max_split_size_mb:1024", &["max_split_size_mb:1024".to_string()][..])
        );
        assert_eq!(inert.devices[0].name, "max_split_size_mb:1024");
        assert_eq!(inert.devices[0].conf, inert.conf);
        assert_eq!(figures(inert.devices[0].clone()), figures(recorded.devices[0].clone()));
        assert_eq!(inert.needed, recorded.needed);
        assert!(recorded.ooms > 0 || recorded.flushes > 0, "the budget is reached");
        let mut s = Settings::default();
        s.apply("max_split_size_mb:32").unwrap();
        assert_eq!(figures(reached.devices[0].clone()), figures(simulate(&d, &s, Some(peak / 2), "s", &[])));
    }
}
