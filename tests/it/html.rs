//! `report.html` and `index.html`: self-contained pages (no external URL,
//! pictures inline), rendered by a real browser — headless Chromium,
//! installed by scripts/install-deps — to a non-blank screenshot, with the
//! title and the verdict in the DOM it builds.

use std::path::{Path, PathBuf};

use crate::browser::chromium;
use crate::common::fragscope;

/// Renders `page` headless: (DOM, share of non-white pixels).
fn render(browser: &Path, page: &Path, tmp: &Path) -> (String, f64) {
    let url = format!("file://{}", page.canonicalize().unwrap().display());
    let common = ["--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,1600"];
    let shot = tmp.join("shot.png");
    let o = std::process::Command::new(browser)
        .args(common)
        .arg(format!("--user-data-dir={}", tmp.join("ud1").display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .unwrap();
    assert!(o.status.success() && shot.is_file(), "{}", String::from_utf8_lossy(&o.stderr));
    let img = crate::common::read_png(&shot);
    let ink = img.pixels.iter().filter(|p| p.iter().any(|&c| c < 240)).count() as f64 / img.pixels.len() as f64;
    let o = std::process::Command::new(browser)
        .args(common)
        .arg(format!("--user-data-dir={}", tmp.join("ud2").display()))
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .unwrap();
    (String::from_utf8_lossy(&o.stdout).into_owned(), ink)
}

fn no_external_urls(html: &str) {
    for attr in ["src=\"http", "href=\"http", "url(http", "src='http", "href='http"] {
        assert!(!html.contains(attr), "external URL ({attr})");
    }
}

#[test]
fn report_and_index_pages_are_self_contained_and_render() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("frag");
    fragscope().args(["synth", "--pattern", "fragmenting", "--events", "20k", "-o"]).arg(&trace).assert().success();
    let out = tmp.path().join("out");
    fragscope().arg("analyze").arg(&trace).arg(fixtures_example()).arg("-o").arg(&out).assert().success();
    let report = out.join("frag/report.html");
    let html = std::fs::read_to_string(&report).unwrap();
    no_external_urls(&html);
    assert!(html.contains("data:image/png;base64,"), "pictures inline");
    assert!(html.contains("<a href=\"metrics.parquet\">"));
    assert!(html.contains("<table>") && html.contains("OOM risk: "));
    let index = out.join("index.html");
    let ihtml = std::fs::read_to_string(&index).unwrap();
    no_external_urls(&ihtml);
    assert!(ihtml.contains("<a href=\"frag/report.html\">frag</a>"), "{ihtml}");
    assert!(ihtml.contains("frag/report.html#fragscope-view"), "the view is linked: {ihtml}");
    // Without views, index.html links no view.
    let plain = tmp.path().join("plain");
    fragscope()
        .arg("analyze")
        .arg(&trace)
        .arg(fixtures_example())
        .args(["--no-view", "-o"])
        .arg(&plain)
        .assert()
        .success();
    let phtml = std::fs::read_to_string(plain.join("index.html")).unwrap();
    assert!(phtml.contains("<a href=\"frag/report.html\">frag</a>") && !phtml.contains("(layout)"), "{phtml}");
    let Some(browser) = chromium() else { return };
    let (dom, ink) = render(&browser, &report, tmp.path());
    assert!(dom.contains("<title>fragscope report: frag</title>") && dom.contains("OOM risk: "), "{dom}");
    assert!(ink > 0.02, "report.html renders blank ({ink})");
    let (dom, ink) = render(&browser, &index, tmp.path());
    assert!(dom.contains("fragscope batch summary") && dom.contains("frag/report.html"));
    assert!(dom.contains("class=\"sortable\""), "the sorting script ran");
    assert!(ink > 0.005, "index.html renders blank ({ink})");
}

fn fixtures_example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/fragmenting-small")
}
