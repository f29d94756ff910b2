//! PyTorch CUDA memory snapshots (SPEC §8): from the pickle to a trace.
//!
//! Three steps:
//! 1. [`Snapshot::read`] types the plain data [`crate::import::pickle`] parses into
//!    segments, blocks and trace entries (the entries as they are appended
//!    to their list, so their dicts never pile up). Frames are interned as
//!    they are met: a frame dict or frame list shared through the memo is
//!    looked up by identity first, by content second, so a stack shared a
//!    hundred thousand times costs one table row.
//! 2. [`reconstruct`] undoes each device's trace backwards from the final
//!    segments and blocks (the trace is a ring buffer that may have dropped
//!    its start), giving the state before the first entry.
//! 3. It then replays the entries forwards from that state, emitting
//!    events, and checks that the replay ends exactly at the snapshot's
//!    final state; every difference is counted in [`Reconstruction`].
//!
//! Block sizes. Trace entries carry the *requested* size, not the size of
//! the block the allocator handed out. A block still alive at the end has its
//! real size in the snapshot, and the replay uses it. For the others the
//! size follows the caching allocator's rules: the request rounded up to
//! 512 bytes, and the rest of the free block taken too when it would be too
//! small to split off (< 512 B in the small pool, ≤ 1 MiB in the large
//! pool, i.e. for requests above 1 MiB). `max_split_size` settings are not
//! modelled. On blocks whose real size is known the rule is checked, and
//! the agreement is reported (`sizes_checked`, `sizes_agreed`).

use std::path::Path;

use ahash::AHashMap;
use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::import::pickle::Value;
use crate::import::settings::{MIN_BLOCK, SMALL_SIZE, Settings};
use crate::trace::details::{Annotation, Details, Reconstruction, SegmentRow, SnapshotDetails, Totals};
use crate::trace::event::{Event, EventKind, Extra, NO_STACK};
use crate::trace::{Frame, Stacks};

/// A block's state in the snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    ActiveAllocated,
    ActivePendingFree,
    Inactive,
}

impl BlockState {
    fn parse(s: &str) -> Option<BlockState> {
        match s {
            "active_allocated" => Some(BlockState::ActiveAllocated),
            "active_pending_free" | "active_awaiting_free" => Some(BlockState::ActivePendingFree),
            "inactive" => Some(BlockState::Inactive),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }

    /// Holds memory the program has not given back yet.
    pub fn is_live(self) -> bool {
        self != BlockState::Inactive
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Block {
    pub address: u64,
    pub size: u64,
    pub requested: u64,
    pub state: BlockState,
    pub stack: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Segment {
    pub device: u32,
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    pub segment_type: String,
    pub is_expandable: bool,
    pub blocks: Vec<Block>,
}

/// A trace entry's action.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Snapshot,
    Oom,
}

impl Action {
    fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            // Before free_requested/free_completed existed, a free was `free`.
            "free_completed" | "free" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "snapshot" => Action::Snapshot,
            "oom" => Action::Oom,
            _ => return None,
        })
    }
}

/// A trace entry, packed in 40 bytes: a big snapshot has millions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Entry {
    pub action: Action,
    /// The address; for `oom`, the device's free memory (`u64::MAX` when
    /// the entry has none), as oom entries have no address.
    addr: u64,
    /// Requested size (alloc and frees), segment size, or the failed request (oom).
    pub size: u64,
    pub stream: u64,
    /// `i64::MIN` when absent.
    time_us: i64,
    /// `NO_STACK` when absent.
    stack: u32,
}

impl Entry {
    pub fn time_us(&self) -> Option<i64> {
        (self.time_us != i64::MIN).then_some(self.time_us)
    }

    pub fn stack(&self) -> Option<u32> {
        (self.stack != NO_STACK).then_some(self.stack)
    }

    pub fn device_free(&self) -> Option<u64> {
        (self.action == Action::Oom && self.addr != u64::MAX).then_some(self.addr)
    }
}

/// A snapshot, typed.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub segments: Vec<Segment>,
    /// One list per device index.
    pub traces: Vec<Vec<Entry>>,
    pub allocator_settings: serde_json::Value,
    pub stacks: Stacks,
    /// The file was a bare list of segments (the oldest layout).
    pub bare_list: bool,
    /// Blocks that had `history` instead of `frames` (an old layout).
    pub legacy_history_blocks: u64,
    /// Blocks without `address` (placed by accumulating sizes).
    pub blocks_without_address: u64,
    /// Entries with an action this version does not know (ignored).
    pub unknown_actions: u64,
    /// `external_annotations`: profiler ranges (`record_function`), with
    /// `time_us` turned into the trace's ns.
    pub annotations: Vec<Annotation>,
}

/// Turns the memo's shared frame dicts and lists into table ids.
#[derive(Default)]
struct Interner {
    frame_by_ptr: AHashMap<usize, u32>,
    frame_by_value: AHashMap<Frame, u32>,
    stack_by_ptr: AHashMap<usize, u32>,
    stack_by_value: AHashMap<Vec<u32>, u32>,
    stacks: Stacks,
    /// Keeps interned objects alive so their addresses stay unique keys.
    keep: Vec<Value>,
}

impl Interner {
    fn frame(&mut self, v: &Value) -> Result<u32> {
        let ptr = identity(v);
        if let Some(&id) = ptr.and_then(|p| self.frame_by_ptr.get(&p)) {
            return Ok(id);
        }
        let text = |k: &str| v.get(k).and_then(|x| x.as_str().map(str::to_string)).unwrap_or_default();
        let line = v.get("line").and_then(|x| x.as_int()).unwrap_or(0);
        let frame = Frame {
            filename: text("filename"),
            line: line.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
            name: text("name"),
        };
        let id = intern(&mut self.frame_by_value, &mut self.stacks.frames, frame);
        if let Some(p) = ptr {
            self.frame_by_ptr.insert(p, id);
            self.keep.push(v.clone());
        }
        Ok(id)
    }

    /// The stack id of a frame list (None for an empty or absent one).
    fn stack(&mut self, v: Option<&Value>) -> Result<Option<u32>> {
        let Some(v) = v else { return Ok(None) };
        let ptr = identity(v);
        if let Some(&id) = ptr.and_then(|p| self.stack_by_ptr.get(&p)) {
            return Ok(Some(id));
        }
        let frames: Vec<u32> = match v {
            Value::List(l) => l.borrow().iter().map(|f| self.frame(f)).collect::<Result<_>>()?,
            Value::Tuple(t) => t.iter().map(|f| self.frame(f)).collect::<Result<_>>()?,
            Value::None => return Ok(None),
            _ => bail!("`frames` is not a list"),
        };
        if frames.is_empty() {
            return Ok(None);
        }
        let id = intern(&mut self.stack_by_value, &mut self.stacks.stacks, frames);
        if let Some(p) = ptr {
            self.stack_by_ptr.insert(p, id);
            self.keep.push(v.clone());
        }
        Ok(Some(id))
    }
}

use crate::import::pickle::container as identity;

/// The id of `key` in `table`, appending it the first time.
fn intern<K: Clone + Eq + std::hash::Hash>(index: &mut AHashMap<K, u32>, table: &mut Vec<K>, key: K) -> u32 {
    let next = table.len() as u32;
    *index.entry(key.clone()).or_insert_with(|| {
        table.push(key);
        next
    })
}

/// Runs `f` over the items of a list or tuple.
fn each(v: &Value, what: &str, mut f: impl FnMut(usize, &Value) -> Result<()>) -> Result<()> {
    match v {
        Value::List(l) => l.borrow().iter().enumerate().try_for_each(|(i, x)| f(i, x)),
        Value::Tuple(t) => t.iter().enumerate().try_for_each(|(i, x)| f(i, x)),
        _ => bail!("{what} is not a list"),
    }
}

/// The value of dict key `key` as an unsigned integer (None: absent or None).
fn uint(v: &Value, key: &str) -> Result<Option<u64>> {
    v.get(key).map_or(Ok(None), |x| as_u64(key, &x))
}

/// `x`, the value of `key`, as an unsigned integer (None for None).
fn as_u64(key: &str, x: &Value) -> Result<Option<u64>> {
    match x {
        Value::None => Ok(None),
        x => match x.as_int() {
            Some(i) if (0..=u64::MAX as i128).contains(&i) => Ok(Some(i as u64)),
            Some(i) => bail!("`{key}` = {i} is out of range"),
            None => bail!("`{key}` is not an integer"),
        },
    }
}

fn need(v: &Value, key: &str) -> Result<u64> {
    uint(v, key)?.with_context(|| format!("missing `{key}`"))
}

impl Snapshot {
    /// Reads and parses a snapshot file.
    pub fn read(path: &Path) -> Result<Snapshot> {
        let started = std::time::Instant::now();
        let len = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?.len();
        let mut interner = Interner::default();
        let mut lists: AHashMap<usize, Vec<Entry>> = AHashMap::new();
        let mut unknown_actions = 0u64;
        // Trace entries are typed as they are appended to their list, so
        // the millions of entry dicts never exist at once.
        let mut hook = |list: usize, v: Value| -> std::result::Result<Option<Value>, String> {
            if !matches!(v, Value::Dict(_)) || v.get("action").is_none() {
                return Ok(Some(v));
            }
            match entry(&v, &mut interner) {
                Ok(Some(e)) => lists.entry(list).or_default().push(e),
                Ok(None) => unknown_actions += 1,
                Err(e) => return Err(format!("trace entry {}: {e:#}", lists.get(&list).map_or(0, Vec::len))),
            }
            Ok(None)
        };
        let value = crate::import::pickle::parse_stream(
            || std::fs::File::open(path),
            usize::try_from(len).unwrap_or(usize::MAX),
            &mut hook,
        )
        .with_context(|| format!("{}: not a readable snapshot", path.display()))?;
        tracing::info!("parsed in {:.3} s", started.elapsed().as_secs_f64());
        let mut snap = Snapshot::from_parts(&value, interner, lists)
            .with_context(|| format!("{}: not a PyTorch memory snapshot", path.display()))?;
        snap.unknown_actions += unknown_actions;
        Ok(snap)
    }

    /// Types a parsed pickle whose trace entries were already taken out of
    /// their lists (by list identity) while parsing.
    fn from_parts(v: &Value, mut interner: Interner, mut lists: AHashMap<usize, Vec<Entry>>) -> Result<Snapshot> {
        let mut snap = Snapshot::default();
        let segments = match v {
            Value::List(_) | Value::Tuple(_) => {
                snap.bare_list = true;
                v.clone()
            }
            Value::Dict(_) => v.get("segments").context("no `segments` key at the top level")?,
            _ => bail!("the top level is neither a dict nor a list of segments"),
        };
        each(&segments, "`segments`", |i, s| {
            let seg = snap.segment(s, &mut interner).with_context(|| format!("segment {i}"))?;
            snap.segments.push(seg);
            Ok(())
        })?;
        if let Some(traces) = v.get("device_traces") {
            each(&traces, "`device_traces`", |d, list| {
                let mut entries = identity(list).and_then(|p| lists.remove(&p)).unwrap_or_default();
                each(list, "a device trace", |i, e| {
                    match entry(e, &mut interner).with_context(|| format!("device {d}, trace entry {i}"))? {
                        Some(entry) => entries.push(entry),
                        None => snap.unknown_actions += 1,
                    }
                    Ok(())
                })?;
                snap.traces.push(entries);
                Ok(())
            })?;
        }
        if let Some(s) = v.get("allocator_settings") {
            snap.allocator_settings = to_json(&s, 0);
        }
        if let Some(list) = v.get("external_annotations") {
            each(&list, "`external_annotations`", |i, a| {
                let text = |k: &str| a.get(k).and_then(|x| x.as_str().map(str::to_string));
                let (Some(stage), Some(name)) = (text("stage"), text("name")) else {
                    bail!("annotation {i}: no `stage` or `name`")
                };
                let device = uint(a, "device")?.unwrap_or(0);
                anyhow::ensure!(device < 1 << 16, "annotation {i}: `device` = {device} is not a device index");
                let Some(t_us) = uint(a, "time_us")? else { return Ok(()) };
                snap.annotations.push(Annotation {
                    stage,
                    name,
                    device: device as u32,
                    t_ns: t_us.saturating_mul(1000),
                });
                Ok(())
            })?;
        }
        snap.stacks = std::mem::take(&mut interner.stacks);
        Ok(snap)
    }

    fn segment(&mut self, s: &Value, interner: &mut Interner) -> Result<Segment> {
        let address = need(s, "address")?;
        let total_size = need(s, "total_size")?;
        let device = uint(s, "device")?.unwrap_or(0);
        anyhow::ensure!(device < 1 << 16, "`device` = {device} is not a device index");
        let mut blocks = Vec::new();
        let mut offset = address;
        if let Some(list) = s.get("blocks") {
            each(&list, "`blocks`", |j, b| {
                let block = self.block(b, offset, interner).with_context(|| format!("block {j}"))?;
                offset = block.address.saturating_add(block.size);
                blocks.push(block);
                Ok(())
            })?;
        }
        Ok(Segment {
            device: device as u32,
            address,
            total_size,
            stream: uint(s, "stream")?.unwrap_or(0),
            segment_type: s.get("segment_type").and_then(|t| t.as_str().map(str::to_string)).unwrap_or_default(),
            is_expandable: matches!(s.get("is_expandable"), Some(Value::Bool(true))),
            blocks,
        })
    }

    fn block(&mut self, b: &Value, offset: u64, interner: &mut Interner) -> Result<Block> {
        let size = need(b, "size")?;
        let address = match uint(b, "address")? {
            Some(a) => a,
            None => {
                self.blocks_without_address += 1;
                offset
            }
        };
        let state = b.get("state").context("missing `state`")?;
        let state =
            state.as_str().and_then(BlockState::parse).with_context(|| format!("unknown block state {state:?}"))?;
        let (stack, requested) = if b.get("frames").is_some() {
            (interner.stack(b.get("frames").as_ref())?, uint(b, "requested_size")?.unwrap_or(size))
        } else if let Some(history) = b.get("history") {
            // Old layout: the first history record holds the allocation.
            self.legacy_history_blocks += 1;
            let first = history.items().and_then(|h| h.into_iter().next());
            match first {
                Some(h) => (interner.stack(h.get("frames").as_ref())?, uint(&h, "real_size")?.unwrap_or(size)),
                None => (None, size),
            }
        } else {
            (None, uint(b, "requested_size")?.unwrap_or(size))
        };
        Ok(Block { address, size, requested, state, stack })
    }

    /// Device indices present in the segments or the traces.
    pub fn devices(&self) -> Vec<u32> {
        let mut d: Vec<u32> = self.segments.iter().map(|s| s.device).collect();
        d.extend((0..self.traces.len() as u32).filter(|&i| !self.traces[i as usize].is_empty()));
        d.sort_unstable();
        d.dedup();
        d
    }
}

/// Types one trace entry (None: an action this version does not know).
/// One pass over the dict's pairs: this runs millions of times.
fn entry(e: &Value, interner: &mut Interner) -> Result<Option<Entry>> {
    let Value::Dict(d) = e else { bail!("not a dict") };
    let (mut action, mut addr, mut size, mut stream, mut time_us, mut frames, mut device_free) =
        (None, None, None, None, None, None, None);
    for (k, v) in d.borrow().iter() {
        match k.as_str() {
            Some("action") => action = Some(Action::parse(v.as_str().context("`action` is not a string")?)),
            Some("addr") => addr = as_u64("addr", v)?,
            Some("size") => size = as_u64("size", v)?,
            Some("stream") => stream = as_u64("stream", v)?,
            Some("time_us") => {
                time_us = Some(v.as_int().context("`time_us` is not an integer")?.clamp(0, i64::MAX as i128) as i64)
            }
            Some("frames") => frames = Some(v.clone()),
            Some("device_free") => device_free = as_u64("device_free", v)?,
            _ => {}
        }
    }
    let Some(action) = action.context("missing `action`")? else { return Ok(None) };
    Ok(Some(Entry {
        action,
        addr: if action == Action::Oom { device_free.unwrap_or(u64::MAX) } else { addr.context("missing `addr`")? },
        size: size.unwrap_or(0),
        stream: stream.unwrap_or(0),
        time_us: time_us.unwrap_or(i64::MIN),
        stack: interner.stack(frames.as_ref())?.unwrap_or(NO_STACK),
    }))
}

/// Plain data to JSON (allocator settings), depth-limited.
fn to_json(v: &Value, depth: usize) -> serde_json::Value {
    use serde_json::Value as J;
    if depth > 16 {
        return J::Null;
    }
    match v {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::UInt(u) => J::from(*u),
        Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        Value::Str(s) => J::String(s.to_string()),
        Value::List(_) | Value::Tuple(_) => {
            J::Array(v.items().unwrap_or_default().iter().map(|x| to_json(x, depth + 1)).collect())
        }
        Value::Dict(d) => J::Object(
            d.borrow()
                .iter()
                .map(|(k, x)| {
                    let key = k.as_str().map(str::to_string).unwrap_or_else(|| format!("{:?}", to_json(k, depth + 1)));
                    (key, to_json(x, depth + 1))
                })
                .collect(),
        ),
    }
}

/// A live block during reconstruction.
#[derive(Clone, Copy, Debug)]
struct LiveBlock {
    /// The real size, when the snapshot knows it.
    size: Option<u64>,
    requested: u64,
    stack: Option<u32>,
    stream: u64,
}

/// Address ranges of segments (start → (end, expandable, stream)).
type Ranges = std::collections::BTreeMap<u64, (u64, bool, u64)>;

/// Adds [a, b) to the ranges. Mapped pages (`merge`) join an adjacent
/// expandable range; a cudaMalloc'ed segment stays on its own.
fn add_range(r: &mut Ranges, a: u64, b: u64, expandable: bool, stream: u64, merge: bool) {
    let (mut a, mut b) = (a, b);
    if merge {
        if let Some((&s, &(e, true, _))) = r.range(..=a).next_back()
            && e == a
        {
            r.remove(&s);
            a = s;
        }
        if let Some(&(e, true, _)) = r.get(&b) {
            r.remove(&b);
            b = e;
        }
    }
    r.insert(a, (b, expandable, stream));
}

/// Removes [a, b) from the range containing it; false if none does.
fn remove_range(r: &mut Ranges, a: u64, b: u64) -> bool {
    let Some((&s, &(e, x, st))) = r.range(..=a).next_back() else { return false };
    if b > e {
        return false;
    }
    r.remove(&s);
    if s < a {
        r.insert(s, (a, x, st));
    }
    if b < e {
        r.insert(b, (e, x, st));
    }
    true
}

/// The size the caching allocator gives a request placed at `addr`, where
/// the free space runs up to `free_end`, under the recorded `settings`
/// (rounding with `roundup_power2_divisions`; no split at or above
/// `max_split_size`; with expandable segments a rest of 512 B is split off
/// in the large pool too).
fn block_size_rule(settings: &Settings, requested: u64, addr: u64, free_end: u64) -> u64 {
    let rounded = settings.round(requested.max(1));
    let room = free_end.saturating_sub(addr);
    if room <= rounded {
        return rounded.min(room.max(rounded.min(room)));
    }
    let rest = room - rounded;
    // With expandable segments every pool splits off a rest of 512 B.
    let unsplit = if rounded > SMALL_SIZE && !settings.expandable_segments {
        rest <= SMALL_SIZE || settings.max_split_size.is_some_and(|m| rounded >= m)
    } else {
        rest < MIN_BLOCK
    };
    if unsplit { room } else { rounded }
}

/// The events of one device: the reconstructed initial state at the first
/// entry's time, then every entry. `t0_ns` is the time given to the initial
/// state when the device's trace is empty.
pub fn reconstruct(snap: &Snapshot, device: u32, t0_ns: u64, out: Sink<'_>) -> Result<Reconstruction> {
    let entries: &[Entry] = snap.traces.get(device as usize).map_or(&[], |t| t.as_slice());
    let settings = Settings::from_snapshot(&snap.allocator_settings);
    let mut rec = Reconstruction { device, entries: entries.len() as u64, ..Default::default() };
    let segs: Vec<&Segment> = snap.segments.iter().filter(|s| s.device == device).collect();

    // The final state.
    let mut ranges = Ranges::new();
    let mut live: AHashMap<u64, LiveBlock> = AHashMap::new();
    for s in &segs {
        ranges.insert(s.address, (s.address.saturating_add(s.total_size), s.is_expandable, s.stream));
        for b in s.blocks.iter().filter(|b| b.state.is_live()) {
            live.insert(
                b.address,
                LiveBlock { size: Some(b.size), requested: b.requested, stack: b.stack, stream: s.stream },
            );
        }
    }
    let final_ranges = ranges.clone();
    let final_live = live.clone();

    // Backwards: undo each entry. `known[i]` is the real size of the block
    // alloc entry i created, when that block is still alive at the end:
    // a map, since those are few (a vector by entry was 16 bytes for each
    // of millions of entries, all but a few thousand of them None).
    let mut known: AHashMap<usize, u64> = AHashMap::new();
    for (i, e) in entries.iter().enumerate().rev() {
        match e.action {
            Action::Alloc => match live.remove(&e.addr) {
                Some(b) => {
                    if let Some(size) = b.size {
                        known.insert(i, size);
                    }
                }
                None => rec.inconsistent_entries += 1,
            },
            Action::FreeCompleted => {
                let b = LiveBlock { size: None, requested: e.size, stack: e.stack(), stream: e.stream };
                if live.insert(e.addr, b).is_some() {
                    rec.inconsistent_entries += 1;
                }
            }
            Action::SegmentAlloc | Action::SegmentMap => {
                if !remove_range(&mut ranges, e.addr, e.addr.saturating_add(e.size)) {
                    rec.inconsistent_entries += 1;
                }
            }
            Action::SegmentFree => {
                add_range(&mut ranges, e.addr, e.addr.saturating_add(e.size), false, e.stream, false)
            }
            Action::SegmentUnmap => add_range(&mut ranges, e.addr, e.addr.saturating_add(e.size), true, e.stream, true),
            Action::FreeRequested | Action::Snapshot | Action::Oom => {}
        }
    }

    // Forwards, emitting events.
    let with_time = !entries.is_empty() && entries.iter().all(|e| e.time_us().is_some());
    let ts_of = |i: usize| -> u64 {
        if with_time { (entries[i].time_us().unwrap_or(0) as u64).saturating_mul(1000) } else { t0_ns + i as u64 }
    };
    let t_start = if entries.is_empty() { t0_ns } else { ts_of(0) };
    let pid = device;
    let ev = |ts: u64, kind: EventKind, addr: u64, size: u64, stream: u64, extra: Extra| Event {
        ts_ns: ts,
        duration_ns: 0,
        pid,
        tid: 0,
        kind,
        addr,
        size,
        ret: 0,
        device: Some(device as i32),
        stream: Some(stream),
        extra,
        cuda: Default::default(),
    };
    rec.initial_segments = ranges.len() as u64;
    for (&a, &(b, expandable, stream)) in &ranges {
        let kind = if expandable { EventKind::SegmentMap } else { EventKind::SegmentAlloc };
        out(ev(t_start, kind, a, b - a, stream, Extra::default()))?;
    }
    // Live blocks by address, for the free space after a new block.
    let mut placed: std::collections::BTreeMap<u64, LiveBlock> = std::collections::BTreeMap::new();
    let free_end = |placed: &std::collections::BTreeMap<u64, LiveBlock>, ranges: &Ranges, addr: u64| -> u64 {
        let seg_end = ranges.range(..=addr).next_back().map_or(addr, |(_, &(e, _, _))| e);
        let next = placed.range(addr + 1..).next().map_or(u64::MAX, |(&a, _)| a);
        seg_end.min(next).max(addr)
    };
    let mut initial: Vec<(u64, LiveBlock)> = live.into_iter().collect();
    initial.sort_unstable_by_key(|p| p.0);
    rec.initial_blocks = initial.len() as u64;
    for (addr, mut b) in initial.into_iter().rev() {
        let size =
            b.size.unwrap_or_else(|| block_size_rule(&settings, b.requested, addr, free_end(&placed, &ranges, addr)));
        b.size = Some(size);
        placed.insert(addr, b);
    }
    for (&addr, b) in &placed {
        let extra = Extra { requested: Some(b.requested), stack: b.stack, device_free: None };
        out(ev(t_start, EventKind::BlockAlloc, addr, b.size.unwrap_or(0), b.stream, extra))?;
    }
    for (i, e) in entries.iter().enumerate() {
        let ts = ts_of(i);
        let end = e.addr.saturating_add(e.size);
        match e.action {
            Action::Alloc => {
                if placed.contains_key(&e.addr) {
                    continue; // counted as inconsistent on the way back
                }
                let rule = block_size_rule(&settings, e.size, e.addr, free_end(&placed, &ranges, e.addr));
                let size = match known.get(&i).copied() {
                    Some(real) => {
                        rec.sizes_checked += 1;
                        rec.sizes_agreed += u64::from(real == rule);
                        real
                    }
                    None => rule,
                };
                placed.insert(
                    e.addr,
                    LiveBlock { size: Some(size), requested: e.size, stack: e.stack(), stream: e.stream },
                );
                let extra = Extra { requested: Some(e.size), stack: e.stack(), device_free: None };
                out(ev(ts, EventKind::BlockAlloc, e.addr, size, e.stream, extra))?;
            }
            Action::FreeRequested | Action::FreeCompleted => {
                let Some(b) = placed.get(&e.addr).copied() else { continue };
                let kind = if e.action == Action::FreeCompleted {
                    placed.remove(&e.addr);
                    EventKind::BlockFree
                } else {
                    EventKind::BlockFreeRequested
                };
                let extra = Extra { requested: Some(e.size), stack: e.stack(), device_free: None };
                out(ev(ts, kind, e.addr, b.size.unwrap_or(0), e.stream, extra))?;
            }
            Action::SegmentAlloc => {
                add_range(&mut ranges, e.addr, end, false, e.stream, false);
                out(ev(ts, EventKind::SegmentAlloc, e.addr, e.size, e.stream, Extra::default()))?;
            }
            Action::SegmentMap => {
                add_range(&mut ranges, e.addr, end, true, e.stream, true);
                out(ev(ts, EventKind::SegmentMap, e.addr, e.size, e.stream, Extra::default()))?;
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                if remove_range(&mut ranges, e.addr, end) {
                    let kind =
                        if e.action == Action::SegmentFree { EventKind::SegmentFree } else { EventKind::SegmentUnmap };
                    // Its stack tells the program's empty_cache() from the
                    // allocator's own release before a retry.
                    out(ev(ts, kind, e.addr, e.size, e.stream, Extra { stack: e.stack(), ..Extra::default() }))?;
                }
            }
            Action::Oom => {
                let extra = Extra { requested: Some(e.size), stack: e.stack(), device_free: e.device_free() };
                out(ev(ts, EventKind::Oom, 0, e.size, e.stream, extra))?;
            }
            Action::Snapshot => {}
        }
    }

    // The end state against the snapshot.
    let fc = &mut rec.final_check;
    fc.blocks_expected = final_live.len() as u64;
    for (addr, b) in &final_live {
        match placed.get(addr) {
            None => fc.blocks_missing += 1,
            Some(p) if p.size != b.size || p.requested != b.requested => fc.blocks_size_mismatch += 1,
            Some(_) => {}
        }
    }
    fc.blocks_unexpected = placed.keys().filter(|a| !final_live.contains_key(a)).count() as u64;
    fc.segments_expected = segs.len() as u64;
    fc.segment_bytes_expected = segs.iter().map(|s| s.total_size).sum();
    fc.segment_bytes_replayed = ranges.iter().map(|(a, (b, _, _))| b - a).sum();
    let flat = |r: &Ranges| -> Vec<(u64, u64)> { r.iter().map(|(&a, &(b, _, _))| (a, b)).collect() };
    let (want, got) = (flat(&final_ranges), flat(&ranges));
    fc.segment_ranges_mismatch = want.iter().filter(|r| !got.contains(r)).count() as u64
        + got.iter().filter(|r| !want.contains(r)).count() as u64;
    Ok(rec)
}

/// Where converted events go.
pub type Sink<'s> = &'s mut dyn FnMut(Event) -> Result<()>;

impl Totals {
    pub fn of<'a>(segments: impl IntoIterator<Item = &'a Segment>) -> Totals {
        let mut t = Totals::default();
        for s in segments {
            t.segments += 1;
            t.reserved += s.total_size;
            for b in &s.blocks {
                if b.state == BlockState::ActiveAllocated {
                    t.allocated += b.requested;
                    t.free_internal += b.size.saturating_sub(b.requested);
                } else {
                    t.free_external += b.size;
                }
            }
        }
        t.free = t.reserved.saturating_sub(t.allocated);
        t
    }
}

/// What a conversion found, besides the events it emitted.
#[derive(Debug)]
pub struct Converted {
    pub meta: crate::trace::TraceMeta,
    pub stacks: Stacks,
    pub reconstructions: Vec<Reconstruction>,
}

/// Reads `path` and converts the selected device (default: all), sending
/// the events to `sink` in time order.
pub fn convert_file(path: &Path, device: Option<u32>, sink: Sink<'_>) -> Result<Converted> {
    let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let snap = Snapshot::read(path)?;
    let started = std::time::Instant::now();
    let converted = convert(snap, device, &path.display().to_string(), file_bytes, sink)
        .with_context(|| format!("{}: cannot convert the snapshot", path.display()))?;
    tracing::info!("converted in {:.3} s", started.elapsed().as_secs_f64());
    Ok(converted)
}

/// Converts a typed snapshot: reconstruction and events per device, and the
/// trace metadata (SPEC §2: device count, allocator settings, final segment
/// table; plus the reconstruction's checks and PyTorch's totals). With one
/// device the events stream straight to `sink`; with several, each
/// device's events are collected and merged by time.
pub fn convert(
    mut snap: Snapshot,
    device: Option<u32>,
    source: &str,
    file_bytes: u64,
    sink: Sink<'_>,
) -> Result<Converted> {
    let all = snap.devices();
    let devices: Vec<u32> = match device {
        Some(d) if all.contains(&d) => vec![d],
        Some(d) => bail!("device {d} is not in this snapshot (it has device(s) {all:?})"),
        None => all.clone(),
    };
    let timed = |snap: &Snapshot, d: u32| {
        snap.traces.get(d as usize).is_some_and(|t| !t.is_empty() && t.iter().all(|e| e.time_us().is_some()))
    };
    let t0 = devices
        .iter()
        .filter(|&&d| timed(&snap, d))
        .filter_map(|&d| snap.traces[d as usize][0].time_us())
        .min()
        .map_or(0, |t| (t as u64).saturating_mul(1000));
    let untimed: Vec<u32> = devices
        .iter()
        .copied()
        .filter(|&d| !timed(&snap, d) && snap.traces.get(d as usize).is_some_and(|t| !t.is_empty()))
        .collect();
    let mut reconstructions = Vec::new();
    if devices.len() == 1 {
        reconstructions.push(reconstruct(&snap, devices[0], t0, sink)?);
    } else {
        let mut per_device: Vec<std::vec::IntoIter<Event>> = Vec::new();
        for &d in &devices {
            let mut events = Vec::new();
            reconstructions.push(reconstruct(&snap, d, t0, &mut |e| {
                events.push(e);
                Ok(())
            })?);
            if let Some(t) = snap.traces.get_mut(d as usize) {
                *t = Vec::new(); // done with this device's entries
            }
            per_device.push(events.into_iter());
        }
        // k-way merge by time (ties: lower device first).
        let mut heads: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>> = Default::default();
        let mut next: Vec<Option<Event>> = per_device.iter_mut().map(|it| it.next()).collect();
        for (i, e) in next.iter().enumerate() {
            if let Some(e) = e {
                heads.push(std::cmp::Reverse((e.ts_ns, i)));
            }
        }
        while let Some(std::cmp::Reverse((_, i))) = heads.pop() {
            if let Some(e) = next[i].take() {
                sink(e)?;
            }
            next[i] = per_device[i].next();
            if let Some(e) = &next[i] {
                heads.push(std::cmp::Reverse((e.ts_ns, i)));
            }
        }
    }

    let mut meta = crate::trace::TraceMeta::new(crate::trace::Source::PytorchSnapshot);
    meta.host = String::new();
    let segments: Vec<&Segment> = snap.segments.iter().filter(|s| devices.contains(&s.device)).collect();
    let totals: std::collections::BTreeMap<String, Totals> = devices
        .iter()
        .map(|&d| (d.to_string(), Totals::of(segments.iter().copied().filter(|s| s.device == d))))
        .collect();
    let table: Vec<SegmentRow> = segments
        .iter()
        .map(|s| {
            let active = |st: BlockState| s.blocks.iter().filter(|b| b.state == st).map(|b| b.size).sum::<u64>();
            SegmentRow {
                device: u64::from(s.device),
                address: s.address,
                total_size: s.total_size,
                stream: s.stream,
                segment_type: s.segment_type.clone(),
                is_expandable: s.is_expandable,
                blocks: s.blocks.len() as u64,
                active_allocated_bytes: active(BlockState::ActiveAllocated),
                active_pending_free_bytes: active(BlockState::ActivePendingFree),
            }
        })
        .collect();
    meta.details = Details::Snapshot(Box::new(SnapshotDetails {
        snapshot: source.to_string(),
        file_bytes,
        layout: if snap.bare_list { "bare list of segments" } else { "dict" }.into(),
        devices: devices.clone(),
        device_count: snap.traces.len().max(all.iter().map(|&d| d as usize + 1).max().unwrap_or(0)),
        allocator_settings: snap.allocator_settings.clone(),
        time_source: if untimed.is_empty() {
            "time_us".to_string()
        } else {
            format!("event order (device(s) {untimed:?} have trace entries without time_us: 1 ns per entry)")
        },
        legacy_history_blocks: snap.legacy_history_blocks,
        blocks_without_address: snap.blocks_without_address,
        unknown_actions: snap.unknown_actions,
        stacks: snap.stacks.stacks.len(),
        frames: snap.stacks.frames.len(),
        annotations: snap.annotations.iter().filter(|a| devices.contains(&a.device)).cloned().collect(),
        totals,
        reconstruction: reconstructions.clone(),
        segments: table,
    }));
    Ok(Converted { meta, stacks: std::mem::take(&mut snap.stacks), reconstructions })
}

/// `fragscope import`: writes the converted snapshot as a trace directory.
/// The output directory appears only once the snapshot has been read.
pub fn import(path: &Path, out: &Path, device: Option<u32>) -> Result<Converted> {
    let file_bytes = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?.len();
    let snap = Snapshot::read(path)?;
    let started = std::time::Instant::now();
    let meta = crate::trace::TraceMeta::new(crate::trace::Source::PytorchSnapshot);
    if let Some(d) = device
        && !snap.devices().contains(&d)
    {
        bail!("{}: device {d} is not in this snapshot (it has device(s) {:?})", path.display(), snap.devices());
    }
    // Parts of 65 536 rows: the part being filled and the one in flight
    // hold about 14 MB of events each. Parts twice as big cost 48 MiB more
    // peak memory on the 100 MB late-ring snapshot (above twice its size)
    // and 85 MiB on the 220 MB one, for 5 % less time on the latter
    // (BENCHMARKS.md, "PyTorch snapshots").
    let mut writer = crate::trace::TraceWriter::create(out, meta, 1 << 16)?;
    writer.write_behind();
    let converted = convert(snap, device, &path.display().to_string(), file_bytes, &mut |e| writer.push(e))
        .with_context(|| format!("{}: cannot convert the snapshot", path.display()));
    let converted = match converted {
        Ok(c) => c,
        Err(e) => {
            writer.abandon();
            return Err(e);
        }
    };
    writer.write_stacks(&converted.stacks)?;
    writer.set_details(converted.meta.details.clone());
    let meta = writer.finish()?;
    tracing::info!("converted and written in {:.3} s", started.elapsed().as_secs_f64());
    Ok(Converted { meta, ..converted })
}

/// Whether `path` is a file that starts like a pickle (protocol 2–5).
pub fn looks_like_pickle(path: &Path) -> bool {
    let mut head = [0u8; 2];
    std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head)).is_ok()
        && head[0] == 0x80
        && (2..=5).contains(&head[1])
}
