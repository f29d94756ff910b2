//! The batch summary of `analyze DIR`: `summary.parquet` (hive-partitioned
//! by source and date), `summary.csv` and `summary.md`, with the groups.

use std::fmt::Write as _;

use anyhow::{Context, Result};
use arrow_array::{BooleanArray, Float64Array, StringArray, UInt32Array, UInt64Array};

use crate::trace::table::{Columns, Table};

use crate::analysis::predict::Risk;
use crate::analysis::summary::*;
use crate::store::Location;
use crate::units::bytes;

/// The columns of the batch summary, in order (csv and Parquet).
pub(crate) const SUMMARY_COLUMNS: &[&str] = &[
    "trace",
    "status",
    "error",
    "source",
    "date",
    "events",
    "processes",
    "duration_s",
    "peak_live_bytes",
    "peak_reserved_bytes",
    "allocs",
    "score_final",
    "score_mean",
    "score_p95",
    "score_max",
    "ext_frag_at_peak",
    "ooms",
    "oom_class",
    "oom_risk",
    "fragmentation_level",
    "leaking",
    "leaked_bytes",
    "anomalies",
    "needs_bytes",
    "class",
    "class_confidence",
    "cluster",
    "cluster_label",
];

/// One summary row's values as text (csv) — `None` for nulls.
pub(crate) fn summary_cells(
    name: &str,
    r: &std::result::Result<Summary, String>,
    cluster: Option<&(usize, String)>,
) -> Vec<Option<String>> {
    let mut v: Vec<Option<String>> = vec![Some(name.to_string())];
    match r {
        Ok(s) => {
            v.extend([
                Some("ok".into()),
                None,
                Some(s.source.clone()),
                Some(s.date.clone()),
                Some(s.events.to_string()),
                Some(s.processes.to_string()),
                Some(format!("{:.6}", s.duration_s)),
                Some(s.peak_live_bytes.to_string()),
                Some(s.peak_reserved_bytes.to_string()),
                Some(s.allocs.to_string()),
                Some(format!("{:.6}", s.score.final_)),
                Some(format!("{:.6}", s.score.mean)),
                Some(format!("{:.6}", s.score.p95)),
                Some(format!("{:.6}", s.score.max)),
                Some(format!("{:.6}", s.ext_frag_at_peak)),
                s.history.then(|| s.ooms.to_string()),
                s.oom_classes.first().map(|c| c.0.name().to_string()),
                Some(s.oom_risk.name().to_string()),
                s.level_name().map(str::to_string),
                s.leaking_known().map(|l| l.to_string()),
                Some(s.leaked_bytes.max(0).to_string()),
                Some(s.anomalies.to_string()),
                s.needs_bytes.map(|b| b.to_string()),
                s.class.as_ref().map(|c| c.0.clone()),
                s.class.as_ref().map(|c| c.1.to_string()),
            ]);
        }
        Err(e) => {
            v.extend([Some("error".into()), Some(e.clone()), Some("unknown".into()), Some(today())]);
            v.resize(SUMMARY_COLUMNS.len() - 2, None);
        }
    }
    v.push(cluster.map(|c| c.0.to_string()));
    v.push(cluster.map(|c| c.1.clone()));
    v
}

pub(crate) fn today() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string().chars().take(10).collect()
}

/// The summary rows as typed columns, without the partition columns
/// (`source`, `date`) that the dataset's folders hold.
pub(crate) fn summary_frame(
    rows: &[(&str, &std::result::Result<Summary, String>, Option<&(usize, String)>)],
) -> Columns {
    let ok = |f: fn(&Summary) -> f64| Float64Array::from_iter(rows.iter().map(|r| r.1.as_ref().ok().map(f)));
    let oku = |f: fn(&Summary) -> u64| UInt64Array::from_iter(rows.iter().map(|r| r.1.as_ref().ok().map(f)));
    let text =
        |f: fn(&Summary) -> Option<String>| StringArray::from_iter(rows.iter().map(|r| r.1.as_ref().ok().and_then(f)));
    let mut c = Columns::new();
    c.push("trace", StringArray::from_iter_values(rows.iter().map(|r| r.0)))
        .push("status", StringArray::from_iter_values(rows.iter().map(|r| if r.1.is_ok() { "ok" } else { "error" })))
        .push("error", StringArray::from_iter(rows.iter().map(|r| r.1.as_ref().err())))
        .push("events", oku(|s| s.events))
        .push("processes", oku(|s| s.processes as u64))
        .push("duration_s", ok(|s| s.duration_s))
        .push("peak_live_bytes", oku(|s| s.peak_live_bytes))
        .push("peak_reserved_bytes", oku(|s| s.peak_reserved_bytes))
        .push("allocs", oku(|s| s.allocs))
        .push("score_final", ok(|s| s.score.final_))
        .push("score_mean", ok(|s| s.score.mean))
        .push("score_p95", ok(|s| s.score.p95))
        .push("score_max", ok(|s| s.score.max))
        .push("ext_frag_at_peak", ok(|s| s.ext_frag_at_peak))
        .push(
            "ooms",
            UInt64Array::from_iter(rows.iter().map(|r| r.1.as_ref().ok().and_then(|s| s.history.then_some(s.ooms)))),
        )
        .push("oom_class", text(|s| s.oom_classes.first().map(|c| c.0.name().to_string())))
        .push("oom_risk", text(|s| Some(s.oom_risk.name().to_string())))
        .push("fragmentation_level", text(|s| s.level_name().map(str::to_string)))
        .push(
            "leaking",
            BooleanArray::from_iter(rows.iter().map(|r| r.1.as_ref().ok().and_then(Summary::leaking_known))),
        )
        .push("leaked_bytes", oku(|s| s.leaked_bytes.max(0) as u64))
        .push("anomalies", oku(|s| s.anomalies))
        .push("needs_bytes", UInt64Array::from_iter(rows.iter().map(|r| r.1.as_ref().ok().and_then(|s| s.needs_bytes))))
        .push("class", text(|s| s.class.as_ref().map(|c| c.0.clone())))
        .push(
            "class_confidence",
            Float64Array::from_iter(rows.iter().map(|r| r.1.as_ref().ok().and_then(|s| s.class.as_ref().map(|c| c.1)))),
        );
    // The grouping features, so that `summarize` can group traces that
    // other processes analysed.
    for (j, f) in crate::analysis::cluster::FEATURES.iter().enumerate() {
        c.push(
            format!("feature_{f}"),
            Float64Array::from_iter(rows.iter().map(|r| r.1.as_ref().ok().map(|s| s.features[j]))),
        );
    }
    c.push("cluster", UInt32Array::from_iter(rows.iter().map(|r| r.2.map(|c| c.0 as u32))))
        .push("cluster_label", StringArray::from_iter(rows.iter().map(|r| r.2.map(|c| c.1.as_str()))));
    c
}

/// The summary dataset's folder under the output root.
pub const DATASET: &str = "summary.parquet";

/// Worst first (failed traces on top, then by OOM risk, then by p95
/// score), then by name.
fn worst_first(rows: &[SummaryRow]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |r: &SummaryRow| {
            r.1.as_ref().map_or((crate::analysis::risk::OomRisk::Oom, f64::INFINITY, true), |s| {
                (s.oom_risk, s.score.p95, false)
            })
        };
        let (ka, kb) = (key(&rows[a]), key(&rows[b]));
        kb.2.cmp(&ka.2).then(kb.0.cmp(&ka.0)).then(kb.1.total_cmp(&ka.1)).then_with(|| rows[a].0.cmp(&rows[b].0))
    });
    order
}

/// Writes one shard's rows (all rows when `shard` is None) as parts of the
/// hive-partitioned dataset: `summary.parquet/source=S/date=D/part-I-of-N.parquet`,
/// worst first, without groups (`summarize` adds them). Then removes the
/// shard's own parts that this run did not write (a re-run replaces only
/// its parts); without a shard, the run owns the dataset and every other
/// part goes.
pub fn write_parts(loc: &Location, rows: &[SummaryRow], shard: Option<Shard>) -> Result<()> {
    let own = shard.unwrap_or(Shard { index: 0, count: 1 }).part_name();
    let mut parts: std::collections::BTreeMap<(String, String), Vec<usize>> = Default::default();
    for i in worst_first(rows) {
        let (source, date) = match &rows[i].1 {
            Ok(s) => (s.source.clone(), s.date.clone()),
            Err(_) => ("unknown".to_string(), today()),
        };
        parts.entry((source, date)).or_default().push(i);
    }
    let mut written = std::collections::HashSet::new();
    for ((source, date), idx) in &parts {
        let rel = format!("{DATASET}/source={}/date={date}/{own}", partition_value(source));
        let part: Vec<_> = idx.iter().map(|&i| (rows[i].0.as_str(), &rows[i].1, None)).collect();
        loc.put(&rel, parquet_bytes(&summary_frame(&part), &loc.show(&rel))?)?;
        written.insert(rel);
    }
    for key in loc.list(DATASET)? {
        let name = key.rsplit('/').next().unwrap_or_default();
        if !written.contains(&key) && (shard.is_none() || name == own) {
            loc.delete(&key)?;
        }
    }
    Ok(())
}

/// (I, N) of a part named `part-I-of-N.parquet`.
fn shard_of(key: &str) -> Option<(u64, u64)> {
    let name = key.rsplit('/').next()?.strip_prefix("part-")?.strip_suffix(".parquet")?;
    let (i, n) = name.split_once("-of-")?;
    Some((i.parse().ok()?, n.parse().ok()?))
}

/// A batch as `summarize` rebuilds it: the rows of every part, their groups
/// (aligned with the rows) and the grouping.
pub struct Batch {
    pub rows: Vec<SummaryRow>,
    pub clusters: Vec<Option<(usize, String)>>,
    pub grouping: Option<crate::analysis::cluster::Clustering>,
}

/// The rows of every part under `loc/summary.parquet`, and each part's key
/// with the span of its rows. A trace in two parts is refused (a part left
/// over from an earlier run).
#[allow(clippy::type_complexity)]
pub(crate) fn read_parts(loc: &Location) -> Result<(Vec<SummaryRow>, Vec<(String, std::ops::Range<usize>)>)> {
    let keys: Vec<String> = loc
        .list(DATASET)?
        .into_iter()
        .filter(|k| k.rsplit('/').next().is_some_and(|n| n.starts_with("part-") && n.ends_with(".parquet")))
        .collect();
    if keys.is_empty() {
        anyhow::bail!(
            "{}: no summary parts (source=…/date=…/part-*.parquet); run `fragscope analyze` into {} first",
            loc.show(DATASET),
            loc.show("")
        );
    }
    let mut rows: Vec<SummaryRow> = Vec::new();
    let mut spans: Vec<(String, std::ops::Range<usize>)> = Vec::new();
    for key in keys {
        let shown = loc.show(&key);
        let bytes = loc.get(&key)?;
        let df = Table::from_bytes(bytes, &shown)?;
        let (source, date) = partition_of(&key).with_context(|| format!("{shown}: not under source=…/date=…"))?;
        let start = rows.len();
        rows.extend(rows_of(&df, &source, &date).with_context(|| format!("{shown}: not a fragscope summary part"))?);
        spans.push((key, start..rows.len()));
    }
    let mut seen: std::collections::HashMap<&str, &str> = Default::default();
    for (key, span) in &spans {
        for r in &rows[span.clone()] {
            if let Some(other) = seen.insert(&r.0, key) {
                anyhow::bail!(
                    "trace {} is in two summary parts, {} and {}: a part is left over from an earlier run (another --shard count?); delete the stale one and run summarize again",
                    r.0,
                    loc.show(other),
                    loc.show(key)
                );
            }
        }
    }
    Ok((rows, spans))
}

/// `fragscope summarize`: reads every part under `loc/summary.parquet`,
/// groups the traces (k-means with the gap statistic, over the traces in
/// name order, so the groups do not depend on how the batch was sharded),
/// writes the groups back into the parts, and writes `summary.csv`,
/// `summary.md` and `index.html`.
pub fn summarize(loc: &Location, seed: u64) -> Result<Batch> {
    let (rows, spans) = read_parts(loc)?;
    let keys: Vec<&String> = spans.iter().map(|s| &s.0).collect();
    // Every part of one sharded run has the same count; a shard of which
    // no part exists anywhere either had no trace or did not run (or its
    // parts were lost): said, since the summary would lack its traces.
    let shards: std::collections::BTreeMap<u64, std::collections::BTreeSet<u64>> =
        keys.iter().filter_map(|k| shard_of(k)).fold(Default::default(), |mut m, (i, n)| {
            m.entry(n).or_default().insert(i);
            m
        });
    // (Parts of several counts are refused below.)
    if let Some((n, present)) = shards.iter().next().filter(|_| shards.len() == 1) {
        let missing = n.saturating_sub(present.len() as u64);
        if missing > 0 {
            let first: Vec<String> =
                (0..*n).filter(|i| !present.contains(i)).take(5).map(|i| format!("{i}/{n}")).collect();
            tracing::warn!(
                "{}: no part of {} ({}{}) in any partition: a shard that drew no trace writes none, but one that did \
                 not run or whose parts were lost would read the same; the summary holds the other shards' traces",
                loc.show(DATASET),
                crate::units::plural(missing, "shard", "shards"),
                first.join(", "),
                if missing > 5 { ", …" } else { "" }
            );
        }
    }
    // Parts of two shard counts that share no trace (the check above).
    if shards.len() > 1 {
        anyhow::bail!(
            "{}: parts of {} sharded runs ({}): a part is left over from an earlier run with another --shard count; \
             delete the stale ones and run summarize again",
            loc.show(DATASET),
            shards.len(),
            shards.keys().map(|n| format!("part-*-of-{n}")).collect::<Vec<_>>().join(", ")
        );
    }
    let mut by_name: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].1.is_ok()).collect();
    by_name.sort_by(|&a, &b| rows[a].0.cmp(&rows[b].0));
    let features: Vec<_> = by_name.iter().filter_map(|&i| rows[i].1.as_ref().ok().map(|s| s.features)).collect();
    let troubles: Vec<_> = by_name
        .iter()
        .filter_map(|&i| rows[i].1.as_ref().ok())
        .map(|s| crate::analysis::cluster::Trouble {
            oom_class: (s.ooms > 0)
                .then(|| s.oom_classes.first().map_or(crate::analysis::oom::OomClass::Unknown, |c| c.0)),
            leaking: s.leaking,
        })
        .collect();
    let grouping = crate::analysis::cluster::cluster(&features, &troubles, seed)?;
    let mut clusters: Vec<Option<(usize, String)>> = vec![None; rows.len()];
    if let Some(g) = &grouping {
        for (k, &i) in by_name.iter().enumerate() {
            let c = g.assignments[k];
            clusters[i] = Some((c, g.labels[c].clone()));
        }
    }
    for (key, span) in &spans {
        let part: Vec<_> = span.clone().map(|i| (rows[i].0.as_str(), &rows[i].1, clusters[i].as_ref())).collect();
        loc.put(key, parquet_bytes(&summary_frame(&part), &loc.show(key))?)?;
    }
    write_summary_files(loc, &rows, &clusters, grouping.as_ref())?;
    Ok(Batch { rows, clusters, grouping })
}

/// `source=S/date=D` of a part's key.
fn partition_of(key: &str) -> Option<(String, String)> {
    let mut source = None;
    let mut date = None;
    for seg in key.split('/') {
        if let Some(v) = seg.strip_prefix("source=") {
            source = Some(v.to_string());
        } else if let Some(v) = seg.strip_prefix("date=") {
            date = Some(v.to_string());
        }
    }
    Some((source?, date?))
}

/// The rows of one part, back as summaries.
fn rows_of(df: &Table, source: &str, date: &str) -> Result<Vec<SummaryRow>> {
    let text = |name: &str| df.texts(name);
    let uint =
        |name: &str| -> Result<Vec<u64>> { Ok(df.ints::<u64>(name)?.into_iter().map(|v| v.unwrap_or(0)).collect()) };
    let float =
        |name: &str| -> Result<Vec<f64>> { Ok(df.floats(name)?.into_iter().map(|v| v.unwrap_or(0.0)).collect()) };
    let trace = text("trace")?;
    let status = text("status")?;
    let error = text("error")?;
    let (events, processes, peak_live, peak_reserved, allocs, ooms, leaked, anomalies) = (
        uint("events")?,
        uint("processes")?,
        uint("peak_live_bytes")?,
        uint("peak_reserved_bytes")?,
        uint("allocs")?,
        df.ints::<u64>("ooms")?,
        uint("leaked_bytes")?,
        uint("anomalies")?,
    );
    let (duration, final_, mean, p95, max, ext) = (
        float("duration_s")?,
        float("score_final")?,
        float("score_mean")?,
        float("score_p95")?,
        float("score_max")?,
        float("ext_frag_at_peak")?,
    );
    let oom_class = text("oom_class")?;
    let oom_risk = text("oom_risk")?;
    let risk = text("fragmentation_level")?;
    // Null: cannot tell (or no process judged); read back as cannot tell.
    let leaking = df.bools("leaking")?;
    // Written since the memory needed (issue 57): older parts lack it.
    let needs = if df.has("needs_bytes") { df.ints::<u64>("needs_bytes")? } else { vec![None; df.height()] };
    // Written since the fleet classes (issue 61).
    let (fleet_class, confidence) = if df.has("class") {
        (text("class")?, df.floats("class_confidence")?)
    } else {
        (vec![None; df.height()], vec![None; df.height()])
    };
    let features: Vec<Vec<f64>> =
        crate::analysis::cluster::FEATURES.iter().map(|f| float(&format!("feature_{f}"))).collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(df.height());
    for i in 0..df.height() {
        let name = trace[i].clone().context("a row without a trace name")?;
        if status[i].as_deref() != Some("ok") {
            out.push((name, Err(error[i].clone().unwrap_or_else(|| "failed".into()))));
            continue;
        }
        let class = oom_class[i].as_deref().and_then(crate::analysis::oom::OomClass::from_name);
        out.push((
            name.clone(),
            Ok(Summary {
                name,
                source: source.to_string(),
                events: events[i],
                processes: processes[i] as usize,
                duration_s: duration[i],
                peak_live_bytes: peak_live[i],
                score: ScoreStats { final_: final_[i], mean: mean[i], p95: p95[i], max: max[i] },
                ooms: ooms[i].unwrap_or(0),
                history: ooms[i].is_some(),
                anomalies: anomalies[i],
                risk: risk[i].as_deref().and_then(|r| <Risk as clap::ValueEnum>::from_str(r, true).ok()),
                oom_risk: oom_risk[i]
                    .as_deref()
                    .and_then(crate::analysis::risk::OomRisk::from_name)
                    .unwrap_or(crate::analysis::risk::OomRisk::Unknown),
                // The part keeps the most frequent class only.
                oom_classes: class.map(|c| vec![(c, ooms[i].unwrap_or(0))]).unwrap_or_default(),
                leaking: leaking[i] == Some(true),
                leak_verdict: Some(match leaking[i] {
                    Some(true) => crate::analysis::leak::Verdict::Leaking,
                    Some(false) => crate::analysis::leak::Verdict::NotLeaking,
                    None => crate::analysis::leak::Verdict::CannotTell,
                }),
                leaked_bytes: leaked[i] as i64,
                allocs: allocs[i],
                alloc_rate: if duration[i] > 0.0 { allocs[i] as f64 / duration[i] } else { 0.0 },
                peak_reserved_bytes: peak_reserved[i],
                ext_frag_at_peak: ext[i],
                needs_bytes: needs[i],
                class: fleet_class[i].clone().map(|c| (c, confidence[i].unwrap_or(0.0))),
                features: std::array::from_fn(|j| features[j][i]),
                date: date.to_string(),
            }),
        ));
    }
    Ok(out)
}

fn parquet_bytes(columns: &Columns, shown: &str) -> Result<Vec<u8>> {
    columns.to_parquet().with_context(|| format!("cannot write {shown}"))
}

/// Writes `summary.csv` (one flat file, every column), `summary.md` and
/// `index.html` (the same, linking to each trace's `report.html`), worst
/// first. `clusters` (aligned with `rows`) and `grouping` come from
/// [`crate::analysis::cluster`] when the batch has enough traces.
pub fn write_summary_files(
    loc: &Location,
    rows: &[SummaryRow],
    clusters: &[Option<(usize, String)>],
    grouping: Option<&crate::analysis::cluster::Clustering>,
) -> Result<()> {
    let order = worst_first(rows);
    let cluster_of = |i: usize| clusters.get(i).and_then(|c| c.as_ref());
    let mut csv = csv::Writer::from_writer(Vec::new());
    csv.write_record(SUMMARY_COLUMNS)?;
    for &i in &order {
        let cells = summary_cells(&rows[i].0, &rows[i].1, cluster_of(i));
        csv.write_record(cells.into_iter().map(|c| c.unwrap_or_default()))?;
    }
    let csv = csv.into_inner().context("cannot finish summary.csv")?;
    loc.put("summary.csv", csv)?;
    let md = summary_md(rows, &order, clusters, grouping);
    // Links only to the traces that have a report, and to the view of
    // those that have one. A store other than a folder is not asked per
    // trace (a request each): its reports keep the link, which opens the
    // report at its top when it has no view.
    let has_view = |name: &str| loc.local_dir().is_none_or(|d| d.join(name).join("view").join("manifest.js").is_file());
    let names: Vec<(&str, bool)> =
        rows.iter().filter(|r| r.1.is_ok()).map(|r| (r.0.as_str(), has_view(&r.0))).collect();
    loc.put("index.html", super::html::index_html(&md, &names).into_bytes())?;
    loc.put("summary.md", md.into_bytes())?;
    Ok(())
}

/// A partition value safe in a folder name.
pub(crate) fn partition_value(v: &str) -> String {
    v.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect()
}

/// The fleet classes of a batch's traces, in the order of their worst
/// member: (name, traces, mean confidence).
fn fleet_classes(rows: &[SummaryRow], order: &[usize]) -> Vec<(String, usize, f64)> {
    let mut out: Vec<(String, usize, f64)> = Vec::new();
    for &i in order {
        if let Some((name, conf)) = rows[i].1.as_ref().ok().and_then(|s| s.class.as_ref()) {
            match out.iter_mut().find(|c| &c.0 == name) {
                Some(c) => {
                    c.1 += 1;
                    c.2 += conf;
                }
                None => out.push((name.clone(), 1, *conf)),
            }
        }
    }
    for c in out.iter_mut() {
        c.2 /= c.1 as f64;
    }
    out
}

/// The "## Classes" table of a batch analysed with `--classes`.
fn classes_table(rows: &[SummaryRow], classes: &[(String, usize, f64)]) -> String {
    let ok = rows.iter().filter(|r| r.1.is_ok()).count();
    let mut md = String::from("## Classes\n\n| class | traces | share | mean confidence |\n|---|---|---|---|\n");
    for (name, n, conf) in classes {
        let _ = writeln!(
            md,
            "| {} | {n} | {:.0} % | {conf:.2} |",
            name.replace('|', "\\|"),
            100.0 * *n as f64 / ok.max(1) as f64
        );
    }
    md
}

pub(crate) fn summary_md(
    rows: &[SummaryRow],
    order: &[usize],
    clusters: &[Option<(usize, String)>],
    grouping: Option<&crate::analysis::cluster::Clustering>,
) -> String {
    let class_of = |i: usize| rows[i].1.as_ref().ok().and_then(|s| s.class.as_ref());
    let classes = fleet_classes(rows, order);
    let mut md = String::from("# fragscope batch summary\n\n");
    if classes.is_empty() {
        md.push_str("Worst first (by OOM risk, then p95 fragmentation score); failed traces on top.\n\n");
        md.push_str("| trace | status | OOM risk | fragmentation level | score final | p95 | max | OOMs | OOM class | peak live | needs | group |\n");
        md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    } else {
        md.push_str(
            "By fleet class (`--classes`), the class of the worst trace first; worst first within a class (by OOM risk, then p95 fragmentation score); failed traces on top.\n\n",
        );
        md.push_str(&classes_table(rows, &classes));
        md.push_str("\n## Traces\n\n| trace | class | status | OOM risk | fragmentation level | score final | p95 | max | OOMs | OOM class | peak live | needs | group |\n");
        md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    }
    let grouped: Vec<usize> = if classes.is_empty() {
        order.to_vec()
    } else {
        // Failed traces first, then class by class, then traces analysed
        // without a class (parts of an older run).
        let rank = |i: usize| match (&rows[i].1, class_of(i)) {
            (Err(_), _) => 0,
            (Ok(_), Some(c)) => 1 + classes.iter().position(|x| x.0 == c.0).unwrap_or(0),
            (Ok(_), None) => 1 + classes.len(),
        };
        let mut g = order.to_vec();
        g.sort_by_key(|&i| rank(i));
        g
    };
    for &i in &grouped {
        let (name, r) = (&rows[i].0, &rows[i].1);
        let group = clusters.get(i).and_then(|c| c.as_ref()).map_or(String::new(), |c| c.1.clone());
        let class = if classes.is_empty() {
            String::new()
        } else {
            format!(" {} |", class_of(i).map_or("—".to_string(), |c| c.0.replace('|', "\\|")))
        };
        match r {
            Ok(s) => {
                let _ = writeln!(
                    md,
                    "| {name} |{class} ok | {} | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} | {group} |",
                    s.oom_risk.name(),
                    // As analyze's one-line summary says them (the
                    // dataset's `none` and null are for machines).
                    s.risk.map_or("not judged", Risk::name),
                    s.score.final_,
                    s.score.p95,
                    s.score.max,
                    if s.history { s.ooms.to_string() } else { "—".into() },
                    s.oom_classes.first().map_or("—", |c| c.0.name()),
                    bytes(s.peak_live_bytes),
                    s.needs_bytes.map_or("—".to_string(), bytes),
                );
            }
            Err(e) => {
                let _ = writeln!(
                    md,
                    "| {name} |{class} **error**: {} | | | | | | | | | | |",
                    e.replace('|', "\\|").replace('\n', " ")
                );
            }
        }
    }
    match grouping {
        Some(g) => {
            let _ = writeln!(
                md,
                "\n## Groups\n\nk-means on the standardised features ({}), projected on the principal components that carry 90 % of their variance; k = {} chosen by the gap statistic (the smallest k with Gap(k) ≥ Gap(k+1) − s(k+1)).\n",
                crate::analysis::cluster::FEATURES.join(", "),
                g.k
            );
            md.push_str(
                "| group | traces | what stands out (z-score of the centroid) | examples |\n|---|---|---|---|\n",
            );
            for (c, label) in g.labels.iter().enumerate() {
                // Worst first, as the table above.
                let members: Vec<&str> = order
                    .iter()
                    .copied()
                    .filter(|&i| clusters.get(i).and_then(|x| x.as_ref()).is_some_and(|x| x.0 == c))
                    .map(|i| rows[i].0.as_str())
                    .collect();
                let mut top: Vec<(usize, f64)> = g.centroids[c].iter().copied().enumerate().collect();
                top.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()));
                let stand: Vec<String> = top
                    .iter()
                    .take(3)
                    .filter(|t| t.1.abs() > 0.5)
                    .map(|t| format!("{} {:+.1}", crate::analysis::cluster::FEATURES[t.0], t.1))
                    .collect();
                let _ = writeln!(
                    md,
                    "| {label} | {} | {} | {}{} |",
                    members.len(),
                    if stand.is_empty() { "nothing".to_string() } else { stand.join(", ") },
                    members.iter().take(5).copied().collect::<Vec<_>>().join(", "),
                    if members.len() > 5 { ", …" } else { "" }
                );
            }
            md.push_str("\n| k | Gap(k) | s(k) |\n|---|---|---|\n");
            for (k, (gap, sk)) in g.gaps.iter().enumerate() {
                let _ = writeln!(md, "| {} | {gap:.3} | {sk:.3} |", k + 1);
            }
        }
        None => {
            let _ = writeln!(
                md,
                "\nGroups: not computed (fewer than {} analysed traces).",
                crate::analysis::cluster::MIN_TRACES
            );
        }
    }
    md
}

/// One shard of a batch: `--shard I/N`, 0 ≤ I < N.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub index: u32,
    pub count: u32,
}

impl Shard {
    /// Whether the trace at `rel` (its path relative to the input root,
    /// `/`-separated) belongs to this shard: FNV-1a (64 bit) of the path's
    /// UTF-8 bytes, modulo N. FNV is fixed by its definition, unlike std's
    /// hasher, so the assignment is the same on every machine and release.
    pub fn holds(self, rel: &str) -> bool {
        let rel = rel.replace('\\', "/");
        let mut h = fnv::FnvHasher::default();
        std::hash::Hasher::write(&mut h, rel.trim_matches('/').as_bytes());
        std::hash::Hasher::finish(&h) % u64::from(self.count) == u64::from(self.index)
    }

    /// The file name of this shard's summary parts.
    pub fn part_name(self) -> String {
        format!("part-{}-of-{}.parquet", self.index, self.count)
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Shard {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Shard, String> {
        let bad = || format!("`{s}`: expected I/N with 0 ≤ I < N (e.g. 0/4 … 3/4)");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (i, n) = (i.trim().parse::<u32>().map_err(|_| bad())?, n.trim().parse::<u32>().map_err(|_| bad())?);
        if n == 0 || i >= n {
            return Err(bad());
        }
        Ok(Shard { index: i, count: n })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_specs_parse_and_reject() {
        assert_eq!("2/4".parse::<Shard>(), Ok(Shard { index: 2, count: 4 }));
        assert_eq!(" 0 / 1 ".parse::<Shard>(), Ok(Shard { index: 0, count: 1 }));
        for bad in ["3/2", "2/2", "0/0", "1", "a/b", "-1/2", "1/2/3"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
    }

    #[test]
    fn shards_are_disjoint_cover_and_are_pinned() {
        // FNV-1a 64 of "a" is 0xaf63dc4c8601ec8c, which is 5 mod 7: the
        // assignment must never change between releases.
        assert!(Shard { index: 5, count: 7 }.holds("a"));
        assert!(Shard { index: 5, count: 7 }.holds("/a/"));
        for n in 1..=9 {
            for t in 0..500 {
                let rel = format!("runs/trace-{t}");
                let owners = (0..n).filter(|&i| Shard { index: i, count: n }.holds(&rel)).count();
                assert_eq!(owners, 1, "{rel} in {owners} of {n} shards");
            }
        }
        // Roughly even: no shard of 4 gets fewer than a sixth of 2000 names.
        for i in 0..4 {
            let k = (0..2000).filter(|t| Shard { index: i, count: 4 }.holds(&format!("t{t}"))).count();
            assert!(k > 333, "shard {i}/4 holds {k} of 2000");
        }
    }
}
