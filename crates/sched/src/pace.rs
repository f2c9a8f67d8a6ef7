//! Per-session takeover by pace: a speculation session is worth its edge only while it commits
//! tokens faster than the verifier would decode them itself at the same load. A draft that is
//! often wrong, a slow edge or a long round trip can make speculation slower than cloud-only
//! generation; then the verifier takes the session over (γ 0) and hands it back when the load
//! makes cloud decoding the slower of the two.
//!
//! The comparison is collective, not myopic: the cloud decoding ITL it uses is the forward time
//! when every open session is decoded by the cloud (one token each), which is what cloud-only
//! serving would give at this load — not the time of today's larger speculative forwards.

use serde::{Deserialize, Serialize};

/// Take a session over as soon as its pace is slower than cloud decoding; hand it back only when
/// cloud decoding is this much slower than its pace (hysteresis: no flapping at the boundary).
pub const HANDBACK_MARGIN: f64 = 1.2;

/// Weight of a new memory-bound forward's time in the one-token time ([`ForwardCost::observe`]).
const OBSERVE_SMOOTHING: f64 = 0.05;

/// Verdict gaps needed before a session's pace counts.
pub const MIN_PACE_GAPS: u32 = 3;

/// Weight of the newest verdict gap in the pace's moving averages.
const PACE_SMOOTHING: f64 = 0.25;

/// The target's forward time against tokens per forward, as a roofline: a forward costs at least
/// the time of one token (reading the weights), and `ms_per_token` per token once compute-bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ForwardCost {
    pub one_token_ms: f64,
    pub ms_per_token: f64,
}

impl ForwardCost {
    /// Fit to measured `(tokens, ms)` points, smallest first: the slope by least squares over the
    /// large sizes (at least a quarter of the largest; the last two if fewer qualify), the
    /// one-token time the median over the sizes up to 4 below them (all memory-bound, so one
    /// noisy run does not set it). `None` unless there are two sizes.
    pub fn fit(points: &[(usize, f64)]) -> Option<Self> {
        if points.len() < 2 || points.iter().any(|p| !(p.1.is_finite() && p.1 > 0.0)) {
            return None;
        }
        let largest = points[points.len() - 1].0;
        let from = points
            .iter()
            .position(|p| p.0 * 4 >= largest)
            .unwrap_or(0)
            .min(points.len() - 2);
        let tail = &points[from..];
        let k = tail.len() as f64;
        let mx = tail.iter().map(|p| p.0 as f64).sum::<f64>() / k;
        let my = tail.iter().map(|p| p.1).sum::<f64>() / k;
        let den = tail.iter().map(|p| (p.0 as f64 - mx).powi(2)).sum::<f64>();
        if den == 0.0 {
            return None;
        }
        let slope = tail
            .iter()
            .map(|p| (p.0 as f64 - mx) * (p.1 - my))
            .sum::<f64>()
            / den;
        let mut small: Vec<f64> = points[..from]
            .iter()
            .filter(|p| p.0 <= 4)
            .map(|p| p.1)
            .collect();
        if small.is_empty() {
            small.push(points[0].1);
        }
        small.sort_by(f64::total_cmp);
        Some(Self {
            one_token_ms: small[(small.len() - 1) / 2],
            ms_per_token: slope.max(1e-6),
        })
    }

    /// A forward of `tokens` tokens took `ms`: one well below the ridge (memory-bound, so its
    /// time is the one-token time) moves the one-token time towards it. The start-up calibration
    /// runs cold and alone; this follows the time forwards take while serving.
    pub fn observe(&mut self, tokens: usize, ms: f64) {
        let below = tokens >= 1 && (tokens as f64) * 2.0 <= self.ridge_tokens();
        if below && ms.is_finite() && ms > 0.0 {
            self.one_token_ms += OBSERVE_SMOOTHING * (ms - self.one_token_ms);
        }
    }

    /// Predicted time of a forward of `tokens` tokens.
    pub fn ms(&self, tokens: f64) -> f64 {
        self.one_token_ms.max(self.ms_per_token * tokens)
    }

    /// Tokens per forward where the target turns compute-bound.
    pub fn ridge_tokens(&self) -> f64 {
        self.one_token_ms / self.ms_per_token
    }
}

/// A speculation session's pace: milliseconds per committed token, measured from the gaps between
/// its verdicts while its edge speculates.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pace {
    last_ms: Option<u64>,
    gap_ms: f64,
    tokens: f64,
    gaps: u32,
}

impl Pace {
    /// A verdict (or a decoded token) committed `tokens` at `now_ms`. The first one after a
    /// [`Pace::restart`] only starts the clock.
    pub fn on_commit(&mut self, now_ms: u64, tokens: usize) {
        if let Some(last) = self.last_ms.replace(now_ms) {
            let (g, t) = (now_ms.saturating_sub(last) as f64, tokens as f64);
            if self.gaps == 0 {
                (self.gap_ms, self.tokens) = (g, t);
            } else {
                self.gap_ms += PACE_SMOOTHING * (g - self.gap_ms);
                self.tokens += PACE_SMOOTHING * (t - self.tokens);
            }
            self.gaps += 1;
        }
    }

    /// Forget the clock (not the measured pace): the session changed hands, and the next gap
    /// would span the change.
    pub fn restart(&mut self) {
        self.last_ms = None;
    }

    /// Milliseconds per committed token, once [`MIN_PACE_GAPS`] gaps were seen.
    pub fn ms_per_token(&self) -> Option<f64> {
        (self.gaps >= MIN_PACE_GAPS && self.tokens > 0.0).then(|| self.gap_ms / self.tokens)
    }
}

/// Whether a session should be decoded by the cloud: its speculative pace (`None`: not measured
/// yet, it speculates) against the cloud decoding ITL at this load, keeping its current hands
/// inside the margin.
pub fn prefer_cloud(pace_ms_per_token: Option<f64>, cloud_itl_ms: f64, now_cloud: bool) -> bool {
    let Some(p) = pace_ms_per_token else {
        return false;
    };
    if now_cloud {
        cloud_itl_ms <= HANDBACK_MARGIN * p
    } else {
        p > cloud_itl_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_roofline_fit_finds_the_ridge() {
        // 100 ms up to 10 tokens, then 10 ms per token.
        let pts: Vec<(usize, f64)> = [1usize, 2, 4, 8, 16, 32, 64]
            .iter()
            .map(|&n| (n, (10.0 * n as f64).max(100.0)))
            .collect();
        let c = ForwardCost::fit(&pts).unwrap();
        assert!((c.ms_per_token - 10.0).abs() < 1e-9);
        assert!((c.ridge_tokens() - 10.0).abs() < 1e-9);
        assert_eq!(c.ms(4.0), 100.0);
        assert!((c.ms(40.0) - 400.0).abs() < 1e-9);
        // The one-token time is the median of the small sizes; the slope ignores them.
        let noisy =
            ForwardCost::fit(&[(1, 130.0), (2, 95.0), (4, 100.0), (32, 320.0), (64, 640.0)])
                .unwrap();
        assert_eq!(noisy.one_token_ms, 100.0);
        assert!((noisy.ms_per_token - 10.0).abs() < 1e-9);
        let two = ForwardCost::fit(&[(1, 100.0), (32, 320.0)]).unwrap();
        assert!((two.ms_per_token - 220.0 / 31.0).abs() < 1e-9);
        // Serving refines the one-token time from memory-bound forwards only.
        let mut c = ForwardCost {
            one_token_ms: 100.0,
            ms_per_token: 10.0,
        };
        c.observe(30, 50.0);
        assert_eq!(
            c.one_token_ms, 100.0,
            "past the ridge: not a one-token time"
        );
        for _ in 0..200 {
            c.observe(2, 80.0);
        }
        assert!((c.one_token_ms - 80.0).abs() < 0.1);
        assert!(ForwardCost::fit(&[(1, 100.0)]).is_none());
        assert!(ForwardCost::fit(&[(1, 100.0), (1, 100.0)]).is_none());
        assert!(ForwardCost::fit(&[(1, f64::NAN), (8, 100.0)]).is_none());
    }

    #[test]
    fn pace_averages_verdict_gaps_per_token() {
        let mut p = Pace::default();
        p.on_commit(1000, 3);
        assert_eq!(p.ms_per_token(), None, "the first verdict starts the clock");
        p.on_commit(1300, 3);
        p.on_commit(1600, 3);
        assert_eq!(p.ms_per_token(), None);
        p.on_commit(1900, 3);
        assert!((p.ms_per_token().unwrap() - 100.0).abs() < 1e-9);
        // A takeover and handback later, the gap across it does not count.
        p.restart();
        p.on_commit(9000, 1);
        assert!((p.ms_per_token().unwrap() - 100.0).abs() < 1e-9);
        // Slower verdicts move it.
        for k in 1..20 {
            p.on_commit(9000 + 600 * k, 3);
        }
        assert!((p.ms_per_token().unwrap() - 200.0).abs() < 1.0);
    }

    #[test]
    fn takeover_and_handback_have_hysteresis() {
        assert!(!prefer_cloud(None, 10.0, false), "unmeasured: speculate");
        assert!(!prefer_cloud(None, 10.0, true));
        assert!(
            prefer_cloud(Some(101.0), 100.0, false),
            "slower than the cloud"
        );
        assert!(!prefer_cloud(Some(99.0), 100.0, false));
        assert!(prefer_cloud(Some(90.0), 100.0, true), "inside the margin");
        assert!(
            !prefer_cloud(Some(80.0), 100.0, true),
            "the load grew: hand back"
        );
    }
}
