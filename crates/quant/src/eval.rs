//! How good a draft is, measured on text: perplexity, and the greedy acceptance of its tokens
//! against the target's own continuation (teacher-forced: the draft is fed the target's prefix at
//! every position), with the tokens per verify it implies.

use std::sync::Arc;

use tandem_engine::{CpuSet, Engine, EngineConfig, LlamaModel, SeqChunk, SeqId, Wanted};

use crate::{QuantError, Result};

fn bad(message: &str) -> QuantError {
    QuantError::InvalidSetting {
        field: "eval",
        message: message.to_string(),
    }
}

/// An engine for `model` on `cpus` (a thread each, one when none are named) with a KV cache of
/// `kv_budget_bytes`: what measuring and calibrating run on.
pub(crate) fn engine(
    model: &Arc<LlamaModel>,
    cpus: CpuSet,
    kv_budget_bytes: usize,
) -> Result<Engine> {
    Ok(Engine::new(
        model.clone(),
        EngineConfig {
            threads: cpus.len().max(1),
            cpus,
            kv_budget_bytes,
            ..EngineConfig::default()
        },
    )?)
}

/// Perplexity of `model` on the first tokens of `tokens`, scored in windows of `window` tokens
/// (each window starts a fresh context; its first token is not scored).
pub fn perplexity(
    model: &Arc<LlamaModel>,
    tokens: &[u32],
    window: usize,
    cpus: CpuSet,
) -> Result<f64> {
    if window < 2 {
        return Err(bad("the perplexity window must hold at least 2 tokens"));
    }
    let mut e = crate::eval::engine(model, cpus, 128 << 20)?;
    let (mut nll, mut n) = (0f64, 0usize);
    for (w, win) in tokens.chunks(window).enumerate() {
        if win.len() < 2 {
            continue;
        }
        let seq = SeqId(w as u64);
        let mut pos = 0;
        for chunk in win[..win.len() - 1].chunks(64) {
            let l = e.forward(&[SeqChunk::new(seq, pos, chunk.to_vec(), Wanted::All)])?;
            for i in 0..chunk.len() {
                let row = l.row(i);
                let max = row.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x)) as f64;
                let lse = max
                    + row
                        .iter()
                        .map(|&x| (x as f64 - max).exp())
                        .sum::<f64>()
                        .ln();
                nll += lse - row[win[pos + i + 1] as usize] as f64;
                n += 1;
            }
            pos += chunk.len();
        }
        e.free(seq);
    }
    if n == 0 {
        return Err(bad(
            "no token to score: the corpus is shorter than 2 tokens",
        ));
    }
    Ok((nll / n as f64).exp())
}

/// E[A] at γ from teacher-forced hits: for a block starting at each position with γ positions
/// after it, the draft's tokens up to the first miss (at most γ) plus the target's own. (A block
/// starting nearer the end would be cut short by the end of the text, not by a miss.)
pub fn mean_accepted(hits: &[Vec<bool>], gamma: usize) -> f64 {
    let mut total = 0.0;
    let mut n = 0usize;
    for h in hits {
        for i in 0..(h.len() + 1).saturating_sub(gamma) {
            let run = h[i..].iter().take(gamma).take_while(|&&x| x).count();
            total += (run + 1) as f64;
            n += 1;
        }
    }
    if n == 0 {
        0.0
    } else {
        total / n as f64
    }
}

/// Greedy acceptance of `draft` against the target's continuation `want` of `prompt`: the share
/// of positions where the draft's argmax, fed the target's prefix, is the target's token.
pub fn teacher_forced_alpha(draft: &Arc<LlamaModel>, prompt: &[u32], want: &[u32]) -> Result<f64> {
    let hits = teacher_forced_hits(draft, prompt, want)?;
    Ok(hits.iter().filter(|&&h| h).count() as f64 / hits.len().max(1) as f64)
}

/// For each token of the target's continuation `want` of `prompt`: whether the draft's argmax, fed
/// the target's prefix, is that token.
pub fn teacher_forced_hits(
    draft: &Arc<LlamaModel>,
    prompt: &[u32],
    want: &[u32],
) -> Result<Vec<bool>> {
    Ok(teacher_forced_guesses(draft, prompt, want)?
        .iter()
        .map(|g| g.first)
        .collect())
}

/// What the draft guessed at one position of the target's continuation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Guess {
    /// Its argmax is the target's token.
    pub first: bool,
    /// Its second choice is.
    pub second: bool,
    /// Its probability of its argmax (softmax at temperature 1): its confidence.
    pub p_top: f32,
}

/// [`teacher_forced_hits`] with the draft's second choice and confidence at each position.
pub fn teacher_forced_guesses(
    draft: &Arc<LlamaModel>,
    prompt: &[u32],
    want: &[u32],
) -> Result<Vec<Guess>> {
    if want.is_empty() {
        return Ok(Vec::new());
    }
    let mut e = engine(draft, CpuSet::default(), 64 << 20)?;
    let mut tokens = prompt.to_vec();
    tokens.extend_from_slice(&want[..want.len() - 1]);
    let at: Vec<usize> = (prompt.len() - 1..tokens.len()).collect();
    let l = e.forward(&[SeqChunk::new(SeqId(1), 0, tokens, Wanted::At(at))])?;
    let greedy = tandem_spec::sampling::SamplingParams::default();
    Ok(want
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            let row = l.row(i);
            let top = tandem_spec::sampling::argmax(row);
            let (alt, p_top) =
                tandem_spec::sampling::second_choice(row, &greedy, top).unwrap_or((top, 1.0));
            Guess {
                first: top == w,
                second: alt == w && top != w,
                p_top,
            }
        })
        .collect())
}

/// The confidence buckets a draft's guesses are told by: `[lower, upper)` of its top-1 probability.
pub use tandem_spec::tree::CONFIDENCE_BUCKETS;

/// Per confidence bucket: positions, the share the draft's argmax got right, and the share its
/// top two did.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Bucket {
    pub lower: f32,
    pub upper: f32,
    pub positions: usize,
    pub first: f64,
    pub first_or_second: f64,
}

/// [`Bucket`]s of `guesses`.
pub fn by_confidence(guesses: &[Guess]) -> Vec<Bucket> {
    CONFIDENCE_BUCKETS
        .iter()
        .map(|&(lower, upper)| {
            let g: Vec<&Guess> = guesses
                .iter()
                .filter(|g| g.p_top >= lower && g.p_top < upper)
                .collect();
            let n = g.len().max(1) as f64;
            Bucket {
                lower,
                upper: upper.min(1.0),
                positions: g.len(),
                first: g.iter().filter(|g| g.first).count() as f64 / n,
                first_or_second: g.iter().filter(|g| g.first || g.second).count() as f64 / n,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_fall_into_their_confidence_buckets() {
        let g = |first, second, p_top| Guess {
            first,
            second,
            p_top,
        };
        let b = by_confidence(&[
            g(true, false, 0.95),
            g(false, true, 0.2),
            g(false, false, 0.25),
            g(true, false, 1.0),
        ]);
        assert_eq!(
            (b[0].positions, b[0].first, b[0].first_or_second),
            (2, 0.0, 0.5)
        );
        assert_eq!((b[4].positions, b[4].first), (2, 1.0));
        assert_eq!(b[2].positions, 0);
    }

    #[test]
    fn mean_accepted_counts_runs_up_to_gamma_plus_the_targets_token() {
        // Blocks of γ 2 start at 0..=3: runs 2 (capped), 1, 0, 2 -> A = 3, 2, 1, 3. The block at
        // 4 would run into the end of the text and is not counted.
        let h = vec![vec![true, true, false, true, true]];
        assert!((mean_accepted(&h, 2) - 9.0 / 4.0).abs() < 1e-12);
        assert_eq!(mean_accepted(&[vec![false; 4]], 4), 1.0);
        assert_eq!(mean_accepted(&[vec![true; 3]], 4), 0.0);
        assert_eq!(mean_accepted(&[], 4), 0.0);
    }
}
