//! The first screen's decision: will this job fit, how much memory does it
//! need, and what to change. It reads what the other passes found (the
//! OOMs, the leak verdicts, the what-if's replays and memory needed, the
//! cache releases) and decides in this order:
//!
//! 1. **failed**: the recording has OOMs;
//! 2. **leaking**: a leak verdict says so;
//! 3. **fits, releasing its cache**: no OOM, but PyTorch released its
//!    cache to retry a request (`num_alloc_retries` > 0);
//! 4. **healthy**: no OOM, no retry, and the memory needed is known;
//! 5. **unknown**, with the reason.
//!
//! The fix is the what-if's own recommendation (so the first screen and
//! the table below it never disagree), with its memory needed; where no
//! setting is recommended for a run that failed or flushed, the call
//! sites holding the most bytes at the peak.

use crate::analysis::Analysis;
use crate::analysis::oom::OomClass;
use crate::analysis::whatif::{Needed, Whatif};

/// The verdict of the first screen.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Verdict {
    Failed {
        ooms: u64,
        classes: Vec<(String, u64)>,
    },
    Leaking {
        per_step_bytes: Option<u64>,
        passes_budget_at_step: Option<u64>,
    },
    /// No OOM, but the allocator released cached memory when its budget
    /// was reached (`releases`: retries as `num_alloc_retries` counts
    /// them; `oversize`: releases of the blocks above `max_split_size_mb`
    /// alone) or by garbage collection (`gc`).
    FitsFlushing {
        releases: u64,
        at_least: bool,
        oversize: u64,
        gc: u64,
    },
    /// `at_most`: the cache was largely built before the trace began,
    /// and the requests that built it are not in the trace: it may need
    /// less.
    Healthy {
        needs_bytes: u64,
        at_most: bool,
    },
    Unknown {
        why: String,
    },
}

/// What PyTorch's allocator may reserve on a unit, and how it is known.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Budget {
    pub lo_bytes: u64,
    pub hi_bytes: u64,
    pub source: &'static str,
}

/// One unit's memory: what it needs under its settings, without releases,
/// and under the best setting.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Memory {
    pub unit: u32,
    pub recorded: Option<Needed>,
    pub best: Option<(String, Needed)>,
    pub budget: Option<Budget>,
    pub peak_allocated_bytes: u64,
    /// What the reader must know about the recorded settings' figures.
    pub note: Option<String>,
    /// A tenth or more of the peak was reserved before the trace began
    /// (or every request fit in that cache): the figures are at most what
    /// it needs, since how that cache was built is not in the trace.
    pub carried_in: bool,
}

/// The fix the first screen gives.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fix {
    /// A replayed setting: its `PYTORCH_CUDA_ALLOC_CONF` line and why.
    Setting { conf: String, why: String, needed: Vec<Needed> },
    /// No setting: the call sites holding the most bytes at the peak.
    Sites { why: String, sites: Vec<crate::analysis::sites::SiteBytes> },
    /// Nothing to change, or nothing to say (with why).
    None { why: String },
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Decision {
    pub verdict: Verdict,
    pub memory: Vec<Memory>,
    pub fix: Fix,
    /// The budget over every unit, as an interval, and where a capacity
    /// given contradicts the recording.
    pub capacity: CapacityView,
}

/// `report.json` `capacity`: the budget's interval over the units (the
/// least low end, the greatest high end), where it comes from, the
/// capacity given, and each contradiction between that and the
/// recording's own evidence (an `oom` entry's CUDA-free + reserved, or
/// the interval its cache releases bound).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct CapacityView {
    pub lo_bytes: Option<u64>,
    pub hi_bytes: Option<u64>,
    pub source: Option<&'static str>,
    pub given_bytes: Option<u64>,
    pub contradictions: Vec<String>,
}

/// Where a capacity given disagrees with what unit `j`'s recording shows:
/// an `oom` entry says what PyTorch could reserve then (more than 2 MiB
/// apart, the grain of every segment), cache releases bound it.
fn contradictions(w: &Whatif, j: usize, given: u64) -> Vec<String> {
    let b = crate::units::bytes;
    let mut out = Vec::new();
    let Some(f) = w.fidelity.get(j) else { return out };
    if let Some(e) = f.inferred_capacity
        && e.abs_diff(given) > crate::analysis::whatif::GRAIN
    {
        out.push(format!(
            "--capacity {} (given), but the `oom` entry of device {} shows {} that PyTorch could reserve (CUDA's free \
             memory then plus what it had reserved)",
            b(given),
            f.device,
            b(e)
        ));
    }
    if let Some((lo, hi)) = w.flushes.iter().find(|(d, _)| *d == f.device).and_then(|x| x.1.capacity)
        && (given < lo || given > hi)
    {
        out.push(format!(
            "--capacity {} (given), but the cache releases of device {} put its budget between {} and {}",
            b(given),
            f.device,
            b(lo),
            b(hi)
        ));
    }
    out
}

/// Each unit's budget as the what-if knew it: given, inferred from an
/// `oom` entry, or bounded by the retries' releases.
fn budget(w: &Whatif, j: usize, given: Option<u64>) -> Option<Budget> {
    let device = w.fidelity.get(j)?.device;
    if let Some(c) = given {
        return Some(Budget { lo_bytes: c, hi_bytes: c, source: "--capacity" });
    }
    let flushes = w.flushes.iter().find(|(d, _)| *d == device).map(|x| x.1);
    // Under a memory fraction (collections show one), an `oom` entry's
    // CUDA free memory is the device's, not the fraction's: the releases
    // come first then, as in the what-if.
    let fraction = flushes.is_some_and(|f| f.gc_capacity.is_some());
    if let Some(c) = w.fidelity.get(j).and_then(|f| f.inferred_capacity).filter(|_| !fraction) {
        return Some(Budget { lo_bytes: c, hi_bytes: c, source: "an OOM entry (CUDA's free memory + reserved then)" });
    }
    if let Some((lo, hi, gc)) = flushes.and_then(|f| f.releases_bound()) {
        let source = if gc { "its garbage collection's releases" } else { "its cache releases" };
        return Some(Budget { lo_bytes: lo, hi_bytes: hi, source });
    }
    // A device-level trace's own capacity (trace.json), which its replay
    // used.
    let c =
        w.capacities.get(j).copied().flatten().filter(|_| w.source == crate::analysis::whatif::Source::DeviceLevel)?;
    Some(Budget { lo_bytes: c, hi_bytes: c, source: "the trace (trace.json)" })
}

/// The scenario with the lowest memory needed to fit on unit `j`, then the
/// fewest releases there, other than the recorded settings.
fn best(w: &Whatif, j: usize) -> Option<(String, Needed)> {
    // The recommended setting, so that the memory line and the fix agree.
    if let Some(s) = w.scenarios.get(w.recommended.0).filter(|_| w.recommended.0 != 0)
        && let Some(n) = s.needed.get(j).filter(|n| n.fits_from_bytes.is_some())
    {
        return Some((crate::analysis::whatif::scenario_label(&w.recorded_conf, &s.conf), n.clone()));
    }
    w.scenarios
        .iter()
        .skip(1)
        .filter_map(|s| Some((s, s.needed.get(j)?.clone())))
        .filter(|(_, n)| n.fits_from_bytes.is_some())
        .min_by_key(|(_, n)| (n.fits_from_bytes, n.flushes_at_fits_from, n.no_flush_from_bytes))
        .map(|(s, n)| (crate::analysis::whatif::scenario_label(&w.recorded_conf, &s.conf), n))
}

/// Decides from what the passes found; `sites`: the call sites at the
/// peak, asked for only when no setting is the fix.
pub fn decide(
    a: &Analysis,
    given: Option<u64>,
    sites: &dyn Fn() -> Vec<crate::analysis::sites::SiteBytes>,
) -> Decision {
    let w = a.whatif.as_ref();
    let memory: Vec<Memory> = match w {
        Some(w) => {
            w.fidelity
                .iter()
                .enumerate()
                .map(|(j, f)| (j, f, w.scenarios.first().and_then(|s| s.needed.get(j))))
                .map(|(j, f, recorded)| {
                    Memory {
                    unit: f.device,
                    recorded: recorded.cloned(),
                    best: best(w, j),
                    budget: budget(w, j, given),
                    peak_allocated_bytes: w
                        .scenarios
                        .first()
                        .and_then(|s| s.devices.get(j))
                        .map_or(0, |o| o.peak_allocated_bytes),
                    carried_in: w.untestable.is_some()
                        || recorded.is_some_and(|n| {
                            f.initial_reserved > 0 && f.initial_reserved >= n.no_flush_from_bytes / 10
                        }),
                    // Garbage collection acts only under a memory fraction,
                    // which a snapshot does not record: where its releases
                    // bound the budget, the replay collects under it; where
                    // they do not, the replay of the recorded settings runs
                    // without it.
                    note: w
                        .flushes
                        .iter()
                        .any(|(d, fl)| *d == f.device && fl.gc_releases > 0 && fl.gc_capacity.is_none())
                        .then(|| {
                        "the recorded settings replay without garbage collection: the memory fraction that turned it \
                         on is not in the snapshot"
                            .to_string()
                    }),
                }
                })
                .collect()
        }
        None => Vec::new(),
    };
    let releases: u64 = w.map_or(0, |w| w.flushes.iter().map(|(_, f)| f.count).sum());
    let oversize: u64 = w.map_or(0, |w| w.flushes.iter().map(|(_, f)| f.oversize_releases).sum());
    let gc: u64 = w.map_or(0, |w| w.flushes.iter().map(|(_, f)| f.gc_releases).sum());
    let at_least = w.is_some_and(|w| w.flushes.iter().any(|(_, f)| f.at_least));
    let leak = a.leaks.iter().find(|l| l.leaking);
    let verdict = if a.has_history() && !a.ooms.is_empty() {
        let classes = oom_classes(a).into_iter().map(|(c, n)| (c.name().replace('_', " "), n)).collect();
        Verdict::Failed { ooms: a.ooms.len() as u64, classes }
    } else if let Some(l) = leak {
        let per_step = l.growth_per_iteration_bytes.and_then(|g| u64::try_from(g).ok()).filter(|&g| g > 0);
        // The step at which the memory needed passes the budget's low end,
        // growing by the floor's rise per step from where it ended.
        let passes = per_step.and_then(|g| {
            let m = memory.iter().find(|m| m.unit == l.pid)?;
            let needs = m.recorded.as_ref()?.no_flush_from_bytes;
            let b = m.budget.as_ref()?.lo_bytes;
            let steps = a.iterations.iter().find(|it| it.pid == l.pid)?.count as u64;
            Some(steps + b.saturating_sub(needs).div_ceil(g))
        });
        Verdict::Leaking { per_step_bytes: per_step, passes_budget_at_step: passes }
    } else if releases + oversize + gc > 0 {
        Verdict::FitsFlushing { releases, at_least, oversize, gc }
    } else if let Some(n) =
        memory.iter().map(|m| m.recorded.as_ref().map(|n| n.no_flush_from_bytes)).sum::<Option<u64>>()
        && !memory.is_empty()
        && a.has_history()
    {
        Verdict::Healthy { needs_bytes: n, at_most: memory.iter().any(|m| m.carried_in) }
    } else {
        Verdict::Unknown {
            why: if !a.has_history() {
                "the snapshot holds no trace history, only the state at one instant".into()
            } else if let Some(why) = &a.whatif_not_run {
                why.clone()
            } else if let Some(why) = w.and_then(|w| w.untestable.clone()) {
                format!("the memory needed cannot be replayed: {why}")
            } else {
                "no replay of PyTorch's allocator ran on this trace (a device-level recording without OOMs, or \
                 `--no-whatif`), so the memory it needs is not known"
                    .into()
            },
        }
    };
    let fix = match w {
        // A leak is the program's: no allocator setting is its fix.
        _ if matches!(verdict, Verdict::Leaking { .. }) => Fix::None {
            why: "the program keeps memory from step to step: the call sites whose memory grew are under Leaks \
                  below"
                .into(),
        },
        Some(w) if w.recommended.0 != 0 => Fix::Setting {
            conf: w.recommendation(),
            why: w.recommended.1.clone(),
            needed: w.scenarios[w.recommended.0].needed.clone(),
        },
        Some(w) if matches!(verdict, Verdict::Failed { .. } | Verdict::FitsFlushing { .. }) => {
            Fix::Sites { why: format!("{}: {}", w.recommendation(), w.recommended.1), sites: sites() }
        }
        Some(w) => Fix::None { why: format!("{}: {}", w.recommendation(), w.recommended.1) },
        None => Fix::None { why: "no allocator setting was replayed".into() },
    };
    let mut capacity = CapacityView { given_bytes: given, ..CapacityView::default() };
    for m in &memory {
        if let Some(b) = &m.budget {
            capacity.lo_bytes = Some(capacity.lo_bytes.map_or(b.lo_bytes, |x| x.min(b.lo_bytes)));
            capacity.hi_bytes = Some(capacity.hi_bytes.map_or(b.hi_bytes, |x| x.max(b.hi_bytes)));
            capacity.source = Some(b.source);
        }
    }
    // No replay to bound it: the capacity the analysis used (given, or
    // the trace's own).
    if capacity.lo_bytes.is_none()
        && let Some(c) = a.capacity
    {
        (capacity.lo_bytes, capacity.hi_bytes) = (Some(c), Some(c));
        capacity.source = Some(if given.is_some() { "--capacity" } else { "the trace (trace.json)" });
    }
    if let (Some(w), Some(c)) = (w, given) {
        capacity.contradictions = (0..w.fidelity.len()).flat_map(|j| contradictions(w, j, c)).collect();
    }
    Decision { verdict, memory, fix, capacity }
}

/// The trace's OOMs by class, the most frequent first.
pub(crate) fn oom_classes(a: &Analysis) -> Vec<(OomClass, u64)> {
    oom_classes_of(a, None)
}

/// [`oom_classes`] of one unit (`pid`), or of the whole trace (None).
pub(crate) fn oom_classes_of(a: &Analysis, pid: Option<u32>) -> Vec<(OomClass, u64)> {
    let mut counts: std::collections::BTreeMap<OomClass, u64> = Default::default();
    for o in a.ooms.iter().filter(|o| pid.is_none_or(|p| o.pid == p)) {
        *counts.entry(o.class).or_default() += 1;
    }
    let mut v: Vec<(OomClass, u64)> = counts.into_iter().collect();
    v.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    v
}
