//! Leaks: memory that stays allocated, iteration after iteration.
//!
//! The verdict is `leaking`, `not leaking` or `cannot tell`, never stronger
//! than the evidence. It rests on **exact floors**: the least live
//! (allocated) bytes of the series over a span of time, computed from the
//! event stream itself ([`floors`]) — the state entering the span and the
//! state after each of its events — not from the sampled metric rows,
//! which can miss the true minimum of a short iteration by a large margin.
//!
//! - **With iterations** ([`crate::analysis::iterations`]): the floor of
//!   each complete iteration after the first (warm-up) one. A deterministic
//!   loop's floors are equal to the byte; with variable shapes they move up
//!   and down. Their *fluctuation* is the largest fall from one floor to
//!   the next. Then:
//!   - `not leaking` when the last floor is no higher than the first by
//!     more than the fluctuation;
//!   - `leaking` when the floors rise beyond the fluctuation across at
//!     least 3 consecutive iterations (two rises in a row), the total rise
//!     is more than twice the fluctuation, and the floors did not then hold
//!     still for the last 3 iterations (growth that stops by itself is
//!     bounded: a cache or state that filled up, `not leaking`; growth that
//!     stops when requests begin to fail ran out of memory, and stays
//!     `leaking`);
//!   - `cannot tell` for other growth, and with fewer than 3 complete
//!     iterations after the warm-up (memory allocated once — optimizer
//!     moments, caches, activations held for backward — looks like growth
//!     inside one iteration).
//!
//!   Memory released after the last complete iteration (a function
//!   returning, a list cleared, the process ending) does not undo a verdict
//!   reached across the iterations; the reason says that it was released.
//!   `growth_per_iteration_bytes` is the median of the rises from one floor
//!   to the next (exact for a constant leak, robust to one odd iteration).
//!   The call sites of the growth are what each site held more at the last
//!   iteration's floor than at the first after the warm-up.
//! - **Without iterations**: the series' events that move live memory,
//!   up to the final descent (see [`by_windows`]), cut by count into
//!   quarters and six windows after the first quarter (warm-up): the floor
//!   of the second quarter against the last. Always `cannot tell`: no
//!   growth beyond the noise (2 % of the peak, at least 16 MiB) over
//!   repeated rises may be layers or requests as well as steps, and a leak
//!   once per step would not show; growth may be a leak across steps, one
//!   pass that holds memory or a working set that grows by design. The
//!   reason says which, with the rise's call sites where there are stacks
//!   and a rise at every window.
//!
//! Floors use live bytes as the replay counts them (every block by its
//! address; an allocation at a live address replaces that block; a
//! process's exit releases all it holds), with one difference: in a
//! PyTorch snapshot a block counts its *requested* size, the bytes the
//! program asked for. The block sizes the allocator hands out depend on
//! its settings (rounding, and remainders of under 1 MiB given out with a
//! block), so the same program under two settings has the same requested
//! floors, to the byte, and the same verdict. The replay also removes blocks
//! that a new one overlaps (frees the recorder lost, counted as `overlap`
//! anomalies); the floors do not, so they can differ from the replay's
//! live bytes in a trace with that anomaly.

mod windows;

use ahash::AHashMap;
use serde::Serialize;

use self::windows::*;
use crate::analysis::iterations::Iterations;
use crate::analysis::sites::SiteBytes;
use crate::trace::Stacks;
use crate::trace::event::{EventKind, Events};

/// Sizes of blocks alive at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SizeGroup {
    pub size: u64,
    pub count: u64,
    pub bytes: u64,
}

/// What the evidence says about a leak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    #[serde(rename = "leaking")]
    Leaking,
    #[serde(rename = "not leaking")]
    NotLeaking,
    #[serde(rename = "cannot tell")]
    CannotTell,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Leaking => "leaking",
            Verdict::NotLeaking => "not leaking",
            Verdict::CannotTell => "cannot tell",
        }
    }
}

/// The least live bytes of a series over [`start_t_ns`, `end_t_ns`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Floor {
    pub start_t_ns: u64,
    pub end_t_ns: u64,
    pub bytes: u64,
    /// When the floor was first reached: the span's start (the state
    /// entering it) or the time of the event that brought it there.
    pub at_t_ns: u64,
    /// Events (of the whole trace) applied when the floor holds: the floor
    /// is the state after rows `0..after_rows`.
    #[serde(skip)]
    pub after_rows: usize,
    /// The most live over the span, in the floor's unit: the span's peak
    /// (compare.png sets the iterations of two runs side by side by it).
    pub peak_bytes: u64,
}

impl Floor {
    fn consider(&mut self, bytes: u64, t_ns: u64, after_rows: usize) {
        self.peak_bytes = self.peak_bytes.max(bytes);
        if bytes < self.bytes {
            (self.bytes, self.at_t_ns, self.after_rows) = (bytes, t_ns, after_rows);
        }
    }
}

/// How the verdict was reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// The floors of complete iterations after the warm-up.
    Iterations,
    /// No iterations: the floors of windows of the series' events.
    Windows,
}

/// The leak verdict of one process (device, for snapshots).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LeakReport {
    pub pid: u32,
    pub verdict: Verdict,
    /// Why, in plain words.
    pub reason: String,
    /// True only for [`Verdict::Leaking`].
    pub leaking: bool,
    pub method: Method,
    /// The first and last floor compared.
    pub floor_early_bytes: u64,
    pub floor_late_bytes: u64,
    pub growth_bytes: i64,
    /// Iterations: the median rise from one floor to the next (after the
    /// warm-up); None without iterations or with fewer than two floors.
    pub growth_per_iteration_bytes: Option<i64>,
    /// Iterations: the largest fall from one floor to the next, what the
    /// floors move by on their own.
    pub fluctuation_bytes: u64,
    pub rate_bytes_per_s: f64,
    /// Iterations: the floor of every complete iteration, the warm-up
    /// first; windows: the floors of the six windows.
    pub floors: Vec<Floor>,
    /// Iterations: memory released after the last complete iteration
    /// (when, how much below the last iteration's floor live memory went).
    /// Windows: what was freed after the run's last rise (when the run
    /// ended, how much), where it took live memory below the run's last
    /// floor.
    pub released_after: Option<(u64, u64)>,
    /// Block sizes alive at the end.
    pub live_at_end_bytes: u64,
    /// Allocator view: the bytes the program asked for of them, the unit
    /// of its floors.
    pub live_at_end_requested_bytes: Option<u64>,
    pub live_at_end_blocks: u64,
    /// The process exited holding memory: (bytes, blocks) its exit
    /// released. Alive at the end is then nothing: the driver freed them.
    pub held_at_exit: Option<(u64, u64)>,
    /// Largest groups first (by bytes), at most ten.
    pub by_size: Vec<SizeGroup>,
    /// The call sites of the growth (traces with stacks): what each site
    /// held more at the last floor than at the first compared (the first
    /// after the warm-up; without iterations, the second quarter's).
    /// Bytes as the program asked for them. Largest first, at most ten.
    pub top_sites: Vec<SiteBytes>,
    /// Traces with stacks and iterations: blocks alive at the end that were
    /// allocated once, in the warm-up (or the only) iteration, by call site
    /// — state such as optimizer moments, not leaks. A site of the growth
    /// keeps its warm-up blocks here.
    pub allocated_once: Vec<SiteBytes>,
}

impl LeakReport {
    /// The growth per second, for a leak on a clock: None otherwise (not
    /// leaking, or a snapshot whose time is entry order, where a second
    /// means nothing; [`LeakReport::rate_bytes_per_s`] is then 0).
    pub fn rate(&self) -> Option<f64> {
        (self.leaking && self.rate_bytes_per_s > 0.0).then_some(self.rate_bytes_per_s)
    }
}

/// Growth below this is noise without iterations: 2 % of the peak, at
/// least 16 MiB.
fn threshold(peak: u64) -> u64 {
    (peak / 50).max(16 << 20)
}

/// Live bytes of one series after each of its events, as the replay
/// counts them.
struct LiveBytes {
    allocator_view: bool,
    blocks: AHashMap<u64, u64>,
    now: u64,
}

impl LiveBytes {
    fn new(allocator_view: bool) -> LiveBytes {
        LiveBytes { allocator_view, blocks: AHashMap::new(), now: 0 }
    }

    /// Applies row `i` (of this series).
    fn apply(&mut self, events: &Events, i: usize) {
        let Some(kind) = events.kind[i] else { return };
        if kind == EventKind::Exit {
            self.blocks.clear();
            self.now = 0;
            return;
        }
        if events.ret[i] != 0 || !crate::analysis::replay::tracks(kind, self.allocator_view) {
            return;
        }
        let (addr, block) = (events.addr.at(i), events.size.at(i));
        // The program's own bytes: a snapshot's blocks by the size asked
        // for, which no allocator setting changes (rounding and unsplit
        // remainders do).
        let size = if self.allocator_view { events.requested_at(i).unwrap_or(block) } else { block };
        if kind.creates_block() {
            if block == 0 {
                return;
            }
            if !self.allocator_view && (addr == 0 || addr.checked_add(size).is_none()) {
                return;
            }
            if let Some(old) = self.blocks.insert(addr, size) {
                self.now -= old;
            }
            self.now += size;
        } else if kind.releases_block()
            && let Some(size) = self.blocks.remove(&addr)
        {
            self.now -= size;
        }
    }
}

/// The exact floor of series `pid` over each of `spans` (ascending, not
/// overlapping), and its live bytes at the end.
pub fn floors(events: &Events, pid: u32, allocator_view: bool, spans: &[(u64, u64)]) -> (Vec<Floor>, u64) {
    let mut out: Vec<Floor> = spans
        .iter()
        .map(|&(s, e)| Floor { start_t_ns: s, end_t_ns: e, bytes: u64::MAX, at_t_ns: s, after_rows: 0, peak_bytes: 0 })
        .collect();
    let mut live = LiveBytes::new(allocator_view);
    let (mut k, mut entered, mut applied) = (0usize, false, 0usize);
    for i in 0..events.len() {
        if events.pid[i] != pid {
            continue;
        }
        let ts = events.ts_ns.at(i);
        while k < out.len() && ts >= out[k].end_t_ns {
            if !entered {
                let start = out[k].start_t_ns;
                out[k].consider(live.now, start, applied);
            }
            k += 1;
            entered = false;
        }
        if k < out.len() && ts >= out[k].start_t_ns && !entered {
            let start = out[k].start_t_ns;
            out[k].consider(live.now, start, applied);
            entered = true;
        }
        live.apply(events, i);
        applied = i + 1;
        if entered {
            out[k].consider(live.now, ts, applied);
        }
    }
    while k < out.len() {
        if !entered {
            let start = out[k].start_t_ns;
            out[k].consider(live.now, start, applied);
        }
        k += 1;
        entered = false;
    }
    (out, live.now)
}

/// The exact floors of one series' iterations ([`iteration_floors`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IterationFloors {
    /// The floor of each complete iteration, the warm-up first.
    pub complete: Vec<Floor>,
    /// The floor after the last boundary: what was released there.
    pub tail: Option<Floor>,
}

/// The floors of every complete iteration of `it`, and after its last
/// boundary. They read only the events, so they are computed beside the
/// replay, as the iterations are.
pub fn iteration_floors(events: &Events, pid: u32, allocator_view: bool, it: &Iterations) -> IterationFloors {
    let mut spans: Vec<(u64, u64)> = it.spans().collect();
    let last_boundary = it.boundaries_t_ns.last().copied();
    if let Some(b) = last_boundary {
        spans.push((b, u64::MAX));
    }
    let (mut complete, _) = floors(events, pid, allocator_view, &spans);
    let tail = last_boundary.and_then(|_| complete.pop());
    IterationFloors { complete, tail }
}

/// What one series' events, iterations and stacks say about a leak.
pub struct Input<'a> {
    pub pid: u32,
    pub events: &'a Events,
    pub allocator_view: bool,
    /// Its blocks alive at the end (address, size).
    pub live: &'a [(u64, u64)],
    /// Its peak live bytes.
    pub peak: u64,
    /// Its iterations, when found, and their floors.
    pub iterations: Option<(&'a Iterations, &'a IterationFloors)>,
    pub stacks: Option<&'a Stacks>,
    /// When its requests failed (OOMs).
    pub oom_times: &'a [u64],
    /// Its exit, where it ended holding memory: (bytes, blocks) its exit
    /// released (the driver frees them).
    pub exited: Option<(u64, u64)>,
}

/// The leak verdict of one series.
pub fn detect(input: &Input<'_>) -> LeakReport {
    let mut groups: std::collections::BTreeMap<u64, (u64, u64)> = Default::default();
    for &(_, size) in input.live {
        let g = groups.entry(size).or_default();
        g.0 += 1;
        g.1 += size;
    }
    let mut by_size: Vec<SizeGroup> =
        groups.into_iter().map(|(size, (count, bytes))| SizeGroup { size, count, bytes }).collect();
    by_size.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.size.cmp(&b.size)));
    by_size.truncate(10);
    let mut report = LeakReport {
        pid: input.pid,
        verdict: Verdict::CannotTell,
        reason: String::new(),
        leaking: false,
        method: Method::Windows,
        floor_early_bytes: 0,
        floor_late_bytes: 0,
        growth_bytes: 0,
        growth_per_iteration_bytes: None,
        fluctuation_bytes: 0,
        rate_bytes_per_s: 0.0,
        floors: Vec::new(),
        released_after: None,
        live_at_end_bytes: input.live.iter().map(|b| b.1).sum(),
        live_at_end_requested_bytes: None,
        live_at_end_blocks: input.live.len() as u64,
        held_at_exit: input.exited.filter(|x| x.0 > 0),
        by_size,
        top_sites: Vec::new(),
        allocated_once: Vec::new(),
    };
    let (verdict, reason) = match input.iterations {
        Some((_, floors)) => by_iterations(&mut report, input, floors),
        None => by_windows(&mut report, input),
    };
    report.verdict = verdict;
    report.leaking = verdict == Verdict::Leaking;
    report.reason = reason;
    if let (Some(st), Some((it, _))) = (input.stacks, input.iterations)
        && let Some(&until) = it.warmup_end_t_ns.as_ref().or(it.boundaries_t_ns.last())
    {
        // A site that also grew keeps its warm-up blocks here: they were
        // allocated once, and the report says the site grew too.
        report.allocated_once =
            crate::analysis::sites::grown_sites(input.events, st, input.pid, (0, until), input.allocator_view, 10);
    }
    report
}

/// The median of `v` (the lower middle for an even count).
fn median(v: &[i64]) -> Option<i64> {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.get((s.len().max(1) - 1) / 2).copied()
}

fn by_iterations(r: &mut LeakReport, input: &Input<'_>, floors: &IterationFloors) -> (Verdict, String) {
    r.method = Method::Iterations;
    let tail = floors.tail;
    r.floors = floors.complete.clone();
    let post: Vec<Floor> = floors.complete.iter().skip(1).copied().collect();
    let n = post.len();
    if n < 3 {
        return (
            Verdict::CannotTell,
            format!(
                "{n} complete iteration{} after the warm-up (at least 3 are needed): memory allocated once — optimizer \
                 moments, caches, activations held for backward — cannot be told from a leak in so few iterations",
                if n == 1 { "" } else { "s" }
            ),
        );
    }
    let b = |v: u64| crate::units::bytes(v);
    let f: Vec<u64> = post.iter().map(|p| p.bytes).collect();
    let d: Vec<i64> = f.windows(2).map(|w| w[1] as i64 - w[0] as i64).collect();
    let fluct = d.iter().map(|&x| (-x).max(0) as u64).max().unwrap_or(0);
    let (first, last) = (post[0], post[n - 1]);
    r.floor_early_bytes = first.bytes;
    r.floor_late_bytes = last.bytes;
    r.growth_bytes = last.bytes as i64 - first.bytes as i64;
    r.growth_per_iteration_bytes = median(&d);
    r.fluctuation_bytes = fluct;
    let seconds = last.at_t_ns.saturating_sub(first.at_t_ns) as f64 / 1e9;
    r.rate_bytes_per_s = if seconds > 0.0 && r.growth_bytes > 0 { r.growth_bytes as f64 / seconds } else { 0.0 };
    // Iterations are numbered from 1, the warm-up being the first.
    let total = r.growth_bytes;
    let within =
        if fluct == 0 { "equal to the byte".to_string() } else { format!("within {} of each other", b(fluct)) };
    if total <= fluct as i64 {
        return (
            Verdict::NotLeaking,
            format!(
                "the floors of the {n} complete iterations after the warm-up are {within} ({} → {})",
                b(first.bytes),
                b(last.bytes)
            ),
        );
    }
    // The longest run of rises beyond the fluctuation, and how many of the
    // last transitions did not rise.
    let (mut run, mut best, mut best_end) = (0usize, 0usize, 0usize);
    for (i, &x) in d.iter().enumerate() {
        run = if x > fluct as i64 { run + 1 } else { 0 };
        if run > best {
            (best, best_end) = (run, i);
        }
    }
    let held = d.iter().rev().take_while(|&&x| x <= fluct as i64).count();
    let fluct_text = if fluct == 0 { "they never fell".to_string() } else { format!("they fluctuate by {}", b(fluct)) };
    if best >= 2 && total > 2 * fluct as i64 {
        // d[i] is f[i + 1] − f[i]; f[j] is iteration j + 2.
        let (from, to) = (best_end + 1 - best, best_end + 1);
        // Growth that stopped because requests began to fail did not stop
        // by itself: memory ran out.
        let ran_out = input.oom_times.iter().filter(|&&t| t >= post[to].start_t_ns).count();
        if held >= 3 && ran_out == 0 {
            return (
                Verdict::NotLeaking,
                format!(
                    "the floor rose by {} from iteration {} to {}, then held for the last {held} iterations: bounded \
                     growth (a cache or state that filled up), not a leak",
                    b(f[to] - f[from]),
                    from + 2,
                    to + 2
                ),
            );
        }
        let mut reason = format!(
            "the floor of {n} complete iterations after the warm-up rose from {} to {}, by {} per iteration ({fluct_text})",
            b(first.bytes),
            b(last.bytes),
            b(r.growth_per_iteration_bytes.unwrap_or(0).max(0) as u64)
        );
        if held >= 3 {
            reason.push_str(&format!(
                "; it stopped at {} only when memory ran out ({ran_out} failed request{} from iteration {} on)",
                b(f[to]),
                if ran_out == 1 { "" } else { "s" },
                to + 2
            ));
        }
        if let Some(t) = tail
            && t.bytes < last.bytes
        {
            r.released_after = Some((t.at_t_ns, last.bytes - t.bytes));
            reason.push_str(&format!(
                "; {} was released after the last complete iteration (a function returning, a list cleared or the \
                 process ending), which does not undo the growth seen across the iterations",
                b(last.bytes - t.bytes)
            ));
        }
        if let Some(st) = input.stacks {
            r.top_sites = growth_sites(input, st, first.after_rows, last.after_rows);
        }
        return (Verdict::Leaking, reason);
    }
    // A rise, then floors that held: bounded growth or a leak the cache
    // absorbs for a while look the same over so few iterations.
    if best >= 1 && held >= 1 && best_end + 1 + held == d.len() {
        let (from, to) = (best_end + 1 - best, best_end + 1);
        return (
            Verdict::CannotTell,
            format!(
                "the floor rose by {} from iteration {} to {}, then held ({}) for the last {held} iteration{}: growth \
                 that stopped (a cache or state that filled up) needs 3 iterations held to be told from a leak, and a \
                 leak needs rises at 3 consecutive iterations",
                b(f[to] - f[from]),
                from + 2,
                to + 2,
                if fluct == 0 { "equal to the byte".to_string() } else { format!("within {}", b(fluct)) },
                if held == 1 { "" } else { "s" }
            ),
        );
    }
    (
        Verdict::CannotTell,
        format!(
            "the floor of {n} complete iterations after the warm-up rose from {} to {}, but not steadily beyond its own \
             fluctuation ({fluct_text}; a leak needs rises at 3 consecutive iterations)",
            b(first.bytes),
            b(last.bytes)
        ),
    )
}

/// What each call site of the series held more at the last floor (the
/// state after the first `last_rows` rows) than at the first
/// (`first_rows`): the growth, without what every iteration holds at its
/// floor (the previous step's input and loss, say).
fn growth_sites(input: &Input<'_>, st: &Stacks, first_rows: usize, last_rows: usize) -> Vec<SiteBytes> {
    let ev = input.events;
    // The bytes the program asked for, as the floors count them (a
    // snapshot's block sizes carry the allocator's rounding).
    let bytes = |b: &crate::trace::event::LiveBlock| {
        if input.allocator_view { ev.requested_at(b.row).unwrap_or(b.size) } else { b.size }
    };
    let blocks = |live: &crate::trace::event::LiveSet| -> Vec<(u64, u64, u64, u32)> {
        live.blocks.iter().map(|(&(_, a), b)| (a, bytes(b), bytes(b), b.stack)).collect()
    };
    let mut live = crate::trace::event::LiveSet::default();
    let mut before = Vec::new();
    for i in 0..last_rows.min(ev.len()) {
        if i == first_rows {
            before = blocks(&live);
        }
        if ev.pid[i] == input.pid {
            live.apply(ev, i);
        }
    }
    if first_rows >= last_rows.min(ev.len()) {
        before = blocks(&live);
    }
    crate::analysis::sites::site_growth(st, &before, &blocks(&live), 10)
}

#[cfg(test)]
mod tests;
