//! Nsight Systems SQLite and `parquetdir` exports: import and analyze an export written by
//! scripts/gen-nsys.py from the published schema (no real export with the
//! memory table exists in public repositories), with the enum ids
//! shuffled so only their names can give the meaning; and the errors of
//! files that are not such exports.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::fragscope;

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// Runs the generator; None (and a note) without python3.
pub(crate) fn generate(dir: &Path, extra: &[&str]) -> Option<PathBuf> {
    let out = dir.join("report.sqlite");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gen-nsys.py");
    match std::process::Command::new("python3").arg(&script).arg(&out).args(extra).status() {
        Ok(s) if s.success() => Some(out),
        other => {
            assert!(std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() != Ok("1"), "gen-nsys.py: {other:?}");
            eprintln!("skipped: python3 could not write the export ({other:?})");
            None
        }
    }
}

/// Imports and analyzes `input` (a file or a folder) and checks both
/// against what the generator computed.
fn imports_as_expected(input: &Path, expected: &Value, tmp: &Path) {
    let dir = tmp.join("t");
    fragscope().arg("import").arg(input).arg("-o").arg(&dir).assert().success();
    let meta = json(&dir.join("trace.json"));
    assert_eq!(meta["source"], "nsight-systems");
    let d = &meta["details"];
    for key in ["rows", "device_events", "pooled", "skipped"] {
        assert_eq!(d[key], expected[key], "{key}");
    }
    let counts = &meta["event_counts"];
    let n = |k: &str| counts[k].as_u64().unwrap_or(0);
    assert_eq!(n("alloc_async"), expected["pooled"].as_u64().unwrap());
    assert_eq!(n("alloc") + n("alloc_async") + n("alloc_managed"), expected["allocs"].as_u64().unwrap());
    assert_eq!(n("free") + n("free_async"), expected["frees"].as_u64().unwrap());
    // analyze takes the export directly.
    let a = tmp.join("a");
    fragscope().arg("analyze").arg(input).arg("-o").arg(&a).arg("--no-plots").assert().success();
    let r = json(&a.join("report.json"));
    assert_eq!(r["processes"][0]["pid"], expected["pid"]);
    assert_eq!(r["processes"][0]["peak_live_bytes"], expected["peak_live_bytes"]);
    assert_eq!(r["anomalies"]["unknown_free"], 0);
    assert_eq!(r["anomalies"]["overlap"], 0);
}

#[test]
fn an_export_imports_by_the_names_of_its_enums() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(db) = generate(tmp.path(), &["--shuffle-enums", "--seed", "3"]) else { return };
    let expected = json(&tmp.path().join("report.expected.json"));
    imports_as_expected(&db, &expected, &tmp.path().join("sqlite"));
}

/// The same rows as a `parquetdir` export (one `<TABLE>.parquet` per
/// table, written by scripts/nsys-parquetdir.py with DuckDB): the same
/// trace, and a folder without an enum table says which file is missing.
#[test]
fn a_parquetdir_export_imports_like_the_sqlite_one() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(db) = generate(tmp.path(), &["--shuffle-enums", "--seed", "5"]) else { return };
    let expected = json(&tmp.path().join("report.expected.json"));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/pyenv/bin/python3");
    let pq = tmp.path().join("report_pqtdir");
    let written = std::process::Command::new(&python)
        .arg(root.join("scripts/nsys-parquetdir.py"))
        .arg(&db)
        .arg(&pq)
        .status()
        .is_ok_and(|s| s.success());
    if !written {
        let required = std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() == Ok("1");
        assert!(!required, "target/pyenv could not write the parquetdir (DuckDB; scripts/install-deps installs it)");
        eprintln!("skipped: target/pyenv lacks DuckDB to write the parquetdir");
        return;
    }
    imports_as_expected(&pq, &expected, &tmp.path().join("pq"));
    // The two imports hold the same events.
    let sqlite_trace = tmp.path().join("sqlite");
    fragscope().arg("import").arg(&db).arg("-o").arg(&sqlite_trace).assert().success();
    let read = |dir: &Path| {
        let e = fragscope::input::open(dir, None).unwrap().events;
        (e.ts_ns, e.pid, e.kind, e.addr, e.size)
    };
    assert_eq!(read(&sqlite_trace), read(&tmp.path().join("pq/t")));
    // A folder missing an enum table: an error naming the file.
    std::fs::remove_file(pq.join("ENUM_CUDA_MEM_KIND.parquet")).unwrap();
    let out = tmp.path().join("out");
    let a = fragscope().arg("import").arg(&pq).arg("-o").arg(&out).assert().code(1);
    let err = String::from_utf8_lossy(&a.get_output().stderr).into_owned();
    assert!(err.contains("ENUM_CUDA_MEM_KIND.parquet") && err.contains("report_pqtdir"), "{err}");
    assert!(!out.exists());
}

#[test]
fn sqlite_files_that_are_not_memory_exports_say_what_is_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let sql = |name: &str, script: &str| -> Option<PathBuf> {
        let p = tmp.path().join(name);
        let code =
            format!("import sqlite3,sys; db=sqlite3.connect(sys.argv[1]); db.executescript({script:?}); db.commit()");
        match std::process::Command::new("python3").arg("-c").arg(&code).arg(&p).status() {
            Ok(s) if s.success() => Some(p),
            other => {
                assert!(std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() != Ok("1"), "python3: {other:?}");
                None
            }
        }
    };
    let cases = [
        (
            sql("no-table.sqlite", "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER);"),
            "--cuda-memory-usage=true",
        ),
        (
            sql(
                "no-enum.sqlite",
                "CREATE TABLE CUDA_GPU_MEMORY_USAGE_EVENTS (start INTEGER, globalPid INTEGER, deviceId INTEGER, address INTEGER, bytes INTEGER, memKind INTEGER, memoryOperationType INTEGER, localMemoryPoolAddress INTEGER);",
            ),
            "ENUM_CUDA_MEM_KIND",
        ),
    ];
    for (path, says) in cases {
        let Some(path) = path else { return };
        let out = tmp.path().join("out");
        let a = fragscope().arg("import").arg(&path).arg("-o").arg(&out).assert().code(1);
        let err = String::from_utf8_lossy(&a.get_output().stderr).into_owned();
        assert!(err.contains(says) && err.contains(&*path.to_string_lossy()), "{err}");
        assert!(!out.exists());
    }
    // An SQLite header over garbage.
    let bad = tmp.path().join("corrupt.sqlite");
    let mut bytes = b"SQLite format 3\0".to_vec();
    bytes.extend(std::iter::repeat_n(0xA5u8, 4096));
    std::fs::write(&bad, bytes).unwrap();
    let a = fragscope().arg("import").arg(&bad).arg("-o").arg(tmp.path().join("o")).assert().code(1);
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("corrupt.sqlite"));
}
