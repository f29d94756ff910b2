//! The memory a device's requests need under some settings: the replay
//! turned around. Instead of "what happens within this budget", the
//! smallest budget under which nothing fails ([`Needed::fits_from_bytes`],
//! by bisection over the budget) and the smallest under which the
//! allocator never releases its cache ([`Needed::no_flush_from_bytes`],
//! the peak reserved of a replay with no budget).
//!
//! The budget is what PyTorch's allocator may reserve on the device: the
//! memory CUDA had free for the process when it started plus what it
//! reserves itself, or `per_process_memory_fraction` × the device's total
//! when the program set one. The figures hold for the recorded requests
//! only: they leave out the CUDA context, other libraries' allocations
//! (cuBLAS workspaces) and other processes, which take their share of the
//! same device.
//!
//! Every segment and page the allocator reserves is a multiple of 2 MiB,
//! so a budget behaves as the multiple of 2 MiB below it: the bisection
//! runs over those multiples, and `fits_from_bytes` is exact to
//! [`GRAIN`] (a budget `GRAIN` below it is replayed and fails).

use super::simulate::replay;
use super::stream::DeviceStream;
use crate::allocator::Settings;
use crate::trace::event::EventKind;

/// The bisection's step: every segment size is a multiple of it.
pub const GRAIN: u64 = 2 << 20;

/// What one device's requests need under one setting.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Needed {
    /// The smallest budget (a multiple of [`GRAIN`]) under which the
    /// replay raises no OOM; None when none up to the unbounded peak does
    /// (a setting whose replay is not monotone in the budget).
    pub fits_from_bytes: Option<u64>,
    /// Cache releases (each a device synchronisation) at that budget.
    pub flushes_at_fits_from: u64,
    /// The smallest budget under which it never releases its cache: the
    /// peak reserved with no budget at all.
    pub no_flush_from_bytes: u64,
    /// `fits_from_bytes` is at most this far above the true smallest
    /// budget (the replay at `fits_from_bytes - precision_bytes` failed).
    pub precision_bytes: u64,
    /// Peak allocated with no budget.
    pub peak_allocated_bytes: u64,
    /// The replays the bisection ran.
    pub replays: u32,
}

/// The memory `d`'s requests need under `settings`. Garbage collection,
/// when the settings collect, acts at its threshold of each budget tried.
pub fn needed(d: &DeviceStream, settings: &Settings) -> Needed {
    // What the state before the trace's first entry reserved is held in
    // every replay: no budget below it.
    let carried: u64 = d.events[..d.initial]
        .iter()
        .filter(|r| matches!(r.kind, EventKind::SegmentAlloc | EventKind::SegmentMap))
        .map(|r| r.size)
        .sum();
    let floor = carried.div_ceil(GRAIN) * GRAIN;
    let mut replays = 1;
    let free = replay(d, settings, None, false, "needed", &[], None);
    let no_flush = free.peak_reserved_bytes;
    // Whether a budget serves every request, and with how many releases.
    let mut runs = |budget: u64| {
        replays += 1;
        let o = replay(d, settings, Some(budget), true, "needed", &[], None);
        (o.ooms == 0, o.flushes)
    };
    let mut hi = no_flush.div_ceil(GRAIN) * GRAIN;
    let mut at_hi = runs(hi);
    // Garbage collection can make a replay fail at a budget that a replay
    // without a budget never reached: look a little higher.
    let mut tries = 0;
    while !at_hi.0 && tries < 8 {
        hi += hi / 8 + GRAIN;
        at_hi = runs(hi);
        tries += 1;
    }
    if !at_hi.0 {
        return Needed {
            fits_from_bytes: None,
            flushes_at_fits_from: 0,
            no_flush_from_bytes: no_flush,
            precision_bytes: GRAIN,
            peak_allocated_bytes: free.peak_allocated_bytes,
            replays,
        };
    }
    // Allocated memory never exceeds what is reserved, so a budget below
    // the peak allocated fails: start just under it.
    let mut lo = ((free.peak_allocated_bytes / GRAIN).saturating_sub(1) * GRAIN).max(floor);
    if lo >= hi || runs(lo).0 {
        // Below the carried-in state nothing can be held: fails unrun.
        lo = floor.saturating_sub(GRAIN);
    }
    // Invariant: `lo` fails (or is 0), `hi` fits with `at_hi.1` releases.
    while hi - lo > GRAIN {
        let mid = lo + (hi - lo) / GRAIN / 2 * GRAIN;
        let got = runs(mid);
        if got.0 {
            hi = mid;
            at_hi = got;
        } else {
            lo = mid;
        }
    }
    Needed {
        fits_from_bytes: Some(hi),
        flushes_at_fits_from: at_hi.1,
        no_flush_from_bytes: no_flush,
        precision_bytes: GRAIN,
        peak_allocated_bytes: free.peak_allocated_bytes,
        replays,
    }
}
