//! Units and number formatting shared by every output: human bytes
//! (binary units), and rounding that keeps reports stable across platforms.

/// Rounds to 6 decimals so reports are stable across platforms.
pub fn r6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Human-readable bytes: 1.50 GiB.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// "1 OOM", "2 OOMs": a count and its noun.
pub fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// A time window `A..B` after a trace's first event, as every command's
/// `--time-window` takes it: each end a duration (`250ms`, `1.5s`) or a
/// number of seconds (`0.25`), either end left open (`A..`, `..B`). In
/// nanoseconds; None for an open end.
pub fn time_window(spec: &str) -> Result<(Option<u64>, Option<u64>), String> {
    let (a, b) =
        spec.split_once("..").ok_or_else(|| format!("`{spec}`: expected A..B (examples: 1s..2.5s, 0.5.., ..250ms)"))?;
    let end = |s: &str| -> Result<Option<u64>, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(None);
        }
        if let Ok(v) = s.parse::<f64>() {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("`{spec}`: `{s}` must be zero or more seconds"));
            }
            return Ok(Some((v * 1e9).round().min(u64::MAX as f64) as u64));
        }
        humantime::parse_duration(s)
            .map(|d| Some(d.as_nanos().min(u64::MAX as u128) as u64))
            .map_err(|e| format!("`{spec}`: `{s}`: {e} (a duration such as 250ms or 1.5s, or a number of seconds)"))
    };
    let (a, b) = (end(a)?, end(b)?);
    if let (Some(a), Some(b)) = (a, b)
        && b <= a
    {
        return Err(format!("`{spec}`: the end must be after the start"));
    }
    Ok((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_windows_take_durations_seconds_and_open_ends() {
        assert_eq!(time_window("1s..2.5s"), Ok((Some(1_000_000_000), Some(2_500_000_000))));
        assert_eq!(time_window("0.035..60ms"), Ok((Some(35_000_000), Some(60_000_000))));
        assert_eq!(time_window("7.."), Ok((Some(7_000_000_000), None)));
        assert_eq!(time_window("..250ms"), Ok((None, Some(250_000_000))));
        assert!(time_window("2s..1s").unwrap_err().contains("the end must be after the start"));
        assert!(time_window("5-7").unwrap_err().contains("expected A..B"));
        assert!(time_window("-1..2").unwrap_err().contains("must be zero or more seconds"));
        assert!(time_window("1x..2").is_err());
    }

    #[test]
    fn human_bytes() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(3 << 30), "3.00 GiB");
    }
}
