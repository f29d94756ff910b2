use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

// The Parquet decoder and the replay allocate and free large buffers all
// the time; mimalloc reuses them instead of returning every one to the
// kernel (as glibc does for large blocks) and zeroing fresh pages again.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    fragscope::trace::install_panic_hook();
    let cli = fragscope::cli::Cli::parse();
    // `fragscope analyze … | head` must end quietly, as Unix tools do, not
    // panic on a closed stdout: the default SIGPIPE action (Rust ignores
    // the signal). Not for `record`, which writes to its own pipes and must
    // never die before its trace is complete.
    if !matches!(cli.command, fragscope::cli::Command::Record(_)) {
        // SAFETY: setting a signal disposition to the default, before any
        // thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
        // mimalloc asks for transparent huge pages on its arenas, so every
        // first touch of a 2 MiB stretch makes the kernel zero all of it,
        // whether or not the process uses it all. Without them analyses
        // are as fast or faster and smaller (BENCHMARKS.md, "Memory
        // pages": `analyze` of the 220 MB snapshot 0.84x the time, of a
        // 4 M-event trace 0.91x, peak RSS 5-11 % lower). Not for `record`:
        // the flag is inherited by the program it starts. A kernel without
        // the flag just keeps huge pages.
        // SAFETY: prctl with integer arguments only.
        unsafe {
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        }
    }
    let default = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
    match fragscope::cli::run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::from(fragscope::exit::ERROR)
        }
    }
}
