//! What the driver says of the GPUs, through NVML (`libnvidia-ml.so.1`,
//! which every NVIDIA driver installs; loaded at run time by
//! `nvml-wrapper`, so a machine without the driver records as before and
//! says why): each device's memory when the recording starts, and at each
//! part which processes use which device, and how much.
//!
//! The trace's capacity is the devices' memory when they all have the
//! same (`analyze` replays a process's devices as one series yet, so with
//! devices of different sizes no one capacity is true, and none is
//! written). It is NVML's total: CUDA's own context takes some of it
//! (about 0.5 GiB on an H100), so the headroom the OOM risk reads is that
//! much larger than what the program could allocate.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

use crate::trace::details::{Gpu, GpuProcess};

/// NVML, when the driver answers.
pub(super) struct Driver {
    nvml: Option<Nvml>,
    /// Why there is no NVML, for `trace.json`.
    pub(super) unavailable: Option<String>,
}

impl Driver {
    /// Loads NVML; never fails (a machine without the driver has none).
    pub(super) fn open() -> Driver {
        match Nvml::builder().lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1")).init() {
            Ok(nvml) => Driver { nvml: Some(nvml), unavailable: None },
            Err(e) => {
                let why = format!("NVML (libnvidia-ml.so.1) is not available: {e}");
                tracing::info!("{why}: the device capacity stays unknown");
                Driver { nvml: None, unavailable: Some(why) }
            }
        }
    }

    /// Every device's memory and the processes using it, now; empty
    /// without NVML. A device that does not answer is left out, with a
    /// warning.
    pub(super) fn sample(&self) -> Vec<Gpu> {
        let Some(nvml) = &self.nvml else { return Vec::new() };
        let count = match nvml.device_count() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("NVML: cannot count the devices: {e}");
                return Vec::new();
            }
        };
        (0..count)
            .filter_map(|index| {
                let device =
                    nvml.device_by_index(index).map_err(|e| tracing::warn!("NVML device {index}: {e}")).ok()?;
                let memory = device.memory_info().map_err(|e| tracing::warn!("NVML device {index}: {e}")).ok()?;
                let processes = device
                    .running_compute_processes()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|p| GpuProcess {
                        pid: p.pid,
                        used_bytes: match p.used_gpu_memory {
                            UsedGpuMemory::Used(b) if b != u64::MAX => Some(b),
                            _ => None,
                        },
                    })
                    .collect();
                Some(Gpu {
                    index,
                    name: device.name().unwrap_or_default(),
                    total_bytes: memory.total,
                    used_bytes: memory.used,
                    processes,
                })
            })
            .collect()
    }
}

/// The capacity of every device, when they all have the same memory.
pub(super) fn capacity(gpus: &[Gpu]) -> Option<u64> {
    let first = gpus.first()?.total_bytes;
    gpus.iter().all(|g| g.total_bytes == first).then_some(first)
}

/// Appends one sample to `gpus.jsonl` in the trace directory: how many
/// parts were written when it was taken, the time (the events' clock) and
/// the devices.
pub(super) fn append_sample(dir: &Path, part: u32, t_ns: u64, gpus: &[Gpu]) -> Result<()> {
    let path = dir.join(GPUS_FILE);
    let line = serde_json::to_string(&serde_json::json!({"part": part, "t_ns": t_ns, "gpus": gpus}))?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    writeln!(f, "{line}").with_context(|| format!("cannot write {}", path.display()))
}

/// The file of the per-part samples.
pub const GPUS_FILE: &str = "gpus.jsonl";

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, total: u64) -> Gpu {
        Gpu { index, name: String::new(), total_bytes: total, used_bytes: 0, processes: Vec::new() }
    }

    #[test]
    fn one_capacity_only_when_every_device_has_it() {
        assert_eq!(capacity(&[]), None);
        assert_eq!(capacity(&[gpu(0, 80 << 30), gpu(1, 80 << 30)]), Some(80 << 30));
        assert_eq!(capacity(&[gpu(0, 80 << 30), gpu(1, 40 << 30)]), None);
    }
}
