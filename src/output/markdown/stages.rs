//! The report's "Memory per stage" section ([`crate::analysis::stages`]).

use std::fmt::Write as _;

use crate::analysis::Analysis;
use crate::analysis::stages::Stage;
use crate::units::bytes;

/// Rows shown in report.md (report.json has every stage).
const SHOWN: usize = 60;

/// How to get stages into a snapshot, in one line of code.
pub const HOW: &str = "wrap each part of a step in `with torch.profiler.record_function(\"forward\"):` (and \
                       \"backward\", \"optimizer\", or a layer's name) while the memory history records, and each \
                       gets its peak here";

pub(crate) fn stages_md(a: &Analysis) -> String {
    if !a.allocator_view {
        return String::new();
    }
    let mut md = String::from("\n## Memory per stage\n\n");
    let st = &a.stages;
    if st.stages.is_empty() {
        let meta = a.trace.meta.as_ref();
        let all = meta.map_or(0, |m| m.details.annotations().len());
        let unplaced = meta.map_or(0, |m| m.details.unplaced_annotations());
        let why = if all == 0 {
            "this trace has no `record_function` ranges".to_string()
        } else if unplaced > 0 {
            "its annotations carry wall-clock times, and its entries none (time is entry order), so they cannot be \
             placed"
                .to_string()
        } else if st.before_trace > 0 {
            format!(
                "every one of its {} annotated ranges began before the trace's first entry (the history kept only \
                 its last entries)",
                st.before_trace
            )
        } else {
            "its annotations hold no range with both a start and a place among the entries".to_string()
        };
        let _ = writeln!(md, "None: {why}. To see them, {HOW}.");
        return md;
    }
    let _ = writeln!(
        md,
        "Per `record_function` range, over all its runs (nested ranges below the one that encloses them). *Peak \
         allocated*: the most the active blocks held during a run, what it began with included; *added*: that peak \
         less what was allocated when the run began; *held at end*: bytes allocated inside a run and still active \
         when it ended; *net at end*: allocated at its end less at its start (negative where it freed more than it \
         kept; near 0 where it replaced what it found, as an optimizer step does); *fragmentation*: free ranges inside the segments over the reserved bytes, at the peak; \
         *largest request*: the biggest single allocation.\n"
    );
    let several = st.stages.first().is_some_and(|f| st.stages.iter().any(|s| s.device != f.device));
    let _ = writeln!(
        md,
        "| stage | runs | peak allocated | added | peak reserved | held at end | net at end | fragmentation at peak | largest request |\n|---|---|---|---|---|---|---|---|---|"
    );
    for s in st.stages.iter().take(SHOWN) {
        let _ = writeln!(md, "{}", row(s, several.then(|| a.who(s.device))));
    }
    if st.stages.len() > SHOWN {
        let _ = writeln!(md, "\n{} more stages in report.json (`stages`).", st.stages.len() - SHOWN);
    }
    if st.before_trace > 0 {
        let _ = writeln!(
            md,
            "\n{} left out: they began before the trace's first entry, so what was allocated when they began is not \
             in it.",
            crate::units::plural(st.before_trace as u64, "run", "runs")
        );
    }
    md
}

fn row(s: &Stage, who: Option<String>) -> String {
    let indent = "\u{a0}\u{a0}".repeat(s.depth());
    let mark = if s.depth() > 0 { "└ " } else { "" };
    let device = who.map(|w| format!(" ({w})")).unwrap_or_default();
    let runs = if s.unfinished > 0 { format!("{} ({} unfinished)", s.runs, s.unfinished) } else { s.runs.to_string() };
    let held = s.held_at_end_bytes.map_or("—".to_string(), bytes);
    let net = s.net_at_end_bytes.map_or("—".to_string(), |n| {
        if n < 0 { format!("−{}", bytes(n.unsigned_abs())) } else { format!("+{}", bytes(n as u64)) }
    });
    let frag = s.fragmentation_at_peak.map_or("—".to_string(), |f| format!("{:.1} %", 100.0 * f));
    format!(
        "| {indent}{mark}`{}`{device} | {runs} | {} | {} | {} | {held} | {net} | {frag} | {} |",
        s.name(),
        bytes(s.peak_allocated_bytes),
        bytes(s.added_bytes),
        bytes(s.peak_reserved_bytes),
        if s.largest_request_bytes == 0 { "none".to_string() } else { bytes(s.largest_request_bytes) }
    )
}
