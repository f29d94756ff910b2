//! The multi-trace driver of `fragscope analyze`: finds the traces, analyses
//! them on `--jobs` threads (each into a staging folder renamed when
//! complete), groups them, writes the batch summary and applies the CI gates.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use anyhow::{Context, Result};

use crate::analysis::Options;
use crate::analysis::summary::{Summary, SummaryRow};
use crate::cli::{self, AnalyzeArgs};
use crate::exit;
use crate::output::plot::PlotConfig;

/// `fragscope analyze`: one trace, or a batch of them into per-trace folders
/// and a summary.
pub fn run(args: &AnalyzeArgs) -> Result<u8> {
    let opts = args.options();
    let plot = args.plot_config();
    opts.metrics.validate()?;
    let (traces, batch) = crate::trace::input::discover(&args.traces)?;
    if !batch {
        let a = crate::analysis::analyze_path(&traces[0], &opts)?;
        crate::output::write_trace_outputs(&a, &args.output, plot.as_ref())?;
        print!("{}", crate::output::stdout_summary(&a, &args.output));
        return Ok(gate(&[(a.trace.name.clone(), Ok(Summary::of(&a)))], &args.gates));
    }
    std::fs::create_dir_all(&args.output).with_context(|| format!("cannot create {}", args.output.display()))?;
    let names = unique_names(&traces);
    let jobs = args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let started = std::time::Instant::now();
    let (rows, per_trace) = analyze_all(&traces, &names, &args.output, &opts, plot.as_ref(), jobs);
    let ok: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].1.is_ok()).collect();
    let features: Vec<_> = ok.iter().filter_map(|&i| rows[i].1.as_ref().ok().map(|s| s.features)).collect();
    for (&i, f) in ok.iter().zip(&features) {
        tracing::debug!("grouping features of {}: {:?}", rows[i].0, f.map(|x| (x * 1000.0).round() / 1000.0));
    }
    let grouping = crate::analysis::cluster::cluster(&features, args.cluster_seed)?;
    let mut clusters: Vec<Option<(usize, String)>> = vec![None; rows.len()];
    if let Some(g) = &grouping {
        for (k, &i) in ok.iter().enumerate() {
            let c = g.assignments[k];
            clusters[i] = Some((c, g.labels[c].clone()));
        }
    }
    crate::output::write_batch_summary(&rows, &args.output, &clusters, grouping.as_ref())?;
    // The batch's own cost (scheduling, grouping, summaries) against the
    // traces' (scripts/bench-batch reads this line).
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

/// Analyses every trace on `jobs` threads into `out/NAME`; returns a row
/// per trace, in input order, and the seconds of per-trace work summed over
/// the threads.
fn analyze_all(
    traces: &[PathBuf],
    names: &[String],
    out: &Path,
    opts: &Options,
    plot: Option<&PlotConfig>,
    jobs: usize,
) -> (Vec<SummaryRow>, f64) {
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
                        analyze_one(path, &out.join(name), opts, plot)
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
        .zip(names)
        .map(|(slot, name)| {
            slot.into_inner().ok().flatten().unwrap_or_else(|| (name.clone(), Err("the analysis thread failed".into())))
        })
        .collect();
    bar.finish_and_clear();
    let per_trace = per_trace_ns.load(Ordering::Relaxed) as f64 / 1e9;
    (rows, per_trace)
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
fn analyze_one(path: &Path, out: &Path, opts: &Options, plot: Option<&PlotConfig>) -> Result<Summary> {
    let a = crate::analysis::analyze_path(path, opts)?;
    let staging = out.with_file_name(format!(
        ".{}.partial",
        out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    let written = crate::output::write_trace_outputs(&a, &staging, plot).and_then(|()| {
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
