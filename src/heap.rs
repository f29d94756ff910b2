//! Memory the process freed, handed back to the kernel on purpose.
//!
//! The binary's allocator is mimalloc (`src/main.rs`). It keeps the pages
//! of freed blocks for reuse and returns them to the kernel only some
//! milliseconds after they were freed, when it next looks at them. A
//! long stream of frees of blocks it has no use for again is kept far
//! longer: converting a 220 MB snapshot frees its 160 MB of parsed trace
//! entries as their events are built, and without a collection those
//! pages stayed resident through the analysis, 100 MiB above what it
//! held (`analyze` peaked at 462 MiB, median of four runs, against 354
//! MiB with collections; a purge at every free, mimalloc's
//! `MIMALLOC_PURGE_DELAY=0`, gives 331 MiB for 14-16 % more time).
//! Called where a pass has freed much that nothing will reuse.

/// Returns the pages freed so far to the kernel. Cheap (well under a
/// millisecond on a snapshot's conversion); without mimalloc as the
/// global allocator (the library's tests) it collects mimalloc's empty
/// heap and does nothing else.
pub fn give_back_freed() {
    // SAFETY: mimalloc's collection takes no pointers; it only works on
    // the calling thread's heap and the process's free pages.
    unsafe { libmimalloc_sys::mi_collect(true) };
}
