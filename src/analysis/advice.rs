//! Advice: what to do, from the analysis's own evidence. `report.json`'s
//! `advice` and `report.md`'s Advice render this list.
//!
//! How it is chosen:
//! - **OOMs, with a what-if replay** ([`crate::analysis::whatif`]): every
//!   allocator setting advised comes from the replay, with its simulated
//!   figures. A setting whose replay removes every recorded OOM is advised
//!   (`removes_ooms: true`), the lowest peak reserved first; one that only
//!   reduces them says so; one the replay shows failing is never advised.
//!   When no setting tried removes the OOMs, that comes first, then what
//!   pins the memory — the live blocks that keep partly used segments (or
//!   expandable pages) from being released, by call site, with counts and
//!   sizes — and what would help in the program. A setting that only lowers
//!   peak reserved is a secondary saving, stated as such.
//! - **OOMs, no replay** (no snapshot and no device-level requests to
//!   replay), or a replay without a capacity (where no scenario can run
//!   out of memory, so none can be said to avoid the OOMs): what a setting
//!   usually does, marked as not simulated.
//! - **Program patterns**: a tensor regrown by concatenation at every step
//!   (one call site whose allocations grow by a constant size, each size
//!   allocated in its turn, from the smallest to the largest) calls for a
//!   buffer allocated once at its final size.
//! - **Leaks** and an **OOM risk** of high or more without an OOM. Without
//!   an OOM a leak is the first advice, then the risk, then the program's
//!   patterns, and a setting's saving last.

use std::collections::BTreeMap;

use crate::analysis::oom::OomClass;
use crate::analysis::result::Analysis;
pub use crate::analysis::result::{Advice, Kind};
use crate::analysis::risk::OomRisk;
use crate::trace::event::{EventKind, Events};
use crate::units::bytes;

/// The advice for an analysed trace (`events`: its events, for the
/// program's patterns and what pins memory at an OOM).
pub fn advise(a: &Analysis, events: &Events) -> Vec<Advice> {
    let mut out = Vec::new();
    if !a.ooms.is_empty() {
        // Without a capacity no scenario can run out of memory: the replay
        // cannot say which setting avoids these OOMs.
        match a.whatif.as_ref().filter(|w| w.scenarios.len() > 1) {
            Some(w) if w.capacity.is_some() => match &w.unreproduced {
                None => from_replay(a, w, events, &mut out),
                Some(why) => {
                    out.push(Advice::new(
                        Kind::Generic,
                        format!(
                            "The what-if replay does not reproduce the recorded OOMs ({why}), so it cannot say which setting would avoid them; none is claimed to."
                        ),
                    ));
                    generic(a, "the replay cannot judge these OOMs (above)", &mut out);
                }
            },
            Some(_) => {
                out.push(Advice::new(
                    Kind::Generic,
                    "The what-if replay cannot tell which allocator setting would avoid these OOMs: the device's capacity is unknown, so no scenario can run out of memory. Pass `--capacity` (the GPU's total memory) to classify the OOMs and to replay the settings against them.".into(),
                ));
                generic(a, "the replay cannot judge these OOMs (above)", &mut out);
            }
            None if a.whatif_not_run.is_some() => {
                out.push(Advice::new(
                    Kind::Generic,
                    "No allocator setting is judged here: this recording holds PyTorch's segments, not its requests \
                     (What the allocator settings would change). Record again with this version of `fragscope record`, \
                     without `--no-torch`: its probes on PyTorch's allocator see every tensor. Or dump a memory \
                     snapshot."
                        .into(),
                ));
                generic(a, "no what-if replay ran", &mut out);
            }
            None => generic(a, "no what-if replay ran", &mut out),
        }
        if let Some(o) = a.ooms.iter().find(|o| o.class == OomClass::Capacity) {
            let peak = a.peaks.iter().find(|p| p.pid == o.pid).map_or(0, |p| p.bytes);
            out.push(Advice::new(
                Kind::Capacity,
                format!(
                    "Capacity OOMs: a request of {} met only {} free; live memory of {} {} peaked at {}. Defragmenting will not help: reduce the batch, checkpoint activations or offload.",
                    bytes(o.requested),
                    bytes(o.device_free.unwrap_or(0)),
                    a.unit(),
                    o.pid,
                    bytes(peak)
                ),
            ));
        }
    } else if let Some(w) = a.whatif.as_ref()
        && w.capacity.is_some()
        && !w.capacity_inferred
        && !w.capacity_from_flushes
        && w.scenarios.first().is_some_and(|s| s.ooms > 0)
    {
        // No OOM was recorded, but under the capacity given or recorded
        // (a smaller device than the recording's, with --capacity) the
        // replay of the recorded settings fails: the question is then
        // whether it fits. (A capacity inferred from the trace itself
        // holds what it did.)
        let (recorded, cap) = (&w.scenarios[0], w.capacity.unwrap_or(0));
        let head = format!(
            "No OOM in this trace, but under the capacity of {} a replay of its requests under the recorded settings \
             fails {} time{}",
            bytes(cap),
            recorded.ooms,
            if recorded.ooms == 1 { "" } else { "s" }
        );
        let s = &w.scenarios[w.recommended.0];
        if w.recommended.0 != 0 && s.ooms < recorded.ooms {
            out.push(Advice {
                kind: Kind::Setting,
                text: format!(
                    "{head}; {} fails {} (peak reserved {}) in the same replay.",
                    crate::analysis::whatif::conf_md(&w.recommendation()),
                    if s.ooms == 0 { "never".to_string() } else { format!("{} times", s.ooms) },
                    bytes(s.peak_reserved_bytes)
                ),
                conf: Some(w.recommendation()),
                simulated: true,
                removes_ooms: Some(s.ooms == 0),
            });
        } else {
            out.push(Advice::new(
                Kind::NoSetting,
                format!(
                    "{head}, and no allocator setting tried fails less: to fit it, hold less memory at the peak (a \
                     smaller batch, activations checkpointed, offloading)."
                ),
            ));
        }
    } else if let Some(w) = a.whatif.as_ref()
        && w.recommended.0 != 0
    {
        let s = &w.scenarios[w.recommended.0];
        out.push(Advice {
            kind: Kind::Saving,
            text: format!(
                "No OOM here. {} would reserve less in a replay of this trace's requests: peak reserved {} instead of {}{} — a saving, not a fix.",
                crate::analysis::whatif::conf_md(&w.recommendation()),
                bytes(s.peak_reserved_bytes),
                bytes(w.scenarios[0].peak_reserved_bytes),
                match s.at_high.as_deref().filter(|_| s.depends_on_budget() || w.scenarios[0].depends_on_budget()) {
                    Some(h) => format!(
                        " at the budget's low end ({} instead of {} at its high end)",
                        bytes(h.peak_reserved_bytes),
                        bytes(w.scenarios[0].at_high.as_deref().map_or(0, |r| r.peak_reserved_bytes))
                    ),
                    None => String::new(),
                }
            ),
            conf: Some(w.recommendation()),
            simulated: true,
            removes_ooms: None,
        });
    }
    // Releases by garbage collection alone are no flush.
    for (w, (d, f)) in a.whatif.iter().flat_map(|w| w.flushes.iter().filter(|f| f.1.count > 0).map(move |f| (w, f))) {
        out.push(Advice::new(
            Kind::Flush,
            format!(
                "Device {d} ran full {} time{}: PyTorch {} ({} segments, {}) and asked CUDA again; each `cudaFree` synchronizes the device — slow, and the sign that the next larger request may fail. {}",
                f.count,
                if f.count == 1 { "" } else { "s" },
                w.release_phrase(),
                f.segments_freed,
                bytes(f.bytes_freed),
                // Only a setting the replay recommends is pointed to.
                if w.recommended.0 != 0 {
                    format!(
                        "The replay recommends {} (What the allocator settings would change); a smaller batch helps too.",
                        crate::analysis::whatif::conf_md(&w.recommendation())
                    )
                } else {
                    "The replay recommends no allocator setting (What the allocator settings would change says why): less memory held at the peak (a smaller batch, activations checkpointed) avoids it.".to_string()
                }
            ),
        ));
    }
    if let Some(st) = a.trace.stacks.as_deref() {
        out.extend(regrown_tensors(events, st));
    }
    for l in a.leaks.iter().filter(|l| l.leaking) {
        let mut site = l.top_sites.first().map_or(String::new(), |s| format!(", most of it from `{}`", s.site));
        let per = l
            .growth_per_iteration_bytes
            .map_or(String::new(), |g| format!(" ({} per iteration)", bytes(g.max(0) as u64)));
        if let Some(x) = a.oom_risk.iter().find(|x| x.covers(l.pid))
            && let (Some(left), Some(h)) = (x.leak_iterations_left, x.headroom_bytes)
        {
            site.push_str(&format!("; the headroom of {} lasts about {left} more iterations at that rate", bytes(h)));
        }
        out.push(Advice::new(
            Kind::Leak,
            format!(
                "{} {} leaks: its floor grew by {}{per}{site}. Free what each step keeps (a list of tensors that holds their graph, a cache without a bound), or keep Python numbers (`.item()`) instead of tensors.",
                a.unit(),
                l.pid,
                bytes(l.growth_bytes.max(0) as u64)
            ),
        ));
    }
    if a.ooms.is_empty()
        && let Some(x) =
            a.oom_risk.iter().filter(|x| x.level >= OomRisk::High && !x.raised_by_leak).max_by_key(|x| x.level)
    {
        out.push(Advice::new(
            Kind::Risk,
            format!("No OOM in this trace, but the OOM risk is {}: {}.", x.level.name(), x.reason),
        ));
    }
    // Without an OOM, what will run out comes first (a leak, then a high
    // OOM risk), then what the program could change, and a setting's
    // saving, only a saving, last.
    if a.ooms.is_empty() {
        out.sort_by_key(|x| match x.kind {
            Kind::Leak => 0,
            Kind::Risk => 1,
            Kind::Pattern | Kind::Program => 2,
            Kind::Saving => 4,
            _ => 3,
        });
    }
    out
}

/// Advice from the what-if replay of a trace with OOMs.
fn from_replay(a: &Analysis, w: &crate::analysis::whatif::Whatif, events: &Events, out: &mut Vec<Advice>) {
    let recorded = &w.scenarios[0];
    let rec_ooms = recorded.ooms.max(a.ooms.len() as u64);
    let line = |conf: &[String]| crate::analysis::whatif::conf_line(&w.recorded_conf, conf);
    let mut fixes: Vec<&crate::analysis::whatif::Scenario> =
        w.scenarios[1..].iter().filter(|s| s.ooms == 0 && !s.conf.is_empty()).collect();
    // The lowest peak first; at the same peak, settings real runs checked.
    fixes.sort_by_key(|s| (s.peak_reserved_bytes, s.unchecked_pair));
    for s in &fixes {
        let mut tight =
            crate::analysis::whatif::tight_margin(w.capacity, s).map_or(String::new(), |t| format!(", {t}"));
        if s.unchecked_pair {
            tight.push_str(&format!("; {}", crate::analysis::whatif::UNCHECKED));
        }
        out.push(Advice {
            kind: Kind::Setting,
            text: format!(
                "{} removes every OOM in a replay of this trace's requests (0 instead of {rec_ooms}; peak reserved {}{tight}).",
                crate::analysis::whatif::conf_md(&line(&s.conf)),
                bytes(s.peak_reserved_bytes)
            ),
            conf: Some(line(&s.conf)),
            simulated: true,
            removes_ooms: Some(true),
        });
    }
    if fixes.is_empty() {
        let tried: Vec<String> = w.scenarios[1..]
            .iter()
            .filter(|s| !crate::analysis::whatif::is_recorded(&w.recorded_conf, &s.conf))
            .map(|s| crate::analysis::whatif::scenario_label(&w.recorded_conf, &s.conf))
            .collect();
        out.push(Advice {
            kind: Kind::NoSetting,
            text: format!(
                "No allocator setting tried removes the OOM: in the replay, {} still fail{}. The program itself must change.",
                tried.join("; "),
                if tried.len() == 1 { "s" } else { "" }
            ),
            conf: None,
            simulated: true,
            removes_ooms: Some(false),
        });
        if let Some(p) = pinned(a, events) {
            out.push(p);
        }
        fewer(w, rec_ooms, out);
        // A lower peak reserved with the same OOMs: a saving only.
        if let Some(s) = w.scenarios[1..]
            .iter()
            .filter(|s| {
                s.ooms >= rec_ooms
                    && s.peak_reserved_bytes < recorded.peak_reserved_bytes
                    && s.flushes <= recorded.flushes
            })
            .min_by_key(|s| (s.peak_reserved_bytes, s.unchecked_pair))
        {
            out.push(Advice {
                kind: Kind::Saving,
                text: format!(
                    "{} would reserve {} less at the peak ({} instead of {}) but still runs out of memory in the replay: a secondary saving, not a fix{}.",
                    crate::analysis::whatif::conf_md(&line(&s.conf)),
                    bytes(recorded.peak_reserved_bytes - s.peak_reserved_bytes),
                    bytes(s.peak_reserved_bytes),
                    bytes(recorded.peak_reserved_bytes),
                    if s.unchecked_pair { format!(" ({})", crate::analysis::whatif::UNCHECKED) } else { String::new() }
                ),
                conf: Some(line(&s.conf)),
                simulated: true,
                removes_ooms: Some(false),
            });
        }
    }
}

/// The settings whose replay leaves fewer OOMs, but some: said as such.
fn fewer(w: &crate::analysis::whatif::Whatif, rec_ooms: u64, out: &mut Vec<Advice>) {
    let line = |conf: &[String]| crate::analysis::whatif::conf_line(&w.recorded_conf, conf);
    let mut fewer: Vec<&crate::analysis::whatif::Scenario> =
        w.scenarios[1..].iter().filter(|s| s.ooms > 0 && s.ooms < rec_ooms && !s.conf.is_empty()).collect();
    fewer.sort_by_key(|s| (s.ooms, s.peak_reserved_bytes));
    for s in fewer.iter().take(2) {
        out.push(Advice {
            kind: Kind::Setting,
            text: format!(
                "{} leaves {} of the {rec_ooms} OOMs in the replay (peak reserved {}): fewer, not none{}.",
                crate::analysis::whatif::conf_md(&line(&s.conf)),
                s.ooms,
                bytes(s.peak_reserved_bytes),
                if s.unchecked_pair { format!("; {}", crate::analysis::whatif::UNCHECKED) } else { String::new() }
            ),
            conf: Some(line(&s.conf)),
            simulated: true,
            removes_ooms: Some(false),
        });
    }
}

/// What a setting usually does, when no replay could judge the OOMs
/// (`why_not` says why).
fn generic(a: &Analysis, why_not: &str, out: &mut Vec<Advice>) {
    let Some(o) = a.ooms.iter().find(|o| o.class == OomClass::Fragmentation) else { return };
    let what = format!(
        "Fragmentation OOMs: a request of {} failed with {} free but at most {} contiguous",
        bytes(o.requested),
        bytes(o.device_free.unwrap_or(0)),
        bytes(o.largest_free.unwrap_or(0))
    );
    let snapshot = a.snapshot_details();
    let expandable =
        snapshot.is_some_and(|d| crate::allocator::Settings::from_snapshot(&d.allocator_settings).expandable_segments);
    let text = if expandable {
        format!(
            "{what}, with expandable segments already on. What they leave is page granularity: a page (20 MiB in the large pool, 2 MiB in the small) stays mapped while any live block touches it. Long-lived blocks scattered over many pages pin them: allocate those together and early, or leave headroom. (Not simulated: {why_not}.)"
        )
    } else if snapshot.is_some() {
        format!(
            "{what}. What usually helps (not simulated: {why_not}): `expandable_segments:True`, so segments grow in place, or a `max_split_size_mb` below the large requests, so large cached blocks are not split. Run `fragscope whatif` to check them against this trace."
        )
    } else {
        format!(
            "{what}. Allocate long-lived buffers first and together, reuse buffers of equal size, or use a pooling allocator that can map physical memory into a fresh range (CUDA's stream-ordered pools, or VMM-based expandable segments). (Not simulated: {why_not}.)"
        )
    };
    out.push(Advice::new(Kind::Generic, text));
}

/// At the first OOM of a snapshot, when it was one of fragmentation: the
/// live blocks that keep partly used segments (or expandable pages) from
/// being released, by call site and size. After a capacity OOM the free
/// bytes inside segments are not what stood in the way, so nothing is said.
fn pinned(a: &Analysis, events: &Events) -> Option<Advice> {
    if !a.allocator_view {
        return None;
    }
    let first = a.ooms.iter().find(|o| o.class == OomClass::Fragmentation)?;
    let device = first.pid;
    // Segments (or mapped ranges) and blocks of the device at the OOM. An
    // expandable segment unmaps pages anywhere in what one request mapped,
    // so a range is cut, not removed whole; each piece keeps its map's
    // start, so two segments that happen to touch stay two.
    let mut segments: rangemap::RangeMap<u64, u64> = rangemap::RangeMap::new();
    let mut blocks: BTreeMap<u64, (u64, u32)> = BTreeMap::new();
    for i in 0..events.len() {
        if events.ts_ns.at(i) > first.t_ns {
            break;
        }
        if events.pid[i] != device || events.ret[i] != 0 {
            continue;
        }
        let (addr, size) = (events.addr.at(i), events.size.at(i));
        let end = addr.saturating_add(size);
        let stack = events.stack.get(i).copied().unwrap_or(crate::trace::event::NO_STACK);
        match events.kind[i] {
            Some(EventKind::SegmentAlloc | EventKind::SegmentMap) if end > addr => {
                segments.insert(addr..end, addr);
            }
            Some(kind @ (EventKind::SegmentFree | EventKind::SegmentUnmap)) => {
                if let Some(span) = crate::analysis::layout::released_span(&segments, kind, addr, size, |&v| v) {
                    segments.remove(span);
                }
            }
            Some(EventKind::BlockAlloc) if size > 0 => {
                blocks.insert(addr, (size, stack));
            }
            Some(EventKind::BlockFree) => {
                blocks.remove(&addr);
            }
            _ => {}
        }
    }
    // Per segment: its live blocks (those that overlap it).
    let mut pinning: BTreeMap<u64, (u64, u32)> = BTreeMap::new();
    let (mut partly, mut free_in_partly, mut seg_sizes) = (0u64, 0u64, BTreeMap::<u64, u64>::new());
    for (range, _) in segments.iter() {
        let (s, end) = (range.start, range.end);
        let len = end - s;
        let start_key = blocks.range(..s).next_back().filter(|(b, v)| **b + v.0 > s).map_or(s, |(b, _)| *b);
        let inside: Vec<(u64, (u64, u32))> = blocks.range(start_key..end).map(|(&b, &v)| (b, v)).collect();
        let used: u64 = inside.iter().map(|(b, (sz, _))| (b + sz).min(end) - (*b).max(s)).sum();
        if inside.is_empty() || used >= len {
            continue;
        }
        partly += 1;
        free_in_partly += len - used;
        *seg_sizes.entry(len).or_default() += 1;
        for (b, v) in inside {
            pinning.insert(b, v);
        }
    }
    if partly == 0 {
        return None;
    }
    let stacks = a.trace.stacks.as_deref();
    // By call site: (blocks, bytes, smallest, largest).
    let mut groups: BTreeMap<String, (u64, u64, u64, u64)> = BTreeMap::new();
    for &(size, stack) in pinning.values() {
        let site = stacks
            .and_then(|st| crate::analysis::sites::call_site(st, stack))
            .unwrap_or_else(|| crate::analysis::sites::NO_SITE.to_string());
        let g = groups.entry(site).or_insert((0, 0, u64::MAX, 0));
        *g = (g.0 + 1, g.1 + size, g.2.min(size), g.3.max(size));
    }
    let mut groups: Vec<(String, (u64, u64, u64, u64))> = groups.into_iter().collect();
    groups.sort_by(|x, y| y.1.1.cmp(&x.1.1).then(x.0.cmp(&y.0)));
    let list: Vec<String> = groups
        .iter()
        .take(3)
        .map(|(site, (n, _, lo, hi))| {
            let sizes = if lo == hi { bytes(*lo) } else { format!("{} to {}", bytes(*lo), bytes(*hi)) };
            format!("{n} live block{} of {sizes} from `{site}`", if *n == 1 { "" } else { "s" })
        })
        .collect();
    let (common_size, common_n) = seg_sizes.iter().max_by_key(|x| x.1).map(|(s, n)| (*s, *n)).unwrap_or((0, 0));
    // Under expandable segments a range is what one request mapped: pages
    // (20 MiB in the large pool) where none is larger than one.
    let unit = if !a
        .snapshot_details()
        .is_some_and(|d| crate::allocator::Settings::from_snapshot(&d.allocator_settings).expandable_segments)
    {
        "segments"
    } else if seg_sizes.keys().all(|&len| len <= 20 << 20) {
        "mapped pages"
    } else {
        "mapped ranges"
    };
    let one_each = pinning.len() as u64 == partly;
    Some(Advice::new(
        Kind::Program,
        format!(
            "What pins the memory at the first {}OOM: {} keep {partly} {unit}{} partly used{}, and the {} free inside them can be neither released nor merged into one range for the request of {}. Free those tensors before the large request, or allocate long-lived tensors before the temporaries (so they share segments instead of each pinning one).",
            if a.ooms.first().is_some_and(|o| o.t_ns == first.t_ns) { "" } else { "fragmentation " },
            list.join(", "),
            if common_n == partly {
                format!(" of {}", bytes(common_size))
            } else {
                format!(" ({common_n} of them of {})", bytes(common_size))
            },
            if one_each { ", one block in each" } else { "" },
            bytes(free_in_partly),
            bytes(first.requested)
        ),
    ))
}

/// The fewest distinct sizes of a regrown tensor.
const REGROWN_MIN_SIZES: usize = 8;

/// Call sites whose allocations regrow a tensor by a constant size: the
/// distinct requested sizes of the site form an arithmetic progression
/// (nine in ten steps equal), first allocated in increasing order.
fn regrown_tensors(events: &Events, stacks: &crate::trace::Stacks) -> Vec<Advice> {
    // Per stack id: (first time each requested size appeared, count).
    let mut by_stack: ahash::AHashMap<u32, (BTreeMap<u64, u64>, u64)> = Default::default();
    for i in 0..events.len() {
        if events.kind[i] != Some(EventKind::BlockAlloc) || events.ret[i] != 0 {
            continue;
        }
        let stack = events.stack.get(i).copied().unwrap_or(crate::trace::event::NO_STACK);
        if stack == crate::trace::event::NO_STACK {
            continue;
        }
        let size = events.requested.get(i).copied().filter(|&r| r != u64::MAX && r > 0).unwrap_or(events.size.at(i));
        let e = by_stack.entry(stack).or_default();
        e.0.entry(size).or_insert(events.ts_ns.at(i));
        e.1 += 1;
    }
    // Merged by call site (one line may be reached through several stacks).
    let mut by_site: BTreeMap<String, (BTreeMap<u64, u64>, u64)> = BTreeMap::new();
    for (stack, (sizes, n)) in by_stack {
        let Some(site) = crate::analysis::sites::call_site(stacks, stack) else { continue };
        let e = by_site.entry(site).or_default();
        for (s, t) in sizes {
            let first = e.0.entry(s).or_insert(t);
            *first = (*first).min(t);
        }
        e.1 += n;
    }
    // Sites with the same progression (the K and the V of a cache) make
    // one piece of advice: (step, sizes, smallest, largest) → (sites, allocations).
    let mut found: BTreeMap<(u64, usize, u64, u64), (Vec<String>, u64)> = BTreeMap::new();
    for (site, (sizes, n)) in by_site {
        if sizes.len() < REGROWN_MIN_SIZES {
            continue;
        }
        let list: Vec<(u64, u64)> = sizes.into_iter().collect();
        let steps: Vec<u64> = list.windows(2).map(|w| w[1].0 - w[0].0).collect();
        let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
        for &d in &steps {
            *counts.entry(d).or_default() += 1;
        }
        let Some((&step, &same)) = counts.iter().max_by_key(|x| (x.1, std::cmp::Reverse(*x.0))) else { continue };
        let in_order = list.windows(2).filter(|w| w[1].1 >= w[0].1).count();
        // One progression over the whole range, not a few runs of it.
        let (lo, hi) = (list[0].0, list[list.len() - 1].0);
        let spanned = (hi - lo) as f64 / (step as f64 * steps.len() as f64);
        if same * 10 < steps.len() * 9 || in_order * 10 < steps.len() * 9 || !(0.9..=1.1).contains(&spanned) {
            continue;
        }
        let e = found.entry((step, list.len(), lo, hi)).or_default();
        e.0.push(format!("`{site}`"));
        e.1 += n;
    }
    let mut out = Vec::new();
    for ((step, count, lo, hi), (sites, n)) in found {
        let per_step = n / count as u64 / sites.len() as u64;
        out.push(Advice::new(
            Kind::Pattern,
            format!(
                "{} regrow{} a tensor: {n} allocations whose size grows by {} at each of {} growths, from {} to {} ({per_step} allocation{} of each size{}) — the mark of `torch.cat` onto a growing tensor, such as a KV cache growing by a token per step. Each growth allocates the whole tensor again and frees the old one, so memory churns and fragments. Allocate it once at its final size and write each step into a slice (`buf[:, t] = x`), or use a static cache.",
                sites.join(" and "),
                if sites.len() == 1 { "s" } else { "" },
                bytes(step),
                count - 1,
                bytes(lo),
                bytes(hi),
                if per_step == 1 { "" } else { "s" },
                if sites.len() > 1 { " at each site" } else { "" }
            ),
        ));
    }
    out
}
