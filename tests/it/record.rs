//! `fragscope record` against ground truth: real BPF, real uprobes, a
//! stand-in CUDA runtime and driver built here (tests/cuda-standin), and
//! NVIDIA's real runtime from PyPI. Every call a workload makes is logged by
//! the workload itself; the trace must hold exactly those calls (function,
//! return code, address, size, process, thread, order per thread).
//!
//! The tests need root (BPF and uprobes) and gcc. Without them they say
//! why and pass, unless FRAGSCOPE_REQUIRE_BPF=1 (CI), where they fail.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::common::read_parquet;

/// One call: (pid, tid, function, return code, address, size).
type Call = (u32, u32, String, i32, u64, u64);

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fragscope"))
}

/// Record tests share the machine, except one that loads both its cores
/// on purpose: it runs alone (the others' readers, starved, missed the
/// maps of their short-lived programs).
static MACHINE: RwLock<()> = RwLock::new(());

/// Whether the record tests can run here (then a share of the machine, held
/// for the test); otherwise prints why, and panics when
/// FRAGSCOPE_REQUIRE_BPF=1.
fn bpf_ready(test: &str) -> Option<RwLockReadGuard<'static, ()>> {
    bpf_can_run(test).then(|| MACHINE.read().unwrap_or_else(|e| e.into_inner()))
}

/// [`bpf_ready`] for a test that loads the machine: the whole of it.
fn bpf_ready_alone(test: &str) -> Option<RwLockWriteGuard<'static, ()>> {
    bpf_can_run(test).then(|| MACHINE.write().unwrap_or_else(|e| e.into_inner()))
}

fn bpf_can_run(test: &str) -> bool {
    let why = if unsafe { libc_geteuid() } != 0 {
        Some("not root (BPF and uprobes need root or CAP_BPF+CAP_PERFMON)")
    } else if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        Some("the kernel has no BTF (/sys/kernel/btf/vmlinux)")
    } else if Command::new("gcc").arg("--version").output().is_err() {
        Some("gcc is missing (it builds the stand-in CUDA libraries)")
    } else {
        None
    };
    match why {
        None => true,
        Some(why) if std::env::var("FRAGSCOPE_REQUIRE_BPF").as_deref() == Ok("1") => {
            panic!("{test}: FRAGSCOPE_REQUIRE_BPF=1 but {why}")
        }
        Some(why) => {
            eprintln!("SKIPPED {test}: {why}");
            false
        }
    }
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

/// The stand-in libraries and workloads, built once per test run.
fn standin() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin");
        let status = Command::new("bash")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda-standin/build.sh"))
            .arg(&dir)
            .status()
            .expect("bash");
        assert!(status.success(), "building the stand-in CUDA libraries failed");
        dir
    })
}

/// Run inside a private mount namespace (`unshare --mount`): unmounts
/// tracefs and debugfs there, checks they are gone, then execs the
/// recorder (same pid, so signals reach it).
const WITHOUT_TRACEFS: &str = r#"for m in /sys/kernel/debug/tracing /sys/kernel/tracing /sys/kernel/debug; do
  while umount -l "$m" 2>/dev/null; do :; done
done
if grep -qE ' (tracefs|debugfs) ' /proc/self/mounts; then echo "tracefs or debugfs still mounted" >&2; exit 99; fi
exec "$@""#;

/// `fragscope record -o OUT ARGS…`, always as on a fresh machine: in a
/// private mount namespace where neither tracefs nor debugfs is mounted,
/// whatever the host has, so a recorder that needs tracefs fails here.
fn record_cmd(out: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "--", "sh", "-c", WITHOUT_TRACEFS, "fragscope-record"]);
    c.arg(bin()).arg("record").arg("-o").arg(out).args(args);
    c
}

fn ground_truth(path: &Path) -> Vec<Call> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 6, "bad ground-truth line {l:?}");
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].to_string(),
                f[3].parse().unwrap(),
                f[4].parse().unwrap(),
                f[5].parse().unwrap(),
            )
        })
        .collect()
}

/// The trace's rows in time order, read straight from its Parquet parts.
/// The event parts of trace `dir`, in order (not a part a `kill -9` left
/// half written: `events-N.parquet.tmp`, which readers skip).
fn parts(dir: &Path) -> Vec<PathBuf> {
    let mut parts: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("events-") && name.ends_with(".parquet")
        })
        .collect();
    parts.sort();
    parts
}

fn trace_calls(dir: &Path) -> Vec<Call> {
    let mut rows = Vec::new();
    for part in parts(dir) {
        let df = read_parquet(&part);
        let (ts, pid, tid, ret) = (df.u64s("ts_ns"), df.u32s("pid"), df.u32s("tid"), df.i32s("ret"));
        let (addr, size, call, kind) = (df.u64s("addr"), df.u64s("size"), df.strs("call"), df.strs("kind"));
        for i in 0..df.height() {
            if kind[i].as_deref() == Some("exit") {
                continue; // not a call: see trace_exits
            }
            rows.push((
                ts[i].unwrap(),
                (
                    pid[i].unwrap(),
                    tid[i].unwrap(),
                    call[i].clone().unwrap(),
                    ret[i].unwrap(),
                    addr[i].unwrap(),
                    size[i].unwrap(),
                ),
            ));
        }
    }
    rows.sort_by_key(|r| r.0);
    rows.into_iter().map(|r| r.1).collect()
}

/// The processes whose `exit` the trace recorded, in time order.
fn trace_exits(dir: &Path) -> Vec<u32> {
    let mut rows = Vec::new();
    for part in parts(dir) {
        let df = read_parquet(&part);
        let (kind, call, ts, pid) = (df.strs("kind"), df.strs("call"), df.u64s("ts_ns"), df.u32s("pid"));
        for i in (0..df.height()).filter(|&i| kind[i].as_deref() == Some("exit")) {
            assert!(call[i].is_none(), "an exit is no call");
            rows.push((ts[i].unwrap(), pid[i].unwrap()));
        }
    }
    rows.sort();
    rows.into_iter().map(|r| r.1).collect()
}

/// Calls grouped by (pid, tid), each in call order.
fn per_thread(calls: &[Call]) -> BTreeMap<(u32, u32), Vec<Call>> {
    let mut m: BTreeMap<(u32, u32), Vec<Call>> = BTreeMap::new();
    for c in calls {
        m.entry((c.0, c.1)).or_default().push(c.clone());
    }
    m
}

/// Exactly the same calls, in the same order on every thread.
fn assert_exact(trace: &Path, truth: &Path) -> (Vec<Call>, Vec<Call>) {
    let got = trace_calls(trace);
    // Launches are written at their entry: what they returned is not
    // recorded (trace.json says `launches_at_entry`).
    let want: Vec<Call> = ground_truth(truth)
        .into_iter()
        .map(|(pid, tid, f, ret, addr, size)| {
            let ret = if f.starts_with("cudaLaunchKernel") { 0 } else { ret };
            (pid, tid, f, ret, addr, size)
        })
        .collect();
    assert!(!want.is_empty(), "the workload logged nothing");
    let (g, w) = (per_thread(&got), per_thread(&want));
    assert_eq!(g.keys().collect::<Vec<_>>(), w.keys().collect::<Vec<_>>(), "threads differ");
    for (k, wv) in &w {
        let gv = &g[k];
        if let Some(i) = (0..wv.len().min(gv.len())).find(|&i| gv[i] != wv[i]) {
            panic!("thread {k:?}: call {i} differs: recorded {:?}, made {:?}", gv[i], wv[i]);
        }
        assert_eq!(gv.len(), wv.len(), "thread {k:?}: {} calls recorded, {} made", gv.len(), wv.len());
    }
    let meta = meta(trace);
    assert_eq!(meta["lost_events"], 0, "lost events");
    (got, want)
}

/// Device blocks (count, bytes) a process's calls leave allocated, by the
/// ground truth's own bookkeeping: successful device allocations minus
/// frees of their addresses.
fn held_at_end(calls: &[Call]) -> (u64, u64) {
    let mut live: BTreeMap<u64, u64> = BTreeMap::new();
    for (_, _, f, ret, addr, size) in calls {
        if *ret != 0 {
            continue;
        }
        match f.as_str() {
            "cudaMalloc" | "cudaMallocAsync" | "cudaMallocManaged" | "cuMemAlloc_v2" | "cuMemAllocAsync" => {
                if *addr != 0 && *size > 0 {
                    live.insert(*addr, *size);
                }
            }
            "cudaFree" | "cudaFreeAsync" | "cuMemFree_v2" | "cuMemFreeAsync" => {
                live.remove(addr);
            }
            _ => {}
        }
    }
    (live.len() as u64, live.values().sum())
}

fn meta(trace: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(trace.join("trace.json")).expect("trace.json")).unwrap()
}

/// `--lib` options for the stand-in runtime and driver.
fn libs(dir: &Path) -> [String; 2] {
    ["libcudart.so.12", "libcuda.so.1"].map(|l| format!("--lib={}", dir.join("lib64").join(l).display()))
}

/// Runs a linked workload under `record --lib runtime --lib driver`, with
/// `extra` record options.
fn record_workload(
    tmp: &Path,
    extra: &[&str],
    mode: &[&str],
    env: &[(&str, &str)],
) -> (PathBuf, PathBuf, std::process::Output) {
    let dir = standin();
    let (trace, gt) = (tmp.join("trace"), tmp.join("gt.txt"));
    let l = libs(dir);
    let mut c = record_cmd(&trace, &[&l[0], &l[1]]);
    c.args(extra);
    c.arg("--").arg(dir.join("workload")).args(mode).env("GT_LOG", &gt);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "record failed: {}", String::from_utf8_lossy(&out.stderr));
    (trace, gt, out)
}

fn analyze_ok(trace: &Path, out: &Path) -> String {
    let o = Command::new(bin()).arg("analyze").arg(trace).arg("-o").arg(out).arg("--no-plots").output().unwrap();
    assert!(o.status.success(), "analyze failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn single_threaded_workload_is_recorded_exactly() {
    let Some(_shared) = bpf_ready("single_threaded_workload_is_recorded_exactly") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt, out) = record_workload(tmp.path(), &[], &["single"], &[]);
    let (got, _) = assert_exact(&trace, &gt);
    // The runtime's own cuMemAlloc_v2 calls are not recorded again: the
    // driver calls in the trace are only those the workload made itself.
    assert_eq!(got.iter().filter(|c| c.2 == "cuMemAlloc_v2").count(), 1);
    // cudaMallocHost calls cudaHostAlloc inside the stand-in: one event.
    assert_eq!(got.iter().filter(|c| c.2 == "cudaMallocHost").count(), 1);
    assert_eq!(got.iter().filter(|c| c.2 == "cudaHostAlloc").count(), 1);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("lost events: 0") && stderr.contains("libcudart.so.12"), "{stderr}");
    let m = meta(&trace);
    assert_eq!(m["source"], "ebpf");
    assert_eq!(m["libraries"].as_array().unwrap().len(), 2);
    assert_eq!(m["event_counts"]["alloc"], 50, "{m}");
    assert!(m["mono_to_wall_offset_ns"].as_i64().unwrap() > 0);
    // Launch configuration and memcpy fields.
    let df = read_parquet(&trace.join("events-00000.parquet"));
    let (kind, grid) = (df.strs("kind"), df.cells("grid_x"));
    // The workload's second launch fails (grid 0); both are recorded, as made.
    let launches: Vec<usize> =
        (0..df.height()).filter(|&i| kind[i].as_deref() == Some("launch") && grid[i] != "0").collect();
    assert_eq!(launches.len(), 1);
    assert_eq!(m["details"]["launches_at_entry"], true, "{m}");
    let row = |c: &str| df.cells(c)[launches[0]].clone();
    assert_eq!(
        (row("grid_x"), row("grid_y"), row("block_x"), row("shared_mem")),
        ("4".into(), "2".into(), "128".into(), "256".into())
    );
    assert_eq!(row("stream"), (0x5100).to_string());
    let summary = analyze_ok(&trace, &tmp.path().join("a"));
    assert!(summary.contains("events"), "{summary}");
    // The workload's exit is an event; what it still held is released then.
    let pid = got[0].0;
    assert_eq!(trace_exits(&trace), vec![pid]);
    assert_eq!(held_at_end(&got), (0, 0), "`single` frees what it allocates");
    // The launch's function address is named from the workload's symbols,
    // demangled.
    let maps = fs::read_to_string(trace.join("maps").join(pid.to_string())).unwrap();
    assert!(maps.contains("libcudart.so.12"), "maps/{pid} lacks the runtime");
    let report: serde_json::Value =
        serde_json::from_slice(&fs::read(tmp.path().join("a/report.json")).unwrap()).unwrap();
    assert_eq!(
        report["kernels"],
        serde_json::json!([{"name": "add_kernel(float*, float*)", "launches": 2, "failed": null}]),
        "{report}"
    );
}

#[test]
fn stacks_name_the_callers_of_allocations() {
    let Some(_shared) = bpf_ready("stacks_name_the_callers_of_allocations") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt, _) = record_workload(tmp.path(), &["--stacks", "--no-launch", "--no-memcpy"], &["single"], &[]);
    assert!(trace.join("ustacks.parquet").is_file());
    // --no-launch / --no-memcpy: those calls are left out, the rest is exact.
    let want: Vec<Call> =
        ground_truth(&gt).into_iter().filter(|c| !c.2.starts_with("cudaMemcpy") && c.2 != "cudaLaunchKernel").collect();
    assert_eq!(trace_calls(&trace), want);
    analyze_ok(&trace, &tmp.path().join("a"));
    let report: serde_json::Value =
        serde_json::from_slice(&fs::read(tmp.path().join("a/report.json")).unwrap()).unwrap();
    let stacks = report["alloc_stacks"].as_array().expect("alloc_stacks in report.json");
    let malloc = stacks.iter().find(|s| s["frames"][0] == "cudaMalloc").expect("a cudaMalloc stack");
    let bytes: u64 = want.iter().filter(|c| c.2 == "cudaMalloc" && c.3 == 0).map(|c| c.5).sum();
    assert_eq!((malloc["allocations"].as_u64(), malloc["bytes"].as_u64()), (Some(48), Some(bytes)));
    let frames = malloc["frames"].to_string();
    assert!(frames.contains("\"single\"") && frames.contains("\"main\""), "{frames}");
    // The same stacks feed call sites and flamegraphs as a snapshot's do:
    // each leaf is a function of the workload (main, single, c_malloc),
    // not the CUDA runtime.
    let folded = fs::read_to_string(tmp.path().join("a/flamegraph.folded")).expect("flamegraph.folded");
    let leaves: Vec<&str> =
        folded.lines().filter_map(|l| l.rsplit_once(' ')).filter_map(|(s, _)| s.rsplit(';').next()).collect();
    assert!(leaves.iter().all(|l| l.starts_with("workload:0:")), "{folded}");
    assert!(leaves.contains(&"workload:0:single"), "{folded}");
}

#[test]
fn processes_that_exit_holding_memory_release_it_at_exit() {
    let Some(_shared) = bpf_ready("processes_that_exit_holding_memory_release_it_at_exit") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let n = 40;
    let (trace, gt, _) = record_workload(tmp.path(), &[], &["procs", &n.to_string()], &[]);
    let (got, _) = assert_exact(&trace, &gt);
    let by_pid: BTreeMap<u32, Vec<Call>> = got.iter().fold(BTreeMap::new(), |mut m, c| {
        m.entry(c.0).or_default().push(c.clone());
        m
    });
    assert_eq!(by_pid.len(), n, "one process per iteration, the parent makes no call");
    // Every child's exit is recorded, in the order they ran.
    let mut order: Vec<(u32, usize)> =
        by_pid.keys().map(|&p| (p, got.iter().position(|c| c.0 == p).unwrap())).collect();
    order.sort_by_key(|x| x.1);
    assert_eq!(trace_exits(&trace), order.iter().map(|x| x.0).collect::<Vec<_>>());
    // analyze releases what each held at its exit; nothing is live or
    // leaking at the end; the MDTP draws 8 panels and says so.
    let out = tmp.path().join("a");
    let o = Command::new(bin()).arg("analyze").arg(&trace).arg("-o").arg(&out).output().unwrap();
    assert!(o.status.success(), "analyze failed: {}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    let released = report["released_at_exit"].as_array().expect("released_at_exit");
    assert_eq!(released.len(), n);
    for r in released {
        let pid = r["pid"].as_u64().unwrap() as u32;
        let held = held_at_end(&by_pid[&pid]);
        assert_eq!((r["blocks"].as_u64(), r["bytes"].as_u64()), (Some(held.0), Some(held.1)), "pid {pid}");
        assert_eq!(held.0, 2);
    }
    let leaks = report["leaks"].as_array().unwrap();
    // `leaking` is null where a process lived too few steps to compare.
    let bad: Vec<_> = leaks.iter().filter(|l| l["leaking"] == true || l["live_at_end_bytes"] != 0).collect();
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(report["processes"].as_array().unwrap().len(), n, "every process stays in report.json");
    assert_eq!(report["plots"]["panels_not_drawn"], n - 8);
    let md = fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains(&format!("+{} processes not drawn", n - 8)), "{md}");
    assert!(md.contains(&format!("Released at exit: {n} processes")), "{md}");
    assert!(out.join("mdtp.png").is_file());
}

#[test]
fn classic_tracepoints_mount_tracefs_when_it_is_missing() {
    let Some(_shared) = bpf_ready("classic_tracepoints_mount_tracefs_when_it_is_missing") else { return };
    // The fallback for kernels that refuse tp_btf, forced: in the test's
    // namespace tracefs is not mounted, so the recorder mounts it (there
    // only), and records exactly, children and exits included.
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt, out) = record_workload(tmp.path(), &[], &["fork"], &[("FRAGSCOPE_RECORD_HOOKS", "tracepoint")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("mounted it at /sys/kernel/tracing"), "{stderr}");
    let (got, _) = assert_exact(&trace, &gt);
    let pids: std::collections::BTreeSet<u32> = got.iter().map(|c| c.0).collect();
    assert_eq!(pids.len(), 3);
    assert_eq!(trace_exits(&trace).len(), 3);
}

#[test]
fn eight_threads_hammering_lose_nothing() {
    let Some(_shared) = bpf_ready("eight_threads_hammering_lose_nothing") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt, _) = record_workload(tmp.path(), &[], &["threads", "8", "4000"], &[]);
    let (got, _) = assert_exact(&trace, &gt);
    assert_eq!(per_thread(&got).len(), 8);
    assert!(got.len() >= 8 * 4000, "{} calls", got.len());
}

#[test]
fn forked_children_and_grandchildren_are_followed() {
    let Some(_shared) = bpf_ready("forked_children_and_grandchildren_are_followed") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt, _) = record_workload(tmp.path(), &[], &["fork"], &[]);
    let (got, _) = assert_exact(&trace, &gt);
    let pids: std::collections::BTreeSet<u32> = got.iter().map(|c| c.0).collect();
    assert_eq!(pids.len(), 3, "parent, child and grandchild: {pids:?}");
    assert_eq!(meta(&trace)["pids"].as_array().unwrap().len(), 3);
    // Each of the three ended while recorded: one exit each, after its calls.
    let exits = trace_exits(&trace);
    assert_eq!(exits.iter().copied().collect::<std::collections::BTreeSet<u32>>(), pids, "{exits:?}");
    assert_eq!(exits.len(), 3, "one exit per process, none per thread: {exits:?}");
}

#[test]
fn a_library_dlopened_after_start_is_found_and_recorded() {
    let Some(_shared) = bpf_ready("a_library_dlopened_after_start_is_found_and_recorded") else { return };
    let dir = standin();
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt) = (tmp.path().join("trace"), tmp.path().join("gt.txt"));
    // No --lib: the recorder finds the runtime under $CUDA_HOME/lib64 and
    // probes it before the workload, which is not linked against it, loads
    // it 1.5 s after start.
    let out = record_cmd(&trace, &[])
        .arg("--")
        .arg(dir.join("workload-dlopen"))
        .args(["dlopen", "1500"])
        .arg(dir.join("lib64/libcudart.so.12"))
        .env("GT_LOG", &gt)
        .env("CUDA_HOME", dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("$CUDA_HOME"), "{stderr}");
    let (got, _) = assert_exact(&trace, &gt);
    assert_eq!(got.len(), 20);
    let libs = meta(&trace)["libraries"].to_string();
    assert!(libs.contains("libcudart.so.12") && libs.contains("libcuda.so.1"), "{libs}");
}

#[test]
fn a_runtime_linked_into_the_executable_is_probed_with_lib() {
    let Some(_shared) = bpf_ready("a_runtime_linked_into_the_executable_is_probed_with_lib") else { return };
    let dir = standin();
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt) = (tmp.path().join("trace"), tmp.path().join("gt.txt"));
    let exe = dir.join("workload-static");
    let out = record_cmd(&trace, &[&format!("--lib={}", exe.display())])
        .arg("--")
        .arg(&exe)
        .arg("single")
        .env("GT_LOG", &gt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (got, _) = assert_exact(&trace, &gt);
    // cudaMalloc calls cuMemAlloc_v2 inside the same executable: still once.
    assert_eq!(got.iter().filter(|c| c.2 == "cuMemAlloc_v2").count(), 1);
}

#[test]
fn failed_allocations_are_events_with_their_return_code() {
    let Some(_shared) = bpf_ready("failed_allocations_are_events_with_their_return_code") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt, _) = record_workload(tmp.path(), &[], &["oom"], &[("STANDIN_CAPACITY", "1073741824")]);
    let (got, _) = assert_exact(&trace, &gt);
    let failed = got.iter().filter(|c| c.2 == "cudaMalloc" && c.3 == 2).count();
    assert_eq!(failed, 13, "16 requests of 300 MiB in 1 GiB: 3 fit");
    assert!(got.iter().filter(|c| c.3 == 2).all(|c| c.4 == 0), "a failed allocation has no address");
    let out = tmp.path().join("a");
    analyze_ok(&trace, &out);
    let report = fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("13 OOMs"), "{}", &report[..report.len().min(800)]);
}

#[test]
fn attach_to_a_running_process_with_pid() {
    let Some(_shared) = bpf_ready("attach_to_a_running_process_with_pid") else { return };
    let dir = standin();
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt) = (tmp.path().join("trace"), tmp.path().join("gt.txt"));
    let mut app =
        Command::new(dir.join("workload")).arg("wait").env("GT_LOG", &gt).stdin(Stdio::piped()).spawn().unwrap();
    // No --lib: the libraries come from the process's own mappings.
    let mut rec = record_cmd(&trace, &["--pid", &app.id().to_string()]).stderr(Stdio::piped()).spawn().unwrap();
    let mut err = BufReader::new(rec.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("recording pid"), "{line}");
    app.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert!(app.wait().unwrap().success());
    let status = rec.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert!(status.success(), "{rest}");
    assert!(rest.contains("exited"), "{rest}");
    assert_exact(&trace, &gt);
}

/// Starts `workload long SECONDS` under the recorder with 200 ms parts;
/// returns once the recorder says it is recording.
fn start_long(tmp: &Path, seconds: &str) -> (std::process::Child, PathBuf, PathBuf) {
    let dir = standin();
    let (trace, gt) = (tmp.join("trace"), tmp.join("gt.txt"));
    let l = libs(dir);
    let mut rec = record_cmd(&trace, &[&l[0], &l[1], "--part-interval", "200ms"])
        .arg("--")
        .arg(dir.join("workload"))
        .args(["long", seconds])
        .env("GT_LOG", &gt)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(rec.stderr.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert!(line.contains("recording pid"), "{line}");
    (rec, trace, gt)
}

fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]).status().unwrap().success());
}

/// Every recorded call is one the workload made, in the same order per
/// thread (a prefix when the recording stopped early).
fn assert_prefix(trace: &Path, gt: &Path) -> usize {
    let got = per_thread(&trace_calls(trace));
    let want = per_thread(&ground_truth(gt));
    let mut n = 0;
    for (k, gv) in &got {
        let wv = &want[k];
        let first_diff = gv.iter().zip(wv).position(|(g, w)| g != w);
        assert!(
            gv.len() <= wv.len() && first_diff.is_none(),
            "thread {k:?}: recorded calls are not a prefix of those made: {} recorded, {} made, first difference at {first_diff:?}: {:?} vs {:?}",
            gv.len(),
            wv.len(),
            first_diff.map(|i| &gv[i]),
            first_diff.map(|i| &wv[i])
        );
        n += gv.len();
    }
    n
}

#[test]
fn kill_9_of_the_recorder_leaves_analysable_parts() {
    let Some(_shared) = bpf_ready("kill_9_of_the_recorder_leaves_analysable_parts") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (mut rec, trace, gt) = start_long(tmp.path(), "3");
    std::thread::sleep(Duration::from_millis(1500));
    signal(rec.id(), "KILL");
    rec.wait().unwrap();
    // Let the workload finish and write its ground truth.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gt.exists() || fs::read_to_string(&gt).unwrap().lines().count() < 100 {
        assert!(Instant::now() < deadline, "the workload did not finish");
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(2000));
    assert!(!trace.join("trace.json").exists(), "trace.json is only written at a clean end");
    let n = assert_prefix(&trace, &gt);
    assert!(n > 100, "only {n} calls in the parts written before the kill");
    let summary = analyze_ok(&trace, &tmp.path().join("a"));
    assert!(summary.contains("events"), "{summary}");
}

#[test]
fn ctrl_c_finishes_a_complete_trace_with_status_0() {
    let Some(_shared) = bpf_ready("ctrl_c_finishes_a_complete_trace_with_status_0") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (rec, trace, gt) = start_long(tmp.path(), "2");
    std::thread::sleep(Duration::from_millis(800));
    signal(rec.id(), "INT");
    let out = rec.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("stopped by SIGINT"), "{stderr}");
    let m = meta(&trace);
    let counted: u64 = m["event_counts"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    std::thread::sleep(Duration::from_millis(2500)); // the workload goes on untraced, then logs
    let n = assert_prefix(&trace, &gt);
    assert_eq!(n as u64, counted, "trace.json counts every row of the parts");
    assert!(n > 50, "{n}");
    // The process ran long enough for its memory map to be kept.
    let pid = m["pids"][0].as_u64().unwrap();
    let maps = fs::read_to_string(trace.join("maps").join(pid.to_string())).unwrap();
    assert!(maps.contains("libcudart.so.12"), "maps/{pid} lacks the runtime");
}

#[test]
fn nvidia_runtime_from_pypi_calls_are_recorded_with_their_error_codes() {
    let Some(_shared) = bpf_ready("nvidia_runtime_from_pypi_calls_are_recorded_with_their_error_codes") else { return };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/pyenv/bin/python3");
    let has_wheel = python.exists()
        && Command::new(&python).args(["-c", "import nvidia.cuda_runtime"]).output().is_ok_and(|o| o.status.success());
    if !has_wheel {
        let why = "target/pyenv lacks nvidia-cuda-runtime-cu12 (scripts/install-deps installs it)";
        assert!(std::env::var("FRAGSCOPE_REQUIRE_BPF").as_deref() != Ok("1"), "{why}");
        eprintln!("SKIPPED nvidia runtime test: {why}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (trace, gt) = (tmp.path().join("trace"), tmp.path().join("gt.txt"));
    // No --lib: found in the site-packages of the Python being run, and
    // probed before the program loads it.
    let out = record_cmd(&trace, &[])
        .arg("--")
        .arg(&python)
        .arg(root.join("tests/cuda-standin/real_cudart.py"))
        .arg(&gt)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("nvidia/cuda_runtime/lib/libcudart.so.12"), "{stderr}");
    let (got, _) = assert_exact(&trace, &gt);
    assert_eq!(got.len(), 7);
    // Without a GPU driver the real runtime fails every call; with one,
    // they succeed. Either way the recorded codes are the real ones.
    assert!(got.iter().all(|c| c.3 == got[0].3), "{got:?}");
}

#[test]
fn output_belongs_to_the_sudo_user() {
    let Some(_shared) = bpf_ready("output_belongs_to_the_sudo_user") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, _, _) = record_workload(tmp.path(), &[], &["single"], &[("SUDO_UID", "65534"), ("SUDO_GID", "65534")]);
    use std::os::unix::fs::MetadataExt;
    for e in fs::read_dir(&trace).unwrap().map(|e| e.unwrap().path()).chain([trace.clone()]) {
        let md = fs::metadata(&e).unwrap();
        if e.file_name().unwrap() != "maps" {
            assert_eq!((md.uid(), md.gid()), (65534, 65534), "{}", e.display());
        }
    }
}

#[test]
fn clear_errors_without_privileges_or_libraries() {
    let Some(_shared) = bpf_ready("clear_errors_without_privileges_or_libraries") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = standin();
    // A file that defines none of the CUDA functions.
    let out = record_cmd(&tmp.path().join("t1"), &["--lib", "/bin/true", "--", "/bin/true"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("none of the probed CUDA functions") && stderr.contains("/bin/true"), "{stderr}");
    assert!(!tmp.path().join("t1").exists(), "no half trace left behind");
    // A program that calls none of the probed libraries (its runtime is
    // elsewhere, or it uses none): an empty recording that says why it may be.
    let l = libs(dir);
    let out = record_cmd(&tmp.path().join("t0"), &[&l[0], &l[1], "--", "/bin/true"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("recorded 0 events") && stderr.contains("name the executable with --lib"), "{stderr}");
    // Not root: says what is needed.
    let open = tmp.path().join("open");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(bin())
        .args(["record", "-o"])
        .arg(open.join("t2"))
        .args([&l[0], &l[1], "--", "/bin/true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("needs root") && stderr.contains("sudo"), "{stderr}");
}

#[test]
fn the_driver_gives_the_capacity_and_who_uses_each_gpu() {
    let Some(_shared) = bpf_ready("the_driver_gives_the_capacity_and_who_uses_each_gpu") else { return };
    let dir = standin();
    let tmp = tempfile::tempdir().unwrap();
    let l = libs(dir);
    let run = |name: &str, driver: Option<&str>| -> PathBuf {
        let trace = tmp.path().join(name);
        let mut c = record_cmd(&trace, &[&l[0], &l[1], "--part-interval", "200ms"]);
        c.arg("--").arg(dir.join("workload")).args(["long", "1"]).env("GT_LOG", tmp.path().join(format!("{name}.gt")));
        if let Some(spec) = driver {
            // The stand-in NVML, found as the real one is: by its soname.
            c.env("STANDIN_NVML", spec).env("LD_LIBRARY_PATH", dir.join("nvml"));
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        trace
    };
    let meta = |trace: &Path| -> serde_json::Value {
        serde_json::from_slice(&fs::read(trace.join("trace.json")).unwrap()).unwrap()
    };

    // Two 80 GiB devices, 1 GiB of the first used by another tenant.
    let with = run("with-driver", Some("85899345920:1073741824,85899345920:0"));
    let m = meta(&with);
    assert_eq!(m["capacity_bytes"].as_u64(), Some(85_899_345_920));
    let gpus = m["details"]["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(
        (gpus[0]["total_bytes"].as_u64(), gpus[0]["used_bytes"].as_u64()),
        (Some(85_899_345_920), Some(1 << 30))
    );
    assert!(m["details"].get("nvml").is_none());
    // A sample at each part: while the workload runs, the driver lists it
    // on device 0 with the memory it uses.
    let pid = m["pids"][0].as_u64().unwrap();
    let samples: Vec<serde_json::Value> = fs::read_to_string(with.join("gpus.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(samples.len() >= 2, "{samples:?}");
    assert!(
        samples.iter().any(|s| s["gpus"][0]["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"].as_u64() == Some(pid) && p["used_bytes"].as_u64() == Some(1 << 20))),
        "the workload (pid {pid}) is never listed: {samples:?}"
    );
    // analyze takes the recorded capacity.
    let out = tmp.path().join("with-out");
    let status = Command::new(bin()).args(["analyze", "--no-plots", "-o"]).arg(&out).arg(&with).status().unwrap();
    assert!(status.success());
    let r: serde_json::Value = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(r["oom_risk"][0]["capacity_source"].as_str(), Some("recorded"));
    assert_eq!(r["oom_risk"][0]["capacity_bytes"].as_u64(), Some(85_899_345_920));

    // Devices of different sizes: no one capacity is true.
    let m = meta(&run("mixed", Some("85899345920:0,42949672960:0")));
    assert_eq!((m["capacity_bytes"].as_u64(), m["details"]["gpus"].as_array().map(Vec::len)), (None, Some(2)));

    // No driver loaded (the stand-in then answers as NVML does on such a
    // machine; CI has no NVML at all, the same to the recorder): capacity
    // unknown, and why.
    let without = run("no-driver", Some(""));
    let m = meta(&without);
    assert!(m["capacity_bytes"].is_null());
    assert!(m["details"]["nvml"].as_str().unwrap().starts_with("NVML (libnvidia-ml.so.1) is not available"), "{m}");
    assert!(!without.join("gpus.jsonl").exists());
}

#[test]
fn kernels_are_named_as_the_program_registered_them_on_cuda_12_and_13() {
    let Some(_shared) = bpf_ready("kernels_are_named_as_the_program_registered_them_on_cuda_12_and_13") else { return };
    let dir = standin();
    let tmp = tempfile::tempdir().unwrap();
    // The workload registers two kernels (host function, mangled name),
    // launches one through its host function (CUDA 12 and older) and one
    // through the heap handle cudaGetKernel made (CUDA 13); with the
    // runtime in a library, and linked into the executable.
    let linked = libs(dir);
    let exe_static = format!("--lib={}", dir.join("workload-static").display());
    for (name, exe, lib_args) in [
        ("linked", "workload", vec![linked[0].as_str(), linked[1].as_str()]),
        ("static", "workload-static", vec![exe_static.as_str()]),
    ] {
        let trace = tmp.path().join(name);
        let out = record_cmd(&trace, &lib_args)
            .arg("--")
            .arg(dir.join(exe))
            .arg("kernels")
            .env("GT_LOG", tmp.path().join(format!("{name}.gt")))
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        // What the workload launched through: "host 0x… handle 0x…".
        let said = String::from_utf8_lossy(&out.stdout).to_string();
        let hex = |key: &str| {
            let w = said.split_whitespace().skip_while(|w| *w != key).nth(1).unwrap();
            u64::from_str_radix(w.trim_start_matches("0x"), 16).unwrap()
        };
        let k: serde_json::Value = serde_json::from_slice(&fs::read(trace.join("kernels.json")).unwrap()).unwrap();
        let names: Vec<&str> = k["functions"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["_Z6vecAddPfS_S_i", "_ZN5fused7softmaxILi4EEEvPKfPfi"], "{name}");
        assert!(
            k["functions"].as_array().unwrap().iter().any(|f| f["host"].as_u64() == Some(hex("host"))),
            "{name}: {k}"
        );
        assert_eq!(k["handles"][0]["handle"].as_u64(), Some(hex("handle")), "{name}: {k}");
        let report = tmp.path().join(format!("{name}-out"));
        let status =
            Command::new(bin()).args(["analyze", "--no-plots", "-o"]).arg(&report).arg(&trace).status().unwrap();
        assert!(status.success());
        let r: serde_json::Value = serde_json::from_slice(&fs::read(report.join("report.json")).unwrap()).unwrap();
        let kernels: Vec<(String, u64)> = r["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| (k["name"].as_str().unwrap().to_string(), k["launches"].as_u64().unwrap()))
            .collect();
        assert_eq!(
            kernels,
            [
                ("void fused::softmax<4>(float const*, float*, int)".to_string(), 5),
                ("vecAdd(float*, float*, float*, int)".to_string(), 3)
            ],
            "{name}"
        );
    }
}

#[test]
fn each_call_keeps_the_address_it_returns_to() {
    let Some(_shared) = bpf_ready("each_call_keeps_the_address_it_returns_to") else { return };
    // The workload calls the runtime from its own code: every recorded
    // call's return address lies in the workload executable's code, as the
    // copied maps of the process say (what names the library that asked).
    let tmp = tempfile::tempdir().unwrap();
    let (trace, _, _) = record_workload(tmp.path(), &[], &["single"], &[]);
    let mut checked = 0;
    for part in parts(&trace) {
        let df = read_parquet(&part);
        let (pid, caller, kind) = (df.u32s("pid"), df.u64s("caller"), df.strs("kind"));
        for i in 0..df.height() {
            if kind[i].as_deref() == Some("exit") {
                continue;
            }
            let addr = caller[i].expect("every call has its return address");
            let maps = fs::read_to_string(trace.join("maps").join(pid[i].unwrap().to_string())).unwrap();
            let file = maps.lines().find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let (lo, hi) = f[0].split_once('-')?;
                let (lo, hi) = (u64::from_str_radix(lo, 16).ok()?, u64::from_str_radix(hi, 16).ok()?);
                ((lo..hi).contains(&addr) && f[1].contains('x')).then(|| f.get(5).copied().unwrap_or("").to_string())
            });
            assert!(file.as_deref().is_some_and(|f| f.ends_with("/workload")), "call {i}: {addr:#x} in {file:?}");
            checked += 1;
        }
    }
    assert!(checked > 5, "{checked} calls checked");
}

#[test]
fn every_call_carries_the_device_its_thread_works_on() {
    let Some(_shared) = bpf_ready("every_call_carries_the_device_its_thread_works_on") else { return };
    // The main thread allocates on the default device (0), a second thread
    // after cudaSetDevice(2), a third after making device 3's primary
    // context current through the driver.
    let tmp = tempfile::tempdir().unwrap();
    let (trace, _, _) = record_workload(tmp.path(), &[], &["devices"], &[]);
    let mut by_size: BTreeMap<u64, Vec<Option<i32>>> = BTreeMap::new();
    for part in parts(&trace) {
        let df = read_parquet(&part);
        let (kind, size, device) = (df.strs("kind"), df.u64s("size"), df.i32s("device"));
        for i in 0..df.height() {
            if kind[i].as_deref() == Some("alloc") {
                by_size.entry(size[i].unwrap()).or_default().push(device[i]);
            }
        }
    }
    assert_eq!(
        by_size,
        BTreeMap::from([(1 << 20, vec![Some(0)]), (2 << 20, vec![Some(2)]), (3 << 20, vec![Some(3)])]),
        "allocations by size, with their devices"
    );
    // trace.json and the report say which devices the process used, and
    // each device is replayed on its own: 1, 2 and 3 MiB, not 6 MiB summed
    // over three address spaces.
    let out = tmp.path().join("out");
    analyze_ok(&trace, &out);
    let r: serde_json::Value = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    let used: Vec<Vec<i64>> = r["devices_by_process"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect())
        .collect();
    assert_eq!(used, vec![vec![0, 2, 3]]);
    let md = fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("made its calls on GPUs 0, 2, 3: each device's memory is replayed on its own"), "{md}");
    let pid = r["units"].as_object().unwrap().values().next().unwrap()["pid"].as_u64().unwrap();
    let per_device: Vec<(i64, u64)> = r["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["device"].as_i64().unwrap(), p["peak_live_bytes"].as_u64().unwrap()))
        .collect();
    assert_eq!(per_device, vec![(0, 1 << 20), (2, 2 << 20), (3, 3 << 20)]);
    assert!(r["processes"].as_array().unwrap().iter().all(|p| p["process"].as_u64() == Some(pid)));
    assert!(md.contains(&format!("| {pid} on GPU 2 | 2.00 MiB |")), "{md}");
}

#[path = "record_torch.rs"]
mod torch;

#[test]
fn processes_on_different_gpus_do_not_share_a_capacity() {
    let Some(_shared) = bpf_ready("processes_on_different_gpus_do_not_share_a_capacity") else { return };
    // Three ranks at once, rank r on GPU r holding (r + 1) MiB: 6 MiB live
    // at one instant, but never more than 3 MiB on one GPU.
    let tmp = tempfile::tempdir().unwrap();
    let (trace, _, _) = record_workload(tmp.path(), &[], &["ranks", "3"], &[]);
    let out = tmp.path().join("out");
    let o = Command::new(bin())
        .arg("analyze")
        .arg(&trace)
        .arg("-o")
        .arg(&out)
        .args(["--no-plots", "--capacity", "8MiB"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    let per_gpu: Vec<(u64, u64, usize)> = r["oom_risk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (x["device"].as_u64().unwrap(), x["peak_bytes"].as_u64().unwrap(), x["units"].as_array().unwrap().len())
        })
        .collect();
    assert_eq!(per_gpu, vec![(0, 1 << 20, 1), (1, 2 << 20, 1), (2, 3 << 20, 1)], "{}", r["oom_risk"]);
    let md = fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("(the highest of 3 devices)"), "{md}");
}

#[test]
fn each_gpu_gets_its_own_recorded_size_through_cuda_visible_devices() {
    let Some(_shared) = bpf_ready("each_gpu_gets_its_own_recorded_size_through_cuda_visible_devices") else { return };
    // Three GPUs of 4, 8 and 16 MiB; the ranks see them in the order 2, 0,
    // 1, so rank r's device r is NVML's GPU [2, 0, 1][r].
    let (dir, tmp) = (standin(), tempfile::tempdir().unwrap());
    let (trace, l) = (tmp.path().join("trace"), libs(dir));
    let mut c = record_cmd(&trace, &[&l[0], &l[1]]);
    c.arg("--").arg(dir.join("workload")).args(["ranks", "3"]).env("GT_LOG", tmp.path().join("gt"));
    c.env("STANDIN_NVML", "4194304:0,8388608:0,16777216:0")
        .env("LD_LIBRARY_PATH", dir.join("nvml"))
        .env("CUDA_VISIBLE_DEVICES", "2,0,1");
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = meta(&trace);
    assert!(m["capacity_bytes"].is_null(), "GPUs of different sizes have no one capacity: {m}");
    let visible = m["details"]["visible_devices"].as_object().unwrap();
    // The three ranks, and the parent that spawned them (it makes no call).
    assert!(visible.len() >= 3, "{visible:?}");
    assert!(visible.values().all(|v| v == "2,0,1"));
    let out = tmp.path().join("out");
    analyze_ok(&trace, &out);
    let r: serde_json::Value = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    let per_gpu: Vec<(u64, u64, u64)> = r["oom_risk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (x["device"].as_u64().unwrap(), x["peak_bytes"].as_u64().unwrap(), x["capacity_bytes"].as_u64().unwrap())
        })
        .collect();
    // GPU 0: rank 1 (2 MiB) of 4 MiB; GPU 1: rank 2 (3 MiB) of 8 MiB;
    // GPU 2: rank 0 (1 MiB) of 16 MiB.
    assert_eq!(
        per_gpu,
        vec![(0, 2 << 20, 4 << 20), (1, 3 << 20, 8 << 20), (2, 1 << 20, 16 << 20)],
        "{}",
        r["oom_risk"]
    );
}
