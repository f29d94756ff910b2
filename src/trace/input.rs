//! The one way in: what a path named on the command line is (a trace
//! directory, a PyTorch snapshot, a PyTorch-profiler trace or an Nsight
//! Systems export, decided here and nowhere else), and loading it into a
//! [`Trace`] and its time-sorted [`Events`]. A new input format plugs in
//! here.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::trace::Trace;
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

/// What `path` is, or None when it is neither input.
pub fn classify(path: &Path) -> Option<Input> {
    if path.is_dir() {
        if Trace::is_trace_dir(path) {
            Some(Input::Trace)
        } else {
            crate::import::nsys::looks_like_parquetdir(path).then_some(Input::Nsys)
        }
    } else if crate::import::snapshot::looks_like_pickle(path) {
        Some(Input::Snapshot)
    } else if crate::import::nsys::looks_like_sqlite(path) {
        Some(Input::Nsys)
    } else {
        crate::import::profiler::looks_like_profiler_trace(path).then_some(Input::Profiler)
    }
}

/// A loaded input: the trace, its events sorted by time (symbolised stacks
/// in `trace.stacks` where recorded), and how many rows were out of time
/// order in the files.
#[derive(Debug)]
pub struct Loaded {
    pub trace: Trace,
    pub events: Events,
    pub out_of_order: u64,
}

/// Loads a trace directory, or imports a snapshot pickle in memory
/// (`device` selects one of its devices).
pub fn open(dir: &Path, device: Option<u32>) -> Result<Loaded> {
    let start = std::time::Instant::now();
    if classify(dir) == Some(Input::Snapshot) {
        let mut events = Events::default();
        let converted = crate::import::snapshot::convert_file(dir, device, &mut |e| {
            events.push(&e);
            Ok(())
        })?;
        let stacks = Some(std::sync::Arc::new(converted.stacks));
        return Ok(imported(dir, converted.meta, stacks, events, start));
    }
    if let Some(kind @ (Input::Profiler | Input::Nsys)) = classify(dir) {
        if device.is_some() {
            bail!("{}: --device selects a device of a PyTorch snapshot; this input is not one", dir.display());
        }
        let mut events = Events::default();
        let mut sink = |e: crate::trace::event::Event| {
            events.push(&e);
            Ok(())
        };
        let meta = if kind == Input::Profiler {
            crate::import::profiler::convert_file(dir, &mut sink)?.meta
        } else {
            crate::import::nsys::convert_file(dir, &mut sink)?.meta
        };
        return Ok(imported(dir, meta, None, events, start));
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
    let (mut events, out_of_order) = trace.load_events()?;
    if let Some(d) = device {
        // An imported snapshot: one series per device, in the pid column.
        if trace.source() != Some(crate::trace::Source::PytorchSnapshot) {
            bail!("{}: --device selects a device of a PyTorch snapshot; this trace is not one", dir.display());
        }
        if !events.pid.contains(&d) {
            bail!("{}: device {d} is not in this imported snapshot", dir.display());
        }
        events.retain(|e, i| e.pid[i] == d);
    }
    tracing::info!("{}: loaded {} events in {:.3} s", trace.name, events.len(), start.elapsed().as_secs_f64());
    Ok(Loaded { trace, events, out_of_order })
}

/// A file imported in memory as a trace: its events sorted by time. The
/// PyTorch columns are there when the importer kept stacks (snapshots).
fn imported(
    path: &Path,
    meta: crate::trace::TraceMeta,
    stacks: Option<std::sync::Arc<crate::trace::Stacks>>,
    mut events: Events,
    start: std::time::Instant,
) -> Loaded {
    let out_of_order = events.sort_by_time();
    let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    let trace = Trace {
        dir: path.to_path_buf(),
        name,
        meta: Some(meta),
        parts: Vec::new(),
        skipped: Vec::new(),
        pytorch_columns: stacks.is_some(),
        ustack_ids: false,
        modified: std::fs::metadata(path).and_then(|m| m.modified()).ok(),
        stacks,
    };
    tracing::info!("{}: imported {} events in {:.3} s", trace.name, events.len(), start.elapsed().as_secs_f64());
    Loaded { trace, events, out_of_order }
}

/// The traces named on the command line: trace directories, or
/// directories of trace directories, each with its path relative to the
/// input root (the name inside a directory of traces; its own name when
/// named directly), which `--shard` hashes. `batch` is true when the output
/// should be one folder per trace plus a summary.
pub fn discover(paths: &[PathBuf]) -> Result<(Vec<(PathBuf, String)>, bool)> {
    let mut found = Vec::new();
    let mut batch = paths.len() > 1;
    for p in paths {
        if p.is_dir() && classify(p).is_none() {
            let mut subs: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("cannot read {}", p.display()))?
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|s| classify(s).is_some())
                .collect();
            if subs.is_empty() {
                bail!(
                    "{}: neither a trace (no events-NNNNN.parquet) nor a directory of traces or snapshots",
                    p.display()
                );
            }
            subs.sort();
            found.extend(subs.into_iter().map(|s| {
                let rel = s.strip_prefix(p).unwrap_or(&s).to_string_lossy().into_owned();
                (s, rel)
            }));
            batch = true;
        } else {
            let rel = p.file_name().unwrap_or(p.as_os_str()).to_string_lossy().into_owned();
            found.push((p.clone(), rel));
        }
    }
    Ok((found, batch))
}
