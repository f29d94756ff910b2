//! The caching allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`, and the
//! `allocator_settings` a snapshot records) and the request rounding they
//! imply: what the import needs to reconstruct block sizes, and what the
//! allocator model ([`crate::allocator`]) runs under. Rounding
//! follows PyTorch ≥ 2.4 (`roundup_power2_divisions` of 1 means plain
//! 512 B rounding).

/// PyTorch's constants.
pub const MIN_BLOCK: u64 = 512;
pub const SMALL_SIZE: u64 = 1 << 20;
pub const SMALL_BUFFER: u64 = 2 << 20;
pub const LARGE_BUFFER: u64 = 20 << 20;

/// The settings of `PYTORCH_CUDA_ALLOC_CONF` the model follows.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// None: unlimited (PyTorch's default).
    pub max_split_size: Option<u64>,
    /// Divisions per power-of-two interval, from 1 MiB (index 0 for every
    /// size below) up; 0 or 1: plain 512 B rounding.
    pub roundup_power2_divisions: Vec<u64>,
    /// Fraction of the capacity; None: off. PyTorch collects garbage only
    /// under a per-process memory fraction ([`Settings::collects_garbage`]).
    pub garbage_collection_threshold: Option<f64>,
    pub expandable_segments: bool,
    /// `torch.cuda.set_per_process_memory_fraction(F)` (a key too from
    /// PyTorch 2.10); the allocator may then hold at most F × the device's
    /// memory. None: not set.
    pub per_process_memory_fraction: Option<f64>,
    /// `large_segment_size_mb` (PyTorch 2.11): the segment of a large
    /// request under 10 MiB, the large pool's page of expandable segments,
    /// and the default of `max_non_split_rounding`. None: 20 MiB.
    pub large_segment_size: Option<u64>,
    /// `max_non_split_rounding_mb` (PyTorch 2.6): a request at or above
    /// `max_split_size` takes a larger cached block only when it wastes
    /// less than this. None: the large segment size.
    pub max_non_split_rounding: Option<u64>,
    /// Entries of keys that change neither where blocks go nor the bytes
    /// reserved ([`INERT_KEYS`]): kept to be named, replayed as absent.
    pub inert: Vec<String>,
    /// A per-process memory fraction below 1 was in force, its value not
    /// recorded: the recording shows garbage collection releasing blocks,
    /// which PyTorch does only under one. The budget the replay is given
    /// is then that fraction's bytes.
    pub fraction_shown: bool,
}

/// Keys PyTorch 2.12–2.15 accept that change neither placement nor
/// reserved bytes, with what they change instead.
pub const INERT_KEYS: [(&str, &str); 16] = [
    ("release_lock_on_cudamalloc", "whether the allocator's lock is held during cudaMalloc"),
    ("release_lock_on_hipmalloc", "whether the allocator's lock is held during hipMalloc"),
    ("pinned_use_cuda_host_register", "how pinned host memory is allocated"),
    ("pinned_use_hip_host_register", "how pinned host memory is allocated"),
    ("pinned_num_register_threads", "threads registering pinned host memory"),
    ("pinned_use_background_threads", "threads freeing pinned host memory"),
    ("pinned_reserve_segment_size_mb", "pinned host memory reserved up front"),
    ("pinned_max_round_threshold_mb", "pinned host memory rounding"),
    ("pinned_max_cached_size_mb", "pinned host memory cached"),
    ("pinned_free_catch_all", "how pinned host memory is freed"),
    ("graph_capture_record_stream_reuse", "block reuse inside CUDA graph captures, which the model does not replay"),
    ("throw_on_cudamalloc_oom", "whether a failed cudaMalloc raises at once, not the bytes"),
    (
        "expandable_segments_reserve",
        "the virtual range an expandable segment reserves (the model keeps 9/8 of the device: its sizing rule was not read from PyTorch's source)",
    ),
    (
        "expandable_segments_reserve_by_class",
        "the virtual range an expandable segment reserves (as `expandable_segments_reserve`)",
    ),
    ("backend", "nothing when `native` (the caching allocator)"),
    ("device_specific_option_mb", "nothing the model follows"),
];

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_split_size: None,
            roundup_power2_divisions: vec![0; 16],
            garbage_collection_threshold: None,
            expandable_segments: false,
            per_process_memory_fraction: None,
            large_segment_size: None,
            max_non_split_rounding: None,
            inert: Vec::new(),
            fraction_shown: false,
        }
    }
}

impl Settings {
    /// The settings a snapshot's `allocator_settings` records (missing
    /// keys keep PyTorch's defaults).
    pub fn from_snapshot(s: &serde_json::Value) -> Settings {
        let mut out = Settings::default();
        if let Some(m) = s.get("max_split_size").and_then(|v| v.as_i64()) {
            out.max_split_size = (m > 0 && m < i64::MAX).then_some(m as u64);
        }
        if let Some(d) = s.get("roundup_power2_divisions") {
            match d {
                serde_json::Value::Object(map) => {
                    // Keys are interval starts in MiB-ish units ("1", "2", …);
                    // in order of size they are the intervals from 1 MiB up.
                    let mut by_size: Vec<(u64, u64)> = map
                        .iter()
                        .filter_map(|(k, v)| Some((k.parse::<u64>().ok()?, v.as_u64().unwrap_or(0))))
                        .collect();
                    by_size.sort_unstable();
                    for (i, (_, v)) in by_size.into_iter().enumerate().take(out.roundup_power2_divisions.len()) {
                        out.roundup_power2_divisions[i] = v;
                    }
                }
                serde_json::Value::Array(list) => {
                    for (i, v) in list.iter().enumerate().take(out.roundup_power2_divisions.len()) {
                        out.roundup_power2_divisions[i] = v.as_u64().unwrap_or(0);
                    }
                }
                serde_json::Value::Number(n) => out.roundup_power2_divisions.fill(n.as_u64().unwrap_or(0)),
                _ => {}
            }
        }
        if let Some(g) = s.get("garbage_collection_threshold").and_then(|v| v.as_f64()) {
            out.garbage_collection_threshold = (g > 0.0).then_some(g);
        }
        out.expandable_segments = s.get("expandable_segments").and_then(|v| v.as_bool()).unwrap_or(false);
        out
    }

    /// These settings as a snapshot's `allocator_settings` records them
    /// (what [`Settings::from_snapshot`] reads back).
    pub fn to_snapshot(&self) -> serde_json::Value {
        serde_json::json!({
            "max_split_size": self.max_split_size.map_or(i64::MAX, |m| m as i64),
            "roundup_power2_divisions": self.roundup_power2_divisions,
            "garbage_collection_threshold": self.garbage_collection_threshold.unwrap_or(0.0),
            "expandable_segments": self.expandable_segments,
        })
    }

    /// Applies one `PYTORCH_CUDA_ALLOC_CONF` entry (`key:value`). A value
    /// of `default` (fragscope's, not PyTorch's) puts back PyTorch's
    /// default for that key: the recorded settings without it.
    pub fn apply(&mut self, entry: &str) -> Result<(), String> {
        let (key, value) = entry
            .split_once(':')
            .ok_or_else(|| format!("`{entry}`: expected KEY:VALUE, as in PYTORCH_CUDA_ALLOC_CONF"))?;
        let bad = |what: &str| format!("`{entry}`: {key} takes {what}");
        if value.trim() == "default" {
            let d = Settings::default();
            match key.trim() {
                "max_split_size_mb" => self.max_split_size = d.max_split_size,
                "roundup_power2_divisions" => self.roundup_power2_divisions = d.roundup_power2_divisions,
                "garbage_collection_threshold" => self.garbage_collection_threshold = d.garbage_collection_threshold,
                "expandable_segments" => self.expandable_segments = d.expandable_segments,
                "per_process_memory_fraction" => self.per_process_memory_fraction = d.per_process_memory_fraction,
                "large_segment_size_mb" => self.large_segment_size = d.large_segment_size,
                "max_non_split_rounding_mb" => self.max_non_split_rounding = d.max_non_split_rounding,
                k if inert(k).is_some() => self.inert.retain(|e| e.split(':').next() != Some(k)),
                other => return Err(format!("`{entry}`: unknown key `{other}`")),
            }
            return Ok(());
        }
        match key.trim() {
            "max_split_size_mb" | "max_non_split_rounding_mb" => {
                let mb: u64 = value.trim().parse().map_err(|_| bad("a whole number of MiB"))?;
                // PyTorch: at least the large segment size (20 MiB).
                let least = self.large_segment() >> 20;
                if mb < least {
                    return Err(bad(&format!("at least {least} (MiB), as PyTorch requires")));
                }
                let v = Some(mb.min(u64::MAX >> 20) << 20);
                if key.trim() == "max_split_size_mb" {
                    self.max_split_size = v;
                } else {
                    self.max_non_split_rounding = v;
                }
            }
            "large_segment_size_mb" => {
                let mb: u64 = value.trim().parse().map_err(|_| bad("a whole number of MiB"))?;
                if mb <= 10 {
                    return Err(bad("more than 10 (MiB), as PyTorch requires"));
                }
                self.large_segment_size = Some(mb << 20);
            }
            "roundup_power2_divisions" => {
                let v = value.trim();
                if let Some(list) = v.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                    self.roundup_power2_divisions = divisions_list(list).map_err(|e| bad(&e))?;
                } else {
                    let d: u64 = v.parse().map_err(|_| bad("a power of two, or a list `[64:8,>:1]`"))?;
                    if d != 0 && !d.is_power_of_two() {
                        return Err(bad("a power of two"));
                    }
                    self.roundup_power2_divisions.fill(d);
                }
            }
            "garbage_collection_threshold" => {
                let g: f64 = value.trim().parse().map_err(|_| bad("a fraction between 0 and 1"))?;
                if !(g > 0.0 && g < 1.0) {
                    return Err(bad("a fraction strictly between 0 and 1"));
                }
                self.garbage_collection_threshold = Some(g);
            }
            "expandable_segments" => {
                self.expandable_segments = match value.trim() {
                    "True" | "true" => true,
                    "False" | "false" => false,
                    _ => return Err(bad("True or False")),
                };
            }
            // Stands for torch.cuda.set_per_process_memory_fraction(F).
            "per_process_memory_fraction" => {
                let f: f64 = value.trim().parse().map_err(|_| bad("a fraction in (0, 1]"))?;
                if !(f > 0.0 && f <= 1.0) {
                    return Err(bad("a fraction in (0, 1]"));
                }
                self.per_process_memory_fraction = Some(f);
            }
            "backend" if value.trim() != "native" => {
                return Err(format!(
                    "`{entry}`: the model is of PyTorch's native caching allocator; `{}` is another allocator \
                     (CUDA's own pools), which it does not replay",
                    value.trim()
                ));
            }
            k if inert(k).is_some() => {
                self.inert.retain(|e| e.split(':').next() != Some(k));
                self.inert.push(format!("{k}:{}", value.trim()));
            }
            other => {
                return Err(format!(
                    "`{entry}`: unknown key `{other}` (modelled: max_split_size_mb, max_non_split_rounding_mb, \
                     large_segment_size_mb, roundup_power2_divisions, garbage_collection_threshold, \
                     expandable_segments, per_process_memory_fraction; accepted without effect on placement: {})",
                    INERT_KEYS.iter().map(|k| k.0).collect::<Vec<_>>().join(", ")
                ));
            }
        }
        Ok(())
    }

    /// The settings that differ from PyTorch's defaults, as
    /// `PYTORCH_CUDA_ALLOC_CONF` entries (`roundup_power2_divisions` as
    /// one value when every interval has it, else PyTorch's list form).
    pub fn conf_entries(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(m) = self.max_split_size {
            out.push(format!("max_split_size_mb:{}", m.div_ceil(1 << 20)));
        }
        let d = &self.roundup_power2_divisions;
        if d.iter().any(|&v| v > 1) {
            if d.iter().all(|&v| v == d[0]) {
                out.push(format!("roundup_power2_divisions:{}", d[0]));
            } else {
                let list: Vec<String> = d.iter().enumerate().map(|(i, v)| format!("{}:{v}", 1u64 << i)).collect();
                out.push(format!("roundup_power2_divisions:[{}]", list.join(",")));
            }
        }
        if let Some(g) = self.garbage_collection_threshold {
            out.push(format!("garbage_collection_threshold:{g}"));
        }
        if self.expandable_segments {
            out.push("expandable_segments:True".into());
        }
        if let Some(f) = self.per_process_memory_fraction {
            out.push(format!("per_process_memory_fraction:{f}"));
        }
        if let Some(l) = self.large_segment_size {
            out.push(format!("large_segment_size_mb:{}", l >> 20));
        }
        if let Some(m) = self.max_non_split_rounding {
            out.push(format!("max_non_split_rounding_mb:{}", m >> 20));
        }
        out.extend(self.inert.iter().cloned());
        out
    }

    /// The segment of a large request under 10 MiB, and the large pool's
    /// page of expandable segments: `large_segment_size_mb`, else 20 MiB.
    pub fn large_segment(&self) -> u64 {
        self.large_segment_size.unwrap_or(LARGE_BUFFER)
    }

    /// How much larger than an oversize request a cached block it takes
    /// may be: `max_non_split_rounding_mb`, else the large segment size.
    pub fn non_split_rounding(&self) -> u64 {
        self.max_non_split_rounding.unwrap_or_else(|| self.large_segment())
    }

    /// The size of a new segment for a rounded request
    /// (`get_allocation_size`): 2 MiB for small requests, the large
    /// segment size below 10 MiB, else the request rounded up to 2 MiB.
    pub fn segment_size(&self, rounded: u64) -> u64 {
        if rounded <= SMALL_SIZE {
            SMALL_BUFFER
        } else if rounded < MIN_LARGE_ALLOC {
            self.large_segment()
        } else {
            rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
        }
    }

    /// The garbage collection threshold in force: PyTorch 2.11 runs
    /// `garbage_collect_cached_blocks` only when a per-process memory
    /// fraction below 1 is set (`allowed_memory_maximum`; a fraction of 1
    /// sets no limit), so the threshold alone changes nothing.
    pub fn collects_garbage(&self) -> Option<f64> {
        self.garbage_collection_threshold
            .filter(|_| self.fraction_shown || self.per_process_memory_fraction.is_some_and(|f| f < 1.0))
    }

    /// The memory the allocator may hold on a device of `capacity` bytes:
    /// the per-process fraction of it, when one is set.
    pub fn limit(&self, capacity: Option<u64>) -> Option<u64> {
        match (capacity, self.per_process_memory_fraction) {
            (Some(c), Some(f)) => Some((f * c as f64) as u64),
            (c, _) => c,
        }
    }

    /// The allocated size of a request.
    pub fn round(&self, size: u64) -> u64 {
        if size <= MIN_BLOCK {
            return MIN_BLOCK;
        }
        let divisions = self.divisions(size);
        if divisions > 1 && size > MIN_BLOCK * divisions {
            next_division(size, divisions)
        } else {
            size.div_ceil(MIN_BLOCK) * MIN_BLOCK
        }
    }

    fn divisions(&self, size: u64) -> u64 {
        // Interval 0 holds every size up to 1 MiB; then one per power of two.
        let log = 63 - size.leading_zeros() as usize;
        let index = log.saturating_sub(20).min(self.roundup_power2_divisions.len().saturating_sub(1));
        self.roundup_power2_divisions.get(index).copied().unwrap_or(0)
    }
}

/// PyTorch's constants for new segments.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
pub const ROUND_LARGE: u64 = 2 << 20;

/// What a key that changes neither placement nor reserved bytes changes.
pub fn inert(key: &str) -> Option<&'static str> {
    INERT_KEYS.iter().find(|k| k.0 == key).map(|k| k.1)
}

/// The entries of a `PYTORCH_CUDA_ALLOC_CONF` value (`a:1,b:[64:8,>:1]`),
/// as PyTorch's lexer splits them: at commas outside brackets, spaces
/// left out, empty entries dropped.
pub fn split_conf(conf: &str) -> impl Iterator<Item = &str> {
    let mut depth = 0i32;
    conf.split(move |c| {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => {}
        }
        c == ',' && depth <= 0
    })
    .map(str::trim)
    .filter(|e| !e.is_empty())
}

/// `roundup_power2_divisions:[64:8,128:2,>:1]` as PyTorch parses it: each
/// `interval:divisions` sets the interval that starts at `interval` MiB
/// (the first also every interval below it), `>` the last one named and
/// every interval after it (PyTorch fills from that interval on, itself
/// included).
fn divisions_list(list: &str) -> Result<Vec<u64>, String> {
    let mut out = vec![0u64; 16];
    let mut last = 0usize;
    for (n, item) in list.split(',').map(str::trim).filter(|i| !i.is_empty()).enumerate() {
        let (interval, d) = item.split_once(':').ok_or_else(|| format!("`{item}` is not INTERVAL:DIVISIONS"))?;
        let d: u64 = d.trim().parse().map_err(|_| format!("`{item}`: divisions must be a whole number"))?;
        if d != 0 && !d.is_power_of_two() {
            return Err(format!("`{item}`: divisions must be a power of two or 0"));
        }
        if interval.trim() == ">" {
            out[last..].fill(d);
            continue;
        }
        let mb: u64 = interval.trim().parse().map_err(|_| format!("`{item}`: the interval must be a number of MiB"))?;
        if !mb.is_power_of_two() {
            return Err(format!("`{item}`: the interval must be a power of two"));
        }
        let index = (63 - mb.leading_zeros() as usize).min(15);
        if n == 0 {
            out[..index].fill(d);
        }
        out[index] = d;
        last = index;
    }
    Ok(out)
}

/// `roundup_power2_next_division`: up to the next of `divisions` equal
/// steps between the powers of two around `size`.
fn next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size { size } else { down + step }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conf_entries_give_back_what_differs_from_the_defaults() {
        assert!(Settings::default().conf_entries().is_empty());
        let mut s = Settings::default();
        for e in ["max_split_size_mb:64", "roundup_power2_divisions:4", "expandable_segments:True"] {
            s.apply(e).unwrap();
        }
        let entries = s.conf_entries();
        assert_eq!(entries, ["max_split_size_mb:64", "roundup_power2_divisions:4", "expandable_segments:True"]);
        // They parse back to the same settings.
        let mut back = Settings::default();
        for e in &entries {
            back.apply(e).unwrap();
        }
        assert_eq!(back, s);
        // Divisions that differ by interval: PyTorch's list form.
        s.roundup_power2_divisions[3] = 8;
        assert!(s.conf_entries()[1].starts_with("roundup_power2_divisions:[1:4,2:4,4:4,8:8,"));
    }

    #[test]
    fn settings_go_into_a_snapshots_allocator_settings_and_back() {
        let mut s = Settings::default();
        for e in [
            "max_split_size_mb:64",
            "roundup_power2_divisions:4",
            "expandable_segments:True",
            "garbage_collection_threshold:0.8",
        ] {
            s.apply(e).unwrap();
        }
        assert_eq!(Settings::from_snapshot(&s.to_snapshot()), s);
        assert_eq!(Settings::from_snapshot(&Settings::default().to_snapshot()), Settings::default());
    }
}
