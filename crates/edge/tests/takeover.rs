//! A saturated verifier takes a speculation session over — grants it γ 0 and decodes every token
//! itself, verifying none of its blocks — and later hands it back; the real edge runtime follows
//! along (drafting paused and resumed, blocks in flight matched against the decoded tokens) and
//! commits exactly the target's greedy output. Tiny random model, real verifier and scheduler,
//! real load control, real pipeline: the link drives the verifier through its one API and makes
//! it busy or idle by the clock it turns it on.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tandem_edge::synthetic::SyntheticDrafter;
use tandem_edge::{EdgeError, Link, SpecConfig};
use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{Engine, EngineConfig, LlamaModel, WeightMode};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, Incoming, Shape, VerifyRule};
use tandem_verifier::control::IDLE_RELAX_MS;
use tandem_verifier::{
    Inbound, LoadConfig, Mode, NewSession, ToEdge, VerifierConfig, VerifierCore,
};

const SESSION: SessionId = SessionId(7);

/// A verifier whose grants, within γ 3 and `max_depth`, follow its load, saturated from one token
/// a forward: while forwards follow each other it shrinks the grant a level every other forward,
/// down to γ 0, where it takes its speculation sessions over; idle for [`IDLE_RELAX_MS`], it
/// relaxes the grant a level and hands them back.
fn verifier(max_depth: u32) -> VerifierCore {
    let mut f = tiny_file(&TinySpec::default()).unwrap();
    let m = Arc::new(LlamaModel::load(&mut f, WeightMode::F32).unwrap());
    let e = Engine::new(
        m,
        EngineConfig {
            threads: 1,
            kv_budget_bytes: 1 << 20,
            kv_block_size: 4,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let cfg = VerifierConfig {
        load: LoadConfig {
            saturation_tokens: 1.0,
            ..LoadConfig::new(3, max_depth)
        },
        ..VerifierConfig::default()
    };
    VerifierCore::new(e, cfg, 0).unwrap()
}

fn new_session(prompt: &[u32], max_tokens: usize, mode: Mode) -> NewSession {
    NewSession {
        tenant: TenantId(0),
        prompt: prompt.to_vec(),
        params: SamplingParams::default(),
        max_tokens,
        eog: vec![],
        mode,
        grammar: None,
        logprobs: None,
        self_draft: false,
    }
}

/// The verifier behind a link, turned on a clock the link keeps: with a gap of [`IDLE_RELAX_MS`]
/// before each turn (the verifier idle between them, its grant relaxed) until `take_after`
/// verdicts have come, then turn after turn (the verifier busy, until it takes the session over),
/// and with the gaps again once `give_after` tokens were decoded since (so it hands the session
/// back).
struct Local {
    v: VerifierCore,
    now_us: u64,
    inbox: VecDeque<Incoming>,
    verdicts: usize,
    decoded: usize,
    take_after: usize,
    give_after: usize,
    /// Taken over (told γ 0), when it had decoded this many tokens.
    taken: Option<usize>,
    /// Told a grant of γ 1 or more after it was taken over.
    handed_back: bool,
}

impl Local {
    fn new(v: VerifierCore, take_after: usize, give_after: usize) -> Self {
        Self {
            v,
            now_us: 0,
            inbox: VecDeque::new(),
            verdicts: 0,
            decoded: 0,
            take_after,
            give_after,
            taken: None,
            handed_back: false,
        }
    }

    /// Whether the verifier is kept busy now.
    fn busy(&self) -> bool {
        self.verdicts >= self.take_after
            && self
                .taken
                .is_none_or(|at| self.decoded < at + self.give_after)
    }

    /// One turn, its messages into the inbox (a refusal is the edge's error). Whether it ran a
    /// forward or sent anything.
    fn turn(&mut self) -> Result<bool, EdgeError> {
        if !self.busy() {
            self.now_us += IDLE_RELAX_MS * 1000;
        }
        let t = self.v.turn(self.now_us);
        self.now_us = t.ends_us;
        let did = t.forward.is_some() || !t.out.is_empty();
        for o in t.out {
            let before = self.decoded;
            let grant = match o.msg {
                ToEdge::Verdict(verdict) => {
                    self.verdicts += 1;
                    self.inbox.push_back(Incoming::Verdict(verdict));
                    verdict.grant
                }
                ToEdge::Decoded(decoded) => {
                    self.decoded += 1;
                    self.inbox.push_back(Incoming::Decoded(decoded));
                    decoded.grant
                }
                ToEdge::Error { error, .. } => return Err(EdgeError::Refused(error.to_string())),
                other => panic!("unexpected {other:?}"),
            };
            match grant {
                Some(g) if g.draft_len == 0 => self.taken = self.taken.or(Some(before)),
                Some(_) if self.taken.is_some() => self.handed_back = true,
                _ => {}
            }
        }
        Ok(did)
    }
}

impl Link for Local {
    fn send(&mut self, block: Block) -> Result<(), EdgeError> {
        let msg = Inbound::Draft {
            session: SESSION,
            block,
        };
        self.v.receive(self.now_us, msg);
        Ok(())
    }

    fn ack(&mut self, committed: usize) -> Result<(), EdgeError> {
        let msg = Inbound::Ack {
            session: SESSION,
            committed,
        };
        self.v.receive(self.now_us, msg);
        Ok(())
    }

    fn recv(&mut self, wait: bool) -> Result<Option<Incoming>, EdgeError> {
        while wait && self.inbox.is_empty() {
            // With no work, a turn sends only the answers to what was received (a refusal).
            let idle = !self.v.has_work();
            if !self.turn()? && idle {
                break;
            }
        }
        Ok(self.inbox.pop_front())
    }
}

#[test]
fn a_session_taken_over_and_handed_back_is_the_targets() {
    let prompt: Vec<u32> = (0..8).map(|i| (i * 11 + 5) % 90).collect();
    let n = 40;
    // The target's own greedy answer: a cloud-only generation on a verifier of its own.
    let mut v = verifier(1);
    let open = Inbound::Open {
        session: SessionId(1),
        new: new_session(&prompt, n, Mode::Generate),
        handle: (),
    };
    v.receive(0, open);
    let mut want: Vec<u32> = Vec::new();
    while v.has_work() {
        for o in v.turn(0).out {
            if let ToEdge::Token { token, .. } = o.msg {
                want.push(token);
            }
        }
    }
    assert_eq!(want.len(), n);
    for (take_after, give_after, alpha, depth) in [(2, 5, 0.7, 2), (1, 1, 0.5, 3), (4, 12, 0.9, 1)]
    {
        // Grants within the edge's own shape (γ 3 and its depth).
        let mut link = Local::new(verifier(depth as u32), take_after, give_after);
        let mode = Mode::Speculate {
            rule: VerifyRule::Greedy,
            want: Shape::UNLIMITED,
        };
        let open = Inbound::Open {
            session: SESSION,
            new: new_session(&prompt, n, mode),
            handle: (),
        };
        link.v.receive(0, open);
        // One forward prefills the prompt (and plans the first decode).
        let t = link.v.turn(0);
        let Some(ToEdge::Opened { first, grant, .. }) = t
            .out
            .iter()
            .map(|o| o.msg.clone())
            .find(|m| matches!(m, ToEdge::Opened { .. }))
        else {
            panic!("expected the session to open: {:?}", t.out)
        };
        assert_eq!(
            grant,
            Shape::new(3, depth as u32),
            "the idle verifier's grant"
        );
        link.now_us = t.ends_us;
        let cfg = SpecConfig {
            session: tandem_spec::edge::SessionConfig {
                draft_len: 3,
                depth,
                max_new_tokens: n,
                auto: None,
                tree: tandem_spec::TreeConfig::LINEAR,
            },
            rule: VerifyRule::Greedy,
            params: SamplingParams::default(),
            q_top_k: 0,
            self_draft: true,
            suffix: true,
        };
        let mut d = SyntheticDrafter::new(prompt.len(), want.clone(), alpha, 0.0, 96, 3);
        let r = tandem_edge::run_with(
            &mut d,
            vec![],
            &prompt,
            // (The core bounds no side nodes: the gRPC service does.)
            Some(tandem_spec::Opened {
                first,
                grant,
                side_nodes: usize::MAX,
            }),
            &cfg,
            &mut link,
            Instant::now(),
            |_| {},
        )
        .unwrap();
        assert_eq!(
            r.output_ids, want,
            "take after {take_after}, give after {give_after}"
        );
        assert!(
            link.taken.is_some() && link.handed_back,
            "it was taken over and handed back"
        );
        assert!(r.measured.cloud_decoded >= give_after, "{:?}", r.measured);
        println!(
            "take after {take_after} verdicts, hand back after {give_after}: {} decoded by the verifier, {} verdicts in all, {} stale blocks",
            link.decoded, link.verdicts, r.stats.stale_blocks
        );
    }
}
