//! What the forecasters read and how they are set: a step's columns
//! ([`Step`]), the settings ([`PredictConfig`]) and the levels a forecast
//! maps to ([`Risk`]). Below every other file of the predictor.

use serde::Serialize;

/// Columns of a step: E, K, S, C, L, U, score.
pub const COLUMNS: usize = 7;
pub type Step = [f64; COLUMNS];

/// Hyper-parameters and thresholds, all configurable from the command line.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PredictConfig {
    pub window: usize,
    pub horizon: usize,
    pub learning_rate: f64,
    pub max_iterations: usize,
    /// Early stop after this many iterations without a lower loss.
    pub patience: usize,
    /// A fall of the held-out loss smaller than this share of it counts
    /// toward `patience` ([`super::GradientDescent::tolerance`]).
    pub tolerance: f64,
    pub trend_window: usize,
    pub cv_origins: usize,
    /// The online backtest retrains every this many steps.
    pub retrain_every: usize,
    pub deterioration: f64,
    pub min_confidence: f64,
    pub sharp_jump: f64,
    pub clear_trend: f64,
}

impl Default for PredictConfig {
    fn default() -> Self {
        PredictConfig {
            window: 5,
            horizon: 3,
            learning_rate: 0.01,
            max_iterations: 1000,
            patience: 20,
            tolerance: 1e-3,
            trend_window: 20,
            cv_origins: 50,
            retrain_every: 20,
            deterioration: 5.0,
            min_confidence: 0.6,
            sharp_jump: 10.0,
            clear_trend: 0.3,
        }
    }
}

/// Risk levels, from the highest forecast score.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Risk {
    Minimal,
    Low,
    Medium,
    High,
    Critical,
}

impl Risk {
    /// Every level, lowest first.
    pub const ALL: [Risk; 5] = [Risk::Minimal, Risk::Low, Risk::Medium, Risk::High, Risk::Critical];

    pub fn of(score: f64) -> Risk {
        match score {
            s if s >= 80.0 => Risk::Critical,
            s if s >= 70.0 => Risk::High,
            s if s >= 50.0 => Risk::Medium,
            s if s >= 30.0 => Risk::Low,
            _ => Risk::Minimal,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Risk::Minimal => "minimal",
            Risk::Low => "low",
            Risk::Medium => "medium",
            Risk::High => "high",
            Risk::Critical => "critical",
        }
    }
}

// ---------------------------------------------------------------------------
// The gradient-descent linear model, linfa style.
