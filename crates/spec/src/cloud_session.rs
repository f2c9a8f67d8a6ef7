//! The cloud's per-session verification bookkeeping, pure: which tokens to feed the target for a
//! block, and the verdict from the target's logits.
//!
//! The cloud tracks the same committed sequence as the edge. Tokens the cloud produced itself (a
//! correction) are committed but not yet fed through the target: they go at the front of the
//! session's next forward. After a fully accepted block the cloud keeps the **pending prediction**,
//! the target's token for the next position; the next block's first token is checked against it
//! before any forward, and on a mismatch the verdict goes out at once with no target compute.

use serde::{Deserialize, Serialize};

use crate::pipeline::{Block, BlockId, Decoded, Verdict};
use crate::sampling::SamplingParams;
use crate::verify::{judge, target_token, VerifyRule};
use crate::SpecError;

/// What the target must compute for a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Feed {
    /// Position of the first token fed (the session's KV length).
    pub start_pos: usize,
    /// Unfed committed tokens, then the block's drafted tokens.
    pub tokens: Vec<u32>,
    /// Indices into `tokens` whose logits the verdict needs, in order.
    pub logits_at: Vec<usize>,
}

/// What to do with an incoming block.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockAction {
    /// An older epoch's block: drop it, answer nothing.
    Stale,
    /// Decided without the target (the first token contradicts the pending prediction).
    Verdict(Verdict),
    /// Run this forward, then call [`CloudSession::finish`].
    Forward(Feed),
}

/// The next token of a session the verifier decodes itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeAction {
    /// Known without a forward (the pending prediction): committed now.
    Ready(Decoded),
    /// Feed these (the last committed token) and call [`CloudSession::finish_decode`].
    Forward(Feed),
}

/// The verdict of a block plus how far the target's KV must be cut back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub verdict: Verdict,
    /// Truncate the session's target KV to this many tokens (drops rejected draft tokens).
    pub kv_len: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CloudSession {
    pub rule: VerifyRule,
    pub params: SamplingParams,
    /// Committed tokens, prompt included.
    committed_len: usize,
    /// Committed tokens not yet fed through the target (at most one: a correction).
    unfed: Vec<u32>,
    /// The target's token for position `committed_len`, when known.
    pending: Option<u32>,
    epoch: u64,
    last_block: Option<BlockId>,
    /// Tokens in the session's target KV.
    kv_len: usize,
    max_len: usize,
    /// Counters: target positions verified, blocks decided without compute.
    pub verified_positions: u64,
    pub early_rejections: u64,
}

impl CloudSession {
    /// A session whose prompt (`prompt_len` tokens) is fed; `first` is the target's token after it
    /// (from the prefill's last logits). `max_len` bounds positions (the context limit).
    pub fn new(
        rule: VerifyRule,
        params: SamplingParams,
        prompt_len: usize,
        first: u32,
        max_len: usize,
    ) -> Self {
        Self {
            rule: rule.effective(&params),
            params,
            committed_len: prompt_len,
            unfed: Vec::new(),
            pending: Some(first),
            epoch: 0,
            last_block: None,
            kv_len: prompt_len,
            max_len,
            verified_positions: 0,
            early_rejections: 0,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    pub fn committed_len(&self) -> usize {
        self.committed_len
    }
    pub fn kv_len(&self) -> usize {
        self.kv_len
    }
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }

    /// Decode the next token itself (the verifier took the session over): the pending prediction
    /// when there is one, else a forward over the unfed committed token. Each decoded token moves
    /// the session to the next epoch, so the edge's blocks in flight go stale.
    pub fn decode(&mut self) -> Result<DecodeAction, SpecError> {
        if self.committed_len >= self.max_len {
            return Err(SpecError::Protocol(format!(
                "the session reached the context limit {}",
                self.max_len
            )));
        }
        if let Some(p) = self.pending.take() {
            let d = Decoded {
                epoch: self.epoch,
                pos: self.committed_len,
                token: p,
                resume: None,
            };
            self.unfed.push(p);
            self.committed_len += 1;
            self.epoch += 1;
            return Ok(DecodeAction::Ready(d));
        }
        if self.unfed.is_empty() {
            return Err(SpecError::Protocol(
                "nothing to decode from: no committed token waits to be fed".into(),
            ));
        }
        Ok(DecodeAction::Forward(Feed {
            start_pos: self.kv_len,
            tokens: self.unfed.clone(),
            logits_at: vec![self.unfed.len() - 1],
        }))
    }

    /// The target's logits after the plan of [`decode`](Self::decode): the next token, committed.
    pub fn finish_decode(&mut self, row: &[f32]) -> Decoded {
        self.kv_len += self.unfed.len();
        let pos = self.committed_len;
        let token = target_token(row, &self.params, pos as u64);
        let d = Decoded {
            epoch: self.epoch,
            pos,
            token,
            resume: None,
        };
        self.unfed = vec![token];
        self.committed_len += 1;
        self.epoch += 1;
        d
    }

    /// Judge an incoming block: stale, decided at once, or a forward to run.
    pub fn on_block(&mut self, b: &Block) -> Result<BlockAction, SpecError> {
        if b.epoch < self.epoch {
            return Ok(BlockAction::Stale);
        }
        if b.epoch > self.epoch {
            return Err(SpecError::InvalidBlock(format!(
                "block {} has epoch {}, the session is at epoch {}",
                b.index, b.epoch, self.epoch
            )));
        }
        if self.last_block.is_some_and(|l| b.index <= l) {
            return Err(SpecError::InvalidBlock(format!(
                "block index {} does not follow {}",
                b.index,
                self.last_block.unwrap_or_default()
            )));
        }
        if b.tokens.is_empty() {
            return Err(SpecError::InvalidBlock(format!(
                "block {} has no tokens",
                b.index
            )));
        }
        if self.rule.needs_q() && b.q.len() != b.tokens.len() {
            return Err(SpecError::InvalidBlock(format!(
                "block {}: rejection sampling needs one draft distribution per token ({} for {} tokens)",
                b.index,
                b.q.len(),
                b.tokens.len()
            )));
        }
        let expected = self.committed_len;
        if b.start_pos == expected + 1 && self.pending.is_some() {
            // The edge committed the bonus and drafted after it.
            let p = self.pending.take().expect("invariant: checked");
            self.unfed.push(p);
            self.committed_len += 1;
        } else if b.start_pos != expected {
            return Err(SpecError::InvalidBlock(format!(
                "block {} starts at position {}, expected {}",
                b.index, b.start_pos, expected
            )));
        }
        if b.start_pos + b.tokens.len() > self.max_len {
            return Err(SpecError::InvalidBlock(format!(
                "block {} reaches position {}, beyond the context limit {}",
                b.index,
                b.start_pos + b.tokens.len(),
                self.max_len
            )));
        }
        self.last_block = Some(b.index);
        if let Some(p) = self.pending {
            if b.tokens[0] != p {
                self.early_rejections += 1;
                let v = Verdict {
                    epoch: self.epoch,
                    block: b.index,
                    accepted: 0,
                    token: p,
                    verify_us: 0,
                    grant: None,
                };
                self.pending = None;
                self.unfed.push(p);
                self.committed_len += 1;
                self.epoch += 1;
                return Ok(BlockAction::Verdict(v));
            }
        }
        let k = self.unfed.len();
        let mut tokens = self.unfed.clone();
        tokens.extend_from_slice(&b.tokens);
        // Row for position start_pos (unless pending), then one per drafted token (the last one is
        // the bonus position).
        let first = if self.pending.is_some() { k } else { k - 1 };
        let logits_at = (first..k + b.tokens.len()).collect();
        Ok(BlockAction::Forward(Feed {
            start_pos: self.kv_len,
            tokens,
            logits_at,
        }))
    }

    /// Fold the target's logits for `b` (rows in the order of the plan's `logits_at`) into the
    /// verdict, and move the session on.
    pub fn finish(&mut self, b: &Block, rows: &[&[f32]]) -> Result<Finished, SpecError> {
        let n = b.tokens.len();
        let epoch = self.epoch;
        let has_pending = self.pending.is_some();
        let want = if has_pending { n } else { n + 1 };
        if rows.len() != want {
            return Err(SpecError::Protocol(format!(
                "{} logits rows for a plan of {want}",
                rows.len()
            )));
        }
        let start = b.start_pos;
        // Row for position start + i.
        let row = |i: usize| if has_pending { rows[i - 1] } else { rows[i] };
        let mut accepted = 0;
        let mut token = None;
        for i in 0..n {
            let pos = (start + i) as u64;
            let outcome = if i == 0 && has_pending {
                Ok(()) // checked against the pending prediction in on_block
            } else {
                judge(
                    self.rule,
                    row(i),
                    &self.params,
                    pos,
                    b.tokens[i],
                    b.q.get(i),
                )
            };
            match outcome {
                Ok(()) => accepted += 1,
                Err(c) => {
                    token = Some(c);
                    break;
                }
            }
        }
        self.verified_positions += n as u64;
        self.unfed.clear();
        let kv_len = start + accepted;
        self.kv_len = kv_len;
        self.committed_len = kv_len;
        let token = match token {
            Some(c) => {
                // Rejection: the correction is committed and fed with the next block.
                self.unfed.push(c);
                self.committed_len += 1;
                self.pending = None;
                self.epoch += 1;
                c
            }
            None => {
                let bonus = target_token(row(n), &self.params, (start + n) as u64);
                self.pending = Some(bonus);
                bonus
            }
        };
        Ok(Finished {
            verdict: Verdict {
                epoch,
                block: b.index,
                accepted,
                token,
                verify_us: 0,
                grant: None,
            },
            kv_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session over a 3-token prompt whose prefill predicted 7.
    fn session() -> CloudSession {
        CloudSession::new(VerifyRule::Greedy, SamplingParams::default(), 3, 7, 64)
    }

    fn block(epoch: u64, index: u64, start_pos: usize, tokens: &[u32]) -> Block {
        Block {
            epoch,
            index: BlockId(index),
            start_pos,
            tokens: tokens.to_vec(),
            q: vec![],
        }
    }

    /// One-hot logits rows choosing `tokens`.
    fn rows(tokens: &[u32]) -> Vec<Vec<f32>> {
        tokens
            .iter()
            .map(|&t| {
                let mut r = vec![0f32; 16];
                r[t as usize] = 1.0;
                r
            })
            .collect()
    }

    #[test]
    fn a_first_token_against_the_pending_prediction_is_answered_without_a_forward() {
        let mut s = session();
        let a = s.on_block(&block(0, 0, 3, &[5, 6])).unwrap();
        let BlockAction::Verdict(v) = a else {
            panic!("{a:?}")
        };
        assert_eq!((v.accepted, v.token, v.verify_us), (0, 7, 0));
        assert_eq!(
            (s.epoch(), s.committed_len()),
            (1, 4),
            "the correction is committed"
        );
        // What the edge sent before it saw the rejection is stale; a block of the new epoch
        // after the correction feeds the correction first.
        assert_eq!(
            s.on_block(&block(0, 1, 5, &[1])).unwrap(),
            BlockAction::Stale
        );
        let BlockAction::Forward(f) = s.on_block(&block(1, 2, 4, &[8, 9])).unwrap() else {
            panic!()
        };
        assert_eq!((f.start_pos, f.tokens.clone()), (3, vec![7, 8, 9]));
        assert_eq!(f.logits_at, vec![0, 1, 2]);
    }

    #[test]
    fn a_block_after_the_bonus_commits_it_and_the_verdict_judges_each_token() {
        let mut s = session();
        // The edge committed the first token (7) and drafted after it.
        let b = block(0, 0, 4, &[8, 9, 10]);
        let BlockAction::Forward(f) = s.on_block(&b).unwrap() else {
            panic!()
        };
        assert_eq!(f.tokens, vec![7, 8, 9, 10], "the bonus fed in front");
        // The target agrees with 8 and 9, then wants 4 where the draft said 10.
        let r = rows(&[8, 9, 4, 12]);
        let rr: Vec<&[f32]> = f.logits_at.iter().map(|&i| r[i].as_slice()).collect();
        let done = s.finish(&b, &rr).unwrap();
        assert_eq!((done.verdict.accepted, done.verdict.token), (2, 4));
        assert_eq!(done.kv_len, 6, "the rejected token's KV is cut");
        assert_eq!((s.committed_len(), s.epoch()), (7, 1));
    }

    #[test]
    fn bad_blocks_are_refused_by_name() {
        let mut s = session();
        let e = s.on_block(&block(2, 0, 3, &[7])).unwrap_err().to_string();
        assert!(e.contains("epoch 2") && e.contains("epoch 0"), "{e}");
        let e = s.on_block(&block(0, 0, 9, &[7])).unwrap_err().to_string();
        assert!(e.contains("starts at position 9, expected 3"), "{e}");
        let e = s.on_block(&block(0, 0, 3, &[])).unwrap_err().to_string();
        assert!(e.contains("no tokens"), "{e}");
        let mut short = CloudSession::new(VerifyRule::Greedy, SamplingParams::default(), 3, 7, 5);
        let e = short
            .on_block(&block(0, 0, 3, &[7, 1, 2]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("beyond the context limit 5"), "{e}");
        assert!(matches!(
            s.on_block(&block(0, 4, 3, &[7])).unwrap(),
            BlockAction::Forward(_)
        ));
        let e = s.on_block(&block(0, 4, 3, &[7])).unwrap_err().to_string();
        assert!(e.contains("index 4 does not follow 4"), "{e}");
    }
}
