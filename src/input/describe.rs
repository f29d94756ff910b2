//! What a path named on the command line is, found once ([`describe`]):
//! the path is looked at once and a file's head read once, and everything
//! downstream (loading, decompressing, the error for a file that is no
//! input) takes the [`Described`] instead of the path.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::Input;
use crate::import::decompress::{Codec, codec_of, reader_from};

/// How much of a file's head (and of its decompressed content) is read to
/// tell what it is.
const HEAD: u64 = 64 << 10;

/// A path, described once.
#[derive(Clone, Debug, PartialEq)]
pub struct Described {
    pub path: PathBuf,
    /// What it holds (None: none of the inputs, or not readable).
    pub kind: Option<Input>,
    /// How a file is compressed, by its magic bytes.
    pub codec: Option<Codec>,
    /// A file's size in bytes (0 for a directory).
    pub size: u64,
    pub is_dir: bool,
    pub is_file: bool,
    /// When it was last modified (dates a trace without a recorded start).
    pub modified: Option<std::time::SystemTime>,
    /// It exists but is neither a regular file nor a directory (a pipe, a
    /// socket, a device): never opened, since opening a FIFO waits for a
    /// writer and its head, once read, would be gone for the import.
    pub irregular: bool,
    /// A compressed file: how many bytes of its content could be read (up
    /// to 64 KiB), and the stream's error if it broke before them.
    pub inner: Option<(usize, Option<String>)>,
}

/// Describes `path`: a directory (a trace, or an Nsight `parquetdir`), or a
/// file by its first 64 KiB (and, compressed, by the first 64 KiB of its
/// content: a snapshot pickle, an Nsight SQLite export, a profiler JSON
/// trace). A plain JSON file is a profiler trace only when named `.json`
/// (or `.json.gz`); inside a compressed file its content alone tells.
pub fn describe(path: &Path) -> Described {
    let mut d = Described {
        path: path.to_path_buf(),
        kind: None,
        codec: None,
        size: 0,
        is_dir: false,
        is_file: false,
        modified: None,
        irregular: false,
        inner: None,
    };
    let Ok(meta) = std::fs::metadata(path) else { return d };
    d.modified = meta.modified().ok();
    if meta.is_file() {
        d.is_file = true;
        describe_file(&mut d, meta.len());
    } else if meta.is_dir() {
        d.is_dir = true;
        d.kind = if crate::trace::Trace::is_trace_dir(path) {
            Some(Input::Trace)
        } else {
            crate::import::nsys::looks_like_parquetdir(path).then_some(Input::Nsys)
        };
    } else {
        d.irregular = true;
    }
    d
}

/// A file's size, codec and kind, from its head (and, compressed, the head
/// of its content).
fn describe_file(d: &mut Described, size: u64) {
    let path = d.path.as_path();
    d.size = size;
    let Ok(mut file) = std::fs::File::open(path) else { return };
    let mut head = Vec::with_capacity(HEAD as usize);
    let _ = (&mut file).take(HEAD).read_to_end(&mut head);
    d.codec = codec_of(&head);
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    d.kind = if crate::import::snapshot::head_is_pickle(&head) {
        Some(Input::Snapshot)
    } else if crate::import::nsys::head_is_sqlite(&head) {
        Some(Input::Nsys)
    } else if let Some(codec) = d.codec {
        // The content: the head's bytes, then the rest of the open file.
        let (inner, err) = match reader_from(std::io::Cursor::new(head).chain(file), codec, path) {
            Ok(r) => {
                let mut inner = Vec::with_capacity(HEAD as usize);
                let err = r.take(HEAD).read_to_end(&mut inner).err().map(|e| e.to_string());
                (inner, err)
            }
            Err(e) => (Vec::new(), Some(format!("{e:#}"))),
        };
        d.inner = Some((inner.len(), err));
        // A stream broken after its head still classifies; the error is
        // reported when the whole is decompressed.
        if crate::import::snapshot::head_is_pickle(&inner) {
            Some(Input::Snapshot)
        } else if crate::import::nsys::head_is_sqlite(&inner) {
            Some(Input::Nsys)
        } else {
            crate::import::profiler::head_is_profiler_trace(&inner).then_some(Input::Profiler)
        }
    } else if (name.ends_with(".json") || name.ends_with(".json.gz"))
        && crate::import::profiler::head_is_profiler_trace(&head)
    {
        Some(Input::Profiler)
    } else {
        None
    };
}
