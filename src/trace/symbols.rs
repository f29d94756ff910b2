//! Names for recorded code addresses. `record` copies `/proc/PID/maps` of
//! every recorded process (`maps/PID`); an address becomes a file offset
//! through the mapping that holds it, and the ELF file's symbol tables give
//! the name, demangled, by blazesym (the symbolizer of the libbpf project).
//! No debug info is needed. Kernel launches ([`crate::analysis::kernels`])
//! and the call stacks of `record --stacks` (the trace's stack table) are
//! named here.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};

use crate::trace::column::Coded;
use crate::trace::event::NO_STACK;
use crate::trace::stacks::{Frame, Stacks, UstackFrame};

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

/// The file mapped at `addr` in a process whose maps were copied to
/// `maps` (the format of `/proc/PID/maps`), and the offset in it.
pub fn mapped_file(maps: &Path, addr: u64) -> Option<(PathBuf, u64)> {
    file_at(&std::fs::read_to_string(maps).ok()?, addr)
}

/// [`mapped_file`] of maps already read.
pub fn file_at(maps: &str, addr: u64) -> Option<(PathBuf, u64)> {
    let maps = parse_maps(maps);
    locate(&maps, addr).map(|(p, o)| (p.to_path_buf(), o))
}

/// The recorded processes that mapped PyTorch's CUDA allocator
/// (`libc10_cuda.so`) by their copied maps: their failed `cudaMalloc`s
/// are asked again by that allocator after it releases cached memory.
pub fn pytorch_processes(trace_dir: &Path) -> std::collections::HashSet<u32> {
    let Ok(dir) = fs::read_dir(trace_dir.join("maps")) else { return Default::default() };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let text = fs::read_to_string(e.path()).ok()?;
            text.lines().any(|l| l.rsplit('/').next().is_some_and(|f| f.starts_with("libc10_cuda.so"))).then_some(pid)
        })
        .collect()
}

/// Names addresses of recorded processes: their copied maps give the file
/// and offset, the file's symbol tables the name.
pub struct Resolver {
    maps_dir: PathBuf,
    maps: HashMap<u32, Vec<Mapping>>,
    symbolizer: Symbolizer,
}

impl Resolver {
    pub fn new(trace_dir: &Path) -> Resolver {
        Resolver { maps_dir: trace_dir.join("maps"), maps: HashMap::new(), symbolizer: Symbolizer::new() }
    }

    /// Frames for many (pid, address) pairs, symbolising each file once.
    /// The frame's file is the mapped file's path ("" when no mapping was
    /// recorded) and its line 0; its name is the demangled symbol,
    /// `+0xOFFSET` when the file has no symbol there, `0xADDR` when the
    /// address is in no recorded mapping ([`label`] names them all).
    pub fn frames(&mut self, wanted: impl IntoIterator<Item = (u32, u64)>) -> HashMap<(u32, u64), Frame> {
        let mut by_file: BTreeMap<PathBuf, Vec<(u64, (u32, u64))>> = BTreeMap::new();
        let mut out = HashMap::new();
        for (pid, addr) in wanted {
            let dir = &self.maps_dir;
            let m = self.maps.entry(pid).or_insert_with(|| {
                fs::read_to_string(dir.join(pid.to_string())).map(|t| parse_maps(&t)).unwrap_or_default()
            });
            match locate(m, addr) {
                Some((path, off)) => by_file.entry(path.to_path_buf()).or_default().push((off, (pid, addr))),
                None => {
                    out.insert((pid, addr), Frame { filename: String::new(), line: 0, name: format!("0x{addr:x}") });
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
            let filename = path.display().to_string();
            for (i, (off, key)) in items.into_iter().enumerate() {
                let name = match syms.get(i) {
                    Some(Symbolized::Sym(sym)) => sym.name.to_string(),
                    _ => format!("+0x{off:x}"),
                };
                out.insert(key, Frame { filename: filename.clone(), line: 0, name });
            }
        }
        out
    }

    /// Names for many (pid, address) pairs: the [`label`]s of their frames.
    pub fn names(&mut self, wanted: impl IntoIterator<Item = (u32, u64)>) -> HashMap<(u32, u64), String> {
        self.frames(wanted).into_iter().map(|(k, f)| (k, label(&f))).collect()
    }
}

/// A resolved frame's name for tables: the symbol, `file+0xOFFSET` where
/// the file has no symbol, `0xADDR` outside every recorded mapping.
pub fn label(f: &Frame) -> String {
    if f.name.starts_with("+0x") { format!("{}{}", f.filename, f.name) } else { f.name.clone() }
}

/// The stack table of a trace recorded with `record --stacks`. `ids`
/// holds each event's recorded stack id (per process, [`NO_STACK`] for
/// none) and is rewritten in place to indices of the returned table. Each
/// (id, pid) the events name becomes a stack of symbolised frames,
/// innermost (the probed CUDA function) first; the same frames in several
/// processes make one stack. An id without recorded frames gets an empty
/// stack.
pub fn stack_table(trace_dir: &Path, frames: &[UstackFrame], pids: &Coded<u32>, ids: &mut [u32]) -> Stacks {
    let used: std::collections::HashSet<(u32, u32)> =
        ids.iter().zip(pids.iter()).filter(|(id, _)| **id != NO_STACK).map(|(&id, pid)| (id, pid)).collect();
    let mut addrs: HashMap<(u32, u32), Vec<u64>> = HashMap::new();
    for f in frames.iter().filter(|f| used.contains(&(f.stack_id, f.pid))) {
        let s = addrs.entry((f.stack_id, f.pid)).or_default();
        if s.len() <= f.depth as usize {
            s.resize(f.depth as usize + 1, 0);
        }
        s[f.depth as usize] = f.addr;
    }
    let wanted: Vec<(u32, u64)> =
        addrs.iter().flat_map(|(&(_, pid), a)| a.iter().map(move |&addr| (pid, addr))).collect();
    let named = Resolver::new(trace_dir).frames(wanted);
    let mut table = Stacks::default();
    let mut frame_index: HashMap<Frame, u32> = HashMap::new();
    let mut stack_index: HashMap<Vec<u32>, u32> = HashMap::new();
    // Sorted, so the table does not depend on hash order.
    let mut keys: Vec<(u32, u32)> = used.into_iter().collect();
    keys.sort_unstable();
    let mut index_of: HashMap<(u32, u32), u32> = HashMap::new();
    for key in keys {
        let stack: Vec<u32> = addrs
            .get(&key)
            .into_iter()
            .flatten()
            .map(|&addr| {
                let f = named.get(&(key.1, addr)).cloned().unwrap_or_else(|| Frame {
                    filename: String::new(),
                    line: 0,
                    name: format!("0x{addr:x}"),
                });
                *frame_index.entry(f.clone()).or_insert_with(|| {
                    table.frames.push(f);
                    (table.frames.len() - 1) as u32
                })
            })
            .collect();
        let id = *stack_index.entry(stack.clone()).or_insert_with(|| {
            table.stacks.push(stack);
            (table.stacks.len() - 1) as u32
        });
        index_of.insert(key, id);
    }
    for (id, pid) in ids.iter_mut().zip(pids.iter()) {
        if *id != NO_STACK {
            *id = index_of.get(&(*id, pid)).copied().unwrap_or(NO_STACK);
        }
    }
    table
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
