//! The verdicts on real PyTorch 2.11 runs on an H100
//! (`../shared/fixtures/gpu-h100/`, whose README says what is true about
//! each file): leaks from exact floors, the OOM risk, and advice that
//! agrees with the replay and with what the real runs did.

use std::fs;
use std::path::{Path, PathBuf};

use crate::common::fragscope;

/// The real H100 snapshots, or None (with a visible message) outside the
/// development checkout and CI.
fn h100(name: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100/snapshots").join(name);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", p.display());
        None
    }
}

fn analyze(trace: &Path, out: &Path, extra: &[&str]) -> (serde_json::Value, String) {
    fragscope().arg("analyze").arg(trace).args(extra).args(["--no-plots", "-o"]).arg(out).assert().success();
    let json = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    (json, fs::read_to_string(out.join("report.md")).unwrap())
}

fn floors(r: &serde_json::Value) -> Vec<u64> {
    r["leaks"][0]["floors"].as_array().unwrap().iter().map(|f| f["bytes"].as_u64().unwrap()).collect()
}

#[test]
fn training_runs_leak_only_where_the_program_keeps_its_logits() {
    let (Some(default), Some(expandable), Some(leak)) =
        (h100("training-default.pickle"), h100("training-expandable.pickle"), h100("training-leak.pickle"))
    else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (d, d_md) = analyze(&default, &tmp.path().join("d"), &[]);
    assert!(d_md.contains("| warm-up (the set-up and the first step) |"), "{d_md}");
    let (e, _) = analyze(&expandable, &tmp.path().join("e"), &[]);
    // The same allocations: the same floors to the byte under both
    // settings, equal in every iteration, and the same verdict.
    assert_eq!(floors(&d), floors(&e));
    // The recording began with the program: all 6 steps are complete, the
    // first (with AdamW's set-up) is the warm-up, with a lower floor.
    let f = floors(&d);
    assert_eq!(f.len(), 6, "{f:?}");
    assert!(f[0] < f[1] && f[1..].iter().all(|&x| x == 1_600_977_924), "{f:?}");
    assert_eq!((d["iterations"][0]["count"].as_u64(), d["iterations"][0]["complete"].as_u64()), (Some(6), Some(6)));
    for r in [&d, &e] {
        assert_eq!(r["leaks"][0]["verdict"], "not leaking", "{}", r["leaks"][0]["reason"]);
        assert_eq!(r["leaks"][0]["method"], "iterations");
    }
    // 250 MiB of logits kept per step, released when the function returns.
    let (l, md) = analyze(&leak, &tmp.path().join("l"), &[]);
    let report = &l["leaks"][0];
    assert_eq!(report["verdict"], "leaking", "{}", report["reason"]);
    assert_eq!(report["growth_per_iteration_bytes"], 262_144_000);
    let f = floors(&l);
    assert_eq!(f.len(), 10, "{f:?}");
    assert!(f.windows(2).skip(1).all(|w| w[1] - w[0] == 262_144_000), "{f:?}");
    // From the first floor after the warm-up to the last: 8 rises.
    assert_eq!(report["growth_bytes"], 8 * 262_144_000);
    assert!(report["released_after_last_iteration"]["bytes"].as_u64().unwrap() > 0);
    // The growth is the logits alone (what each site holds more at the
    // last floor than at the first), not the step's input and loss.
    let sites = report["top_sites"].as_array().unwrap();
    assert_eq!(sites.len(), 1, "{sites:?}");
    assert!(sites[0]["site"].as_str().unwrap().ends_with(":forward"), "{sites:?}");
    assert_eq!(sites[0]["bytes"], 8 * 262_144_000);
    // What is alive at the end was all allocated in the warm-up.
    let once: u64 = report["allocated_once"].as_array().unwrap().iter().map(|s| s["bytes"].as_u64().unwrap()).sum();
    assert_eq!(once, report["live_at_end_bytes"].as_u64().unwrap());
    assert!(md.contains("**Leak**") && md.contains("was released after the last complete iteration"), "{md}");
}

#[test]
fn generation_that_grows_then_gives_everything_back_is_not_called_a_leak_and_its_cat_is_named() {
    let Some(kvcat) = h100("kvcat-default.pickle") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (r, _) = analyze(&kvcat, &tmp.path().join("k"), &[]);
    // No iterations: the KV cache's growth looks as a leak across steps
    // would, so neither verdict is claimed; the release at the end is said.
    let leak = &r["leaks"][0];
    assert_eq!(leak["verdict"], "cannot tell", "{}", leak["reason"]);
    let reason = leak["reason"].as_str().unwrap();
    assert!(reason.contains("freed by the end of the trace") && reason.contains("KV cache"), "{reason}");
    // The rise by call site counts the bytes asked for: the two caches,
    // 35.98 MiB each, whatever the allocator rounded them to.
    let sites = leak["top_sites"].as_array().unwrap();
    assert!(sites.len() >= 2 && sites[..2].iter().all(|s| s["bytes"] == 37_715_968), "{sites:?}");
    let pattern: Vec<&serde_json::Value> =
        r["advice"].as_array().unwrap().iter().filter(|a| a["kind"] == "pattern").collect();
    assert_eq!(pattern.len(), 1, "{}", r["advice"]);
    let text = pattern[0]["text"].as_str().unwrap();
    assert!(text.contains("grows by 16.00 KiB") && text.contains("torch.cat"), "{text}");
    // No OOM: a lower peak reserved is a saving, never a fix.
    for a in r["advice"].as_array().unwrap() {
        assert_ne!(a["kind"], "setting", "{a}");
    }
}

#[test]
fn oom_advice_follows_the_replay_and_the_real_runs() {
    let (Some(varshape), Some(checker)) = (h100("varshape-default.pickle"), h100("checker-default.pickle")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // varshape: expandable segments and max_split_size_mb:64 removed the
    // OOM on the H100; both are advised, from the replay.
    let (v, md) = analyze(&varshape, &tmp.path().join("v"), &[]);
    let fixes: Vec<&str> = v["advice"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["removes_ooms"] == true)
        .map(|a| a["conf"].as_str().unwrap())
        .collect();
    assert!(fixes.contains(&"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"), "{fixes:?}");
    assert!(fixes.contains(&"PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64"), "{fixes:?}");
    // Every setting advised as a fix has no OOM in its replay.
    let scenarios = v["whatif"]["scenarios"].as_array().unwrap();
    for conf in &fixes {
        let entry = conf.trim_start_matches("PYTORCH_CUDA_ALLOC_CONF=");
        let s = scenarios.iter().find(|s| s["name"] == entry).unwrap();
        assert_eq!(s["ooms"], 0, "{s}");
    }
    assert!(!md.contains("max_split_size_mb:598"), "no setting that the replay does not back");
    // A setting that serves the request the recording failed holds it: the
    // scenario's peaks are the real run's, to the byte.
    let outcomes = varshape.parent().unwrap().join("../outcomes.json");
    let outcomes: serde_json::Value = serde_json::from_slice(&fs::read(outcomes).unwrap()).unwrap();
    for (entry, run) in [
        ("expandable_segments:True", "varshape-expandable_segments-True"),
        ("max_split_size_mb:64", "varshape-max_split_size_mb-64"),
    ] {
        let s = scenarios.iter().find(|s| s["name"] == entry).unwrap();
        let real = &outcomes[run];
        assert_eq!(s["peak_allocated_bytes"], real["allocated_bytes.all.peak"], "{entry}: {s}");
        assert_eq!(s["peak_reserved_bytes"], real["reserved_bytes.all.peak"], "{entry}: {s}");
    }
    // The free memory is named for what it is, with CUDA's own figure (the
    // one in PyTorch's error message).
    assert_eq!(v["ooms"][0]["cuda_free"], 627_245_056u64);
    assert!(md.contains("| free (CUDA + PyTorch's cache) |"), "{md}");
    assert!(md.contains("CUDA reported 598.19 MiB free") && md.contains("segments held 800.00 MiB unused"), "{md}");
    // The capacity is inferred from the OOM itself: no monitor could have
    // warned before it, so no lead time is claimed.
    assert!(md.contains("| warning lead time | none: the capacity was not known before the first OOM"), "{md}");
    // A fix with little to spare says how little: under roundup 4 the
    // replay of max_split_size_mb:64 peaks 6.19 MiB below the capacity.
    if let Some(roundup) = h100("varshape-roundup_power2_divisions-4.pickle") {
        let (r, _) = analyze(&roundup, &tmp.path().join("r"), &[]);
        let tight: Vec<&str> = r["advice"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|a| a["text"].as_str())
            .filter(|t| t.contains("below the capacity"))
            .collect();
        assert!(tight.iter().any(|t| t.contains("max_split_size_mb:64") && t.contains("only 6.19 MiB")), "{tight:?}");
        assert!(!tight.iter().any(|t| t.contains("expandable_segments:True")), "{tight:?}");
    }
    // checker: no setting removes it (none did on the H100); the advice says
    // so first and names the 6 MiB blocks that pin one 20 MiB segment each.
    let (c, md) = analyze(&checker, &tmp.path().join("c"), &[]);
    let advice = c["advice"].as_array().unwrap();
    assert_eq!(advice[0]["kind"], "no_setting", "{advice:?}");
    assert!(advice.iter().all(|a| a["removes_ooms"] != true));
    let program = advice.iter().find(|a| a["kind"] == "program").unwrap()["text"].as_str().unwrap();
    assert!(program.contains("114 live blocks of 6.00 MiB") && program.contains(":checker`"), "{program}");
    assert!(program.contains("114 segments of 20.00 MiB") && program.contains("one block in each"), "{program}");
    assert!(md.contains("Recommendation: no allocator setting tried removes the OOMs"), "{md}");
    // The capacity is stated the same everywhere: inferred from the oom entry.
    assert!(md.contains("inferred from the `oom` entry") && !md.contains("capacity unknown"), "{md}");
}

#[test]
fn oom_runs_rank_above_healthy_runs() {
    let (Some(healthy), Some(varshape), Some(checker)) =
        (h100("training-default.pickle"), h100("varshape-default.pickle"), h100("checker-default.pickle"))
    else {
        return;
    };
    use fragscope::analysis::risk::OomRisk;
    let tmp = tempfile::tempdir().unwrap();
    let level = |r: &serde_json::Value| OomRisk::from_name(r["summary"]["oom_risk"].as_str().unwrap()).unwrap();
    let (h, md) = analyze(&healthy, &tmp.path().join("h"), &[]);
    // No capacity in the snapshot: unknown, and no claim about room.
    assert_eq!(level(&h), OomRisk::Unknown);
    assert!(md.starts_with("# fragscope report") && md.contains("**OOM risk: UNKNOWN**"), "{md}");
    assert!(!md.contains("will not find room"));
    // Without a capacity nothing runs out of memory in the what-if: its
    // OOMs are not judged, where a 0 would read as a verdict.
    assert!(md.contains("| 79 | not judged |") && !md.contains("| 79 | 0 |"), "{md}");
    assert_eq!(h["summary"]["fragmentation_level"], "critical", "the cache's free blocks count as gaps");
    // On its 80 GB GPU it used 5 GB: low, whatever the fragmentation level.
    let (h80, _) = analyze(&healthy, &tmp.path().join("h80"), &["--capacity", "80GiB"]);
    assert_eq!(level(&h80), OomRisk::Low);
    for oom in [varshape, checker] {
        let (r, _) = analyze(&oom, &tmp.path().join("o"), &[]);
        assert_eq!(level(&r), OomRisk::Oom);
        assert!(level(&r) > level(&h80) && level(&r) > level(&h));
    }
}

#[test]
fn a_recording_of_pytorchs_segments_gets_no_setting() {
    // `record` of varshape on the H100: PyTorch's 1 GiB request failed, and
    // failed again when its allocator retried after releasing its cache.
    // Real runs: max_split_size_mb:128 did not remove the OOM, expandable
    // segments did; the recording (segments only) cannot tell them apart.
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100/ebpf/varshape-default");
    if !p.exists() {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", p.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (name, extra) in [("none", &[][..]), ("h100", &["--capacity", "85017493504"][..])] {
        let (r, md) = analyze(&p, &tmp.path().join(name), extra);
        let advice = r["advice"].as_array().unwrap();
        assert!(!advice.is_empty());
        assert!(advice.iter().all(|a| a["removes_ooms"] != true), "{name}: {advice:?}");
        // Its cudaMallocs are PyTorch's segments: no model of PyTorch's
        // allocator is run over them.
        assert!(
            r["whatif"].is_null() && md.contains("Not replayed: the failing process ran PyTorch's"),
            "{name}: {md}"
        );
        // One request failed (outcomes.json: 1 OOM, 1 retry): PyTorch's
        // allocator, mapped by the process, asked again after releasing its
        // cache, and that second failed cudaMalloc is the same OOM.
        let ooms = r["ooms"].as_array().unwrap();
        assert_eq!((ooms.len(), ooms[0]["retries"].as_u64()), (1, Some(1)), "{name}: {ooms:?}");
        assert!(md.contains("The request was asked twice: PyTorch's allocator"), "{name}: {md}");
        // Its class cannot be told from PyTorch's segments, whatever the
        // capacity: with the GPU's total it read "allocator policy" (the
        // CUDA context counted as free), where the truth is fragmentation
        // inside PyTorch's cache.
        assert_eq!(ooms[0]["class"], "unknown", "{name}");
        assert_eq!(ooms[0]["inside_pytorch_cache"], true, "{name}");
        assert!(md.contains("capacity or fragmentation cannot be told from it"), "{name}: {md}");
        assert!(!md.contains("Defragmenting will not help"), "{name}: {md}");
    }
    // `whatif`, asked for it, refuses as `analyze` does (its replay of the
    // segments "recommended" the defaults the run had failed under).
    let out = fragscope().arg("whatif").arg(&p).arg("-o").arg(tmp.path().join("w")).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("process 1375 ran PyTorch's caching allocator"), "{stderr}");
    assert!(!stderr.contains("Recommendation") && !tmp.path().join("w").exists(), "{stderr}");
    if let Some(checker) = p.parent().map(|d| d.join("checker-default")).filter(|c| c.exists()) {
        let (r, md) = analyze(&checker, &tmp.path().join("checker"), &["--capacity", "85017493504"]);
        assert_eq!(r["ooms"][0]["class"], "unknown", "{md}");
        assert!(!md.contains("Defragmenting will not help"), "{md}");
    }
    // The same calls without the copied maps, as from a program not known
    // to run PyTorch: each failure is a request, and the replay runs. The
    // 1 GiB request failed with 1.1 GiB free by the trace's own count (the
    // CUDA context is not in it): a replay that cannot fail where the
    // program failed claims no setting.
    let bare = tmp.path().join("bare");
    fs::create_dir(&bare).unwrap();
    for e in fs::read_dir(&p).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            fs::copy(e.path(), bare.join(e.file_name())).unwrap();
        }
    }
    let (r, md) = analyze(&bare, &tmp.path().join("bare-out"), &["--capacity", "85017493504"]);
    assert_eq!(r["ooms"].as_array().map(Vec::len), Some(2), "no retry claimed without the maps");
    // And the report says why that count may be high (a short process can
    // exit before the recorder copies its maps).
    assert_eq!(r["trace"]["ooms_without_maps"], serde_json::json!([1375]), "{}", r["trace"]);
    assert!(md.contains("holds no copy of the memory map of process 1375"), "{md}");
    assert!(r["advice"].as_array().unwrap().iter().all(|a| a["removes_ooms"] != true));
    assert!(md.contains("Recommendation: none — the replay does not reproduce"), "{md}");
}

#[test]
fn the_floors_are_drawn_where_a_verdict_rests_on_iterations() {
    let (Some(leak), Some(kvcat)) = (h100("training-leak.pickle"), h100("kvcat-default.pickle")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    for (trace, out) in [(&leak, "l"), (&kvcat, "k")] {
        fragscope().arg("analyze").arg(trace).arg("-o").arg(tmp.path().join(out)).assert().success();
    }
    let png = fs::read(tmp.path().join("l/floors.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    // Width 1600, one panel: the IHDR's width and height.
    let dim = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    assert_eq!((dim(16), dim(20)), (1600, 340));
    let html = fs::read_to_string(tmp.path().join("l/report.html")).unwrap();
    assert!(html.contains("floors.png: the floor of live memory in each iteration"));
    // A generation loop has no iterations: nothing to draw.
    assert!(!tmp.path().join("k/floors.png").exists());
}

#[test]
fn recordings_of_cached_training_runs_have_their_steps_from_the_launches() {
    // `record` of `train --iters 6` (cached) and of `--iters 4` without the
    // cache: PyTorch keeps its segments, so live device memory does not
    // repeat, but the launch sequence repeats once per step (534 launches).
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100/ebpf");
    if !dir.exists() {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", dir.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (name, steps) in [("training-default", 6), ("training-expandable", 6), ("training-nocache", 4)] {
        let (r, md) = analyze(&dir.join(name), &tmp.path().join(name), &[]);
        let it = &r["iterations"][0];
        assert_eq!((it["count"].as_u64(), it["source"].as_str()), (Some(steps), Some("launches")), "{name}: {it}");
        assert_eq!(it["complete"].as_u64(), Some(steps - 1), "{name}");
        // A healthy run: whatever the recording can tell of it, never a leak.
        let verdict = r["leaks"][0]["verdict"].as_str().unwrap();
        assert_ne!(verdict, "leaking", "{name}: {md}");
        // The cached runs: PyTorch's segments added in the second step, then
        // not one byte more; the reason says so, not "rose … unsteadily".
        if name != "training-nocache" {
            let reason = r["leaks"][0]["reason"].as_str().unwrap();
            assert!(reason.contains("then held (equal to the byte) for the last 2 iterations"), "{name}: {reason}");
        }
        assert!(md.contains("| launches |"), "{name}: the report names the source");
        // CUDA 13's launch handles, and no kernels.json from that recorder:
        // the report says why the kernels have no names.
        assert!(md.contains("kernels are shown by their launch address: this recording has no registered"), "{md}");
    }
    // The OOM workloads launch too few kernels to repeat: no steps claimed.
    let (r, _) = analyze(&dir.join("varshape-default"), &tmp.path().join("varshape"), &[]);
    assert_eq!(r["iterations"].as_array().map(Vec::len), Some(0));
}

#[test]
fn a_recording_joined_with_its_snapshot_shows_what_pytorch_did_not_allocate() {
    // training-default and -expandable were recorded both ways in one run:
    // PyTorch's 86 segments (79 maps with expandable segments) are among
    // the recorded allocations, and 10 cuMemAlloc calls, 134 532 616 B,
    // were not PyTorch's (cuBLAS's workspaces among them).
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100");
    if !dir.exists() {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", dir.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (name, segments) in [("training-default", 86), ("training-expandable", 79)] {
        let snapshot = dir.join("snapshots").join(format!("{name}.pickle"));
        let (r, md) =
            analyze(&dir.join("ebpf").join(name), &tmp.path().join(name), &["--snapshot", snapshot.to_str().unwrap()]);
        let j = &r["join"];
        assert_eq!(
            (j["segments_matched"].as_u64(), j["segments_total"].as_u64()),
            (Some(segments), Some(segments)),
            "{name}"
        );
        assert_eq!(
            (j["outside"]["allocations"].as_u64(), j["outside"]["bytes"].as_u64()),
            (Some(10), Some(134_532_616))
        );
        // The clocks agree with the recording's own offset to wall time.
        assert!(j["clock_disagreement_ns"].as_i64().unwrap() < 1_000_000, "{name}: {j}");
        // The snapshot's verdicts stand, with the outside memory counted.
        let (alone, _) = analyze(&snapshot, &tmp.path().join(format!("{name}-alone")), &[]);
        assert_eq!(r["leaks"][0]["verdict"], alone["leaks"][0]["verdict"]);
        assert_eq!(r["iterations"][0]["count"], alone["iterations"][0]["count"]);
        let peak = |r: &serde_json::Value| r["processes"][0]["peak_live_bytes"].as_u64().unwrap();
        assert!(peak(&r) > peak(&alone) && peak(&r) <= peak(&alone) + 134_532_616, "{} vs {}", peak(&r), peak(&alone));
        assert_eq!(r["anomalies"]["out_of_order"].as_u64(), Some(0));
        assert!(
            md.contains("## Recording and snapshot") && md.contains("128.30 MiB outside PyTorch's allocator"),
            "{md}"
        );
    }
    // Two different runs share no segment: said, not joined.
    let out = fragscope()
        .arg("analyze")
        .arg(dir.join("ebpf/training-default"))
        .arg("--snapshot")
        .arg(dir.join("snapshots/varshape-default.pickle"))
        .args(["-o"])
        .arg(tmp.path().join("mismatch"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not the same run"));
}

/// One program's leak verdict does not depend on the allocator setting it
/// ran under: the windows count the program's block events, not the
/// segment events a setting changes, and call sites count the bytes
/// asked for, not the rounded blocks.
#[test]
fn the_same_program_gets_the_same_leak_verdict_under_every_setting() {
    let tmp = tempfile::tempdir().unwrap();
    for (program, confs) in [
        (
            "varshape",
            &["default", "expandable_segments-True", "max_split_size_mb-64", "roundup_power2_divisions-4"][..],
        ),
        ("kvcat", &["default", "expandable_segments-True", "roundup_power2_divisions-4"][..]),
    ] {
        let mut seen: Vec<(String, serde_json::Value, serde_json::Value)> = Vec::new();
        for conf in confs {
            let Some(file) = h100(&format!("{program}-{conf}.pickle")) else { return };
            let (r, _) = analyze(&file, &tmp.path().join(format!("{program}-{conf}")), &[]);
            let l = &r["leaks"][0];
            seen.push((conf.to_string(), l["verdict"].clone(), l["top_sites"].clone()));
        }
        assert!(seen.windows(2).all(|w| w[0].1 == w[1].1 && w[0].2 == w[1].2), "{program}: {seen:?}");
    }
}

/// A recorded setting can be left out (`KEY:default`): the sweep replays
/// the recording without it, alone and under expandable segments, and a
/// recommendation prefers what real runs checked to an unchecked pair.
/// Each figure is a real run's (outcomes.json, the README).
#[test]
fn a_recorded_setting_is_replayed_without_it_as_the_real_runs_did() {
    let (Some(kvcat), Some(varshape)) =
        (h100("kvcat-roundup_power2_divisions-4.pickle"), h100("varshape-max_split_size_mb-128.pickle"))
    else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let peak = |r: &serde_json::Value, conf: &[&str]| -> u64 {
        let s = r["whatif"]["scenarios"].as_array().unwrap().iter().find(|s| s["conf"] == serde_json::json!(conf));
        s.unwrap_or_else(|| panic!("no scenario {conf:?}"))["peak_reserved_bytes"].as_u64().unwrap()
    };
    let (k, _) = analyze(&kvcat, &tmp.path().join("k"), &[]);
    // kvcat: the real default run reserved 413 138 944 B, the real
    // expandable one 358 612 992 B.
    assert_eq!(peak(&k, &["roundup_power2_divisions:default"]), 413_138_944);
    assert_eq!(peak(&k, &["expandable_segments:True", "roundup_power2_divisions:default"]), 358_612_992);
    assert_eq!(k["whatif"]["recommendation"]["conf"], "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
    // varshape under max_split_size_mb:128 ran out of memory; the real run
    // with expandable segments alone did not, at 2 348 810 240 B.
    let (v, md) = analyze(&varshape, &tmp.path().join("v"), &[]);
    assert_eq!(peak(&v, &["expandable_segments:True", "max_split_size_mb:default"]), 2_348_810_240);
    let rec = &v["whatif"]["recommendation"];
    assert_eq!(rec["conf"], "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "{rec}");
    assert!(rec["reason"].as_str().unwrap().contains("without the recorded `max_split_size_mb:128`"), "{rec}");
    assert!(md.contains(", without recorded `max_split_size_mb:128`"), "{md}");
}

/// A `--capacity` larger than what the process had (another tenant held
/// the rest) lets the replay serve the request that failed: no setting is
/// then said to remove the OOM, and the reason gives the capacity the
/// `oom` entry shows. Advice never names fragscope's `KEY:default`, which
/// PyTorch would refuse, nor a Python call inside the environment line.
#[test]
fn a_capacity_larger_than_the_process_had_claims_no_fix() {
    let (Some(varshape), Some(checker)) =
        (h100("varshape-max_split_size_mb-128.pickle"), h100("checker-max_split_size_mb-128.pickle"))
    else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (r, md) = analyze(&varshape, &tmp.path().join("v"), &["--capacity", "85017493504"]);
    assert!(r["advice"].as_array().unwrap().iter().all(|a| a["removes_ooms"] != true), "{}", r["advice"]);
    let why = r["whatif"]["unreproduced_ooms"].as_str().unwrap_or_default();
    assert!(why.contains("the `oom` entry shows 2.54 GiB available"), "{why}");
    assert!(md.contains("Recommendation: none"), "{md}");
    let (_, md) = analyze(&checker, &tmp.path().join("c"), &["--capacity", "85017493504"]);
    let (_, md2) = analyze(&checker, &tmp.path().join("c2"), &[]);
    for m in [&md, &md2] {
        assert!(!m.contains(":default"), "{m}");
        assert!(!m.contains(" and torch.cuda.set_per_process_memory_fraction(0.99)`"), "{m}");
    }
}

/// Without iterations a floor that held is no leak: varshape allocates and
/// frees 20 blocks, keeps 20, and asks once more; it is one pass, not
/// steps (the fixtures' README), and the reason says so.
#[test]
fn one_pass_without_iterations_is_not_called_leak_free() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(file) = h100("varshape-default.pickle") else { return };
    let (r, _) = analyze(&file, tmp.path(), &[]);
    let l = &r["leaks"][0];
    assert_eq!(l["verdict"], "cannot tell", "{l}");
    assert!(l["reason"].as_str().unwrap().contains("(falling back between): too few repetitions"), "{l}");
}

/// The public training snapshots reserved every segment before their
/// trace began: every request fit in that cache, each scenario starts
/// from it, so no setting is recommended, and none is kept as if tested.
#[test]
fn a_cache_reserved_before_the_trace_leaves_the_settings_unjudged() {
    let tmp = tempfile::tempdir().unwrap();
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/pytorch/bcrafton_memory_snapshot.pickle");
    if !file.exists() {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", file.display());
        return;
    }
    let (r, md) = analyze(&file, tmp.path(), &[]);
    let w = &r["whatif"];
    assert_eq!(w["recommendation"]["conf"], "none: the settings cannot be judged from this trace", "{w}");
    assert!(w["untestable"].as_str().unwrap().contains("reserved before it began"), "{w}");
    assert!(!md.contains("keep the current settings"), "{md}");
    assert!(r["advice"].as_array().unwrap().iter().all(|a| a["conf"].is_null()), "{}", r["advice"]);
}

/// `training-leak` as other recordings of the same run would hold it: the
/// trace of a ring buffer that kept only its last half (the annotations,
/// far fewer, kept whole, as PyTorch keeps them), and the trace without
/// `time_us` (older PyTorch). Each still says `leaking` by 250 MiB per
/// iteration, from the iterations its trace holds; the one without a
/// clock gives no rate per second.
#[test]
fn a_leak_is_told_from_a_ring_buffers_half_and_from_a_trace_without_time() {
    let Some(leak) = h100("training-leak.pickle") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let script = r#"
import pickle, sys
class Plain(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}")
s = Plain(open(sys.argv[1], "rb")).load()
half = dict(s)
half["device_traces"] = [t[len(t) // 2:] for t in s["device_traces"]]
pickle.dump(half, open(sys.argv[2], "wb"), protocol=4)
untimed = dict(s)
untimed["device_traces"] = [[{k: v for k, v in e.items() if k != "time_us"} for e in t] for t in s["device_traces"]]
pickle.dump(untimed, open(sys.argv[3], "wb"), protocol=4)
"#;
    let (half, untimed) = (tmp.path().join("half.pickle"), tmp.path().join("untimed.pickle"));
    let made = std::process::Command::new("python3").arg("-c").arg(script).arg(&leak).arg(&half).arg(&untimed).status();
    if !matches!(made, Ok(s) if s.success()) {
        assert!(std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() != Ok("1"), "python3: {made:?}");
        eprintln!("skipped: python3 could not rewrite the snapshot ({made:?})");
        return;
    }
    let (h, h_md) = analyze(&half, &tmp.path().join("h"), &[]);
    let it = &h["iterations"][0];
    assert_eq!(it["source"], "annotations");
    assert!(it["before_trace"].as_u64().unwrap() >= 4, "{it}");
    let f = floors(&h);
    assert!(f.iter().all(|&b| b > 1 << 30), "no floor of an iteration outside the trace: {f:?}");
    assert!(h_md.contains("that began before the trace's first entry"), "{h_md}");
    let (u, _) = analyze(&untimed, &tmp.path().join("u"), &[]);
    for (r, name) in [(&h, "half"), (&u, "untimed")] {
        let l = &r["leaks"][0];
        assert_eq!(l["verdict"], "leaking", "{name}: {}", l["reason"]);
        assert_eq!(l["growth_per_iteration_bytes"].as_u64(), Some(250 << 20), "{name}: {l}");
    }
    assert!(h["leaks"][0]["rate_bytes_per_s"].as_f64().is_some_and(|r| r > 0.0));
    assert!(u["leaks"][0]["rate_bytes_per_s"].is_null(), "no clock, no rate: {}", u["leaks"][0]);
    assert_ne!(u["iterations"][0]["source"], "annotations");
}

/// A public snapshot (`../shared/fixtures/pytorch/`), or None (with a
/// visible message) outside the development checkout and CI.
fn public(name: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/pytorch").join(name);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", p.display());
        None
    }
}

/// Each figure of a real OOM says what it measures: the largest gap in
/// PyTorch's cache (40 MiB) apart from CUDA's free memory (598.19 MiB,
/// what `cudaMalloc` could still give), a fragmentation level taken at the
/// peak of reserved, not in the emptied cache the run ended with, no
/// forecast level of that empty cache, no confidence figure where the score
/// never moved, and PyTorch's Σgap²/(Σseg)² for what it is: it rises as
/// free memory gathers (1 for the expandable run's one free range).
#[test]
fn a_real_ooms_figures_say_what_they_measure() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(file) = h100("varshape-default.pickle") else { return };
    let (r, md) = analyze(&file, tmp.path(), &[]);
    let o = &r["ooms"][0];
    assert_eq!((o["largest_gap"].as_u64(), o["cuda_free"].as_u64()), (Some(40 << 20), o["largest_free"].as_u64()));
    assert!(md.contains("| largest gap in the cache | largest request that could fit (the larger of that gap and CUDA's free) | class |"), "{md}");
    assert!(md.contains("| 1.00 GiB | 1.37 GiB | 40.00 MiB | 598.19 MiB | fragmentation |"), "{md}");
    let level = md.lines().find(|l| l.starts_with("Fragmentation level:")).unwrap();
    assert!(level.starts_with("Fragmentation level: **medium** — fragmentation score 55.0 at the timestep"), "{level}");
    assert!(level.contains("(step 12, 2.37 ms: 1.17 GiB live in 1.95 GiB reserved)"), "{level}");
    let forecast = md.lines().find(|l| l.starts_with("Forecast level:")).unwrap();
    assert!(forecast.starts_with("Forecast level: not judged — nothing is live at the last timestep"), "{forecast}");
    assert!(forecast.contains("1.95 GiB still reserved") && !forecast.contains("confidence 1.00"), "{forecast}");
    assert!(md.contains("No fragmentation warnings (deterioration, trend): nothing is live"), "{md}");
    assert!(md.contains("| confidence | not rated: the score did not move"), "{md}");
    assert!(r["prediction"]["confidence"].is_null(), "{}", r["prediction"]);
    assert_eq!(r["summary"]["fragmentation_level"], "medium", "{}", r["summary"]);
    let at_peak = &r["processes"][0]["fragmentation_at_peak"];
    assert_eq!(
        (at_peak["step"].as_u64(), at_peak["held_bytes"].as_u64()),
        (Some(12), Some(2_097_152_000)),
        "{at_peak}"
    );
    assert!(md.contains("not a fragmentation score: it rises as free memory gathers"), "{md}");
    let Some(file) = h100("varshape-expandable_segments-True.pickle") else { return };
    let (r, _) = analyze(&file, tmp.path(), &[]);
    let f = r["allocator"]["devices"][0]["pytorch_fragmentation"].as_f64().unwrap();
    assert!((f - 1.0).abs() < 1e-9, "one free range: {f}");
}

/// `max_split_size_mb` releases its blocks above that size before it
/// flushes the whole cache, and PyTorch counts only the latter in
/// `num_alloc_retries`: the real run under `max_split_size_mb:64` released
/// 8 times (18 segments, as its `num_device_free`) with 0 retries
/// (`outcomes.json`). The report says so instead of calling them retries,
/// and says the peak allocated is a bound, not the state at the peak.
#[test]
fn flushes_under_max_split_are_not_called_retries() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(file) = h100("varshape-max_split_size_mb-64.pickle") else { return };
    let (r, md) = analyze(&file, tmp.path(), &[]);
    assert!(md.contains("**Verdict: fits, releasing its cached blocks above `max_split_size_mb` 8 times**"), "{md}");
    assert_eq!(r["flushes"][0]["count"].as_u64(), Some(0), "{}", r["flushes"]);
    assert_eq!(r["flushes"][0]["oversize_releases"].as_u64(), Some(8), "{}", r["flushes"]);
    assert!(!md.contains("and retried"), "{md}");
    assert!(md.contains("the program's tensors never held more, so at least the rest was PyTorch's cache"), "{md}");
}

/// A snapshot of one training step cannot tell a leak (no iteration after
/// the warm-up to compare): what it allocated once is not cleared as
/// state either. Its backward's blocks, allocated on the autograd
/// engine's threads without Python frames, are named by the backward,
/// not "unknown (native)"; and the sites count requested bytes, as the
/// floors do.
#[test]
fn a_one_step_snapshot_does_not_clear_what_it_allocated_once() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(file) = public("wedson_128_training.pickle") else { return };
    let (r, md) = analyze(&file, tmp.path(), &[]);
    assert_eq!(r["leaks"][0]["verdict"], "cannot tell", "{}", r["leaks"][0]);
    assert!(!md.contains("not leaks"), "{md}");
    assert!(md.contains("a leak of one step would look the same (in the bytes the program asked for)"), "{md}");
    let once = r["leaks"][0]["allocated_once"].as_array().unwrap();
    let site = |s: &str| once.iter().find(|x| x["site"] == s).map(|x| x["bytes"].as_u64().unwrap());
    assert!(site("autograd backward").is_some_and(|b| b > 1 << 30), "{once:?}");
    assert!(site("autograd backward (IndexBackward0)").is_some(), "{once:?}");
    assert_eq!(site("unknown (native)"), None, "{once:?}");
    let requested = r["leaks"][0]["live_at_end_requested_bytes"].as_u64().unwrap();
    let listed: u64 = once.iter().map(|x| x["bytes"].as_u64().unwrap()).sum();
    assert!(listed <= requested, "sites in requested bytes: {listed} > {requested}");
}

/// cs336's snapshot began with 227 of its 516 segments (12.82 GiB of the
/// 18.32 GiB peak) already reserved: every scenario keeps them, so its
/// "keep the current settings" is said to judge only what the trace
/// added.
#[test]
fn a_cache_built_before_the_trace_qualifies_the_recommendation() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(file) = public("cs336_ctx128_forward.pickle") else { return };
    let (r, md) = analyze(&file, tmp.path(), &[]);
    let rec = &r["whatif"]["recommendation"];
    assert_eq!(rec["conf"], "keep the current settings", "{rec}");
    assert!(
        rec["reason"]
            .as_str()
            .unwrap()
            .contains("judged on what the trace added: 12.82 GiB of the 18.32 GiB peak was reserved before it began"),
        "{rec}"
    );
    assert!(md.contains("judged on what the trace added"), "{md}");
}

/// An H100 recording (`ebpf/`) of a process that exited: it is judged on
/// the rows while it ran, not on the nothing its exit left. Before, its
/// last row (after the exit, 0 B live) made its score "now" 0.0, its
/// trend a fall to it ("clear trend: the score fell by 0.34 points per
/// step" on training-nocache, whose score stood at 23.5), and its leak
/// table said "0 B in 0 blocks" beside "ended holding 4.95 GiB".
#[test]
fn a_recorded_process_is_judged_while_it_ran_not_after_its_exit() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/gpu-h100/ebpf");
    if !dir.exists() {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", dir.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // Caching off: its cudaMallocs are its tensors, and its level is real.
    let (r, md) = analyze(&dir.join("training-nocache"), &tmp.path().join("nocache"), &[]);
    let p = &r["prediction"];
    assert!(p["current"].as_f64().unwrap() > 20.0, "{p}");
    assert!(p["warnings"].as_array().unwrap().is_empty(), "{p}");
    // Judged where its arenas held the most, not after its exit.
    assert!(
        md.contains(
            "Fragmentation level: **medium** — fragmentation score 67.8 at the timestep where the arena span peaked"
        ),
        "{md}"
    );
    let l = &r["leaks"][0];
    assert_eq!(l["live_at_end_bytes"], 0, "{l}");
    assert!(l["held_at_exit"]["bytes"].as_u64().unwrap() > 0, "{l}");
    assert!(md.contains("which its exit released)"), "{md}");
    // PyTorch's cache: its segments' level is not given as the process's.
    let (r, md) = analyze(&dir.join("training-default"), &tmp.path().join("default"), &[]);
    assert!(md.contains("Fragmentation level: not measured inside PyTorch's cache"), "{md}");
    // Its 4 frees are all of a null pointer: the 96 blocks are held at exit.
    assert!(md.contains("| free | 4 (4 of a null pointer, which frees nothing"), "{md}");
    assert!(!md.contains("Fragmentation level: **"), "{md}");
    assert!(r["prediction"]["current"].as_f64().unwrap() > 0.0, "{}", r["prediction"]);
    // The drop at the end of varshape is its exit, said so; and the advice
    // asks for this version's probes, which the recording's build lacked.
    let (r, md) = analyze(&dir.join("varshape-default"), &tmp.path().join("varshape"), &[]);
    assert!(r["leaks"][0]["reason"].as_str().unwrap().contains("78.08 GiB was released by its exit"), "{}", r["leaks"]);
    assert!(md.contains("Record again with this version of `fragscope record`, without `--no-torch`"), "{md}");
}

/// Without an OOM, a leak is the first advice: training-leak's setting
/// only saves memory, while its leak runs out in the end.
#[test]
fn without_an_oom_a_leak_comes_before_a_settings_saving() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(file) = h100("training-leak.pickle") else { return };
    let (r, _) = analyze(&file, tmp.path(), &[]);
    let kinds: Vec<&str> = r["advice"].as_array().unwrap().iter().map(|a| a["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"leak"), "{kinds:?}");
    assert!(kinds.contains(&"saving"), "{kinds:?}");
}

/// The fragmentation level gates on the peak of reserved, not on the
/// emptied cache a run ends with: varshape's cache was empty at its end
/// (a score of 50 there) and scored "medium" (55.0) where it held the most.
/// The batch summary and compare say the same level.
#[test]
fn the_fragmentation_level_gated_on_is_the_one_at_the_peak() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(empty) = h100("varshape-default.pickle") else { return };
    let out = fragscope()
        .arg("analyze")
        .arg(&empty)
        .args(["--no-plots", "--fail-on-fragmentation", "high", "-o"])
        .arg(tmp.path().join("v"))
        .assert()
        .code(0);
    let stdout = String::from_utf8_lossy(&out.get_output().stdout).into_owned();
    assert!(stdout.contains("fragmentation level medium"), "{stdout}");
    fragscope()
        .arg("analyze")
        .arg(&empty)
        .args(["--no-plots", "--fail-on-fragmentation", "medium", "-o"])
        .arg(tmp.path().join("v2"))
        .assert()
        .code(3);
    let Some(live) = h100("training-default.pickle") else { return };
    fragscope()
        .arg("analyze")
        .arg(&live)
        .args(["--no-plots", "--fail-on-fragmentation", "critical", "-o"])
        .arg(tmp.path().join("t"))
        .assert()
        .code(3);
    // The batch summary and compare name it as analyze does.
    let batch = tmp.path().join("b");
    fs::create_dir_all(&batch).unwrap();
    fs::copy(&empty, batch.join("varshape.pickle")).unwrap();
    fs::copy(&live, batch.join("training.pickle")).unwrap();
    fragscope().arg("analyze").arg(&batch).args(["--no-plots", "-o"]).arg(tmp.path().join("bo")).assert().success();
    let md = fs::read_to_string(tmp.path().join("bo/summary.md")).unwrap();
    assert!(md.contains("| oom | medium |"), "{md}");
    fragscope().arg("compare").arg(&empty).arg(&live).arg("-o").arg(tmp.path().join("c")).assert().success();
    let md = fs::read_to_string(tmp.path().join("c/compare.md")).unwrap();
    assert!(md.contains("| fragmentation level | medium | critical |"), "{md}");
    assert!(md.contains("| OOM risk | oom | unknown | — | — |"), "{md}");
    // A falling Δ % has the minus sign its Δ has.
    assert!(md.contains("| −11.8 | −23.2 % |"), "{md}");
}

/// The first line of stdout: a high fragmentation level beside a verdict
/// that the run fits says that the score counts the cache's free blocks,
/// not a shortage (the runs fit: the README); beside a leak it stands alone.
#[test]
fn a_high_fragmentation_level_beside_a_fitting_run_says_it_is_the_cache() {
    let (Some(healthy), Some(fits), Some(leak)) =
        (h100("training-default.pickle"), h100("varlen-fraction-default.pickle"), h100("training-leak.pickle"))
    else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let first_two = |trace: &Path, out: &str| {
        let o = fragscope()
            .arg("analyze")
            .arg(trace)
            .args(["--no-plots", "-o"])
            .arg(tmp.path().join(out))
            .output()
            .unwrap();
        assert!(o.status.success());
        String::from_utf8(o.stdout).unwrap().lines().take(2).collect::<Vec<_>>().join("\n")
    };
    let said = "fragmentation level critical (free blocks the cache keeps, not a shortage: see the verdict)";
    let h = first_two(&healthy, "h");
    assert!(h.contains(said) && h.contains("verdict: healthy"), "{h}");
    let f = first_two(&fits, "f");
    assert!(f.contains(said) && f.contains("verdict: fits, releasing its cache 4 times"), "{f}");
    let l = first_two(&leak, "l");
    assert!(l.contains("fragmentation level high; leaking") && l.contains("verdict: leaking"), "{l}");
    assert!(!l.contains("not a shortage"), "{l}");
}
