//! `fragscope record` (SPEC §9): uprobes on the CUDA runtime and driver,
//! a BPF ring buffer, and a writer that turns the records into a trace
//! directory part by part.
//!
//! - What is probed and how records decode: [`probes`]. Which files:
//!   [`libs`].
//! - Processes: a BPF hash of traced tgids. The spawned command (or
//!   `--pid`) is put in before it runs; a hook on `sched_process_fork`
//!   adds the children of traced processes, so DataLoader workers and
//!   `torchrun` ranks are followed. `--all` skips the filter. A hook on
//!   `sched_process_exit` writes an `exit` event when the last thread of a
//!   process that made a recorded call ends (the driver then frees what it
//!   held; the replay releases it).
//! - The hooks are BTF-enabled tracepoints (`tp_btf`), which need no
//!   tracefs; kernels that refuse them get classic tracepoints, and tracefs
//!   is mounted for those when it is absent. Uprobes need no tracefs. The
//!   recorder needs kernel BTF (CO-RE) either way.
//! - The command is forked here and waits on a pipe until every probe is
//!   attached, so its first call is recorded.
//! - Parts rotate every `--part-interval` or `--part-events` (each a
//!   complete Parquet file), so a `kill -9` of the recorder loses at most
//!   the last interval. `trace.json` is written at the end; a trace
//!   without it still analyses.
//! - The `/proc/PID/maps` of every process seen is kept under `maps/`,
//!   so the analysis can name kernel launches and `--stacks` frames
//!   ([`crate::trace::symbols`]).
//!
//! The files: [`libs`] (which libraries), [`probes`] (the probe table),
//! [`attach`], [`process`]; this module runs a recording.

mod attach;
mod elf;
mod finish;
mod gpus;
mod kernels;
pub mod libs;
pub mod probes;
mod process;
pub(crate) mod skel;
pub mod torch;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, RingBufferBuilder};

use self::attach::{
    AllocatorProbes, Hooks, attach_allocator, attach_each, attach_hooks, attach_multi, bpf_error, defined_functions,
};
use self::finish::{finish, programs_cost, save_stacks};
use self::process::{
    MapsKeeper, Paused, STOP_SIGNAL, alive, install_signal_handlers, mono_to_wall_offset, own_cpu_seconds, sudo_owner,
};
use crate::trace::details::{Details, ProgramCost, ReaderStats, RecordDetails};
use crate::trace::event::Event;
use crate::trace::{Source, TraceMeta, TraceWriter};
use libs::Library;
use probes::{Group, PROBES};

/// What `fragscope record` was asked to do.
#[derive(Clone, Debug)]
pub struct Options {
    pub output: PathBuf,
    pub libs: Vec<PathBuf>,
    pub all: bool,
    pub pid: Option<u32>,
    pub command: Vec<OsString>,
    pub duration: Option<Duration>,
    pub launch: bool,
    pub memcpy: bool,
    pub stacks: bool,
    /// Probe PyTorch's caching allocator where found (`--no-torch` turns
    /// it off).
    pub torch: bool,
    pub part_events: usize,
    pub part_interval: Duration,
    pub buffer_bytes: u64,
}

/// Why the recording ended.
#[derive(Debug)]
enum End {
    CommandExited(i32),
    PidExited,
    Signal(i32),
    Duration,
}

/// Records until the command or process exits, the duration passes or a
/// SIGINT/SIGTERM arrives; returns the exit code for `fragscope` (the
/// command's, when it ran to its end).
pub fn run(opts: &Options) -> Result<u8> {
    let started = Instant::now();
    if opts.pid.is_none() && opts.command.is_empty() && !opts.all {
        bail!("nothing to record: give a command after `--`, --pid PID, or --all");
    }
    if opts.pid.is_some() && !opts.command.is_empty() {
        bail!("give either --pid or a command, not both");
    }
    if let Some(pid) = opts.pid
        && !Path::new(&format!("/proc/{pid}")).exists()
    {
        bail!("--pid {pid}: no such process");
    }
    let libraries =
        if opts.libs.is_empty() { libs::discover(&opts.command, opts.pid) } else { libs::explicit(&opts.libs)? };
    if libraries.is_empty() {
        bail!(
            "no CUDA library found to probe (looked for libcudart.so* and libcuda.so* in $CUDA_HOME, $CUDA_PATH, \
             $LD_LIBRARY_PATH, /usr/local/cuda*, the dynamic linker cache and the site-packages of python3{}). \
             Name the library with --lib PATH, or the executable when the runtime is linked into it (nvcc's default).",
            if opts.pid.is_some() { ", and the process's own mappings" } else { "" }
        );
    }

    let mut meta = TraceMeta::new(Source::Ebpf);
    meta.command = opts.command.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    meta.mono_to_wall_offset_ns = Some(mono_to_wall_offset());
    let mut writer = TraceWriter::create(&opts.output, meta, opts.part_events)?;
    writer.set_zstd_level(1);
    if let Some((uid, gid)) = sudo_owner() {
        writer.set_owner(uid, gid)?;
    }

    let mut child = if opts.command.is_empty() { None } else { Some(Paused::spawn(&opts.command)?) };
    let result = record(opts, &libraries, &mut writer, child.as_mut(), started);
    match result {
        Ok((end, attached)) => finish(opts, writer, end, &attached, started),
        Err(e) => {
            if let Some(c) = child {
                c.abandon();
            }
            writer.abandon();
            Err(e)
        }
    }
}

/// A library and the functions probed in it.
struct Attached {
    library: Library,
    functions: Vec<String>,
    /// How many of the probed entries are after an `endbr64`
    /// ([`elf::entry_probe_at`]).
    past_endbr64: usize,
    /// PyTorch's allocator, when probed in this library.
    allocator: Option<torch::Plan>,
}

fn record(
    opts: &Options,
    libraries: &[Library],
    writer: &mut TraceWriter,
    mut child: Option<&mut Paused>,
    started: Instant,
) -> Result<(End, Vec<Attached>)> {
    // The devices as the driver sees them before the probes go in.
    let driver = gpus::Driver::open();
    let gpus_at_start = driver.sample();
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, |level, msg| {
        let msg = msg.trim_end();
        match level {
            libbpf_rs::PrintLevel::Warn => tracing::debug!(target: "libbpf", "{msg}"),
            _ => tracing::trace!(target: "libbpf", "{msg}"),
        }
    })));
    let target = match (&child, opts.pid) {
        _ if opts.all => None,
        (Some(c), _) => Some(c.pid as u32),
        (None, pid) => pid,
    };
    // Multi-uprobes need Linux 6.6; BTF-enabled tracepoints need no tracefs
    // but are refused by some kernels. Try the best combination first.
    let forced_classic = std::env::var("FRAGSCOPE_RECORD_HOOKS").as_deref() == Ok("tracepoint");
    // One uprobe per function, as on kernels before 6.6 (for tests).
    let forced_single = std::env::var("FRAGSCOPE_RECORD_UPROBES").as_deref() == Ok("single");
    let attempts: Vec<(Hooks, bool)> =
        [(Hooks::Btf, true), (Hooks::Btf, false), (Hooks::Classic, true), (Hooks::Classic, false)]
            .into_iter()
            .filter(|(h, _)| !forced_classic || *h == Hooks::Classic)
            .filter(|(_, multi)| !forced_single || !multi)
            .collect();
    let mut objects: [MaybeUninit<libbpf_rs::OpenObject>; 4] = [const { MaybeUninit::uninit() }; 4];
    let mut loaded = None;
    let mut failures = Vec::new();
    for (object, &(hooks, multi)) in objects.iter_mut().zip(&attempts) {
        match open_and_load(opts, object, multi, hooks).and_then(|skel| {
            let links = attach_hooks(&skel, hooks, target)?;
            Ok((skel, links))
        }) {
            Ok((skel, links)) => {
                loaded = Some((skel, links, multi, hooks));
                break;
            }
            Err(e) => {
                tracing::info!("{hooks:?} process hooks with multi-uprobes {multi}: {e:#}");
                failures.push(e);
            }
        }
    }
    let Some((skel, mut links, multi, hooks)) = loaded else {
        // The last attempt is the most conservative one; its error says most.
        return Err(failures.pop().expect("at least one attempt"));
    };
    tracing::info!("process hooks: {hooks:?}; multi-uprobes: {multi}");
    let mut skel = skel;

    let mut attached = Vec::new();
    for lib in libraries {
        let defined = match defined_functions(&lib.path) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("{}: {e:#}; not probed", lib.path.display());
                continue;
            }
        };
        let mut allocator = if opts.torch { allocator_plan(lib) } else { None };
        let mut lib_links = Vec::new();
        if let Some(plan) = &mut allocator {
            match attach_allocator(&skel, &lib.path, plan, multi) {
                Ok((l, how)) => {
                    lib_links.extend(l);
                    if how != AllocatorProbes::StaticArguments {
                        plan.static_args = None;
                    }
                    if how == AllocatorProbes::AfterCall {
                        plan.static_probe = None;
                    }
                }
                Err(e) => {
                    eprintln!(
                        "fragscope: {}: PyTorch's allocator not probed: {e:#}. Its segments are recorded as usual.",
                        lib.path.display()
                    );
                    allocator = None;
                }
            }
        }
        let wanted: Vec<usize> = PROBES
            .iter()
            .enumerate()
            .filter(|(_, p)| match p.group {
                Group::Memory => true,
                Group::Memcpy => opts.memcpy,
                Group::Launch => opts.launch,
                Group::Torch => false,
                Group::TorchRuntime => opts.torch,
            })
            .filter(|(_, p)| defined.at.contains_key(p.symbol))
            .map(|(i, _)| i)
            .collect();
        if wanted.is_empty() && allocator.is_none() {
            tracing::info!("{}: defines none of the probed CUDA functions; not probed", lib.path.display());
            continue;
        }
        if !wanted.is_empty() {
            lib_links.extend(match multi.then(|| attach_multi(&skel, &lib.path, &wanted, &defined)) {
                Some(Ok(l)) => l,
                Some(Err(e)) => {
                    tracing::info!(
                        "{}: multi-uprobe attach failed ({e:#}); one probe per function",
                        lib.path.display()
                    );
                    attach_each(&skel, &lib.path, &wanted, &defined)?
                }
                None => attach_each(&skel, &lib.path, &wanted, &defined)?,
            });
        }
        links.extend(lib_links);
        let mut functions: Vec<String> = wanted.iter().map(|&i| PROBES[i].symbol.to_string()).collect();
        let mut past_endbr64 = wanted.iter().filter(|&&i| defined.past_endbr64.contains(PROBES[i].symbol)).count();
        if let Some(plan) = &allocator {
            functions.push(plan.malloc.name.clone());
            functions.extend(plan.frees.iter().map(|(f, _)| f.name.clone()));
            // malloc's entry is probed unless its allocations are read
            // from PyTorch's static probe.
            let malloc = plan.static_args.is_none().then_some(&plan.malloc);
            past_endbr64 +=
                malloc.into_iter().chain(plan.frees.iter().map(|(f, _)| f)).filter(|f| f.past_endbr64).count();
        }
        attached.push(Attached { library: lib.clone(), functions, past_endbr64, allocator });
    }
    if attached.is_empty() {
        let list: Vec<String> = libraries.iter().map(|l| l.path.display().to_string()).collect();
        bail!(
            "none of the probed CUDA functions is defined in {} (a stripped executable? name the library with --lib)",
            list.join(", ")
        );
    }

    let bss = skel.maps.bss_data.as_deref_mut().context("the BPF object has no .bss")?;
    let (stopping, woken): (*mut u8, *mut u64) = (&mut bss.stopping, &mut bss.woken);
    let wakeups: *const u64 = &bss.wakeups;

    // The ring buffer's callback only queues; the loop below writes.
    // As long as a read can be (pages are taken as it fills).
    let queue = Rc::new(RefCell::new(Vec::<Event>::with_capacity(READ_BATCH)));
    let bad = Rc::new(RefCell::new(0u64));
    // Kernel names are read from the process at once, while it runs.
    let kernels: Rc<RefCell<kernels::Kernels>> = Rc::default();
    let mut devices = probes::Devices::default();
    let mut blocks = probes::TorchBlocks::default();
    let mut rb = RingBufferBuilder::new();
    {
        let (queue, bad, kernels) = (queue.clone(), bad.clone(), kernels.clone());
        rb.add(&skel.maps.events, move |data: &[u8]| {
            match probes::Raw::parse(data) {
                Some(r) => {
                    if let Some(k) = r.kernel() {
                        kernels.borrow_mut().add(k);
                    } else if let Some(d) = r.device() {
                        devices.apply(d);
                    } else {
                        match r.decode() {
                            Some(mut e) => {
                                use crate::trace::event::EventKind::{AllocHost, Exit, FreeHost};
                                blocks.apply(&mut e);
                                if e.device.is_none() && !matches!(e.kind, Exit | AllocHost | FreeHost) {
                                    e.device = Some(devices.of(e.tid));
                                }
                                queue.borrow_mut().push(e)
                            }
                            None => *bad.borrow_mut() += 1,
                        }
                    }
                }
                None => *bad.borrow_mut() += 1,
            }
            0
        })
        .map_err(|e| bpf_error("read the ring buffer of", e))?;
    }
    let rb = rb.build().map_err(|e| bpf_error("read the ring buffer of", e))?;

    install_signal_handlers();
    if let Some(c) = child.as_deref_mut() {
        c.release()?;
    }
    let probed: Vec<String> = attached.iter().map(|a| a.library.path.display().to_string()).collect();
    match (&child, opts.pid) {
        (Some(c), _) => eprintln!("fragscope: recording pid {} ({}); probing {}", c.pid, c.name, probed.join(", ")),
        (None, Some(pid)) => {
            eprintln!("fragscope: recording pid {pid} and its children; probing {}", probed.join(", "))
        }
        (None, None) => eprintln!("fragscope: recording every process; probing {}", probed.join(", ")),
    }

    let mut maps = MapsKeeper::new(writer.dir());
    // The spawned command has the recorder's environment: known now, even if
    // it exits before its first call is read.
    if let Some(c) = child.as_deref() {
        maps.keep_env(c.pid as u32, |name| std::env::var(name).ok());
    }
    // The queue's other buffer: the two swap at each read, and each keeps
    // its capacity. (A new queue each read grew from nothing into fresh
    // pages every time: a third of the machine's time went to zeroing them
    // when the reader fell behind, which made it fall further behind.)
    let mut spare = Vec::with_capacity(READ_BATCH);
    let mut used_stacks = BTreeSet::new();
    let mut devices_used: BTreeMap<u32, BTreeSet<i32>> = BTreeMap::new();
    let mut last_part = Instant::now();
    let deadline = opts.duration.map(|d| Instant::now() + d);
    // More events waiting than one batch took.
    let mut behind = false;
    let mut reader = ReaderStats::default();
    let end = loop {
        if !behind {
            wait_for_events(&rb, Duration::from_millis(50))?;
        }
        behind = read_batch(&rb)?;
        reader.reads += 1;
        reader.behind += u64::from(behind);
        // Read: the next backlog past the threshold may wake the reader again.
        // SAFETY: `woken` points into the BPF object's mapped .bss.
        unsafe { std::ptr::write_volatile(woken, 0) };
        drain(&queue, &mut spare, writer, &mut maps, &mut used_stacks, &mut devices_used)?;
        if writer.buffered() > 0 && last_part.elapsed() >= opts.part_interval {
            writer.flush_part()?;
            maps.refresh();
            if !gpus_at_start.is_empty() {
                // The parts written so far (full ones flush on their own);
                // a sample that cannot be written costs a warning, not the
                // recording.
                let parts = writer.meta_mut().parts;
                if let Err(e) = gpus::append_sample(writer.dir(), parts, monotonic_ns(), &driver.sample()) {
                    tracing::warn!("{e:#}");
                }
            }
            last_part = Instant::now();
        }
        let sig = STOP_SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            break End::Signal(sig);
        }
        if let Some(c) = child.as_deref_mut()
            && let Some(code) = c.try_wait()?
        {
            break End::CommandExited(code);
        }
        if let Some(pid) = opts.pid
            && !alive(pid)
        {
            break End::PidExited;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break End::Duration;
        }
    };
    // A clean cut: no call entered from now on is recorded; calls in
    // flight are given 200 ms to return. Then detach, and take what is
    // still in the buffer.
    // SAFETY: `stopping` points into the BPF object's mapped .bss.
    unsafe { std::ptr::write_volatile(stopping, 1) };
    let settle = Instant::now();
    // (Level 3 is a thread's last free-memory figure, kept for an OOM
    // report: no call in flight.)
    let level = |key: &[u8]| key.get(..8).map(|k| u64::from_ne_bytes(k.try_into().unwrap_or_default()) >> 32);
    while skel.maps.inflight.keys().any(|k| level(&k) != Some(3)) && settle.elapsed() < Duration::from_millis(200) {
        // Reading meanwhile: a reader that was behind leaves the buffer
        // nearly full, and the calls that return now need room in it.
        if !read_batch(&rb)? {
            std::thread::sleep(Duration::from_millis(5));
        }
        drain(&queue, &mut spare, writer, &mut maps, &mut used_stacks, &mut devices_used)?;
    }
    detach(links);
    while read_batch(&rb)? {
        drain(&queue, &mut spare, writer, &mut maps, &mut used_stacks, &mut devices_used)?;
    }
    // Allocations still in flight never returned: out-of-memory errors of
    // threads that made no allocator call since (and have not exited).
    for key in skel.maps.inflight.keys() {
        if key.len() == 8
            && level(&key) == Some(2)
            && let Ok(Some(v)) = skel.maps.inflight.lookup(&key, MapFlags::ANY)
            && let Some(mut r) = probes::Raw::parse(&v)
        {
            r.cookie.0 |= skel::types::cookie_bits::COOKIE_UNRETURNED.0;
            if let Some(e) = r.decode() {
                queue.borrow_mut().push(e);
            }
        }
    }
    drain(&queue, &mut spare, writer, &mut maps, &mut used_stacks, &mut devices_used)?;
    let mut lost = 0u64;
    if let Some(per_cpu) =
        skel.maps.lost.lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY).map_err(|e| bpf_error("read", e))?
    {
        lost = per_cpu.iter().map(|v| u64::from_ne_bytes(v[..8].try_into().unwrap_or_default())).sum();
    }
    if opts.stacks {
        save_stacks(&skel, writer, &used_stacks)?;
    }
    drop(rb);
    Rc::try_unwrap(kernels).map(RefCell::into_inner).unwrap_or_default().write(writer)?;
    // Files beside the parts go to the sudo user too.
    if let Ok(rd) = std::fs::read_dir(writer.dir().join("maps")) {
        writer.chown(&writer.dir().join("maps"))?;
        for e in rd.filter_map(|e| e.ok()) {
            writer.chown(&e.path())?;
        }
    }
    if !gpus_at_start.is_empty() {
        let parts = writer.meta_mut().parts;
        match gpus::append_sample(writer.dir(), parts, monotonic_ns(), &driver.sample()) {
            Ok(()) => writer.chown(&writer.dir().join(gpus::GPUS_FILE))?,
            Err(e) => tracing::warn!("{e:#}"),
        }
    }
    let bad = *bad.borrow();
    let m = writer.meta_mut();
    m.lost_events = lost;
    m.capacity_bytes = gpus::capacity(&gpus_at_start);
    m.details = Details::Record(RecordDetails {
        undecodable_records: bad,
        recording_s: started.elapsed().as_secs_f64(),
        maps: maps.saved(),
        visible_devices: maps.visible.iter().map(|(pid, v)| (pid.to_string(), v.clone())).collect(),
        allocator_conf: maps.alloc_conf.iter().map(|(pid, v)| (pid.to_string(), v.clone())).collect(),
        allocator_env: maps.alloc_env.iter().map(|(pid, v)| (pid.to_string(), v.clone())).collect(),
        torch_versions: maps.torch_versions.iter().map(|(pid, v)| (pid.to_string(), v.clone())).collect(),
        gpus: gpus_at_start,
        nvml: driver.unavailable.clone(),
        devices: devices_used.into_iter().map(|(pid, d)| (pid.to_string(), d.into_iter().collect())).collect(),
        launches_at_entry: opts.launch,
        unprobed_libraries: libs::unprobed(&maps.saved, libraries, opts.torch),
        // SAFETY: `wakeups` points into the BPF object's mapped .bss.
        reader: Some(ReaderStats { wakeups: unsafe { std::ptr::read_volatile(wakeups) }, ..reader }),
        bpf_programs: programs_cost(&skel),
        ..RecordDetails::default()
    });
    Ok((end, attached))
}

/// Drops the links from many threads at once. Each classic uprobe waits
/// for an RCU grace period (about 0.1 s here) when unregistered: one after
/// the other, 42 took 4.7 s; from 64 threads, 3.5 s. Multi-uprobe links
/// (two per file) take about 0.12 s in all, so this matters only for the
/// classic fallback on kernels before 6.6.
fn detach(links: Vec<Link>) {
    let started = Instant::now();
    let n = links.len();
    let chunk = n.div_ceil(64).max(1);
    let mut links = links;
    std::thread::scope(|s| {
        while !links.is_empty() {
            let rest = links.split_off(links.len().saturating_sub(chunk));
            s.spawn(move || drop(rest));
        }
    });
    tracing::info!("detached {n} probe links in {:.3} s", started.elapsed().as_secs_f64());
}

fn open_and_load<'o>(
    opts: &Options,
    object: &'o mut MaybeUninit<libbpf_rs::OpenObject>,
    multi: bool,
    hooks: Hooks,
) -> Result<skel::RecordSkel<'o>> {
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        bail!(
            "this kernel has no BTF (/sys/kernel/btf/vmlinux is missing); the eBPF recorder reads kernel structures \
             through it (CO-RE). Use a kernel built with CONFIG_DEBUG_INFO_BTF=y, as the stock kernels of Debian 11+, \
             Ubuntu 20.10+, RHEL 8.2+ and Fedora 31+ are"
        );
    }
    let mut open = skel::RecordSkelBuilder::default().open(object).map_err(|e| bpf_error("open", e))?;
    if !multi {
        open.progs.on_entry_multi.set_autoload(false);
        open.progs.on_return_multi.set_autoload(false);
        open.progs.on_landed_multi.set_autoload(false);
    }
    match hooks {
        Hooks::Btf => {
            open.progs.on_fork.set_autoload(false);
            open.progs.on_exit.set_autoload(false);
        }
        Hooks::Classic => {
            open.progs.on_fork_btf.set_autoload(false);
            open.progs.on_exit_btf.set_autoload(false);
        }
    }
    let rodata = open.maps.rodata_data.as_deref_mut().context("the BPF object has no read-only data")?;
    rodata.trace_all = opts.all as u8;
    rodata.want_stacks = opts.stacks as u8;
    let ring = opts.buffer_bytes.clamp(1 << 16, 1 << 30).next_power_of_two();
    rodata.wakeup_bytes = ring / 4;
    open.maps.events.set_max_entries(ring as u32).map_err(|e| bpf_error("size the ring buffer of", e))?;
    let stack_slots = if opts.stacks { 16384 } else { 1 };
    open.maps.stacks.set_max_entries(stack_slots).map_err(|e| bpf_error("size the stack map of", e))?;
    open.load().map_err(|e| bpf_error("load", e))
}

/// The most events one read takes from the ring buffer. `record` then
/// writes them and checks for a stop before it reads on: a read that went
/// on while events came (libbpf's `consume` does) could last the whole
/// run when the program made events faster than the reader wrote them,
/// holding every event in memory (230 bytes each) and answering no signal.
const READ_BATCH: usize = 1 << 16;

/// Reads at most [`READ_BATCH`] events into the queue; says whether more
/// were waiting.
fn read_batch(rb: &libbpf_rs::RingBuffer) -> Result<bool> {
    let n = rb.consume_raw_n(READ_BATCH);
    if n < 0 {
        return Err(bpf_error("read the ring buffer of", libbpf_rs::Error::from_raw_os_error(-n)));
    }
    Ok(n as usize >= READ_BATCH)
}

/// Waits until the BPF side wakes the reader (a new process's first event,
/// or a backlog past a quarter of the buffer), a signal arrives, or
/// `timeout` passes. Once woken, the ring stays ready (level-triggered) as
/// long as each wait finds events in it: a reader that has been woken
/// reads on without sleeping until it finds the buffer empty. Reads
/// nothing: [`read_batch`] does.
fn wait_for_events(rb: &libbpf_rs::RingBuffer, timeout: Duration) -> Result<()> {
    let mut fd = libc::pollfd { fd: rb.epoll_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd, valid for the call.
    if unsafe { libc::poll(&mut fd, 1, timeout.as_millis().try_into().unwrap_or(i32::MAX)) } < 0 {
        let e = std::io::Error::last_os_error();
        // A signal: the caller checks for a stop.
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(bpf_error("poll the ring buffer of", e.into()));
        }
    }
    Ok(())
}

fn drain(
    queue: &RefCell<Vec<Event>>,
    spare: &mut Vec<Event>,
    writer: &mut TraceWriter,
    maps: &mut MapsKeeper,
    stacks: &mut BTreeSet<(u32, u32)>,
    devices: &mut BTreeMap<u32, BTreeSet<i32>>,
) -> Result<()> {
    std::mem::swap(&mut *queue.borrow_mut(), spare);
    for e in spare.drain(..) {
        if let Some(d) = e.device {
            devices.entry(e.pid).or_default().insert(d);
        }
        // The ring buffer is in submit order, not quite time order.
        let m = writer.meta_mut();
        let wall = e.ts_ns.saturating_add_signed(m.mono_to_wall_offset_ns.unwrap_or(0));
        m.start_wall_ns = Some(m.start_wall_ns.map_or(wall, |w| w.min(wall)));
        maps.saw(e.pid);
        if let Some(id) = e.cuda.ustack {
            stacks.insert((id, e.pid));
        }
        writer.push(e)?;
    }
    Ok(())
}

/// PyTorch's allocator in `lib`, when it has one this recorder can probe;
/// a library that looks like it but cannot be probed is said so.
fn allocator_plan(lib: &Library) -> Option<torch::Plan> {
    match torch::plan(&lib.path) {
        Ok(Ok(plan)) => {
            tracing::info!(
                "{}: PyTorch's allocator ({}, {} call sites, {} frees)",
                lib.path.display(),
                plan.malloc.name,
                plan.landings.len(),
                plan.frees.len()
            );
            Some(plan)
        }
        Ok(Err(torch::Refusal::Absent)) => {
            if lib.path.file_name().is_some_and(torch::is_allocator_library) {
                eprintln!(
                    "fragscope: {}: PyTorch's allocator not probed: the library has no symbol table naming it \
                     (stripped, or a custom build). Its segments are recorded as usual.",
                    lib.path.display()
                );
            }
            None
        }
        Ok(Err(torch::Refusal::Unusable(why))) => {
            eprintln!(
                "fragscope: {}: PyTorch's allocator not probed: {why}. Its segments are recorded as usual.",
                lib.path.display()
            );
            None
        }
        Err(e) => {
            eprintln!("fragscope: {e:#}; PyTorch's allocator not probed there");
            None
        }
    }
}

/// Now on the events' clock (`bpf_ktime_get_ns`: CLOCK_MONOTONIC).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
