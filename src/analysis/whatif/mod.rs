//! `fragscope whatif`: the recorded requests of a PyTorch snapshot replayed
//! through the allocator model ([`crate::allocator`]) — first
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
//!
//! The files: [`stream`] (the requests), [`fidelity`], [`simulate`] (one
//! scenario); this module runs the sweep and recommends.

mod fidelity;
mod inert;
mod needed;
mod recommend;
mod replay;
mod simulate;
mod stream;

use self::fidelity::device_level_fidelity;
use self::recommend::*;
pub use self::recommend::{
    UNCHECKED, conf_line, conf_md, is_default, is_recorded, kept_entries, scenario_label, tight_margin,
};
use self::replay::Checkpoints;
use self::simulate::{as_recorded, simulate_keeping};
use crate::allocator::Settings;
use crate::trace::event::EventKind;
pub use fidelity::{Fidelity, Mismatch, fidelity};
pub use needed::{GRAIN, Needed, needed};
pub use replay::{Outcome, SERIES_POINTS};
pub use simulate::{simulate, simulate_into};
pub use stream::{DeviceStream, Flushes, Release, Req, device_level_streams, inferred_capacity, streams};

/// The default sweep: `expandable_segments:True`, `max_split_size_mb` at up to four values taken from
/// the large requests (their 10th percentile, median, 90th percentile and largest, rounded
/// up to a power of two MiB above 20), `roundup_power2_divisions:4`, and
/// with a capacity given (`--capacity`) `garbage_collection_threshold:0.8`
/// under a per-process memory fraction of 0.99 (PyTorch collects garbage
/// only under one below 1). Not with an inferred one: the fraction is of
/// the device's whole memory, and a capacity inferred from an OOM or from
/// cache flushes is what the process could have (CUDA's free memory and
/// its own), which other processes or a budget may make far smaller: the
/// replay would collect at 0.8 of the wrong figure.
/// `known`: the largest capacity, where every device's is known (given or
/// inferred): a split threshold at or above it splits nothing a device
/// could hold, and is left out.
pub fn default_sweep(
    d: &[DeviceStream],
    recorded: &Settings,
    given: Option<u64>,
    known: Option<u64>,
) -> Vec<Vec<String>> {
    let mut large: Vec<u64> = d
        .iter()
        .flat_map(|s| s.all())
        .filter(|r| r.kind == EventKind::BlockAlloc && r.requested > crate::allocator::SMALL_SIZE)
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
        .filter(|&mb| known.is_none_or(|c| mb.saturating_mul(1 << 20) < c))
        .collect();
    splits.sort_unstable();
    splits.dedup();
    // A recording made with expandable segments: what plain segments
    // would have done instead.
    let flip = if recorded.expandable_segments { "expandable_segments:False" } else { "expandable_segments:True" };
    let mut sweep: Vec<Vec<String>> = vec![vec![flip.into()]];
    // A recording made with a rounding or a split threshold: what it cost
    // or saved, without it and without it under expandable segments (the
    // pair with expandable segments is unchecked, each alone is not).
    let mut set: Vec<&str> = Vec::new();
    if recorded.max_split_size.is_some() {
        set.push("max_split_size_mb");
    }
    if recorded.roundup_power2_divisions.iter().any(|&d| d > 1) {
        set.push("roundup_power2_divisions");
    }
    for key in set {
        sweep.push(vec![format!("{key}:default")]);
        if !recorded.expandable_segments {
            sweep.push(vec![flip.into(), format!("{key}:default")]);
        }
    }
    sweep.extend(splits.into_iter().map(|mb| vec![format!("max_split_size_mb:{mb}")]));
    sweep.push(vec!["roundup_power2_divisions:4".into()]);
    // Garbage collection acts only under a per-process memory fraction
    // below 1: tried with one of 0.99 (nearly the whole device), never
    // alone.
    if given.is_some() {
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
    /// Requests that found the device full and released the cache.
    pub flushes: u64,
    pub devices: Vec<Outcome>,
    /// What each device's requests need under these settings (empty for a
    /// device-level recording as it happened: no model replayed it).
    pub needed: Vec<Needed>,
    /// What the reader must know about how it replays (a setting that has
    /// no effect as given).
    pub note: Option<String>,
    /// Its settings combine two or more of expandable segments,
    /// `max_split_size_mb`, `roundup_power2_divisions` and garbage
    /// collection in force, which no real
    /// run has checked.
    pub unchecked_pair: bool,
    /// The same scenario replayed at the high end of the budget interval,
    /// where the budget is known only as one (cache flushes bound it): the
    /// figures above are at its low end. Its outcomes keep no series.
    pub at_high: Option<Box<Scenario>>,
}

impl Scenario {
    /// Its peak reserved for a sentence: summed over the devices, and said
    /// so, when there are several.
    pub fn reserved(&self) -> String {
        match self.devices.len() {
            0 | 1 => crate::units::bytes(self.peak_reserved_bytes),
            n => format!("{} (summed over its {n} devices)", crate::units::bytes(self.peak_reserved_bytes)),
        }
    }

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
            flushes: sum(|o| o.flushes),
            devices,
            needed: Vec::new(),
            note: None,
            unchecked_pair: false,
            at_high: None,
        }
    }

    /// Whether a figure of the table (peak reserved or allocated, what
    /// reserved held beyond allocated, segments, OOMs, flushes) differs
    /// between the two ends of the budget interval.
    pub fn depends_on_budget(&self) -> bool {
        self.at_high.as_deref().is_some_and(|h| {
            (h.peak_reserved_bytes, h.peak_allocated_bytes, h.reserved_minus_allocated_at_peak)
                != (self.peak_reserved_bytes, self.peak_allocated_bytes, self.reserved_minus_allocated_at_peak)
                || (h.segment_allocs, h.ooms, h.flushes) != (self.segment_allocs, self.ooms, self.flushes)
        })
    }
}

/// One scenario's replays over its devices: at the budget, the memory
/// needed, and at the high end of the budget interval when there is one.
#[derive(Clone)]
struct Replays {
    outcomes: Vec<Outcome>,
    needed: Vec<Needed>,
    at_high: Option<Vec<Outcome>>,
}

impl Replays {
    /// The replays of a scenario that replays alike, as this one's.
    fn named(mut self, name: &str, conf: &[String]) -> Replays {
        for o in self.outcomes.iter_mut().chain(self.at_high.iter_mut().flatten()) {
            (o.name, o.conf) = (name.to_string(), conf.to_vec());
        }
        self
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
    /// The inferred capacity comes from cache flushes, not an `oom` entry
    /// (or from garbage collection's releases: then
    /// `capacity_from_collection` too).
    pub capacity_from_flushes: bool,
    pub capacity_from_collection: bool,
    /// Each device's cache flushes, where it had any.
    pub flushes: Vec<(u32, Flushes)>,
    /// When each device's retries released its cache (ns, the trace's
    /// clock), for the timeline.
    pub retry_times: Vec<(u32, Vec<u64>)>,
    /// Why the replay cannot be trusted about the recorded OOMs, when it
    /// cannot: a snapshot's model does not fail where the recording failed,
    /// or a device-level trace's failed requests would have fit by its own
    /// count. No setting is then said to avoid them.
    pub unreproduced: Option<String>,
    /// Why the replay cannot test any setting on this trace, when it
    /// cannot: it holds no allocation, or every request fit in the cache
    /// reserved before it began (each scenario starts from that cache, so
    /// none can reserve less, and how a setting would have built it is not
    /// in the trace). Nothing is then recommended.
    pub untestable: Option<String>,
    /// Each device's capacity in the replay (in the order of `fidelity`
    /// and of each scenario's `devices`): given, inferred, or unknown.
    pub capacities: Vec<Option<u64>>,
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

    /// How PyTorch released its cache when the device was full, under the
    /// recorded settings: with `max_split_size_mb` it first frees only the
    /// cached blocks above that size, and the whole cache only when that
    /// is not enough; without it, the whole cache.
    pub fn release_phrase(&self) -> &'static str {
        if self.recorded_conf.iter().any(|e| e.starts_with("max_split_size_mb:")) {
            "released cached segments (with `max_split_size_mb` set, first only its cached blocks above that size, the whole cache only when that is not enough)"
        } else {
            "released its whole cache"
        }
    }

    /// How the flushes compare with `torch.cuda.memory_stats()`: PyTorch
    /// counts in `num_alloc_retries` only the asks that follow a release
    /// of its whole cache, not those after a release of the blocks above
    /// `max_split_size_mb` (on the H100 run of varshape under
    /// `max_split_size_mb:64`, 8 flushes of 18 segments and 0 retries).
    pub fn retries_note(&self) -> &'static str {
        if self.recorded_conf.iter().any(|e| e.starts_with("max_split_size_mb:")) {
            " `num_alloc_retries` in `torch.cuda.memory_stats()` counts only flushes of the whole cache (one comes before every OOM), not these releases of the blocks above `max_split_size_mb`: it may read fewer, or 0."
        } else {
            " Each flush is one of `num_alloc_retries` in `torch.cuda.memory_stats()`, which also counts the flush before each OOM."
        }
    }

    /// The `PYTORCH_CUDA_ALLOC_CONF` line to use, "keep the current
    /// settings", or, when the recorded settings ran out of memory and no
    /// scenario removes an OOM, that no setting tried helps.
    pub fn recommendation(&self) -> String {
        let (i, _) = &self.recommended;
        if *i == 0 {
            if self.untestable.is_some() {
                "none: the settings cannot be judged from this trace".into()
            } else if self.scenarios.first().is_some_and(|s| s.ooms > 0 && !ooms_judged(s, &self.capacities)) {
                "none: which setting avoids the OOMs cannot be told without a capacity".into()
            } else if self.unreproduced.is_some() {
                "none".into()
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
    // Garbage collection's releases show a memory fraction in force (the
    // only way PyTorch collects), and bound its budget: the recorded
    // settings then replay with collection on.
    let gc_budgets: Vec<Option<(u64, u64)>> = devices
        .iter()
        .map(|d| {
            recorded
                .garbage_collection_threshold
                .filter(|_| recorded.per_process_memory_fraction.is_none())
                .and_then(|t| d.flushes.gc_budget(t))
        })
        .collect();
    let with_fraction;
    let recorded = if gc_budgets.iter().any(Option::is_some) {
        with_fraction = Settings { fraction_shown: true, ..recorded.clone() };
        &with_fraction
    } else {
        recorded
    };
    // Each device's capacity: the one given, else inferred from its OOM,
    // else the least its cache flushes allow, else the least its garbage
    // collection allows (the cautious end: a setting said to avoid OOMs
    // must do so on the smallest device the recording is consistent with).
    let capacities: Vec<Option<u64>> = devices
        .iter()
        .zip(&gc_budgets)
        .map(|(d, gc)| {
            // Under a fraction, an `oom` entry's CUDA free memory is the
            // device's, not the fraction's: collections and flushes, which
            // PyTorch makes at the fraction's budget, come first then.
            match gc {
                Some(gc) => capacity.or_else(|| d.flushes.capacity.map(|c| c.0)).or(Some(gc.0)),
                None => capacity.or_else(|| inferred_capacity(d)).or_else(|| d.flushes.capacity.map(|c| c.0)),
            }
        })
        .collect();
    let known = capacities.iter().copied().collect::<Option<Vec<u64>>>().and_then(|c| c.into_iter().max());
    // Where cache flushes bound the budget only as an interval, every
    // scenario is replayed at its high end too, so that no figure is given
    // at one end unlabelled (each device at its own low end when it has no
    // interval).
    let highs: Vec<Option<u64>> = devices
        .iter()
        .zip(&capacities)
        .zip(&gc_budgets)
        .map(|((d, &c), gc)| match d.flushes.capacity.or(*gc) {
            Some((lo, hi)) if capacity.is_none() && (inferred_capacity(d).is_none() || gc.is_some()) && hi > lo => {
                Some(hi)
            }
            _ => c,
        })
        .collect();
    let interval = highs != capacities;
    let mut confs = if confs.is_empty() { default_sweep(devices, recorded, capacity, known) } else { confs };
    if source == Source::DeviceLevel {
        confs.insert(0, Vec::new());
    }
    let runs = settings_of(recorded, &confs)?;
    let started = std::time::Instant::now();
    // Inferred from the trace's releases: cache flushes, or garbage
    // collection where no flush bounds it.
    let from_flushes = capacity.is_none()
        && devices
            .iter()
            .zip(&gc_budgets)
            .any(|(d, gc)| gc.is_some() || inferred_capacity(d).is_none() && d.flushes.capacity.is_some());
    let from_collection = from_flushes && devices.iter().all(|d| d.flushes.capacity.is_none());
    // One scenario's replays over every device: at the budget, the memory
    // needed, and at the interval's high end.
    let replay_all = |name: &str, conf: &[String], s: &Settings| -> Replays {
        let started = std::time::Instant::now();
        let (outcomes, kept): (Vec<Outcome>, Vec<Option<Checkpoints>>) =
            devices.iter().zip(&capacities).map(|(d, &c)| simulate_keeping(d, s, c, name, conf)).unzip();
        tracing::debug!("whatif: {name}: replayed in {:.3} s", started.elapsed().as_secs_f64());
        let started = std::time::Instant::now();
        // A device replayed without a budget is the memory needed's
        // replay with none: not run twice.
        let needed = devices
            .iter()
            .zip(outcomes.iter().zip(&kept))
            .map(|(d, (o, kept))| needed(d, s, kept.as_ref().map(|k| (o, k))))
            .collect::<Vec<_>>();
        tracing::debug!(
            "whatif: {name}: memory needed in {} replays, {:.3} s",
            needed.iter().map(|n: &Needed| n.replays).sum::<u32>(),
            started.elapsed().as_secs_f64()
        );
        let at_high = interval.then(|| {
            devices
                .iter()
                .zip(&highs)
                .map(|(d, &c)| Outcome { series: Vec::new(), ..simulate(d, s, c, name, conf) })
                .collect()
        });
        Replays { outcomes, needed, at_high }
    };
    let scenario = |name: &str, conf: &[String], s: &Settings, r: Replays| -> Scenario {
        let mut scenario = Scenario::of(name, conf, r.outcomes);
        scenario.at_high = r.at_high.map(|o| Box::new(Scenario::of(name, conf, o)));
        scenario.needed = r.needed;
        scenario.note = settings_note(s, capacities.iter().all(Option::is_some));
        scenario.unchecked_pair = unchecked_pair(s);
        scenario
    };
    let names: Vec<String> = runs
        .iter()
        .map(|(conf, _)| if conf.is_empty() { "pytorch_defaults".to_string() } else { conf.join(",") })
        .collect();
    // A scenario that replays as an earlier one (the recorded settings
    // first, for a snapshot) takes that one's replays: see [`inert`].
    // Index 0 is the recorded settings, replayed only for a snapshot.
    let jobs: Vec<(&str, &[String], &Settings)> = std::iter::once(("recorded", &[][..], recorded))
        .chain(runs.iter().zip(&names).map(|((conf, s), name)| (name.as_str(), &conf[..], s)))
        .collect();
    let replayed = |i: usize| i > 0 || source == Source::Snapshot;
    let keys: Vec<Settings> = jobs.iter().map(|j| inert::replay_key(devices, j.2)).collect();
    let same_as: Vec<usize> =
        (0..jobs.len()).map(|i| (0..i).find(|&j| replayed(j) && keys[j] == keys[i]).unwrap_or(i)).collect();
    for (i, &j) in same_as.iter().enumerate().filter(|(i, j)| i != *j) {
        tracing::debug!("whatif: {}: replays as {}, not replayed again", jobs[i].0, jobs[j].0);
    }
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
        let handles: Vec<_> = jobs
            .iter()
            .enumerate()
            .map(|(i, &(name, conf, s))| {
                let replay_all = &replay_all;
                (replayed(i) && same_as[i] == i).then(|| scope.spawn(move || replay_all(name, conf, s)))
            })
            .collect();
        let replays: Vec<Option<Replays>> = handles.into_iter().map(|h| h.map(join)).collect();
        let scenarios = jobs
            .iter()
            .enumerate()
            .map(|(i, &(name, conf, s))| match &replays[same_as[i]] {
                Some(r) if same_as[i] == i => scenario(name, conf, s, r.clone()),
                Some(r) => scenario(name, conf, s, r.clone().named(name, conf)),
                None if replayed(i) => scenario(name, conf, s, replay_all(name, conf, s)),
                None => Scenario::of(name, conf, devices.iter().map(as_recorded).collect()),
            })
            .collect::<Vec<Scenario>>();
        (join(fidelity), scenarios)
    });
    tracing::debug!("whatif: fidelity and {} scenarios in {:.3} s", scenarios.len(), started.elapsed().as_secs_f64());
    let unreproduced = match source {
        Source::Snapshot => {
            let (same, recorded) = fidelity
                .iter()
                .filter(|f| f.not_measured.is_none())
                .fold((0, 0), |(s, n), f| (s + f.ooms_same, n + f.recorded_ooms));
            let replayed = scenarios.first().map_or(0, |s| s.ooms);
            let inferred = fidelity.iter().filter_map(|f| f.inferred_capacity).max();
            if same < recorded {
                Some(format!("the model under the recorded settings fails at {same} of the {recorded} recorded OOMs"))
            } else if replayed < recorded {
                // The model fails where the recording did, but not under
                // the capacity given: the process had less.
                let b = crate::units::bytes;
                Some(format!(
                    "under the capacity given ({}), the recorded settings' replay runs out of memory {replayed} time(s) \
                     where the recording did {recorded} time(s){}",
                    capacity.map_or("none".into(), b),
                    inferred.map_or(String::new(), |c| format!(
                        ": the `oom` entry shows {} available to the process (CUDA's free memory plus what it had \
                         reserved), less than that; give that as --capacity, or leave --capacity out",
                        b(c)
                    ))
                ))
            } else if replayed > recorded && capacity.is_none() {
                // The model runs out where the program did not, at the
                // capacity inferred: its scenarios would be judged against
                // OOMs that never happened.
                Some(format!(
                    "the model under the recorded settings runs out of memory {replayed} time(s) where the recording \
                     did {recorded} time(s), at the capacity inferred{}",
                    if from_flushes { " from cache flushes (the least they allow)" } else { "" }
                ))
            } else {
                None
            }
        }
        Source::DeviceLevel => unexplained,
    };
    // What the recording itself did: its OOMs and the segments it asked.
    let (recorded_ooms, recorded_segments) = fidelity
        .iter()
        .fold((0, 0), |(o, s), f| (o + f.recorded_ooms, s + f.segments_requested + f.segments_only_recorded));
    let untestable = scenarios.first().and_then(|rec| {
        if rec.devices.iter().all(|d| d.allocations + d.ooms == 0) {
            Some("it holds no allocation to replay".to_string())
        } else if source == Source::Snapshot
            && rec.ooms + recorded_ooms == 0
            && rec.segment_allocs + recorded_segments == 0
        {
            Some(
                "every request fit in the segments PyTorch had reserved before it began, and each scenario starts \
                 from them, so none can reserve less; how a setting would have built that cache is not in the trace"
                    .to_string(),
            )
        } else {
            None
        }
    });
    let recorded_conf = recorded.conf_entries();
    let mut recommended =
        recommend(&scenarios, &recorded_conf, &capacities, unreproduced.as_deref(), untestable.as_deref());
    if source == Source::DeviceLevel && recommended.0 != 0 && scenarios[recommended.0].conf.is_empty() {
        recommended.1 = format!("{} with PyTorch's caching allocator as it comes", recommended.1);
    }
    // A recommended setting that removes the OOMs with little to spare on
    // one device: say how little.
    if let ([Some(cap)], true) = (capacities.as_slice(), recommended.0 != 0)
        && scenarios[recommended.0].ooms < scenarios[0].ooms
        && let Some(tight) = tight_margin(Some(*cap), &scenarios[recommended.0])
    {
        recommended.1 = format!("{}, {tight}", recommended.1);
    }
    // Figures given at the budget interval's low end that differ at its
    // high end: said as a range, never at one end unlabelled.
    if let Some(high) =
        scenarios[recommended.0].at_high.as_deref().filter(|_| scenarios[recommended.0].depends_on_budget())
    {
        let low = &scenarios[recommended.0];
        let b = crate::units::bytes;
        let (lo, hi) = (capacities.iter().flatten().min(), highs.iter().flatten().max());
        let mut parts = vec![format!(
            "peak reserved {}–{}",
            b(low.peak_reserved_bytes.min(high.peak_reserved_bytes)),
            b(low.peak_reserved_bytes.max(high.peak_reserved_bytes))
        )];
        if low.ooms != high.ooms {
            parts.push(format!("{}–{} OOMs", low.ooms.min(high.ooms), low.ooms.max(high.ooms)));
        }
        recommended.1 = format!(
            "{} (at the budget's low end; {} depending on the budget within {}–{})",
            recommended.1,
            parts.join(", "),
            lo.map_or("?".into(), |c| b(*c)),
            hi.map_or("?".into(), |c| b(*c))
        );
    }
    if recommended.0 != 0 && scenarios[recommended.0].unchecked_pair {
        recommended.1 = format!("{} ({UNCHECKED})", recommended.1);
    }
    // A setting left out because it reserves less only by releasing its
    // cache more often: said, with the cost.
    if recommended.0 == 0 && untestable.is_none() && unreproduced.is_none() {
        let rec = &scenarios[0];
        if let Some(s) = scenarios[1..]
            .iter()
            .filter(|s| s.ooms == rec.ooms && saves_by_flushing(rec, s))
            .min_by_key(|s| s.peak_reserved_bytes)
        {
            recommended.1 = format!(
                "{}; {} reserves {} less at the peak, but only by releasing its cache to make room {} times where the \
                 recorded settings did {} (a `cudaFree` each time, which synchronizes the device)",
                recommended.1,
                scenario_label(&recorded_conf, &s.conf),
                crate::units::bytes(rec.peak_reserved_bytes - s.peak_reserved_bytes),
                s.flushes,
                rec.flushes
            );
        }
    }
    // Scenarios compare with the model's own replay of the recorded
    // settings; where that is not what PyTorch reserved, say both.
    let measured = || fidelity.iter().enumerate().filter(|(_, f)| f.not_measured.is_none());
    let recorded_peak: u64 = measured().map(|(_, f)| f.recorded_peak_reserved).sum();
    let model_peak: u64 =
        measured().filter_map(|(j, _)| scenarios[0].devices.get(j)).map(|o| o.peak_reserved_bytes).sum();
    if source == Source::Snapshot && recommended.0 != 0 && recorded_peak.abs_diff(model_peak) > noise(recorded_peak) {
        recommended.1 = format!(
            "{} (against the model's own replay of the recorded settings, {}; PyTorch reserved {}{})",
            recommended.1,
            crate::units::bytes(model_peak),
            crate::units::bytes(recorded_peak),
            if measured().count() > 1 { ", both summed over the devices" } else { "" }
        );
    }
    // A recommendation that leaves recorded entries out says which.
    let dropped = dropped_entries(&recorded_conf, &scenarios[recommended.0].conf);
    if recommended.0 != 0 && !dropped.is_empty() {
        let list: Vec<String> = dropped.iter().map(|e| format!("`{e}`")).collect();
        recommended.1 = format!("{}; without the recorded {}", recommended.1, list.join(", "));
    }
    // A snapshot whose cache was largely built before the trace began:
    // every scenario keeps that cache, so the verdict is on what the trace
    // added only (a tenth of the peak: less moves no verdict).
    let before: u64 = measured().map(|(_, f)| f.initial_reserved).sum();
    if source == Source::Snapshot && untestable.is_none() && before > 0 && before >= recorded_peak / 10 {
        recommended.1 = format!(
            "{} — judged on what the trace added: {} of the {} peak was reserved before it began, the same in every \
             scenario, and how a setting would have built it is not in the trace",
            recommended.1,
            crate::units::bytes(before),
            crate::units::bytes(recorded_peak)
        );
    }
    let capacity_inferred = capacity.is_none() && capacities.iter().any(Option::is_some);
    let capacity = capacity.or_else(|| capacities.iter().flatten().copied().max());
    let flushes = devices
        .iter()
        .zip(&gc_budgets)
        .map(|(d, gc)| (d.device, Flushes { gc_capacity: *gc, ..d.flushes }))
        .filter(|x| x.1.count + x.1.gc_releases + x.1.oversize_releases > 0)
        .collect();
    let retry_times = devices
        .iter()
        .map(|d| {
            let times = d
                .releases
                .iter()
                .filter(|(_, r)| **r == Release::Retry)
                .filter_map(|(&i, _)| d.get(i).map(|e| e.ts_ns))
                .collect();
            (d.device, times)
        })
        .collect();
    Ok(Whatif {
        retry_times,
        fidelity,
        scenarios,
        recommended,
        capacity,
        capacity_inferred,
        capacity_from_flushes: from_flushes,
        capacity_from_collection: from_collection,
        flushes,
        source,
        recorded_conf,
        unreproduced,
        untestable,
        capacities,
    })
}

#[cfg(test)]
mod tests;
