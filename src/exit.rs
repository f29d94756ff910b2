//! Process exit codes, shared by every command.

pub const OK: u8 = 0;
pub const ERROR: u8 = 1;
/// A usage error (clap's own code for bad arguments).
pub const USAGE: u8 = 2;
pub const GATE: u8 = 3;
