//! The settings check: what a process asked of PyTorch's caching
//! allocator against what the allocator used. No other tool tells users
//! that a setting did not take effect, and from PyTorch 2.8 several did
//! not: 2.9 warns that `PYTORCH_CUDA_ALLOC_CONF` is deprecated in favour
//! of `PYTORCH_ALLOC_CONF`, yet its CUDA allocator reads only the old name
//! (pytorch/pytorch#183387, whose reporter saw it up to 2.11); from 2.10
//! the first of `PYTORCH_CUDA_ALLOC_CONF`, `PYTORCH_HIP_ALLOC_CONF`,
//! `PYTORCH_ALLOC_CONF` that is set is read and the others are ignored.
//!
//! What was asked:
//! - the string a snapshot's allocator parsed
//!   (`allocator_settings.PYTORCH_CUDA_ALLOC_CONF`, PyTorch ≥ 2.1);
//! - each allocator variable in a recorded process's environment (`record`
//!   keeps them; a recording's allocator view, or a snapshot joined with
//!   its recording).
//!
//! What was used:
//! - a snapshot: the values its allocator parsed (`allocator_settings`);
//! - a recording: only what its segments show — mapped pages
//!   (`cuMemCreate`/`cuMemMap`, expandable segments) or whole `cudaMalloc`
//!   segments. The other keys leave no trace in a recording, so they are
//!   not checked there.
//!
//! A key asked for whose value was used is silent; so is a key whose use
//! the evidence cannot show (`max_non_split_rounding_mb`, `pinned_*`,
//! `per_process_memory_fraction`, which no snapshot records).

use serde::Serialize;

use crate::trace::details::SnapshotDetails;

/// One setting asked for and not used.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Difference {
    /// The unit (device) whose allocator did otherwise.
    pub unit: u32,
    pub key: String,
    pub asked: String,
    /// Where it was asked: a variable of a process's environment, or the
    /// string the snapshot's allocator parsed.
    pub asked_in: String,
    pub used: String,
    /// What shows the value used ("the recorded segments show (…)").
    pub evidence: String,
    pub reason: String,
    /// What to do, naming the variable that works.
    pub advice: String,
}

/// The check of one trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SettingsCheck {
    pub differences: Vec<Difference>,
    /// What was compared, for a reader who wants to know the check ran
    /// ("PYTORCH_ALLOC_CONF of pid 41 against its segments").
    pub compared: Vec<String>,
    /// The PyTorch version, where `record` found it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub torch_version: Option<String>,
}

/// The entries of an allocator configuration string as (key, value),
/// split as PyTorch's lexer splits them
/// ([`crate::import::settings::split_conf`]: at commas outside `[…]`),
/// spaces left out.
pub fn entries(conf: &str) -> Vec<(String, String)> {
    crate::import::settings::split_conf(conf)
        .map(|e| {
            let e: String = e.chars().filter(|c| !c.is_whitespace()).collect();
            match e.split_once(':') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (e, String::new()),
            }
        })
        .collect()
}

/// What one key's value says in the units `allocator_settings` records
/// it, when the snapshot records that key: (asked, used), both as text.
fn compare(key: &str, value: &str, used: &serde_json::Value) -> Option<(String, String)> {
    let recorded = |k: &str| used.get(k);
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let bool_key = |k: &str| {
        let u = recorded(k)?.as_bool()?;
        let a = match value {
            "True" | "true" => true,
            "False" | "false" => false,
            _ => return None,
        };
        (a != u).then(|| (value.to_string(), if u { "True" } else { "False" }.to_string()))
    };
    match key {
        "expandable_segments" => bool_key("expandable_segments"),
        "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => bool_key("release_lock_on_cudamalloc"),
        "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => bool_key("pinned_use_cuda_host_register"),
        "graph_capture_record_stream_reuse" => bool_key("graph_capture_record_stream_reuse"),
        "max_split_size_mb" => {
            let u = recorded("max_split_size")?.as_i64()?;
            let a: i64 = value.parse::<i64>().ok()?.checked_mul(1 << 20)?;
            let used_mb = if u <= 0 || u == i64::MAX { "unlimited".to_string() } else { (u >> 20).to_string() };
            (a != u).then(|| (value.to_string(), used_mb))
        }
        "garbage_collection_threshold" => {
            let raw = recorded("garbage_collection_threshold")?;
            let (u, a): (f64, f64) = (raw.as_f64()?, value.parse().ok()?);
            let used = if u == 0.0 { "off".to_string() } else { text(raw) };
            ((a - u).abs() > 1e-9).then(|| (value.to_string(), used))
        }
        "roundup_power2_divisions" if !value.starts_with('[') => {
            let a: u64 = value.parse().ok()?;
            let u = crate::allocator::Settings::from_snapshot(used).roundup_power2_divisions;
            let differs = u.iter().any(|&d| d != a);
            let shown = if u.iter().all(|&d| d == u[0]) { u[0].to_string() } else { format!("{u:?}") };
            differs.then(|| (value.to_string(), shown))
        }
        "pinned_num_register_threads" => {
            let u = recorded("pinned_num_register_threads")?.as_u64()?;
            let a: u64 = value.parse().ok()?;
            (a != u).then(|| (value.to_string(), u.to_string()))
        }
        _ => None,
    }
}

/// The PyTorch release `version` names, as (major, minor).
fn release(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.split(['.', '+', 'a', 'r', 'd']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Why a key asked in `var` (of a process whose other variables are
/// `others`) was not used, and what to do, by the PyTorch version.
fn reason_and_advice(var: &str, key: &str, value: &str, others: &[&str], version: Option<&str>) -> (String, String) {
    let entry = format!("{key}:{value}");
    let works = format!(
        "Set `PYTORCH_CUDA_ALLOC_CONF={entry}`: every PyTorch release reads it for CUDA (2.9 calls it deprecated, \
         but it is the only one 2.9's CUDA allocator reads; from 2.10 it is read first)"
    );
    let v = version.and_then(release);
    match var {
        "PYTORCH_ALLOC_CONF" if !others.is_empty() => (
            format!(
                "the process also had {} set, and PyTorch reads only the first of `PYTORCH_CUDA_ALLOC_CONF`, \
                 `PYTORCH_HIP_ALLOC_CONF`, `PYTORCH_ALLOC_CONF` that is set (2.10 and later; 2.9's CUDA allocator \
                 reads only `PYTORCH_CUDA_ALLOC_CONF`)",
                others.iter().map(|o| format!("`{o}`")).collect::<Vec<_>>().join(" and ")
            ),
            format!("Put `{entry}` in `{}`, or set one variable only", others[0]),
        ),
        "PYTORCH_ALLOC_CONF" => match v {
            Some((2, minor)) if minor < 9 => {
                (format!("PyTorch {} knows only `PYTORCH_CUDA_ALLOC_CONF`", version.unwrap_or_default()), works)
            }
            Some((2, 9)) => (
                format!(
                    "PyTorch {}'s CUDA allocator reads its settings only from `PYTORCH_CUDA_ALLOC_CONF`, although \
                     it warns that name is deprecated (pytorch/pytorch#183387)",
                    version.unwrap_or_default()
                ),
                works,
            ),
            Some(_) => (
                format!(
                    "PyTorch {} reads `PYTORCH_ALLOC_CONF` when no other allocator variable is set, so the \
                     allocator turned it off itself: {}",
                    version.unwrap_or_default(),
                    platform(key)
                ),
                works,
            ),
            None => (
                "PyTorch 2.9 (up to 2.11, by pytorch/pytorch#183387's report) reads its CUDA settings only from \
                 `PYTORCH_CUDA_ALLOC_CONF`, although it warns that name is deprecated; the PyTorch version was not \
                 recorded"
                    .to_string(),
                format!("{works}, or set both variables to the same value"),
            ),
        },
        _ => (
            format!("the allocator parsed it and turned it off: {}", platform(key)),
            format!(
                "Look for PyTorch's warning about `{key}` in the job's log; the what-if below replays only settings this allocator took"
            ),
        ),
    }
}

/// Why an allocator turns a key it parsed off.
fn platform(key: &str) -> &'static str {
    match key {
        "expandable_segments" => {
            "the platform does not support expandable segments (no virtual memory management in the driver, an \
             older GPU, or a build without it), and PyTorch then warns once and runs without them"
        }
        _ => "a later call (`torch.cuda.memory._set_allocator_settings`) or the platform changed it",
    }
}

/// The check of a snapshot (or a recording's allocator view): `events`
/// gives what a recording's segments show.
pub fn check(details: &SnapshotDetails, recording: bool) -> SettingsCheck {
    let mut out = SettingsCheck {
        torch_version: details.asked.iter().find_map(|a| a.torch_version.clone()),
        ..SettingsCheck::default()
    };
    let used = &details.allocator_settings;
    let unit = details.devices.first().copied().unwrap_or(0);
    // A recording shows only whether its segments were expandable, and
    // only where it made segments (`inferred_settings` says so).
    let checkable =
        |key: &str| !recording || (key == "expandable_segments" && details.inferred_settings.iter().any(|k| k == key));
    let evidence = if !recording {
        "its parsed values in the snapshot's `allocator_settings` show".to_string()
    } else if used.get("expandable_segments").and_then(|v| v.as_bool()) == Some(true) {
        "the recorded segments show (mapped pages)".to_string()
    } else {
        "the recorded segments show (whole cudaMalloc segments, no mapped pages)".to_string()
    };
    // The string the snapshot's allocator parsed.
    if !recording && let Some(parsed) = used.get("PYTORCH_CUDA_ALLOC_CONF").and_then(|v| v.as_str()) {
        out.compared.push("the allocator configuration string the snapshot recorded against its parsed values".into());
        for (key, value) in entries(parsed) {
            if let Some((asked, was)) = compare(&key, &value, used) {
                let (reason, advice) = reason_and_advice("", &key, &value, &[], None);
                out.differences.push(Difference {
                    unit,
                    key,
                    asked,
                    asked_in: "the configuration string the snapshot's allocator parsed".into(),
                    used: was,
                    evidence: evidence.clone(),
                    reason,
                    advice,
                });
            }
        }
    }
    // Each recorded process's environment.
    for a in &details.asked {
        let vars: Vec<&str> = a.vars.keys().map(String::as_str).collect();
        for (var, conf) in &a.vars {
            out.compared.push(format!(
                "`{var}` of pid {} against {}",
                a.pid,
                if recording { "its segments" } else { "the snapshot's allocator_settings" }
            ));
            for (key, value) in entries(conf) {
                if !checkable(&key) {
                    continue;
                }
                let Some((asked, was)) = compare(&key, &value, used) else { continue };
                // Already said, from the snapshot's own string.
                if out.differences.iter().any(|d| d.key == key && d.unit == a.unit && d.asked == asked) {
                    continue;
                }
                let others: Vec<&str> =
                    vars.iter().copied().filter(|v| v != var && *v != "PYTORCH_ALLOC_CONF").collect();
                let (reason, advice) = reason_and_advice(var, &key, &value, &others, a.torch_version.as_deref());
                out.differences.push(Difference {
                    unit: a.unit,
                    key,
                    asked,
                    asked_in: format!("`{var}` of pid {}", a.pid),
                    used: was,
                    evidence: evidence.clone(),
                    reason,
                    advice,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::details::AskedSettings;

    fn snapshot(settings: serde_json::Value) -> SnapshotDetails {
        SnapshotDetails { allocator_settings: settings, devices: vec![0], ..SnapshotDetails::default() }
    }

    #[test]
    fn entries_split_as_pytorch_lexes() {
        assert_eq!(
            entries(" expandable_segments:True, roundup_power2_divisions:[256:1,>:4],max_split_size_mb:64"),
            [
                ("expandable_segments".to_string(), "True".to_string()),
                ("roundup_power2_divisions".to_string(), "[256:1,>:4]".to_string()),
                ("max_split_size_mb".to_string(), "64".to_string()),
            ]
        );
        assert!(entries("").is_empty());
    }

    #[test]
    fn a_parsed_string_that_agrees_is_silent() {
        let d = snapshot(serde_json::json!({
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64,garbage_collection_threshold:0.8",
            "expandable_segments": true, "max_split_size": 64 << 20, "garbage_collection_threshold": 0.8,
        }));
        let c = check(&d, false);
        assert!(c.differences.is_empty(), "{:?}", c.differences);
        assert_eq!(c.compared.len(), 1);
    }

    #[test]
    fn expandable_asked_and_turned_off_by_the_platform() {
        let d = snapshot(serde_json::json!({
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": false,
        }));
        let [diff] = check(&d, false).differences.try_into().unwrap();
        assert_eq!(
            (diff.key.as_str(), diff.asked.as_str(), diff.used.as_str()),
            ("expandable_segments", "True", "False")
        );
        assert!(diff.reason.contains("platform does not support"), "{}", diff.reason);
    }

    #[test]
    fn the_new_variable_ignored_by_the_version_that_ignores_it() {
        let mut d = snapshot(serde_json::json!({"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": false}));
        let asked = |version: Option<&str>| AskedSettings {
            pid: 41,
            unit: 0,
            vars: [("PYTORCH_ALLOC_CONF".to_string(), "expandable_segments:True".to_string())].into(),
            torch_version: version.map(str::to_string),
        };
        d.asked = vec![asked(Some("2.9.1+cu128"))];
        let [diff] = check(&d, false).differences.try_into().unwrap();
        assert_eq!(diff.asked_in, "`PYTORCH_ALLOC_CONF` of pid 41");
        assert!(diff.reason.contains("2.9.1+cu128's CUDA allocator reads its settings only from"), "{}", diff.reason);
        assert!(diff.advice.starts_with("Set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`"), "{}", diff.advice);
        // Version unknown: both named, with the reason.
        d.asked = vec![asked(None)];
        let [diff] = check(&d, false).differences.try_into().unwrap();
        assert!(diff.advice.contains("or set both variables to the same value"), "{}", diff.advice);
        // The setting in force: silent.
        d.allocator_settings["expandable_segments"] = true.into();
        assert!(check(&d, false).differences.is_empty());
    }

    #[test]
    fn both_variables_set_names_the_one_read() {
        let mut d = snapshot(serde_json::json!({"expandable_segments": false}));
        d.inferred_settings = vec!["expandable_segments".into()];
        d.asked = vec![AskedSettings {
            pid: 7,
            unit: 0,
            vars: [
                ("PYTORCH_ALLOC_CONF".to_string(), "expandable_segments:True".to_string()),
                ("PYTORCH_CUDA_ALLOC_CONF".to_string(), "max_split_size_mb:128".to_string()),
            ]
            .into(),
            torch_version: Some("2.12.0".into()),
        }];
        // A recording: only expandable segments are checked (its segments
        // show them); max_split_size_mb leaves no trace.
        let c = check(&d, true);
        let [diff] = c.differences.try_into().unwrap();
        assert!(diff.reason.contains("also had `PYTORCH_CUDA_ALLOC_CONF` set"), "{}", diff.reason);
        assert!(diff.advice.starts_with("Put `expandable_segments:True` in `PYTORCH_CUDA_ALLOC_CONF`"));
        assert_eq!(c.compared.len(), 2);
    }
}
