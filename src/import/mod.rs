//! Importers: other tools' files turned into fragscope traces: the
//! PyTorch memory snapshot (`torch.cuda.memory._snapshot()` pickles), read
//! by a restricted [`pickle`] reader and converted by [`snapshot`]; and
//! the PyTorch profiler's Chrome trace JSON with memory events
//! ([`profiler`]); and Nsight Systems' SQLite exports ([`nsys`]); each
//! maybe compressed ([`decompress`]).

pub mod decompress;
pub mod nsys;
pub mod pickle;
pub mod profiler;
pub mod settings;
pub mod snapshot;

/// Runs an importer's `convert` over `path` and writes what it read as
/// a trace in `out`: every event is read before anything is written, so a
/// bad file leaves no trace directory.
pub(crate) fn import_file(
    path: &std::path::Path,
    out: &std::path::Path,
    source: crate::trace::Source,
    origin: Option<&crate::trace::details::CompressedOrigin>,
    convert: impl FnOnce(
        &std::path::Path,
        &mut dyn FnMut(crate::trace::event::Event) -> anyhow::Result<()>,
    ) -> anyhow::Result<crate::trace::TraceMeta>,
) -> anyhow::Result<crate::trace::TraceMeta> {
    let mut events = Vec::new();
    let meta = convert(path, &mut |e| {
        events.push(e);
        Ok(())
    })?;
    let mut writer = crate::trace::TraceWriter::create(out, crate::trace::TraceMeta::new(source), 1 << 18)?;
    writer.write_behind();
    for e in events {
        if let Err(err) = writer.push(e) {
            writer.abandon();
            return Err(err);
        }
    }
    let mut details = meta.details;
    if let Some(o) = origin {
        details.name_compressed_source(o);
    }
    writer.set_details(details);
    writer.finish()
}
