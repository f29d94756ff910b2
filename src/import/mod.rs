//! Importers: other tools' files turned into fragscope traces. Today the
//! PyTorch memory snapshot (`torch.cuda.memory._snapshot()` pickles), read by
//! a restricted [`pickle`] reader and converted by [`snapshot`].

pub mod pickle;
pub mod settings;
pub mod snapshot;
