//! Importers: other tools' files turned into fragscope traces: the
//! PyTorch memory snapshot (`torch.cuda.memory._snapshot()` pickles), read
//! by a restricted [`pickle`] reader and converted by [`snapshot`]; and
//! the PyTorch profiler's Chrome trace JSON with memory events
//! ([`profiler`]).

pub mod pickle;
pub mod profiler;
pub mod settings;
pub mod snapshot;
