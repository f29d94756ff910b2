//! The driver of `fragscope whatif`: reads a snapshot's requests per
//! device, measures the allocator model's fidelity to the recording, runs
//! the scenarios ([`crate::analysis::whatif`]) and writes `whatif.json`
//! and `whatif.md` ([`crate::output::whatif`]).

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};

use crate::analysis::allocator::Settings;
use crate::analysis::whatif::{DeviceStream, Outcome, Req, default_sweep, fidelity, simulate};
use crate::cli::WhatifArgs;
use crate::exit;
use crate::output::whatif::{Report, Scenario};
use crate::trace::input::{Input, classify};

/// Parses each `--conf` into a scenario's entries on top of `base`.
fn scenarios(base: &Settings, confs: &[Vec<String>]) -> std::result::Result<Vec<(Vec<String>, Settings)>, String> {
    confs
        .iter()
        .map(|entries| {
            let mut s = base.clone();
            for e in entries {
                s.apply(e)?;
            }
            Ok((entries.clone(), s))
        })
        .collect()
}

/// The requests of each device of a snapshot, with the state before its
/// first trace entry, and the allocator settings it recorded (parsed and
/// as recorded).
fn load(path: &std::path::Path, device: Option<u32>) -> Result<(Vec<DeviceStream>, Settings, serde_json::Value)> {
    let mut devices: BTreeMap<u32, DeviceStream> = BTreeMap::new();
    let converted = crate::import::snapshot::convert_file(path, device, &mut |e| {
        let d = devices.entry(e.pid).or_insert_with(|| DeviceStream { device: e.pid, ..DeviceStream::default() });
        d.events.push(Req::of(&e));
        Ok(())
    })?;
    for r in &converted.reconstructions {
        let d = devices.entry(r.device).or_insert_with(|| DeviceStream { device: r.device, ..DeviceStream::default() });
        d.initial = (r.initial_segments + r.initial_blocks) as usize;
    }
    let details = converted.meta.details.snapshot().context("the snapshot's details are missing")?;
    let recorded = Settings::from_snapshot(&details.allocator_settings);
    Ok((devices.into_values().collect(), recorded, details.allocator_settings.clone()))
}

pub fn run(args: &WhatifArgs) -> Result<u8> {
    let confs: Vec<Vec<String>> = args
        .conf
        .iter()
        .map(|c| c.split(',').map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect())
        .collect();
    // Usage errors before the (long) read: a bad key or value exits 2.
    if let Err(e) = scenarios(&Settings::default(), &confs) {
        eprintln!("error: --conf {e}");
        return Ok(exit::USAGE);
    }
    if classify(&args.input) != Some(Input::Snapshot) {
        bail!(
            "{}: whatif reads a PyTorch memory snapshot (a pickle); trace directories are not supported yet",
            args.input.display()
        );
    }
    let started = std::time::Instant::now();
    let (devices, recorded, settings_json) = load(&args.input, args.device)?;
    let confs = if confs.is_empty() { default_sweep(&devices, args.capacity) } else { confs };
    let runs = scenarios(&recorded, &confs).map_err(|e| anyhow::anyhow!("--conf {e}"))?;

    let fidelity: Vec<_> = devices.iter().map(|d| fidelity(d, &recorded)).collect();
    let run_all = |name: &str, conf: &[String], s: &Settings| -> Scenario {
        let per_device: Vec<Outcome> = devices.iter().map(|d| simulate(d, s, args.capacity, name, conf)).collect();
        Scenario::of(name, conf, per_device)
    };
    let mut all = vec![run_all("recorded", &[], &recorded)];
    // Scenarios are independent: run them on threads.
    let others: Vec<Scenario> = std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .iter()
            .map(|(conf, s)| {
                let run_all = &run_all;
                scope.spawn(move || run_all(&conf.join(","), conf, s))
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    all.extend(others);
    let report = Report::new(&args.input, &recorded, settings_json, args.capacity, fidelity, all);
    std::fs::create_dir_all(&args.output).with_context(|| format!("cannot create {}", args.output.display()))?;
    crate::trace::write_atomic(&args.output.join("whatif.json"), &serde_json::to_vec_pretty(&report.json())?)?;
    crate::trace::write_atomic(&args.output.join("whatif.md"), report.markdown().as_bytes())?;
    println!("{}", report.headline());
    println!(
        "  {} scenario(s) in {:.2} s; wrote {}",
        report.scenarios.len(),
        started.elapsed().as_secs_f64(),
        args.output.display()
    );
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared real snapshots, when this checkout has them beside it.
    fn fixtures() -> Vec<std::path::PathBuf> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/pytorch");
        let mut v: Vec<_> = std::fs::read_dir(&dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "pickle"))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Every allocation of every real snapshot lands where PyTorch put it;
    /// and the check can fail: under other rounding it does not.
    #[test]
    fn the_model_places_every_real_allocation_where_pytorch_did() {
        let files = fixtures();
        if files.is_empty() {
            eprintln!("skipped: ../shared/fixtures/pytorch is not beside this checkout");
            return;
        }
        let mut differed = 0;
        for path in &files {
            let (devices, recorded, _) = load(path, None).unwrap();
            for d in &devices {
                let f = fidelity(d, &recorded);
                assert!(f.allocations > 0, "{}", path.display());
                assert_eq!(f.same_address, f.allocations, "{}: {:?}", path.display(), f.first_mismatches);
                assert_eq!((f.segments_same_size, f.desynchronised), (f.segments_requested, 0), "{}", path.display());
                let mut other = recorded.clone();
                other.apply("roundup_power2_divisions:4").unwrap();
                other.apply("max_split_size_mb:32").unwrap();
                differed += usize::from(fidelity(d, &other).same_address < f.allocations);
            }
        }
        assert!(differed > 0, "other settings should mispredict somewhere: the check must be able to fail");
    }
}
