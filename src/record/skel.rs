//! The BPF skeleton that `build.rs` generates from `bpf/record.bpf.c`
//! (libbpf-cargo): the programs, maps and their loader.

#![allow(unused_imports, clippy::all)]
include!(concat!(env!("OUT_DIR"), "/record.skel.rs"));
