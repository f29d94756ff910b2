//! PyTorch-profiler traces (`profile_memory=True`): import and analyze on
//! real files (fixtures/profiler), cross-checked against Python's own
//! reading of the JSON, and the errors of files that are not usable.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::fragscope;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/profiler").join(name)
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// Python's reading of a trace: CUDA memory events sorted by time, blocks
/// freed before being allocated put at the start, and the peak of the
/// live bytes of the trace's own blocks. Printed as JSON.
const PYTHON_PEAK: &str = r#"
import gzip, json, sys
p = sys.argv[1]
d = json.load(gzip.open(p) if p.endswith('.gz') else open(p))
m = [e for e in d['traceEvents'] if e.get('name') == '[memory]' and e['args'].get('Device Type') == 1]
m.sort(key=lambda e: e['ts'])
live, before = {}, 0
for e in m:
    a, b = e['args']['Addr'], e['args']['Bytes']
    if b > 0: live[a] = b
    elif b < 0 and live.pop(a, None) is None: before += -b
cur = peak = before
for e in m:
    cur += e['args']['Bytes']; peak = max(peak, cur)
steps = [e for e in d['traceEvents'] if str(e.get('name', '')).startswith('ProfilerStep#') and e.get('ph') == 'X' and e.get('cat') != 'gpu_user_annotation']
reserved = [e['args']['Total Reserved'] for e in m if 'Total Reserved' in e['args']]
print(json.dumps({'cuda': len(m), 'peak': peak, 'steps': len(steps),
                  'reserved_values': sorted(set(reserved)), 'reserved_last': reserved[-1] if reserved else None}))
"#;

fn python_view(path: &Path) -> Option<Value> {
    match std::process::Command::new("python3").arg("-c").arg(PYTHON_PEAK).arg(path).output() {
        Ok(o) if o.status.success() => Some(serde_json::from_slice(&o.stdout).unwrap()),
        other => {
            assert!(std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() != Ok("1"), "python3: {other:?}");
            eprintln!("skipped the Python cross-check: {other:?}");
            None
        }
    }
}

#[test]
fn real_profiler_traces_import_and_analyze_with_their_steps() {
    let tmp = tempfile::tempdir().unwrap();
    for (file, cuda, cpu, steps) in
        [("h100_torch2.11_mlp.pt.trace.json.gz", 174, 6, 3), ("hta_df_index_resolver.json.gz", 26770, 1240, 5)]
    {
        let input = fixture(file);
        let dir = tmp.path().join(file);
        let out = fragscope().arg("import").arg(&input).arg("-o").arg(&dir).assert().success();
        let said = String::from_utf8_lossy(&out.get_output().stdout).into_owned();
        assert!(said.contains(&format!("{cuda} CUDA memory events")), "{said}");
        let meta = json(&dir.join("trace.json"));
        assert_eq!(meta["source"], "pytorch-profiler");
        let d = &meta["details"];
        assert_eq!(d["cuda_memory_events"], cuda, "{file}");
        assert_eq!(d["cpu_events_skipped"], cpu, "{file}");
        assert_eq!(d["profiler_steps"], steps, "{file}");
        assert_eq!(d["total_allocated_breaks"], 0, "{file}");
        // analyze reads the file directly, as it reads a snapshot.
        let a = tmp.path().join(format!("{file}-a"));
        fragscope().arg("analyze").arg(&input).arg("-o").arg(&a).args(["--no-plots"]).assert().success();
        let r = json(&a.join("report.json"));
        assert_eq!(r["anomalies"]["unknown_free"], 0, "{file}");
        assert_eq!(r["anomalies"]["overlap"], 0, "{file}");
        let its = r["iterations"].as_array().unwrap();
        assert_eq!(its.len(), 1, "{file}");
        assert_eq!((its[0]["count"].as_u64(), its[0]["source"].as_str()), (Some(steps), Some("annotations")), "{file}");
        let md = std::fs::read_to_string(a.join("report.md")).unwrap();
        assert!(md.contains("| source | pytorch-profiler |") && md.contains("`ProfilerStep` spans"), "{file}");
        // `whatif` does not replay the allocator's blocks as requests (it
        // "recommended" the settings the run already had), and writes nothing.
        let w = tmp.path().join(format!("{file}-w"));
        let out = fragscope().arg("whatif").arg(&input).arg("-o").arg(&w).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{file}: {err}");
        assert!(err.contains(&format!("{}: a PyTorch profiler trace's memory events", input.display())), "{err}");
        assert!(!w.exists(), "{file}");
        if let Some(py) = python_view(&input) {
            assert_eq!(py["cuda"], cuda);
            assert_eq!(py["steps"], steps);
            assert_eq!(
                r["processes"][0]["peak_live_bytes"], py["peak"],
                "{file}: peak live bytes against Python's replay"
            );
            // Each row's reserved bytes are a `Total Reserved` the trace
            // reported (one device per process here), the last row's the
            // last one.
            let reserved = crate::common::read_parquet(&a.join("metrics.parquet")).u64s("reserved_bytes");
            let values: Vec<u64> =
                py["reserved_values"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            assert!(!values.is_empty(), "{file}");
            assert!(reserved.iter().flatten().all(|v| values.contains(v)), "{file}: {reserved:?} not in {values:?}");
            assert_eq!(reserved.last().copied().flatten(), py["reserved_last"].as_u64(), "{file}");
            assert!(
                reserved.iter().flatten().count() * 10 >= reserved.len() * 9,
                "{file}: rows without reserved bytes"
            );
        }
    }
}

#[test]
fn unusable_profiler_traces_say_why() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let cases = [
        (
            write(
                "no-memory.json",
                r#"{"traceEvents": [{"name": "aten::mm", "ph": "X", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}"#,
            ),
            "profile_memory=True",
        ),
        (
            write(
                "cpu-only.json",
                r#"{"traceEvents": [{"name": "[memory]", "ph": "i", "ts": 1, "pid": 1, "tid": 1, "args": {"Addr": 16, "Bytes": 64, "Device Type": 0, "Device Id": -1}}]}"#,
            ),
            "all on the CPU",
        ),
        (
            write(
                "legacy.pt.trace.json",
                r#"{"traceEvents": [{"name": "[memory]", "ph": "i", "ts": 1, "pid": 1, "tid": 1, "args": {"Bytes": 64, "Device Type": 1, "Device Id": 0}}]}"#,
            ),
            "no `Addr`",
        ),
        (write("not-a-trace.json", r#"{"schemaVersion": 1}"#), "no `traceEvents`"),
        (write("broken.json", r#"{"traceEvents": [{"name": "[memory]", "#), "not a valid Chrome trace JSON"),
    ];
    for (path, says) in &cases {
        let out = tmp.path().join("out");
        let a = fragscope().arg("import").arg(path).arg("-o").arg(&out).assert().code(1);
        let err = String::from_utf8_lossy(&a.get_output().stderr).into_owned();
        assert!(err.contains(says) && err.contains(&*path.to_string_lossy()), "{}: {err}", path.display());
        assert!(!out.exists(), "{}: no trace directory is left behind", path.display());
        fragscope().arg("analyze").arg(path).arg("-o").arg(&out).assert().code(1);
    }
    // A truncated gzip file.
    let gz = std::fs::read(fixture("h100_torch2.11_mlp.pt.trace.json.gz")).unwrap();
    let cut = tmp.path().join("cut.json.gz");
    std::fs::write(&cut, &gz[..gz.len() / 2]).unwrap();
    let a = fragscope().arg("import").arg(&cut).arg("-o").arg(tmp.path().join("o")).assert().code(1);
    let err = String::from_utf8_lossy(&a.get_output().stderr).into_owned();
    assert!(err.contains("cut.json.gz") && err.contains("truncated"), "{err}");
}
