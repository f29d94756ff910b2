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

/// `analyze` of one real snapshot, its report.json.
fn analyzed(dir: &Path, name: &str, out: &Path) -> serde_json::Value {
    fragscope()
        .arg("analyze")
        .arg(dir.join(format!("snapshots/{name}.pickle")))
        .arg("-o")
        .arg(out.join(name))
        .assert()
        .success();
    serde_json::from_slice(&fs::read(out.join(name).join("report.json")).unwrap()).unwrap()
}

/// A setting's figures in report.json's `memory_needed` (one device).
fn needed<'a>(report: &'a serde_json::Value, conf: &str) -> &'a serde_json::Value {
    let units = report["memory_needed"].as_array().unwrap();
    assert_eq!(units.len(), 1, "{units:?}");
    let settings = units[0]["settings"].as_array().unwrap();
    settings.iter().find(|s| s["conf"] == conf).unwrap_or_else(|| panic!("no {conf} in {settings:?}"))
}

/// The training loop under a 9000 MiB memory fraction: the memory needed
/// under expandable segments, replayed from the default run, is what the
/// real expandable run reserved (it never reached its cap); under the
/// recorded settings it fits within the cap, but never releasing its
/// cache needs more than the cap, since the real run had to release it.
#[test]
fn memory_needed_matches_the_real_runs_under_a_memory_fraction() {
    let Some(dir) = shared() else { return };
    let outcomes: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("outcomes.json")).unwrap()).unwrap();
    let cap = outcomes["varlen-fraction-default"]["per_process_memory_fraction_bytes"].as_u64().unwrap();
    assert_eq!(cap, 9000 << 20);
    let expandable = outcomes["varlen-fraction-expandable_segments-True"]["reserved_bytes.all.peak"].as_u64().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let r = analyzed(&dir, "varlen-fraction-default", tmp.path());
    let e = needed(&r, "expandable_segments:True");
    assert_eq!(e["no_flush_from_bytes"].as_u64(), Some(expandable));
    let rec = needed(&r, "recorded");
    let fits = rec["fits_from_bytes"].as_u64().unwrap();
    assert!(fits <= cap, "fits from {fits} > the cap {cap}");
    assert!(rec["no_flush_from_bytes"].as_u64().unwrap() > cap, "{rec}");
    // The bisection's answer is a multiple of 2 MiB (every segment is), to
    // within 0.4 % of the no-release budget.
    let precision = rec["precision_bytes"].as_u64().unwrap();
    assert!(precision >= 2 << 20 && precision <= rec["no_flush_from_bytes"].as_u64().unwrap() / 256, "{rec}");
    assert_eq!(fits % (2 << 20), 0);
    // The first screen decides: it fit, releasing its cache as often as
    // PyTorch counted, and the fix is the setting that never releases.
    let md = fs::read_to_string(tmp.path().join("varlen-fraction-default/report.md")).unwrap();
    let first = md.lines().nth(2).unwrap();
    assert_eq!(first, "**Verdict: fits, releasing its cache 4 times**", "{md}");
    assert!(md.contains("**The fix:** `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`"), "{md}");
    // The budget the releases imply holds the real one.
    let d = &r["decision"]["memory"][0]["budget"];
    assert!(d["lo_bytes"].as_u64().unwrap() <= cap && cap <= d["hi_bytes"].as_u64().unwrap(), "{d}");
    // The what-if rows hold at both ends of that interval or say a range:
    // `max_split_size_mb:64` reserves more where the budget allows more,
    // expandable segments never reach its low end.
    let scenarios = r["whatif"]["scenarios"].as_array().unwrap();
    let at = |conf: &str| scenarios.iter().find(|s| s["label"] == conf).unwrap_or_else(|| panic!("{conf}"));
    let split = at("max_split_size_mb:64");
    assert!(split["at_budget_high"]["peak_reserved_bytes"].as_u64() > split["peak_reserved_bytes"].as_u64(), "{split}");
    let e = at("expandable_segments:True");
    assert_eq!(e["at_budget_high"]["peak_reserved_bytes"], e["peak_reserved_bytes"], "{e}");
    assert!(md.contains("every scenario was replayed at both ends. A figure that reads a–b depends on"), "{md}");
    assert!(md.contains("a single figure is the same at both ends."), "{md}");
    assert!(md.contains("| `max_split_size_mb:64` | 8.67 GiB–9.63 GiB | 6.33 GiB |"), "{md}");
    assert!(md.contains("| `expandable_segments:True` | 6.88 GiB | 6.31 GiB |"), "{md}");
}

/// Cache releases as PyTorch counts them (`num_alloc_retries`): the
/// retries of the varlen runs (two of them on autograd's thread, with no
/// Python stack), none where garbage collection released first, one before
/// each OOM, and none for releases of the blocks above
/// `max_split_size_mb` alone.
#[test]
fn cache_releases_are_counted_as_pytorch_counts_its_retries() {
    let Some(dir) = shared() else { return };
    let outcomes: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("outcomes.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for (name, real) in outcomes.as_object().unwrap() {
        // Runs recorded with eBPF, and those kept only as outcomes.
        if name.contains('(') || !dir.join(format!("snapshots/{name}.pickle")).exists() {
            continue;
        }
        let r = analyzed(&dir, name, tmp.path());
        let f = &r["flushes"][0];
        assert_eq!(f["count"].as_u64(), real["num_alloc_retries"].as_u64(), "{name}: {f}");
        assert_eq!(f["at_least"].as_bool(), Some(false), "{name}: {f}");
        if name == "varlen-fraction-garbage_collection_threshold-0-6" {
            assert!(f["gc_releases"].as_u64().unwrap() > 0, "{name}: {f}");
        }
        checked += 1;
    }
    assert!(checked >= 20, "{checked}");
}

/// A capacity given that the recording contradicts is said, with both
/// numbers, in `report.json` and on stderr: the varshape OOM entry shows
/// the 2600 MiB budget, not the 80 GiB device. One the recording agrees
/// with is no contradiction. `analyze --conf` runs the scenarios asked
/// for instead of the sweep, and a bad one is a usage error.
#[test]
fn a_capacity_the_recording_contradicts_is_said() {
    let Some(dir) = shared() else { return };
    let snap = dir.join("snapshots/varshape-default.pickle");
    let tmp = tempfile::tempdir().unwrap();
    let out = fragscope()
        .arg("analyze")
        .arg(&snap)
        .args(["--capacity", "80GiB", "-o"])
        .arg(tmp.path().join("a"))
        .assert()
        .success();
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert!(
        stderr.contains("--capacity 80.00 GiB (given), but the `oom` entry of device 0 shows 2.54 GiB"),
        "{stderr}"
    );
    let r: serde_json::Value = serde_json::from_slice(&fs::read(tmp.path().join("a/report.json")).unwrap()).unwrap();
    let c = &r["capacity"];
    assert_eq!(c["given_bytes"].as_u64(), Some(80 << 30), "{c}");
    assert_eq!(c["contradictions"].as_array().map(Vec::len), Some(1), "{c}");
    let md = fs::read_to_string(tmp.path().join("a/report.md")).unwrap();
    assert!(md.contains("**The capacity given contradicts the recording:**"), "{md}");
    // The budget the OOM entry shows: no contradiction.
    let budget = 2600u64 << 20;
    fragscope()
        .arg("analyze")
        .arg(&snap)
        .args(["--capacity", &budget.to_string(), "--conf", "expandable_segments:True", "-o"])
        .arg(tmp.path().join("b"))
        .assert()
        .success();
    let r: serde_json::Value = serde_json::from_slice(&fs::read(tmp.path().join("b/report.json")).unwrap()).unwrap();
    assert_eq!(r["capacity"]["contradictions"].as_array().map(Vec::len), Some(0), "{}", r["capacity"]);
    let names: Vec<&str> =
        r["whatif"]["scenarios"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["recorded", "expandable_segments:True"]);
    // Out of (0, 1], or no such key: exit 2, nothing written.
    for bad in ["per_process_memory_fraction:1.5", "per_process_memory_fraction:0", "no_such_key:1"] {
        let out = tmp.path().join("c");
        fragscope().arg("analyze").arg(&snap).args(["--conf", bad, "-o"]).arg(&out).assert().code(2);
        assert!(!out.join("report.json").exists(), "{bad}");
    }
}

/// "X instead of the recorded Y" predicts the real run under X: each run
/// recorded under `roundup_power2_divisions:4`, replayed without it and
/// with expandable segments instead, gives the real default and
/// expandable runs (OOM or not, peak reserved to the byte).
#[test]
fn a_run_recorded_under_roundup_predicts_the_runs_without_it() {
    let Some(dir) = shared() else { return };
    let outcomes: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("outcomes.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for workload in ["varshape", "checker", "kvcat"] {
        let out = tmp.path().join(workload);
        fragscope()
            .arg("whatif")
            .arg(dir.join(format!("snapshots/{workload}-roundup_power2_divisions-4.pickle")))
            .args(["--conf", "expandable_segments:True,roundup_power2_divisions:default"])
            .args(["--conf", "roundup_power2_divisions:default", "-o"])
            .arg(&out)
            .assert()
            .success();
        let w: serde_json::Value = serde_json::from_slice(&fs::read(out.join("whatif.json")).unwrap()).unwrap();
        let scenarios = w["scenarios"].as_array().unwrap();
        for (i, real) in [(1, "expandable_segments-True"), (2, "default")] {
            let real = &outcomes[format!("{workload}-{real}")];
            let s = &scenarios[i];
            assert_eq!(s["ooms"].as_u64(), real["oom"].as_u64(), "{workload}: {}", s["name"]);
            assert_eq!(
                s["peak_reserved_bytes"].as_u64(),
                real["reserved_bytes.all.peak"].as_u64(),
                "{workload}: {}",
                s["name"]
            );
        }
    }
}

/// `compare` decides as a user would: the real leaking run is worse than
/// the healthy one, because it leaks and needs more memory, however its
/// mean score moved; compare.md opens with the memory needed, the leak
/// verdicts and the call site that grew (`wl.py:59:forward`), and the gate
/// on the memory needed trips on the batch.
#[test]
fn compare_weighs_leaks_and_memory_needed_before_scores() {
    let Some(dir) = shared() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cmp");
    fragscope()
        .arg("compare")
        .arg(dir.join("snapshots/training-default.pickle"))
        .arg(dir.join("snapshots/training-leak.pickle"))
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    let md = fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(md.contains("**Verdict: WORSE** — leak verdict now leaking; also worse on memory needed to fit +"), "{md}");
    let first = md.split("## Metrics").next().unwrap();
    assert!(first.contains("- **Leak verdicts:** A not leaking, B leaking."), "{md}");
    assert!(first.contains("- **Memory needed to fit**"), "{md}");
    assert!(first.contains("| `wl.py:59:forward` |"), "{md}");
    let c: serde_json::Value = serde_json::from_slice(&fs::read(out.join("compare.json")).unwrap()).unwrap();
    let needs = c["metrics"].as_array().unwrap().iter().find(|m| m["key"] == "needs").unwrap().clone();
    assert_eq!(needs["judgement"], "worse", "{needs}");
    // compare.png sets the 6 and 10 steps side by side: the leak's floor
    // rises by 250 MiB a step, the healthy run's stays.
    let floors = |k: &str| -> Vec<u64> {
        c["iterations"][k].as_array().unwrap().iter().map(|p| p["floor_bytes"].as_u64().unwrap()).collect()
    };
    let (fa, fb) = (floors("a"), floors("b"));
    assert_eq!((fa.len(), fb.len()), (6, 10), "{}", c["iterations"]);
    assert!(fa[1..].iter().all(|&f| f == fa[1]), "{fa:?}");
    assert!(fb.windows(2).skip(1).all(|w| w[1] >= w[0] + (200 << 20)), "{fb:?}");
    // The batch gate on the memory needed.
    let batch = tmp.path().join("batch");
    let run = fragscope()
        .arg("analyze")
        .arg(dir.join("snapshots/training-leak.pickle"))
        .args(["--no-plots", "--no-view", "--fail-if-needs-more-than", "5GiB", "-o"])
        .arg(&batch)
        .assert()
        .code(3);
    let stderr = String::from_utf8_lossy(&run.get_output().stderr).to_string();
    assert!(stderr.contains("more than --fail-if-needs-more-than 5.00 GiB"), "{stderr}");
}

/// The run under `garbage_collection_threshold:0.6` and a 9000 MiB
/// fraction the snapshot does not record: its collections bound the
/// budget to an interval that holds the real one, and the recorded
/// settings, replayed with collection on anywhere in it, reserve what the
/// real run reserved, to the byte, with no OOM and no retry.
#[test]
fn garbage_collection_shows_the_budget_and_replays_under_it() {
    let Some(dir) = shared() else { return };
    let outcomes: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("outcomes.json")).unwrap()).unwrap();
    let name = "varlen-fraction-garbage_collection_threshold-0-6";
    let real = &outcomes[name];
    let cap = real["per_process_memory_fraction_bytes"].as_u64().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let r = analyzed(&dir, name, tmp.path());
    let b = &r["decision"]["memory"][0]["budget"];
    assert!(b["lo_bytes"].as_u64().unwrap() <= cap && cap <= b["hi_bytes"].as_u64().unwrap(), "{b}");
    let recorded = &r["whatif"]["scenarios"][0];
    let peak = real["reserved_bytes.all.peak"].as_u64();
    assert_eq!(recorded["peak_reserved_bytes"].as_u64(), peak, "{recorded}");
    assert_eq!(recorded["at_budget_high"]["peak_reserved_bytes"].as_u64(), peak, "{recorded}");
    assert_eq!((recorded["ooms"].as_u64(), recorded["at_budget_high"]["ooms"].as_u64()), (Some(0), Some(0)));
    assert!(needed(&r, "recorded")["fits_from_bytes"].as_u64().unwrap() <= cap);
    let md = fs::read_to_string(tmp.path().join(name).join("report.md")).unwrap();
    assert!(!md.contains("replay without garbage collection"), "{md}");
    assert!(!md.contains("ran full 0 times"), "{md}");
    assert!(md.contains("(from its garbage collection's releases)"), "{md}");
}

/// A leaking run with a known budget says at which step the memory it
/// needs passes it: the real leak of 250 MiB a step, after its 10 steps,
/// needing 6.78 GiB without a release, passes 8 GiB 6 steps later.
#[test]
fn a_leak_says_when_it_passes_the_budget() {
    let Some(dir) = shared() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = fragscope()
        .arg("analyze")
        .arg(dir.join("snapshots/training-leak.pickle"))
        .args(["--no-plots", "--no-view", "--capacity", "8GiB", "-o"])
        .arg(tmp.path())
        .assert()
        .success();
    let r: serde_json::Value = serde_json::from_slice(&fs::read(tmp.path().join("report.json")).unwrap()).unwrap();
    let v = &r["decision"]["verdict"];
    let (g, steps) = (v["per_step_bytes"].as_u64().unwrap(), r["iterations"][0]["count"].as_u64().unwrap());
    let needs = needed(&r, "recorded")["no_flush_from_bytes"].as_u64().unwrap();
    assert_eq!((g, steps), (250 << 20, 10));
    let expected = steps + ((8u64 << 30) - needs).div_ceil(g);
    assert_eq!(expected, 16, "needs {needs}");
    assert_eq!(v["passes_budget_at_step"].as_u64(), Some(expected), "{v}");
    let stdout = String::from_utf8_lossy(&out.get_output().stdout).into_owned();
    assert!(
        stdout.contains(&format!("verdict: leaking 250.00 MiB per step: passes the budget at step ~{expected}")),
        "{stdout}"
    );
}
