//! Self-contained HTML for CI artifacts: `report.html` next to each
//! trace's `report.md`, and `index.html` next to a batch's `summary.md`.
//!
//! One file each, opened from a file system or an artifact store: the
//! Markdown report rendered to HTML (pulldown-cmark), the PNGs inline as
//! `data:` URIs, the flamegraph SVG inline as an image (its own script
//! does not run there), links to the Parquet files beside it. No external
//! URL and no JavaScript framework: the index's table sorts on a header
//! click with a dozen lines of plain script.

use std::path::Path;

use base64::Engine as _;

/// The page's styles: readable tables, images fitted to the width.
const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}\
table{border-collapse:collapse;margin:1em 0;font-size:.92em}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}\
th{background:#f3f3f3}tr:nth-child(even) td{background:#fafafa}code{background:#f3f3f3;padding:0 .2em}\
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}h1{font-size:1.6em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}\
th.sortable{cursor:pointer}th.sortable:after{content:' \\2195';color:#999}\
#fragscope-view{position:relative;user-select:none}#fragscope-view canvas{display:block;margin:.3em 0}\
#fragscope-view canvas.mdtp{cursor:crosshair}#fragscope-view .help,#fragscope-view .status{color:#555;font-size:.88em}\
#fragscope-view .legend{font-size:.88em;color:#333}#fragscope-view .legend i{display:inline-block;width:5em;height:.8em;\
vertical-align:middle;border:1px solid #999;background:linear-gradient(to right,rgb(198,219,239),rgb(8,48,107))}\
#fragscope-view .legend b{display:inline-block;width:.9em;height:.8em;vertical-align:middle;border:1px solid #999}\
#fragscope-view .bar{margin:.4em 0}#fragscope-view .oom-at{margin-left:.6em;color:#a00}#fragscope-view input.search{width:22em}#fragscope-view .found{color:#a60;margin-left:.6em}\
#fragscope-view .tip{position:absolute;display:none;background:#fff;border:1px solid #888;padding:.4em .6em;font-size:.85em;\
max-width:330px;pointer-events:none;box-shadow:0 2px 6px rgba(0,0,0,.2);z-index:2}#fragscope-view .details pre{font-size:.85em;overflow-x:auto}";

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Markdown (tables on) to HTML.
fn markdown_to_html(md: &str) -> String {
    let parser = pulldown_cmark::Parser::new_ext(md, pulldown_cmark::Options::ENABLE_TABLES);
    let mut html = String::with_capacity(md.len() * 2);
    pulldown_cmark::html::push_html(&mut html, parser);
    html
}

fn page(title: &str, body: &str, script: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"generator\" content=\"fragscope {}\">\n<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}\n{script}</body>\n</html>\n",
        env!("CARGO_PKG_VERSION"),
        escape(title)
    )
}

fn data_uri(mime: &str, bytes: &[u8]) -> String {
    format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// `report.html` from the trace folder `dir` as `write_trace_outputs`
/// left it: `report.md`, the pictures and the flamegraph that are there,
/// and links to the data files.
pub fn report_html(dir: &Path, title: &str) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let md = std::fs::read_to_string(dir.join("report.md"))
        .with_context(|| format!("cannot read {}", dir.join("report.md").display()))?;
    let mut body = markdown_to_html(&md);
    let mut pictures = String::new();
    for (file, alt) in [
        ("mdtp.png", "memory layout over time (MDTP)"),
        ("timeline.png", "fragmentation score and live memory over time"),
        ("floors.png", "the floor of live memory in each iteration"),
        ("whatif.png", "reserved and allocated memory under other allocator settings"),
    ] {
        if let Ok(bytes) = std::fs::read(dir.join(file)) {
            pictures.push_str(&format!(
                "<figure><img src=\"{}\" alt=\"{alt}\"><figcaption>{file}: {alt}</figcaption></figure>\n",
                data_uri("image/png", &bytes)
            ));
        }
    }
    if let Ok(svg) = std::fs::read(dir.join("flamegraph.svg")) {
        pictures.push_str(&format!(
            "<figure><img src=\"{}\" alt=\"live memory by call stack\"><figcaption>flamegraph.svg: live memory by call stack at the end and at the peak</figcaption></figure>\n",
            data_uri("image/svg+xml", &svg)
        ));
    }
    let mut script = String::new();
    if dir.join("view").join("manifest.js").is_file() {
        // The link first, under the title; the view before the pictures.
        if let Some(at) = body.find("</h1>") {
            body.insert_str(at + 5, VIEW_LINK);
        }
        body.push_str(VIEW_SECTION);
        script = format!(
            "<script>\n{VIEW_JS}</script>\n<script src=\"view/manifest.js\" onerror=\"{VIEW_MISSING}\"></script>\n"
        );
    }
    if !pictures.is_empty() {
        body.push_str("<h2>Pictures</h2>\n");
        body.push_str(&pictures);
    }
    let files: Vec<String> = ["metrics.parquet", "report.json", "report.md", "flamegraph.folded"]
        .iter()
        .filter(|f| dir.join(f).is_file())
        .map(|f| format!("<a href=\"{f}\">{f}</a>"))
        .collect();
    body.push_str(&format!("<h2>Data</h2>\n<p>{}</p>\n", files.join(" · ")));
    Ok(page(title, &body, &script))
}

/// The explorable view (`view/`, [`crate::output::view`]): its markup and
/// its script, which reads the files beside the page.
const VIEW_JS: &str = include_str!("view/view.js");
/// What the page says when `view/` is not beside it (the report copied
/// alone).
const VIEW_MISSING: &str = "document.querySelector('#fragscope-view .status').textContent=\
'The files of this view (view/ beside report.html) were not found: copy the folder with the report.'";
const VIEW_LINK: &str = "\n<p><a href=\"#fragscope-view\">Explore the memory layout</a>: zoom into it, point at a block for its call site.</p>\n";
const VIEW_SECTION: &str = "<section id=\"fragscope-view\">\n<h2>Explore the memory layout</h2>\n\
<p class=\"help\">Wheel or pinch to zoom: both axes; with Shift or over the time axis, time only; with Alt or over the \
address axis, address only. Drag to pan (the timeline below pans and zooms time), double-click to reset. Point at a \
block for its size, lifetime and call site; click it to keep it, with its whole stack below the timeline (click free \
space to let it go). Point at an OOM's red line for the failed request; the OOM buttons (keys p and n) step through \
the OOMs. The menu, when there is one, picks the process or GPU. The address bar keeps the view: a link to it opens \
it.</p>\n\
<p class=\"legend\"></p>\n\
<div class=\"bar\"><select class=\"panel\"></select> <input class=\"search\" type=\"search\" \
placeholder=\"highlight blocks whose call stack contains…\"><span class=\"found\"></span></div>\n\
<div class=\"bar ooms\"><button class=\"oom-prev\" title=\"the OOM before (key p)\">&#9664; OOM</button> \
<button class=\"oom-next\" title=\"the OOM after (key n)\">OOM &#9654;</button> <span class=\"oom-at\"></span></div>\n\
<canvas class=\"mdtp\"></canvas>\n<canvas class=\"timeline\"></canvas>\n<div class=\"status\"></div>\n\
<div class=\"tip\"></div>\n<div class=\"details\"></div>\n</section>\n";

/// The script that sorts a table by the clicked header: sizes ("2.36
/// GiB") by their bytes, other numbers as numbers, text as text.
const SORT_SCRIPT: &str = "<script>\
var U={B:1,KiB:1024,MiB:1048576,GiB:1073741824,TiB:1099511627776};\
function key(r,i){var s=r.cells[i].textContent.trim();var m=s.match(/^(-?[0-9.]+) (B|KiB|MiB|GiB|TiB)$/);\
if(m)return parseFloat(m[1])*U[m[2]];var n=parseFloat(s);return isNaN(n)?s:n;}\
document.querySelectorAll('table').forEach(function(t){var h=t.tHead;if(!h)return;\
Array.prototype.forEach.call(h.rows[0].cells,function(th,i){th.className='sortable';var asc=false;\
th.addEventListener('click',function(){asc=!asc;var b=t.tBodies[0];var rows=Array.prototype.slice.call(b.rows);\
rows.sort(function(x,y){var a=key(x,i),c=key(y,i);var r=(typeof a==='number'&&typeof c==='number')?a-c:String(a).localeCompare(String(c));return asc?r:-r;});\
rows.forEach(function(r){b.appendChild(r);});});});});\
</script>\n";

/// `index.html` of a batch from its `summary.md`: the same tables, each
/// trace's name linking to its `report.html` and, when the flag beside the
/// name says it has one, to the explorable view in it; sortable by any
/// column.
pub fn index_html(summary_md: &str, names: &[(&str, bool)]) -> String {
    let html = markdown_to_html(summary_md);
    // One pass over the cells (a batch may hold 10 000 traces): the first
    // row-opening cell that holds exactly a trace's name becomes its link
    // (a trace named like a status or a risk must not link those cells).
    let mut pending: std::collections::HashMap<String, (&str, bool)> =
        names.iter().map(|&(n, view)| (escape(n), (n, view))).collect();
    let mut body = String::with_capacity(html.len() + names.len() * 40);
    let mut rest = html.as_str();
    while let Some(at) = rest.find("<td>") {
        body.push_str(&rest[..at + 4]);
        rest = &rest[at + 4..];
        let opens_row = body[..body.len() - 4].trim_end().ends_with("<tr>");
        if opens_row
            && let Some(end) = rest.find("</td>")
            && let Some((name, view)) = pending.remove(&rest[..end])
        {
            // The report, and its explorable layout (where it has one).
            let href = url_path(name);
            body.push_str(&format!("<a href=\"{href}/report.html\">{}</a>", &rest[..end]));
            if view {
                body.push_str(&format!(
                    " <a class=\"view\" href=\"{href}/report.html#fragscope-view\" \
                     title=\"explore the memory layout\">(layout)</a>"
                ));
            }
            rest = &rest[end..];
        }
    }
    body.push_str(rest);
    page("fragscope batch summary", &body, SORT_SCRIPT)
}

/// A folder name as a relative URL path segment.
fn url_path(name: &str) -> String {
    name.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_tables_become_html_tables_and_names_become_links() {
        let md = "# t\n\n| trace | p95 |\n|---|---|\n| x | ok |\n| a b&c | 1.0 |\n| other | 2.0 |\n| ok | 3.0 |\n| y | 4.0 |\n";
        let html = index_html(md, &[("a b&c", true), ("ok", true), ("y", false)]);
        // A trace named like a status cell links its own row only.
        assert!(html.contains("<td>x</td><td>ok</td>"), "{html}");
        assert!(
            html.contains(
                "<td><a href=\"ok/report.html\">ok</a> <a class=\"view\" href=\"ok/report.html#fragscope-view\""
            ),
            "{html}"
        );
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("<td><a href=\"a%20b%26c/report.html\">a b&amp;c</a> <a class=\"view\""), "{html}");
        assert!(html.contains("<td>other</td>"));
        // A trace without a view links its report only.
        assert!(html.contains("<td><a href=\"y/report.html\">y</a></td>"), "{html}");
        assert!(!html.contains("http://") && !html.contains("https://"), "no external URL");
    }
}
