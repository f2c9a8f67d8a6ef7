//! Verify rules: how the target's logits at a position judge the draft's token there.
//!
//! - **Greedy**: accept while the draft equals the target's argmax.
//! - **Sample-and-match**: the target samples each position with the request's temperature /
//!   top-k / top-p from a draw keyed by (seed, position) and accepts while it equals the draft.
//!   Lossless for any sampling parameters with token ids alone on the wire.
//! - **Rejection sampling**: accept the draft token `d` with probability `min(1, p(d)/q(d))`; on
//!   rejection draw from `normalize(max(0, p − q))`. The edge drew `d` from the sparse `q` it sends
//!   with the block, so the committed token is distributed exactly as `p`.
//!
//! A position whose target token is already known (the pending prediction after a fully accepted
//! block) is always judged by matching against that token, which was itself drawn from `p`.

use serde::{Deserialize, Serialize};

use crate::pipeline::SparseDist;
use crate::sampling::{distribution, draw, sample, uniform, SamplingParams};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifyRule {
    Greedy,
    SampleMatch,
    Rejection,
}

impl std::str::FromStr for VerifyRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "greedy" => Ok(Self::Greedy),
            "sample-match" | "sample_match" => Ok(Self::SampleMatch),
            "rejection" => Ok(Self::Rejection),
            _ => Err(format!(
                "unknown verify rule `{s}` (greedy, sample-match, rejection)"
            )),
        }
    }
}

impl VerifyRule {
    /// The rule to use for `params`: greedy parameters always verify greedily.
    pub fn effective(self, params: &SamplingParams) -> Self {
        if params.is_greedy() {
            Self::Greedy
        } else if self == Self::Greedy {
            Self::SampleMatch
        } else {
            self
        }
    }

    /// Does the edge have to send its draft distributions?
    pub fn needs_q(self) -> bool {
        self == Self::Rejection
    }
}

/// Stream ids of the counter-based draws. The target's draw and the draft's share one (coupled
/// draws: each on its own distribution); acceptance and the residual have their own, so that a
/// rejection-sampling verdict is independent of the draft's token given its distribution.
pub const STREAM_TARGET: u64 = 0;
pub const STREAM_ACCEPT: u64 = 1;
pub const STREAM_RESIDUAL: u64 = 2;

/// The target's own token at `pos` (bonus or pending prediction): argmax, or a draw from `p`.
pub fn target_token(logits: &[f32], params: &SamplingParams, pos: u64) -> u32 {
    sample(logits, params, pos)
}

/// `Ok(())` when the draft token `d` is accepted at `pos`, else `Err(correction)`.
pub fn judge(
    rule: VerifyRule,
    logits: &[f32],
    params: &SamplingParams,
    pos: u64,
    d: u32,
    q: Option<&SparseDist>,
) -> Result<(), u32> {
    match rule.effective(params) {
        VerifyRule::Greedy | VerifyRule::SampleMatch => {
            let t = target_token(logits, params, pos);
            if t == d {
                Ok(())
            } else {
                Err(t)
            }
        }
        VerifyRule::Rejection => {
            let p = distribution(logits, params);
            rejection_step(&p, q.map_or(&[][..], |q| &q[..]), params.seed, pos, d)
        }
    }
}

fn prob(dist: &[(u32, f32)], t: u32) -> f64 {
    dist.iter()
        .find(|(x, _)| *x == t)
        .map_or(0.0, |(_, p)| *p as f64)
}

/// One step of speculative rejection sampling with target `p` and draft `q` (both sparse).
pub fn rejection_step(
    p: &[(u32, f32)],
    q: &[(u32, f32)],
    seed: u64,
    pos: u64,
    d: u32,
) -> Result<(), u32> {
    let (pd, qd) = (prob(p, d), prob(q, d));
    if qd > 0.0 && uniform(seed, pos, STREAM_ACCEPT) < (pd / qd).min(1.0) {
        return Ok(());
    }
    let mut residual: Vec<(u32, f32)> = p
        .iter()
        .map(|&(t, pt)| (t, (pt as f64 - prob(q, t)).max(0.0) as f32))
        .filter(|&(_, r)| r > 0.0)
        .collect();
    let total: f64 = residual.iter().map(|&(_, r)| r as f64).sum();
    if total <= 0.0 {
        // p ≤ q everywhere means p = q, where acceptance is certain; only reached through rounding.
        return Err(draw(p, uniform(seed, pos, STREAM_RESIDUAL)));
    }
    residual
        .iter_mut()
        .for_each(|(_, r)| *r = (*r as f64 / total) as f32);
    Err(draw(&residual, uniform(seed, pos, STREAM_RESIDUAL)))
}

/// The edge's draw from its draft distribution: `q` is the renormalised top-k (after temperature)
/// that goes on the wire, `d` a draw from it on the uniform the target's own draw at `pos` uses
/// (coupled: where the verifier decodes the position itself, the draft's token agrees with it as
/// often as the two distributions allow). Rejection sampling stays exact: `d` is a draw from `q`,
/// independent of the acceptance and residual uniforms (other streams).
pub fn draft_sample(
    logits: &[f32],
    params: &SamplingParams,
    pos: u64,
    top_k: usize,
) -> (u32, SparseDist) {
    let k = if params.top_k > 0 {
        params.top_k.min(top_k)
    } else {
        top_k
    };
    let p = SamplingParams {
        top_k: k,
        ..*params
    };
    let q = distribution(logits, &p);
    let d = draw(&q, uniform(params.seed, pos, STREAM_TARGET));
    (d, q)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// χ² statistic of observed counts against probabilities.
    fn chi2(counts: &[usize], probs: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(probs)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    // Target and draft logits over 6 tokens that disagree on purpose.
    const TARGET: [f32; 6] = [2.0, 1.5, 0.2, -0.5, 1.0, 0.0];
    const DRAFT: [f32; 6] = [0.5, 2.2, 0.4, 0.8, -1.0, 0.3];

    fn target_probs(params: &SamplingParams) -> Vec<f64> {
        let d = distribution(&TARGET, params);
        (0..6).map(|t| prob(&d, t)).collect()
    }

    /// Committed token at one position, over many independent seeds, for a rule.
    fn committed_counts(rule: VerifyRule, params: SamplingParams, n: u64) -> Vec<usize> {
        let mut counts = vec![0usize; 6];
        for seed in 0..n {
            let p = SamplingParams { seed, ..params };
            let (d, q) = draft_sample(&DRAFT, &p, 17, 6);
            let t = match judge(rule, &TARGET, &p, 17, d, Some(&q)) {
                Ok(()) => d,
                Err(c) => c,
            };
            counts[t as usize] += 1;
        }
        counts
    }

    #[test]
    fn sample_match_and_rejection_commit_the_target_distribution() {
        // χ² with 5 degrees of freedom: 20.5 is the 0.999 quantile. Seeds are fixed, so this is
        // deterministic; a wrong rule (e.g. accepting the draft always) scores in the thousands.
        for params in [
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                seed: 0,
            },
            SamplingParams {
                temperature: 0.7,
                top_k: 4,
                top_p: 1.0,
                seed: 0,
            },
            SamplingParams {
                temperature: 1.3,
                top_k: 0,
                top_p: 0.9,
                seed: 0,
            },
        ] {
            let want = target_probs(&params);
            for rule in [VerifyRule::SampleMatch, VerifyRule::Rejection] {
                let counts = committed_counts(rule, params, 40_000);
                let (c, w): (Vec<usize>, Vec<f64>) = counts
                    .iter()
                    .zip(&want)
                    .filter(|(_, &p)| p > 0.0)
                    .map(|(&c, &p)| (c, p))
                    .unzip();
                assert_eq!(
                    counts.iter().sum::<usize>(),
                    c.iter().sum::<usize>(),
                    "{rule:?}: token outside p's support"
                );
                let x = chi2(&c, &w);
                assert!(
                    x < 20.5,
                    "{rule:?} {params:?}: chi2 {x}, counts {counts:?}, want {want:?}"
                );
            }
        }
        // The test can fail: committing the draft token unjudged is far from the target.
        let mut wrong = vec![0usize; 6];
        for seed in 0..40_000u64 {
            let p = SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                seed,
            };
            wrong[draft_sample(&DRAFT, &p, 17, 6).0 as usize] += 1;
        }
        let x = chi2(
            &wrong,
            &target_probs(&SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            }),
        );
        assert!(x > 1000.0, "chi2 of the draft itself {x}");
    }

    #[test]
    fn rejection_sampling_accepts_more_than_matching() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        };
        let acc = |rule| {
            (0..20_000u64)
                .filter(|&seed| {
                    let p = SamplingParams { seed, ..params };
                    let (d, q) = draft_sample(&DRAFT, &p, 3, 6);
                    judge(rule, &TARGET, &p, 3, d, Some(&q)).is_ok()
                })
                .count()
        };
        let (m, r) = (acc(VerifyRule::SampleMatch), acc(VerifyRule::Rejection));
        assert!(r > m, "rejection {r} vs match {m}");
    }

    #[test]
    fn greedy_is_argmax_match() {
        let p = SamplingParams::default();
        assert_eq!(
            judge(VerifyRule::Rejection, &TARGET, &p, 0, 0, None),
            Ok(())
        );
        assert_eq!(judge(VerifyRule::Greedy, &TARGET, &p, 0, 1, None), Err(0));
    }
}
