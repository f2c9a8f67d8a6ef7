//! Per-session takeover by pace: a speculation session is worth its edge only while it commits
//! tokens faster than the verifier would decode them itself at the same load. A draft that is
//! often wrong, a slow edge or a long round trip can make speculation slower than cloud-only
//! generation; then the verifier takes the session over (γ 0) and hands it back when the load
//! makes cloud decoding the slower of the two.
//!
//! The comparison is collective, not myopic: the cloud decoding ITL it uses is the forward time
//! when every open session is decoded by the cloud (one token each), which is what cloud-only
//! serving would give at this load — not the time of today's larger speculative forwards.

pub use tandem_spec::capacity::ForwardCost;

/// Take a session over as soon as its pace is slower than cloud decoding; hand it back only when
/// cloud decoding is this much slower than its pace (hysteresis: no flapping at the boundary).
pub const HANDBACK_MARGIN: f64 = 1.2;

/// Verdict gaps needed before a session's pace counts.
pub const MIN_PACE_GAPS: u32 = 6;

/// Tokens the verifier decodes for a session it took over by pace before it hands the session
/// back to try its edge again (the pace forgotten): a draft that was wrong for a stretch (a
/// table, code, a name) gets another chance, even on a verifier whose load never changes.
pub const PROBE_TOKENS: u32 = 64;

/// Weight of the newest verdict gap in the pace's moving averages.
const PACE_SMOOTHING: f64 = 0.25;

/// A speculation session's pace: milliseconds per committed token, measured from the gaps between
/// its verdicts while its edge speculates, and the positions its blocks add to the verifier's
/// forwards beyond the one a decode computes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pace {
    last_ms: Option<u64>,
    gap_ms: f64,
    tokens: f64,
    extra: f64,
    gaps: u32,
}

impl Pace {
    /// A verdict committed `tokens` at `now_ms`, from a forward that computed `extra` positions
    /// of the session beyond the one a decode would have. The first one after a
    /// [`Pace::restart`] only starts the clock.
    pub fn on_commit(&mut self, now_ms: u64, tokens: usize, extra: usize) {
        if let Some(last) = self.last_ms.replace(now_ms) {
            let (g, t, e) = (
                now_ms.saturating_sub(last) as f64,
                tokens as f64,
                extra as f64,
            );
            if self.gaps == 0 {
                (self.gap_ms, self.tokens, self.extra) = (g, t, e);
            } else {
                self.gap_ms += PACE_SMOOTHING * (g - self.gap_ms);
                self.tokens += PACE_SMOOTHING * (t - self.tokens);
                self.extra += PACE_SMOOTHING * (e - self.extra);
            }
            self.gaps += 1;
        }
    }

    /// The verifier decoded a token of the session at `now_ms`: it counts once a verdict started
    /// the clock. Before its first verdict a session's tokens are all the verifier's own (its
    /// edge's first blocks are still on the wire): their gaps measure cloud decoding, not the
    /// speculation.
    pub fn on_decoded(&mut self, now_ms: u64) {
        if self.last_ms.is_some() {
            self.on_commit(now_ms, 1, 0);
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

    /// Positions the session's blocks add to each forward it is in, beyond a decode's one, once
    /// [`MIN_PACE_GAPS`] gaps were seen (a session is in every forward while it speculates: the
    /// verifier never idles it).
    pub fn extra_positions(&self) -> Option<f64> {
        (self.gaps >= MIN_PACE_GAPS).then_some(self.extra)
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
    fn pace_averages_verdict_gaps_per_token() {
        let mut p = Pace::default();
        p.on_decoded(900);
        p.on_decoded(950);
        p.on_commit(1000, 3, 2);
        assert_eq!(p.ms_per_token(), None, "the first verdict starts the clock");
        for k in 1..MIN_PACE_GAPS as u64 {
            p.on_commit(1000 + 300 * k, 3, 2);
        }
        assert_eq!(p.ms_per_token(), None);
        p.on_commit(1000 + 300 * MIN_PACE_GAPS as u64, 3, 2);
        assert!((p.ms_per_token().unwrap() - 100.0).abs() < 1e-9);
        assert!((p.extra_positions().unwrap() - 2.0).abs() < 1e-9);
        // A takeover and handback later, the gap across it does not count.
        p.restart();
        p.on_commit(9000, 1, 0);
        assert!((p.ms_per_token().unwrap() - 100.0).abs() < 1e-9);
        // Slower verdicts move it.
        for k in 1..20 {
            p.on_commit(9000 + 600 * k, 3, 2);
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
