//! The multi-trace driver of `fragscope analyze`: finds the traces, analyses
//! them on `--jobs` threads (each into a staging folder renamed when
//! complete), groups them, writes the batch summary and applies the CI gates.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use anyhow::{Context, Result};

use crate::analysis::predict::Risk;
use crate::analysis::risk::OomRisk;
use crate::analysis::summary::{Summary, SummaryRow};
use crate::exit;
use crate::input::Found;
use crate::output::plot::PlotConfig;
use crate::output::summary::Shard;
use crate::store::Location;

/// What `fragscope analyze` is asked for.
#[derive(Clone, Debug)]
pub struct Options {
    /// Trace directories, snapshots, other tools' files, directories of
    /// them, or object-store URLs.
    pub traces: Vec<PathBuf>,
    /// The output folder (or object-store URL).
    pub output: PathBuf,
    /// How each trace is analysed.
    pub analysis: crate::analysis::Options,
    /// The pictures to draw (None: no plots).
    pub plot: Option<PlotConfig>,
    /// Traces analysed in parallel (None: one per core).
    pub jobs: Option<usize>,
    /// Seed of the k-means grouping.
    pub cluster_seed: u64,
    /// Only this shard of the batch.
    pub shard: Option<Shard>,
    pub gates: Gates,
    /// A PyTorch snapshot of the same run as the (one) recording, joined
    /// with it ([`crate::input::join`]).
    pub snapshot: Option<PathBuf>,
}

/// The CI gates: exit code 3 when one trips.
#[derive(Clone, Copy, Debug, Default)]
pub struct Gates {
    /// A trace's OOM risk at or above this level.
    pub fail_on: Option<OomRisk>,
    /// A trace's fragmentation level at or above this.
    pub fail_on_fragmentation: Option<Risk>,
    /// A trace whose leak verdict is "leaking".
    pub fail_on_leak: bool,
    /// A trace's final score above this.
    pub max_score: Option<f64>,
    /// A trace whose memory needed ([`crate::analysis::summary::Summary::needs_bytes`])
    /// is above this many bytes.
    pub fail_if_needs_more_than: Option<u64>,
}

/// `fragscope analyze`: one trace, or a batch of them into per-trace folders
/// and a summary; with `--shard`, one shard of a batch.
pub fn run(args: &Options) -> Result<u8> {
    let opts = &args.analysis;
    let plot = &args.plot;
    opts.metrics.validate()?;
    let remote = args.traces.iter().any(|p| crate::store::is_url(&p.to_string_lossy()))
        || crate::store::is_url(&args.output.to_string_lossy());
    let (found, batch) =
        if remote { discover_all(&args.traces)? } else { local(crate::input::discover(&args.traces)?) };
    if args.snapshot.is_some() && (batch || args.shard.is_some() || remote) {
        anyhow::bail!("--snapshot joins one recording with one snapshot of the same run: give one local trace");
    }
    if !batch && args.shard.is_none() && !remote {
        let TraceIn::Local(desc) = &found[0].0 else { unreachable!("local inputs") };
        let loaded = match &args.snapshot {
            Some(snapshot) => {
                let recording = crate::input::load(desc, None)?;
                let mut joined = crate::input::join(recording, crate::input::open(snapshot, None)?)?;
                if let Some(d) = opts.device {
                    joined.events.retain(|e, i| e.pid[i] == d);
                }
                joined
            }
            None => crate::input::allocator_view(crate::input::load(desc, opts.device)?)?,
        };
        let a = crate::analysis::analyze_loaded(loaded, opts)?;
        crate::output::write_trace_outputs(&a, &args.output, plot.as_ref())?;
        print!("{}", crate::output::stdout_summary(&a, &args.output));
        return Ok(gate(&[(a.trace.name.clone(), Ok(Summary::of(&a)))], &args.gates));
    }
    let loc = Location::open(&args.output.to_string_lossy(), true)?;
    // An unreachable store or a missing bucket fails here, before any work.
    loc.list(crate::output::summary::DATASET)?;
    // Names over the whole input set, so that every shard names a trace
    // as the unsharded run would.
    let bases: Vec<String> = found.iter().map(|f| f.0.name_base()).collect();
    let total = bases.len();
    let all_names = unique_names(bases);
    let (traces, names): (Vec<TraceIn>, Vec<String>) = found
        .into_iter()
        .zip(all_names)
        .filter(|((_, rel), _)| args.shard.is_none_or(|s| s.holds(rel)))
        .map(|((t, _), n)| (t, n))
        .unzip();
    let jobs = args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let started = std::time::Instant::now();
    let (rows, per_trace) = analyze_all(&traces, &names, &loc, opts, plot.as_ref(), jobs);
    crate::output::write_parts(&loc, &rows, args.shard)?;
    let failed = rows.iter().filter(|r| r.1.is_err()).count();
    match args.shard {
        None => {
            crate::output::summarize(&loc, args.cluster_seed)?;
            println!(
                "{} traces analysed, {} failed; summary in {}",
                rows.len() - failed,
                failed,
                loc.show("summary.md")
            );
        }
        Some(shard) => println!(
            "shard {shard}: {} of {} traces analysed, {} failed; parts in {}. Once every shard is done: fragscope summarize {}",
            rows.len() - failed,
            total,
            failed,
            loc.show(crate::output::summary::DATASET),
            loc.show("")
        ),
    }
    // The batch's own cost (scheduling, grouping, summaries) against the
    // traces' (scripts/bench-batch reads this line).
    tracing::info!(
        "batch: {} traces, {jobs} job(s), wall {:.3} s, per-trace work {per_trace:.3} s (summed over jobs)",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    if failed > 0 {
        return Ok(exit::ERROR);
    }
    Ok(gate(&rows, &args.gates))
}

/// `fragscope summarize OUT`: the batch summary from the parts of its shards.
pub fn summarize(output: &Path, cluster_seed: u64) -> Result<u8> {
    let loc = Location::open(&output.to_string_lossy(), false)?;
    let batch = crate::output::summarize(&loc, cluster_seed)?;
    let failed = batch.rows.iter().filter(|r| r.1.is_err()).count();
    println!(
        "{} traces, {} failed, {}; summary in {}",
        batch.rows.len(),
        failed,
        batch
            .grouping
            .as_ref()
            .map_or("not grouped".to_string(), |g| crate::units::plural(g.k as u64, "group", "groups")),
        loc.show("summary.md")
    );
    Ok(exit::OK)
}

/// Analyses every trace on `jobs` threads into `out/NAME`; returns a row
/// per trace, in input order, and the seconds of per-trace work summed over
/// the threads.
fn analyze_all(
    traces: &[TraceIn],
    names: &[String],
    out: &Location,
    opts: &crate::analysis::Options,
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
    // Plain threads pulling the next trace, not a work-stealing pool: a
    // worker that waits for the threads a trace starts (the loader's, the
    // predictor's) would steal another trace meanwhile, so traces would nest
    // on one thread and more than --jobs of them would be in memory at once.
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
                        analyze_one(path, name, out, opts, plot)
                    }))
                    .unwrap_or_else(|panic| {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "unknown panic".into());
                        Err(anyhow::anyhow!(
                            "{}: internal error while analysing (a bug, please report it): {what}",
                            path.show()
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
fn gate(rows: &[SummaryRow], gates: &Gates) -> u8 {
    let mut tripped = false;
    for (name, s) in rows {
        let Ok(s) = s else { continue };
        if let Some(level) = gates.fail_on
            && s.oom_risk >= level
        {
            eprintln!("gate: {name}: OOM risk {} is at or above --fail-on {}", s.oom_risk.name(), level.name());
            tripped = true;
        }
        if let (Some(level), Some(risk)) = (gates.fail_on_fragmentation, s.risk)
            && risk >= level
        {
            eprintln!(
                "gate: {name}: fragmentation level {} is at or above --fail-on-fragmentation {}",
                risk.name(),
                level.name()
            );
            tripped = true;
        }
        if gates.fail_on_leak && s.leaking {
            eprintln!(
                "gate: {name}: leaking (--fail-on-leak): its floor of live memory rose by {}",
                crate::units::bytes(s.leaked_bytes.max(0) as u64)
            );
            tripped = true;
        }
        if let (Some(max), Some(needs)) = (gates.fail_if_needs_more_than, s.needs_bytes)
            && needs > max
        {
            eprintln!(
                "gate: {name}: needs {} to fit, more than --fail-if-needs-more-than {}",
                crate::units::bytes(needs),
                crate::units::bytes(max)
            );
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

/// A trace of a batch: a local path, or the files of one trace under an
/// object-store prefix.
enum TraceIn {
    /// A local path, described once (by `discover`).
    Local(crate::input::Described),
    /// A trace folder or a file under `loc`: its keys, each with the path
    /// it is downloaded to (relative to a scratch folder) and its last
    /// modification, the path of the trace there, and its URL for messages.
    Remote { loc: Location, keys: Vec<(String, String, std::time::SystemTime)>, local: String, shown: String },
}

impl TraceIn {
    fn show(&self) -> String {
        match self {
            TraceIn::Local(d) => d.path.display().to_string(),
            TraceIn::Remote { shown, .. } => shown.clone(),
        }
    }

    /// What its output folder is named after: a local trace's own name
    /// (through links: `runs/latest` → the folder it points to); a remote
    /// one's last key part, as listed (never a local file's name).
    fn name_base(&self) -> String {
        let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
        match self {
            TraceIn::Local(d) => d.path.canonicalize().ok().and_then(|c| name(&c)).or_else(|| name(&d.path)),
            TraceIn::Remote { local, .. } => name(Path::new(local)),
        }
        .unwrap_or_else(|| "trace".into())
    }
}

fn local((found, batch): (Vec<Found>, bool)) -> (Vec<(TraceIn, String)>, bool) {
    (found.into_iter().map(|f| (TraceIn::Local(f.desc), f.rel)).collect(), batch)
}

/// The traces of the inputs when some are object-store URLs: a URL names a
/// prefix holding traces, one per top-level entry — a folder (a trace
/// directory) or a file (a snapshot, profiler trace or Nsight export). A
/// run with remote inputs or output is always a batch.
fn discover_all(inputs: &[PathBuf]) -> Result<(Vec<(TraceIn, String)>, bool)> {
    let mut out = Vec::new();
    for input in inputs {
        let s = input.to_string_lossy();
        if !crate::store::is_url(&s) {
            out.extend(local(crate::input::discover(std::slice::from_ref(input))?).0);
            continue;
        }
        let loc = Location::open(&s, false)?;
        let listed = loc.list_modified("")?;
        let part_or_meta = |k: &str| k == "trace.json" || crate::trace::is_part_name(k);
        // The prefix is itself one trace directory.
        if listed.iter().any(|(k, _)| part_or_meta(k)) {
            let name = s.trim_end_matches('/').rsplit('/').next().unwrap_or("trace").to_string();
            let keys = listed.into_iter().map(|(k, t)| (k.clone(), format!("{name}/{k}"), t)).collect();
            let shown = loc.show("");
            out.push((TraceIn::Remote { loc, local: name.clone(), keys, shown }, name));
            continue;
        }
        // Else one trace per top-level entry: a folder holding a trace
        // (trace.json or events parts directly in it), or a file with an
        // input's extension. Other entries (a README, _SUCCESS markers) are
        // skipped, as `classify` skips them in a local folder.
        let before = out.len();
        let mut entries: std::collections::BTreeMap<String, Vec<(String, std::time::SystemTime)>> = Default::default();
        for (key, t) in listed {
            let top = key.split('/').next().unwrap_or_default().to_string();
            entries.entry(top).or_default().push((key, t));
        }
        // Each also compressed (`.pickle.gz`, `.sqlite.zst`): input::compressed.
        let input_file = |k: &str| {
            let k = crate::input::strip_compression_suffix(k).to_ascii_lowercase();
            [".pickle", ".pkl", ".json", ".sqlite"].iter().any(|e| k.ends_with(e))
        };
        for (rel, keys) in entries {
            let is_file = keys.len() == 1 && keys[0].0 == rel;
            let is_trace = keys.iter().any(|(k, _)| {
                k.strip_prefix(&format!("{rel}/")).is_some_and(|inner| !inner.contains('/') && part_or_meta(inner))
            });
            if rel.starts_with('.') || !(is_trace || is_file && input_file(&rel)) {
                tracing::debug!("{}: not a trace, skipped", loc.show(&rel));
                continue;
            }
            let keys = keys.into_iter().map(|(k, t)| (k.clone(), k, t)).collect();
            let shown = loc.show(&rel);
            out.push((TraceIn::Remote { loc: loc.clone(), local: rel.clone(), keys, shown }, rel));
        }
        if out.len() == before {
            anyhow::bail!("{}: no traces or snapshots under this prefix", loc.show(""));
        }
    }
    Ok((out, true))
}

/// Analyses one trace of a batch into `out/name`, through a staging folder
/// so a failed trace leaves no half-written folder. A remote trace is
/// downloaded into a temporary folder first (the importers and the replay
/// read whole files); a remote output folder is written locally, uploaded
/// file by file, and its stale files are removed.
fn analyze_one(
    input: &TraceIn,
    name: &str,
    out: &Location,
    opts: &crate::analysis::Options,
    plot: Option<&PlotConfig>,
) -> Result<Summary> {
    // A temporary folder only where something remote needs one: local
    // batches make no folder per trace.
    let mut scratch_dir: Option<tempfile::TempDir> = None;
    let mut scratch = || -> Result<PathBuf> {
        if scratch_dir.is_none() {
            let d =
                tempfile::Builder::new().prefix("fragscope-").tempdir().context("cannot create a temporary folder")?;
            scratch_dir = Some(d);
        }
        Ok(scratch_dir.as_ref().expect("just made").path().to_path_buf())
    };
    let desc = match input {
        TraceIn::Local(d) => d.clone(),
        TraceIn::Remote { loc, keys, local, .. } => {
            let scratch = scratch()?;
            for (key, to, modified) in keys {
                let dest = scratch.join("in").join(to);
                if let Some(dir) = dest.parent() {
                    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
                }
                std::fs::write(&dest, loc.get(key)?).with_context(|| format!("cannot write {}", dest.display()))?;
                // The object's date, not the download's: a trace without a
                // recorded start is dated by its files (the date partition).
                let _ = std::fs::File::options().write(true).open(&dest).and_then(|f| f.set_modified(*modified));
            }
            crate::input::describe(&scratch.join("in").join(local))
        }
    };
    let path = &desc.path;
    let a = crate::input::load(&desc, opts.device)
        .and_then(crate::input::allocator_view)
        .and_then(|loaded| crate::analysis::analyze_loaded(loaded, opts))
        .map_err(|e| {
            // Named once: most errors already start with the local path.
            let named = matches!(input, TraceIn::Local(..)) && format!("{e:#}").starts_with(&*path.to_string_lossy());
            if named { e } else { e.context(input.show()) }
        })?;
    let Some(dir) = out.local_dir() else {
        let folder = scratch()?.join("out");
        crate::output::write_trace_outputs(&a, &folder, plot)?;
        let mut written = std::collections::HashSet::new();
        let mut stack = vec![folder.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).with_context(|| format!("cannot read {}", d.display()))? {
                let p = e?.path();
                if p.is_dir() {
                    stack.push(p);
                } else if let Ok(rel) = p.strip_prefix(&folder) {
                    let key = format!("{name}/{}", rel.to_string_lossy());
                    out.put(&key, std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?)?;
                    written.insert(key);
                }
            }
        }
        for key in out.list(name)? {
            if !written.contains(&key) {
                out.delete(&key)?;
            }
        }
        return Ok(Summary::of(&a));
    };
    crate::trace::write_dir_atomic(&dir.join(name), |staging| crate::output::write_trace_outputs(&a, staging, plot))?;
    Ok(Summary::of(&a))
}

/// Output folder names: each trace's base name, suffixed when two traces
/// share one.
fn unique_names(bases: Vec<String>) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    bases
        .into_iter()
        .map(|base| {
            let n = seen.entry(base.clone()).or_insert(0);
            *n += 1;
            if *n == 1 { base } else { format!("{base}-{n}") }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A remote trace is named by its key, even where a file of the same
    /// name in the working directory is a link elsewhere; local ones are
    /// named through links; equal names get suffixes.
    #[test]
    fn output_names_follow_keys_and_links() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("real-run");
        std::fs::create_dir(&target).unwrap();
        let link = tmp.path().join("latest");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert_eq!(TraceIn::Local(crate::input::describe(&link)).name_base(), "real-run");
        let remote = TraceIn::Remote {
            loc: Location::open(tmp.path().to_str().unwrap(), false).unwrap(),
            keys: Vec::new(),
            // As if downloaded under the scratch folder; the same relative
            // name resolves to the link from the working directory here.
            local: link.to_string_lossy().into_owned(),
            shown: "s3://b/latest".into(),
        };
        assert_eq!(remote.name_base(), "latest");
        assert_eq!(unique_names(vec!["a".into(), "b".into(), "a".into(), "a".into()]), vec!["a", "b", "a-2", "a-3"]);
    }
}
