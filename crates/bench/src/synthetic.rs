//! A synthetic edge for load generation, so that 64 edges do not need 64 models on two cores: it
//! knows the target's continuation and drafts each token right with probability α, taking a set
//! time per token. The verifier cannot tell it from a model: the protocol, the edge session and
//! the verdicts are real. With `cover` set it also names second choices for token trees, as a
//! draft model does where it is unsure.

use tandem_edge::{Drafter, EdgeError, Proposal};
use tandem_spec::{BranchJob, Hedge, SpecError};

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

    fn sleep(&self, tokens: usize) {
        if self.draft_ms > 0.0 && tokens > 0 {
            std::thread::sleep(std::time::Duration::from_secs_f64(
                self.draft_ms * tokens as f64 / 1e3,
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

impl Drafter for SyntheticDrafter {
    fn propose(&mut self, tokens: &[u32]) -> Result<Proposal, EdgeError> {
        self.sleep(1);
        let i = tokens.len().saturating_sub(self.prompt_len);
        let right = self.right(i);
        let hit = self.uniform() < self.alpha;
        let token = if hit { right } else { (right + 1) % self.vocab };
        let cover = self.cover;
        let hedge = match cover {
            // Unsure at every miss, and at a hit as often as there are misses.
            Some(cover) if !hit || self.uniform() < 1.0 - self.alpha => {
                let covered = !hit && self.uniform() < cover;
                Some(Hedge {
                    alt: if covered {
                        right
                    } else {
                        (right + 2) % self.vocab
                    },
                    p_top: UNSURE,
                })
            }
            Some(_) => Some(Hedge {
                alt: (right + 2) % self.vocab,
                p_top: SURE,
            }),
            None => None,
        };
        Ok(Proposal {
            token,
            q: None,
            prefill: false,
            hedge,
        })
    }

    fn rollback(&mut self, _len: usize) -> Result<(), EdgeError> {
        Ok(())
    }

    fn branch(&mut self, _: &[u32], job: BranchJob) -> Result<(Vec<u32>, usize), EdgeError> {
        if self.cover.is_none() {
            return Err(EdgeError::Spec(SpecError::Protocol(format!(
                "the synthetic edge drafts linear blocks; a branch at {} was asked for",
                job.pos
            ))));
        }
        // A branch that starts right continues right at rate α (until its first miss).
        let i = job.pos.saturating_sub(self.prompt_len);
        let mut on = job.first == self.right(i);
        let mut out = vec![job.first];
        for k in 1..job.len {
            let right = self.right(i + k);
            on = on && self.uniform() < self.alpha;
            out.push(if on { right } else { (right + 1) % self.vocab });
        }
        self.sleep(job.len - 1);
        Ok((out, job.len - 1))
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
        // A branch that starts right continues right at α; one that starts wrong stays wrong.
        let job = BranchJob {
            pos: 3 + 10,
            first: want[10],
            len: 3,
        };
        let (b, forwards) = d.branch(&prefix, job).unwrap();
        assert_eq!((b[0], b.len(), forwards), (want[10], 3, 2));
        let wrong = BranchJob {
            first: want[10] + 1,
            ..job
        };
        let (b, _) = d.branch(&prefix, wrong).unwrap();
        assert!(b[1..].iter().zip(&want[11..]).all(|(x, y)| x != y), "{b:?}");
    }
}
