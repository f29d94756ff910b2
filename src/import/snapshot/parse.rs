//! A snapshot as Python wrote it ([`Snapshot`]): segments, their blocks,
//! the trace entries of each device and the allocator settings, read from
//! the pickle's values with the frames interned into one stack table.

use std::path::Path;

use ahash::AHashMap;
use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::import::pickle::Value;
use crate::trace::details::{Annotation, Totals};
use crate::trace::event::NO_STACK;
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
    pub(super) fn parse(s: &str) -> Option<BlockState> {
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
    /// `segment_pool_id`: (0, 0) for the default pool; a private pool
    /// (a `MemPool`, a CUDA graph's) otherwise.
    pub pool: (u64, u64),
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
    Annotate,
}

impl Action {
    pub(super) fn parse(s: &str) -> Option<Action> {
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
            // PyTorch 2.14's `_annotate_tensor`: a label on a storage, no
            // memory moved.
            "annotate" => Action::Annotate,
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
    pub(super) addr: u64,
    /// Requested size (alloc and frees), segment size, or the failed request (oom).
    pub size: u64,
    pub stream: u64,
    /// `i64::MIN` when absent.
    pub(super) time_us: i64,
    /// `NO_STACK` when absent.
    pub(super) stack: u32,
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

/// One device's trace entries, in chunks of [`Entries::CHUNK`]. A vector
/// of millions of entries is copied each time it doubles while it is read,
/// and is held whole until the replay forwards has read its last entry;
/// chunks (past the first) are appended without copies and freed one by one as that replay
/// consumes them ([`Entries::into_chunks`]). On a 220 MB snapshot the
/// entries are 160 MB, held beside the events built from them.
#[derive(Debug, Default)]
pub struct Entries {
    chunks: Vec<Vec<Entry>>,
    len: usize,
}

impl Entries {
    /// 1.3 MB of entries a chunk.
    pub const CHUNK: usize = 1 << 15;

    pub fn push(&mut self, e: Entry) {
        match self.chunks.last_mut() {
            Some(c) if c.len() < Self::CHUNK => c.push(e),
            _ => {
                // The first chunk grows as a vector does (a device with a
                // few entries holds a few), the next ones are made whole.
                let mut c = Vec::with_capacity(if self.chunks.is_empty() { 64 } else { Self::CHUNK });
                c.push(e);
                self.chunks.push(c);
            }
        }
        self.len += 1;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn first(&self) -> Option<&Entry> {
        self.chunks.first().and_then(|c| c.first())
    }

    /// The entries in order; `.rev()` walks them backwards.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Entry> {
        self.chunks.iter().flatten()
    }

    /// The entries, chunk by chunk in order: each chunk is freed when its
    /// consumer drops it.
    pub fn into_chunks(self) -> impl Iterator<Item = Vec<Entry>> {
        self.chunks.into_iter()
    }
}

/// A snapshot, typed.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub segments: Vec<Segment>,
    /// One list per device index.
    pub traces: Vec<Entries>,
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
    /// Keys of `allocator_settings` the snapshot did not record, inferred
    /// from what it holds (`expandable_segments`).
    pub inferred_settings: Vec<String>,
    /// PyTorch 2.14's pinned host memory (`record_pinned_host_memory`):
    /// `host_segments` and the entries of `host_traces`, kept apart from
    /// every device.
    pub host_segments: Vec<Segment>,
    pub host_trace: Vec<Entry>,
}

/// Turns the memo's shared frame dicts and lists into table ids.
#[derive(Default)]
pub(super) struct Interner {
    pub(super) frame_by_ptr: AHashMap<usize, u32>,
    pub(super) frame_by_value: AHashMap<Frame, u32>,
    pub(super) stack_by_ptr: AHashMap<usize, u32>,
    pub(super) stack_by_value: AHashMap<Vec<u32>, u32>,
    pub(super) stacks: Stacks,
    /// Keeps interned objects alive so their addresses stay unique keys.
    pub(super) keep: Vec<Value>,
}

impl Interner {
    pub(super) fn frame(&mut self, v: &Value) -> Result<u32> {
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
    pub(super) fn stack(&mut self, v: Option<&Value>) -> Result<Option<u32>> {
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
pub(super) fn intern<K: Clone + Eq + std::hash::Hash>(index: &mut AHashMap<K, u32>, table: &mut Vec<K>, key: K) -> u32 {
    let next = table.len() as u32;
    *index.entry(key.clone()).or_insert_with(|| {
        table.push(key);
        next
    })
}

/// Runs `f` over the items of a list or tuple.
pub(super) fn each(v: &Value, what: &str, mut f: impl FnMut(usize, &Value) -> Result<()>) -> Result<()> {
    match v {
        Value::List(l) => l.borrow().iter().enumerate().try_for_each(|(i, x)| f(i, x)),
        Value::Tuple(t) => t.iter().enumerate().try_for_each(|(i, x)| f(i, x)),
        _ => bail!("{what} is not a list"),
    }
}

/// The value of dict key `key` as an unsigned integer (None: absent or None).
pub(super) fn uint(v: &Value, key: &str) -> Result<Option<u64>> {
    v.get(key).map_or(Ok(None), |x| as_u64(key, &x))
}

/// `x`, the value of `key`, as an unsigned integer (None for None).
pub(super) fn as_u64(key: &str, x: &Value) -> Result<Option<u64>> {
    match x {
        Value::None => Ok(None),
        x => match x.as_int() {
            Some(i) if (0..=u64::MAX as i128).contains(&i) => Ok(Some(i as u64)),
            Some(i) => bail!("`{key}` = {i} is out of range"),
            None => bail!("`{key}` is not an integer"),
        },
    }
}

pub(super) fn need(v: &Value, key: &str) -> Result<u64> {
    uint(v, key)?.with_context(|| format!("missing `{key}`"))
}

impl Snapshot {
    /// Reads and parses a snapshot file.
    pub fn read(path: &Path) -> Result<Snapshot> {
        let started = std::time::Instant::now();
        let len = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?.len();
        let mut interner = Interner::default();
        let mut lists: AHashMap<usize, Entries> = AHashMap::new();
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
                Err(e) => return Err(format!("trace entry {}: {e:#}", lists.get(&list).map_or(0, Entries::len))),
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
    pub(super) fn from_parts(
        v: &Value,
        mut interner: Interner,
        mut lists: AHashMap<usize, Entries>,
    ) -> Result<Snapshot> {
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
        if let Some(segs) = v.get("host_segments") {
            each(&segs, "`host_segments`", |i, s| {
                let seg = snap.segment_of(s, &mut interner, true).with_context(|| format!("host segment {i}"))?;
                snap.host_segments.push(seg);
                Ok(())
            })?;
        }
        if let Some(list) = v.get("host_traces") {
            // A flat list of entries (2.14); a list of lists is read too.
            let mut read = |list: &Value, snap: &mut Snapshot| -> Result<()> {
                let mut entries = identity(list).and_then(|p| lists.remove(&p)).unwrap_or_default();
                each(list, "`host_traces`", |i, e| {
                    if matches!(e, Value::List(_) | Value::Tuple(_)) {
                        return Ok(());
                    }
                    match entry(e, &mut interner).with_context(|| format!("host trace entry {i}"))? {
                        Some(entry) => entries.push(entry),
                        None => snap.unknown_actions += 1,
                    }
                    Ok(())
                })?;
                snap.host_trace.extend(entries.into_chunks().flatten());
                Ok(())
            };
            read(&list, &mut snap)?;
            each(&list, "`host_traces`", |_, inner| {
                if matches!(inner, Value::List(_) | Value::Tuple(_)) { read(inner, &mut snap) } else { Ok(()) }
            })?;
            snap.host_trace.sort_by_key(|e| e.time_us);
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
        snap.infer_expandable();
        Ok(snap)
    }

    /// A snapshot that records no `expandable_segments` (no
    /// `allocator_settings` at all, as older PyTorch wrote them, or a
    /// hand-made dict) but whose segments are expandable, or whose trace
    /// maps pages: `expandable_segments:True` was on, and is recorded so,
    /// with the key named in `inferred_settings`. Without it every later
    /// step took the default (off): the replay refused to measure, its
    /// "recorded" peak read 0 B, and it advised the setting already on.
    fn infer_expandable(&mut self) {
        if self.allocator_settings.get("expandable_segments").is_some() {
            return;
        }
        let mapped = self.segments.iter().any(|s| s.is_expandable)
            || self
                .traces
                .iter()
                .flat_map(Entries::iter)
                .any(|e| matches!(e.action, Action::SegmentMap | Action::SegmentUnmap));
        if !mapped {
            return;
        }
        if !self.allocator_settings.is_object() {
            self.allocator_settings = serde_json::Value::Object(Default::default());
        }
        self.allocator_settings["expandable_segments"] = serde_json::Value::Bool(true);
        self.inferred_settings.push("expandable_segments".into());
    }

    pub(super) fn segment(&mut self, s: &Value, interner: &mut Interner) -> Result<Segment> {
        self.segment_of(s, interner, false)
    }

    /// A segment; `host`: of pinned host memory, whose `device` is -1.
    pub(super) fn segment_of(&mut self, s: &Value, interner: &mut Interner, host: bool) -> Result<Segment> {
        let address = need(s, "address")?;
        let total_size = need(s, "total_size")?;
        let device = if host { 0 } else { uint(s, "device")?.unwrap_or(0) };
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
            pool: match &s.get("segment_pool_id") {
                Some(Value::Tuple(t)) if t.len() == 2 => {
                    (as_u64("segment_pool_id", &t[0])?.unwrap_or(0), as_u64("segment_pool_id", &t[1])?.unwrap_or(0))
                }
                _ => (0, 0),
            },
        })
    }

    pub(super) fn block(&mut self, b: &Value, offset: u64, interner: &mut Interner) -> Result<Block> {
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
pub(super) fn entry(e: &Value, interner: &mut Interner) -> Result<Option<Entry>> {
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
pub(super) fn to_json(v: &Value, depth: usize) -> serde_json::Value {
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
