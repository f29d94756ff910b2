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
//! runs over those multiples until the interval is 0.4 % of the
//! no-release budget (never below 2 MiB). `precision_bytes` is that
//! interval: a replay at `fits_from_bytes` fits, and one at
//! `fits_from_bytes - precision_bytes` fails (or could not hold the state
//! carried in from before the trace).

use std::sync::atomic::{AtomicU32, Ordering};

use super::replay::{Checkpoints, Outcome, budget_free, replay_from, replay_keeping};
use super::stream::DeviceStream;
use crate::allocator::Settings;

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
    /// budget (the replay at `fits_from_bytes - precision_bytes` failed,
    /// or held less than the state carried in).
    pub precision_bytes: u64,
    /// Peak allocated with no budget.
    pub peak_allocated_bytes: u64,
    /// The replays the bisection ran.
    pub replays: u32,
}

/// The bisection stops when the interval is this share of the no-release
/// budget or less (and never below [`GRAIN`]): 0.4 %, finer than any
/// figure a budget is chosen by, at several replays fewer than 2 MiB.
const PRECISION_SHARE: u64 = 256;

/// The memory `d`'s requests need under `settings`. Garbage collection,
/// when the settings collect, acts at its threshold of each budget tried.
/// `unbounded`: the replay with no budget and its checkpoints, when the
/// caller ran it already.
pub fn needed(d: &DeviceStream, settings: &Settings, unbounded: Option<(&Outcome, &Checkpoints)>) -> Needed {
    // What the state before the trace's first entry reserved is held in
    // every replay: no budget below it.
    let floor = d.initial_reserved().div_ceil(GRAIN) * GRAIN;
    let replays = AtomicU32::new(0);
    let ran;
    let (o, kept) = match unbounded {
        Some(u) => u,
        None => {
            replays.fetch_add(1, Ordering::Relaxed);
            ran = replay_keeping(d, settings, "needed", &[]);
            (&ran.0, &ran.1)
        }
    };
    let (no_flush, peak_allocated) = (o.peak_reserved_bytes, o.peak_allocated_bytes);
    let step = (no_flush / PRECISION_SHARE / GRAIN * GRAIN).max(GRAIN);
    // Whether a budget serves every request, and with how many releases.
    let runs = |budget: u64| {
        replays.fetch_add(1, Ordering::Relaxed);
        let started = std::time::Instant::now();
        let o = replay_from(d, settings, budget, kept);
        tracing::trace!(
            "needed: budget {budget}: {} in {:.3} s",
            if o.ooms == 0 { "fits" } else { "fails" },
            started.elapsed().as_secs_f64()
        );
        (o.ooms == 0, o.flushes)
    };
    // The bisection below `hi`, which fits (with `at_hi` releases, when
    // known): the smallest budget found to fit, its releases (None: `hi`'s,
    // not known yet), and the largest known or assumed to fail.
    let search = |mut hi: u64, mut at_hi: Option<u64>| {
        // Allocated memory never exceeds what is reserved, so a budget
        // below the peak allocated fails: start a step under it. That is
        // not checked unless the answer comes down to it (block sizes, and
        // so the peak allocated, can differ a little under a budget); below
        // the carried-in state nothing can be held.
        let mut lo = (peak_allocated.saturating_sub(step) / GRAIN * GRAIN).max(floor.saturating_sub(GRAIN)).min(hi);
        let mut lo_checked = lo < floor;
        loop {
            // Invariant: `hi` fits; `lo` fails once checked.
            while hi - lo > step {
                let mid = lo + (hi - lo) / GRAIN / 2 * GRAIN;
                let got = runs(mid);
                if got.0 {
                    (hi, at_hi) = (mid, Some(got.1));
                } else {
                    (lo, lo_checked) = (mid, true);
                }
            }
            if lo_checked {
                break;
            }
            let got = runs(lo);
            if !got.0 {
                break;
            }
            // It fits lower still: search below, down to the carried-in
            // state.
            (hi, at_hi) = (lo, Some(got.1));
            lo = floor.saturating_sub(GRAIN).min(hi);
            lo_checked = true;
        }
        (hi, at_hi, lo)
    };
    let hi = no_flush.div_ceil(GRAIN) * GRAIN;
    let (hi, at_hi, lo) = if budget_free(d, settings) {
        // A budget no request reaches replays as no budget at all...
        search(hi, Some(0))
    } else {
        // ... unless the budget itself changes a decision: garbage
        // collection acts at a share of it, an expandable range spans a
        // share of it, and a release whose maker the trace cannot tell is
        // judged by it. So `hi` is checked, on a thread beside the search
        // below it, which assumes it fits (a replay that fits runs the
        // whole trace; most of the search's fail early).
        let (at_hi, found) = std::thread::scope(|scope| {
            let at_hi = scope.spawn(|| runs(hi));
            let found = search(hi, None);
            (at_hi.join().unwrap_or_else(|e| std::panic::resume_unwind(e)), found)
        });
        if at_hi.0 {
            (found.0, found.1.or(Some(at_hi.1)), found.2)
        } else {
            // Garbage collection can make a replay fail at a budget that
            // a replay without a budget never reached: look a little
            // higher, and search below the first that fits.
            let (mut hi, mut at_hi) = (hi, at_hi);
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
                    precision_bytes: step,
                    peak_allocated_bytes: peak_allocated,
                    replays: replays.into_inner(),
                };
            }
            search(hi, Some(at_hi.1))
        }
    };
    // Always known here: `hi` was checked, or a lower budget fit.
    let at_hi = at_hi.unwrap_or(0);
    Needed {
        fits_from_bytes: Some(hi),
        flushes_at_fits_from: at_hi,
        no_flush_from_bytes: no_flush,
        precision_bytes: hi - lo,
        peak_allocated_bytes: peak_allocated,
        replays: replays.into_inner(),
    }
}
