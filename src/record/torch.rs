//! PyTorch's caching allocator, probed in `libc10_cuda.so` (issue 40): every
//! tensor's allocation and free, with no change to the program.
//!
//! **Which functions.** PyTorch's wheels keep a full symbol table, where the
//! allocator's functions are local symbols; uprobes attach to them by their
//! offset. They are found by demangled name, and their parameter lists are
//! checked (the arguments are read by position):
//!
//! - every allocation goes through `NativeCachingAllocator::malloc(void**
//!   out, device, size, stream)` (`THCCachingAllocator::malloc` in 1.13):
//!   `allocate`, `raw_alloc` and `raw_alloc_with_stream` call it, in every
//!   wheel from 1.13 to 2.15 (`scripts/torch-allocator-symbols` reads their
//!   symbol tables; `tests/data/torch-allocator-symbols.txt` keeps what it
//!   found);
//! - frees have several ways in: a tensor's deleter `local_raw_delete(void*)`
//!   (which inlines the free since 2.1), `raw_delete(void*)`, and
//!   `NativeCachingAllocator::free(void*)`. Each that exists is probed,
//!   except one that calls or jumps to another of them (`raw_delete` in 2.0
//!   and 2.6 goes through `free`), so each free is seen once.
//!
//! **No return probes.** `malloc` throws on out-of-memory, and a uretprobe
//! replaces the return address with a trampoline that the C++ unwinder
//! cannot step through: the program would die in `std::terminate` instead
//! of raising `OutOfMemoryError`. So a plain uprobe goes on the instruction
//! after each call to `malloc` (its callers, decoded here): it fires when
//! `malloc` returns and reads the pointer it wrote. A call that throws never
//! gets there; the next allocator call of its thread (or its exit) writes
//! it as an out-of-memory, with the size it asked for. Frees are written at
//! their entry. Where a direct jump follows the call within a few
//! instructions that only load registers (1.13 to 2.1: `allocate` reads
//! the tensor's device, then jumps), the probe goes on that jump instead,
//! which the kernel emulates ([`super::elf::return_probe_at`]).
//!
//! **PyTorch's static probe.** The instruction after a call is stepped out
//! of line by the kernel's uprobe: two traps, and on a virtual machine
//! (Firecracker, Linux 6.18) 9.4 µs a hit, against 0.6 µs for a probe on a
//! `nop` or a `push`, which the kernel emulates (measured on this project's
//! machine with a tracefs uprobe on each kind of instruction). Since 2.2,
//! PyTorch's `allocate` (every tensor's allocation) has a static probe,
//! USDT `pytorch:malloc`, reached after `malloc` returned: a `nop` behind a
//! semaphore. Where the library's `.note.stapsdt` has it, in the function
//! of one of the calls to `malloc` and that call's only one, and every path
//! from that call's return reaches it ([`always_reaches`]; in 2.1 it stands
//! before the call), the probe after that call goes on the `nop` instead,
//! and the kernel raises the semaphore while it is attached
//! (`ref_ctr_offset`). It reads the same
//! pointer through the same saved argument. The other calls (`raw_alloc`,
//! a few a run) keep their probe after the call. Whether it was used is in
//! `trace.json` (`pytorch_allocator.static_probe`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{Context, Result};
use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

/// The role of an allocator function and where its pointer argument is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `malloc(this, void** out, device, size, stream)`.
    Malloc,
    /// A free taking the pointer as argument `ptr` (0 for a function, 1 for
    /// a member, after `this`).
    Free { ptr: usize },
}

/// The allocator functions recognised, by demangled name without the
/// parameters, and the parameter lists accepted for each.
const KNOWN: &[(&str, Role, &[&str])] = &[
    (
        "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc",
        Role::Malloc,
        &["void**, signed char, unsigned long, CUstream_st*", "void**, int, unsigned long, CUstream_st*"],
    ),
    (
        "c10::cuda::CUDACachingAllocator::THCCachingAllocator::malloc",
        Role::Malloc,
        &["void**, int, unsigned long, CUstream_st*"],
    ),
    ("c10::cuda::CUDACachingAllocator::Native::local_raw_delete", Role::Free { ptr: 0 }, &["void*"]),
    ("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::raw_delete", Role::Free { ptr: 1 }, &["void*"]),
    ("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::free", Role::Free { ptr: 1 }, &["void*"]),
    ("c10::cuda::CUDACachingAllocator::THCCachingAllocator::free", Role::Free { ptr: 1 }, &["void*"]),
    ("c10::cuda::CUDACachingAllocator::raw_delete", Role::Free { ptr: 0 }, &["void*"]),
];

/// What a name matched: the function's role, or a known name whose
/// parameters are not the ones this recorder reads (another release's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Match {
    Known(Role),
    WrongShape(String),
}

/// Matches a demangled name against [`KNOWN`].
pub fn recognise(demangled: &str) -> Option<Match> {
    let (name, params) = demangled.strip_suffix(')')?.split_once('(')?;
    let &(_, role, shapes) = KNOWN.iter().find(|(n, ..)| *n == name)?;
    Some(if shapes.contains(&params) { Match::Known(role) } else { Match::WrongShape(demangled.to_string()) })
}

/// A probed function: its demangled name and the file offset of its entry
/// probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Function {
    pub name: String,
    pub offset: usize,
    /// The probe goes after the `endbr64` the function begins with
    /// ([`super::elf::entry_probe_at`]).
    pub past_endbr64: bool,
}

/// PyTorch's static probe after `malloc` in `allocate` (USDT
/// `pytorch:malloc`): where it is, its semaphore, and the probe after the
/// call it stands in for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaticProbe {
    /// File offset of its `nop`.
    pub offset: usize,
    /// File offset of its semaphore (0: none).
    pub semaphore: usize,
    /// The landing (file offset) it replaces.
    pub replaces: usize,
    /// The function it is in.
    pub function: String,
}

/// What reading the allocation from PyTorch's static probe's own arguments
/// (pointer, device, size, stream) takes, in place of `malloc`'s entry: the
/// entry is then not probed, so what it did is done elsewhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaticArgs {
    /// The calls to `malloc` the static probe does not stand in for
    /// (`raw_alloc`'s): a probe on each call instruction takes the
    /// arguments, as the entry did, and the probe after it the pointer.
    pub calls: Vec<usize>,
    /// The calls to `c10::reportOutOfMemoryToProfiler(size, allocated,
    /// reserved, device)`, which PyTorch makes as a request fails, after
    /// asking CUDA for the free memory: each allocation that throws is
    /// written there (an allocation seen only by the static probe has no
    /// entry left in flight to tell it).
    pub oom_reports: Vec<usize>,
    /// The calls in the static probe's function that allocate without the
    /// cache (`PYTORCH_NO_CUDA_MEMORY_CACHING`, the allocator disabled),
    /// which the static probe follows too: the call, and the argument that
    /// holds the size (0: `uncached_allocate(size)`, 1: `cudaMalloc(&p,
    /// size)`). The probe there tells the static probe to skip that one,
    /// as such a tensor is a segment of its own and freed by
    /// `uncached_delete`, not a block.
    pub uncached: Vec<(usize, u8)>,
    /// How many `pytorch:malloc` probes the library has (libbpf attaches
    /// every one).
    pub locations: usize,
}

/// The function PyTorch's allocator reports an out-of-memory to.
const REPORT_OOM: &str = "_ZN3c1027reportOutOfMemoryToProfilerElmmNS_6DeviceE";
/// The allocation without the cache, where it is not inlined.
const UNCACHED_ALLOCATE: &str = "c10::cuda::CUDACachingAllocator::Native::uncached_allocate(unsigned long)";

/// How to probe one library's allocator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub malloc: Function,
    /// File offsets of the probes on each call to `malloc`'s return: the
    /// instruction after the call, or a jump soon after it
    /// ([`super::elf::return_probe_at`]).
    pub landings: Vec<usize>,
    /// Those of them on such a jump.
    pub on_a_jump: Vec<usize>,
    /// Where one of them is better seen through PyTorch's static probe.
    pub static_probe: Option<StaticProbe>,
    /// Where the static probe's own arguments can stand for `malloc`'s
    /// entry too: one trap per tensor allocation instead of two.
    pub static_args: Option<StaticArgs>,
    pub frees: Vec<(Function, Role)>,
    /// Frees left out because they call another probed one.
    pub left_out: Vec<String>,
}

/// Why a library's allocator is not probed, for the user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not PyTorch's allocator at all: says nothing.
    Absent,
    /// Looks like PyTorch's, but cannot be probed: the reason.
    Unusable(String),
}

/// A function symbol: address, size, demangled name.
struct Sym {
    addr: u64,
    size: u64,
    name: String,
}

/// Reads `path` and plans its allocator probes.
pub fn plan(path: &Path) -> Result<std::result::Result<Plan, Refusal>> {
    let data = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    plan_bytes(&data).with_context(|| format!("{}: cannot read its symbols", path.display()))
}

fn plan_bytes(data: &[u8]) -> Result<std::result::Result<Plan, Refusal>> {
    let file = object::File::parse(data)?;
    if file.architecture() != object::Architecture::X86_64 {
        // The call sites are found by decoding x86-64 code.
        let names = file.symbols().filter_map(|s| s.name().ok()).any(|n| n.contains("CUDACachingAllocator"));
        return Ok(Err(if names {
            Refusal::Unusable(format!("its allocator is probed on x86-64 only, and this is {:?}", file.architecture()))
        } else {
            Refusal::Absent
        }));
    }
    let text = |addr: u64, size: u64| -> Option<&[u8]> {
        file.segments().find_map(|s| s.data_range(addr, size).ok().flatten())
    };
    let offsets = super::elf::FileOffsets::of(&file);
    let offset = |addr: u64| offsets.at(addr);
    let mut syms: Vec<Sym> = Vec::new();

    let mut roles: BTreeMap<u64, (String, Role)> = BTreeMap::new();
    let mut wrong_shape = Vec::new();
    let mut names_seen = false;
    for s in file.symbols().chain(file.dynamic_symbols()) {
        if !s.is_definition() || s.kind() != SymbolKind::Text {
            continue;
        }
        let Ok(raw) = s.name() else { continue };
        // `.cold`, `.part` and `.isra` clones are pieces of a function: their
        // calls count, but they are not the entries probed.
        if raw.contains('.') {
            if s.size() > 0 {
                syms.push(Sym { addr: s.address(), size: s.size(), name: demangle(raw) });
            }
            continue;
        }
        let name = demangle(raw);
        names_seen |= name.contains("CUDACachingAllocator");
        match recognise(&name) {
            Some(Match::Known(role)) => {
                roles.insert(s.address(), (name.clone(), role));
            }
            Some(Match::WrongShape(n)) => wrong_shape.push(n),
            None => {}
        }
        if s.size() > 0 {
            syms.push(Sym { addr: s.address(), size: s.size(), name });
        }
    }
    syms.sort_by_key(|s| s.addr);
    syms.dedup_by_key(|s| s.addr);
    let mallocs: Vec<(u64, String)> =
        roles.iter().filter(|(_, (_, r))| *r == Role::Malloc).map(|(&a, (n, _))| (a, n.clone())).collect();
    let Some((malloc_at, malloc_name)) = mallocs.first().cloned() else {
        return Ok(Err(if !wrong_shape.is_empty() {
            Refusal::Unusable(format!(
                "its allocator's functions have parameters this recorder does not read: {}",
                wrong_shape.join("; ")
            ))
        } else if names_seen {
            Refusal::Unusable("it names PyTorch's CUDA caching allocator but not its malloc (another release?)".into())
        } else {
            Refusal::Absent
        }));
    };
    // Every call to malloc, and what would hide a return: a jump to it from
    // elsewhere (a tail call returns past the caller), its address taken
    // (an indirect call), or a jump to the instruction after a call (that
    // instruction would not only mean "malloc returned").
    let mut landing_at = Vec::new();
    let mut call_at = HashMap::new(); // landing -> its call instruction
    let mut jump_targets = std::collections::HashSet::new();
    let mut hidden = Vec::new();
    for s in &syms {
        let Some(code) = text(s.addr, s.size) else { continue };
        for b in branches(code, s.addr) {
            match b {
                Branch::Direct { at, next, target, call: true } if target == malloc_at => {
                    landing_at.push(next);
                    call_at.insert(next, at);
                }
                Branch::Direct { at, target, call: false, .. } => {
                    if target == malloc_at && s.addr != malloc_at {
                        hidden.push(format!("a tail call from {} at {at:#x}", s.name));
                    }
                    jump_targets.insert(target);
                }
                Branch::Direct { .. } => {}
                Branch::AddressOf { at, target } if target == malloc_at => {
                    hidden.push(format!("its address taken in {} at {at:#x}", s.name));
                }
                Branch::AddressOf { .. } => {}
            }
        }
    }
    if address_in_relocations(&file, malloc_at) {
        hidden.push("its address in a relocation (a table of function pointers)".into());
    }
    hidden.extend(
        landing_at.iter().filter(|a| jump_targets.contains(a)).map(|a| format!("a jump to {a:#x}, after a call")),
    );
    if !hidden.is_empty() {
        return Ok(Err(Refusal::Unusable(format!(
            "{malloc_name} has returns a probe could not see or tell apart: {}",
            hidden.join(", ")
        ))));
    }
    // A function's entry probe, past its `endbr64` where it has one and
    // nothing jumps there (from its own code, or from a `.cold` clone).
    let entry = |name: &str, addr: u64, size: u64| -> Option<Function> {
        let site = text(addr, size).map_or(addr, |code| super::elf::entry_probe_at(code, addr));
        let site = if jump_targets.contains(&site) { addr } else { site };
        Some(Function { name: name.to_string(), offset: offset(site)?, past_endbr64: site != addr })
    };
    // Each return's probe: the instruction after the call, or a jump soon
    // after it, which the kernel emulates.
    let site_of: HashMap<u64, u64> = landing_at
        .iter()
        .map(|&next| {
            let f = syms.iter().find(|f| f.addr < next && next < f.addr + f.size);
            let code = f.and_then(|f| Some((text(f.addr, f.size)?, f.addr)));
            (next, code.map_or(next, |(code, at)| super::elf::return_probe_at(code, at, next, &jump_targets)))
        })
        .collect();
    let on_a_jump: Vec<usize> =
        site_of.iter().filter(|(landing, site)| landing != site).filter_map(|(_, &s)| offset(s)).collect();
    let mut landings: Vec<usize> = site_of.values().filter_map(|&a| offset(a)).collect();
    if landings.is_empty() {
        return Ok(Err(Refusal::Unusable(format!("nothing in the library calls {malloc_name}"))));
    }
    landings.sort_unstable();
    // Frees, less those that reach another probed free.
    let free_at: HashMap<u64, (String, Role)> =
        roles.iter().filter(|(_, (_, r))| *r != Role::Malloc).map(|(&a, v)| (a, v.clone())).collect();
    let mut frees = Vec::new();
    let mut left_out = Vec::new();
    for (&addr, (name, role)) in roles.iter().filter(|(_, (_, r))| *r != Role::Malloc) {
        let size = syms.iter().find(|s| s.addr == addr).map_or(0, |s| s.size);
        let reaches_other = text(addr, size)
            .map(|code| {
                branches(code, addr).any(
                    |b| matches!(b, Branch::Direct { target, .. } if target != addr && free_at.contains_key(&target)),
                )
            })
            .unwrap_or(false);
        if reaches_other {
            left_out.push(name.clone());
        } else if let Some(f) = entry(name, addr, size) {
            frees.push((f, *role));
        }
    }
    if frees.is_empty() {
        return Ok(Err(Refusal::Unusable(format!("{malloc_name} is there but none of the frees is"))));
    }
    let malloc_size = syms.iter().find(|s| s.addr == malloc_at).map_or(0, |s| s.size);
    let malloc = entry(&malloc_name, malloc_at, malloc_size).context("malloc lies in no segment")?;
    // The static probe, in the function of exactly one call to malloc,
    // where every path from that call's return reaches it.
    let notes = usdt(data, "pytorch", "malloc");
    let static_probe = notes.iter().find_map(|&Note { pc, semaphore: sema, .. }| {
        let f = syms.iter().find(|s| s.addr <= pc && pc < s.addr + s.size)?;
        let calls: Vec<u64> = landing_at.iter().copied().filter(|&a| f.addr < a && a <= f.addr + f.size).collect();
        let (&[next], Some(&0x90)) = (calls.as_slice(), text(pc, 1).and_then(|b| b.first())) else { return None };
        if !always_reaches(text(f.addr, f.size)?, f.addr, next, pc, malloc_at, sema) {
            return None;
        }
        Some(StaticProbe {
            offset: offset(pc)?,
            semaphore: if sema == 0 { 0 } else { offset(sema)? },
            replaces: offset(*site_of.get(&next)?)?,
            function: f.name.clone(),
        })
    });
    let static_args = static_probe.as_ref().and_then(|p| {
        let within = |f: &Sym, a: u64| f.addr <= a && a < f.addr + f.size;
        let function = syms.iter().find(|f| f.name == p.function)?;
        // libbpf attaches every `pytorch:malloc`: each other one must be
        // where no call to malloc is (2.15's `allocateWithAddress`), so
        // that none of its allocations is written twice.
        let others_apart = notes.iter().all(|n| {
            n.args == 4
                && syms
                    .iter()
                    .filter(|f| within(f, n.pc))
                    .all(|f| f.name == p.function || !call_at.values().any(|&a| within(f, a)))
        });
        let report = super::elf::Import::of(&file, REPORT_OOM);
        let runtime_malloc = super::elf::Import::of(&file, "cudaMalloc");
        let uncached_at = syms.iter().find(|f| f.name == UNCACHED_ALLOCATE).map(|f| f.addr);
        let mut oom_reports = Vec::new();
        let mut uncached = Vec::new();
        for (f, c) in syms.iter().filter_map(|f| Some((f, text(f.addr, f.size)?))) {
            let mut d = iced_x86::Decoder::with_ip(64, c, f.addr, iced_x86::DecoderOptions::NONE);
            while d.can_decode() {
                let ins = d.decode();
                if report.called_by(&ins) {
                    oom_reports.push(offset(ins.ip())?);
                } else if std::ptr::eq(f, function) {
                    // The allocation without the cache (PYTORCH_NO_CUDA_MEMORY_CACHING):
                    // `uncached_allocate(size)`, or `cudaMalloc(&p, size)` inlined.
                    let direct = ins.op0_kind() == iced_x86::OpKind::NearBranch64;
                    if direct
                        && ins.mnemonic() == iced_x86::Mnemonic::Call
                        && Some(ins.near_branch_target()) == uncached_at
                    {
                        uncached.push((offset(ins.ip())?, 0));
                    } else if runtime_malloc.called_by(&ins) {
                        uncached.push((offset(ins.ip())?, 1));
                    }
                }
            }
        }
        let calls: Option<Vec<usize>> = plan_landings_other_than(&landing_at, &call_at, &site_of, p, &offset);
        (others_apart && !oom_reports.is_empty() && !uncached.is_empty())
            .then_some(())
            .and(calls)
            .map(|calls| StaticArgs { calls, oom_reports, uncached, locations: notes.len() })
    });
    Ok(Ok(Plan { malloc, landings, on_a_jump, static_probe, static_args, frees, left_out }))
}

/// The call instructions (file offsets) of the calls to malloc other than
/// the one the static probe stands in for (whose return's probe, `site_of`
/// its landing, it replaces).
fn plan_landings_other_than(
    landing_at: &[u64],
    call_at: &HashMap<u64, u64>,
    site_of: &HashMap<u64, u64>,
    p: &StaticProbe,
    offset: &impl Fn(u64) -> Option<usize>,
) -> Option<Vec<usize>> {
    landing_at
        .iter()
        .filter(|next| site_of.get(next).and_then(|&s| offset(s)) != Some(p.replaces))
        .map(|next| offset(*call_at.get(next)?))
        .collect()
}

/// Whether every path through the function `code` (at `start`) from `from`
/// (the instruction after a call to `malloc`) reaches `target` (the static
/// probe's `nop`) before it returns, leaves the function, jumps somewhere
/// computed, or calls `malloc` again. Conditional jumps are followed both
/// ways, but for the probe's guard: the first conditional jump within a few
/// instructions of a read of its semaphore (`semaphore`, its address; 0
/// for none), if one side of it goes to the `nop` (straight, or through
/// jumps), is taken that way, as the kernel holds the semaphore raised
/// while the probe is attached. Other calls are taken
/// to return; a trap (`ud2`, `int3`) ends a path (the process dies there).
/// So each return of that call is seen at the probe, and none is mistaken
/// for an out-of-memory. (In 2.1 the probe comes before the call, and this
/// refuses it.)
fn always_reaches(code: &[u8], start: u64, from: u64, target: u64, malloc: u64, semaphore: u64) -> bool {
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind};
    let end = start + code.len() as u64;
    // Whether `at` is the probe, or jumps straight to it.
    let lands = |mut at: u64| {
        for _ in 0..4 {
            if at == target {
                return true;
            }
            let Some(rest) = at.checked_sub(start).and_then(|o| code.get(o as usize..)) else { return false };
            let ins = Decoder::with_ip(64, rest, at, DecoderOptions::NONE).decode();
            if ins.mnemonic() != Mnemonic::Jmp || ins.op0_kind() != OpKind::NearBranch64 {
                return false;
            }
            at = ins.near_branch_target();
        }
        false
    };
    // (address, instructions left in which the next conditional jump tests
    // the semaphore just read: the compiler puts moves between the load,
    // the test and the jump, 5 in 2.6)
    const GUARD: u8 = 8;
    let mut todo = vec![(from, 0u8)];
    let mut seen = std::collections::HashSet::new();
    while let Some((at, read)) = todo.pop() {
        if at == target || !seen.insert((at, read)) {
            continue;
        }
        if at < start || at >= end {
            return false;
        }
        let mut decoder = Decoder::with_ip(64, &code[(at - start) as usize..], at, DecoderOptions::NONE);
        let ins = decoder.decode();
        let direct = ins.op0_kind() == OpKind::NearBranch64;
        let read = if semaphore != 0 && ins.is_ip_rel_memory_operand() && ins.ip_rel_memory_address() == semaphore {
            GUARD
        } else {
            read.saturating_sub(1)
        };
        let m = ins.mnemonic();
        if ins.is_invalid() || matches!(m, Mnemonic::Ret | Mnemonic::Retf | Mnemonic::Iret | Mnemonic::Iretq) {
            return false;
        } else if matches!(m, Mnemonic::Ud2 | Mnemonic::Int3 | Mnemonic::Hlt) {
            // The path ends: the process dies there.
        } else if m == Mnemonic::Call {
            if direct && ins.near_branch_target() == malloc {
                return false;
            }
            todo.push((ins.next_ip(), read));
        } else if m == Mnemonic::Jmp {
            if !direct {
                return false;
            }
            todo.push((ins.near_branch_target(), read));
        } else if direct && read > 0 && (lands(ins.next_ip()) || lands(ins.near_branch_target())) {
            // The guard: with the semaphore raised, on to the probe.
            todo.push((target, 0));
        } else if direct {
            // A conditional jump (jcc, jrcxz, loop): both ways. (The first
            // one after the semaphore's read is its test, or there is none.)
            todo.extend([(ins.next_ip(), 0), (ins.near_branch_target(), 0)]);
        } else {
            todo.push((ins.next_ip(), read));
        }
    }
    true
}

/// The address and semaphore address of each static probe (SystemTap SDT,
/// USDT) `provider:name` in the file's `.note.stapsdt` (2.15 has two
/// `pytorch:malloc`), moved as the `.stapsdt.base` section was (prelink).
/// The note's layout: three addresses (the probe, the base, the
/// semaphore), then the provider's, the probe's and the arguments' names.
fn usdt(data: &[u8], provider: &str, name: &str) -> Vec<Note> {
    use object::ObjectSection;
    use object::read::elf::{ElfFile64, SectionHeader};
    let Ok(elf) = ElfFile64::<object::Endianness>::parse(data) else { return Vec::new() };
    let endian = elf.endian();
    let base_section = elf.section_by_name(".stapsdt.base").map(|s| s.address());
    let Some(mut notes) =
        elf.section_by_name(".note.stapsdt").and_then(|s| s.elf_section_header().notes(endian, data).ok().flatten())
    else {
        return Vec::new();
    };
    let mut found = Vec::new();
    while let Ok(Some(note)) = notes.next() {
        let desc = note.desc();
        if note.name() != b"stapsdt" || note.n_type(endian) != 3 || desc.len() < 24 {
            continue;
        }
        // x86-64 only (checked by the caller): little-endian words.
        let word = |i: usize| u64::from_le_bytes(desc[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (pc, base, sema) = (word(0), word(1), word(2));
        let mut strings = desc[24..].split(|&b| b == 0);
        if strings.next() != Some(provider.as_bytes()) || strings.next() != Some(name.as_bytes()) {
            continue;
        }
        let pc = match base_section {
            Some(b) if base != 0 => pc.wrapping_add(b).wrapping_sub(base),
            _ => pc,
        };
        // The arguments: `size@place` each, separated by spaces.
        let args = strings.next().map_or(0, |a| a.split(|&b| b == b' ').filter(|w| !w.is_empty()).count());
        found.push(Note { pc, semaphore: sema, args });
    }
    found
}

/// A static probe's note: its `nop`, its semaphore (0: none), and how many
/// arguments it passes.
#[derive(Clone, Copy, Debug)]
struct Note {
    pc: u64,
    semaphore: u64,
    args: usize,
}

/// What an instruction says of the flow to an address.
#[derive(Clone, Copy, Debug)]
enum Branch {
    /// A call, jump or conditional jump to a fixed address: where it is,
    /// the next instruction, the target.
    Direct { at: u64, next: u64, target: u64, call: bool },
    /// An address computed relative to the instruction (`lea`, a load):
    /// a function whose address is taken can be called indirectly.
    AddressOf { at: u64, target: u64 },
}

/// The branches and RIP-relative addresses of `code` (x86-64, at `at`).
fn branches(code: &[u8], at: u64) -> impl Iterator<Item = Branch> + '_ {
    use iced_x86::{Decoder, DecoderOptions, OpKind};
    let mut decoder = Decoder::with_ip(64, code, at, DecoderOptions::NONE);
    std::iter::from_fn(move || {
        while decoder.can_decode() {
            let ins = decoder.decode();
            if matches!(ins.op0_kind(), OpKind::NearBranch64) {
                let call = ins.mnemonic() == iced_x86::Mnemonic::Call;
                return Some(Branch::Direct {
                    at: ins.ip(),
                    next: ins.next_ip(),
                    target: ins.near_branch_target(),
                    call,
                });
            }
            if ins.is_ip_rel_memory_operand() {
                return Some(Branch::AddressOf { at: ins.ip(), target: ins.ip_rel_memory_address() });
            }
        }
        None
    })
}

/// Whether a dynamic relocation puts `addr` somewhere (a vtable, a table of
/// function pointers): `R_X86_64_RELATIVE` with it as the addend.
fn address_in_relocations(file: &object::File<'_>, addr: u64) -> bool {
    file.dynamic_relocations()
        .into_iter()
        .flatten()
        .any(|(_, r)| r.kind() == object::RelocationKind::Relative && r.addend() as u64 == addr)
}

fn demangle(raw: &str) -> String {
    cpp_demangle::Symbol::new(raw).ok().and_then(|s| s.demangle().ok()).unwrap_or_else(|| raw.to_string())
}

/// PyTorch's allocator library, by file name.
pub fn is_allocator_library(name: &std::ffi::OsStr) -> bool {
    name.to_string_lossy().starts_with("libc10_cuda") && name.to_string_lossy().contains(".so")
}

#[cfg(test)]
mod tests;
