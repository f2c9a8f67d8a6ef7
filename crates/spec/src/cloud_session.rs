//! The cloud's per-session bookkeeping, pure: what to feed the target next (a block to verify, or
//! the session's next token to decode), and what the target's logits commit.
//!
//! The verifier never idles a session: in every forward in which it has no usable block, it
//! decodes the session's next token itself and streams it ([`Decoded`]). Every token the cloud
//! commits is told to the edge once, in position order: the first token at Open, then each
//! verdict's accepted run and its correction or bonus, and each decoded token.
//!
//! Blocks therefore land behind the verifier. A block is **rebased** when it is planned, not when
//! it arrives (a decode may run in between): its tokens at positions already committed are matched
//! against them for free, and only the rest is verified. A block that contradicts a committed
//! token is useless; the session moves to the next epoch and the block is dropped unanswered —
//! the edge sees the same contradiction in the commits it has already been sent, and moves to the
//! same epoch. A block whose every token is committed (and agrees) is dropped unanswered too: the
//! edge sees it covered. Only a block that reaches past the committed tokens is verified and
//! answered with a [`Verdict`]; a rejection in it moves the epoch on both sides.
//! A token tree's diversion into a side path (a lane of the edge's draft tree) moves nothing: the
//! blocks behind carry the lane on (see [`crate::tree`]).
//!
//! After every forward of the session, exactly one committed token is not yet in the target's
//! KV (the last one): it is fed first in the session's next forward, whose first logits row then
//! gives the target's token at the committed length.

use serde::{Deserialize, Serialize};

/// Flow control: the verifier commits at most this many tokens past the last one the edge has
/// acknowledged, so a session whose edge stops reading is not decoded further.
pub const FLOW_WINDOW: usize = 64;
/// The edge acks every this many committed tokens, well inside [`FLOW_WINDOW`].
pub const ACK_EVERY: usize = 16;

use crate::pipeline::{Block, BlockId, Decoded, Verdict};
use crate::sampling::SamplingParams;
use crate::tree::{Node, Step};
use crate::verify::{judge, judge_guesses, target_token, Guess, VerifyRule};
use crate::SpecError;

/// What the target must compute for a verify or a decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Feed {
    /// Position of the first token fed (the session's KV length).
    pub start_pos: usize,
    /// The last committed token, then the block's drafted tokens past the committed ones (none
    /// for a decode).
    pub tokens: Vec<u32>,
    /// Indices into `tokens` whose logits are needed, in order.
    pub logits_at: Vec<usize>,
    /// A token tree's feed: `parents[i]` is the index of token `i`'s parent in `tokens` (token 0,
    /// the last committed one, is linear; its entry is 0). Empty for a linear feed.
    pub parents: Vec<usize>,
    /// The block's node of each token of a tree feed (token 0: the node the committed tokens
    /// reached). Empty for a linear feed.
    pub nodes: Vec<Node>,
}

impl Feed {
    pub fn is_tree(&self) -> bool {
        !self.parents.is_empty()
    }
}

/// What to do with the oldest block a session has queued, at the time its forward is planned.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockAction {
    /// An older epoch's block: drop it, answer nothing.
    Stale,
    /// Every token of it is committed and agrees: drop it, answer nothing.
    Covered,
    /// Its token at `pos` contradicts the committed one: the session moved to the next epoch;
    /// drop it, answer nothing (the edge has the committed token).
    Contradicted { pos: usize },
    /// Its tokens past the committed ones need the target: run this forward, then
    /// [`CloudSession::finish`].
    Forward(Feed),
}

/// The verdict of a block plus how far the target's KV must be cut back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub verdict: Verdict,
    /// Truncate the session's target KV to this many tokens (drops rejected draft tokens).
    pub kv_len: usize,
    /// Drafted tokens the target judged in the forward, and how many of them it accepted.
    pub judged: usize,
    pub accepted: usize,
    /// A tree feed: the indices into its tokens of the accepted path (after token 0), whose K
    /// and V move down to the slots after the feed's first (`Engine::keep_path_paged`). Empty
    /// otherwise.
    pub keep: Vec<usize>,
    /// The forward fed only the first positions of a longer block (see
    /// [`CloudSession::plan_block_within`]) and the target followed the block through them and
    /// on to its next token (of a tree: one of the children below the last node fed): they are
    /// committed, the block is not answered yet (the verdict is not
    /// for the edge), and it goes on in a later forward. The `accepted + 1` tokens committed (at
    /// positions from the feed's `start_pos + 1`) reach the edge as tokens the verifier decoded.
    pub partial: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CloudSession {
    pub rule: VerifyRule,
    pub params: SamplingParams,
    prompt_len: usize,
    /// The committed sequence, prompt included. Its last token is not yet in the target's KV.
    committed: Vec<u32>,
    epoch: u64,
    last_block: Option<BlockId>,
    /// Tokens in the session's target KV: `committed.len() - 1`.
    kv_len: usize,
    max_len: usize,
    /// Committed tokens the edge has said it received (flow control).
    acked: usize,
    /// Target positions verified (drafted tokens judged in a forward).
    pub verified_positions: u64,
}

impl CloudSession {
    /// A session whose prompt is fed; `first` is the target's token after it (from the prefill's
    /// last logits), committed now and sent at Open. `max_len` bounds positions (the context
    /// limit).
    pub fn new(
        rule: VerifyRule,
        params: SamplingParams,
        prompt: &[u32],
        first: u32,
        max_len: usize,
    ) -> Self {
        let mut committed = prompt.to_vec();
        committed.push(first);
        let acked = committed.len();
        Self {
            acked,
            rule: rule.effective(&params),
            params,
            prompt_len: prompt.len(),
            committed,
            epoch: 0,
            last_block: None,
            kv_len: prompt.len(),
            max_len,
            verified_positions: 0,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// Committed tokens, prompt included.
    pub fn committed_len(&self) -> usize {
        self.committed.len()
    }
    /// The committed sequence, prompt included.
    pub fn committed(&self) -> &[u32] {
        &self.committed
    }
    /// The committed output (prompt excluded).
    pub fn output(&self) -> &[u32] {
        &self.committed[self.prompt_len..]
    }
    pub fn kv_len(&self) -> usize {
        self.kv_len
    }

    /// The edge has received the first `committed` tokens. Acks never go back; one beyond what
    /// was committed is refused by name.
    pub fn ack(&mut self, committed: usize) -> Result<(), SpecError> {
        if committed > self.committed.len() {
            return Err(SpecError::Protocol(format!(
                "ack.committed: {committed} tokens acknowledged, only {} committed",
                self.committed.len()
            )));
        }
        self.acked = self.acked.max(committed);
        Ok(())
    }

    /// Whether the verifier may commit more now: fewer than [`FLOW_WINDOW`] tokens are unacked.
    pub fn window_open(&self) -> bool {
        self.committed.len() < self.acked + FLOW_WINDOW
    }

    /// Check a block as it arrives, before it is queued: well formed. Its epoch and position are
    /// checked when it is planned (the blocks queued before it may still move the epoch).
    pub fn check(&self, b: &Block) -> Result<(), SpecError> {
        if b.tokens.is_empty() {
            return Err(SpecError::InvalidBlock(format!(
                "block {} has no tokens",
                b.index
            )));
        }
        if b.is_tree() {
            b.check_tree()
                .map_err(|e| SpecError::InvalidBlock(format!("block {}: {e}", b.index)))?;
        }
        if self.rule.needs_q() && b.q.len() != b.tokens.len() {
            return Err(SpecError::InvalidBlock(format!(
                "block {}: rejection sampling needs one draft distribution per token ({} for {} tokens)",
                b.index,
                b.q.len(),
                b.tokens.len()
            )));
        }
        // A block may start at the first token's position: an edge drafts from its Open on, and
        // its guess of the first token is judged against the verifier's like any committed one.
        if b.start_pos < self.prompt_len {
            return Err(SpecError::InvalidBlock(format!(
                "block {} starts at position {}, inside the prompt (the first draftable position is {}, the first token's)",
                b.index, b.start_pos, self.prompt_len
            )));
        }
        if b.start_pos + b.reach() > self.max_len {
            return Err(SpecError::InvalidBlock(format!(
                "block {} reaches position {}, beyond the context limit {}",
                b.index,
                b.start_pos + b.reach(),
                self.max_len
            )));
        }
        // Every node of a tree takes a KV slot of its own (siblings share a position, not a
        // slot): the forward that verifies it ends at most this far.
        if b.is_tree() && b.start_pos + b.tokens.len() + b.side.len() > self.max_len {
            return Err(SpecError::InvalidBlock(format!(
                "block {}: its {} nodes from position {} need KV slots beyond the context limit {}",
                b.index,
                b.tokens.len() + b.side.len(),
                b.start_pos,
                self.max_len
            )));
        }
        Ok(())
    }

    /// Record that `b` (checked) is queued: block indices must increase.
    pub fn accept_index(&mut self, b: &Block) -> Result<(), SpecError> {
        if self.last_block.is_some_and(|l| b.index <= l) {
            return Err(SpecError::InvalidBlock(format!(
                "block index {} does not follow {}",
                b.index,
                self.last_block.unwrap_or_default()
            )));
        }
        self.last_block = Some(b.index);
        Ok(())
    }

    /// Plan the oldest queued block now: stale, covered, contradicted (the epoch moves on), or
    /// the forward that verifies its tokens past the committed ones. A current block that starts
    /// beyond the committed tokens skipped some: refused by name.
    pub fn plan_block(&mut self, b: &Block) -> Result<BlockAction, SpecError> {
        self.plan_block_within(b, usize::MAX)
    }

    /// [`plan_block`](Self::plan_block), feeding at most `most` positions of a block past the
    /// committed ones (the γ granted now, when the block was drafted under a larger grant; at
    /// least one): a linear block's next `most` tokens, a token tree's nodes at most `most`
    /// below where the committed tokens reached. A block trimmed, not refused: its verdict comes
    /// once it is judged to its end or rejected, over as many forwards as it takes
    /// ([`Finished::partial`]). The block itself stays whole, so that every plan walks it from
    /// its start, as the edge does, and the verdict names its path in the block's own terms.
    pub fn plan_block_within(&mut self, b: &Block, most: usize) -> Result<BlockAction, SpecError> {
        if b.epoch < self.epoch {
            return Ok(BlockAction::Stale);
        }
        if b.epoch > self.epoch {
            return Err(SpecError::InvalidBlock(format!(
                "block {} has epoch {}, the session is at epoch {}",
                b.index, b.epoch, self.epoch
            )));
        }
        let c = self.committed.len();
        if b.start_pos > c {
            return Err(SpecError::InvalidBlock(format!(
                "block {} starts at position {}, beyond the {c} committed tokens",
                b.index, b.start_pos
            )));
        }
        if b.is_tree() {
            return self.plan_tree(b, most.max(1));
        }
        let known = (c - b.start_pos).min(b.tokens.len());
        if let Some(i) = (0..known).find(|&i| b.tokens[i] != self.committed[b.start_pos + i]) {
            self.epoch += 1;
            return Ok(BlockAction::Contradicted {
                pos: b.start_pos + i,
            });
        }
        if known == b.tokens.len() {
            return Ok(BlockAction::Covered);
        }
        self.room()?;
        let end = b.tokens.len().min(known.saturating_add(most.max(1)));
        let mut tokens = vec![self.committed[c - 1]];
        tokens.extend_from_slice(&b.tokens[known..end]);
        let logits_at = (0..tokens.len()).collect();
        Ok(BlockAction::Forward(Feed {
            start_pos: self.kv_len,
            tokens,
            logits_at,
            parents: Vec::new(),
            nodes: Vec::new(),
        }))
    }

    fn room(&self) -> Result<(), SpecError> {
        if self.committed.len() >= self.max_len {
            return Err(SpecError::Protocol(format!(
                "the session reached the context limit {}",
                self.max_len
            )));
        }
        Ok(())
    }

    /// [`plan_block`](Self::plan_block) for a token tree: walk it along the committed tokens
    /// (a diversion into a side path moves nothing; leaving the tree moves the epoch), then feed
    /// the subtree below where the walk stopped, to `most` levels — only the committed token when
    /// that is a lane that ended inside the block, whose verdict is then a correction.
    fn plan_tree(&mut self, b: &Block, most: usize) -> Result<BlockAction, SpecError> {
        let c = self.committed.len();
        let mut at = Node::Root;
        for pos in b.start_pos..c {
            match b.step(at, self.committed[pos]) {
                Step::Expected(n) | Step::Diverted(n) => at = n,
                Step::Off => {
                    self.epoch += 1;
                    return Ok(BlockAction::Contradicted { pos });
                }
                Step::Leaf => return Ok(BlockAction::Covered),
            }
        }
        if b.at_end(at) {
            return Ok(BlockAction::Covered);
        }
        self.room()?;
        // Depth first from `at`, expected children first: every parent before its children,
        // and the expected path in consecutive slots (kept as it lies when it is accepted). A
        // node's first child, when it has any in the feed, is the token right after it.
        let mut tokens = vec![self.committed[c - 1]];
        let mut parents = vec![0];
        let mut nodes = vec![at];
        let mut stack: Vec<(Node, usize, usize)> = b
            .children(at)
            .into_iter()
            .rev()
            .map(|k| (k, 0, 1))
            .collect();
        while let Some((n, parent, depth)) = stack.pop() {
            let i = tokens.len();
            tokens.push(b.token(n).expect("invariant: a child has a token"));
            parents.push(parent);
            nodes.push(n);
            if depth < most {
                stack.extend(b.children(n).into_iter().rev().map(|k| (k, i, depth + 1)));
            }
        }
        let logits_at = (0..tokens.len()).collect();
        Ok(BlockAction::Forward(Feed {
            start_pos: self.kv_len,
            tokens,
            logits_at,
            parents,
            nodes,
        }))
    }

    /// The forward that decodes the session's next token: the last committed token, fed.
    pub fn plan_decode(&self) -> Result<Feed, SpecError> {
        if self.committed.len() >= self.max_len {
            return Err(SpecError::Protocol(format!(
                "the session reached the context limit {}",
                self.max_len
            )));
        }
        Ok(Feed {
            start_pos: self.kv_len,
            tokens: vec![*self.committed.last().expect("invariant: the first token")],
            logits_at: vec![0],
            parents: Vec::new(),
            nodes: Vec::new(),
        })
    }

    /// The target's logits after [`plan_decode`](Self::plan_decode): the next token, committed.
    /// It does not move the epoch: blocks in flight are rebased against it.
    pub fn finish_decode(&mut self, row: &[f32]) -> Decoded {
        self.kv_len += 1;
        let pos = self.committed.len();
        let token = target_token(row, &self.params, pos as u64);
        self.committed.push(token);
        Decoded {
            epoch: self.epoch,
            pos,
            token,
            grant: None,
        }
    }

    /// Fold the target's logits for `b` (rows in the order of the plan's `logits_at`, as planned
    /// by [`plan_block`](Self::plan_block) just before, in `feed`) into the verdict, and move the
    /// session on: the accepted run and the correction or bonus are committed.
    pub fn finish(
        &mut self,
        b: &Block,
        feed: &Feed,
        rows: &[&[f32]],
    ) -> Result<Finished, SpecError> {
        if feed.is_tree() {
            return self.finish_tree(b, feed, rows);
        }
        let c = self.committed.len();
        let known = c - b.start_pos;
        // The drafted tokens fed: the block's past the committed ones, or its first few.
        let m = feed.tokens.len() - 1;
        if known + m > b.tokens.len() {
            return Err(SpecError::Protocol(format!(
                "a plan of {m} tokens past the {known} committed of a {}-token block",
                b.tokens.len()
            )));
        }
        if rows.len() != m + 1 {
            return Err(SpecError::Protocol(format!(
                "{} logits rows for a plan of {}",
                rows.len(),
                m + 1
            )));
        }
        let epoch = self.epoch;
        let mut accepted = 0;
        let mut correction = None;
        for (i, row) in rows[..m].iter().enumerate() {
            let pos = (c + i) as u64;
            match judge(
                self.rule,
                row,
                &self.params,
                pos,
                b.tokens[known + i],
                b.q.get(known + i),
            ) {
                Ok(()) => accepted += 1,
                Err(t) => {
                    correction = Some(t);
                    break;
                }
            }
        }
        self.verified_positions += m as u64;
        self.committed
            .extend_from_slice(&b.tokens[known..known + accepted]);
        let (token, partial) = match correction {
            Some(t) => {
                self.epoch += 1;
                (t, false)
            }
            None => {
                let t = target_token(rows[m], &self.params, (c + m) as u64);
                // A trimmed block: the target's next token is its draft's next token, accepted
                // (committed as the target's own), or a correction of it.
                match b.tokens.get(known + m) {
                    Some(&drafted) if drafted == t => (t, true),
                    Some(_) => {
                        self.epoch += 1;
                        (t, false)
                    }
                    None => (t, false),
                }
            }
        };
        self.committed.push(token);
        self.kv_len = self.committed.len() - 1;
        Ok(Finished {
            verdict: Verdict {
                epoch,
                block: b.index,
                accepted: known + accepted,
                side_end: None,
                token,
                verify_us: 0,
                grant: None,
            },
            kv_len: self.kv_len,
            judged: m,
            accepted,
            keep: Vec::new(),
            partial,
        })
    }

    /// [`finish`](Self::finish) for a tree feed: from the node the committed tokens reached, judge
    /// each node's children ([`judge_guesses`]: the target's token picks the child under greedy
    /// and sample-and-match, recursive residuals under rejection sampling) and follow the one
    /// committed; the epoch moves at a rejection, and at the end of a lane that ended inside the
    /// block (none at a diversion, nor past the block's last position: the bonus). Where the feed
    /// was trimmed below the node reached, the target's token there is committed; it is
    /// [`Finished::partial`] when it is one of the node's children in the block (the block goes
    /// on from it), a correction otherwise.
    fn finish_tree(
        &mut self,
        b: &Block,
        feed: &Feed,
        rows: &[&[f32]],
    ) -> Result<Finished, SpecError> {
        if rows.len() != feed.tokens.len() {
            return Err(SpecError::Protocol(format!(
                "{} logits rows for a plan of {}",
                rows.len(),
                feed.tokens.len()
            )));
        }
        let epoch = self.epoch;
        let c = self.committed.len();
        let mut i = 0;
        let mut keep = Vec::new();
        let mut partial = false;
        let token = loop {
            let at = feed.nodes[i];
            let pos = (b.start_pos + b.path_len(at)) as u64;
            let kids = b.children(at);
            if kids.is_empty() {
                let t = target_token(rows[i], &self.params, pos);
                if !b.at_end(at) {
                    self.epoch += 1; // a lane that ended inside the block: off the tree
                }
                break t; // past the block: the bonus
            }
            if feed.parents.get(i + 1) != Some(&i) {
                // Trimmed below this node: the target's own token, which the block goes on from
                // when it guessed it (the edge walks it there too), or its correction.
                let t = target_token(rows[i], &self.params, pos);
                if kids.iter().any(|&k| b.token(k) == Some(t)) {
                    partial = true;
                } else {
                    self.epoch += 1;
                }
                break t;
            }
            // Under rejection sampling a main token was drawn from the q sent with it, a side
            // token beside it is a sibling draw (see `verify::draft_sibling`) unless the edge
            // marked it a point mass, and a node continuing a side node is a point mass.
            let guesses: Vec<Guess> = kids
                .iter()
                .map(|&k| {
                    let t = b.token(k).expect("invariant: a child has a token");
                    match k {
                        Node::Main(m) if self.rule.needs_q() => match b.q.get(m) {
                            Some(q) => Guess::Drawn(t, q),
                            None => Guess::Point(t),
                        },
                        Node::Side(s) if matches!(kids[0], Node::Main(_)) && !b.side[s].point => {
                            Guess::Sibling(t)
                        }
                        _ => Guess::Point(t),
                    }
                })
                .collect();
            let next = match judge_guesses(self.rule, rows[i], &self.params, pos, &guesses) {
                Ok(k) => kids[k],
                Err(t) => {
                    self.epoch += 1;
                    break t;
                }
            };
            let j = (i + 1..feed.tokens.len())
                .find(|&j| feed.parents[j] == i && feed.nodes[j] == next)
                .expect("invariant: the feed holds the subtree below its first node");
            keep.push(j);
            self.committed.push(feed.tokens[j]);
            i = j;
        };
        let last = feed.nodes[i];
        let judged = feed.tokens.len() - 1;
        self.verified_positions += judged as u64;
        self.committed.push(token);
        self.kv_len = self.committed.len() - 1;
        let accepted = self.committed.len() - 1 - c;
        Ok(Finished {
            verdict: Verdict {
                epoch,
                block: b.index,
                accepted: b.path_len(last),
                side_end: match last {
                    Node::Side(m) => Some(m as u32),
                    _ => None,
                },
                token,
                verify_us: 0,
                grant: None,
            },
            kv_len: self.kv_len,
            judged,
            accepted,
            keep,
            partial,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session over a 3-token prompt whose prefill predicted 7 (committed at position 3).
    fn session() -> CloudSession {
        CloudSession::new(
            VerifyRule::Greedy,
            SamplingParams::default(),
            &[1, 2, 3],
            7,
            64,
        )
    }

    fn block(epoch: u64, index: u64, start_pos: usize, tokens: &[u32]) -> Block {
        Block {
            epoch,
            index: BlockId(index),
            start_pos,
            tokens: tokens.to_vec(),
            q: vec![],
            side: vec![],
        }
    }

    /// One-hot logits rows choosing `tokens`.
    fn rows(tokens: &[u32]) -> Vec<Vec<f32>> {
        tokens
            .iter()
            .map(|&t| {
                let mut r = vec![0f32; 64];
                r[t as usize] = 1.0;
                r
            })
            .collect()
    }

    fn refs(r: &[Vec<f32>]) -> Vec<&[f32]> {
        r.iter().map(|x| x.as_slice()).collect()
    }

    #[test]
    fn a_block_is_verified_past_the_committed_tokens_and_commits_its_run_and_bonus() {
        let mut s = session();
        let b = block(0, 0, 4, &[8, 9, 10]);
        s.check(&b).unwrap();
        let BlockAction::Forward(f) = s.plan_block(&b).unwrap() else {
            panic!()
        };
        assert_eq!((f.start_pos, f.tokens.clone()), (3, vec![7, 8, 9, 10]));
        // The target agrees with 8 and 9, then wants 4 where the draft said 10.
        let r = rows(&[8, 9, 4, 12]);
        let done = s.finish(&b, &f, &refs(&r)).unwrap();
        assert_eq!((done.verdict.accepted, done.verdict.token), (2, 4));
        assert_eq!((done.judged, done.accepted), (3, 2));
        assert_eq!(done.kv_len, 6, "the rejected token's KV is cut");
        assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 4]);
        assert_eq!(s.epoch(), 1, "a rejection moves the epoch");
    }

    #[test]
    fn a_block_trimmed_to_the_grant_is_judged_over_several_forwards_with_one_verdict() {
        // A block of five drafted under γ 5, verified under γ 2: two tokens a forward.
        let mut s = session();
        let b = block(0, 0, 4, &[8, 9, 10, 11, 12]);
        let plan = |s: &mut CloudSession| match s.plan_block_within(&b, 2).unwrap() {
            BlockAction::Forward(f) => f,
            other => panic!("{other:?}"),
        };
        let f = plan(&mut s);
        assert_eq!((f.start_pos, f.tokens.clone()), (3, vec![7, 8, 9]));
        // 8 and 9 are right, and the target's token after them is the draft's next, 10: three
        // tokens committed, no verdict yet, the epoch where it was.
        let done = s.finish(&b, &f, &refs(&rows(&[8, 9, 10]))).unwrap();
        assert!(done.partial);
        assert_eq!((done.judged, done.accepted, done.kv_len), (2, 2, 6));
        assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 10]);
        assert_eq!(s.epoch(), 0);
        // The rest: 11 is right, then the target wants 4 where the draft said 12: the verdict
        // counts from the block's start, and the rejection moves the epoch.
        let f = plan(&mut s);
        assert_eq!(f.tokens, vec![10, 11, 12]);
        let done = s.finish(&b, &f, &refs(&rows(&[11, 4, 5]))).unwrap();
        assert!(!done.partial);
        assert_eq!((done.verdict.accepted, done.verdict.token), (4, 4));
        assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 10, 11, 4]);
        assert_eq!(s.epoch(), 1);

        // Where the target's token after the fed ones differs from the draft's next, that is
        // the block's rejection: a verdict now, and the epoch moves (on the edge too, whose
        // draft had another token there).
        let mut s = session();
        let f = plan(&mut s);
        let done = s.finish(&b, &f, &refs(&rows(&[8, 9, 6]))).unwrap();
        assert!(!done.partial);
        assert_eq!((done.verdict.accepted, done.verdict.token), (2, 6));
        assert_eq!((s.epoch(), s.committed().len()), (1, 7));
        // A block wholly committed by its partial forwards is covered: dropped, unanswered
        // (the edge had each token as a decoded one).
        let mut s = session();
        let b = block(0, 0, 4, &[8, 9, 10]);
        let BlockAction::Forward(f) = s.plan_block_within(&b, 2).unwrap() else {
            panic!()
        };
        assert!(s.finish(&b, &f, &refs(&rows(&[8, 9, 10]))).unwrap().partial);
        assert_eq!(s.plan_block_within(&b, 2).unwrap(), BlockAction::Covered);
    }

    #[test]
    fn a_block_behind_the_decoded_tokens_is_rebased_not_replayed() {
        let mut s = session();
        // Two tokens decoded while the block travels: 8 at 4, 9 at 5.
        for t in [8, 9] {
            let f = s.plan_decode().unwrap();
            assert_eq!(f.tokens.len(), 1);
            let d = s.finish_decode(&rows(&[t])[0]);
            assert_eq!((d.epoch, d.token), (0, t), "a decode keeps the epoch");
        }
        assert_eq!((s.committed_len(), s.kv_len()), (6, 5));
        // The block agrees with both and drafts two more: only those are verified.
        let b = block(0, 0, 4, &[8, 9, 10, 11]);
        let BlockAction::Forward(f) = s.plan_block(&b).unwrap() else {
            panic!()
        };
        assert_eq!((f.start_pos, f.tokens.clone()), (5, vec![9, 10, 11]));
        let done = s.finish(&b, &f, &refs(&rows(&[10, 11, 12]))).unwrap();
        assert_eq!(
            (done.verdict.accepted, done.verdict.token),
            (4, 12),
            "counted from the block's start"
        );
        assert_eq!((done.judged, done.accepted), (2, 2));
        assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 10, 11, 12]);
        assert_eq!(s.epoch(), 0);
        // A block that contradicts a committed token moves the epoch, unanswered; the next one
        // of the old epoch is stale; one wholly committed is covered.
        let bad = block(0, 1, 8, &[11, 5]);
        assert_eq!(
            s.plan_block(&bad).unwrap(),
            BlockAction::Contradicted { pos: 8 }
        );
        assert_eq!(s.epoch(), 1);
        assert_eq!(
            s.plan_block(&block(0, 2, 9, &[1])).unwrap(),
            BlockAction::Stale
        );
        assert_eq!(
            s.plan_block(&block(1, 3, 5, &[9, 10])).unwrap(),
            BlockAction::Covered
        );
    }

    /// Main 8 9 10; 20 beside 9, continued by 21; 30 beside 8.
    fn tree_block() -> Block {
        use crate::tree::SideNode;
        Block {
            side: vec![
                SideNode {
                    parent: 1,
                    token: 20,
                    point: false,
                },
                SideNode {
                    parent: 3,
                    token: 21,
                    point: true,
                },
                SideNode {
                    parent: 0,
                    token: 30,
                    point: false,
                },
            ],
            ..block(0, 0, 4, &[8, 9, 10])
        }
    }

    /// Rows for a tree feed from a target whose continuation after the prompt's first token is
    /// `want`: a node on that path gets its next token, any other node token 0.
    fn tree_rows(b: &Block, f: &Feed, want: &[u32]) -> Vec<Vec<f32>> {
        let next: Vec<u32> = f
            .nodes
            .iter()
            .map(|&n| {
                let path: Vec<u32> = b.path_to(n).iter().map(|&m| b.token(m).unwrap()).collect();
                if want.starts_with(&path) {
                    want[path.len()]
                } else {
                    0
                }
            })
            .collect();
        rows(&next)
    }

    #[test]
    fn a_tree_commits_the_path_the_target_follows() {
        // The main path right: its run and the bonus, nothing moves.
        let b = tree_block();
        for (want, accepted, side_end, token, epoch, committed) in [
            (
                vec![8, 9, 10, 11],
                3,
                None,
                11,
                0,
                vec![1, 2, 3, 7, 8, 9, 10, 11],
            ),
            // The lane beside 9 right: the path 8 20 21 and the bonus; a diversion moves nothing
            // (the blocks behind carry the lane on).
            (
                vec![8, 20, 21, 5],
                3,
                Some(1),
                5,
                0,
                vec![1, 2, 3, 7, 8, 20, 21, 5],
            ),
            // The branch right at its first token only: a correction after it.
            (vec![8, 20, 6], 2, Some(0), 6, 1, vec![1, 2, 3, 7, 8, 20, 6]),
            // Every guess wrong at the first position: the correction.
            (vec![40], 0, None, 40, 1, vec![1, 2, 3, 7, 40]),
        ] {
            let mut s = session();
            s.check(&b).unwrap();
            let BlockAction::Forward(f) = s.plan_block(&b).unwrap() else {
                panic!()
            };
            assert_eq!(f.tokens.len(), 7, "the committed token and every node");
            assert_eq!(f.nodes[0], Node::Root);
            let r = tree_rows(&b, &f, &want);
            let done = s.finish(&b, &f, &refs(&r)).unwrap();
            let v = done.verdict;
            assert_eq!(
                (v.accepted, v.side_end, v.token),
                (accepted, side_end, token),
                "{want:?}"
            );
            assert_eq!(s.committed(), &committed[..]);
            assert_eq!(s.epoch(), epoch, "{want:?}");
            assert_eq!(done.kv_len, committed.len() - 1);
            let kept: Vec<u32> = done.keep.iter().map(|&j| f.tokens[j]).collect();
            assert_eq!(
                kept,
                committed[4..committed.len() - 1],
                "the KV keeps the path"
            );
            assert!(b.named_path(v.accepted, v.side_end).is_some());
        }
    }

    #[test]
    fn a_tree_trimmed_to_the_grant_is_judged_over_several_forwards_with_one_verdict() {
        let b = tree_block();
        // Trimmed to two levels: the root's children and theirs, not 10 nor 21 below them.
        let mut s = session();
        let BlockAction::Forward(f) = s.plan_block_within(&b, 2).unwrap() else {
            panic!()
        };
        assert_eq!(f.tokens, vec![7, 8, 9, 20, 30]);
        // To one level: 8 and 30 beside it.
        let plan = |s: &mut CloudSession| match s.plan_block_within(&b, 1).unwrap() {
            BlockAction::Forward(f) => f,
            other => panic!("{other:?}"),
        };
        // The target follows the lane 8 20 21, then 5. The first forward commits 8 and the
        // target's 20 after it, a child of 8 in the block: partial, the epoch stays.
        let want = [8, 20, 21, 5];
        let mut s = session();
        let f = plan(&mut s);
        assert_eq!(f.tokens, vec![7, 8, 30]);
        let done = s.finish(&b, &f, &refs(&tree_rows(&b, &f, &want))).unwrap();
        assert!(done.partial);
        assert_eq!((done.accepted, done.kv_len, s.epoch()), (1, 5, 0));
        assert_eq!(
            done.keep.iter().map(|&j| f.tokens[j]).collect::<Vec<_>>(),
            [8]
        );
        assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 20]);
        // The next walks the block from its start through the lane: its one verdict names the
        // lane's path in the block's own numbering, as the untrimmed forward's did.
        let f = plan(&mut s);
        assert_eq!(f.tokens, vec![20, 21]);
        let done = s.finish(&b, &f, &refs(&tree_rows(&b, &f, &want))).unwrap();
        assert!(!done.partial);
        let v = done.verdict;
        assert_eq!((v.accepted, v.side_end, v.token), (3, Some(1), 5));
        assert_eq!(
            (s.epoch(), s.committed()),
            (0, &[1, 2, 3, 7, 8, 20, 21, 5][..])
        );
        // The target's token below the trimmed node is none of the block's: the correction.
        let mut s = session();
        let f = plan(&mut s);
        let done = s
            .finish(&b, &f, &refs(&tree_rows(&b, &f, &[8, 6])))
            .unwrap();
        assert!(!done.partial);
        let v = done.verdict;
        assert_eq!((v.accepted, v.side_end, v.token), (1, None, 6));
        assert_eq!((s.epoch(), s.committed()), (1, &[1, 2, 3, 7, 8, 6][..]));
        // The main path right, a level a forward: 8 (and 9), 10 (and the bonus 11).
        let want = [8, 9, 10, 11];
        let mut s = session();
        let f = plan(&mut s);
        assert!(
            s.finish(&b, &f, &refs(&tree_rows(&b, &f, &want)))
                .unwrap()
                .partial
        );
        let f = plan(&mut s);
        assert_eq!(f.tokens, vec![9, 10]);
        let done = s.finish(&b, &f, &refs(&tree_rows(&b, &f, &want))).unwrap();
        let v = done.verdict;
        assert_eq!(
            (done.partial, v.accepted, v.side_end, v.token),
            (false, 3, None, 11)
        );
        assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 10, 11]);
    }

    #[test]
    fn decodes_that_divert_a_tree_move_nothing_and_decodes_off_it_move_the_epoch() {
        let b = tree_block();
        let mut s = session();
        for t in [8, 20] {
            s.plan_decode().unwrap();
            s.finish_decode(&rows(&[t])[0]);
        }
        let BlockAction::Forward(f) = s.plan_block(&b).unwrap() else {
            panic!()
        };
        assert_eq!(f.tokens, vec![20, 21], "the subtree below the lane");
        let done = s
            .finish(&b, &f, &refs(&tree_rows(&b, &f, &[8, 20, 21, 5])))
            .unwrap();
        assert_eq!(
            (
                done.verdict.epoch,
                done.verdict.accepted,
                done.verdict.side_end
            ),
            (0, 3, Some(1))
        );
        assert_eq!(
            (s.epoch(), s.committed()),
            (0, &[1, 2, 3, 7, 8, 20, 21, 5][..])
        );
        // A tree the decodes walk to its end is covered; one they leave is contradicted.
        let mut s = session();
        for t in [8, 20, 21] {
            s.plan_decode().unwrap();
            s.finish_decode(&rows(&[t])[0]);
        }
        assert_eq!(s.plan_block(&b).unwrap(), BlockAction::Covered);
        assert_eq!(s.epoch(), 0);
        let mut s = session();
        for t in [8, 20, 3] {
            s.plan_decode().unwrap();
            s.finish_decode(&rows(&[t])[0]);
        }
        assert_eq!(
            s.plan_block(&b).unwrap(),
            BlockAction::Contradicted { pos: 6 }
        );
        assert_eq!(s.epoch(), 1);
    }

    #[test]
    fn a_lane_that_ends_inside_the_block_is_a_correction_after_its_end() {
        // 30 beside 8 ends at block position 0 of 3: the walk to it leaves nothing to verify
        // but the committed token, whose verdict is a correction (the epoch moves).
        let b = tree_block();
        let mut s = session();
        s.plan_decode().unwrap();
        s.finish_decode(&rows(&[30])[0]);
        let BlockAction::Forward(f) = s.plan_block(&b).unwrap() else {
            panic!()
        };
        assert_eq!(
            (f.tokens.clone(), f.nodes.clone()),
            (vec![30], vec![Node::Side(2)])
        );
        let done = s.finish(&b, &f, &refs(&rows(&[6]))).unwrap();
        assert_eq!(
            (
                done.verdict.accepted,
                done.verdict.side_end,
                done.verdict.token
            ),
            (1, Some(2), 6)
        );
        assert_eq!(s.epoch(), 1);
        assert_eq!(s.committed(), &[1, 2, 3, 7, 30, 6]);
    }

    #[test]
    fn under_rejection_sampling_a_side_node_marked_point_is_judged_as_a_point_mass() {
        // A main token drawn from q and, beside it, a token the edge chose itself (a lane's,
        // from another parent): marked `point`, the committed token follows p (χ², 5 dof, 0.999
        // quantile 20.5); judged as a second draw from q (unmarked), it does not.
        use crate::sampling::distribution;
        use crate::tree::SideNode;
        use crate::verify::draft_sample;
        let target = [1.0f32, 0.2, 0.5, -0.3, 0.9, 0.0];
        let draft = [0.1f32, 1.2, 0.4, 0.6, -0.2, 0.3];
        let at = |seed| SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed,
        };
        let chi2 = |point: bool| {
            let mut counts = [0usize; 6];
            for seed in 0..20_000u64 {
                let p = at(seed);
                let mut s = CloudSession::new(VerifyRule::Rejection, p, &[1, 2, 3], 5, 64);
                let (d, q) = draft_sample(&draft, &p, 4, 6);
                let b = Block {
                    q: vec![q],
                    side: vec![SideNode {
                        parent: 0,
                        token: if d == 4 { 0 } else { 4 },
                        point,
                    }],
                    ..block(0, 0, 4, &[d])
                };
                let BlockAction::Forward(f) = s.plan_block(&b).unwrap() else {
                    panic!()
                };
                let rows = vec![target.to_vec(); f.tokens.len()];
                s.finish(&b, &f, &refs(&rows)).unwrap();
                counts[s.committed()[4] as usize] += 1;
            }
            let want = distribution(&target, &at(0));
            let n = counts.iter().sum::<usize>() as f64;
            want.iter()
                .map(|&(t, p)| {
                    let e = n * p as f64;
                    (counts[t as usize] as f64 - e).powi(2) / e
                })
                .sum::<f64>()
        };
        let (right, wrong) = (chi2(true), chi2(false));
        assert!(right < 20.5, "point masses: χ² {right}");
        assert!(wrong > 100.0, "judged as second draws: χ² {wrong}");
    }

    #[test]
    fn bad_trees_are_refused_by_name() {
        let s = session();
        let mut b = tree_block();
        b.side[2].token = 8;
        let e = s.check(&b).unwrap_err().to_string();
        assert!(e.contains("two guesses of token 8"), "{e}");
        let rs = CloudSession::new(
            VerifyRule::Rejection,
            SamplingParams {
                temperature: 0.8,
                ..SamplingParams::default()
            },
            &[1, 2, 3],
            7,
            64,
        );
        // Under rejection sampling a tree's main path carries its q; side nodes are point masses.
        let e = rs.check(&tree_block()).unwrap_err().to_string();
        assert!(e.contains("needs one draft distribution per token"), "{e}");
        let mut with_q = tree_block();
        with_q.q = vec![vec![(0, 1.0)]; with_q.tokens.len()];
        rs.check(&with_q).unwrap();
        // A branch past the context limit, though the main path is within it.
        let short = CloudSession::new(
            VerifyRule::Greedy,
            SamplingParams::default(),
            &[1, 2, 3],
            7,
            5,
        );
        let deep = Block {
            side: vec![
                crate::tree::SideNode {
                    parent: 0,
                    token: 30,
                    point: false,
                },
                crate::tree::SideNode {
                    parent: 1,
                    token: 31,
                    point: true,
                },
            ],
            ..block(0, 0, 4, &[8])
        };
        let e = short.check(&deep).unwrap_err().to_string();
        assert!(e.contains("past the block's last position 0"), "{e}");
        let e = short
            .check(&block(0, 0, 4, &[8, 9, 10]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("reaches position 7"), "{e}");
        // Siblings share a position but not a KV slot: a tree whose positions fit but whose
        // nodes need slots past the limit is refused too (it could never be fed).
        let wide = CloudSession::new(
            VerifyRule::Greedy,
            SamplingParams::default(),
            &[1, 2, 3],
            7,
            8,
        );
        let mut bushy = block(0, 0, 4, &[8, 9]);
        bushy.side = (0..3)
            .map(|i| crate::tree::SideNode {
                parent: 0,
                token: 20 + i,
                point: false,
            })
            .collect();
        assert_eq!(bushy.start_pos + bushy.reach(), 6, "positions fit");
        let e = wide.check(&bushy).unwrap_err().to_string();
        assert!(
            e.contains("need KV slots beyond the context limit 8"),
            "{e}"
        );
        s.check(&tree_block()).unwrap();
    }

    #[test]
    fn bad_blocks_are_refused_by_name() {
        let mut s = session();
        let e = s.plan_block(&block(2, 0, 4, &[7])).unwrap_err().to_string();
        assert!(e.contains("epoch 2") && e.contains("epoch 0"), "{e}");
        let e = s.check(&block(0, 0, 2, &[7])).unwrap_err().to_string();
        assert!(e.contains("inside the prompt"), "{e}");
        let e = s.plan_block(&block(0, 0, 9, &[7])).unwrap_err().to_string();
        assert!(
            e.contains("starts at position 9, beyond the 4 committed"),
            "{e}"
        );
        let e = s.check(&block(0, 0, 4, &[])).unwrap_err().to_string();
        assert!(e.contains("no tokens"), "{e}");
        let short = CloudSession::new(
            VerifyRule::Greedy,
            SamplingParams::default(),
            &[1, 2, 3],
            7,
            5,
        );
        let e = short
            .check(&block(0, 0, 4, &[7, 1, 2]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("beyond the context limit 5"), "{e}");
        s.accept_index(&block(0, 4, 4, &[7])).unwrap();
        let e = s
            .accept_index(&block(0, 4, 4, &[7]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("index 4 does not follow 4"), "{e}");
    }
}
