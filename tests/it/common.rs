//! Helpers shared by the test modules.

use std::path::Path;

use assert_cmd::Command;
use polars::prelude::*;

/// The `fragscope` binary under test.
pub fn fragscope() -> Command {
    Command::cargo_bin("fragscope").unwrap()
}

/// A hive-partitioned Parquet dataset (the batch summary), read back.
pub fn read_dataset(dir: &Path) -> DataFrame {
    let args = ScanArgsParquet {
        hive_options: HiveOptions { enabled: Some(true), try_parse_dates: false, ..Default::default() },
        ..Default::default()
    };
    LazyFrame::scan_parquet(PlRefPath::new(dir.to_string_lossy().as_ref()), args).unwrap().collect().unwrap()
}
