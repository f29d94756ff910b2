//! The report's "Pinned host memory" section: PyTorch 2.14's host pool,
//! apart from every device ([`crate::trace::details::HostMemory`]).

use std::fmt::Write as _;

use crate::analysis::Analysis;
use crate::units::bytes;

pub(crate) fn host_md(a: &Analysis) -> String {
    let Some(h) = a.trace.meta.as_ref().and_then(|m| m.details.snapshot()).and_then(|d| d.host.as_ref()) else {
        return String::new();
    };
    let mut md = String::from("\n## Pinned host memory\n\n");
    let _ = writeln!(
        md,
        "PyTorch's pinned host allocator (`record_pinned_host_memory=True`), its own pool: none of it is in a \
         device's figures above or below (fragmentation, OOM risk, the memory needed, the what-if), and the \
         timeline draws it in a panel of its own.\n\n| | segments | reserved | allocated |\n|---|---|---|---|\n| at the \
         snapshot | {} | {} | {} |\n| most at once over its {} entries ({} allocations) | | {} | {} |",
        h.segments,
        bytes(h.reserved_bytes),
        bytes(h.allocated_bytes),
        h.entries,
        h.allocations,
        bytes(h.peak_reserved_bytes),
        bytes(h.peak_allocated_bytes),
    );
    md.push_str("\nAllocated counts the bytes the entries name (requested sizes).\n");
    md
}
