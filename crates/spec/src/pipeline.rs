//! The edge's speculation pipeline as a pure state machine.
//!
//! The edge holds one token sequence: the prompt, the committed (verified) output, then a speculative
//! tail of drafted tokens, some of them sent as blocks that are in flight. Up to `depth` blocks are in
//! flight at once (`depth = 1` is synchronous speculation), plus enough to cover the verifier's
//! **lead**: the verifier never idles a session, it decodes the next token itself whenever it has
//! no block to verify and streams it ([`Decoded`]), so blocks land behind it and only their tokens
//! past its committed ones are verified.
//!
//! The cloud commits every position once, in order: the first token at Open, each verdict's
//! accepted run and its correction or bonus, each decoded token. The edge takes each commit as it
//! comes: a token that agrees with its tail is kept (the draft has fed it already); one that
//! differs replaces the tail from there and rolls the draft back. When the tail token it replaces
//! was sent in a block, that block is useless to the verifier too, which sees the same
//! contradiction when it plans the block: both sides move to the next epoch, and every block and
//! verdict of an older epoch is dropped and counted. A block whose every position is committed (and
//! agrees) is answered by the commits themselves. A verdict `{accepted: a, token: t}` for a block
//! starting at position `s` says: the first `a` drafted tokens are the target's (those before the
//! verifier's committed length were matched, the rest verified), and the target's token at
//! `s + a` is `t` — a correction when `a` is short of the block, the bonus when the whole block
//! passed.
//!
//!
//! With token trees on, the speculative tail is a tree ([`lanes`]): the main path plus lanes that
//! fork where the draft was unsure, grown together and carried in the blocks over their
//! positions; a commit that a lane guessed makes it the main path, and the blocks in flight stay
//! (those that carry it go on along it).
//!
//! The shell around it (draft engine, network) asks [`Pipeline::next`] what to do, grows the
//! draft's [`Pipeline::frontier`] by a token per leaf (with one leaf: the next token after
//! [`Pipeline::tokens`]) and reports them with [`Pipeline::on_grown`] ([`Pipeline::on_drafted`]
//! for a linear pipeline), each verdict with [`Pipeline::on_verdict`], and carries out the
//! returned [`Output`]s: send a block, truncate the draft KV, show committed tokens to the user.

mod lanes;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

pub use lanes::{parse_on_off, parse_tree, Estimates, Frontier, Grown, TreeArg, TreeConfig};
use lanes::{Lane, NodeInfo};

use crate::tree::{Node, Step};
use crate::SpecError;

pub use crate::messages::{
    Block, BlockId, Decoded, Shape, SparseDist, Verdict, MAX_BLOCKS_IN_FLIGHT,
};

/// What the shell must do after an event.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Send this block to the verifier.
    Send(Block),
    /// These tokens are verified: show them to the user as final. `pos` is the absolute position of
    /// the first one; commits are contiguous and never repeat a position.
    Commit { pos: usize, tokens: Vec<u32> },
    /// Truncate the draft model's KV cache to `to` tokens.
    Rollback { to: usize },
    /// Tell the verifier that every committed token before `committed` has arrived (flow
    /// control: see [`crate::cloud_session::FLOW_WINDOW`]).
    Ack { committed: usize },
}

/// What the shell should do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Grow the [`Pipeline::frontier`] by one token per leaf (linear: draft the next token).
    Draft,
    /// Nothing to draft until a verdict arrives.
    Wait,
    /// Generation is over: the token limit or an end-of-generation token was committed.
    Done,
}

/// The draft's second choice at a position, and its probability of its first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hedge {
    pub alt: u32,
    pub p_top: f32,
}

/// A block in flight and the node of its tree the committed tokens reached (the root until
/// one of its positions is committed).
#[derive(Debug, Clone)]
struct InFlight {
    block: Block,
    at: Node,
}

impl InFlight {
    /// The position after the block's last.
    fn end(&self) -> usize {
        self.block.start_pos + self.block.tokens.len()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineConfig {
    /// Draft tokens per block (γ).
    pub draft_len: usize,
    /// Blocks in flight at most.
    pub depth: usize,
    /// New tokens to generate at most.
    pub max_new_tokens: usize,
}

impl PipelineConfig {
    pub fn validate(&self) -> Result<(), SpecError> {
        let bad = |field, message: &str| {
            Err(SpecError::InvalidConfig {
                field,
                message: message.into(),
            })
        };
        if self.draft_len == 0 {
            return bad("draft_len", "must be at least 1");
        }
        if self.depth == 0 {
            return bad("depth", "must be at least 1");
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens", "must be at least 1");
        }
        Ok(())
    }
}

/// Counters of one pipeline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PipelineStats {
    /// Tokens the draft model produced.
    pub drafted: usize,
    /// Blocks sent.
    pub blocks_sent: usize,
    /// Verdicts applied (rounds).
    pub verdicts: usize,
    /// Drafted tokens the target accepted.
    pub accepted: usize,
    /// Verdicts that rejected a drafted token (each judges one position false).
    pub rejections: usize,
    /// Tokens the cloud supplied (corrections and bonus tokens that were not drafted).
    pub cloud_tokens: usize,
    /// Committed tokens the verifier guessed from the session's own text while it decoded the
    /// session alone, and the target accepted (told as decoded, [`Decoded::guessed`]).
    pub verifier_guessed: usize,
    /// Committed tokens that a lane of the draft tree guessed where the main path missed (each
    /// also counts as a rejection of the main path's token).
    pub lane_hits: usize,
    /// Side nodes sent.
    pub side_nodes: usize,
    /// Blocks dropped unanswered: made stale by an earlier rejection, lost with a connection, or
    /// still in flight when the generation ended.
    pub stale_blocks: usize,
    /// Verdicts ignored because they belonged to an older epoch.
    pub stale_verdicts: usize,
    /// Draft steps dropped because a message moved the frontier during their forward
    /// ([`Pipeline::on_grown_at`]).
    pub stale_steps: usize,
    /// Blocks answered by commits alone: every position committed (decoded or verified) and
    /// agreeing before the verifier planned them.
    pub covered_blocks: usize,
    /// Tokens verdicts committed (their verified runs and corrections or bonuses; not the
    /// tokens the verifier decoded on its own).
    pub verdict_tokens: usize,
    /// Of those, the drafted tokens the target judged right in a forward (a verdict's run past
    /// what was committed before it): the accepted draft tokens the verifier's usage counts.
    /// Every other committed token is the verifier's own.
    pub verdict_accepted: usize,
    /// Drafted tokens thrown away (rejected, or in stale blocks, or in the discarded tail).
    pub wasted_draft_tokens: usize,
    /// Committed positions the draft had guessed, by its confidence there
    /// ([`crate::tree::CONFIDENCE_BUCKETS`]; counted only when it names second choices, i.e.
    /// with token trees on).
    pub by_confidence: [ConfidenceCount; 5],
    /// Accepted draft tokens (as `verdict_accepted` counts them) by their position in their
    /// block (0: the first drafted token; positions past the last are not counted), as vLLM's
    /// per-position acceptance.
    pub accepted_at: [usize; ACCEPT_POSITIONS],
}

/// Block positions [`PipelineStats::accepted_at`] counts.
pub const ACCEPT_POSITIONS: usize = 16;

/// Committed positions of one confidence bucket: guessed, right, and wrong but the second
/// choice (or second draw) right.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ConfidenceCount {
    pub judged: usize,
    pub accepted: usize,
    pub covered: usize,
}

impl PipelineStats {
    /// Per-token acceptance rate α: accepted drafted tokens over judged positions (accepted ones
    /// plus the rejected one of each rejecting verdict; tokens after a rejection are never judged).
    pub fn acceptance_rate(&self) -> f64 {
        let judged = self.accepted + self.rejections;
        if judged == 0 {
            0.0
        } else {
            self.accepted as f64 / judged as f64
        }
    }
    /// α counting a branch's hit as an accepted guess: the share of judged positions where the
    /// block had the target's token on some path.
    pub fn tree_acceptance_rate(&self) -> f64 {
        let judged = self.accepted + self.rejections;
        if judged == 0 {
            0.0
        } else {
            (self.accepted + self.lane_hits) as f64 / judged as f64
        }
    }
    /// Mean tokens committed per verdict (its verified run plus the cloud's token), E[A].
    pub fn mean_accepted(&self) -> f64 {
        if self.verdicts == 0 {
            0.0
        } else {
            self.verdict_tokens as f64 / self.verdicts as f64
        }
    }
}

#[derive(Debug, Clone)]
pub struct Pipeline {
    cfg: PipelineConfig,
    eog: Vec<u32>,
    prompt_len: usize,
    /// Prompt, committed output, speculative tail (the main path).
    tokens: Vec<u32>,
    /// What the draft said of the main path's tokens, by position: its distribution (rejection
    /// sampling), second choice and chance (trees).
    info: BTreeMap<usize, NodeInfo>,
    /// The draft tree's other paths.
    lanes: Vec<Lane>,
    committed: usize,
    /// `tokens[..sent]` are committed or inside sent blocks.
    sent: usize,
    in_flight: VecDeque<InFlight>,
    /// The block a verdict is being applied for (not counted stale or covered meanwhile).
    answering: Option<BlockId>,
    tree: TreeConfig,
    epoch: u64,
    next_index: u64,
    draft_fed: usize,
    done: bool,
    /// The verifier's grant lets this session draft (γ 0: the verifier decodes every token).
    drafting: bool,
    /// Tokens the verifier is expected to commit past a block's start before it plans the block:
    /// that many more tokens go in flight, in blocks of γ.
    lead: usize,
    /// The last verdict's block started this many tokens before the committed length.
    last_lead: Option<usize>,
    /// How many times the main path was cut back (see [`Frontier::cuts`]).
    cuts: u64,
    stats: PipelineStats,
}

impl Pipeline {
    /// A pipeline whose first output token is already known: the verifier computes it while
    /// prefilling the prompt, so it is committed at once (time to first token = one round trip plus
    /// the prefill). Returns the pipeline and the commit of that token.
    pub fn with_first(
        prompt: Vec<u32>,
        first: u32,
        cfg: PipelineConfig,
        eog: Vec<u32>,
    ) -> Result<(Self, Vec<Output>), SpecError> {
        let mut p = Self::new(prompt, cfg, eog)?;
        p.tokens.push(first);
        p.sent += 1;
        let mut out = Vec::new();
        p.commit_to(p.prompt_len + 1, &mut out);
        Ok((p, out))
    }

    pub fn new(prompt: Vec<u32>, cfg: PipelineConfig, eog: Vec<u32>) -> Result<Self, SpecError> {
        cfg.validate()?;
        if prompt.is_empty() {
            return Err(SpecError::InvalidConfig {
                field: "prompt",
                message: "must hold at least one token".into(),
            });
        }
        let n = prompt.len();
        Ok(Self {
            cfg,
            eog,
            prompt_len: n,
            tokens: prompt,
            info: BTreeMap::new(),
            lanes: Vec::new(),
            committed: n,
            sent: n,
            in_flight: VecDeque::new(),
            answering: None,
            tree: TreeConfig::LINEAR,
            epoch: 0,
            next_index: 0,
            draft_fed: 0,
            done: false,
            drafting: true,
            lead: 0,
            last_lead: None,
            cuts: 0,
            stats: PipelineStats::default(),
        })
    }

    pub fn config(&self) -> &PipelineConfig {
        &self.cfg
    }

    /// Change γ and depth for the blocks still to be sent (the policy re-plans as it measures).
    /// Blocks already in flight keep their length; a smaller depth only delays the next send.
    pub fn set_shape(&mut self, draft_len: usize, depth: usize) -> Result<Vec<Output>, SpecError> {
        PipelineConfig {
            draft_len,
            depth,
            ..self.cfg
        }
        .validate()?;
        self.cfg.draft_len = draft_len;
        self.cfg.depth = depth;
        // A longer block or a deeper pipeline may let a waiting block go now.
        let mut out = Vec::new();
        self.try_send(&mut out);
        Ok(out)
    }
    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// Prompt, committed output and speculative tail.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Tokens already fed through the draft model; feed `tokens()[draft_fed()..]` before drafting.
    pub fn draft_fed(&self) -> usize {
        self.draft_fed
    }
    /// Number of verified tokens, prompt included.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    pub fn committed_len(&self) -> usize {
        self.committed
    }
    /// The verified output (prompt excluded).
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..self.committed]
    }
    pub fn blocks_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The blocks in flight, oldest first.
    pub fn in_flight_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.in_flight.iter().map(|f| f.block.index)
    }

    /// Blocks in flight at most: `depth`, plus the verifier's lead in blocks of γ.
    fn max_in_flight(&self) -> usize {
        (self.cfg.depth + self.lead.div_ceil(self.cfg.draft_len)).min(MAX_BLOCKS_IN_FLIGHT)
    }

    /// Draft (or not, with the verifier decoding every token: its grant was γ 0).
    pub fn set_drafting(&mut self, on: bool) -> Vec<Output> {
        self.drafting = on;
        let mut out = Vec::new();
        if on {
            self.try_send(&mut out);
        }
        out
    }
    pub fn drafting(&self) -> bool {
        self.drafting
    }

    /// Keep enough blocks in flight to cover `lead` tokens the verifier commits before it plans
    /// a block.
    pub fn set_lead(&mut self, lead: usize) -> Vec<Output> {
        self.lead = lead;
        let mut out = Vec::new();
        self.try_send(&mut out);
        out
    }
    pub fn lead(&self) -> usize {
        self.lead
    }
    /// How far behind the committed length the last verdict's block started (what the lead was).
    pub fn last_lead(&self) -> Option<usize> {
        self.last_lead
    }

    fn limit(&self) -> usize {
        self.prompt_len + self.cfg.max_new_tokens
    }

    /// Drafting stops at the token limit and after a drafted end-of-generation token.
    fn drafting_stopped(&self) -> bool {
        self.tokens.len() >= self.limit()
            || (self.tokens.len() > self.committed
                && self.tokens.last().is_some_and(|t| self.eog.contains(t)))
    }

    pub fn next(&self) -> Next {
        if self.done {
            Next::Done
        } else if !self.drafting
            || self.drafting_stopped()
            || self.in_flight.len() >= self.max_in_flight()
            || self.tokens.len().saturating_sub(self.sent) >= self.cfg.draft_len
        {
            // Drafting runs only while a finished block could be sent at once: with depth 1 the
            // edge waits for each verdict (synchronous speculation), with depth d it works on the
            // d-th block while d − 1 are in flight.
            Next::Wait
        } else {
            Next::Draft
        }
    }

    /// The draft model produced `token` for position `tokens().len()` (having fed everything
    /// before it); `q` is its distribution there when the verify rule needs it. A linear
    /// pipeline's [`on_grown`](Self::on_grown).
    pub fn on_drafted(&mut self, token: u32, q: Option<SparseDist>) -> Vec<Output> {
        self.on_drafted_hedged(token, q, None)
    }

    /// [`on_drafted`](Self::on_drafted) with the draft's second choice there (token trees: it
    /// may fork a lane, which the next [`frontier`](Self::frontier) grows).
    pub fn on_drafted_hedged(
        &mut self,
        token: u32,
        q: Option<SparseDist>,
        hedge: Option<Hedge>,
    ) -> Vec<Output> {
        debug_assert_eq!(
            self.next(),
            Next::Draft,
            "invariant: the shell drafts only when told to"
        );
        self.on_grown(vec![Grown { token, q, hedge }])
            .expect("invariant: on_drafted grows a frontier of one leaf (no lanes growing)")
    }

    /// The length of the block that could go now, if one could.
    fn ready_to_send(&self) -> Option<usize> {
        let unsent = self.tokens.len().saturating_sub(self.sent);
        let full = unsent >= self.cfg.draft_len || (unsent > 0 && self.drafting_stopped());
        (!self.done && self.drafting && full && self.in_flight.len() < self.max_in_flight())
            .then(|| unsent.min(self.cfg.draft_len))
    }

    fn try_send(&mut self, out: &mut Vec<Output>) {
        let Some(n) = self.ready_to_send() else {
            return;
        };
        let block = self.cut_block(self.sent, n);
        self.next_index += 1;
        self.sent += n;
        self.stats.blocks_sent += 1;
        self.stats.side_nodes += block.side.len();
        self.in_flight.push_back(InFlight {
            at: Node::Root,
            block: block.clone(),
        });
        out.push(Output::Send(block));
    }

    /// Keep `tokens[..len]`, dropping what the draft said of the tokens past it.
    fn cut_tail(&mut self, len: usize) {
        self.cuts += 1;
        self.tokens.truncate(len);
        self.info.split_off(&len);
    }

    /// Drop the blocks in flight after the first `keep`, counting them stale (not the one a
    /// verdict answers).
    fn drop_in_flight(&mut self, keep: usize) {
        let keep = keep.min(self.in_flight.len());
        let answering = self
            .in_flight
            .iter()
            .skip(keep)
            .filter(|f| Some(f.block.index) == self.answering)
            .count();
        self.stats.stale_blocks += self.in_flight.len() - keep - answering;
        self.in_flight.truncate(keep);
    }

    /// Mark `tokens[self.committed..upto]` verified: trim q, apply the limit and end-of-generation.
    fn commit_to(&mut self, upto: usize, out: &mut Vec<Output>) {
        let upto = upto.min(self.limit());
        if upto <= self.committed {
            return;
        }
        let from = self.committed;
        let mut end = upto;
        if let Some(i) = self.tokens[from..upto]
            .iter()
            .position(|t| self.eog.contains(t))
        {
            end = from + i + 1;
            self.done = true;
        }
        self.info = self.info.split_off(&end);
        self.committed = end;
        if self.committed >= self.limit() {
            self.done = true;
        }
        match out.last_mut() {
            // Consecutive commits of one event go out as one.
            Some(Output::Commit { pos, tokens }) if *pos + tokens.len() == from => {
                tokens.extend_from_slice(&self.tokens[from..end]);
            }
            _ => out.push(Output::Commit {
                pos: from,
                tokens: self.tokens[from..end].to_vec(),
            }),
        }
        if self.done {
            // Nothing past the end is ever verified: drop it all.
            let wasted = self.tokens.len() - self.committed;
            self.stats.wasted_draft_tokens += wasted;
            self.cut_tail(self.committed);
            self.lanes.clear();
            self.drop_in_flight(0);
            self.sent = self.committed;
            self.draft_fed = self.draft_fed.min(self.committed);
        }
    }

    /// The cloud committed `token` at `pos` (the next position: the cloud commits each once, in
    /// order). The block in flight over `pos` is walked with it: when the token is off its tree,
    /// that block and those behind it are useless to the verifier too, and the epoch moves on (the
    /// verifier moves when it plans or verifies that block). The draft tree follows it: a main
    /// token that agrees is kept, a lane that guessed it becomes the main path, and with neither
    /// the tail is replaced from there.
    fn take(&mut self, pos: usize, token: u32, out: &mut Vec<Output>) -> Result<(), SpecError> {
        if pos != self.committed {
            return Err(SpecError::Protocol(format!(
                "the verifier committed position {pos}, but the next one is {}",
                self.committed
            )));
        }
        self.count_confidence(pos, token);
        let off = self.walk(pos, token);
        if pos < self.tokens.len() && self.tokens[pos] == token {
            self.stats.accepted += 1;
            self.trim_lanes(pos, token);
        } else {
            if pos < self.tokens.len() {
                self.stats.rejections += 1;
            } else {
                self.stats.cloud_tokens += 1;
            }
            if let Some(k) = self.lane_with(pos, token) {
                // A lane guessed it: it is the main path now, in the blocks behind as well.
                self.stats.lane_hits += 1;
                self.stats.wasted_draft_tokens += self.switch_to(k, pos);
            } else {
                self.stats.wasted_draft_tokens += self.tokens.len().saturating_sub(pos);
                self.lanes.clear();
                self.cut_tail(pos);
                self.tokens.push(token);
            }
            self.trim_lanes(pos, token);
            if self.draft_fed > pos {
                self.draft_fed = pos;
                out.push(Output::Rollback { to: pos });
            }
        }
        if off {
            self.epoch += 1;
            self.drop_in_flight(0);
            self.sent = pos + 1;
        } else {
            self.sent = self.sent.max(pos + 1);
        }
        self.commit_to(pos + 1, out);
        self.pop_covered();
        Ok(())
    }

    /// Walk the block in flight over `pos` with the committed `token`: whether it left the
    /// block's tree (a rejection, for both sides).
    fn walk(&mut self, pos: usize, token: u32) -> bool {
        let Some(f) = self
            .in_flight
            .iter_mut()
            .find(|f| f.block.start_pos <= pos && pos < f.end())
        else {
            return false;
        };
        match f.block.step(f.at, token) {
            Step::Expected(n) | Step::Diverted(n) => {
                f.at = n;
                false
            }
            Step::Off => true,
            Step::Leaf => false,
        }
    }

    /// Blocks wholly committed are answered by the commits (not the one a verdict answers).
    fn pop_covered(&mut self) {
        while let Some(f) = self.in_flight.front() {
            if f.end() > self.committed || self.answering == Some(f.block.index) {
                break;
            }
            self.in_flight.pop_front();
            self.stats.covered_blocks += 1;
        }
    }

    pub fn on_verdict(&mut self, v: Verdict) -> Result<Vec<Output>, SpecError> {
        let mut out = Vec::new();
        if v.epoch != self.epoch || self.done {
            self.stats.stale_verdicts += 1;
            return Ok(out);
        }
        let Some(front) = self.in_flight.front() else {
            return Err(SpecError::Protocol(format!(
                "verdict for block {} with no block in flight",
                v.block
            )));
        };
        let front = &front.block;
        if front.index != v.block {
            return Err(SpecError::Protocol(format!(
                "verdict for block {} but block {} is the oldest in flight",
                v.block, front.index
            )));
        }
        if v.accepted > front.tokens.len() && v.side_end.is_none() {
            return Err(SpecError::Protocol(format!(
                "verdict accepts {} tokens of a {}-token block",
                v.accepted,
                front.tokens.len()
            )));
        }
        let Some(path) = front.named_path(v.accepted, v.side_end) else {
            return Err(SpecError::Protocol(format!(
                "verdict names a path of {} tokens to side node {:?}, which block {} does not have",
                v.accepted, v.side_end, front.index
            )));
        };
        let start = front.start_pos;
        if start > self.committed || start + v.accepted < self.committed {
            return Err(SpecError::Protocol(format!(
                "verdict for the block at {start} accepting {} tokens does not continue the {} committed",
                v.accepted, self.committed
            )));
        }
        let path: Vec<u32> = path
            .iter()
            .map(|&n| front.token(n).expect("invariant: path nodes have tokens"))
            .collect();
        self.stats.verdicts += 1;
        self.last_lead = Some(self.committed - start);
        let from = self.committed;
        self.answering = Some(v.block);
        let mut taken = Ok(());
        for pos in self.committed..start + v.accepted {
            if self.done || taken.is_err() {
                break;
            }
            taken = self.take(pos, path[pos - start], &mut out);
        }
        if !self.done && taken.is_ok() {
            taken = self.take(start + v.accepted, v.token, &mut out);
        }
        self.answering = None;
        if self
            .in_flight
            .front()
            .is_some_and(|f| f.block.index == v.block)
        {
            self.in_flight.pop_front();
        }
        self.pop_covered();
        taken?;
        self.stats.verdict_tokens += self.committed - from;
        let accepted_end = (start + v.accepted).min(self.committed);
        self.stats.verdict_accepted += accepted_end.saturating_sub(from);
        // By block position, the same tokens: those this verdict accepted that were not
        // committed before it.
        for pos in from.max(start)..accepted_end {
            if let Some(n) = self.stats.accepted_at.get_mut(pos - start) {
                *n += 1;
            }
        }
        if self.done {
            return Ok(out);
        }
        if !self.done {
            self.try_send(&mut out);
        }
        Ok(out)
    }

    /// A token the verifier decoded itself ([`Decoded`]): committed like any other.
    pub fn on_decoded(&mut self, d: Decoded) -> Result<Vec<Output>, SpecError> {
        let mut out = Vec::new();
        if self.done {
            return Ok(out);
        }
        if d.epoch > self.epoch {
            return Err(SpecError::Protocol(format!(
                "decoded token of epoch {}, ahead of the edge's epoch {}",
                d.epoch, self.epoch
            )));
        }
        let before = self.committed;
        self.take(d.pos, d.token, &mut out)?;
        if d.guessed && self.committed > before {
            self.stats.verifier_guessed += 1;
        }
        if !self.done {
            self.try_send(&mut out);
        }
        Ok(out)
    }

    /// The connection died: every block in flight is lost. The committed history stays; the next
    /// connection re-opens the session from it as a new session, whose epochs start again at 0
    /// (nothing of the old stream can arrive on the new one).
    /// A new session, opened over the committed history after a lost connection, answered with
    /// the target's token after that history: commit it (as [`Pipeline::with_first`] does) and
    /// draft on from there. Optional: the verifier also accepts a block that starts with it.
    pub fn on_reopened(&mut self, first: u32) -> Vec<Output> {
        let mut out = Vec::new();
        if self.done || self.tokens.len() != self.committed {
            return out;
        }
        self.tokens.push(first);
        self.stats.cloud_tokens += 1;
        self.sent = self.committed + 1;
        self.commit_to(self.committed + 1, &mut out);
        out
    }

    pub fn on_connection_lost(&mut self) -> Vec<Output> {
        let mut out = Vec::new();
        self.drafting = true;
        self.drop_speculation(&mut out);
        self.epoch = 0;
        out
    }

    /// Forget every block in flight and the speculative tail; the draft rolls back to the
    /// committed sequence.
    fn drop_speculation(&mut self, out: &mut Vec<Output>) {
        self.stats.wasted_draft_tokens += self.tokens.len() - self.committed;
        self.drop_in_flight(0);
        self.cut_tail(self.committed);
        self.lanes.clear();
        self.sent = self.committed;
        if self.draft_fed > self.committed {
            self.draft_fed = self.committed;
            out.push(Output::Rollback { to: self.committed });
        }
    }
}
