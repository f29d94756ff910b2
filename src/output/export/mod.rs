//! `fragscope export`: a trace in the formats other tools open. This
//! module dispatches; each format is a file of its own implementing
//! [`common::Exporter`], and imports nothing from its siblings:
//!
//! - **memory-viz** ([`memory_viz`]): a PyTorch snapshot pickle for
//!   pytorch.org/memory_viz and SnapViewer;
//! - **perfetto** ([`perfetto`]): a Perfetto protobuf trace of TrackEvents
//!   (counter tracks, OOM instants, iteration slices, leak markers);
//! - **chrome** ([`chrome`]): Trace Event JSON;
//! - **speedscope** ([`speedscope`]): the flamegraph's stacks.
//!
//! `--time-window A..B` (seconds from the first event) cuts a slice.

pub(crate) mod chrome;
pub(crate) mod common;
pub(crate) mod memory_viz;
pub mod perfetto;
pub(crate) mod speedscope;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::output::export::common::{Exporter, Paths, Source, Window};
use crate::trace::details::Details;

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

/// Writes `bytes` to `path` through a temporary file renamed at the end,
/// so a failed export never leaves a half-written file under the name.
fn write_file<T>(path: &Path, f: impl FnOnce(&mut std::fs::File) -> Result<T>) -> Result<T> {
    let tmp = path.with_file_name(format!(
        ".{}.partial",
        path.file_name().map_or("export".into(), |n| n.to_string_lossy().into_owned())
    ));
    let result = (|| {
        // Errors name the file asked for, not its temporary.
        let mut file = std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", path.display()))?;
        let value = f(&mut file)?;
        file.sync_all().with_context(|| format!("cannot write {}", path.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(value)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// What `fragscope export` is asked for.
#[derive(Clone, Debug)]
pub struct Options {
    /// The trace directory or snapshot to read.
    pub input: PathBuf,
    pub format: Format,
    /// The file to write.
    pub output: PathBuf,
    /// `A..B` seconds from the first event, as given.
    pub time_window: Option<String>,
    /// Only this device of a snapshot.
    pub device: Option<u32>,
}

impl Format {
    fn exporter(self) -> &'static dyn Exporter {
        match self {
            Format::MemoryViz => &memory_viz::MemoryViz,
            Format::Perfetto => &perfetto::Perfetto,
            Format::Chrome => &chrome::Chrome,
            Format::Speedscope => &speedscope::Speedscope,
        }
    }
}

/// `fragscope export`.
pub fn run(args: &Options) -> Result<u8> {
    let started = std::time::Instant::now();
    // A malformed window is a usage error, before the (long) read; so is
    // a window for a format it does not cut.
    if let Some(spec) = &args.time_window {
        if let Err(e) = Window::parse(spec, 0) {
            eprintln!("error: {e}");
            return Ok(crate::exit::USAGE);
        }
        if !args.format.exporter().takes_window() {
            eprintln!(
                "error: --time-window does not apply to --format speedscope: it exports the live memory by call \
                 stack at the end and at the peak of the whole trace"
            );
            return Ok(crate::exit::USAGE);
        }
    }
    // The output replaces whatever file is there: never the input itself
    // (or a file inside an input trace directory).
    // An output that does not exist yet: its folder, resolved, and its name.
    let resolve = |p: &std::path::Path| {
        p.canonicalize().or_else(|_| {
            let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
            parent.canonicalize().map(|d| d.join(p.file_name().unwrap_or_default()))
        })
    };
    let same = |a: &std::path::Path, b: &std::path::Path| matches!((a.canonicalize(), resolve(b)), (Ok(x), Ok(y)) if y == x || y.starts_with(&x) && x.is_dir());
    if same(&args.input, &args.output) {
        eprintln!(
            "error: -o {} is the input ({}): the export would replace what it reads; write it elsewhere",
            args.output.display(),
            args.input.display()
        );
        return Ok(crate::exit::USAGE);
    }
    // A recording of PyTorch's allocator exports as the snapshot it reads
    // as: memory_viz shows each tensor.
    let loaded = crate::input::allocator_view(crate::input::open(&args.input, args.device)?)?;
    let first = loaded.events.ts_ns.first().unwrap_or(0);
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
    if args.time_window.is_some() && !loaded.events.ts_ns.iter().any(|t| window.contains(t)) {
        // Said, not refused: a memory_viz slice of an idle stretch still
        // holds the state at its end.
        let last = loaded.events.ts_ns.iter().max().unwrap_or(first);
        eprintln!(
            "warning: {}: no event in --time-window {} (the trace's events span 0 to {:.6} s after its first): the \
             export holds none",
            args.input.display(),
            args.time_window.as_deref().unwrap_or_default(),
            last.saturating_sub(first) as f64 / 1e9
        );
    }
    let exporter = args.format.exporter();
    let paths = Paths { input: &args.input, output: &args.output };
    let written = if exporter.needs_analysis() {
        let opts =
            crate::analysis::Options { device: args.device, whatif: false, ..crate::analysis::Options::default() };
        let a = crate::analysis::analyze_events(loaded.trace, &loaded.events, loaded.out_of_order, &opts)?;
        write_file(&args.output, |f| exporter.write(&paths, Source::Analysis(&a), window, f))?
    } else {
        write_file(&args.output, |f| exporter.write(&paths, Source::Events(&loaded), window, f))?
    };
    println!(
        "{}: {} of {}{} in {:.2} s",
        args.output.display(),
        written.what,
        args.input.display(),
        written.detail,
        started.elapsed().as_secs_f64()
    );
    Ok(crate::exit::OK)
}
