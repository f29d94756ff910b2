//! The predictor (SPEC §6): where fragmentation is heading. Input: the
//! metric rows of one process (its regular steps); output: a forecast of the
//! score for the next H steps with a cross-validated confidence, the trend,
//! a risk level, warnings, the two baselines the model must be compared
//! with, and an online backtest (what a live monitor would have said at
//! each step from the data it had).
//!
//! The model is SPEC §6's windowed linear model: z-scored features and
//! score of the last W steps (7·W values) → one linear model per horizon
//! step, trained by batch gradient descent on the mean squared error.
//! When the iteration period is known, the inputs also hold, per horizon
//! step, the change the seasonal baseline forecasts (z-scored with the
//! score's std; see [`Inputs`]): W steps cannot tell where in a longer
//! iteration they stand. With zero weight on them it is SPEC §6's model.
//! It predicts the *change* of the score from the last step, divided by
//! its std but not centred, so all-zero parameters mean persistence ("no
//! change") and gradient descent starts from there.
//!
//! Where SPEC §6 leaves room, the model is trained as a careful
//! practitioner would, to stop it chasing noise (issue: verdicts a
//! PyTorch user can trust):
//! - **Early stopping on held-out samples.** The latest fifth of the
//!   training samples (when there are at least twice the minimum) is held
//!   out; gradient descent runs on the rest, "the loss" of the 20-iteration
//!   patience rule is the held-out loss, and the parameters with the lowest
//!   held-out loss are kept. Without enough samples, the training loss.
//! - **Do no harm.** A horizon step whose held-out forecasts are, in mean
//!   absolute error, no better than "no change" is set to no change.
//! - **Warm starts.** The model is trained in one pass over the series, at
//!   every point the cross-validation, the online backtest and the final
//!   forecast need ([`run`]); each training starts from the previous one's
//!   parameters. This and the shared trainings halve the predictor's cost.
//!
//! Every training, held-out part included, only sees samples whose
//! targets lie at or before its step.
//! [`GradientDescent`] implements linfa's `Fit` and `PredictInplace`, so it
//! is used like any linfa model. The gradient is computed from the Gram
//! matrix XᵀX, Xᵀy and the column sums — algebraically the same gradient
//! as over the samples, in O(d²) per iteration instead of O(n·d).
//!
//! The forecasters compared by the same rolling-origin cross-validation:
//! - the model;
//! - persistence: the score stays as it is;
//! - seasonal: the score one iteration period earlier (when iterations
//!   are known and span at least one step);
//! - ridge: a *stable* least-squares fit of the same windowed problem,
//!   `(XᵀX + λI)⁻¹Xᵀy` with λ chosen by the cross-validation, solved by
//!   Cholesky (the system is 7·W + 1 wide and positive definite; a
//!   hand-written solve avoids a LAPACK system dependency). Plain OLS blew
//!   up to 10¹⁵ on the collinear windows of real snapshots.
//!
//! The forecaster with the lowest cross-validated MAE makes the headline
//! forecast and the risk ([`Prediction::forecaster`]); its skill is
//! 1 − MAE / MAE(persistence). The online backtest stays the model's.

//! The files: [`series`] (the inputs and settings), [`model`] (the seed's
//! gradient descent), [`baselines`] (persistence, seasonal, ridge),
//! [`cv`] (origins, MAE, the choice), [`backtest`] (the one pass) and
//! [`linalg`] (the product and its intrinsics). This module drives them.

mod backtest;
mod baselines;
mod cv;
mod linalg;
mod model;
mod series;

use serde::Serialize;

pub use backtest::{Backtest, retrain_interval};
use backtest::{Pass, run};
use baselines::seasonal_index;
pub use cv::{CvMae, ForecasterKind};
pub use linalg::GramStats;
use model::{Accumulator, Forecaster, Inputs};
pub use model::{FittedGradientDescent, GradientDescent};
pub use series::{COLUMNS, PredictConfig, Risk, Step};

/// Rolling-origin cross-validation: at each origin t (at most
/// `cv_origins`, spread over the series), forecasters trained only on samples whose
/// targets end at or before t predict t+1 … t+H. `period` is the iteration
/// period in steps, when known. None when no origin has enough history.
pub fn cross_validate(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> Option<CvMae> {
    run(series, cfg, period).cv
}

/// Least-squares slope of the last `window` values against their index.
pub fn trend(values: &[f64], window: usize) -> f64 {
    let v = &values[values.len().saturating_sub(window.max(2))..];
    let n = v.len() as f64;
    if v.len() < 2 {
        return 0.0;
    }
    let mx = (n - 1.0) / 2.0;
    let my = v.iter().sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (i, y) in v.iter().enumerate() {
        sxy += (i as f64 - mx) * (y - my);
        sxx += (i as f64 - mx).powi(2);
    }
    sxy / sxx
}

/// The prediction of one process.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub window: usize,
    pub horizon: usize,
    /// The headline forecast, by [`Prediction::forecaster`]. None when
    /// there is not enough data (fewer than W + H + 1 steps).
    pub forecast: Option<Vec<f64>>,
    /// The forecaster with the lowest cross-validated MAE (the model when
    /// no origin could be validated).
    pub forecaster: ForecasterKind,
    /// 1 − MAE(forecaster) / MAE(persistence): above 0 it beats "no
    /// change". None without cross-validation or when persistence is exact.
    pub skill: Option<f64>,
    /// The model's own forecast, whatever the forecaster.
    pub model_forecast: Option<Vec<f64>>,
    pub current: f64,
    /// SPEC §6's formula, max(0.1, 1 − MAE/50), for the forecaster used.
    pub confidence: Option<f64>,
    /// The same for the model.
    pub confidence_model: Option<f64>,
    pub trend: f64,
    pub risk: Option<Risk>,
    pub warnings: Vec<String>,
    pub cv_mae: Option<CvMae>,
}

impl Prediction {
    /// "No change" forecast every cross-validation origin exactly: the
    /// score never moved, and a confidence computed from those errors
    /// means nothing (the report and report.json do not rate it).
    pub fn flat_score(&self) -> bool {
        self.cv_mae.as_ref().is_some_and(|cv| cv.persistence < 1e-9)
    }
}

/// Everything SPEC §6 asks of one series; `period` is the iteration
/// period in steps, when known (the seasonal baseline).
pub fn predict(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> Prediction {
    predict_with_backtest(series, cfg, period).0
}

/// [`predict`] and [`backtest`] from one pass over the series (see the
/// module documentation).
pub fn predict_with_backtest(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> (Prediction, Backtest) {
    let scores: Vec<f64> = series.iter().map(|s| s[COLUMNS - 1]).collect();
    let current = scores.last().copied().unwrap_or(0.0);
    let trend = trend(&scores, cfg.trend_window);
    let mut p = Prediction {
        window: cfg.window,
        horizon: cfg.horizon,
        forecast: None,
        forecaster: ForecasterKind::Model,
        skill: None,
        model_forecast: None,
        current,
        confidence: None,
        confidence_model: None,
        trend,
        risk: None,
        warnings: Vec::new(),
        cv_mae: None,
    };
    let Pass { model, cv, backtest } = run(series, cfg, period);
    if cfg.window == 0 || cfg.horizon == 0 || series.len() < cfg.window + cfg.horizon + 1 {
        return (p, backtest);
    }
    let last = series.len() - 1;
    let Some(model) = model else {
        return (p, backtest);
    };
    let clamp = |f: Vec<f64>| -> Vec<f64> { f.into_iter().map(|v| v.clamp(0.0, 100.0)).collect() };
    let model_forecast = clamp(model.forecast(series, last));
    let confidence_of = |mae: f64| (1.0 - mae / 50.0).max(0.1);
    // Without a cross-validation origin nothing is proven: the model, at
    // the lowest confidence.
    let (forecaster, mae) = cv.as_ref().map_or((ForecasterKind::Model, f64::NAN), CvMae::best);
    let forecast = match forecaster {
        ForecasterKind::Model => Some(model_forecast.clone()),
        ForecasterKind::Persistence => Some(vec![current; cfg.horizon]),
        ForecasterKind::Seasonal => period.and_then(|per| {
            (1..=cfg.horizon).map(|k| seasonal_index(last, k, per).map(|i| scores[i])).collect::<Option<Vec<_>>>()
        }),
        ForecasterKind::Ridge => cv.as_ref().and_then(|c| c.ridge_lambda).and_then(|c| {
            let mut acc = Accumulator::new(series, Inputs::new(cfg, period, series.len()));
            Forecaster::train_ridges(&mut acc, last, cfg, &[c]).pop().flatten().map(|r| r.forecast(series, last))
        }),
    };
    // A forecaster that cannot forecast now falls back to "no change".
    let (forecaster, forecast) = match forecast.filter(|f| f.iter().all(|v| v.is_finite())) {
        Some(f) => (forecaster, clamp(f)),
        None => (ForecasterKind::Persistence, vec![current; cfg.horizon]),
    };
    let mae = match (forecaster, &cv) {
        (ForecasterKind::Persistence, Some(c)) => c.persistence,
        _ => mae,
    };
    let confidence = if mae.is_finite() { confidence_of(mae) } else { 0.1 };
    p.confidence_model = Some(cv.as_ref().map_or(0.1, |c| confidence_of(c.model)));
    p.skill = cv.as_ref().filter(|c| c.persistence > 1e-9 && mae.is_finite()).map(|c| 1.0 - mae / c.persistence);
    let highest = forecast.iter().copied().fold(f64::MIN, f64::max);
    if forecast.iter().any(|f| f - current > cfg.deterioration) && confidence > cfg.min_confidence {
        p.warnings.push(format!(
            "significant deterioration: the score is forecast to rise from {current:.1} to {highest:.1} (confidence {confidence:.2})"
        ));
    }
    if let Some(w) = forecast.windows(2).find(|w| w[1] - w[0] > cfg.sharp_jump) {
        p.warnings.push(format!("sharp deterioration: consecutive forecasts jump from {:.1} to {:.1}", w[0], w[1]));
    }
    if trend.abs() > cfg.clear_trend {
        // What the last steps did, not a forecast (which may be flat: the
        // rise may be one release at the end).
        let dir = if trend > 0.0 { "rose" } else { "fell" };
        p.warnings.push(format!(
            "clear trend: the score {dir} by {:.2} points per step over the last {} steps",
            trend.abs(),
            cfg.trend_window.max(2).min(scores.len())
        ));
    }
    p.risk = Some(Risk::of(highest));
    p.forecast = Some(forecast);
    p.forecaster = forecaster;
    p.model_forecast = Some(model_forecast);
    p.confidence = Some(confidence);
    p.cv_mae = cv;
    (p, backtest)
}

/// The online backtest: at each step t, the model's forecast from a model
/// trained on data up to the last retraining point ≤ t (see
/// [`retrain_interval`]; the cross-validation origins are retraining
/// points too), using only steps ≤ t. `period`: the iteration period in
/// steps, when known (an input of the model).
pub fn backtest(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> Backtest {
    run(series, cfg, period).backtest
}

#[cfg(test)]
mod tests;
