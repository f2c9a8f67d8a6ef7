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

/// Latency figures of a stream from each token's time (ms since the request): time to the first
/// token, the gaps between tokens, and the decode rate after the first token.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StreamTiming {
    pub ttft_ms: f64,
    pub itl_ms: Summary,
    pub tokens_per_s: f64,
}

impl StreamTiming {
    pub fn of(times_ms: &[f64]) -> Self {
        let itl: Vec<f64> = times_ms.windows(2).map(|w| w[1] - w[0]).collect();
        let decode_ms =
            times_ms.last().copied().unwrap_or(0.0) - times_ms.first().copied().unwrap_or(0.0);
        let s = Summary::of(&itl);
        Self {
            ttft_ms: round2(times_ms.first().copied().unwrap_or(0.0)),
            itl_ms: Summary {
                mean: round2(s.mean),
                p50: round2(s.p50),
                p99: round2(s.p99),
            },
            tokens_per_s: if decode_ms > 0.0 {
                round2(itl.len() as f64 / decode_ms * 1e3)
            } else {
                0.0
            },
        }
    }
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
