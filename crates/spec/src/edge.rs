//! [`EdgeSession`]: the edge's side of one session, IO-free — the speculation [`Pipeline`], the
//! verifier's grant, the running estimates of the model's inputs, the adaptive choice of γ and
//! depth, and the decision to reopen a session after a lost connection. The edge runtime (a draft
//! model and a gRPC link) and the simulator (a synthetic draft on simulated time) drive the same
//! session: they feed it what arrived and what was drafted, with the time, and carry out the
//! [`Output`]s it returns.

use std::collections::HashMap;

use serde::Serialize;

use crate::cloud_session::ACK_EVERY;
use crate::never_idle;
use crate::pipeline::{
    BlockId, Decoded, Frontier, Grown, Next, Output, Pipeline, PipelineConfig, Shape, SparseDist,
    TreeConfig, Verdict,
};
use crate::policy::{Costs, Estimator};
use crate::SpecError;

/// What the verifier sends a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming {
    Verdict(Verdict),
    /// A token it decoded itself, having no block of the session to verify.
    Decoded(Decoded),
    /// Its answer to the Open of a session started with [`EdgeSession::opening`]: the first
    /// token, committed at the prompt's length like a decoded one, and the grant at Open.
    Opened(Opened),
}

/// The verifier's lead the edge drafts ahead for, at most (tokens).
const MAX_LEAD: usize = 32;

/// A draft right less often than this (over its recent judged positions) is paused: the verifier
/// decodes the session anyway, and draft forwards would only delay the edge's handling of each
/// token it streams.
const MIN_DRAFT_ALPHA: f64 = 0.3;
/// Judged positions (decayed) before the edge judges its draft, and tokens it then pauses for.
const DRAFT_JUDGED_MIN: f64 = 8.0;
const PAUSE_TOKENS: usize = 16;

/// How long the edge keeps trying to reopen a session after its connection is lost (a
/// verifier's restart takes seconds), by default.
pub const RECONNECT_WINDOW_MS: u64 = 30_000;
/// The first wait between tries, doubling up to [`REOPEN_MAX_WAIT_MS`], each jittered down to
/// half (so that edges cut off together do not come back together).
pub const REOPEN_FIRST_WAIT_MS: u64 = 100;
pub const REOPEN_MAX_WAIT_MS: u64 = 2_000;

/// The adaptive policy re-plans only for a predicted gain of this share, so that noise does not
/// make the shape flap.
const REPLAN_GAIN: f64 = 0.95;

/// Bounds and starting guesses of the adaptive policy.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct AutoShape {
    /// The cloud's grant: γ and depth never exceed these.
    pub max_draft_len: usize,
    pub max_depth: usize,
    /// What the policy assumes before it has measured anything.
    pub prior: Costs,
}

/// The policy's assumptions before it has measured anything: a draft about as good as a 4-bit
/// copy of the target (α 0.7), a draft forward half as long as a verify.
pub fn default_prior(rtt_ms: f64) -> Costs {
    Costs {
        alpha: 0.7,
        draft_ms: 30.0,
        verify_ms: 60.0,
        verify_ms_per_token: 0.0,
        rtt_ms,
        verdict_ms: 1.0,
    }
}

/// The shape an edge session wants and may use.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SessionConfig {
    /// γ and depth the edge wants (the start, with `auto`).
    pub draft_len: usize,
    pub depth: usize,
    pub max_new_tokens: usize,
    /// Let the policy re-plan γ and depth as it measures.
    pub auto: Option<AutoShape>,
    /// Token trees (within the side nodes the verifier granted at Open).
    pub tree: TreeConfig,
}

/// The verifier's answer to a session's Open: the target's first token and the session's grant
/// (γ and depth; the side nodes a token tree may carry). The shape stays within the grant, and
/// within each later one that verdicts bring as the verifier's load changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    pub first: u32,
    pub grant: Shape,
    pub side_nodes: usize,
}

/// What the edge measured during a session (milliseconds).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Measured {
    /// Mean time of one draft forward.
    pub draft_ms: f64,
    /// Mean verifier forward time per verdict that needed one.
    pub verify_ms: f64,
    /// Mean time from sending a block to its verdict's arrival.
    pub block_round_trip_ms: f64,
    /// The round trip as the policy sees it (smallest recent arrival − send − verify).
    pub net_ms: f64,
    /// The edge's own time per verdict outside draft forwards and waits: handling verdicts,
    /// rolling the draft back, sending blocks, the caller's display.
    pub verdict_ms: f64,
    /// γ and depth at the end, and how often the policy changed them.
    pub final_draft_len: usize,
    pub final_depth: usize,
    pub reshapes: usize,
    /// Sessions reopened after a lost connection.
    pub reconnects: usize,
    /// Tokens the verifier decoded itself (no block of this session to verify at the time).
    pub cloud_decoded: usize,
    /// The verifier's lead at the end: tokens it had committed past a block's start when it
    /// planned the block (smoothed).
    pub lead: f64,
    /// Times drafting was paused because the draft was almost always wrong.
    pub draft_pauses: usize,
}

/// What a message did, beyond the outputs: a rejected draft token, for the user's view.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reaction {
    pub outputs: Vec<Output>,
    /// The target rejected the draft's token here: `(draft's token, target's token)`.
    pub correction: Option<(u32, u32)>,
}

/// Where a reconnection stands: tries that failed since the connection was lost, the time since
/// then, the window it may take, the wait the verifier asked for with its last refusal
/// (`retry-after-ms`), and a uniform draw in [0, 1) for the jitter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reconnecting {
    pub attempt: u32,
    pub elapsed_ms: u64,
    pub window_ms: u64,
    pub retry_after_ms: Option<u64>,
    pub jitter: f64,
}

impl Reconnecting {
    /// How long to wait before the next try: None once the window is spent. The wait doubles
    /// from [`REOPEN_FIRST_WAIT_MS`] to [`REOPEN_MAX_WAIT_MS`], jittered down to half, never
    /// shorter than the verifier asked, never past the window. The same for a session whose
    /// connection was lost and for a first `Open` that found no verifier.
    pub fn wait_ms(&self) -> Option<u64> {
        if self.elapsed_ms >= self.window_ms {
            return None;
        }
        let base = (REOPEN_FIRST_WAIT_MS << self.attempt.min(16)).min(REOPEN_MAX_WAIT_MS);
        let jittered = base / 2 + (base as f64 / 2.0 * self.jitter.clamp(0.0, 1.0)) as u64;
        Some(
            jittered
                .max(self.retry_after_ms.unwrap_or(0))
                .min(self.window_ms - self.elapsed_ms),
        )
    }
}

/// When and how to reopen a session after a lost connection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reopen {
    /// Wait this long first.
    pub after_ms: u64,
    /// New tokens the reopened session may still produce.
    pub max_tokens: usize,
}

/// Sums behind [`Measured`]'s means.
#[derive(Debug, Clone, Default)]
struct Totals {
    draft_ms: f64,
    draft_steps: usize,
    verify_ms: f64,
    verified: usize,
    round_trip_ms: f64,
    arrivals: usize,
    /// Verdict arrivals since the edge last reported its own work.
    unreported_arrivals: usize,
}

/// A grant as the edge's sizes (a speculating edge drafts at least one token, one block deep).
fn sizes(s: Shape) -> (usize, usize) {
    (s.draft_len.max(1) as usize, s.depth.max(1) as usize)
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct EdgeSession {
    p: Pipeline,
    cfg: SessionConfig,
    /// The verifier's current grant, as the edge's sizes.
    cap: (usize, usize),
    /// The grant at Open (None until the verifier answered it).
    open_grant: Option<Shape>,
    est: Estimator,
    /// When each block in flight was sent (ms on the driver's clock).
    sent_at: HashMap<BlockId, f64>,
    totals: Totals,
    m: Measured,
    /// The verifier's lead, smoothed over verdicts.
    lead: f64,
    /// The grant lets the session draft (γ > 0).
    granted_drafting: bool,
    /// The draft's recent record (decayed accepted and judged positions) and the counters seen.
    recent: (f64, f64),
    seen: (usize, usize),
    /// Drafting is paused (a useless draft) until this many tokens are committed.
    paused_until: Option<usize>,
    /// Committed tokens last acknowledged to the verifier (flow control).
    acked: usize,
    /// The edge has said something to the verifier (a block, an ack) since the session opened
    /// (or reopened).
    spoken: bool,
}

impl EdgeSession {
    /// A session over `prompt`, already open on the verifier, which answered with the target's
    /// `first` token at `now_us`: the outputs commit it.
    pub fn new(
        now_us: u64,
        prompt: Vec<u32>,
        opened: Opened,
        cfg: SessionConfig,
        eog: Vec<u32>,
    ) -> Result<(Self, Vec<Output>), SpecError> {
        let now_ms = as_ms(now_us);
        let mut cfg = cfg;
        cfg.tree.side_nodes = cfg.tree.side_nodes.min(opened.side_nodes);
        let grant = Some(opened.grant);
        let pcfg = Self::pipeline_config(&cfg, grant);
        let (p, out) = Pipeline::with_first(prompt, opened.first, pcfg, eog)?;
        Self::start(now_ms, p, out, cfg, grant)
    }

    /// A session whose `Open` is still on its way: the edge drafts from the prompt at once, its
    /// first block starting at the first token's position, so that its guesses reach the verifier
    /// as the prompt's prefill ends instead of a round trip later. The verifier's `Opened` comes
    /// as the commit of that position ([`Incoming::Opened`]: the first token at the prompt's length,
    /// with the grant), judged against the draft's guess like any token the verifier decoded.
    /// Linear blocks only: a tree's side nodes wait for the grant that bounds them.
    pub fn opening(
        now_us: u64,
        prompt: Vec<u32>,
        cfg: SessionConfig,
        eog: Vec<u32>,
    ) -> Result<(Self, Vec<Output>), SpecError> {
        let now_ms = as_ms(now_us);
        if cfg.tree.side_nodes > 0 {
            return Err(SpecError::InvalidConfig {
                field: "tree",
                message: "a session drafting before its Open is answered sends linear blocks"
                    .into(),
            });
        }
        let p = Pipeline::new(prompt, Self::pipeline_config(&cfg, None), eog)?;
        Self::start(now_ms, p, Vec::new(), cfg, None)
    }

    fn pipeline_config(cfg: &SessionConfig, grant: Option<Shape>) -> PipelineConfig {
        let cap = sizes(grant.unwrap_or(Shape::UNLIMITED));
        PipelineConfig {
            draft_len: cfg.draft_len.min(cap.0).max(1),
            depth: cfg.depth.min(cap.1).max(1),
            max_new_tokens: cfg.max_new_tokens,
        }
    }

    fn start(
        now_ms: f64,
        mut p: Pipeline,
        out: Vec<Output>,
        cfg: SessionConfig,
        grant: Option<Shape>,
    ) -> Result<(Self, Vec<Output>), SpecError> {
        let cap = sizes(grant.unwrap_or(Shape::UNLIMITED));
        p.set_tree(cfg.tree);
        let prior = cfg.auto.map_or(
            Costs {
                alpha: 0.0,
                draft_ms: 0.0,
                verify_ms: 0.0,
                verify_ms_per_token: 0.0,
                rtt_ms: 0.0,
                verdict_ms: 0.0,
            },
            |a| a.prior,
        );
        let mut s = Self {
            p,
            cfg,
            cap,
            open_grant: grant,
            est: Estimator::new(prior),
            sent_at: HashMap::new(),
            totals: Totals::default(),
            m: Measured::default(),
            lead: 0.0,
            granted_drafting: true,
            recent: (0.0, 0.0),
            seen: (0, 0),
            paused_until: None,
            acked: 0,
            spoken: false,
        };
        s.acked = s.p.committed_len();
        let mut out = out;
        if let Some(g) = grant {
            s.granted_drafting = g.draft_len > 0;
            out.extend(s.p.set_drafting(s.granted_drafting));
        }
        s.sent(now_ms, &out);
        s.ack(&mut out);
        Ok((s, out))
    }

    pub fn pipeline(&self) -> &Pipeline {
        &self.p
    }

    /// Whether the verifier's grant lets the session draft (false while the verifier decodes
    /// it itself: γ 0; true before `Opened`).
    pub fn drafting_granted(&self) -> bool {
        self.granted_drafting
    }

    /// What the driver should do next (draft after feeding `pipeline().tokens()` from
    /// `pipeline().draft_fed()` on, wait for a message, or stop).
    pub fn next(&self) -> Next {
        self.p.next()
    }

    /// Remember when the blocks among `out` left.
    fn sent(&mut self, now_ms: f64, out: &[Output]) {
        for o in out {
            match o {
                Output::Send(b) => {
                    self.sent_at.insert(b.index, now_ms);
                    self.spoken = true;
                }
                Output::Ack { .. } => self.spoken = true,
                _ => {}
            }
        }
    }

    /// A new grant from the verifier: draft within it (γ 0: draft nothing, the verifier decodes
    /// every token).
    fn apply_grant(
        &mut self,
        grant: Shape,
        want: (usize, usize),
    ) -> Result<Vec<Output>, SpecError> {
        self.cap = sizes(grant);
        self.granted_drafting = grant.draft_len > 0;
        // A grant below the one at Open means a loaded verifier, where every verified position
        // costs it what a decoded one does: side nodes go first, before γ does, and come back
        // with the full grant.
        let full = self
            .open_grant
            .is_none_or(|g| grant.draft_len >= g.draft_len && grant.depth >= g.depth);
        self.p.set_tree(if full {
            self.cfg.tree
        } else {
            TreeConfig::LINEAR
        });
        let mut out = self
            .p
            .set_drafting(self.granted_drafting && self.paused_until.is_none());
        out.extend(self.fit_shape(want)?);
        Ok(out)
    }

    /// Follow the verifier's lead: keep that many more tokens in flight, so that blocks reach
    /// past what it decodes while they travel. A verdict measures it (how far past the block's
    /// start the verifier had committed); a block covered by commits before it was verified says
    /// the lead was longer than the blocks reached: one token more each time.
    fn follow_lead(&mut self, verdicts_before: usize, covered_before: usize) -> Vec<Output> {
        let s = *self.p.stats();
        let mut lead = self.lead;
        lead += (s.covered_blocks - covered_before) as f64;
        if let (Some(l), true) = (self.p.last_lead(), s.verdicts > verdicts_before) {
            lead += 0.3 * (l as f64 - lead);
        }
        if lead == self.lead {
            return Vec::new();
        }
        self.lead = lead.min(MAX_LEAD as f64);
        self.p.set_lead(self.lead.ceil() as usize)
    }

    /// Keep the pipeline's shape within the grant, aiming at `want`.
    fn fit_shape(&mut self, want: (usize, usize)) -> Result<Vec<Output>, SpecError> {
        let shape = (want.0.min(self.cap.0).max(1), want.1.min(self.cap.1).max(1));
        if shape == (self.p.config().draft_len, self.p.config().depth) {
            return Ok(Vec::new());
        }
        self.m.reshapes += 1;
        self.p.set_shape(shape.0, shape.1)
    }

    /// The draft produced `token` (with its distribution `q` when the verify rule needs it) at
    /// `now_us`, in a forward of `ms`; `prefill`: that forward also fed the prompt (its time is
    /// not a draft step's).
    pub fn on_drafted(
        &mut self,
        now_us: u64,
        token: u32,
        q: Option<SparseDist>,
        ms: f64,
        prefill: bool,
    ) -> Vec<Output> {
        let now_ms = as_ms(now_us);
        self.count_draft(ms, prefill);
        let out = self.p.on_drafted(token, q);
        self.sent(now_ms, &out);
        out
    }

    /// What the drafter grows next (see [`Pipeline::frontier`]).
    pub fn frontier(&self) -> Frontier {
        self.p.frontier()
    }

    /// The drafter grew the frontier at `now_us`, in a forward of `ms` (`prefill`: that forward
    /// also fed the prompt): one token per leaf.
    pub fn on_grown(
        &mut self,
        now_us: u64,
        grown: Vec<Grown>,
        ms: f64,
        prefill: bool,
    ) -> Result<Vec<Output>, SpecError> {
        let now_ms = as_ms(now_us);
        self.count_draft(ms, prefill);
        let out = self.p.on_grown(grown)?;
        self.sent(now_ms, &out);
        Ok(out)
    }

    /// The drafter grew `asked` at `now_us` in a forward of `ms`, while messages that arrived
    /// meanwhile were applied: the tokens count when `asked` is still the frontier (see
    /// [`Pipeline::on_grown_at`]); `None`: they were dropped.
    pub fn on_grown_at(
        &mut self,
        now_us: u64,
        asked: &Frontier,
        grown: Vec<Grown>,
        ms: f64,
        prefill: bool,
    ) -> Result<Option<Vec<Output>>, SpecError> {
        let now_ms = as_ms(now_us);
        self.count_draft(ms, prefill);
        let out = self.p.on_grown_at(asked, grown)?;
        if let Some(out) = &out {
            self.sent(now_ms, out);
        }
        Ok(out)
    }

    /// A draft forward of `ms` ran: the policy's estimate and the totals count it, unless it
    /// also fed the prompt (`prefill`: not a draft step's time).
    fn count_draft(&mut self, ms: f64, prefill: bool) {
        if !prefill {
            self.est.on_draft(ms);
            self.totals.draft_ms += ms;
            self.totals.draft_steps += 1;
        }
    }

    /// A message from the verifier arrived at `now_us`.
    pub fn on_message(&mut self, now_us: u64, msg: Incoming) -> Result<Reaction, SpecError> {
        let now_ms = as_ms(now_us);
        let mut r = Reaction::default();
        let v = match msg {
            Incoming::Verdict(v) => v,
            Incoming::Decoded(d) => {
                self.m.cloud_decoded += 1;
                return self.on_commit(now_ms, d);
            }
            Incoming::Opened(o) => {
                if self.open_grant.is_some() {
                    return Err(SpecError::Protocol(
                        "Opened for a session the verifier had opened already".into(),
                    ));
                }
                self.open_grant = Some(o.grant);
                let first = Decoded {
                    epoch: 0,
                    pos: self.p.prompt_len(),
                    token: o.first,
                    grant: Some(o.grant),
                    guessed: false,
                };
                return self.on_commit(now_ms, first);
            }
        };
        if let Some(t) = self.sent_at.remove(&v.block) {
            let rt = now_ms - t;
            let vms = v.verify_us as f64 / 1e3;
            self.est.on_verdict(rt, vms);
            self.totals.round_trip_ms += rt;
            self.totals.arrivals += 1;
            self.totals.unreported_arrivals += 1;
            if v.verify_us > 0 {
                self.totals.verify_ms += vms;
                self.totals.verified += 1;
            }
        }
        let (from, rejections) = (self.p.committed_len(), self.p.stats().rejections);
        let before = self.p.tokens()[from..].to_vec();
        let (verdicts, covered) = (self.p.stats().verdicts, self.p.stats().covered_blocks);
        r.outputs = self.p.on_verdict(v)?;
        r.outputs.extend(self.follow_lead(verdicts, covered));
        // The verifier's load changed its grant: keep within it (and grow back into it).
        if let Some(grant) = v.grant {
            let want = match self.cfg.auto {
                // The policy re-plans within the new bounds below.
                Some(_) => (self.p.config().draft_len, self.p.config().depth),
                None => (self.cfg.draft_len, self.cfg.depth),
            };
            r.outputs.extend(self.apply_grant(grant, want)?);
        }
        if self.p.stats().rejections > rejections {
            let now = &self.p.tokens()[from..];
            r.correction = before
                .iter()
                .zip(now)
                .find(|(b, n)| b != n)
                .map(|(&b, &n)| (b, n));
        }
        if let Some(shape) = self.replan() {
            r.outputs.extend(self.p.set_shape(shape.0, shape.1)?);
            self.m.reshapes += 1;
        }
        r.outputs.extend(self.gate_drafting());
        self.forget_answered();
        self.ack(&mut r.outputs);
        self.sent(now_ms, &r.outputs);
        Ok(r)
    }

    /// A token the verifier committed without a block (decoded alone, or the first at Open),
    /// with the grant it may bring.
    fn on_commit(&mut self, now_ms: f64, d: Decoded) -> Result<Reaction, SpecError> {
        let mut r = Reaction::default();
        let (from, rejections) = (self.p.committed_len(), self.p.stats().rejections);
        let before = self.p.tokens()[from..].to_vec();
        let (verdicts, covered) = (self.p.stats().verdicts, self.p.stats().covered_blocks);
        r.outputs = self.p.on_decoded(d)?;
        r.outputs.extend(self.follow_lead(verdicts, covered));
        if self.p.stats().rejections > rejections {
            r.correction = before.first().map(|&b| (b, d.token));
        }
        if let Some(grant) = d.grant {
            let want = (self.cfg.draft_len, self.cfg.depth);
            r.outputs.extend(self.apply_grant(grant, want)?);
        }
        r.outputs.extend(self.gate_drafting());
        self.forget_answered();
        self.ack(&mut r.outputs);
        self.sent(now_ms, &r.outputs);
        Ok(r)
    }

    /// Acknowledge the committed tokens every [`ACK_EVERY`] of them, so that the verifier, which
    /// commits at most [`FLOW_WINDOW`](crate::cloud_session::FLOW_WINDOW) past the last ack,
    /// keeps going. (Not once the session is done: the verifier stops at the token limit or end
    /// of generation by itself.) The first token the verifier commits is acknowledged at once
    /// when the edge has said nothing yet since the session opened: a verifier puts a session
    /// whose edge stays silent after its `Open` in the background (it takes the edge for gone),
    /// and an edge that is there but sends no block — the verifier took the session over (γ 0),
    /// or the draft is still prefilling a long prompt — would otherwise first speak
    /// [`ACK_EVERY`] tokens later, past the verifier's quiet time under load.
    fn ack(&mut self, out: &mut Vec<Output>) {
        let c = self.p.committed_len();
        let first = !self.spoken && c > self.p.prompt_len();
        if self.p.next() != Next::Done && (first || c >= self.acked + ACK_EVERY) {
            self.acked = c;
            self.spoken = true;
            out.push(Output::Ack { committed: c });
        }
    }

    /// Pause a draft that is almost always wrong, for [`PAUSE_TOKENS`] commits, then try again.
    fn gate_drafting(&mut self) -> Vec<Output> {
        let s = *self.p.stats();
        let (a, r) = (s.accepted - self.seen.0, s.rejections - self.seen.1);
        self.seen = (s.accepted, s.rejections);
        let decay = 0.9f64.powi((a + r) as i32);
        self.recent = (
            decay * self.recent.0 + a as f64,
            decay * self.recent.1 + (a + r) as f64,
        );
        let committed = self.p.committed_len();
        match self.paused_until {
            Some(at) if committed >= at => {
                self.paused_until = None;
                self.recent = (0.0, 0.0);
                self.p.set_drafting(self.granted_drafting)
            }
            Some(_) => Vec::new(),
            None if self.recent.1 >= DRAFT_JUDGED_MIN
                && self.recent.0 < MIN_DRAFT_ALPHA * self.recent.1 =>
            {
                self.paused_until = Some(committed + PAUSE_TOKENS);
                self.m.draft_pauses += 1;
                self.p.set_drafting(false)
            }
            None => Vec::new(),
        }
    }

    /// Blocks answered by commits alone (covered) or dropped get no verdict to time.
    fn forget_answered(&mut self) {
        if self.sent_at.len() > self.p.blocks_in_flight() {
            let live: std::collections::HashSet<BlockId> = self.p.in_flight_ids().collect();
            self.sent_at.retain(|id, _| live.contains(id));
        }
    }

    /// With the adaptive policy: the shape to change to, when protocol 2's model
    /// ([`never_idle`]) predicts a clear gain over the current one.
    fn replan(&self) -> Option<(usize, usize)> {
        let a = self.cfg.auto?;
        let s = *self.p.stats();
        let costs = self.est.costs(s.accepted, s.accepted + s.rejections);
        let max_g = a.max_draft_len.min(self.cap.0).max(1);
        let max_d = a.max_depth.min(self.cap.1).max(1);
        let (g, d) = (self.p.config().draft_len, self.p.config().depth);
        let (best_g, best_d, best_ms) = never_idle::best_shape(&costs, max_g, max_d);
        let now_ms = never_idle::itl_ms(&costs, g, d);
        ((best_g, best_d) != (g, d) && best_ms < REPLAN_GAIN * now_ms).then_some((best_g, best_d))
    }

    /// The edge spent `ms` of its own time (outside draft forwards and waits for the verifier)
    /// since it last said: spread over the verdicts that arrived meanwhile.
    pub fn on_edge_work(&mut self, ms: f64) {
        let n = std::mem::take(&mut self.totals.unreported_arrivals);
        self.est.on_edge_work(ms, n);
    }

    /// The connection died: keep what is verified, drop the rest.
    pub fn on_connection_lost(&mut self) -> Vec<Output> {
        self.sent_at.clear();
        self.p.on_connection_lost()
    }

    /// Whether (and when) to try reopening, `r` failed tries since the connection was lost:
    /// None means give up (the window is spent). The wait doubles from
    /// [`REOPEN_FIRST_WAIT_MS`] to [`REOPEN_MAX_WAIT_MS`], jittered down to half, never shorter
    /// than the verifier asked, never past the window.
    pub fn reopen(&self, r: Reconnecting) -> Option<Reopen> {
        Some(Reopen {
            after_ms: r.wait_ms()?,
            max_tokens: self.cfg.max_new_tokens - self.p.output().len(),
        })
    }

    /// The committed history a reopened session starts from.
    pub fn committed(&self) -> &[u32] {
        &self.p.tokens()[..self.p.committed_len()]
    }

    /// A session reopened over the committed history answered with the target's `first` token.
    pub fn on_reopened(&mut self, first: u32) -> Vec<Output> {
        self.m.reconnects += 1;
        let mut out = self.p.on_reopened(first);
        self.acked = self.p.committed_len();
        // The reopened session is a new one to the verifier: the edge speaks in it at once.
        self.spoken = out.iter().any(|o| matches!(o, Output::Send(_)));
        self.ack(&mut out);
        out
    }

    /// What the session measured so far.
    pub fn measured(&self) -> Measured {
        let mean = |t: f64, n: usize| if n == 0 { 0.0 } else { t / n as f64 };
        let t = &self.totals;
        Measured {
            draft_ms: mean(t.draft_ms, t.draft_steps),
            verify_ms: mean(t.verify_ms, t.verified),
            block_round_trip_ms: mean(t.round_trip_ms, t.arrivals),
            net_ms: self.est.costs(0, 0).rtt_ms,
            verdict_ms: self.est.edge_ms_per_verdict().unwrap_or(0.0),
            final_draft_len: self.p.config().draft_len,
            final_depth: self.p.config().depth,
            lead: self.lead,
            ..self.m
        }
    }
}

/// The driver's clock (µs, as every core takes it) in the ms the session's estimates use.
fn as_ms(us: u64) -> f64 {
    us as f64 / 1e3
}

#[cfg(test)]
mod tests;
