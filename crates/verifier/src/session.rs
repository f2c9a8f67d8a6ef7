//! The one record the verifier keeps per open session, and what its iterations report.

use std::collections::VecDeque;

use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, BlockId, CloudSession, Decoded, Feed, Verdict, VerifyRule};

use crate::control::Ctl;
use crate::VerifierError;

/// Something an iteration (or a message from an edge) produced for one session, made into its
/// edge's message by the turn that sends it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Event {
    /// A session was admitted (its prefill is to come).
    Admitted { session: SessionId },
    /// The target's log-probabilities of tokens committed in this forward (before the event that
    /// commits them).
    Logprobs {
        session: SessionId,
        entries: Vec<tandem_spec::sampling::TokenLogprob>,
    },
    /// A speculation session's prompt is prefilled; `first` is the target's first token.
    Opened {
        session: SessionId,
        first: u32,
        /// Its log-probability, when the session asked for them.
        first_logprob: Option<tandem_spec::sampling::TokenLogprob>,
    },
    /// A block's verdict: `drafted` tokens past the committed ones were judged and `accepted` of
    /// them accepted, in a forward over `positions` positions (the last committed token in
    /// front).
    Verdict {
        session: SessionId,
        verdict: Verdict,
        drafted: usize,
        accepted: usize,
        positions: usize,
    },
    /// A token of a cloud-only generation.
    Token {
        session: SessionId,
        token: u32,
        done: bool,
    },
    /// A message of the session was refused; the session goes on unless `fatal`.
    Error {
        session: SessionId,
        error: VerifierError,
        fatal: bool,
    },
    /// The session's KV was dropped to make room; it is recomputed before its next verify.
    Preempted { session: SessionId },
    /// A token of a speculation session the verifier decoded itself, in a forward in which the
    /// session had no block to verify (or, taken over, verifies none).
    Decoded {
        session: SessionId,
        decoded: Decoded,
        /// The edge drafted it: a token of a block trimmed to the grant, found right (see
        /// [`tandem_spec::Finished::partial`]), not one the verifier decoded on its own.
        drafted: bool,
    },
}

impl Event {
    pub fn session(&self) -> SessionId {
        match self {
            Event::Admitted { session }
            | Event::Logprobs { session, .. }
            | Event::Opened { session, .. }
            | Event::Verdict { session, .. }
            | Event::Token { session, .. }
            | Event::Error { session, .. }
            | Event::Preempted { session }
            | Event::Decoded { session, .. } => *session,
        }
    }
}

/// The forward planned for a speculation session: one chunk per session per forward.
pub(crate) enum Scheduled {
    /// Verify a block's tokens past the committed ones (planning moved nothing: a failed
    /// forward only puts the block back).
    Verify { block: Block, feed: Feed },
    /// Decode the session's next token.
    Decode { feed: Feed },
}

impl Scheduled {
    pub fn feed(&self) -> &Feed {
        match self {
            Scheduled::Verify { feed, .. } | Scheduled::Decode { feed } => feed,
        }
    }
}

/// Counters of the verifier.
#[derive(Debug, Clone, Copy, Default)]
pub struct VerifierStats {
    /// Forward passes of the target (prefill chunks included).
    pub target_forwards: u64,
    /// Blocks verified in a forward; dropped without one as covered (every token already
    /// committed, agreeing) or contradicted (one disagrees with a committed token).
    pub blocks_verified: u64,
    pub blocks_covered: u64,
    pub blocks_contradicted: u64,
    /// Forwards that fed only the first positions of a block drafted under a larger grant than
    /// the session's now, which the target followed, with more of the block to come (see
    /// [`tandem_spec::Finished::partial`]).
    pub partial_verifies: u64,
    /// Tokens of speculation sessions the verifier decoded itself.
    pub spec_decoded: u64,
    /// Guesses the verifier copied from sessions' own text and fed while decoding them alone,
    /// and those the target accepted (committed besides the token decoded).
    pub self_draft_guesses: u64,
    pub self_drafted: u64,
    /// Running mean of the tokens per forward (0 once the verifier goes idle): its load.
    pub tokens_per_forward: f64,
    /// Tokens recomputed after preemption.
    pub recomputed_tokens: u64,
    /// Speculation sessions decoded in the background now: their edge went quiet
    /// ([`crate::LoadConfig::quiet_ms`]).
    pub quiet_sessions: usize,
}

/// What a session asks of the verifier.
// One per session, never moved in bulk: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Work {
    /// Speculation: the edge drafts, the verifier verifies its blocks and decodes the session
    /// itself in every forward it has none to verify (every forward, once taken over).
    Spec {
        rule: VerifyRule,
        /// Its edge let the verifier draft for it from its own text (when the verifier does).
        self_draft: bool,
        /// None until the prompt is prefilled.
        vs: Option<CloudSession>,
        /// Blocks received, planned in order when the session's next forward is.
        queue: VecDeque<Block>,
        /// The forward planned for the session (None: nothing to do, or not yet prefilled).
        planned: Option<Scheduled>,
        /// How often its drafts turn out right: whether verifying its blocks pays.
        draft: DraftRecord,
        /// Since when (the driver's µs) it has waited for its edge's next block with nothing
        /// planned ([`crate::VerifierConfig::await_drafts_ms`]).
        waiting_since: Option<u64>,
        /// Committed tokens (prompt included) at which it ends, and its end-of-generation ids.
        limit: usize,
        eog: Vec<u32>,
    },
    /// Cloud-only generation: the verifier produces every token.
    Generation {
        /// The last sampled token, fed next; None until the prompt is prefilled.
        next: Option<u32>,
        produced: usize,
        max_tokens: usize,
        eog: Vec<u32>,
        /// Its text indexed, when the verifier drafts for it, and the guesses planned for its
        /// next forward (fed behind `next`).
        suffix: Option<tandem_spec::SelfDrafter>,
        guesses: Vec<u32>,
    },
}

/// How often a speculation session's drafted tokens turn out to be the target's, over its recent
/// blocks (verified, covered by decoded tokens, contradicted). Verifying a block costs the forward
/// a logits row per drafted token (the output head is a fifth of SmolLM2's weights), so a draft
/// that is almost always wrong is not verified — its blocks wait until decoded tokens cover them,
/// which keeps measuring it — but for one block in [`PROBE_EVERY`], so that a draft that gets
/// better is verified again.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DraftRecord {
    accepted: f64,
    judged: f64,
    skipped: u32,
    /// The decision for the block it was last asked about.
    decided: Option<(BlockId, bool)>,
}

/// Below this share of drafted tokens right, blocks are not verified.
pub(crate) const MIN_VERIFY_ALPHA: f64 = 0.3;
/// A session whose blocks are not verified still has one in this many verified.
pub(crate) const PROBE_EVERY: u32 = 8;
/// Each block's weight decays by this per block after it.
const DRAFT_DECAY: f64 = 0.9;

impl Default for DraftRecord {
    /// Before any block: a draft about as good as a 4-bit copy of the target, worth two tokens.
    fn default() -> Self {
        Self {
            accepted: 1.4,
            judged: 2.0,
            skipped: 0,
            decided: None,
        }
    }
}

impl DraftRecord {
    /// `judged` drafted tokens met the committed ones, `accepted` of them right.
    pub fn record(&mut self, accepted: usize, judged: usize) {
        self.accepted = DRAFT_DECAY * self.accepted + accepted as f64;
        self.judged = DRAFT_DECAY * self.judged + judged as f64;
    }

    pub fn alpha(&self) -> f64 {
        self.accepted / self.judged.max(1e-9)
    }

    /// Whether to verify block `id` (the oldest usable one), decided once per block.
    pub fn verify(&mut self, id: BlockId) -> bool {
        if let Some((b, v)) = self.decided {
            if b == id {
                return v;
            }
        }
        let v = self.alpha() >= MIN_VERIFY_ALPHA || self.skipped + 1 >= PROBE_EVERY;
        self.skipped = if v { 0 } else { self.skipped + 1 };
        self.decided = Some((id, v));
        v
    }
}

/// When a session's tokens reached its edge, for the time to first token, the inter-token
/// latency and the queue time of its blocks (µs on the driver's clock).
#[derive(Debug, Clone, Default)]
pub(crate) struct Meter {
    pub opened_us: u64,
    /// When its edge last spoke (a block, an ack), or the session opened: its idle timeout
    /// counts from here ([`crate::LoadConfig::idle_timeout_ms`]).
    pub heard_us: u64,
    /// When its edge last spoke (a block, an ack), or its `Open` arrived: whether it is quiet
    /// counts from here ([`crate::LoadConfig::quiet_ms`]; unlike the idle timeout, not restarted
    /// by `Opened`: an edge that is there drafts from its `Open` on, or acks the first token at
    /// once when it sends no block, and a session that waited for its prefill longer than the
    /// quiet time without a word starts in the background).
    pub spoke_us: u64,
    /// Its edge has spoken (a block, an ack) since its `Open`.
    pub spoke: bool,
    pub last_commit_us: Option<u64>,
    /// Arrival times of blocks not yet answered, by block index, oldest first.
    pub arrivals: VecDeque<(tandem_spec::BlockId, u64)>,
}

/// The verifier's record of one open session. `H` is the driver's handle to reach its edge (a
/// gRPC stream's sender; `()` in the simulator).
pub(crate) struct Session<H> {
    pub tenant: TenantId,
    pub params: SamplingParams,
    /// A constrained session's grammar until its prompt is prefilled (a speculation session's
    /// then moves into its `CloudSession`); a generation's, at its state after its output.
    pub grammar: Option<Box<tandem_spec::Grammar>>,
    /// The target's log-probabilities asked for (alternatives each): a speculation session's.
    pub logprobs: Option<usize>,
    pub prompt_len: usize,
    /// The tokens the session's target KV holds (or will hold once recomputed).
    pub history: Vec<u32>,
    pub work: Work,
    /// What the load control knows of it.
    pub ctl: Ctl,
    pub meter: Meter,
    /// What it used so far (see [`crate::usage`]).
    pub counts: crate::usage::Counts,
    pub handle: H,
}

/// One open session's state, for the `GetSession` RPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionState {
    pub tenant: TenantId,
    /// Tokens committed (prompt included).
    pub committed_len: usize,
    pub epoch: u64,
    pub verified_positions: u64,
    /// Blocks waiting behind the one in verification, and whether one is.
    pub queued_blocks: usize,
    pub verifying: bool,
    pub prefilled: bool,
}

impl<H> Session<H> {
    /// A speculation session whose prompt is prefilled (its edge has had `Opened`).
    pub fn opened_speculation(&self) -> bool {
        matches!(&self.work, Work::Spec { vs: Some(_), .. })
    }

    pub fn state(&self) -> SessionState {
        match &self.work {
            Work::Spec {
                vs, queue, planned, ..
            } => SessionState {
                tenant: self.tenant,
                committed_len: vs.as_ref().map_or(self.prompt_len, |v| v.committed_len()),
                epoch: vs.as_ref().map_or(0, |v| v.epoch()),
                verified_positions: vs.as_ref().map_or(0, |v| v.verified_positions),
                queued_blocks: queue.len(),
                verifying: matches!(planned, Some(Scheduled::Verify { .. })),
                prefilled: vs.is_some(),
            },
            Work::Generation { next, produced, .. } => SessionState {
                tenant: self.tenant,
                committed_len: self.prompt_len + produced,
                epoch: 0,
                verified_positions: 0,
                queued_blocks: 0,
                verifying: false,
                prefilled: next.is_some(),
            },
        }
    }
}
