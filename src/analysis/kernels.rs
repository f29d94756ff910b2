//! Names for recorded code addresses: kernels of launches, and the call
//! stacks `record --stacks` captured. Kernel names for recorded launches. `record` stores each launch's
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

use anyhow::Result;
use polars::prelude::{DataType, ParquetReader, SerReader};

use crate::trace::event::{EventKind, Events};
use crate::trace::{Trace, USTACKS_FILE, read_ustacks};

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

/// (pid, code address).
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

/// Names addresses of recorded processes: their copied maps give the file
/// and offset, the file's symbol tables the name.
struct Resolver {
    maps_dir: PathBuf,
    maps: HashMap<u32, Vec<Mapping>>,
    symbolizer: Symbolizer,
}

impl Resolver {
    fn new(trace_dir: &Path) -> Resolver {
        Resolver { maps_dir: trace_dir.join("maps"), maps: HashMap::new(), symbolizer: Symbolizer::new() }
    }

    /// Names for many (pid, address) pairs, symbolising each file once.
    fn names(&mut self, wanted: impl IntoIterator<Item = (u32, u64)>) -> HashMap<(u32, u64), String> {
        let mut by_file: BTreeMap<PathBuf, Vec<(u64, Launched)>> = BTreeMap::new();
        let mut out = HashMap::new();
        for (pid, addr) in wanted {
            let dir = &self.maps_dir;
            let m = self.maps.entry(pid).or_insert_with(|| {
                fs::read_to_string(dir.join(pid.to_string())).map(|t| parse_maps(&t)).unwrap_or_default()
            });
            match locate(m, addr) {
                Some((path, off)) => by_file.entry(path.to_path_buf()).or_default().push((off, (pid, addr))),
                None => {
                    out.insert((pid, addr), format!("0x{addr:x}"));
                }
            }
        }
        for (path, items) in by_file {
            let offsets: Vec<u64> = items.iter().map(|i| i.0).collect();
            let syms = self.symbolizer.symbolize(&Source::Elf(Elf::new(&path)), Input::FileOffset(&offsets));
            if let Err(e) = &syms {
                tracing::debug!("cannot symbolise in {}: {e}", path.display());
            }
            let syms = syms.unwrap_or_default();
            for (i, (off, key)) in items.into_iter().enumerate() {
                let name = match syms.get(i) {
                    Some(Symbolized::Sym(sym)) => sym.name.to_string(),
                    _ => format!("{}+0x{off:x}", path.display()),
                };
                out.insert(key, name);
            }
        }
        out
    }
}

/// Kernels by launch count (most first), for a trace recorded with maps.
/// Empty when the trace has no launches or no `maps/` folder.
pub fn kernel_table(trace_dir: &Path, events: &Events) -> Vec<KernelStat> {
    if !trace_dir.join("maps").is_dir() {
        return Vec::new();
    }
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
    let names = Resolver::new(trace_dir).names(launches.keys().copied());
    let mut by_name: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (key, (n, f)) in launches {
        let e = by_name.entry(names[&key].clone()).or_default();
        e.0 += n;
        e.1 += f;
    }
    let mut out: Vec<KernelStat> =
        by_name.into_iter().map(|(name, (launches, failed))| KernelStat { name, launches, failed }).collect();
    out.sort_by(|a, b| b.launches.cmp(&a.launches).then_with(|| a.name.cmp(&b.name)));
    out
}

/// Device memory allocated from one call stack (`record --stacks`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StackStat {
    pub bytes: u64,
    pub allocations: u64,
    /// Innermost first: the probed CUDA function, then its callers.
    pub frames: Vec<String>,
}

/// Successful device allocations by call stack, most bytes first (the
/// same symbolised stack in several processes counts once). Empty when
/// the trace has no `ustacks.parquet`.
pub fn allocation_stacks(trace: &Trace) -> Result<Vec<StackStat>> {
    let path = trace.dir.join(USTACKS_FILE);
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let frames = read_ustacks(&path)?;
    let mut bytes: BTreeMap<(u32, u32), (u64, u64)> = BTreeMap::new();
    for part in &trace.parts {
        let df = ParquetReader::new(fs::File::open(part)?).finish()?;
        let (Ok(kind), Ok(ustack)) = (df.column("kind"), df.column("ustack_id")) else { continue };
        let kind = kind.cast(&DataType::String)?;
        let (kind, ustack) = (kind.str()?, ustack.u32()?);
        let pid = df.column("pid")?.cast(&DataType::UInt32)?;
        let size = df.column("size")?.cast(&DataType::UInt64)?;
        let ret = df.column("ret")?.cast(&DataType::Int32)?;
        let (pid, size, ret) = (pid.u32()?, size.u64()?, ret.i32()?);
        for i in 0..df.height() {
            let alloc = kind.get(i).and_then(EventKind::from_name).is_some_and(|k| k.is_device_alloc());
            if let (true, Some(0), Some(id), Some(p), Some(sz)) =
                (alloc, ret.get(i), ustack.get(i), pid.get(i), size.get(i))
            {
                let e = bytes.entry((id, p)).or_default();
                e.0 += sz;
                e.1 += 1;
            }
        }
    }
    let mut stacks: HashMap<(u32, u32), Vec<u64>> = HashMap::new();
    for f in &frames {
        if bytes.contains_key(&(f.stack_id, f.pid)) {
            let s = stacks.entry((f.stack_id, f.pid)).or_default();
            if s.len() <= f.depth as usize {
                s.resize(f.depth as usize + 1, 0);
            }
            s[f.depth as usize] = f.addr;
        }
    }
    let wanted = stacks.iter().flat_map(|(&(_, pid), addrs)| addrs.iter().map(move |&a| (pid, a)));
    let names = Resolver::new(&trace.dir).names(wanted.collect::<Vec<_>>());
    let mut by_frames: BTreeMap<Vec<String>, (u64, u64)> = BTreeMap::new();
    for (key, (b, n)) in bytes {
        let frames =
            stacks.get(&key).map_or_else(Vec::new, |a| a.iter().map(|&addr| names[&(key.1, addr)].clone()).collect());
        let e = by_frames.entry(frames).or_default();
        e.0 += b;
        e.1 += n;
    }
    let mut out: Vec<StackStat> =
        by_frames.into_iter().map(|(frames, (bytes, allocations))| StackStat { bytes, allocations, frames }).collect();
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.frames.cmp(&b.frames)));
    Ok(out)
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
