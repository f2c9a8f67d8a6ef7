//! The event loop: closed-loop users, their edges (each an [`EdgeSession`]) and the verifier
//! replicas (each a [`VerifierCore`]), on simulated time (µs).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::uniform;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::suffix::Copier;
use tandem_spec::{
    Block, EdgeSession, Grown, Hedge, Incoming, Next, Opened, Output, SessionConfig, Shape,
    TreeConfig, VerifyRule,
};
use tandem_verifier::{Inbound, Mode, NewSession, Outgoing, ToEdge, VerifierCore};

use crate::target::{CopySpans, SimTarget, Texts, VOCAB};
use crate::SimConfig;

/// An edge retries an open the verifier refused (saturated) after this long (µs).
pub(crate) const RETRY_US: u64 = 100_000;
/// A replica whose plan came out empty plans again after this long (µs), as the batcher does.
pub(crate) const THROTTLED_US: u64 = 2_000;

#[derive(Debug)]
pub(crate) enum Ev {
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
        /// The open it was sent after (a refused open's stream is gone, its blocks with it).
        attempt: u32,
        block: Block,
    },
    /// The edge acknowledges its first `committed` tokens (flow control).
    Ack {
        r: usize,
        sid: u64,
        committed: usize,
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
    /// An edge's draft forward ends: a token for each leaf of its draft tree.
    Drafted {
        sid: u64,
        grown: Vec<Grown>,
        ms: f64,
    },
}

pub(crate) struct Session {
    pub(crate) user: usize,
    pub(crate) replica: usize,
    pub(crate) rtt_ms: f64,
    pub(crate) prompt: Vec<u32>,
    /// The edge's session: from the Open on for linear blocks (it drafts while the verifier
    /// prefills), else once the verifier opened it.
    pub(crate) edge: Option<EdgeSession>,
    /// The verifier answered the Open.
    pub(crate) opened: bool,
    /// Opens sent (a refused one is sent again).
    pub(crate) attempt: u32,
    /// Verdicts and decoded tokens that arrived while the edge was drafting, in order.
    pub(crate) pending: Vec<Incoming>,
    pub(crate) drafting: bool,
    pub(crate) start_us: u64,
    /// (µs, tokens) of each commit.
    pub(crate) commits: Vec<(u64, usize)>,
    pub(crate) committed: usize,
    /// The last committed token (the prompt's last at first).
    pub(crate) last: u32,
    pub(crate) done: bool,
    /// The edge's copier (`--suffix on`, linear drafts), and the tokens it copied since the
    /// draft model last ran (its next forward feeds them in one chunk).
    pub(crate) copier: Option<Copier>,
    pub(crate) behind: usize,
}

pub(crate) struct Replica {
    pub(crate) core: VerifierCore<SimTarget>,
    pub(crate) takeovers: usize,
    pub(crate) busy: bool,
    /// Messages that arrived during a forward, applied when it ends.
    pub(crate) inbox: Vec<Ev>,
    /// The running forward's messages, sent when it ends.
    pub(crate) outbox: Vec<Outgoing<()>>,
    pub(crate) busy_us: u64,
    pub(crate) forwards: u64,
    pub(crate) tokens: u64,
}

pub(crate) struct Sim {
    pub(crate) cfg: SimConfig,
    pub(crate) now: u64,
    pub(crate) seq: u64,
    pub(crate) queue: BinaryHeap<Reverse<Queued>>,
    pub(crate) sessions: HashMap<u64, Session>,
    pub(crate) next_sid: u64,
    pub(crate) replicas: Vec<Replica>,
    pub(crate) window: (u64, u64),
    pub(crate) wrong: usize,
    /// Protocol errors: refusals at either end (must be 0).
    pub(crate) errors: usize,
    /// When the last message on each (session, edge-to-cloud?) link arrives.
    pub(crate) last_arrival: HashMap<(u64, bool), u64>,
    pub(crate) drafted: u64,
    pub(crate) accepted: u64,
    /// Positions where a drafted token met the committed one (agreeing or not).
    pub(crate) judged: u64,
    /// Committed tokens a lane of the draft tree guessed where its main path missed.
    pub(crate) lane_hits: u64,
    pub(crate) done_sessions: Vec<Session>,
    pub(crate) events: u64,
    /// The target's texts (shared with the replicas' targets).
    pub(crate) texts: Texts,
    /// The share of each session's output its text copies, summed, and the sessions.
    pub(crate) copy_share: (f64, usize),
    /// Tokens the edges copied, and of those judged, the right ones (sessions done).
    pub(crate) copied: (usize, usize, usize),
}

/// An event due at `t` (µs); events due at the same time run in the order they were queued.
pub(crate) struct Queued {
    pub(crate) t: u64,
    pub(crate) seq: u64,
    pub(crate) ev: Ev,
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

    pub(crate) fn run(&mut self) {
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
                // The user's history first (the same in each of its sessions), then this
                // session's own tokens.
                let shared = (self.cfg.prompt_tokens as f64 * self.cfg.prefix_hit) as usize;
                let prompt: Vec<u32> = (0..self.cfg.prompt_tokens)
                    .map(|i| match i < shared {
                        true => crate::target_token(self.cfg.seed ^ 0x51, user as u64, i, 0),
                        false => crate::target_token(self.cfg.seed ^ 0x9, sid, i, 0),
                    })
                    .collect();
                let spans = CopySpans {
                    share: self.cfg.copy_share,
                    span: self.cfg.copy_span,
                };
                let share = self.texts.write(sid, &prompt, self.cfg.new_tokens, spans);
                self.copy_share.0 += share;
                self.copy_share.1 += 1;
                let copy = self.cfg.suffix && self.cfg.gamma > 0 && self.cfg.tree.0.is_none();
                let copier = copy.then(|| Copier::new(&prompt));
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
                        opened: false,
                        attempt: 0,
                        pending: Vec::new(),
                        drafting: false,
                        start_us: self.now,
                        commits: Vec::new(),
                        committed: 0,
                        last,
                        done: false,
                        copier,
                        behind: 0,
                    },
                );
                let r = user % self.cfg.replicas;
                self.send(sid, true, Ev::Open { r, sid });
                self.open_early(sid);
            }
            Ev::Open { r, .. } | Ev::Block { r, .. } | Ev::Ack { r, .. } | Ev::Close { r, .. } => {
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
            Ev::Reopen { r, sid } => {
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.attempt += 1;
                }
                self.send(sid, true, Ev::Open { r, sid });
                self.open_early(sid);
            }
            Ev::ToEdge { sid, msg } => self.edge_event(sid, msg),
            Ev::Drafted { sid, grown, ms } => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                s.drafting = false;
                let Some(es) = s.edge.as_mut() else {
                    return;
                };
                self.drafted += grown.len() as u64;
                match es.on_grown(self.now, grown, ms, false) {
                    Ok(outs) => self.outputs(sid, outs),
                    Err(_) => self.errors += 1,
                }
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
                        want: Shape::new(self.cfg.gamma as u32, self.cfg.depth as u32),
                    }
                };
                Inbound::Open {
                    session: SessionId(sid),
                    new: NewSession {
                        tenant: TenantId(0),
                        prompt: s.prompt.clone(),
                        params: SamplingParams::default(),
                        max_tokens: self.cfg.new_tokens,
                        eog: Vec::new(),
                        mode,
                        grammar: None,
                        logprobs: None,
                        self_draft: self.cfg.self_draft,
                    },
                    handle: (),
                }
            }
            Ev::Block {
                sid,
                block,
                attempt,
                ..
            } => {
                // Blocks behind a refused open, or an earlier one, went with its stream.
                let current = self.sessions.get(&sid).map(|s| s.attempt);
                if current != Some(attempt)
                    || self.replicas[r].core.session(SessionId(sid)).is_none()
                {
                    return;
                }
                Inbound::Draft {
                    session: SessionId(sid),
                    block,
                }
            }
            Ev::Ack { sid, committed, .. } => Inbound::Ack {
                session: SessionId(sid),
                committed,
            },
            Ev::Close { sid, .. } => Inbound::Close {
                session: SessionId(sid),
            },
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
            let more = rep.core.has_work();
            self.emit(turn.out);
            if more {
                // Work, but no forward ran (rate quotas, or only preemptions): look again
                // shortly, as the batcher does.
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

    /// Send a replica's messages to their edges (an edge waits for `Opened`, not for the
    /// admission before it: the simulator's edges have no connect timeout).
    fn emit(&mut self, out: Vec<Outgoing<()>>) {
        for o in out {
            if matches!(o.msg, ToEdge::Admitted { .. }) {
                continue;
            }
            let sid = o.session.0;
            self.send(sid, false, Ev::ToEdge { sid, msg: o.msg });
        }
    }

    fn edge_event(&mut self, sid: u64, msg: ToEdge) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        match msg {
            ToEdge::Opened { first, grant, .. } if s.edge.is_some() => {
                // An edge drafting since its Open: the first token commits its position.
                s.opened = true;
                let o = Opened {
                    first,
                    grant,
                    side_nodes: usize::MAX,
                };
                self.arrived(sid, Incoming::Opened(o));
            }
            ToEdge::Opened { first, grant, .. } => {
                s.opened = true;
                let cfg = SessionConfig {
                    draft_len: self.cfg.gamma,
                    depth: self.cfg.depth,
                    max_new_tokens: self.cfg.new_tokens,
                    auto: None,
                    tree: self.cfg.tree.0.unwrap_or(TreeConfig::LINEAR),
                };
                // (The core's replicas bound no side nodes: the gRPC service does.)
                let opened = Opened {
                    first,
                    grant,
                    side_nodes: usize::MAX,
                };
                let (es, outs) =
                    EdgeSession::new(self.now, s.prompt.clone(), opened, cfg, Vec::new())
                        .expect("invariant: a valid session configuration");
                s.edge = Some(es);
                self.outputs(sid, outs);
                self.drive(sid);
            }
            ToEdge::Admitted { .. } | ToEdge::Logprobs(_) => {}
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
            } if !s.opened => {
                // Refused for load: the edge opens it again a little later (drafting afresh).
                s.edge = None;
                s.pending.clear();
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

    /// A speculating edge with linear blocks starts its session as it sends the Open
    /// ([`EdgeSession::opening`]), as `tandem generate` does: it drafts while the verifier
    /// prefills.
    fn open_early(&mut self, sid: u64) {
        if self.cfg.gamma == 0 || self.cfg.tree.0.is_some() {
            return;
        }
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        let cfg = SessionConfig {
            draft_len: self.cfg.gamma,
            depth: self.cfg.depth,
            max_new_tokens: self.cfg.new_tokens,
            auto: None,
            tree: TreeConfig::LINEAR,
        };
        let (es, outs) = EdgeSession::opening(self.now, s.prompt.clone(), cfg, Vec::new())
            .expect("invariant: a valid session configuration");
        s.edge = Some(es);
        self.outputs(sid, outs);
        self.drive(sid);
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
        let now_us = self.now;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        let Some(es) = s.edge.as_mut() else {
            return;
        };
        match es.on_message(now_us, m) {
            Ok(r) => {
                self.outputs(sid, r.outputs);
            }
            Err(_) => self.errors += 1,
        }
    }

    fn outputs(&mut self, sid: u64, outs: Vec<Output>) {
        for o in outs {
            match o {
                Output::Send(block) => {
                    let (r, attempt) = self
                        .sessions
                        .get(&sid)
                        .map_or((0, 0), |s| (s.replica, s.attempt));
                    self.send(
                        sid,
                        true,
                        Ev::Block {
                            r,
                            sid,
                            attempt,
                            block,
                        },
                    );
                }
                Output::Commit { pos, tokens } => self.commit(sid, pos, &tokens),
                Output::Rollback { .. } => {}
                Output::Ack { committed } => {
                    let r = self.sessions.get(&sid).map_or(0, |s| s.replica);
                    self.send(sid, true, Ev::Ack { r, sid, committed });
                }
            }
        }
    }

    fn commit(&mut self, sid: u64, pos: usize, tokens: &[u32]) {
        let s = self
            .sessions
            .get_mut(&sid)
            .expect("invariant: committing session");
        // Each token checked against the target's choice after what was committed before it.
        for (i, &t) in tokens.iter().enumerate() {
            if t != self.texts.token(sid, pos + i, s.last) {
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
                // Every leaf of the draft tree in one forward (one leaf when linear).
                let f = p.frontier();
                let base = &p.tokens()[..f.base];
                let trees = self.cfg.tree.0.is_some();
                // A linear draft copies from the session's text where the copier says so, as
                // the edge's drafter does: no forward of the draft model.
                if let (Some(c), [leaf]) = (s.copier.as_mut(), &f.leaves[..]) {
                    c.sync(es.committed());
                    let path = [base, &leaf[..]].concat();
                    if let Some((token, m)) = c.guess(&path) {
                        c.proposed(path.len(), token, &m);
                        let grown = vec![Grown {
                            token,
                            q: None,
                            hedge: None,
                        }];
                        s.behind += 1;
                        s.drafting = true;
                        self.at(
                            self.now,
                            Ev::Drafted {
                                sid,
                                grown,
                                ms: 0.0,
                            },
                        );
                        return;
                    }
                }
                let grown: Vec<Grown> = f
                    .leaves
                    .iter()
                    .enumerate()
                    .map(|(k, leaf)| {
                        let path = [base, &leaf[..]].concat();
                        let key =
                            (path.len() as u64) << 20 | (p.stats().drafted as u64) << 4 | k as u64;
                        draft_token(&self.cfg, &self.texts, sid, &path, key, trees)
                    })
                    .collect();
                if let (Some(c), [leaf], [g]) = (s.copier.as_mut(), &f.leaves[..], &grown[..]) {
                    c.drafted(f.base + leaf.len(), g.token);
                }
                // The forward also feeds the tokens copied since the last one (a chunk).
                let fed = grown.len() - 1 + std::mem::take(&mut s.behind);
                let ms = self.cfg.draft_ms * (1.0 + self.cfg.leaf_cost * fed as f64);
                s.drafting = true;
                let t = self.now + (ms * 1e3) as u64;
                self.at(t, Ev::Drafted { sid, grown, ms });
            }
            Next::Wait => {}
            Next::Done => {
                let st = *p.stats();
                self.accepted += st.accepted as u64;
                self.judged += (st.accepted + st.rejections) as u64;
                self.lane_hits += st.lane_hits as u64;
                if let Some(c) = s.copier.as_mut() {
                    c.sync(es.committed());
                    let cs = c.stats();
                    self.copied.0 += cs.copied;
                    self.copied.1 += cs.judged;
                    self.copied.2 += cs.right;
                }
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

/// How sure the simulated draft says it is where it hedges, and elsewhere.
const UNSURE: f32 = 0.3;
const SURE: f32 = 0.95;

/// The simulated draft's token after `path` (draw `key`): the target's with probability α;
/// with trees also its second choice, unsure at every miss and as often at a hit, and the
/// target's token for `cover` of the misses.
fn draft_token(
    cfg: &SimConfig,
    texts: &Texts,
    sid: u64,
    path: &[u32],
    key: u64,
    trees: bool,
) -> Grown {
    let pos = path.len();
    let right = texts.token(sid, pos, path[pos - 1]);
    let wrong = |k: u32| (right + k - 1) % (VOCAB as u32 - 1) + 1;
    let u = |stream: u64| uniform(cfg.seed ^ 0xd4af, sid ^ stream << 40, key);
    let hit = u(0) < cfg.alpha;
    let token = if hit { right } else { wrong(1) };
    let hedge = trees.then(|| {
        if !hit || u(1) < 1.0 - cfg.alpha {
            let covered = !hit && u(2) < cfg.cover;
            Hedge {
                alt: if covered { right } else { wrong(2) },
                p_top: UNSURE,
            }
        } else {
            Hedge {
                alt: wrong(2),
                p_top: SURE,
            }
        }
    });
    Grown {
        token,
        q: None,
        hedge,
    }
}

/// Per-token gaps of the commits inside `window` (as `bench load`): a commit of k tokens after a
/// gap g counts k gaps of g / k; a session's first commit counts its time to first token.
pub(crate) fn gaps(sessions: &[&Session], window: (u64, u64)) -> (Vec<f64>, Vec<f64>, usize) {
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
