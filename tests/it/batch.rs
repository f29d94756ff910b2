//! Batch analysis for CI: the hive-partitioned summary dataset read back
//! by polars and by DuckDB (or pyarrow), and the grouping of traces by
//! their problem on a population of known patterns.

use std::fs;
use std::path::{Path, PathBuf};

use crate::common::{fragscope, read_dataset};
use fragscope::analysis::cluster::adjusted_rand_index;
use polars::prelude::*;
use serde_json::Value;

/// 10 traces each of `steady`, `fragmenting` and `leak` (different seeds),
/// analysed as one batch.
fn population(tmp: &Path) -> PathBuf {
    let runs = tmp.join("runs");
    for pattern in ["steady", "fragmenting", "leak"] {
        for seed in 1..=10 {
            fragscope()
                .args(["synth", "--pattern", pattern, "--events", "20k", "--seed", &seed.to_string(), "-o"])
                .arg(runs.join(format!("{pattern}-{seed}")))
                .assert()
                .success();
        }
    }
    let out = tmp.join("out");
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "--jobs", "2", "-o"]).arg(&out).assert().success();
    out
}

#[test]
fn known_patterns_are_grouped_and_the_dataset_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let out = population(tmp.path());

    // The dataset: one folder per (source, date), read in place by polars.
    let parts: Vec<_> = fs::read_dir(out.join("summary.parquet")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(parts, vec!["source=synthetic"]);
    let df = read_dataset(&out.join("summary.parquet"));
    assert_eq!(df.height(), 30);
    let source: Vec<String> = df
        .column("source")
        .unwrap()
        .cast(&DataType::String)
        .unwrap()
        .str()
        .unwrap()
        .iter()
        .flatten()
        .map(String::from)
        .collect();
    assert!(source.iter().all(|s| s == "synthetic"));
    assert!(df.column("date").is_ok());
    let names: Vec<String> = df.column("trace").unwrap().str().unwrap().iter().flatten().map(String::from).collect();
    let clusters: Vec<usize> = df
        .column("cluster")
        .unwrap()
        .u32()
        .unwrap()
        .iter()
        .map(|c| c.expect("every trace has a group") as usize)
        .collect();
    let labels: Vec<String> =
        df.column("cluster_label").unwrap().str().unwrap().iter().flatten().map(String::from).collect();

    // The groups recover the patterns, with k = 3 and fitting names.
    let truth: Vec<usize> = names
        .iter()
        .map(|n| ["steady", "fragmenting", "leak"].iter().position(|p| n.starts_with(p)).unwrap())
        .collect();
    let ari = adjusted_rand_index(&clusters, &truth);
    assert!(ari >= 0.8, "adjusted Rand index {ari}");
    let mut distinct = clusters.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "k chosen by the gap statistic");
    let label_of = |pattern: &str| {
        let i = names.iter().position(|n| n.starts_with(pattern)).unwrap();
        labels[i].clone()
    };
    assert_eq!(label_of("steady"), "healthy");
    assert_eq!(label_of("fragmenting"), "fragmentation-bound");
    assert_eq!(label_of("leak"), "leaking");
    let md = fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("## Groups") && md.contains("k = 3 chosen by the gap statistic"), "{md}");
    let csv = fs::read_to_string(out.join("summary.csv")).unwrap();
    assert!(csv.lines().next().unwrap().ends_with("cluster,cluster_label"));

    // DuckDB (or pyarrow) reads the same dataset in place.
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/pyenv/bin/python3");
    let python = if venv.is_file() { venv } else { PathBuf::from("python3") };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/readback-summary.py");
    let result = std::process::Command::new(&python).arg(&script).arg(out.join("summary.parquet")).output();
    match result {
        Ok(o) if o.status.success() => {
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            eprintln!("read back with {}", v["engine"]);
            assert_eq!(v["rows"], 30);
            assert_eq!(v["sources"], serde_json::json!(["synthetic"]));
            assert_eq!(v["labels"]["healthy"], 10);
            assert!(v["worst"].as_str().unwrap().starts_with("fragmenting"));
        }
        other => {
            let required = std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() == Ok("1");
            assert!(!required, "DuckDB/pyarrow read-back failed and FRAGSCOPE_REQUIRE_PYTHON=1: {other:?}");
            eprintln!("skipped: neither DuckDB nor pyarrow could read the dataset ({other:?})");
        }
    }
}

#[test]
fn small_batches_are_not_grouped() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    for seed in 1..=3 {
        fragscope()
            .args(["synth", "--pattern", "steady", "--events", "5k", "--seed", &seed.to_string(), "-o"])
            .arg(runs.join(format!("s{seed}")))
            .assert()
            .success();
    }
    let out = tmp.path().join("out");
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "-o"]).arg(&out).assert().success();
    let df = read_dataset(&out.join("summary.parquet"));
    assert_eq!(df.height(), 3);
    assert_eq!(df.column("cluster").unwrap().null_count(), 3);
    assert!(fs::read_to_string(out.join("summary.md")).unwrap().contains("Groups: not computed"));
}
