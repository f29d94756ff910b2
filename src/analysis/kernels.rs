//! Recorded kernel launches by kernel name. `record` stores each launch's
//! function address (`addr` of `launch` rows): on CUDA 12 and older the
//! host-side stub nvcc emits for a `__global__` function, on CUDA 13 a
//! handle in the process's heap. The names the program registered with
//! the runtime (`kernels.json`, [`crate::trace::kernel_names`]) name both;
//! a launch they do not name is named by the symbol at its address
//! ([`crate::trace::symbols`]: host stubs of statically linked programs).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::trace::event::{EventKind, Events};
use crate::trace::kernel_names::{KernelNames, demangle};
use crate::trace::symbols::Resolver;

/// Launches of one kernel, over all processes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelStat {
    /// Demangled symbol; `file+0xOFFSET` when the file has no symbol there,
    /// `0xADDR` when no mapping was recorded for the process.
    pub name: String,
    pub launches: u64,
    /// Launches that returned an error; `None` where the recording has no
    /// return codes (launches written at entry, as `record` does since
    /// 2026-11-26).
    pub failed: Option<u64>,
}

/// (pid, code address).
type Launched = (u32, u64);

/// Kernels by launch count (most first), for a trace recorded with maps.
/// Empty when the trace has no launches or no `maps/` folder. `process`
/// gives the recorded process of a series (a unit's, or a probed
/// recording's allocator view's), which the maps are keyed by.
pub fn kernel_table(trace_dir: &Path, events: &Events, returns: bool, process: impl Fn(u32) -> u32) -> Vec<KernelStat> {
    let registered = match KernelNames::read(trace_dir) {
        Ok(k) => k,
        Err(e) => {
            tracing::warn!("{e:#}; kernels are named by symbols only");
            None
        }
    };
    if !trace_dir.join("maps").is_dir() && registered.is_none() {
        return Vec::new();
    }
    let mut launches: BTreeMap<Launched, (u64, u64)> = BTreeMap::new();
    for i in 0..events.len() {
        if events.kind[i] == Some(EventKind::Launch) {
            let c = launches.entry((process(events.pid[i]), events.addr.at(i))).or_default();
            c.0 += 1;
            c.1 += u64::from(events.ret[i] != 0);
        }
    }
    if launches.is_empty() {
        return Vec::new();
    }
    let by_address = registered.as_ref().map(KernelNames::by_launch_address).unwrap_or_default();
    let unnamed: Vec<Launched> = launches.keys().copied().filter(|k| !by_address.contains_key(k)).collect();
    let mut names = if unnamed.is_empty() || !trace_dir.join("maps").is_dir() {
        std::collections::HashMap::new()
    } else {
        Resolver::new(trace_dir).names(unnamed)
    };
    for key in launches.keys() {
        if let Some(name) = by_address.get(key) {
            names.insert(*key, demangle(name));
        } else {
            names.entry(*key).or_insert_with(|| format!("{:#x}", key.1));
        }
    }
    let mut by_name: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (key, (n, f)) in launches {
        let e = by_name.entry(names[&key].clone()).or_default();
        e.0 += n;
        e.1 += f;
    }
    let mut out: Vec<KernelStat> = by_name
        .into_iter()
        .map(|(name, (launches, failed))| KernelStat { name, launches, failed: returns.then_some(failed) })
        .collect();
    out.sort_by(|a, b| b.launches.cmp(&a.launches).then_with(|| a.name.cmp(&b.name)));
    out
}
