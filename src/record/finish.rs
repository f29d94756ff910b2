//! The end of a recording: what each BPF program cost, the user stacks
//! the events refer to, and `trace.json` with the recording's details and
//! exit status.

use super::*;

/// Each BPF program that ran, with its runs and mean run time, as the
/// kernel counts them while `kernel.bpf_stats_enabled` is 1 (read from
/// /proc/self/fdinfo, which says nothing of them otherwise); empty when
/// counting is off. Counting costs two clock reads a run: it is the user's
/// to turn on, for a measurement.
pub(super) fn programs_cost(skel: &skel::RecordSkel) -> BTreeMap<String, ProgramCost> {
    use std::os::fd::{AsFd, AsRawFd};
    let on = std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").is_ok_and(|v| v.trim() == "1");
    let mut costs = BTreeMap::new();
    if !on {
        return costs;
    }
    // (A program not loaded, a hook left out on this kernel, has no fd.)
    for prog in skel.object().progs().filter(|p| p.autoload()) {
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", prog.as_fd().as_raw_fd())) else {
            continue;
        };
        let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok());
        if let (Some(ns), Some(runs)) = (field("run_time_ns:"), field("run_cnt:"))
            && runs > 0
        {
            costs.insert(
                prog.name().to_string_lossy().into_owned(),
                ProgramCost { runs, ns_per_run: ns as f64 / runs as f64 },
            );
        }
    }
    costs
}

/// Writes the user stacks the events refer to (`ustacks.parquet`).
pub(super) fn save_stacks(skel: &skel::RecordSkel, writer: &TraceWriter, used: &BTreeSet<(u32, u32)>) -> Result<()> {
    let mut frames = Vec::new();
    let mut missing = 0;
    for &(stack_id, pid) in used {
        match skel.maps.stacks.lookup(&stack_id.to_ne_bytes(), MapFlags::ANY) {
            Ok(Some(bytes)) => {
                let addrs = bytes.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")));
                for (depth, addr) in addrs.take_while(|&a| a != 0).enumerate() {
                    frames.push(crate::trace::UstackFrame { stack_id, pid, depth: depth as u32, addr });
                }
            }
            _ => missing += 1,
        }
    }
    if missing > 0 {
        tracing::warn!("{missing} recorded stacks were no longer in the stack map");
    }
    let path = writer.dir().join(crate::trace::USTACKS_FILE);
    crate::trace::write_ustacks(&path, &frames)?;
    writer.chown(&path)
}

pub(super) fn finish(
    opts: &Options,
    mut writer: TraceWriter,
    end: End,
    attached: &[Attached],
    started: Instant,
) -> Result<u8> {
    let libraries: Vec<String> = attached.iter().map(|a| a.library.path.display().to_string()).collect();
    let probes: serde_json::Value = attached
        .iter()
        .map(|a| {
            let mut j =
                serde_json::json!({"library": a.library.path, "found": a.library.found, "functions": a.functions,
                    "entries_after_endbr64": a.past_endbr64});
            if let Some(p) = &a.allocator {
                j["pytorch_allocator"] = serde_json::json!({
                    "malloc": p.malloc.name,
                    "returns_probed_at": p.landings.len(),
                    // Of those, on a jump soon after the call (one trap, not
                    // two); the one PyTorch's static probe replaces is not probed.
                    "returns_probed_on_a_jump": p.on_a_jump.iter()
                        .filter(|&&at| p.static_probe.as_ref().is_none_or(|s| s.replaces != at)).count(),
                    "static_probe": p.static_probe.as_ref().map(|u| format!("pytorch:malloc in {}", u.function)),
                    // Its arguments read (one trap a tensor), malloc's entry
                    // not probed; the calls probed in its place.
                    "static_probe_arguments": p.static_args.as_ref().map(|a| serde_json::json!({
                        "locations": a.locations,
                        "calls_to_malloc": a.calls.len(),
                        "oom_reports": a.oom_reports.len(),
                        "uncached_allocations": a.uncached.len(),
                    })),
                    "frees": p.frees.iter().map(|(f, _)| &f.name).collect::<Vec<_>>(),
                    "frees_left_out": p.left_out,
                });
            }
            j
        })
        .collect();
    let (exit_code, why) = match end {
        End::CommandExited(code) => (code, format!("the command exited with status {code}")),
        End::PidExited => (0, format!("pid {} exited", opts.pid.unwrap_or(0))),
        End::Signal(sig) => (0, format!("stopped by {}", if sig == libc::SIGINT { "SIGINT" } else { "SIGTERM" })),
        End::Duration => (0, "--duration reached".to_string()),
    };
    // The last part first, so that the recorder's CPU time counts it.
    writer.flush_part()?;
    let m = writer.meta_mut();
    m.libraries = libraries.clone();
    let cpu = own_cpu_seconds();
    if let Details::Record(d) = &mut m.details {
        d.probes = Some(probes);
        d.end = Some(why.clone());
        d.recorder_cpu_s = Some(cpu);
    }
    let unprobed = match &m.details {
        Details::Record(d) => d.unprobed_libraries.clone(),
        _ => BTreeMap::new(),
    };
    let dir = writer.dir().to_path_buf();
    let meta = writer.finish()?;
    let total: u64 = meta.event_counts.values().sum();
    let bytes: u64 = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()).filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
        })
        .unwrap_or(0);
    eprintln!(
        "fragscope: {why}; recorded {total} events from {} process(es) in {:.2} s into {} ({} parts, {})",
        meta.pids.len(),
        started.elapsed().as_secs_f64(),
        dir.display(),
        meta.parts,
        crate::units::bytes(bytes)
    );
    if total > 0 {
        let kinds: Vec<String> = meta.event_counts.iter().map(|(k, n)| format!("{k} {n}")).collect();
        eprintln!("  events: {}", kinds.join(", "));
    } else {
        eprintln!(
            "  no call of the probed libraries was recorded: if the program uses CUDA, it calls a runtime \
             that was not probed (linked into the executable: name the executable with --lib; loaded from \
             elsewhere: name that library with --lib)"
        );
    }
    if meta.lost_events > 0 {
        eprintln!("  LOST {} events (ring buffer full): raise --buffer-size", meta.lost_events);
    } else {
        eprintln!("  lost events: 0");
    }
    eprintln!("  recorder CPU time: {cpu:.3} s");
    if let Details::Record(d) = &meta.details
        && !d.bpf_programs.is_empty()
    {
        let each: Vec<String> = d
            .bpf_programs
            .iter()
            .map(|(name, c)| {
                format!("{name} {} run{}, {:.0} ns a run", c.runs, if c.runs == 1 { "" } else { "s" }, c.ns_per_run)
            })
            .collect();
        eprintln!("  BPF programs (kernel.bpf_stats_enabled): {}", each.join("; "));
    }
    for a in attached {
        // A build for Intel CET: its entries probed after their endbr64.
        let cet = match a.past_endbr64 {
            0 => String::new(),
            n => format!(" ({n} probed after their endbr64: built for Intel CET)"),
        };
        eprintln!("  probed {} ({}): {} functions{cet}", a.library.path.display(), a.library.found, a.functions.len());
        if a.allocator.is_some() {
            eprintln!("    PyTorch's caching allocator: every tensor's block_alloc and block_free");
        }
    }
    for (pid, paths) in &unprobed {
        for path in paths {
            eprintln!(
                "fragscope: warning: pid {pid} loaded {path}, which was not probed (outside the places searched, \
                 or not named by --lib): its calls are not in this recording. Name it with --lib, with the \
                 other libraries to probe."
            );
        }
    }
    Ok(u8::try_from(exit_code).unwrap_or(1))
}
