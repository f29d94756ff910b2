//! Attaching the recorder's programs: the scheduler's fork and exit hooks
//! (BTF tracepoints, or classic ones through tracefs), and the uprobes on
//! each library's functions, all at once where the kernel can, else one by
//! one; and what a refusal means for the user ([`bpf_error`]).

use anyhow::{Context, Result, bail};
use libbpf_rs::{Link, MapCore, MapFlags, UprobeOpts};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use super::probes::PROBES;
use super::{probes, skel};

/// How processes are followed: the scheduler's fork and exit hooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hooks {
    /// BTF-enabled tracepoints (`tp_btf`), attached by BTF id: no tracefs.
    Btf,
    /// Classic tracepoints, whose ids are read from tracefs (mounted here
    /// when absent). The fallback for kernels that refuse `tp_btf`, and
    /// what `FRAGSCOPE_RECORD_HOOKS=tracepoint` forces.
    Classic,
}

/// Puts the target process in the filter and attaches the fork hook (not
/// with `--all`) and the exit hook.
pub(super) fn attach_hooks(skel: &skel::RecordSkel, hooks: Hooks, target: Option<u32>) -> Result<Vec<Link>> {
    let mut links = Vec::new();
    let (fork, exit) = match hooks {
        Hooks::Btf => (&skel.progs.on_fork_btf, &skel.progs.on_exit_btf),
        Hooks::Classic => {
            ensure_tracefs()?;
            (&skel.progs.on_fork, &skel.progs.on_exit)
        }
    };
    if let Some(target) = target {
        skel.maps.traced.update(&target.to_ne_bytes(), &[1], MapFlags::ANY).map_err(|e| bpf_error("fill", e))?;
        links.push(fork.attach().map_err(|e| bpf_error("attach the fork hook of", e))?);
    }
    links.push(exit.attach().map_err(|e| bpf_error("attach the exit hook of", e))?);
    Ok(links)
}

/// Classic tracepoints are found through tracefs: mounts it at
/// `/sys/kernel/tracing` when neither that nor debugfs's copy is there.
pub(super) fn ensure_tracefs() -> Result<()> {
    const TRACEFS: &str = "/sys/kernel/tracing";
    if Path::new(TRACEFS).join("events").exists() || Path::new("/sys/kernel/debug/tracing/events").exists() {
        return Ok(());
    }
    let (src, target, fstype) = (c"nodev", c"/sys/kernel/tracing", c"tracefs");
    // SAFETY: all three are NUL-terminated strings; no data argument.
    let r = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if r != 0 {
        bail!(
            "this kernel refuses BTF-enabled tracepoints, and the classic ones need tracefs, which is not mounted and \
             could not be mounted at {TRACEFS}: {}. Mount it (`mount -t tracefs nodev {TRACEFS}`) and try again",
            std::io::Error::last_os_error()
        );
    }
    eprintln!("fragscope: tracefs was not mounted; mounted it at {TRACEFS} (the classic tracepoints need it)");
    Ok(())
}

/// The functions of [`PROBES`] that a library defines: where each one's
/// entry probe goes ([`defined_functions`]).
#[derive(Debug, Default)]
pub(super) struct Defined {
    /// Each function's file offset for its probe.
    pub at: HashMap<String, usize>,
    /// Those whose probe goes after the `endbr64` they begin with
    /// ([`super::elf::entry_probe_at`]).
    pub past_endbr64: BTreeSet<String>,
}

/// The functions of [`PROBES`] that `path` defines, each with its offset in
/// the file (where a uprobe goes): the symbol's address, through the
/// loadable segment that holds it, past a leading `endbr64` on x86-64.
/// Versioned names (`cudaMalloc@@libcudart.so.12`) count by their base
/// name.
pub(super) fn defined_functions(path: &Path) -> Result<Defined> {
    let data = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    defined_in(&data).with_context(|| format!("{}: not an ELF file", path.display()))
}

/// [`defined_functions`] of a file's bytes.
pub(super) fn defined_in(data: &[u8]) -> Result<Defined> {
    use object::{Object, ObjectSegment, ObjectSymbol};
    let file = object::File::parse(data)?;
    let offsets = super::elf::FileOffsets::of(&file);
    let x86 = file.architecture() == object::Architecture::X86_64;
    // Of several definitions of a name, the default version's (`f@@V2`;
    // `f@V1` is an older one), then the first (the dynamic, exported
    // symbols come first): (older, address, size).
    let mut chosen: HashMap<&str, (bool, u64, u64)> = HashMap::new();
    for s in file.dynamic_symbols().chain(file.symbols()) {
        if !s.is_definition() || s.kind() != object::SymbolKind::Text {
            continue;
        }
        let Ok(name) = s.name() else { continue };
        let older = name.contains('@') && !name.contains("@@");
        let base = name.split('@').next().unwrap_or(name);
        if !PROBES.iter().any(|p| p.symbol == base) || offsets.at(s.address()).is_none() {
            continue;
        }
        // Kept unless an older version's was kept and this is the default.
        let replace = chosen.get(base).is_none_or(|&(was_older, ..)| was_older && !older);
        if replace {
            chosen.insert(base, (older, s.address(), s.size()));
        }
    }
    let mut defined = Defined::default();
    for (name, (_, addr, size)) in chosen {
        let code = file.segments().find_map(|s| s.data_range(addr, size).ok().flatten());
        let site = match code {
            Some(code) if x86 => super::elf::entry_probe_at(code, addr),
            _ => addr,
        };
        let Some(at) = offsets.at(site) else { continue };
        if site != addr {
            defined.past_endbr64.insert(name.to_string());
        }
        defined.at.insert(name.to_string(), at);
    }
    Ok(defined)
}

/// Two links for the file: every wanted function's entry, and the return of
/// those not written at entry ([`probes::at_entry`]).
/// The probes go at the offsets read from the file ([`defined_functions`]),
/// not by name: libbpf's own lookup of the names refused NVIDIA's runtime
/// from PyPI (ENOENT), and probing each function on its own instead made
/// detaching cost 80 ms a probe (2.8 s for one library).
pub(super) fn attach_multi(
    skel: &skel::RecordSkel,
    path: &Path,
    wanted: &[usize],
    defined: &Defined,
) -> Result<Vec<Link>> {
    // Each function's offset and cookie, from one list so they stay paired.
    let sites = |retprobe: bool| -> libbpf_rs::UprobeMultiOpts {
        let (offsets, cookies) = wanted
            .iter()
            .filter(|&&i| !(retprobe && probes::at_entry(i)))
            .filter_map(|&i| Some((*defined.at.get(PROBES[i].symbol)?, probes::cookie(i))))
            .unzip();
        libbpf_rs::UprobeMultiOpts { offsets, cookies, retprobe, ..Default::default() }
    };
    let mut links = vec![skel.progs.on_entry_multi.attach_uprobe_multi_with_opts(-1, path, "", sites(false))?];
    let returns = sites(true);
    if !returns.offsets.is_empty() {
        links.push(skel.progs.on_return_multi.attach_uprobe_multi_with_opts(-1, path, "", returns)?);
    }
    Ok(links)
}

/// Two links per function (kernels before 6.6).
pub(super) fn attach_each(
    skel: &skel::RecordSkel,
    path: &Path,
    wanted: &[usize],
    defined: &Defined,
) -> Result<Vec<Link>> {
    let mut links = Vec::with_capacity(wanted.len() * 2);
    for &i in wanted {
        for (prog, retprobe) in [(&skel.progs.on_entry, false), (&skel.progs.on_return, true)] {
            if retprobe && probes::at_entry(i) {
                continue;
            }
            let symbol = PROBES[i].symbol;
            // At the offset read from the file, as the multi-probe: not by
            // name, which libbpf's lookup refused for NVIDIA's PyPI runtime.
            let Some(&at) = defined.at.get(symbol) else { continue };
            let o = UprobeOpts { cookie: probes::cookie(i), retprobe, ..Default::default() };
            let link = prog
                .attach_uprobe_with_opts(-1, path, at, o)
                .map_err(|e| bpf_error(&format!("attach {symbol} in {} with", path.display()), e))?;
            links.push(link);
        }
    }
    Ok(links)
}

pub(super) fn bpf_error(what: &str, e: libbpf_rs::Error) -> anyhow::Error {
    let denied = matches!(e.kind(), libbpf_rs::ErrorKind::PermissionDenied)
        || e.to_string().contains("Operation not permitted")
        || e.to_string().contains("Permission denied");
    if denied {
        anyhow::anyhow!(
            "cannot {what} the eBPF recorder: permission denied. `fragscope record` needs root, or the CAP_BPF \
             and CAP_PERFMON capabilities (run it with sudo) ({e})"
        )
    } else {
        anyhow::anyhow!("cannot {what} the eBPF recorder: {e}")
    }
}

/// How PyTorch's allocations are seen in a library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AllocatorProbes {
    /// Through PyTorch's static probe's own arguments: one trap a tensor.
    StaticArguments,
    /// `malloc`'s entry, then PyTorch's static probe after the call.
    StaticProbe,
    /// `malloc`'s entry, then the instruction after each call.
    AfterCall,
}

/// PyTorch's allocator in `path` ([`super::torch`]): where the plan can,
/// PyTorch's static probe with its own arguments ([`attach_static_arguments`]);
/// else (or when that is refused) its malloc's and frees' entries, and
/// plain uprobes after each call to malloc (no return probes: they would
/// stop its out-of-memory exception), one of them on PyTorch's static
/// probe where the plan has it. Also says which.
pub(super) fn attach_allocator(
    skel: &skel::RecordSkel,
    path: &Path,
    plan: &super::torch::Plan,
    multi: bool,
) -> Result<(Vec<Link>, AllocatorProbes)> {
    if plan.static_args.is_some() {
        match attach_static_arguments(skel, path, plan, multi) {
            Ok(links) => return Ok((links, AllocatorProbes::StaticArguments)),
            Err(e) => tracing::info!(
                "{}: PyTorch's static probe's arguments not read ({e:#}); malloc's entry probed instead",
                path.display()
            ),
        }
    }
    attach_entries(skel, path, plan, multi)
        .map(|(links, used)| (links, if used { AllocatorProbes::StaticProbe } else { AllocatorProbes::AfterCall }))
}

/// The allocator with its allocations read from PyTorch's static probe's
/// arguments ([`super::torch::StaticArgs`]), through libbpf's USDT support
/// (which reads the note's argument places and raises the semaphore):
/// malloc's entry is not probed. In this order, so that a `--pid` attach
/// never half-sees a call: the calls without the cache (which the static
/// probe must skip), the probes after the other calls to malloc, the
/// probes on those calls, on the out-of-memory reports and on the frees,
/// and the static probe last (a tensor allocated before it and freed after
/// is a free of an unknown block, left out; the other way round it would
/// be a block never freed).
fn attach_static_arguments(
    skel: &skel::RecordSkel,
    path: &Path,
    plan: &super::torch::Plan,
    multi: bool,
) -> Result<Vec<Link>> {
    use super::torch::Role;
    let (Some(args), Some(sp)) = (&plan.static_args, &plan.static_probe) else {
        bail!("no static probe's arguments planned")
    };
    let malloc = probes::cookie(probes::torch_probe(Role::Malloc));
    let landed = malloc | probes::COOKIE_LANDED;
    let uncached: Vec<(usize, u64)> = args
        .uncached
        .iter()
        .map(|&(at, arg)| {
            let which = if arg == 1 { probes::COOKIE_OUT_ARG1 } else { 0 };
            (at, (malloc & !probes::COOKIE_OUT_ARG1) | probes::COOKIE_UNCACHED | which)
        })
        .collect();
    let landings: Vec<(usize, u64)> =
        plan.landings.iter().filter(|&&at| at != sp.replaces).map(|&at| (at, landed)).collect();
    let mut entries: Vec<(usize, u64)> = args.calls.iter().map(|&at| (at, malloc | probes::COOKIE_CALL_SITE)).collect();
    entries.extend(args.oom_reports.iter().map(|&at| (at, malloc | probes::COOKIE_OOM_REPORT)));
    entries.extend(plan.frees.iter().map(|(f, role)| (f.offset, probes::cookie(probes::torch_probe(*role)))));
    let attach = |multi_prog: &libbpf_rs::ProgramMut, prog: &libbpf_rs::ProgramMut, sites: &[(usize, u64)]| {
        let sites: Vec<Site> = sites.iter().map(|&(at, cookie)| (at, cookie, 0)).collect();
        if sites.is_empty() {
            Ok(Vec::new())
        } else if multi {
            attach_sites(multi_prog, path, &sites).map(|l| vec![l])
        } else {
            sites.iter().map(|&site| attach_site(prog, path, site)).collect::<std::result::Result<Vec<_>, _>>()
        }
    };
    let p = &skel.progs;
    let mut links = attach(&p.on_entry_multi, &p.on_entry, &uncached)?;
    links.extend(attach(&p.on_landed_multi, &p.on_landed, &landings)?);
    links.extend(attach(&p.on_entry_multi, &p.on_entry, &entries)?);
    let usdt = libbpf_rs::UsdtOpts { cookie: landed, ..Default::default() };
    links.push(p.on_static_malloc.attach_usdt_with_opts(-1, path, "pytorch", "malloc", usdt)?);
    Ok(links)
}

/// A plain uprobe site: file offset, cookie, and the offset of a semaphore
/// the kernel raises while it is attached (0: none).
type Site = (usize, u64, usize);

/// One multi-uprobe link (no return probes) for every site of `path`.
fn attach_sites(prog: &libbpf_rs::ProgramMut, path: &Path, sites: &[Site]) -> libbpf_rs::Result<Link> {
    let opts = libbpf_rs::UprobeMultiOpts {
        offsets: sites.iter().map(|s| s.0).collect(),
        cookies: sites.iter().map(|s| s.1).collect(),
        ref_ctr_offsets: sites.iter().map(|s| s.2).collect(),
        retprobe: false,
        ..Default::default()
    };
    prog.attach_uprobe_multi_with_opts(-1, path, "", opts)
}

/// A classic uprobe (no return probe) on one site of `path`.
fn attach_site(prog: &libbpf_rs::ProgramMut, path: &Path, (at, cookie, semaphore): Site) -> libbpf_rs::Result<Link> {
    let o = UprobeOpts { cookie, retprobe: false, ref_ctr_offset: semaphore, ..Default::default() };
    prog.attach_uprobe_with_opts(-1, path, at, o)
}

/// The allocator through malloc's entry and the probes after its calls.
fn attach_entries(
    skel: &skel::RecordSkel,
    path: &Path,
    plan: &super::torch::Plan,
    multi: bool,
) -> Result<(Vec<Link>, bool)> {
    use super::torch::Role;
    let malloc = probes::cookie(probes::torch_probe(Role::Malloc));
    let mut entries = vec![(plan.malloc.offset, malloc)];
    entries.extend(plan.frees.iter().map(|(f, role)| (f.offset, probes::cookie(probes::torch_probe(*role)))));
    // (offset, cookie, semaphore): the static probe where there is one,
    // else the instruction after the call.
    let landed = malloc | probes::COOKIE_LANDED;
    let landings = |use_static: bool| -> Vec<Site> {
        plan.landings
            .iter()
            .map(|&at| match &plan.static_probe {
                Some(p) if use_static && p.replaces == at => (p.offset, landed, p.semaphore),
                _ => (at, landed, 0),
            })
            .collect()
    };
    // The static probe refused (its semaphore): the call's return instead.
    let refused = |e: &libbpf_rs::Error| {
        tracing::info!("{}: PyTorch's static probe not attached ({e}); the call's return probed", path.display())
    };
    if multi {
        let attach = |prog: &libbpf_rs::ProgramMut, sites: &[Site]| attach_sites(prog, path, sites);
        let entries: Vec<Site> = entries.iter().map(|&(at, c)| (at, c, 0)).collect();
        // The landings with the static probe, else without it (its
        // semaphore refused), before one probe per site.
        let attach_landings = || match attach(&skel.progs.on_landed_multi, &landings(true)) {
            Ok(l) => Ok((l, plan.static_probe.is_some())),
            Err(e) if plan.static_probe.is_some() => {
                refused(&e);
                attach(&skel.progs.on_landed_multi, &landings(false)).map(|l| (l, false))
            }
            Err(e) => Err(e),
        };
        // The landings first: one without its entry does nothing, but an
        // entry without its landing would leave a call in flight that the
        // thread's next one writes as an OOM (a `--pid` attach).
        match attach_landings().and_then(|(b, used)| attach(&skel.progs.on_entry_multi, &entries).map(|a| (a, b, used)))
        {
            Ok((a, b, used)) => return Ok((vec![b, a], used)),
            Err(e) => tracing::info!("{}: multi-uprobe attach failed ({e}); one probe per site", path.display()),
        }
    }
    let attach = |prog: &libbpf_rs::ProgramMut, site: Site| attach_site(prog, path, site);
    let error = |e| bpf_error(&format!("attach PyTorch's allocator in {} with", path.display()), e);
    // The landings first (see above).
    let mut links = Vec::new();
    let mut used_static = false;
    for (site, plain) in landings(true).into_iter().zip(landings(false)) {
        if site == plain {
            links.push(attach(&skel.progs.on_landed, site).map_err(error)?);
            continue;
        }
        // A kernel that refuses to raise the semaphore (`ref_ctr_offset`)
        // refuses the static probe: the instruction after the call then.
        match attach(&skel.progs.on_landed, site) {
            Ok(l) => {
                links.push(l);
                used_static = true;
            }
            Err(e) => {
                refused(&e);
                links.push(attach(&skel.progs.on_landed, plain).map_err(error)?);
            }
        }
    }
    for &(at, cookie) in &entries {
        links.push(attach(&skel.progs.on_entry, (at, cookie, 0)).map_err(error)?);
    }
    Ok((links, used_static))
}
