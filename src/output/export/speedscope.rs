//! `export --format speedscope`: the live memory by call stack at the end
//! and at the peak (the flamegraph's stacks) as a speedscope file.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::{Context, Result};
use serde_json::json;

use crate::analysis::Analysis;
use crate::output::export::common::{Exporter, Paths, Source, Window, Written};

/// The speedscope format.
pub(crate) struct Speedscope;

impl Exporter for Speedscope {
    fn needs_analysis(&self) -> bool {
        true
    }

    /// The stacks are those live at the end and at the peak of the whole
    /// trace: no window cuts them.
    fn takes_window(&self) -> bool {
        false
    }

    fn write(&self, paths: &Paths, source: Source<'_>, _window: Window, out: &mut dyn Write) -> Result<Written> {
        let doc = speedscope(source.analysis()?).with_context(|| {
            format!(
                "{}: has no call stacks to export (PyTorch snapshots, their imports and traces recorded with `record --stacks` have them)",
                paths.input.display()
            )
        })?;
        let bytes = serde_json::to_vec(&doc)?;
        out.write_all(&bytes).with_context(|| format!("cannot write {}", paths.output.display()))?;
        Ok(Written { what: "speedscope".into(), detail: String::new() })
    }
}

/// The flamegraph's stacks as a speedscope file: one profile per folded
/// root (`end`, and `peak`), weighted in bytes. None without stacks.
pub fn speedscope(a: &Analysis) -> Option<serde_json::Value> {
    let folded = a.flamegraph.as_deref().filter(|f| !f.trim().is_empty())?;
    let mut frames: Vec<String> = Vec::new();
    let mut index: BTreeMap<String, usize> = BTreeMap::new();
    let mut profiles: Vec<(String, Vec<Vec<usize>>, Vec<u64>)> = Vec::new();
    for line in folded.lines() {
        let Some((stack, n)) = line.rsplit_once(' ') else { continue };
        let Ok(n) = n.parse::<u64>() else { continue };
        let mut parts = stack.split(';');
        let Some(root) = parts.next() else { continue };
        let ids: Vec<usize> = parts
            .map(|f| {
                *index.entry(f.to_string()).or_insert_with(|| {
                    frames.push(f.to_string());
                    frames.len() - 1
                })
            })
            .collect();
        let p = match profiles.iter().position(|p| p.0 == root) {
            Some(p) => p,
            None => {
                profiles.push((root.to_string(), Vec::new(), Vec::new()));
                profiles.len() - 1
            }
        };
        profiles[p].1.push(ids);
        profiles[p].2.push(n);
    }
    let profiles: Vec<serde_json::Value> = profiles
        .into_iter()
        .map(|(root, samples, weights)| {
            let total: u64 = weights.iter().sum();
            let name =
                if root == "end" { "live memory at the end".to_string() } else { format!("live memory at the {root}") };
            json!({"type": "sampled", "name": name, "unit": "bytes", "startValue": 0, "endValue": total,
                "samples": samples, "weights": weights})
        })
        .collect();
    Some(json!({
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames.iter().map(|f| json!({"name": f})).collect::<Vec<_>>()},
        "profiles": profiles,
        "name": a.trace.name,
        "activeProfileIndex": 0,
        "exporter": "fragscope",
    }))
}
