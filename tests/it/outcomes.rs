//! The what-if model against what PyTorch 2.11 really did on an H100
//! (`../shared/fixtures/gpu-h100/outcomes.json`): each default run's
//! snapshot replayed under every setting that was also run for real must
//! give the real outcome — OOM or not — and the real peak reserved, to the
//! byte.

use std::fs;
use std::path::Path;

use crate::common::fragscope;

fn shared() -> Option<std::path::PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100");
    if p.join("outcomes.json").exists() {
        Some(p)
    } else {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", p.display());
        None
    }
}

/// Each real run of `workload` (its default run first): (name, conf, oom,
/// peak reserved).
fn real_runs(outcomes: &serde_json::Value, workload: &str) -> Vec<(String, String, bool, u64)> {
    let mut runs: Vec<(String, String, bool, u64)> = outcomes
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{workload}-")) && !k.contains('('))
        .map(|(k, v)| {
            (
                k.clone(),
                v["conf"].as_str().unwrap().to_string(),
                v["oom"].as_u64().unwrap() > 0,
                v["reserved_bytes.all.peak"].as_u64().unwrap(),
            )
        })
        .collect();
    runs.sort_by_key(|r| !r.1.is_empty());
    runs
}

#[test]
fn the_replay_predicts_every_real_run_under_other_settings() {
    let Some(dir) = shared() else { return };
    let outcomes: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("outcomes.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut pairs = 0;
    for workload in ["varshape", "checker", "kvcat"] {
        let runs = real_runs(&outcomes, workload);
        let out = tmp.path().join(workload);
        let mut cmd = fragscope();
        cmd.arg("whatif").arg(dir.join(format!("snapshots/{workload}-default.pickle"))).arg("-o").arg(&out);
        for (_, conf, _, _) in runs.iter().filter(|r| !r.1.is_empty()) {
            cmd.args(["--conf", conf]);
        }
        cmd.assert().success();
        let w: serde_json::Value = serde_json::from_slice(&fs::read(out.join("whatif.json")).unwrap()).unwrap();
        let scenarios = w["scenarios"].as_array().unwrap();
        for (name, conf, oom, reserved) in &runs {
            let want = if conf.is_empty() { "recorded" } else { conf.as_str() };
            let s = scenarios.iter().find(|s| s["name"] == want).unwrap_or_else(|| panic!("{name}: no scenario"));
            assert_eq!(s["ooms"].as_u64().unwrap() > 0, *oom, "{name}: OOM or not");
            assert_eq!(s["peak_reserved_bytes"].as_u64().unwrap(), *reserved, "{name}: peak reserved");
            pairs += 1;
        }
    }
    assert_eq!(pairs, 18, "every real run of the three workloads");
}

#[test]
fn garbage_collection_without_a_memory_fraction_replays_as_the_defaults() {
    let Some(dir) = shared() else { return };
    let tmp = tempfile::tempdir().unwrap();
    for (workload, gc) in [("varshape", "0.8"), ("checker", "0.8"), ("kvcat", "0.6")] {
        let out = tmp.path().join(workload);
        let conf = format!("garbage_collection_threshold:{gc}");
        fragscope()
            .arg("whatif")
            .arg(dir.join(format!("snapshots/{workload}-default.pickle")))
            .args(["-o"])
            .arg(&out)
            .args(["--conf", &conf])
            .assert()
            .success();
        let w: serde_json::Value = serde_json::from_slice(&fs::read(out.join("whatif.json")).unwrap()).unwrap();
        let (recorded, alone) = (&w["scenarios"][0], &w["scenarios"][1]);
        assert_eq!(alone["name"], conf.as_str());
        for key in ["peak_reserved_bytes", "peak_allocated_bytes", "segment_allocs", "ooms"] {
            assert_eq!(alone[key], recorded[key], "{workload}: {key}");
        }
        assert!(
            alone["note"].as_str().unwrap().contains("only under a per-process memory fraction below 1"),
            "{alone}"
        );
    }
}
