//! The requests a what-if replays, per device ([`DeviceStream`]): read
//! from a snapshot's entries (each free matched to its allocation, the
//! state before the first entry, the program's `empty_cache()` calls as
//! [`Flushes`]) or from a device-level trace's `cudaMalloc`s.

use crate::trace::event::{Event, EventKind, Events};

/// One recorded event of one device, as the model needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Req {
    pub ts_ns: u64,
    pub kind: EventKind,
    pub addr: u64,
    /// Block or segment size.
    pub size: u64,
    pub requested: u64,
    pub stream: u64,
    /// `oom` events: the free device memory CUDA reported.
    pub device_free: Option<u64>,
}

impl Req {
    pub fn of(e: &Event) -> Req {
        Req {
            ts_ns: e.ts_ns,
            kind: e.kind,
            addr: e.addr,
            size: e.size,
            requested: e.extra.requested.unwrap_or(e.size),
            stream: e.stream.unwrap_or(0),
            device_free: e.extra.device_free,
        }
    }
}

/// The events of one device: the reconstructed initial state (its first
/// `initial` events: segments, then live blocks), then the trace.
///
/// The requests read from a trace are its rows, each read as a [`Req`]
/// when a replay comes to it ([`DeviceStream::get`]): 4 bytes a request
/// (5 for a device-level trace, whose kinds the model reads differently),
/// where a copy took 64. A snapshot's requests are nearly all its events,
/// and the what-if replays them while the analysis holds the events.
#[derive(Clone, Debug, Default)]
pub struct DeviceStream<'e> {
    pub device: u32,
    pub initial: usize,
    pub(super) requests: Requests<'e>,
    /// Who made each run of releases (`segment_free`, or `segment_unmap`
    /// with expandable segments), by the index in the stream of the run's
    /// last request.
    pub releases: std::collections::BTreeMap<usize, Release>,
    /// The times PyTorch released its cache because the budget was
    /// reached, counted as `num_alloc_retries` counts them, and the
    /// capacity they imply.
    pub flushes: Flushes,
    /// What every replay starts from, found once ([`DeviceStream::extent`]).
    pub(super) extent: std::sync::OnceLock<Extent>,
}

/// What every replay of a stream starts from: a full pass over its
/// requests, made once rather than once per replay (the memory needed
/// replays a stream ten times under each setting).
#[derive(Clone, Debug, Default)]
pub(super) struct Extent {
    /// The highest end of any request's range.
    pub(super) top: u64,
    /// The segments the trace makes after the initial state: (address,
    /// size), in order.
    pub(super) segments: std::sync::Arc<[(u64, u64)]>,
}

/// Where a [`DeviceStream`]'s requests are.
#[derive(Clone, Debug)]
pub(super) enum Requests<'e> {
    /// Rows of the events, read as recorded (a snapshot's entries, a
    /// recording's allocator view).
    Rows { events: &'e Events, rows: Vec<u32> },
    /// Rows of a device-level trace, with the kind the model reads each
    /// as (a `cudaMalloc` is a block request, a failed one an `oom`).
    DeviceLevel { events: &'e Events, rows: Vec<u32>, kinds: Vec<EventKind> },
    /// Requests made in memory (tests, and traces of more than 2³² rows).
    Built(Vec<Req>),
}

impl Default for Requests<'_> {
    fn default() -> Self {
        Requests::Built(Vec::new())
    }
}

impl<'e> DeviceStream<'e> {
    /// An empty stream whose requests will be rows of `events`, read as
    /// recorded (`device_level`: read as a device-level trace's).
    fn of_rows(device: u32, initial: usize, events: &'e Events, device_level: bool) -> DeviceStream<'e> {
        let requests = if events.len() > u32::MAX as usize {
            Requests::Built(Vec::new())
        } else if device_level {
            Requests::DeviceLevel { events, rows: Vec::new(), kinds: Vec::new() }
        } else {
            Requests::Rows { events, rows: Vec::new() }
        };
        DeviceStream { device, initial, requests, ..DeviceStream::default() }
    }

    /// Room for `n` more requests.
    fn reserve_exact(&mut self, n: usize) {
        match &mut self.requests {
            Requests::Rows { rows, .. } => rows.reserve_exact(n),
            Requests::DeviceLevel { rows, kinds, .. } => {
                rows.reserve_exact(n);
                kinds.reserve_exact(n);
            }
            Requests::Built(v) => v.reserve_exact(n),
        }
    }

    /// Appends row `row` of `events`: read as recorded, or (`as_kind`) as
    /// a device-level trace's row of that kind.
    fn push_row(&mut self, events: &Events, row: usize, as_kind: Option<EventKind>) {
        match (&mut self.requests, as_kind) {
            (Requests::Rows { rows, .. }, _) => rows.push(row as u32),
            (Requests::DeviceLevel { rows, kinds, .. }, Some(kind)) => {
                rows.push(row as u32);
                kinds.push(kind);
            }
            (Requests::DeviceLevel { rows, kinds, .. }, None) => {
                rows.push(row as u32);
                kinds.push(events.kind[row].unwrap_or(EventKind::Oom));
            }
            (Requests::Built(v), None) => v.push(recorded(events, row)),
            (Requests::Built(v), Some(kind)) => v.push(device_level(events, row, kind)),
        }
    }

    /// The requests of a stream made in memory, to change (tests).
    #[cfg(test)]
    pub(super) fn built(&mut self) -> &mut Vec<Req> {
        self.extent = std::sync::OnceLock::new();
        match &mut self.requests {
            Requests::Built(v) => v,
            _ => panic!("a stream of rows is not changed in place"),
        }
    }

    pub fn len(&self) -> usize {
        match &self.requests {
            Requests::Rows { rows, .. } | Requests::DeviceLevel { rows, .. } => rows.len(),
            Requests::Built(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Request `i`.
    #[inline]
    pub fn get(&self, i: usize) -> Option<Req> {
        (i < self.len()).then(|| self.at(i))
    }

    /// Request `i`; like a slice's index, it must be in the stream.
    #[inline]
    pub fn at(&self, i: usize) -> Req {
        match &self.requests {
            Requests::Rows { events, rows } => recorded(events, rows[i] as usize),
            Requests::DeviceLevel { events, rows, kinds } => device_level(events, rows[i] as usize, kinds[i]),
            Requests::Built(v) => v[i],
        }
    }

    /// Requests `range`, in order; like a slice's range, it must be in
    /// the stream.
    pub fn requests(
        &self,
        range: std::ops::Range<usize>,
    ) -> impl ExactSizeIterator<Item = Req> + DoubleEndedIterator + '_ {
        range.map(move |i| self.at(i))
    }

    /// Every request, in order.
    pub fn all(&self) -> impl ExactSizeIterator<Item = Req> + DoubleEndedIterator + '_ {
        self.requests(0..self.len())
    }

    /// Drops request `i` (a device-level trace's `oom` that PyTorch's
    /// retry then served).
    fn remove(&mut self, i: usize) {
        match &mut self.requests {
            Requests::Rows { rows, .. } => {
                rows.remove(i);
            }
            Requests::DeviceLevel { rows, kinds, .. } => {
                rows.remove(i);
                kinds.remove(i);
            }
            Requests::Built(v) => {
                v.remove(i);
            }
        }
    }

    /// The same stream, its requests copied out of the events (what a
    /// command keeps after the events are gone).
    pub fn into_owned(self) -> DeviceStream<'static> {
        let requests = match self.requests {
            Requests::Built(v) => v,
            _ => self.all().collect(),
        };
        DeviceStream {
            device: self.device,
            initial: self.initial,
            requests: Requests::Built(requests),
            releases: self.releases,
            flushes: self.flushes,
            extent: self.extent,
        }
    }

    /// [`Extent`], found on first use.
    pub(super) fn extent(&self) -> &Extent {
        self.extent.get_or_init(|| Extent {
            top: self.all().map(|r| r.addr.saturating_add(r.size)).max().unwrap_or(0),
            segments: self
                .requests(self.initial..self.len())
                .filter(|r| r.kind == EventKind::SegmentAlloc)
                .map(|r| (r.addr, r.size))
                .collect(),
        })
    }

    /// What the state before the first trace entry reserved: its segments
    /// and mapped pages.
    pub fn initial_reserved(&self) -> u64 {
        self.requests(0..self.initial)
            .filter(|r| matches!(r.kind, EventKind::SegmentAlloc | EventKind::SegmentMap))
            .map(|r| r.size)
            .sum()
    }
}

/// Row `row` of `events` as recorded (a snapshot's allocator event).
#[inline]
fn recorded(events: &Events, row: usize) -> Req {
    let size = events.size.at(row);
    Req {
        ts_ns: events.ts_ns.at(row),
        kind: events.kind[row].unwrap_or(EventKind::Oom),
        addr: events.addr.at(row),
        size,
        requested: events.requested.get(row).copied().filter(|&r| r != u64::MAX).unwrap_or(size),
        stream: events.stream.get(row).unwrap_or(0),
        device_free: events.device_free.get(row).filter(|&v| v != u64::MAX),
    }
}

/// Row `row` of a device-level trace, read as `kind`: its size is what
/// was asked for, on the default stream.
#[inline]
fn device_level(events: &Events, row: usize, kind: EventKind) -> Req {
    Req {
        ts_ns: events.ts_ns.at(row),
        kind,
        addr: events.addr.at(row),
        size: events.size.at(row),
        requested: events.size.at(row),
        stream: 0,
        device_free: None,
    }
}

/// Who released cached memory in a run of `segment_free` entries (or
/// `segment_unmap` ones, with expandable segments).
///
/// A release the program asked for (`torch.cuda.empty_cache()`) has that
/// frame in its stack. The allocator's own releases come inside a request,
/// right before the segment they make room for or its `oom`; a release on
/// autograd's backward thread carries no Python stack, so a run without
/// one, in a trace that has stacks elsewhere, is the allocator's when a
/// new segment or an `oom` follows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Release {
    /// `torch.cuda.empty_cache()`: every scenario replays it.
    Program,
    /// The whole cache released to retry a request the budget refused
    /// (`release_cached_blocks`, then `alloc_block` again): one of
    /// PyTorch's `num_alloc_retries`.
    Retry,
    /// With `max_split_size_mb`: only cached segments at or above it
    /// (`release_available_cached_blocks`), which PyTorch does not count
    /// as a retry.
    Oversize,
    /// Garbage collection (`garbage_collection_threshold` under a memory
    /// fraction): blocks released before the budget was reached.
    Collection,
    /// The trace has no stacks to tell: a replay judges it by its budget.
    Unknown,
}

impl Release {
    /// Whether the allocator made it (it is not the program's and is not
    /// replayed as such).
    pub fn by_allocator(self) -> bool {
        matches!(self, Release::Retry | Release::Oversize | Release::Collection)
    }
}

/// What a recorded entry's stack says of who made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Caller {
    /// No frames.
    Unknown,
    /// Frames, none of them `empty_cache`.
    Elsewhere,
    /// An `empty_cache` frame.
    EmptyCache,
}

/// Who made each run of releases of `d`: `callers[i]` says what the stack
/// of request `i` of `d` shows; `stacked`: whether the trace has stacks at all.
pub(super) fn classify_releases(
    d: &DeviceStream,
    callers: &[Caller],
    stacked: bool,
    settings: &crate::allocator::Settings,
) -> std::collections::BTreeMap<usize, Release> {
    let mut out = std::collections::BTreeMap::new();
    let mut start = None;
    for (i, r) in d.all().enumerate() {
        if !is_release(r.kind) {
            start = None;
            continue;
        }
        let s = *start.get_or_insert(i);
        if d.get(i + 1).is_some_and(|n| is_release(n.kind)) {
            continue;
        }
        let run = || d.requests(s..i + 1);
        let caller = |k: usize| callers.get(k).copied().unwrap_or(Caller::Unknown);
        let next = d.get(i + 1).map(|n| n.kind);
        let grows = matches!(next, Some(EventKind::SegmentAlloc | EventKind::SegmentMap));
        let release = if (s..=i).any(|k| caller(k) == Caller::EmptyCache) {
            Release::Program
        } else if next == Some(EventKind::Oom) {
            // The release before a request fails: always the whole cache.
            Release::Retry
        } else if !grows {
            // The allocator releases only to make room for a segment.
            if stacked { Release::Program } else { Release::Unknown }
        } else if (s..=i).any(|k| caller(k) == Caller::Elsewhere) || stacked {
            if settings.max_split_size.is_some_and(|m| run().all(|r| r.size >= m)) {
                Release::Oversize
            } else if settings.garbage_collection_threshold.is_some() {
                Release::Collection
            } else {
                Release::Retry
            }
        } else {
            Release::Unknown
        };
        out.insert(i, release);
    }
    out
}

/// Cache releases as PyTorch counts them (`num_alloc_retries`): each
/// release of the whole cache to retry a request, and the retry before
/// each OOM (which may release nothing, and then shows in no entry).
/// Releases by garbage collection and, with `max_split_size_mb`, of the
/// oversize blocks alone are no retries: counted apart. Each retry
/// followed by a new segment says the budget was reached: the capacity is
/// below what was reserved then plus that segment, and at least the most
/// that was ever reserved with a new segment that fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Flushes {
    /// Retries, as `num_alloc_retries` counts them.
    pub count: u64,
    /// The count may be short: the trace began after the allocator was in
    /// use (a ring buffer), or it has releases whose maker its stacks
    /// cannot tell.
    pub at_least: bool,
    /// Releases by garbage collection (not retries).
    pub gc_releases: u64,
    /// With `max_split_size_mb`: releases of the oversize blocks alone.
    pub oversize_releases: u64,
    /// Segments (or pages) and bytes the retries released.
    pub segments_freed: u64,
    pub bytes_freed: u64,
    /// The capacity interval [lo, hi] they imply, when consistent.
    pub capacity: Option<(u64, u64)>,
    /// The least reserved just before a garbage collection released
    /// blocks, and the most ever reserved with a new segment that fit:
    /// with the threshold, they bound the budget ([`Flushes::gc_budget`]).
    pub gc_reserved_before: Option<u64>,
    pub peak_fit: u64,
    /// The most reserved when a new segment was made with a wholly
    /// free large segment cached and no collection before it: garbage
    /// collection, had it been over its threshold, would have released
    /// that segment first ([`Flushes::gc_budget`]).
    pub gc_quiet_max: u64,
    /// The budget interval garbage collection implied under the recorded
    /// threshold, where the what-if used it.
    pub gc_capacity: Option<(u64, u64)>,
}

impl Flushes {
    /// The budget interval garbage collection's releases imply under
    /// `threshold`: PyTorch collects only when what it reserved exceeds
    /// threshold × budget (`garbage_collect_cached_blocks`), so each
    /// collection bounds the budget below reserved ÷ threshold; every
    /// segment that fit bounds it from below. None without a collection,
    /// or when the two disagree.
    pub fn gc_budget(&self, threshold: f64) -> Option<(u64, u64)> {
        let before = self.gc_reserved_before?;
        if threshold <= 0.0 {
            return None;
        }
        // Collected: R > threshold × B, so B < R ÷ threshold, strictly.
        let hi = ((before as f64 / threshold).ceil() as u64).saturating_sub(1);
        let lo = self.peak_fit.max((self.gc_quiet_max as f64 / threshold).ceil() as u64);
        (lo <= hi).then_some((lo, hi))
    }

    /// The budget interval the releases bound: the retries', else the
    /// collections' (then true), where the what-if used them.
    pub fn releases_bound(&self) -> Option<(u64, u64, bool)> {
        self.capacity.map(|(lo, hi)| (lo, hi, false)).or(self.gc_capacity.map(|(lo, hi)| (lo, hi, true)))
    }
}

/// Whether an event gives memory back to the device.
pub(super) fn is_release(kind: EventKind) -> bool {
    matches!(kind, EventKind::SegmentFree | EventKind::SegmentUnmap)
}

pub(super) fn is_small_segment(size: u64) -> bool {
    size == crate::allocator::SMALL_BUFFER
}

/// The request stream of each process of a device-level trace (eBPF,
/// synthetic): successful allocations, frees, and failed allocations as
/// requests that ran out of memory.
/// For the units in `pytorch` ([`crate::analysis::oom::Retries`]), a
/// failed request that PyTorch's allocator asked again is one request: a
/// failed second ask is left out, and a failure that the second ask got
/// served is no request that ran out of memory (its `oom` is taken back).
pub fn device_level_streams<'e>(
    events: &'e crate::trace::event::Events,
    pytorch: &crate::analysis::oom::PytorchUnits,
) -> Vec<DeviceStream<'e>> {
    use crate::analysis::oom::Ask;
    let mut by: std::collections::BTreeMap<u32, DeviceStream> = Default::default();
    let mut retries = crate::analysis::oom::Retries::of(pytorch.clone());
    for i in 0..events.len() {
        let Some(kind) = events.kind[i] else { continue };
        match retries.see(kind, events.pid[i], events.size.at(i), events.ret[i]) {
            Ask::Retry => continue,
            Ask::Recovered => {
                if let Some(d) = by.get_mut(&events.pid[i]) {
                    let last_oom = d.all().rposition(|r| r.kind == EventKind::Oom);
                    if let Some(at) = last_oom {
                        d.remove(at);
                    }
                }
            }
            Ask::New => {}
        }
        let k = if kind.is_device_alloc() || (kind.is_alloc_request() && events.ret[i] != 0) {
            if events.ret[i] == 0 { EventKind::BlockAlloc } else { EventKind::Oom }
        } else if kind.releases_block() && events.ret[i] == 0 {
            EventKind::BlockFree
        } else {
            continue;
        };
        let pid = events.pid[i];
        let d = by.entry(pid).or_insert_with(|| DeviceStream::of_rows(pid, 0, events, true));
        d.push_row(events, i, Some(k));
    }
    by.into_values().collect()
}

/// The kinds of event the allocator model reads.
fn replays(kind: EventKind) -> bool {
    use EventKind::*;
    matches!(
        kind,
        BlockAlloc | BlockFree | BlockFreeRequested | SegmentAlloc | SegmentFree | SegmentMap | SegmentUnmap | Oom
    )
}

/// The request stream of each device of an imported snapshot (its time-
/// sorted events), with the reconstructed state before the first trace
/// entry: the first `initial_segments + initial_blocks` events of each
/// device.
pub fn streams<'e>(
    events: &'e crate::trace::event::Events,
    details: &crate::trace::details::SnapshotDetails,
    stacks: Option<&crate::trace::Stacks>,
) -> Vec<DeviceStream<'e>> {
    let mut by: std::collections::BTreeMap<u32, DeviceStream> = Default::default();
    for r in &details.reconstruction {
        let initial = (r.initial_segments + r.initial_blocks) as usize;
        by.insert(r.device, DeviceStream::of_rows(r.device, initial, events, false));
    }
    if let [only] = details.reconstruction.as_slice()
        && let Some(d) = by.get_mut(&only.device)
    {
        d.reserve_exact(events.len());
    }
    // A recording joined with the snapshot adds the allocations PyTorch
    // did not make, at their own call site: they are not the allocator's
    // requests, and its model does not replay them.
    let outside: std::collections::HashSet<u32> = stacks.map_or_else(Default::default, crate::input::outside_stacks);
    // What each release's stack says of who made it.
    let caller = |i: usize| {
        let id = events.stack.get(i).copied().unwrap_or(crate::trace::event::NO_STACK);
        match stacks.filter(|_| id != crate::trace::event::NO_STACK) {
            Some(st) if st.frames_of(id).any(|f| f.name == "empty_cache") => Caller::EmptyCache,
            Some(st) if st.frames_of(id).next().is_some() => Caller::Elsewhere,
            _ => Caller::Unknown,
        }
    };
    let mut callers: std::collections::BTreeMap<u32, Vec<Caller>> = Default::default();
    // Whether the trace's entries carry stacks at all (the history may
    // have been recorded without them).
    let mut stacked = false;
    for i in 0..events.len() {
        // The allocator's own events only: a recording's view also holds
        // its kernel launches, which would split a run of segment frees.
        let Some(kind) = events.kind[i].filter(|&k| replays(k)) else { continue };
        let Some(d) = by.get_mut(&events.pid[i]) else { continue };
        if !outside.is_empty() && events.stack.get(i).is_some_and(|s| outside.contains(s)) {
            continue;
        }
        stacked = stacked || caller(i) != Caller::Unknown;
        if is_release(kind) {
            let list = callers.entry(d.device).or_default();
            list.resize(d.len(), Caller::Unknown);
            list.push(caller(i));
        }
        d.push_row(events, i, None);
    }
    let settings = crate::allocator::Settings::from_snapshot(&details.allocator_settings);
    let mut out: Vec<DeviceStream> = by.into_values().collect();
    for d in &mut out {
        let callers = callers.remove(&d.device).unwrap_or_default();
        d.releases = classify_releases(d, &callers, stacked, &settings);
        d.flushes = find_flushes(d);
    }
    out
}

/// The flushes of a device's stream, from its classified releases
/// ([`Flushes`]).
pub(super) fn find_flushes(d: &DeviceStream) -> Flushes {
    // A cache largely built before the trace's first entry (a tenth of its
    // peak or more, as elsewhere): retries may have come before it.
    let before = d.initial_reserved();
    let mut f = Flushes::default();
    let mut reserved: u64 = 0;
    let (mut lo, mut hi) = (0u64, u64::MAX);
    // The run of releases just ended, and what was reserved before it.
    let mut run: Option<(u64, u64, u64)> = None; // (reserved before, segments, bytes)
    let mut last: Option<Release> = None;
    // Segments (not expandable ones' pages) by address: size and blocks
    // live in each; and how many large ones are wholly free.
    let mut segments: std::collections::BTreeMap<u64, (u64, u64)> = std::collections::BTreeMap::new();
    let mut free_large: u64 = 0;
    let large = |size: u64| !is_small_segment(size);
    for (i, r) in d.all().enumerate() {
        match r.kind {
            EventKind::BlockAlloc | EventKind::BlockFree => {
                if let Some((_, (size, live))) =
                    segments.range_mut(..=r.addr).next_back().filter(|(a, (s, _))| r.addr < *a + *s)
                {
                    let was_free = *live == 0;
                    if r.kind == EventKind::BlockAlloc {
                        *live += 1;
                    } else {
                        *live = live.saturating_sub(1);
                    }
                    if large(*size) && was_free != (*live == 0) {
                        if was_free {
                            free_large -= 1;
                        } else {
                            free_large += 1;
                        }
                    }
                }
                // A block event ends a run of releases, as in
                // `classify_releases`.
                run = None;
                last = None;
                continue;
            }
            _ => {}
        }
        match r.kind {
            EventKind::SegmentFree | EventKind::SegmentUnmap => {
                if let Some((size, live)) = segments.remove(&r.addr)
                    && live == 0
                    && large(size)
                {
                    free_large -= 1;
                }
                let e = run.get_or_insert((reserved, 0, 0));
                *e = (e.0, e.1 + 1, e.2 + r.size);
                reserved = reserved.saturating_sub(r.size);
                if let Some(&kind) = d.releases.get(&i) {
                    last = Some(kind);
                    match kind {
                        Release::Retry => {
                            f.count += 1;
                            f.segments_freed += e.1;
                            f.bytes_freed += e.2;
                        }
                        Release::Collection => {
                            f.gc_releases += 1;
                            f.gc_reserved_before = Some(f.gc_reserved_before.map_or(e.0, |r| r.min(e.0)));
                        }
                        Release::Oversize => f.oversize_releases += 1,
                        Release::Unknown => f.at_least = true,
                        Release::Program => {}
                    }
                }
                continue;
            }
            EventKind::SegmentAlloc | EventKind::SegmentMap => {
                if i >= d.initial
                    && let (Some((before, _, _)), Some(Release::Retry | Release::Oversize)) = (run, last)
                {
                    hi = hi.min((before + r.size).saturating_sub(1));
                }
                // A new segment (in either pool: PyTorch collects before
                // any) with a free large one cached, and no collection
                // released it: reserved was not over the
                // threshold.
                if i >= d.initial && r.kind == EventKind::SegmentAlloc && free_large > 0 && run.is_none() {
                    f.gc_quiet_max = f.gc_quiet_max.max(reserved);
                }
                if r.kind == EventKind::SegmentAlloc {
                    // (A segment made again at a live address, in a
                    // malformed trace, replaces the one there.)
                    if let Some((size, live)) = segments.insert(r.addr, (r.size, 0))
                        && live == 0
                        && large(size)
                    {
                        free_large -= 1;
                    }
                    if large(r.size) {
                        free_large += 1;
                    }
                }
                reserved += r.size;
                lo = lo.max(reserved);
            }
            // An OOM comes after a retry; one that released nothing shows
            // in no entry.
            EventKind::Oom if i >= d.initial && !(run.is_some() && last == Some(Release::Retry)) => f.count += 1,
            _ => {}
        }
        run = None;
        last = None;
    }
    f.capacity = (hi != u64::MAX && lo <= hi).then_some((lo, hi));
    f.peak_fit = lo;
    f.at_least |= before > 0 && before >= lo / 10;
    f
}

/// The capacity a recording's first `oom` entry implies: the free memory
/// CUDA reported plus what the recording had reserved then.
pub fn inferred_capacity(d: &DeviceStream) -> Option<u64> {
    let mut reserved: u64 = 0;
    for r in d.all() {
        match r.kind {
            EventKind::SegmentAlloc | EventKind::SegmentMap => reserved += r.size,
            EventKind::SegmentFree | EventKind::SegmentUnmap => reserved = reserved.saturating_sub(r.size),
            EventKind::Oom => {
                if let Some(free) = r.device_free {
                    return Some(free + reserved);
                }
            }
            _ => {}
        }
    }
    None
}
