//! The input stage, the one way in: what a path named on the command line
//! is (a trace directory, a PyTorch snapshot, a PyTorch-profiler trace or
//! an Nsight Systems export), decided here once per path and nowhere else,
//! and loading it into a [`Trace`] and its time-sorted [`Events`]
//! ([`Loaded`]), converting it in memory where it is another tool's file.
//! `fragscope import` converts one into a trace directory ([`import`]).
//!
//! It sits above [`crate::trace`] and [`crate::import`]: neither knows it,
//! and every command that reads a trace (analyze, compare, export, whatif)
//! comes through here. A new input format plugs in here.

mod allocator;
mod compressed;
mod describe;
mod join;
mod loaded;
mod memory;
mod units;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

pub(crate) use allocator::recorded_settings;
pub use compressed::strip_suffix as strip_compression_suffix;
pub use describe::{Described, describe};
pub use join::{OUTSIDE, is_outside, outside_stacks};
pub use loaded::Loaded;

use crate::trace::Trace;
use crate::trace::details::Details;
use crate::trace::event::Events;

/// What an input path holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// A trace directory (`events-NNNNN.parquet` parts or `trace.json`).
    Trace,
    /// A PyTorch memory snapshot pickle, imported in memory.
    Snapshot,
    /// A PyTorch-profiler trace (`.json`, `.json.gz`), imported in memory.
    Profiler,
    /// An Nsight Systems export (SQLite, or a `parquetdir` folder),
    /// imported in memory.
    Nsys,
}

/// What `path` is, or None when it is neither input ([`describe`]).
pub fn classify(path: &Path) -> Option<Input> {
    describe(path).kind
}

/// Loads a trace directory, or imports a snapshot pickle in memory
/// (`device` selects one of its devices).
pub fn open(dir: &Path, device: Option<u32>) -> Result<Loaded> {
    load(&describe(dir), device)
}

/// [`open`] for a path already described (by [`discover`]).
pub fn load(d: &Described, device: Option<u32>) -> Result<Loaded> {
    let (dir, kind) = (d.path.as_path(), d.kind);
    let start = std::time::Instant::now();
    if let Some(Input::Snapshot | Input::Profiler | Input::Nsys) = kind {
        // What the loaded trace says of its file, read before the
        // conversion: the conversion is the last use of the path.
        let shell = Shell {
            dir: dir.to_path_buf(),
            name: dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned()),
            modified: d.modified,
        };
        let readable = compressed::readable(d)?;
        let Some(origin) = &readable.origin else { return convert(dir, d, device, shell, start) };
        let mut loaded = convert(&readable.path, d, device, shell, start)
            .with_context(|| format!("{}, decompressed", dir.display()))?;
        if let Some(meta) = &mut loaded.trace.meta {
            meta.details.name_compressed_source(origin);
        }
        return Ok(loaded);
    }
    if kind.is_none() && (d.is_file || d.irregular) {
        return Err(no_input(d));
    }
    let mut trace = Trace::open(dir)?;
    match &trace.meta {
        Some(m) if m.lost_events > 0 => tracing::warn!(
            "{}: the recorder lost {} events (its ring buffer was full); figures may be off",
            dir.display(),
            m.lost_events
        ),
        None => tracing::warn!(
            "{}: no trace.json (an interrupted recording?); analysing the {} complete parts",
            dir.display(),
            trace.parts.len()
        ),
        _ => {}
    }
    // Said before the minutes of loading, not after the kernel kills it.
    if let Some(w) = memory::warning(trace.rows, memory::bytes_per_event(&trace), memory::available()) {
        tracing::warn!("{}: {w}", dir.display());
    }
    let (mut events, out_of_order) = trace.load_events()?;
    units::split(&mut trace, &mut events);
    if let Some(d) = device {
        // An imported snapshot: one series per device, in the pid column.
        if trace.source() != Some(crate::trace::Source::PytorchSnapshot) {
            bail!("{}: --device selects a device of a PyTorch snapshot; this trace is not one", dir.display());
        }
        if !events.pid.iter().any(|p| p == d) {
            bail!("{}: device {d} is not in this imported snapshot", dir.display());
        }
        events.retain(|e, i| e.pid[i] == d);
    }
    tracing::info!("{}: loaded {} events in {:.3} s", trace.name, events.len(), start.elapsed().as_secs_f64());
    Ok(Loaded { trace, events, out_of_order })
}

/// The error for a file that is none of the inputs, or cannot be read.
fn no_input(d: &Described) -> anyhow::Error {
    let path = d.path.as_path();
    // Opening a FIFO would wait for a writer.
    if d.irregular {
        return anyhow::anyhow!(
            "{} is not a regular file (a pipe, socket or device): fragscope reads a file or a directory, and \
             reads some files twice; save the stream to a file first",
            path.display()
        );
    }
    if let Err(e) = std::fs::File::open(path) {
        return anyhow::anyhow!("cannot read {}: {e}", path.display());
    }
    anyhow::anyhow!(
        "{} is not a trace directory (expected a directory of events-NNNNN.parquet parts), and its \
         content is none of the files fragscope imports: a PyTorch memory snapshot (a pickle of protocol 2 to 5, \
         starting with the PROTO opcode 0x80), a PyTorch-profiler JSON trace or an Nsight Systems SQLite export, \
         each also compressed with gzip or zstd{}",
        path.display(),
        compressed::not_an_input(d).unwrap_or_default()
    )
}

/// One view of a run recorded both ways ([`join`](join::join)): a
/// recording without PyTorch's blocks, and its snapshot.
pub fn join(recording: Loaded, snapshot: Loaded) -> Result<Loaded> {
    if allocator::has_blocks(&recording) {
        bail!(
            "{}: this recording already holds PyTorch's blocks (the probes on its allocator): analyse it alone, or \
             record with --no-torch to join it with a snapshot",
            recording.trace.dir.display()
        );
    }
    join::join(recording, snapshot)
}

/// A recording that holds PyTorch's blocks (the probes on its allocator)
/// put in the allocator view ([`allocator`]); any other input as it is.
/// What `analyze`, `whatif` and `compare` run on.
pub fn allocator_view(loaded: Loaded) -> Result<Loaded> {
    allocator::view(loaded)
}

/// Converts another tool's file in memory: `dir`, which is `d`'s path or
/// its decompressed copy.
fn convert(dir: &Path, d: &Described, device: Option<u32>, shell: Shell, start: std::time::Instant) -> Result<Loaded> {
    let kind = d.kind;
    if kind == Some(Input::Snapshot) {
        let mut events = Events::default();
        let converted = crate::import::snapshot::convert_file(dir, device, &mut |e| {
            events.push(&e);
            Ok(())
        })?;
        let stacks = Some(std::sync::Arc::new(converted.stacks));
        return Ok(imported(shell, converted.meta, stacks, events, start));
    }
    if let Some(kind @ (Input::Profiler | Input::Nsys)) = kind {
        if device.is_some() {
            bail!("{}: --device selects a device of a PyTorch snapshot; this input is not one", dir.display());
        }
        let mut events = Events::default();
        let mut sink = |e: crate::trace::event::Event| {
            events.push(&e);
            Ok(())
        };
        let meta = if kind == Input::Profiler {
            crate::import::profiler::convert_file(dir, d.codec, d.size, &mut sink)?.meta
        } else {
            crate::import::nsys::convert_file(dir, &mut sink)?.meta
        };
        return Ok(imported(shell, meta, None, events, start));
    }
    bail!("{}: not a file fragscope converts", dir.display())
}

/// What a converted trace says of the file it came from.
struct Shell {
    dir: PathBuf,
    name: String,
    modified: Option<std::time::SystemTime>,
}

/// A file imported in memory as a trace: its events sorted by time. The
/// PyTorch columns are there when the importer kept stacks (snapshots).
fn imported(
    shell: Shell,
    meta: crate::trace::TraceMeta,
    stacks: Option<std::sync::Arc<crate::trace::Stacks>>,
    mut events: Events,
    start: std::time::Instant,
) -> Loaded {
    let out_of_order = events.sort_by_time();
    let trace = Trace {
        dir: shell.dir,
        name: shell.name,
        meta: Some(meta),
        parts: Vec::new(),
        skipped: Vec::new(),
        pytorch_columns: stacks.is_some(),
        ustack_ids: false,
        device_column: false,
        units: Default::default(),
        modified: shell.modified,
        stacks,
        rows: 0,
    };
    tracing::info!("{}: imported {} events in {:.3} s", trace.name, events.len(), start.elapsed().as_secs_f64());
    Loaded { trace, events, out_of_order }
}

/// An input found by [`discover`]: its path, its path relative to the
/// input root (the name inside a directory of traces; its own name when
/// named directly), which `--shard` hashes, and what it is.
#[derive(Clone, Debug)]
pub struct Found {
    pub path: PathBuf,
    pub rel: String,
    /// What it is, described once.
    pub desc: Described,
}

/// The traces named on the command line: trace directories, or
/// directories of trace directories, each classified once. `batch` is true
/// when the output should be one folder per trace plus a summary.
pub fn discover(paths: &[PathBuf]) -> Result<(Vec<Found>, bool)> {
    let mut found = Vec::new();
    let mut batch = paths.len() > 1;
    for p in paths {
        let desc = describe(p);
        if desc.is_dir && desc.kind.is_none() {
            let mut subs: Vec<(PathBuf, Described)> = std::fs::read_dir(p)
                .with_context(|| format!("cannot read {}", p.display()))?
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .map(|s| (s.clone(), describe(&s)))
                .filter(|(_, d)| d.kind.is_some())
                .collect();
            if subs.is_empty() {
                bail!(
                    "{}: neither a trace (no events-NNNNN.parquet) nor a directory of traces or snapshots",
                    p.display()
                );
            }
            subs.sort_by(|a, b| a.0.cmp(&b.0));
            found.extend(subs.into_iter().map(|(s, desc)| {
                let rel = s.strip_prefix(p).unwrap_or(&s).to_string_lossy().into_owned();
                Found { path: s, rel, desc }
            }));
            batch = true;
        } else {
            let rel = p.file_name().unwrap_or(p.as_os_str()).to_string_lossy().into_owned();
            found.push(Found { path: p.clone(), rel, desc });
        }
    }
    Ok((found, batch))
}

/// `fragscope import`: converts `path` (a snapshot pickle, a profiler
/// trace or an Nsight export) into the trace directory `output`, and says
/// what it found.
pub fn import(path: &Path, output: &Path, device: Option<u32>) -> Result<()> {
    let started = std::time::Instant::now();
    let desc = describe(path);
    let kind = desc.kind;
    if kind.is_none() && desc.is_dir {
        bail!(
            "{} is a directory: import takes one file (a PyTorch memory snapshot, a profiler trace or an Nsight \
             Systems export); a trace directory is read as it is, and analyze takes a folder of inputs",
            path.display()
        );
    }
    if kind.is_none() && (desc.is_file || desc.irregular) {
        return Err(no_input(&desc));
    }
    let readable = compressed::readable(&desc)?;
    let (from, origin) = (readable.path.as_path(), readable.origin.as_ref());
    let decompressed = |e: anyhow::Error| match origin {
        Some(_) => e.context(format!("{}, decompressed", path.display())),
        None => e,
    };
    if kind == Some(Input::Nsys) {
        anyhow::ensure!(device.is_none(), "--device selects a device of a PyTorch snapshot, not of an Nsight export");
        let c = crate::import::nsys::import(from, output, origin).map_err(decompressed)?;
        if let Details::Nsys(d) = &c.meta.details {
            println!(
                "{}: {} device-memory events of {} rows from {} (device(s) {:?}, {} from memory pools) in {:.2} s",
                output.display(),
                d.device_events,
                d.rows,
                path.display(),
                d.devices,
                d.pooled,
                started.elapsed().as_secs_f64()
            );
            if !d.skipped.is_empty() {
                println!("skipped (not device memory): {:?}", d.skipped);
            }
        }
        return Ok(());
    }
    if kind == Some(Input::Profiler) {
        anyhow::ensure!(device.is_none(), "--device selects a device of a PyTorch snapshot, not of a profiler trace");
        let c = crate::import::profiler::import(from, desc.codec, desc.size, output).map_err(decompressed)?;
        let total: u64 = c.meta.event_counts.values().sum();
        println!(
            "{}: {} events from {} in {:.2} s",
            output.display(),
            total,
            path.display(),
            started.elapsed().as_secs_f64()
        );
        if let Details::Profiler(p) = &c.meta.details {
            println!(
                "{} CUDA memory events on device(s) {:?} ({} CPU events skipped); {} ProfilerStep spans; before the first event: {} allocated, {} placed (freed later), {} never freed (no address)",
                p.cuda_memory_events,
                p.devices,
                p.cpu_events_skipped,
                p.profiler_steps,
                crate::units::bytes(p.allocated_before_trace_bytes),
                crate::units::bytes(p.reconstructed_bytes),
                crate::units::bytes(p.unplaced_before_trace_bytes),
            );
            if p.total_allocated_breaks > 0 {
                eprintln!(
                    "warning: {} events disagree with the profiler's `Total Allocated` (events lost?)",
                    p.total_allocated_breaks
                );
            }
        }
        return Ok(());
    }
    let c = crate::import::snapshot::import(from, output, device, origin).map_err(decompressed)?;
    let total: u64 = c.meta.event_counts.values().sum();
    println!(
        "{}: {} events from {} ({} device(s), {} stacks) in {:.2} s",
        output.display(),
        total,
        path.display(),
        c.reconstructions.len(),
        c.stacks.stacks.len(),
        started.elapsed().as_secs_f64()
    );
    for r in &c.reconstructions {
        let fc = &r.final_check;
        println!(
            "device {}: {} trace entries; before the first: {} segments, {} blocks; final state {}",
            r.device,
            r.entries,
            r.initial_segments,
            r.initial_blocks,
            if fc.exact() {
                format!(
                    "matches the snapshot ({} blocks, {} segment bytes)",
                    fc.blocks_expected, fc.segment_bytes_expected
                )
            } else {
                format!(
                    "DIFFERS from the snapshot: {} blocks missing, {} unexpected, {} of another size; segment bytes {} vs {}",
                    fc.blocks_missing,
                    fc.blocks_unexpected,
                    fc.blocks_size_mismatch,
                    fc.segment_bytes_replayed,
                    fc.segment_bytes_expected
                )
            }
        );
        if r.inconsistent_entries > 0 {
            eprintln!(
                "warning: device {}: {} trace entries contradict the state and were skipped",
                r.device, r.inconsistent_entries
            );
        }
    }
    Ok(())
}
