//! fragscope: GPU memory fragmentation from allocation traces.
//!
//! The data flow is the architecture: producers write a trace
//! ([`synth`], `record` with eBPF, `import` of PyTorch snapshots through
//! [`pickle`] and [`snapshot`]) → [`trace`] loads it → [`replay`] applies
//! its [`event`]s → [`metrics`] per timestep ([`analyze`]) →
//! [`iterations`], [`predict`], [`oom`], [`leak`], [`sites`] → [`plot`],
//! [`report`], [`compare`].

pub mod analyze;
pub mod cli;
pub mod cluster;
pub mod compare;
pub mod event;
pub mod flame;
pub mod iterations;
pub mod kernels;
pub mod leak;
pub mod metrics;
pub mod oom;
pub mod pickle;
pub mod plot;
pub mod predict;
#[cfg(feature = "record")]
pub mod record;
pub mod replay;
pub mod report;
pub mod sites;
pub mod snapshot;
pub mod synth;
pub mod trace;

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::analyze::Options;
use crate::cli::{AnalyzeArgs, Cli, Command, SynthArgs};
use crate::metrics::MetricsConfig;
use crate::report::{Summary, SummaryRow};

/// Process exit codes.
pub mod exit {
    pub const OK: u8 = 0;
    pub const ERROR: u8 = 1;
    pub const GATE: u8 = 3;
}

/// Runs a parsed command line; returns the exit code.
pub fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::Synth(args) => run_synth(&args),
        Command::Analyze(args) => run_analyze(&args),
        Command::Import(args) => run_import(&args),
        Command::Record(args) => run_record(&args),
        Command::Compare(args) => {
            let opts = Options { step: args.step, device: args.device, ..Options::default() };
            let tripped = compare::run(&args.a, &args.b, &args.output, &opts, args.size, &args.fail_if_worse)?;
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
    let c = snapshot::import(&args.snapshot, &args.output, args.device)?;
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

fn run_analyze(args: &AnalyzeArgs) -> Result<u8> {
    let p = &args.predict;
    let opts = Options {
        metrics: MetricsConfig {
            page_size: args.page_size,
            small_threshold: args.small_threshold,
            min_gap: args.min_gap,
        },
        step: args.step,
        brute_force: args.brute_force,
        capacity: args.capacity,
        predict: predict::PredictConfig {
            window: p.window as usize,
            horizon: p.horizon as usize,
            learning_rate: p.learning_rate,
            trend_window: p.trend_window,
            cv_origins: p.cv_origins,
            retrain_every: p.retrain_every,
            deterioration: p.deterioration,
            min_confidence: p.min_confidence,
            sharp_jump: p.sharp_jump,
            clear_trend: p.clear_trend,
            ..predict::PredictConfig::default()
        },
        plot: (!args.plots.no_plots).then_some(plot::PlotConfig {
            width: args.plots.size.0,
            height: args.plots.size.1,
            time_window: args.plots.time_window,
            addr_window: args.plots.addr_window,
            pid: args.plots.pid,
            normalised_time: false,
            max_panels: args.plots.max_panels,
        }),
        device: args.device,
    };
    opts.metrics.validate()?;
    let (traces, batch) = analyze::discover(&args.traces)?;
    if !batch {
        let a = analyze::analyze_path(&traces[0], &opts)?;
        report::write_trace_outputs(&a, &args.output)?;
        print!("{}", report::stdout_summary(&a, &args.output));
        return Ok(gate(&[(a.trace.name.clone(), Ok(Summary::of(&a)))], &args.gates));
    }
    std::fs::create_dir_all(&args.output).with_context(|| format!("cannot create {}", args.output.display()))?;
    let names = unique_names(&traces);
    let jobs = args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let bar = indicatif::ProgressBar::new(traces.len() as u64);
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} traces {elapsed} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Plain threads pulling the next trace, not a rayon pool: polars waits
    // for its own pool with rayon's cross-pool install, and a rayon worker
    // that waits keeps stealing, so traces would nest on one thread (and
    // more than --jobs of them would be in memory at once).
    let started = std::time::Instant::now();
    let per_trace_ns = AtomicU64::new(0);
    let next = AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<SummaryRow>>> = traces.iter().map(|_| Default::default()).collect();
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(traces.len()) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let (Some(path), Some(name)) = (traces.get(i), names.get(i)) else { break };
                    let t = std::time::Instant::now();
                    // A bug in one trace's analysis must not take the batch
                    // down: its panic becomes that trace's error row.
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        analyze_one(path, &args.output.join(name), &opts)
                    }))
                    .unwrap_or_else(|panic| {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "unknown panic".into());
                        Err(anyhow::anyhow!(
                            "{}: internal error while analysing (a bug, please report it): {what}",
                            path.display()
                        ))
                    });
                    per_trace_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    bar.inc(1);
                    let row = match result {
                        Ok(s) => (name.clone(), Ok(s)),
                        Err(e) => {
                            let msg = format!("{e:#}");
                            tracing::error!("{msg}");
                            (name.clone(), Err(msg))
                        }
                    };
                    if let Ok(mut slot) = results[i].lock() {
                        *slot = Some(row);
                    }
                }
            });
        }
    });
    let rows: Vec<SummaryRow> = results
        .into_iter()
        .zip(&names)
        .map(|(slot, name)| {
            slot.into_inner().ok().flatten().unwrap_or_else(|| (name.clone(), Err("the analysis thread failed".into())))
        })
        .collect();
    bar.finish_and_clear();
    let ok: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].1.is_ok()).collect();
    let features: Vec<_> = ok.iter().filter_map(|&i| rows[i].1.as_ref().ok().map(|s| s.features)).collect();
    for (&i, f) in ok.iter().zip(&features) {
        tracing::debug!("grouping features of {}: {:?}", rows[i].0, f.map(|x| (x * 1000.0).round() / 1000.0));
    }
    let grouping = cluster::cluster(&features, args.cluster_seed)?;
    let mut clusters: Vec<Option<(usize, String)>> = vec![None; rows.len()];
    if let Some(g) = &grouping {
        for (k, &i) in ok.iter().enumerate() {
            let c = g.assignments[k];
            clusters[i] = Some((c, g.labels[c].clone()));
        }
    }
    report::write_batch_summary(&rows, &args.output, &clusters, grouping.as_ref())?;
    // The batch's own cost (scheduling, grouping, summaries) against the
    // traces' (scripts/bench-batch reads this line).
    let per_trace = per_trace_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9;
    tracing::info!(
        "batch: {} traces, {jobs} job(s), wall {:.3} s, per-trace work {per_trace:.3} s (summed over jobs)",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    let failed = rows.iter().filter(|r| r.1.is_err()).count();
    println!(
        "{} traces analysed, {} failed; summary in {}",
        rows.len() - failed,
        failed,
        args.output.join("summary.md").display()
    );
    if failed > 0 {
        return Ok(exit::ERROR);
    }
    Ok(gate(&rows, &args.gates))
}

/// Applies the CI gates to analysed traces; prints each trip on stderr.
fn gate(rows: &[SummaryRow], gates: &cli::GateArgs) -> u8 {
    let mut tripped = false;
    for (name, s) in rows {
        let Ok(s) = s else { continue };
        if let (Some(level), Some(risk)) = (gates.fail_on, s.risk)
            && risk >= level
        {
            eprintln!("gate: {name}: forecast risk {} is at or above --fail-on {}", risk.name(), level.name());
            tripped = true;
        }
        if let Some(max) = gates.max_score
            && s.score.final_ > max
        {
            eprintln!("gate: {name}: final score {:.1} exceeds --max-score {max}", s.score.final_);
            tripped = true;
        }
    }
    if tripped { exit::GATE } else { exit::OK }
}

/// Analyses one trace of a batch into `out`, through a staging folder so a
/// failed trace leaves no half-written folder.
fn analyze_one(path: &Path, out: &Path, opts: &Options) -> Result<Summary> {
    let a = analyze::analyze_path(path, opts)?;
    let staging = out.with_file_name(format!(
        ".{}.partial",
        out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    let written = report::write_trace_outputs(&a, &staging).and_then(|()| {
        if out.exists() {
            std::fs::remove_dir_all(out).with_context(|| format!("cannot replace {}", out.display()))?;
        }
        std::fs::rename(&staging, out).with_context(|| format!("cannot write {}", out.display()))
    });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    written?;
    Ok(Summary::of(&a))
}

/// Output folder names: the trace directory's name, suffixed when two
/// traces share one.
fn unique_names(traces: &[PathBuf]) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    traces
        .iter()
        .map(|p| {
            let base = p
                .canonicalize()
                .ok()
                .and_then(|c| c.file_name().map(|n| n.to_string_lossy().into_owned()))
                .or_else(|| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "trace".into());
            let n = seen.entry(base.clone()).or_insert(0);
            *n += 1;
            if *n == 1 { base } else { format!("{base}-{n}") }
        })
        .collect()
}
