//! The batch summary of `analyze DIR`: `summary.parquet` (hive-partitioned
//! by source and date), `summary.csv` and `summary.md`, with the groups.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use polars::prelude::*;

use crate::analysis::predict::Risk;
use crate::analysis::summary::*;
use crate::output::write_parquet;
use crate::trace::write_atomic;
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
    "risk",
    "leaking",
    "leaked_bytes",
    "anomalies",
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
                Some(s.ooms.to_string()),
                s.oom_classes.first().map(|c| c.0.name().to_string()),
                s.risk.map(|r| r.name().to_string()),
                Some(s.leaking.to_string()),
                Some(s.leaked_bytes.max(0).to_string()),
                Some(s.anomalies.to_string()),
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

/// A DataFrame of summary rows with typed columns, without the partition
/// columns (`source`, `date`) that the dataset's folders hold.
pub(crate) fn summary_frame(
    rows: &[(&str, &std::result::Result<Summary, String>, Option<&(usize, String)>)],
) -> Result<DataFrame> {
    let ok = |f: fn(&Summary) -> f64| rows.iter().map(|r| r.1.as_ref().ok().map(f)).collect::<Vec<Option<f64>>>();
    let oku = |f: fn(&Summary) -> u64| rows.iter().map(|r| r.1.as_ref().ok().map(f)).collect::<Vec<Option<u64>>>();
    let text = |f: fn(&Summary) -> Option<String>| {
        rows.iter().map(|r| r.1.as_ref().ok().and_then(f)).collect::<Vec<Option<String>>>()
    };
    Ok(DataFrame::new_infer_height(vec![
        Column::new("trace".into(), rows.iter().map(|r| r.0.to_string()).collect::<Vec<String>>()),
        Column::new(
            "status".into(),
            rows.iter().map(|r| if r.1.is_ok() { "ok" } else { "error" }).collect::<Vec<&str>>(),
        ),
        Column::new("error".into(), rows.iter().map(|r| r.1.as_ref().err().cloned()).collect::<Vec<Option<String>>>()),
        Column::new("events".into(), oku(|s| s.events)),
        Column::new("processes".into(), oku(|s| s.processes as u64)),
        Column::new("duration_s".into(), ok(|s| s.duration_s)),
        Column::new("peak_live_bytes".into(), oku(|s| s.peak_live_bytes)),
        Column::new("peak_reserved_bytes".into(), oku(|s| s.peak_reserved_bytes)),
        Column::new("allocs".into(), oku(|s| s.allocs)),
        Column::new("score_final".into(), ok(|s| s.score.final_)),
        Column::new("score_mean".into(), ok(|s| s.score.mean)),
        Column::new("score_p95".into(), ok(|s| s.score.p95)),
        Column::new("score_max".into(), ok(|s| s.score.max)),
        Column::new("ext_frag_at_peak".into(), ok(|s| s.ext_frag_at_peak)),
        Column::new("ooms".into(), oku(|s| s.ooms)),
        Column::new("oom_class".into(), text(|s| s.oom_classes.first().map(|c| c.0.name().to_string()))),
        Column::new("risk".into(), text(|s| s.risk.map(|r| r.name().to_string()))),
        Column::new(
            "leaking".into(),
            rows.iter().map(|r| r.1.as_ref().ok().map(|s| s.leaking)).collect::<Vec<Option<bool>>>(),
        ),
        Column::new("leaked_bytes".into(), oku(|s| s.leaked_bytes.max(0) as u64)),
        Column::new("anomalies".into(), oku(|s| s.anomalies)),
        Column::new("cluster".into(), rows.iter().map(|r| r.2.map(|c| c.0 as u32)).collect::<Vec<Option<u32>>>()),
        Column::new(
            "cluster_label".into(),
            rows.iter().map(|r| r.2.map(|c| c.1.clone())).collect::<Vec<Option<String>>>(),
        ),
    ])?)
}

/// Writes the batch summary, worst first: `summary.parquet` — a
/// hive-partitioned dataset (`summary.parquet/source=S/date=D/part-0.parquet`)
/// that DuckDB, Spark or polars query in place —, `summary.csv` (one flat
/// file, every column), `summary.md` and `index.html` (the same, linking
/// to each trace's `report.html`). `clusters` (aligned with `rows`)
/// and `grouping` come from [`crate::analysis::cluster`] when the batch has enough
/// traces.
pub fn write_batch_summary(
    rows: &[SummaryRow],
    out: &Path,
    clusters: &[Option<(usize, String)>],
    grouping: Option<&crate::analysis::cluster::Clustering>,
) -> Result<()> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |r: &SummaryRow| r.1.as_ref().map_or(f64::INFINITY, |s| s.score.p95);
        key(&rows[b]).total_cmp(&key(&rows[a])).then_with(|| rows[a].0.cmp(&rows[b].0))
    });
    let cluster_of = |i: usize| clusters.get(i).and_then(|c| c.as_ref());

    // The dataset, one folder per (source, date), through a staging folder.
    let mut parts: std::collections::BTreeMap<(String, String), Vec<usize>> = Default::default();
    for &i in &order {
        let (source, date) = match &rows[i].1 {
            Ok(s) => (s.source.clone(), s.date.clone()),
            Err(_) => ("unknown".to_string(), today()),
        };
        parts.entry((source, date)).or_default().push(i);
    }
    let dataset = out.join("summary.parquet");
    let staging = out.join(".summary.parquet.partial");
    let _ = std::fs::remove_dir_all(&staging);
    for ((source, date), idx) in &parts {
        let dir = staging.join(format!("source={}", partition_value(source))).join(format!("date={date}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let part: Vec<_> = idx.iter().map(|&i| (rows[i].0.as_str(), &rows[i].1, cluster_of(i))).collect();
        write_parquet(&mut summary_frame(&part)?, &dir.join("part-0.parquet"))?;
    }
    if dataset.is_dir() {
        std::fs::remove_dir_all(&dataset).with_context(|| format!("cannot replace {}", dataset.display()))?;
    } else if dataset.exists() {
        std::fs::remove_file(&dataset).with_context(|| format!("cannot replace {}", dataset.display()))?;
    }
    std::fs::rename(&staging, &dataset).with_context(|| format!("cannot write {}", dataset.display()))?;

    let mut csv = csv::Writer::from_writer(Vec::new());
    csv.write_record(SUMMARY_COLUMNS)?;
    for &i in &order {
        let cells = summary_cells(&rows[i].0, &rows[i].1, cluster_of(i));
        csv.write_record(cells.into_iter().map(|c| c.unwrap_or_default()))?;
    }
    let csv = csv.into_inner().context("cannot finish summary.csv")?;
    write_atomic(&out.join("summary.csv"), &csv)?;
    let md = summary_md(rows, &order, clusters, grouping);
    write_atomic(&out.join("summary.md"), md.as_bytes())?;
    // Links only to the traces that have a report.
    let names: Vec<&str> = rows.iter().filter(|r| r.1.is_ok()).map(|r| r.0.as_str()).collect();
    write_atomic(&out.join("index.html"), super::html::index_html(&md, &names).as_bytes())?;
    Ok(())
}

/// A partition value safe in a folder name.
pub(crate) fn partition_value(v: &str) -> String {
    v.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect()
}

pub(crate) fn summary_md(
    rows: &[SummaryRow],
    order: &[usize],
    clusters: &[Option<(usize, String)>],
    grouping: Option<&crate::analysis::cluster::Clustering>,
) -> String {
    let mut md = String::from("# fragscope batch summary\n\nWorst first (by p95 score); failed traces on top.\n\n");
    md.push_str("| trace | status | risk | score final | p95 | max | OOMs | OOM class | peak live | group |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for &i in order {
        let (name, r) = (&rows[i].0, &rows[i].1);
        let group = clusters.get(i).and_then(|c| c.as_ref()).map_or(String::new(), |c| c.1.clone());
        match r {
            Ok(s) => {
                let _ = writeln!(
                    md,
                    "| {name} | ok | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {group} |",
                    s.risk.map_or("n/a", Risk::name),
                    s.score.final_,
                    s.score.p95,
                    s.score.max,
                    s.ooms,
                    s.oom_classes.first().map_or("—", |c| c.0.name()),
                    bytes(s.peak_live_bytes),
                );
            }
            Err(e) => {
                let _ = writeln!(
                    md,
                    "| {name} | **error**: {} | | | | | | | | |",
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
                let members: Vec<&str> = (0..rows.len())
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
