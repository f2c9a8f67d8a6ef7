//! The real edge session ([`EdgeSession`]) against the real verifier core, driven through the
//! same turn interface as the server and the simulator, under arbitrary interleavings: drafting,
//! blocks reaching the verifier before, during and after its own decodes (stale, partly and
//! wholly agreeing), verdicts and decoded tokens reaching the edge late, acks, dropped
//! connections and reopened sessions, and cloud-only generations opening and closing beside it
//! so that the grant shrinks, takes the session over (γ 0) and hands it back. Blocks may be token
//! trees: the draft's second choices (sometimes the target's token) and branches continuing
//! them, which the verifier's tokens and decodes divert into.
//!
//! Checked at every step: every committed token is the target's greedy token, commits are
//! contiguous and never repeat a position; the verifier tells each position once (a verdict
//! only tells positions past the ones already told); the draft is fed each token once, and rolled
//! back only where a token it was fed changed; no verdict is of an epoch the edge left; and once
//! nothing is on the way, both sides are at the same epoch.

mod common;

use std::collections::{HashMap, VecDeque};

use common::{recurrent_after, VOCAB};
use proptest::prelude::*;
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::{uniform, SamplingParams};
use tandem_spec::{
    Block, BlockId, EdgeSession, Grown, Hedge, Incoming, Next, Output, SessionConfig, Shape,
    TreeConfig, VerifyRule,
};
use tandem_verifier::LoadConfig;
use tandem_verifier::{Inbound, Mode, NewSession, ToEdge, VerifierConfig, VerifierCore};

const PROMPT: [u32; 3] = [3, 4, 5];
const EOG: u32 = 13;

/// The target's greedy continuation, up to `n` tokens or the end-of-generation token.
fn oracle(prompt: &[u32], n: usize, eog: &[u32]) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    while seq.len() < prompt.len() + n {
        let t = recurrent_after(&seq);
        seq.push(t);
        if eog.contains(&t) {
            break;
        }
    }
    seq[prompt.len()..].to_vec()
}

/// The draft's token after `seq`: the target's with probability `alpha`, else a wrong one.
fn draft(seq: &[u32], seed: u64, alpha: f64, salt: u64) -> u32 {
    let p = seq.len() - 1;
    let t = recurrent_after(seq);
    if uniform(seed, (p as u64) << 20 | salt, 3) < alpha {
        t
    } else {
        t % (VOCAB as u32 - 1) + 1
    }
}

/// The draft's second choice beside `token` after `seq`: the target's token half the time when
/// the draft missed, else another wrong one; its confidence, a draw.
fn hedge(seq: &[u32], token: u32, seed: u64, salt: u64) -> Option<Hedge> {
    let p = seq.len() - 1;
    let t = recurrent_after(seq);
    let u = uniform(seed, (p as u64) << 20 | salt, 4);
    let alt = if t != token && u < 0.5 {
        t
    } else {
        (token + 1 + (u * 7.0) as u32) % VOCAB as u32
    };
    (alt != token).then_some(Hedge {
        alt,
        p_top: uniform(seed, (p as u64) << 20 | salt, 5) as f32,
    })
}

#[derive(Debug, Clone, Copy)]
enum Step {
    Draft,
    /// The edge drafts until it has to wait (or is told to stop).
    DraftAll,
    /// The oldest message on the way to the verifier arrives.
    Up,
    /// One turn of the verifier (a forward, if any session has work).
    Turn,
    /// The oldest message on the way to the edge arrives.
    Down,
    /// The connection drops (both directions lose what is on the way); the edge reopens.
    Drop,
    /// A cloud-only generation opens beside the session (the load rises), or one closes.
    LoadOn,
    LoadOff,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        20 => Just(Step::Draft),
        4 => Just(Step::DraftAll),
        10 => Just(Step::Up),
        8 => Just(Step::Turn),
        10 => Just(Step::Down),
        1 => Just(Step::Drop),
        2 => Just(Step::LoadOn),
        2 => Just(Step::LoadOff),
    ]
}

enum ToCloud {
    Draft(Block),
    Ack(usize),
}

struct World {
    v: VerifierCore<common::Recurrent, u64>,
    now_us: u64,
    /// The speculation session's id on the verifier (a new one per connection).
    id: SessionId,
    load: Vec<SessionId>,
    next_id: u64,
    up: VecDeque<ToCloud>,
    down: VecDeque<ToEdge>,
    /// Blocks sent on this connection, for the positions their verdicts tell.
    sent: HashMap<BlockId, Block>,
    /// The next position the verifier tells the edge (each once, in order).
    told: usize,
    seen: Seen,
    self_draft: bool,
}

/// How often a run took each path, to check that the interleavings reach them all.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    /// Sessions taken over (or handed back) by the load control.
    takeovers: usize,
    verdicts: usize,
    /// Verdicts of blocks that started behind the verifier (rebased: their leading tokens had
    /// been decoded meanwhile).
    rebased: usize,
    decoded: usize,
    reconnects: usize,
    /// Blocks answered by the verifier's decodes alone.
    covered: usize,
    /// Verdicts whose accepted path ended in a branch, and committed tokens a branch guessed
    /// (by a verdict or by a decode).
    side_verdicts: usize,
    lane_hits: usize,
    /// Forwards that fed only part of a block drafted under a larger grant than the current one,
    /// and turns in which such a block was a token tree.
    partial: usize,
    partial_trees: usize,
    /// Sessions (reopened ones, cloud-only generations) whose prompt started from cached pages,
    /// and cached pages taken back for new content.
    cached: usize,
    evictions: usize,
    /// The verifier's own guesses the target accepted.
    self_drafted: usize,
}

impl World {
    fn fresh_id(&mut self) -> SessionId {
        self.next_id += 1;
        SessionId(self.next_id)
    }

    /// One turn: the speculation session's messages go on the way to the edge, checked as they
    /// leave; the generations' are dropped.
    fn turn(&mut self) -> Result<(), TestCaseError> {
        self.now_us += 1_000;
        let t = self.v.turn(self.now_us);
        self.seen.takeovers += t.takeovers;
        let partial = self.v.stats.partial_verifies as usize;
        // The block trimmed in this turn covers the first position it tells.
        let at = self.told;
        self.seen.partial_trees += usize::from(
            partial > self.seen.partial
                && self
                    .sent
                    .values()
                    .any(|b| b.is_tree() && b.start_pos <= at && at < b.start_pos + b.reach()),
        );
        self.seen.partial = partial;
        for o in t.out {
            if o.session != self.id {
                if o.msg.ends() {
                    self.load.retain(|&s| s != o.session);
                }
                continue;
            }
            match &o.msg {
                ToEdge::Decoded(d) => {
                    prop_assert_eq!(d.pos, self.told, "each position is told once, in order");
                    self.told += 1;
                    self.seen.decoded += 1;
                }
                ToEdge::Verdict(v) => {
                    let b = &self.sent[&v.block];
                    let end = b.start_pos + v.accepted + 1;
                    prop_assert!(end > self.told, "a verdict re-tells position {}", self.told);
                    prop_assert!(
                        b.named_path(v.accepted, v.side_end).is_some(),
                        "a verdict names a path its block lacks: {:?}",
                        v
                    );
                    self.seen.verdicts += 1;
                    self.seen.side_verdicts += usize::from(v.side_end.is_some());
                    self.seen.rebased += usize::from(b.start_pos < self.told);
                    self.told = end;
                }
                ToEdge::Opened { .. } => {}
                // Admitted before its prefill (the edge waits for Opened).
                ToEdge::Admitted { .. } => continue,
                m => return Err(TestCaseError::fail(format!("the session got {m:?}"))),
            }
            self.down.push_back(o.msg);
        }
        Ok(())
    }

    /// Open the speculation session over `history` and turn until it is prefilled: the first
    /// token and the grant.
    fn open(
        &mut self,
        history: &[u32],
        max_tokens: usize,
        want: Shape,
    ) -> Result<(u32, Shape), TestCaseError> {
        self.id = self.fresh_id();
        self.sent.clear();
        self.v.receive(
            self.now_us,
            Inbound::Open {
                session: self.id,
                new: NewSession {
                    tenant: TenantId(0),
                    prompt: history.to_vec(),
                    params: SamplingParams::default(),
                    max_tokens,
                    eog: vec![EOG],
                    mode: Mode::Speculate {
                        rule: VerifyRule::Greedy,
                        want,
                    },
                    grammar: None,
                    logprobs: None,
                    self_draft: self.self_draft,
                },
                handle: self.id.0,
            },
        );
        self.told = history.len();
        for _ in 0..100 {
            self.turn()?;
            if let Some(ToEdge::Opened {
                first,
                grant,
                cached,
                ..
            }) = self.down.pop_front()
            {
                prop_assert_eq!(first, recurrent_after(history));
                self.seen.cached += usize::from(cached > 0);
                self.told = history.len() + 1;
                return Ok((first, grant));
            }
        }
        Err(TestCaseError::fail("the session never opened"))
    }
}

/// The shell's view of the edge: what it committed and what its draft model was fed.
struct Shell {
    want: Vec<u32>,
    committed: Vec<u32>,
    /// The tokens in the draft model's KV, in order.
    draft_kv: Vec<u32>,
    rollbacks: Vec<usize>,
}

impl Shell {
    fn handle(&mut self, outs: Vec<Output>, w: &mut World) -> Result<(), TestCaseError> {
        for o in outs {
            match o {
                Output::Send(b) => {
                    w.sent.insert(b.index, b.clone());
                    w.up.push_back(ToCloud::Draft(b));
                }
                Output::Ack { committed } => w.up.push_back(ToCloud::Ack(committed)),
                Output::Rollback { to } => self.rollbacks.push(to),
                Output::Commit { pos, tokens } => {
                    prop_assert_eq!(
                        pos,
                        PROMPT.len() + self.committed.len(),
                        "commits are contiguous, never repeated"
                    );
                    for (i, t) in tokens.iter().enumerate() {
                        let k = self.committed.len() + i;
                        prop_assert!(k < self.want.len(), "committed past the end");
                        prop_assert_eq!(
                            *t,
                            self.want[k],
                            "committed token {} is not the target's",
                            k
                        );
                    }
                    self.committed.extend(tokens);
                }
            }
        }
        Ok(())
    }

    /// After the edge handled something: its rollbacks truncate the draft's KV, each only where
    /// a token the draft was fed is no longer the edge's (a token that agrees is kept).
    fn roll_back(&mut self, e: &EdgeSession) -> Result<(), TestCaseError> {
        for to in std::mem::take(&mut self.rollbacks) {
            if to < self.draft_kv.len() {
                let now = e.pipeline().tokens().get(to);
                prop_assert!(
                    now != Some(&self.draft_kv[to]),
                    "rolled the draft back to {} though its token there still holds",
                    to
                );
                self.draft_kv.truncate(to);
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct Case {
    seed: u64,
    alpha: f64,
    gamma: usize,
    depth: usize,
    max_new: usize,
    tree: TreeConfig,
    /// The verifier drafts for the session (and the generations beside it) from their own text.
    self_draft: bool,
}

fn run(c: Case, schedule: &[Step]) -> Result<Seen, TestCaseError> {
    let Case {
        seed,
        alpha,
        gamma,
        depth,
        max_new,
        tree,
        self_draft,
    } = c;
    let target = common::Recurrent::new();
    let cfg = VerifierConfig {
        load: LoadConfig {
            saturation_tokens: 4.0,
            ..LoadConfig::new(4, 3)
        },
        // The target's text seldom repeats two tokens: guess after any match.
        self_draft_min_match: 1,
        ..VerifierConfig::default()
    };
    let v = VerifierCore::new(target, cfg, 0).unwrap();
    let mut w = World {
        v,
        now_us: 0,
        id: SessionId(0),
        load: Vec::new(),
        next_id: 0,
        up: VecDeque::new(),
        down: VecDeque::new(),
        sent: HashMap::new(),
        told: 0,
        seen: Seen::default(),
        self_draft,
    };
    let want_shape = Shape::new(gamma as u32, depth as u32);
    let (first, grant) = w.open(&PROMPT, max_new, want_shape)?;
    let cfg = SessionConfig {
        draft_len: gamma,
        depth,
        max_new_tokens: max_new,
        auto: None,
        tree,
    };
    let opened = tandem_spec::Opened {
        first,
        grant,
        side_nodes: usize::MAX,
    };
    let (mut edge, outs) = EdgeSession::new(0, PROMPT.to_vec(), opened, cfg, vec![EOG]).unwrap();
    let mut shell = Shell {
        want: oracle(&PROMPT, max_new, &[EOG]),
        committed: Vec::new(),
        draft_kv: Vec::new(),
        rollbacks: Vec::new(),
    };
    shell.handle(outs, &mut w)?;
    shell.roll_back(&edge)?;
    let (mut i, mut steps, mut salt) = (0, 0, 0u64);
    while edge.next() != Next::Done {
        steps += 1;
        prop_assert!(steps < 20_000, "no progress");
        let now_us = w.now_us;
        let s = schedule.get(i).copied().unwrap_or(match steps % 4 {
            0 => Step::Draft,
            1 => Step::Up,
            2 => Step::Down,
            _ => Step::Turn,
        });
        i += 1;
        match s {
            Step::Draft | Step::DraftAll => {
                let mut n = if matches!(s, Step::Draft) { 1 } else { 64 };
                while n > 0 && edge.next() == Next::Draft {
                    n -= 1;
                    // The shell feeds what the draft has not seen, then drafts.
                    let p = edge.pipeline();
                    prop_assert_eq!(p.draft_fed(), shell.draft_kv.len(), "the draft's KV length");
                    prop_assert_eq!(&p.tokens()[..p.draft_fed()], &shell.draft_kv[..]);
                    shell.draft_kv = p.tokens().to_vec();
                    // Every leaf of the draft tree grows a token (the main path first); the
                    // lanes' KV is the drafter's own (crates/edge/tests/drafter.rs).
                    let f = edge.frontier();
                    let mut grown = Vec::new();
                    for leaf in &f.leaves {
                        salt += 1;
                        let mut seq = p.tokens()[..f.base].to_vec();
                        seq.extend(leaf);
                        let t = draft(&seq, seed, alpha, salt);
                        let h = hedge(&seq, t, seed, salt);
                        grown.push(Grown {
                            token: t,
                            q: None,
                            hedge: h,
                        });
                    }
                    let outs = edge
                        .on_grown(now_us, grown, 1.0, false)
                        .map_err(|e| TestCaseError::fail(format!("growing refused: {e}")))?;
                    shell.handle(outs, &mut w)?;
                    shell.roll_back(&edge)?;
                }
            }
            Step::Up => match w.up.pop_front() {
                Some(ToCloud::Draft(block)) => w.v.receive(
                    w.now_us,
                    Inbound::Draft {
                        session: w.id,
                        block,
                    },
                ),
                Some(ToCloud::Ack(committed)) => w.v.receive(
                    w.now_us,
                    Inbound::Ack {
                        session: w.id,
                        committed,
                    },
                ),
                None => {}
            },
            Step::Turn => w.turn()?,
            Step::Down => {
                let msg = match w.down.pop_front() {
                    Some(ToEdge::Verdict(v)) => Some(Incoming::Verdict(v)),
                    Some(ToEdge::Decoded(d)) => Some(Incoming::Decoded(d)),
                    Some(m) => return Err(TestCaseError::fail(format!("unexpected {m:?}"))),
                    None => None,
                };
                if let Some(msg) = msg {
                    let r = edge.on_message(now_us, msg).map_err(|e| {
                        TestCaseError::fail(format!("the edge refused {msg:?}: {e}"))
                    })?;
                    shell.handle(r.outputs, &mut w)?;
                    shell.roll_back(&edge)?;
                }
            }
            Step::Drop => {
                w.up.clear();
                w.down.clear();
                let old = w.id;
                w.v.receive(w.now_us, Inbound::Close { session: old });
                let outs = edge.on_connection_lost();
                shell.handle(outs, &mut w)?;
                shell.roll_back(&edge)?;
                let reopen = edge
                    .reopen(tandem_spec::edge::Reconnecting {
                        attempt: 0,
                        elapsed_ms: 0,
                        window_ms: tandem_spec::edge::RECONNECT_WINDOW_MS,
                        retry_after_ms: None,
                        jitter: 0.5,
                    })
                    .expect("a first attempt");
                let history = edge.committed().to_vec();
                let (first, _) = w.open(&history, reopen.max_tokens, want_shape)?;
                let outs = edge.on_reopened(first);
                shell.handle(outs, &mut w)?;
                shell.roll_back(&edge)?;
            }
            Step::LoadOn if w.load.len() < 6 => {
                let id = w.fresh_id();
                w.v.receive(
                    w.now_us,
                    Inbound::Open {
                        session: id,
                        new: NewSession {
                            tenant: TenantId(0),
                            prompt: (1..10).collect(),
                            params: SamplingParams::default(),
                            max_tokens: 60,
                            eog: vec![],
                            mode: Mode::Generate,
                            grammar: None,
                            logprobs: None,
                            self_draft: w.self_draft,
                        },
                        handle: id.0,
                    },
                );
                w.load.push(id);
            }
            Step::LoadOff => {
                if let Some(id) = w.load.pop() {
                    w.v.receive(w.now_us, Inbound::Close { session: id });
                }
            }
            _ => {}
        }
        prop_assert_eq!(
            edge.pipeline().stats().stale_verdicts,
            0,
            "a verdict went stale"
        );
        let state = w.v.session(w.id);
        // (Not once the edge is done: see the spec crate's lossless test.)
        if let Some(st) = state.filter(|st| st.queued_blocks == 0 && !st.verifying) {
            if w.up.is_empty() && w.down.is_empty() && edge.next() != Next::Done {
                prop_assert_eq!(edge.pipeline().epoch(), st.epoch, "the epochs drifted");
            }
        }
    }
    prop_assert_eq!(&shell.committed, &shell.want);
    w.seen.reconnects = edge.measured().reconnects;
    w.seen.covered = edge.pipeline().stats().covered_blocks;
    w.seen.lane_hits = edge.pipeline().stats().lane_hits;
    w.seen.evictions = w.v.scheduler().pool().counts().evictions as usize;
    w.seen.self_drafted = w.v.stats.self_drafted as usize;
    Ok(w.seen)
}

fn tree() -> impl Strategy<Value = TreeConfig> {
    prop_oneof![
        1 => Just(TreeConfig::LINEAR),
        4 => (1usize..12, 1usize..4, 0.5f32..1.0, 0.0f32..0.2).prop_map(
            |(side_nodes, lanes, below, min_chance)| TreeConfig {
                side_nodes,
                lanes,
                below,
                min_chance,
            }
        ),
    ]
}

fn case() -> impl Strategy<Value = (Case, Vec<Step>)> {
    (
        (
            0u64..10_000,
            prop_oneof![Just(0.0), Just(0.6), Just(0.9), Just(1.0), 0.0f64..1.0],
            1usize..6,
            1usize..4,
            1usize..70,
            tree(),
        )
            .prop_map(|(seed, alpha, gamma, depth, max_new, tree)| Case {
                seed,
                alpha,
                gamma,
                depth,
                max_new,
                tree,
                // Half the cases, from the seed (no draw of its own: the others keep theirs).
                self_draft: seed.is_multiple_of(2),
            }),
        proptest::collection::vec(step(), 0..400),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn the_edge_session_and_the_verifier_core_commit_the_targets_tokens(
        (c, schedule) in case()
    ) {
        run(c, &schedule)?;
    }
}

/// The interleavings the proptest draws reach every path it is meant to cover, in a good share of
/// cases: a strategy that drifted to (say) never verifying would pass the proptest vacuously.
#[test]
fn the_interleavings_reach_every_path() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let cases = 800;
    let mut with = [0usize; 13];
    for _ in 0..cases {
        let (c, schedule) = case().new_tree(&mut runner).unwrap().current();
        let s = run(c, &schedule).unwrap();
        let took = [
            s.takeovers,
            s.verdicts,
            s.rebased,
            s.decoded,
            s.reconnects,
            s.covered,
            s.side_verdicts,
            s.lane_hits.saturating_sub(s.side_verdicts),
            s.partial,
            s.partial_trees,
            s.cached,
            s.evictions,
            s.self_drafted,
        ];
        for (n, t) in with.iter_mut().zip(took) {
            *n += usize::from(t > 0);
        }
    }
    let names = [
        "takeovers",
        "verdicts",
        "rebased verdicts",
        "decodes",
        "reconnects",
        "covered blocks",
        "verdicts ending in a branch",
        "decodes diverted into a branch",
        "blocks trimmed to a smaller grant",
        "token trees trimmed to a smaller grant",
        "prompts started from cached pages",
        "cached pages evicted",
        "the verifier's own guesses accepted",
    ];
    // The tree paths need a tree, a miss and a second choice that hits: rarer by design; a
    // trimmed block needs the grant to shrink under blocks in flight that the draft got right;
    // a guess of the verifier's own, a decode alone with room in the forward and a text that
    // repeats itself at its end (this target's seldom does).
    let min = [5, 5, 5, 5, 5, 5, 16, 10, 50, 160, 5, 160, 80].map(|d| cases / d);
    for ((name, n), min) in names.iter().zip(with).zip(min) {
        assert!(n >= min, "only {n} of {cases} cases had {name}: {with:?}");
    }
}
