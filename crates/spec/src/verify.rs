//! Verify rules: how the target's logits at a position judge the draft's token there.
//!
//! - **Greedy**: accept while the draft equals the target's argmax.
//! - **Sample-and-match** (coupled): the target samples each position with the request's
//!   temperature / top-k / top-p, a Gumbel-max draw on noise keyed by (seed, position, token), and
//!   accepts while it equals the draft, which drew on the same noise from its own distribution.
//!   Lossless for any sampling parameters with token ids alone on the wire, and reproducible: the
//!   committed token at a position is the target's draw whether the verifier decoded it or
//!   judged a draft there, so a seeded answer is a function of (prompt, parameters, seed) alone.
//! - **Rejection sampling**: accept the draft token `d` with probability `min(1, p(d)/q(d))`; on
//!   rejection draw from `normalize(max(0, p − q))`. The edge drew `d` from the sparse `q` it sends
//!   with the block, so the committed token is distributed exactly as `p`. At a node of a token
//!   tree the guesses are judged in turn, each against what the ones before it left of `p`
//!   ([`recursive_rejection`]): a side token beside a main one is a draw from `q` without the
//!   main token ([`draft_sibling`]); a branch's continuation is a point mass.
//!
//! A position whose target token is already known (the pending prediction after a fully accepted
//! block) is always judged by matching against that token, which was itself drawn from `p`.

use serde::{Deserialize, Serialize};

use crate::pipeline::SparseDist;
use crate::sampling::{distribution, draw, draw_coupled, sample, uniform, SamplingParams};

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

/// Stream ids of the counter-based uniforms. The target's draw and the draft's share the Gumbel
/// noise of [`crate::sampling::gumbel`] (coupled draws: each on its own distribution); acceptance
/// and the residual have streams of their own, so that a rejection-sampling verdict is
/// independent of the draft's token given its distribution.
pub const STREAM_ACCEPT: u64 = 1;
pub const STREAM_RESIDUAL: u64 = 2;
/// The edge's draw of a second guess beside its drawn token (a token tree under rejection
/// sampling).
pub const STREAM_DRAFT_SIBLING: u64 = 3;
/// The `i`-th guess after the first at a position (a token tree's siblings) is judged on stream
/// `STREAM_SIBLING + i`.
pub const STREAM_SIBLING: u64 = 16;

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
    let guess = Guess::Drawn(d, q.map_or(&[][..], |q| &q[..]));
    judge_guesses(rule, logits, params, pos, &[guess]).map(|_| ())
}

/// A guess at one position, as the rejection rule sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Guess<'a> {
    /// The draft's token, drawn from its distribution `q` (the main path).
    Drawn(u32, &'a [(u32, f32)]),
    /// A later draw, without replacement, from the first guess's `q` (a side token beside a
    /// drawn main token: [`draft_sibling`]); a point mass when the first guess was not drawn.
    Sibling(u32),
    /// A token the edge chose without drawing (a branch's continuation): a point mass.
    Point(u32),
}

impl Guess<'_> {
    pub fn token(&self) -> u32 {
        match *self {
            Guess::Drawn(t, _) | Guess::Sibling(t) | Guess::Point(t) => t,
        }
    }
}

/// Judge the guesses at one position (a tree node's children, the expected one first):
/// `Ok(i)` commits `guesses[i]`, `Err(t)` commits `t`, which is none of them. Greedy and
/// sample-and-match follow the target's own token; rejection sampling judges the guesses in turn,
/// each against what the ones before it left of `p` (recursive residuals), so the committed
/// token is distributed as `p` whichever guesses were sent.
pub fn judge_guesses(
    rule: VerifyRule,
    logits: &[f32],
    params: &SamplingParams,
    pos: u64,
    guesses: &[Guess],
) -> Result<usize, u32> {
    match rule.effective(params) {
        VerifyRule::Greedy | VerifyRule::SampleMatch => {
            let t = target_token(logits, params, pos);
            guesses.iter().position(|g| g.token() == t).ok_or(t)
        }
        VerifyRule::Rejection => {
            let p = distribution(logits, params);
            recursive_rejection(&p, guesses, params.seed, pos)
        }
    }
}

/// The tokens a forward commits when the verifier decodes from `start_pos` with its own `guesses`
/// fed behind the last committed token (rows: one per fed token, `guesses.len() + 1`): each
/// guess judged as a point mass (the committed token is the target's, decoded or accepted, as
/// with no guess at all under greedy and sample-and-match, and distributed as `p` under
/// rejection sampling), while they are accepted; then the target's own token (the correction,
/// or the bonus after them all). With no guesses: the target's token at `start_pos`. A
/// constrained session's rows are masked by `grammar`, which follows each committed token.
pub fn judge_run(
    rule: VerifyRule,
    params: &SamplingParams,
    start_pos: usize,
    guesses: &[u32],
    rows: &[&[f32]],
    mut grammar: Option<&mut crate::Grammar>,
) -> Result<Vec<u32>, crate::GrammarError> {
    let mut out = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let pos = (start_pos + i) as u64;
        let masked;
        let row: &[f32] = match grammar.as_deref_mut() {
            Some(g) => {
                masked = g.mask(row)?;
                &masked
            }
            None => row,
        };
        let guess = guesses.get(i).copied();
        let t = match guess {
            Some(g) => match judge_guesses(rule, row, params, pos, &[Guess::Point(g)]) {
                Ok(_) => g,
                Err(t) => t,
            },
            None => target_token(row, params, pos),
        };
        if let Some(g) = grammar.as_deref_mut() {
            g.advance(t)?;
        }
        out.push(t);
        if guess != Some(t) {
            break;
        }
    }
    Ok(out)
}

fn prob(dist: &[(u32, f32)], t: u32) -> f64 {
    dist.iter()
        .find(|(x, _)| *x == t)
        .map_or(0.0, |(_, p)| *p as f64)
}

/// The uniform that judges the `i`-th guess at a position: the first has the stream linear
/// blocks use, each sibling after it one of its own.
fn accept_uniform(seed: u64, pos: u64, i: usize) -> f64 {
    let stream = if i == 0 {
        STREAM_ACCEPT
    } else {
        STREAM_SIBLING + i as u64
    };
    uniform(seed, pos, stream)
}

/// Speculative rejection sampling over several guesses at one position, target `p` (sparse).
///
/// The residual `r` starts as `p`. A guess drawn from `q` is accepted with probability
/// `min(1, r(d)/q(d))`, else `r ← normalize(max(0, r − q))`; a point mass `t` is accepted with
/// probability `r(t)`, else `r ← normalize(r` without `t)`; a sibling is judged as drawn from
/// the first guess's `q` without the guesses before it ([`without`]). When none is accepted the
/// token is a draw from the last `r`. Each step keeps the committed token distributed as the `r` it started
/// from, for any choice of the point masses (even one made after seeing the drawn guess), as long
/// as the drawn guess was a draw from its `q` and no guess depends on the uniforms judging them.
pub fn recursive_rejection(
    p: &[(u32, f32)],
    guesses: &[Guess],
    seed: u64,
    pos: u64,
) -> Result<usize, u32> {
    let mut r: Vec<(u32, f64)> = p.iter().map(|&(t, x)| (t, x as f64)).collect();
    let at = |r: &[(u32, f64)], t: u32| r.iter().find(|(x, _)| *x == t).map_or(0.0, |e| e.1);
    let first_q = match guesses.first() {
        Some(&Guess::Drawn(_, q)) => Some(q),
        _ => None,
    };
    let mut rest: SparseDist;
    for (i, g) in guesses.iter().enumerate() {
        let u = accept_uniform(seed, pos, i);
        let g = match (*g, first_q) {
            (Guess::Sibling(t), Some(q)) => {
                let before: Vec<u32> = guesses[..i].iter().map(Guess::token).collect();
                rest = without(q, &before);
                Guess::Drawn(t, &rest)
            }
            (Guess::Sibling(t), None) => Guess::Point(t),
            (g, _) => g,
        };
        match g {
            Guess::Drawn(d, q) => {
                let qd = prob(q, d);
                if qd > 0.0 && u < (at(&r, d) / qd).min(1.0) {
                    return Ok(i);
                }
                let q: std::collections::HashMap<u32, f64> =
                    q.iter().map(|&(t, x)| (t, x as f64)).collect();
                r.iter_mut()
                    .for_each(|(t, x)| *x = (*x - q.get(t).copied().unwrap_or(0.0)).max(0.0));
            }
            Guess::Point(t) | Guess::Sibling(t) => {
                if u < at(&r, t) {
                    return Ok(i);
                }
                r.iter_mut()
                    .filter(|(x, _)| *x == t)
                    .for_each(|e| e.1 = 0.0);
            }
        }
        r.retain(|&(_, x)| x > 0.0);
        let total: f64 = r.iter().map(|e| e.1).sum();
        if total <= 0.0 {
            // Nothing left: the guesses held all of p, where one is accepted for certain; only
            // reached through rounding. The target's own draw decides.
            let t = draw(p, uniform(seed, pos, STREAM_RESIDUAL));
            return guesses.iter().position(|g| g.token() == t).ok_or(t);
        }
        r.iter_mut().for_each(|e| e.1 /= total);
    }
    let r: Vec<(u32, f32)> = r.into_iter().map(|(t, x)| (t, x as f32)).collect();
    Err(draw(&r, uniform(seed, pos, STREAM_RESIDUAL)))
}

/// `q` without `tokens`, renormalised (empty when nothing is left): what a guess drawn after
/// them, without replacement, is drawn from.
pub fn without(q: &[(u32, f32)], tokens: &[u32]) -> SparseDist {
    let rest: Vec<(u32, f32)> = q
        .iter()
        .copied()
        .filter(|(t, _)| !tokens.contains(t))
        .collect();
    let total: f64 = rest.iter().map(|e| e.1 as f64).sum();
    if total <= 0.0 {
        return Vec::new();
    }
    rest.into_iter()
        .map(|(t, x)| (t, (x as f64 / total) as f32))
        .collect()
}

/// The edge's second guess beside its drawn token `d` under rejection sampling: a draw from `q`
/// without `d` (sampling without replacement, on a stream of its own), judged by the verifier as
/// a draw from [`without`]`(q, [d])` — which commits it far more often than the draft's second
/// choice would as a point mass (only where the target's probability exceeds the draft's).
pub fn draft_sibling(q: &[(u32, f32)], d: u32, seed: u64, pos: u64) -> Option<u32> {
    let rest = without(q, &[d]);
    (!rest.is_empty()).then(|| draw(&rest, uniform(seed, pos, STREAM_DRAFT_SIBLING)))
}

/// The edge's draw from its draft distribution: `q` is the renormalised top-k (after temperature)
/// that goes on the wire, `d` a draw from it on the Gumbel noise the target's own draw at `pos`
/// uses (coupled: where the verifier decodes the position itself, the draft's token agrees with
/// it as often as the two distributions allow). Rejection sampling stays exact: `d` is a draw from `q`,
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
    let d = draw_coupled(&q, params.seed, pos);
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

    /// χ² of `counts` on the support of `probs`, and the count outside it.
    fn chi2_on_support(counts: &[usize], probs: &[f64]) -> (f64, usize) {
        let (c, w): (Vec<usize>, Vec<f64>) = counts
            .iter()
            .zip(probs)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&c, &p)| (c, p))
            .unzip();
        (
            chi2(&c, &w),
            counts.iter().sum::<usize>() - c.iter().sum::<usize>(),
        )
    }

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
                let (x, outside) = chi2_on_support(&counts, &want);
                assert_eq!(outside, 0, "{rule:?}: token outside p's support");
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

    /// Under a grammar's mask (structured outputs) both models' rows lose the tokens it forbids
    /// (−∞: what `Grammar::mask` writes); the rules, run on the masked rows, commit the target's
    /// masked distribution. Here the mask forbids the draft's favourite (1) and one more (4).
    #[test]
    fn a_verifiers_own_guesses_as_point_masses_keep_the_targets_distribution() {
        // The verifier feeds its own guesses (copied from the text, not drawn) behind the last
        // committed token: under rejection sampling each is a point mass. The first committed
        // token follows p at its position, and, where the first guess was accepted, the second
        // follows p at the next (χ², 5 dof: 20.5 is the 0.999 quantile).
        let second: [f32; 6] = [0.1, 0.3, 2.4, -1.0, 0.6, 1.1];
        let params = SamplingParams {
            temperature: 0.9,
            ..SamplingParams::default()
        };
        let p0: Vec<f64> = {
            let d = distribution(&TARGET, &params);
            (0..6).map(|t| prob(&d, t)).collect()
        };
        let p1: Vec<f64> = {
            let d = distribution(&second, &params);
            (0..6).map(|t| prob(&d, t)).collect()
        };
        let rows: [&[f32]; 3] = [&TARGET, &second, &TARGET];
        for guesses in [[0u32, 2], [3, 5], [1, 3]] {
            let (mut first, mut next) = (vec![0usize; 6], vec![0usize; 6]);
            for seed in 0..40_000u64 {
                let p = SamplingParams { seed, ..params };
                let run = judge_run(VerifyRule::Rejection, &p, 30, &guesses, &rows, None).unwrap();
                first[run[0] as usize] += 1;
                if run[0] == guesses[0] {
                    next[run[1] as usize] += 1;
                }
            }
            let x = chi2(&first, &p0);
            assert!(x < 20.5, "{guesses:?}: first token chi2 {x}, {first:?}");
            let y = chi2(&next, &p1);
            assert!(y < 20.5, "{guesses:?}: second token chi2 {y}, {next:?}");
        }
        assert_eq!(
            judge_run(
                VerifyRule::Greedy,
                &SamplingParams::default(),
                30,
                &[0, 2],
                &rows,
                None
            )
            .unwrap(),
            vec![0, 2, 0],
            "greedy: both guesses are the argmax, then the bonus"
        );
    }

    #[test]
    fn the_rules_commit_the_targets_distribution_under_a_mask() {
        let mask = |l: &[f32; 6]| {
            let mut m = *l;
            m[1] = f32::NEG_INFINITY;
            m[4] = f32::NEG_INFINITY;
            m
        };
        let (target, draft) = (mask(&TARGET), mask(&DRAFT));
        for params in [
            SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                temperature: 0.7,
                top_k: 3,
                top_p: 0.95,
                seed: 0,
            },
        ] {
            let d = distribution(&target, &params);
            let want: Vec<f64> = (0..6).map(|t| prob(&d, t)).collect();
            assert_eq!((want[1], want[4]), (0.0, 0.0));
            for rule in [VerifyRule::SampleMatch, VerifyRule::Rejection] {
                let mut counts = vec![0usize; 6];
                for seed in 0..40_000u64 {
                    let p = SamplingParams { seed, ..params };
                    let (d, q) = draft_sample(&draft, &p, 17, 6);
                    let t = match judge(rule, &target, &p, 17, d, Some(&q)) {
                        Ok(()) => d,
                        Err(c) => c,
                    };
                    counts[t as usize] += 1;
                }
                let (x, outside) = chi2_on_support(&counts, &want);
                assert_eq!(
                    outside, 0,
                    "{rule:?}: a token the mask forbids was committed"
                );
                // 3 degrees of freedom at most: 16.3 is the 0.999 quantile.
                assert!(
                    x < 16.3,
                    "{rule:?} {params:?}: chi2 {x}, {counts:?}, {want:?}"
                );
            }
        }
        // The test can fail: judging against the unmasked target commits forbidden tokens.
        let p = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let forbidden = (0..4_000u64)
            .filter(|&seed| {
                let p = SamplingParams { seed, ..p };
                let (d, q) = draft_sample(&draft, &p, 17, 6);
                let t = judge(VerifyRule::Rejection, &TARGET, &p, 17, d, Some(&q))
                    .map_or_else(|c| c, |()| d);
                t == 1 || t == 4
            })
            .count();
        assert!(forbidden > 500, "{forbidden}");
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
    fn rejection_over_a_tree_node_commits_the_target_distribution() {
        // The main token drawn from q, then the draft's next choices as point masses: the
        // committed token follows p (χ², 5 dof, 0.999 quantile 20.5). A point mass is committed
        // only where p exceeds q (the residual's support): here tokens 0 and 4, which the draft
        // ranks low, so only with every other token as a guess are the side guesses committed
        // often. A second guess drawn without replacement is committed often (Σ min(r, q')).
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        };
        let run = |p: &SamplingParams, guesses: usize, wrong: bool| {
            let (d, q) = draft_sample(&DRAFT, p, 17, 6);
            let alts: Vec<u32> = q.iter().map(|e| e.0).filter(|&t| t != d).collect();
            let mut g = vec![Guess::Drawn(d, &q[..])];
            // guesses 0: a second draw, without replacement, then a point mass.
            if guesses == 0 {
                let s = draft_sibling(&q, d, p.seed, 17).expect("q has more than one token");
                g.push(Guess::Sibling(s));
                g.extend(alts.iter().find(|&&t| t != s).map(|&t| Guess::Point(t)));
            }
            g.extend(
                alts.iter()
                    .take(guesses.saturating_sub(1))
                    .map(|&t| Guess::Point(t)),
            );
            let tp = distribution(&TARGET, p);
            if wrong {
                // Planted: the second guess judged against p itself, not against the residual.
                if rejection_step_linear(&tp, &q, p.seed, d) {
                    return (d, 0);
                }
                if uniform(p.seed, 17, STREAM_SIBLING + 1) < prob(&tp, alts[0]) {
                    return (alts[0], 1);
                }
                return (draw(&tp, uniform(p.seed, 17, STREAM_RESIDUAL)), 9);
            }
            match recursive_rejection(&tp, &g, p.seed, 17) {
                Ok(i) => (g[i].token(), i),
                Err(t) => {
                    assert!(
                        g.iter().all(|x| x.token() != t),
                        "a correction equals a guess"
                    );
                    (t, 9)
                }
            }
        };
        for (guesses, p, sides) in [
            (0, params, true),
            (
                0,
                SamplingParams {
                    temperature: 0.7,
                    top_k: 4,
                    ..params
                },
                true,
            ),
            (2, params, false),
            (6, params, true),
            (
                3,
                SamplingParams {
                    temperature: 0.7,
                    top_k: 4,
                    ..params
                },
                false,
            ),
        ] {
            let mut counts = vec![0usize; 6];
            let mut side = 0;
            for seed in 0..40_000u64 {
                let (t, i) = run(&SamplingParams { seed, ..p }, guesses, false);
                counts[t as usize] += 1;
                side += usize::from((1..9).contains(&i));
            }
            let want = target_probs(&p);
            let (x, outside) = chi2_on_support(&counts, &want);
            assert_eq!(outside, 0, "token outside p's support");
            assert!(
                x < 20.5,
                "{guesses} guesses {p:?}: chi2 {x}, counts {counts:?}, want {want:?}"
            );
            assert!(
                !sides || side > 4000,
                "the side guesses are committed {side} times"
            );
        }
        let mut counts = vec![0usize; 6];
        for seed in 0..40_000u64 {
            counts[run(&SamplingParams { seed, ..params }, 2, true).0 as usize] += 1;
        }
        let x = chi2(&counts, &target_probs(&params));
        assert!(x > 100.0, "the planted rule passes: chi2 {x}");
    }

    /// The linear rule's acceptance alone (for the planted variant above).
    fn rejection_step_linear(p: &[(u32, f32)], q: &[(u32, f32)], seed: u64, d: u32) -> bool {
        let qd = prob(q, d);
        qd > 0.0 && uniform(seed, 17, STREAM_ACCEPT) < (prob(p, d) / qd).min(1.0)
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
