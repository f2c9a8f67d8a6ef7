//! Sampling: greedy, or temperature / top-k / top-p with a counter-based generator. A sampled token
//! is a Gumbel-max draw: the token whose log-probability plus its own Gumbel noise is largest,
//! the noise a pure function of `(seed, position, token)`, never a stream. So a recomputed or
//! re-verified position draws the same token, and two models drawing at one position on the same
//! noise agree as often as a shared-noise coupling allows (at least (1 − TV)/(1 + TV) of the
//! time, TV their total variation distance): the draft's draw is the target's wherever their
//! distributions are close, whatever order each ranks its tokens in.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Field-named check of the parameters.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature must be ≥ 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

/// SplitMix64 finaliser: a bijective 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) that depends only on `(seed, position, stream)`.
pub fn uniform(seed: u64, position: u64, stream: u64) -> f64 {
    let z =
        mix(mix(seed ^ 0x9e37_79b9_7f4a_7c15).wrapping_add(position) ^ mix(stream.wrapping_add(1)));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The Gumbel noise of `token` at `(seed, position)`: −ln(−ln U) for a uniform U in (0, 1) keyed
/// by all three (the key of the position computed once: [`gumbel_key`]).
pub fn gumbel(key: u64, token: u32) -> f64 {
    let z = mix(key ^ mix((token as u64) ^ 0x6a09_e667_f3bc_c908));
    // (0, 1): never 0 or 1, so both logarithms are finite.
    let u = ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -(-u.ln()).ln()
}

/// The part of a token's noise key that depends on `(seed, position)` alone.
pub fn gumbel_key(seed: u64, position: u64) -> u64 {
    mix(mix(seed ^ 0x3c6e_f372_fe94_f82b).wrapping_add(position))
}

/// The Gumbel-max draw at `(seed, position)` over `tokens` scored by `score` (a log-probability
/// up to a constant; −∞ never drawn unless nothing else is there): the token with the largest
/// score plus noise, the first on ties.
pub fn gumbel_draw(
    tokens: impl Iterator<Item = (u32, f64)>,
    seed: u64,
    position: u64,
) -> Option<u32> {
    let key = gumbel_key(seed, position);
    let mut best: Option<(u32, f64)> = None;
    for (t, score) in tokens {
        if score == f64::NEG_INFINITY && best.is_some() {
            continue;
        }
        let v = score + gumbel(key, t);
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((t, v));
        }
    }
    best.map(|(t, _)| t)
}

/// A Gumbel-max draw from a sparse distribution (a draft's `q`): the same noise as the target's
/// draw at `(seed, position)`, each token scored by its log-probability.
pub fn draw_coupled(dist: &[(u32, f32)], seed: u64, position: u64) -> u32 {
    gumbel_draw(
        dist.iter().map(|&(t, p)| (t, (p as f64).ln())),
        seed,
        position,
    )
    .unwrap_or(0)
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The sparse distribution the sampler draws from: `(token, probability)` sorted by probability,
/// after temperature, top-k and top-p, renormalised. Greedy gives a single token with probability 1.
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
    if p.is_greedy() {
        return vec![(argmax(logits), 1.0)];
    }
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    if p.top_k > 0 {
        idx.truncate(p.top_k);
    }
    let max = logits[idx[0] as usize];
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i as usize] - max) / p.temperature) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, &x) in probs.iter().enumerate() {
            acc += x;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        idx.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
    }
    idx.into_iter()
        .zip(probs.into_iter().map(|x| x as f32))
        .collect()
}

/// How sure a model is of `chosen` under `p` (its probability, at temperature 1 when greedy) and
/// its most likely other token: the draft's second choice, for a token tree.
pub fn second_choice(logits: &[f32], p: &SamplingParams, chosen: u32) -> Option<(u32, f32)> {
    if p.is_greedy() {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
        let p_chosen = ((logits.get(chosen as usize)? - max) as f64).exp() / total;
        let alt = (0..logits.len())
            .filter(|&i| i != chosen as usize)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))?;
        return Some((alt as u32, p_chosen as f32));
    }
    let dist = distribution(logits, p);
    let p_chosen = dist.iter().find(|(t, _)| *t == chosen).map_or(0.0, |d| d.1);
    let alt = dist.iter().find(|(t, _)| *t != chosen)?.0;
    Some((alt, p_chosen))
}

/// Draw from a sparse distribution with the uniform `u`.
pub fn draw(dist: &[(u32, f32)], u: f64) -> u32 {
    let mut acc = 0.0f64;
    for &(t, p) in dist {
        acc += p as f64;
        if u < acc {
            return t;
        }
    }
    dist.last().map_or(0, |&(t, _)| t)
}

/// The token for `position` under `p`: greedy, or the Gumbel-max draw keyed by `(seed, position)`
/// over what top-k and top-p leave of the vocabulary (all of it without them: no sort), each token
/// scored by its logit over the temperature.
pub fn sample(logits: &[f32], p: &SamplingParams, position: u64) -> u32 {
    if p.is_greedy() {
        return argmax(logits);
    }
    let t = p.temperature as f64;
    let score = |i: u32| logits[i as usize] as f64 / t;
    let drawn = if p.top_k == 0 && p.top_p >= 1.0 {
        gumbel_draw(
            (0..logits.len() as u32).map(|i| (i, score(i))),
            p.seed,
            position,
        )
    } else {
        let support = distribution(logits, p);
        gumbel_draw(
            support.iter().map(|&(i, _)| (i, score(i))),
            p.seed,
            position,
        )
    };
    drawn.unwrap_or(0)
}

/// The most alternatives a token's log-probability may come with (OpenAI's `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The target's log-probability of the token committed at `pos`, and of its `top` likeliest
/// tokens there: the log-softmax of the model's own row (before temperature, truncation or a
/// grammar's mask), as OpenAI and vLLM report it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub pos: usize,
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// [`TokenLogprob`] of `token` at `pos` from the logits `row`, with its `top` alternatives (at
/// most [`MAX_TOP_LOGPROBS`]).
pub fn token_logprob(row: &[f32], token: u32, pos: usize, top: usize) -> TokenLogprob {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let lp = |t: u32| (row.get(t as usize).map_or(f64::NEG_INFINITY, |&l| l as f64) - lse) as f32;
    let mut best: Vec<u32> = Vec::new();
    let top = top.min(MAX_TOP_LOGPROBS);
    if top > 0 {
        let mut idx: Vec<u32> = (0..row.len() as u32).collect();
        let k = top.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        best = idx;
    }
    TokenLogprob {
        pos,
        token,
        logprob: lp(token),
        top: best.into_iter().map(|t| (t, lp(t))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_second_choice_is_the_likeliest_other_token() {
        let logits = [0.0, 3.0, 1.0, 2.9];
        let (alt, p) = second_choice(&logits, &SamplingParams::default(), 1).unwrap();
        assert_eq!(alt, 3);
        let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - 3.0).exp()).collect();
        assert!((p as f64 - 1.0 / e.iter().sum::<f64>()).abs() < 1e-6);
        assert_eq!(
            second_choice(&logits, &SamplingParams::default(), 3)
                .unwrap()
                .0,
            1
        );
    }

    #[test]
    fn draws_are_keyed_by_seed_and_position() {
        assert_eq!(uniform(7, 3, 0), uniform(7, 3, 0));
        assert_ne!(uniform(7, 3, 0), uniform(7, 4, 0));
        assert_ne!(uniform(7, 3, 0), uniform(8, 3, 0));
        let mean: f64 = (0..20_000).map(|i| uniform(1, i, 0)).sum::<f64>() / 20_000.0;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn top_k_top_p_cut_and_renormalise() {
        let logits = [1.0, 3.0, 2.0, 0.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 0,
        };
        let d = distribution(&logits, &p);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((d.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            seed: 0,
        };
        assert_eq!(distribution(&logits, &p).len(), 1);
        assert_eq!(sample(&logits, &SamplingParams::default(), 0), 1);
    }

    /// The Gumbel-max draw is a draw from the distribution: χ² against p over many positions, for
    /// the whole vocabulary and for what top-k and top-p leave of it.
    #[test]
    fn gumbel_draws_follow_the_distribution_chi_squared() {
        let logits = [1.0f32, 0.2, -0.7, 2.1, 0.0, 1.4, -3.0, 0.9];
        for (top_k, top_p) in [(0, 1.0), (4, 1.0), (0, 0.8)] {
            let p = SamplingParams {
                temperature: 0.8,
                top_k,
                top_p,
                seed: 9,
            };
            let dist = distribution(&logits, &p);
            let n = 80_000;
            let mut counts = [0usize; 8];
            for pos in 0..n {
                counts[sample(&logits, &p, pos) as usize] += 1;
            }
            let mut chi2 = 0.0;
            for (t, c) in counts.iter().enumerate() {
                let want = dist
                    .iter()
                    .find(|d| d.0 == t as u32)
                    .map_or(0.0, |d| d.1 as f64);
                if want == 0.0 {
                    assert_eq!(*c, 0, "token {t} is outside the support ({top_k}, {top_p})");
                    continue;
                }
                let e = want * n as f64;
                chi2 += (*c as f64 - e).powi(2) / e;
            }
            // 7 degrees of freedom at most: p = 0.001 is 24.3.
            assert!(chi2 < 24.3, "χ² {chi2} ({top_k}, {top_p}): {counts:?}");
        }
    }

    /// On the same noise, a draft's draw over its sparse q agrees with the target's draw far more
    /// often than independent draws would, and as often as the coupling bound says.
    #[test]
    fn coupled_draws_agree_where_the_distributions_are_close() {
        let target = [2.0f32, 1.5, 0.2, -0.5, 1.0, 0.0];
        let draft = [1.8f32, 1.6, 0.1, -0.4, 0.7, 0.2];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 3,
        };
        let (dp, dq) = (distribution(&target, &p), distribution(&draft, &p));
        let at = |d: &[(u32, f32)], t: u32| d.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1 as f64);
        let tv: f64 = (0..6).map(|t| (at(&dp, t) - at(&dq, t)).abs()).sum::<f64>() / 2.0;
        let n = 40_000;
        let agree = (0..n)
            .filter(|&pos| sample(&target, &p, pos) == draw_coupled(&dq, p.seed, pos))
            .count() as f64
            / n as f64;
        assert!(
            agree >= (1.0 - tv) / (1.0 + tv) - 0.01,
            "{agree} vs tv {tv}"
        );
        let independent: f64 = (0..6).map(|t| at(&dp, t) * at(&dq, t)).sum();
        assert!(agree > independent + 0.2, "{agree} vs {independent}");
    }

    #[test]
    fn empirical_frequencies_follow_the_distribution() {
        let logits = [0.0f32, (2.0f32).ln(), (3.0f32).ln()]; // 1:2:3
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
        };
        let mut counts = [0usize; 3];
        for pos in 0..60_000 {
            counts[sample(&logits, &p, pos) as usize] += 1;
        }
        for (i, want) in [1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0].iter().enumerate() {
            let got = counts[i] as f64 / 60_000.0;
            assert!((got - want).abs() < 0.01, "token {i}: {got} vs {want}");
        }
    }
}
