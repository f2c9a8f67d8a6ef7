//! The simulated target: a cost model for time, and a fixed pseudo-random function for its
//! greedy output, which may copy spans of the session's own text ([`Texts`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tandem_engine::{EngineError, Logits, SeqChunk};
use tandem_spec::capacity::ForwardCost;
use tandem_spec::sampling::uniform;
use tandem_verifier::Target;

/// Vocabulary of the simulated target (token 0 is never produced).
pub const VOCAB: usize = 256;
/// KV token slots per block.
const BLOCK_SIZE: usize = 16;

/// The target's greedy token at `pos` of session `seq`, after `prev` at `pos − 1`: a function of
/// what it was fed, so a verifier that fed a wrong token would get (and commit) a wrong one.
pub fn target_token(seed: u64, seq: u64, pos: usize, prev: u32) -> u32 {
    let key = (pos as u64) << 16 | prev as u64;
    1 + (uniform(seed ^ 0x7a6d, seq, key) * (VOCAB - 1) as f64) as u32 % (VOCAB as u32 - 1)
}

/// The target's texts where they copy themselves: per session, its greedy output along the
/// committed path (prompt first), in which a share of the positions lie in spans copied from
/// earlier in the text (what a code edit, a correction or an answer quoting its input does). The
/// target's token at `pos` after `prev` is the text's where `prev` is the text's token before it,
/// else [`target_token`]'s: still a function of what it was fed, so a wrong feed gets a wrong
/// token. A session without a text is [`target_token`]'s alone; the replicas and the edges share
/// one set.
#[derive(Debug, Clone, Default)]
pub struct Texts {
    texts: Arc<Mutex<HashMap<u64, Arc<Vec<u32>>>>>,
    seed: u64,
}

/// How a session's text copies itself: `share` of its positions after the prompt lie in copied
/// spans, `span` tokens long on average, each copied from a uniformly drawn earlier position.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopySpans {
    pub share: f64,
    pub span: f64,
}

impl Texts {
    pub fn new(seed: u64) -> Self {
        Self {
            texts: Default::default(),
            seed,
        }
    }

    /// Write session `seq`'s text: `prompt`, then `len` tokens of output copying as `spans`
    /// says (nothing to write when it does not copy: the target's own function is its text).
    /// Returns the share of the output that lies in copied spans.
    pub fn write(&self, seq: u64, prompt: &[u32], len: usize, spans: CopySpans) -> f64 {
        if spans.share <= 0.0 || prompt.is_empty() {
            return 0.0;
        }
        let seed = self.seed;
        let u = |pos: usize, k: u64| uniform(seed ^ 0xc0b1, seq, (pos as u64) << 4 | k);
        // A span starts at a fresh position with probability q: its span tokens per fresh one
        // give the share, q·L / (q·L + 1 − q) = share.
        let (share, l) = (spans.share.min(0.99), spans.span.max(1.0));
        let q = share / (l * (1.0 - share) + share);
        let mut text = prompt.to_vec();
        let mut copied = 0;
        let end = prompt.len() + len;
        while text.len() < end {
            let pos = text.len();
            if u(pos, 0) < q {
                // Exponentially long, at least one token, from an earlier position.
                let n = ((-u(pos, 1).max(1e-12).ln() * l).round() as usize).max(1);
                let from = (u(pos, 2) * pos as f64) as usize;
                for i in 0..n.min(end - pos) {
                    text.push(text[from + i]);
                    copied += 1;
                }
            } else {
                text.push(target_token(seed, seq, pos, text[pos - 1]));
            }
        }
        self.texts
            .lock()
            .expect("invariant: no panic while held")
            .insert(seq, Arc::new(text));
        copied as f64 / len.max(1) as f64
    }

    /// The target's greedy token at `pos` of session `seq` after `prev` at `pos − 1`.
    pub fn token(&self, seq: u64, pos: usize, prev: u32) -> u32 {
        let texts = self.texts.lock().expect("invariant: no panic while held");
        match texts.get(&seq) {
            Some(t) if pos >= 1 && pos < t.len() && t[pos - 1] == prev => t[pos],
            _ => target_token(self.seed, seq, pos, prev),
        }
    }
}

/// The target as a cost model: a forward of n tokens takes `cost.ms(n)`; its logits rows are
/// one-hot at the target's token for the next position (its [`Texts`]').
pub struct SimTarget {
    pub cost: ForwardCost,
    pub num_blocks: usize,
    pub texts: Texts,
}

impl SimTarget {
    /// A target whose output is [`target_token`]'s for `seed`, copying where `texts` (of the
    /// same seed) says.
    pub fn new(cost: ForwardCost, num_blocks: usize, texts: Texts) -> Self {
        Self {
            cost,
            num_blocks,
            texts,
        }
    }
}

impl Target for SimTarget {
    fn vocab(&self) -> usize {
        VOCAB
    }

    fn context_len(&self) -> usize {
        1 << 20
    }

    fn kv_geometry(&self) -> (usize, usize) {
        (BLOCK_SIZE, self.num_blocks)
    }

    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        _tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32) {
        let texts = &self.texts;
        let logits = Logits::one_hot(batch, VOCAB, |seq, pos, t| texts.token(seq.0, pos + 1, t));
        let t0: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let us = (self.cost.ms(t0 as f64) * 1e3).round() as u32;
        (Ok(logits), us)
    }
    fn keep_path(&mut self, _: &[u32], _: usize, _: &[usize]) -> Result<(), EngineError> {
        Ok(()) // one-hot logits: no KV to move
    }
}
