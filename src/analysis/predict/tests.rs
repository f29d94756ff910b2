use super::*;
use super::{cv::*, linalg::*, model::*};
use linfa::prelude::*;
use linfa::traits::Fit;
use linfa_linear::LinearRegression;
use ndarray::array;
use ndarray::{Array1, Array2};

fn constant_series(n: usize, score: f64) -> Vec<Step> {
    (0..n).map(|_| [0.2, 0.1, 0.3, 0.4, 0.1, 0.6, score]).collect()
}

#[test]
fn gradient_descent_approaches_the_closed_form() {
    // y = 0.5 x1 − 0.25 x2 + 0.1, noiseless.
    let x = array![[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5], [0.5, -1.0], [2.0, 1.0], [-0.5, -0.5]];
    let y: Array1<f64> = x.rows().into_iter().map(|r| 0.5 * r[0] - 0.25 * r[1] + 0.1).collect();
    let ds = Dataset::new(x.clone(), y.clone());
    let gd = GradientDescent { max_iterations: 20_000, learning_rate: 0.05, ..Default::default() };
    let fit = gd.fit(&ds).unwrap();
    let ols = LinearRegression::new().fit(&ds).unwrap();
    assert!((fit.weights[0] - 0.5).abs() < 1e-3, "{:?}", fit.weights);
    assert!((fit.weights[1] + 0.25).abs() < 1e-3);
    assert!((fit.bias - 0.1).abs() < 1e-3);
    assert!((ols.params()[0] - 0.5).abs() < 1e-9);
    let pred = fit.predict(&x);
    assert!(pred.iter().zip(y.iter()).all(|(p, t)| (p - t).abs() < 1e-3));
}

#[test]
fn the_blocked_product_is_bit_for_bit_ndarrays() {
    // Every width around the 4-row blocks and the 8-wide partial sums,
    // a matrix that is not symmetric, and values whose sums round.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    for d in 1..=41 {
        let m = Array2::from_shape_fn((d, d), |(r, c)| next() * 10f64.powi(((r * 7 + c) % 9) as i32 - 4));
        let w = Array1::from_shape_fn(d, |_| next() * 3.0);
        let e = Array1::from_shape_fn(d, |_| next());
        let mut want = m.dot(&w).to_vec();
        want.push(e.dot(&w));
        for lanes in [4, 8] {
            let mut out = vec![0.0; d + 1];
            Columns::with_lanes(&m, &[&e], lanes).times(w.as_slice().unwrap(), &mut out);
            for r in 0..=d {
                assert_eq!(out[r].to_bits(), want[r].to_bits(), "d = {d}, {lanes} lanes, row {r}");
            }
        }
    }
}

#[test]
fn without_inputs_gradient_descent_fits_the_bias() {
    let ds = Dataset::new(Array2::<f64>::zeros((4, 0)), array![1.0, 2.0, 3.0, 4.0]);
    let fit = GradientDescent { max_iterations: 5000, ..Default::default() }.fit(&ds).unwrap();
    assert!(fit.weights.is_empty());
    assert!((fit.bias - 2.5).abs() < 1e-6, "{}", fit.bias);
}

#[test]
fn gram_gradient_equals_the_sample_gradient_path() {
    // One step of plain sample-wise GD from zero equals ours.
    let x = array![[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]];
    let y = array![1.0, -2.0, 0.25];
    let ds = Dataset::new(x.clone(), y.clone());
    let gd = GradientDescent { max_iterations: 1, max_gradient_norm: 1e9, ..Default::default() };
    let fit = gd.fit(&ds).unwrap();
    let n = 3.0;
    let gw0 = -(2.0 / n) * (1.0 * 1.0 + 3.0 * -2.0 + 0.5 * 0.25);
    let gw1 = -(2.0 / n) * (2.0 * 1.0 + -1.0 * -2.0 + 0.5 * 0.25);
    let gb = -(2.0 / n) * (1.0 - 2.0 + 0.25);
    assert!((fit.weights[0] + 0.01 * gw0).abs() < 1e-12);
    assert!((fit.weights[1] + 0.01 * gw1).abs() < 1e-12);
    assert!((fit.bias + 0.01 * gb).abs() < 1e-12);
}

#[test]
fn clipping_clamping_and_early_stopping_are_observable() {
    // Huge targets: gradients clipped every step, parameters clamped.
    let x = array![[1.0], [2.0], [3.0]];
    let y = array![1000.0, 2000.0, 3000.0];
    let gd = GradientDescent { learning_rate: 1.0, max_iterations: 200, ..Default::default() };
    let fit = gd.fit(&Dataset::new(x, y)).unwrap();
    assert_eq!(fit.clipped, fit.iterations);
    assert!(fit.clamped);
    assert!(fit.weights[0] <= 10.0 && fit.bias <= 10.0);
    assert_eq!(fit.weights[0], 10.0);
    // Perfectly fitted already (y = 0): the loss never improves on the
    // start, so training stops after `patience` iterations.
    let x = array![[1.0], [2.0]];
    let fit = GradientDescent::default().fit(&Dataset::new(x, array![0.0, 0.0])).unwrap();
    assert!(fit.stopped_early);
    assert_eq!(fit.iterations, 20);
}

#[test]
fn held_out_early_stopping_keeps_the_parameters_with_the_lowest_held_out_loss() {
    // Training says y = x, the held-out samples say y = −x: every step
    // away from the start makes the held-out loss worse.
    let x = array![[1.0], [2.0], [-1.0], [0.5]];
    let train = GramStats::of(&x, &array![1.0, 2.0, -1.0, 0.5]);
    let held = GramStats::of(&x, &array![-1.0, -2.0, 1.0, -0.5]);
    let gd = GradientDescent::default();
    let fit = gd.fit_monitored(&train, Some(&held), None);
    assert!(fit.stopped_early);
    assert_eq!(fit.iterations, gd.patience);
    assert_eq!((fit.weights[0], fit.bias), (0.0, 0.0));
    // Agreeing held-out samples: training runs on and fits y = x.
    let fit = gd.fit_monitored(&train, Some(&train), None);
    assert!(fit.weights[0] > 0.9, "{fit:?}");
    // A warm start begins where it is told to.
    let start = (array![1.0], 0.0);
    let fit = gd.fit_monitored(&train, Some(&held), Some((&start.0, start.1)));
    assert!(fit.weights[0] <= 1.0 && fit.stopped_early);
}

#[test]
fn held_out_early_stopping_returns_the_best_point_of_the_path() {
    // Training says y = x, the held-out samples y = x / 2: the held-out
    // loss falls while w climbs towards 1/2, then rises. The fit must
    // return exactly the point of the training path where it was
    // lowest (the path itself: plain gradient descent stopped after
    // i updates).
    let x = array![[1.0], [2.0], [-1.0], [0.5]];
    let train = GramStats::of(&x, &array![1.0, 2.0, -1.0, 0.5]);
    let held_y = array![0.5, 1.0, -0.5, 0.25];
    let held = GramStats::of(&x, &held_y);
    let gd = GradientDescent::default();
    let fit = gd.fit_monitored(&train, Some(&held), None);
    assert!(fit.stopped_early, "{fit:?}");
    let held_loss =
        |w: f64, b: f64| x.column(0).iter().zip(&held_y).map(|(xi, yi)| (xi * w + b - yi).powi(2)).sum::<f64>() / 4.0;
    let path: Vec<(f64, f64)> = (0..fit.iterations)
        .map(|i| {
            let p = GradientDescent { max_iterations: i, patience: usize::MAX, ..gd }.fit_stats(&train);
            (p.weights[0], p.bias)
        })
        .collect();
    let best = path.iter().copied().min_by(|a, b| held_loss(a.0, a.1).total_cmp(&held_loss(b.0, b.1))).unwrap();
    assert_eq!((fit.weights[0], fit.bias), best);
    assert!(best != path[0] && best != path[path.len() - 1], "the best point lies inside the path: {best:?}");
}

#[test]
fn one_pass_gives_what_the_separate_calls_give() {
    let series: Vec<Step> = (0..150)
        .map(|i| [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 30.0 + (i as f64 * 0.3).sin() * 4.0 + i as f64 * 0.05])
        .collect();
    let cfg = PredictConfig::default();
    let (p, b) = predict_with_backtest(&series, &cfg, Some(21));
    assert_eq!(p, predict(&series, &cfg, Some(21)));
    assert_eq!(b, backtest(&series, &cfg, Some(21)));
    assert_eq!(p.cv_mae, cross_validate(&series, &cfg, Some(21)));
    assert_eq!(p.cv_mae.unwrap().origins, cfg.cv_origins);
    // The model's forecast at the last step is the backtest's there.
    assert_eq!(p.model_forecast, b.forecasts[149]);
}

#[test]
fn seasonal_inputs_let_the_model_follow_a_periodic_spike() {
    // A spike at one phase of a 10-step period, longer than the window:
    // the last W steps cannot say when it comes; one period earlier can.
    let series: Vec<Step> = (0..400)
        .map(|i| {
            let spike = if i % 10 == 9 { 30.0 } else { 0.0 };
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 10.0 + spike + (i as f64 * 1.3).sin()]
        })
        .collect();
    let cfg = PredictConfig::default();
    let with = cross_validate(&series, &cfg, Some(10)).unwrap();
    let without = cross_validate(&series, &cfg, None).unwrap();
    assert!(with.model < 0.5 * with.persistence, "{with:?}");
    assert!(with.model < 0.5 * without.model, "{with:?} {without:?}");
}

#[test]
fn cv_origins_spread_over_the_phases_of_a_period() {
    // 1 000 steps of a 20-step period: evenly spaced origins were
    // exactly 20 steps apart and all fell on 3 of the 20 phases.
    let cfg = PredictConfig::default();
    let origins = cv_origins(1000, &cfg);
    assert_eq!(origins.len(), cfg.cv_origins);
    assert!(origins.windows(2).all(|w| w[0] < w[1]));
    let first = cfg.window - 1 + min_samples(&cfg) - 1 + cfg.horizon;
    assert!(origins[0] >= first && *origins.last().unwrap() < 1000 - cfg.horizon);
    let mut phases = [0usize; 20];
    for t in &origins {
        phases[t % 20] += 1;
    }
    assert!(phases.iter().filter(|&&c| c > 0).count() >= 10, "{phases:?}");
    assert!(phases.iter().all(|&c| c <= cfg.cv_origins / 5), "{phases:?}");
    // Short series: every step with enough history is an origin.
    assert_eq!(cv_origins(first + 10 + cfg.horizon + 1, &cfg), (first..=first + 10).collect::<Vec<_>>());
    assert_eq!(cv_origins(first + cfg.horizon, &cfg), Vec::<usize>::new());
}

#[test]
fn insufficient_data_gives_no_model() {
    let cfg = PredictConfig::default();
    let p = predict(&constant_series(cfg.window + cfg.horizon, 40.0), &cfg, None);
    assert_eq!(p.forecast, None);
    assert_eq!(p.risk, None);
    assert!(backtest(&constant_series(3, 40.0), &cfg, None).risk.iter().all(Option::is_none));
}

#[test]
fn constant_series_is_confident_and_risk_matches_its_level() {
    let cfg = PredictConfig::default();
    for (score, risk) in [(10.0, Risk::Minimal), (55.0, Risk::Medium), (85.0, Risk::Critical)] {
        let p = predict(&constant_series(120, score), &cfg, None);
        let f = p.forecast.unwrap();
        assert!(f.iter().all(|v| (v - score).abs() < 0.5), "{f:?}");
        assert!(p.confidence.unwrap() > 0.95);
        assert_eq!(p.risk, Some(risk));
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    }
}

#[test]
fn on_a_rising_trend_the_model_beats_persistence() {
    let cfg = PredictConfig::default();
    let series: Vec<Step> = (0..200)
        .map(|i| {
            let e = i as f64 / 400.0;
            let score = 10.0 + 0.4 * i as f64;
            [e, 0.2, 0.3, 0.5, 0.1 + e / 2.0, 0.9 - e, score]
        })
        .collect();
    let p = predict(&series, &cfg, None);
    let cv = p.cv_mae.unwrap();
    assert!(cv.model < cv.persistence, "{cv:?}");
    assert!(p.trend > 0.39 && p.trend < 0.41);
    assert!(p.warnings.iter().any(|w| w.starts_with("clear trend")));
}

#[test]
fn cross_validation_never_sees_the_future_of_an_origin() {
    // Two series equal up to step 60, wildly different afterwards: a
    // forecaster trained up to an origin ≤ 60 − H must not differ.
    let cfg = PredictConfig::default();
    let base: Vec<Step> =
        (0..120).map(|i| [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 20.0 + (i as f64 * 0.7).sin() * 5.0]).collect();
    let mut other = base.clone();
    for s in &mut other[61..] {
        *s = [0.9, 0.9, 0.9, 3.0, 0.9, 0.1, 99.0];
    }
    // With and without the seasonal inputs of a known period.
    for period in [None, Some(9)] {
        for upto in [30, 45, 60] {
            let train = |series: &[Step]| {
                Forecaster::train(
                    &mut Accumulator::new(series, Inputs::new(&cfg, period, series.len())),
                    upto,
                    &cfg,
                    None,
                )
                .unwrap()
                .forecast(series, upto)
            };
            assert_eq!(train(&base), train(&other), "{period:?} {upto}");
        }
        // And the backtest at t only uses steps ≤ t.
        let ba = backtest(&base, &cfg, period);
        let bb = backtest(&other, &cfg, period);
        assert_eq!(ba.forecasts[..=60], bb.forecasts[..=60]);
    }
}

#[test]
fn on_noise_the_headline_is_no_change_or_as_good() {
    // A score that wanders randomly: nothing predicts it better than
    // its last value, and the headline must not claim otherwise.
    let cfg = PredictConfig::default();
    let mut x = 40.0f64;
    let mut seed = 7u64;
    let series: Vec<Step> = (0..300)
        .map(|_| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            x += ((seed >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 4.0;
            [0.3, 0.2, 0.5, 0.4, 0.2, 0.7, x]
        })
        .collect();
    let p = predict(&series, &cfg, None);
    let cv = p.cv_mae.clone().unwrap();
    let (best, mae) = cv.best();
    assert_eq!(p.forecaster, best);
    assert!(mae <= cv.persistence && p.skill.unwrap() >= 0.0, "{cv:?}");
    if p.forecaster == ForecasterKind::Persistence {
        assert_eq!(p.forecast.unwrap(), vec![p.current; cfg.horizon]);
    }
    // The model predicts changes: with no signal it stays near the last value.
    let mf = p.model_forecast.unwrap();
    assert!(mf.iter().all(|v| (v - p.current).abs() < 3.0), "{mf:?} from {}", p.current);
}

#[test]
fn a_periodic_score_is_best_forecast_by_the_seasonal_baseline() {
    // A sawtooth of period 10 steps: seasonal is exact.
    let cfg = PredictConfig::default();
    let series: Vec<Step> = (0..200).map(|i| [0.3, 0.2, 0.5, 0.4, 0.2, 0.7, 20.0 + 3.0 * (i % 10) as f64]).collect();
    let p = predict(&series, &cfg, Some(10));
    let cv = p.cv_mae.clone().unwrap();
    assert_eq!(cv.seasonal, Some(0.0), "{cv:?}");
    assert_eq!(p.forecaster, ForecasterKind::Seasonal);
    assert_eq!(p.forecast.unwrap(), vec![20.0 + 3.0 * 0.0, 23.0, 26.0]);
    assert_eq!(p.skill, Some(1.0));
    let none = predict(&series, &cfg, None).cv_mae.unwrap();
    assert_eq!((none.seasonal, none.seasonal_reason.as_deref()), (None, Some("no iteration period is known")));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Collinear, constant and wildly scaled windows: the ridge
    /// baseline is never a blown-up number — finite, and its forecast
    /// within the score's range once clamped as the headline is.
    #[test]
    fn ridge_stays_finite_on_collinear_and_constant_windows(
        n in 20usize..160,
        constant in proptest::prelude::any::<bool>(),
        scale in 1e-9f64..1e9,
        slope in -2.0f64..2.0,
    ) {
        let cfg = PredictConfig::default();
        let series: Vec<Step> = (0..n)
            .map(|i| {
                let v = if constant { 1.0 } else { i as f64 * scale };
                // Every feature a multiple of the same column: collinear.
                [v, 2.0 * v, 3.0 * v, v, v, 0.5 * v, (50.0 + slope * i as f64).clamp(0.0, 100.0)]
            })
            .collect();
        let cv = cross_validate(&series, &cfg, None);
        if let Some(cv) = cv {
            proptest::prop_assert!(cv.model.is_finite() && cv.persistence.is_finite());
            if let Some(r) = cv.ridge {
                proptest::prop_assert!(r.is_finite() && (0.0..=100.0).contains(&r), "{:?}", cv);
            } else {
                proptest::prop_assert!(cv.ridge_reason.is_some());
            }
        }
        let p = predict(&series, &cfg, None);
        if let Some(f) = p.forecast {
            proptest::prop_assert!(f.iter().all(|v| v.is_finite() && (0.0..=100.0).contains(v)));
        }
    }
}

#[test]
fn trend_is_the_least_squares_slope() {
    let v: Vec<f64> = (0..30).map(|i| 3.0 + 0.5 * i as f64).collect();
    assert!((trend(&v, 20) - 0.5).abs() < 1e-12);
    assert_eq!(trend(&[4.0], 20), 0.0);
}

#[test]
fn risk_levels() {
    assert_eq!(Risk::of(80.0), Risk::Critical);
    assert_eq!(Risk::of(79.9), Risk::High);
    assert_eq!(Risk::of(50.0), Risk::Medium);
    assert_eq!(Risk::of(30.0), Risk::Low);
    assert_eq!(Risk::of(29.9), Risk::Minimal);
}

/// A relative tolerance stops gradient descent where the loss only creeps
/// down: far fewer iterations, nearly the same loss. With none, every
/// fall, however small, resets the patience.
#[test]
fn a_tolerance_stops_a_descent_that_only_creeps() {
    // A noisy line: the loss falls toward the noise's, ever more slowly.
    let x = array![[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5], [0.5, -1.0], [2.0, 1.0], [-0.5, -0.5]];
    let y: Array1<f64> = x
        .rows()
        .into_iter()
        .enumerate()
        .map(|(i, r)| 0.5 * r[0] - 0.25 * r[1] + 0.1 + 0.05 * (i as f64).sin())
        .collect();
    let ds = Dataset::new(x, y);
    let every = GradientDescent { max_iterations: 20_000, learning_rate: 0.01, ..Default::default() };
    let loose = GradientDescent { tolerance: 1e-3, ..every };
    let (a, b) = (every.fit(&ds).unwrap(), loose.fit(&ds).unwrap());
    assert!(b.stopped_early && b.iterations * 2 < a.iterations, "{b:?} against {a:?}");
    // Stopped where an iteration took off less than 0.1 % of the loss: a
    // little above the loss of the full run, never below it.
    assert!(b.final_loss >= a.final_loss && b.final_loss < a.final_loss * 1.1, "{b:?} against {a:?}");
}
