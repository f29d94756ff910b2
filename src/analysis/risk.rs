//! OOM risk (SPEC §6.10): the risk of running out of memory, the headline
//! of every report. The predictor's level ([`crate::analysis::predict::Risk`],
//! SPEC §6.8) is the *fragmentation level*: it is high on every cached
//! PyTorch run, because the free blocks a cache keeps on purpose count as
//! gaps, so on its own it says nothing about running out of memory.
//!
//! The OOM risk of a device (each device of a snapshot; for a device-level
//! trace, whose events carry no device yet, the one device its processes
//! share, by their summed live bytes):
//! - `oom` when the trace holds an OOM there;
//! - `unknown` when the capacity C is not known: not given (`--capacity`),
//!   not recorded (`capacity_bytes` in `trace.json`), and not inferred
//!   from an `oom` entry (CUDA's free memory plus what was reserved then)
//!   nor from cache flushes (the least capacity they allow);
//! - otherwise from the headroom C − R (R: peak reserved for snapshots,
//!   peak live for device-level traces), the room for a new request now
//!   (the larger of the largest free range and C − reserved now, since a
//!   request takes one range), the largest request seen, and the trend of R:
//!   - `critical`: R ≥ 95 % of C, or the largest request seen would not
//!     fit in the room now;
//!   - `high`: R ≥ 85 % of C, or a headroom of less than twice the largest
//!     request, or R rising at a rate that fills the headroom within as
//!     many steps again as the trace has had (the trend of the last 20);
//!   - `medium`: R ≥ 70 % of C;
//!   - `low` otherwise: a healthy run using a small share of its GPU is
//!     `low` whatever its fragmentation level.
//!
//!   A fragmentation level of high or critical raises the risk by one
//!   level when R ≥ 70 % of C (scattered free space matters only when room
//!   is short).
//!
//! This file holds the rule; [`crate::analysis::risk_series`] applies it
//! to a trace. The online risk of the backtest applies the same rule at each step with
//! what was known up to that step (peak so far, largest request so far,
//! the online fragmentation level), so the warning lead time before an OOM
//! is measured on this risk.

use serde::Serialize;

use crate::analysis::predict::Risk;

/// The risk of running out of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OomRisk {
    /// No capacity to compare with.
    Unknown,
    Low,
    Medium,
    High,
    Critical,
    /// The trace ran out of memory.
    Oom,
}

impl OomRisk {
    pub const ALL: [OomRisk; 6] =
        [OomRisk::Unknown, OomRisk::Low, OomRisk::Medium, OomRisk::High, OomRisk::Critical, OomRisk::Oom];

    pub fn name(self) -> &'static str {
        match self {
            OomRisk::Unknown => "unknown",
            OomRisk::Low => "low",
            OomRisk::Medium => "medium",
            OomRisk::High => "high",
            OomRisk::Critical => "critical",
            OomRisk::Oom => "oom",
        }
    }

    pub fn from_name(name: &str) -> Option<OomRisk> {
        OomRisk::ALL.into_iter().find(|r| r.name() == name)
    }

    fn raised(self) -> OomRisk {
        match self {
            OomRisk::Low => OomRisk::Medium,
            OomRisk::Medium => OomRisk::High,
            OomRisk::High | OomRisk::Critical => OomRisk::Critical,
            other => other,
        }
    }
}

/// Where a capacity comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CapacitySource {
    /// `--capacity`.
    Given,
    /// `capacity_bytes` in `trace.json` (the recorder, or `synth`).
    Recorded,
    /// An `oom` entry (a snapshot's, or a recording's of PyTorch's
    /// allocator): CUDA's free memory plus what was reserved then.
    InferredFromOom,
    /// PyTorch's cache flushes (the device was full): the least capacity
    /// they allow ([`crate::analysis::whatif::Flushes`]).
    InferredFromFlushes,
    /// Garbage collection's releases under `garbage_collection_threshold`:
    /// the least budget they allow ([`crate::analysis::whatif::Flushes::gc_budget`]).
    InferredFromCollection,
}

impl CapacitySource {
    pub fn phrase(self) -> &'static str {
        match self {
            CapacitySource::Given => "given with --capacity",
            CapacitySource::Recorded => "recorded in trace.json",
            CapacitySource::InferredFromOom => {
                "inferred from the `oom` entry: the free memory CUDA reported plus what was reserved then"
            }
            CapacitySource::InferredFromFlushes => {
                "inferred from cache flushes (PyTorch released cached segments because the device was full), which bound it"
            }
            CapacitySource::InferredFromCollection => {
                "inferred from garbage collection's releases (PyTorch collects only above its threshold's share of the \
                 budget), which bound it"
            }
        }
    }
}

/// A device's capacity and where it comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Capacity {
    pub bytes: u64,
    pub source: CapacitySource,
    /// The most it can be, when only an interval is known (cache flushes).
    pub upper: Option<u64>,
}

impl Capacity {
    /// Whether only a least capacity is known (cache flushes): the device
    /// may be larger. Flushes that bound it from both sides to one figure
    /// know it exactly.
    pub fn is_lower_bound(&self) -> bool {
        match self.source {
            CapacitySource::InferredFromFlushes | CapacitySource::InferredFromCollection => {
                self.upper != Some(self.bytes)
            }
            _ => false,
        }
    }
}

/// The state of a device at one step, as the rule reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct State {
    /// R: the peak of reserved (snapshots) or live (device-level) bytes so far.
    pub peak: u64,
    /// Reserved (or live, or the arenas' span) bytes now.
    pub reserved_now: u64,
    /// The largest free range inside what is reserved now.
    pub largest_free_now: u64,
    /// The largest request that succeeded so far.
    pub largest_request: u64,
    /// Slope of R's series over the last steps, bytes per step.
    pub trend_per_step: f64,
    /// Steps so far.
    pub steps: usize,
    pub fragmentation: Option<Risk>,
    /// R is the memory needed to fit (a replay's smallest budget), not a
    /// recorded peak: the reasons say so.
    pub needed: bool,
}

/// The OOM risk of one device, and the figures behind it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Assessment {
    /// The device (snapshots; the GPU of a device-level recording whose
    /// processes were on several), or None: the processes of a
    /// device-level trace together.
    pub device: Option<u32>,
    /// The replay units on this GPU (device-level recordings on several
    /// GPUs); empty otherwise.
    pub members: Option<Vec<u32>>,
    pub level: OomRisk,
    pub capacity: Option<Capacity>,
    /// R, and what it is ("peak reserved" or "peak live").
    pub peak_bytes: u64,
    pub peak_what: &'static str,
    pub headroom_bytes: Option<u64>,
    /// A leaking process on the device: how many more iterations of its
    /// rise the headroom holds.
    pub leak_iterations_left: Option<u64>,
    /// Whether the level is what it is only because of a leak.
    pub raised_by_leak: bool,
    pub largest_request_bytes: u64,
    pub room_now_bytes: Option<u64>,
    pub trend_bytes_per_step: f64,
    pub ooms: u64,
    /// The fragmentation level (SPEC §6.8) of the device's forecast.
    pub fragmentation_level: Option<Risk>,
    /// Why, in plain words.
    pub reason: String,
}

impl Assessment {
    /// Whether replay unit `pid` (a process, or a snapshot's device) is in
    /// this assessment.
    pub fn covers(&self, pid: u32) -> bool {
        covers(self.device, self.members.as_deref(), pid)
    }
}

/// Whether a series (a device, or the units on a GPU, or everything when
/// both are None) holds replay unit `pid`.
pub(crate) fn covers(device: Option<u32>, members: Option<&[u32]>, pid: u32) -> bool {
    match (members, device) {
        (Some(m), _) => m.contains(&pid),
        (None, d) => d.is_none_or(|d| d == pid),
    }
}

/// The share of the capacity at which each level begins.
const CRITICAL_SHARE: f64 = 0.95;
const HIGH_SHARE: f64 = 0.85;
const MEDIUM_SHARE: f64 = 0.70;

/// The level of a device with capacity `c` in state `s`, and the reasons.
pub fn assess(c: u64, s: &State) -> (OomRisk, Vec<String>) {
    let b = crate::units::bytes;
    let share = if c == 0 { 1.0 } else { s.peak as f64 / c as f64 };
    let headroom = c.saturating_sub(s.peak);
    let room = s.largest_free_now.max(c.saturating_sub(s.reserved_now));
    let mut why = Vec::new();
    let in_use = if s.needed { "of the budget needed to fit" } else { "of the capacity in use at the peak" };
    let mut level = if s.peak > c {
        // More than the capacity: a capacity given for another (smaller)
        // device, or one inferred too low. As recorded, it does not fit.
        why.push(format!("{:.0} % {in_use}: the run reserved more than the capacity holds", share * 100.0));
        OomRisk::Critical
    } else if share >= CRITICAL_SHARE {
        why.push(format!("{:.0} % {in_use}", share * 100.0));
        OomRisk::Critical
    } else if room < s.largest_request {
        why.push(format!(
            "the largest request seen ({}) would not fit in the largest room now ({})",
            b(s.largest_request),
            b(room)
        ));
        OomRisk::Critical
    } else if share >= HIGH_SHARE {
        why.push(format!("{:.0} % {in_use}", share * 100.0));
        OomRisk::High
    } else if headroom < s.largest_request.saturating_mul(2) {
        why.push(format!(
            "a headroom of {} is less than twice the largest request seen ({})",
            b(headroom),
            b(s.largest_request)
        ));
        OomRisk::High
    } else if share >= MEDIUM_SHARE {
        why.push(format!("{:.0} % {in_use}", share * 100.0));
        OomRisk::Medium
    } else {
        why.push(format!(
            "{:.0} % {in_use}, the largest request seen ({}) fits {} times in the headroom",
            share * 100.0,
            b(s.largest_request),
            if s.largest_request == 0 { 0 } else { headroom / s.largest_request }
        ));
        OomRisk::Low
    };
    if s.trend_per_step > 0.0 && s.steps > 0 && headroom > 0 && (headroom as f64) < s.trend_per_step * s.steps as f64 {
        why.push(format!(
            "rising by {} per step, which fills the headroom of {} within {} steps",
            b(s.trend_per_step as u64),
            b(headroom),
            (headroom as f64 / s.trend_per_step).ceil() as u64
        ));
        level = level.max(OomRisk::High);
    }
    if share >= MEDIUM_SHARE && s.fragmentation >= Some(Risk::High) && level < OomRisk::Critical {
        why.push(format!(
            "the fragmentation level is {} while room is short",
            s.fragmentation.map_or("unknown", Risk::name)
        ));
        level = level.raised();
    }
    (level, why)
}

/// The steps of R's series that the trend reads.
pub const TREND_WINDOW: usize = 20;

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn state(peak: u64, largest_request: u64) -> State {
        State {
            peak,
            reserved_now: peak,
            largest_free_now: 0,
            largest_request,
            trend_per_step: 0.0,
            steps: 100,
            fragmentation: Some(Risk::Critical),
            needed: false,
        }
    }

    #[test]
    fn a_small_share_is_low_whatever_the_fragmentation() {
        let (level, why) = assess(80 * GIB, &state(5 * GIB, GIB / 4));
        assert_eq!(level, OomRisk::Low, "{why:?}");
    }

    #[test]
    fn levels_follow_the_share_and_the_largest_request() {
        let mut s = state(58 * GIB, GIB / 4);
        s.fragmentation = None;
        assert_eq!(assess(80 * GIB, &s).0, OomRisk::Medium);
        s.peak = 70 * GIB;
        s.reserved_now = 70 * GIB;
        assert_eq!(assess(80 * GIB, &s).0, OomRisk::High);
        s.peak = 77 * GIB;
        s.reserved_now = 77 * GIB;
        assert_eq!(assess(80 * GIB, &s).0, OomRisk::Critical);
        // Half the device, but the largest request no longer fits.
        let mut s = state(40 * GIB, 30 * GIB);
        s.reserved_now = 60 * GIB;
        s.fragmentation = None;
        assert_eq!(assess(80 * GIB, &s).0, OomRisk::Critical);
        // Fragmentation raises the level once room is short.
        let mut s = state(58 * GIB, GIB / 4);
        assert_eq!(assess(80 * GIB, &s).0, OomRisk::High);
        s.fragmentation = Some(Risk::Medium);
        assert_eq!(assess(80 * GIB, &s).0, OomRisk::Medium);
    }

    #[test]
    fn a_rising_peak_that_fills_the_headroom_is_high() {
        let mut s = state(20 * GIB, GIB / 4);
        // 60 GiB of headroom, 1 GiB more per step over 100 steps.
        s.trend_per_step = GIB as f64;
        assert_eq!(assess(80 * GIB, &s).0, OomRisk::High);
        s.trend_per_step = (GIB / 1000) as f64;
        assert_eq!(assess(80 * GIB, &s).0, OomRisk::Low);
    }

    /// A capacity below the peak (given for a smaller device): critical,
    /// said as such, and no headroom "filled within 0 steps".
    #[test]
    fn a_peak_above_the_capacity_is_said_so() {
        let mut s = state(20 * GIB, GIB / 4);
        s.trend_per_step = GIB as f64;
        let (level, why) = assess(18 * GIB, &s);
        assert_eq!(level, OomRisk::Critical);
        assert!(why[0].contains("the run reserved more than the capacity holds"), "{why:?}");
        assert!(!why.iter().any(|w| w.contains("fills the headroom")), "{why:?}");
    }

    #[test]
    fn oom_ranks_above_every_level_and_unknown_below() {
        assert!(OomRisk::Oom > OomRisk::Critical && OomRisk::Unknown < OomRisk::Low);
        for r in OomRisk::ALL {
            assert_eq!(OomRisk::from_name(r.name()), Some(r));
        }
    }
}
