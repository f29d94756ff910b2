//! Batch analysis for CI: the hive-partitioned summary dataset read back
//! by fragscope's reader and by DuckDB (or pyarrow), and the grouping of traces by
//! their problem on a population of known patterns.

use std::fs;
use std::path::{Path, PathBuf};

use crate::common::{fragscope, read_dataset};
use fragscope::analysis::cluster::adjusted_rand_index;
use serde_json::Value;

/// 10 traces each of `steady`, `fragmenting` and `leak` (different seeds),
/// analysed as one batch.
fn population(tmp: &Path) -> PathBuf {
    let runs = tmp.join("runs");
    for pattern in ["steady", "fragmenting", "leak"] {
        for seed in 1..=10 {
            fragscope()
                .args(["synth", "--pattern", pattern, "--events", "20k", "--seed", &seed.to_string(), "-o"])
                .arg(runs.join(format!("{pattern}-{seed}")))
                .assert()
                .success();
        }
    }
    let out = tmp.join("out");
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "--jobs", "2", "-o"]).arg(&out).assert().success();
    out
}

#[test]
fn known_patterns_are_grouped_and_the_dataset_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let out = population(tmp.path());

    // The dataset: one folder per (source, date), read in place.
    let parts: Vec<_> = fs::read_dir(out.join("summary.parquet")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(parts, vec!["source=synthetic"]);
    let df = read_dataset(&out.join("summary.parquet"));
    assert_eq!(df.height(), 30);
    let source: Vec<String> = df.strs("source").into_iter().flatten().collect();
    assert!(source.iter().all(|s| s == "synthetic"));
    assert!(df.has("date"));
    let names: Vec<String> = df.strs("trace").into_iter().flatten().collect();
    let clusters: Vec<usize> =
        df.u32s("cluster").into_iter().map(|c| c.expect("every trace has a group") as usize).collect();
    let labels: Vec<String> = df.strs("cluster_label").into_iter().flatten().collect();

    // The groups recover the patterns: no group mixes two of them, and
    // each is named for its pattern. Since leak verdicts use exact floors
    // the gap statistic splits `steady` and `fragmenting` into two pure
    // sub-groups each (k = 5, adjusted Rand index 0.73 against the three
    // patterns); it chose k = 3 before.
    let truth: Vec<usize> = names
        .iter()
        .map(|n| ["steady", "fragmenting", "leak"].iter().position(|p| n.starts_with(p)).unwrap())
        .collect();
    let mut distinct = clusters.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!((3..=5).contains(&distinct.len()), "k chosen by the gap statistic: {}", distinct.len());
    for &c in &distinct {
        let mut patterns: Vec<usize> = (0..names.len()).filter(|&i| clusters[i] == c).map(|i| truth[i]).collect();
        patterns.dedup();
        assert_eq!(patterns.len(), 1, "group {c} mixes patterns: {names:?} {clusters:?}");
    }
    let ari = adjusted_rand_index(&clusters, &truth);
    assert!(ari >= 0.7, "adjusted Rand index {ari}");
    let label_of = |pattern: &str| {
        let i = names.iter().position(|n| n.starts_with(pattern)).unwrap();
        labels[i].clone()
    };
    assert!(label_of("steady").starts_with("healthy"), "{}", label_of("steady"));
    assert!(label_of("fragmenting").starts_with("fragmentation-bound"), "{}", label_of("fragmenting"));
    assert_eq!(label_of("leak"), "leaking");
    // `leaking` is the trace's report.json answer: true, false only for
    // "not leaking", null for "cannot tell".
    for (name, leaking) in names.iter().zip(df.bools("leaking")) {
        let r: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(out.join(name).join("report.json")).unwrap()).unwrap();
        let verdict = r["summary"]["leak_verdict"].as_str().unwrap();
        let want = match verdict {
            "leaking" => Some(true),
            "not leaking" => Some(false),
            _ => None,
        };
        assert_eq!(leaking, want, "{name}: {verdict}");
        assert_eq!(leaking == Some(true), name.starts_with("leak"), "{name}: {verdict}");
    }
    let md = fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        md.contains("## Groups") && md.contains(&format!("k = {} chosen by the gap statistic", distinct.len())),
        "{md}"
    );
    let csv = fs::read_to_string(out.join("summary.csv")).unwrap();
    assert!(csv.lines().next().unwrap().ends_with("cluster,cluster_label"));

    // DuckDB (or pyarrow) reads the same dataset in place.
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/pyenv/bin/python3");
    let python = if venv.is_file() { venv } else { PathBuf::from("python3") };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/readback-summary.py");
    let result = std::process::Command::new(&python).arg(&script).arg(out.join("summary.parquet")).output();
    match result {
        Ok(o) if o.status.success() => {
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            eprintln!("read back with {}", v["engine"]);
            assert_eq!(v["rows"], 30);
            assert_eq!(v["sources"], serde_json::json!(["synthetic"]));
            let healthy: u64 = v["labels"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.starts_with("healthy"))
                .map(|(_, n)| n.as_u64().unwrap())
                .sum();
            assert_eq!(healthy, 10, "{}", v["labels"]);
            assert!(v["worst"].as_str().unwrap().starts_with("fragmenting"));
        }
        other => {
            let required = std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() == Ok("1");
            assert!(!required, "DuckDB/pyarrow read-back failed and FRAGSCOPE_REQUIRE_PYTHON=1: {other:?}");
            eprintln!("skipped: neither DuckDB nor pyarrow could read the dataset ({other:?})");
        }
    }
}

#[test]
fn small_batches_are_not_grouped() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    for seed in 1..=3 {
        fragscope()
            .args(["synth", "--pattern", "steady", "--events", "5k", "--seed", &seed.to_string(), "-o"])
            .arg(runs.join(format!("s{seed}")))
            .assert()
            .success();
    }
    let out = tmp.path().join("out");
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "-o"]).arg(&out).assert().success();
    let df = read_dataset(&out.join("summary.parquet"));
    assert_eq!(df.height(), 3);
    assert_eq!(df.nulls("cluster"), 3);
    assert!(fs::read_to_string(out.join("summary.md")).unwrap().contains("Groups: not computed"));
}

/// Every file under `dir` (relative path → bytes).
fn files(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned(), fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// The dataset's rows, sorted by trace, as csv text (parts may differ).
fn dataset_rows(dir: &Path) -> String {
    let df = read_dataset(dir);
    let traces = df.cells("trace");
    let mut order: Vec<usize> = (0..df.height()).collect();
    order.sort_by(|&a, &b| traces[a].cmp(&traces[b]));
    let mut text = String::new();
    for c in df.names() {
        let cells = df.cells(&c);
        let values: Vec<&str> = order.iter().map(|&i| cells[i].as_str()).collect();
        text += &format!("{c}: {}\n", values.join(","));
    }
    text
}

#[test]
fn shards_cover_the_batch_and_summarize_equals_the_unsharded_run() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    for (k, pattern) in ["steady", "fragmenting", "leak"].iter().enumerate() {
        for seed in 1..=7 {
            fragscope()
                .args(["synth", "--pattern", pattern, "--events", "12k", "--seed", &(seed + 10 * k).to_string(), "-o"])
                .arg(runs.join(format!("{pattern}-{seed}")))
                .assert()
                .success();
        }
    }
    let all = tmp.path().join("all");
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "-o"]).arg(&all).assert().success();

    // Three shards, the inputs listed differently each time: the directory,
    // its traces one by one in reverse, and the directory again.
    let sharded = tmp.path().join("sharded");
    let mut listed: Vec<PathBuf> = fs::read_dir(&runs).unwrap().map(|e| e.unwrap().path()).collect();
    listed.sort();
    listed.reverse();
    let mut held = 0;
    for i in 0..3 {
        let mut cmd = fragscope();
        cmd.arg("analyze");
        if i == 1 {
            cmd.args(&listed)
        } else {
            cmd.arg(&runs)
        };
        let out = cmd.args(["--no-plots", "--shard", &format!("{i}/3"), "-o"]).arg(&sharded).assert().success();
        let stdout = String::from_utf8_lossy(&out.get_output().stdout).into_owned();
        assert!(stdout.contains(&format!("shard {i}/3")) && stdout.contains("fragscope summarize"), "{stdout}");
        assert!(!sharded.join("summary.csv").exists(), "a shard does not write the summary");
        let parts: Vec<String> = files(&sharded.join("summary.parquet")).into_keys().collect();
        let own: Vec<&String> = parts.iter().filter(|p| p.ends_with(&format!("part-{i}-of-3.parquet"))).collect();
        let rows = read_dataset(&sharded.join("summary.parquet")).height();
        assert!(rows > held, "shard {i}/3 added no rows ({parts:?})");
        assert!(!own.is_empty());
        held = rows;
    }
    // Disjoint and covering: 21 rows, 21 distinct traces, every folder.
    let df = read_dataset(&sharded.join("summary.parquet"));
    assert_eq!(df.height(), 21);
    assert_eq!(df.strs("trace").into_iter().collect::<std::collections::BTreeSet<_>>().len(), 21);
    assert_eq!(df.nulls("cluster"), 21, "groups wait for summarize");
    for e in fs::read_dir(&runs).unwrap() {
        assert!(sharded.join(e.unwrap().file_name()).join("report.md").is_file());
    }

    let out = fragscope().arg("summarize").arg(&sharded).assert().success();
    let stdout = String::from_utf8_lossy(&out.get_output().stdout).into_owned();
    assert!(stdout.contains("21 traces, 0 failed, 3 groups"), "{stdout}");
    for f in ["summary.csv", "summary.md", "index.html"] {
        assert_eq!(
            fs::read_to_string(sharded.join(f)).unwrap(),
            fs::read_to_string(all.join(f)).unwrap(),
            "{f} differs from the unsharded run's"
        );
    }
    assert_eq!(dataset_rows(&sharded.join("summary.parquet")), dataset_rows(&all.join("summary.parquet")));
    assert!(fs::read_to_string(sharded.join("summary.md")).unwrap().contains("k = 3 chosen by the gap statistic"));

    // A re-run of shard 1 replaces its own parts and touches no other.
    let before = files(&sharded.join("summary.parquet"));
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "--shard", "1/3", "-o"]).arg(&sharded).assert().success();
    let after = files(&sharded.join("summary.parquet"));
    assert_eq!(before.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>());
    for (k, v) in &before {
        if k.ends_with("part-1-of-3.parquet") {
            assert_ne!(&after[k], v, "{k} was not rewritten");
        } else {
            assert_eq!(&after[k], v, "{k} was touched by another shard");
        }
    }

    // A part left over from a run with another shard count is named.
    let (stale, bytes) = before.iter().find(|(k, _)| k.ends_with("part-0-of-3.parquet")).unwrap();
    let copy = sharded.join("summary.parquet").join(stale.replace("part-0-of-3", "part-4-of-5"));
    fs::write(&copy, bytes).unwrap();
    let out = fragscope().arg("summarize").arg(&sharded).assert().code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(stderr.contains("part-4-of-5.parquet") && stderr.contains("two summary parts"), "{stderr}");
    fs::remove_file(&copy).unwrap();
    // A shard's part lost (or never written): summarize says so.
    let (one, bytes) = before.iter().find(|(k, _)| k.ends_with("part-1-of-3.parquet")).unwrap();
    let one = sharded.join("summary.parquet").join(one);
    fs::remove_file(&one).unwrap();
    let out = fragscope().arg("summarize").arg(&sharded).assert().success();
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(stderr.contains("no part of 1 shard (1/3) in any partition"), "{stderr}");
    // The same part under another shard count, with no trace in two parts:
    // the two counts are named.
    let other = one.with_file_name("part-1-of-4.parquet");
    fs::write(&other, bytes).unwrap();
    let out = fragscope().arg("summarize").arg(&sharded).assert().code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(stderr.contains("parts of 2 sharded runs (part-*-of-3, part-*-of-4)"), "{stderr}");
    fs::remove_file(&other).unwrap();
    fs::write(&copy, bytes).unwrap();
    // The unsharded run owns the whole dataset: the stale part goes.
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "-o"]).arg(&sharded).assert().success();
    assert!(!copy.exists());
    assert_eq!(dataset_rows(&sharded.join("summary.parquet")), dataset_rows(&all.join("summary.parquet")));
}

#[test]
fn bad_shard_specs_and_empty_summaries_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for bad in ["3/2", "0/0", "1", "x/4"] {
        let out = fragscope()
            .arg("analyze")
            .arg(tmp.path())
            .args(["--shard", bad, "-o"])
            .arg(tmp.path().join("out"))
            .assert()
            .code(2);
        let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
        assert!(stderr.contains("I/N"), "{bad}: {stderr}");
    }
    let out = fragscope().arg("summarize").arg(tmp.path()).assert().code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(stderr.contains("no summary parts") && stderr.contains(&tmp.path().display().to_string()), "{stderr}");
}

/// scripts/ray-batch.py on a local Ray cluster (2 CPUs): one task per
/// shard, then summarize; the summary equals the unsharded run's.
#[test]
fn the_ray_driver_matches_the_unsharded_run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/pyenv/bin/python3");
    let has_ray =
        std::process::Command::new(&python).args(["-c", "import ray"]).output().is_ok_and(|o| o.status.success());
    if !has_ray {
        let required = std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() == Ok("1");
        assert!(!required, "target/pyenv lacks ray (scripts/install-deps installs it) and FRAGSCOPE_REQUIRE_PYTHON=1");
        eprintln!("skipped: target/pyenv lacks ray (scripts/install-deps installs it)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let patterns = ["steady", "fragmenting", "leak", "filling"];
    for i in 0..20 {
        fragscope()
            .args(["synth", "--pattern", patterns[i % 4], "--events", "3k", "--seed", &i.to_string(), "-o"])
            .arg(runs.join(format!("{}-{i}", patterns[i % 4])))
            .assert()
            .success();
    }
    let all = tmp.path().join("all");
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "-o"]).arg(&all).assert().success();
    let ray = tmp.path().join("ray");
    let bin = assert_cmd::cargo::cargo_bin("fragscope");
    let out = std::process::Command::new(&python)
        .arg(root.join("scripts/ray-batch.py"))
        .arg(&runs)
        .arg("-o")
        .arg(&ray)
        .args(["--num-cpus", "2", "--shards", "4", "--fragscope"])
        .arg(&bin)
        .args(["--", "--no-plots"])
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ray-batch.py failed: {stderr}");
    for i in 0..4 {
        assert!(stderr.contains(&format!("shard {i}/4: exit 0")), "{stderr}");
    }
    for f in ["summary.csv", "summary.md"] {
        assert_eq!(fs::read_to_string(ray.join(f)).unwrap(), fs::read_to_string(all.join(f)).unwrap(), "{f}");
    }
    assert_eq!(dataset_rows(&ray.join("summary.parquet")), dataset_rows(&all.join("summary.parquet")));
}

/// moto's S3 server on 127.0.0.1, killed on drop.
struct S3Server {
    child: std::process::Child,
    endpoint: String,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `code` in target/pyenv's Python with boto3 pointed at `endpoint`
/// (`s3` in scope); panics with its stderr on failure.
fn boto(endpoint: &str, code: &str) -> String {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/pyenv/bin/python3");
    let script = format!(
        "import boto3, os, sys\ns3 = boto3.client('s3', endpoint_url='{endpoint}', aws_access_key_id='test', aws_secret_access_key='test', region_name='us-east-1')\n{code}"
    );
    let out = std::process::Command::new(python).args(["-c", &script]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn object_store_inputs_and_outputs_work_against_a_local_s3_server() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let moto = root.join("target/pyenv/bin/moto_server");
    if !moto.is_file() {
        let required = std::env::var("FRAGSCOPE_REQUIRE_PYTHON").as_deref() == Ok("1");
        assert!(!required, "target/pyenv lacks moto (scripts/install-deps installs it) and FRAGSCOPE_REQUIRE_PYTHON=1");
        eprintln!("skipped: target/pyenv lacks moto (scripts/install-deps installs it)");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server = S3Server {
        child: std::process::Command::new(&moto)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
        endpoint: format!("http://127.0.0.1:{port}"),
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(std::time::Instant::now() < deadline, "moto_server did not start");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    for (i, pattern) in ["steady", "fragmenting", "leak", "filling", "steady", "leak"].iter().enumerate() {
        // One name that object_store percent-encodes in keys.
        let name = if i == 5 { format!("{pattern} [{i}] 50%") } else { format!("{pattern}-{i}") };
        fragscope()
            .args(["synth", "--pattern", pattern, "--events", "3k", "--seed", &i.to_string(), "-o"])
            .arg(runs.join(name))
            .assert()
            .success();
    }
    let all = tmp.path().join("all");
    fragscope().arg("analyze").arg(&runs).args(["--no-plots", "-o"]).arg(&all).assert().success();
    boto(
        &server.endpoint,
        &format!(
            "s3.create_bucket(Bucket='fleet')\nroot = {:?}\nfor d, _, fs in os.walk(root):\n    for f in fs:\n        p = os.path.join(d, f)\n        s3.upload_file(p, 'fleet', 'runs/' + os.path.relpath(p, root))\ns3.put_object(Bucket='fleet', Key='runs/README.md', Body=b'not a trace')\ns3.put_object(Bucket='fleet', Key='runs/_SUCCESS', Body=b'')",
            runs.display().to_string()
        ),
    );
    let s3 = |cmd: &mut assert_cmd::Command| {
        cmd.env("AWS_ENDPOINT_URL", &server.endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1");
    };
    // Two shards reading and writing the bucket, then summarize there.
    for i in 0..2 {
        let mut cmd = fragscope();
        s3(&mut cmd);
        cmd.args(["analyze", "s3://fleet/runs", "-o", "s3://fleet/out", "--no-plots", "--shard", &format!("{i}/2")])
            .assert()
            .success();
    }
    let mut cmd = fragscope();
    s3(&mut cmd);
    cmd.args(["summarize", "s3://fleet/out"]).assert().success();
    // The fleet classes read the summary dataset in the bucket (one sample
    // per trace), here beside the same traces on disk (one per process).
    let mut cmd = fragscope();
    s3(&mut cmd);
    let model = tmp.path().join("fleet.classes");
    let fit = cmd.args(["classes", "fit", "s3://fleet/out/summary.parquet"]).arg(&runs).arg("-o").arg(&model).assert();
    let said = String::from_utf8_lossy(&fit.success().get_output().stdout).to_string();
    assert!(said.contains("from 12 samples"), "{said}");
    let listing = boto(
        &server.endpoint,
        "for o in s3.list_objects_v2(Bucket='fleet', Prefix='out/')['Contents']: print(o['Key'])",
    );
    for i in 0..2 {
        assert!(listing.contains(&format!("part-{i}-of-2.parquet")), "{listing}");
    }
    assert!(listing.contains("out/steady-0/report.md") && listing.contains("out/index.html"), "{listing}");
    assert!(listing.contains("out/leak [5] 50%/report.md"), "{listing}");
    assert!(!listing.contains("README") && !listing.contains("_SUCCESS"), "{listing}");
    let csv = boto(
        &server.endpoint,
        "sys.stdout.write(s3.get_object(Bucket='fleet', Key='out/summary.csv')['Body'].read().decode())",
    );
    assert_eq!(csv, fs::read_to_string(all.join("summary.csv")).unwrap());

    // A prefix that is itself one trace directory is one trace.
    let mut cmd = fragscope();
    s3(&mut cmd);
    cmd.args(["analyze", "s3://fleet/runs/steady-0/", "-o", "s3://fleet/single", "--no-plots"]).assert().success();
    let listing = boto(
        &server.endpoint,
        "for o in s3.list_objects_v2(Bucket='fleet', Prefix='single/')['Contents']: print(o['Key'])",
    );
    assert!(listing.contains("single/steady-0/report.md") && listing.contains("single/summary.md"), "{listing}");

    // An unreachable store: a clear error naming the URL, before any work.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = fragscope()
        .env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{closed}"))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .arg("analyze")
        .arg(&runs)
        .args(["-o", "s3://fleet/elsewhere", "--no-plots"])
        .assert()
        .code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(stderr.contains("s3://fleet/elsewhere"), "{stderr}");
    // A missing bucket names it.
    let mut cmd = fragscope();
    s3(&mut cmd);
    let out = cmd.args(["summarize", "s3://nobucket/out"]).assert().code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(stderr.contains("s3://nobucket/out") && stderr.contains("NoSuchBucket"), "{stderr}");

    // Missing credentials: with no keys in the environment object_store
    // asks the instance-metadata endpoint, here a closed loopback port
    // (AWS_METADATA_ENDPOINT) instead of 169.254.169.254. A clear error
    // naming the URL, in bounded time, and the parts another shard wrote
    // before stay.
    let mut cmd = fragscope();
    s3(&mut cmd);
    cmd.args(["analyze", "s3://fleet/runs", "-o", "s3://fleet/keep", "--no-plots", "--shard", "0/2"])
        .assert()
        .success();
    let keep = |server: &S3Server| {
        let mut parts: Vec<String> = boto(
            &server.endpoint,
            "for o in s3.list_objects_v2(Bucket='fleet', Prefix='keep/')['Contents']: print(o['Key'], o['Size'])",
        )
        .lines()
        .filter(|l| l.contains(".parquet"))
        .map(str::to_string)
        .collect();
        parts.sort();
        parts
    };
    let before = keep(&server);
    assert!(!before.is_empty());
    let started = std::time::Instant::now();
    let mut cmd = fragscope();
    for var in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ] {
        cmd.env_remove(var);
    }
    let out = cmd
        .env("AWS_ENDPOINT_URL", &server.endpoint)
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_METADATA_ENDPOINT", format!("http://127.0.0.1:{closed}"))
        .args(["analyze", "s3://fleet/runs", "-o", "s3://fleet/keep", "--no-plots", "--shard", "1/2"])
        .assert()
        .code(1);
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(stderr.contains("s3://fleet/"), "{stderr}");
    assert!(stderr.contains("AWS_ACCESS_KEY_ID"), "{stderr}");
    assert!(took < std::time::Duration::from_secs(60), "took {took:?}");
    eprintln!("missing credentials: exit 1 after {took:?}");
    assert_eq!(keep(&server), before, "the parts shard 0 wrote stay");
}
