//! The command line end to end: synth → analyze, batch mode with a corrupt
//! trace among good ones, and every bad input the trace issue lists.

use std::fs;
use std::path::Path;

use crate::common::{fragscope, read_dataset, read_parquet};
use predicates::prelude::*;

fn synth(dir: &Path, pattern: &str, events: u64, seed: u64, rows_per_part: u64) {
    fragscope()
        .args(["synth", "--pattern", pattern, "--events", &events.to_string(), "--seed", &seed.to_string()])
        .args(["--rows-per-part", &rows_per_part.to_string(), "-o"])
        .arg(dir)
        .assert()
        .success();
}

/// The batch summary: a hive-partitioned dataset (source=…/date=…).
fn report(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(dir.join("report.json")).unwrap()).unwrap()
}

const COLUMNS: &[&str] = &[
    "step",
    "t_ns",
    "pid",
    "external_fragmentation",
    "kernel_unusable_index",
    "small_alloc_ratio",
    "size_cv",
    "large_gap_ratio",
    "utilization",
    "score",
    "live_bytes",
    "live_blocks",
    "gap_count",
    "largest_gap",
    "span_bytes",
];

#[test]
fn synth_then_analyze_writes_metrics_and_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("training");
    synth(&trace, "training", 30_000, 7, 10_000);
    assert!(trace.join("events-00002.parquet").is_file());
    assert!(trace.join("trace.json").is_file());
    let out = tmp.path().join("out");
    fragscope()
        .args(["analyze"])
        .arg(&trace)
        .arg("-o")
        .arg(&out)
        .assert()
        .success()
        .stdout(predicate::str::contains("training: 30000 events, 1 process"));
    let df = read_parquet(&out.join("metrics.parquet"));
    for c in COLUMNS {
        assert!(df.has(c), "metrics.parquet lacks {c}");
    }
    // 1000 auto steps, one process, no OOMs in training.
    assert_eq!(df.height(), 1000);
    let score = df.f64s("score");
    assert!(score.iter().all(|s| s.is_some_and(|s| (0.0..=100.0).contains(&s))));
    let t: Vec<u64> = df.u64s("t_ns").into_iter().map(Option::unwrap).collect();
    assert!(t.windows(2).all(|w| w[0] < w[1]), "t_ns strictly increasing");
    // Training allocates weights: something is live at the end.
    let live: Vec<u64> = df.u64s("live_bytes").into_iter().map(Option::unwrap).collect();
    assert!(live[999] > 1 << 30);

    let r = report(&out);
    assert_eq!(r["format_version"], 1);
    assert_eq!(r["trace"]["name"], "training");
    assert_eq!(r["trace"]["source"], "synthetic");
    assert_eq!(r["events"]["total"], 30_000);
    let kinds = r["events"]["by_kind"].as_object().unwrap();
    assert_eq!(kinds.values().map(|v| v.as_u64().unwrap()).sum::<u64>(), 30_000);
    assert!(kinds["alloc"].as_u64().unwrap() > 1000);
    assert_eq!(r["anomalies"]["unknown_free"], 0);
    assert_eq!(r["anomalies"]["double_free"], 0);
    let summary = &r["summary"];
    assert!(summary["peak_live_bytes"].as_u64().unwrap() >= *live.iter().max().unwrap());
    for k in ["final", "mean", "p95", "max"] {
        assert!(summary["score"][k].is_number(), "summary.score.{k}");
    }
    let md = fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.starts_with("# fragscope report: training"));
}

#[test]
fn synth_is_deterministic_per_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let read = |name: &str, seed: u64| {
        let dir = tmp.path().join(name);
        synth(&dir, "fragmenting", 5000, seed, 100_000);
        fs::read(dir.join("events-00000.parquet")).unwrap()
    };
    assert_eq!(read("a", 3), read("b", 3));
    assert_ne!(read("c", 3), read("d", 4));
}

#[test]
fn fragmenting_ends_in_oom_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("frag");
    synth(&trace, "fragmenting", 40_000, 1, 1_000_000);
    let out = tmp.path().join("out");
    fragscope().arg("analyze").arg(&trace).arg("-o").arg(&out).assert().success();
    let df = read_parquet(&out.join("metrics.parquet"));
    let ooms = df.bools("at_oom").into_iter().filter(|b| *b == Some(true)).count();
    let r = report(&out);
    assert!(ooms > 0, "the fragmenting pattern must fail allocations");
    assert_eq!(r["events"]["ooms"].as_u64().unwrap() as usize, ooms);
    assert_eq!(df.height(), 1000 + ooms);
}

#[test]
fn step_by_event_count_and_duration() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("steady");
    synth(&trace, "steady", 2_050, 1, 1_000_000);
    let out = tmp.path().join("ev");
    fragscope().arg("analyze").arg(&trace).args(["--step", "100ev", "-o"]).arg(&out).assert().success();
    assert_eq!(read_parquet(&out.join("metrics.parquet")).height(), 21);
    let out = tmp.path().join("dur");
    fragscope().arg("analyze").arg(&trace).args(["--step", "1ms", "-o"]).arg(&out).assert().success();
    let df = read_parquet(&out.join("metrics.parquet"));
    let t: Vec<u64> = df.u64s("t_ns").into_iter().map(Option::unwrap).collect();
    assert!(t.windows(2).take(t.len().saturating_sub(2)).all(|w| w[1] - w[0] == 1_000_000));
    fragscope()
        .arg("analyze")
        .arg(&trace)
        .args(["--step", "fortnightly", "-o"])
        .arg(tmp.path().join("x"))
        .assert()
        .code(2)
        .stderr(predicate::str::contains("expected a duration"));
}

#[test]
fn multi_process_traces_get_rows_per_process() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("multi");
    synth(&trace, "multi", 40_000, 2, 1_000_000);
    let out = tmp.path().join("out");
    fragscope().arg("analyze").arg(&trace).arg("-o").arg(&out).assert().success();
    let r = report(&out);
    assert_eq!(r["processes"].as_array().unwrap().len(), 4);
    let df = read_parquet(&out.join("metrics.parquet"));
    let pids = df.u32s("pid").into_iter().collect::<std::collections::BTreeSet<_>>().len();
    assert_eq!(pids, 4);
}

#[test]
fn batch_with_a_corrupt_trace_completes_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let traces = tmp.path().join("runs");
    synth(&traces.join("good-a"), "steady", 3000, 1, 1000);
    synth(&traces.join("good-b"), "leak", 3000, 2, 1000);
    let bad = traces.join("bad");
    synth(&bad, "steady", 3000, 3, 1000);
    // Corrupt a part that is not the last one: a real error, not a crash leftover.
    fs::write(bad.join("events-00001.parquet"), b"this is not parquet").unwrap();
    let out = tmp.path().join("out");
    fragscope()
        .arg("analyze")
        .arg(&traces)
        .args(["--jobs", "2", "-o"])
        .arg(&out)
        .assert()
        .code(1)
        .stdout(predicate::str::contains("2 traces analysed, 1 failed"))
        .stderr(predicate::str::contains("events-00001.parquet"));
    assert!(out.join("good-a/report.json").is_file());
    assert!(out.join("good-b/metrics.parquet").is_file());
    assert!(!out.join("bad").exists(), "no half-written output for the failed trace");
    let summary = read_dataset(&out.join("summary.parquet"));
    assert_eq!(summary.height(), 3);
    let status: Vec<String> = summary.strs("status").into_iter().flatten().collect();
    assert_eq!(status.iter().filter(|s| **s == "error").count(), 1);
    let csv = fs::read_to_string(out.join("summary.csv")).unwrap();
    assert!(csv.contains("bad,error,"));
    let md = fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("| bad | **error**"));
}

fn analyze_fails(trace: &Path, out: &Path, message: &str) {
    fails("analyze", trace, out, message);
    assert!(!out.join("report.json").exists());
}

/// `fragscope CMD INPUT -o OUT` exits 1 within a minute, saying `message`.
fn fails(cmd: &str, input: &Path, out: &Path, message: &str) {
    fragscope()
        .arg(cmd)
        .arg(input)
        .arg("-o")
        .arg(out)
        .timeout(std::time::Duration::from_secs(60))
        .assert()
        .code(1)
        .stderr(predicate::str::contains(message))
        .stderr(predicate::str::contains("panicked").not());
}

#[test]
fn bad_inputs_get_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");

    analyze_fails(&tmp.path().join("nope"), &out, "nope: no such trace");

    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    analyze_fails(&empty, &out, "neither a trace");

    let snapshot = tmp.path().join("snap.pickle");
    fs::write(&snapshot, b"\x80\x04}\x94.").unwrap();
    analyze_fails(&snapshot, &out, "snap.pickle: not a PyTorch memory snapshot: no `segments` key");

    let file = tmp.path().join("file.parquet");
    fs::write(&file, b"PAR1 garbage").unwrap();
    analyze_fails(&file, &out, "is not a trace directory");
    // A damaged file named as a snapshot: what it is not, and what a
    // snapshot starts with.
    let garbage = tmp.path().join("garbage.pickle");
    fs::write(&garbage, [0x13u8, 0x37, 0x00, 0xff].repeat(25)).unwrap();
    analyze_fails(&garbage, &out, "garbage.pickle is not a trace directory");
    analyze_fails(
        &garbage,
        &out,
        "a PyTorch memory snapshot (a pickle of protocol 2 to 5, starting with the PROTO opcode 0x80)",
    );

    // A single part that is not Parquet: skipped as an unfinished last part,
    // and then nothing is left.
    let junk = tmp.path().join("junk");
    fs::create_dir(&junk).unwrap();
    fs::write(junk.join("events-00000.parquet"), vec![7u8; 4096]).unwrap();
    analyze_fails(&junk, &out, "no readable events part");

    // A truncated part that is not the last one.
    let trunc = tmp.path().join("trunc");
    synth(&trunc, "steady", 3000, 1, 1000);
    let p = trunc.join("events-00000.parquet");
    let bytes = fs::read(&p).unwrap();
    fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    analyze_fails(&trunc, &out, "events-00000.parquet: not a valid Parquet file");

    // Zeroed bytes inside the last part's data, which zstd may decode
    // without noticing: the part's checksum catches them, and the last
    // part is not skipped as an unfinished one.
    let zeroed = tmp.path().join("zeroed");
    synth(&zeroed, "training", 3000, 1, 1000);
    let p = zeroed.join("events-00002.parquet");
    let mut bytes = fs::read(&p).unwrap();
    // Inside the first column's data: after the magic and the first page
    // header, before the end of the first column chunk.
    let md = parquet::arrow::arrow_reader::ArrowReaderMetadata::load(&fs::File::open(&p).unwrap(), Default::default())
        .unwrap();
    let (start, len) = md.metadata().row_group(0).column(0).byte_range();
    assert!(len > 200, "a first column chunk of {len} bytes");
    let at = (start + len / 2) as usize;
    bytes[at..at + 100].fill(0);
    fs::write(&p, &bytes).unwrap();
    analyze_fails(&zeroed, &out, "events-00002.parquet: damaged after it was written");

    // A corrupt trace.json.
    let meta = tmp.path().join("meta");
    synth(&meta, "steady", 1000, 1, 1000);
    fs::write(meta.join("trace.json"), b"{ not json").unwrap();
    analyze_fails(&meta, &out, "trace.json: not a valid trace.json");

    // A part lost from the middle, or from the end of a finished trace:
    // lost data, not a shorter trace.
    let gap = tmp.path().join("gap");
    synth(&gap, "steady", 5000, 1, 1000);
    fs::remove_file(gap.join("events-00002.parquet")).unwrap();
    analyze_fails(&gap, &out, "gap: events-00002.parquet is missing");
    let short = tmp.path().join("short");
    synth(&short, "steady", 5000, 1, 1000);
    fs::remove_file(short.join("events-00004.parquet")).unwrap();
    analyze_fails(&short, &out, "short: trace.json says 5 parts, the folder holds 4");
    let twice = tmp.path().join("twice");
    synth(&twice, "steady", 3000, 1, 1000);
    fs::copy(twice.join("events-00001.parquet"), twice.join("events-1.parquet")).unwrap();
    analyze_fails(&twice, &out, "are the same part number twice");
    // A last part that is a directory or a FIFO is no unfinished write,
    // and a FIFO is never opened (that would wait for a writer).
    let dir_part = tmp.path().join("dirpart");
    synth(&dir_part, "steady", 3000, 1, 1000);
    fs::remove_file(dir_part.join("events-00002.parquet")).unwrap();
    fs::create_dir(dir_part.join("events-00002.parquet")).unwrap();
    analyze_fails(&dir_part, &out, "events-00002.parquet: not a regular file");
    let fifo_part = tmp.path().join("fifopart");
    synth(&fifo_part, "steady", 3000, 1, 1000);
    fs::remove_file(fifo_part.join("events-00001.parquet")).unwrap();
    mkfifo(&fifo_part.join("events-00001.parquet"));
    analyze_fails(&fifo_part, &out, "events-00001.parquet: not a regular file");
    // A FIFO given as the input, to analyze and to import.
    let fifo = tmp.path().join("p.pickle");
    mkfifo(&fifo);
    analyze_fails(&fifo, &out, "p.pickle is not a regular file (a pipe, socket or device)");
    fails("import", &fifo, &out, "p.pickle is not a regular file");
    // A folder given to whatif, which replays one input, and to import,
    // which takes one file.
    fails("whatif", &empty, &out, "empty: a folder, not a trace: whatif replays one snapshot or trace");
    fails("import", &empty, &out, "empty is a directory: import takes one file");
    assert!(!out.exists());
}

fn mkfifo(path: &Path) {
    let st = std::process::Command::new("mkfifo").arg(path).status().unwrap();
    assert!(st.success(), "mkfifo {}", path.display());
}

/// Writes a one-part trace with a custom schema.
fn write_custom(dir: &Path, fields: Vec<(&str, arrow_array::ArrayRef)>) {
    use std::sync::Arc;
    fs::create_dir_all(dir).unwrap();
    let schema = Arc::new(arrow_schema::Schema::new(
        fields.iter().map(|(n, a)| arrow_schema::Field::new(*n, a.data_type().clone(), true)).collect::<Vec<_>>(),
    ));
    let batch = arrow_array::RecordBatch::try_new(schema.clone(), fields.into_iter().map(|f| f.1).collect()).unwrap();
    let file = fs::File::create(dir.join("events-00000.parquet")).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, schema, None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

#[test]
fn schema_is_checked_and_minimal_traces_are_accepted() {
    use arrow_array::{ArrayRef, Int32Array, Int64Array, StringArray, UInt32Array, UInt64Array};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let ts: ArrayRef = Arc::new(UInt64Array::from(vec![1, 2, 3, 4]));
    let pid: ArrayRef = Arc::new(UInt32Array::from(vec![9, 9, 9, 9]));
    let kind: ArrayRef = Arc::new(StringArray::from(vec!["alloc", "alloc", "free", "cudaMagic"]));
    let addr: ArrayRef = Arc::new(UInt64Array::from(vec![0x10000, 0x30000, 0x10000, 0]));
    let size: ArrayRef = Arc::new(UInt64Array::from(vec![0x1000, 0x1000, 0, 0]));
    let ret: ArrayRef = Arc::new(Int32Array::from(vec![0, 0, 0, 0]));

    let missing = tmp.path().join("missing");
    write_custom(
        &missing,
        vec![
            ("ts_ns", ts.clone()),
            ("pid", pid.clone()),
            ("kind", kind.clone()),
            ("size", size.clone()),
            ("ret", ret.clone()),
        ],
    );
    analyze_fails(&missing, &out, "missing required column `addr`");

    let wrong = tmp.path().join("wrong");
    let text_ts: ArrayRef = Arc::new(StringArray::from(vec!["a", "b", "c", "d"]));
    write_custom(
        &wrong,
        vec![
            ("ts_ns", text_ts),
            ("pid", pid.clone()),
            ("kind", kind.clone()),
            ("addr", addr.clone()),
            ("size", size.clone()),
            ("ret", ret.clone()),
        ],
    );
    analyze_fails(&wrong, &out, "column `ts_ns` has type Utf8, expected an integer");

    // Only the required columns, plain strings, other integer widths, an
    // unknown extra column and an unknown kind: accepted.
    let minimal = tmp.path().join("minimal");
    let extra: ArrayRef = Arc::new(Int64Array::from(vec![5, 6, 7, 8]));
    let ts64: ArrayRef = Arc::new(Int64Array::from(vec![1, 2, 3, 4]));
    write_custom(
        &minimal,
        vec![
            ("ts_ns", ts64),
            ("pid", pid),
            ("kind", kind),
            ("addr", addr),
            ("size", size),
            ("ret", ret),
            ("vendor_extra", extra),
        ],
    );
    fragscope().arg("analyze").arg(&minimal).arg("-o").arg(&out).assert().success();
    let r = report(&out);
    assert_eq!(r["trace"]["has_metadata"], false);
    assert_eq!(r["anomalies"]["unknown_kind"], 1);
    assert_eq!(r["processes"][0]["final"]["live_bytes"], 0x1000);
}

#[test]
fn trace_json_of_other_producers_needs_only_version_and_source() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    synth(&dir, "steady", 2000, 1, 1000);
    let out = tmp.path().join("out");
    fs::write(dir.join("trace.json"), r#"{"format_version": 1, "source": "ebpf", "vendor": {"x": 1}}"#).unwrap();
    fragscope().arg("analyze").arg(&dir).args(["--no-plots", "-o"]).arg(&out).assert().success();
    let r = report(&out);
    assert_eq!((r["trace"]["source"].as_str(), r["trace"]["has_metadata"].as_bool()), (Some("ebpf"), Some(true)));
    assert_eq!(r["trace"]["lost_events"], 0);
    // Without either of the two, the error names the file and the field.
    for (json, field) in [(r#"{"source": "ebpf"}"#, "format_version"), (r#"{"format_version": 1}"#, "source")] {
        fs::write(dir.join("trace.json"), json).unwrap();
        analyze_fails(&dir, &tmp.path().join("bad"), &format!("missing field `{field}`"));
        fragscope()
            .arg("analyze")
            .arg(&dir)
            .args(["--no-plots", "-o"])
            .arg(tmp.path().join("bad"))
            .assert()
            .stderr(predicate::str::contains(dir.join("trace.json").display().to_string()));
    }
}

#[test]
fn an_unfinished_last_part_is_skipped_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("killed");
    synth(&trace, "training", 5000, 1, 1000);
    fs::remove_file(trace.join("trace.json")).unwrap();
    let last = trace.join("events-00004.parquet");
    let bytes = fs::read(&last).unwrap();
    fs::write(&last, &bytes[..bytes.len() - 100]).unwrap();
    let out = tmp.path().join("out");
    fragscope()
        .arg("analyze")
        .arg(&trace)
        .arg("-o")
        .arg(&out)
        .assert()
        .success()
        .stderr(predicate::str::contains("skipping").and(predicate::str::contains("events-00004.parquet")));
    let r = report(&out);
    assert_eq!(r["events"]["total"], 4000);
    assert_eq!(r["trace"]["skipped_parts"].as_array().unwrap().len(), 1);
}

#[test]
fn brute_force_mode_gives_the_same_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("frag");
    synth(&trace, "fragmenting", 20_000, 5, 1_000_000);
    let fast = tmp.path().join("fast");
    let slow = tmp.path().join("slow");
    fragscope().arg("analyze").arg(&trace).args(["--step", "50ev", "-o"]).arg(&fast).assert().success();
    fragscope()
        .arg("analyze")
        .arg(&trace)
        .args(["--step", "50ev", "--brute-force", "-o"])
        .arg(&slow)
        .assert()
        .success();
    let a = read_parquet(&fast.join("metrics.parquet"));
    let b = read_parquet(&slow.join("metrics.parquet"));
    assert_eq!(a.height(), b.height());
    for c in ["live_bytes", "gap_count", "largest_gap", "span_bytes"] {
        assert_eq!(a.u64s(c), b.u64s(c), "{c}");
    }
    let (sa, sb) = (a.f64s("score"), b.f64s("score"));
    assert!(sa.iter().zip(&sb).all(|(x, y)| (x.unwrap() - y.unwrap()).abs() < 1e-9));
}

/// `record`'s usage and target errors come before anything needs BPF, so
/// they are checked as any user.
#[test]
fn record_says_what_to_record() {
    let tmp = tempfile::tempdir().unwrap();
    fragscope()
        .args(["record", "-o"])
        .arg(tmp.path().join("t"))
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--pid").and(predicate::str::contains("--all")));
    fragscope()
        .args(["record", "--pid", "4000000000", "-o"])
        .arg(tmp.path().join("t"))
        .assert()
        .code(1)
        .stderr(predicate::str::contains("--pid 4000000000: no such process"));
    fragscope()
        .args(["record", "--lib"])
        .arg(tmp.path().join("missing.so"))
        .args(["-o"])
        .arg(tmp.path().join("t"))
        .args(["--", "/bin/true"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("missing.so: cannot read it"));
    assert!(!tmp.path().join("t").exists());
}

/// A file its user may not read says so, rather than "none of the files
/// fragscope imports". Run as `nobody` (root reads anything), with a copy
/// of the binary in a folder `nobody` can enter; skipped, visibly, where
/// the test is not root or `setpriv` is missing.
#[test]
fn an_unreadable_file_says_it_cannot_be_read() {
    let setpriv = std::path::Path::new("/usr/bin/setpriv");
    if unsafe { libc::geteuid() } != 0 || !setpriv.exists() {
        eprintln!("skipped: an_unreadable_file_says_it_cannot_be_read needs root and setpriv");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let bin = tmp.path().join("fragscope");
    fs::copy(assert_cmd::cargo::cargo_bin("fragscope"), &bin).unwrap();
    let file = tmp.path().join("snapshot.pickle");
    fs::write(&file, b"\x80\x04}.").unwrap();
    fs::set_permissions(&file, fs::Permissions::from_mode(0o000)).unwrap();
    for cmd in ["analyze", "import"] {
        let out = std::process::Command::new(setpriv)
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .arg(cmd)
            .arg(&file)
            .arg("-o")
            .arg(tmp.path().join(format!("out-{cmd}")))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{cmd}: {err}");
        assert!(err.contains(&format!("cannot read {}: Permission denied", file.display())), "{cmd}: {err}");
    }
}

/// A ring buffer the kernel cannot have is a usage error, before anything
/// is recorded (it used to be clamped to the nearest allowed size unsaid).
#[test]
fn record_refuses_a_buffer_size_out_of_range() {
    let tmp = tempfile::tempdir().unwrap();
    for size in ["1KiB", "2GiB"] {
        fragscope()
            .args(["record", "--buffer-size", size, "-o"])
            .arg(tmp.path().join("t"))
            .args(["--", "true"])
            .assert()
            .code(2)
            .stderr(predicate::str::contains(format!("{size} is outside 64KiB to 1GiB")));
        assert!(!tmp.path().join("t").exists());
    }
}

/// A run that fails while writing (here: a folder where `timeline.png`
/// goes; on a full disk the same) leaves no report beside what it could
/// not write, and no temporary file.
#[test]
fn a_failed_write_leaves_no_report() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("t");
    synth(&trace, "steady", 3000, 1, 1000);
    let out = tmp.path().join("out");
    fs::create_dir_all(out.join("timeline.png")).unwrap();
    fragscope()
        .arg("analyze")
        .arg(&trace)
        .arg("-o")
        .arg(&out)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("cannot write").and(predicate::str::contains("timeline.png")));
    let left: Vec<String> =
        fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, vec!["timeline.png".to_string()], "only what was there before");
    // A run that fails before it writes (a --pid of no process) leaves an
    // earlier run's report as it was.
    let good = tmp.path().join("good");
    fragscope().arg("analyze").arg(&trace).arg("-o").arg(&good).assert().success();
    let report = fs::read(good.join("report.json")).unwrap();
    fragscope().arg("analyze").arg(&trace).args(["--pid", "999999", "-o"]).arg(&good).assert().code(1);
    assert_eq!(fs::read(good.join("report.json")).unwrap(), report);
    assert!(good.join("mdtp.png").is_file() && good.join("report.html").is_file());
}
