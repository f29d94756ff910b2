//! Memory per stage on every shared snapshot that has annotations: each
//! figure of `report.json`'s `stages` against a computation by hand —
//! a naive walk that keeps, for every entry, the bytes allocated and
//! reserved after it, and rebuilds the layout from scratch at the peak.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use fragscope::trace::event::EventKind;

use crate::common::fragscope;

fn snapshots() -> Option<Vec<PathBuf>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures");
    if !root.join("gpu-h100/outcomes.json").exists() {
        eprintln!("skipped: {} is not here (only beside the development checkout and CI)", root.display());
        return None;
    }
    let mut out = Vec::new();
    for dir in ["pytorch", "gpu-h100/snapshots"] {
        for e in fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "pickle") {
                out.push(p);
            }
        }
    }
    out.sort();
    Some(out)
}

/// What the hand computation finds for one stage name.
#[derive(Debug, Default)]
struct ByHand {
    runs: u64,
    peak: u64,
    peak_at: Option<usize>,
    added: u64,
    reserved: u64,
    held: Option<u64>,
    net: Option<i64>,
    largest: u64,
}

const PAGE: u64 = 2 << 20;

#[test]
fn stages_of_every_shared_snapshot_match_a_computation_by_hand() {
    let Some(files) = snapshots() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for file in files {
        let loaded = fragscope::input::allocator_view(fragscope::input::open(&file, None).unwrap()).unwrap();
        let ev = &loaded.events;
        let details = &loaded.trace.meta.as_ref().unwrap().details;
        let annotations: Vec<_> = details.annotations().iter().filter(|a| details.placeable(a)).cloned().collect();
        let out = tmp.path().join(file.file_stem().unwrap());
        fragscope().arg("analyze").arg(&file).arg("-o").arg(&out).arg("--no-whatif").assert().success();
        let report: serde_json::Value = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
        let stages = report["stages"].as_array().unwrap();
        // Every real run's allocator used what it was asked for.
        assert_eq!(report["settings_check"]["differences"].as_array().map(Vec::len), Some(0), "{}", file.display());
        if annotations.is_empty() {
            assert!(stages.is_empty(), "{}", file.display());
            let md = fs::read_to_string(out.join("report.md")).unwrap();
            assert!(md.contains("record_function(\"forward\")"), "{}: says how to get stages", file.display());
            continue;
        }
        assert!(!stages.is_empty(), "{}: annotations, and no stages", file.display());

        // Every entry: allocated and reserved after it, the entry that frees
        // each allocation, requested sizes.
        let n = ev.len();
        let (mut alloc_after, mut reserved_after) = (vec![0u64; n], vec![0u64; n]);
        let mut freed_at: HashMap<usize, usize> = HashMap::new();
        let mut born: HashMap<u64, usize> = HashMap::new();
        let (mut a, mut r) = (0u64, 0u64);
        for i in 0..n {
            if ev.ret[i] == 0 {
                match ev.kind[i] {
                    Some(EventKind::BlockAlloc) if ev.size.at(i) > 0 => {
                        a += ev.size.at(i);
                        if let Some(old) = born.insert(ev.addr.at(i), i) {
                            a -= ev.size.at(old);
                        }
                    }
                    Some(EventKind::BlockFree) => {
                        if let Some(b) = born.remove(&ev.addr.at(i)) {
                            a -= ev.size.at(b);
                            freed_at.insert(b, i);
                        }
                    }
                    Some(EventKind::SegmentAlloc | EventKind::SegmentMap) => r += ev.size.at(i),
                    Some(EventKind::SegmentFree | EventKind::SegmentUnmap) => r -= ev.size.at(i),
                    _ => {}
                }
            }
            (alloc_after[i], reserved_after[i]) = (a, r);
        }
        let before = |i: usize, v: &[u64]| if i == 0 { 0 } else { v[i - 1] };
        // Runs: a START and the next END of its name.
        let t0 = ev.ts_ns.at(0);
        let mut open: HashMap<String, Vec<u64>> = HashMap::new();
        let mut runs: Vec<(String, u64, Option<u64>)> = Vec::new();
        let mut sorted = annotations.clone();
        sorted.sort_by_key(|a| a.t_ns);
        for an in &sorted {
            if an.stage == "START" {
                open.entry(an.name.clone()).or_default().push(an.t_ns);
            } else if let Some(s) = open.get_mut(&an.name).and_then(|v| v.pop()) {
                runs.push((an.name.clone(), s, Some(an.t_ns)));
            }
        }
        runs.extend(open.into_iter().flat_map(|(name, v)| v.into_iter().map(move |s| (name.clone(), s, None))));
        let mut by_hand: BTreeMap<String, ByHand> = BTreeMap::new();
        for (name, s, e) in runs.into_iter().filter(|r| r.1 >= t0) {
            let si = ev.ts_ns.partition_point(|t| t < s);
            let ei = e.map_or(n, |e| ev.ts_ns.partition_point(|t| t <= e));
            let h = by_hand.entry(name).or_default();
            h.runs += 1;
            let start_alloc = before(si, &alloc_after);
            let (mut peak, mut peak_at) = (start_alloc, si.checked_sub(1));
            let mut reserved = before(si, &reserved_after);
            let mut largest = 0;
            for i in si..ei {
                if alloc_after[i] > peak {
                    (peak, peak_at) = (alloc_after[i], Some(i));
                }
                reserved = reserved.max(reserved_after[i]);
                if ev.kind[i] == Some(EventKind::BlockAlloc) {
                    largest = largest.max(ev.requested_at(i).unwrap());
                }
            }
            if h.runs == 1 || peak > h.peak {
                (h.peak, h.peak_at) = (peak, peak_at);
            }
            h.added = h.added.max(peak - start_alloc);
            h.reserved = h.reserved.max(reserved);
            h.largest = h.largest.max(largest);
            if e.is_some() {
                // Allocated inside the run, not freed before its end.
                let held: u64 = (si..ei)
                    .filter(|&i| ev.kind[i] == Some(EventKind::BlockAlloc) && ev.ret[i] == 0)
                    .filter(|i| freed_at.get(i).is_none_or(|&f| f >= ei))
                    .map(|i| ev.size.at(i))
                    .sum();
                h.held = Some(h.held.map_or(held, |x: u64| x.max(held)));
                let net = before(ei, &alloc_after) as i64 - start_alloc as i64;
                h.net = Some(h.net.map_or(net, |x: i64| x.max(net)));
            }
        }
        for (name, h) in &by_hand {
            let got = stages
                .iter()
                .find(|s| s["path"].as_array().unwrap().last().unwrap() == name.as_str())
                .unwrap_or_else(|| panic!("{}: no stage {name}", file.display()));
            let what = format!("{} {name}", file.display());
            assert_eq!(got["runs"], h.runs, "{what}");
            assert_eq!(got["peak_allocated_bytes"], h.peak, "{what}");
            assert_eq!(got["added_bytes"], h.added, "{what}");
            assert_eq!(got["peak_reserved_bytes"], h.reserved, "{what}");
            assert_eq!(got["held_at_end_bytes"].as_u64(), h.held, "{what}");
            assert_eq!(got["net_at_end_bytes"].as_i64(), h.net, "{what}");
            assert_eq!(got["largest_request_bytes"], h.largest, "{what}");
            let frag = h.peak_at.and_then(|p| fragmentation_from_scratch(ev, p));
            let reported = got["fragmentation_at_peak"].as_f64();
            assert!(
                match (frag, reported) {
                    (Some(x), Some(y)) => (x - y).abs() < 1e-9,
                    (x, y) => x == y,
                },
                "{what}: fragmentation {reported:?}, by hand {frag:?}"
            );
            checked += 1;
        }
    }
    // training ×3, varlen ×3, and the public snapshots with optimizer ranges.
    assert!(checked >= 14, "{checked} stages checked");
}

/// The layout just after entry `p`, rebuilt from every entry up to it:
/// segments (expandable ones as 2 MiB pages, joined where they touch) and
/// the blocks alive in them; free ranges above 1 KiB over reserved bytes.
fn fragmentation_from_scratch(ev: &fragscope::trace::event::Events, p: usize) -> Option<f64> {
    let mut segments: BTreeMap<u64, u64> = BTreeMap::new();
    let mut pages: BTreeSet<u64> = BTreeSet::new();
    let mut blocks: BTreeMap<u64, u64> = BTreeMap::new();
    for i in 0..=p {
        if ev.ret[i] != 0 {
            continue;
        }
        let (addr, size) = (ev.addr.at(i), ev.size.at(i));
        match ev.kind[i] {
            Some(EventKind::BlockAlloc) if size > 0 => {
                blocks.insert(addr, size);
            }
            Some(EventKind::BlockFree) => {
                blocks.remove(&addr);
            }
            Some(EventKind::SegmentAlloc) => {
                segments.insert(addr, addr + size);
            }
            Some(EventKind::SegmentFree) => {
                segments.remove(&addr);
            }
            Some(EventKind::SegmentMap) => pages.extend((addr..addr + size).step_by(PAGE as usize)),
            Some(EventKind::SegmentUnmap) => (addr..addr + size).step_by(PAGE as usize).for_each(|q| {
                pages.remove(&q);
            }),
            _ => {}
        }
    }
    let mut ranges: Vec<(u64, u64)> = segments.into_iter().collect();
    let mut run: Option<(u64, u64)> = None;
    for q in pages {
        run = match run {
            Some((s, e)) if e == q => Some((s, q + PAGE)),
            Some(done) => {
                ranges.push(done);
                Some((q, q + PAGE))
            }
            None => Some((q, q + PAGE)),
        };
    }
    ranges.extend(run);
    let span: u64 = ranges.iter().map(|(s, e)| e - s).sum();
    let mut gaps = 0;
    for (s, e) in ranges {
        let mut at = s;
        for (&a, &size) in blocks.range(s..e) {
            if a > at && a - at > 1024 {
                gaps += a - at;
            }
            at = at.max(a + size);
        }
        if e > at && e - at > 1024 {
            gaps += e - at;
        }
    }
    (span > 0).then(|| gaps as f64 / span as f64)
}

/// The generated `stages` snapshot (PyTorch 2.14's layout: `annotate`
/// entries, `user_metadata`, empty host segments) with nested ranges and
/// a step cut by the snapshot: every figure as the generator's own model
/// of the allocator computed it while it made the entries.
#[test]
fn generated_nested_stages_match_the_generator() {
    let Some(dir) = crate::snapshots::generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r");
    fragscope().arg("analyze").arg(dir.join("stages.pickle")).arg("-o").arg(&out).assert().success();
    let report: serde_json::Value = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_slice(&fs::read(dir.join("stages.expected.json")).unwrap()).unwrap();
    let expected = expected["stages"].as_object().unwrap();
    let stages = report["stages"].as_array().unwrap();
    assert_eq!(stages.len(), expected.len(), "{stages:?}");
    for s in stages {
        let path: Vec<&str> = s["path"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let e = &expected[&path.join(" > ")];
        for k in ["runs", "unfinished", "peak_allocated_bytes", "added_bytes", "peak_reserved_bytes"] {
            assert_eq!(s[k], e[k], "{path:?} {k}");
        }
        assert_eq!(s["held_at_end_bytes"], e["held_at_end_bytes"], "{path:?}");
        assert_eq!(s["net_at_end_bytes"], e["net_at_end_bytes"], "{path:?}");
        assert_eq!(s["largest_request_bytes"], e["largest_request_bytes"], "{path:?}");
        let (x, y) = (s["fragmentation_at_peak"].as_f64().unwrap(), e["fragmentation_at_peak"].as_f64().unwrap());
        assert!((x - y).abs() < 1e-12, "{path:?}: {x} against {y}");
    }
    // Tree order: each stage below the one that encloses it.
    let first: Vec<String> = stages.iter().map(|s| s["path"].as_array().unwrap().len().to_string()).collect();
    assert_eq!(first, ["1", "2", "3", "3", "2", "2"]);
    // The annotate entry is no unknown action, and nothing is an anomaly.
    let loaded = fragscope::input::open(&dir.join("stages.pickle"), None).unwrap();
    let details = loaded.trace.meta.as_ref().unwrap().details.snapshot().unwrap().clone();
    assert_eq!(details.unknown_actions, 0);
    assert_eq!(
        report["anomalies"].as_object().unwrap().values().filter(|v| **v != 0).count(),
        0,
        "{}",
        report["anomalies"]
    );
    let md = fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| `ProfilerStep#N` | 4 (1 unfinished) |"), "{md}");
    assert!(md.contains("\u{a0}\u{a0}\u{a0}\u{a0}└ `layer.0` | 4 |"), "{md}");
}

/// The settings check fires where the string PyTorch parsed asks for
/// what its values did not take, and is silent where they agree (and on
/// every shared snapshot: `stages_of_every_shared_snapshot…` reads their
/// reports, and `settings_check` there has no difference).
#[test]
fn the_settings_check_fires_where_asked_and_used_differ() {
    let Some(dir) = crate::snapshots::generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    for (name, differences) in [("settings_not_in_force", 1), ("settings_agree", 0)] {
        let out = tmp.path().join(name);
        let o =
            fragscope().arg("analyze").arg(dir.join(format!("{name}.pickle"))).arg("-o").arg(&out).output().unwrap();
        assert!(o.status.success());
        let report: serde_json::Value = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
        let c = &report["settings_check"];
        assert_eq!(c["differences"].as_array().unwrap().len(), differences, "{name}: {c}");
        let md = fs::read_to_string(out.join("report.md")).unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout);
        if differences == 0 {
            assert!(!md.contains("A setting not in force"), "{md}");
            continue;
        }
        assert_eq!(c["differences"][0]["key"], "expandable_segments");
        assert_eq!(
            (c["differences"][0]["asked"].as_str(), c["differences"][0]["used"].as_str()),
            (Some("True"), Some("False"))
        );
        let line = "**A setting not in force:** the configuration string the snapshot's allocator parsed asks for \
                    `expandable_segments:True`, but the allocator ran with `expandable_segments:False`";
        assert!(md.contains(line), "{md}");
        // On the first screen: before the tables.
        assert!(md.find(line) < md.find("## "), "{md}");
        assert!(stdout.contains("settings not in force:"), "{stdout}");
    }
}

/// The explorable view draws the outer two levels of stages as bands
/// along its time axis: the manifest carries each run's span.
#[test]
fn the_view_carries_stage_bands() {
    let Some(dir) = crate::snapshots::generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r");
    fragscope().arg("analyze").arg(dir.join("stages.pickle")).arg("-o").arg(&out).assert().success();
    let js = fs::read_to_string(out.join("view/manifest.js")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&js[js.find('(').unwrap() + 1..js.rfind(')').unwrap()]).unwrap();
    let bands: Vec<(String, u64, usize)> = m["panels"][0]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_string(),
                s["depth"].as_u64().unwrap(),
                s["spans"].as_array().unwrap().len(),
            )
        })
        .collect();
    let want: Vec<(String, u64, usize)> =
        [("ProfilerStep#N", 0, 4), ("forward", 1, 4), ("backward", 1, 3), ("Optimizer.step#SGD.step", 1, 3)]
            .iter()
            .map(|(n, d, k)| (n.to_string(), *d, *k))
            .collect();
    assert_eq!(bands, want);
    // Each span lies inside the trace and starts before it ends.
    let span = m["span"].as_f64().unwrap();
    for s in m["panels"][0]["stages"].as_array().unwrap() {
        for sp in s["spans"].as_array().unwrap() {
            let (a, b) = (sp[0].as_f64().unwrap(), sp[1].as_f64().unwrap());
            assert!(a <= b && b <= span + 1.0, "{sp} in {span}");
        }
    }
}

/// `compare` gives the change per stage: B's backward pass makes larger
/// gradients, and the Δ of each stage's figures is the generator's.
#[test]
fn compare_gives_the_change_per_stage() {
    let Some(dir) = crate::snapshots::generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("c");
    fragscope()
        .arg("compare")
        .arg(dir.join("stages.pickle"))
        .arg(dir.join("stages_more.pickle"))
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    let c: serde_json::Value = serde_json::from_slice(&fs::read(out.join("compare.json")).unwrap()).unwrap();
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&fs::read(dir.join(format!("{name}.expected.json"))).unwrap()).unwrap()
    };
    let (a, b) = (read("stages"), read("stages_more"));
    let stages = c["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 6);
    for s in stages {
        let path: Vec<&str> = s["path"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let key = path.join(" > ");
        let d = |k: &str| b["stages"][&key][k].as_i64().unwrap() - a["stages"][&key][k].as_i64().unwrap();
        assert_eq!(s["delta_peak_allocated_bytes"].as_i64(), Some(d("peak_allocated_bytes")), "{key}");
        assert_eq!(s["delta_added_bytes"].as_i64(), Some(d("added_bytes")), "{key}");
        assert_eq!(s["delta_net_at_end_bytes"].as_i64(), Some(d("net_at_end_bytes")), "{key}");
    }
    let backward = stages.iter().find(|s| s["path"][1] == "backward").unwrap();
    assert!(backward["delta_added_bytes"].as_i64().unwrap() > 0, "{backward}");
    let md = fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(md.contains("## Memory per stage") && md.contains("\u{a0}\u{a0}└ `backward` |"), "{md}");
}
