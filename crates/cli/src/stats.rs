//! Latency summaries.

use serde::Serialize;

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Summary {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

impl Summary {
    /// Mean and nearest-rank percentiles; all zero for no samples.
    pub fn of(samples: &[f64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        let rank = |p: f64| s[((p * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1];
        Self {
            mean: s.iter().sum::<f64>() / s.len() as f64,
            p50: rank(0.5),
            p99: rank(0.99),
        }
    }
}

pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!(
            s,
            Summary {
                mean: 2.5,
                p50: 2.0,
                p99: 4.0
            }
        );
        assert_eq!(Summary::of(&[]), Summary::default());
    }
}
