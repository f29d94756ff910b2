//! Compiles the eBPF recorder (`bpf/record.bpf.c`) and generates its
//! libbpf-rs skeleton, when the `record` feature is on. Needs clang and
//! the kernel's user-space headers (scripts/install-deps installs them).

fn main() {
    #[cfg(feature = "record")]
    record::build();
}

#[cfg(feature = "record")]
mod record {
    use std::env;
    use std::path::PathBuf;

    use libbpf_cargo::SkeletonBuilder;

    const SRC: &str = "bpf/record.bpf.c";

    pub fn build() {
        let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo")).join("record.skel.rs");
        let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
        // <asm/ptrace.h> lives in the multiarch include directory on Debian.
        let multiarch = format!("-I/usr/include/{arch}-linux-gnu");
        if let Err(e) = SkeletonBuilder::new().source(SRC).clang_args([multiarch.as_str()]).build_and_generate(&out) {
            panic!(
                "cannot build {SRC}: {e:#}\n\
                 The recorder needs clang, libelf-dev, zlib1g-dev and pkg-config: run `bash scripts/install-deps`, \
                 or build without it: `cargo build --no-default-features`."
            );
        }
        println!("cargo:rerun-if-changed={SRC}");
        println!("cargo:rerun-if-changed=bpf/record.h");
    }
}
