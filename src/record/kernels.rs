//! Kernel names as the program registers them: `__cudaRegisterFunction`
//! gives each kernel's host function and a pointer to its mangled name in
//! the process's memory, read here while the process runs; the
//! `cudaGetKernel` family gives the handles CUDA 13's launches pass.
//! Written to `kernels.json` ([`crate::trace::kernel_names`]) at the end.

use std::io::Read;

use anyhow::Result;

use super::probes::KernelRecord;
use crate::trace::TraceWriter;
use crate::trace::kernel_names::{Function, Handle, KERNELS_FILE, KernelNames};

/// Longest name read (mangled template names run long).
const MAX_NAME: usize = 4096;

#[derive(Default)]
pub(super) struct Kernels {
    names: KernelNames,
    /// Registrations whose process was gone before its name was read:
    /// read at the end from the file its copied `maps/PID` says holds it.
    pending: Vec<(u32, u64, u64)>,
}

impl Kernels {
    pub(super) fn add(&mut self, r: KernelRecord) {
        match r {
            KernelRecord::Function { pid, host, name_at } => match read_c_string(pid, name_at) {
                Some(name) => self.names.functions.push(Function { pid, host, name }),
                None => self.pending.push((pid, host, name_at)),
            },
            KernelRecord::Handle { pid, handle, host } => self.names.handles.push(Handle { pid, handle, host }),
            KernelRecord::Failed => {}
        }
    }

    /// Writes `kernels.json`, when anything was registered.
    pub(super) fn write(mut self, writer: &TraceWriter) -> Result<()> {
        for (pid, host, at) in std::mem::take(&mut self.pending) {
            match read_from_file(&writer.dir().join("maps").join(pid.to_string()), at) {
                Some(name) => self.names.functions.push(Function { pid, host, name }),
                None => self.names.unreadable += 1,
            }
        }
        self.names.functions.sort_by(|a, b| (a.pid, &a.name).cmp(&(b.pid, &b.name)));
        if self.names.functions.is_empty() && self.names.handles.is_empty() && self.names.unreadable == 0 {
            return Ok(());
        }
        self.names.handles.sort_by_key(|h| (h.pid, h.handle));
        self.names.handles.dedup();
        let path = writer.dir().join(KERNELS_FILE);
        crate::trace::write_atomic(&path, &serde_json::to_vec_pretty(&self.names)?)?;
        writer.chown(&path)
    }
}

/// The NUL-terminated string at `at` in process `pid`'s memory.
fn read_c_string(pid: u32, at: u64) -> Option<String> {
    read_string_at(std::path::Path::new(&format!("/proc/{pid}/mem")), at)
}

/// The string at `at` of a process that is gone, from the file that its
/// copied maps (`maps`, the format of `/proc/PID/maps`) say was mapped
/// there: the names lie in the read-only data of the program or library.
fn read_from_file(maps: &std::path::Path, at: u64) -> Option<String> {
    let (path, offset) = crate::trace::symbols::mapped_file(maps, at)?;
    read_string_at(&path, offset)
}

/// The NUL-terminated string at offset `at` of file `path`.
fn read_string_at(path: &std::path::Path, at: u64) -> Option<String> {
    let mut f = std::fs::File::open(path).ok()?;
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(at)).ok()?;
    // Names are mostly short: read 256 bytes at a time (the callback that
    // reads them must keep up with tens of thousands at start-up).
    let mut buf = vec![0u8; MAX_NAME];
    let mut got = 0;
    while got < buf.len() {
        let upto = (got + 256).min(buf.len());
        match f.read(&mut buf[got..upto]) {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                if buf[..got].contains(&0) {
                    break;
                }
            }
            Err(_) if got > 0 => break,
            Err(_) => return None,
        }
    }
    let end = buf[..got].iter().position(|&b| b == 0)?;
    std::str::from_utf8(&buf[..end]).ok().filter(|s| !s.is_empty()).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gone process's name is read from the file its copied maps say
    /// was mapped at the address.
    #[test]
    fn names_of_a_gone_process_come_from_its_mapped_file() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libkernels.so");
        let mut bytes = vec![0u8; 0x3000];
        bytes[0x2010..0x2010 + 17].copy_from_slice(b"_Z6vecAddPfS_S_i\0");
        std::fs::write(&lib, &bytes).unwrap();
        let maps = dir.path().join("maps");
        std::fs::write(
            &maps,
            format!(
                "7f0000000000-7f0000001000 r--p 00000000 fe:00 1 {0}\n7f0000005000-7f0000006000 r--p 00002000 fe:00 1 {0}\n",
                lib.display()
            ),
        )
        .unwrap();
        assert_eq!(read_from_file(&maps, 0x7f00_0000_5010).as_deref(), Some("_Z6vecAddPfS_S_i"));
        assert_eq!(read_from_file(&maps, 0x7f00_0000_9000), None, "unmapped");
    }
}
