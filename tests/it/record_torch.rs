//! `record` on PyTorch's caching allocator (issue 40): the stand-in
//! `libc10_cuda.so` (tests/cuda-standin/c10_cuda.cpp) has the mangled names
//! of PyTorch's, as local symbols, and throws on out-of-memory as PyTorch
//! does. Its workload prints every call it makes; the recording must hold
//! exactly those, in order, with their addresses, sizes and devices, and
//! the out-of-memory as an `oom` event, while the program catches its
//! exception and runs on.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Output;

use super::{bpf_ready, bpf_ready_alone, libs, meta, parts, record_cmd, standin};
use crate::common::read_parquet;

/// (kind, address, requested size, device, and for an OOM the free memory
/// CUDA reported during it) of the allocator's events.
type Block = (String, u64, Option<u64>, Option<i32>, Option<u64>);

/// 64 MiB of stand-in device memory: the workload's last phase runs out.
const CAPACITY: &str = "67108864";

/// Steps of a workload whose maps the recorder must copy while it runs
/// (what it loaded is read there).
const STEPS_TO_BE_SEEN: &str = "5000";

fn record_torch(tmp: &Path, extra: &[&str]) -> (PathBuf, Output) {
    record_torch_env(tmp, extra, &[])
}

fn record_torch_env(tmp: &Path, extra: &[&str], env: &[(&str, &str)]) -> (PathBuf, Output) {
    record_torch_run(tmp, extra, &["3"], env)
}

/// Records the stand-in workload run with `args`.
fn record_torch_run(tmp: &Path, extra: &[&str], args: &[&str], env: &[(&str, &str)]) -> (PathBuf, Output) {
    let dir = standin();
    let trace = tmp.join("trace");
    let l = libs(dir);
    let c10 = format!("--lib={}", dir.join("lib64/libc10_cuda.so").display());
    let mut c = record_cmd(&trace, &[&l[0], &l[1], &c10]);
    c.args(extra).arg("--").arg(dir.join("torch-workload")).args(args).env("STANDIN_CAPACITY", CAPACITY);
    c.envs(env.iter().copied());
    let out = c.output().unwrap();
    assert!(out.status.success(), "record failed: {}", String::from_utf8_lossy(&out.stderr));
    (trace, out)
}

/// What the workload says it did.
fn bookkeeping(out: &Output) -> Vec<Block> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
            match f[0] {
                "alloc" => {
                    ("block_alloc".into(), hex(f[1]), Some(f[2].parse().unwrap()), Some(f[3].parse().unwrap()), None)
                }
                "free" => ("block_free".into(), hex(f[1]), None, Some(0), None),
                "oom" => {
                    let free = Some(f[3].parse().unwrap());
                    ("oom".into(), 0, Some(f[1].parse().unwrap()), Some(f[2].parse().unwrap()), free)
                }
                other => panic!("unexpected line {other:?}"),
            }
        })
        .collect()
}

/// The allocator's events of the recording, in time order.
fn recorded(trace: &Path) -> Vec<Block> {
    let mut rows = Vec::new();
    for part in parts(trace) {
        let df = read_parquet(&part);
        let (ts, kind, addr) = (df.u64s("ts_ns"), df.strs("kind"), df.u64s("addr"));
        let (req, dev, free) = (df.u64s("requested_size"), df.i32s("device"), df.u64s("device_free"));
        for i in 0..df.height() {
            let k = kind[i].clone().unwrap();
            if matches!(k.as_str(), "block_alloc" | "block_free" | "oom") {
                let req = if k == "block_free" { None } else { req[i] };
                rows.push((ts[i].unwrap(), (k, addr[i].unwrap(), req, dev[i], free[i])));
            }
        }
    }
    rows.sort_by_key(|r| r.0);
    rows.into_iter().map(|r| r.1).collect()
}

#[test]
fn every_tensor_block_and_the_oom_are_recorded_and_the_program_runs_on() {
    let Some(_shared) = bpf_ready("every_tensor_block_and_the_oom_are_recorded_and_the_program_runs_on") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch(tmp.path(), &[]);
    let truth = bookkeeping(&out);
    // The workload caught its out-of-memory (a return probe on malloc would
    // have made the unwinder call std::terminate) and freed everything.
    assert_eq!(truth.iter().filter(|b| b.0 == "oom").count(), 1, "{truth:?}");
    assert!(truth.last().is_some_and(|b| b.0 == "block_free"));
    assert!(truth.len() > 50);
    assert_eq!(recorded(&trace), truth);

    // trace.json names the library and what was probed there.
    let m = meta(&trace);
    let a = &allocator_probes(&trace);
    assert!(
        a["malloc"]
            .as_str()
            .unwrap()
            .ends_with("NativeCachingAllocator::malloc(void**, signed char, unsigned long, CUstream_st*)")
    );
    // raw_delete goes through free: left out, so each free is seen once.
    assert_eq!(
        a["frees_left_out"][0],
        "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::raw_delete(void*)"
    );
    // Two call sites: allocate's (a tensor's) and raw_alloc's; allocate's
    // seen through PyTorch's static probe.
    assert_eq!(a["returns_probed_at"], 2);
    // raw_alloc's (allocate's is the static probe's).
    assert_eq!(a["returns_probed_on_a_jump"], 0, "{a}");
    assert_eq!(
        a["static_probe"],
        "pytorch:malloc in c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long, signed char)"
    );
    // Its own arguments read there, so malloc's entry is not probed: raw_alloc's
    // call is, and the out-of-memory report (which wrote the OOM above, with
    // its free memory) and the allocation without the cache.
    assert_eq!(
        a["static_probe_arguments"],
        serde_json::json!({"locations": 1, "calls_to_malloc": 1, "oom_reports": 1, "uncached_allocations": 2}),
        "{a}"
    );
    // The segments underneath are still the runtime's calls.
    let n = &m["event_counts"];
    assert!(n["alloc"].as_u64().unwrap() >= 3, "{n}");
}

/// A PyTorch before 2.2 has no static probe after malloc: the probe goes after each
/// call to malloc, and the recording is the same.
#[test]
fn without_pytorchs_static_probe_every_block_is_recorded_the_same() {
    let Some(_shared) = bpf_ready("without_pytorchs_static_probe_every_block_is_recorded_the_same") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_variant(tmp.path(), "nosdt");
    let truth = bookkeeping(&out);
    assert_eq!(truth.iter().filter(|b| b.0 == "oom").count(), 1, "{truth:?}");
    assert_eq!(recorded(&trace), truth);
    let a = allocator_probes(&trace);
    assert_eq!(a["returns_probed_at"], 2);
    // allocate's return, as in those releases: a load of what malloc wrote
    // (which the kernel would step out of line), then a jump, probed.
    // raw_alloc's returns at once: its probe stays after the call.
    assert_eq!(a["returns_probed_on_a_jump"], 1, "{a}");
    assert!(a["static_probe"].is_null(), "{a}");
    // Its allocation is written when malloc returns, stamped when it
    // began, after the segment malloc asked for inside it, and its OOM at
    // the thread's next call: each part is still in time order.
    for part in parts(&trace) {
        let ts: Vec<u64> = read_parquet(&part).u64s("ts_ns").into_iter().map(Option::unwrap).collect();
        assert!(ts.is_sorted(), "{}", part.display());
    }
    assert!(a["static_probe_arguments"].is_null(), "{a}");
}

/// Records the stand-in's `variant` (a folder of tests/cuda-standin/build.sh's
/// output, with its own `lib64`).
fn record_variant(tmp: &Path, variant: &str) -> (PathBuf, Output) {
    let dir = standin().join(variant);
    let trace = tmp.join("trace");
    let l: Vec<String> = ["libcudart.so.12", "libcuda.so.1", "libc10_cuda.so"]
        .iter()
        .map(|f| format!("--lib={}", dir.join("lib64").join(f).display()))
        .collect();
    let a: Vec<&str> = l.iter().map(String::as_str).collect();
    let out = record_cmd(&trace, &a)
        .arg("--")
        .arg(dir.join("torch-workload"))
        .arg("3")
        .env("STANDIN_CAPACITY", CAPACITY)
        .output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (trace, out)
}

/// Libraries built for Intel CET (`-fcf-protection`, the default of
/// Ubuntu's GCC) begin every function with `endbr64`, which the kernel
/// steps out of line (a second trap, about 9 µs on a VM): each entry probe
/// goes on the instruction after it, and records the same.
#[test]
fn built_for_cet_the_entry_probes_go_after_endbr64_and_record_the_same() {
    let Some(_shared) = bpf_ready("built_for_cet_the_entry_probes_go_after_endbr64_and_record_the_same") else {
        return;
    };
    if !standin().join("cet").exists() {
        eprintln!("SKIPPED built_for_cet_the_entry_probes_go_after_endbr64_and_record_the_same: not x86-64");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // With PyTorch's static probe's arguments (malloc's entry not probed),
    // and without it, as before 2.2 (malloc's entry past its endbr64, and a
    // jump after its return).
    for variant in ["cet", "cet/nosdt"] {
        let dir = tmp.path().join(variant.replace('/', "-"));
        fs::create_dir(&dir).unwrap();
        let (trace, out) = record_variant(&dir, variant);
        let truth = bookkeeping(&out);
        assert_eq!(truth.iter().filter(|b| b.0 == "oom").count(), 1, "{variant}: {truth:?}");
        assert_eq!(recorded(&trace), truth, "{variant}");
        let n = &meta(&trace)["event_counts"];
        assert!(n["alloc"].as_u64().unwrap() >= 3, "{variant}: {n}");
        let a = allocator_probes(&trace);
        assert_eq!(a["static_probe_arguments"].is_object(), variant == "cet", "{variant}: {a}");
        // Every probed entry: the runtime's and driver's functions, and the
        // allocator's frees, and its malloc unless its allocations are read
        // from PyTorch's static probe.
        for p in meta(&trace)["details"]["probes"].as_array().unwrap() {
            let unprobed = usize::from(p["pytorch_allocator"]["static_probe_arguments"].is_object());
            let entries = p["functions"].as_array().unwrap().len() - unprobed;
            assert!(entries > 1, "{p}");
            assert_eq!(p["entries_after_endbr64"].as_u64(), Some(entries as u64), "{variant}: {p}");
        }
    }
    // The same libraries built without CET: none.
    let plain = tmp.path().join("plain");
    fs::create_dir(&plain).unwrap();
    let (trace, _) = record_variant(&plain, "");
    for p in meta(&trace)["details"]["probes"].as_array().unwrap() {
        assert_eq!(p["entries_after_endbr64"], 0, "{p}");
    }
}

#[test]
fn no_torch_records_the_segments_only() {
    let Some(_shared) = bpf_ready("no_torch_records_the_segments_only") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch(tmp.path(), &["--no-torch"]);
    assert!(recorded(&trace).is_empty());
    assert!(!bookkeeping(&out).is_empty());
    let m = meta(&trace);
    assert!(m["details"]["probes"].as_array().unwrap().iter().all(|p| p.get("pytorch_allocator").is_none()));
}

/// `--lib` naming the runtime and the driver but not PyTorch's allocator,
/// which the program loads: the recording says that library's calls are
/// missing (on stderr and in trace.json), rather than looking complete.
#[test]
fn a_cuda_library_the_program_loaded_but_not_probed_is_said() {
    let Some(_shared) = bpf_ready("a_cuda_library_the_program_loaded_but_not_probed_is_said") else { return };
    let dir = standin();
    let c10 = dir.join("lib64/libc10_cuda.so");
    let run = |tmp: &Path, extra: &[&str]| {
        let trace = tmp.join("trace");
        let l = libs(dir);
        let mut c = record_cmd(&trace, &[&l[0], &l[1]]);
        // Long enough (5 000 steps, some 100 ms) for the reader to copy the
        // process's maps while it runs, also on a loaded machine: two steps
        // (a millisecond) were missed now and then.
        c.args(extra).arg("--").arg(dir.join("torch-workload")).arg(STEPS_TO_BE_SEEN).env("STANDIN_CAPACITY", CAPACITY);
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (meta(&trace)["details"]["unprobed_libraries"].clone(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let tmp = tempfile::tempdir().unwrap();
    let (unprobed, err) = run(tmp.path(), &[]);
    let listed: Vec<&str> = unprobed
        .as_object()
        .unwrap()
        .values()
        .flat_map(|v| v.as_array().unwrap())
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(listed, [c10.to_str().unwrap()], "{unprobed}");
    assert!(err.contains(&format!("loaded {}, which was not probed", c10.display())), "{err}");
    // With --no-torch the allocator is left out on purpose: nothing said.
    let tmp = tempfile::tempdir().unwrap();
    let (unprobed, err) = run(tmp.path(), &["--no-torch"]);
    assert!(unprobed.is_null() && !err.contains("not probed"), "{unprobed} {err}");
    // Every library named: nothing said.
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch(tmp.path(), &[]);
    assert!(meta(&trace)["details"]["unprobed_libraries"].is_null());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("not probed"));
}

/// Only PyTorch's allocator named: its blocks are recorded, CUDA's calls
/// beneath are not, and neither the warning nor the report pretends
/// otherwise.
#[test]
fn the_allocator_alone_says_what_is_not_recorded() {
    let Some(_shared) = bpf_ready("the_allocator_alone_says_what_is_not_recorded") else { return };
    let dir = standin();
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace");
    let c10 = format!("--lib={}", dir.join("lib64/libc10_cuda.so").display());
    let mut c = record_cmd(&trace, &[&c10]);
    c.arg("--").arg(dir.join("torch-workload")).arg(STEPS_TO_BE_SEEN).env("STANDIN_CAPACITY", CAPACITY);
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("libcudart.so.12, which was not probed"), "{err}");
    let (json, md) = analyze_json(&trace, &tmp.path().join("report"));
    assert_eq!(json["join"]["runtime_calls"], 0, "{}", json["join"]);
    assert!(md.contains("or CUDA's runtime was not probed (`--lib` without `libcudart`)"), "{md}");
    assert!(md.contains("so the memory outside PyTorch's allocator is unknown"), "{md}");
    assert!(!md.contains("Every device allocation of the process was PyTorch's"), "{md}");
}

#[test]
fn a_stripped_allocator_library_is_said_and_its_segments_still_recorded() {
    let Some(_shared) = bpf_ready("a_stripped_allocator_library_is_said_and_its_segments_still_recorded") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = standin();
    // A copy without .symtab: PyTorch's names are gone.
    let lib = tmp.path().join("lib64");
    fs::create_dir(&lib).unwrap();
    for f in ["libcudart.so.12", "libcuda.so.1", "libc10.so"] {
        fs::copy(dir.join("lib64").join(f), lib.join(f)).unwrap();
    }
    let st = std::process::Command::new("strip")
        .arg("-o")
        .arg(lib.join("libc10_cuda.so"))
        .arg(dir.join("lib64/libc10_cuda.so"))
        .status()
        .unwrap();
    assert!(st.success());
    fs::copy(dir.join("torch-workload"), tmp.path().join("torch-workload")).unwrap();
    let trace = tmp.path().join("trace");
    let args: Vec<String> = ["libcudart.so.12", "libcuda.so.1", "libc10_cuda.so"]
        .iter()
        .map(|f| format!("--lib={}", lib.join(f).display()))
        .collect();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = record_cmd(&trace, &a)
        .arg("--")
        .arg(tmp.path().join("torch-workload"))
        .arg("1")
        .env("STANDIN_CAPACITY", CAPACITY)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(recorded(&trace).is_empty());
    assert!(meta(&trace)["event_counts"]["alloc"].as_u64().unwrap() > 0);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("libc10_cuda.so: PyTorch's allocator not probed") && err.contains("stripped"), "{err}");
}

#[test]
fn a_recording_with_blocks_is_analysed_as_a_snapshot_and_its_oom_classified() {
    let Some(_shared) = bpf_ready("a_recording_with_blocks_is_analysed_as_a_snapshot_and_its_oom_classified") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch(tmp.path(), &[]);
    let truth = bookkeeping(&out);
    let (json, md) = analyze_json(&trace, &tmp.path().join("report"));
    // Every block, in the allocator view, inside the segments PyTorch got.
    let kinds = &json["events"]["by_kind"];
    let allocs = truth.iter().filter(|b| b.0 == "block_alloc").count() as u64;
    assert_eq!(kinds["block_alloc"].as_u64(), Some(allocs), "{kinds}");
    assert_eq!(kinds["block_free"].as_u64(), Some(allocs), "{kinds}");
    assert!(md.contains("## PyTorch's allocator, recorded"), "{md}");
    assert_eq!(json["join"]["probed"], true);
    assert_eq!(json["join"]["segments_matched"], json["join"]["segments_total"]);
    // The table counts the view; the note beside it says what `record`
    // recorded, as trace.json counts it.
    let counts = meta(&trace)["event_counts"].as_object().unwrap().clone();
    let recorded: Vec<String> = counts.iter().map(|(k, n)| format!("{k} {n}")).collect();
    assert!(
        md.contains(&format!(
            "These count PyTorch's allocator view of the recording, which recorded {} (trace.json `event_counts`). \
             In the view, each of PyTorch's {} segments",
            recorded.join(", "),
            json["join"]["segments_matched"]
        )),
        "{md}"
    );
    assert!(md.contains("Every device allocation of the process was PyTorch's."), "{md}");
    // No block outside its segment, no free of an unknown block. (An OOM is
    // written when the thread's next allocator call starts, so the files
    // may hold it after later rows: `out_of_order`, sorted before replay.)
    for bad in ["double_free", "overlap", "outside_segment", "unknown_free"] {
        assert!(!md.contains(&format!("| {bad} |")), "{bad}: {md}");
    }
    // The OOM, with the free memory CUDA reported to the allocator during
    // it (as PyTorch's message and a snapshot's `oom` entry have it): less
    // than the request, and the cache had nothing free: capacity.
    let ooms = json["ooms"].as_array().unwrap();
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    let reported = truth.iter().find(|b| b.0 == "oom").and_then(|b| b.4).unwrap();
    assert!(reported < 6 << 20, "{reported}");
    assert_eq!(ooms[0]["cuda_free"].as_u64(), Some(reported), "{:?}", ooms[0]);
    assert_eq!(ooms[0]["class"], "capacity", "{:?}", ooms[0]);
    assert_eq!(ooms[0]["requested"].as_u64(), Some(6 << 20));
}

/// A fragmentation OOM is one, as in a snapshot: the free memory CUDA
/// reported and the cache's free pieces are read together. (Classified
/// from the refused segment alone, as before, with nothing taken as free
/// on the device, it read "capacity", as the real `varshape` OOM on an
/// H200 did.) The figure is the one PyTorch read as it failed, not the
/// one its handler reads after emptying the cache (52 MiB), although the
/// OOM is written only later, when the thread allocates again.
#[test]
fn a_recorded_fragmentation_oom_is_classified_as_one() {
    let Some(_shared) = bpf_ready("a_recorded_fragmentation_oom_is_classified_as_one") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch_run(tmp.path(), &[], &["frag"], &[]);
    let truth = bookkeeping(&out);
    let oom = truth.iter().find(|b| b.0 == "oom").cloned().unwrap();
    assert_eq!((oom.2, oom.4), (Some(4 << 20), Some(2 << 20)), "{truth:?}");
    assert_eq!(recorded(&trace), truth);
    let (json, md) = analyze_json(&trace, &tmp.path().join("report"));
    let ooms = json["ooms"].as_array().unwrap();
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    // 2 MiB on the device and 6 tails of 0.5 MiB: 5 MiB free, 2 MiB the
    // largest piece.
    assert_eq!(ooms[0]["cuda_free"].as_u64(), Some(2 << 20), "{:?}", ooms[0]);
    assert_eq!(ooms[0]["device_free"].as_u64(), Some(5 << 20), "{:?}", ooms[0]);
    assert_eq!(ooms[0]["largest_free"].as_u64(), Some(2 << 20), "{:?}", ooms[0]);
    assert_eq!(ooms[0]["class"], "fragmentation", "{:?}", ooms[0]);
    assert!(
        md.contains("At the first OOM CUDA reported 2.00 MiB free (the figure in PyTorch's error message)"),
        "{md}"
    );
}

#[test]
fn whatif_replays_a_recording_with_blocks() {
    let Some(_shared) = bpf_ready("whatif_replays_a_recording_with_blocks") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch(tmp.path(), &[]);
    let allocs = bookkeeping(&out).iter().filter(|b| b.0 == "block_alloc").count() as u64;
    let dir = tmp.path().join("whatif");
    let o = std::process::Command::new(super::bin())
        .arg("whatif")
        .arg(&trace)
        .arg("-o")
        .arg(&dir)
        .arg("--capacity")
        .arg("64MiB")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let w: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("whatif.json")).unwrap()).unwrap();
    // The model replays every recorded request (the stand-in is not
    // PyTorch's allocator, so where it puts them is not the point here).
    let f = &w["fidelity"][0];
    assert_eq!(f["allocations"].as_u64(), Some(allocs), "{f}");
    assert_eq!(f["recorded_ooms"].as_u64(), Some(1), "{f}");
    assert!(w["scenarios"].as_array().unwrap().len() > 1);
    // `analyze`, the capacity inferred from the OOM: where the model runs
    // out of memory more often than the program did (the stand-in sizes
    // its segments its own way), no setting is recommended against OOMs
    // that never happened.
    let (r, md) = analyze_json(&trace, &tmp.path().join("a"));
    let w = &r["whatif"];
    // (2 against the workload's 1: the stand-in's segments are not sized
    // as the model sizes PyTorch's.)
    assert!(w["scenarios"][0]["ooms"].as_u64().unwrap() > 1, "{w}");
    assert!(w["recommendation"]["conf"].as_str().unwrap().starts_with("none"), "{w}");
    assert!(md.contains("the replay does not reproduce the recorded OOMs"), "{md}");
    assert!(md.contains("This recording's tensor requests replayed"), "{md}");
}

fn analyze_json(trace: &Path, out: &Path) -> (serde_json::Value, String) {
    let o = std::process::Command::new(super::bin())
        .arg("analyze")
        .arg(trace)
        .arg("-o")
        .arg(out)
        .arg("--no-plots")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    (json, fs::read_to_string(out.join("report.md")).unwrap())
}

#[test]
fn ranks_on_two_gpus_are_two_units_of_the_allocator_view() {
    let Some(_shared) = bpf_ready("ranks_on_two_gpus_are_two_units_of_the_allocator_view") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = standin();
    let trace = tmp.path().join("trace");
    let l = libs(dir);
    let c10 = format!("--lib={}", dir.join("lib64/libc10_cuda.so").display());
    let out = record_cmd(&trace, &[&l[0], &l[1], &c10])
        .arg("--")
        .arg(dir.join("torch-workload"))
        .args(["ranks", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let allocs = bookkeeping(&out).iter().filter(|b| b.0 == "block_alloc").count() as u64;
    let (json, md) = analyze_json(&trace, &tmp.path().join("out"));
    // Each rank is a unit, named by its process and GPU, with every block.
    let mut units: Vec<(u64, i64)> = json["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["process"].as_u64().unwrap(), p["device"].as_i64().unwrap()))
        .collect();
    // The ranks run at once: either may call first.
    units.sort_by_key(|u| u.1);
    assert_eq!(units.iter().map(|u| u.1).collect::<Vec<_>>(), vec![0, 1], "{units:?}");
    assert_ne!(units[0].0, units[1].0);
    assert_eq!(json["join"]["pids"].as_array().unwrap().len(), 2);
    assert_eq!(json["events"]["by_kind"]["block_alloc"].as_u64(), Some(allocs));
    assert!(md.contains(&format!("| {} on GPU 1 |", units[1].0)), "{md}");
    // Named so everywhere: no unit id (above every pid) in the report.
    assert!(!md.contains("107374"), "{md}");
    assert_eq!(json["units"].as_object().map(|u| u.len()), Some(2));
}

#[test]
fn attached_mid_run_the_blocks_of_earlier_segments_are_said() {
    use std::io::{BufRead, BufReader, Write};
    let Some(_shared) = bpf_ready("attached_mid_run_the_blocks_of_earlier_segments_are_said") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = standin();
    let trace = tmp.path().join("trace");
    let mut app = std::process::Command::new(dir.join("torch-workload"))
        .arg("wait")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its weights are allocated (and their segment) before the recorder starts.
    let mut app_out = BufReader::new(app.stdout.take().unwrap());
    let mut line = String::new();
    app_out.read_line(&mut line).unwrap();
    assert!(line.starts_with("alloc"), "{line}");
    // No --lib: libc10_cuda.so comes from the process's own mappings.
    let mut rec =
        record_cmd(&trace, &["--pid", &app.id().to_string()]).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let mut err = BufReader::new(rec.stderr.take().unwrap());
    let mut said = String::new();
    err.read_line(&mut said).unwrap();
    assert!(said.contains("recording pid") && said.contains("libc10_cuda.so"), "{said}");
    app.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert!(app.wait().unwrap().success());
    assert!(rec.wait().unwrap().success());
    let (json, md) = analyze_json(&trace, &tmp.path().join("out"));
    assert!(json["join"]["blocks_without_segment"].as_u64().unwrap() > 0, "{}", json["join"]);
    assert!(md.contains("in no recorded segment: PyTorch got their segments before the recording began"), "{md}");
}

#[test]
fn a_recording_without_trace_json_still_gets_the_allocator_view() {
    let Some(_shared) = bpf_ready("a_recording_without_trace_json_still_gets_the_allocator_view") else { return };
    // As a recorder killed before its end leaves it: parts, no trace.json.
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch(tmp.path(), &[]);
    fs::remove_file(trace.join("trace.json")).unwrap();
    let allocs = bookkeeping(&out).iter().filter(|b| b.0 == "block_alloc").count() as u64;
    let (json, md) = analyze_json(&trace, &tmp.path().join("out"));
    assert_eq!(json["events"]["by_kind"]["block_alloc"].as_u64(), Some(allocs));
    assert!(md.contains("## PyTorch's allocator, recorded"), "{md}");
}

#[test]
fn one_uprobe_per_site_as_on_kernels_before_6_6_records_the_same() {
    let Some(_shared) = bpf_ready("one_uprobe_per_site_as_on_kernels_before_6_6_records_the_same") else { return };
    // The object loads without its multi-uprobe programs, and each malloc,
    // call site and free gets a classic uprobe of its own.
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch_env(tmp.path(), &[], &[("FRAGSCOPE_RECORD_UPROBES", "single")]);
    assert_eq!(recorded(&trace), bookkeeping(&out));
    // With PyTorch's static probe (its semaphore raised) and its arguments,
    // not the fallback.
    let a = allocator_probes(&trace);
    assert!(a["static_probe"].is_string(), "{a}");
    assert!(a["static_probe_arguments"].is_object(), "{a}");
}

/// An allocation through the raw interface (which the static probe does
/// not follow) that fails: its call was probed in place of malloc's entry,
/// and the out-of-memory report writes it, with the free memory CUDA gave.
#[test]
fn a_raw_allocation_that_fails_is_an_oom_too() {
    let Some(_shared) = bpf_ready("a_raw_allocation_that_fails_is_an_oom_too") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch_run(tmp.path(), &[], &["rawoom"], &[]);
    let truth = bookkeeping(&out);
    let oom = truth.iter().find(|b| b.0 == "oom").cloned().unwrap_or_else(|| panic!("{truth:?}"));
    assert!(oom.4.is_some_and(|free| free > 0), "{oom:?}");
    assert!(truth.iter().filter(|b| b.0 == "block_alloc").count() > 2, "{truth:?}");
    assert_eq!(recorded(&trace), truth);
    assert_static_arguments(&trace);
}

/// The recording read the allocations from PyTorch's static probe's
/// arguments (not malloc's entry, the fallback).
fn assert_static_arguments(trace: &Path) {
    let a = allocator_probes(trace);
    assert!(a["static_probe_arguments"].is_object(), "{a}");
}

/// What trace.json says was probed in the stand-in's `libc10_cuda.so`.
fn allocator_probes(trace: &Path) -> serde_json::Value {
    let m = meta(trace);
    let probes = m["details"]["probes"].as_array().unwrap();
    let c10 = probes.iter().find(|p| p["library"].as_str().unwrap().ends_with("libc10_cuda.so")).unwrap();
    c10["pytorch_allocator"].clone()
}

/// PYTORCH_NO_CUDA_MEMORY_CACHING: each tensor is a cudaMalloc of its own,
/// which PyTorch's static probe follows too. The recording keeps them as
/// the segments they are (as with malloc's entry probed, which they never
/// reach), not as blocks that no free would end.
#[test]
fn without_the_cache_tensors_are_segments_not_blocks() {
    let Some(_shared) = bpf_ready("without_the_cache_tensors_are_segments_not_blocks") else { return };
    // Through `uncached_allocate(size)`, and through the `cudaMalloc(&p,
    // size)` it inlines in most wheels.
    for inline in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let mut env = vec![("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")];
        if inline {
            env.push(("STANDIN_UNCACHED_INLINE", "1"));
        }
        let (trace, out) = record_torch_run(tmp.path(), &[], &["2"], &env);
        let truth = bookkeeping(&out);
        let tensors = truth.iter().filter(|b| b.0 == "block_alloc").count() as u64;
        assert!(tensors > 10, "{truth:?}");
        let blocks: Vec<_> = recorded(&trace).into_iter().filter(|b| b.0 != "oom").collect();
        // raw_alloc's one allocation goes through the cache's malloc even so
        // in the stand-in; no tensor of `allocate` is a block.
        assert!(blocks.iter().filter(|b| b.0 == "block_alloc").count() <= 1, "inline {inline}: {blocks:?}");
        let n = &meta(&trace)["event_counts"];
        assert!(n["alloc"].as_u64().unwrap() >= tensors, "{n}");
        assert_static_arguments(&trace);
    }
}

#[test]
fn a_recording_with_blocks_exports_to_memory_viz_with_every_tensor() {
    let Some(_shared) = bpf_ready("a_recording_with_blocks_exports_to_memory_viz_with_every_tensor") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, out) = record_torch(tmp.path(), &[]);
    let truth = bookkeeping(&out);
    let pickle = tmp.path().join("snap.pickle");
    let o = std::process::Command::new(super::bin())
        .args(["export", "--format", "memory-viz", "-o"])
        .arg(&pickle)
        .arg(&trace)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // PyTorch's memory_viz reads a pickle of plain dicts: every tensor is an
    // `alloc` entry at its recorded address, and the OOM an `oom` entry.
    let script = "import pickle, sys\n\
        s = pickle.load(open(sys.argv[1], 'rb'))\n\
        t = [e for d in s['device_traces'] for e in d]\n\
        print(' '.join(hex(e['addr']) for e in t if e['action'] == 'alloc'))\n\
        print(sum(e['action'] == 'oom' for e in t))";
    let py = match std::process::Command::new("python3").arg("-c").arg(script).arg(&pickle).output() {
        Ok(p) => p,
        Err(e) => {
            assert!(std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() != Ok("1"), "python3: {e}");
            eprintln!("SKIPPED reading the export: no python3 ({e})");
            return;
        }
    };
    assert!(py.status.success(), "{}", String::from_utf8_lossy(&py.stderr));
    let text = String::from_utf8_lossy(&py.stdout).into_owned();
    let mut lines = text.lines();
    let allocs: Vec<String> = lines.next().unwrap().split_whitespace().map(str::to_string).collect();
    let expected: Vec<String> = truth.iter().filter(|b| b.0 == "block_alloc").map(|b| format!("{:#x}", b.1)).collect();
    assert_eq!(allocs, expected);
    assert_eq!(lines.next(), Some("1"));
}

#[test]
fn the_programs_allocator_settings_are_kept_and_used() {
    let Some(_shared) = bpf_ready("the_programs_allocator_settings_are_kept_and_used") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let conf = "roundup_power2_divisions:4";
    let (trace, _) = record_torch_env(tmp.path(), &[], &[("PYTORCH_CUDA_ALLOC_CONF", conf)]);
    let m = meta(&trace);
    let kept: Vec<&str> =
        m["details"]["allocator_conf"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(kept, vec![conf]);
    let (json, md) = analyze_json(&trace, &tmp.path().join("out"));
    assert!(md.contains(&format!("`PYTORCH_CUDA_ALLOC_CONF` (`{conf}`)")), "{md}");
    // whatif's "recorded settings" are the program's.
    assert_eq!(json["allocator"]["snapshot"]["allocator_settings"]["roundup_power2_divisions"][0], 4);
    // Nothing a recording could show differs: the check is silent.
    assert_eq!(json["settings_check"]["differences"].as_array().map(Vec::len), Some(0), "{}", json["settings_check"]);
    assert!(!md.contains("A setting not in force"), "{md}");
}

/// `PYTORCH_ALLOC_CONF=expandable_segments:True`, and the allocator made
/// whole cudaMalloc segments: the setting was not in force (PyTorch 2.9's
/// CUDA allocator reads only `PYTORCH_CUDA_ALLOC_CONF`). Each variable is
/// kept apart, and the what-if replays what was in force.
#[test]
fn a_setting_asked_in_a_variable_the_allocator_did_not_read_is_said() {
    let Some(_shared) = bpf_ready("a_setting_asked_in_a_variable_the_allocator_did_not_read_is_said") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let conf = "expandable_segments:True,roundup_power2_divisions:4";
    let (trace, _) = record_torch_env(tmp.path(), &[], &[("PYTORCH_ALLOC_CONF", conf)]);
    let m = meta(&trace);
    let env = m["details"]["allocator_env"].as_object().unwrap();
    assert_eq!(env.len(), 1, "{env:?}");
    assert_eq!(env.values().next().unwrap()["PYTORCH_ALLOC_CONF"], conf);
    let (json, md) = analyze_json(&trace, &tmp.path().join("out"));
    let d = &json["settings_check"]["differences"];
    assert_eq!(d.as_array().map(Vec::len), Some(1), "{}", json["settings_check"]);
    assert_eq!(d[0]["key"], "expandable_segments");
    assert!(d[0]["asked_in"].as_str().unwrap().starts_with("`PYTORCH_ALLOC_CONF` of pid "), "{}", d[0]);
    assert!(md.contains("**A setting not in force:** `PYTORCH_ALLOC_CONF` of pid"), "{md}");
    assert!(md.contains("Set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`"), "{md}");
    // The variable was not read: none of its keys was in force.
    let used = &json["allocator"]["snapshot"]["allocator_settings"];
    assert_eq!(
        (used["expandable_segments"].as_bool(), used["roundup_power2_divisions"][0].as_u64()),
        (Some(false), Some(0))
    );
}

/// A training loop seen through the probes: no Python frame and no
/// profiler annotation mark its steps, its kernel launches do. The leak
/// verdict follows each step's floor, and the kernels are named as the
/// process registered them (the view's series is named by its device, the
/// recording's maps by the process).
#[test]
fn the_probes_view_finds_steps_from_the_launches_and_tells_a_leak() {
    let Some(_shared) = bpf_ready("the_probes_view_finds_steps_from_the_launches_and_tells_a_leak") else { return };
    for (keep, verdict) in [("0", "not leaking"), ("1048576", "leaking")] {
        let tmp = tempfile::tempdir().unwrap();
        let (trace, _) = record_torch_run(tmp.path(), &[], &["launches", "10", keep], &[]);
        let (json, md) = analyze_json(&trace, &tmp.path().join("report"));
        assert_eq!(json["join"]["probed"], true);
        let it = &json["iterations"][0];
        assert_eq!(it["source"], "launches", "keep {keep}: {it}");
        assert!(it["count"].as_u64().unwrap() >= 8, "keep {keep}: {it}");
        let leak = &json["leaks"][0];
        assert_eq!(leak["verdict"], verdict, "keep {keep}: {}", leak["reason"]);
        if keep != "0" {
            assert_eq!(leak["growth_per_iteration_bytes"].as_u64(), Some(1 << 20), "{leak}");
        }
        let kernels: Vec<(&str, u64)> = json["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| (k["name"].as_str().unwrap(), k["launches"].as_u64().unwrap()))
            .collect();
        assert_eq!(kernels, [("layer(float*, int)", 40), ("norm(float*)", 40), ("adam(float*, float*)", 10)], "{md}");
        // Launches were written at entry: whether one failed is not known,
        // in this view too (its details are a snapshot's, with the join's).
        assert!(json["kernels"].as_array().unwrap().iter().all(|k| k["failed"].is_null()), "{}", json["kernels"]);
        assert!(md.contains("| kernel | launches |\n") && md.contains("whether it failed is not"), "{md}");
    }
    // Without the launches: no steps, and the report says why (not a
    // snapshot's reason).
    let tmp = tempfile::tempdir().unwrap();
    let (trace, _) = record_torch_run(tmp.path(), &["--no-launch"], &["launches", "10", "0"], &[]);
    let (json, md) = analyze_json(&trace, &tmp.path().join("report"));
    assert!(json["iterations"][0]["count"].as_u64().unwrap_or(0) == 0, "{}", json["iterations"]);
    assert!(md.contains("None found: the recording has no kernel launches (`record --no-launch`"), "{md}");
    assert_eq!(json["leaks"][0]["verdict"], "cannot tell", "{}", json["leaks"]);
}

/// A program that makes events faster than the recorder writes them (the
/// stand-in allocator, about a million a second, on this machine's two
/// cores): the recorder reads in bounded batches, so it writes its parts
/// as it goes and stops at Ctrl-C at once. (It used to read for as long as
/// events kept coming: the whole run, every event held in memory, the
/// signal unanswered until the program ended.)
#[test]
fn a_program_faster_than_the_reader_is_stopped_at_ctrl_c_at_once() {
    let Some(_alone) = bpf_ready_alone("a_program_faster_than_the_reader_is_stopped_at_ctrl_c_at_once") else { return };
    let dir = standin();
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace");
    let l = libs(dir);
    let c10 = format!("--lib={}", dir.join("lib64/libc10_cuda.so").display());
    // 400 000 steps: 7.2 million allocator calls, some seconds under record.
    let workload = dir.join("torch-workload");
    // Whatever happens here, neither the recorder nor the program outlives
    // the test (the program runs on after a stop).
    struct Reap(String);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = std::process::Command::new("pkill").args(["-KILL", "-f", &self.0]).status();
        }
    }
    let _reap = Reap(format!("{} 400000", workload.display()));
    let rec = record_cmd(&trace, &[&l[0], &l[1], &c10])
        .arg("--")
        .arg(&workload)
        .arg("400000")
        .env("STANDIN_CAPACITY", CAPACITY)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Until its first part is written: the recorder reads while the program runs.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !trace.is_dir() || parts(&trace).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "no part written in 5 s of recording: the reader does not write as it reads"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let asked = std::time::Instant::now();
    assert!(std::process::Command::new("kill").args(["-INT", &rec.id().to_string()]).status().unwrap().success());
    let out = rec.wait_with_output().unwrap();
    let took = asked.elapsed();
    // Detaching takes a grace period a link: one link a library from Linux
    // 6.6, one a function before (seconds for the stand-in's libraries).
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut version = release.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse::<u32>().ok());
    let multi = (version.next().unwrap_or(0), version.next().unwrap_or(0)) >= (6, 6);
    let bound = std::time::Duration::from_secs(if multi { 4 } else { 10 });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.contains("stopped by SIGINT"), "{stderr}");
    let m = meta(&trace);
    // The program runs on, untraced: not this test's to wait for.
    let pid = m["pids"][0].as_u64().unwrap();
    let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
    assert!(took < bound, "stopped {took:?} after SIGINT: {stderr}");
    let counted: u64 = m["event_counts"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    let rows: usize = parts(&trace).iter().map(|p| read_parquet(p).height()).sum();
    assert_eq!(rows as u64, counted, "trace.json counts every row of the parts");
    assert!(counted > 100_000, "{counted} events");
    let reader = &m["details"]["reader"];
    assert!(reader["reads"].as_u64().unwrap() >= 2, "{reader}");
}

/// A reader that falls behind (a 1 MiB buffer: a quarter of it waits within
/// milliseconds) is woken once until it has read, not by every event after
/// that: each wakeup is an interrupt the traced program raises.
#[test]
fn a_reader_behind_is_woken_once_between_two_reads() {
    let Some(_shared) = bpf_ready("a_reader_behind_is_woken_once_between_two_reads") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (trace, _) = record_torch_run(tmp.path(), &["--buffer-size", "1MiB"], &["20000"], &[]);
    let reader = meta(&trace)["details"]["reader"].clone();
    let (reads, wakeups) = (reader["reads"].as_u64().unwrap(), reader["wakeups"].as_u64().unwrap());
    assert!(wakeups >= 1, "the backlog never woke the reader: {reader}");
    assert!(wakeups <= reads + 1, "{reader}");
}

/// With `kernel.bpf_stats_enabled` on, the recording says what each of its
/// BPF programs cost a run (the kernel's own count); with it off, nothing.
/// Alone: the setting is the machine's.
#[test]
fn the_bpf_programs_cost_is_said_when_the_kernel_counts_it() {
    let Some(_alone) = bpf_ready_alone("the_bpf_programs_cost_is_said_when_the_kernel_counts_it") else { return };
    const SETTING: &str = "/proc/sys/kernel/bpf_stats_enabled";
    // Put back as it was, also when the test fails.
    struct Restore(String);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = fs::write(SETTING, &self.0);
        }
    }
    let _restore = Restore(fs::read_to_string(SETTING).unwrap());
    let run = |on: &str| {
        fs::write(SETTING, on).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let (trace, out) = record_torch_run(tmp.path(), &[], &["200"], &[]);
        (meta(&trace)["details"]["bpf_programs"].clone(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (programs, err) = run("1");
    // 200 steps: 1 800 allocations, each seen by PyTorch's static probe.
    let malloc = &programs["on_static_malloc"];
    assert!(malloc["runs"].as_u64().unwrap() >= 1800, "{programs}");
    assert!(malloc["ns_per_run"].as_f64().unwrap() > 0.0, "{programs}");
    assert!(err.contains("BPF programs (kernel.bpf_stats_enabled): ") && err.contains("on_static_malloc "), "{err}");
    let (programs, err) = run("0");
    assert!(programs.is_null() && !err.contains("BPF programs"), "{programs} {err}");
}
