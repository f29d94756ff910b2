//! Fuzz target for the importers of single files that are not pickles: a
//! PyTorch-profiler JSON trace, plain or gzip-compressed, and an Nsight
//! Systems SQLite export. The first byte picks the file's name (and so how
//! `input::open` reads it, as `fragscope analyze FILE` would); the rest is
//! the file. Any input must end in an error or an analysis — never a panic,
//! a hang, or an allocation of a size the input merely claims. Run with
//! `bash scripts/fuzz input` (nightly + cargo-fuzz; the seeds are the
//! bundled profiler traces and a generated Nsight export).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use fragscope::analysis::{Options, StepSpec, analyze_events};
use libfuzzer_sys::fuzz_target;

/// The names the first byte picks from, modulo their count.
const NAMES: [&str; 3] = ["trace.json", "trace.json.gz", "export.sqlite"];

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| std::env::temp_dir().join(format!("fragscope-fuzz-input-{}", std::process::id())))
}

fuzz_target!(|data: &[u8]| {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(fragscope::trace::install_panic_hook);
    let Some((&pick, file)) = data.split_first() else { return };
    let dir = scratch();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("scratch directory");
    let path = dir.join(NAMES[pick as usize % NAMES.len()]);
    std::fs::write(&path, file).expect("write the input");
    let Ok(loaded) = fragscope::input::open(&path, None) else { return };
    let opts = Options { step: StepSpec::Events(64), ..Options::default() };
    let _ = analyze_events(loaded.trace, &loaded.events, loaded.out_of_order, &opts);
});
