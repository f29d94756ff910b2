//! `report.md`, the analysis for people, and the few lines `analyze`
//! prints on stdout.
//!
//! The files: [`sections`] (each section), [`words`] (the phrases they
//! share); this module puts the report together.

mod cycles;
mod first_screen;
mod host;
mod sections;
mod stages;
mod words;
use std::fmt::Write as _;
use std::path::Path;

use self::cycles::{iterations_md, leaks_md};
use self::sections::join_md;
use self::sections::{advice_md, allocator_md, ooms_md, prediction_md, verdict_md};
use self::words::{peak_live_text, plural};
use crate::analysis::Analysis;
use crate::analysis::summary::*;
use crate::units::bytes;

/// `report.md`: the verdict first, then the tables.
/// `panels_not_drawn`: processes the MDTP had no room for.
pub fn report_md(a: &Analysis, panels_not_drawn: usize) -> String {
    let s = Summary::of(a);
    let mut md = String::new();
    let _ = writeln!(md, "# fragscope report: {}\n", s.name);
    if let Some(d) = &a.decision {
        md.push_str(&first_screen::first_screen_md(d, &|u| a.who(u)));
    }
    if let Some(c) = &a.settings_check {
        for line in first_screen::settings_sentences(c) {
            let _ = writeln!(md, "**A setting not in force:** {line}\n");
        }
    }
    if let Some(c) = &a.class {
        let _ = writeln!(
            md,
            "**Fleet class:** {} (model {}, {})\n",
            c.line(&|u| a.who(u)),
            c.trace.model_id,
            c.trace.classifier
        );
    }
    md.push_str(&verdict_md(a, &s));
    let _ = writeln!(
        md,
        "Fragmentation score now {:.1} / 100 (mean {:.1}, p95 {:.1}, max {:.1}) · {} · {} · {}{}.\n",
        s.score.final_,
        s.score.mean,
        s.score.p95,
        s.score.max,
        peak_live_text(a),
        if a.has_history() { plural(s.ooms, "OOM", "OOMs") } else { "OOMs not recorded".to_string() },
        s.processes,
        match (a.allocator_view, s.processes == 1) {
            (true, true) => " device",
            (true, false) => " devices",
            (false, true) => " process",
            (false, false) => " processes",
        },
    );
    let _ = writeln!(md, "| trace | |\n|---|---|");
    let _ = writeln!(md, "| source | {} |", s.source);
    if a.entry_order() {
        let entries: u64 = a.snapshot_details().map_or(0, |d| d.entries());
        let _ = writeln!(
            md,
            "| events | {} from {} (no timestamps: time is entry order) |",
            s.events,
            plural(entries, "trace entry", "trace entries"),
        );
    } else {
        if a.has_history() {
            let _ = writeln!(md, "| events | {} over {:.3} s |", s.events, s.duration_s);
        } else {
            let _ = writeln!(md, "| events | {} (the state at one instant, rebuilt) |", s.events);
        }
    }
    let _ = writeln!(md, "| steps | {} ({}), {} rows |", a.step_count, a.options.step, a.rows.len());
    let _ = writeln!(md, "| parts | {} read, {} skipped |", a.trace.parts.len(), a.trace.skipped.len());
    if let Some(m) = &a.trace.meta {
        if let crate::trace::details::Details::Profiler(p) = &m.details {
            let _ = writeln!(
                md,
                "| profiler | {} CUDA memory events ({} CPU ones skipped), {} `ProfilerStep` spans |",
                p.cuda_memory_events, p.cpu_events_skipped, p.profiler_steps
            );
            if p.unplaced_before_trace_bytes > 0 {
                let _ = writeln!(
                    md,
                    "| before the trace | {} allocated before the profiler started and never freed in it: no address, so not in these figures (live bytes here are the trace's own) |",
                    bytes(p.unplaced_before_trace_bytes)
                );
            }
            if let (Some(alloc), Some(res)) = (p.peak_allocated_bytes, p.peak_reserved_bytes) {
                let _ = writeln!(
                    md,
                    "| profiler's own peaks | {} allocated, {} reserved (`Total Allocated`, `Total Reserved`) |",
                    bytes(alloc),
                    bytes(res)
                );
            }
        }
        if m.lost_events > 0 {
            let _ = writeln!(
                md,
                "| lost events | **{}** (the recorder dropped events; numbers may be off) |",
                m.lost_events
            );
        }
        if let Some(c) = m.capacity_bytes {
            let _ = writeln!(md, "| capacity | {} |", bytes(c));
        }
    } else {
        let _ = writeln!(md, "| metadata | trace.json missing (interrupted recording?) |");
    }

    let _ = writeln!(md, "\n## {}\n", if a.allocator_view { "Devices" } else { "Processes" });
    let _ = writeln!(
        md,
        "| {} | {} | score final | mean | p95 | max | E | K | S | C | L | U | OOMs |",
        a.unit(),
        if a.has_history() { "peak live" } else { "live at the snapshot" }
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for p in &a.peaks {
        let st = ScoreStats::of(&process_scores(&a.rows, p.pid));
        let m = last_row(a, p.pid).map(|r| r.metrics).unwrap_or_default();
        let [e, k, small, cv, l, u] = m.features();
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {} |",
            a.who(p.pid),
            // One instant: what was live at its end, not a peak.
            bytes(if a.has_history() {
                p.bytes
            } else {
                a.leaks.iter().find(|l| l.pid == p.pid).map_or(p.bytes, |l| l.live_at_end_bytes)
            }),
            st.final_,
            st.mean,
            st.p95,
            st.max,
            e,
            k,
            small,
            cv,
            l,
            u,
            if a.has_history() { a.ooms.iter().filter(|o| o.pid == p.pid).count().to_string() } else { "—".into() }
        );
    }
    let _ = writeln!(
        md,
        "\nE external fragmentation, K unusable-free-space index, S small-allocation ratio, C size CV, L large-gap ratio, U utilization — at the last timestep (a process's last before its exit).\n"
    );
    if let Some(crate::trace::details::Details::Record(d)) = a.trace.meta.as_ref().map(|m| &m.details)
        && d.devices.values().any(|d| d.len() > 1)
    {
        for (pid, devices) in d.devices.iter().filter(|(_, d)| d.len() > 1) {
            let list: Vec<String> = devices.iter().map(i32::to_string).collect();
            let _ = writeln!(
                md,
                "- pid {pid} made its calls on GPUs {}: each device's memory is replayed on its own, as \
                 \"{pid} on GPU N\" (each device has its own address space and capacity).",
                list.join(", ")
            );
        }
        md.push('\n');
    }
    if panels_not_drawn > 0 {
        let _ = writeln!(
            md,
            "The MDTP draws the {} processes with the highest peak live bytes: +{} processes not drawn (`--max-panels`, `--pid`); every process is in metrics.parquet and report.json.\n",
            a.peaks.len() - panels_not_drawn,
            panels_not_drawn
        );
    }
    if !a.exits.is_empty() {
        let bytes_total: u64 = a.exits.iter().map(|x| x.bytes).sum();
        let _ = writeln!(
            md,
            "Released at exit: {} process{} ended holding {} in {} blocks; the driver frees it, so it is neither live nor leaked afterwards (all in report.json).\n",
            a.exits.len(),
            if a.exits.len() == 1 { "" } else { "es" },
            bytes(bytes_total),
            a.exits.iter().map(|x| x.blocks).sum::<u64>()
        );
    }

    let _ = writeln!(md, "## Events by kind\n\n| kind | count |\n|---|---|");
    for (k, n) in a.counts_by_kind.present() {
        let null = if k == crate::trace::event::EventKind::Free && a.null_frees > 0 {
            format!(
                " ({} of a null pointer, which frees nothing: a common way to create the CUDA context)",
                a.null_frees
            )
        } else {
            String::new()
        };
        let _ = writeln!(md, "| {} | {n}{null} |", k.name());
    }
    if a.recovered_allocs > 0 {
        let _ = writeln!(
            md,
            "| failed allocations | {} ({} served when PyTorch asked again, after it released cached memory: no OOM) |",
            a.failed_allocs, a.recovered_allocs
        );
    } else if !(a.snapshot_details().is_some() && a.failed_allocs == 0) {
        // A snapshot's failures are its `oom` entries, counted above.
        let _ = writeln!(md, "| failed allocations | {} |", a.failed_allocs);
    }
    if let Some(d) = a.snapshot_details() {
        let (segments, blocks): (u64, u64) =
            d.reconstruction.iter().fold((0, 0), |(s, b), r| (s + r.initial_segments, b + r.initial_blocks));
        if segments + blocks > 0 {
            let _ = writeln!(
                md,
                "\nOf these, {segments} segment_alloc and {blocks} block_alloc are reconstructed: what was alive before the \
                 snapshot's first trace entry, stamped at its time.{}",
                if a.has_history() {
                    " The rest are the entries the snapshot recorded."
                } else {
                    " They are the state at the one instant the snapshot holds."
                }
            );
        }
        // A recording with PyTorch's blocks: the table counts its view,
        // which is not what `record` printed.
        if let Some(j) = d.join.as_ref().filter(|j| j.probed)
            && let Some(m) = a.trace.meta.as_ref().filter(|m| !m.event_counts.is_empty())
        {
            let recorded: Vec<String> = m.event_counts.iter().map(|(k, n)| format!("{k} {n}")).collect();
            let _ = writeln!(
                md,
                "\nThese count PyTorch's allocator view of the recording, which recorded {} (trace.json \
                 `event_counts`). In the view, each of PyTorch's {} segments and each of the {} device allocations \
                 outside its allocator is a segment_alloc (an outside one is also its own block_alloc); copies, the \
                 process's exit and frees of nothing it holds (a null pointer) have no part in it.",
                recorded.join(", "),
                j.segments_matched,
                j.outside.allocations
            );
        }
    }

    if a.allocator_view {
        md.push_str(&allocator_md(a));
        md.push_str(&join_md(a));
    }
    if !a.kernels.is_empty() {
        // Recordings since 2026-11-26 write launches at entry: no return code.
        let failed = a.kernels.iter().any(|k| k.failed.is_some());
        let _ = writeln!(
            md,
            "\n## Kernels\n\nLaunches by kernel (the names the program registered with the CUDA runtime, else the symbols of the traced processes' files; demangled){}:\n\n| kernel | launches |{}\n|---|---|{}",
            if failed {
                ""
            } else {
                ". Each launch is recorded as it is made; whether it failed is not (its return would cost a second \
                 probe per launch)"
            },
            if failed { " failed |" } else { "" },
            if failed { "---|" } else { "" },
        );
        for k in a.kernels.iter().take(15) {
            let name = k.name.replace('|', "\\|");
            match k.failed {
                Some(f) if failed => {
                    let _ = writeln!(md, "| `{name}` | {} | {f} |", k.launches);
                }
                _ => {
                    let _ = writeln!(md, "| `{name}` | {} |", k.launches);
                }
            }
        }
        if a.kernels.len() > 15 {
            let _ = writeln!(md, "\n{} more in report.json.", a.kernels.len() - 15);
        }
        let unnamed = a.kernels.iter().filter(|k| k.name.starts_with("0x")).count();
        if unnamed > 0 {
            let why = if a.trace.dir.join(crate::trace::kernel_names::KERNELS_FILE).is_file() {
                "the program registered no name for them and no symbol lies at their address"
            } else {
                "this recording has no registered kernel names (`kernels.json`, which `fragscope record` writes from \
                 the CUDA runtime's registration calls; recordings made by earlier versions have none), and CUDA 13 \
                 launches pass a handle in the heap, where no symbol lies: record again with this version to name them"
            };
            let which = if unnamed == a.kernels.len() {
                format!("All {unnamed} kernels are")
            } else {
                format!("{unnamed} of the {} kernels are", a.kernels.len())
            };
            let _ = writeln!(md, "\n{which} shown by their launch address: {why}.");
        }
    }
    if !a.alloc_stacks.is_empty() {
        let _ = writeln!(
            md,
            "\n## Allocation call stacks\n\nDevice memory allocated by call stack (`record --stacks`; innermost first, all in report.json):\n\n| bytes | allocations | stack |\n|---|---|---|"
        );
        for st in a.alloc_stacks.iter().take(10) {
            let frames: Vec<String> =
                st.frames.iter().take(8).map(|f| format!("`{}`", f.replace('|', "\\|"))).collect();
            let _ = writeln!(md, "| {} | {} | {} |", bytes(st.bytes), st.allocations, frames.join(" ← "));
        }
    }
    let an = &a.anomalies;
    let _ = writeln!(md, "\n## Anomalies\n");
    if an.total() == 0 {
        let _ = writeln!(md, "None.");
    } else {
        let _ = writeln!(md, "| anomaly | count |\n|---|---|");
        for (name, n, why) in [
            (
                "unknown_free",
                an.unknown_free,
                "free of an address never allocated in the trace (allocated before recording?)",
            ),
            ("double_free", an.double_free, "free of an address already freed"),
            ("overlap", an.overlap, "allocation overlapping live blocks (their frees were lost)"),
            ("out_of_order", an.out_of_order, "rows out of time order (sorted before replay)"),
            ("unknown_kind", an.unknown_kind, "rows with a kind this version does not know (ignored)"),
            (
                "outside_segment",
                an.outside_segment,
                "blocks outside every live segment, or taken away by a segment free",
            ),
        ] {
            if n > 0 {
                let _ = writeln!(md, "| {name} | {n} — {why} |");
            }
        }
    }
    md.push_str(&iterations_md(a));
    md.push_str(&stages::stages_md(a));
    md.push_str(&host::host_md(a));
    md.push_str(&prediction_md(a));
    md.push_str(&ooms_md(a));
    md.push_str(&leaks_md(a));
    if let Some(w) = &a.whatif {
        md.push_str("\n## What the allocator settings would change\n\n");
        let what = match w.source {
            // A recording's allocator view replays as a snapshot does.
            crate::analysis::whatif::Source::Snapshot if a.trace.source() == Some(crate::trace::Source::Ebpf) => {
                "This recording's tensor requests"
            }
            crate::analysis::whatif::Source::Snapshot => "This snapshot's requests",
            crate::analysis::whatif::Source::DeviceLevel => "This trace's requests (every cudaMalloc)",
        };
        let _ = writeln!(
            md,
            "{what} replayed through a model of PyTorch's caching allocator (details: `fragscope whatif`). Recommendation: {} — {}.\n",
            crate::output::whatif::recommendation_md(w),
            w.recommended.1
        );
        md.push_str(&crate::output::whatif::sections_md(w, "###", &|d| a.who(d)));
    } else if let Some(why) = &a.whatif_not_run {
        let _ = writeln!(md, "\n## What the allocator settings would change\n\nNot replayed: {why}.");
    }
    md.push_str(&advice_md(a));
    md
}

/// A few lines for stdout.
pub fn stdout_summary(a: &Analysis, out: &Path) -> String {
    let s = Summary::of(a);
    format!(
        "{}: {} events, {} {}, {}, {}; OOM risk {}, fragmentation level {}{}\n{}  score final {:.1}, mean {:.1}, p95 {:.1}, max {:.1}; {}; {}; {} anomal{}\n  wrote {}\n",
        s.name,
        s.events,
        s.processes,
        match (a.allocator_view, s.processes == 1) {
            (true, true) => "device",
            (true, false) => "devices",
            (false, true) => "process",
            (false, false) => "processes",
        },
        if a.entry_order() {
            let entries: u64 = a.snapshot_details().map_or(0, |d| d.entries());
            format!("{} without timestamps", plural(entries, "trace entry", "trace entries"))
        } else {
            format!("{:.3} s", s.duration_s)
        },
        plural(a.step_count as u64, "step", "steps"),
        s.oom_risk.name(),
        match s.risk {
            Some(r) if headline_at_peak(a).is_some_and(|p| a.pytorch_processes.contains(&p.pid)) => {
                format!("not measured inside PyTorch's cache (its segments: {})", r.name())
            }
            // A high level beside a verdict that the run fits would read
            // as a contradiction on the first line: the score counts the
            // free blocks a cache keeps on purpose (report.md says so too).
            Some(r)
                if r >= crate::analysis::predict::Risk::High
                    && a.decision.as_ref().is_some_and(|d| {
                        matches!(
                            d.verdict,
                            crate::analysis::decision::Verdict::Healthy { .. }
                                | crate::analysis::decision::Verdict::FitsFlushing { .. }
                        )
                    }) =>
            {
                format!("{} (free blocks the cache keeps, not a shortage: see the verdict)", r.name())
            }
            Some(r) => r.name().to_string(),
            None => "not judged (no memory held)".to_string(),
        },
        if s.leaking {
            format!("; leaking: its floor rose by {}", bytes(s.leaked_bytes.max(0) as u64))
        } else {
            String::new()
        },
        a.decision.as_ref().map_or_else(String::new, |d| first_screen::first_screen_stdout(d, &|u| a.who(u)))
            + &a.settings_check.as_ref().map_or_else(String::new, first_screen::settings_stdout)
            + &a.class.as_ref().map_or_else(String::new, |c| format!("  class: {}\n", c.line(&|u| a.who(u)))),
        s.score.final_,
        s.score.mean,
        s.score.p95,
        s.score.max,
        peak_live_text(a),
        if a.has_history() { plural(s.ooms, "OOM", "OOMs") } else { "OOMs not recorded".to_string() },
        s.anomalies,
        if s.anomalies == 1 { "y" } else { "ies" },
        out.display()
    )
}

#[cfg(test)]
mod tests;
