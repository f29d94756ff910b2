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

/// A PNG read back as 8-bit RGB (alpha dropped, grey spread to three
/// channels).
pub struct Rgb {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<[u8; 3]>,
}

/// Reads a PNG file as [`Rgb`].
pub fn read_png(path: &Path) -> Rgb {
    let file = std::io::BufReader::new(std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    let mut decoder = png::Decoder::new(file);
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let step = info.color_type.samples();
    let pixels = buf[..info.buffer_size()]
        .chunks_exact(step)
        .map(|p| match step {
            1 | 2 => [p[0]; 3],
            _ => [p[0], p[1], p[2]],
        })
        .collect();
    Rgb { width: info.width, height: info.height, pixels }
}

/// Asserts that nothing is drawn within `px` pixels of the image's border
/// (no clipped or edge-touching text): the frame is all white.
pub fn assert_clear_border(path: &std::path::Path, px: u32) {
    let img = read_png(path);
    let (w, h) = (img.width, img.height);
    for (i, p) in img.pixels.iter().enumerate() {
        let (x, y) = (i as u32 % w, i as u32 / w);
        let on_border = x < px || y < px || x >= w - px || y >= h - px;
        assert!(
            !on_border || *p == [255, 255, 255],
            "{}: ink at ({x}, {y}), within {px} px of the border",
            path.display()
        );
    }
}
