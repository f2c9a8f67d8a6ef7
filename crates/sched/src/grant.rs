//! Load-aware grants: every verified position costs the cloud, so the γ and depth granted to new
//! sessions shrink as the verifier's batches fill, and grow back when they empty — with hysteresis,
//! so that a load hovering at a threshold does not make the grant flap.

use serde::Serialize;

use crate::pace::ForwardCost;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GrantPolicy {
    pub max_draft_len: u32,
    pub max_depth: u32,
    /// Tokens per forward at which the verifier stops being memory-bound (its ridge).
    pub saturation_tokens: f64,
    /// Shrink one level above this fraction of saturation, grow one below `grow_below`.
    pub shrink_above: f64,
    pub grow_below: f64,
    /// One level past γ 1, depth 1: γ 0, the verifier decodes the sessions itself (past the
    /// ridge a verified position costs as much as a decoded one, and a rejected one is waste).
    pub cloud_decode: bool,
    /// With the target's forward cost, each session is also taken over on its own when its
    /// speculation is slower than cloud decoding at this load ([`crate::pace`]).
    pub pace: Option<ForwardCost>,
    level: u32,
}

impl GrantPolicy {
    pub fn new(max_draft_len: u32, max_depth: u32, saturation_tokens: f64) -> Self {
        Self {
            max_draft_len: max_draft_len.max(1),
            max_depth: max_depth.max(1),
            saturation_tokens: saturation_tokens.max(1.0),
            shrink_above: 0.75,
            grow_below: 0.5,
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
    pub fn current(&self) -> (u32, u32) {
        if self.level > self.speculative_levels() {
            return (0, 1);
        }
        let g = (self.max_draft_len >> self.level.min(31)).max(1);
        let d = self.max_depth.saturating_sub(self.level).max(1);
        (g, d)
    }

    /// Move at most one level for the observed load (tokens per forward, averaged), and return the
    /// grant for a session opening now.
    pub fn grant(&mut self, tokens_per_forward: f64) -> (u32, u32) {
        let f = tokens_per_forward / self.saturation_tokens;
        if f > self.shrink_above && self.level < self.max_level() {
            self.level += 1;
        } else if f < self.grow_below && self.level > 0 {
            self.level -= 1;
        }
        self.current()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
