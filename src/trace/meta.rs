//! `trace.json` ([`TraceMeta`]): who produced the trace ([`Source`]), the
//! format version, the capacity, the event counts and the producer's own
//! details; and reading it back ([`parse_meta`]).

use super::details;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self};
use std::path::Path;

/// Version of the on-disk format; bumped on incompatible changes.
pub const FORMAT_VERSION: u32 = 1;

pub const META_FILE: &str = "trace.json";

/// Where a trace came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    Ebpf,
    PytorchSnapshot,
    /// A PyTorch-profiler trace (`profile_memory=True`), imported.
    PytorchProfiler,
    /// An Nsight Systems SQLite export (`--cuda-memory-usage=true`), imported.
    NsightSystems,
    Synthetic,
    /// A `whatif` scenario: recorded requests placed by the allocator
    /// model under other settings.
    Simulated,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Ebpf => "ebpf",
            Source::PytorchSnapshot => "pytorch-snapshot",
            Source::PytorchProfiler => "pytorch-profiler",
            Source::NsightSystems => "nsight-systems",
            Source::Synthetic => "synthetic",
            Source::Simulated => "simulated",
        }
    }
}

/// `trace.json`. Only `format_version` and `source` are required: every
/// other field may be missing (a trace written by another producer) and
/// then takes its default — empty text and lists, `null` for the optional
/// figures, 0 for counts, and no details. Unknown fields are ignored, so
/// older and newer producers stay readable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceMeta {
    pub format_version: u32,
    /// The producer's version (default: empty).
    #[serde(default)]
    pub tool_version: String,
    pub source: Source,
    #[serde(default)]
    pub host: String,
    /// Wall-clock time of the first event, ns since the Unix epoch.
    #[serde(default)]
    pub start_wall_ns: Option<u64>,
    /// Add to `ts_ns` to get wall-clock ns since the epoch.
    #[serde(default)]
    pub mono_to_wall_offset_ns: Option<i64>,
    #[serde(default)]
    pub pids: Vec<u32>,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub libraries: Vec<String>,
    #[serde(default)]
    pub event_counts: BTreeMap<String, u64>,
    #[serde(default)]
    pub lost_events: u64,
    /// Device memory capacity in bytes, when the producer knows it.
    #[serde(default)]
    pub capacity_bytes: Option<u64>,
    #[serde(default)]
    pub parts: u32,
    /// Producer-specific details.
    #[serde(default, serialize_with = "details::sorted")]
    pub details: details::Details,
}

impl TraceMeta {
    pub fn new(source: Source) -> TraceMeta {
        TraceMeta {
            format_version: FORMAT_VERSION,
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            source,
            host: fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default(),
            start_wall_ns: None,
            mono_to_wall_offset_ns: None,
            pids: Vec::new(),
            command: Vec::new(),
            libraries: Vec::new(),
            event_counts: BTreeMap::new(),
            lost_events: 0,
            capacity_bytes: None,
            parts: 0,
            details: details::Details::default(),
        }
    }
}

pub(crate) fn parse_meta(path: &Path, bytes: &[u8]) -> Result<TraceMeta> {
    let meta: TraceMeta =
        serde_json::from_slice(bytes).with_context(|| format!("{}: not a valid trace.json", path.display()))?;
    if meta.format_version > FORMAT_VERSION {
        bail!(
            "{}: trace format version {} is newer than this fragscope understands ({}); upgrade fragscope",
            path.display(),
            meta.format_version,
            FORMAT_VERSION
        );
    }
    if let details::Details::Other(value) = &meta.details
        && let Some(why) = details::malformed(value, meta.source.name())
    {
        bail!("{}: not a valid trace.json: {why}", path.display());
    }
    Ok(meta)
}
