//! The model file (`fleet.classes`): readable JSON, versioned, naming its
//! features and their standardisation; and classifying new samples with
//! it.

use std::path::Path;

use anyhow::{Context, Result};
use ndarray::Array2;
use serde::{Deserialize, Serialize};

use super::naming::Verdicts;
use super::{FEATURES, FOLDS, LAYER_GRID, SEARCH_ROWS, Sample, ssae};

/// The `format` field of every model file.
pub const FORMAT: &str = "fragscope-classes";
/// The model file's version: a file of another version is refused.
pub const VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Model {
    pub format: String,
    pub version: u32,
    /// A hash of the rest of the file: names the model in reports.
    pub model_id: String,
    pub created_by: String,
    /// The features, in the order of every vector below.
    pub features: Vec<String>,
    /// Standardisation: z = (x − mean) / scale.
    pub mean: Vec<f64>,
    pub scale: Vec<f64>,
    pub samples: usize,
    /// Samples whose label the user gave (`--labels`).
    pub user_labelled: usize,
    pub seed: u64,
    /// The grouping behind the classes: k and (Gap(k), s_k) for k = 1 ….
    pub gap_k: usize,
    pub gaps: Vec<(f64, f64)>,
    pub classes: Vec<Class>,
    /// "ssae" or "nearest-centroid": the one that classifies.
    pub classifier: String,
    pub accuracy: Accuracy,
    pub network: Network,
    /// Set by `fit --from`: what became of the old model's classes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refit: Option<Refit>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Class {
    pub name: String,
    pub direction: String,
    /// Named by the user's labels (kept as given, never renamed).
    #[serde(default)]
    pub by_user: bool,
    pub members: usize,
    /// Mean z-scores of the members.
    pub centroid: Vec<f64>,
    /// 99th percentile of the members' distances to the centroid (z units;
    /// [`super::p99`] of the squared distances).
    pub distance_p99: f64,
    /// 99th percentile of the members' reconstruction errors (network).
    pub reconstruction_p99: f64,
    pub verdicts: Verdicts,
}

/// Cross-validated accuracy against the labels, same folds for both.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Accuracy {
    pub folds: usize,
    pub ssae: f64,
    pub nearest_centroid: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Network {
    pub hyper: ssae::Hyper,
    /// The layer-size search: 3-fold accuracy of each shape, short training.
    pub layer_search: Vec<(Vec<usize>, f64)>,
    pub hidden: Vec<usize>,
    pub net: ssae::Net,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Refit {
    pub from_model: String,
    /// The old names that a new class matched and kept.
    pub kept: Vec<String>,
    pub appeared: Vec<String>,
    pub vanished: Vec<String>,
}

/// A sample's class.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Assignment {
    /// The class, or "unclassified".
    pub name: String,
    /// The classifier's probability of the class (0 when unclassified).
    pub confidence: f64,
    pub classifier: String,
    pub model_id: String,
    /// The class's direction to optimise (None when unclassified).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub direction: Option<String>,
    /// Why a sample is unclassified (None when it has a class).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

pub const UNCLASSIFIED: &str = "unclassified";

/// The smallest radius of a class (z units): a class of one member, or of
/// identical members, would otherwise take no new sample.
pub const RADIUS_FLOOR: f64 = 0.5;
/// Under this many members a class's reconstruction threshold is at least
/// the 99th percentile over every sample.
pub const MIN_OWN_SPREAD: usize = 20;

/// Builds the model from the labelled, standardised samples.
#[allow(clippy::too_many_arguments)]
pub(super) fn build(
    samples: &[Sample],
    z: &Array2<f64>,
    mean: &[f64],
    scale: &[f64],
    labels: &[usize],
    (names, by_user): (Vec<String>, Vec<bool>),
    grouping: &crate::analysis::cluster::Clustering,
    user_labelled: usize,
    opts: &super::FitOptions,
) -> Result<Model> {
    let k = names.len();
    let n = samples.len();
    let x = super::squash(z);
    let all: Vec<usize> = (0..n).collect();
    let hy = opts.hyper;
    // The layer sizes: 3-fold accuracy on an evenly spaced subset, short
    // training, each shape once.
    let search_rows: Vec<usize> = (0..n.min(SEARCH_ROWS)).map(|i| i * n / n.min(SEARCH_ROWS)).collect();
    let xs = x.select(ndarray::Axis(0), &search_rows);
    let ls: Vec<usize> = search_rows.iter().map(|&i| labels[i]).collect();
    let search_folds = super::folds(search_rows.len(), 3, opts.seed);
    let layer_search: Vec<(Vec<usize>, f64)> = LAYER_GRID
        .iter()
        .map(|h| (h.to_vec(), super::cv_network(&xs, &ls, k, h, &hy.short(), &search_folds, opts.seed)))
        .collect();
    // The best; the network with the fewest weights on a tie (within half
    // a percent).
    let best = layer_search.iter().map(|s| s.1).fold(0.0, f64::max);
    let weights = |h: &[usize]| {
        let mut width = FEATURES.len();
        h.iter().map(|&u| std::mem::replace(&mut width, u) * u).sum::<usize>() + width * k
    };
    let hidden = layer_search
        .iter()
        .filter(|s| s.1 >= best - 0.005)
        .min_by_key(|s| weights(&s.0))
        .map_or(vec![30, 30, 30], |s| s.0.clone());
    // Both classifiers on the same folds.
    let parts = super::folds(n, FOLDS, opts.seed);
    let ssae_accuracy = super::cv_network(&x, labels, k, &hidden, &hy, &parts, opts.seed);
    let mut predicted = vec![0; n];
    for (f, part) in parts.iter().enumerate() {
        let train: Vec<usize> = (0..parts.len()).filter(|&g| g != f).flat_map(|g| parts[g].clone()).collect();
        let c = super::centroids(z, labels, k, &train);
        let held = z.select(ndarray::Axis(0), part);
        for (r, (class, _)) in super::nearest(&held, &c).into_iter().enumerate() {
            predicted[part[r]] = class;
        }
    }
    let nc_accuracy = super::accuracy(&predicted, labels, &all);
    let net = ssae::train(&x, labels, k, &hidden, &hy, opts.seed);
    let ready = net.ready(FEATURES.len(), k).context("the trained network's shapes do not chain (a bug)")?;
    let errors = ready.reconstruction_error(&x);
    // Every class has members here: its label comes from them.
    let centroids: Vec<Vec<f64>> =
        super::centroids(z, labels, k, &all).into_iter().map(Option::unwrap_or_default).collect();
    // A class of few members has no spread of its own to speak of: its
    // radius is at least RADIUS_FLOOR, and under MIN_OWN_SPREAD members
    // its reconstruction threshold is at least the 99th percentile over
    // every sample.
    let global_error = super::p99(&mut errors.clone());
    let mut classes: Vec<Class> = (0..k)
        .map(|c| {
            let members: Vec<usize> = all.iter().copied().filter(|&i| labels[i] == c).collect();
            let mut d: Vec<f64> = members.iter().map(|&i| super::distance(z.row(i), &centroids[c]).powi(2)).collect();
            let mut e: Vec<f64> = members.iter().map(|&i| errors[i]).collect();
            let verdicts = Verdicts::of(members.iter().map(|&i| &samples[i].trouble));
            let own_error = super::p99(&mut e);
            Class {
                direction: if by_user[c] {
                    super::naming::user_direction(&verdicts)
                } else {
                    super::naming::direction(&names[c], &verdicts)
                },
                name: names[c].clone(),
                by_user: by_user[c],
                members: members.len(),
                centroid: centroids[c].clone(),
                distance_p99: super::p99(&mut d).sqrt().max(RADIUS_FLOOR),
                reconstruction_p99: if members.len() < MIN_OWN_SPREAD {
                    own_error.max(global_error)
                } else {
                    own_error
                },
                verdicts,
            }
        })
        .collect();
    let refit = opts.from.as_ref().map(|old| rename(old, &mut classes, mean, scale));
    let mut model = Model {
        format: FORMAT.to_string(),
        version: VERSION,
        model_id: String::new(),
        created_by: format!("fragscope {}", env!("CARGO_PKG_VERSION")),
        features: FEATURES.iter().map(|f| f.to_string()).collect(),
        mean: mean.to_vec(),
        scale: scale.to_vec(),
        samples: n,
        user_labelled,
        seed: opts.seed,
        gap_k: grouping.k,
        gaps: grouping.gaps.clone(),
        classes,
        classifier: if ssae_accuracy > nc_accuracy { "ssae" } else { "nearest-centroid" }.to_string(),
        accuracy: Accuracy { folds: parts.len(), ssae: ssae_accuracy, nearest_centroid: nc_accuracy },
        network: Network { hyper: hy, layer_search, hidden, net },
        refit,
    };
    model.model_id = model.digest();
    Ok(model)
}

/// Keeps an old class's name wherever a new class's centroid lies within
/// the old class's radius (its members' 99th-percentile distance), the
/// closest pairs first; returns what was kept, what appeared, what vanished.
fn rename(old: &Model, classes: &mut [Class], mean: &[f64], scale: &[f64]) -> Refit {
    // A new centroid in the old model's z-scores.
    let in_old = |c: &[f64]| -> Vec<f64> {
        (0..c.len()).map(|j| (c[j] * scale[j] + mean[j] - old.mean[j]) / old.scale[j]).collect()
    };
    let mut pairs: Vec<(f64, usize, usize)> = Vec::new();
    for (i, c) in classes.iter().enumerate() {
        let z = in_old(&c.centroid);
        for (j, o) in old.classes.iter().enumerate() {
            // A name the new class's own verdicts deny is not kept, and a
            // user's class keeps the user's name.
            let base = o.name.split(" (").next().unwrap_or(&o.name);
            if c.by_user || c.verdicts.confirm(base) == Some(false) {
                continue;
            }
            let d = super::distance(ndarray::ArrayView1::from(&z[..]), &o.centroid);
            if d <= o.distance_p99.max(RADIUS_FLOOR) {
                pairs.push((d, i, j));
            }
        }
    }
    pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut new_taken, mut old_taken) = (vec![false; classes.len()], vec![false; old.classes.len()]);
    let mut refit = Refit { from_model: old.model_id.clone(), ..Refit::default() };
    for (_, i, j) in pairs {
        if new_taken[i] || old_taken[j] {
            continue;
        }
        new_taken[i] = true;
        old_taken[j] = true;
        if classes[i].name != old.classes[j].name {
            classes[i].name = old.classes[j].name.clone();
            classes[i].direction = super::naming::direction(&classes[i].name, &classes[i].verdicts);
        }
        refit.kept.push(old.classes[j].name.clone());
    }
    for (i, c) in classes.iter_mut().enumerate() {
        if !new_taken[i] {
            // A new class may not take an old class's name.
            if old.classes.iter().any(|o| o.name == c.name) {
                c.name = format!("{} (new)", c.name);
            }
            refit.appeared.push(c.name.clone());
        }
    }
    refit.vanished = old.classes.iter().zip(&old_taken).filter(|(_, t)| !**t).map(|(o, _)| o.name.clone()).collect();
    refit
}

/// Whether a serialised model holds a null where a number belongs (a
/// non-finite float); `refit` is the one field that may be null.
fn has_null_number(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Array(a) => a.iter().any(|x| x.is_null() || has_null_number(x)),
        serde_json::Value::Object(m) => m.iter().any(|(k, x)| (x.is_null() && k != "refit") || has_null_number(x)),
        _ => false,
    }
}

impl Model {
    /// FNV-1a over the model's JSON with an empty id, in hex.
    fn digest(&self) -> String {
        let mut copy = self.clone();
        copy.model_id = String::new();
        let text = serde_json::to_string(&copy).unwrap_or_default();
        let mut h = fnv::FnvHasher::default();
        std::hash::Hasher::write(&mut h, text.as_bytes());
        format!("{:016x}", std::hash::Hasher::finish(&h))
    }

    /// Writes the model as pretty JSON, whole or not at all.
    pub fn save(&self, path: &Path) -> Result<()> {
        // serde_json writes a non-finite number as null, which would not
        // read back: refuse it here, naming the cause.
        if has_null_number(&serde_json::to_value(self)?) {
            anyhow::bail!(
                "{}: not written: the model holds a non-finite number (a feature too large to standardise?)",
                path.display()
            );
        }
        let text = serde_json::to_string_pretty(self)?;
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let mut tmp =
            tempfile::NamedTempFile::new_in(dir).with_context(|| format!("cannot write {}", path.display()))?;
        std::io::Write::write_all(&mut tmp, text.as_bytes())
            .and_then(|_| std::io::Write::write_all(&mut tmp, b"\n"))
            .with_context(|| format!("cannot write {}", path.display()))?;
        // A temporary file is private (0600); a model is shared like a report.
        #[cfg(unix)]
        std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .with_context(|| format!("cannot write {}", path.display()))?;
        tmp.persist(path).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(())
    }

    /// Reads and checks a model file: its format, version, features,
    /// shapes and id.
    pub fn load(path: &Path) -> Result<Model> {
        let show = path.display();
        let bytes = std::fs::read(path).with_context(|| format!("cannot read the class model {show}"))?;
        let value: serde_json::Value = serde_json::from_slice(&bytes).with_context(|| {
            format!("{show}: not a fragscope class model (not JSON; `fragscope classes fit` writes one)")
        })?;
        let format = value.get("format").and_then(|f| f.as_str());
        if format != Some(FORMAT) {
            anyhow::bail!("{show}: not a fragscope class model (format {format:?}, want \"{FORMAT}\")");
        }
        let version = value.get("version").and_then(|v| v.as_u64());
        if version != Some(VERSION as u64) {
            anyhow::bail!(
                "{show}: a class model of version {}, this fragscope reads version {VERSION}; fit it again with this fragscope",
                version.map_or("?".to_string(), |v| v.to_string())
            );
        }
        let model: Model =
            serde_path_to_error::deserialize(value).map_err(|e| match e.path().to_string().as_str() {
                // A field missing at the top: no path to name.
                "." => anyhow::anyhow!("{show}: not a complete class model: {}", e.inner()),
                field => anyhow::anyhow!("{show}: field `{field}` does not read: {}", e.inner()),
            })?;
        let want: Vec<String> = FEATURES.iter().map(|f| f.to_string()).collect();
        if model.features != want {
            anyhow::bail!(
                "{show}: the model was fitted on other features ({}); this fragscope computes {}; fit it again",
                model.features.join(", "),
                want.join(", ")
            );
        }
        let d = FEATURES.len();
        let shapes = model.mean.len() == d
            && model.scale.len() == d
            && model.scale.iter().all(|s| s.is_finite() && *s > 0.0)
            && !model.classes.is_empty()
            && model.classes.iter().all(|c| c.centroid.len() == d)
            && model.network.net.ready(d, model.classes.len()).is_some();
        if !shapes {
            anyhow::bail!("{show}: damaged class model (a vector or weight matrix has the wrong length)");
        }
        if model.digest() != model.model_id {
            anyhow::bail!(
                "{show}: damaged or edited class model (its content does not match its id {})",
                model.model_id
            );
        }
        Ok(model)
    }

    /// The class of each feature vector (non-finite features read as 0).
    pub fn classify(&self, rows: &[[f64; FEATURES.len()]]) -> Vec<Assignment> {
        let z = super::standardise(rows, &self.mean, &self.scale);
        let centroids: Vec<Vec<f64>> = self.classes.iter().map(|c| c.centroid.clone()).collect();
        let near = super::nearest(&z, &centroids.iter().cloned().map(Some).collect::<Vec<_>>());
        let network = self.classifier == "ssae";
        let ready = self.network.net.ready(FEATURES.len(), self.classes.len());
        let (probs, errors) = match (&ready, network) {
            (Some(r), true) => {
                let x = super::squash(&z);
                (Some(r.probabilities(&x)), r.reconstruction_error(&x))
            }
            _ => (None, vec![0.0; rows.len()]),
        };
        (0..rows.len())
            .map(|i| {
                let (class, confidence) = match &probs {
                    Some(p) => {
                        let c = super::argmax(p.row(i));
                        (c, p[[i, c]])
                    }
                    None => {
                        // A Gaussian posterior of unit variance around each centroid.
                        let d: Vec<f64> = centroids.iter().map(|m| super::distance(z.row(i), m)).collect();
                        let w: Vec<f64> = d.iter().map(|v| (-(v * v - near[i].1 * near[i].1) / 2.0).exp()).collect();
                        (near[i].0, 1.0 / w.iter().sum::<f64>())
                    }
                };
                let c = &self.classes[class];
                let dist = super::distance(z.row(i), &c.centroid);
                let why = if dist > c.distance_p99 {
                    Some(format!(
                        "nearest to {}, but {:.2} from its centroid, beyond its members' 99th percentile {:.2}",
                        c.name, dist, c.distance_p99
                    ))
                } else if network && errors[i] > c.reconstruction_p99 {
                    Some(format!(
                        "the network says {}, but reconstructs it with error {:.4}, beyond its members' 99th percentile {:.4}",
                        c.name, errors[i], c.reconstruction_p99
                    ))
                } else {
                    None
                };
                Assignment {
                    name: if why.is_some() { UNCLASSIFIED.to_string() } else { c.name.clone() },
                    // Four digits: a probability, not a measurement. None
                    // for an unclassified sample (its why names the nearest).
                    confidence: if why.is_some() { 0.0 } else { (confidence * 1e4).round() / 1e4 },
                    classifier: self.classifier.clone(),
                    model_id: self.model_id.clone(),
                    direction: why.is_none().then(|| c.direction.clone()),
                    why,
                }
            })
            .collect()
    }

    /// The class named `name`.
    pub fn class(&self, name: &str) -> Option<&Class> {
        self.classes.iter().find(|c| c.name == name)
    }
}
