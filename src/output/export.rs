//! `fragscope export`: a trace in the formats other tools open.
//!
//! - **memory-viz**: a protocol-4 pickle in the shape of
//!   `torch.cuda.memory._snapshot()` — `segments` (with `blocks` covering
//!   each segment), `device_traces` and `allocator_settings` — which
//!   PyTorch's memory_viz (pytorch.org/memory_viz) and SnapViewer open.
//!   A snapshot-derived trace gives back its segments, blocks, requests
//!   and frames. In a device-level trace (eBPF, synthetic) each
//!   `cudaMalloc` range is a segment holding one block: its entries are
//!   `segment_alloc` + `alloc`, and `free_requested` + `free_completed` +
//!   `segment_free`; a failed request is an `oom` entry. The processes of
//!   a device-level trace become devices 0, 1, … in pid order.
//! - **perfetto**: the same as a Perfetto protobuf trace of TrackEvents
//!   (counter tracks, OOM instants, iteration slices, leak markers): see
//!   [`crate::output::perfetto`].
//! - **chrome**: Trace Event JSON (`chrome://tracing`, Perfetto's UI):
//!   per process, counters of live bytes, reserved bytes, the score and
//!   its components and the online forecast; OOM instants with their
//!   class; iteration slices; leak markers.
//! - **speedscope**: the live memory by call stack at the end and at the
//!   peak (the flamegraph's stacks) as a speedscope file.
//!
//! `--time-window A..B` (seconds from the first event) cuts a slice. For
//! memory-viz the slice replays correctly: `segments` are the state at B
//! and `device_traces` the entries in [A, B], so an importer rebuilds the
//! state at A the way it rebuilds the state before a ring buffer's first
//! entry.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::rc::Rc;

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::import::pickle::Value;
use crate::trace::details::Details;
use crate::trace::event::{EventKind, Events};
use crate::trace::input::Loaded;

/// The formats `export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A PyTorch memory snapshot pickle (memory_viz, SnapViewer).
    MemoryViz,
    /// A Perfetto protobuf trace of TrackEvents (ui.perfetto.dev,
    /// trace_processor).
    Perfetto,
    /// Trace Event JSON (chrome://tracing, ui.perfetto.dev).
    Chrome,
    /// speedscope's JSON (the flamegraph stacks at the end and the peak).
    Speedscope,
}

/// A time window, ns on the trace's clock, both ends included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Window {
    /// `A..B` in seconds from `first_ns`; either end may be omitted.
    pub fn parse(spec: &str, first_ns: u64) -> Result<Window> {
        let (a, b) =
            spec.split_once("..").with_context(|| format!("--time-window {spec:?}: expected A..B (seconds)"))?;
        let secs = |s: &str, default: u64| -> Result<u64> {
            let s = s.trim();
            if s.is_empty() {
                return Ok(default);
            }
            let v: f64 =
                s.parse().with_context(|| format!("--time-window {spec:?}: {s:?} is not a number of seconds"))?;
            if !(v.is_finite() && v >= 0.0) {
                bail!("--time-window {spec:?}: {s:?} must be zero or more seconds");
            }
            Ok(first_ns.saturating_add((v * 1e9).round() as u64))
        };
        let w = Window { start_ns: secs(a, first_ns)?, end_ns: secs(b, u64::MAX)? };
        if w.start_ns > w.end_ns {
            bail!("--time-window {spec:?}: the start is after the end");
        }
        Ok(w)
    }

    pub(crate) fn contains(&self, t: u64) -> bool {
        (self.start_ns..=self.end_ns).contains(&t)
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
    let mut pids: Vec<u32> = ev.pid.clone();
    pids.sort_unstable();
    pids.dedup();
    let device_of = |pid: u32, pids: &[u32]| -> usize {
        if allocator_view { pid as usize } else { pids.binary_search(&pid).unwrap_or(0) }
    };
    let devices = pids.iter().map(|&p| device_of(p, &pids) + 1).max().unwrap_or(0);
    let mut traces: Vec<Vec<Value>> = vec![Vec::new(); devices];
    let mut states: Vec<State> = (0..devices).map(|_| State::default()).collect();
    let mut seen: BTreeMap<u32, u64> = BTreeMap::new();
    let mut summary = MemoryVizSummary { devices, ..Default::default() };
    if !allocator_view {
        summary.pids = pids.clone();
    }
    for i in 0..ev.len() {
        let Some(kind) = ev.kind[i] else { continue };
        let t = ev.ts_ns[i];
        if t > window.end_ns {
            break;
        }
        let pid = ev.pid[i];
        let d = device_of(pid, &pids);
        let n = seen.entry(pid).or_insert(0);
        *n += 1;
        let before_trace = *n <= initial.get(&pid).copied().unwrap_or(0);
        let emit = !before_trace && window.contains(t);
        let (addr, size, ok) = (ev.addr[i], ev.size[i], ev.ret[i] == 0);
        let stream = column(&ev.stream, i, 0);
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
                let free = column(&ev.device_free, i, u64::MAX);
                e.push(("size", uint(s)));
                e.push(("device_free", uint(if free == u64::MAX { 0 } else { free })));
            } else {
                e.push(("addr", uint(a)));
                e.push(("size", uint(s)));
            }
            e.push(("stream", uint(stream)));
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
                ("stream", uint(s.stream)),
                ("segment_type", pool.s(if small { "small" } else { "large" })),
                ("segment_pool_id", Value::Tuple(Rc::new(vec![Value::Int(0), Value::Int(0)]))),
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

/// The processes (devices) of an analysis with rows, in order: the
/// processes both timeline exports draw.
pub(crate) fn timeline_pids(a: &crate::analysis::Analysis) -> Vec<u32> {
    let mut pids: Vec<u32> = a.rows.iter().map(|r| r.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// One iteration as the timeline exports draw it.
pub(crate) struct IterationSpan {
    pub pid: u32,
    /// 1-based.
    pub number: usize,
    pub start_ns: u64,
    pub end_ns: u64,
    pub source: String,
}

/// The iterations that overlap `window`, clipped to it and to the trace's
/// first event (the exports' time zero; a profiler's step can open before
/// the first memory event). Spans left empty by the clipping are dropped.
pub(crate) fn iteration_spans(a: &crate::analysis::Analysis, window: Window) -> Vec<IterationSpan> {
    let lo = window.start_ns.max(a.first_ts);
    let mut spans = Vec::new();
    for it in &a.iterations {
        for (n, w) in it.boundaries_t_ns.windows(2).enumerate() {
            let (start_ns, end_ns) = (w[0].max(lo), w[1].min(window.end_ns));
            if start_ns < end_ns {
                spans.push(IterationSpan {
                    pid: it.pid,
                    number: n + 1,
                    start_ns,
                    end_ns,
                    source: format!("{:?}", it.source),
                });
            }
        }
    }
    spans
}

/// Where the leak markers go: the end of the trace, within the window.
pub(crate) fn leak_marker_ns(a: &crate::analysis::Analysis, window: Window) -> u64 {
    a.last_ts.min(window.end_ns).max(window.start_ns.min(a.last_ts))
}

/// Trace Event JSON of an analysis: per process (device, for snapshots)
/// the counters `memory` (live and, in the allocator view, reserved
/// bytes), `fragmentation` (the score and its six components) and
/// `forecast` (the online backtest's next H scores); OOM instants with
/// their class; one slice per iteration; a marker per leak verdict at the
/// end. Timestamps are µs from the first event.
pub fn chrome(a: &crate::analysis::Analysis, window: Window) -> serde_json::Value {
    let us = |t: u64| t.saturating_sub(a.first_ts) as f64 / 1000.0;
    let mut out = Vec::new();
    for pid in timeline_pids(a) {
        out.push(json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": format!("{} {pid}", a.unit())}}));
    }
    for r in a.rows.iter().filter(|r| window.contains(r.t_ns)) {
        let ts = us(r.t_ns);
        let m = &r.metrics;
        let mut memory = json!({"live_bytes": m.live_bytes});
        if let Some(reserved) = r.reserved_bytes() {
            memory["reserved_bytes"] = json!(reserved);
        }
        out.push(json!({"ph": "C", "name": "memory", "pid": r.pid, "tid": 0, "ts": ts, "args": memory}));
        let [e, k, sm, c, l, u] = m.features();
        out.push(json!({"ph": "C", "name": "fragmentation", "pid": r.pid, "tid": 0, "ts": ts, "args": {
            "score": m.score, "external_fragmentation": e, "kernel_unusable_index": k, "small_alloc_ratio": sm,
            "size_cv": c, "large_gap_ratio": l, "utilization": u,
        }}));
        if let Some(f) = &r.forecast {
            let args: serde_json::Map<String, serde_json::Value> =
                f.iter().enumerate().map(|(i, v)| (format!("score_t+{}", i + 1), json!(v))).collect();
            out.push(json!({"ph": "C", "name": "forecast", "pid": r.pid, "tid": 0, "ts": ts, "args": args}));
        }
    }
    for o in a.ooms.iter().filter(|o| window.contains(o.t_ns)) {
        out.push(json!({"ph": "i", "s": "p", "name": format!("OOM ({})", o.class.name()), "pid": o.pid, "tid": 0,
        "ts": us(o.t_ns), "args": {
            "class": o.class.name(), "requested_bytes": o.requested, "live_bytes": o.live_bytes,
            "largest_gap_bytes": o.largest_gap, "device_free_bytes": o.device_free, "site": o.request_site,
        }}));
    }
    for it in iteration_spans(a, window) {
        out.push(json!({"ph": "X", "name": format!("iteration {}", it.number), "cat": "iteration", "pid": it.pid,
            "tid": 1, "ts": us(it.start_ns), "dur": (it.end_ns - it.start_ns) as f64 / 1000.0, "args": {"source": it.source}}));
    }
    let end = leak_marker_ns(a, window);
    for l in &a.leaks {
        out.push(json!({"ph": "i", "s": "p", "name": format!("leak: {}", l.verdict.name()), "pid": l.pid, "tid": 0,
            "ts": us(end), "args": {"verdict": l.verdict.name(), "reason": l.reason, "growth_bytes": l.growth_bytes,
            "rate_bytes_per_s": l.rate_bytes_per_s}}));
    }
    json!({
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "fragscope", "trace": a.trace.name},
    })
}

/// The flamegraph's stacks as a speedscope file: one profile per folded
/// root (`end`, and `peak`), weighted in bytes. None without stacks.
pub fn speedscope(a: &crate::analysis::Analysis) -> Option<serde_json::Value> {
    let folded = a.flamegraph.as_deref().filter(|f| !f.trim().is_empty())?;
    let mut frames: Vec<String> = Vec::new();
    let mut index: BTreeMap<String, usize> = BTreeMap::new();
    let mut profiles: Vec<(String, Vec<Vec<usize>>, Vec<u64>)> = Vec::new();
    for line in folded.lines() {
        let Some((stack, n)) = line.rsplit_once(' ') else { continue };
        let Ok(n) = n.parse::<u64>() else { continue };
        let mut parts = stack.split(';');
        let Some(root) = parts.next() else { continue };
        let ids: Vec<usize> = parts
            .map(|f| {
                *index.entry(f.to_string()).or_insert_with(|| {
                    frames.push(f.to_string());
                    frames.len() - 1
                })
            })
            .collect();
        let p = match profiles.iter().position(|p| p.0 == root) {
            Some(p) => p,
            None => {
                profiles.push((root.to_string(), Vec::new(), Vec::new()));
                profiles.len() - 1
            }
        };
        profiles[p].1.push(ids);
        profiles[p].2.push(n);
    }
    let profiles: Vec<serde_json::Value> = profiles
        .into_iter()
        .map(|(root, samples, weights)| {
            let total: u64 = weights.iter().sum();
            let name =
                if root == "end" { "live memory at the end".to_string() } else { format!("live memory at the {root}") };
            json!({"type": "sampled", "name": name, "unit": "bytes", "startValue": 0, "endValue": total,
                "samples": samples, "weights": weights})
        })
        .collect();
    Some(json!({
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames.iter().map(|f| json!({"name": f})).collect::<Vec<_>>()},
        "profiles": profiles,
        "name": a.trace.name,
        "activeProfileIndex": 0,
        "exporter": "fragscope",
    }))
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

/// Writes `bytes` to `path` through a temporary file renamed at the end,
/// so a failed export never leaves a half-written file under the name.
fn write_file(path: &Path, f: impl FnOnce(&mut std::fs::File) -> Result<()>) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.partial",
        path.file_name().map_or("export".into(), |n| n.to_string_lossy().into_owned())
    ));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f(&mut file)?;
        file.sync_all().with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `fragscope export`.
pub fn run(args: &crate::cli::ExportArgs) -> Result<u8> {
    let started = std::time::Instant::now();
    // A malformed window is a usage error, before the (long) read.
    if let Some(spec) = &args.time_window
        && let Err(e) = Window::parse(spec, 0)
    {
        eprintln!("error: {e}");
        return Ok(crate::exit::USAGE);
    }
    let loaded = crate::trace::input::open(&args.input, args.device)?;
    let first = loaded.events.ts_ns.first().copied().unwrap_or(0);
    let window = match &args.time_window {
        Some(spec) => {
            let timed = match loaded.trace.meta.as_ref().map(|m| &m.details) {
                Some(Details::Snapshot(s)) => s.time_source == "time_us",
                _ => true,
            };
            if !timed {
                bail!(
                    "{}: has no timestamps (entry order), so --time-window has nothing to cut by",
                    args.input.display()
                );
            }
            Window::parse(spec, first)?
        }
        None => Window { start_ns: 0, end_ns: u64::MAX },
    };
    if loaded.events.is_empty() {
        bail!("{}: the trace has no events to export", args.input.display());
    }
    match args.format {
        Format::MemoryViz => {
            let (snapshot, s) = memory_viz(&loaded, window)?;
            write_file(&args.output, |f| {
                crate::import::pickle::write(&snapshot, f)
                    .with_context(|| format!("cannot write {}", args.output.display()))
            })?;
            let devices = if s.pids.is_empty() {
                format!("{} device(s)", s.devices)
            } else {
                format!(
                    "{} process(es) as devices 0–{} (pids {:?})",
                    s.pids.len(),
                    s.pids.len().saturating_sub(1),
                    s.pids
                )
            };
            println!(
                "{}: memory-viz snapshot of {} — {devices}, {} segments, {} blocks, {} trace entries in {:.2} s",
                args.output.display(),
                args.input.display(),
                s.segments,
                s.blocks,
                s.entries,
                started.elapsed().as_secs_f64()
            );
        }
        Format::Perfetto | Format::Chrome | Format::Speedscope => {
            let opts =
                crate::analysis::Options { device: args.device, whatif: false, ..crate::analysis::Options::default() };
            let a = crate::analysis::analyze_events(loaded.trace, &loaded.events, loaded.out_of_order, &opts)?;
            let (bytes, what) = match args.format {
                Format::Perfetto => {
                    let trace = crate::output::perfetto::perfetto(&a, window);
                    (
                        crate::output::perfetto::encode(&trace),
                        format!("Perfetto trace ({} packets)", trace.packet.len()),
                    )
                }
                Format::Chrome => (serde_json::to_vec(&chrome(&a, window))?, "Trace Event JSON".to_string()),
                _ => {
                    let doc = speedscope(&a).with_context(|| {
                        format!(
                            "{}: has no call stacks to export (PyTorch snapshots, their imports and traces recorded with `record --stacks` have them)",
                            args.input.display()
                        )
                    })?;
                    (serde_json::to_vec(&doc)?, "speedscope".to_string())
                }
            };
            write_file(&args.output, |f| {
                f.write_all(&bytes).with_context(|| format!("cannot write {}", args.output.display()))
            })?;
            println!(
                "{}: {what} of {} in {:.2} s",
                args.output.display(),
                args.input.display(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(crate::exit::OK)
}
