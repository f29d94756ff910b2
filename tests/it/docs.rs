//! The documents a newcomer reads (README.md, BENCHMARKS.md, docs/*.md):
//! every relative link and image points at a file that exists, every
//! `#anchor` at a heading that exists (GitHub's slugs), every `fragscope`
//! command in a shell block parses with today's arguments, and every
//! script such a block runs exists.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use clap::Parser;
use pulldown_cmark::{CodeBlockKind, Event, HeadingLevel, Parser as Markdown, Tag, TagEnd};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The documents, relative to the repository root.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![PathBuf::from("README.md"), PathBuf::from("BENCHMARKS.md")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .filter_map(|e| e.ok())
        .map(|e| PathBuf::from("docs").join(e.file_name()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    more.sort();
    assert!(!more.is_empty(), "docs/ holds the reference, one file per topic");
    docs.extend(more);
    docs
}

/// GitHub's anchor of a heading: lower case, punctuation other than `-`
/// and `_` dropped, each space a `-`; a repeated heading gets `-1`, `-2`.
fn slug(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// What a document holds: its anchors, its links, and its shell blocks.
#[derive(Default)]
struct Doc {
    anchors: BTreeSet<String>,
    links: Vec<String>,
    shell: Vec<String>,
}

fn read(path: &Path) -> Doc {
    let text = std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut doc = Doc::default();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut heading: Option<String> = None;
    let mut block: Option<String> = None;
    for event in Markdown::new_ext(&text, pulldown_cmark::Options::ENABLE_TABLES) {
        match event {
            Event::Start(Tag::Heading { level, .. }) if level <= HeadingLevel::H6 => heading = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                let base = slug(&heading.take().unwrap_or_default());
                let n = seen.entry(base.clone()).or_insert(0);
                doc.anchors.insert(if *n == 0 { base } else { format!("{base}-{n}") });
                *n += 1;
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
                if let Some(b) = block.as_mut() {
                    b.push_str(&t);
                }
            }
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                doc.links.push(dest_url.to_string())
            }
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(info))) => {
                block = matches!(info.as_ref(), "sh" | "bash" | "shell").then(String::new);
            }
            Event::End(TagEnd::CodeBlock) => doc.shell.extend(block.take()),
            _ => {}
        }
    }
    doc
}

/// The commands of a shell block: continuation lines joined, each cut at
/// its comment and at the first pipe, `&&` or redirection, a leading
/// `sudo` and environment assignments dropped. A shell variable stands for
/// what the shell would put there: a count (`…COUNT`, `…TOTAL`) 2, any
/// other value 0.
fn commands(block: &str) -> Vec<Vec<String>> {
    let variable = regex::Regex::new(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?").expect("a valid pattern");
    let joined = block.replace("\\\n", " ");
    let joined = variable.replace_all(&joined, |c: &regex::Captures| {
        if c[1].ends_with("COUNT") || c[1].ends_with("TOTAL") { "2" } else { "0" }.to_string()
    });
    let mut out = Vec::new();
    for line in joined.lines() {
        let line = line.trim().trim_start_matches("$ ");
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some(words) = shlex::split(line) else { panic!("unbalanced quotes in `{line}`") };
        let mut words: Vec<String> = words
            .into_iter()
            .take_while(|w| !w.starts_with('#') && !["|", "&&", "||", ";", ">", "2>", "<", "&"].contains(&w.as_str()))
            .collect();
        while words.first().is_some_and(|w| w == "sudo" || (w.contains('=') && !w.starts_with('-'))) {
            words.remove(0);
        }
        // `sudo "$(command -v fragscope)" …`, `./target/release/fragscope …`.
        if let Some(first) = words.first_mut()
            && (first == "$(command -v fragscope)" || first.ends_with("/fragscope"))
        {
            *first = "fragscope".into();
        }
        out.push(words);
    }
    out
}

#[test]
fn every_link_and_anchor_in_the_documents_resolves() {
    let docs = documents();
    let read_all: BTreeMap<PathBuf, Doc> = docs.iter().map(|p| (p.clone(), read(p))).collect();
    let mut bad = Vec::new();
    let mut checked = 0;
    for (path, doc) in &read_all {
        for link in &doc.links {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = link.split_once('#').map_or((link.as_str(), None), |(f, a)| (f, Some(a)));
            let target = if file.is_empty() {
                path.clone()
            } else {
                let joined = path.parent().unwrap_or(Path::new("")).join(file);
                // Normalise `docs/../X` to `X`.
                joined.components().fold(PathBuf::new(), |mut acc, c| {
                    match c {
                        std::path::Component::ParentDir => {
                            acc.pop();
                        }
                        std::path::Component::CurDir => {}
                        c => acc.push(c),
                    }
                    acc
                })
            };
            checked += 1;
            if !root().join(&target).exists() {
                bad.push(format!("{}: `{link}`: no file {}", path.display(), target.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                let anchors = match read_all.get(&target) {
                    Some(d) => &d.anchors,
                    None if target.extension().is_some_and(|x| x == "md") => &read(&target).anchors,
                    None => {
                        bad.push(format!("{}: `{link}`: an anchor into a file that is not Markdown", path.display()));
                        continue;
                    }
                };
                if !anchors.contains(anchor) {
                    bad.push(format!("{}: `{link}`: no heading with the anchor #{anchor}", path.display()));
                }
            }
        }
    }
    assert!(checked > 30, "only {checked} links found: the reader is broken");
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

#[test]
fn every_command_the_documents_show_parses_and_every_script_exists() {
    let mut bad = Vec::new();
    let mut parsed = 0;
    for path in documents() {
        for block in read(&path).shell {
            for words in commands(&block) {
                let Some(first) = words.first() else { continue };
                if first == "fragscope" {
                    parsed += 1;
                    if let Err(e) = fragscope::cli::Cli::try_parse_from(&words) {
                        let first_line = e.to_string().lines().next().unwrap_or_default().to_string();
                        bad.push(format!("{}: `{}`: {first_line}", path.display(), words.join(" ")));
                    }
                } else {
                    // `bash scripts/x`, `scripts/x`, `python3 scripts/x.py`.
                    for w in words.iter().take(2).filter(|w| w.starts_with("scripts/")) {
                        if !root().join(w).is_file() {
                            bad.push(format!("{}: `{}`: no {w}", path.display(), words.join(" ")));
                        }
                    }
                }
            }
        }
    }
    assert!(parsed > 20, "only {parsed} fragscope commands found: the reader is broken");
    assert!(bad.is_empty(), "commands that no longer work:\n{}", bad.join("\n"));
}

#[test]
fn the_reader_of_commands_and_anchors_is_right() {
    assert_eq!(slug("The `record` command: 1.5× faster (issue 36)"), "the-record-command-15-faster-issue-36");
    assert_eq!(
        commands(
            "sudo FOO=1 \"$(command -v fragscope)\" record -o t -- python a.py   # spawn\nfragscope analyze a \\\n  -o b --shard ${I}/$N_COUNT | head"
        ),
        vec![
            vec!["fragscope", "record", "-o", "t", "--", "python", "a.py"],
            vec!["fragscope", "analyze", "a", "-o", "b", "--shard", "0/2"]
        ]
    );
    // The check can fail: a flag that does not exist is refused.
    assert!(fragscope::cli::Cli::try_parse_from(["fragscope", "analyze", "x", "-o", "y", "--no-such-flag"]).is_err());
}

/// No source file grows past 800 lines (issue 62): a file that does is
/// split where its parts separate.
#[test]
fn no_source_file_passes_800_lines() {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, usize)>) {
        for e in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push((p.clone(), std::fs::read_to_string(&p).unwrap().lines().count()));
            }
        }
    }
    let mut files = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
    assert!(files.len() > 50, "{files:?}");
    let long: Vec<_> = files.iter().filter(|f| f.1 > 800).collect();
    assert!(long.is_empty(), "over 800 lines: {long:?}");
}
