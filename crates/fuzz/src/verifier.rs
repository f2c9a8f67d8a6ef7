//! The verifier core behind the server's validation, fed by up to four sessions at once.
//!
//! Each op of the input acts on one slot: open a session honestly (an edge session core drafts
//! for it), send it raw protobuf bytes (decoded, validated and handed on exactly as the gRPC
//! service does, through [`SessionStream`]), draft a token for it (the target's own or the
//! fuzzer's), run a turn and deliver what the verifier sent, close, cancel, or drain.
//!
//! Invariants: nothing panics; a session that received only honest messages commits exactly the
//! target's greedy tokens, and its edge accepts every message the verifier sends it; once every
//! session is closed, the verifier holds no session and no KV block.

use prost::Message;
use tandem_cloud::validation::{self, OnStream, SessionStream};
use tandem_proto::v1::{self, edge_message, EdgeMessage, ModelInfo};
use tandem_proto::{rule_to_proto, FromCloud, PROTOCOL_VERSION};
use tandem_sched::{SessionId, TenantId};
use tandem_sim::{target_token, SimTarget, Texts, VOCAB};
use tandem_spec::capacity::ForwardCost;
use tandem_spec::pipeline::{Next, Output, TreeConfig};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{EdgeSession, Opened, SessionConfig, Shape, VerifyRule};
use tandem_verifier::{
    Inbound, LoadConfig, Mode, NewSession, ToEdge, VerifierConfig, VerifierCore,
};

use crate::Input;

const SEED: u64 = 7;
const SLOTS: usize = 4;
const KV_BLOCKS: usize = 48;
const FINGERPRINT: &str = "fuzz";

/// As `cloud serve` at its largest shape (γ ≤ 8, depth ≤ 4), without token trees, and with
/// every session kept at the shape it asked for.
const LOAD: LoadConfig = LoadConfig {
    max_draft_len: 8,
    max_depth: 4,
    max_side_nodes: 0,
    ..LoadConfig::FIXED
};

fn model() -> ModelInfo {
    ModelInfo {
        name: "fuzz".into(),
        tokenizer_fingerprint: FINGERPRINT.into(),
        vocab_size: VOCAB as u32,
        context_length: 4096,
        weights: "sim".into(),
    }
}

/// One open session, as the server's stream task and its edge see it.
struct Slot {
    check: SessionStream,
    /// The honest edge (None: opened by raw bytes, or its edge is gone).
    edge: Option<EdgeSession>,
    prompt: Vec<u32>,
    max_tokens: usize,
    want: Shape,
    /// Raw bytes reached this session: its answer is no longer the target's to check.
    tainted: bool,
    /// Tokens committed to its edge so far, from the prompt's end.
    committed: Vec<u32>,
}

struct World {
    core: VerifierCore<SimTarget, u8>,
    slots: [Option<Slot>; SLOTS],
    next_id: u64,
    now_us: u64,
}

fn eog() -> Vec<u32> {
    vec![VOCAB as u32 - 1]
}

impl World {
    fn new() -> Self {
        let target = SimTarget::new(
            ForwardCost {
                one_token_ms: 20.0,
                ms_per_token: 1.0,
            },
            KV_BLOCKS,
            Texts::new(SEED),
        );
        let cfg = VerifierConfig {
            token_budget: 32,
            max_sessions: 3,
            max_waiting_tokens: 256,
            load: LOAD,
            ..VerifierConfig::default()
        };
        Self {
            core: VerifierCore::new(target, cfg, 0).expect("a valid verifier configuration"),
            slots: Default::default(),
            next_id: 1,
            now_us: 0,
        }
    }

    /// The Open message's path through validation into the core, as the service takes it.
    fn open(&mut self, slot: usize, open: v1::Open, honest: bool) {
        let Ok(o) = validation::open(open, &model()) else {
            return;
        };
        // What the service checks a session's blocks against, as the core clamps it.
        let (want, max_side) = LOAD.clamp(Shape::new(o.want_draft_len, o.want_depth), 0);
        let (gamma, depth) = (want.draft_len, want.depth);
        let session = SessionId(self.next_id);
        self.next_id += 1;
        let uses_q = o.rule.effective(&o.params) == VerifyRule::Rejection;
        self.slots[slot] = Some(Slot {
            check: SessionStream {
                session,
                vocab: VOCAB,
                max_len: gamma as usize,
                max_side: max_side as usize,
                uses_q,
            },
            edge: None,
            prompt: o.prompt.clone(),
            max_tokens: o.max_tokens,
            want: Shape::new(gamma, depth),
            tainted: !honest,
            committed: Vec::new(),
        });
        self.core.receive(
            self.now_us,
            Inbound::Open {
                session,
                new: NewSession {
                    tenant: TenantId(0),
                    prompt: o.prompt,
                    params: o.params,
                    max_tokens: o.max_tokens,
                    eog: eog(),
                    mode: Mode::Speculate {
                        rule: o.rule,
                        want: Shape::new(gamma, depth),
                    },
                    grammar: None,
                    logprobs: None,
                    self_draft: o.self_draft,
                },
                handle: slot as u8,
            },
        );
    }

    /// A message on `slot`'s stream, through its encoding and the service's validation.
    fn message(&mut self, slot: usize, m: EdgeMessage) {
        let Some(s) = self.slots[slot].as_ref() else {
            return;
        };
        let bytes = m.encode_to_vec();
        let m = EdgeMessage::decode(bytes.as_slice()).expect("a message we encoded decodes");
        match s.check.message::<u8>(m) {
            OnStream::Core(m) => self.core.receive(self.now_us, m),
            OnStream::Refuse(_) => {}
            OnStream::End => self.close(slot),
        }
    }

    fn close(&mut self, slot: usize) {
        if let Some(s) = self.slots[slot].take() {
            self.core.receive(
                self.now_us,
                Inbound::Close {
                    session: s.check.session,
                },
            );
        }
    }

    /// What the honest edge of `slot` said: blocks and acks go to the verifier, commits are
    /// checked against the target.
    fn outputs(&mut self, slot: usize, out: Vec<Output>) {
        for o in out {
            match o {
                Output::Send(b) => self.message(
                    slot,
                    EdgeMessage {
                        kind: Some(edge_message::Kind::Draft(v1::Draft::from(&b))),
                    },
                ),
                Output::Ack { committed } => self.message(
                    slot,
                    EdgeMessage {
                        kind: Some(edge_message::Kind::Ack(v1::Ack {
                            committed: committed as u64,
                        })),
                    },
                ),
                Output::Commit { pos, tokens } => {
                    let Some(s) = self.slots[slot].as_mut() else {
                        return;
                    };
                    assert_eq!(
                        pos,
                        s.prompt.len() + s.committed.len(),
                        "commits are contiguous"
                    );
                    s.committed.extend(tokens);
                    if !s.tainted {
                        check_target(s);
                    }
                }
                Output::Rollback { .. } => {}
            }
        }
    }

    fn draft(&mut self, slot: usize, choice: u8) {
        let Some(s) = self.slots[slot].as_mut() else {
            return;
        };
        let Some(edge) = s.edge.as_mut() else {
            return;
        };
        if edge.next() != Next::Draft {
            return;
        }
        let tokens = edge.pipeline().tokens();
        let pos = tokens.len();
        let prev = *tokens.last().expect("a session has a prompt");
        // Mostly the target's own token (so that blocks are accepted), sometimes a wrong one.
        let token = if choice < 192 {
            target_token(SEED, s.check.session.0, pos, prev)
        } else {
            u32::from(choice) % VOCAB as u32
        };
        let out = edge.on_drafted(self.now_us, token, None, 1.0, false);
        self.outputs(slot, out);
    }

    fn turn(&mut self) {
        let turn = self.core.turn(self.now_us);
        self.now_us = self.now_us.max(turn.ends_us);
        let now_us = self.now_us;
        for o in turn.out {
            let slot = o.to as usize;
            let Some(s) = self.slots[slot].as_mut() else {
                continue;
            };
            if s.check.session != o.session {
                continue; // a session closed before, whose slot was reused
            }
            let incoming = match o.msg {
                ToEdge::Opened { first, grant, .. } => {
                    if s.tainted || s.edge.is_some() {
                        continue;
                    }
                    let cfg = SessionConfig {
                        draft_len: s.want.draft_len as usize,
                        depth: s.want.depth as usize,
                        max_new_tokens: s.max_tokens,
                        auto: None,
                        tree: TreeConfig::LINEAR,
                    };
                    let opened = Opened {
                        first,
                        grant,
                        side_nodes: 0,
                    };
                    let (edge, out) =
                        EdgeSession::new(now_us, s.prompt.clone(), opened, cfg, eog())
                            .expect("the verifier's Opened starts an edge session");
                    s.edge = Some(edge);
                    self.outputs(slot, out);
                    continue;
                }
                ToEdge::Verdict(v) => v1::CloudMessage {
                    kind: Some(v1::cloud_message::Kind::Verdict(v.into())),
                },
                ToEdge::Logprobs(_) => continue,
                ToEdge::Decoded(d) => v1::CloudMessage {
                    kind: Some(v1::cloud_message::Kind::Decoded(d.into())),
                },
                ToEdge::Error { fatal: true, .. } => {
                    // The verifier closed the session.
                    self.slots[slot] = None;
                    continue;
                }
                ToEdge::Error { .. } | ToEdge::Token { .. } | ToEdge::Admitted { .. } => continue,
            };
            let bytes = incoming.encode_to_vec();
            let m = v1::CloudMessage::decode(bytes.as_slice()).expect("what we encoded decodes");
            let FromCloud::Message(m) = tandem_proto::from_cloud(m) else {
                continue;
            };
            let Some(edge) = s.edge.as_mut() else {
                continue;
            };
            match edge.on_message(now_us, m) {
                Ok(r) => self.outputs(slot, r.outputs),
                Err(e) => assert!(
                    s.tainted,
                    "an honest session's edge refused its verifier's {m:?}: {e}"
                ),
            }
        }
    }

    fn run(&mut self, input: &mut Input) {
        while !input.is_empty() {
            let op = input.byte();
            let slot = (op >> 4) as usize % SLOTS;
            match op % 8 {
                0 => {
                    if self.slots[slot].is_none() {
                        let open = honest_open(input);
                        self.open(slot, open, true);
                    }
                }
                1 => {
                    let Ok(m) = EdgeMessage::decode(input.chunk()) else {
                        continue; // the transport refuses what does not decode
                    };
                    match (self.slots[slot].as_mut(), m.kind) {
                        (None, Some(edge_message::Kind::Open(o))) => self.open(slot, o, false),
                        (None, _) => {} // the first message must be Open
                        (Some(s), kind) => {
                            s.tainted = true;
                            self.message(slot, EdgeMessage { kind });
                        }
                    }
                }
                2 | 3 => {
                    let choice = input.byte();
                    self.draft(slot, choice);
                }
                4 | 5 => {
                    self.now_us += u64::from(input.byte()) * 1000;
                    self.turn();
                }
                6 => self.close(slot),
                _ => match input.byte() % 4 {
                    0 => self.core.drain(),
                    1 => {
                        if let Some(s) = self.slots[slot].as_ref() {
                            let _ = self.core.cancel(s.check.session, TenantId(0));
                        }
                    }
                    _ => {
                        // Whole rounds of honest work: every edge drafts, then a turn.
                        for _ in 0..8 {
                            for s in 0..SLOTS {
                                self.draft(s, 0);
                            }
                            self.turn();
                        }
                    }
                },
            }
        }
        for s in 0..SLOTS {
            self.close(s);
        }
        self.turn();
        assert_eq!(self.core.open_sessions(), 0, "every session closed");
        let pool = self.core.scheduler().pool();
        assert_eq!(
            pool.num_free(),
            pool.num_pages(),
            "every KV block is free once every session is closed"
        );
    }
}

/// The target's greedy continuation of the session's prompt, as far as it has committed.
fn check_target(s: &Slot) {
    let mut prev = *s.prompt.last().expect("a prompt");
    for (i, &t) in s.committed.iter().enumerate() {
        let pos = s.prompt.len() + i;
        let want = target_token(SEED, s.check.session.0, pos, prev);
        assert_eq!(
            t, want,
            "session {} committed {t} at {pos}, the target's token is {want}",
            s.check.session.0
        );
        prev = t;
    }
}

fn honest_open(input: &mut Input) -> v1::Open {
    let n = 1 + input.byte() as usize % 24;
    let prompt_ids: Vec<u32> = input
        .take(n)
        .iter()
        .map(|&b| u32::from(b) % VOCAB as u32)
        .chain(std::iter::once(1))
        .collect();
    let rule = match input.byte() % 3 {
        0 => VerifyRule::Greedy,
        1 => VerifyRule::SampleMatch,
        _ => VerifyRule::Rejection,
    };
    // Half the sessions let the verifier draft for itself (chosen from bytes already read, so
    // the corpora keep their meaning).
    let self_draft = prompt_ids.len().is_multiple_of(2);
    v1::Open {
        protocol_version: PROTOCOL_VERSION,
        tokenizer_fingerprint: FINGERPRINT.into(),
        self_draft,
        prompt_ids,
        params: Some(SamplingParams::default().into()),
        max_tokens: 1 + u32::from(input.byte()) % 48,
        rule: rule_to_proto(rule) as i32,
        want_draft_len: 1 + u32::from(input.byte()) % 8,
        want_depth: 1 + u32::from(input.byte()) % 4,
        want_side_nodes: 0,
        grammar: None,
        logprobs: false,
        top_logprobs: 0,
    }
}

/// See the module docs.
pub fn verifier_stream(data: &[u8]) {
    World::new().run(&mut Input::new(data));
}
