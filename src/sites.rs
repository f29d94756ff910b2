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
    use crate::event::EventKind;
    let mut live: AHashMap<u64, (u64, u64, u32)> = AHashMap::new();
    for i in 0..events.len() {
        let Some(k) = events.kind[i] else { continue };
        if events.pid[i] != pid || events.ret[i] != 0 {
            continue;
        }
        if (k.is_device_alloc() || k == EventKind::BlockAlloc) && events.size[i] > 0 {
            let stack = events.stack.get(i).copied().unwrap_or(NO_STACK);
            live.insert(events.addr[i], (events.ts_ns[i], events.size[i], stack));
        } else if k.is_device_free() || k == EventKind::BlockFree {
            live.remove(&events.addr[i]);
        }
    }
    let blocks: Vec<(u64, u64, u64, u32)> =
        live.into_iter().filter(|b| b.1.0 > since_ns).map(|(a, (_, size, stack))| (a, size, size, stack)).collect();
    top_sites(stacks, &blocks, n)
}

/// Live bytes by call site at the instant the live bytes of the whole
/// trace (all series) peaked, every site.
pub fn sites_at_peak(events: &crate::event::Events, stacks: &Stacks) -> Vec<SiteBytes> {
    use crate::event::EventKind;
    let is_alloc = |k: EventKind| k.is_device_alloc() || k == EventKind::BlockAlloc;
    let is_free = |k: EventKind| k.is_device_free() || k == EventKind::BlockFree;
    // Pass 1: where the total peaks. Pass 2: what is alive there.
    let mut live: AHashMap<(u32, u64), (u64, u32)> = AHashMap::new();
    let (mut now, mut peak, mut at) = (0u64, 0u64, None);
    for pass in 0..2 {
        live.clear();
        now = 0;
        for i in 0..events.len() {
            let Some(k) = events.kind[i] else { continue };
            if events.ret[i] == 0 {
                let key = (events.pid[i], events.addr[i]);
                if is_alloc(k) && events.size[i] > 0 {
                    let stack = events.stack.get(i).copied().unwrap_or(NO_STACK);
                    if let Some(old) = live.insert(key, (events.size[i], stack)) {
                        now -= old.0;
                    }
                    now += events.size[i];
                } else if is_free(k)
                    && let Some(old) = live.remove(&key)
                {
                    now -= old.0;
                }
            }
            if pass == 0 && now > peak {
                (peak, at) = (now, Some(i));
            }
            if pass == 1 && Some(i) == at {
                break;
            }
        }
        if at.is_none() {
            return Vec::new();
        }
    }
    let _ = now;
    let blocks: Vec<(u64, u64, u64, u32)> = live.into_iter().map(|((_, a), (s, st))| (a, s, s, st)).collect();
    top_sites(stacks, &blocks, usize::MAX)
}
