//! The producer-specific part of `trace.json` (`details`), typed: what an
//! imported snapshot, a recording and `synth` each know about their trace.
//! On disk it is a JSON object with sorted keys, as it always was; a
//! `details` this version does not recognise (another producer's, or a
//! hand-written trace's) is kept as it is. Details that have a producer's
//! required field but do not read as that producer's (a field of the wrong
//! type), in a trace whose `source` is that producer, are an error naming
//! the field ([`malformed`], checked by `parse_meta`): read as foreign, a
//! recording would lose, without a word, what only a recording's details
//! say (its GPUs, its launches at entry, the libraries it did not probe).
//! Under another `source` such details are another producer's, and kept.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `trace.json` `details`. Told apart by their required fields:
/// `snapshot`, `undecodable_records`, `pattern`, `profiler_trace`,
/// `nsys_export` (see [`KINDS`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Details {
    Snapshot(Box<SnapshotDetails>),
    Record(RecordDetails),
    Synthetic(SynthDetails),
    Profiler(Box<ProfilerDetails>),
    Nsys(Box<NsysDetails>),
    Other(serde_json::Value),
}

/// A producer's kind of details: its required field, the `source`s whose
/// traces it writes (a snapshot's details also describe the view of a
/// recording), its name in messages, and how its details are read.
struct Kind {
    key: &'static str,
    sources: &'static [&'static str],
    producer: &'static str,
    read: fn(&serde_json::Value) -> Result<Details, String>,
}

/// In the order they are tried (the order the enum's variants were tried
/// in when it was read untagged).
const KINDS: [Kind; 5] = [
    Kind {
        key: "snapshot",
        sources: &["pytorch-snapshot", "ebpf"],
        producer: "a snapshot import's",
        read: |v| typed(v).map(|d| Details::Snapshot(Box::new(d))),
    },
    Kind {
        key: "undecodable_records",
        sources: &["ebpf"],
        producer: "a recording's",
        read: |v| typed(v).map(Details::Record),
    },
    Kind {
        key: "pattern",
        sources: &["synthetic"],
        producer: "a synthetic trace's",
        read: |v| typed(v).map(Details::Synthetic),
    },
    Kind {
        key: "profiler_trace",
        sources: &["pytorch-profiler"],
        producer: "a profiler import's",
        read: |v| typed(v).map(|d| Details::Profiler(Box::new(d))),
    },
    Kind {
        key: "nsys_export",
        sources: &["nsight-systems"],
        producer: "an Nsight Systems import's",
        read: |v| typed(v).map(|d| Details::Nsys(Box::new(d))),
    },
];

fn has(value: &serde_json::Value, key: &str) -> bool {
    value.as_object().is_some_and(|o| o.contains_key(key))
}

/// `value` read as `T`, or what is wrong with it, named by its path from
/// `details` (e.g. `details.reader.reads: invalid type: string "x",
/// expected u64`).
fn typed<T: serde::de::DeserializeOwned>(value: &serde_json::Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." { "details".to_string() } else { format!("details.{path}") };
        format!("{at}: {}", e.into_inner())
    })
}

impl<'de> Deserialize<'de> for Details {
    /// The first producer's details they have the required field of and
    /// read as; otherwise [`Details::Other`], as they are (see
    /// [`malformed`] for the ones that should have read).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        Ok(KINDS
            .iter()
            .filter(|k| has(&value, k.key))
            .find_map(|k| (k.read)(&value).ok())
            .unwrap_or(Details::Other(value)))
    }
}

/// Why `details`, kept as another producer's ([`Details::Other`]), do not
/// read as those of the producer of a trace of `source` (its
/// [`Source::name`](super::Source::name)) although they have its required
/// field: the field that is wrong, by its path. `None` when they are not
/// that producer's.
pub(crate) fn malformed(value: &serde_json::Value, source: &str) -> Option<String> {
    let kind = KINDS.iter().find(|k| k.sources.contains(&source) && has(value, k.key))?;
    let err = (kind.read)(value).err()?;
    Some(format!("`details` are {} (they have `{}`), but {err}", kind.producer, kind.key))
}

impl Default for Details {
    fn default() -> Self {
        Details::Other(serde_json::Value::Null)
    }
}

impl Details {
    /// Whether the recording behind these details (its own, or the one a
    /// view or a join was made of) wrote its launches without their return
    /// codes.
    pub fn launches_at_entry(&self) -> bool {
        match self {
            Details::Record(d) => d.launches_at_entry,
            Details::Snapshot(s) => s.join.as_ref().is_some_and(|j| j.launches_at_entry),
            _ => false,
        }
    }

    pub fn snapshot(&self) -> Option<&SnapshotDetails> {
        if let Details::Snapshot(s) = self { Some(s) } else { None }
    }

    pub fn snapshot_mut(&mut self) -> Option<&mut SnapshotDetails> {
        if let Details::Snapshot(s) = self { Some(s) } else { None }
    }

    pub fn record(&self) -> Option<&RecordDetails> {
        if let Details::Record(r) = self { Some(r) } else { None }
    }

    /// Names the file an imported trace came from when the importer read a
    /// decompressed copy of it (`input::compressed`).
    pub fn name_compressed_source(&mut self, origin: &CompressedOrigin) {
        let (p, b, c) = match self {
            Details::Snapshot(s) => (&mut s.snapshot, &mut s.file_bytes, &mut s.compression),
            Details::Profiler(s) => (&mut s.profiler_trace, &mut s.file_bytes, &mut s.compression),
            Details::Nsys(s) => (&mut s.nsys_export, &mut s.file_bytes, &mut s.compression),
            _ => return,
        };
        p.clone_from(&origin.path);
        *b = origin.file_bytes;
        *c = Some(origin.compression.to_string());
    }

    /// Whether annotation `a` can be placed among its device's events: not
    /// where that device's time is entry order (no `time_us`), while the
    /// annotation's is the wall clock.
    pub fn placeable(&self, a: &Annotation) -> bool {
        self.snapshot().is_none_or(|s| !s.untimed_devices.contains(&a.device))
    }

    /// Whether series `id` (a snapshot's device) has no clock: its time is
    /// entry order.
    pub fn untimed(&self, id: u32) -> bool {
        self.snapshot().is_some_and(|s| s.untimed_devices.contains(&id))
    }

    /// A snapshot's annotation ranges that cannot be placed
    /// ([`Details::placeable`]).
    pub fn unplaced_annotations(&self) -> usize {
        self.annotations().iter().filter(|a| a.stage == "START" && !self.placeable(a)).count()
    }

    /// The reserved bytes a profiler trace reported over time (empty for
    /// other sources).
    pub fn reserved_series(&self) -> &[ReservedSample] {
        match self {
            Details::Profiler(p) => &p.reserved_series,
            _ => &[],
        }
    }

    /// Profiler ranges (`record_function`, `ProfilerStep#N`) of a snapshot
    /// or a profiler trace: where `analyze` takes iterations from first.
    /// Those of a snapshot's device whose time is entry order are among
    /// them, though their wall-clock times cannot be placed among its
    /// entries: see [`Details::placeable`].
    pub fn annotations(&self) -> &[Annotation] {
        match self {
            Details::Snapshot(s) => &s.annotations,
            Details::Profiler(p) => &p.annotations,
            _ => &[],
        }
    }
}

/// The compressed file an import read a decompressed copy of: its path,
/// its size and how it was compressed ("gzip", "zstd").
#[derive(Clone, Debug)]
pub struct CompressedOrigin {
    pub path: String,
    pub file_bytes: u64,
    pub compression: &'static str,
}

/// Writes `details` with its keys sorted, whatever the declaration order.
pub(crate) fn sorted<S: serde::Serializer>(d: &Details, s: S) -> Result<S::Ok, S::Error> {
    serde_json::to_value(d).map_err(serde::ser::Error::custom)?.serialize(s)
}

/// An imported PyTorch snapshot.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotDetails {
    /// The snapshot file's path.
    pub snapshot: String,
    #[serde(default)]
    pub file_bytes: u64,
    /// How the file was compressed ("gzip", "zstd"), when it was:
    /// `file_bytes` is then the compressed size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<String>,
    /// "dict", or "bare list of segments" (the oldest layout).
    #[serde(default)]
    pub layout: String,
    /// The devices imported.
    #[serde(default)]
    pub devices: Vec<u32>,
    #[serde(default)]
    pub device_count: usize,
    /// PyTorch's `allocator_settings`, as the snapshot has them, plus the
    /// keys in `inferred_settings`.
    #[serde(default)]
    pub allocator_settings: serde_json::Value,
    /// Keys of `allocator_settings` the snapshot did not record, inferred
    /// from what it holds: `expandable_segments` (true) where its segments
    /// are expandable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inferred_settings: Vec<String>,
    /// Devices whose trace entries have no `time_us` (their time is entry
    /// order, 1 ns per entry).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub untimed_devices: Vec<u32>,
    /// "time_us", or why time is entry order.
    #[serde(default)]
    pub time_source: String,
    #[serde(default)]
    pub legacy_history_blocks: u64,
    #[serde(default)]
    pub blocks_without_address: u64,
    #[serde(default)]
    pub unknown_actions: u64,
    /// Sizes of the stack table.
    #[serde(default)]
    pub stacks: usize,
    #[serde(default)]
    pub frames: usize,
    #[serde(default)]
    pub annotations: Vec<Annotation>,
    /// `_memory_viz.py segsum` totals of the final state, by device.
    #[serde(default)]
    pub totals: BTreeMap<String, Totals>,
    #[serde(default)]
    pub reconstruction: Vec<Reconstruction>,
    #[serde(default)]
    pub segments: Vec<SegmentRow>,
    /// Joined with a recording of the same run (`analyze --snapshot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join: Option<Join>,
    /// What the recorded processes' environments asked of PyTorch's
    /// allocator (a recording's allocator view, or a snapshot joined with
    /// its recording), for the settings check.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub asked: Vec<AskedSettings>,
    /// Pinned host memory (PyTorch 2.14's `host_segments`/`host_traces`):
    /// its own pool, never part of a device's figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostMemory>,
}

/// Pinned host memory as a snapshot records it (PyTorch 2.14,
/// `_record_memory_history(record_pinned_host_memory=True)`): the
/// CachingHostAllocator's pool, in the bytes its entries name (requested
/// sizes), apart from every device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    /// At the snapshot: segments, the bytes they hold, and the bytes of
    /// their active blocks (requested).
    pub segments: u64,
    pub reserved_bytes: u64,
    pub allocated_bytes: u64,
    /// Entries of `host_traces`, and allocations among them.
    pub entries: u64,
    pub allocations: u64,
    /// Most allocated and reserved at once over the entries (the state
    /// before the first entry rebuilt from the end state).
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// (ns, allocated, reserved) after each entry, thinned to at most
    /// [`HostMemory::POINTS`] points (each kept point is an entry's state;
    /// the peaks are always kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub series: Vec<(u64, u64, u64)>,
}

impl HostMemory {
    pub const POINTS: usize = 2000;
}

/// The allocator variables one recorded process had set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AskedSettings {
    pub pid: u32,
    /// The unit (device) its allocator's events are in.
    pub unit: u32,
    /// By variable name. A recording made before fragscope kept each
    /// variable apart has one entry, `PYTORCH_CUDA_ALLOC_CONF or
    /// PYTORCH_ALLOC_CONF`.
    pub vars: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_version: Option<String>,
}

impl RecordDetails {
    /// What process `pid` asked of PyTorch's allocator, as `record` kept it.
    pub fn asked(&self, pid: u32, unit: u32) -> Option<AskedSettings> {
        let key = pid.to_string();
        let vars = match (self.allocator_env.get(&key), self.allocator_conf.get(&key)) {
            (Some(env), _) => env.clone(),
            (None, Some(conf)) => [("PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF".to_string(), conf.clone())].into(),
            (None, None) => BTreeMap::new(),
        };
        let torch_version = self.torch_versions.get(&key).cloned();
        (!vars.is_empty() || torch_version.is_some()).then_some(AskedSettings { pid, unit, vars, torch_version })
    }
}

/// What joining a recording with the snapshot matched
/// ([`crate::input::join`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Join {
    /// The recording's path.
    pub recording: String,
    /// The recorded processes that are the snapshot's.
    pub pids: Vec<u32>,
    /// The blocks are the recording's own (the probes on PyTorch's
    /// allocator), not a snapshot's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub probed: bool,
    /// Probed recordings: blocks in no recorded segment (segments PyTorch
    /// got before the recording began, as with `record --pid`); each is
    /// counted as a segment of its own size.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub blocks_without_segment: u64,
    /// Probed recordings: the device allocation and free calls recorded
    /// for these processes (CUDA's, beneath PyTorch's blocks); 0 when none
    /// was made while recording or the runtime was not probed. Absent in
    /// views made before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_calls: Option<u64>,
    pub segments_matched: u64,
    pub segments_total: u64,
    /// The recording's clock minus the snapshot's, from the matched
    /// segments.
    pub clock_offset_ns: i64,
    /// How far that is from what the recording's own offset between its
    /// clock and wall time says (the snapshot's clock is wall time), when
    /// it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_disagreement_ns: Option<i64>,
    pub outside: JoinOutside,
    /// The recording wrote its launches at entry, without their return
    /// codes ([`RecordDetails::launches_at_entry`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub launches_at_entry: bool,
}

/// The device allocations of the snapshot's processes that PyTorch's
/// allocator did not make.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinOutside {
    pub allocations: u64,
    pub bytes: u64,
    /// (library, allocations, bytes).
    pub by_library: Vec<(String, u64, u64)>,
    /// Each allocation's life on the snapshot's clock, for the OOMs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spans: Vec<OutsideSpan>,
}

/// An allocation outside PyTorch's allocator: allocated at `from_ns`,
/// freed at `to_ns` (None: never, in the recording).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutsideSpan {
    pub from_ns: u64,
    pub to_ns: Option<u64>,
    pub bytes: u64,
    pub library: String,
    /// The replay unit it belongs to, when the view has several (a
    /// recording with PyTorch's blocks of several processes or GPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<u32>,
}

/// (library, allocations, bytes) of the outside allocations, by library.
pub fn by_library(spans: &[OutsideSpan]) -> Vec<(String, u64, u64)> {
    let mut by: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for s in spans {
        let e = by.entry(s.library.as_str()).or_default();
        e.0 += 1;
        e.1 += s.bytes;
    }
    by.into_iter().map(|(l, (n, b))| (l.to_string(), n, b)).collect()
}

impl SnapshotDetails {
    /// Time is entry order: some device's trace entries had no `time_us`.
    pub fn entry_order(&self) -> bool {
        self.time_source.starts_with("event order")
    }

    /// The trace entries the snapshot holds, over its devices.
    pub fn entries(&self) -> u64 {
        self.reconstruction.iter().map(|r| r.entries).sum()
    }
}

/// One segment of a snapshot's final state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SegmentRow {
    pub device: u64,
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    pub segment_type: String,
    pub is_expandable: bool,
    pub blocks: u64,
    pub active_allocated_bytes: u64,
    pub active_pending_free_bytes: u64,
}

/// One `external_annotations` entry of a PyTorch snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Annotation {
    /// `START` or `END`.
    pub stage: String,
    pub name: String,
    pub device: u32,
    pub t_ns: u64,
}

/// PyTorch's `_memory_viz.py` segment summary totals for the final state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Totals {
    pub segments: u64,
    pub reserved: u64,
    /// Σ requested size of active_allocated blocks.
    pub allocated: u64,
    /// reserved − allocated; `free_internal` of it is rounding inside
    /// active blocks, the rest is free blocks (pending frees included, as
    /// PyTorch counts them).
    pub free: u64,
    pub free_internal: u64,
    pub free_external: u64,
}

/// What the reconstruction found for one device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Reconstruction {
    pub device: u32,
    pub entries: u64,
    /// Blocks and segments alive before the first trace entry.
    pub initial_blocks: u64,
    pub initial_segments: u64,
    /// Entries that contradict the state (e.g. alloc of a block that is not
    /// alive after it, free of one already free): counted and skipped.
    pub inconsistent_entries: u64,
    /// Blocks whose size the allocator rule gave, checked against the real
    /// size where the snapshot knows it.
    pub sizes_checked: u64,
    pub sizes_agreed: u64,
    /// The forward replay's end state against the snapshot.
    pub final_check: FinalCheck,
}

/// The forward replay's end state against the snapshot's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FinalCheck {
    pub blocks_expected: u64,
    pub blocks_missing: u64,
    pub blocks_unexpected: u64,
    pub blocks_size_mismatch: u64,
    pub segments_expected: u64,
    pub segment_bytes_expected: u64,
    pub segment_bytes_replayed: u64,
    pub segment_ranges_mismatch: u64,
}

impl FinalCheck {
    pub fn exact(&self) -> bool {
        self.blocks_missing == 0
            && self.blocks_unexpected == 0
            && self.blocks_size_mismatch == 0
            && self.segment_ranges_mismatch == 0
            && self.segment_bytes_expected == self.segment_bytes_replayed
    }
}

/// How `record` read its ring buffer while it recorded (not the reads that
/// empty it after the stop). A reader that keeps up reads on its timer
/// (every 50 ms) and is not woken for a backlog; one that is woken reads
/// on without sleeping until it finds the buffer empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReaderStats {
    /// Reads of the ring buffer, each of at most 65 536 events.
    pub reads: u64,
    /// Reads that took a whole batch: events were likely still waiting.
    pub behind: u64,
    /// Times the traced program woke the reader because a quarter of the
    /// buffer was waiting: at most one between two reads.
    pub wakeups: u64,
}

/// One BPF program's runs while it was counted, and their mean time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProgramCost {
    pub runs: u64,
    pub ns_per_run: f64,
}

/// A recording (`fragscope record`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RecordDetails {
    /// Ring-buffer records that could not be decoded.
    pub undecodable_records: u64,
    #[serde(default)]
    pub recording_s: f64,
    /// Processes whose `/proc/PID/maps` was saved.
    #[serde(default)]
    pub maps: Vec<u32>,
    /// Per library: its path, whether it was found, the functions probed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probes: Option<serde_json::Value>,
    /// Why the recording ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorder_cpu_s: Option<f64>,
    /// How the recorder read its ring buffer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader: Option<ReaderStats>,
    /// What each of the recorder's BPF programs cost, by name, as the
    /// kernel counts it when `kernel.bpf_stats_enabled` is 1 (else empty):
    /// the time in the program, not the trap that brought the thread there.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub bpf_programs: BTreeMap<String, ProgramCost>,
    /// The GPUs as the driver (NVML) saw them when the recording started.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<Gpu>,
    /// Why the driver could not be asked (no NVIDIA driver, no NVML).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml: Option<String>,
    /// The devices each process's calls were made on, by pid (as text: an
    /// untagged enum cannot read integer map keys back).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub devices: BTreeMap<String, Vec<i32>>,
    /// `CUDA_VISIBLE_DEVICES` of each process that had it set, by pid (as
    /// text): the program's device N is the N-th GPU it names.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub visible_devices: BTreeMap<String, String>,
    /// `PYTORCH_CUDA_ALLOC_CONF` of each process that had it set, by pid:
    /// the settings PyTorch's allocator ran under.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocator_conf: BTreeMap<String, String>,
    /// Every variable PyTorch's allocator reads its settings from
    /// (`PYTORCH_CUDA_ALLOC_CONF`, `PYTORCH_HIP_ALLOC_CONF`,
    /// `PYTORCH_ALLOC_CONF`) that a process had set, by pid: what it asked
    /// for, which the settings check holds against what its allocator did.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocator_env: BTreeMap<String, BTreeMap<String, String>>,
    /// The PyTorch version of each process that mapped its CUDA allocator,
    /// by pid.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub torch_versions: BTreeMap<String, String>,
    /// Launches were written at their entry, without their return code (so
    /// without whether one failed). Absent in recordings made before, whose
    /// launches have it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub launches_at_entry: bool,
    /// CUDA runtimes, drivers and PyTorch allocators that a recorded
    /// process loaded but that were not among the libraries probed (outside
    /// the places searched, or not named by `--lib`): their calls are not
    /// in the recording. By pid.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unprobed_libraries: BTreeMap<String, Vec<String>>,
}

/// One GPU as the driver reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// NVML's index (the order of `nvidia-smi`, which `CUDA_VISIBLE_DEVICES`
    /// may renumber for the program).
    pub index: u32,
    pub name: String,
    pub total_bytes: u64,
    /// Used by every process and the driver, at the time of the sample.
    pub used_bytes: u64,
    /// The processes with a compute context on it.
    pub processes: Vec<GpuProcess>,
}

/// A process using a GPU, and how much of its memory (None when the
/// driver does not say).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub used_bytes: Option<u64>,
}

/// An imported PyTorch-profiler trace (`import::profiler`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfilerDetails {
    /// The trace file's path.
    pub profiler_trace: String,
    #[serde(default)]
    pub file_bytes: u64,
    /// How the file was compressed ("gzip", "zstd"), when it was:
    /// `file_bytes` is then the compressed size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<String>,
    #[serde(default)]
    pub trace_events: u64,
    /// `"[memory]"` events, of every device type.
    #[serde(default)]
    pub memory_events: u64,
    #[serde(default)]
    pub cuda_memory_events: u64,
    #[serde(default)]
    pub cpu_events_skipped: u64,
    #[serde(default)]
    pub other_device_events_skipped: u64,
    #[serde(default)]
    pub devices: Vec<i32>,
    /// `Total Allocated` before the first event, summed over devices.
    #[serde(default)]
    pub allocated_before_trace_bytes: u64,
    /// Blocks freed in the trace but allocated before it (placed at the
    /// first event's time).
    #[serde(default)]
    pub reconstructed_blocks: u64,
    #[serde(default)]
    pub reconstructed_bytes: u64,
    /// Allocated before the trace and never freed in it: no address.
    #[serde(default)]
    pub unplaced_before_trace_bytes: u64,
    #[serde(default)]
    pub peak_allocated_bytes: Option<u64>,
    /// The peak of `Total Reserved` (the caching allocator's segments).
    #[serde(default)]
    pub peak_reserved_bytes: Option<u64>,
    /// Events where the previous `Total Allocated` plus `Bytes` is not
    /// this one's (0 in every real trace we checked).
    #[serde(default)]
    pub total_allocated_breaks: u64,
    #[serde(default)]
    pub profiler_steps: u64,
    #[serde(default)]
    pub annotations: Vec<Annotation>,
    /// `Total Reserved` over time: one sample wherever it changes on a
    /// device of a process (segments are allocated and freed rarely, so
    /// this stays short). `analyze` turns it into the rows'
    /// reserved bytes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserved_series: Vec<ReservedSample>,
}

/// The caching allocator's reserved bytes on one device of a process
/// from `t_ns` on, as the PyTorch profiler reported them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservedSample {
    pub t_ns: u64,
    pub pid: u32,
    pub device: i32,
    pub bytes: u64,
}

/// An imported Nsight Systems export (`import::nsys`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NsysDetails {
    /// The export's path.
    pub nsys_export: String,
    #[serde(default)]
    pub file_bytes: u64,
    /// How the file was compressed ("gzip", "zstd"), when it was:
    /// `file_bytes` is then the compressed size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<String>,
    /// Rows of `CUDA_GPU_MEMORY_USAGE_EVENTS`.
    #[serde(default)]
    pub rows: u64,
    /// Device (and managed) memory allocations and frees kept.
    #[serde(default)]
    pub device_events: u64,
    /// Allocations from a memory pool (`cudaMallocAsync`).
    #[serde(default)]
    pub pooled: u64,
    /// Rows skipped, by memory kind (the export's own names).
    #[serde(default)]
    pub skipped: BTreeMap<String, u64>,
    #[serde(default)]
    pub devices: Vec<i32>,
}

/// A synthetic trace (`fragscope synth`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SynthDetails {
    pub pattern: String,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub events: u64,
    /// The true start of every iteration, by pid (ns).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iteration_starts: Option<BTreeMap<String, Vec<u64>>>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
