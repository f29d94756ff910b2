//! Recorded kernel launches by kernel name. `record` stores each launch's
//! function address (`addr` of `launch` rows: the host-side stub nvcc
//! emits for a `__global__` function, which carries the kernel's mangled
//! name); [`crate::trace::symbols`] names it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::trace::event::{EventKind, Events};
use crate::trace::symbols::Resolver;

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
