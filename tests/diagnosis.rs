//! What `analyze` tells the user: OOM classes, leaks, the prediction in the
//! report and metrics, the CI gates, and golden files of the report.

use std::fs;
use std::path::Path;

use assert_cmd::Command;
use polars::prelude::*;
use predicates::prelude::*;

fn fragscope() -> Command {
    Command::cargo_bin("fragscope").unwrap()
}

fn synth(dir: &Path, pattern: &str, events: u64, seed: u64) {
    fragscope()
        .args(["synth", "--pattern", pattern, "--events", &events.to_string(), "--seed", &seed.to_string(), "-o"])
        .arg(dir)
        .assert()
        .success();
}

fn analyze(trace: &Path, out: &Path, extra: &[&str]) -> serde_json::Value {
    fragscope().arg("analyze").arg(trace).args(extra).arg("-o").arg(out).assert().success();
    serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap()
}

#[test]
fn fragmenting_ooms_are_fragmentation_and_filling_ooms_are_capacity() {
    let tmp = tempfile::tempdir().unwrap();
    let frag = tmp.path().join("frag");
    synth(&frag, "fragmenting", 30_000, 1);
    let r = analyze(&frag, &tmp.path().join("a"), &[]);
    let ooms = r["ooms"].as_array().unwrap();
    assert!(!ooms.is_empty());
    for o in ooms {
        assert_eq!(o["class"], "fragmentation", "{o}");
        let (req, free, largest) =
            (o["requested"].as_u64().unwrap(), o["device_free"].as_u64().unwrap(), o["largest_free"].as_u64().unwrap());
        assert!(req <= free && req > largest);
        assert_eq!(o["top_blocks"].as_array().unwrap().len(), 10);
    }
    assert_eq!(r["oom_classes"]["fragmentation"].as_u64().unwrap() as usize, ooms.len());
    let md = fs::read_to_string(tmp.path().join("a/report.md")).unwrap();
    assert!(md.contains("fragmentation** — enough memory was free, but no single free range could hold the request"));

    let fill = tmp.path().join("fill");
    synth(&fill, "filling", 30_000, 1);
    let r = analyze(&fill, &tmp.path().join("b"), &[]);
    let ooms = r["ooms"].as_array().unwrap();
    assert!(!ooms.is_empty());
    assert!(ooms.iter().all(|o| o["class"] == "capacity"));

    // Unknown capacity: no class is guessed.
    let r = analyze(&fill, &tmp.path().join("c"), &["--capacity", "1TiB"]);
    assert!(r["ooms"].as_array().unwrap().iter().all(|o| o["class"] != "capacity"));
}

#[test]
fn leak_is_flagged_and_training_is_not() {
    let tmp = tempfile::tempdir().unwrap();
    let leak = tmp.path().join("leak");
    synth(&leak, "leak", 60_000, 1);
    let r = analyze(&leak, &tmp.path().join("a"), &[]);
    assert_eq!(r["leaks"][0]["leaking"], true);
    assert_eq!(r["summary"]["leaking"], true);
    assert!(r["leaks"][0]["growth_bytes"].as_i64().unwrap() > 100 << 20);

    let training = tmp.path().join("training");
    synth(&training, "training", 60_000, 1);
    let r = analyze(&training, &tmp.path().join("b"), &[]);
    assert_eq!(r["leaks"][0]["leaking"], false);
    assert_eq!(r["summary"]["leaking"], false);
}

#[test]
fn prediction_is_reported_and_backtest_is_in_the_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let frag = tmp.path().join("frag");
    synth(&frag, "fragmenting", 30_000, 2);
    let out = tmp.path().join("out");
    let r = analyze(&frag, &out, &["--horizon", "4"]);
    let p = &r["prediction"];
    assert_eq!(p["window"], 5);
    assert_eq!(p["horizon"], 4);
    assert_eq!(p["forecast"].as_array().unwrap().len(), 4);
    for k in ["model", "persistence", "ols"] {
        assert!(p["cv_mae"].get(k).is_some(), "cv_mae.{k}");
    }
    assert!(p["confidence"].as_f64().unwrap() >= 0.1);
    assert!(["minimal", "low", "medium", "high", "critical"].contains(&p["risk"].as_str().unwrap()));
    // The online risk reached high before the first OOM here.
    assert!(p["lead_time_steps"].as_u64().unwrap() > 0);
    assert!(p["lead_time_s"].as_f64().unwrap() > 0.0);

    let df = ParquetReader::new(fs::File::open(out.join("metrics.parquet")).unwrap()).finish().unwrap();
    for c in ["forecast_1", "forecast_4", "risk_online"] {
        assert!(df.column(c).is_ok(), "{c}");
    }
    // Null before enough data, present later.
    let f1 = df.column("forecast_1").unwrap().f64().unwrap();
    assert!(f1.get(0).is_none());
    assert!(f1.get(df.height() - 1).is_some());
}

#[test]
fn too_few_steps_say_insufficient_data() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("t");
    synth(&t, "steady", 2000, 1);
    let out = tmp.path().join("out");
    let r = analyze(&t, &out, &["--step", "500ev"]);
    assert_eq!(r["prediction"]["status"], "insufficient data");
    assert!(r["prediction"]["forecast"].is_null());
    assert!(fs::read_to_string(out.join("report.md")).unwrap().contains("**Risk: insufficient data**"));
}

#[test]
fn ci_gates_exit_3() {
    let tmp = tempfile::tempdir().unwrap();
    let frag = tmp.path().join("frag");
    synth(&frag, "fragmenting", 30_000, 1);
    let steady = tmp.path().join("steady");
    synth(&steady, "steady", 30_000, 1);
    let run = |trace: &Path, args: &[&str]| {
        fragscope().arg("analyze").arg(trace).args(args).arg("-o").arg(tmp.path().join("o")).assert()
    };
    run(&frag, &["--fail-on", "high"]).code(3).stderr(predicate::str::contains("--fail-on high"));
    run(&steady, &["--fail-on", "high"]).code(0);
    run(&frag, &["--max-score", "50"]).code(3).stderr(predicate::str::contains("exceeds --max-score 50"));
    run(&steady, &["--max-score", "50"]).code(0);
    // In a batch, one bad trace trips the gate.
    fragscope()
        .arg("analyze")
        .arg(&frag)
        .arg(&steady)
        .args(["--fail-on", "critical", "-o"])
        .arg(tmp.path().join("batch"))
        .assert()
        .code(3);
}

#[test]
fn golden_report() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("golden");
    synth(&t, "leak", 20_000, 11);
    let out = tmp.path().join("out");
    let r = analyze(&t, &out, &[]);
    insta::assert_json_snapshot!("report_json", r, { ".trace.path" => "[path]", ".tool_version" => "[version]" });
    let md = fs::read_to_string(out.join("report.md")).unwrap();
    insta::assert_snapshot!("report_md", md);
}
