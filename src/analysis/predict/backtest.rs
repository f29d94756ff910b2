//! The online backtest: one pass over the series in step order, training
//! the model wherever a consumer needs it (each retraining of the
//! backtest, each cross-validation origin, the last step), warm-started
//! from the training before, and recording what a live monitor would have
//! forecast at each step from the data it had.

use super::cv::{CvMae, CvTally, cv_origins};
use super::model::{Accumulator, Forecaster, Inputs};
use super::series::{PredictConfig, Risk, Step};

/// What one pass over a series gives: the model trained on all of it,
/// the cross-validation and the online backtest.
pub(super) struct Pass {
    pub(super) model: Option<Forecaster>,
    pub(super) cv: Option<CvMae>,
    pub(super) backtest: Backtest,
}

/// One pass over the series. The model is trained, in step order, at each
/// point any consumer needs — at each cross-validation origin, at the last
/// step for the forecast, and for the online backtest whenever its model
/// would otherwise be more than [`retrain_interval`] steps old (an
/// origin's training serves the backtest too: with the default 50 origins
/// over 1 000 steps, 71 trainings where there were 101) — each training
/// warm-started from the one before
/// (they differ by a few samples). Every training only sees the samples
/// whose targets lie at or before its step.
pub(super) fn run(series: &[Step], cfg: &PredictConfig, period: Option<usize>) -> Pass {
    let n = series.len();
    let mut pass = Pass { model: None, cv: None, backtest: Backtest { forecasts: vec![None; n], risk: vec![None; n] } };
    if cfg.window == 0 || cfg.horizon == 0 || n == 0 {
        return pass;
    }
    let period = period.filter(|&p| p >= 1 && p < n);
    let origins = cv_origins(n, cfg);
    let every = retrain_interval(cfg, n);
    let mut acc = Accumulator::new(series, Inputs::new(cfg, period, n));
    let mut tally = CvTally::new();
    let mut next_origin = origins.iter().copied().peekable();
    let mut model: Option<Forecaster> = None;
    let (mut trained_at, mut tried_at) = (None, None);
    for t in 0..n {
        let at_origin = next_origin.next_if_eq(&t).is_some();
        // The backtest's model is never more than `every` steps old: a
        // training made for an origin serves it too.
        let due = tried_at.is_none_or(|at| t >= at + every);
        if due || model.is_none() || at_origin || t == n - 1 {
            tried_at = Some(t);
            if let Some(m) = Forecaster::train(&mut acc, t, cfg, model.as_ref()) {
                model = Some(m);
                trained_at = Some(t);
            }
        }
        let Some(m) = &model else {
            tally.failed |= at_origin;
            continue;
        };
        let f = m.forecast(series, t);
        if at_origin {
            if trained_at == Some(t) {
                tally.add(&mut acc, t, &f, cfg, period);
            } else {
                tally.failed = true;
            }
        }
        let f: Vec<f64> = f.into_iter().map(|v| v.clamp(0.0, 100.0)).collect();
        pass.backtest.risk[t] = Some(Risk::of(f.iter().copied().fold(f64::MIN, f64::max)));
        pass.backtest.forecasts[t] = Some(f);
    }
    pass.cv = tally.finish(period);
    pass.model = model.filter(|_| trained_at == Some(n - 1));
    pass
}

/// The online backtest of one process: per step, the forecasts and risk a
/// monitor would have reported from the data up to that step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Backtest {
    pub forecasts: Vec<Option<Vec<f64>>>,
    pub risk: Vec<Option<Risk>>,
}

/// Steps between retrainings of the online backtest: `retrain_every`, but
/// at most about 200 retrainings over the series (long series with fine
/// steps would otherwise retrain tens of thousands of times).
pub fn retrain_interval(cfg: &PredictConfig, steps: usize) -> usize {
    cfg.retrain_every.max(steps.div_ceil(200)).max(1)
}
