//! Which files to probe. Uprobes attach to a file (its inode), not to a
//! process, so probing a library before a program `dlopen`s it works: that
//! is how the recorder catches PyTorch, which loads libcudart from
//! site-packages after start-up. Without `--lib` the recorder therefore
//! probes every CUDA runtime and driver library it can find in the places a
//! program would load them from, plus (for `--pid`) those the process has
//! mapped already.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, bail};

/// A file to probe and where it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Library {
    pub path: PathBuf,
    pub found: String,
}

/// A CUDA runtime or driver library, by file name: `libcudart.so*`
/// (including PyTorch's `libcudart-<hash>.so.12`) or `libcuda.so*`; or
/// PyTorch's allocator, `libc10_cuda.so` (probed when it has the symbols,
/// [`super::torch`]).
pub fn is_cuda_library(name: &OsStr) -> bool {
    let n = name.to_string_lossy();
    (n.starts_with("libcudart") || n.starts_with("libcuda.so") || super::torch::is_allocator_library(name))
        && n.contains(".so")
}

/// Libraries given with `--lib`: each must be a readable ELF file.
pub fn explicit(paths: &[PathBuf]) -> Result<Vec<Library>> {
    let mut out = Vec::new();
    for p in paths {
        let bytes = match fs::File::open(p).and_then(|mut f| {
            let mut magic = [0u8; 4];
            std::io::Read::read_exact(&mut f, &mut magic).map(|_| magic)
        }) {
            Ok(m) => m,
            Err(e) => bail!("--lib {}: cannot read it: {e}", p.display()),
        };
        if &bytes != b"\x7fELF" {
            bail!("--lib {}: not an ELF shared library or executable", p.display());
        }
        let path = fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        out.push(Library { path, found: "--lib".into() });
    }
    Ok(dedup(out))
}

/// The usual places, for a spawned command (`command`, to find its Python)
/// or `--all`, and the libraries mapped by `pid`.
pub fn discover(command: &[std::ffi::OsString], pid: Option<u32>) -> Vec<Library> {
    let mut out = Vec::new();
    if let Some(pid) = pid {
        out.extend(mapped(pid));
    }
    for (dir, why) in search_dirs(command) {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        let mut names: Vec<PathBuf> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.file_name().is_some_and(is_cuda_library))
            .collect();
        names.sort();
        out.extend(names.into_iter().map(|path| Library { path, found: why.clone() }));
    }
    out.extend(ldconfig());
    // The toolkit's `stubs/libcuda.so` is for the linker only: at run time
    // every program loads the driver's libcuda.so.1, so probing the stub
    // (2.6 s of start-up on the H100 machine) records nothing.
    out.retain(|l| !is_link_stub(&l.path));
    dedup(out)
}

/// The CUDA libraries (by [`is_cuda_library`]) that each process's copy of
/// its maps shows loaded and that are not among `considered` (the same
/// file, by device and inode): the calls a recording of them misses. By
/// pid, each path once. PyTorch's allocator counts only with `torch`
/// (`--no-torch` leaves it out on purpose).
pub fn unprobed(
    maps: &std::collections::BTreeMap<u32, String>,
    considered: &[Library],
    torch: bool,
) -> std::collections::BTreeMap<String, Vec<String>> {
    let known: HashSet<(u64, u64)> = considered.iter().filter_map(|l| file_id(&l.path)).collect();
    let mut out = std::collections::BTreeMap::new();
    for (&pid, text) in maps {
        let mut missed: Vec<String> = Vec::new();
        for (path, openable) in mapped_cuda(pid, text) {
            let allocator = path.file_name().is_some_and(super::torch::is_allocator_library);
            if (!torch && allocator) || missed.iter().any(|m| Path::new(m) == path) {
                continue;
            }
            if file_id(&openable).is_some_and(|file| !known.contains(&file)) {
                missed.push(path.display().to_string());
            }
        }
        if !missed.is_empty() {
            out.insert(pid.to_string(), missed);
        }
    }
    out
}

/// A library of a `stubs` folder (`lib64/stubs/libcuda.so`).
fn is_link_stub(path: &Path) -> bool {
    path.parent().and_then(Path::file_name).is_some_and(|d| d == "stubs")
}

/// A file's identity: its device and inode.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The CUDA libraries (by [`is_cuda_library`]) in the text of process
/// `pid`'s maps: each as named there, and where to open it (through the
/// process's root while it runs, so across mount namespaces; else as
/// named).
fn mapped_cuda(pid: u32, maps: &str) -> impl Iterator<Item = (&Path, PathBuf)> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(Path::new)
        .filter(|path| path.file_name().is_some_and(is_cuda_library))
        .map(move |path| {
            let via_proc = PathBuf::from(format!("/proc/{pid}/root{}", path.display()));
            let openable = if via_proc.exists() { via_proc } else { path.to_path_buf() };
            (path, openable)
        })
}

/// One entry per file (by device and inode, so symlinks such as
/// `libcudart.so -> libcudart.so.12` count once), keeping the first.
fn dedup(libs: Vec<Library>) -> Vec<Library> {
    let mut seen = HashSet::new();
    libs.into_iter()
        .filter_map(|mut l| {
            let md = fs::metadata(&l.path).ok()?;
            if !md.is_file() || !seen.insert((md.dev(), md.ino())) {
                return None;
            }
            if let Ok(c) = fs::canonicalize(&l.path) {
                l.path = c;
            }
            Some(l)
        })
        .collect()
}

fn mapped(pid: u32) -> Vec<Library> {
    let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) else { return Vec::new() };
    mapped_cuda(pid, &maps).map(|(_, path)| Library { path, found: format!("mapped by pid {pid}") }).collect()
}

fn search_dirs(command: &[std::ffi::OsString]) -> Vec<(PathBuf, String)> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            for sub in ["lib64", "lib"] {
                dirs.push((Path::new(&root).join(sub), format!("${var}")));
            }
        }
    }
    if let Some(ld) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&ld).map(|d| (d, "$LD_LIBRARY_PATH".to_string())));
    }
    if let Ok(rd) = fs::read_dir("/usr/local") {
        let mut cuda: Vec<PathBuf> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("cuda")))
            .collect();
        cuda.sort();
        for root in cuda {
            dirs.push((root.join("lib64"), "/usr/local/cuda*".into()));
            if let Ok(targets) = fs::read_dir(root.join("targets")) {
                dirs.extend(targets.filter_map(|e| e.ok()).map(|t| (t.path().join("lib"), "/usr/local/cuda*".into())));
            }
        }
    }
    for site in python_site_dirs(command) {
        if let Ok(rd) = fs::read_dir(site.join("nvidia")) {
            let mut pkgs: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path().join("lib")).collect();
            pkgs.sort();
            dirs.extend(pkgs.into_iter().map(|d| (d, "Python site-packages (nvidia/*/lib)".to_string())));
        }
        dirs.push((site.join("torch/lib"), "Python site-packages (torch/lib)".into()));
    }
    dirs
}

/// site-packages of `python3` on PATH and, when the command is a Python
/// interpreter (a virtual environment's, say), of that one too.
fn python_site_dirs(command: &[std::ffi::OsString]) -> Vec<PathBuf> {
    let mut pythons = vec![std::ffi::OsString::from("python3")];
    if let Some(first) = command.first()
        && Path::new(first).file_name().is_some_and(|n| n.to_string_lossy().starts_with("python"))
    {
        pythons.insert(0, first.clone());
    }
    let script =
        "import site, sys\nfor p in site.getsitepackages() + [site.getusersitepackages()] + sys.path: print(p)";
    let mut dirs = Vec::new();
    for py in pythons {
        let Ok(out) = Command::new(&py).args(["-c", script]).stderr(std::process::Stdio::null()).output() else {
            continue;
        };
        if !out.status.success() {
            continue;
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let p = PathBuf::from(line);
            if !line.is_empty() && p.is_dir() && !dirs.contains(&p) {
                dirs.push(p);
            }
        }
    }
    dirs
}

/// The dynamic linker cache (`ldconfig -p`).
fn ldconfig() -> Vec<Library> {
    let Ok(out) =
        Command::new("ldconfig").arg("-p").output().or_else(|_| Command::new("/sbin/ldconfig").arg("-p").output())
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, path) = l.trim().split_once(" => ")?;
            let name = name.split_whitespace().next()?;
            is_cuda_library(OsStr::new(name)).then(|| Library { path: PathBuf::from(path), found: "ldconfig".into() })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_library_names() {
        for yes in ["libcudart.so.12", "libcudart.so", "libcudart-9335f6a2.so.12", "libcuda.so.1", "libcuda.so.535.1"] {
            assert!(is_cuda_library(OsStr::new(yes)), "{yes}");
        }
        assert!(is_cuda_library(OsStr::new("libc10_cuda.so")));
        for no in ["libcudnn.so.9", "libcudart_static.a", "libcublas.so.12", "libcuda_stub.txt", "libc10.so"] {
            assert!(!is_cuda_library(OsStr::new(no)), "{no}");
        }
    }

    /// The tests that set the environment `discover` reads take turns.
    static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn discovery_dedups_by_inode_and_follows_cuda_home() {
        let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let lib64 = dir.path().join("lib64");
        fs::create_dir(&lib64).unwrap();
        fs::write(lib64.join("libcudart.so.12"), b"\x7fELF").unwrap();
        std::os::unix::fs::symlink("libcudart.so.12", lib64.join("libcudart.so")).unwrap();
        // SAFETY: the tests that set or read the environment here hold ENV.
        unsafe { std::env::set_var("CUDA_HOME", dir.path()) };
        let found = discover(&[], None);
        unsafe { std::env::remove_var("CUDA_HOME") };
        let ours: Vec<_> = found.iter().filter(|l| l.path.starts_with(fs::canonicalize(dir.path()).unwrap())).collect();
        assert_eq!(ours.len(), 1, "{found:?}");
        assert_eq!(ours[0].found, "$CUDA_HOME");
    }

    #[test]
    fn link_stubs_are_not_probed() {
        let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
        assert!(is_link_stub(Path::new("/usr/local/cuda/lib64/stubs/libcuda.so")));
        assert!(!is_link_stub(Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1")));
        let dir = tempfile::tempdir().unwrap();
        let stubs = dir.path().join("stubs");
        fs::create_dir(&stubs).unwrap();
        fs::write(stubs.join("libcuda.so"), b"\x7fELF").unwrap();
        fs::write(dir.path().join("libcudart.so.13"), b"\x7fELF").unwrap();
        let path = std::env::join_paths([dir.path(), &stubs]).unwrap();
        // SAFETY: the tests that set or read the environment here hold ENV.
        let before = std::env::var_os("LD_LIBRARY_PATH");
        unsafe { std::env::set_var("LD_LIBRARY_PATH", &path) };
        let found = discover(&[], None);
        match before {
            Some(b) => unsafe { std::env::set_var("LD_LIBRARY_PATH", b) },
            None => unsafe { std::env::remove_var("LD_LIBRARY_PATH") },
        }
        let root = fs::canonicalize(dir.path()).unwrap();
        let ours: Vec<_> = found.iter().filter(|l| l.path.starts_with(&root)).map(|l| l.path.clone()).collect();
        assert_eq!(ours, vec![root.join("libcudart.so.13")], "{found:?}");
    }

    #[test]
    fn explicit_libraries_must_be_elf() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("notes.txt");
        fs::write(&text, "hello").unwrap();
        let err = explicit(std::slice::from_ref(&text)).unwrap_err().to_string();
        assert!(err.contains("not an ELF"), "{err}");
        let err = explicit(&[dir.path().join("missing.so")]).unwrap_err().to_string();
        assert!(err.contains("missing.so") && err.contains("cannot read"), "{err}");
    }
}
