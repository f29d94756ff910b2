//! Memory per stage: for each `record_function` range a snapshot's
//! annotations name (`forward`, `backward`, `Optimizer.step#AdamW.step`,
//! …), what the allocator held while it ran — the question Mosaic's
//! per-annotation peaks answer, and the first one users ask after an OOM.
//!
//! Only the allocator view (a PyTorch snapshot, where the annotations and
//! the allocator's entries share one clock). For each stage, nested ones
//! as a tree by the ranges that enclose them, over all its runs:
//!
//! - peak allocated: the most the device's active blocks held (Σ block
//!   sizes, as PyTorch's `allocated_bytes` counts them) at any moment of
//!   a run, the state when it began included;
//! - added: that peak less what was allocated when the run began (what
//!   the stage itself needed on top of what it found);
//! - peak reserved: the most the segments held during a run;
//! - held at end: bytes of blocks allocated inside a run and still active
//!   when it ended (activations kept for the backward pass, a cache) —
//!   the most of any finished run;
//! - net at end: allocated when a run ended less allocated when it began
//!   (negative where it freed more than it kept: a backward pass freeing
//!   activations; near 0 where it replaced what it found, as an
//!   optimizer's `foreach` step does, however much it held at end) — the
//!   largest of any finished run;
//! - fragmentation at the peak: the metrics' external fragmentation (free
//!   ranges above `min_gap` inside the segments, over the reserved bytes)
//!   at the moment of the largest peak allocated;
//! - largest request: the most bytes one allocation asked for.
//!
//! A run is a `START` and the next `END` of the same name on the same
//! device; a `START` whose `END` the trace does not hold (the program died
//! inside it, or the snapshot was taken there) is a run to the trace's
//! end, counted as unfinished. Runs that began before the device's first
//! entry are left out (the history kept only its last entries): what was
//! allocated when they began is not in the trace.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::analysis::metrics::MetricsConfig;
use crate::trace::details::Annotation;
use crate::trace::event::{EventKind, Events};

/// One stage (a name at one place in the tree) of one device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Stage {
    pub device: u32,
    /// Names from the outermost enclosing stage to this one; numbered
    /// names (`ProfilerStep#12`) as `ProfilerStep#N`.
    pub path: Vec<String>,
    pub runs: u32,
    /// Runs whose `END` the trace does not hold.
    pub unfinished: u32,
    pub peak_allocated_bytes: u64,
    pub added_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// None when no run finished inside the trace.
    pub held_at_end_bytes: Option<u64>,
    /// Allocated at a run's end less at its start, the largest of any
    /// finished run (None when none finished).
    pub net_at_end_bytes: Option<i64>,
    /// None when the device had no reserved bytes at the peak.
    pub fragmentation_at_peak: Option<f64>,
    /// Reserved bytes at the moment of the peak allocated.
    pub reserved_at_peak_bytes: u64,
    pub peak_t_ns: u64,
    pub largest_request_bytes: u64,
    /// Start of the first run.
    pub first_t_ns: u64,
    /// Each run's start and end (an unfinished run's end: the trace's last
    /// entry), for the view's stage bands; not in report.json.
    #[serde(skip)]
    pub spans: Vec<(u64, u64)>,
}

impl Stage {
    pub fn name(&self) -> &str {
        self.path.last().map_or("", String::as_str)
    }

    pub fn depth(&self) -> usize {
        self.path.len().saturating_sub(1)
    }
}

/// The stages of a trace, in tree order (each stage before the stages it
/// encloses, siblings by their first run).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stages {
    pub stages: Vec<Stage>,
    /// Runs left out because they began before their device's first entry.
    pub before_trace: u32,
}

/// A name as stages group it: a trailing `#<number>` (`ProfilerStep#12`)
/// becomes `#N`, so every step is one stage.
pub fn stage_name(name: &str) -> String {
    match name.rsplit_once('#') {
        Some((head, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => format!("{head}#N"),
        _ => name.to_string(),
    }
}

/// One run of a stage while the events are walked.
#[derive(Clone, Debug)]
struct Run {
    device: u32,
    path: usize,
    start_t: u64,
    end_t: Option<u64>,
    /// First event inside, and one past the last (None: no `END`).
    start_i: usize,
    end_i: Option<usize>,
    alloc_start: u64,
    peak_alloc: u64,
    /// The event after which the peak held (None: the state before any).
    peak_i: Option<usize>,
    peak_t: u64,
    reserved_at_peak: u64,
    peak_reserved: u64,
    /// Bytes freed inside the run of blocks allocated before it.
    freed_old: u64,
    held: Option<u64>,
    net: Option<i64>,
    largest: u64,
}

/// A stage's place: its device and the names from the outermost range.
type Path = (u32, Vec<String>);

/// The runs of `annotations` (placed ones: on the events' clock) over
/// `events` (time-sorted, the allocator view), with the paths they name,
/// and how many runs began before their device's first entry.
fn runs(events: &Events, annotations: &[Annotation]) -> (Vec<Run>, Vec<Path>, u32) {
    let mut by_device: BTreeMap<u32, Vec<&Annotation>> = BTreeMap::new();
    for a in annotations {
        by_device.entry(a.device).or_default().push(a);
    }
    // The first entry of each device: runs that began before it are left out.
    let mut first: BTreeMap<u32, u64> = BTreeMap::new();
    for i in 0..events.len() {
        first.entry(events.pid[i]).or_insert(events.ts_ns.at(i));
    }
    let mut paths: Vec<Path> = Vec::new();
    let mut path_ids: ahash::AHashMap<Path, usize> = Default::default();
    let mut out: Vec<Run> = Vec::new();
    let mut before = 0u32;
    for (device, mut list) in by_device {
        let Some(&t0) = first.get(&device) else { continue };
        list.sort_by_key(|a| a.t_ns);
        // Open runs, innermost last: (name, index in `out` or None when left out).
        let mut open: Vec<(String, Option<usize>)> = Vec::new();
        for a in list {
            let name = stage_name(&a.name);
            if a.stage == "START" {
                if a.t_ns < t0 {
                    before += 1;
                    open.push((name, None));
                    continue;
                }
                // The innermost enclosing run's path, this name below it.
                let parent = open.iter().rev().find_map(|(_, r)| *r);
                let mut path: Vec<String> = parent.map_or_else(Vec::new, |r| paths[out[r].path].1.clone());
                path.push(name.clone());
                let key = (device, path);
                let id = *path_ids.entry(key.clone()).or_insert_with(|| {
                    paths.push(key);
                    paths.len() - 1
                });
                let start_i = events.ts_ns.partition_point(|t| t < a.t_ns);
                out.push(Run {
                    device,
                    path: id,
                    start_t: a.t_ns,
                    end_t: None,
                    start_i,
                    end_i: None,
                    alloc_start: 0,
                    peak_alloc: 0,
                    peak_i: None,
                    peak_t: a.t_ns,
                    reserved_at_peak: 0,
                    peak_reserved: 0,
                    freed_old: 0,
                    held: None,
                    net: None,
                    largest: 0,
                });
                open.push((name, Some(out.len() - 1)));
            } else if a.stage == "END"
                && let Some(at) = open.iter().rposition(|(n, _)| *n == name)
                && let (_, Some(r)) = open.remove(at)
            {
                out[r].end_t = Some(a.t_ns);
                out[r].end_i = Some(events.ts_ns.partition_point(|t| t <= a.t_ns).max(out[r].start_i));
            }
        }
    }
    (out, paths, before)
}

/// Whether the stage walk reads events of this kind.
fn reads(kind: EventKind) -> bool {
    use EventKind::*;
    matches!(kind, BlockAlloc | BlockFree | SegmentAlloc | SegmentFree | SegmentMap | SegmentUnmap)
}

/// The stages of `events` (time-sorted, the allocator view) that the
/// placed `annotations` mark.
pub fn find(events: &Events, annotations: &[Annotation], cfg: &MetricsConfig) -> Stages {
    if annotations.is_empty() {
        return Stages::default();
    }
    let (mut runs, paths, before_trace) = runs(events, annotations);
    if runs.is_empty() {
        return Stages { stages: Vec::new(), before_trace };
    }
    walk(events, &mut runs);
    // Per path: the runs together.
    let mut stages: Vec<Option<Stage>> = vec![None; paths.len()];
    let mut peak_of: Vec<Option<usize>> = vec![None; paths.len()];
    for r in &runs {
        let (device, path) = &paths[r.path];
        let s = stages[r.path].get_or_insert_with(|| Stage {
            device: *device,
            path: path.clone(),
            runs: 0,
            unfinished: 0,
            peak_allocated_bytes: 0,
            added_bytes: 0,
            peak_reserved_bytes: 0,
            held_at_end_bytes: None,
            net_at_end_bytes: None,
            fragmentation_at_peak: None,
            reserved_at_peak_bytes: 0,
            peak_t_ns: r.peak_t,
            largest_request_bytes: 0,
            first_t_ns: r.start_t,
            spans: Vec::new(),
        });
        let last = events.ts_ns.last().unwrap_or(r.start_t);
        s.spans.push((r.start_t, r.end_t.unwrap_or(last).max(r.start_t)));
        s.runs += 1;
        s.unfinished += u32::from(r.end_i.is_none());
        if s.runs == 1 || r.peak_alloc > s.peak_allocated_bytes {
            s.peak_allocated_bytes = r.peak_alloc;
            s.reserved_at_peak_bytes = r.reserved_at_peak;
            s.peak_t_ns = r.peak_t;
            peak_of[r.path] = r.peak_i;
        }
        s.added_bytes = s.added_bytes.max(r.peak_alloc - r.alloc_start.min(r.peak_alloc));
        s.peak_reserved_bytes = s.peak_reserved_bytes.max(r.peak_reserved);
        if let Some(h) = r.held {
            s.held_at_end_bytes = Some(s.held_at_end_bytes.map_or(h, |x| x.max(h)));
        }
        if let Some(n) = r.net {
            s.net_at_end_bytes = Some(s.net_at_end_bytes.map_or(n, |x| x.max(n)));
        }
        s.largest_request_bytes = s.largest_request_bytes.max(r.largest);
        s.first_t_ns = s.first_t_ns.min(r.start_t);
    }
    let probes: Vec<(usize, u32)> =
        paths.iter().enumerate().filter_map(|(p, (device, _))| peak_of[p].map(|i| (i, *device))).collect();
    let frag = fragmentation_at(events, &probes, cfg);
    let mut stages: Vec<Stage> = stages
        .into_iter()
        .zip(&peak_of)
        .filter_map(|(s, peak)| {
            let mut s = s?;
            s.fragmentation_at_peak = peak.and_then(|i| frag.get(&(i, s.device)).copied().flatten());
            Some(s)
        })
        .collect();
    // Tree order: by the first-run times of each level of the path.
    let first: ahash::AHashMap<(u32, Vec<String>), u64> =
        stages.iter().map(|s| ((s.device, s.path.clone()), s.first_t_ns)).collect();
    let key = |s: &Stage| -> (u32, Vec<(u64, String)>) {
        let levels = (1..=s.path.len())
            .map(|n| {
                let prefix = s.path[..n].to_vec();
                (first.get(&(s.device, prefix)).copied().unwrap_or(s.first_t_ns), s.path[n - 1].clone())
            })
            .collect();
        (s.device, levels)
    };
    stages.sort_by_cached_key(key);
    Stages { stages, before_trace }
}

/// Walks the events once, each run's figures gathered while it is open.
fn walk(events: &Events, runs: &mut [Run]) {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by_key(|&r| runs[r].start_i);
    let mut next = 0usize;
    let mut open: Vec<usize> = Vec::new();
    // Per device: allocated and reserved bytes; live blocks (size, birth).
    let mut allocated: ahash::AHashMap<u32, u64> = Default::default();
    let mut reserved: ahash::AHashMap<u32, u64> = Default::default();
    let mut live: ahash::AHashMap<(u32, u64), (u64, usize)> = Default::default();
    let close = |r: &mut Run, allocated: &ahash::AHashMap<u32, u64>| {
        if r.end_i.is_some() {
            let now = allocated.get(&r.device).copied().unwrap_or(0);
            r.held = Some(now.saturating_sub(r.alloc_start.saturating_sub(r.freed_old)));
            r.net = Some(now as i64 - r.alloc_start as i64);
        }
    };
    for i in 0..=events.len() {
        while next < order.len() && runs[order[next]].start_i <= i {
            let r = &mut runs[order[next]];
            let a = allocated.get(&r.device).copied().unwrap_or(0);
            let res = reserved.get(&r.device).copied().unwrap_or(0);
            (r.alloc_start, r.peak_alloc, r.peak_i) = (a, a, i.checked_sub(1));
            (r.reserved_at_peak, r.peak_reserved) = (res, res);
            open.push(order[next]);
            next += 1;
        }
        open.retain(|&r| {
            let run = &mut runs[r];
            let ended = i == events.len() || run.end_i.is_some_and(|e| e <= i);
            if ended {
                close(run, &allocated);
            }
            !ended
        });
        if i == events.len() {
            break;
        }
        let Some(kind) = events.kind[i].filter(|&k| reads(k)) else { continue };
        if events.ret[i] != 0 {
            continue;
        }
        let (device, addr, size) = (events.pid[i], events.addr.at(i), events.size.at(i));
        let mut freed_birth = None;
        match kind {
            EventKind::BlockAlloc if size > 0 => {
                if let Some((old, _)) = live.insert((device, addr), (size, i)) {
                    *allocated.entry(device).or_default() -= old;
                }
                *allocated.entry(device).or_default() += size;
            }
            EventKind::BlockFree => {
                if let Some((old, birth)) = live.remove(&(device, addr)) {
                    *allocated.entry(device).or_default() -= old;
                    freed_birth = Some((old, birth));
                }
            }
            EventKind::SegmentAlloc | EventKind::SegmentMap => *reserved.entry(device).or_default() += size,
            EventKind::SegmentFree | EventKind::SegmentUnmap => {
                let r = reserved.entry(device).or_default();
                *r = r.saturating_sub(size);
            }
            _ => {}
        }
        let (a, res) = (allocated.get(&device).copied().unwrap_or(0), reserved.get(&device).copied().unwrap_or(0));
        for &r in &open {
            let run = &mut runs[r];
            if run.device != device {
                continue;
            }
            if a > run.peak_alloc {
                (run.peak_alloc, run.peak_i, run.peak_t, run.reserved_at_peak) = (a, Some(i), events.ts_ns.at(i), res);
            }
            run.peak_reserved = run.peak_reserved.max(res);
            if kind == EventKind::BlockAlloc {
                let requested = events.requested_at(i).unwrap_or(size);
                run.largest = run.largest.max(requested);
            }
            if let Some((old, birth)) = freed_birth
                && birth < run.start_i
            {
                run.freed_old += old;
            }
        }
    }
}

/// The external fragmentation of each `(event, device)` in `probes`: the
/// free ranges inside the device's segments larger than `min_gap`, over
/// its reserved bytes, just after that event (None: nothing reserved).
fn fragmentation_at(
    events: &Events,
    probes: &[(usize, u32)],
    cfg: &MetricsConfig,
) -> ahash::AHashMap<(usize, u32), Option<f64>> {
    let mut probes = probes.to_vec();
    probes.sort_unstable();
    probes.dedup();
    let mut out = ahash::AHashMap::default();
    // Per device: segments (start → end, mapped), live blocks (addr → size).
    let mut segments: BTreeMap<u32, BTreeMap<u64, (u64, bool)>> = BTreeMap::new();
    let mut blocks: BTreeMap<u32, BTreeMap<u64, u64>> = BTreeMap::new();
    let mut p = 0usize;
    for i in 0..events.len() {
        if p >= probes.len() {
            break;
        }
        if let Some(kind) = events.kind[i].filter(|&k| reads(k))
            && events.ret[i] == 0
        {
            let (device, addr, size) = (events.pid[i], events.addr.at(i), events.size.at(i));
            let segs = segments.entry(device).or_default();
            let live = blocks.entry(device).or_default();
            match kind {
                EventKind::BlockAlloc if size > 0 => {
                    live.insert(addr, size);
                }
                EventKind::BlockFree => {
                    live.remove(&addr);
                }
                EventKind::SegmentAlloc => {
                    segs.insert(addr, (addr + size, false));
                }
                EventKind::SegmentMap => map(segs, addr, addr + size),
                EventKind::SegmentFree => {
                    segs.remove(&addr);
                }
                EventKind::SegmentUnmap => unmap(segs, addr, addr + size),
                _ => {}
            }
        }
        while p < probes.len() && probes[p].0 == i {
            let d = probes[p].1;
            let (segs, live) = (segments.get(&d), blocks.get(&d));
            out.insert(probes[p], segs.and_then(|s| external_fragmentation(s, live, cfg)));
            p += 1;
        }
    }
    out
}

/// Adds mapped pages [a, b), joined with mapped ranges they touch (an
/// expandable segment is one range however many pages mapped it).
fn map(segs: &mut BTreeMap<u64, (u64, bool)>, a: u64, b: u64) {
    let (mut s, mut e) = (a, b);
    if let Some((&ps, &(pe, true))) = segs.range(..a).next_back()
        && pe == a
    {
        segs.remove(&ps);
        s = ps;
    }
    if let Some(&(ne, true)) = segs.get(&b) {
        segs.remove(&b);
        e = ne;
    }
    segs.insert(s, (e, true));
}

/// Removes mapped pages [a, b) from the range holding them.
fn unmap(segs: &mut BTreeMap<u64, (u64, bool)>, a: u64, b: u64) {
    let Some((&s, &(e, mapped))) = segs.range(..=a).next_back() else { return };
    if e < b {
        return;
    }
    segs.remove(&s);
    if s < a {
        segs.insert(s, (a, mapped));
    }
    if b < e {
        segs.insert(b, (e, mapped));
    }
}

fn external_fragmentation(
    segs: &BTreeMap<u64, (u64, bool)>,
    live: Option<&BTreeMap<u64, u64>>,
    cfg: &MetricsConfig,
) -> Option<f64> {
    let (mut span, mut gaps) = (0u64, 0u64);
    for (&s, &(e, _)) in segs {
        span += e - s;
        let mut prev = s;
        for (&a, &size) in live.into_iter().flat_map(|l| l.range(s..e)) {
            let g = a.saturating_sub(prev);
            if cfg.is_gap(g) {
                gaps += g;
            }
            prev = prev.max(a + size);
        }
        let g = e.saturating_sub(prev);
        if cfg.is_gap(g) {
            gaps += g;
        }
    }
    (span > 0).then(|| gaps as f64 / span as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::event::Event;

    fn ann(stage: &str, name: &str, t: u64) -> Annotation {
        Annotation { stage: stage.into(), name: name.into(), device: 0, t_ns: t }
    }

    fn ev(events: &mut Events, t: u64, kind: EventKind, addr: u64, size: u64) {
        let mut e = Event::new(t, 0, kind, addr, size);
        e.extra.requested = Some(size);
        events.push(&e);
    }

    const MB: u64 = 1 << 20;

    /// forward ⊃ layer: the figures by hand.
    #[test]
    fn nested_stages_by_hand() {
        let mut e = Events::default();
        ev(&mut e, 1, EventKind::SegmentAlloc, 0, 20 * MB);
        ev(&mut e, 2, EventKind::BlockAlloc, 0, 4 * MB); // weights, before any stage
        // forward [10, 50]: layer [20, 30] inside.
        ev(&mut e, 21, EventKind::BlockAlloc, 4 * MB, 6 * MB);
        ev(&mut e, 22, EventKind::BlockAlloc, 10 * MB, 2 * MB); // kept: the activation
        ev(&mut e, 25, EventKind::BlockFree, 4 * MB, 6 * MB);
        ev(&mut e, 40, EventKind::BlockFree, 0, 4 * MB); // an old block freed inside forward
        ev(&mut e, 41, EventKind::SegmentAlloc, 64 * MB, 20 * MB);
        ev(&mut e, 42, EventKind::BlockAlloc, 64 * MB, 8 * MB);
        ev(&mut e, 45, EventKind::BlockFree, 64 * MB, 8 * MB);
        ev(&mut e, 60, EventKind::BlockAlloc, 0, MB);
        let a = [
            ann("START", "forward", 10),
            ann("START", "layer", 20),
            ann("END", "layer", 30),
            ann("END", "forward", 50),
        ];
        let s = find(&e, &a, &MetricsConfig::default());
        assert_eq!(s.stages.len(), 2);
        let (fwd, layer) = (&s.stages[0], &s.stages[1]);
        assert_eq!(fwd.path, ["forward"]);
        assert_eq!(layer.path, ["forward", "layer"]);
        // layer: 4 MB at its start, 4 + 6 + 2 = 12 at the peak (t 22).
        assert_eq!(layer.peak_allocated_bytes, 12 * MB);
        assert_eq!(layer.added_bytes, 8 * MB);
        assert_eq!(layer.peak_reserved_bytes, 20 * MB);
        assert_eq!(layer.held_at_end_bytes, Some(2 * MB));
        assert_eq!(layer.net_at_end_bytes, Some(2 * MB as i64));
        assert_eq!(layer.largest_request_bytes, 6 * MB);
        assert_eq!(layer.peak_t_ns, 22);
        // At t 22: segment [0, 20) holds [0, 4), [4, 10), [10, 12): free [12, 20).
        assert_eq!(layer.fragmentation_at_peak, Some(8.0 / 20.0));
        // forward: peak 12 MB at t 22 (at t 42: 2 + 8 = 10); reserved 40 MB;
        // held: the 2 MB activation (the old 4 MB block it freed is not its own).
        assert_eq!(fwd.peak_allocated_bytes, 12 * MB);
        assert_eq!(fwd.peak_reserved_bytes, 40 * MB);
        assert_eq!(fwd.held_at_end_bytes, Some(2 * MB));
        // Net: 2 MB kept less the 4 MB old block it freed.
        assert_eq!(fwd.net_at_end_bytes, Some(-2 * MB as i64));
        assert_eq!(fwd.largest_request_bytes, 8 * MB);
        assert_eq!(fwd.runs, 1);
        assert_eq!(fwd.unfinished, 0);
    }

    #[test]
    fn runs_group_by_name_and_an_unended_run_is_unfinished() {
        let mut e = Events::default();
        ev(&mut e, 1, EventKind::SegmentAlloc, 0, 20 * MB);
        ev(&mut e, 11, EventKind::BlockAlloc, 0, 2 * MB);
        ev(&mut e, 12, EventKind::BlockFree, 0, 2 * MB);
        ev(&mut e, 21, EventKind::BlockAlloc, 0, 5 * MB);
        let a = [
            ann("START", "ProfilerStep#1", 10),
            ann("END", "ProfilerStep#1", 15),
            ann("START", "ProfilerStep#2", 20),
            // A run that began before the first entry is left out.
            ann("START", "setup", 0),
        ];
        let s = find(&e, &a, &MetricsConfig::default());
        assert_eq!(s.before_trace, 1);
        let [step] = s.stages.as_slice() else { panic!("{:?}", s.stages) };
        assert_eq!(step.path, ["ProfilerStep#N"]);
        assert_eq!((step.runs, step.unfinished), (2, 1));
        assert_eq!(step.peak_allocated_bytes, 5 * MB);
        // Only the finished run held nothing at its end.
        assert_eq!(step.held_at_end_bytes, Some(0));
    }

    #[test]
    fn mapped_pages_are_one_range() {
        let mut e = Events::default();
        ev(&mut e, 1, EventKind::SegmentMap, 0, 2 * MB);
        ev(&mut e, 2, EventKind::SegmentMap, 2 * MB, 2 * MB);
        ev(&mut e, 3, EventKind::BlockAlloc, 0, MB);
        ev(&mut e, 4, EventKind::BlockAlloc, 3 * MB, MB);
        let a = [ann("START", "s", 2), ann("END", "s", 5)];
        let s = find(&e, &a, &MetricsConfig::default());
        // One 4 MB range: free [1, 3) MB is one 2 MB gap.
        assert_eq!(s.stages[0].fragmentation_at_peak, Some(0.5));
        assert_eq!(stage_name("ProfilerStep#12"), "ProfilerStep#N");
        assert_eq!(stage_name("Optimizer.step#AdamW.step"), "Optimizer.step#AdamW.step");
    }
}
