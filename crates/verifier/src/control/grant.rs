//! Load-aware grants: every verified position costs the cloud, so the γ and depth granted to new
//! sessions shrink as the verifier's batches fill, and grow back when they empty — with hysteresis,
//! so that a load hovering at a threshold does not make the grant flap.

use serde::Serialize;

use tandem_spec::Shape;

use super::pace::ForwardCost;

/// [`GrantPolicy::grant_by_model`] changes level only for this gain in predicted rate.
pub const MODEL_GAIN: f64 = 1.05;

/// Without a forward cost, the grant shrinks a level above this fraction of the saturation point
/// and grows one below [`GROW_BELOW`].
pub const SHRINK_ABOVE: f64 = 0.75;
pub const GROW_BELOW: f64 = 0.5;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GrantPolicy {
    pub max_draft_len: u32,
    pub max_depth: u32,
    /// Tokens per forward at which the verifier stops being memory-bound (its ridge).
    pub saturation_tokens: f64,
    /// One level past γ 1, depth 1: γ 0, the verifier decodes the sessions itself (past the
    /// ridge a verified position costs as much as a decoded one, and a rejected one is waste).
    pub cloud_decode: bool,
    /// With the target's forward cost, each session is also taken over on its own when its
    /// speculation is slower than cloud decoding at this load ([`super::pace`]).
    pub pace: Option<ForwardCost>,
    level: u32,
}

impl GrantPolicy {
    pub fn new(max_draft_len: u32, max_depth: u32, saturation_tokens: f64) -> Self {
        Self {
            max_draft_len: max_draft_len.max(1),
            max_depth: max_depth.max(1),
            saturation_tokens: saturation_tokens.max(1.0),
            cloud_decode: false,
            pace: None,
            level: 0,
        }
    }

    /// With the last level, γ 0: the verifier takes sessions over.
    pub fn with_cloud_decode(mut self) -> Self {
        self.cloud_decode = true;
        self
    }

    /// Take sessions over one by one by their pace, with the target's forward cost.
    pub fn with_pace(mut self, cost: ForwardCost) -> Self {
        self.pace = Some(cost);
        self
    }

    /// A forward of `tokens` tokens took `ms` (refines the forward cost: [`ForwardCost::observe`]).
    pub fn observe_forward(&mut self, tokens: usize, ms: f64) {
        if let Some(c) = &mut self.pace {
            c.observe(tokens, ms);
        }
    }

    /// The cloud decoding ITL with `sessions` open: one forward of a token each (what cloud-only
    /// serving would give at this load). `None` without a forward cost.
    pub fn cloud_itl_ms(&self, sessions: usize) -> Option<f64> {
        self.pace.map(|c| c.ms(sessions.max(1) as f64))
    }

    /// The level of γ 1 and depth 1.
    fn speculative_levels(&self) -> u32 {
        let halvings = 32 - self.max_draft_len.leading_zeros() - 1;
        halvings.max(self.max_depth - 1)
    }

    /// The deepest level: γ 1 and depth 1, or γ 0 with `cloud_decode`.
    fn max_level(&self) -> u32 {
        self.speculative_levels() + self.cloud_decode as u32
    }

    /// The grant at the current level: each level halves γ and takes one block of depth away;
    /// γ 0 (with `cloud_decode`) means the verifier decodes the session itself.
    pub fn current(&self) -> Shape {
        self.at(self.level)
    }

    /// The grant at `level` (see [`GrantPolicy::current`]).
    fn at(&self, level: u32) -> Shape {
        if level > self.speculative_levels() {
            return Shape::new(0, 1);
        }
        let g = (self.max_draft_len >> level.min(31)).max(1);
        let d = self.max_depth.saturating_sub(level).max(1);
        Shape::new(g, d)
    }

    /// Predicted committed tokens per millisecond of verifier time at `level`, with `sessions`
    /// sessions whose drafts are accepted at `alpha` per token, all at that level's γ: each
    /// forward verifies N blocks of γ + 1 positions and commits N·E\[A\](γ) tokens (γ 0: N tokens
    /// for N positions). `None` without a forward cost.
    pub fn predicted_rate(&self, level: u32, sessions: usize, alpha: f64) -> Option<f64> {
        let cost = self.pace?;
        let g = self.at(level).draft_len;
        let n = sessions.max(1) as f64;
        let e = tandem_spec::policy::expected_accepted(alpha.clamp(0.0, 1.0), g as usize);
        Some(n * e / cost.ms(n * (g as f64 + 1.0)))
    }

    /// With a forward cost: the level whose batches would commit the most tokens per unit of
    /// verifier time ([`GrantPolicy::predicted_rate`]), taken when it beats the current level by
    /// [`MODEL_GAIN`] (hysteresis). Past the ridge a verified position costs as much as a decoded
    /// token, so a rejected one is waste; below it, positions are nearly free. Without a forward
    /// cost: [`GrantPolicy::grant`] by tokens per forward.
    pub fn grant_by_model(
        &mut self,
        sessions: usize,
        alpha: f64,
        tokens_per_forward: f64,
    ) -> Shape {
        let Some(here) = self.predicted_rate(self.level, sessions, alpha) else {
            return self.grant(tokens_per_forward);
        };
        let best = (0..=self.max_level())
            .filter_map(|l| Some((l, self.predicted_rate(l, sessions, alpha)?)))
            .fold((self.level, here), |b, x| if x.1 > b.1 { x } else { b });
        if best.1 > here * MODEL_GAIN {
            self.level = best.0;
        }
        self.current()
    }

    /// Move at most one level for the observed load (tokens per forward, averaged), and return the
    /// grant for a session opening now.
    pub fn grant(&mut self, tokens_per_forward: f64) -> Shape {
        let f = tokens_per_forward / self.saturation_tokens;
        if f > SHRINK_ABOVE && self.level < self.max_level() {
            self.level += 1;
        } else if f < GROW_BELOW && self.level > 0 {
            self.level -= 1;
        }
        self.current()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_grant_follows_sessions_and_alpha() {
        // One-token forward 100 ms, 10 ms per token past a ridge of 10 tokens.
        let cost = ForwardCost {
            one_token_ms: 100.0,
            ms_per_token: 10.0,
        };
        let settle = |sessions: usize, alpha: f64| {
            let mut p = GrantPolicy::new(4, 2, 20.0)
                .with_cloud_decode()
                .with_pace(cost);
            for _ in 0..10 {
                p.grant_by_model(sessions, alpha, 0.0);
            }
            p.current()
        };
        // Alone, positions are free: the longest blocks.
        assert_eq!(settle(1, 0.8), (4, 2));
        assert_eq!(settle(3, 0.95), (4, 2));
        // Five users at α 0.95: 5 × 5 positions is past the ridge; γ 1 commits the most.
        assert_eq!(settle(5, 0.95), (1, 1));
        // Past the ridge with cloud decoding alone (32 users), every rejected position is waste.
        assert_eq!(settle(32, 0.95), (0, 1));
        assert_eq!(settle(32, 0.6), (0, 1));
        // At 4 users γ 2 beats γ 4 by just over the hysteresis.
        let mut p = GrantPolicy::new(4, 2, 20.0)
            .with_cloud_decode()
            .with_pace(cost);
        let r = |p: &GrantPolicy, l| p.predicted_rate(l, 4, 0.95).unwrap();
        assert!(r(&p, 1) > r(&p, 0) * MODEL_GAIN);
        assert_eq!(p.grant_by_model(4, 0.95, 0.0), (2, 1));
        // Hysteresis: at 3 users and α 0.93, γ 4 would be better than γ 2, but by less than 5%.
        let rate = |p: &GrantPolicy, l| p.predicted_rate(l, 3, 0.93).unwrap();
        assert!(rate(&p, 0) > rate(&p, 1) && rate(&p, 0) < rate(&p, 1) * MODEL_GAIN);
        assert_eq!(p.grant_by_model(3, 0.93, 0.0), (2, 1));
        // Without a forward cost it falls back to tokens per forward.
        let mut p = GrantPolicy::new(4, 2, 20.0).with_cloud_decode();
        assert_eq!(p.grant_by_model(32, 0.95, 30.0), (2, 1));
    }

    #[test]
    fn grants_shrink_under_load_and_recover_with_hysteresis() {
        let mut p = GrantPolicy::new(8, 4, 32.0);
        assert_eq!(p.grant(4.0), (8, 4));
        assert_eq!(p.grant(30.0), (4, 3));
        assert_eq!(p.grant(30.0), (2, 2));
        assert_eq!(p.grant(30.0), (1, 1));
        assert_eq!(p.grant(100.0), (1, 1), "never below 1");
        // Between the thresholds it holds.
        assert_eq!(p.grant(20.0), (1, 1));
        assert_eq!(p.grant(10.0), (2, 2));
        assert_eq!(p.grant(10.0), (4, 3));
        assert_eq!(p.grant(10.0), (8, 4));
        assert_eq!(p.grant(0.0), (8, 4));
        // With cloud decoding, one level more.
        let mut p = GrantPolicy::new(2, 2, 10.0).with_cloud_decode();
        assert_eq!(p.grant(9.0), (1, 1));
        assert_eq!(p.grant(9.0), (0, 1));
        assert_eq!(p.grant(9.0), (0, 1));
        assert_eq!(p.grant(6.0), (0, 1), "hysteresis");
        assert_eq!(p.grant(1.0), (1, 1));
    }
}
