//! The benchmark's floor: the time polars needs just to scan the replay
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
    let paths: Vec<PlRefPath> = trace.parts.iter().map(|p| PlRefPath::new(p.to_string_lossy().as_ref())).collect();
    let args = ScanArgsParquet { rechunk: true, glob: false, ..Default::default() };
    let df = LazyFrame::scan_parquet_files(paths.into_iter().collect(), args)?
        .select([col("ts_ns"), col("pid"), col("kind"), col("addr"), col("size"), col("ret")])
        .collect()?;
    println!("{} rows in {:.3} s", df.height(), start.elapsed().as_secs_f64());
    Ok(())
}
