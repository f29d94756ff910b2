//! Call sites: naming where memory was allocated, from a trace's stack
//! table (PyTorch snapshots; `record --stacks` later).
//!
//! A call site is the innermost frame that belongs to the program rather
//! than to the framework, written `file:line:function` with the file's base
//! name (as PyTorch's `_memory_viz.py` writes frames). Framework frames are
//! the C/C++ ones (no `.py` file: the allocator, ATen, the interpreter) and
//! Python files of torch itself or of installed packages (`site-packages`,
//! `dist-packages`). When a stack has none of the program's frames, the
//! innermost Python frame names it, then the innermost frame.

use ahash::AHashMap;
use serde::Serialize;

use crate::event::NO_STACK;
use crate::trace::{Frame, Stacks};

/// The site of blocks without a recorded stack (e.g. allocated before
/// PyTorch started recording history).
pub const NO_SITE: &str = "<no stack recorded>";

/// Live bytes attributed to one call site.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SiteBytes {
    pub site: String,
    pub bytes: u64,
    pub blocks: u64,
}

fn is_python(f: &Frame) -> bool {
    f.filename.ends_with(".py")
}

fn is_framework_python(f: &Frame) -> bool {
    let p = &f.filename;
    p.contains("/torch/") || p.starts_with("torch/") || p.contains("site-packages/") || p.contains("dist-packages/")
}

/// `file:line:function`, the file by its base name.
pub fn format_frame(f: &Frame) -> String {
    let file = f.filename.rsplit('/').next().unwrap_or(&f.filename);
    format!("{file}:{}:{}", f.line, f.name)
}

/// The call site of stack `id` (None for an unknown or empty stack).
pub fn call_site(stacks: &Stacks, id: u32) -> Option<String> {
    if id == NO_STACK {
        return None;
    }
    let frames: Vec<&Frame> = stacks.frames_of(id).collect();
    frames
        .iter()
        .find(|f| is_python(f) && !is_framework_python(f))
        .or_else(|| frames.iter().find(|f| is_python(f)))
        .or_else(|| frames.first())
        .map(|f| format_frame(f))
}

/// Live bytes by call site, the `n` largest; `blocks` are (address, size,
/// requested, stack id). Blocks without a stack count as [`NO_SITE`].
pub fn top_sites(stacks: &Stacks, blocks: &[(u64, u64, u64, u32)], n: usize) -> Vec<SiteBytes> {
    let mut names: AHashMap<u32, Option<String>> = AHashMap::new();
    let mut by_site: AHashMap<String, (u64, u64)> = AHashMap::new();
    for &(_, size, _, stack) in blocks {
        let name = names.entry(stack).or_insert_with(|| call_site(stacks, stack)).clone();
        let e = by_site.entry(name.unwrap_or_else(|| NO_SITE.into())).or_default();
        e.0 += size;
        e.1 += 1;
    }
    let mut out: Vec<SiteBytes> =
        by_site.into_iter().map(|(site, (bytes, blocks))| SiteBytes { site, bytes, blocks }).collect();
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
    out.truncate(n);
    out
}

/// Live bytes at the end of the trace by call site, counting only blocks of
/// `pid` allocated after `since_ns`: the memory a leak report is about (the
/// floor that rose), not the weights allocated at start-up.
pub fn grown_sites(
    events: &crate::event::Events,
    stacks: &Stacks,
    pid: u32,
    since_ns: u64,
    n: usize,
) -> Vec<SiteBytes> {
    let mut live = crate::event::LiveSet::default();
    for i in 0..events.len() {
        live.apply(events, i);
    }
    let blocks: Vec<(u64, u64, u64, u32)> = live
        .blocks
        .into_iter()
        .filter(|((p, _), b)| *p == pid && events.ts_ns[b.row] > since_ns)
        .map(|((_, a), b)| (a, b.size, b.size, b.stack))
        .collect();
    top_sites(stacks, &blocks, n)
}

/// Live bytes by call site at the instant the live bytes of the whole
/// trace (all series) peaked, every site.
pub fn sites_at_peak(events: &crate::event::Events, stacks: &Stacks) -> Vec<SiteBytes> {
    // Pass 1: the row where the total peaks. Pass 2: what is alive there.
    let mut live = crate::event::LiveSet::default();
    let (mut now, mut peak, mut at) = (0i64, 0i64, None);
    for i in 0..events.len() {
        if let Some((_, delta)) = live.apply(events, i) {
            now += delta;
            if now > peak {
                (peak, at) = (now, Some(i));
            }
        }
    }
    let Some(at) = at else { return Vec::new() };
    let mut live = crate::event::LiveSet::default();
    for i in 0..=at {
        live.apply(events, i);
    }
    let blocks: Vec<(u64, u64, u64, u32)> =
        live.blocks.into_iter().map(|((_, a), b)| (a, b.size, b.size, b.stack)).collect();
    top_sites(stacks, &blocks, usize::MAX)
}
