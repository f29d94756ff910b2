//! `fragscope export`: memory-viz pickles that replay to the same metrics
//! and that CPython reads as PyTorch's snapshots, time windows that cut a
//! slice which replays correctly, Trace Event JSON, speedscope, and the
//! errors of bad requests.

use std::fs;
use std::path::Path;

use crate::common::fragscope;
use crate::snapshots::generated;

fn metrics(dir: &Path) -> crate::common::Frame {
    crate::common::read_parquet(&dir.join("metrics.parquet"))
}

fn analyze(input: &Path, out: &Path) {
    fragscope().arg("analyze").arg(input).arg("-o").arg(out).args(["--no-plots", "--no-whatif"]).assert().success();
}

fn export(input: &Path, format: &str, out: &Path, extra: &[&str]) -> String {
    let a = fragscope()
        .arg("export")
        .arg(input)
        .args(["--format", format])
        .arg("-o")
        .arg(out)
        .args(extra)
        .assert()
        .success();
    String::from_utf8_lossy(&a.get_output().stdout).into_owned()
}

/// Runs a Python check on a pickle; false (and a note) without python3,
/// a failure when FRAGSCOPE_REQUIRE_PYTHON=1.
fn python(script: &str, args: &[&Path]) -> bool {
    match std::process::Command::new("python3").arg("-c").arg(script).args(args).output() {
        Ok(o) => {
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            true
        }
        Err(e) => {
            assert!(std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() != Ok("1"), "python3: {e}");
            eprintln!("skipped: no python3 to read the export ({e})");
            false
        }
    }
}

/// What CPython reads back: PyTorch's snapshot shape, blocks covering each
/// segment, the original's final segments and trace entries.
const SAME_SNAPSHOT: &str = r#"
import pickle, sys
a = pickle.load(open(sys.argv[1], 'rb')); b = pickle.load(open(sys.argv[2], 'rb'))
assert set(b) >= {'segments', 'device_traces', 'allocator_settings'}, set(b)
for s in b['segments']:
    assert sum(x['size'] for x in s['blocks']) == s['total_size'], s['address']
    assert s['allocated_size'] == sum(x['size'] for x in s['blocks'] if x['state'] == 'active_allocated')
seg = lambda snap: sorted((s['device'], s['address'], s['total_size'], tuple((x['size'], x['state']) for x in s['blocks'])) for s in snap['segments'])
assert seg(a) == seg(b)
key = lambda e: (e['action'], e.get('addr'), e['size'], e.get('stream', 0), e.get('time_us'))
for ta, tb in zip(a['device_traces'], b['device_traces']):
    assert [key(e) for e in ta] == [key(e) for e in tb]
"#;

#[test]
fn memory_viz_round_trips_snapshots_to_the_same_metrics() {
    let mut inputs = Vec::new();
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/pytorch");
    if shared.is_dir() {
        inputs.extend(["bcrafton_memory_snapshot", "cs336_ctx128_forward"].map(|n| shared.join(format!("{n}.pickle"))));
    } else {
        eprintln!("skipped the real snapshots: {} is absent", shared.display());
    }
    if let Some(g) = generated() {
        inputs.extend(["basic", "oom", "two_devices", "no_time"].map(|n| g.join(format!("{n}.pickle"))));
    }
    assert!(!inputs.is_empty() || std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() != Ok("1"));
    let tmp = tempfile::tempdir().unwrap();
    for input in &inputs {
        let name = input.file_stem().unwrap().to_string_lossy().into_owned();
        let exported = tmp.path().join(format!("{name}.pickle"));
        let said = export(input, "memory-viz", &exported, &[]);
        assert!(said.contains("memory-viz snapshot"), "{said}");
        let (a, b) = (tmp.path().join(format!("{name}-a")), tmp.path().join(format!("{name}-b")));
        analyze(input, &a);
        analyze(&exported, &b);
        let (ma, mb) = (metrics(&a), metrics(&b));
        assert_eq!(ma.height(), mb.height(), "{name}");
        assert_eq!(ma.names(), mb.names(), "{name}");
        for col in ma.names() {
            assert_eq!(ma.cells(&col), mb.cells(&col), "{name}: column {col} differs after the round trip");
        }
        python(SAME_SNAPSHOT, &[input, &exported]);
    }
}

#[test]
fn a_time_window_cuts_a_slice_that_replays_correctly() {
    let Some(g) = generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let input = g.join("basic.pickle");
    let slice = tmp.path().join("slice.pickle");
    // The generated trace spans about 0.1 s: a window in the middle.
    export(&input, "memory-viz", &slice, &["--time-window", "0.02..0.06"]);
    // The importer rebuilds the state at the window's start from the
    // state at its end and the entries between: exact, nothing skipped.
    let a = fragscope().arg("import").arg(&slice).arg("-o").arg(tmp.path().join("t")).assert().success();
    let said = String::from_utf8_lossy(&a.get_output().stdout).into_owned();
    assert!(said.contains("matches the snapshot"), "{said}");
    assert!(!String::from_utf8_lossy(&a.get_output().stderr).contains("contradict"));
    let script = r#"
import pickle, sys
a = pickle.load(open(sys.argv[1], 'rb')); b = pickle.load(open(sys.argv[2], 'rb'))
t = a['device_traces'][0]; t0 = t[0]['time_us']
inside = [e for e in t if t0 + 20000 <= e["time_us"] <= t0 + 60000]
assert 0 < len(inside) < len(t) and len(b['device_traces'][0]) == len(inside), (len(inside), len(b['device_traces'][0]))
assert [e['addr'] for e in inside if 'addr' in e] == [e['addr'] for e in b['device_traces'][0] if 'addr' in e]
"#;
    python(script, &[&input, &slice]);
}

#[test]
fn chrome_json_holds_counters_ooms_and_iterations() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("t");
    fragscope().args(["synth", "--pattern", "fragmenting", "--events", "20k", "-o"]).arg(&trace).assert().success();
    let out = tmp.path().join("t.json");
    export(&trace, "chrome", &out, &[]);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let count = |ph: &str, prefix: &str| {
        events.iter().filter(|e| e["ph"] == ph && e["name"].as_str().unwrap().starts_with(prefix)).count()
    };
    assert!(count("C", "memory") > 100 && count("C", "fragmentation") == count("C", "memory"));
    assert!(count("C", "forecast") > 0);
    let r: serde_json::Value = {
        let a = tmp.path().join("a");
        analyze(&trace, &a);
        serde_json::from_slice(&std::fs::read(a.join("report.json")).unwrap()).unwrap()
    };
    assert_eq!(count("i", "OOM ("), r["ooms"].as_array().unwrap().len());
    assert!(count("i", "OOM (fragmentation)") > 0);
    assert!(count("X", "iteration") > 0);
    let ts: Vec<f64> = events.iter().filter(|e| e["ph"] == "C").map(|e| e["ts"].as_f64().unwrap()).collect();
    assert!(ts.windows(2).all(|w| w[0] <= w[1]) && ts[0] >= 0.0);
}

#[test]
fn speedscope_weights_are_the_live_bytes_by_stack() {
    let Some(g) = generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let input = g.join("basic.pickle");
    let out = tmp.path().join("s.json");
    export(&input, "speedscope", &out, &[]);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let frames = v["shared"]["frames"].as_array().unwrap().len();
    let end = v["profiles"].as_array().unwrap().iter().find(|p| p["name"] == "live memory at the end").unwrap();
    let weights: u64 = end["weights"].as_array().unwrap().iter().map(|w| w.as_u64().unwrap()).sum();
    assert_eq!(weights, end["endValue"].as_u64().unwrap());
    assert!(
        end["samples"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s.as_array().unwrap())
            .all(|i| (i.as_u64().unwrap() as usize) < frames)
    );
    // The live bytes at the end: the active blocks of the snapshot's segments.
    let script = format!(
        "import pickle,sys; s=pickle.load(open(sys.argv[1],'rb')); n=sum(b['size'] for g in s['segments'] for b in g['blocks'] if b['state']=='active_allocated'); assert n=={weights}, (n, {weights})"
    );
    python(&script, &[&input]);
}

#[test]
fn bad_requests_say_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("t");
    fragscope().args(["synth", "--pattern", "steady", "--events", "2k", "-o"]).arg(&trace).assert().success();
    let out = tmp.path().join("x");
    // Unknown format: a usage error.
    fragscope().arg("export").arg(&trace).args(["--format", "nsys", "-o"]).arg(&out).assert().code(2);
    // A malformed window: a usage error naming it, before any reading.
    let a = fragscope()
        .arg("export")
        .arg(&trace)
        .args(["--format", "chrome", "--time-window", "5-7", "-o"])
        .arg(&out)
        .assert()
        .code(2);
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("--time-window `5-7`: expected A..B"));
    // A window that holds no event: said (a memory_viz slice of an idle
    // stretch still holds the state at its end).
    let a = fragscope()
        .arg("export")
        .arg(&trace)
        .args(["--format", "chrome", "--time-window", "50..60", "-o"])
        .arg(&out)
        .assert()
        .success();
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("no event in --time-window 50..60"));
    fs::remove_file(&out).unwrap();
    // The window takes the syntax analyze's takes, and analyze export's:
    // durations or seconds, either end open.
    for w in ["1ms..", "..0.5", "0s..250ms"] {
        fragscope()
            .arg("export")
            .arg(&trace)
            .args(["--format", "chrome", "--time-window", w, "-o"])
            .arg(tmp.path().join("w.json"))
            .assert()
            .success();
        fragscope()
            .arg("analyze")
            .arg(&trace)
            .args(["--no-view", "--time-window", w, "-o"])
            .arg(tmp.path().join("w"))
            .assert()
            .success();
    }
    // A window for speedscope, which exports the whole trace's end and peak
    // stacks: a usage error, not a file that ignores it.
    let a = fragscope()
        .arg("export")
        .arg(&trace)
        .args(["--format", "speedscope", "--time-window", "0..1", "-o"])
        .arg(&out)
        .assert()
        .code(2);
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("does not apply to --format speedscope"));
    assert!(!out.exists());
    // No stacks for speedscope: an error naming the trace.
    let a = fragscope().arg("export").arg(&trace).args(["--format", "speedscope", "-o"]).arg(&out).assert().code(1);
    let err = String::from_utf8_lossy(&a.get_output().stderr).into_owned();
    assert!(err.contains("has no call stacks") && err.contains(&*trace.to_string_lossy()), "{err}");
    assert!(!out.exists(), "no file is left behind");
    // A missing input.
    fragscope()
        .arg("export")
        .arg(tmp.path().join("nope"))
        .args(["--format", "chrome", "-o"])
        .arg(&out)
        .assert()
        .code(1);
    // An unwritable output: nothing half-written under the name.
    let a = fragscope()
        .arg("export")
        .arg(&trace)
        .args(["--format", "memory-viz", "-o", "/proc/fragscope.pickle"])
        .assert()
        .code(1);
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("/proc/"));
    // The input itself, or a file inside an input trace, as the output: a
    // usage error, and the input untouched.
    let snap = tmp.path().join("s.pickle");
    fragscope().arg("export").arg(&trace).args(["--format", "memory-viz", "-o"]).arg(&snap).assert().success();
    let before = fs::read(&snap).unwrap();
    for (input, output) in [(&snap, snap.clone()), (&trace, trace.join("events-00000.parquet"))] {
        let kept = fs::read(&output).unwrap();
        let a = fragscope().arg("export").arg(input).args(["--format", "chrome", "-o"]).arg(&output).assert().code(2);
        let err = String::from_utf8_lossy(&a.get_output().stderr).into_owned();
        assert!(err.contains("is the input") && err.contains("would replace what it reads"), "{err}");
        assert_eq!(fs::read(&output).unwrap(), kept);
    }
    assert_eq!(fs::read(&snap).unwrap(), before);
    // A new file inside the input trace is refused too (trace.json of a
    // killed recording, a stray part).
    let inside = trace.join("events-00009.parquet");
    fragscope().arg("export").arg(&trace).args(["--format", "chrome", "-o"]).arg(&inside).assert().code(2);
    assert!(!inside.exists());
}

/// Reads a Perfetto export back with Perfetto's own generated classes
/// (scripts/readback-perfetto.py in target/pyenv): None, with a note, when
/// target/pyenv lacks the `perfetto` package; a failure when
/// FRAGSCOPE_REQUIRE_PYTHON=1.
fn perfetto_readback(path: &Path) -> Option<serde_json::Value> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/pyenv/bin/python3");
    let has = std::process::Command::new(&python)
        .args(["-c", "import perfetto.protos.perfetto.trace.perfetto_trace_pb2"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        let required = std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() == Ok("1");
        assert!(
            !required,
            "target/pyenv lacks perfetto (scripts/install-deps installs it) and FRAGSCOPE_REQUIRE_PYTHON=1"
        );
        eprintln!("skipped: target/pyenv lacks perfetto (scripts/install-deps installs it)");
        return None;
    }
    let o =
        std::process::Command::new(&python).arg(root.join("scripts/readback-perfetto.py")).arg(path).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    Some(serde_json::from_slice(&o.stdout).unwrap())
}

/// The chrome export's counter `name`.`arg` per pid, as (ns, value).
fn chrome_series(events: &[serde_json::Value], pid: u64, name: &str, arg: &str) -> Vec<(u64, f64)> {
    events
        .iter()
        .filter(|e| e["ph"] == "C" && e["name"] == name && e["pid"] == pid && !e["args"][arg].is_null())
        .map(|e| (ns(&e["ts"]), e["args"][arg].as_f64().unwrap()))
        .collect()
}

/// A chrome timestamp (µs from the first event) in ns.
fn ns(us: &serde_json::Value) -> u64 {
    (us.as_f64().unwrap() * 1000.0).round() as u64
}

fn perfetto_series(p: &serde_json::Value, root: &str, track: &str) -> Vec<(u64, f64)> {
    p["counters"][format!("{root}/{track}")]
        .as_array()
        .unwrap_or_else(|| panic!("no counter track {root}/{track}: {:?}", p["tracks"]))
        .iter()
        .map(|v| (v[0].as_u64().unwrap(), v[1].as_f64().unwrap()))
        .collect()
}

/// Perfetto's own classes read the protobuf export, every field known to
/// its schema, and find what the Trace Event JSON of the same analysis
/// holds: every counter series of every process, the OOM instants and leak
/// markers at the same times with the same class and verdict, and the same
/// iteration slices. `extra` goes to both exports (a time window).
fn perfetto_matches_chrome(input: &Path, tmp: &Path, extra: &[&str]) -> Option<serde_json::Value> {
    let pf = tmp.join("t.pftrace");
    let stdout = export(input, "perfetto", &pf, extra);
    assert!(stdout.contains("Perfetto trace"), "{stdout}");
    let cj = tmp.join("t.json");
    export(input, "chrome", &cj, extra);
    let c: serde_json::Value = serde_json::from_slice(&std::fs::read(&cj).unwrap()).unwrap();
    let events = c["traceEvents"].as_array().unwrap();
    let p = perfetto_readback(&pf)?;
    assert_eq!(p["sequences"], serde_json::json!([1]));
    // Processes (devices) by name, as chrome's metadata names them.
    let names: std::collections::BTreeMap<u64, String> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .map(|e| (e["pid"].as_u64().unwrap(), e["args"]["name"].as_str().unwrap().to_string()))
        .collect();
    let roots: Vec<&String> = names.values().collect();
    assert_eq!(p["roots"], serde_json::json!(roots));
    assert_eq!(p["units"]["live bytes"], "UNIT_SIZE_BYTES");
    let horizon =
        p["tracks"].as_array().unwrap().iter().filter(|t| t.as_str().unwrap().starts_with("forecast t+")).count()
            / names.len();
    for (&pid, root) in &names {
        let mut pairs = vec![
            ("live bytes", "memory", "live_bytes".to_string()),
            ("fragmentation score", "fragmentation", "score".into()),
        ];
        for c in fragscope::analysis::metrics::Metrics::FEATURE_NAMES {
            pairs.push((c, "fragmentation", c.to_string()));
        }
        let forecast_tracks: Vec<String> = (1..=horizon).map(|k| format!("forecast t+{k}")).collect();
        for (k, t) in forecast_tracks.iter().enumerate() {
            pairs.push((t, "forecast", format!("score_t+{}", k + 1)));
        }
        if !chrome_series(events, pid, "memory", "reserved_bytes").is_empty() {
            pairs.push(("reserved bytes", "memory", "reserved_bytes".into()));
        }
        for (track, name, arg) in pairs {
            let want = chrome_series(events, pid, name, &arg);
            assert_eq!(perfetto_series(&p, root, track), want, "{root}/{track}");
        }
    }
    // Instants: the same (process, name, time), OOMs with their class.
    let mut want: Vec<(String, String, u64)> = events
        .iter()
        .filter(|e| e["ph"] == "i")
        .map(|e| (names[&e["pid"].as_u64().unwrap()].clone(), e["name"].as_str().unwrap().to_string(), ns(&e["ts"])))
        .collect();
    let instants = p["instants"].as_array().unwrap();
    let mut got: Vec<(String, String, u64)> = instants
        .iter()
        .map(|i| {
            (
                i["root"].as_str().unwrap().to_string(),
                i["name"].as_str().unwrap().to_string(),
                i["ts"].as_u64().unwrap(),
            )
        })
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
    for i in instants.iter().filter(|i| i["track"] == "OOMs") {
        assert!(i["name"].as_str().unwrap().contains(i["args"]["class"].as_str().unwrap()), "{i}");
        assert!(i["args"]["requested_bytes"].as_u64().unwrap() > 0);
    }
    // Slices: the same iterations, begin and end.
    let mut want: Vec<(String, String, u64, u64)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            let (b, d) = (ns(&e["ts"]), ns(&e["dur"]));
            (names[&e["pid"].as_u64().unwrap()].clone(), e["name"].as_str().unwrap().to_string(), b, b + d)
        })
        .collect();
    let mut got: Vec<(String, String, u64, u64)> = p["slices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let f = |k: &str| s[k].as_str().unwrap().to_string();
            (f("root"), f("name"), s["begin"].as_u64().unwrap(), s["end"].as_u64().unwrap())
        })
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
    Some(p)
}

#[test]
fn perfetto_protobuf_holds_what_the_chrome_json_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("t");
    fragscope().args(["synth", "--pattern", "fragmenting", "--events", "20k", "-o"]).arg(&trace).assert().success();
    // Without the Python read-back, prost's own decoding still checks the
    // structure: time order, known tracks, balanced slices per track.
    let pf = tmp.path().join("structure.pftrace");
    export(&trace, "perfetto", &pf, &[]);
    structure_is_sound(&pf);
    let Some(p) = perfetto_matches_chrome(&trace, tmp.path(), &[]) else { return };
    let names: Vec<&str> = p["instants"].as_array().unwrap().iter().map(|i| i["name"].as_str().unwrap()).collect();
    assert!(names.iter().any(|n| n.starts_with("OOM (fragmentation)")), "{names:?}");
    assert!(p["slices"].as_array().unwrap().len() > 10, "iteration slices");
    assert_eq!(p["processes"], serde_json::json!([4100]));
    // A window that cuts iterations: clipped slices, still balanced.
    let dir = tmp.path().join("window");
    std::fs::create_dir_all(&dir).unwrap();
    let p = perfetto_matches_chrome(&trace, &dir, &["--time-window", "0.02..0.05"]).unwrap();
    let slices = p["slices"].as_array().unwrap();
    assert!(!slices.is_empty() && slices.iter().all(|s| s["begin"].as_u64().unwrap() >= 20_000_000));
    // A snapshot: the allocator view, with reserved bytes, per device (no
    // process descriptor: device indices are not process ids).
    if let Some(g) = generated() {
        let dir = tmp.path().join("snap");
        std::fs::create_dir_all(&dir).unwrap();
        let p = perfetto_matches_chrome(&g.join("basic.pickle"), &dir, &[]).unwrap();
        assert!(p["tracks"].as_array().unwrap().iter().any(|t| t == "reserved bytes"), "{:?}", p["tracks"]);
        assert_eq!(p["processes"], serde_json::json!([]));
    }
}

/// What can be checked of a Perfetto export in Rust alone: packets in
/// time order after the descriptors, every event on a described track, and
/// each track's slices balanced.
fn structure_is_sound(path: &Path) {
    use fragscope::output::export::perfetto::Trace;
    use prost::Message;
    let t = Trace::decode(std::fs::read(path).unwrap().as_slice()).unwrap();
    let mut tracks = std::collections::HashSet::new();
    let mut open: std::collections::HashMap<u64, i32> = Default::default();
    let mut last = 0;
    for p in &t.packet {
        if let Some(d) = &p.track_descriptor {
            assert!(tracks.insert(d.uuid.unwrap()));
            continue;
        }
        let e = p.track_event.as_ref().unwrap();
        let ts = p.timestamp.unwrap();
        assert!(ts >= last);
        last = ts;
        let track = e.track_uuid.unwrap();
        assert!(tracks.contains(&track));
        let depth = open.entry(track).or_default();
        match e.r#type {
            Some(1) => *depth += 1,
            Some(2) => *depth -= 1,
            _ => {}
        }
        assert!((0..=1).contains(depth), "slices nest or end before they begin");
    }
    assert!(open.values().all(|&d| d == 0));
}
