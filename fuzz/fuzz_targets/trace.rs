//! Fuzz target for the trace-directory loader: the input is cut at each
//! `SEPARATOR` into `trace.json` and up to four `events-NNNNN.parquet`
//! parts, written to a scratch directory, then opened, loaded and analysed
//! as `fragscope analyze --no-plots` would. Any input must end in an error
//! or an analysis — never a panic (other than one the loader turns into an
//! error, as the binary does), a hang, or an allocation of a size the
//! input merely claims. Run with `bash scripts/fuzz trace` (nightly +
//! cargo-fuzz; the seeds are a synthetic trace's own files).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use fragscope::analysis::{Options, StepSpec, analyze_events};
use fragscope::trace::Trace;
use libfuzzer_sys::fuzz_target;

const SEPARATOR: &[u8] = b"\n--8<--fragscope-fuzz--8<--\n";

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| std::env::temp_dir().join(format!("fragscope-fuzz-trace-{}", std::process::id())))
}

fn split<'a>(mut data: &'a [u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    while let Some(i) = data.windows(SEPARATOR.len()).position(|w| w == SEPARATOR) {
        out.push(&data[..i]);
        data = &data[i + SEPARATOR.len()..];
    }
    out.push(data);
    out
}

fuzz_target!(|data: &[u8]| {
    // As in the fragscope binary: a panic inside polars' Parquet reader
    // becomes an error (`trace::guarded`), and only then. libFuzzer's own
    // hook (abort on any panic) stays in force everywhere else.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(fragscope::trace::install_panic_hook);
    let dir = scratch();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("scratch directory");
    let pieces = split(data);
    let (json, parts) = pieces.split_first().expect("split gives one piece at least");
    if !json.is_empty() {
        std::fs::write(dir.join("trace.json"), json).expect("write trace.json");
    }
    for (i, part) in parts.iter().take(4).enumerate() {
        std::fs::write(dir.join(format!("events-{i:05}.parquet")), part).expect("write a part");
    }
    let Ok(mut trace) = Trace::open(dir) else { return };
    let Ok((events, out_of_order)) = trace.load_events() else { return };
    // Few steps keep each run fast; the replay still sees every event.
    let opts = Options { step: StepSpec::Events(64), ..Options::default() };
    let _ = analyze_events(trace, &events, out_of_order, &opts);
});
