//! A synthetic edge for load generation, so that 64 edges do not need 64 models on two cores: it
//! knows the target's continuation and drafts each token right with probability α, taking a set
//! time per token. The verifier cannot tell it from a model: the protocol, the edge session and
//! the verdicts are real. With `cover` set it also names second choices for token trees, as a
//! draft model does where it is unsure, and grows every leaf of the draft tree (a leaf off the
//! target's continuation is never right), taking [`DEFAULT_LEAF_COST`] of a forward more per extra leaf.

use tandem_spec::tree::DEFAULT_LEAF_COST;
use tandem_spec::Hedge;

use crate::{Drafter, EdgeError, Proposal};

/// How sure the synthetic draft says it is: below any sensible branching threshold where it
/// hedges, above it elsewhere.
const UNSURE: f32 = 0.3;
const SURE: f32 = 0.95;

/// A synthetic edge for load generation: it knows the target's greedy continuation of its prompt
/// and drafts each token correctly with probability `alpha` (a seeded draw per position and
/// attempt) and a wrong token otherwise, sleeping `draft_ms` per token as a draft model would take.
/// The verifier cannot tell it from a model: the protocol, the pipeline and the verdicts are real.
pub struct SyntheticDrafter {
    prompt_len: usize,
    /// The target's continuation after the prompt.
    want: Vec<u32>,
    alpha: f64,
    draft_ms: f64,
    vocab: u32,
    seed: u64,
    /// Draws so far (each proposal draws afresh, so a position redrafted after a rejection gets a
    /// new chance).
    draws: u64,
    /// Token trees: the share of wrong guesses whose second choice is right. The draft is unsure
    /// (and names a second choice) at every wrong guess and, as often, at a right one.
    cover: Option<f64>,
}

impl SyntheticDrafter {
    pub fn new(
        prompt_len: usize,
        want: Vec<u32>,
        alpha: f64,
        draft_ms: f64,
        vocab: u32,
        seed: u64,
    ) -> Self {
        Self {
            prompt_len,
            want,
            alpha: alpha.clamp(0.0, 1.0),
            draft_ms: draft_ms.max(0.0),
            vocab: vocab.max(2),
            seed,
            draws: 0,
            cover: None,
        }
    }

    /// Name second choices for token trees: right for `cover` of the wrong guesses.
    pub fn with_cover(mut self, cover: f64) -> Self {
        self.cover = Some(cover.clamp(0.0, 1.0));
        self
    }

    /// The target's token at output index `i` (past the known continuation, any token: the run
    /// ends there anyway).
    fn right(&self, i: usize) -> u32 {
        self.want.get(i).copied().unwrap_or(0)
    }

    /// Take as long as `forwards` draft forwards.
    fn sleep(&self, forwards: f64) {
        if self.draft_ms > 0.0 && forwards > 0.0 {
            std::thread::sleep(std::time::Duration::from_secs_f64(
                self.draft_ms * forwards / 1e3,
            ));
        }
    }

    /// A uniform draw in [0, 1) from (seed, draw number): splitmix64.
    fn uniform(&mut self) -> f64 {
        self.draws += 1;
        let mut z = self
            .seed
            .wrapping_add(self.draws.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl SyntheticDrafter {
    /// One leaf's next token after `path` (prompt, committed and drafted tokens).
    fn next_after(&mut self, path: &[u32]) -> Proposal {
        let i = path.len().saturating_sub(self.prompt_len);
        // Only a leaf on the target's continuation has a right token; any other is off.
        let on = path[self.prompt_len.min(path.len())..] == self.want[..i.min(self.want.len())];
        let right = self.right(i);
        let hit = on && self.uniform() < self.alpha;
        let token = if hit { right } else { (right + 1) % self.vocab };
        let hedge = self.cover.map(|cover| {
            // Unsure at every miss, and at a hit as often as there are misses.
            if !hit || self.uniform() < 1.0 - self.alpha {
                let covered = on && !hit && self.uniform() < cover;
                Hedge {
                    alt: if covered {
                        right
                    } else {
                        (right + 2) % self.vocab
                    },
                    p_top: UNSURE,
                }
            } else {
                Hedge {
                    alt: (right + 2) % self.vocab,
                    p_top: SURE,
                }
            }
        });
        Proposal {
            token,
            q: None,
            prefill: false,
            hedge,
        }
    }
}

impl Drafter for SyntheticDrafter {
    fn grow(&mut self, base: &[u32], leaves: &[Vec<u32>]) -> Result<Vec<Proposal>, EdgeError> {
        self.sleep(1.0 + DEFAULT_LEAF_COST * leaves.len().saturating_sub(1) as f64);
        Ok(leaves
            .iter()
            .map(|leaf| {
                let mut path = base.to_vec();
                path.extend(leaf);
                self.next_after(&path)
            })
            .collect())
    }

    fn rollback(&mut self, _len: usize) -> Result<(), EdgeError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_drafts_are_right_at_rate_alpha() {
        let want: Vec<u32> = (0..10_000).map(|i| i % 50).collect();
        let mut d = SyntheticDrafter::new(3, want.clone(), 0.8, 0.0, 50, 7);
        let mut prefix = vec![9, 9, 9];
        let mut right = 0;
        for w in &want {
            right += (d.propose(&prefix).unwrap().token == *w) as usize;
            prefix.push(*w);
        }
        let rate = right as f64 / want.len() as f64;
        assert!((rate - 0.8).abs() < 0.02, "{rate}");
    }

    #[test]
    fn synthetic_trees_hedge_every_miss_and_cover_their_share() {
        let want: Vec<u32> = (0..10_000).map(|i| i % 50).collect();
        let mut d = SyntheticDrafter::new(3, want.clone(), 0.8, 0.0, 50, 7).with_cover(0.6);
        let mut prefix = vec![9, 9, 9];
        let (mut misses, mut unsure_misses, mut covered, mut unsure_hits) = (0, 0, 0, 0);
        for w in &want {
            let p = d.propose(&prefix).unwrap();
            let h = p.hedge.expect("a second choice at every position");
            let unsure = h.p_top < 0.6;
            if p.token == *w {
                unsure_hits += usize::from(unsure);
            } else {
                misses += 1;
                unsure_misses += usize::from(unsure);
                covered += usize::from(h.alt == *w);
            }
            prefix.push(*w);
        }
        assert_eq!(unsure_misses, misses, "unsure at every miss");
        let cover = covered as f64 / misses as f64;
        assert!((cover - 0.6).abs() < 0.05, "{cover}");
        let false_alarms = unsure_hits as f64 / (want.len() - misses) as f64;
        assert!((false_alarms - 0.2).abs() < 0.03, "{false_alarms}");
        // Leaves: one on the target's continuation is right at α, one off it never.
        let base = prefix[..3 + 10].to_vec();
        let (mut on_right, mut off_right) = (0, 0);
        for _ in 0..2000 {
            let p = d
                .grow(&base, &[vec![want[10]], vec![want[10] + 1]])
                .unwrap();
            on_right += usize::from(p[0].token == want[11]);
            off_right += usize::from(p[1].token == want[11]);
        }
        assert!((on_right as f64 / 2000.0 - 0.8).abs() < 0.04, "{on_right}");
        assert_eq!(off_right, 0);
    }
}
