use super::words::*;
use crate::analysis::predict::ForecasterKind;
use crate::analysis::predict::{PredictConfig, Step, predict};

/// A score that never moved at a cross-validation origin gives an error of
/// 0 and a confidence of 1: said to rest on nothing, and the 1 not shown.
#[test]
fn a_confidence_from_a_flat_score_is_said_to_rest_on_nothing() {
    let flat: Vec<Step> = (0..120).map(|_| [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 42.0]).collect();
    let p = predict(&flat, &PredictConfig::default(), None);
    assert!(confidence_phrase(&p).contains("rests on nothing"), "{}", confidence_phrase(&p));
    assert!(!confidence_phrase(&p).contains("1.00"), "{}", confidence_phrase(&p));
    let moving: Vec<Step> = (0..120).map(|i| [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 20.0 + 3.0 * (i % 10) as f64]).collect();
    let p = predict(&moving, &PredictConfig::default(), Some(10));
    assert!(!confidence_phrase(&p).contains("rests on nothing"), "{}", confidence_phrase(&p));
}

#[test]
fn a_skill_under_five_percent_is_not_called_a_win() {
    let series: Vec<Step> = (0..120).map(|i| [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 20.0 + 3.0 * (i % 10) as f64]).collect();
    let mut p = predict(&series, &PredictConfig::default(), Some(10));
    assert_eq!(p.forecaster, ForecasterKind::Seasonal);
    for (skill, phrase) in [
        (0.48, "beats no change, skill +0.48"),
        (0.05, "beats no change, skill +0.05"),
        (0.021, "about as good as no change, skill +0.02 (under 5 % better)"),
    ] {
        p.skill = Some(skill);
        assert_eq!(skill_phrase(&p), phrase);
    }
    p.forecaster = ForecasterKind::Persistence;
    assert_eq!(skill_phrase(&p), "nothing forecast better than no change");
}
