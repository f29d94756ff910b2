//! Files compressed as a whole with gzip or zstd, known by their magic
//! bytes, read as their decompressed bytes: one reader for the importers
//! that stream (the profiler's JSON) and for the input stage, which
//! decompresses the others into a temporary file
//! (`input::compressed`).

use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result};

/// How a file is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Gzip,
    Zstd,
}

impl Codec {
    pub fn name(self) -> &'static str {
        match self {
            Codec::Gzip => "gzip",
            Codec::Zstd => "zstd",
        }
    }

    /// The suffixes a file compressed this way usually ends with.
    pub fn suffixes(self) -> &'static [&'static str] {
        match self {
            Codec::Gzip => &[".gz", ".gzip"],
            Codec::Zstd => &[".zst", ".zstd"],
        }
    }
}

/// How a file whose first bytes are `head` is compressed.
pub fn codec_of(head: &[u8]) -> Option<Codec> {
    match head {
        [0x1f, 0x8b, ..] => Some(Codec::Gzip),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Some(Codec::Zstd),
        _ => None,
    }
}

/// `path`'s content, decompressed as `codec` says.
pub fn reader(path: &Path, codec: Codec) -> Result<Box<dyn Read>> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    reader_from(file, codec, path)
}

/// `file`'s bytes (the file at `path`, or its head and the rest of it)
/// decompressed as `codec` says.
pub fn reader_from<R: Read + 'static>(file: R, codec: Codec, path: &Path) -> Result<Box<dyn Read>> {
    Ok(match codec {
        // Several members, as pigz and bgzip write, are one stream.
        Codec::Gzip => Box::new(flate2::read::MultiGzDecoder::new(std::io::BufReader::new(file))),
        Codec::Zstd => Box::new(
            zstd::stream::read::Decoder::new(file)
                .with_context(|| format!("{}: cannot start a zstd decoder", path.display()))?,
        ),
    })
}
