//! `export --format perfetto`: an analysis as a Perfetto trace (protobuf
//! `Trace` of `TracePacket`s with `TrackDescriptor`s and `TrackEvent`s),
//! which ui.perfetto.dev and `trace_processor` open beside the program's
//! own profiles.
//!
//! Per process a process track (per device, in the allocator view of a
//! snapshot, a top-level track `device N` without a process descriptor,
//! since device indices are not process ids) holds:
//! - counter tracks: `live bytes`, `reserved bytes` (allocator view, or as a
//!   profiler trace reported it),
//!   `fragmentation score` and its six components, and `forecast t+k` for
//!   each horizon step of the online backtest;
//! - an `OOMs` track of instants named `OOM (<class>)`, whose debug
//!   annotations carry the class, the request, the live bytes, the largest
//!   gap, the device's free memory and the call site;
//! - an `iterations` track with one slice per iteration (clipped to the
//!   window and to the first event);
//! - a `leaks` track with one instant per leak verdict, at the end.
//!
//! Timestamps are ns from the trace's first event (entries, for a snapshot
//! without `time_us`), on Perfetto's default clock; all packets are on one
//! sequence, in time order.
//!
//! The messages below are the subset of Perfetto's published schema
//! (`protos/perfetto/trace/trace.proto`, `trace_packet.proto`,
//! `track_event/{track_descriptor,track_event,counter_descriptor,
//! process_descriptor,debug_annotation}.proto`, Perfetto v51) that this
//! export writes, with the schema's field numbers, encoded by `prost`.
//! Fields of a `oneof` are plain optional fields here: on the wire a oneof
//! member is an ordinary field. Deriving the subset keeps protoc and the
//! generated code of the whole schema out of the build; the tests decode
//! the output with Perfetto's own generated Python classes (the `perfetto`
//! package's `perfetto_trace_pb2`), so a wrong number would show there.

use std::io::Write;

use anyhow::{Context, Result};
use prost::Message;

use crate::analysis::Analysis;
use crate::output::export::common::{
    Exporter, Paths, Source, Window, Written, iteration_spans, leak_marker_ns, timeline_pids,
};

/// The Perfetto format.
pub(crate) struct Perfetto;

impl Exporter for Perfetto {
    fn needs_analysis(&self) -> bool {
        true
    }

    fn write(&self, paths: &Paths, source: Source<'_>, window: Window, out: &mut dyn Write) -> Result<Written> {
        let trace = perfetto(source.analysis()?, window);
        out.write_all(&encode(&trace)).with_context(|| format!("cannot write {}", paths.output.display()))?;
        Ok(Written { what: format!("Perfetto trace ({} packets)", trace.packet.len()), detail: String::new() })
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct Trace {
    #[prost(message, repeated, tag = "1")]
    pub packet: Vec<TracePacket>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TracePacket {
    #[prost(uint64, optional, tag = "8")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "10")]
    pub trusted_packet_sequence_id: Option<u32>,
    #[prost(message, optional, tag = "11")]
    pub track_event: Option<TrackEvent>,
    #[prost(uint32, optional, tag = "13")]
    pub sequence_flags: Option<u32>,
    #[prost(message, optional, tag = "60")]
    pub track_descriptor: Option<TrackDescriptor>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TrackDescriptor {
    #[prost(uint64, optional, tag = "1")]
    pub uuid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
    #[prost(message, optional, tag = "3")]
    pub process: Option<ProcessDescriptor>,
    #[prost(uint64, optional, tag = "5")]
    pub parent_uuid: Option<u64>,
    #[prost(message, optional, tag = "8")]
    pub counter: Option<CounterDescriptor>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ProcessDescriptor {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    #[prost(string, optional, tag = "6")]
    pub process_name: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct CounterDescriptor {
    /// `CounterDescriptor.Unit`: 1 time (ns), 2 count, 3 size (bytes).
    #[prost(int32, optional, tag = "3")]
    pub unit: Option<i32>,
    #[prost(string, optional, tag = "6")]
    pub unit_name: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TrackEvent {
    #[prost(message, repeated, tag = "4")]
    pub debug_annotations: Vec<DebugAnnotation>,
    /// `TrackEvent.Type`: 1 slice begin, 2 slice end, 3 instant, 4 counter.
    #[prost(int32, optional, tag = "9")]
    pub r#type: Option<i32>,
    #[prost(uint64, optional, tag = "11")]
    pub track_uuid: Option<u64>,
    #[prost(string, repeated, tag = "22")]
    pub categories: Vec<String>,
    #[prost(string, optional, tag = "23")]
    pub name: Option<String>,
    #[prost(int64, optional, tag = "30")]
    pub counter_value: Option<i64>,
    #[prost(double, optional, tag = "44")]
    pub double_counter_value: Option<f64>,
}

#[derive(Clone, PartialEq, Message)]
pub struct DebugAnnotation {
    #[prost(bool, optional, tag = "2")]
    pub bool_value: Option<bool>,
    #[prost(uint64, optional, tag = "3")]
    pub uint_value: Option<u64>,
    #[prost(int64, optional, tag = "4")]
    pub int_value: Option<i64>,
    #[prost(double, optional, tag = "5")]
    pub double_value: Option<f64>,
    #[prost(string, optional, tag = "6")]
    pub string_value: Option<String>,
    #[prost(string, optional, tag = "10")]
    pub name: Option<String>,
}

const SLICE_BEGIN: i32 = 1;
const SLICE_END: i32 = 2;
const INSTANT: i32 = 3;
const COUNTER: i32 = 4;
const UNIT_SIZE_BYTES: i32 = 3;
/// `TracePacket.SequenceFlags.SEQ_INCREMENTAL_STATE_CLEARED`.
const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;
const SEQUENCE: u32 = 1;

/// A debug annotation's value.
enum Arg {
    U(u64),
    I(i64),
    F(f64),
    S(String),
}

fn annotation(name: &str, v: Arg) -> DebugAnnotation {
    let mut d = DebugAnnotation { name: Some(name.to_string()), ..Default::default() };
    match v {
        Arg::U(u) => d.uint_value = Some(u),
        Arg::I(i) => d.int_value = Some(i),
        Arg::F(f) => d.double_value = Some(f),
        Arg::S(s) => d.string_value = Some(s),
    }
    d
}

/// Allocates track uuids and collects the descriptors and timed events.
struct Builder {
    descriptors: Vec<TrackDescriptor>,
    /// (timestamp, order within a timestamp, event): slice ends sort before
    /// begins at the same time, so consecutive iterations nest correctly.
    events: Vec<(u64, u8, TrackEvent)>,
}

impl Builder {
    fn track(&mut self, parent: Option<u64>, name: String, counter: Option<CounterDescriptor>) -> u64 {
        let uuid = self.descriptors.len() as u64 + 1;
        self.descriptors.push(TrackDescriptor {
            uuid: Some(uuid),
            name: Some(name),
            parent_uuid: parent,
            counter,
            ..Default::default()
        });
        uuid
    }

    /// A process's top-level track. Device series (the allocator view of
    /// a snapshot, keyed by device index) are plain top-level tracks: a
    /// ProcessDescriptor would claim a real process 0, 1, ….
    fn process(&mut self, pid: Option<u32>, name: String) -> u64 {
        let uuid = self.track(None, name.clone(), None);
        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
            let d = self.descriptors.last_mut().expect("just pushed");
            d.process = Some(ProcessDescriptor { pid: Some(pid), process_name: Some(name) });
        }
        uuid
    }

    fn event(&mut self, ts: u64, order: u8, e: TrackEvent) {
        self.events.push((ts, order, e));
    }

    fn counter_i(&mut self, ts: u64, track: u64, v: i64) {
        self.event(
            ts,
            1,
            TrackEvent { r#type: Some(COUNTER), track_uuid: Some(track), counter_value: Some(v), ..Default::default() },
        );
    }

    fn counter_f(&mut self, ts: u64, track: u64, v: f64) {
        if v.is_finite() {
            self.event(
                ts,
                1,
                TrackEvent {
                    r#type: Some(COUNTER),
                    track_uuid: Some(track),
                    double_counter_value: Some(v),
                    ..Default::default()
                },
            );
        }
    }

    fn instant(&mut self, ts: u64, track: u64, name: String, category: &str, args: Vec<DebugAnnotation>) {
        self.event(
            ts,
            1,
            TrackEvent {
                r#type: Some(INSTANT),
                track_uuid: Some(track),
                name: Some(name),
                categories: vec![category.to_string()],
                debug_annotations: args,
                ..Default::default()
            },
        );
    }

    fn into_trace(mut self) -> Trace {
        self.events.sort_by_key(|(ts, order, _)| (*ts, *order));
        let mut packet: Vec<TracePacket> = Vec::with_capacity(self.descriptors.len() + self.events.len());
        let first_ts = self.events.first().map_or(0, |e| e.0);
        for (i, d) in self.descriptors.into_iter().enumerate() {
            packet.push(TracePacket {
                timestamp: Some(first_ts),
                trusted_packet_sequence_id: Some(SEQUENCE),
                sequence_flags: (i == 0).then_some(SEQ_INCREMENTAL_STATE_CLEARED),
                track_descriptor: Some(d),
                ..Default::default()
            });
        }
        packet.extend(self.events.into_iter().map(|(ts, _, e)| TracePacket {
            timestamp: Some(ts),
            trusted_packet_sequence_id: Some(SEQUENCE),
            track_event: Some(e),
            ..Default::default()
        }));
        Trace { packet }
    }
}

/// The per-process tracks.
struct Tracks {
    live: u64,
    reserved: Option<u64>,
    score: u64,
    components: [u64; 6],
    forecast: Vec<u64>,
    ooms: u64,
    iterations: u64,
    leaks: u64,
}

/// The Perfetto trace of an analysis, restricted to `window` as the
/// chrome export is.
pub fn perfetto(a: &Analysis, window: Window) -> Trace {
    let rel = |t: u64| t.saturating_sub(a.first_ts);
    let mut b = Builder { descriptors: Vec::new(), events: Vec::new() };
    let pids = timeline_pids(a);
    let bytes = || Some(CounterDescriptor { unit: Some(UNIT_SIZE_BYTES), unit_name: None });
    let plain = || Some(CounterDescriptor { unit: None, unit_name: None });
    let horizon = a.rows.iter().find_map(|r| r.forecast.as_ref().map(|f| f.len())).unwrap_or(0);
    let mut tracks: std::collections::BTreeMap<u32, Tracks> = std::collections::BTreeMap::new();
    for &pid in &pids {
        let p = b.process((!a.allocator_view).then_some(pid), format!("{} {}", a.unit(), a.who(pid)));
        let has_reserved = a.rows.iter().any(|r| r.pid == pid && r.reserved_bytes().is_some());
        let t = Tracks {
            live: b.track(Some(p), "live bytes".into(), bytes()),
            reserved: has_reserved.then(|| b.track(Some(p), "reserved bytes".into(), bytes())),
            score: b.track(Some(p), "fragmentation score".into(), plain()),
            components: crate::analysis::metrics::Metrics::FEATURE_NAMES.map(|c| b.track(Some(p), c.into(), plain())),
            forecast: (1..=horizon).map(|k| b.track(Some(p), format!("forecast t+{k}"), plain())).collect(),
            ooms: b.track(Some(p), "OOMs".into(), None),
            iterations: b.track(Some(p), "iterations".into(), None),
            leaks: b.track(Some(p), "leaks".into(), None),
        };
        tracks.insert(pid, t);
    }
    for r in a.rows.iter().filter(|r| window.contains(r.t_ns)) {
        let (ts, t) = (rel(r.t_ns), &tracks[&r.pid]);
        let m = &r.metrics;
        b.counter_i(ts, t.live, m.live_bytes as i64);
        if let (Some(track), Some(reserved)) = (t.reserved, r.reserved_bytes()) {
            b.counter_i(ts, track, reserved as i64);
        }
        b.counter_f(ts, t.score, m.score);
        for (track, v) in t.components.iter().zip(m.features()) {
            b.counter_f(ts, *track, v);
        }
        if let Some(f) = &r.forecast {
            for (track, v) in t.forecast.iter().zip(f) {
                b.counter_f(ts, *track, *v);
            }
        }
    }
    for o in a.ooms.iter().filter(|o| window.contains(o.t_ns)) {
        let mut args = vec![
            annotation("class", Arg::S(o.class.name().to_string())),
            annotation("requested_bytes", Arg::U(o.requested)),
            annotation("live_bytes", Arg::U(o.live_bytes)),
            annotation("largest_gap_bytes", Arg::U(o.largest_gap)),
        ];
        if let Some(free) = o.device_free {
            args.push(annotation("device_free_bytes", Arg::U(free)));
        }
        if let Some(site) = &o.request_site {
            args.push(annotation("site", Arg::S(site.clone())));
        }
        let Some(t) = tracks.get(&o.pid) else { continue };
        let track = t.ooms;
        b.instant(rel(o.t_ns), track, format!("OOM ({})", o.class.name()), "oom", args);
    }
    for it in iteration_spans(a, window) {
        let Some(t) = tracks.get(&it.pid) else { continue };
        let track = t.iterations;
        b.event(
            rel(it.start_ns),
            1,
            TrackEvent {
                r#type: Some(SLICE_BEGIN),
                track_uuid: Some(track),
                name: Some(format!("iteration {}", it.number)),
                categories: vec!["iteration".into()],
                debug_annotations: vec![annotation("source", Arg::S(it.source))],
                ..Default::default()
            },
        );
        b.event(
            rel(it.end_ns),
            0,
            TrackEvent { r#type: Some(SLICE_END), track_uuid: Some(track), ..Default::default() },
        );
    }
    let end = rel(leak_marker_ns(a, window));
    for l in &a.leaks {
        let Some(t) = tracks.get(&l.pid) else { continue };
        let track = t.leaks;
        let mut args = vec![
            annotation("verdict", Arg::S(l.verdict.name().to_string())),
            annotation("reason", Arg::S(l.reason.clone())),
            annotation("growth_bytes", Arg::I(l.growth_bytes)),
        ];
        // Only a leak has a rate (as in report.json).
        if let Some(rate) = l.rate() {
            args.push(annotation("rate_bytes_per_s", Arg::F(rate)));
        }
        b.instant(end, track, format!("leak: {}", l.verdict.name()), "leak", args);
    }
    b.into_trace()
}

/// The encoded trace.
pub fn encode(t: &Trace) -> Vec<u8> {
    t.encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slice ends sort before begins at the same time, and descriptors
    /// come first with the incremental-state flag on the first packet only.
    #[test]
    fn packets_in_time_order_with_descriptors_first() {
        let mut b = Builder { descriptors: Vec::new(), events: Vec::new() };
        let p = b.process(Some(7), "pid 7".into());
        let it = b.track(Some(p), "iterations".into(), None);
        let slice = |ty| TrackEvent { r#type: Some(ty), track_uuid: Some(it), ..Default::default() };
        b.event(200, 1, slice(SLICE_BEGIN));
        b.event(200, 0, slice(SLICE_END));
        b.event(100, 1, slice(SLICE_BEGIN));
        b.event(300, 0, slice(SLICE_END));
        let t = b.into_trace();
        let kinds: Vec<(Option<u64>, Option<i32>)> =
            t.packet.iter().map(|p| (p.timestamp, p.track_event.as_ref().and_then(|e| e.r#type))).collect();
        assert_eq!(
            kinds,
            vec![
                (Some(100), None),
                (Some(100), None),
                (Some(100), Some(SLICE_BEGIN)),
                (Some(200), Some(SLICE_END)),
                (Some(200), Some(SLICE_BEGIN)),
                (Some(300), Some(SLICE_END)),
            ]
        );
        assert_eq!(t.packet[0].sequence_flags, Some(SEQ_INCREMENTAL_STATE_CLEARED));
        assert_eq!(t.packet[1].sequence_flags, None);
        assert_eq!(t.packet[1].track_descriptor.as_ref().unwrap().parent_uuid, Some(p));
        // prost's own decoding gives back what was encoded.
        assert_eq!(Trace::decode(encode(&t).as_slice()).unwrap(), t);
    }

    /// A non-finite counter value is left out rather than written as NaN.
    #[test]
    fn non_finite_counters_are_skipped() {
        let mut b = Builder { descriptors: Vec::new(), events: Vec::new() };
        b.counter_f(1, 1, f64::NAN);
        b.counter_f(1, 1, 0.5);
        assert_eq!(b.events.len(), 1);
    }
}
