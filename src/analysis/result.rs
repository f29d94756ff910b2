//! What the analysis of one trace found ([`Analysis`]): the metric rows,
//! the per-process forecasts, the OOM diagnoses, iterations, leaks, call
//! sites, the what-if replay and the advice ([`Advice`]). Data only; the
//! stages above it compute it ([`super::analyze_events`], [`super::advice`])
//! and present it ([`crate::output`]).

use serde::Serialize;

use crate::analysis::options::Options;
use crate::analysis::{layout, risk, whatif};

use crate::analysis::iterations::Iterations;
use crate::analysis::leak::LeakReport;
use crate::analysis::metrics::Metrics;
use crate::analysis::oom::OomDiagnosis;
use crate::analysis::predict::{Prediction, Risk};
use crate::analysis::replay::{AllocatorFigures, Anomalies, ExitRelease, Peak};
use crate::trace::Trace;

/// One metric row, with the online backtest's view at that step (regular
/// rows only, once there is enough data).
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub step: u32,
    pub t_ns: u64,
    pub pid: u32,
    pub at_oom: bool,
    pub metrics: Metrics,
    pub forecast: Option<Vec<f64>>,
    /// The fragmentation level the online backtest forecast at this step.
    pub risk_online: Option<Risk>,
    /// The OOM risk an online monitor would have reported at this step
    /// ([`risk`]): unknown while the capacity could not have been known
    /// (one inferred from a later OOM, or from the cache flushes).
    pub oom_risk_online: Option<risk::OomRisk>,
    /// Allocator view only: reserved, allocated and requested bytes and
    /// PyTorch's fragmentation figure.
    pub alloc: Option<AllocatorFigures>,
    /// The iteration this row falls in (None before the first boundary,
    /// or when no iterations were found).
    pub iteration: Option<u32>,
    /// The reserved bytes the producer reported at this instant, summed
    /// over the process's devices (PyTorch-profiler traces: `Total
    /// Reserved`); None elsewhere.
    pub reported_reserved: Option<u64>,
}

impl Row {
    /// Reserved bytes: the allocator view's segments, else what the
    /// producer reported.
    pub fn reserved_bytes(&self) -> Option<u64> {
        self.alloc.map(|a| a.reserved_bytes).or(self.reported_reserved)
    }
}

/// The prediction of one process and when it first warned.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessPrediction {
    pub pid: u32,
    pub prediction: Prediction,
    /// Steps and seconds between the first online OOM risk ≥ high and the
    /// process's first OOM (None: no OOM, or no warning before it).
    pub lead_time: Option<(u32, f64)>,
}

/// Everything `analyze` computed for one trace.
#[derive(Clone, Debug)]
pub struct Analysis {
    /// The first screen's verdict, memory and fix ([`crate::analysis::decision`]).
    pub decision: Option<crate::analysis::decision::Decision>,
    pub trace: Trace,
    pub events: u64,
    pub counts_by_kind: crate::trace::event::KindCounts,
    pub failed_allocs: u64,
    /// Device frees of a null pointer (`cudaFree(0)`), which free nothing.
    pub null_frees: u64,
    /// Of those, failed cudaMallocs whose request PyTorch's allocator then
    /// served when it asked again, after releasing cached memory: not OOMs.
    pub recovered_allocs: u64,
    pub first_ts: u64,
    pub last_ts: u64,
    pub step_count: usize,
    pub rows: Vec<Row>,
    pub ooms: Vec<OomDiagnosis>,
    pub predictions: Vec<ProcessPrediction>,
    pub leaks: Vec<LeakReport>,
    /// The OOM risk of each device (snapshots), or of the processes'
    /// device together (device-level traces): the headline.
    pub oom_risk: Vec<risk::Assessment>,
    /// The capacity the OOM diagnosis used, if any.
    pub capacity: Option<u64>,
    /// What the pictures draw, when `Options::layout` asked for it and
    /// the trace has device memory.
    pub layout: Option<layout::Layout>,
    pub anomalies: Anomalies,
    /// Blocks that recorded processes still held when they exited.
    pub exits: Vec<ExitRelease>,
    /// The iterations of each process (device) where some were found.
    pub iterations: Vec<Iterations>,
    pub peaks: Vec<Peak>,
    /// Peak of the live bytes summed over processes.
    pub peak_live_total: u64,
    pub options: Options,
    /// The allocator view (PyTorch snapshots: one series per device, the
    /// `pid` fields hold the device index) rather than the device view.
    pub allocator_view: bool,
    /// Folded stacks of live memory at the end and the peak (traces with
    /// stacks), for flamegraph.folded and flamegraph.svg.
    pub flamegraph: Option<String>,
    /// Recorded launches by kernel name (eBPF traces with `maps/`).
    pub kernels: Vec<crate::analysis::kernels::KernelStat>,
    /// Device allocations by recorded call stack (`record --stacks`).
    pub alloc_stacks: Vec<crate::analysis::sites::StackStat>,
    /// Snapshots, and device-level traces with OOMs (with
    /// `Options::whatif`): the allocator model's fidelity and the default
    /// sweep of settings.
    pub whatif: Option<whatif::Whatif>,
    /// Why the what-if did not run where a reader would look for it (a
    /// device-level recording of PyTorch processes: their cudaMallocs are
    /// PyTorch's segments, not the program's requests).
    pub whatif_not_run: Option<String>,
    /// A device-level recording's processes that ran PyTorch's caching
    /// allocator (they mapped `libc10_cuda.so`): their cudaMallocs are its
    /// segments, so the gaps inside its cache are not in the recording.
    pub pytorch_processes: Vec<u32>,
    /// Processes with nothing live at their last timestep and something
    /// reserved (a job's teardown), sorted: their score is of an empty
    /// cache ([`crate::analysis::summary::ended_empty`]).
    pub ended_empty: Vec<u32>,
    /// A device-level recording's processes with OOMs and no copy of their
    /// maps (they exited before the recorder read them): whether they ran
    /// PyTorch's caching allocator is unknown, so their OOMs are counted
    /// call by call.
    pub ooms_without_maps: Vec<u32>,
    /// What to do ([`advice`]).
    pub advice: Vec<Advice>,
    /// Memory per annotated stage (snapshots with `record_function`
    /// ranges).
    pub stages: crate::analysis::stages::Stages,
    /// What the process asked of PyTorch's allocator against what it used
    /// (snapshots and recordings' allocator views).
    pub settings_check: Option<crate::analysis::settings_check::SettingsCheck>,
    /// The trace's class and its units' under `--classes`.
    pub class: Option<crate::analysis::classes::TraceClass>,
}

impl Analysis {
    /// What a series is: a process (device view) or a device (allocator view).
    /// How the report names replay unit `id`: its pid (or a snapshot's
    /// device), or "PID on GPU N" for one device of a process that used
    /// several ([`crate::trace::Trace::units`]).
    pub fn who(&self, id: u32) -> String {
        self.trace.unit_label(id)
    }

    /// A series of the OOM risk, a device of the allocator view: "device
    /// N", or "pid P on GPU N" for a unit of a recording.
    pub fn device_name(&self, id: u32) -> String {
        match self.trace.units.get(&id) {
            Some(_) => format!("pid {}", self.who(id)),
            None => format!("device {id}"),
        }
    }

    pub fn unit(&self) -> &'static str {
        // The allocator view of several processes' recorded blocks: its
        // units are processes (and their GPUs), named by [`Self::who`].
        if self.allocator_view && self.trace.units.is_empty() { "device" } else { "pid" }
    }

    /// Time is entry order, not a clock: an imported snapshot whose trace
    /// entries carry no `time_us` (then 1 ns stands for one entry).
    pub fn entry_order(&self) -> bool {
        self.snapshot_details().is_some_and(|d| d.entry_order())
    }

    /// False for a snapshot that holds no trace history (only the state at
    /// one instant): OOMs, leaks, iterations and what-if cannot be judged
    /// from it. A trace of a few frees and no allocation (PyTorch keeps
    /// only the last `max_entries` entries) is none either.
    pub fn has_history(&self) -> bool {
        self.snapshot_details().is_none_or(|d| {
            let rebuilt: u64 = d.reconstruction.iter().map(|r| r.initial_blocks).sum();
            d.entries() > 0
                && (self.counts_by_kind.get(crate::trace::event::EventKind::BlockAlloc) > rebuilt
                    || self.counts_by_kind.get(crate::trace::event::EventKind::Oom) > 0)
        })
    }

    /// What an imported snapshot's `trace.json` says about it.
    pub fn snapshot_details(&self) -> Option<&crate::trace::details::SnapshotDetails> {
        self.trace.meta.as_ref().and_then(|m| m.details.snapshot())
    }

    /// A duration for a reader: seconds, or entries in entry order.
    pub fn time_text(&self, seconds: f64) -> String {
        if self.entry_order() {
            let n = (seconds * 1e9).round() as u64;
            format!("{n} entr{}", if n == 1 { "y" } else { "ies" })
        } else if seconds >= 1.0 {
            format!("{seconds:.2} s")
        } else {
            format!("{:.2} ms", seconds * 1e3)
        }
    }
}

/// What a piece of advice is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// An allocator setting the replay shows removing (or reducing) OOMs.
    Setting,
    /// No setting tried removes the OOMs.
    NoSetting,
    /// What pins memory, and what to change in the program.
    Program,
    /// A recognised program pattern.
    Pattern,
    /// A setting that only lowers peak reserved.
    Saving,
    /// A setting from general knowledge, not simulated.
    Generic,
    Capacity,
    /// PyTorch released cached segments because the device was full.
    Flush,
    Leak,
    Risk,
}

/// One piece of advice.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Advice {
    pub kind: Kind,
    pub text: String,
    /// The `PYTORCH_CUDA_ALLOC_CONF=…` line it advises, if any.
    pub conf: Option<String>,
    /// Whether the figures come from a replay of this trace's requests.
    pub simulated: bool,
    /// For a setting: whether its replay removes every recorded OOM.
    pub removes_ooms: Option<bool>,
}

impl Advice {
    pub(crate) fn new(kind: Kind, text: String) -> Advice {
        Advice { kind, text, conf: None, simulated: false, removes_ooms: None }
    }
}
