//! Command-line interface, the top of the house: the clap derive types,
//! and [`run`], which turns them into each command's own options
//! ([`crate::batch::Options`], [`crate::whatif::Options`],
//! [`crate::output::export::Options`], …) and calls the command. Nothing
//! below imports this module.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use crate::analysis::StepSpec;
use crate::analysis::predict::Risk;
use crate::synth::Pattern;

pub const EXIT_CODES: &str =
    "Exit codes: 0 success, 1 error (bad input, a trace that failed), 2 usage error, 3 a CI gate tripped.";

#[derive(Debug, Parser)]
#[command(
    name = "fragscope",
    version,
    about = "GPU memory fragmentation: record, replay, measure, diagnose",
    long_about = "fragscope replays the allocation timeline of a GPU program (an eBPF trace of CUDA calls, \
                  a PyTorch memory snapshot or a synthetic trace), measures fragmentation at every timestep \
                  and writes metric tables and reports.",
    after_help = EXIT_CODES
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log more to stderr (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate a realistic synthetic trace from a simulated best-fit allocator.
    Synth(SynthArgs),
    /// Replay traces and compute fragmentation metrics, reports and summaries.
    Analyze(AnalyzeArgs),
    /// Convert a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot), a PyTorch-profiler trace (profile_memory=True) or an Nsight Systems export (SQLite, or a parquetdir folder) into a trace.
    Import(ImportArgs),
    /// Compare two traces or snapshots: did memory get better or worse from A to B?
    #[command(
        after_help = "Example (CI): fragscope compare main.pickle branch.pickle -o cmp \\\n    --fail-if-worse p95_score:5 --fail-if-worse peak_live:10%\n\nMetrics: peak_live, peak_reserved, allocs, alloc_rate, mean_score, p95_score, max_score, final_score, ext_frag_at_peak, ooms, leaked, oom_risk, risk (the fragmentation level).\n\nExit codes: 0 success, 1 error, 2 usage error, 3 a --fail-if-worse gate tripped."
    )]
    Compare(CompareArgs),
    /// Replay a PyTorch snapshot's requests through a model of its caching allocator: how faithful the model is, and what other PYTORCH_CUDA_ALLOC_CONF settings would have done.
    #[command(
        after_help = "Examples:\n  fragscope whatif snapshot.pickle -o whatif\n  fragscope whatif snapshot.pickle -o whatif --capacity 80GiB \\\n    --conf max_split_size_mb:128 --conf roundup_power2_divisions:4"
    )]
    Whatif(WhatifArgs),
    /// Write a trace in another tool's format: PyTorch's memory_viz, a Perfetto protobuf trace, Chrome trace JSON, speedscope.
    #[command(
        after_help = "Examples:\n  fragscope export trace --format memory-viz -o trace.pickle   (open at pytorch.org/memory_viz)\n  fragscope export snapshot.pickle --format memory-viz --time-window 2..5 -o slice.pickle\n  fragscope export trace --format perfetto -o trace.pftrace   (ui.perfetto.dev, trace_processor)\n  fragscope export trace --format chrome -o trace.json   (chrome://tracing or ui.perfetto.dev)\n  fragscope export snapshot.pickle --format speedscope -o stacks.speedscope.json"
    )]
    Export(ExportArgs),
    /// Rebuild summary.csv, summary.md, index.html and the groups of a batch from the summary parts under OUT (after `analyze --shard`).
    #[command(
        after_help = "Example (two machines, then one):\n  fragscope analyze runs/ -o out --shard 0/2\n  fragscope analyze runs/ -o out --shard 1/2\n  fragscope summarize out\n\nExit status: 0, also when the shards' rows list failed traces (each shard exited 1 for them); 1 on errors."
    )]
    Summarize(SummarizeArgs),
    /// Record CUDA allocations, frees, copies and kernel launches of a program with eBPF (needs root).
    #[command(
        after_help = "Examples (sudo resets PATH, so name the binaries whole):\n  sudo \"$(command -v fragscope)\" record -o trace -- \"$(command -v python)\" train.py\n  sudo \"$(command -v fragscope)\" record -o trace --pid 4242\n  sudo \"$(command -v fragscope)\" record -o trace --lib ./app -- ./app   (runtime linked into the executable)\n\nExit status: the command's, when it ran to its end; 0 when stopped by Ctrl-C, SIGTERM, --duration or the end of --pid; 1 on errors."
    )]
    Record(RecordArgs),
    /// A fleet's problem classes: learn them once from many traces (`fit`), then give every new
    /// trace its class (`analyze --classes`).
    #[command(subcommand)]
    Classes(ClassesCommand),
}

#[derive(Debug, Subcommand)]
pub enum ClassesCommand {
    /// Learn the classes and the classifier from traces, batch outputs or summary datasets.
    #[command(
        after_help = "Examples:\n  fragscope classes fit runs/ -o fleet.classes\n  fragscope classes fit out/summary.parquet s3://bucket/ci/summary.parquet -o fleet.classes\n  fragscope classes fit --from fleet.classes runs-today/ -o fleet.classes\n  fragscope analyze new-run.pickle --classes fleet.classes -o report"
    )]
    Fit(ClassesFitArgs),
    /// Print a model's classes, their directions and its classifiers' accuracy.
    Show {
        /// The model file.
        model: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct ClassesFitArgs {
    /// Trace directories, snapshots or anything `analyze` reads (one sample per process), a
    /// batch's output folder or a summary dataset (`summary.parquet`, local or an object-store
    /// URL; one sample per trace).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The model file to write.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Your own labels: a CSV of `trace,class` rows. They take precedence over the groups found.
    #[arg(long, value_name = "CSV")]
    pub labels: Option<PathBuf>,
    /// An earlier model: its class names are kept wherever a new class matches an old one.
    #[arg(long, value_name = "MODEL")]
    pub from: Option<PathBuf>,
    /// Seed of the grouping and the network's training.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Traces analysed in parallel (default: number of cores).
    #[arg(short, long)]
    pub jobs: Option<usize>,
}

#[derive(Debug, Args)]
pub struct SummarizeArgs {
    /// The output root of the sharded `analyze` runs (a folder or an object-store URL).
    pub output: PathBuf,
    /// Seed of the k-means grouping (8 traces or more).
    #[arg(long, default_value_t = 1)]
    pub cluster_seed: u64,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).multiple(true).args(["command", "pid", "all"])))]
pub struct RecordArgs {
    /// Output trace directory (must not hold a trace already).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Probe this library or executable (repeatable). Default: every libcudart, libcuda and
    /// libc10_cuda.so found in $CUDA_HOME, $CUDA_PATH, $LD_LIBRARY_PATH, /usr/local/cuda*, the
    /// linker cache and Python's site-packages (nvidia/*/lib, torch/lib), plus those mapped by
    /// --pid. Giving --lib replaces that search: name every library to probe.
    #[arg(long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,
    /// Trace every process that calls the probed libraries, not just the command or --pid.
    #[arg(long)]
    pub all: bool,
    /// Attach to a running process (and the children it forks from now on).
    #[arg(long, conflicts_with = "command")]
    pub pid: Option<u32>,
    /// Stop after this long (e.g. 30s, 5m).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<std::time::Duration>,
    /// Do not probe cudaLaunchKernel.
    #[arg(long)]
    pub no_launch: bool,
    /// Do not probe cudaMemcpy/cudaMemcpyAsync.
    #[arg(long)]
    pub no_memcpy: bool,
    /// Do not probe PyTorch's caching allocator (libc10_cuda.so): record its segments only,
    /// not each tensor's block.
    #[arg(long)]
    pub no_torch: bool,
    /// Also record each call's user-space call stack (frame pointers, up to 64 frames);
    /// `analyze` names the frames and reports the stacks that allocate most.
    #[arg(long)]
    pub stacks: bool,
    /// Start a new Parquet part after this many events.
    #[arg(long, default_value_t = 65536, value_name = "N")]
    pub part_events: usize,
    /// Start a new Parquet part after this long, so a crash loses at most this much.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration, value_name = "D")]
    pub part_interval: std::time::Duration,
    /// Size of the BPF ring buffer, 64KiB to 1GiB (rounded up to a power of two).
    #[arg(long, default_value = "64MiB", value_parser = parse_buffer_size, value_name = "SIZE")]
    pub buffer_size: u64,
    /// The program to run and record, with its arguments.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<std::ffi::OsString>,
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s).map_err(|e| e.to_string())
}

/// `--buffer-size`: a size the kernel's ring buffer can have, 64 KiB to
/// 1 GiB (rounded up to a power of two by the recorder); outside that, a
/// usage error rather than a buffer other than the one asked for.
fn parse_buffer_size(s: &str) -> Result<u64, String> {
    let n = parse_size_arg(s)?;
    if !(1 << 16..=1 << 30).contains(&n) {
        return Err(format!("{s} is outside 64KiB to 1GiB"));
    }
    Ok(n)
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The baseline: a trace directory, or any file `analyze` reads (a PyTorch snapshot pickle, a
    /// profiler trace, an Nsight export; each also gzip- or zstd-compressed).
    pub a: PathBuf,
    /// The candidate, compared against A.
    pub b: PathBuf,
    /// Output directory (compare.md, compare.json, compare.png).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Exit 3 when B is worse than A on METRIC by more than DELTA (absolute, in the
    /// metric's unit — sizes accept 512MiB — or relative to A with %). Repeatable.
    #[arg(long = "fail-if-worse", value_name = "METRIC:DELTA")]
    pub fail_if_worse: Vec<crate::output::compare::Gate>,
    /// Timestep, as for analyze.
    #[arg(long, default_value = "auto")]
    pub step: StepSpec,
    /// PyTorch snapshots: compare only this CUDA device.
    #[arg(long)]
    pub device: Option<u32>,
    /// compare.png size in pixels, WIDTHxHEIGHT.
    #[arg(long, default_value = "2000x1200", value_parser = parse_size_px)]
    pub size: (u32, u32),
}

#[derive(Debug, Args)]
pub struct WhatifArgs {
    /// A PyTorch memory snapshot pickle (also gzip- or zstd-compressed, or a trace imported from
    /// one), or a device-level trace (an eBPF recording, a synthetic trace): its allocations are
    /// replayed as the allocator's requests.
    pub input: PathBuf,
    /// Output directory (whatif.json, whatif.md, whatif.png, scenarios/NAME/ trace directories).
    #[arg(short, long)]
    pub output: PathBuf,
    /// A scenario: PYTORCH_CUDA_ALLOC_CONF entries on top of the recorded settings, comma-separated; KEY:default leaves a recorded entry out (PyTorch's default)
    /// (max_split_size_mb:128,roundup_power2_divisions:4). Repeatable; without it a default sweep runs.
    #[arg(long = "conf", value_name = "KEY:VALUE[,KEY:VALUE]")]
    pub conf: Vec<String>,
    /// Device memory capacity: the budget PyTorch's allocator may reserve (CUDA's free memory at
    /// start plus its own reserve, or per_process_memory_fraction × the device's total); a
    /// scenario whose reserved memory would exceed it runs out of memory.
    /// Without it the capacity is inferred from an OOM entry or cache flushes (a device-level
    /// trace: its own); where none is known nothing runs out, and only peaks are compared.
    /// Binary units: 80GiB, and 80GB or 80G read as 80GiB; a bare number is bytes.
    #[arg(long, value_parser = parse_capacity)]
    pub capacity: Option<u64>,
    /// Only this CUDA device (default: every device of the snapshot).
    #[arg(long)]
    pub device: Option<u32>,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A trace directory, or any file `analyze` reads (a PyTorch snapshot, also gzip- or
    /// zstd-compressed).
    pub input: PathBuf,
    /// memory-viz: a PyTorch snapshot pickle (pytorch.org/memory_viz, SnapViewer); perfetto: a
    /// Perfetto protobuf trace (ui.perfetto.dev, trace_processor); chrome: Trace Event JSON
    /// (chrome://tracing, ui.perfetto.dev); speedscope: the flamegraph stacks.
    #[arg(long, value_enum)]
    pub format: crate::output::export::Format,
    /// The file to write.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Only events from A to B after the first event (A.., ..B and A..B; each a duration such as
    /// 250ms or 1.5s, or seconds); not for
    /// speedscope, which exports the stacks live at the end and at the peak of the whole trace.
    #[arg(long, value_name = "A..B")]
    pub time_window: Option<String>,
    /// Only this CUDA device of a snapshot.
    #[arg(long)]
    pub device: Option<u32>,
}

#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The snapshot pickle, a PyTorch-profiler trace (`.json`, `.json.gz`) or an Nsight Systems
    /// export (`nsys export --type sqlite`, or the folder of `--type parquetdir`); each file may
    /// also be compressed with gzip or zstd.
    pub snapshot: PathBuf,
    /// Output trace directory (must not already hold a trace).
    #[arg(short, long)]
    pub output: PathBuf,
    /// PyTorch snapshots: import only this CUDA device (default: every device).
    #[arg(long)]
    pub device: Option<u32>,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(s)
        .map_err(|e| format!("`{s}`: {e} (examples: 4096, 4KiB, 80GiB)"))
}

/// A device's memory: a size (GB and G read as GiB, as `parse_bytes`),
/// where a bare number under 1 MiB is refused: `--capacity 80` meant
/// 80 GiB, and 80 bytes would make every request an OOM.
fn parse_capacity(s: &str) -> Result<u64, String> {
    let v = parse_bytes(s)?;
    if v < 1 << 20 && s.trim().chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("`{s}` bytes is no GPU's memory: give a unit (80GiB, 81920MiB)"));
    }
    Ok(v)
}

/// A count: 20000, 100k, 10M, 1B (a billion: a count's B is not a
/// byte, and `1B` once wrote a trace of one event).
fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let billions =
        t.strip_suffix(['B', 'b']).filter(|n| n.trim_end().ends_with(|c: char| c.is_ascii_digit() || c == '.'));
    let t = billions.map_or_else(|| t.to_string(), |n| format!("{}G", n.trim_end()));
    parse_size::Config::new()
        .with_decimal()
        .parse_size(&t)
        .map_err(|e| format!("`{s}`: {e} (examples: 20000, 100k, 10M, 1B)"))
}

#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Workload to simulate.
    #[arg(long, value_enum)]
    pub pattern: Pattern,
    /// Number of events to write (accepts 100k, 10M, 1B).
    #[arg(long, value_parser = parse_count, default_value = "100k")]
    pub events: u64,
    /// Random seed; the same seed gives the same trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Device memory of each simulated GPU.
    #[arg(long, value_parser = parse_capacity, default_value = "80GiB")]
    pub capacity: u64,
    /// Rows per Parquet part file.
    #[arg(long, value_parser = parse_count, default_value = "1M")]
    pub rows_per_part: u64,
    /// Output trace directory (must not already hold a trace).
    #[arg(short, long)]
    pub output: PathBuf,
}

#[derive(Debug, Args)]
pub struct AnalyzeArgs {
    /// Trace directories, PyTorch snapshot pickles, PyTorch-profiler traces (.json, .json.gz), Nsight
    /// Systems exports (.sqlite, parquetdir folders), each file also compressed with gzip or zstd,
    /// directories of them, or object-store URLs.
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// PyTorch snapshots (pickles or imported traces): analyse only this CUDA
    /// device (default: every device, each as its own series).
    #[arg(long)]
    pub device: Option<u32>,
    /// Output directory (one trace: its files; several: one folder each plus summaries).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Timestep: `auto` (about 1000 equal-duration steps), a duration (10ms) or an event count (5000ev).
    #[arg(long, default_value = "auto")]
    pub step: StepSpec,
    /// Traces analysed in parallel (default: number of cores).
    #[arg(short, long)]
    pub jobs: Option<usize>,
    /// Seed of the k-means grouping of a batch (8 traces or more).
    #[arg(long, default_value_t = 1)]
    pub cluster_seed: u64,
    /// Analyse only shard I of N (0 ≤ I < N): the traces whose stable hash
    /// of their path relative to the input root falls in it. Writes the
    /// per-trace folders and summary parts; run `fragscope summarize OUT`
    /// once every shard is done.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<crate::output::summary::Shard>,
    /// Page size P of the unusable-free-space index (power of two).
    #[arg(long, value_parser = parse_bytes, default_value = "4KiB")]
    pub page_size: u64,
    /// Blocks up to this size count as small allocations.
    #[arg(long, value_parser = parse_bytes, default_value = "4MiB")]
    pub small_threshold: u64,
    /// Free ranges up to this size are alignment slack, not gaps.
    #[arg(long, value_parser = parse_bytes, default_value = "1KiB")]
    pub min_gap: u64,
    /// Recompute every metric from the full live set at each row (the
    /// reference implementation's method; slow, for verification).
    #[arg(long)]
    pub brute_force: bool,
    /// Device memory capacity for the OOM diagnosis and the OOM risk (e.g. 80GiB): the budget
    /// PyTorch's allocator may reserve (CUDA's free memory at start plus its own reserve, or
    /// per_process_memory_fraction × the device's total); default: the
    /// trace's own (`record` writes NVML's, `synth` its own; else inferred from an `oom` entry or
    /// from PyTorch's cache flushes), else unknown. Binary units: 80GiB, and 80GB or 80G read
    /// as 80GiB; a bare number is bytes.
    #[arg(long, value_parser = parse_capacity)]
    pub capacity: Option<u64>,
    /// Do not replay the requests through the allocator model (PyTorch snapshots, and
    /// device-level traces with OOMs: the "What the allocator settings would change" section).
    #[arg(long)]
    pub no_whatif: bool,
    /// A what-if scenario, as `fragscope whatif --conf` takes it: PYTORCH_CUDA_ALLOC_CONF entries on
    /// top of the recorded settings, comma-separated (expandable_segments:True,
    /// max_split_size_mb:128; KEY:default leaves a recorded entry out;
    /// per_process_memory_fraction:F stands for torch.cuda.set_per_process_memory_fraction(F), F in
    /// (0, 1], a budget of F × --capacity). Repeatable; without it the default sweep runs.
    #[arg(long = "conf", value_name = "KEY:VALUE[,KEY:VALUE]")]
    pub conf: Vec<String>,
    /// A PyTorch memory snapshot of the same run as the (one) recording: one view of both,
    /// PyTorch's blocks in its segments and every device allocation PyTorch did not make.
    #[arg(long, value_name = "SNAPSHOT")]
    pub snapshot: Option<PathBuf>,
    /// A fleet's class model (`fragscope classes fit`): every trace and process gets a class, in
    /// report.json, the report's first screen and the batch summary.
    #[arg(long, value_name = "MODEL")]
    pub classes: Option<PathBuf>,
    #[command(flatten)]
    pub predict: PredictArgs,
    #[command(flatten)]
    pub gates: GateArgs,
    #[command(flatten)]
    pub plots: PlotArgs,
}

/// Pictures: mdtp.png and timeline.png.
#[derive(Debug, Args)]
#[command(next_help_heading = "Plots")]
pub struct PlotArgs {
    /// Do not draw mdtp.png, timeline.png, floors.png or the explorable view (view/); implies
    /// --no-view.
    #[arg(long)]
    pub no_plots: bool,
    /// Image size in pixels, WIDTHxHEIGHT.
    #[arg(long, default_value = "1600x900", value_parser = parse_size_px)]
    pub size: (u32, u32),
    /// Time window of the MDTP after the trace's first event: A..B, A.. or ..B, each a duration
    /// (250ms, 1.5s) or seconds (0.25), as export's.
    #[arg(long, value_parser = parse_time_window)]
    pub time_window: Option<(u64, u64)>,
    /// Address window of the MDTP, in collapsed offset (e.g. 0..4GiB).
    #[arg(long, value_parser = parse_addr_window)]
    pub addr_window: Option<(u64, u64)>,
    /// Draw only this process.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Draw at most N process panels in the MDTP: those with the highest
    /// peak live bytes (every process stays in metrics.parquet and
    /// report.json; the figure and report.md say how many were left out).
    #[arg(long, value_name = "N", default_value_t = crate::output::plot::MAX_PANELS, value_parser = parse_panels)]
    pub max_panels: usize,
    /// Do not write the explorable view (view/ beside report.html: the MDTP
    /// to zoom into and point at, with each block's call site).
    #[arg(long)]
    pub no_view: bool,
}

fn parse_tolerance(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if (0.0..1.0).contains(&t) => Ok(t),
        _ => Err(format!("`{s}` is not a share of the loss: give a number from 0 up to (not including) 1")),
    }
}

fn parse_panels(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=10_000).contains(&n) => Ok(n),
        _ => Err(format!("`{s}`: expected a number of panels from 1 to 10000")),
    }
}

fn parse_size_px(s: &str) -> Result<(u32, u32), String> {
    let (w, h) = s.split_once(['x', 'X']).ok_or_else(|| format!("`{s}`: expected WIDTHxHEIGHT, e.g. 1600x900"))?;
    match (w.trim().parse::<u32>(), h.trim().parse::<u32>()) {
        (Ok(w), Ok(h)) if crate::output::plot::check_size(w, h).is_ok() => Ok((w, h)),
        _ => Err(format!(
            "`{s}`: expected WIDTHxHEIGHT between {}x{} and 20000x20000",
            crate::output::plot::MIN_SIZE.0,
            crate::output::plot::MIN_SIZE.1
        )),
    }
}

fn parse_window<F: Fn(&str) -> Result<u64, String>>(s: &str, one: F) -> Result<(u64, u64), String> {
    let (a, b) = s.split_once("..").ok_or_else(|| format!("`{s}`: expected START..END"))?;
    let (a, b) = (one(a.trim())?, one(b.trim())?);
    if b <= a {
        return Err(format!("`{s}`: the end must be after the start"));
    }
    Ok((a, b))
}

/// `A..B` after the first event (an open end: the trace's start or end,
/// `u64::MAX`).
fn parse_time_window(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = crate::units::time_window(s)?;
    Ok((a.unwrap_or(0), b.unwrap_or(u64::MAX)))
}

fn parse_addr_window(s: &str) -> Result<(u64, u64), String> {
    parse_window(s, parse_bytes)
}

/// Predictor settings (SPEC §6).
#[derive(Debug, Args)]
#[command(next_help_heading = "Predictor")]
pub struct PredictArgs {
    /// Window W: steps of history the model sees.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub window: u64,
    /// Horizon H: steps forecast.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub horizon: u64,
    /// Gradient-descent learning rate.
    #[arg(long, default_value_t = 0.01)]
    pub learning_rate: f64,
    /// Steps over which the trend (score slope) is fitted.
    #[arg(long, default_value_t = 20)]
    pub trend_window: usize,
    /// Early stopping: a fall of the held-out loss smaller than this share of it does not
    /// count as a fall (0: every fall does).
    #[arg(long, default_value_t = 1e-3, value_parser = parse_tolerance)]
    pub tolerance: f64,
    /// Cross-validation origins (one per equal stretch of the series).
    #[arg(long, default_value_t = 50)]
    pub cv_origins: usize,
    /// The online backtest's model is never more than this many steps old; a cross-validation
    /// origin's training counts (at most 200 retrainings a series: longer series retrain less
    /// often).
    #[arg(long, default_value_t = 20)]
    pub retrain_every: usize,
    /// Warn of deterioration when a forecast exceeds the current score by this much...
    #[arg(long, default_value_t = 5.0)]
    pub deterioration: f64,
    /// ...and the confidence exceeds this.
    #[arg(long, default_value_t = 0.6)]
    pub min_confidence: f64,
    /// Warn when two consecutive forecasts jump by more than this.
    #[arg(long, default_value_t = 10.0)]
    pub sharp_jump: f64,
    /// Warn of a clear trend when |slope| exceeds this (points per step).
    #[arg(long, default_value_t = 0.3)]
    pub clear_trend: f64,
}

/// CI gates: exit code 3 when tripped.
#[derive(Debug, Args)]
#[command(next_help_heading = "CI gates (exit code 3)")]
pub struct GateArgs {
    /// Fail when any trace's OOM risk (the headline: low, medium, high,
    /// critical, oom) is at or above this level. A trace whose capacity is
    /// unknown has OOM risk `unknown` and trips only at `oom`.
    #[arg(long, value_parser = parse_oom_risk)]
    pub fail_on: Option<crate::analysis::risk::OomRisk>,
    /// Fail when any trace's fragmentation level (minimal, low, medium,
    /// high, critical: the score's level at the timestep where reserved
    /// memory peaked, not the forecast from the run's end) is at or above
    /// this.
    #[arg(long, value_enum)]
    pub fail_on_fragmentation: Option<Risk>,
    /// Fail when any trace's leak verdict is "leaking" (the floors of
    /// complete iterations rose beyond their fluctuation across at least 3
    /// consecutive iterations, by more than twice it in all, and did not
    /// then hold; a trace without iterations is never "leaking").
    #[arg(long)]
    pub fail_on_leak: bool,
    /// Fail when any trace's final score exceeds this.
    #[arg(long)]
    pub max_score: Option<f64>,
    /// Fail when any trace needs more than this to fit (e.g. 40GiB): the smallest budget for
    /// PyTorch's allocator under which its recorded requests raise no OOM, replayed under its
    /// settings (the first screen's "needs"; the most any one device needs). A trace with no
    /// replay (no allocator requests) does not trip it.
    #[arg(long, value_parser = parse_capacity, value_name = "BYTES")]
    pub fail_if_needs_more_than: Option<u64>,
}

/// Runs a parsed command line; returns the exit code.
pub fn run(cli: Cli) -> Result<u8> {
    use crate::exit;
    match cli.command {
        Command::Synth(args) => {
            let cfg = crate::synth::SynthConfig {
                pattern: args.pattern,
                events: args.events,
                seed: args.seed,
                capacity: args.capacity,
                rows_per_part: args.rows_per_part.clamp(1, usize::MAX as u64) as usize,
            };
            crate::synth::run(&cfg, &args.output)?;
            Ok(exit::OK)
        }
        Command::Analyze(args) => {
            // A bad scenario is a usage error before the (long) read.
            let opts = args.options();
            if let Err(e) = crate::analysis::whatif::settings_of(&crate::allocator::Settings::default(), &opts.confs) {
                eprintln!("error: --conf {e}");
                return Ok(exit::USAGE);
            }
            let mut batch = args.batch_options();
            if let Some(path) = &args.classes {
                batch.analysis.classes = Some(std::sync::Arc::new(crate::analysis::classes::Model::load(path)?));
            }
            crate::batch::run(&batch)
        }
        Command::Summarize(args) => crate::batch::summarize(&args.output, args.cluster_seed),
        Command::Import(args) => {
            crate::input::import(&args.snapshot, &args.output, args.device)?;
            Ok(exit::OK)
        }
        Command::Whatif(args) => crate::whatif::run(&crate::whatif::Options {
            input: args.input,
            output: args.output,
            conf: args.conf,
            capacity: args.capacity,
            device: args.device,
        }),
        Command::Export(args) => crate::output::export::run(&crate::output::export::Options {
            input: args.input,
            format: args.format,
            output: args.output,
            time_window: args.time_window,
            device: args.device,
        }),
        Command::Record(args) => run_record(&args),
        Command::Classes(ClassesCommand::Fit(args)) => crate::classes::fit(&crate::classes::FitArgs {
            inputs: args.inputs,
            output: args.output,
            labels: args.labels,
            from: args.from,
            seed: args.seed,
            jobs: args.jobs,
        }),
        Command::Classes(ClassesCommand::Show { model }) => crate::classes::show(&model),
        Command::Compare(args) => {
            // The what-if runs for the memory needed, which the verdict weighs.
            let opts =
                crate::analysis::Options { step: args.step, device: args.device, whatif: true, ..Default::default() };
            let tripped =
                crate::output::compare::run(&args.a, &args.b, &args.output, &opts, args.size, &args.fail_if_worse)?;
            Ok(if tripped { exit::GATE } else { exit::OK })
        }
    }
}

#[cfg(feature = "record")]
fn run_record(args: &RecordArgs) -> Result<u8> {
    crate::record::run(&crate::record::Options {
        output: args.output.clone(),
        libs: args.libs.clone(),
        all: args.all,
        pid: args.pid,
        command: args.command.clone(),
        duration: args.duration,
        launch: !args.no_launch,
        memcpy: !args.no_memcpy,
        stacks: args.stacks,
        torch: !args.no_torch,
        part_events: args.part_events,
        part_interval: args.part_interval,
        buffer_bytes: args.buffer_size,
    })
}

#[cfg(not(feature = "record"))]
fn run_record(_: &RecordArgs) -> Result<u8> {
    anyhow::bail!("this fragscope was built without the recorder (the `record` feature); rebuild with default features")
}

impl AnalyzeArgs {
    /// The options of `analyze` (one trace or a batch).
    pub fn batch_options(&self) -> crate::batch::Options {
        crate::batch::Options {
            traces: self.traces.clone(),
            output: self.output.clone(),
            analysis: self.options(),
            plot: self.plot_config(),
            jobs: self.jobs,
            cluster_seed: self.cluster_seed,
            shard: self.shard,
            gates: crate::batch::Gates {
                fail_on: self.gates.fail_on,
                fail_on_fragmentation: self.gates.fail_on_fragmentation,
                fail_on_leak: self.gates.fail_on_leak,
                max_score: self.gates.max_score,
                fail_if_needs_more_than: self.gates.fail_if_needs_more_than,
            },
            snapshot: self.snapshot.clone(),
        }
    }

    /// The analysis options these arguments ask for.
    pub fn options(&self) -> crate::analysis::Options {
        let p = &self.predict;
        crate::analysis::Options {
            metrics: crate::analysis::metrics::MetricsConfig {
                page_size: self.page_size,
                small_threshold: self.small_threshold,
                min_gap: self.min_gap,
            },
            step: self.step,
            brute_force: self.brute_force,
            capacity: self.capacity,
            predict: crate::analysis::predict::PredictConfig {
                window: p.window as usize,
                horizon: p.horizon as usize,
                learning_rate: p.learning_rate,
                trend_window: p.trend_window,
                cv_origins: p.cv_origins,
                retrain_every: p.retrain_every,
                tolerance: p.tolerance,
                deterioration: p.deterioration,
                min_confidence: p.min_confidence,
                sharp_jump: p.sharp_jump,
                clear_trend: p.clear_trend,
                ..crate::analysis::predict::PredictConfig::default()
            },
            layout: !self.plots.no_plots,
            whatif: !self.no_whatif,
            classes: None,
            device: self.device,
            confs: self
                .conf
                .iter()
                .map(|c| crate::import::settings::split_conf(c).map(str::to_string).collect())
                .collect(),
        }
    }

    /// The pictures to draw (None: `--no-plots`).
    pub fn plot_config(&self) -> Option<crate::output::plot::PlotConfig> {
        (!self.plots.no_plots).then_some(crate::output::plot::PlotConfig {
            width: self.plots.size.0,
            height: self.plots.size.1,
            time_window: self.plots.time_window,
            addr_window: self.plots.addr_window,
            pid: self.plots.pid,
            normalised_time: false,
            max_panels: self.plots.max_panels,
            view: !self.plots.no_view,
        })
    }
}

/// An OOM risk level for `--fail-on`.
fn parse_oom_risk(s: &str) -> Result<crate::analysis::risk::OomRisk, String> {
    use crate::analysis::risk::OomRisk;
    match OomRisk::from_name(&s.to_ascii_lowercase()) {
        Some(OomRisk::Unknown) | None => Err(format!("`{s}`: expected one of low, medium, high, critical, oom")),
        Some(r) => Ok(r),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_count;

    #[test]
    fn counts_read_k_m_and_b_as_thousands_millions_and_billions() {
        for (s, n) in [("20000", 20_000), ("100k", 100_000), ("10M", 10_000_000), ("1B", 1_000_000_000)] {
            assert_eq!(parse_count(s), Ok(n), "{s}");
        }
        assert_eq!(parse_count("2 b"), Ok(2_000_000_000));
        assert_eq!(parse_count("1.5B"), Ok(1_500_000_000));
        assert_eq!(parse_count("10MB"), Ok(10_000_000), "a unit before the B keeps its meaning");
        assert_eq!(parse_count("1G"), Ok(1_000_000_000));
        assert!(parse_count("B").is_err());
        assert!(parse_count("ten").unwrap_err().contains("1B"));
    }
}
