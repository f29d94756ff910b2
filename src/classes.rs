//! `fragscope classes fit` and `classes show`: the inputs read into
//! samples, the user's labels, the model written and described
//! ([`crate::analysis::classes`] does the learning).
//!
//! Inputs: a trace (anything `analyze` reads, or a folder of them) is
//! analysed without the what-if or the pictures, one sample per process;
//! a batch's output folder or a summary dataset (`summary.parquet`, local
//! or at an object-store URL) gives one sample per trace row, read from
//! its parts. Failed traces are skipped with a warning; a run in which
//! none succeeds fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::analysis::classes::{self, FitOptions, Model, Sample};
use crate::exit;
use crate::store::Location;

pub struct FitArgs {
    pub inputs: Vec<PathBuf>,
    pub output: PathBuf,
    pub labels: Option<PathBuf>,
    pub from: Option<PathBuf>,
    pub seed: u64,
    pub jobs: Option<usize>,
}

/// Where a summary dataset is, if `input` names one: the dataset folder
/// itself, a batch output holding one, or a URL ending in either.
fn dataset_root(input: &Path) -> Option<String> {
    let s = input.to_string_lossy().trim_end_matches('/').to_string();
    let name = crate::output::summary::DATASET;
    // The last path component, not a suffix: `old_summary.parquet` is not one.
    if let Some((root, last)) = s.rsplit_once('/').or(Some(("", s.as_str())))
        && last == name
    {
        return Some(if root.is_empty() { ".".to_string() } else { root.to_string() });
    }
    if crate::store::is_url(&s) || input.join(name).is_dir() {
        return Some(s);
    }
    None
}

/// One sample per trace row of the dataset under `root`.
fn dataset_samples(root: &str) -> Result<Vec<Sample>> {
    let loc = Location::open(root, false)?;
    let (rows, _) = crate::output::summary::read_parts(&loc)?;
    let mut out = Vec::new();
    for (name, row) in rows {
        match row {
            Ok(s) => out.push(Sample {
                trace: name,
                unit: None,
                features: s.features,
                trouble: classes::samples::trouble_of_summary(&s),
            }),
            Err(e) => tracing::warn!("{}: trace {name} failed in its batch ({e}); skipped", loc.show("")),
        }
    }
    Ok(out)
}

/// Analyses local traces on `jobs` threads; one sample per process.
fn trace_samples(paths: &[PathBuf], jobs: usize) -> Result<Vec<Sample>> {
    let (found, _) = crate::input::discover(paths)?;
    let opts = crate::analysis::Options { whatif: false, layout: false, ..crate::analysis::Options::default() };
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<(usize, Result<Vec<Sample>>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..jobs.min(found.len()).max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(f) = found.get(i) else { break };
                        let got = crate::input::load(&f.desc, None)
                            .and_then(crate::input::allocator_view)
                            .and_then(|l| crate::analysis::analyze_loaded(l, &opts))
                            .map(|a| classes::samples_of(&a));
                        mine.push((i, got));
                    }
                    mine
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    let mut results = results;
    results.sort_by_key(|r| r.0);
    let mut out = Vec::new();
    let mut failed = 0;
    for (i, r) in results {
        match r {
            Ok(s) => out.extend(s),
            Err(e) => {
                failed += 1;
                tracing::warn!("{}: {e:#}; skipped", found[i].path.display());
            }
        }
    }
    if out.is_empty() && failed > 0 {
        anyhow::bail!("no trace of {} could be analysed", crate::units::plural(failed, "input", "inputs"));
    }
    Ok(out)
}

/// The user's labels: `trace,class` rows, an optional header.
fn read_labels(path: &Path) -> Result<BTreeMap<String, String>> {
    let show = path.display();
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .trim(csv::Trim::All)
        .from_path(path)
        .with_context(|| format!("cannot read the labels {show}"))?;
    let mut out = BTreeMap::new();
    for (i, record) in reader.records().enumerate() {
        let record = record.with_context(|| format!("{show}: line {} does not read as CSV", i + 1))?;
        if i == 0 && record.get(0) == Some("trace") && record.get(1) == Some("class") {
            continue;
        }
        let (Some(trace), Some(class), 2) = (record.get(0), record.get(1), record.len()) else {
            anyhow::bail!("{show}: line {}: want two fields, `trace,class`, found {}", i + 1, record.len());
        };
        if trace.is_empty() || class.is_empty() {
            anyhow::bail!("{show}: line {}: an empty trace or class name", i + 1);
        }
        if let Some(old) = out.insert(trace.to_string(), class.to_string()).filter(|o| o != class) {
            anyhow::bail!("{show}: trace {trace} is labelled twice, {old} and {class}");
        }
    }
    Ok(out)
}

/// `fragscope classes fit`.
pub fn fit(args: &FitArgs) -> Result<u8> {
    let from = args.from.as_deref().map(Model::load).transpose()?;
    let labels = args.labels.as_deref().map(read_labels).transpose()?.unwrap_or_default();
    let jobs = args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let started = std::time::Instant::now();
    let mut samples = Vec::new();
    let mut traces = Vec::new();
    for input in &args.inputs {
        match dataset_root(input) {
            Some(root) => samples.extend(dataset_samples(&root)?),
            None => traces.push(input.clone()),
        }
    }
    if !traces.is_empty() {
        samples.extend(trace_samples(&traces, jobs)?);
    }
    let read = started.elapsed().as_secs_f64();
    let known: std::collections::HashSet<&str> = samples.iter().map(|s| s.trace.as_str()).collect();
    let unmatched: Vec<&String> = labels.keys().filter(|t| !known.contains(t.as_str())).collect();
    if !unmatched.is_empty() {
        let first: Vec<&str> = unmatched.iter().take(5).map(|s| s.as_str()).collect();
        tracing::warn!(
            "{} of the labels name no trace among the samples ({}{}): trace names are a batch's folder names",
            unmatched.len(),
            first.join(", "),
            if unmatched.len() > 5 { ", …" } else { "" }
        );
    }
    let opts = FitOptions { seed: args.seed, labels, from, ..FitOptions::default() };
    let model = classes::fit(&samples, &opts)?;
    model.save(&args.output)?;
    print!("{}", describe(&model));
    println!(
        "model {} written to {} ({} samples read in {read:.1} s, fitted in {:.1} s)",
        model.model_id,
        args.output.display(),
        model.samples,
        started.elapsed().as_secs_f64() - read
    );
    Ok(exit::OK)
}

/// `fragscope classes show`.
pub fn show(path: &Path) -> Result<u8> {
    let model = Model::load(path)?;
    print!("{}", describe(&model));
    Ok(exit::OK)
}

/// The classes, their directions and the classifiers' accuracy, as text.
pub fn describe(m: &Model) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} classes from {} samples (k = {} by the gap statistic{}):",
        m.classes.len(),
        m.samples,
        m.gap_k,
        if m.user_labelled > 0 { format!("; {} labelled by you", m.user_labelled) } else { String::new() }
    );
    let width = m.classes.iter().map(|c| c.name.chars().count()).max().unwrap_or(0);
    for c in &m.classes {
        let _ = writeln!(s, "  {:<width$}  {:>5}  {}", c.name, c.members, c.direction);
    }
    let pct = |v: f64| format!("{:.1} %", 100.0 * v);
    let _ = writeln!(
        s,
        "classifier: {} ({}-fold cross-validated accuracy: sparse autoencoder {} with layers {:?}, nearest centroid {})",
        m.classifier,
        m.accuracy.folds,
        pct(m.accuracy.ssae),
        m.network.hidden,
        pct(m.accuracy.nearest_centroid)
    );
    if let Some(r) = &m.refit {
        let _ = writeln!(
            s,
            "refit of model {}: kept {}; appeared: {}; vanished: {}",
            r.from_model,
            list(&r.kept),
            list(&r.appeared),
            list(&r.vanished)
        );
    }
    s
}

fn list(v: &[String]) -> String {
    if v.is_empty() { "none".to_string() } else { v.join(", ") }
}
