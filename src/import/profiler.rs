//! PyTorch-profiler traces (`torch.profiler.profile(profile_memory=True)`,
//! Chrome Trace Event JSON, `.json`, or compressed: `.json.gz`, `.json.zst`)
//! as fragscope traces.
//!
//! What is read, streamed (the files reach gigabytes; only the memory
//! events and the step spans are kept):
//! - `"[memory]"` instant events. Their `args`: `Addr`, `Bytes` (negative
//!   for a free), `Total Allocated`, `Total Reserved`, `Device Id` and
//!   `Device Type` (1 = CUDA). CUDA events become `alloc` and `free` of the
//!   caching allocator's blocks, keyed by the profiled process (`pid`),
//!   with the device in the `device` column. CPU events and other device
//!   types are skipped and counted. Events without `Addr` (profilers
//!   before PyTorch 1.10) cannot be placed: an error says so.
//! - `ProfilerStep#N` spans (`ph: "X"`, not the `gpu_user_annotation`
//!   copies on the GPU timeline): START and END annotations, from which
//!   `analyze` takes its iterations, as it does for a snapshot's
//!   `external_annotations`.
//!
//! `ts` is in µs (floats with sub-µs fractions in recent versions). The
//! memory events are not in global time order — each thread's run is — so
//! they are sorted stably by time; then, per device, `Total Allocated`
//! before plus `Bytes` equals `Total Allocated` after at every event in
//! the real traces we checked; breaks are counted in `details`.
//!
//! The profiler starts mid-run: blocks freed in the trace but never
//! allocated in it were allocated before it began, and become allocations
//! at the first event's time (SPEC §3). Memory allocated before and never
//! freed has no address in the trace: its size (the first event's `Total
//! Allocated` minus `Bytes`, minus the reconstructed blocks) is reported,
//! not placed. `Total Reserved` is the allocator's reserved memory: its
//! peak, and its value wherever it changes (`reserved_series`), are in
//! `details`; `analyze` gives each metric row the reserved bytes of that
//! instant (`reserved_bytes` in `metrics.parquet`, the exports' reserved
//! counters). The trace has no segments, so `analyze` uses the device
//! view of the blocks: fragmentation is the free space between live
//! blocks, the cached memory the allocator keeps.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::decompress::Codec;
use crate::trace::details::{Annotation, Details, ProfilerDetails, ReservedSample};
use crate::trace::event::{Event, EventKind};

pub type Sink<'s> = &'s mut dyn FnMut(Event) -> Result<()>;

/// Whether a file's (decompressed) first bytes are a JSON object naming
/// `traceEvents` or Kineto's `schemaVersion`.
pub fn head_is_profiler_trace(head: &[u8]) -> bool {
    let text = String::from_utf8_lossy(head);
    text.trim_start().starts_with('{') && (text.contains("\"traceEvents\"") || text.contains("\"schemaVersion\""))
}

/// A JSON number kept exactly when it is an integer; anything else
/// (strings, lists, …) reads as absent, so an unrelated event's `args`
/// with the same key never fails the parse.
#[derive(Clone, Copy, Debug, Default)]
struct Num {
    int: Option<i128>,
    float: Option<f64>,
}

impl Num {
    fn i(self) -> Option<i128> {
        self.int.or_else(|| self.float.filter(|f| f.fract() == 0.0 && f.abs() < 1e30).map(|f| f as i128))
    }

    /// µs → ns, exact for integer µs.
    fn us_to_ns(self) -> Option<u64> {
        if let Some(i) = self.int {
            return u64::try_from(i.checked_mul(1000)?).ok();
        }
        let f = self.float.filter(|f| f.is_finite() && *f >= 0.0)?;
        let whole = f.trunc();
        Some((whole as u64).checked_mul(1000)?.saturating_add(((f - whole) * 1000.0).round() as u64))
    }
}

impl<'de> Deserialize<'de> for Num {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Num, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Num;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Num, E> {
                Ok(Num { int: Some(i128::from(v)), float: None })
            }
            fn visit_u64<E>(self, v: u64) -> Result<Num, E> {
                Ok(Num { int: Some(i128::from(v)), float: None })
            }
            fn visit_f64<E>(self, v: f64) -> Result<Num, E> {
                Ok(Num { int: None, float: Some(v) })
            }
            fn visit_str<E>(self, _: &str) -> Result<Num, E> {
                Ok(Num::default())
            }
            fn visit_bool<E>(self, _: bool) -> Result<Num, E> {
                Ok(Num::default())
            }
            fn visit_unit<E>(self) -> Result<Num, E> {
                Ok(Num::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Num, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Num::default())
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Num, A::Error> {
                while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Num::default())
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize, Default)]
struct Args {
    #[serde(rename = "Addr", default)]
    addr: Num,
    #[serde(rename = "Bytes", default)]
    bytes: Num,
    #[serde(rename = "Total Allocated", default)]
    total_allocated: Num,
    #[serde(rename = "Total Reserved", default)]
    total_reserved: Num,
    #[serde(rename = "Device Id", default)]
    device_id: Num,
    #[serde(rename = "Device Type", default)]
    device_type: Num,
}

/// The fields of a trace event this reader looks at.
#[derive(Deserialize)]
struct RawEvent {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    ph: Option<String>,
    #[serde(default)]
    cat: Option<String>,
    #[serde(default)]
    pid: Num,
    #[serde(default)]
    tid: Num,
    #[serde(default)]
    ts: Num,
    #[serde(default)]
    dur: Num,
    #[serde(default)]
    args: Option<Args>,
}

/// One CUDA memory event, as read.
#[derive(Clone, Copy, Debug)]
struct Mem {
    ts_ns: u64,
    pid: u32,
    tid: u32,
    device: i32,
    addr: Option<u64>,
    bytes: i64,
    total_allocated: Option<i64>,
    total_reserved: Option<u64>,
}

#[derive(Default)]
struct Read_ {
    mem: Vec<Mem>,
    steps: Vec<(u32, u64, u64, String)>,
    events: u64,
    memory_events: u64,
    cpu_skipped: u64,
    other_device_skipped: u64,
    without_addr: u64,
    saw_trace_events: bool,
}

impl Read_ {
    fn take(&mut self, e: RawEvent) {
        self.events += 1;
        let Some(name) = e.name.as_deref() else { return };
        let pid = e.pid.i().and_then(|p| u32::try_from(p).ok()).unwrap_or(0);
        if name == "[memory]" {
            self.memory_events += 1;
            let a = e.args.unwrap_or_default();
            match a.device_type.i() {
                Some(1) => {}
                Some(0) | None => {
                    self.cpu_skipped += 1;
                    return;
                }
                Some(_) => {
                    self.other_device_skipped += 1;
                    return;
                }
            }
            let (Some(ts_ns), Some(bytes)) = (e.ts.us_to_ns(), a.bytes.i().and_then(|b| i64::try_from(b).ok())) else {
                return;
            };
            let addr = a.addr.i().and_then(|x| u64::try_from(x).ok());
            self.without_addr += u64::from(addr.is_none());
            self.mem.push(Mem {
                ts_ns,
                pid,
                tid: e.tid.i().and_then(|t| u32::try_from(t).ok()).unwrap_or(pid),
                device: a.device_id.i().and_then(|d| i32::try_from(d).ok()).unwrap_or(0),
                addr,
                bytes,
                total_allocated: a.total_allocated.i().and_then(|t| i64::try_from(t).ok()),
                total_reserved: a.total_reserved.i().and_then(|t| u64::try_from(t).ok()),
            });
        } else if name.starts_with("ProfilerStep#")
            && e.ph.as_deref() == Some("X")
            && e.cat.as_deref() != Some("gpu_user_annotation")
            && let (Some(ts), Some(dur)) = (e.ts.us_to_ns(), e.dur.us_to_ns())
        {
            self.steps.push((pid, ts, ts.saturating_add(dur), name.to_string()));
        }
    }
}

/// Streams the top-level object, handing each `traceEvents` element to
/// `Read_::take` without keeping the others.
struct Top<'a>(&'a mut Read_);

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Chrome trace object with `traceEvents`")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
        while let Some(key) = m.next_key::<String>()? {
            if key == "traceEvents" {
                self.0.saw_trace_events = true;
                m.next_value_seed(Events(self.0))?;
            } else {
                m.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

struct Events<'a>(&'a mut Read_);

impl<'de> DeserializeSeed<'de> for Events<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Events<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of trace events")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<(), A::Error> {
        while let Some(e) = s.next_element::<RawEvent>()? {
            self.0.take(e);
        }
        Ok(())
    }
}

fn read(path: &Path, codec: Option<Codec>) -> Result<Read_> {
    let reader: Box<dyn std::io::Read> = match codec {
        Some(c) => super::decompress::reader(path, c)?,
        None => Box::new(std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?),
    };
    let mut r = Read_::default();
    let mut de = serde_json::Deserializer::from_reader(std::io::BufReader::with_capacity(1 << 20, reader));
    Top(&mut r).deserialize(&mut de).map_err(|e| {
        if e.is_io() {
            anyhow::anyhow!("{}: cannot read ({e}); a truncated or corrupt compressed file?", path.display())
        } else {
            anyhow::anyhow!("{}: not a valid Chrome trace JSON ({e})", path.display())
        }
    })?;
    de.end().map_err(|e| anyhow::anyhow!("{}: trailing data after the trace object ({e})", path.display()))?;
    if !r.saw_trace_events {
        bail!("{}: no `traceEvents` list: not a PyTorch profiler (Chrome) trace", path.display());
    }
    Ok(r)
}

/// What a conversion found, besides the events it emitted.
#[derive(Debug)]
pub struct Converted {
    pub meta: crate::trace::TraceMeta,
}

/// Reads a profiler trace and emits its events (time-sorted) to `sink`.
/// The input stage has already looked at the file: `codec` is how it is
/// compressed (a profiler trace is decompressed as it is read) and
/// `file_bytes` its size, so the file is neither sniffed nor looked up
/// again here.
pub fn convert_file(path: &Path, codec: Option<Codec>, file_bytes: u64, sink: Sink<'_>) -> Result<Converted> {
    let mut r = read(path, codec)?;
    if r.memory_events == 0 {
        bail!(
            "{}: no \"[memory]\" events among its {} trace events: record with torch.profiler.profile(profile_memory=True)",
            path.display(),
            r.events
        );
    }
    if r.mem.is_empty() {
        bail!(
            "{}: its {} \"[memory]\" events are all on the CPU ({} skipped) or on other device types ({}): no CUDA memory to analyse",
            path.display(),
            r.memory_events,
            r.cpu_skipped,
            r.other_device_skipped
        );
    }
    if r.without_addr > 0 {
        bail!(
            "{}: {} of its CUDA \"[memory]\" events have no `Addr` (a profiler before PyTorch 1.10): allocations cannot be placed",
            path.display(),
            r.without_addr
        );
    }
    r.mem.sort_by_key(|m| m.ts_ns);
    let t0 = r.mem[0].ts_ns;
    // Per device: the running total against `Total Allocated`.
    let mut totals: BTreeMap<i32, i64> = BTreeMap::new();
    let mut breaks = 0u64;
    // Blocks freed before any allocation in the trace: allocated before it.
    let mut live: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    let mut before: Vec<(u32, i32, u64, u64, u32)> = Vec::new(); // pid, device, addr, size, tid
    let mut peak_allocated = None::<i64>;
    let mut first_total: BTreeMap<i32, i64> = BTreeMap::new();
    let mut reserved_series: Vec<ReservedSample> = Vec::new();
    let mut reserved_now: BTreeMap<(u32, i32), u64> = BTreeMap::new();
    for m in &r.mem {
        let addr = m.addr.unwrap_or(0);
        if let Some(t) = m.total_allocated {
            let running = totals.entry(m.device).or_insert(t - m.bytes);
            first_total.entry(m.device).or_insert(t - m.bytes);
            breaks += u64::from(*running + m.bytes != t);
            *running = t;
            peak_allocated = Some(peak_allocated.map_or(t, |p| p.max(t)));
        }
        if let Some(res) = m.total_reserved {
            if reserved_now.insert((m.pid, m.device), res) != Some(res) {
                reserved_series.push(ReservedSample { t_ns: m.ts_ns, pid: m.pid, device: m.device, bytes: res });
            }
        }
        if m.bytes > 0 {
            live.insert((m.pid, addr), m.bytes as u64);
        } else if m.bytes < 0 && live.remove(&(m.pid, addr)).is_none() {
            before.push((m.pid, m.device, addr, m.bytes.unsigned_abs(), m.tid));
        }
    }
    let reconstructed_bytes: u64 = before.iter().map(|b| b.3).sum();
    let before_trace: i64 = first_total.values().sum();
    let mut emitted = 0u64;
    let mut emit = |e: Event| -> Result<()> {
        emitted += 1;
        sink(e)
    };
    for &(pid, device, addr, size, tid) in &before {
        let mut e = Event::new(t0, pid, EventKind::Alloc, addr, size);
        e.device = Some(device);
        e.tid = tid;
        emit(e)?;
    }
    for m in &r.mem {
        if m.bytes == 0 {
            continue;
        }
        let kind = if m.bytes > 0 { EventKind::Alloc } else { EventKind::Free };
        let mut e = Event::new(m.ts_ns, m.pid, kind, m.addr.unwrap_or(0), m.bytes.unsigned_abs());
        e.device = Some(m.device);
        e.tid = m.tid;
        emit(e)?;
    }
    let mut annotations = Vec::new();
    r.steps.sort_by_key(|s| s.1);
    for (pid, start, end, name) in &r.steps {
        annotations.push(Annotation { stage: "START".into(), name: name.clone(), device: *pid, t_ns: *start });
        annotations.push(Annotation { stage: "END".into(), name: name.clone(), device: *pid, t_ns: *end });
    }
    let mut devices: Vec<i32> = r.mem.iter().map(|m| m.device).collect();
    devices.sort_unstable();
    devices.dedup();
    let mut pids: Vec<u32> = r.mem.iter().map(|m| m.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let mut meta = crate::trace::TraceMeta::new(crate::trace::Source::PytorchProfiler);
    meta.pids = pids;
    meta.details = Details::Profiler(Box::new(ProfilerDetails {
        profiler_trace: path.display().to_string(),
        file_bytes,
        compression: codec.map(|c| c.name().to_string()),
        trace_events: r.events,
        memory_events: r.memory_events,
        cuda_memory_events: r.mem.len() as u64,
        cpu_events_skipped: r.cpu_skipped,
        other_device_events_skipped: r.other_device_skipped,
        devices,
        allocated_before_trace_bytes: before_trace.max(0) as u64,
        reconstructed_blocks: before.len() as u64,
        reconstructed_bytes,
        unplaced_before_trace_bytes: (before_trace.max(0) as u64).saturating_sub(reconstructed_bytes),
        peak_allocated_bytes: peak_allocated.map(|p| p.max(0) as u64),
        // Every value is in the series, or equal to the one before it there.
        peak_reserved_bytes: reserved_series.iter().map(|s| s.bytes).max(),
        total_allocated_breaks: breaks,
        profiler_steps: r.steps.len() as u64,
        annotations,
        reserved_series,
    }));
    tracing::info!("{}: {} memory events, {emitted} trace events", path.display(), r.mem.len());
    Ok(Converted { meta })
}

/// `fragscope import` of a profiler trace: writes the trace directory.
/// `codec` and `file_bytes` as for [`convert_file`].
pub fn import(path: &Path, codec: Option<Codec>, file_bytes: u64, out: &Path) -> Result<Converted> {
    let meta = super::import_file(path, out, crate::trace::Source::PytorchProfiler, None, |p, sink| {
        Ok(convert_file(p, codec, file_bytes, sink)?.meta)
    })?;
    Ok(Converted { meta })
}
