//! Whether loading a trace may exhaust the machine's memory: `analyze`
//! holds every event while it works (issue 60 will stream them), so a
//! recording of a long job can need more memory than the machine has. The
//! kernel would then kill the analysis without a word, after minutes of
//! work. The check warns before loading instead, from the rows the parts'
//! footers announce and the memory available to this process.

use std::path::Path;

/// What `analyze` holds per event at its peak, rounded up: 25 bytes on a
/// synthetic training trace of 100 M events, 42 at 10 M with the fixed
/// costs (the event columns, 15 bytes, each process's live bytes after
/// each event and its tokens' positions while iterations are found, the
/// blocks' lives for the pictures), measured by `scripts/bench-growth`.
pub const BYTES_PER_EVENT: u64 = 30;

/// What `analyze` holds per event of `trace`: [`BYTES_PER_EVENT`], and
/// the width of each optional column it loads besides (PyTorch's
/// `requested_size` and `stack_id`, and its `stream` in a byte;
/// `device_free` takes a bit; recorded stack ids; the device of each
/// call).
pub fn bytes_per_event(trace: &crate::trace::Trace) -> u64 {
    BYTES_PER_EVENT
        + if trace.pytorch_columns { 8 + 4 + 1 } else { 0 }
        + if trace.ustack_ids { 4 } else { 0 }
        + if trace.device_column { 4 } else { 0 }
}

/// The warning for a trace of `rows` events of `per_event` bytes each
/// where `available` bytes of memory are free for this process, or None
/// when it fits.
pub fn warning(rows: u64, per_event: u64, available: Option<u64>) -> Option<String> {
    let available = available?;
    let needs = rows.saturating_mul(per_event);
    (needs > available).then(|| {
        format!(
            "{rows} events: analyze holds them all in memory, about {} at {per_event} bytes an event, and {} is \
             available here, so it may run out of memory and be killed. A recording made with `record --no-launch \
             --no-memcpy` keeps the allocations, frees and OOMs in far fewer events (docs/recording.md, \"Long jobs\")",
            crate::units::bytes(needs),
            crate::units::bytes(available)
        )
    })
}

/// The memory this process may still take: the kernel's `MemAvailable`,
/// and below it the room left under its cgroup's `memory.max` (a
/// container's limit), whichever is less. None where neither can be read.
pub fn available() -> Option<u64> {
    let host = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| mem_available(&m));
    let cgroup =
        std::fs::read_to_string("/proc/self/cgroup").ok().and_then(|c| cgroup_room(&c, Path::new("/sys/fs/cgroup")));
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo`, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// The room under the memory limit of the cgroup `/proc/self/cgroup`
/// names, under `root`: cgroup v2's `memory.max` less `memory.current`
/// (`0::/path`), else v1's `memory.limit_in_bytes` less
/// `memory.usage_in_bytes` (`N:memory:/path`, under `memory/`). Both
/// usages count the page cache, so its inactive part, which the kernel
/// reclaims before it kills, is given back (as `docker stats` does). None
/// without a limit (v2's `max`; v1's "no limit" is near 2⁶³).
fn cgroup_room(self_cgroup: &str, root: &Path) -> Option<u64> {
    let read = |dir: &Path, name: &str| std::fs::read_to_string(dir.join(name)).ok()?.trim().parse::<u64>().ok();
    let inactive_file = |dir: &Path, key: &str| -> u64 {
        let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
        stat.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0)
    };
    let room = |dir: &Path, max: u64, used: &str, key: &str| {
        let used = read(dir, used).unwrap_or(0).saturating_sub(inactive_file(dir, key));
        max.saturating_sub(used)
    };
    let v2 = self_cgroup.lines().find_map(|l| l.strip_prefix("0::")).and_then(|path| {
        let dir = root.join(path.trim_start_matches('/'));
        let max = read(&dir, "memory.max")?;
        Some(room(&dir, max, "memory.current", "inactive_file"))
    });
    let v1 = || {
        let path = self_cgroup.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            controllers.split(',').any(|c| c == "memory").then_some(path)
        })?;
        let dir = root.join("memory").join(path.trim_start_matches('/'));
        let max = read(&dir, "memory.limit_in_bytes").filter(|&m| m < 1 << 62)?;
        Some(room(&dir, max, "memory.usage_in_bytes", "total_inactive_file"))
    };
    v2.or_else(v1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_warns_only_when_its_events_need_more_than_is_available() {
        assert_eq!(warning(1_000_000_000, 50, None), None, "nothing known, nothing said");
        assert_eq!(warning(100, 50, Some(1 << 30)), None);
        let w = warning(1_000_000_000, 50, Some(20 << 30)).expect("50 GB against 20 GiB");
        assert!(w.starts_with("1000000000 events: analyze holds them all in memory, about 46.57 GiB"), "{w}");
        assert!(w.contains("20.00 GiB is available here") && w.contains("--no-launch"), "{w}");
    }

    #[test]
    fn each_optional_column_a_trace_loads_adds_its_width() {
        let mut t = crate::trace::Trace::default();
        assert_eq!(bytes_per_event(&t), BYTES_PER_EVENT);
        (t.pytorch_columns, t.device_column) = (true, true);
        assert_eq!(bytes_per_event(&t), BYTES_PER_EVENT + 13 + 4);
    }

    #[test]
    fn available_memory_is_read_from_meminfo_and_the_cgroup_limit() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("job/a");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "8589934592\n").unwrap();
        std::fs::write(dir.join("memory.current"), "1073741824\n").unwrap();
        assert_eq!(cgroup_room("0::/job/a\n", root.path()), Some(7 << 30));
        std::fs::write(dir.join("memory.stat"), "anon 1\ninactive_file 536870912\nactive_file 2\n").unwrap();
        assert_eq!(cgroup_room("0::/job/a\n", root.path()), Some((7 << 30) + (512 << 20)), "inactive cache is room");
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_room("0::/job/a\n", root.path()), None, "no limit");
        let v1 = root.path().join("memory/job/b");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "4294967296\n").unwrap();
        std::fs::write(v1.join("memory.usage_in_bytes"), "1073741824\n").unwrap();
        assert_eq!(cgroup_room("4:memory:/job/b\n0::/\n", root.path()), Some(3 << 30), "cgroup v1");
        std::fs::write(v1.join("memory.stat"), "inactive_file 5\ntotal_inactive_file 1073741824\n").unwrap();
        assert_eq!(cgroup_room("4:memory:/job/b\n", root.path()), Some(4 << 30), "v1's hierarchy total");
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(cgroup_room("4:memory:/job/b\n", root.path()), None, "v1 without a limit");
    }
}
