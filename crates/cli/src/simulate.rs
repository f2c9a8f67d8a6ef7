//! `tandem simulate`: a discrete-event simulation of many edges and verifier replicas, driven by
//! simulated time. The protocol code is the real one: each edge is a [`Pipeline`] (the edge's
//! state machine) and each replica a [`Verifier`] (per-session verify bookkeeping and the
//! multi-tenant scheduler), exactly as `tandem cloud serve` and the edge runtime drive them. Only
//! the models are replaced:
//! - the target ([`SimTarget`]) answers a forward with the roofline's time
//!   ([`ForwardCost`], from `tandem bench engine` or `cloud serve`'s calibration) and logits
//!   whose greedy token at every position is a fixed pseudo-random function of (session,
//!   position): the "target's output";
//! - each edge drafts a token in `draft_ms`, right with probability α;
//! - each message crosses the network in half its session's round trip, with jitter.
//!
//! Each replica is a [`VerifierCore`], the same core `cloud serve`'s batcher drives, here on
//! simulated time: it adapts to its load as `cloud serve` does (grants planned from the forward
//! cost, takeovers by pace) unless the shape is held fixed. Every committed token is
//! checked against the target's output, so the simulation also tests that the protocol stays
//! lossless at any scale.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use anyhow::{bail, Result};
use serde::Serialize;
use tandem_engine::{EngineError, Logits, SamplingParams, SeqChunk};
use tandem_sched::GrantPolicy;
use tandem_spec::plan::{operate_on, plan, ForwardCost, Workload};
use tandem_spec::policy::Costs;
use tandem_spec::sampling::uniform;
use tandem_spec::{Block, EdgeSession, Incoming, Next, Output, SessionConfig, VerifyRule};
use tandem_verifier::{
    Inbound, Mode, NewSession, Outgoing, Target, ToEdge, VerifierConfig, VerifierCore,
};

use crate::stats::Summary;

/// Vocabulary of the simulated target (token 0 is never produced).
const VOCAB: usize = 256;
/// KV token slots per block.
const BLOCK_SIZE: usize = 16;
/// An edge retries an open the verifier refused (saturated) after this long (µs).
const RETRY_US: u64 = 100_000;
/// A replica whose plan came out empty plans again after this long (µs), as the batcher does.
const THROTTLED_US: u64 = 2_000;

/// The target's greedy token at `pos` of session `seq`, after `prev` at `pos − 1`: a function of
/// what it was fed, so a verifier that fed a wrong token would get (and commit) a wrong one.
fn target_token(seed: u64, seq: u64, pos: usize, prev: u32) -> u32 {
    let key = (pos as u64) << 16 | prev as u64;
    1 + (uniform(seed ^ 0x7a6d, seq, key) * (VOCAB - 1) as f64) as u32 % (VOCAB as u32 - 1)
}

/// The target as a cost model: a forward of n tokens takes `cost.ms(n)`; its logits rows are
/// one-hot at the target's token for the next position.
pub struct SimTarget {
    pub cost: ForwardCost,
    pub num_blocks: usize,
    pub seed: u64,
    /// The last forward's duration (µs).
    pub last_us: u32,
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
        let seed = self.seed;
        let logits = Logits::one_hot(batch, VOCAB, |seq, pos, t| {
            target_token(seed, seq.0, pos + 1, t)
        });
        let t0: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let us = (self.cost.ms(t0 as f64) * 1e3).round() as u32;
        self.last_us = us;
        (Ok(logits), us)
    }
}

/// What one simulation runs.
#[derive(Debug, Clone, Serialize)]
pub struct SimConfig {
    /// Closed-loop users: each opens session after session.
    pub users: usize,
    pub replicas: usize,
    pub alpha: f64,
    pub draft_ms: f64,
    /// Mean round trip; each session draws its own within ± `rtt_spread_pct`, and each message
    /// gets ± `jitter_pct` of its half.
    pub rtt_ms: f64,
    pub rtt_spread_pct: f64,
    pub jitter_pct: f64,
    /// 0: cloud-only (the verifier decodes every session).
    pub gamma: usize,
    pub depth: usize,
    /// Replicas adapt γ and depth to their load and take sessions over, as `cloud serve` does
    /// (false: every session keeps γ and depth).
    pub adaptive: bool,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub token_budget: usize,
    pub kv_blocks: usize,
    pub cost: ForwardCost,
    pub warmup_s: f64,
    pub duration_s: f64,
    pub seed: u64,
}

/// One simulation's measurements (same definitions as `bench load`) beside the analytic model's
/// prediction for the same inputs.
#[derive(Debug, Clone, Serialize)]
pub struct SimRow {
    pub users: usize,
    pub replicas: usize,
    pub gamma: usize,
    pub depth: usize,
    pub adaptive: bool,
    pub tokens_per_s: f64,
    pub itl_ms: Summary,
    pub ttft_ms: Summary,
    pub tokens_per_forward: f64,
    pub forwards: u64,
    /// Busy share of the replicas over the window.
    pub utilization: f64,
    pub sessions_done: usize,
    /// Committed tokens that differ from the target's output (must be 0).
    pub wrong_tokens: usize,
    /// Messages refused at either end (must be 0).
    pub protocol_errors: usize,
    /// Share of the committed tokens the replicas decoded themselves (taken over or γ 0), over
    /// the whole run.
    pub cloud_decoded_share: f64,
    pub takeovers: usize,
    pub acceptance: f64,
    pub predicted_itl_ms: f64,
    pub predicted_tokens_per_s: f64,
    pub predicted_ttft_ms: f64,
    /// Events processed and the wall time the simulation took.
    pub events: u64,
    pub wall_s: f64,
}

#[derive(Debug)]
enum Ev {
    /// A user opens its next session.
    Start {
        user: usize,
    },
    /// Messages reach replica `r`.
    Open {
        r: usize,
        sid: u64,
    },
    Block {
        r: usize,
        sid: u64,
        block: Block,
    },
    Close {
        r: usize,
        sid: u64,
    },
    /// A replica's forward ends: its events go out.
    Done {
        r: usize,
    },
    /// A replica whose plan was empty looks again.
    Kick {
        r: usize,
    },
    /// An edge whose open was refused for load sends it again.
    Reopen {
        r: usize,
        sid: u64,
    },
    /// A message reaches an edge.
    ToEdge {
        sid: u64,
        msg: ToEdge,
    },
    /// An edge's draft forward ends.
    Drafted {
        sid: u64,
        token: u32,
    },
}

struct Session {
    user: usize,
    replica: usize,
    rtt_ms: f64,
    prompt: Vec<u32>,
    /// The edge's session, once the verifier opened it.
    edge: Option<EdgeSession>,
    /// Verdicts and decoded tokens that arrived while the edge was drafting, in order.
    pending: Vec<Incoming>,
    drafting: bool,
    start_us: u64,
    /// (µs, tokens) of each commit.
    commits: Vec<(u64, usize)>,
    committed: usize,
    /// The last committed token (the prompt's last at first).
    last: u32,
    /// Tokens that came as `Decoded` (the replica decoded them).
    decoded: usize,
    done: bool,
}

struct Replica {
    core: VerifierCore<SimTarget>,
    takeovers: usize,
    busy: bool,
    /// Messages that arrived during a forward, applied when it ends.
    inbox: Vec<Ev>,
    /// The running forward's messages, sent when it ends.
    outbox: Vec<Outgoing<()>>,
    busy_us: u64,
    forwards: u64,
    tokens: u64,
}

struct Sim {
    cfg: SimConfig,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Queued>>,
    sessions: HashMap<u64, Session>,
    next_sid: u64,
    replicas: Vec<Replica>,
    window: (u64, u64),
    wrong: usize,
    /// Protocol errors: refusals at either end (must be 0).
    errors: usize,
    /// When the last message on each (session, edge-to-cloud?) link arrives.
    last_arrival: HashMap<(u64, bool), u64>,
    drafted: u64,
    accepted: u64,
    done_sessions: Vec<Session>,
    events: u64,
}

/// An event due at `t` (µs); events due at the same time run in the order they were queued.
struct Queued {
    t: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        (self.t, self.seq) == (other.t, other.seq)
    }
}

impl Eq for Queued {}

impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Queued {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.t, self.seq).cmp(&(other.t, other.seq))
    }
}

impl Sim {
    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        let seq = self.seq;
        self.queue.push(Reverse(Queued { t, seq, ev }));
    }

    /// Deliver `ev` on session `sid`'s link in one direction (`up`: edge to cloud) after half a
    /// round trip, jittered, but never before the message sent on it just before: a gRPC stream
    /// keeps its order.
    fn send(&mut self, sid: u64, up: bool, ev: Ev) {
        let t = self.now + self.one_way(sid);
        let last = self.last_arrival.entry((sid, up)).or_insert(0);
        let t = t.max(*last + 1);
        *last = t;
        self.at(t, ev);
    }

    /// Half a round trip for session `sid`'s next message, jittered.
    fn one_way(&mut self, sid: u64) -> u64 {
        let rtt = self
            .sessions
            .get(&sid)
            .map_or(self.cfg.rtt_ms, |s| s.rtt_ms);
        self.seq += 1;
        let u = uniform(self.cfg.seed ^ 0x6a17, sid, self.seq) * 2.0 - 1.0;
        ((rtt / 2.0) * (1.0 + u * self.cfg.jitter_pct / 100.0) * 1e3).max(0.0) as u64
    }

    fn run(&mut self) {
        for user in 0..self.cfg.users {
            // Spread the first sessions over one round trip (at least 10 ms) so users are out of
            // phase.
            let t =
                (uniform(self.cfg.seed, user as u64, 1) * 1e3 * self.cfg.rtt_ms.max(10.0)) as u64;
            self.at(t, Ev::Start { user });
        }
        let end = self.window.1;
        while let Some(Reverse(Queued { t, ev, .. })) = self.queue.pop() {
            if t > end {
                break;
            }
            self.now = t;
            self.events += 1;
            self.handle(ev);
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Start { user } => {
                let sid = self.next_sid;
                self.next_sid += 1;
                let spread = (uniform(self.cfg.seed ^ 0x55, sid, 2) * 2.0 - 1.0)
                    * self.cfg.rtt_spread_pct
                    / 100.0;
                let prompt: Vec<u32> = (0..self.cfg.prompt_tokens)
                    .map(|i| target_token(self.cfg.seed ^ 0x9, sid, i, 0))
                    .collect();
                let last = *prompt
                    .last()
                    .expect("invariant: a prompt of at least one token");
                self.sessions.insert(
                    sid,
                    Session {
                        user,
                        replica: user % self.cfg.replicas,
                        rtt_ms: self.cfg.rtt_ms * (1.0 + spread),
                        prompt,
                        edge: None,
                        pending: Vec::new(),
                        drafting: false,
                        start_us: self.now,
                        commits: Vec::new(),
                        committed: 0,
                        last,
                        decoded: 0,
                        done: false,
                    },
                );
                let r = user % self.cfg.replicas;
                self.send(sid, true, Ev::Open { r, sid });
            }
            Ev::Open { r, .. } | Ev::Block { r, .. } | Ev::Close { r, .. } => {
                if self.replicas[r].busy {
                    self.replicas[r].inbox.push(ev);
                } else {
                    self.deliver(r, ev);
                    self.kick(r);
                }
            }
            Ev::Done { r } => {
                let out = std::mem::take(&mut self.replicas[r].outbox);
                self.replicas[r].busy = false;
                self.emit(out);
                for ev in std::mem::take(&mut self.replicas[r].inbox) {
                    self.deliver(r, ev);
                }
                self.kick(r);
            }
            Ev::Kick { r } => self.kick(r),
            Ev::Reopen { r, sid } => self.send(sid, true, Ev::Open { r, sid }),
            Ev::ToEdge { sid, msg } => self.edge_event(sid, msg),
            Ev::Drafted { sid, token } => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                s.drafting = false;
                let Some(es) = s.edge.as_mut() else {
                    return;
                };
                let outs =
                    es.on_drafted(self.now as f64 / 1e3, token, None, self.cfg.draft_ms, false);
                self.drafted += 1;
                self.outputs(sid, outs);
                let pending = std::mem::take(
                    &mut self
                        .sessions
                        .get_mut(&sid)
                        .expect("invariant: present")
                        .pending,
                );
                for m in pending {
                    self.message(sid, m);
                }
                self.drive(sid);
            }
        }
    }

    /// Apply a message at replica `r` (idle): its answers go out with the replica's next turn.
    fn deliver(&mut self, r: usize, ev: Ev) {
        let msg = match ev {
            Ev::Open { sid, .. } => {
                let Some(s) = self.sessions.get(&sid) else {
                    return;
                };
                let mode = if self.cfg.gamma == 0 {
                    Mode::Generate
                } else {
                    Mode::Speculate {
                        rule: VerifyRule::Greedy,
                        want: (self.cfg.gamma as u32, self.cfg.depth as u32),
                    }
                };
                Inbound::Open {
                    session: sid,
                    new: NewSession {
                        tenant: 0,
                        prompt: s.prompt.clone(),
                        params: SamplingParams::default(),
                        max_tokens: self.cfg.new_tokens,
                        eog: Vec::new(),
                        mode,
                    },
                    handle: (),
                }
            }
            Ev::Block { sid, block, .. } => Inbound::Draft {
                session: sid,
                block,
            },
            Ev::Close { sid, .. } => Inbound::Close { session: sid },
            _ => return,
        };
        self.replicas[r].core.receive(self.now, msg);
    }

    /// Run replica `r`'s next turn if it is idle: its messages go out when its forward ends (at
    /// once when none ran).
    fn kick(&mut self, r: usize) {
        let rep = &mut self.replicas[r];
        if rep.busy {
            return;
        }
        let turn = rep.core.turn(self.now);
        rep.takeovers += turn.takeovers;
        let Some(f) = turn.forward else {
            self.emit(turn.out);
            if turn.throttled {
                // Nothing could be planned (rate quotas): the batcher looks again shortly.
                self.at(self.now + THROTTLED_US, Ev::Kick { r });
            }
            return;
        };
        let (w0, w1) = self.window;
        let (a, b) = (self.now.max(w0), (self.now + f.us).min(w1));
        if b > a {
            rep.busy_us += b - a;
        }
        if self.now >= w0 && self.now < w1 {
            rep.forwards += 1;
            rep.tokens += f.tokens as u64;
        }
        rep.busy = true;
        rep.outbox = turn.out;
        self.at(self.now + f.us.max(1), Ev::Done { r });
    }

    /// Send a replica's messages to their edges.
    fn emit(&mut self, out: Vec<Outgoing<()>>) {
        for o in out {
            let sid = o.session;
            self.send(sid, false, Ev::ToEdge { sid, msg: o.msg });
        }
    }

    fn edge_event(&mut self, sid: u64, msg: ToEdge) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        match msg {
            ToEdge::Opened { first, grant } => {
                let cfg = SessionConfig {
                    draft_len: self.cfg.gamma,
                    depth: self.cfg.depth,
                    max_new_tokens: self.cfg.new_tokens,
                    auto: None,
                    granted: Some((grant.0 as usize, grant.1 as usize)),
                };
                let now_ms = self.now as f64 / 1e3;
                let (es, outs) = EdgeSession::new(now_ms, s.prompt.clone(), first, cfg, Vec::new())
                    .expect("invariant: a valid session configuration");
                s.edge = Some(es);
                self.outputs(sid, outs);
                self.drive(sid);
            }
            ToEdge::Verdict(v) => self.arrived(sid, Incoming::Verdict(v)),
            ToEdge::Decoded(d) => self.arrived(sid, Incoming::Decoded(d)),
            ToEdge::Token { token, done } => {
                let pos = s.prompt.len() + s.committed;
                self.commit(sid, pos, &[token]);
                if done {
                    self.finish(sid);
                }
            }
            ToEdge::Error {
                retry_after_ms: Some(_),
                fatal: true,
                ..
            } if s.edge.is_none() => {
                // Refused for load: the edge opens it again a little later.
                let r = s.replica;
                self.at(self.now + RETRY_US, Ev::Reopen { r, sid });
            }
            ToEdge::Error { fatal, .. } => {
                self.errors += 1;
                if fatal {
                    self.finish(sid);
                }
            }
        }
    }

    /// A verdict or decoded token reached the edge: applied now, or once its draft forward
    /// ends.
    fn arrived(&mut self, sid: u64, m: Incoming) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.drafting {
            s.pending.push(m);
        } else {
            self.message(sid, m);
            self.drive(sid);
        }
    }

    fn message(&mut self, sid: u64, m: Incoming) {
        let now_ms = self.now as f64 / 1e3;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        let Some(es) = s.edge.as_mut() else {
            return;
        };
        match es.on_message(now_ms, m) {
            Ok(r) => {
                s.decoded += usize::from(matches!(m, Incoming::Decoded(_)));
                self.outputs(sid, r.outputs);
            }
            Err(_) => self.errors += 1,
        }
    }

    fn outputs(&mut self, sid: u64, outs: Vec<Output>) {
        for o in outs {
            match o {
                Output::Send(block) => {
                    let r = self.sessions.get(&sid).map_or(0, |s| s.replica);
                    self.send(sid, true, Ev::Block { r, sid, block });
                }
                Output::Commit { pos, tokens } => self.commit(sid, pos, &tokens),
                Output::Rollback { .. } => {}
            }
        }
    }

    fn commit(&mut self, sid: u64, pos: usize, tokens: &[u32]) {
        let seed = self.cfg.seed;
        let s = self
            .sessions
            .get_mut(&sid)
            .expect("invariant: committing session");
        // Each token checked against the target's choice after what was committed before it.
        for (i, &t) in tokens.iter().enumerate() {
            if t != target_token(seed, sid, pos + i, s.last) {
                self.wrong += 1;
            }
            s.last = t;
        }
        s.commits.push((self.now, tokens.len()));
        s.committed += tokens.len();
    }

    /// Let session `sid`'s edge draft, or finish it.
    fn drive(&mut self, sid: u64) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.drafting || s.done {
            return;
        }
        let Some(es) = s.edge.as_ref() else {
            return;
        };
        let p = es.pipeline();
        match p.next() {
            Next::Draft => {
                let pos = p.tokens().len();
                let prev = p.tokens()[pos - 1];
                let right = target_token(self.cfg.seed, sid, pos, prev);
                let u = uniform(self.cfg.seed ^ 0xd4af, sid, (pos as u64) << 20 | p.epoch());
                let token = if u < self.cfg.alpha {
                    right
                } else {
                    (right % (VOCAB as u32 - 1)) + 1
                };
                s.drafting = true;
                let t = self.now + (self.cfg.draft_ms * 1e3) as u64;
                self.at(t, Ev::Drafted { sid, token });
            }
            Next::Wait => {}
            Next::Done => {
                let st = *p.stats();
                self.accepted += st.accepted as u64;
                self.finish(sid);
            }
        }
    }

    /// The session is over: its edge closes it and the user starts the next one.
    fn finish(&mut self, sid: u64) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.done {
            return;
        }
        s.done = true;
        let (user, r) = (s.user, s.replica);
        self.send(sid, true, Ev::Close { r, sid });
        self.at(self.now, Ev::Start { user });
        let s = self.sessions.remove(&sid).expect("invariant: present");
        self.done_sessions.push(s);
    }
}

/// Per-token gaps of the commits inside `window` (as `bench load`): a commit of k tokens after a
/// gap g counts k gaps of g / k; a session's first commit counts its time to first token.
fn gaps(sessions: &[&Session], window: (u64, u64)) -> (Vec<f64>, Vec<f64>, usize) {
    let (mut itl, mut ttft, mut tokens) = (Vec::new(), Vec::new(), 0);
    let inside = |t: u64| t >= window.0 && t <= window.1;
    for s in sessions {
        let mut last: Option<u64> = None;
        for &(t, k) in &s.commits {
            if inside(t) {
                tokens += k;
            }
            match last {
                None if inside(t) => ttft.push((t - s.start_us) as f64 / 1e3),
                Some(l) if inside(t) => {
                    let g = (t - l) as f64 / 1e3 / k.max(1) as f64;
                    itl.extend(std::iter::repeat_n(g, k.max(1)));
                }
                _ => {}
            }
            last = Some(t);
        }
    }
    (itl, ttft, tokens)
}

/// Run one simulation.
pub fn simulate(cfg: &SimConfig) -> Result<SimRow> {
    if cfg.users == 0 || cfg.replicas == 0 {
        bail!("--sessions and --replicas must be at least 1");
    }
    if !(0.0..=1.0).contains(&cfg.alpha) {
        bail!("--alpha must be within 0..=1, got {}", cfg.alpha);
    }
    if cfg.gamma > 0 && cfg.depth == 0 {
        bail!("--depth must be at least 1");
    }
    if cfg.gamma + 1 > cfg.token_budget {
        bail!(
            "--token-budget {} must exceed --gamma {}",
            cfg.token_budget,
            cfg.gamma
        );
    }
    if cfg.new_tokens == 0 || cfg.prompt_tokens == 0 {
        bail!("--tokens and --prompt-tokens must be at least 1");
    }
    let wall = std::time::Instant::now();
    let per_replica = cfg.users.div_ceil(cfg.replicas);
    let mut replicas = Vec::new();
    for r in 0..cfg.replicas {
        let target = SimTarget {
            cost: cfg.cost,
            num_blocks: cfg.kv_blocks,
            seed: cfg.seed,
            last_us: 0,
        };
        let core = VerifierCore::new(
            target,
            VerifierConfig {
                token_budget: cfg.token_budget,
                max_sessions: per_replica * 2 + 16,
                max_waiting_tokens: (per_replica + 16) * cfg.prompt_tokens,
            },
        )
        .map_err(|e| anyhow::anyhow!("replica {r}: {e}"))?;
        // As `cloud serve` sets it up: grants within the configured shape, saturating at twice
        // the ridge, γ 0 as the last level, takeovers by pace.
        let core = if cfg.adaptive && cfg.gamma > 0 {
            let grants = GrantPolicy::new(
                cfg.gamma as u32,
                cfg.depth as u32,
                2.0 * cfg.cost.ridge_tokens().max(1.0),
            )
            .with_cloud_decode()
            .with_pace(cfg.cost);
            core.with_grants(grants, 0)
        } else {
            core
        };
        replicas.push(Replica {
            core,
            takeovers: 0,
            busy: false,
            inbox: Vec::new(),
            outbox: Vec::new(),
            busy_us: 0,
            forwards: 0,
            tokens: 0,
        });
    }
    let w0 = (cfg.warmup_s * 1e6) as u64;
    let mut sim = Sim {
        cfg: cfg.clone(),
        now: 0,
        seq: 0,
        queue: BinaryHeap::new(),
        sessions: HashMap::new(),
        next_sid: 1,
        replicas,
        window: (w0, w0 + (cfg.duration_s * 1e6) as u64),
        wrong: 0,
        errors: 0,
        last_arrival: HashMap::new(),
        drafted: 0,
        accepted: 0,
        done_sessions: Vec::new(),
        events: 0,
    };
    sim.run();
    let all: Vec<&Session> = sim
        .done_sessions
        .iter()
        .chain(sim.sessions.values())
        .collect();
    let (itl, ttft, tokens) = gaps(&all, sim.window);
    let committed: usize = all.iter().map(|s| s.committed).sum();
    let decoded: usize = all.iter().map(|s| s.decoded).sum();
    let takeovers: usize = sim.replicas.iter().map(|r| r.takeovers).sum();
    let span = (sim.window.1 - sim.window.0) as f64 / 1e6;
    let forwards: u64 = sim.replicas.iter().map(|r| r.forwards).sum();
    let fwd_tokens: u64 = sim.replicas.iter().map(|r| r.tokens).sum();
    let busy: u64 = sim.replicas.iter().map(|r| r.busy_us).sum();
    let costs = Costs {
        alpha: cfg.alpha,
        draft_ms: cfg.draft_ms,
        verify_ms: 0.0,
        verify_ms_per_token: 0.0,
        rtt_ms: cfg.rtt_ms,
        // A simulated edge handles verdicts in no time.
        verdict_ms: 0.0,
    };
    let per = cfg.users.div_ceil(cfg.replicas);
    let work = Workload {
        prompt_tokens: cfg.prompt_tokens,
        new_tokens: cfg.new_tokens,
        token_budget: cfg.token_budget,
    };
    // An adaptive replica is predicted at the model's best shape within γ and depth (γ 0
    // included), a fixed one at its shape.
    let pred = if cfg.adaptive && cfg.gamma > 0 {
        plan(&costs, &cfg.cost, per, cfg.gamma, cfg.depth.max(1), &work).best
    } else {
        operate_on(&costs, &cfg.cost, per, cfg.gamma, cfg.depth.max(1), &work)
    };
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    let sum = |s: Summary| Summary {
        mean: r2(s.mean),
        p50: r2(s.p50),
        p99: r2(s.p99),
    };
    Ok(SimRow {
        users: cfg.users,
        replicas: cfg.replicas,
        gamma: cfg.gamma,
        depth: if cfg.gamma == 0 { 1 } else { cfg.depth },
        adaptive: cfg.adaptive && cfg.gamma > 0,
        tokens_per_s: r2(tokens as f64 / span),
        itl_ms: sum(Summary::of(&itl)),
        ttft_ms: sum(Summary::of(&ttft)),
        tokens_per_forward: r2(fwd_tokens as f64 / forwards.max(1) as f64),
        forwards,
        utilization: r2(busy as f64 / (span * 1e6 * cfg.replicas as f64)),
        sessions_done: sim.done_sessions.len(),
        wrong_tokens: sim.wrong,
        protocol_errors: sim.errors,
        cloud_decoded_share: if cfg.gamma == 0 {
            1.0
        } else {
            r2(decoded as f64 / committed.max(1) as f64)
        },
        takeovers,
        acceptance: r2(sim.accepted as f64 / sim.drafted.max(1) as f64),
        predicted_itl_ms: r2(pred.itl_ms),
        predicted_tokens_per_s: r2(pred.tokens_per_s * (cfg.users as f64 / per as f64)),
        predicted_ttft_ms: r2(pred.ttft_ms),
        events: sim.events,
        wall_s: r2(wall.elapsed().as_secs_f64()),
    })
}

pub fn table(rows: &[SimRow]) -> String {
    let mut s = String::from(
        "| sessions | replicas | mode | tok/s | predicted tok/s | ITL mean | predicted ITL | ITL p99 | TTFT mean | predicted TTFT | tokens/fwd | busy | accepted | cloud-decoded | takeovers | sessions done | wrong tokens | protocol errors | events | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let mode = if r.gamma == 0 {
            "cloud-only".to_string()
        } else {
            format!(
                "γ {} depth {}{}",
                r.gamma,
                r.depth,
                if r.adaptive { ", adaptive" } else { "" }
            )
        };
        s += &format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0}% | {:.2} | {:.0}% | {} | {} | {} | {} | {} | {:.1} |\n",
            r.users,
            r.replicas,
            mode,
            r.tokens_per_s,
            r.predicted_tokens_per_s,
            r.itl_ms.mean,
            r.predicted_itl_ms,
            r.itl_ms.p99,
            r.ttft_ms.mean,
            r.predicted_ttft_ms,
            r.tokens_per_forward,
            r.utilization * 100.0,
            r.acceptance,
            r.cloud_decoded_share * 100.0,
            r.takeovers,
            r.sessions_done,
            r.wrong_tokens,
            r.protocol_errors,
            r.events,
            r.wall_s
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(users: usize, gamma: usize) -> SimConfig {
        SimConfig {
            users,
            replicas: 1,
            alpha: 0.8,
            draft_ms: 11.0,
            rtt_ms: 50.0,
            rtt_spread_pct: 0.0,
            jitter_pct: 10.0,
            gamma,
            depth: 2,
            adaptive: false,
            prompt_tokens: 1,
            new_tokens: 200,
            token_budget: 64,
            kv_blocks: 8192,
            cost: ForwardCost {
                one_token_ms: 44.0,
                ms_per_token: 2.2,
            },
            warmup_s: 5.0,
            duration_s: 20.0,
            seed: 3,
        }
    }

    #[test]
    fn the_simulation_is_lossless_and_agrees_with_the_model_when_prompts_are_short() {
        for users in [1, 4, 16, 64] {
            for gamma in [0, 4] {
                let r = simulate(&cfg(users, gamma)).unwrap();
                assert_eq!((r.wrong_tokens, r.protocol_errors), (0, 0), "{r:?}");
                assert!(r.tokens_per_s > 0.0 && r.forwards > 0, "{r:?}");
                let ratio = r.tokens_per_s / r.predicted_tokens_per_s;
                assert!(
                    (0.85..1.15).contains(&ratio),
                    "{users} users, γ {gamma}: {r:?}"
                );
            }
        }
    }

    #[test]
    fn the_simulation_is_deterministic_and_spreads_users_over_replicas() {
        let mut c = cfg(40, 4);
        c.adaptive = true;
        c.replicas = 4;
        c.rtt_spread_pct = 50.0;
        c.prompt_tokens = 30;
        c.new_tokens = 40;
        let (a, b) = (simulate(&c).unwrap(), simulate(&c).unwrap());
        assert_eq!(
            (
                a.tokens_per_s,
                a.itl_ms,
                a.forwards,
                a.events,
                a.sessions_done
            ),
            (
                b.tokens_per_s,
                b.itl_ms,
                b.forwards,
                b.events,
                b.sessions_done
            )
        );
        assert_eq!((a.wrong_tokens, a.protocol_errors), (0, 0), "{a:?}");
        // Four replicas of ten users each serve what one replica of ten does, four times.
        let mut one = c.clone();
        one.users = 10;
        one.replicas = 1;
        let o = simulate(&one).unwrap();
        let ratio = a.tokens_per_s / (4.0 * o.tokens_per_s);
        assert!((0.85..1.15).contains(&ratio), "{a:?} vs 4 × {o:?}");
    }

    #[test]
    fn jittery_links_keep_each_streams_order() {
        // Blocks sent every 5 ms over a 200 ms ± 50% link would overtake each other if each
        // message took its own jitter alone; a stream keeps its order.
        let mut c = cfg(4, 1);
        (c.draft_ms, c.rtt_ms, c.jitter_pct, c.depth) = (5.0, 200.0, 50.0, 4);
        for adaptive in [false, true] {
            c.adaptive = adaptive;
            let r = simulate(&c).unwrap();
            assert_eq!((r.wrong_tokens, r.protocol_errors), (0, 0), "{r:?}");
            assert!(r.tokens_per_s > 0.0, "{r:?}");
        }
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        for (c, want) in [
            (
                SimConfig {
                    alpha: 1.5,
                    ..cfg(1, 4)
                },
                "--alpha",
            ),
            (
                SimConfig {
                    users: 0,
                    ..cfg(1, 4)
                },
                "--sessions",
            ),
            (
                SimConfig {
                    token_budget: 4,
                    ..cfg(1, 4)
                },
                "--token-budget",
            ),
            (
                SimConfig {
                    new_tokens: 0,
                    ..cfg(1, 4)
                },
                "--tokens",
            ),
        ] {
            let e = simulate(&c).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}

#[cfg(test)]
mod adaptive_tests {
    use super::*;

    #[test]
    fn an_adaptive_replica_takes_over_under_load_and_stays_lossless() {
        let base = SimConfig {
            users: 32,
            replicas: 1,
            alpha: 0.6,
            draft_ms: 20.0,
            rtt_ms: 50.0,
            rtt_spread_pct: 20.0,
            jitter_pct: 10.0,
            gamma: 4,
            depth: 2,
            adaptive: true,
            prompt_tokens: 30,
            new_tokens: 40,
            token_budget: 64,
            kv_blocks: 8192,
            cost: ForwardCost {
                one_token_ms: 52.0,
                ms_per_token: 3.5,
            },
            warmup_s: 10.0,
            duration_s: 30.0,
            seed: 5,
        };
        let adaptive = simulate(&base).unwrap();
        let fixed = simulate(&SimConfig {
            adaptive: false,
            ..base.clone()
        })
        .unwrap();
        assert_eq!(adaptive.wrong_tokens + fixed.wrong_tokens, 0);
        assert_eq!(adaptive.protocol_errors + fixed.protocol_errors, 0);
        assert!(
            adaptive.takeovers > 0 && adaptive.cloud_decoded_share > 0.8,
            "{adaptive:?}"
        );
        assert_eq!(fixed.cloud_decoded_share, 0.0, "{fixed:?}");
        assert!(
            adaptive.tokens_per_s > fixed.tokens_per_s,
            "{adaptive:?} vs {fixed:?}"
        );
        // One user with a good draft and a far verifier keeps speculating.
        let alone = simulate(&SimConfig {
            users: 1,
            alpha: 0.95,
            rtt_ms: 20.0,
            draft_ms: 10.0,
            ..base
        })
        .unwrap();
        assert!(alone.cloud_decoded_share < 0.2, "{alone:?}");
    }
}
