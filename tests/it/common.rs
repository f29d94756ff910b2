//! Helpers shared by the test modules.

use std::path::Path;

use assert_cmd::Command;
use fragscope::trace::table::Table;

/// The `fragscope` binary under test.
pub fn fragscope() -> Command {
    Command::cargo_bin("fragscope").unwrap()
}

/// A Parquet file read whole, with accessors that panic naming the column
/// (tests only).
pub struct Frame(pub Table);

impl Frame {
    pub fn height(&self) -> usize {
        self.0.height()
    }
    pub fn has(&self, c: &str) -> bool {
        self.0.has(c)
    }
    pub fn nulls(&self, c: &str) -> usize {
        self.0.null_count(c).unwrap()
    }
    pub fn u64s(&self, c: &str) -> Vec<Option<u64>> {
        self.0.ints(c).unwrap()
    }
    pub fn u32s(&self, c: &str) -> Vec<Option<u32>> {
        self.0.ints(c).unwrap()
    }
    pub fn i32s(&self, c: &str) -> Vec<Option<i32>> {
        self.0.ints(c).unwrap()
    }
    pub fn f64s(&self, c: &str) -> Vec<Option<f64>> {
        self.0.floats(c).unwrap()
    }
    pub fn strs(&self, c: &str) -> Vec<Option<String>> {
        self.0.texts(c).unwrap()
    }
    pub fn bools(&self, c: &str) -> Vec<Option<bool>> {
        self.0.bools(c).unwrap()
    }
    /// Every value as text, "null" for nulls.
    pub fn cells(&self, c: &str) -> Vec<String> {
        self.0.cells(c).unwrap().into_iter().map(|v| v.unwrap_or_else(|| "null".into())).collect()
    }
    pub fn names(&self) -> Vec<String> {
        self.0.names()
    }
}

/// A Parquet file, read whole.
pub fn read_parquet(path: &Path) -> Frame {
    Frame(Table::open(path).unwrap_or_else(|e| panic!("{e:#}")))
}

/// A hive-partitioned Parquet dataset (the batch summary), read back: every
/// `KEY=VALUE/…/*.parquet` file below `dir`, with its partition values as
/// string columns, stacked in path order.
pub fn read_dataset(dir: &Path) -> Frame {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, RecordBatch, StringArray};
    use arrow_schema::{Field, Schema};

    fn files(dir: &Path, keys: &[(String, String)], out: &mut Vec<(std::path::PathBuf, Vec<(String, String)>)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for p in entries {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                let (k, v) = name.split_once('=').unwrap_or_else(|| panic!("{}: not KEY=VALUE", p.display()));
                let mut keys = keys.to_vec();
                keys.push((k.to_string(), v.to_string()));
                files(&p, &keys, out);
            } else if name.ends_with(".parquet") {
                out.push((p, keys.to_vec()));
            }
        }
    }
    let mut found = Vec::new();
    files(dir, &[], &mut found);
    let batches: Vec<RecordBatch> = found
        .into_iter()
        .map(|(path, keys)| {
            let batch = read_parquet(&path).0.batch().clone();
            let n = batch.num_rows();
            let mut fields: Vec<Field> = batch.schema().fields().iter().map(|f| f.as_ref().clone()).collect();
            let mut columns: Vec<ArrayRef> = batch.columns().to_vec();
            for (k, v) in keys {
                fields.push(Field::new(k, arrow_schema::DataType::Utf8, false));
                columns.push(Arc::new(StringArray::from(vec![v; n])));
            }
            RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
        })
        .collect();
    let first = batches.first().unwrap_or_else(|| panic!("{}: no Parquet files", dir.display()));
    let all = arrow_select::concat::concat_batches(&first.schema(), &batches).unwrap();
    Frame(Table::from_batch(all, dir.display().to_string()))
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
