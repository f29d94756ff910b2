//! Kernel names for recorded launches. `record` stores each launch's
//! function address (`addr` of `launch` rows: the host-side stub nvcc
//! emits for a `__global__` function, which carries the kernel's mangled
//! name) and a copy of `/proc/PID/maps` per process (`maps/PID`). Here an
//! address is turned into a file offset through the mapping that holds it,
//! and the ELF file's symbol tables give the name, demangled, by blazesym
//! (the symbolizer of the libbpf project). No debug info is needed.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};
use serde::Serialize;

use crate::event::{EventKind, Events};

/// Launches of one kernel, over all processes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelStat {
    /// Demangled symbol; `file+0xOFFSET` when the file has no symbol there,
    /// `0xADDR` when no mapping was recorded for the process.
    pub name: String,
    pub launches: u64,
    /// Launches that returned an error.
    pub failed: u64,
}

/// (pid, function address) of launches.
type Launched = (u32, u64);

/// One file-backed mapping of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Mapping {
    start: u64,
    end: u64,
    offset: u64,
    path: PathBuf,
}

fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (range, _perms, offset, _dev, _inode) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            let path = f.next().filter(|p| p.starts_with('/'))?;
            let (start, end) = range.split_once('-')?;
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                offset: u64::from_str_radix(offset, 16).ok()?,
                path: PathBuf::from(path),
            })
        })
        .collect()
}

/// The file and file offset of `addr` in a process's mappings.
fn locate(maps: &[Mapping], addr: u64) -> Option<(&Path, u64)> {
    maps.iter().find(|m| m.start <= addr && addr < m.end).map(|m| (m.path.as_path(), addr - m.start + m.offset))
}

/// Kernels by launch count (most first), for a trace recorded with maps.
/// Empty when the trace has no launches or no `maps/` folder.
pub fn kernel_table(trace_dir: &Path, events: &Events) -> Vec<KernelStat> {
    let maps_dir = trace_dir.join("maps");
    if !maps_dir.is_dir() {
        return Vec::new();
    }
    // (pid, addr) -> (launches, failed)
    let mut launches: BTreeMap<Launched, (u64, u64)> = BTreeMap::new();
    for i in 0..events.len() {
        if events.kind[i] == Some(EventKind::Launch) {
            let c = launches.entry((events.pid[i], events.addr[i])).or_default();
            c.0 += 1;
            c.1 += u64::from(events.ret[i] != 0);
        }
    }
    if launches.is_empty() {
        return Vec::new();
    }
    let mut maps: HashMap<u32, Vec<Mapping>> = HashMap::new();
    // file -> offsets to resolve
    let mut wanted: BTreeMap<PathBuf, Vec<u64>> = BTreeMap::new();
    let mut located: Vec<(Launched, Option<(PathBuf, u64)>)> = Vec::new();
    for &(pid, addr) in launches.keys() {
        let m = maps.entry(pid).or_insert_with(|| {
            fs::read_to_string(maps_dir.join(pid.to_string())).map(|t| parse_maps(&t)).unwrap_or_default()
        });
        let at = locate(m, addr).map(|(p, off)| (p.to_path_buf(), off));
        if let Some((p, off)) = &at {
            wanted.entry(p.clone()).or_default().push(*off);
        }
        located.push(((pid, addr), at));
    }
    let symbolizer = Symbolizer::new();
    let mut names: HashMap<(PathBuf, u64), String> = HashMap::new();
    for (path, offsets) in &wanted {
        let src = Source::Elf(Elf::new(path));
        match symbolizer.symbolize(&src, Input::FileOffset(offsets)) {
            Ok(syms) => {
                for (off, s) in offsets.iter().zip(syms) {
                    if let Symbolized::Sym(sym) = s {
                        names.insert((path.clone(), *off), sym.name.into_owned());
                    }
                }
            }
            Err(e) => tracing::debug!("cannot symbolise in {}: {e}", path.display()),
        }
    }
    let mut by_name: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for ((pid, addr), at) in located {
        let name = match at {
            Some((path, off)) => {
                names.get(&(path.clone(), off)).cloned().unwrap_or_else(|| format!("{}+0x{off:x}", path.display()))
            }
            None => format!("0x{addr:x}"),
        };
        let (n, f) = launches[&(pid, addr)];
        let e = by_name.entry(name).or_default();
        e.0 += n;
        e.1 += f;
    }
    let mut out: Vec<KernelStat> =
        by_name.into_iter().map(|(name, (launches, failed))| KernelStat { name, launches, failed }).collect();
    out.sort_by(|a, b| b.launches.cmp(&a.launches).then_with(|| a.name.cmp(&b.name)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_give_file_offsets() {
        let maps = parse_maps(
            "55d0c0000000-55d0c0001000 r--p 00000000 08:01 42 /opt/app/train\n\
             55d0c0001000-55d0c0005000 r-xp 00001000 08:01 42 /opt/app/train\n\
             7f0000000000-7f0000021000 rw-p 00000000 00:00 0 [heap]\n\
             7f1000000000-7f1000001000 rw-p 00000000 00:00 0\n",
        );
        assert_eq!(maps.len(), 2);
        assert_eq!(locate(&maps, 0x55d0c0001234), Some((Path::new("/opt/app/train"), 0x1234)));
        assert_eq!(locate(&maps, 0x7f0000000010), None);
    }
}
