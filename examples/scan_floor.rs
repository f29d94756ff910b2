//! The benchmark's floor: the time the `parquet` crate needs just to decode
//! the replay columns of a trace (no kind mapping, no copy into the event
//! columns, no replay), the parts spread over the cores as the loader
//! spreads them. Used by `scripts/bench`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

// The same allocator as the fragscope binary, so the floor is comparable.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).ok_or_else(|| anyhow::anyhow!("usage: scan_floor TRACE_DIR"))?;
    let start = Instant::now();
    let trace = fragscope::trace::Trace::open(std::path::Path::new(&dir))?;
    let columns = ["ts_ns", "pid", "kind", "addr", "size", "ret"];
    let next = AtomicUsize::new(0);
    let rows = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(trace.parts.len()).max(1);
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<()> {
                    while let Some(part) = trace.parts.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let builder = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(part)?)?;
                        let mask = ProjectionMask::columns(builder.parquet_schema(), columns);
                        for batch in builder.with_projection(mask).with_batch_size(1 << 16).build()? {
                            rows.fetch_add(batch?.num_rows(), Ordering::Relaxed);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| anyhow::anyhow!("a reader thread panicked"))??;
        }
        Ok(())
    })?;
    println!("{} rows in {:.3} s", rows.into_inner(), start.elapsed().as_secs_f64());
    Ok(())
}
