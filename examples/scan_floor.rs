//! The benchmark's floor: the time polars needs just to read the replay
//! columns of a trace (no kind mapping, no replay). Used by `scripts/bench`.

use std::time::Instant;

use polars::prelude::*;

// The same allocator as the fragscope binary, so the floor is comparable.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).ok_or_else(|| anyhow::anyhow!("usage: scan_floor TRACE_DIR"))?;
    let start = Instant::now();
    let trace = fragscope::trace::Trace::open(std::path::Path::new(&dir))?;
    // Each part read eagerly and stacked, as the loader reads them.
    let columns: Vec<String> = ["ts_ns", "pid", "kind", "addr", "size", "ret"].map(String::from).to_vec();
    let mut df: Option<DataFrame> = None;
    for part in &trace.parts {
        let read = ParquetReader::new(std::fs::File::open(part)?).with_columns(Some(columns.clone())).finish()?;
        match &mut df {
            None => df = Some(read),
            Some(df) => {
                df.vstack_mut_owned(read)?;
            }
        }
    }
    let mut df = df.ok_or_else(|| anyhow::anyhow!("{dir}: no parts"))?;
    df.rechunk_mut_par();
    println!("{} rows in {:.3} s", df.height(), start.elapsed().as_secs_f64());
    Ok(())
}
