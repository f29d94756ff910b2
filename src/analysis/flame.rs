//! Memory flamegraphs of traces with stacks (PyTorch snapshots, and
//! recordings made with `record --stacks`): live bytes
//! by call stack at the end of the trace and at the peak of live memory.
//!
//! `flamegraph.folded` is Brendan Gregg's folded format, one line per
//! block: `end;<frames> BYTES` and `peak;<frames> BYTES`, frames outermost
//! first, written `file:line:function` and filtered like PyTorch's
//! `_memory_viz.py memory` (unwinder, interpreter-loop and dispatcher frames
//! dropped), so its lines carry the same stacks; the first component is the
//! instant instead of the stream. Leaves are named as call sites are
//! ([`crate::analysis::sites`]): machinery frames at the innermost end are dropped
//! too, and a stack of nothing else ends in `unknown (native)`. Blocks without a stack show as
//! `<non-python>`, as there. The byte count is the block's size (what the
//! allocator holds for it). The output stage renders `flamegraph.svg` from
//! it with `inferno`, offline.

use std::fmt::Write as _;

use ahash::AHashMap;

use crate::trace::event::{Events, LiveSet, NO_STACK};
use crate::trace::{Frame, Stacks};

/// Function-name fragments of frames left out of flamegraphs.
const OMIT_NAMES: &[&str] = &[
    "unwind::unwind",
    "CapturedTraceback::gather",
    "gather_with_cpp",
    "_start",
    "__libc_start_main",
    "PyEval_",
    "PyObject_",
    "PyFunction_",
];
/// File-name fragments of frames left out of flamegraphs.
const OMIT_FILES: &[&str] = &[
    "core/boxing",
    "/Register",
    "/Redispatch",
    "pythonrun.c",
    "Modules/main.c",
    "Objects/call.c",
    "Objects/methodobject.c",
    "pycore_ceval.h",
    "ceval.c",
    "cpython/abstract.h",
];

fn keep(f: &Frame) -> bool {
    !OMIT_NAMES.iter().any(|o| f.name.contains(o)) && !OMIT_FILES.iter().any(|o| f.filename.contains(o))
}

/// The folded stack of `id`, outermost frame first; `;` inside names (C++
/// templates rarely have them) would split frames, so they become `,`.
fn folded_stack(stacks: &Stacks, id: u32, cache: &mut AHashMap<u32, String>) -> String {
    cache
        .entry(id)
        .or_insert_with(|| {
            let frames: Vec<String> = if id == NO_STACK {
                Vec::new()
            } else {
                // The leaf is named as call sites are: machinery frames at
                // the innermost end are dropped.
                let mut v: Vec<String> = stacks
                    .frames_of(id)
                    .filter(|f| keep(f))
                    .skip_while(|f| crate::analysis::sites::is_machinery(f))
                    .map(|f| crate::analysis::sites::format_frame(f).replace(';', ","))
                    .collect();
                if v.is_empty() && stacks.frames_of(id).next().is_some() {
                    v.push(crate::analysis::sites::UNKNOWN_NATIVE.to_string());
                }
                v.reverse();
                v
            };
            if frames.is_empty() { "<non-python>".to_string() } else { frames.join(";") }
        })
        .clone()
}

/// The folded lines for the live blocks of every series at the end and at
/// each series' peak (the first instant its live bytes were highest). One
/// pass finds the peaks, a second collects the blocks alive then.
pub fn folded(events: &Events, stacks: &Stacks) -> String {
    // Pass 1: the row of each series' peak.
    let mut live = LiveSet::default();
    let mut bytes: AHashMap<u32, (i64, i64, usize)> = AHashMap::new(); // now, peak, row
    for i in 0..events.len() {
        if let Some((pid, delta)) = live.apply(events, i) {
            let b = bytes.entry(pid).or_insert((0, 0, usize::MAX));
            b.0 += delta;
            if b.0 > b.1 {
                (b.1, b.2) = (b.0, i);
            }
        }
    }
    // Pass 2: the blocks alive at each peak, then at the end.
    let mut out = String::new();
    let mut cache = AHashMap::new();
    let mut peaks: Vec<(usize, u32)> = bytes.iter().filter(|b| b.1.2 != usize::MAX).map(|(&p, b)| (b.2, p)).collect();
    peaks.sort_unstable();
    let mut emit = |out: &mut String, label: &str, pid: Option<u32>, alive: &LiveSet| {
        let mut lines: AHashMap<String, u64> = AHashMap::new();
        for (&(p, _), b) in &alive.blocks {
            if pid.is_none_or(|q| q == p) {
                let prefix = if bytes.len() > 1 { format!("{label};device_{p}") } else { label.to_string() };
                *lines.entry(format!("{prefix};{}", folded_stack(stacks, b.stack, &mut cache))).or_default() += b.size;
            }
        }
        let mut lines: Vec<(String, u64)> = lines.into_iter().collect();
        lines.sort_unstable();
        for (l, n) in lines {
            let _ = writeln!(out, "{l} {n}");
        }
    };
    let mut live = LiveSet::default();
    let mut next_peak = 0;
    for i in 0..events.len() {
        live.apply(events, i);
        while next_peak < peaks.len() && peaks[next_peak].0 == i {
            emit(&mut out, "peak", Some(peaks[next_peak].1), &live);
            next_peak += 1;
        }
    }
    emit(&mut out, "end", None, &live);
    out
}
