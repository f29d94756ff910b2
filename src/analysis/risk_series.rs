//! The OOM risk of a trace ([`crate::analysis::risk`]'s rule applied to
//! it): the capacity of each series (given, recorded, inferred from an
//! `oom` entry or from cache flushes), the online risk of every row from
//! what was known at its step, and each process's assessment.

use crate::analysis::predict::Risk;
use crate::analysis::risk::{Assessment, Capacity, CapacitySource, OomRisk, State, TREND_WINDOW, assess};

/// What [`evaluate`] reads of an analysed trace.
pub(crate) struct Inputs<'a> {
    pub events: &'a crate::trace::event::Events,
    pub allocator_view: bool,
    pub peaks: &'a [crate::analysis::replay::Peak],
    pub peak_live_total: u64,
    pub ooms: &'a [crate::analysis::oom::OomDiagnosis],
    pub given: Option<u64>,
    pub recorded: Option<u64>,
    /// Per device, the least and the most capacity its cache flushes allow
    /// (true: its garbage collection's releases, not flushes).
    pub flushes: &'a [(u32, u64, u64, bool)],
    /// The fragmentation level of each process's forecast.
    pub fragmentation: Vec<(u32, Option<Risk>)>,
    /// A device-level recording's GPUs ([`Gpus`]).
    pub gpus: &'a Gpus,
    /// The processes whose leak verdict is "leaking", with their floor's
    /// rise per iteration (median) when iterations were found.
    pub leaks: Vec<(u32, Option<u64>)>,
    /// Per device of a snapshot, the memory its requests need under the
    /// recorded settings (the smallest budget they fit in, replayed): a
    /// run without OOMs is judged by it, not by its peak reserved (a
    /// cache that filled its budget is not a job at risk).
    pub needed: &'a [(u32, u64)],
}

/// A device-level recording's GPUs: the GPU (NVML's index) of each replay
/// unit, where it is known, and each GPU's memory as the driver reported
/// it. The processes on one GPU share its memory, those on others do not.
#[derive(Clone, Debug, Default)]
pub(crate) struct Gpus {
    /// A process that made all its calls on one device, or one device of a
    /// process that used several ([`crate::trace::Trace::units`]). The
    /// program's device N is the N-th GPU its `CUDA_VISIBLE_DEVICES` names,
    /// when it set one. Empty for other traces, and when a GPU is named by
    /// UUID (then which GPUs are the same is not known: one series for all).
    pub of_unit: std::collections::BTreeMap<u32, i32>,
    /// NVML's index → total bytes.
    pub totals: std::collections::BTreeMap<i32, u64>,
}

impl Gpus {
    pub(crate) fn of(trace: &crate::trace::Trace) -> Gpus {
        let Some(d) = trace.meta.as_ref().and_then(|m| m.details.record()) else { return Gpus::default() };
        let totals = d.gpus.iter().map(|g| (g.index as i32, g.total_bytes)).collect();
        let physical = |pid: u32, device: i32| -> Option<i32> {
            match d.visible_devices.get(&pid.to_string()) {
                None => Some(device),
                Some(list) => list.split(',').nth(usize::try_from(device).ok()?)?.trim().parse().ok(),
            }
        };
        let single = d.devices.iter().filter_map(|(pid, devices)| match devices.as_slice() {
            [device] => Some((pid.parse::<u32>().ok()?, *device)),
            _ => None,
        });
        let mut of_unit = std::collections::BTreeMap::new();
        for (unit, (pid, device)) in
            trace.units.iter().map(|(&id, &pd)| (id, pd)).chain(single.map(|(p, d)| (p, (p, d))))
        {
            match physical(pid, device) {
                Some(g) => of_unit.insert(unit, g),
                None => return Gpus { of_unit: Default::default(), totals },
            };
        }
        Gpus { of_unit, totals }
    }
}

/// One series of the OOM risk: a snapshot's device (its id is the unit's),
/// the processes of a device-level recording on one GPU, or every process
/// of the trace together when their GPUs are not known to differ.
struct Series {
    /// The device the assessment names.
    device: Option<u32>,
    /// The units on that GPU (device-level recordings), else None.
    members: Option<Vec<u32>>,
}

impl Series {
    fn has(&self, pid: u32) -> bool {
        crate::analysis::risk::covers(self.device, self.members.as_deref(), pid)
    }
}

/// The series: per device (snapshots); per GPU when a device-level
/// recording's units are on more than one; else one over all processes.
fn series_of(inp: &Inputs<'_>) -> Vec<Series> {
    if inp.allocator_view {
        return inp.peaks.iter().map(|p| Series { device: Some(p.pid), members: None }).collect();
    }
    let mut by_gpu: std::collections::BTreeMap<i32, Vec<u32>> = Default::default();
    for p in inp.peaks {
        match inp.gpus.of_unit.get(&p.pid) {
            Some(&g) => by_gpu.entry(g).or_default().push(p.pid),
            // A process whose GPU is not known: one series for all.
            None => return vec![Series { device: None, members: None }],
        }
    }
    if by_gpu.len() < 2 {
        return vec![Series { device: None, members: None }];
    }
    by_gpu.into_iter().map(|(g, m)| Series { device: Some(g.max(0) as u32), members: Some(m) }).collect()
}

/// The capacity of a series: given, else recorded, else (snapshots)
/// inferred from its first `oom` entry that reported CUDA's free memory.
fn capacity_of(inp: &Inputs<'_>, series: &Series) -> Option<Capacity> {
    if let Some(bytes) = inp.given {
        return Some(Capacity { bytes, source: CapacitySource::Given, upper: None });
    }
    if let Some(bytes) = inp.recorded {
        return Some(Capacity { bytes, source: CapacitySource::Recorded, upper: None });
    }
    // A recording's GPU, of its own size.
    if series.members.is_some()
        && let Some(&bytes) = series.device.and_then(|g| inp.gpus.totals.get(&(g as i32)))
    {
        return Some(Capacity { bytes, source: CapacitySource::Recorded, upper: None });
    }
    // Inferred only for a snapshot's device.
    let device = series.device.filter(|_| series.members.is_none())?;
    // Under a memory fraction (collections show one), an `oom` entry's
    // CUDA free memory is the device's: the releases' bound comes first.
    let fraction = inp.flushes.iter().any(|f| f.0 == device && f.3);
    inp.ooms
        .iter()
        .filter(|_| !fraction)
        .find(|o| o.pid == device && o.device_free.is_some())
        .and_then(|o| {
            Some(Capacity {
                bytes: o.device_free? + o.live_bytes,
                source: CapacitySource::InferredFromOom,
                upper: None,
            })
        })
        .or_else(|| {
            let &(_, bytes, upper, collection) = inp.flushes.iter().find(|f| f.0 == device)?;
            let source =
                if collection { CapacitySource::InferredFromCollection } else { CapacitySource::InferredFromFlushes };
            Some(Capacity { bytes, source, upper: Some(upper) })
        })
}

/// The running maximum of successful request sizes of a series, at each
/// time it rose: (t_ns, largest so far).
fn largest_requests(events: &crate::trace::event::Events, series: &Series, allocator_view: bool) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut max = 0;
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        if events.ret[i] != 0 || !kind.creates_block() || !crate::analysis::replay::tracks(kind, allocator_view) {
            continue;
        }
        if !series.has(events.pid[i]) {
            continue;
        }
        let size = events.requested_at(i).unwrap_or(events.size.at(i));
        if size > max {
            max = size;
            out.push((events.ts_ns.at(i), max));
        }
    }
    out
}

fn largest_at(list: &[(u64, u64)], t: u64) -> u64 {
    list.partition_point(|x| x.0 <= t).checked_sub(1).map_or(0, |i| list[i].1)
}

/// The OOM risk of every device, and each regular row's online OOM risk
/// (`Row::oom_risk_online`): snapshots per device, device-level traces
/// over all their processes at once.
pub(crate) fn evaluate(inp: &Inputs<'_>, rows: &mut [crate::analysis::result::Row]) -> Vec<Assessment> {
    // Each series: its device (None: all processes), and its regular rows
    // grouped by step.
    let mut out = Vec::new();
    for series in series_of(inp) {
        let device = series.device;
        let capacity = capacity_of(inp, &series);
        let requests = largest_requests(inp.events, &series, inp.allocator_view);
        let mut steps: Vec<(u32, Vec<usize>)> = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            if r.at_oom || !series.has(r.pid) {
                continue;
            }
            match steps.last_mut() {
                Some((s, idx)) if *s == r.step => idx.push(i),
                _ => steps.push((r.step, vec![i])),
            }
        }
        let oom_times: Vec<u64> = inp.ooms.iter().filter(|o| series.has(o.pid)).map(|o| o.t_ns).collect();
        let first_oom = oom_times.iter().copied().min();
        // The online risk is what a live monitor would have said: a
        // capacity inferred from an OOM is known from that OOM on, one
        // inferred from the cache flushes (whose times are not kept) only
        // at the end; before, the online risk is unknown.
        let known_from = capacity.map(|c| match c.source {
            CapacitySource::Given | CapacitySource::Recorded => 0,
            CapacitySource::InferredFromOom => first_oom.unwrap_or(u64::MAX),
            CapacitySource::InferredFromFlushes | CapacitySource::InferredFromCollection => u64::MAX,
        });
        let (mut peak, mut history) = (0u64, Vec::with_capacity(steps.len()));
        let mut last = State::default();
        for (k, (_, idx)) in steps.iter().enumerate() {
            let t = rows[idx[0]].t_ns;
            let r_now: u64 = idx.iter().map(|&i| r_value(&rows[i], inp.allocator_view)).sum();
            peak = peak.max(r_now);
            history.push(r_now as f64);
            let state = State {
                peak,
                reserved_now: idx.iter().map(|&i| rows[i].metrics.span_bytes).sum(),
                largest_free_now: idx.iter().map(|&i| rows[i].metrics.largest_gap).max().unwrap_or(0),
                largest_request: largest_at(&requests, t),
                trend_per_step: crate::analysis::predict::trend(&history, TREND_WINDOW),
                steps: k + 1,
                fragmentation: idx.iter().filter_map(|&i| rows[i].risk_online).max(),
                needed: false,
            };
            let level = match (first_oom, capacity) {
                (Some(o), _) if o <= t => OomRisk::Oom,
                (_, Some(c)) if known_from.is_some_and(|k| k <= t) => assess(c.bytes, &state).0,
                _ => OomRisk::Unknown,
            };
            for &i in idx {
                rows[i].oom_risk_online = Some(level);
            }
            last = state;
        }
        // The whole trace: the exact peak, every request.
        last.peak = match (&series.members, device) {
            // The GPU's processes: the most their rows held at one step,
            // and no less than the exact peak of each of them.
            (Some(m), _) => inp.peaks.iter().filter(|p| m.contains(&p.pid)).map(|p| p.bytes).fold(last.peak, u64::max),
            (None, Some(d)) => inp.peaks.iter().find(|p| p.pid == d).map_or(last.peak, |p| p.span_bytes.max(last.peak)),
            (None, None) => inp.peak_live_total.max(last.peak),
        };
        last.largest_request = requests.last().map_or(0, |x| x.1);
        last.fragmentation = inp.fragmentation.iter().filter(|(pid, _)| series.has(*pid)).filter_map(|x| x.1).max();
        let needs = device
            .filter(|_| inp.allocator_view && oom_times.is_empty() && series.members.is_none())
            .and_then(|d| inp.needed.iter().find(|x| x.0 == d))
            .map(|x| x.1);
        let mut a = match (needs, capacity) {
            (Some(n), Some(c)) => {
                // Judged at the budget's low end: the level holds for
                // every budget the recording allows.
                let at = Capacity { upper: None, ..c };
                // The replay that found it kept the cache's gaps, so the
                // fragmentation level raises nothing more.
                let needed = State { peak: n, fragmentation: None, needed: true, ..last };
                let mut a = assessment(device, Some(at), &needed, 0, true);
                let interval = c.upper.filter(|&hi| hi > c.bytes);
                // The interval stays what is known: no headroom is claimed
                // inside it.
                a.capacity = Some(c);
                if interval.is_some() {
                    a.headroom_bytes = None;
                }
                a.reason = format!(
                    "memory needed {} of {}{} (the smallest budget the requests fit in, replayed): {}",
                    crate::units::bytes(n),
                    crate::units::bytes(c.bytes),
                    interval.map_or(String::new(), |hi| format!("–{}, judged at its low end", crate::units::bytes(hi))),
                    a.reason.split_once(": ").map_or(a.reason.as_str(), |x| x.1)
                );
                a
            }
            _ => assessment(device, capacity, &last, oom_times.len() as u64, inp.allocator_view),
        };
        // A capacity that cache flushes bound is reached by what is
        // reserved: what was allocated says how much of it the program
        // itself needed.
        if inp.allocator_view
            && let Some(c) = capacity.filter(|c| c.source == CapacitySource::InferredFromFlushes)
        {
            let allocated: u64 = inp.peaks.iter().filter(|p| series.has(p.pid)).map(|p| p.bytes).sum();
            let hi = c.upper.unwrap_or(c.bytes).max(1);
            let (least, most) =
                (allocated as f64 / hi as f64 * 100.0, allocated as f64 / c.bytes.max(1) as f64 * 100.0);
            let share = if format!("{least:.0}") == format!("{most:.0}") {
                format!("{least:.0} %")
            } else {
                format!("{least:.0}–{most:.0} %")
            };
            a.reason = format!(
                "{}; peak allocated {} ({share}): the program's tensors never held more, so at least the rest was \
                 PyTorch's cache (memory it releases when the device is full, as it did here)",
                a.reason,
                crate::units::bytes(allocated)
            );
        }
        with_leak(&mut a, inp.leaks.iter().filter(|(pid, _)| series.has(*pid)).map(|&(_, g)| g));
        a.members = series.members;
        out.push(a);
    }
    out
}

/// A confirmed leak raises the risk to at least high where the capacity is
/// known: memory that grows every iteration runs out if the job runs long
/// enough, whatever share of the device the trace reached. With a known
/// headroom and the rise per iteration, the reason says how many more
/// iterations it lasts (`leak_iterations_left`: the fewest of the leaking
/// processes on the device, each at its own rise). Without a capacity the
/// level stays unknown, and the reason says that it leaks. `leaks`: the
/// rise per iteration of each leaking process of the series (None
/// without iterations).
fn with_leak(a: &mut Assessment, leaks: impl Iterator<Item = Option<u64>>) {
    let rises: Vec<Option<u64>> = leaks.collect();
    if rises.is_empty() || a.level >= OomRisk::Oom {
        return;
    }
    let b = crate::units::bytes;
    let fastest = rises.iter().flatten().copied().filter(|&g| g > 0).max();
    let per = fastest.map_or(String::new(), |g| format!(" {} per iteration", b(g)));
    let text = match (a.capacity, fastest, a.headroom_bytes) {
        (None, _, _) => format!("leaking{per} (Leaks): it runs out on any device if the job runs long enough"),
        (Some(_), Some(g), Some(h)) => {
            // The fastest rise empties the headroom first.
            let left = h / g;
            a.leak_iterations_left = Some(left);
            format!("leaking{per} (Leaks): the headroom of {} lasts about {left} more iterations", b(h))
        }
        (Some(_), _, _) => format!("leaking{per} (Leaks): it runs out if the job runs long enough"),
    };
    if a.capacity.is_some() && a.level < OomRisk::High {
        a.level = OomRisk::High;
        a.raised_by_leak = true;
    }
    a.reason = format!("{}; {text}", a.reason);
}

/// R's series value of a row: reserved bytes (snapshots), live bytes.
fn r_value(r: &crate::analysis::result::Row, allocator_view: bool) -> u64 {
    if allocator_view { r.alloc.map_or(r.metrics.span_bytes, |a| a.reserved_bytes) } else { r.metrics.live_bytes }
}

fn assessment(
    device: Option<u32>,
    capacity: Option<Capacity>,
    s: &State,
    ooms: u64,
    allocator_view: bool,
) -> Assessment {
    let b = crate::units::bytes;
    // How `assess` words a share ("87 % of the capacity in use at the
    // peak", "… of the budget needed to fit").
    const SHARE: &str = " % of the ";
    let peak_what = if allocator_view { "peak reserved" } else { "peak live" };
    let (level, reason) = match capacity {
        _ if ooms > 0 => (OomRisk::Oom, format!("{ooms} request{} failed", if ooms == 1 { "" } else { "s" })),
        None => (
            OomRisk::Unknown,
            "the device's capacity is not known: not recorded, not given with --capacity, and neither an `oom` entry nor a cache flush shows it"
                .to_string(),
        ),
        Some(c) if c.upper.is_some_and(|hi| hi > c.bytes) => {
            // An interval: judged at its top, where the least share is in
            // use, so that the level holds for every capacity in it.
            let hi = c.upper.unwrap_or(c.bytes);
            let (level, why) = assess(hi, &State { trend_per_step: 0.0, ..*s });
            let least = if hi == 0 { 100.0 } else { s.peak as f64 / hi as f64 * 100.0 };
            let most = if c.bytes == 0 { 100.0 } else { (s.peak as f64 / c.bytes as f64 * 100.0).min(100.0) };
            let why: Vec<String> = why
                .into_iter()
                .map(|w| match w.split_once(SHARE) {
                    Some((_, rest)) => format!("{least:.0}–{most:.0}{SHARE}{rest}"),
                    None => w,
                })
                .collect();
            (level, format!("{} {} of {}–{}: {}", peak_what, b(s.peak), b(c.bytes), b(hi), why.join("; ")))
        }
        Some(c) if c.is_lower_bound() => {
            // Only a least capacity is known: the share in use is at most
            // what it gives, and the headroom is not known, so no rise is
            // said to fill it.
            let (level, why) = assess(c.bytes, &State { trend_per_step: 0.0, ..*s });
            let why: Vec<String> = why
                .into_iter()
                .map(|w| if w.contains(SHARE) { format!("at most {w}") } else { w })
                .collect();
            (level, format!("{} {} of at least {}: {}", peak_what, b(s.peak), b(c.bytes), why.join("; ")))
        }
        Some(c) => {
            let (level, why) = assess(c.bytes, s);
            (level, format!("{} {} of {}: {}", peak_what, b(s.peak), b(c.bytes), why.join("; ")))
        }
    };
    Assessment {
        device,
        members: None,
        level,
        capacity,
        peak_bytes: s.peak,
        peak_what,
        headroom_bytes: capacity.filter(|c| !c.is_lower_bound()).map(|c| c.bytes.saturating_sub(s.peak)),
        leak_iterations_left: None,
        raised_by_leak: false,
        largest_request_bytes: s.largest_request,
        room_now_bytes: capacity.map(|c| s.largest_free_now.max(c.bytes.saturating_sub(s.reserved_now))),
        trend_bytes_per_step: s.trend_per_step,
        ooms,
        fragmentation_level: s.fragmentation,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn state(peak: u64) -> State {
        State { peak, reserved_now: peak, largest_request: MIB, steps: 10, ..State::default() }
    }

    fn flushes(lo: u64, hi: u64) -> Capacity {
        Capacity { bytes: lo, source: CapacitySource::InferredFromFlushes, upper: Some(hi) }
    }

    /// Cache flushes bound the capacity: an interval is said as one and
    /// judged at its top, with no headroom; an interval of one figure is
    /// the capacity, exactly.
    #[test]
    fn a_capacity_from_flushes_is_said_as_the_interval_it_is() {
        let a = assessment(Some(0), Some(flushes(2520 * MIB, 2540 * MIB)), &state(2520 * MIB), 0, true);
        assert!(a.reason.contains("of 2.46 GiB–2.48 GiB: 99–100 %"), "{}", a.reason);
        assert_eq!(a.headroom_bytes, None);
        let a = assessment(Some(0), Some(flushes(2540 * MIB, 2540 * MIB)), &state(2520 * MIB), 0, true);
        assert!(a.reason.contains("peak reserved 2.46 GiB of 2.48 GiB: 99 %"), "{}", a.reason);
        assert_eq!(a.headroom_bytes, Some(20 * MIB));
    }
}
