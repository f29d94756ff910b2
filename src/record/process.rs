//! The recorder's dealings with processes and the clock: signals that
//! stop a recording, the processes it follows (alive, paused, their
//! mappings kept readable for stack symbolisation), the owner of the
//! output under sudo, and the offset from the monotonic to the wall clock.

use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

/// The signal that stopped the recording, 0 while none has.
pub(super) static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, Ordering::SeqCst);
}

pub(super) fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// User + system CPU time of the recorder itself (not its children).
pub(super) fn own_cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

pub(super) fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Wall clock minus CLOCK_MONOTONIC (what bpf_ktime_get_ns reads), in ns.
pub(super) fn mono_to_wall_offset() -> i64 {
    let now = |clock| {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes the timespec it is given.
        unsafe { libc::clock_gettime(clock, &mut ts) };
        ts.tv_sec * 1_000_000_000 + ts.tv_nsec
    };
    let mono = now(libc::CLOCK_MONOTONIC);
    now(libc::CLOCK_REALTIME) - mono
}

/// The invoking user when run as root through sudo.
pub(super) fn sudo_owner() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let uid = std::env::var("SUDO_UID").ok()?.parse().ok()?;
    let gid = std::env::var("SUDO_GID").ok()?.parse().ok()?;
    Some((uid, gid))
}

/// Keeps `maps/PID` (a copy of `/proc/PID/maps`) for every process that
/// made a recorded call, refreshed at each part so libraries loaded later
/// are in it; `analyze` resolves launch addresses with it.
pub(super) struct MapsKeeper {
    pub(super) dir: PathBuf,
    pub(super) seen: BTreeSet<u32>,
    /// The copy last written, per process.
    pub(super) saved: BTreeMap<u32, String>,
    /// `CUDA_VISIBLE_DEVICES` of each process that had it set.
    pub(super) visible: BTreeMap<u32, String>,
    /// `PYTORCH_CUDA_ALLOC_CONF` of each process that had it set (else its
    /// `PYTORCH_ALLOC_CONF`): what PyTorch 2.10 and later read.
    pub(super) alloc_conf: BTreeMap<u32, String>,
    /// Every allocator variable of each process that had one set
    /// ([`ALLOC_CONF_VARS`]), by name: what the settings check reads.
    pub(super) alloc_env: BTreeMap<u32, BTreeMap<String, String>>,
    /// The PyTorch version of each process that mapped its CUDA allocator
    /// (`torch/version.py` beside the mapped `libc10_cuda.so`).
    pub(super) torch_versions: BTreeMap<u32, String>,
}

/// The variables PyTorch's allocator reads its settings from, in the
/// order PyTorch 2.10 and later look for them (the first set wins).
pub const ALLOC_CONF_VARS: [&str; 3] = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"];

/// The version `torch/version.py` names (`__version__ = '2.11.0+cu130'`),
/// for the `torch` package whose `lib/libc10_cuda.so` a process mapped.
pub fn torch_version(maps: &str) -> Option<String> {
    let lib = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.ends_with("/lib/libc10_cuda.so"))?;
    let torch = std::path::Path::new(lib).parent()?.parent()?;
    let text = std::fs::read_to_string(torch.join("version.py")).ok()?;
    text.lines().find_map(|l| {
        let v = l.strip_prefix("__version__")?.trim_start().strip_prefix('=')?.trim();
        Some(v.trim_matches(|c| c == '\'' || c == '"').to_string()).filter(|v| !v.is_empty())
    })
}

impl MapsKeeper {
    pub(super) fn new(trace: &Path) -> MapsKeeper {
        MapsKeeper {
            dir: trace.join("maps"),
            seen: BTreeSet::new(),
            saved: BTreeMap::new(),
            visible: BTreeMap::new(),
            alloc_conf: BTreeMap::new(),
            alloc_env: BTreeMap::new(),
            torch_versions: BTreeMap::new(),
        }
    }

    pub(super) fn saw(&mut self, pid: u32) {
        if self.seen.insert(pid) {
            self.save(pid);
            if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) {
                self.keep_env(pid, |name| {
                    env.split(|&b| b == 0)
                        .find_map(|kv| kv.strip_prefix(name.as_bytes())?.strip_prefix(b"="))
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                });
            }
        }
    }

    /// Keeps what process `pid`'s environment (`var`) says of which GPUs
    /// its device numbers name, and of the settings of PyTorch's allocator.
    pub(super) fn keep_env(&mut self, pid: u32, var: impl Fn(&str) -> Option<String>) {
        if let Some(v) = var("CUDA_VISIBLE_DEVICES") {
            self.visible.insert(pid, v);
        }
        if let Some(v) = var("PYTORCH_CUDA_ALLOC_CONF").or_else(|| var("PYTORCH_ALLOC_CONF")) {
            self.alloc_conf.insert(pid, v);
        }
        let set: BTreeMap<String, String> =
            ALLOC_CONF_VARS.iter().filter_map(|&name| Some((name.to_string(), var(name)?))).collect();
        if !set.is_empty() {
            self.alloc_env.insert(pid, set);
        }
    }

    pub(super) fn refresh(&mut self) {
        for pid in self.seen.clone() {
            self.save(pid);
        }
    }

    pub(super) fn save(&mut self, pid: u32) {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { return };
        // A process that has exited and is not yet reaped reads as empty:
        // the copy made while it ran stays.
        if maps.is_empty() || self.saved.get(&pid) == Some(&maps) {
            return;
        }
        if !self.torch_versions.contains_key(&pid)
            && let Some(v) = torch_version(&maps)
        {
            self.torch_versions.insert(pid, v);
        }
        if std::fs::create_dir_all(&self.dir).is_ok()
            && crate::trace::write_atomic(&self.dir.join(pid.to_string()), maps.as_bytes()).is_ok()
        {
            self.saved.insert(pid, maps);
        }
    }

    pub(super) fn saved(&self) -> Vec<u32> {
        self.saved.keys().copied().collect()
    }
}

/// The command, forked and waiting on a pipe until the probes are in.
pub(super) struct Paused {
    pub(super) pid: libc::pid_t,
    pub(super) name: String,
    pub(super) go: Option<std::os::fd::OwnedFd>,
    pub(super) exec_status: Option<std::os::fd::OwnedFd>,
    pub(super) exited: bool,
}

impl Paused {
    pub(super) fn spawn(command: &[OsString]) -> Result<Paused> {
        use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
        let argv: Vec<CString> = command
            .iter()
            .map(|a| CString::new(a.as_bytes()).context("the command has an argument with a NUL byte"))
            .collect::<Result<_>>()?;
        let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        let pipe = || -> Result<(OwnedFd, OwnedFd)> {
            let mut fds = [0; 2];
            // SAFETY: pipe2 fills the two descriptors.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                bail!("cannot create a pipe: {}", std::io::Error::last_os_error());
            }
            // SAFETY: both are fresh descriptors we own.
            Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
        };
        let (go_r, go_w) = pipe()?;
        let (st_r, st_w) = pipe()?;
        // SAFETY: the child only calls async-signal-safe functions (read,
        // execvp, write, _exit) on memory prepared before the fork.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            bail!("cannot fork: {}", std::io::Error::last_os_error());
        }
        if pid == 0 {
            let (go_r, st_w) = (go_r.into_raw_fd(), st_w.into_raw_fd());
            let (go_w, st_r) = (go_w.into_raw_fd(), st_r.into_raw_fd());
            unsafe {
                // Only the recorder may hold the write end, or a recorder
                // that gives up would leave this read waiting forever.
                libc::close(go_w);
                libc::close(st_r);
                let mut b = 0u8;
                if libc::read(go_r, (&mut b as *mut u8).cast(), 1) != 1 {
                    libc::_exit(127); // the recorder gave up
                }
                libc::execvp(ptrs[0], ptrs.as_ptr());
                let errno = *libc::__errno_location();
                libc::write(st_w, (&errno as *const i32).cast(), 4);
                libc::_exit(127);
            }
        }
        drop((go_r, st_w));
        Ok(Paused {
            pid,
            name: command[0].to_string_lossy().into_owned(),
            go: Some(go_w),
            exec_status: Some(st_r),
            exited: false,
        })
    }

    /// Lets the command run; fails when it cannot be executed.
    pub(super) fn release(&mut self) -> Result<()> {
        use std::io::{Read, Write};
        let mut go = std::fs::File::from(self.go.take().expect("released once"));
        go.write_all(&[1]).context("cannot start the command")?;
        drop(go);
        let mut status = std::fs::File::from(self.exec_status.take().expect("released once"));
        let mut errno = [0u8; 4];
        match status.read(&mut errno) {
            Ok(4) => {
                self.try_wait_blocking();
                let e = std::io::Error::from_raw_os_error(i32::from_ne_bytes(errno));
                bail!("cannot run `{}`: {e}", self.name)
            }
            _ => Ok(()),
        }
    }

    /// The command's exit code once it has ended (128 + signal when killed).
    pub(super) fn try_wait(&mut self) -> Result<Option<i32>> {
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
        if r == 0 {
            return Ok(None);
        }
        if r < 0 {
            bail!("cannot wait for pid {}: {}", self.pid, std::io::Error::last_os_error());
        }
        self.exited = true;
        Ok(Some(if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) }))
    }

    pub(super) fn try_wait_blocking(&mut self) {
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
        self.exited = true;
    }

    /// Called when recording failed before the command ran: it exits
    /// without running (its pipe closes) and is reaped.
    pub(super) fn abandon(mut self) {
        if !self.exited {
            self.go.take();
            self.try_wait_blocking();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy of a process's maps survives its exit: read once it has
    /// exited (a zombie, not yet reaped), `/proc/PID/maps` is empty, and the
    /// recorder's last refresh came after that on the H200, which left every
    /// outside allocation's library unknown.
    #[test]
    fn an_exited_process_keeps_its_maps() {
        let dir = tempfile::tempdir().unwrap();
        let mut keeper = MapsKeeper::new(dir.path());
        let mut child = std::process::Command::new("sleep").arg("0.5").spawn().unwrap();
        let pid = child.id();
        // Once `sleep` is mapped (right after the fork the child is a copy
        // of this test; during the exec, its stack alone).
        let me = std::env::current_exe().unwrap();
        let mapped = || {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok().filter(|exe| *exe != me)?;
            let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
            maps.contains(exe.to_str()?).then_some(exe)
        };
        let start = std::time::Instant::now();
        while mapped().is_none() && start.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let exe = mapped().expect("sleep runs");
        keeper.saw(pid);
        let copy = dir.path().join("maps").join(pid.to_string());
        let before = std::fs::read_to_string(&copy).unwrap();
        assert!(before.contains(exe.to_str().unwrap()), "{before}");
        // Exited, not reaped.
        let zombie = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')))
        };
        let start = std::time::Instant::now();
        while !zombie() && start.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(zombie(), "sleep did not exit");
        assert_eq!(std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap(), "");
        keeper.refresh();
        assert_eq!(std::fs::read_to_string(&copy).unwrap(), before);
        child.wait().unwrap();
    }
}
