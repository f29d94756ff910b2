use super::*;

/// The allocator's names in every PyTorch wheel from 1.13 to 2.15, as
/// `scripts/torch-allocator-symbols` read them from the package index.
const WHEELS: &str = include_str!("../../../tests/data/torch-allocator-symbols.txt");

#[test]
fn every_wheel_has_a_malloc_and_a_free_this_recorder_reads() {
    let mut versions = 0;
    for block in WHEELS.split("\n== ").filter(|b| !b.trim().is_empty() && !b.starts_with('#')) {
        let mut lines = block.lines();
        let version = lines.next().unwrap().trim_start_matches("== ").to_string();
        let roles: Vec<Match> = lines.filter_map(recognise).collect();
        assert!(roles.contains(&Match::Known(Role::Malloc)), "{version}: no malloc in {roles:?}");
        assert!(roles.iter().any(|r| matches!(r, Match::Known(Role::Free { .. }))), "{version}: no free");
        assert!(!roles.iter().any(|r| matches!(r, Match::WrongShape(_))), "{version}: {roles:?}");
        versions += 1;
    }
    assert!(versions >= 15, "{versions} versions in the list");
}

#[test]
fn names_and_shapes() {
    let m = "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc";
    assert_eq!(
        recognise(&format!("{m}(void**, signed char, unsigned long, CUstream_st*)")),
        Some(Match::Known(Role::Malloc))
    );
    assert!(matches!(recognise(&format!("{m}(void**, long, unsigned long)")), Some(Match::WrongShape(_))));
    assert_eq!(
        recognise("c10::cuda::CUDACachingAllocator::Native::local_raw_delete(void*)"),
        Some(Match::Known(Role::Free { ptr: 0 }))
    );
    assert_eq!(recognise("malloc(unsigned long)"), None);
    assert_eq!(recognise("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::free(Block*)"), None);
}

/// With `FRAGSCOPE_TORCH_LIBS` naming a folder of `libc10_cuda.so`
/// files taken from PyTorch's wheels (`scripts/torch-allocator-symbols
/// --keep DIR`), each must be planned: a malloc with call sites, and
/// frees. Not run otherwise (the wheels are not part of the tests).
#[test]
fn the_wheels_libraries_are_planned() {
    let Some(dir) = std::env::var_os("FRAGSCOPE_TORCH_LIBS") else {
        eprintln!("SKIPPED the_wheels_libraries_are_planned: FRAGSCOPE_TORCH_LIBS is not set");
        return;
    };
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let plan = plan(&path).unwrap().unwrap_or_else(|r| panic!("{}: {r:?}", path.display()));
        assert!(plan.landings.len() >= 2 && !plan.frees.is_empty(), "{}: {plan:?}", path.display());
        eprintln!(
            "{}: {} call sites, frees {:?}, left out {:?}, static probe {:?}",
            path.display(),
            plan.landings.len(),
            plan.frees.iter().map(|f| &f.0.name).collect::<Vec<_>>(),
            plan.left_out,
            plan.static_probe.as_ref().map(|p| &p.function)
        );
        eprintln!("  static probe's arguments: {:?}", plan.static_args);
        // PyTorch's static probe on malloc came with 2.1, before the
        // call there; after it (where a return is seen) since 2.2.
        let version = path.file_stem().unwrap().to_string_lossy().trim_start_matches("c10_").to_string();
        let v: Vec<u32> = version.split('.').take(2).filter_map(|x| x.parse().ok()).collect();
        if v.len() == 2 && (v[0], v[1]) == (2, 1) {
            assert_eq!(plan.static_probe, None, "{version}");
        }
        // Before 2.2 a tensor's allocation is seen after allocate's call
        // to malloc, where a jump soon follows (a register load, then
        // `jmp`): the probe goes on the jump, one trap instead of two.
        eprintln!("  returns probed on a jump: {:?}", plan.on_a_jump);
        if v.len() == 2 && (v[0], v[1]) < (2, 2) {
            assert_eq!(plan.on_a_jump.len(), 1, "{version}: {plan:?}");
        }
        if v.len() == 2 && (v[0], v[1]) >= (2, 2) {
            let p = plan.static_probe.as_ref().unwrap_or_else(|| panic!("{version}: no static probe"));
            assert!(p.function.contains("NativeCachingAllocator::allocate(unsigned long)"), "{p:?}");
            assert!(plan.landings.contains(&p.replaces) && p.semaphore > 0, "{p:?}");
            // Every wheel since 2.2 reports its out-of-memory to the
            // profiler, and has an allocation without the cache in
            // `allocate`: its allocations are read from the static
            // probe's arguments, one trap each.
            let a = plan.static_args.as_ref().unwrap_or_else(|| panic!("{version}: no static arguments"));
            assert_eq!(a.calls.len(), plan.landings.len() - 1, "{version}: {a:?}");
            assert!(!a.oom_reports.is_empty() && !a.uncached.is_empty(), "{version}: {a:?}");
        } else {
            assert_eq!(plan.static_args, None, "{version}");
        }
        n += 1;
    }
    assert!(n > 0);
}

/// The stand-in allocator (tests/cuda-standin) built here, with and
/// without PyTorch's static probe: its note is read, its semaphore
/// found in the file, and its `nop` taken for `allocate`'s call; the
/// build without it keeps the probe after each call. (No root needed:
/// nothing is attached.)
/// The stand-in (tests/cuda-standin) built into a temporary folder, or
/// None (the test said it skipped) where `<sys/sdt.h>` is missing
/// (77: scripts/install-deps --build-only leaves it out; CI, which
/// requires the recorder's tests, has it).
fn built_standin(test: &str) -> Option<tempfile::TempDir> {
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = std::process::Command::new("bash")
        .arg(root.join("tests/cuda-standin/build.sh"))
        .arg(dir.path())
        .output()
        .unwrap();
    if built.status.code() == Some(77) && std::env::var_os("FRAGSCOPE_REQUIRE_BPF").is_none() {
        eprintln!("SKIPPED {test}: {}", String::from_utf8_lossy(&built.stderr));
        return None;
    }
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    Some(dir)
}

#[test]
fn the_stand_ins_static_probe_is_planned() {
    let Some(dir) = built_standin("the_stand_ins_static_probe_is_planned") else { return };
    let with = plan(&dir.path().join("lib64/libc10_cuda.so")).unwrap().unwrap();
    let p = with.static_probe.clone().unwrap();
    assert_eq!(
        p.function,
        "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long, signed char)"
    );
    assert!(with.landings.contains(&p.replaces) && p.semaphore > 0 && p.offset != p.replaces, "{p:?}");
    // The nop is there, at that file offset; the semaphore is 0 there.
    let data = std::fs::read(dir.path().join("lib64/libc10_cuda.so")).unwrap();
    assert_eq!(data[p.offset], 0x90);
    assert_eq!(&data[p.semaphore..p.semaphore + 2], &[0, 0]);
    // Its arguments stand for malloc's entry: raw_alloc's call is
    // probed instead, with the out-of-memory report and the allocation
    // without the cache (`uncached_allocate(size)`).
    let a = with.static_args.clone().unwrap();
    assert_eq!((a.calls.len(), a.oom_reports.len(), a.locations), (1, 1, 1), "{a:?}");
    // Both forms: `uncached_allocate(size)` and `cudaMalloc(&p, size)`.
    let mut args: Vec<u8> = a.uncached.iter().map(|u| u.1).collect();
    args.sort_unstable();
    assert_eq!(args, [0, 1], "{a:?}");
    assert_eq!(data[a.oom_reports[0]], 0xe8, "a call instruction");
    assert_eq!(data[a.calls[0]], 0xe8, "a call instruction");
    let without = plan(&dir.path().join("nosdt/lib64/libc10_cuda.so")).unwrap().unwrap();
    assert_eq!(without.static_probe, None);
    assert_eq!(without.static_args, None);
    assert_eq!(without.landings.len(), with.landings.len());
}

/// A damaged library (a download cut short, a disk error) is planned or
/// refused, never a panic: the stand-in's allocator and runtime, cut at
/// many lengths and with bytes changed all through them. (Each library
/// found is read when `record` starts, `--lib` or not.)
#[test]
fn damaged_libraries_are_planned_or_refused_without_a_panic() {
    let Some(dir) = built_standin("damaged_libraries_are_planned_or_refused_without_a_panic") else { return };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for lib in ["lib64/libc10_cuda.so", "cet/lib64/libc10_cuda.so", "lib64/libcudart.so.12"] {
        let Ok(good) = std::fs::read(dir.path().join(lib)) else { continue };
        assert!(plan_bytes(&good).is_ok() && super::super::attach::defined_in(&good).is_ok(), "{lib}");
        let mut planned = 0;
        let mut check = |data: &[u8]| {
            planned += usize::from(matches!(plan_bytes(data), Ok(Ok(_))));
            let _ = super::super::attach::defined_in(data);
        };
        for cut in (0..good.len()).step_by(good.len() / 97 + 1) {
            check(&good[..cut]);
        }
        for _ in 0..200 {
            let mut data = good.clone();
            for _ in 0..4 {
                let at = (next() % data.len() as u64) as usize;
                data[at] = next() as u8;
            }
            check(&data);
        }
        eprintln!("{lib}: {planned} damaged copies still planned");
    }
}

#[test]
fn a_library_without_the_allocator_is_absent() {
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    assert_eq!(plan_bytes(&exe).unwrap(), Err(Refusal::Absent));
}
