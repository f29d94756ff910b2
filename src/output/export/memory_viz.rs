//! `export --format memory-viz`: a protocol-4 pickle in the shape of
//! `torch.cuda.memory._snapshot()` — `segments` (with `blocks` covering
//! each segment), `device_traces` and `allocator_settings` — which
//! PyTorch's memory_viz (pytorch.org/memory_viz) and SnapViewer open.
//! A snapshot-derived trace gives back its segments, blocks, requests
//! and frames. In a device-level trace (eBPF, synthetic) each
//! `cudaMalloc` range is a segment holding one block: its entries are
//! `segment_alloc` + `alloc`, and `free_requested` + `free_completed` +
//! `segment_free`; a failed request is an `oom` entry. The processes of
//! a device-level trace become devices 0, 1, … in pid order.
//!
//! With `--time-window A..B` the slice replays correctly: `segments` are
//! the state at B and `device_traces` the entries in [A, B], so an
//! importer rebuilds the state at A the way it rebuilds the state before a
//! ring buffer's first entry.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Write;
use std::rc::Rc;

use anyhow::{Context, Result};

use crate::import::pickle::Value;
use crate::input::Loaded;
use crate::output::export::common::{Exporter, Paths, Source, Window, Written};
use crate::trace::details::Details;
use crate::trace::event::{EventKind, Events};

/// The memory-viz format.
pub(crate) struct MemoryViz;

impl Exporter for MemoryViz {
    fn needs_analysis(&self) -> bool {
        false
    }

    fn write(&self, paths: &Paths, source: Source<'_>, window: Window, out: &mut dyn Write) -> Result<Written> {
        let (snapshot, s) = memory_viz(source.events()?, window)?;
        crate::import::pickle::write(&snapshot, out)
            .with_context(|| format!("cannot write {}", paths.output.display()))?;
        let devices = if s.pids.is_empty() {
            format!("{} device(s)", s.devices)
        } else {
            format!("{} process(es) as devices 0–{} (pids {:?})", s.pids.len(), s.pids.len().saturating_sub(1), s.pids)
        };
        Ok(Written {
            what: "memory-viz snapshot".into(),
            detail: format!(" — {devices}, {} segments, {} blocks, {} trace entries", s.segments, s.blocks, s.entries),
        })
    }
}

/// Interned pickle strings and frame lists: the same key, frame or stack
/// is one shared object, which the pickle writer stores once.
struct Pool<'a> {
    strings: RefCell<BTreeMap<String, Value>>,
    stacks: RefCell<BTreeMap<u32, Value>>,
    table: Option<&'a crate::trace::Stacks>,
    empty: Value,
}

impl<'a> Pool<'a> {
    fn new(table: Option<&'a crate::trace::Stacks>) -> Pool<'a> {
        Pool { strings: Default::default(), stacks: Default::default(), table, empty: list(Vec::new()) }
    }

    fn s(&self, s: &str) -> Value {
        self.strings.borrow_mut().entry(s.to_string()).or_insert_with(|| Value::Str(Rc::new(s.to_string()))).clone()
    }

    fn dict(&self, pairs: &[(&str, Value)]) -> Value {
        Value::Dict(Rc::new(RefCell::new(pairs.iter().map(|(k, v)| (self.s(k), v.clone())).collect())))
    }

    /// The frames of a stack, innermost first, as PyTorch lists them.
    fn frames(&self, stack: u32) -> Value {
        let (Some(table), true) = (self.table, stack != u32::MAX) else {
            return self.empty.clone();
        };
        if let Some(v) = self.stacks.borrow().get(&stack) {
            return v.clone();
        }
        let frames: Vec<Value> = table
            .frames_of(stack)
            .map(|f| {
                self.dict(&[("filename", self.s(&f.filename)), ("line", Value::Int(f.line)), ("name", self.s(&f.name))])
            })
            .collect();
        let v = list(frames);
        self.stacks.borrow_mut().insert(stack, v.clone());
        v
    }
}

fn list(items: Vec<Value>) -> Value {
    Value::List(Rc::new(RefCell::new(items)))
}

fn uint(v: u64) -> Value {
    i64::try_from(v).map_or(Value::UInt(v), Value::Int)
}

/// What a memory-viz export holds, for the command's summary line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryVizSummary {
    pub devices: usize,
    pub segments: usize,
    pub blocks: usize,
    pub entries: usize,
    /// Device-level traces: the pid of each device index.
    pub pids: Vec<u32>,
}

#[derive(Clone, Copy)]
struct Seg {
    size: u64,
    stream: u64,
    expandable: bool,
}

#[derive(Clone, Copy)]
struct Blk {
    size: u64,
    requested: u64,
    stack: u32,
}

/// The live state of one device while the events are replayed.
#[derive(Default)]
struct State {
    segments: BTreeMap<u64, Seg>,
    blocks: BTreeMap<u64, Blk>,
}

/// A free's frames: its own (where it was freed) when recorded, else the
/// block's allocation frames.
fn own_or_block(stack: u32, b: Option<Blk>) -> u32 {
    if stack != u32::MAX { stack } else { b.map_or(u32::MAX, |b| b.stack) }
}

fn column<T: Copy>(v: &[T], i: usize, none: T) -> T {
    v.get(i).copied().unwrap_or(none)
}

/// Builds the snapshot of a loaded trace (see the module documentation).
pub fn memory_viz(l: &Loaded, window: Window) -> Result<(Value, MemoryVizSummary)> {
    let ev: &Events = &l.events;
    let allocator_view = ev
        .kind
        .iter()
        .any(|k| matches!(k, Some(EventKind::BlockAlloc | EventKind::SegmentAlloc | EventKind::SegmentMap)));
    let details = l.trace.meta.as_ref().map(|m| &m.details);
    let snapshot = match details {
        Some(Details::Snapshot(s)) => Some(&**s),
        _ => None,
    };
    let timed = snapshot.is_none_or(|s| s.time_source == "time_us");
    // Events before the trace proper (the state an import rebuilt).
    let initial: BTreeMap<u32, u64> = snapshot
        .map(|s| s.reconstruction.iter().map(|r| (r.device, r.initial_segments + r.initial_blocks)).collect())
        .unwrap_or_default();
    let pool = Pool::new(l.trace.stacks.as_deref());
    let mut pids: Vec<u32> = ev.pid.iter().collect();
    pids.sort_unstable();
    pids.dedup();
    // A snapshot's devices keep their numbers; processes (a recording, or
    // the units of a recording of PyTorch's allocator, ids above every pid)
    // become devices 0, 1, … in order.
    let direct = allocator_view && pids.last().is_none_or(|&p| p < 1024);
    let device_of =
        |pid: u32, pids: &[u32]| -> usize { if direct { pid as usize } else { pids.binary_search(&pid).unwrap_or(0) } };
    let devices = pids.iter().map(|&p| device_of(p, &pids) + 1).max().unwrap_or(0);
    let mut traces: Vec<Vec<Value>> = vec![Vec::new(); devices];
    let mut states: Vec<State> = (0..devices).map(|_| State::default()).collect();
    let mut seen: BTreeMap<u32, u64> = BTreeMap::new();
    let mut summary = MemoryVizSummary { devices, ..Default::default() };
    if !direct {
        summary.pids = pids.clone();
    }
    for i in 0..ev.len() {
        let Some(kind) = ev.kind[i] else { continue };
        let t = ev.ts_ns.at(i);
        if t > window.end_ns {
            break;
        }
        let pid = ev.pid[i];
        let d = device_of(pid, &pids);
        let n = seen.entry(pid).or_insert(0);
        *n += 1;
        let before_trace = *n <= initial.get(&pid).copied().unwrap_or(0);
        let emit = !before_trace && window.contains(t);
        let (addr, size, ok) = (ev.addr.at(i), ev.size.at(i), ev.ret[i] == 0);
        let stream = ev.stream.get(i).unwrap_or(0);
        let stack = column(&ev.stack, i, u32::MAX);
        let requested = Some(column(&ev.requested, i, u64::MAX)).filter(|&r| r != u64::MAX).unwrap_or(size);
        let st = &mut states[d];
        let mut out: Vec<(&str, u64, u64, u32)> = Vec::new(); // action, addr, size, stack
        if allocator_view {
            match kind {
                EventKind::SegmentAlloc | EventKind::SegmentMap => {
                    st.segments.insert(addr, Seg { size, stream, expandable: kind == EventKind::SegmentMap });
                    out.push((
                        if kind == EventKind::SegmentMap { "segment_map" } else { "segment_alloc" },
                        addr,
                        size,
                        u32::MAX,
                    ));
                }
                EventKind::SegmentFree | EventKind::SegmentUnmap => {
                    st.segments.remove(&addr);
                    out.push((
                        if kind == EventKind::SegmentUnmap { "segment_unmap" } else { "segment_free" },
                        addr,
                        size,
                        u32::MAX,
                    ));
                }
                EventKind::BlockAlloc => {
                    st.blocks.insert(addr, Blk { size, requested, stack });
                    out.push(("alloc", addr, requested, stack));
                }
                EventKind::BlockFreeRequested => {
                    let b = st.blocks.get(&addr).copied();
                    out.push(("free_requested", addr, b.map_or(size, |b| b.requested), own_or_block(stack, b)));
                }
                EventKind::BlockFree => {
                    let b = st.blocks.remove(&addr);
                    out.push(("free_completed", addr, b.map_or(size, |b| b.requested), own_or_block(stack, b)));
                }
                EventKind::Oom => out.push(("oom", 0, size, stack)),
                _ => {}
            }
        } else if kind.is_device_alloc() && ok {
            st.segments.insert(addr, Seg { size, stream, expandable: false });
            st.blocks.insert(addr, Blk { size, requested: size, stack });
            out.push(("segment_alloc", addr, size, stack));
            out.push(("alloc", addr, size, stack));
        } else if kind.is_alloc_request() && !ok {
            out.push(("oom", 0, size, stack));
        } else if kind.is_device_free() && ok && st.segments.contains_key(&addr) {
            let b = st.blocks.remove(&addr);
            let seg = st.segments.remove(&addr).map_or(size, |s| s.size);
            let (req, stk) = b.map_or((seg, stack), |b| (b.requested, b.stack));
            out.push(("free_requested", addr, req, stk));
            out.push(("free_completed", addr, req, stk));
            out.push(("segment_free", addr, seg, stk));
        }
        if !emit {
            continue;
        }
        for (action, a, s, stk) in out {
            let mut e = vec![("action", pool.s(action))];
            if action == "oom" {
                let free = ev.device_free.get(i).unwrap_or(u64::MAX);
                e.push(("size", uint(s)));
                e.push(("device_free", uint(if free == u64::MAX { 0 } else { free })));
            } else {
                e.push(("addr", uint(a)));
                e.push(("size", uint(s)));
            }
            e.push(("stream", uint(crate::allocator::split_stream(stream).0)));
            if timed {
                e.push(("time_us", uint(t / 1000)));
            }
            e.push(("frames", pool.frames(stk)));
            traces[d].push(pool.dict(&e));
            summary.entries += 1;
        }
    }
    let mut segments = Vec::new();
    for (d, st) in states.iter().enumerate() {
        for (&a, s) in &st.segments {
            let (mut blocks, mut at, mut active, mut req) = (Vec::new(), a, 0, 0);
            let inactive = |addr: u64, size: u64| {
                pool.dict(&[
                    ("address", uint(addr)),
                    ("size", uint(size)),
                    ("requested_size", Value::Int(0)),
                    ("state", pool.s("inactive")),
                    ("frames", pool.empty.clone()),
                ])
            };
            for (&b, blk) in st.blocks.range(a..a + s.size) {
                if b > at {
                    blocks.push(inactive(at, b - at));
                }
                blocks.push(pool.dict(&[
                    ("address", uint(b)),
                    ("size", uint(blk.size)),
                    ("requested_size", uint(blk.requested)),
                    ("state", pool.s("active_allocated")),
                    ("frames", pool.frames(blk.stack)),
                ]));
                at = b + blk.size;
                active += blk.size;
                req += blk.requested;
            }
            if at < a + s.size {
                blocks.push(inactive(at, a + s.size - at));
            }
            summary.blocks += blocks.len();
            let small = s.size == crate::import::settings::SMALL_BUFFER && !s.expandable;
            segments.push(pool.dict(&[
                ("device", uint(d as u64)),
                ("address", uint(a)),
                ("total_size", uint(s.size)),
                ("allocated_size", uint(active)),
                ("active_size", uint(active)),
                ("requested_size", uint(req)),
                ("stream", uint(crate::allocator::split_stream(s.stream).0)),
                ("segment_type", pool.s(if small { "small" } else { "large" })),
                // A private pool as the import numbered it (1, 2, …).
                (
                    "segment_pool_id",
                    Value::Tuple(Rc::new(vec![
                        Value::Int(0),
                        Value::Int(crate::allocator::split_stream(s.stream).1.unwrap_or(0) as i64),
                    ])),
                ),
                ("is_expandable", Value::Bool(s.expandable)),
                ("frames", pool.empty.clone()),
                ("blocks", list(blocks)),
            ]));
        }
    }
    summary.segments = segments.len();
    let settings = match snapshot.map(|s| &s.allocator_settings) {
        Some(serde_json::Value::Object(m)) if !m.is_empty() => json_value(&pool, &serde_json::Value::Object(m.clone())),
        _ => pool.dict(&[
            ("PYTORCH_CUDA_ALLOC_CONF", pool.s("")),
            ("max_split_size", Value::Int(-1)),
            ("expandable_segments", Value::Bool(false)),
        ]),
    };
    // The profiler ranges (`record_function`) that give `analyze` its
    // iterations.
    let annotations: Vec<Value> = snapshot
        .map(|s| s.annotations.as_slice())
        .unwrap_or_default()
        .iter()
        .filter(|a| window.contains(a.t_ns))
        .map(|a| {
            pool.dict(&[
                ("device", uint(u64::from(a.device))),
                ("stage", pool.s(&a.stage)),
                ("name", pool.s(&a.name)),
                ("time_us", uint(a.t_ns / 1000)),
            ])
        })
        .collect();
    let mut top = vec![
        ("segments", list(segments)),
        ("device_traces", list(traces.into_iter().map(list).collect())),
        ("allocator_settings", settings),
    ];
    if !annotations.is_empty() {
        top.push(("external_annotations", list(annotations)));
    }
    let snapshot = pool.dict(&top);
    Ok((snapshot, summary))
}

/// A JSON value as the pickle value Python would have.
fn json_value(pool: &Pool, v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::None,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::Int(i),
            (_, Some(u)) => Value::UInt(u),
            _ => Value::Float(n.as_f64().unwrap_or(0.0)),
        },
        serde_json::Value::String(s) => pool.s(s),
        serde_json::Value::Array(a) => list(a.iter().map(|x| json_value(pool, x)).collect()),
        serde_json::Value::Object(m) => {
            Value::Dict(Rc::new(RefCell::new(m.iter().map(|(k, x)| (pool.s(k), json_value(pool, x))).collect())))
        }
    }
}
