//! Call sites: naming where memory was allocated, from a trace's stack
//! table: a PyTorch snapshot's, or the symbolised stacks of
//! `record --stacks` (native frames: file, line 0, demangled symbol).
//!
//! A call site is a frame written `file:line:function` with the file's base
//! name (as PyTorch's `_memory_viz.py` writes frames), chosen as:
//! 1. the innermost Python frame of the program: a `.py` file that is not
//!    torch's own nor an installed package's (`site-packages`,
//!    `dist-packages`);
//! 2. else the innermost Python frame;
//! 3. else the innermost native frame outside the machinery that records
//!    and dispatches allocations ([`is_machinery`]: frames without a file
//!    (`??`), the unwinder and `CapturedTraceback`, `c10::`/`at::`/`torch::`
//!    and the caching allocator, CPython's interpreter, the C runtime's
//!    start-up and thread start, and the CUDA runtime and driver);
//! 4. else, in a stack of PyTorch's autograd engine (its backward runs on
//!    threads of its own, without Python frames), `autograd backward
//!    (BmmBackward0)`: the innermost node of the backward graph, or
//!    [`BACKWARD`] alone where no node's frame shows (the engine reducing
//!    a gradient);
//! 5. else [`UNKNOWN_NATIVE`].
//!
//! The same rule names sites everywhere: OOMs, leaks, the peak, compare,
//! and the leaves of flamegraphs.
use ahash::AHashMap;
use serde::Serialize;

use crate::trace::event::NO_STACK;
use crate::trace::{Frame, Stacks};

/// The site of blocks without a recorded stack (e.g. allocated before
/// PyTorch started recording history).
pub const NO_SITE: &str = "<no stack recorded>";

/// The site of a stack made only of machinery frames.
pub const UNKNOWN_NATIVE: &str = "unknown (native)";

/// The site of an allocation of PyTorch's autograd engine, where no node
/// of the backward graph shows in its stack.
pub const BACKWARD: &str = "autograd backward";

/// Names of whole functions that start a process or a thread: never the
/// program's code, and outermost in every native stack.
const THREAD_START: &[&str] = &["_start", "clone", "__clone", "clone3", "__clone3", "start_thread"];

/// Function-name fragments of frames that are never the program's own.
const MACHINERY_NAMES: &[&str] = &[
    "torch::unwind",
    "unwind::unwind",
    "CapturedTraceback",
    "gather_with_cpp",
    "c10::",
    "at::",
    "torch::",
    "CUDACachingAllocator",
    "PyEval_",
    "_PyEval",
    "PyObject_",
    "_PyObject",
    "PyFunction_",
    "_PyFunction",
    "PyVectorcall",
    "_PyVectorcall",
    "Py_RunMain",
    "Py_BytesMain",
    "__libc_start_main",
    "__libc_start_call_main",
    // libstdc++'s std::thread entry (`thread48.o` in its symbols).
    "execute_native_thread_routine",
];
/// File-name fragments of the same.
const MACHINERY_FILES: &[&str] = &[
    "CUDACachingAllocator",
    "c10/",
    "aten/",
    "torch/csrc/",
    "core/boxing",
    "/Register",
    "/Redispatch",
    "ceval.c",
    "pycore_",
    "Python/",
    "Objects/",
    "Modules/main.c",
    "libpython",
    // The CUDA runtime and driver, innermost in stacks recorded with eBPF.
    "libcudart",
    "libcuda.so",
];

/// A frame of the machinery that records and dispatches allocations, or
/// of the interpreter — never the user's code. Python frames are not:
/// whether they belong to a framework is `is_framework_python`'s call.
pub fn is_machinery(f: &Frame) -> bool {
    if is_python(f) {
        return false;
    }
    let file = f.filename.as_str();
    file.is_empty()
        || file == "??"
        || THREAD_START.contains(&f.name.as_str())
        || MACHINERY_NAMES.iter().any(|m| f.name.contains(m))
        || MACHINERY_FILES.iter().any(|m| file.contains(m))
}

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

/// A frame of PyTorch or an installed package, not the program's own (a
/// Windows path too: `D:\env\Lib\site-packages\torch\functional.py`).
fn is_framework_python(f: &Frame) -> bool {
    let p = f.filename.replace('\\', "/");
    p.contains("/torch/") || p.starts_with("torch/") || p.contains("site-packages/") || p.contains("dist-packages/")
}

/// `file:line:function`, the file by its base name (after the last `/`,
/// or `\` in a Windows path).
///
/// Also used for flamegraph frames.
pub fn format_frame(f: &Frame) -> String {
    let file = f.filename.rsplit(['/', '\\']).next().unwrap_or(&f.filename);
    format!("{file}:{}:{}", f.line, f.name)
}

/// The call site of stack `id` (None for an unknown or empty stack; a
/// stack of machinery frames only is [`UNKNOWN_NATIVE`]).
pub fn call_site(stacks: &Stacks, id: u32) -> Option<String> {
    if id == NO_STACK {
        return None;
    }
    let frames: Vec<&Frame> = stacks.frames_of(id).collect();
    if frames.is_empty() {
        return None;
    }
    Some(
        frames
            .iter()
            .find(|f| is_python(f) && !is_framework_python(f))
            .or_else(|| frames.iter().find(|f| is_python(f)))
            .or_else(|| frames.iter().find(|f| !is_machinery(f)))
            .map(|f| format_frame(f))
            .or_else(|| backward_site(&frames))
            .unwrap_or_else(|| UNKNOWN_NATIVE.to_string()),
    )
}

/// A stack of PyTorch's autograd engine: `autograd backward (Node)` with
/// the innermost node of the backward graph
/// (`torch::autograd::generated::BmmBackward0::apply`), or [`BACKWARD`].
fn backward_site(frames: &[&Frame]) -> Option<String> {
    const NODE: &str = "torch::autograd::generated::";
    if !frames.iter().any(|f| f.name.contains("torch::autograd::Engine::") || f.name.contains(NODE)) {
        return None;
    }
    let node = frames.iter().find_map(|f| {
        let rest = &f.name[f.name.find(NODE)? + NODE.len()..];
        let (name, tail) = rest.split_once("::")?;
        tail.starts_with("apply").then_some(name)
    });
    Some(node.map_or_else(|| BACKWARD.to_string(), |n| format!("{BACKWARD} ({n})")))
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

/// What each call site holds more in `after` than in `before` (blocks as
/// [`top_sites`] takes them), the `n` largest rises: bytes, and blocks
/// more (none when it holds as many or fewer).
pub fn site_growth(
    stacks: &Stacks,
    before: &[(u64, u64, u64, u32)],
    after: &[(u64, u64, u64, u32)],
    n: usize,
) -> Vec<SiteBytes> {
    let everything = usize::MAX;
    let was: AHashMap<String, (u64, u64)> =
        top_sites(stacks, before, everything).into_iter().map(|s| (s.site, (s.bytes, s.blocks))).collect();
    let mut out: Vec<SiteBytes> = top_sites(stacks, after, everything)
        .into_iter()
        .filter_map(|s| {
            let (bytes, blocks) = was.get(&s.site).copied().unwrap_or_default();
            (s.bytes > bytes).then(|| SiteBytes {
                bytes: s.bytes - bytes,
                blocks: s.blocks.saturating_sub(blocks),
                site: s.site,
            })
        })
        .collect();
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
    out.truncate(n);
    out
}

/// Live bytes at the end of the trace by call site, counting only blocks of
/// `pid` allocated in (`since_ns`, `until_ns`): after the early floor, the
/// memory a leak report is about (the floor that rose); before the end of
/// the warm-up, what was allocated once. With `requested`, a block counts
/// the bytes the program asked for where the trace has them (a snapshot's
/// block sizes carry the allocator's rounding), as the leak's floors do.
pub fn grown_sites(
    events: &crate::trace::event::Events,
    stacks: &Stacks,
    pid: u32,
    (since_ns, until_ns): (u64, u64),
    requested: bool,
    n: usize,
) -> Vec<SiteBytes> {
    let mut live = crate::trace::event::LiveSet::default();
    for i in 0..events.len() {
        live.apply(events, i);
    }
    let blocks: Vec<(u64, u64, u64, u32)> = live
        .blocks
        .into_iter()
        .filter(|((p, _), b)| *p == pid && events.ts_ns.at(b.row) > since_ns && events.ts_ns.at(b.row) < until_ns)
        .map(|((_, a), b)| {
            let bytes = if requested { events.requested_at(b.row).unwrap_or(b.size) } else { b.size };
            (a, bytes, bytes, b.stack)
        })
        .collect();
    top_sites(stacks, &blocks, n)
}

/// Live bytes by call site at the instant the live bytes of the whole
/// trace (all series) peaked, every site.
pub fn sites_at_peak(events: &crate::trace::event::Events, stacks: &Stacks) -> Vec<SiteBytes> {
    // Pass 1: the row where the total peaks. Pass 2: what is alive there.
    let mut live = crate::trace::event::LiveSet::default();
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
    let mut live = crate::trace::event::LiveSet::default();
    for i in 0..=at {
        live.apply(events, i);
    }
    let blocks: Vec<(u64, u64, u64, u32)> =
        live.blocks.into_iter().map(|((_, a), b)| (a, b.size, b.size, b.stack)).collect();
    top_sites(stacks, &blocks, usize::MAX)
}

/// Device memory allocated from one call stack (`record --stacks`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StackStat {
    pub bytes: u64,
    pub allocations: u64,
    /// Innermost first: the probed CUDA function, then its callers.
    pub frames: Vec<String>,
}

/// Successful device allocations by whole call stack (frame names), most
/// bytes first. Allocations without a stack are left out.
pub fn allocation_stacks(events: &crate::trace::event::Events, stacks: &Stacks) -> Vec<StackStat> {
    let mut by_id: AHashMap<u32, (u64, u64)> = AHashMap::new();
    for i in 0..events.len() {
        let alloc = events.kind[i].is_some_and(|k| k.is_device_alloc()) && events.ret[i] == 0;
        let id = events.stack.get(i).copied().unwrap_or(NO_STACK);
        if alloc && id != NO_STACK {
            let e = by_id.entry(id).or_default();
            e.0 += events.size.at(i);
            e.1 += 1;
        }
    }
    let mut by_frames: std::collections::BTreeMap<Vec<String>, (u64, u64)> = Default::default();
    for (id, (b, n)) in by_id {
        let e = by_frames.entry(stacks.frames_of(id).map(crate::trace::symbols::label).collect()).or_default();
        e.0 += b;
        e.1 += n;
    }
    let mut out: Vec<StackStat> =
        by_frames.into_iter().map(|(frames, (bytes, allocations))| StackStat { bytes, allocations, frames }).collect();
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.frames.cmp(&b.frames)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(filename: &str, line: i64, name: &str) -> Frame {
        Frame { filename: filename.into(), line, name: name.into() }
    }

    fn stacks(list: Vec<Vec<Frame>>) -> Stacks {
        let mut st = Stacks::default();
        for frames in list {
            let ids = frames
                .into_iter()
                .map(|f| {
                    st.frames.push(f);
                    (st.frames.len() - 1) as u32
                })
                .collect();
            st.stacks.push(ids);
        }
        st
    }

    #[test]
    fn sites_name_the_users_code_and_never_the_machinery() {
        let unwind = frame("??", 0, "torch::unwind::unwind()");
        let gather = frame("??", 0, "torch::CapturedTraceback::gather(bool, bool, bool)");
        let alloc = frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", 1234, "c10::cuda::malloc");
        let aten = frame("??", 0, "at::native::empty_cuda(...)");
        let eval = frame("/usr/src/python/Python/ceval.c", 4000, "_PyEval_EvalFrameDefault");
        let ext = frame("/home/me/ext/fused.cu", 88, "launch_fused(float*)");
        let torch_py = frame("/venv/lib/python3.11/site-packages/torch/optim/adamw.py", 120, "step");
        let user_py = frame("/home/me/train.py", 42, "main");
        let st = stacks(vec![
            vec![unwind.clone(), gather.clone(), alloc.clone(), torch_py.clone(), user_py.clone()],
            vec![unwind.clone(), alloc.clone(), torch_py.clone()],
            vec![unwind.clone(), gather.clone(), alloc.clone(), aten.clone(), ext.clone(), eval.clone()],
            vec![unwind.clone(), gather, alloc, aten, eval],
            vec![],
        ]);
        assert_eq!(call_site(&st, 0).as_deref(), Some("train.py:42:main"));
        assert_eq!(call_site(&st, 1).as_deref(), Some("adamw.py:120:step"));
        assert_eq!(call_site(&st, 2).as_deref(), Some("fused.cu:88:launch_fused(float*)"));
        assert_eq!(call_site(&st, 3).as_deref(), Some(UNKNOWN_NATIVE));
        assert_eq!(call_site(&st, 4), None);
        assert_eq!(call_site(&st, NO_STACK), None);
        assert!(is_machinery(&unwind) && !is_machinery(&ext) && !is_machinery(&user_py));
        // A Windows run: the program's file by its base name, PyTorch's
        // passed over.
        let win_torch = frame(r"D:\env\Lib\site-packages\torch\functional.py", 373, "einsum");
        let win_user = frame(r"D:\work\bench.py", 65, "run");
        let st = stacks(vec![vec![win_torch, win_user]]);
        assert_eq!(call_site(&st, 0).as_deref(), Some("bench.py:65:run"));
    }

    /// The backward runs on the autograd engine's threads, whose stacks
    /// hold no Python frame: a snapshot's blocks from there are named by
    /// the node of the backward graph (as in nothanmin's snapshot, where
    /// 3.7 GiB came from `BmmBackward0`), never by the thread's start.
    #[test]
    fn backward_allocations_are_named_by_their_node_not_the_thread_start() {
        let unwind = frame("??", 0, "torch::unwind::unwind()");
        let empty = frame("??", 0, "at::detail::empty_cuda(c10::ArrayRef<long>, c10::TensorOptions const&)");
        let node = frame(
            "??",
            0,
            "torch::autograd::generated::BmmBackward0::apply(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)",
        );
        let engine =
            frame("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)");
        let reduce = frame("??", 0, "torch::autograd::InputMetadata::reduce_grad(at::Tensor&) const");
        let routine = frame("thread48.o", 0, "execute_native_thread_routine");
        let clone = frame("??", 0, "__clone");
        let st = stacks(vec![
            vec![unwind.clone(), empty.clone(), node, engine.clone(), routine.clone(), clone.clone()],
            vec![unwind.clone(), empty.clone(), reduce, engine, routine.clone(), clone.clone()],
            vec![unwind, empty, routine.clone(), clone.clone()],
        ]);
        assert_eq!(call_site(&st, 0).as_deref(), Some("autograd backward (BmmBackward0)"));
        assert_eq!(call_site(&st, 1).as_deref(), Some(BACKWARD));
        // A thread of something else: its start is machinery too.
        assert_eq!(call_site(&st, 2).as_deref(), Some(UNKNOWN_NATIVE));
        assert!(is_machinery(&routine) && is_machinery(&clone));
    }
}
