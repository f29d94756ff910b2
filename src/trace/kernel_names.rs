//! `kernels.json` beside a recording's parts: the names of the kernels the
//! recorded processes registered, and the handles their launches pass
//! (SPEC §9). A launch's `addr` is the kernel's host function (CUDA 12 and
//! older) or a handle CUDA 13 made for it (`cudaGetKernel`), which lies in
//! the process's heap where no symbol names it; this file names both.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

pub const KERNELS_FILE: &str = "kernels.json";

/// A registered kernel: its process, host function and mangled device name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Function {
    pub pid: u32,
    pub host: u64,
    pub name: String,
}

/// A handle a launch passes for a host function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handle {
    pub pid: u32,
    pub handle: u64,
    pub host: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelNames {
    pub functions: Vec<Function>,
    pub handles: Vec<Handle>,
    /// Registrations whose name could not be read (the process was gone).
    #[serde(default)]
    pub unreadable: u64,
}

impl KernelNames {
    /// The file of trace `dir`; None when it has none.
    pub fn read(dir: &Path) -> Result<Option<KernelNames>> {
        let path = dir.join(KERNELS_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .with_context(|| format!("{}: not a kernel-name table", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }

    /// The mangled name launched at (pid, addr): a host function, or a
    /// handle made for one.
    pub fn by_launch_address(&self) -> HashMap<(u32, u64), &str> {
        let mut names: HashMap<(u32, u64), &str> =
            self.functions.iter().map(|f| ((f.pid, f.host), f.name.as_str())).collect();
        for h in &self.handles {
            if let Some(&name) = names.get(&(h.pid, h.host)) {
                names.insert((h.pid, h.handle), name);
            }
        }
        names
    }
}

/// A mangled C++ name demangled; as it is when it is not one.
pub fn demangle(name: &str) -> String {
    cpp_demangle::Symbol::new(name).ok().and_then(|s| s.demangle().ok()).unwrap_or_else(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_take_the_name_of_their_host_function() {
        let k = KernelNames {
            functions: vec![Function { pid: 1, host: 0x400, name: "_Z6vecAddPfS_S_i".into() }],
            handles: vec![
                Handle { pid: 1, handle: 0x5555_0000, host: 0x400 },
                Handle { pid: 1, handle: 9, host: 0x999 },
            ],
            unreadable: 0,
        };
        let m = k.by_launch_address();
        assert_eq!(m.get(&(1, 0x400)), Some(&"_Z6vecAddPfS_S_i"));
        assert_eq!(m.get(&(1, 0x5555_0000)), Some(&"_Z6vecAddPfS_S_i"));
        assert_eq!(m.get(&(1, 9)), None);
        assert_eq!(demangle("_Z6vecAddPfS_S_i"), "vecAdd(float*, float*, float*, int)");
        assert_eq!(demangle("not_mangled"), "not_mangled");
    }
}
