//! Fuzz target for the snapshot pickle reader: any byte string must give a
//! value or an error — never a panic, a hang, or an allocation of a size the
//! input merely claims. Run with `bash scripts/fuzz` (nightly + cargo-fuzz).
#![no_main]

#[path = "../../src/import/pickle.rs"]
#[allow(dead_code)]
mod pickle;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = pickle::parse(data);
    // The streaming path with a hook that consumes some items, as the
    // snapshot reader's does.
    let _ = pickle::parse_stream(|| Ok(data), data.len(), &mut |_, v| {
        Ok(if v.as_int().is_some_and(|i| i % 2 == 0) { None } else { Some(v) })
    });
});
