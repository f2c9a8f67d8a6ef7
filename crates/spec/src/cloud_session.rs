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

use std::borrow::Cow;

use crate::grammar::Grammar;
use crate::pipeline::{Block, BlockId, Decoded, Verdict};
use crate::sampling::{token_logprob, SamplingParams, TokenLogprob};
use crate::suffix::{GuessRecord, Judged, SelfDrafter, SuffixPolicy};
use crate::tree::{Node, Step};
use crate::verify::{judge, judge_guesses, judge_run, target_token, Guess, VerifyRule};
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
    /// [`CloudSession::block_action_within`]) and the target followed the block through them and
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
    /// A constrained session's grammar, at its state after the committed output: every row the
    /// session judges or decodes with is masked by it first.
    #[serde(skip)]
    grammar: Option<Grammar>,
    /// The edge asked for the target's log-probabilities of the committed tokens, with this many
    /// alternatives each: those of each forward, until the driver takes them.
    logprobs: Option<usize>,
    pending_logprobs: Vec<TokenLogprob>,
    /// The verifier drafts for itself (see [`CloudSession::self_guesses`]): the committed
    /// sequence indexed, its guesses priced.
    #[serde(skip)]
    suffix: Option<SelfDrafter>,
}

/// What a decode step committed: the target's tokens in position order (the verifier's own
/// guesses it accepted, then its token after them), each told to the edge as decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeRun {
    pub decoded: Vec<Decoded>,
    /// The verifier's own guesses fed, and how many the target accepted.
    pub guessed: usize,
    pub accepted: usize,
    /// Their judgement, for the verifier's record of its guesses (None: none were fed).
    pub judged: Option<Judged>,
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
            grammar: None,
            logprobs: None,
            pending_logprobs: Vec::new(),
            suffix: None,
        }
    }

    /// Let the verifier draft for itself when it decodes the session alone: guesses copied from
    /// the committed sequence (prompt included) by a suffix index, under `policy`
    /// ([`CloudSession::self_guesses`]), priced from `record` at first (the verifier's).
    pub fn with_self_draft(mut self, policy: SuffixPolicy, record: &GuessRecord) -> Self {
        self.suffix = Some(SelfDrafter::new(&self.committed, policy, record));
        self
    }

    /// Whether the verifier drafts for this session.
    pub fn self_drafts(&self) -> bool {
        self.suffix.is_some()
    }

    /// Commit `token` (the last committed token is not yet in the target's KV).
    fn commit(&mut self, token: u32) {
        self.committed.push(token);
        if let Some(ix) = &mut self.suffix {
            ix.push(token);
        }
    }

    /// The verifier's own guesses of the session's next tokens (at most `most`), to verify in
    /// the forward that decodes it: what followed the longest earlier match of the committed
    /// sequence's end, under the session's policy; none without self-drafting. They stop at an
    /// end-of-generation token (`eog`, kept) and within what the session may still commit: its
    /// `limit` of committed tokens, the context, the flow window (the target's token after them
    /// is committed too).
    /// `cost`: a guessed position's cost beside a one-token forward, every session it delays
    /// counted ([`SelfDrafter::guesses`]).
    pub fn self_guesses(&mut self, most: usize, limit: usize, eog: &[u32], cost: f64) -> Vec<u32> {
        let c = self.committed.len();
        let room = limit
            .min(self.max_len)
            .min(self.acked + FLOW_WINDOW)
            .saturating_sub(c + 1);
        match &mut self.suffix {
            Some(d) => d.guesses(most.min(room), eog, cost),
            None => Vec::new(),
        }
    }

    /// Keep the target's log-probability of each committed token, with `top` alternatives
    /// ([`CloudSession::take_logprobs`]); the first token's is noted by the caller, which has its
    /// row ([`CloudSession::note_logprob`]).
    pub fn with_logprobs(mut self, top: usize) -> Self {
        self.logprobs = Some(top);
        self
    }

    /// Note the log-probability of `token`, committed at `pos` from the raw row `row`.
    pub fn note_logprob(&mut self, row: &[f32], token: u32, pos: usize) {
        if let Some(top) = self.logprobs {
            self.pending_logprobs
                .push(token_logprob(row, token, pos, top));
        }
    }

    /// The log-probabilities noted since the last call, in position order.
    pub fn take_logprobs(&mut self) -> Vec<TokenLogprob> {
        std::mem::take(&mut self.pending_logprobs)
    }

    /// Constrain the session's output to `grammar`, at its state after the output committed so
    /// far: the first token (which the caller drew from a row masked by it: [`Grammar::mask`]),
    /// and, for a session reopened over its output, the prompt's tokens that were output.
    pub fn constrain(mut self, grammar: Grammar) -> Self {
        self.grammar = Some(grammar);
        self
    }

    /// `row` as the rules see it: masked by the grammar's state now, if constrained.
    fn row<'a>(&mut self, row: &'a [f32]) -> Result<Cow<'a, [f32]>, SpecError> {
        match &mut self.grammar {
            None => Ok(Cow::Borrowed(row)),
            Some(g) => g
                .mask(row)
                .map(Cow::Owned)
                .map_err(|e| SpecError::Grammar(format!("the mask: {e}"))),
        }
    }

    /// The grammar follows a committed token.
    fn follow(&mut self, token: u32) -> Result<(), SpecError> {
        match &mut self.grammar {
            None => Ok(()),
            Some(g) => g
                .advance(token)
                .map_err(|e| SpecError::Grammar(format!("a committed token: {e}"))),
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

    /// Committed tokens the edge has not acknowledged yet.
    pub fn unacked(&self) -> usize {
        self.committed.len().saturating_sub(self.acked)
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
    pub fn block_action(&mut self, b: &Block) -> Result<BlockAction, SpecError> {
        self.block_action_within(b, usize::MAX)
    }

    /// [`block_action`](Self::block_action), feeding at most `most` positions of a block past the
    /// committed ones (the γ granted now, when the block was drafted under a larger grant; at
    /// least one): a linear block's next `most` tokens, a token tree's nodes at most `most`
    /// below where the committed tokens reached. A block trimmed, not refused: its verdict comes
    /// once it is judged to its end or rejected, over as many forwards as it takes
    /// ([`Finished::partial`]). The block itself stays whole, so that every plan walks it from
    /// its start, as the edge does, and the verdict names its path in the block's own terms.
    pub fn block_action_within(
        &mut self,
        b: &Block,
        most: usize,
    ) -> Result<BlockAction, SpecError> {
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
            return self.tree_action(b, most.max(1));
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

    /// [`block_action`](Self::block_action) for a token tree: walk it along the committed tokens
    /// (a diversion into a side path moves nothing; leaving the tree moves the epoch), then feed
    /// the subtree below where the walk stopped, to `most` levels — only the committed token when
    /// that is a lane that ended inside the block, whose verdict is then a correction.
    fn tree_action(&mut self, b: &Block, most: usize) -> Result<BlockAction, SpecError> {
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
    pub fn decode_feed(&self) -> Result<Feed, SpecError> {
        self.decode_feed_with(&[])
    }

    /// The forward that decodes the session's next token with the verifier's own `guesses`
    /// ([`CloudSession::self_guesses`]) fed behind the last committed token, each one's logits
    /// judging the next.
    pub fn decode_feed_with(&self, guesses: &[u32]) -> Result<Feed, SpecError> {
        let end = self.committed.len() + guesses.len();
        if end >= self.max_len {
            return Err(SpecError::Protocol(format!(
                "the session reached the context limit {}",
                self.max_len
            )));
        }
        let mut tokens = vec![*self.committed.last().expect("invariant: the first token")];
        tokens.extend_from_slice(guesses);
        Ok(Feed {
            start_pos: self.kv_len,
            logits_at: (0..tokens.len()).collect(),
            tokens,
            parents: Vec::new(),
            nodes: Vec::new(),
        })
    }

    /// The target's logits after [`decode_feed`](Self::decode_feed): the next token, committed.
    /// It does not move the epoch: blocks in flight are rebased against it.
    pub fn finish_decode(&mut self, row: &[f32]) -> Result<Decoded, SpecError> {
        let feed = self.decode_feed()?;
        let mut run = self.finish_decode_run(&feed, &[row])?;
        Ok(run.decoded.remove(0))
    }

    /// The target's logits after [`decode_feed_with`](Self::decode_feed_with) (a row per token
    /// fed): the guesses it accepts and its token after them, committed
    /// ([`judge_run`]: each guess a point mass). Like a decoded token, none moves the epoch.
    pub fn finish_decode_run(
        &mut self,
        feed: &Feed,
        rows: &[&[f32]],
    ) -> Result<DecodeRun, SpecError> {
        let c = self.committed.len();
        if feed.start_pos != self.kv_len || rows.len() != feed.tokens.len() || feed.is_tree() {
            return Err(SpecError::Protocol(format!(
                "{} logits rows for a decode of {} tokens from {} (the KV holds {})",
                rows.len(),
                feed.tokens.len(),
                feed.start_pos,
                self.kv_len
            )));
        }
        let guesses = &feed.tokens[1..];
        let tokens = judge_run(
            self.rule,
            &self.params,
            c,
            guesses,
            rows,
            self.grammar.as_mut(),
        )
        .map_err(|e| SpecError::Grammar(format!("a committed token: {e}")))?;
        let mut decoded = Vec::with_capacity(tokens.len());
        for (i, &token) in tokens.iter().enumerate() {
            self.note_logprob(rows[i], token, c + i);
            self.commit(token);
            decoded.push(Decoded {
                epoch: self.epoch,
                pos: c + i,
                token,
                grant: None,
                guessed: i < guesses.len() && guesses[i] == token,
            });
        }
        self.verified_positions += guesses.len() as u64;
        self.kv_len = self.committed.len() - 1;
        let judged = match &mut self.suffix {
            Some(d) => d.judged(guesses.len(), tokens.len() - 1),
            None => None,
        };
        Ok(DecodeRun {
            judged,
            guessed: guesses.len(),
            accepted: tokens.len() - 1,
            decoded,
        })
    }

    /// Fold the target's logits for `b` (rows in the order of the plan's `logits_at`, as planned
    /// by [`block_action`](Self::block_action) just before, in `feed`) into the verdict, and move the
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
            let row = self.row(row)?;
            let d = b.tokens[known + i];
            match judge(self.rule, &row, &self.params, pos, d, b.q.get(known + i)) {
                Ok(()) => {
                    self.follow(d)?;
                    self.note_logprob(rows[i], d, pos as usize);
                    accepted += 1
                }
                Err(t) => {
                    correction = Some(t);
                    break;
                }
            }
        }
        self.verified_positions += m as u64;
        for i in known..known + accepted {
            self.commit(b.tokens[i]);
        }
        let (token, partial) = match correction {
            Some(t) => {
                self.epoch += 1;
                (t, false)
            }
            None => {
                let t = target_token(&self.row(rows[m])?, &self.params, (c + m) as u64);
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
        self.follow(token)?;
        // The correction's row is the rejected position's; the bonus's, the last.
        self.note_logprob(rows[accepted.min(m)], token, c + accepted);
        self.commit(token);
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
            let row = self.row(rows[i])?;
            if kids.is_empty() {
                let t = target_token(&row, &self.params, pos);
                if !b.at_end(at) {
                    self.epoch += 1; // a lane that ended inside the block: off the tree
                }
                break t; // past the block: the bonus
            }
            if feed.parents.get(i + 1) != Some(&i) {
                // Trimmed below this node: the target's own token, which the block goes on from
                // when it guessed it (the edge walks it there too), or its correction.
                let t = target_token(&row, &self.params, pos);
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
            let next = match judge_guesses(self.rule, &row, &self.params, pos, &guesses) {
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
            self.follow(feed.tokens[j])?;
            self.note_logprob(rows[i], feed.tokens[j], pos as usize);
            self.commit(feed.tokens[j]);
            i = j;
        };
        let last = feed.nodes[i];
        let judged = feed.tokens.len() - 1;
        self.verified_positions += judged as u64;
        self.follow(token)?;
        self.note_logprob(rows[i], token, self.committed.len());
        self.commit(token);
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
mod tests;
