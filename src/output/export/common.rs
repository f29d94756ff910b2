//! What the export formats share: the time window, the processes and
//! iterations the timeline formats draw, and [`Exporter`], the one trait
//! every format implements. Below the formats; imports none of them.

use std::io::Write;
use std::path::Path;

use anyhow::{Result, bail};

use crate::analysis::Analysis;
use crate::input::Loaded;

/// What an exporter reads: the loaded events (memory-viz rebuilds a
/// snapshot from them) or their analysis (the timeline formats).
pub(crate) enum Source<'a> {
    Events(&'a Loaded),
    Analysis(&'a Analysis),
}

impl<'a> Source<'a> {
    /// The analysis, for a format that asked for it.
    pub(crate) fn analysis(&self) -> Result<&'a Analysis> {
        match self {
            Source::Analysis(a) => Ok(a),
            Source::Events(_) => bail!("internal error: this export format reads the analysis"),
        }
    }

    /// The loaded events, for a format that asked for them.
    pub(crate) fn events(&self) -> Result<&'a Loaded> {
        match self {
            Source::Events(l) => Ok(l),
            Source::Analysis(_) => bail!("internal error: this export format reads the loaded events"),
        }
    }
}

/// The files of one export: what is read and what is written, for
/// messages.
pub(crate) struct Paths<'a> {
    pub input: &'a Path,
    pub output: &'a Path,
}

/// What an exporter wrote, for the line `export` prints: `{what} of
/// INPUT{detail}`.
pub(crate) struct Written {
    pub what: String,
    pub detail: String,
}

/// One export format.
pub(crate) trait Exporter {
    /// Whether the format reads the analysis (replay, metrics, iterations,
    /// stacks) rather than the loaded events alone.
    fn needs_analysis(&self) -> bool;

    /// Whether `--time-window` cuts this format (else it is refused).
    fn takes_window(&self) -> bool {
        true
    }

    /// Writes the export of `source`, cut to `window`, into `out`.
    fn write(&self, paths: &Paths, source: Source<'_>, window: Window, out: &mut dyn Write) -> Result<Written>;
}

/// A time window, ns on the trace's clock, both ends included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Window {
    /// `A..B` after `first_ns` ([`crate::units::time_window`]: durations
    /// or seconds); either end may be omitted.
    pub(crate) fn parse(spec: &str, first_ns: u64) -> Result<Window> {
        let (a, b) = crate::units::time_window(spec).map_err(|e| anyhow::anyhow!("--time-window {e}"))?;
        Ok(Window {
            start_ns: first_ns.saturating_add(a.unwrap_or(0)),
            end_ns: b.map_or(u64::MAX, |b| first_ns.saturating_add(b)),
        })
    }

    pub(crate) fn contains(&self, t: u64) -> bool {
        (self.start_ns..=self.end_ns).contains(&t)
    }
}

/// The processes (devices) of an analysis with rows, in order: the
/// processes both timeline exports draw.
pub(crate) fn timeline_pids(a: &Analysis) -> Vec<u32> {
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
pub(crate) fn iteration_spans(a: &Analysis, window: Window) -> Vec<IterationSpan> {
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
pub(crate) fn leak_marker_ns(a: &Analysis, window: Window) -> u64 {
    a.last_ts.min(window.end_ns).max(window.start_ns.min(a.last_ts))
}
