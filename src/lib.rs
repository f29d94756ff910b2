//! fragscope: GPU memory fragmentation from allocation traces.
//!
//! The data flow is the architecture, one folder per stage:
//! producers write a trace (`synth`, `record` with eBPF, `import` of
//! PyTorch snapshots) → [`trace`] loads it into [`trace::event`] columns →
//! [`analysis`] replays them and computes metrics, iterations, forecasts,
//! OOM diagnoses, leaks and call sites → [`output`] writes the reports and
//! draws the pictures. `batch` drives many traces; [`cli`] holds the
//! arguments and turns them into options.

pub mod analysis;
pub mod batch;
pub mod cli;
pub(crate) mod import;
pub mod output;
#[cfg(feature = "record")]
pub(crate) mod record;
pub mod store;
pub(crate) mod synth;
pub mod table;
pub mod trace;
pub(crate) mod units;
pub(crate) mod whatif;

use anyhow::Result;

use crate::analysis::Options;
use crate::cli::{Cli, Command, SynthArgs};

/// Process exit codes.
pub mod exit {
    pub const OK: u8 = 0;
    pub const ERROR: u8 = 1;
    /// A usage error (clap's own code for bad arguments).
    pub const USAGE: u8 = 2;
    pub const GATE: u8 = 3;
}

/// Runs a parsed command line; returns the exit code.
pub fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::Synth(args) => run_synth(&args),
        Command::Analyze(args) => batch::run(&args),
        Command::Summarize(args) => batch::summarize(&args),
        Command::Import(args) => run_import(&args),
        Command::Whatif(args) => whatif::run(&args),
        Command::Export(args) => output::export::run(&args),
        Command::Record(args) => run_record(&args),
        Command::Compare(args) => {
            let opts = Options { step: args.step, device: args.device, ..Options::default() };
            let tripped = output::compare::run(&args.a, &args.b, &args.output, &opts, args.size, &args.fail_if_worse)?;
            Ok(if tripped { exit::GATE } else { exit::OK })
        }
    }
}

#[cfg(feature = "record")]
fn run_record(args: &cli::RecordArgs) -> Result<u8> {
    record::run(&record::Options {
        output: args.output.clone(),
        libs: args.libs.clone(),
        all: args.all,
        pid: args.pid,
        command: args.command.clone(),
        duration: args.duration,
        launch: !args.no_launch,
        memcpy: !args.no_memcpy,
        stacks: args.stacks,
        part_events: args.part_events,
        part_interval: args.part_interval,
        buffer_bytes: args.buffer_size,
    })
}

#[cfg(not(feature = "record"))]
fn run_record(_: &cli::RecordArgs) -> Result<u8> {
    anyhow::bail!("this fragscope was built without the recorder (the `record` feature); rebuild with default features")
}

fn run_import(args: &cli::ImportArgs) -> Result<u8> {
    let started = std::time::Instant::now();
    if crate::trace::input::classify(&args.snapshot) == Some(crate::trace::input::Input::Nsys) {
        anyhow::ensure!(
            args.device.is_none(),
            "--device selects a device of a PyTorch snapshot, not of an Nsight export"
        );
        let c = import::nsys::import(&args.snapshot, &args.output)?;
        if let crate::trace::details::Details::Nsys(d) = &c.meta.details {
            println!(
                "{}: {} device-memory events of {} rows from {} (device(s) {:?}, {} from memory pools) in {:.2} s",
                args.output.display(),
                d.device_events,
                d.rows,
                args.snapshot.display(),
                d.devices,
                d.pooled,
                started.elapsed().as_secs_f64()
            );
            if !d.skipped.is_empty() {
                println!("skipped (not device memory): {:?}", d.skipped);
            }
        }
        return Ok(exit::OK);
    }
    if crate::trace::input::classify(&args.snapshot) == Some(crate::trace::input::Input::Profiler) {
        anyhow::ensure!(
            args.device.is_none(),
            "--device selects a device of a PyTorch snapshot, not of a profiler trace"
        );
        let c = import::profiler::import(&args.snapshot, &args.output)?;
        let total: u64 = c.meta.event_counts.values().sum();
        println!(
            "{}: {} events from {} in {:.2} s",
            args.output.display(),
            total,
            args.snapshot.display(),
            started.elapsed().as_secs_f64()
        );
        if let crate::trace::details::Details::Profiler(p) = &c.meta.details {
            println!(
                "{} CUDA memory events on device(s) {:?} ({} CPU events skipped); {} ProfilerStep spans; before the first event: {} allocated, {} placed (freed later), {} never freed (no address)",
                p.cuda_memory_events,
                p.devices,
                p.cpu_events_skipped,
                p.profiler_steps,
                crate::units::bytes(p.allocated_before_trace_bytes),
                crate::units::bytes(p.reconstructed_bytes),
                crate::units::bytes(p.unplaced_before_trace_bytes),
            );
            if p.total_allocated_breaks > 0 {
                eprintln!(
                    "warning: {} events disagree with the profiler's `Total Allocated` (events lost?)",
                    p.total_allocated_breaks
                );
            }
        }
        return Ok(exit::OK);
    }
    let c = import::snapshot::import(&args.snapshot, &args.output, args.device)?;
    let total: u64 = c.meta.event_counts.values().sum();
    println!(
        "{}: {} events from {} ({} device(s), {} stacks) in {:.2} s",
        args.output.display(),
        total,
        args.snapshot.display(),
        c.reconstructions.len(),
        c.stacks.stacks.len(),
        started.elapsed().as_secs_f64()
    );
    for r in &c.reconstructions {
        let fc = &r.final_check;
        println!(
            "device {}: {} trace entries; before the first: {} segments, {} blocks; final state {}",
            r.device,
            r.entries,
            r.initial_segments,
            r.initial_blocks,
            if fc.exact() {
                format!(
                    "matches the snapshot ({} blocks, {} segment bytes)",
                    fc.blocks_expected, fc.segment_bytes_expected
                )
            } else {
                format!(
                    "DIFFERS from the snapshot: {} blocks missing, {} unexpected, {} of another size; segment bytes {} vs {}",
                    fc.blocks_missing,
                    fc.blocks_unexpected,
                    fc.blocks_size_mismatch,
                    fc.segment_bytes_replayed,
                    fc.segment_bytes_expected
                )
            }
        );
        if r.inconsistent_entries > 0 {
            eprintln!(
                "warning: device {}: {} trace entries contradict the state and were skipped",
                r.device, r.inconsistent_entries
            );
        }
    }
    Ok(exit::OK)
}

fn run_synth(args: &SynthArgs) -> Result<u8> {
    let cfg = synth::SynthConfig {
        pattern: args.pattern,
        events: args.events,
        seed: args.seed,
        capacity: args.capacity,
        rows_per_part: args.rows_per_part.clamp(1, usize::MAX as u64) as usize,
    };
    anyhow::ensure!(args.capacity >= 64 << 20, "--capacity must be at least 64MiB");
    let meta = synth::synth(&cfg, &args.output)?;
    let total: u64 = meta.event_counts.values().sum();
    println!(
        "{}: {} events ({} pattern, seed {}) in {} part{}",
        args.output.display(),
        total,
        args.pattern.name(),
        args.seed,
        meta.parts,
        if meta.parts == 1 { "" } else { "s" }
    );
    Ok(exit::OK)
}
