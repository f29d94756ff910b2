use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

// Polars allocates and frees large buffers all the time; mimalloc reuses
// them instead of returning every one to the kernel (as glibc does for
// large blocks) and zeroing fresh pages again (polars recommends it).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    fragscope::trace::install_panic_hook();
    let cli = fragscope::cli::Cli::parse();
    let default = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
    match fragscope::run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::from(fragscope::exit::ERROR)
        }
    }
}
