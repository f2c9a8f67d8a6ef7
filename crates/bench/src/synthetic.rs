//! A synthetic edge for load generation, so that 64 edges do not need 64 models on two cores: it
//! knows the target's continuation and drafts each token right with probability α, taking a set
//! time per token. The verifier cannot tell it from a model: the protocol, the edge session and
//! the verdicts are real.

use tandem_edge::{Drafter, EdgeError, Proposal};
use tandem_spec::{BranchJob, SpecError};

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
        if self.draft_ms > 0.0 {
            std::thread::sleep(std::time::Duration::from_secs_f64(self.draft_ms / 1e3));
        }
        let i = tokens.len().saturating_sub(self.prompt_len);
        // Past the known continuation any token is a guess; the run ends there anyway.
        let right = self.want.get(i).copied().unwrap_or(0);
        let token = if self.uniform() < self.alpha {
            right
        } else {
            (right + 1) % self.vocab
        };
        Ok(Proposal {
            token,
            q: None,
            prefill: false,
            hedge: None,
        })
    }

    fn rollback(&mut self, _len: usize) -> Result<(), EdgeError> {
        Ok(())
    }

    fn branch(&mut self, _: &[u32], job: BranchJob) -> Result<(Vec<u32>, usize), EdgeError> {
        // It proposes no second choices, so its pipeline never asks for a branch.
        Err(EdgeError::Spec(SpecError::Protocol(format!(
            "the synthetic edge drafts linear blocks; a branch at {} was asked for",
            job.pos
        ))))
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
}
