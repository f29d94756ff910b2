//! Where a virtual address of an ELF file lies in the file: what a uprobe
//! is attached at (`record` attaches by file offset, not by name).

use object::{Object, ObjectSegment};

/// The loadable segments of a file: (address, size in the file, offset).
pub(super) struct FileOffsets(Vec<(u64, u64, u64)>);

impl FileOffsets {
    pub(super) fn of(file: &object::File<'_>) -> FileOffsets {
        FileOffsets(file.segments().map(|s| (s.address(), s.file_range().1, s.file_range().0)).collect())
    }

    /// The file offset of `addr`, through the segment that holds it.
    pub(super) fn at(&self, addr: u64) -> Option<usize> {
        self.0
            .iter()
            .find(|&&(at, size, _)| addr >= at && addr < at + size)
            .and_then(|&(at, _, file_at)| usize::try_from(addr - at + file_at).ok())
    }
}
