//! Rolling-origin cross-validation: the origins ([`cv_origins`]), the
//! MAE of every forecaster at each ([`CvTally`], [`CvMae`]) and the choice
//! of the forecaster with the lowest ([`CvMae::best`]).

use serde::Serialize;

use super::baselines::{RIDGE_GRID, seasonal_index};
use super::model::{Accumulator, Forecaster, min_samples};
use super::series::{COLUMNS, PredictConfig};

/// The forecasters compared by the cross-validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ForecasterKind {
    /// SPEC §6's windowed linear model, trained by gradient descent.
    Model,
    /// "No change": the score stays at its last value.
    Persistence,
    /// The score one iteration period earlier.
    Seasonal,
    /// Ridge regression on the model's inputs.
    Ridge,
}

impl ForecasterKind {
    pub fn name(self) -> &'static str {
        match self {
            ForecasterKind::Model => "model",
            ForecasterKind::Persistence => "persistence",
            ForecasterKind::Seasonal => "seasonal",
            ForecasterKind::Ridge => "ridge",
        }
    }
}

/// Cross-validated mean absolute errors, in score points. A baseline that
/// could not be evaluated is `None`, with the reason.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CvMae {
    pub model: f64,
    pub persistence: f64,
    /// Over the origins with one period of history (`seasonal_origins`);
    /// `None` when fewer than half of the origins have it.
    pub seasonal: Option<f64>,
    pub seasonal_origins: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seasonal_reason: Option<String>,
    pub ridge: Option<f64>,
    /// The ridge penalty the cross-validation chose, per training sample.
    pub ridge_lambda: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ridge_reason: Option<String>,
    pub origins: usize,
}

impl CvMae {
    /// The forecaster with the lowest MAE; ties go to the simpler one
    /// (persistence, then seasonal, ridge, model).
    pub fn best(&self) -> (ForecasterKind, f64) {
        let mut best = (ForecasterKind::Persistence, self.persistence);
        for (kind, mae) in [
            (ForecasterKind::Seasonal, self.seasonal),
            (ForecasterKind::Ridge, self.ridge),
            (ForecasterKind::Model, Some(self.model)),
        ] {
            if let Some(m) = mae.filter(|m| m.is_finite())
                && m < best.1
            {
                best = (kind, m);
            }
        }
        best
    }
}

/// The rolling origins of the cross-validation: at most `cv_origins`,
/// from the first step with enough history to the last with H steps after
/// it, one in each of `cv_origins` equal stretches of that range. Empty
/// when there is no such step.
///
/// Within its stretch, origin i sits at the fraction frac(i·φ) (the golden
/// ratio's low-discrepancy sequence), not at the stretch's start. Evenly
/// spaced origins alias with a periodic score: 50 origins over 1 000 steps
/// of 49 iterations are exactly one period apart, so every origin fell at
/// the same phase, and the cross-validation never saw the once-per-
/// iteration spike that decides between the forecasters. The sequence is
/// deterministic, so reruns agree.
pub(super) fn cv_origins(n: usize, cfg: &PredictConfig) -> Vec<usize> {
    let (w, h) = (cfg.window, cfg.horizon);
    let first = w - 1 + min_samples(cfg) - 1 + h;
    let Some(last) = n.checked_sub(h + 1).filter(|&last| first <= last) else {
        return Vec::new();
    };
    let span = last - first + 1;
    let count = span.min(cfg.cv_origins.max(1));
    const PHI: f64 = 0.618_033_988_749_894_9;
    if count == 1 {
        return vec![last];
    }
    (0..count)
        .map(|i| {
            let (lo, hi) = (i * span / count, (i + 1) * span / count);
            let within = ((i as f64 * PHI).fract() * (hi - lo) as f64) as usize;
            first + lo + within.min(hi - lo - 1)
        })
        .collect()
}

/// The absolute errors of the cross-validation, summed as the origins go.
pub(super) struct CvTally {
    pub(super) model: f64,
    pub(super) persistence: f64,
    pub(super) seasonal: f64,
    pub(super) seasonal_m: usize,
    pub(super) seasonal_origins: usize,
    pub(super) ridge: [f64; RIDGE_GRID.len()],
    pub(super) ridge_ok: [bool; RIDGE_GRID.len()],
    pub(super) m: usize,
    pub(super) origins: usize,
    /// An origin where the model could not be trained: no cross-validation.
    pub(super) failed: bool,
}

impl CvTally {
    pub(super) fn new() -> CvTally {
        CvTally {
            model: 0.0,
            persistence: 0.0,
            seasonal: 0.0,
            seasonal_m: 0,
            seasonal_origins: 0,
            ridge: [0.0; RIDGE_GRID.len()],
            ridge_ok: [true; RIDGE_GRID.len()],
            m: 0,
            origins: 0,
            failed: false,
        }
    }

    /// Scores origin `t`: the model's forecast `f` (trained up to `t`),
    /// persistence, seasonal, and ridge at every penalty of the grid.
    pub(super) fn add(
        &mut self,
        acc: &mut Accumulator,
        t: usize,
        f: &[f64],
        cfg: &PredictConfig,
        period: Option<usize>,
    ) {
        let h = cfg.horizon;
        let series = acc.series;
        let fr: Vec<Option<Vec<f64>>> = Forecaster::train_ridges(acc, t, cfg, &RIDGE_GRID)
            .into_iter()
            .map(|r| r.map(|r| r.forecast(series, t)).filter(|v| v.iter().all(|x| x.is_finite())))
            .collect();
        let score = |i: usize| series[i][COLUMNS - 1];
        for k in 1..=h {
            let actual = score(t + k);
            self.model += (f[k - 1] - actual).abs();
            self.persistence += (score(t) - actual).abs();
            if let Some(i) = period.and_then(|p| seasonal_index(t, k, p)) {
                self.seasonal += (score(i) - actual).abs();
                self.seasonal_m += 1;
                self.seasonal_origins += usize::from(k == 1);
            }
            for (g, r) in fr.iter().enumerate() {
                match r {
                    Some(r) => self.ridge[g] += (r[k - 1] - actual).abs(),
                    None => self.ridge_ok[g] = false,
                }
            }
            self.m += 1;
        }
        self.origins += 1;
    }

    pub(super) fn finish(self, period: Option<usize>) -> Option<CvMae> {
        if self.failed || self.origins == 0 {
            return None;
        }
        let m = self.m as f64;
        let best_ridge = (0..RIDGE_GRID.len())
            .filter(|&g| self.ridge_ok[g])
            .min_by(|&a, &b| self.ridge[a].total_cmp(&self.ridge[b]));
        let seasonal_reason = match period {
            None => Some("no iteration period is known".to_string()),
            Some(p) if self.seasonal_origins * 2 < self.origins => {
                Some(format!("the period ({p} steps) is longer than the history at most origins"))
            }
            Some(_) => None,
        };
        Some(CvMae {
            model: self.model / m,
            persistence: self.persistence / m,
            seasonal: seasonal_reason.is_none().then(|| self.seasonal / self.seasonal_m as f64),
            seasonal_origins: self.seasonal_origins,
            seasonal_reason,
            ridge: best_ridge.map(|g| self.ridge[g] / m),
            ridge_lambda: best_ridge.map(|g| RIDGE_GRID[g]),
            ridge_reason: best_ridge.is_none().then(|| "no stable fit at every origin".to_string()),
            origins: self.origins,
        })
    }
}
