//! `tandem bench rules`: how often each verify rule commits the draft's token when both models
//! sample, measured on the target's own sampled continuations (teacher-forced, no network).
//!
//! At each position of a continuation the target's and the draft's rows give `p` and `q` at the
//! request's temperature; the chance that the position's draft token is committed is, for
//! - **rejection sampling**: Σ min(p, q) over the top-k `q` the edge sends (exact: 1 − TV);
//! - **sample-and-match, coupled** (the project's rule: a Gumbel-max draw of each on the same
//!   noise keyed by (seed, position, token)): the share of `seeds` seeds on which the draft's draw
//!   is the target's (Monte Carlo, through the very functions the edge and the verifier call);
//! - **sample-and-match on one uniform** (the rule before: each model's inverse CDF, its tokens
//!   sorted by its own probability, at one shared uniform): the overlap of the two CDFs' intervals
//!   of each token (exact).
//!
//! Only the coupled rule commits, at every position, a token that depends on (prompt, parameters,
//! seed) alone: rejection sampling's depends on whether a draft was judged there.

use std::sync::Arc;

use anyhow::{bail, Result};
use serde::Serialize;
use tandem_engine::{Engine, EngineConfig, LlamaModel, SeqChunk, SeqId, Tokenizer, Wanted};
use tandem_spec::sampling::{distribution, sample, SamplingParams};
use tandem_spec::verify::draft_sample;

#[derive(Debug, Clone)]
pub struct RulesArgs {
    pub temperatures: Vec<f32>,
    pub prompts: Vec<String>,
    /// Tokens of the target's sampled continuation per prompt.
    pub tokens: usize,
    /// Seeds of the coupled rule's Monte Carlo estimate, per position.
    pub seeds: u64,
    /// The edge's top-k of `q` on the wire (rejection sampling).
    pub q_top_k: usize,
    pub threads: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct RulesRow {
    pub temperature: f32,
    pub positions: usize,
    /// Mean chance that a position's draft token is committed, per rule.
    pub rejection: f64,
    pub coupled: f64,
    pub one_uniform: f64,
    /// Mean total variation distance between p and the draft's whole q.
    pub tv: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RulesReport {
    pub target: String,
    pub draft: String,
    pub prompts: usize,
    pub tokens: usize,
    pub seeds: u64,
    pub q_top_k: usize,
    pub kernels: String,
    pub rows: Vec<RulesRow>,
}

/// The chance that inverse-CDF draws from `p` and `q` (each sorted its own way) on one shared
/// uniform give the same token: the overlap of each token's two intervals.
pub fn one_uniform_agreement(p: &[(u32, f32)], q: &[(u32, f32)]) -> f64 {
    let intervals = |d: &[(u32, f32)]| {
        let mut at = 0.0f64;
        d.iter()
            .map(|&(t, x)| {
                let lo = at;
                at += x as f64;
                (t, (lo, at))
            })
            .collect::<std::collections::HashMap<u32, (f64, f64)>>()
    };
    let qi = intervals(q);
    intervals(p)
        .iter()
        .filter_map(|(t, &(a, b))| {
            let &(c, d) = qi.get(t)?;
            Some((b.min(d) - a.max(c)).max(0.0))
        })
        .sum()
}

/// Σ min(p, q): rejection sampling's chance of accepting a draw from `q`.
pub fn overlap(p: &[(u32, f32)], q: &[(u32, f32)]) -> f64 {
    let pm: std::collections::HashMap<u32, f64> = p.iter().map(|&(t, x)| (t, x as f64)).collect();
    q.iter()
        .map(|&(t, x)| (x as f64).min(pm.get(&t).copied().unwrap_or(0.0)))
        .sum()
}

fn engine(model: &Arc<LlamaModel>, threads: usize) -> Result<Engine> {
    Ok(Engine::new(
        model.clone(),
        EngineConfig {
            threads: threads.max(1),
            ..EngineConfig::default()
        },
    )?)
}

/// The rows of `model` at every position of `want` after `prompt` (teacher-forced).
fn rows(e: &mut Engine, prompt: &[u32], want: &[u32]) -> Result<Vec<Vec<f32>>> {
    let mut tokens = prompt.to_vec();
    tokens.extend_from_slice(&want[..want.len() - 1]);
    let at: Vec<usize> = (prompt.len() - 1..tokens.len()).collect();
    let n = at.len();
    let l = e.forward(&[SeqChunk::new(SeqId(1), 0, tokens, Wanted::At(at))])?;
    let out = (0..n).map(|i| l.row(i).to_vec()).collect();
    e.free(SeqId(1));
    Ok(out)
}

pub fn run(
    a: &RulesArgs,
    (target, draft): (&Arc<LlamaModel>, &Arc<LlamaModel>),
    names: (&str, &str),
    tok: &Tokenizer,
    log: &mut dyn FnMut(&str),
) -> Result<RulesReport> {
    if a.prompts.is_empty() || a.tokens == 0 || a.seeds == 0 || a.temperatures.is_empty() {
        bail!("the study needs prompts, --tokens, --seeds and --temperatures of at least one");
    }
    if let Some(t) = a
        .temperatures
        .iter()
        .find(|&&t| !(t > 0.0 && t.is_finite()))
    {
        bail!("--temperatures: {t} is not a sampling temperature (> 0)");
    }
    let (mut te, mut de) = (engine(target, a.threads)?, engine(draft, a.threads)?);
    let mut out = Vec::new();
    for &temperature in &a.temperatures {
        log(&format!("T {temperature}: continuations and rows"));
        let (mut rej, mut cpl, mut one, mut tv, mut n) = (0.0, 0.0, 0.0, 0.0, 0usize);
        for (k, prompt) in a.prompts.iter().enumerate() {
            let params = SamplingParams {
                temperature,
                top_k: 0,
                top_p: 1.0,
                seed: 1000 + k as u64,
            };
            let ids = tok.encode_chat(prompt)?;
            let want =
                tandem_client::generate::generate(&mut te, tok, &ids, a.tokens, &params, |_| {})?
                    .output_ids;
            if want.is_empty() {
                continue;
            }
            let (pr, qr) = (rows(&mut te, &ids, &want)?, rows(&mut de, &ids, &want)?);
            for (i, (prow, qrow)) in pr.iter().zip(&qr).enumerate() {
                let pos = (ids.len() + i) as u64;
                let p = distribution(prow, &params);
                let q = distribution(qrow, &params);
                let (_, q_wire) = draft_sample(qrow, &params, pos, a.q_top_k);
                rej += overlap(&p, &q_wire);
                one += one_uniform_agreement(&p, &q);
                tv += 1.0 - overlap(&p, &q);
                let agree = (0..a.seeds)
                    .filter(|&s| {
                        let ps = SamplingParams { seed: s, ..params };
                        sample(prow, &ps, pos) == sample(qrow, &ps, pos)
                    })
                    .count();
                cpl += agree as f64 / a.seeds as f64;
                n += 1;
            }
        }
        let m = |x: f64| x / n.max(1) as f64;
        out.push(RulesRow {
            temperature,
            positions: n,
            rejection: m(rej),
            coupled: m(cpl),
            one_uniform: m(one),
            tv: m(tv),
        });
    }
    Ok(RulesReport {
        target: names.0.to_string(),
        draft: names.1.to_string(),
        prompts: a.prompts.len(),
        tokens: a.tokens,
        seeds: a.seeds,
        q_top_k: a.q_top_k,
        kernels: tandem_engine::kernels::Isa::selected().name().to_string(),
        rows: out,
    })
}

pub fn table(r: &RulesReport) -> String {
    let mut s = format!(
        "Verify rules when both sample: the chance a position's draft token is committed, on the target's own sampled continuations ({} prompts × {} tokens; target {}, draft {}; kernels {}). Rejection: Σ min(p, q) over the top-{} q on the wire. Coupled: Gumbel-max on shared noise, {} seeds per position. One uniform: each model's inverse CDF at one shared uniform (the rule before).\n\n| T | positions | rejection | sample-and-match, coupled | sample-and-match, one uniform | TV(p, q) |\n|---|---|---|---|---|---|\n",
        r.prompts, r.tokens, r.target, r.draft, r.kernels, r.q_top_k, r.seeds
    );
    for x in &r.rows {
        s += &format!(
            "| {} | {} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
            x.temperature, x.positions, x.rejection, x.coupled, x.one_uniform, x.tv
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_measures_are_one_for_equal_distributions_and_zero_for_disjoint() {
        let p = [(3u32, 0.5f32), (1, 0.3), (2, 0.2)];
        assert!((one_uniform_agreement(&p, &p) - 1.0).abs() < 1e-6);
        assert!((overlap(&p, &p) - 1.0).abs() < 1e-6);
        let q = [(7u32, 1.0f32)];
        assert_eq!(one_uniform_agreement(&p, &q), 0.0);
        assert_eq!(overlap(&p, &q), 0.0);
        // Same probabilities, another order: rejection accepts everything, one uniform only
        // where the intervals line up.
        let r = [(1u32, 0.3f32), (3, 0.5), (2, 0.2)];
        assert!((overlap(&p, &r) - 1.0).abs() < 1e-6);
        let one = one_uniform_agreement(&p, &r);
        assert!((one - (0.2 + 0.2)).abs() < 1e-6, "{one}");
    }
}
