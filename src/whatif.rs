//! The driver of `fragscope whatif`: reads a snapshot's requests per
//! device, measures the allocator model's fidelity to the recording, runs
//! the scenarios ([`crate::analysis::whatif`]) and writes `whatif.json`
//! and `whatif.md` ([`crate::output::whatif`]).

use anyhow::{Context, Result};

use crate::allocator::Settings;
use crate::analysis::whatif::{DeviceStream, Source, device_level_streams, settings_of, streams};
use crate::exit;
use crate::output::whatif::Report;

/// The requests of each device of a snapshot (a pickle, or a trace
/// directory imported from one) with the state before its first trace
/// entry and the allocator settings it recorded (parsed and as recorded);
/// or of each process of a device-level trace (eBPF, synthetic), with
/// PyTorch's default settings and the trace's capacity.
/// …and the input's units (a recording of PyTorch's allocator), for their
/// names.
type Loaded = (Vec<DeviceStream<'static>>, Settings, serde_json::Value, Source, Option<u64>, Units);
type Units = std::collections::BTreeMap<u32, (u32, i32)>;

fn load(path: &std::path::Path, device: Option<u32>) -> Result<Loaded> {
    if path.is_dir() && crate::input::classify(path).is_none() {
        anyhow::bail!(
            "{}: a folder, not a trace: whatif replays one snapshot or trace; run it on each (analyze takes a folder \
             of inputs, and replays each snapshot in it)",
            path.display()
        );
    }
    let loaded = crate::input::allocator_view(crate::input::open(path, device)?)?;
    let meta = loaded.trace.meta.as_ref();
    if let Some(details) = meta.and_then(|m| m.details.snapshot()) {
        let recorded = Settings::from_snapshot(&details.allocator_settings);
        // Copied out: the events go when this returns.
        let streams = streams(&loaded.events, details, loaded.trace.stacks.as_deref())
            .into_iter()
            .map(DeviceStream::into_owned)
            .collect();
        let units = loaded.trace.units.clone();
        return Ok((streams, recorded, details.allocator_settings.clone(), Source::Snapshot, None, units));
    }
    // Requests that are not the program's cannot be replayed as its
    // requests: the replay would "recommend" the settings the program
    // already ran with (a PyTorch program's cudaMallocs are its
    // allocator's segments).
    if meta.is_some_and(|m| m.source == crate::trace::Source::PytorchProfiler) {
        anyhow::bail!(
            "{}: a PyTorch profiler trace's memory events are the blocks of PyTorch's caching allocator, not device \
             allocations, and it holds neither the allocator's segments nor what it had cached before the trace began: \
             replaying them says nothing about PYTORCH_CUDA_ALLOC_CONF. Take a memory snapshot \
             (torch.cuda.memory._record_memory_history, then _dump_snapshot) or record the program with `fragscope \
             record`, and run whatif on that",
            path.display()
        );
    }
    let pytorch = crate::analysis::pytorch_units(&loaded.trace);
    if !pytorch.is_empty() {
        let mut pids: Vec<u32> = pytorch.into_keys().collect();
        pids.sort_unstable();
        anyhow::bail!(
            "{}: process {} ran PyTorch's caching allocator (it mapped libc10_cuda.so), and this recording holds no \
             block events of it (an older `record`, `--no-torch`, or a library without its symbols): its cudaMallocs \
             are PyTorch's segments, not the program's requests, so replaying them says nothing about \
             PYTORCH_CUDA_ALLOC_CONF. Record again without --no-torch (the probes on PyTorch's allocator see every \
             tensor) or take a memory snapshot, and run whatif on that",
            path.display(),
            pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        );
    }
    let streams: Vec<DeviceStream<'static>> =
        device_level_streams(&loaded.events, &pytorch).into_iter().map(DeviceStream::into_owned).collect();
    anyhow::ensure!(!streams.is_empty(), "{}: no device allocations to replay", path.display());
    let capacity = meta.and_then(|m| m.capacity_bytes);
    let units = loaded.trace.units.clone();
    Ok((streams, Settings::default(), serde_json::Value::Null, Source::DeviceLevel, capacity, units))
}

/// A scenario's name as a folder name: `expandable_segments=True`,
/// `max_split_size_mb=64+roundup_power2_divisions=4`.
fn folder(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            ':' => '=',
            ',' => '+',
            c if c.is_ascii_alphanumeric() || "._=+-".contains(c) => c,
            _ => '_',
        })
        .collect()
}

/// Writes every simulated scenario as a trace directory under `dir`
/// (`analyze` and `compare` take them), the scenarios in parallel. A
/// device-level trace's `recorded` scenario is the input itself and is not
/// written again. Each is written to a staging folder and renamed when
/// complete.
fn write_scenarios(
    dir: &std::path::Path,
    input: &std::path::Path,
    devices: &[DeviceStream],
    recorded: &Settings,
    w: &crate::analysis::whatif::Whatif,
) -> Result<()> {
    let todo: Vec<&crate::analysis::whatif::Scenario> =
        w.scenarios.iter().filter(|s| !(s.name == "recorded" && w.source == Source::DeviceLevel)).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(todo.len()).max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(s) = todo.get(i) else { return Ok(()) };
                        write_scenario(dir, input, devices, recorded, w, s)?;
                    }
                })
            })
            .collect();
        workers.into_iter().try_for_each(|h| h.join().map_err(|_| anyhow::anyhow!("a scenario writer panicked"))?)
    })?;
    // A scenario folder an earlier run left that this one did not write
    // would read as one of its scenarios: removed (only the simulated
    // traces `whatif` writes).
    let written: std::collections::HashSet<String> = todo.iter().map(|s| folder(&s.name)).collect();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let meta = e.path().join(crate::trace::META_FILE);
        let simulated = std::fs::read(&meta)
            .ok()
            .and_then(|bytes| crate::trace::parse_meta(&meta, &bytes).ok())
            .is_some_and(|m| m.source == crate::trace::Source::Simulated);
        if !written.contains(&name) && simulated {
            std::fs::remove_dir_all(e.path())
                .with_context(|| format!("cannot remove the old scenario {}", e.path().display()))?;
        }
    }
    Ok(())
}

fn write_scenario(
    dir: &std::path::Path,
    input: &std::path::Path,
    devices: &[DeviceStream],
    recorded: &Settings,
    w: &crate::analysis::whatif::Whatif,
    s: &crate::analysis::whatif::Scenario,
) -> Result<()> {
    let settings =
        settings_of(recorded, std::slice::from_ref(&s.conf)).map_err(|e| anyhow::anyhow!("--conf {e}"))?.remove(0).1;
    let out = dir.join(folder(&s.name));
    let staging = dir.join(format!(".{}.partial", folder(&s.name)));
    let _ = std::fs::remove_dir_all(&staging);
    let mut meta = crate::trace::TraceMeta::new(crate::trace::Source::Simulated);
    meta.capacity_bytes = w.capacity;
    meta.details = crate::trace::details::Details::Other(serde_json::json!({
        "scenario": s.name,
        "conf": s.conf,
        "input": input.display().to_string(),
    }));
    let mut writer = crate::trace::TraceWriter::create(&staging, meta, 1 << 20)?;
    let mut failed: Option<anyhow::Error> = None;
    for d in devices {
        let mut sink = |e: crate::trace::event::Event| {
            if failed.is_none()
                && let Err(err) = writer.push(e)
            {
                failed = Some(err);
            }
        };
        crate::analysis::whatif::simulate_into(d, &settings, w.capacity, &s.name, &s.conf, Some(&mut sink));
    }
    if let Some(e) = failed {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e.context(format!("cannot write scenario {}", s.name)));
    }
    if let Err(e) = writer.finish() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e.context(format!("cannot write scenario {}", s.name)));
    }
    let _ = std::fs::remove_dir_all(&out);
    std::fs::rename(&staging, &out).with_context(|| format!("cannot write {}", out.display()))?;
    Ok(())
}

/// What `fragscope whatif` is asked for.
#[derive(Clone, Debug)]
pub struct Options {
    /// The snapshot (or trace) whose requests are replayed.
    pub input: std::path::PathBuf,
    /// The output directory.
    pub output: std::path::PathBuf,
    /// The scenarios, each as `KEY:VALUE[,KEY:VALUE]` (none: the sweep).
    pub conf: Vec<String>,
    /// Device memory capacity, when given.
    pub capacity: Option<u64>,
    /// Only this device.
    pub device: Option<u32>,
}

/// `fragscope whatif`.
pub fn run(args: &Options) -> Result<u8> {
    let confs: Vec<Vec<String>> =
        args.conf.iter().map(|c| crate::import::settings::split_conf(c).map(str::to_string).collect()).collect();
    // Usage errors before the (long) read: a bad key or value exits 2.
    if let Err(e) = settings_of(&Settings::default(), &confs) {
        eprintln!("error: --conf {e}");
        return Ok(exit::USAGE);
    }
    let started = std::time::Instant::now();
    let (devices, recorded, settings_json, source, trace_capacity, units) = load(&args.input, args.device)?;
    let t = std::time::Instant::now();
    // A device-level trace's failures are not diagnosed here (`analyze`
    // does): its recorded OOMs are taken as the trace explains them.
    let whatif =
        crate::analysis::whatif::run(&devices, &recorded, args.capacity.or(trace_capacity), confs, source, None)
            .map_err(|e| anyhow::anyhow!("--conf {e}"))?;
    tracing::debug!("fidelity and scenarios in {:.3} s", t.elapsed().as_secs_f64());
    let mut report = Report::new(&args.input, settings_json, whatif);
    report.units = units;
    std::fs::create_dir_all(&args.output).with_context(|| format!("cannot create {}", args.output.display()))?;
    let t = std::time::Instant::now();
    write_scenarios(&args.output.join("scenarios"), &args.input, &devices, &recorded, &report.whatif)?;
    tracing::debug!("scenario traces written in {:.3} s", t.elapsed().as_secs_f64());
    let names = ["whatif.json", "whatif.md", "whatif.png"];
    let written = crate::trace::write_atomic(&args.output.join(names[0]), &serde_json::to_vec_pretty(&report.json())?)
        .and_then(|()| crate::trace::write_atomic(&args.output.join(names[1]), report.markdown().as_bytes()))
        .and_then(|()| crate::output::whatif::render_png(&report.whatif, 1600, 700))
        .and_then(|png| png.write_png(&args.output.join(names[2])));
    if let Err(e) = written {
        // No report half written (a full disk, say); each scenario trace
        // written is complete, and the folder holds them.
        crate::trace::discard(&args.output, &names, false);
        return Err(e);
    }
    println!("{}", report.headline());
    println!(
        "  {} in {:.2} s; wrote {}",
        crate::units::plural(report.whatif.scenarios.len() as u64, "scenario", "scenarios"),
        started.elapsed().as_secs_f64(),
        args.output.display()
    );
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::whatif::fidelity;

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
            let (devices, recorded, ..) = load(path, None).unwrap();
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
