//! Inputs compressed with gzip or zstd (`input::compressed`): each read as
//! its plain file is, named in what is recorded, and a broken stream an
//! error naming the file with nothing written.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use predicates::prelude::*;
use serde_json::Value;

use crate::common::fragscope;

fn gzip(from: &Path, to: &Path) -> PathBuf {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(&fs::read(from).unwrap()).unwrap();
    fs::write(to, enc.finish().unwrap()).unwrap();
    to.to_path_buf()
}

/// With the content checksum, as the `zstd` command writes it.
fn zstd(from: &Path, to: &Path) -> PathBuf {
    let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
    enc.include_checksum(true).unwrap();
    enc.write_all(&fs::read(from).unwrap()).unwrap();
    fs::write(to, enc.finish().unwrap()).unwrap();
    to.to_path_buf()
}

/// `analyze`'s report.md of `input`, with the input's name replaced by
/// `NAME`. It runs with a `TMPDIR` of its own, which must be empty after.
fn report(input: &Path, out: &Path) -> String {
    let tmpdir = tempfile::tempdir().unwrap();
    fragscope().env("TMPDIR", tmpdir.path()).arg("analyze").arg(input).arg("-o").arg(out).assert().success();
    assert_empty(tmpdir.path());
    let name = input.file_name().unwrap().to_string_lossy().into_owned();
    fs::read_to_string(out.join("report.md")).unwrap().replace(&name, "NAME")
}

/// Nothing is left in a `TMPDIR` after a run (the decompressed copy is
/// removed).
fn assert_empty(dir: &Path) {
    let left: Vec<_> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
}

fn details(trace: &Path) -> Value {
    let v: Value = serde_json::from_slice(&fs::read(trace.join("trace.json")).unwrap()).unwrap();
    v["details"].clone()
}

#[test]
fn a_compressed_snapshot_reads_as_the_plain_one_and_is_named_in_what_is_recorded() {
    let Some(g) = crate::snapshots::generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    for name in ["oom", "expandable", "ring"] {
        let plain = g.join(format!("{name}.pickle"));
        let want = report(&plain, &tmp.path().join(format!("{name}-plain")));
        assert!(want.contains("NAME"), "{name}: the report names its input");
        for (codec, file) in [
            ("gzip", gzip(&plain, &tmp.path().join(format!("{name}.pickle.gz")))),
            ("zstd", zstd(&plain, &tmp.path().join(format!("{name}.pickle.zst")))),
        ] {
            let got = report(&file, &tmp.path().join(format!("{name}-{codec}")));
            assert_eq!(got, want, "{name}, {codec}: the report differs from the plain file's");
            let trace = tmp.path().join(format!("{name}-{codec}-trace"));
            let tmpdir = tempfile::tempdir().unwrap();
            fragscope().env("TMPDIR", tmpdir.path()).arg("import").arg(&file).arg("-o").arg(&trace).assert().success();
            assert_empty(tmpdir.path());
            let d = details(&trace);
            assert_eq!(d["snapshot"], file.display().to_string(), "{name}, {codec}");
            assert_eq!(d["file_bytes"], fs::metadata(&file).unwrap().len(), "{name}, {codec}: the compressed size");
            assert_eq!(d["compression"], codec, "{name}");
        }
        // A plain import records no compression.
        let trace = tmp.path().join(format!("{name}-plain-trace"));
        fragscope().arg("import").arg(&plain).arg("-o").arg(&trace).assert().success();
        assert!(details(&trace).get("compression").is_none(), "{name}");
    }
}

#[test]
fn compressed_profiler_traces_and_nsight_exports_read_as_the_plain_ones() {
    let tmp = tempfile::tempdir().unwrap();
    // The bundled profiler trace is gzip (streamed by its importer); its
    // JSON compressed with zstd goes through a decompressed copy.
    let gz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/profiler/h100_torch2.11_mlp.pt.trace.json.gz");
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(fs::File::open(&gz).unwrap()), &mut json).unwrap();
    let plain = tmp.path().join("mlp.pt.trace.json");
    fs::write(&plain, &json).unwrap();
    let want = report(&plain, &tmp.path().join("p-plain"));
    assert_eq!(report(&gz, &tmp.path().join("p-gz")), want);
    let zst = zstd(&plain, &tmp.path().join("mlp.pt.trace.json.zst"));
    assert_eq!(report(&zst, &tmp.path().join("p-zst")), want);
    // Streamed, not copied: its own importer names the compression.
    for (file, codec) in [(&gz, "gzip"), (&zst, "zstd")] {
        let trace = tmp.path().join(format!("p-trace-{codec}"));
        fragscope().arg("import").arg(file).arg("-o").arg(&trace).assert().success();
        assert_eq!(details(&trace)["profiler_trace"], file.display().to_string());
        assert_eq!(details(&trace)["compression"], codec);
    }

    let Some(sqlite) = crate::nsys::generate(tmp.path(), &[]) else { return };
    let want = report(&sqlite, &tmp.path().join("n-plain"));
    let gz = gzip(&sqlite, &tmp.path().join("report.sqlite.gz"));
    assert_eq!(report(&gz, &tmp.path().join("n-gz")), want);
    let trace = tmp.path().join("n-trace");
    fragscope().arg("import").arg(&gz).arg("-o").arg(&trace).assert().success();
    assert_eq!(details(&trace)["nsys_export"], gz.display().to_string());
    assert_eq!(details(&trace)["compression"], "gzip");
}

#[test]
fn a_folder_of_inputs_finds_compressed_files_by_their_content() {
    let Some(g) = crate::snapshots::generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    fs::create_dir(&dir).unwrap();
    gzip(&g.join("oom.pickle"), &dir.join("a.pickle.gz"));
    // No telling name: the content decides.
    zstd(&g.join("basic.pickle"), &dir.join("b"));
    // A compressed file that is no input is skipped, as a README is.
    gzip(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md").as_path(), &dir.join("readme.gz"));
    let out = tmp.path().join("out");
    fragscope()
        .arg("analyze")
        .arg(&dir)
        .arg("-o")
        .arg(&out)
        .assert()
        .success()
        .stdout(predicate::str::contains("2 traces analysed, 0 failed"));
    assert!(out.join("a.pickle.gz/report.md").is_file());
    assert!(out.join("b/report.md").is_file());
}

#[test]
fn a_broken_compressed_stream_is_an_error_naming_the_file_and_writes_nothing() {
    let Some(g) = crate::snapshots::generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // Several zstd blocks (128 KiB each): a cut after the first still
    // classifies by its head.
    let plain = g.join("two_devices.pickle");
    for (codec, file, why) in [
        ("gzip", gzip(&plain, &tmp.path().join("s.pickle.gz")), "the gzip stream is broken or ends early"),
        ("zstd", zstd(&plain, &tmp.path().join("s.pickle.zst")), "the zstd stream is broken or ends early"),
    ] {
        let bytes = fs::read(&file).unwrap();
        // Cut after the head (so it still classifies as a snapshot) but
        // before the end.
        assert!(bytes.len() > 4096, "{codec}: the test needs a longer stream");
        let cut = tmp.path().join(format!("cut-{}", file.file_name().unwrap().to_string_lossy()));
        fs::write(&cut, &bytes[..bytes.len() * 7 / 8]).unwrap();
        for cmd in ["analyze", "import"] {
            let out = tmp.path().join(format!("out-{codec}-{cmd}"));
            let tmpdir = tempfile::tempdir().unwrap();
            fragscope()
                .env("TMPDIR", tmpdir.path())
                .arg(cmd)
                .arg(&cut)
                .arg("-o")
                .arg(&out)
                .assert()
                .code(1)
                .stderr(predicate::str::contains(cut.display().to_string()))
                .stderr(predicate::str::contains(why))
                .stderr(predicate::str::contains("panicked").not());
            assert!(!out.exists(), "{codec}, {cmd}: an output was written for a broken file");
            assert_empty(tmpdir.path());
        }
        // A flipped byte in the middle fails the stream or its checksum
        // (gzip's CRC-32; zstd's content checksum, which the `zstd`
        // command writes by default).
        let mut flipped = bytes.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0xff;
        let bad = tmp.path().join(format!("flip-{}", file.file_name().unwrap().to_string_lossy()));
        fs::write(&bad, &flipped).unwrap();
        fragscope()
            .arg("analyze")
            .arg(&bad)
            .arg("-o")
            .arg(tmp.path().join(format!("out-flip-{codec}")))
            .assert()
            .code(1)
            .stderr(predicate::str::contains(bad.display().to_string()))
            .stderr(predicate::str::contains("panicked").not());
    }
    // Cut inside its first bytes: nothing to classify, and the error says
    // why rather than "none of the files".
    let file = gzip(&plain, &tmp.path().join("t.pickle.gz"));
    let head = tmp.path().join("head.pickle.gz");
    fs::write(&head, &fs::read(&file).unwrap()[..40]).unwrap();
    fragscope()
        .arg("analyze")
        .arg(&head)
        .arg("-o")
        .arg(tmp.path().join("out-head"))
        .assert()
        .code(1)
        .stderr(predicate::str::contains("it is compressed with gzip, and its stream breaks after"));
    // A compressed file of something else says what it is not.
    let text = gzip(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md").as_path(), &tmp.path().join("r.gz"));
    for cmd in ["analyze", "import"] {
        fragscope()
            .arg(cmd)
            .arg(&text)
            .arg("-o")
            .arg(tmp.path().join(format!("out-text-{cmd}")))
            .assert()
            .code(1)
            .stderr(predicate::str::contains("what it holds once decompressed is none of these either"));
    }
}

#[test]
fn without_a_temporary_folder_the_error_names_the_file() {
    let Some(g) = crate::snapshots::generated() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let file = gzip(&g.join("basic.pickle"), &tmp.path().join("s.pickle.gz"));
    let out = tmp.path().join("out");
    fragscope()
        .env("TMPDIR", tmp.path().join("no-such-folder"))
        .arg("analyze")
        .arg(&file)
        .arg("-o")
        .arg(&out)
        .assert()
        .code(1)
        .stderr(predicate::str::contains(file.display().to_string()))
        .stderr(predicate::str::contains("cannot create a temporary folder to decompress it into"));
    assert!(!out.exists());
}

/// A decompression bomb (a few MB that inflate to hundreds: here 320 MiB
/// of NONE opcodes, 1 000 times its size) is refused as it inflates, with
/// nothing written, instead of filling the disk and then the memory.
#[test]
fn a_decompression_bomb_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let bomb = tmp.path().join("bomb.pickle.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    enc.write_all(&[0x80, 4]).unwrap();
    let chunk = vec![b'N'; 1 << 20];
    for _ in 0..320 {
        enc.write_all(&chunk).unwrap();
    }
    enc.write_all(b".").unwrap();
    fs::write(&bomb, enc.finish().unwrap()).unwrap();
    let out = tmp.path().join("out");
    fragscope().arg("analyze").arg(&bomb).arg("-o").arg(&out).env("TMPDIR", tmp.path()).assert().code(1).stderr(
        predicate::str::contains("bomb.pickle.gz: decompresses to more than")
            .and(predicate::str::contains("(over 200×, and past 256.00 MiB)")),
    );
    assert!(!out.exists());
    // Its temporary copy is gone too.
    let left: Vec<_> = fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("bomb.pickle.gz")]);
}
