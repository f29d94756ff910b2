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

/// Asserts that nothing is drawn within `px` pixels of the image's border
/// (no clipped or edge-touching text): the frame is all white.
pub fn assert_clear_border(path: &std::path::Path, px: u32) {
    let img = image::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).to_rgb8();
    let (w, h) = img.dimensions();
    for (x, y, p) in img.enumerate_pixels() {
        let on_border = x < px || y < px || x >= w - px || y >= h - px;
        assert!(
            !on_border || p.0 == [255, 255, 255],
            "{}: ink at ({x}, {y}), within {px} px of the border",
            path.display()
        );
    }
}
