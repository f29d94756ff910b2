//! `fragscope compare`: verdicts and gates on synthetic traces built to
//! differ, and the snapshot-only parts on two generated snapshots.

use std::fs;
use std::path::Path;

use crate::common::fragscope;
use predicates::prelude::*;
use serde_json::Value;

fn json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

fn synth(dir: &Path, pattern: &str, events: &str) {
    fragscope().args(["synth", "--pattern", pattern, "--events", events, "-o"]).arg(dir).assert().success();
}

#[test]
fn a_more_fragmented_candidate_is_worse_and_trips_the_gate() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("steady"), tmp.path().join("fragmenting"));
    synth(&a, "steady", "30k");
    synth(&b, "fragmenting", "30k");
    let out = tmp.path().join("cmp");
    fragscope()
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .arg("-o")
        .arg(&out)
        .args([
            "--fail-if-worse",
            "p95_score:5",
            "--fail-if-worse",
            "peak_live:10%",
            "--fail-if-worse",
            "peak_live:10MiB",
        ])
        .assert()
        .code(3)
        .stdout(predicate::str::contains("worse"))
        .stderr(predicate::str::contains("gate: --fail-if-worse p95_score"))
        // A byte allowance in bytes' units, a share as a share.
        .stderr(predicate::str::contains("(allowed: +10.00 MiB)").and(predicate::str::contains("(allowed: +10 %)")));
    let c = json(&out.join("compare.json"));
    assert!(c["verdict"].as_str().unwrap().starts_with("worse"), "{}", c["verdict"]);
    let row = |k: &str| c["metrics"].as_array().unwrap().iter().find(|m| m["key"] == k).unwrap().clone();
    assert_eq!(row("p95_score")["judgement"], "worse");
    assert_eq!(row("ext_frag_at_peak")["judgement"], "worse");
    assert!(row("p95_score")["delta"].as_f64().unwrap() > 20.0);
    assert_eq!(c["gates"].as_array().unwrap().iter().filter(|g| g["tripped"] == true).count(), 3);
    let md = fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(md.contains("**Verdict: WORSE**") && md.contains("| p95 score |"));
    let img = crate::common::read_png(&out.join("compare.png"));
    assert_eq!((img.width, img.height), (2000, 1200));
    crate::common::assert_clear_border(&out.join("compare.png"), 4);

    // The same trace twice: same, and the gates pass.
    let same = tmp.path().join("same");
    fragscope()
        .arg("compare")
        .arg(&a)
        .arg(&a)
        .arg("-o")
        .arg(&same)
        .args(["--fail-if-worse", "p95_score:0"])
        .assert()
        .success()
        .stdout(predicate::str::contains("same"));
    let c = json(&same.join("compare.json"));
    assert!(c["verdict"].as_str().unwrap().starts_with("same"));
    assert!(c["metrics"].as_array().unwrap().iter().all(|m| m["judgement"] == "same" || m["judgement"] == "info"));

    // Reversed: better.
    fragscope().arg("compare").arg(&b).arg(&a).arg("-o").arg(tmp.path().join("rev")).assert().success();
    assert!(json(&tmp.path().join("rev/compare.json"))["verdict"].as_str().unwrap().starts_with("better"));

    // A bad gate is a usage error.
    fragscope()
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .args(["-o", "x", "--fail-if-worse", "p99:5"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("unknown metric"));
}

#[test]
fn two_snapshots_list_the_segments_only_in_each() {
    let dir = std::env::temp_dir().join(format!("fragscope-cmp-{}", std::process::id()));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gen-snapshots.py");
    match std::process::Command::new("python3").arg(&script).arg(&dir).status() {
        Ok(s) if s.success() => {}
        other => {
            assert!(std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() != Ok("1"), "python3 failed: {other:?}");
            eprintln!("skipped: python3 could not generate the snapshots ({other:?})");
            return;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cmp");
    fragscope()
        .arg("compare")
        .arg(dir.join("cmp_a.pickle"))
        .arg(dir.join("cmp_b.pickle"))
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    let c = json(&out.join("compare.json"));
    let expected = json(&dir.join("cmp.expected.json"));
    for side in ["only_a", "only_b"] {
        assert_eq!(c["snapshot"][side], expected[side], "{side}");
        assert!(!expected[side].as_array().unwrap().is_empty(), "the test pair must differ ({side})");
    }
    let sites = c["snapshot"]["sites"].as_array().unwrap();
    assert!(!sites.is_empty() && sites[0][0].as_str().unwrap().starts_with("model.py:"));
    let md = fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(md.contains("## Segments only in A") && md.contains("## Call sites whose live bytes changed most"));
    let _ = fs::remove_dir_all(&dir);
}

/// Two runs with iterations are set side by side by iteration, not by
/// normalised time: compare.json has each complete iteration's floor and
/// peak, and compare.png's lower chart draws them (B's orange is there,
/// below the MDTPs).
#[test]
fn runs_with_iterations_are_aligned_by_iteration() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("training"), tmp.path().join("leak"));
    synth(&a, "training", "30k");
    synth(&b, "leak", "30k");
    let out = tmp.path().join("cmp");
    fragscope().arg("compare").arg(&a).arg(&b).arg("-o").arg(&out).assert().success();
    let c = json(&out.join("compare.json"));
    let side = |k: &str| -> Vec<(u64, u64)> {
        c["iterations"][k]
            .as_array()
            .unwrap_or_else(|| panic!("{}", c["iterations"]))
            .iter()
            .map(|p| (p["floor_bytes"].as_u64().unwrap(), p["peak_bytes"].as_u64().unwrap()))
            .collect()
    };
    let (ia, ib) = (side("a"), side("b"));
    assert!(ia.len() >= 2 && ib.len() >= 2, "{ia:?} {ib:?}");
    assert!(ia.iter().chain(&ib).all(|(f, p)| f <= p), "{ia:?} {ib:?}");
    // The leak's floors rise iteration after iteration.
    assert!(ib.windows(2).all(|w| w[1].0 >= w[0].0) && ib.last().unwrap().0 > ib[0].0, "{ib:?}");
    let img = crate::common::read_png(&out.join("compare.png"));
    let orange = |p: &[u8; 3]| p[0] > 200 && (100..140).contains(&p[1]) && p[2] < 60;
    let lower = (img.height * 2 / 3 + 40) as usize * img.width as usize;
    assert!(img.pixels[lower..].iter().filter(|p| orange(p)).count() > 100, "no B line below the MDTPs");
}
