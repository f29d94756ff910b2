//! Inputs compressed as a whole with gzip or zstd (`snap.pickle.gz`,
//! `report.sqlite.zst`, `trace.json.zst`): the way big snapshots are
//! shared. Known by their magic bytes, never by their name; what is inside
//! is classified by its own first bytes, as a plain file is.
//!
//! The importers read a file twice (the pickle reader's first pass notes
//! which memo entries are read back) or need one on disk (SQLite), so a
//! compressed input is decompressed once, streaming, into a file of a
//! temporary folder (`TMPDIR`, else `/tmp`) that lives while it is read and
//! is removed after (also on an error; not when the process is killed).
//! It costs the decompressed size there for that time: disk, or memory
//! where `TMPDIR` is a tmpfs (as `/tmp` is on many systems); where there
//! is no room, the error says so and how to point `TMPDIR` elsewhere. A
//! batch holds one copy per job at once. A profiler trace is not
//! decompressed to disk: its importer streams it through the same reader
//! ([`crate::import::decompress`]).
//!
//! A stream that ends early or fails its checksum is an error naming the
//! file: nothing of a partial decompression is analysed.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::Input;
use crate::import::decompress::{Codec, reader};
use crate::trace::details::CompressedOrigin;

/// `name` without a compression suffix (`.gz`, `.zst`, …; any case), or
/// as it is: the input's own name, as a file's extension tells it.
pub fn strip_suffix(name: &str) -> &str {
    let lower = name.to_ascii_lowercase();
    [Codec::Gzip, Codec::Zstd]
        .iter()
        .flat_map(|c| c.suffixes())
        .find_map(|s| lower.strip_suffix(s).map(|k| &name[..k.len()]))
        .filter(|s| !s.is_empty())
        .unwrap_or(name)
}

/// For the error on a file that is no input: how it is compressed, and
/// whether its stream breaks before a head could be read (None: not
/// compressed).
pub fn not_an_input(d: &super::Described) -> Option<String> {
    let codec = d.codec?;
    Some(match &d.inner {
        Some((n, Some(e))) if *n < 16 => format!(
            "; it is compressed with {}, and its stream breaks after {} byte(s) ({e}): a truncated or corrupt file?",
            codec.name(),
            n
        ),
        _ => format!(
            "; it is compressed with {}, and what it holds once decompressed is none of these either",
            codec.name()
        ),
    })
}

/// Whether an input goes through `inflate`: a compressed snapshot or
/// Nsight export (a profiler trace is streamed by its importer,
/// decompressed as it goes).
fn needs_inflating(d: &super::Described) -> Option<Codec> {
    match d.kind {
        Some(Input::Snapshot | Input::Nsys) => d.codec,
        _ => None,
    }
}

/// An input file as an importer reads it: the file itself, or its
/// decompressed copy in a temporary folder (removed when this is dropped),
/// with the compressed file it came from.
pub struct Readable {
    /// The file to read: the input, or its decompressed copy, named as the
    /// input without its compression suffix.
    pub path: PathBuf,
    /// The compressed file, where `path` is its copy.
    pub origin: Option<CompressedOrigin>,
    _dir: Option<tempfile::TempDir>,
}

/// A described input, ready for its importer: decompressed into a
/// temporary folder where [`needs_inflating`] says so.
pub fn readable(d: &super::Described) -> Result<Readable> {
    match needs_inflating(d) {
        None => Ok(Readable { path: d.path.clone(), origin: None, _dir: None }),
        Some(codec) => inflate(&d.path, codec),
    }
}

/// The most a compressed input may grow by: real snapshots and Nsight
/// exports compress 10 to 30 times (gzip -9, zstd -19, on the shared
/// fixtures), so 200 leaves a wide margin, and a decompression bomb (a
/// 2 MB file of 2 GiB) is refused before it fills the disk and then the
/// memory of the import. A file that decompresses to under
/// [`INFLATE_FLOOR`] is never refused.
const MAX_INFLATE_RATIO: u64 = 200;
const INFLATE_FLOOR: u64 = 256 << 20;

/// Decompresses `path` into a temporary folder.
fn inflate(path: &Path, codec: Codec) -> Result<Readable> {
    let packed = std::fs::metadata(path).map_or(0, |m| m.len());
    let limit = packed.saturating_mul(MAX_INFLATE_RATIO).max(INFLATE_FLOOR);
    let started = std::time::Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("fragscope-inflated-")
        .tempdir()
        .with_context(|| format!("{}: cannot create a temporary folder to decompress it into", path.display()))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "input".into());
    let out_path = dir.path().join(strip_suffix(&name));
    let mut out = std::fs::File::create(&out_path).with_context(|| format!("cannot create {}", out_path.display()))?;
    let mut input = reader(path, codec)?;
    // Copied by hand, so that the stream's errors (a truncated or corrupt
    // file) are told from the copy's (no room, a quota, a failing disk).
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context(format!(
                        "the {} stream is broken or ends early (a truncated or corrupt file?); nothing of it was \
                         analysed",
                        codec.name()
                    ))
                    .context(format!("{}: cannot decompress it", path.display())));
            }
        };
        if let Err(e) = std::io::Write::write_all(&mut out, &buf[..k]) {
            let why = if e.kind() == std::io::ErrorKind::StorageFull {
                "no room for the decompressed copy (it needs the decompressed size)"
            } else {
                "cannot write the decompressed copy"
            };
            return Err(anyhow::Error::new(e).context(format!(
                "{}: {why} in {}: set TMPDIR to a folder on a disk with room, or decompress it by hand",
                path.display(),
                dir.path().display()
            )));
        }
        n += k as u64;
        if n > limit {
            anyhow::bail!(
                "{}: decompresses to more than {} from {} bytes (over {}×, and past {}), where real snapshots and \
                 exports grow 10 to 30 times: a decompression bomb, or not an input; nothing of it was analysed \
                 (decompress it by hand if it is genuine)",
                path.display(),
                crate::units::bytes(n),
                packed,
                MAX_INFLATE_RATIO,
                crate::units::bytes(INFLATE_FLOOR)
            );
        }
    }
    tracing::info!(
        "{}: {} decompressed to {} bytes in {:.3} s",
        path.display(),
        codec.name(),
        n,
        started.elapsed().as_secs_f64()
    );
    let origin = CompressedOrigin { path: path.display().to_string(), file_bytes: packed, compression: codec.name() };
    Ok(Readable { path: out_path, origin: Some(origin), _dir: Some(dir) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compression_suffix_is_stripped_whatever_its_case() {
        assert_eq!(strip_suffix("snap.pickle.gz"), "snap.pickle");
        assert_eq!(strip_suffix("Snap.PICKLE.ZST"), "Snap.PICKLE");
        assert_eq!(strip_suffix("report.sqlite.zstd"), "report.sqlite");
        assert_eq!(strip_suffix("trace.json.gzip"), "trace.json");
        assert_eq!(strip_suffix("snap.pickle"), "snap.pickle");
        // Nothing left: the name stays.
        assert_eq!(strip_suffix(".gz"), ".gz");
        assert_eq!(strip_suffix("é.pickle.gz"), "é.pickle");
    }
}
