use super::*;
use crate::control::IDLE_RELAX_MS;
use crate::control::{ForwardCost, LoadConfig};
use crate::VerifierConfig;
use tandem_engine::{EngineError, Logits, SeqChunk};
use tandem_sched::TenantId;

/// A target whose greedy token after position p is `p % 15 + 1`, each forward taking 1 ms,
/// or (`ragged`) 10 ms, 1 ms a token and 1 ms a sequence more.
struct Flat {
    ragged: bool,
}

const FLAT: Flat = Flat { ragged: false };

impl Target for Flat {
    fn vocab(&self) -> usize {
        16
    }
    fn context_len(&self) -> usize {
        4096
    }
    fn kv_geometry(&self) -> (usize, usize) {
        (16, 4096)
    }
    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        _tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32) {
        let l = Logits::one_hot(batch, 16, |_, pos, _| ((pos + 1) % 15 + 1) as u32);
        let tokens: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let us = match self.ragged {
            true => 1000 * (10 + tokens + batch.len()) as u32,
            false => 1000,
        };
        (Ok(l), us)
    }
    fn keep_path(&mut self, _: &[u32], _: usize, _: &[usize]) -> Result<(), EngineError> {
        Ok(()) // one-hot logits: no KV to move
    }
}

#[test]
fn the_contended_budget_follows_the_time_forwards_take() {
    // The cost model says 10 ms alone and 1 ms a token: within 150% (15 ms), 15 tokens. A
    // batch of one-token sessions costs twice that a token (and a lone forward more), so
    // the budget comes down to what keeps forwards within 150% of the one-token forwards
    // it sees, and goes back to the token budget once one tenant is left.
    let cfg = VerifierConfig {
        token_budget: 32,
        tenant_slowdown_pct: 150,
        ..VerifierConfig::default()
    };
    let mut v: VerifierCore<Flat, u64> = VerifierCore::new(Flat { ragged: true }, cfg, 0).unwrap();
    let b = cfg
        .contended_budget(&ForwardCost {
            one_token_ms: 10.0,
            ms_per_token: 1.0,
        })
        .unwrap();
    assert_eq!((b.tokens, b.target_ms()), (15, 15.0));
    v.set_contended_budget(Some(b)).unwrap();
    v.set_tenant(TenantId(1), Default::default()).unwrap();
    let open = |id: u64, tenant| Inbound::Open {
        session: SessionId(id),
        new: NewSession {
            tenant: TenantId(tenant),
            prompt: vec![3],
            params: SamplingParams::default(),
            max_tokens: 1000,
            eog: vec![],
            mode: Mode::Generate,
            grammar: None,
            logprobs: None,
            self_draft: false,
        },
        handle: id,
    };
    for id in 0..30 {
        v.receive(0, open(id, 0));
    }
    v.receive(0, open(99, 1));
    let mut now = 0;
    let mut last = Vec::new();
    for _ in 0..60 {
        let t = v.turn(now);
        now = t.ends_us;
        last.push(t.forward.unwrap());
    }
    // A forward of one or two tokens takes 12-14 ms here, so the target is about 20 ms:
    // about five tokens.
    let n = v.contended_tokens().unwrap();
    assert!((2..=6).contains(&n), "{n}");
    for f in &last[40..] {
        assert!(f.tokens <= 6 && f.us <= 23_000, "{f:?}");
    }
    // One tenant left: the whole token budget again.
    v.close(SessionId(99));
    let t = v.turn(now);
    assert_eq!(t.forward.unwrap().tokens, 30);
}

fn core() -> VerifierCore<Flat, u64> {
    let cost = ForwardCost {
        one_token_ms: 44.0,
        ms_per_token: 2.2,
    };
    let cfg = VerifierConfig {
        load: LoadConfig {
            saturation_tokens: 40.0,
            forward_cost: Some(cost),
            ..LoadConfig::new(4, 2)
        },
        ..VerifierConfig::default()
    };
    VerifierCore::new(FLAT, cfg, 0).unwrap()
}

fn open(id: u64, mode: Mode) -> Inbound<u64> {
    Inbound::Open {
        session: SessionId(id),
        new: NewSession {
            tenant: TenantId(0),
            prompt: vec![3, 4, 5],
            params: SamplingParams::default(),
            max_tokens: 40,
            eog: vec![],
            mode,
            grammar: None,
            logprobs: None,
            self_draft: false,
        },
        handle: 100 + id,
    }
}

const SPEC: Mode = Mode::Speculate {
    rule: VerifyRule::Greedy,
    want: Shape::new(4, 2),
};

#[test]
fn a_crowd_is_taken_over_and_the_grant_relaxes_when_the_verifier_idles() {
    let mut v = core();
    for id in 0..64 {
        v.receive(0, open(id, SPEC));
    }
    let (mut now, mut takeovers, mut n_decoded) = (0u64, 0, 0);
    for _ in 0..40 {
        let t = v.turn(now * 1000);
        takeovers += t.takeovers;
        for o in &t.out {
            assert_eq!(o.to, 100 + o.session.0, "each message reaches its own edge");
            n_decoded += usize::from(matches!(o.msg, ToEdge::Decoded(_)));
        }
        now += 1;
    }
    // 64 sessions of γ 4 are far past the ridge (≈ 20 tokens): γ 0, every one decoded by the
    // verifier.
    assert_eq!(v.control().grants().current(), (0, 1));
    assert_eq!(takeovers, 64);
    assert!((0..64).all(|id| v.is_taken_over(SessionId(id))));
    assert!(
        n_decoded >= 64,
        "every session got decoded tokens: {n_decoded}"
    );
    // Idle spells relax the grant a level each.
    let before = v.control().grants().current();
    for k in 1..=4 {
        v.turn((now + 2 * k * IDLE_RELAX_MS) * 1000);
    }
    assert_ne!(v.control().grants().current(), before, "relaxed");
    // A closed session no longer counts.
    v.close(SessionId(3));
    assert!(!v.is_taken_over(SessionId(3)));
}

#[test]
fn a_verifier_that_awaits_drafts_verifies_the_blocks_and_decodes_alone_only_after_a_wait() {
    // The same session twice: the default verifier decodes its tokens while no block is
    // there; one that waits 50 ms for drafts runs no forward for it until its edge's block
    // lands, then verifies the block (a drafted token that is wrong included), waits again,
    // and decodes a token alone once 50 ms have passed without a block.
    for awaiting in [false, true] {
        let cfg = VerifierConfig {
            await_drafts_ms: if awaiting { 50 } else { 0 },
            ..VerifierConfig::default()
        };
        let mut v: VerifierCore<Flat, u64> = VerifierCore::new(FLAT, cfg, 0).unwrap();
        v.receive(0, open(1, SPEC));
        let t = v.turn(0);
        assert!(matches!(t.out[0].msg, ToEdge::Admitted { cached: 0 }));
        assert!(matches!(t.out[1].msg, ToEdge::Opened { first: 4, .. }));
        let mut decoded = 0;
        for now in 1..6 {
            let t = v.turn(now * 1000);
            assert_eq!(t.forward.is_some(), !awaiting, "awaiting {awaiting}");
            decoded += t
                .out
                .iter()
                .filter(|o| matches!(o.msg, ToEdge::Decoded(_)))
                .count();
        }
        assert_eq!(decoded, if awaiting { 0 } else { 5 });
        if !awaiting {
            continue;
        }
        // Position q's token is q % 15 + 1: the block's third token is wrong.
        let block = Block {
            epoch: 0,
            index: tandem_spec::BlockId(0),
            start_pos: 4,
            tokens: vec![5, 6, 9, 8],
            q: vec![],
            side: vec![],
        };
        v.receive(
            6_000,
            Inbound::Draft {
                session: SessionId(1),
                block,
            },
        );
        let t = v.turn(6_000);
        assert_eq!(
            t.forward.map(|f| f.tokens),
            Some(5),
            "the last token and the block"
        );
        let verdicts: Vec<_> = t
            .out
            .iter()
            .filter_map(|o| match &o.msg {
                ToEdge::Verdict(v) => Some((v.accepted, v.token)),
                _ => None,
            })
            .collect();
        assert_eq!(verdicts, vec![(2, 7)], "two accepted, then the correction");
        assert!(
            v.turn(7_000).forward.is_none(),
            "waiting for the next block"
        );
        // The wait began with the verdict's turn, at 6 ms: it runs out at 56 ms.
        assert_eq!(v.wake_at_us(), Some(56_000));
        assert!(v.turn(55_000).forward.is_none());
        let t = v.turn(56_000);
        let decoded: Vec<_> = t
            .out
            .iter()
            .filter_map(|o| match &o.msg {
                ToEdge::Decoded(d) => Some((d.pos, d.token)),
                _ => None,
            })
            .collect();
        assert_eq!(
            decoded,
            vec![(7, 8)],
            "a token decoded alone after the wait"
        );
        assert_eq!(
            v.wake_at_us(),
            Some(106_000),
            "and a new wait from its turn"
        );
    }
}

#[test]
fn blocks_sent_behind_the_open_wait_for_the_prefill_and_the_first_forward_verifies_them() {
    // An edge that drafts from its Open on: its blocks reach the verifier before the prompt
    // is prefilled. They wait, are checked when the session opens (one inside the prompt is
    // refused by name, after `Opened`), and the first forward verifies the first of them
    // instead of decoding a token alone.
    let mut v = core();
    let block = |index, start_pos, tokens: Vec<u32>| Inbound::Draft {
        session: SessionId(1),
        block: Block {
            epoch: 0,
            index: tandem_spec::BlockId(index),
            start_pos,
            tokens,
            q: vec![],
            side: vec![],
        },
    };
    v.receive(0, open(1, SPEC));
    // Position q's token is q % 15 + 1; the prompt is 3 tokens, so the first token (4) is at
    // position 3, where the first block starts (the edge's guess of it included).
    v.receive(0, block(0, 3, vec![4, 5, 6, 7]));
    v.receive(0, block(1, 2, vec![3]));
    v.receive(0, block(2, 7, vec![8, 9, 10, 11]));
    let t = v.turn(0);
    assert!(matches!(t.out[0].msg, ToEdge::Admitted { .. }));
    assert!(matches!(t.out[1].msg, ToEdge::Opened { first: 4, .. }));
    assert!(
        matches!(&t.out[2].msg, ToEdge::Error { error, .. } if error.to_string().contains("inside the prompt")),
        "{:?}",
        t.out
    );
    let answers = |t: &Turn<u64>| -> Vec<String> {
        t.out
            .iter()
            .map(|o| match &o.msg {
                ToEdge::Verdict(v) => format!("verdict {} {} {}", v.block, v.accepted, v.token),
                ToEdge::Decoded(d) => format!("decoded {} {}", d.pos, d.token),
                m => format!("{m:?}"),
            })
            .collect()
    };
    let t = v.turn(1_000);
    assert_eq!(
        t.forward.map(|f| f.tokens),
        Some(4),
        "the first token and three drafted"
    );
    assert_eq!(
        answers(&t),
        vec!["verdict 0 4 8"],
        "all four right, then the bonus"
    );
    let t = v.turn(2_000);
    assert_eq!(answers(&t), vec!["verdict 2 4 12"]);
}

#[test]
fn a_turn_answers_in_order_stamps_its_end_and_closes_what_ended() {
    let mut v = core();
    v.receive(0, open(1, SPEC));
    v.receive(0, open(2, Mode::Generate));
    // A duplicate is refused at once, with the next turn, on its own handle.
    v.receive(0, open(1, Mode::Generate));
    let t = v.turn(5_000);
    assert_eq!(
        t.forward.map(|f| (f.sessions, f.tokens, f.us)),
        Some((2, 6, 1000))
    );
    assert_eq!(t.ends_us, 6_000, "the turn ends when its forward does");
    let msgs: Vec<(SessionId, &ToEdge)> = t.out.iter().map(|o| (o.session, &o.msg)).collect();
    assert!(
        matches!(
            msgs[0],
            (
                SessionId(1),
                ToEdge::Error {
                    error: VerifierError::DuplicateSession(SessionId(1)),
                    fatal: true,
                    ..
                }
            )
        ),
        "{msgs:?}"
    );
    // Admitted before its prefill, then opened by it (one turn here: a short prompt).
    assert!(
        matches!(msgs[1], (SessionId(1), ToEdge::Admitted { cached: 0 })),
        "{msgs:?}"
    );
    assert!(
        matches!(msgs[2], (SessionId(2), ToEdge::Admitted { cached: 0 })),
        "{msgs:?}"
    );
    assert!(
        matches!(msgs[3], (SessionId(1), ToEdge::Opened { grant, .. }) if *grant == (4, 2)),
        "{msgs:?}"
    );
    assert!(
        matches!(msgs[4], (SessionId(2), ToEdge::Token { done: false, .. })),
        "{msgs:?}"
    );
    // Both first tokens came 1 ms after their sessions opened (at 0): the turn's end.
    let firsts: Vec<f64> = t
        .observations
        .iter()
        .filter_map(|o| match o {
            Observation::FirstToken { seconds } => Some(*seconds),
            _ => None,
        })
        .collect();
    assert_eq!(firsts, vec![0.006, 0.006]);
    // The generation runs to its end, is closed by the turn that sends its last token, and
    // a draft for it afterwards is refused by name.
    let mut now = 6_000;
    let mut last = None;
    while v.session(SessionId(2)).is_some() {
        let t = v.turn(now);
        now = t.ends_us + 1;
        last = t.out.into_iter().rfind(|o| o.session == SessionId(2));
    }
    assert!(matches!(
        last.unwrap().msg,
        ToEdge::Token { done: true, .. }
    ));
    v.receive(
        now,
        Inbound::Draft {
            session: SessionId(2),
            block: Block {
                epoch: 0,
                index: tandem_spec::BlockId(0),
                start_pos: 3,
                tokens: vec![1],
                q: vec![],
                side: vec![],
            },
        },
    );
    v.receive(
        now,
        Inbound::Close {
            session: SessionId(1),
        },
    );
    let t = v.turn(now);
    assert!(t.forward.is_none() && v.session(SessionId(1)).is_none());
    // Its answer is dropped: no record is left to reach it through.
    assert!(t.out.is_empty(), "{:?}", t.out);
}

#[test]
fn cancel_drain_and_shut_down_free_their_sessions_and_say_why() {
    let mut v = core();
    v.set_tenant(TenantId(1), Default::default()).unwrap();
    v.receive(0, open(1, SPEC));
    v.receive(0, open(2, Mode::Generate));
    v.receive(0, open(3, SPEC));
    let t = v.turn(0);
    // Two speculation sessions admitted and opened, a generation admitted and its first token.
    assert_eq!(t.out.len(), 6);
    let free = v.scheduler().pool().num_free();
    // Another tenant's cancel finds nothing and changes nothing; the owner's ends it, frees
    // its KV and tells its edge with the next turn.
    assert_eq!(
        v.cancel(SessionId(1), TenantId(1)),
        Err(VerifierError::UnknownSession(SessionId(1)))
    );
    assert!(v.session(SessionId(1)).is_some());
    assert_eq!(v.cancel(SessionId(1), TenantId(0)), Ok(()));
    assert!(v.session(SessionId(1)).is_none());
    assert!(
        v.scheduler().pool().num_free() > free,
        "its KV blocks are free"
    );
    assert_eq!(
        v.cancel(SessionId(1), TenantId(0)),
        Err(VerifierError::UnknownSession(SessionId(1)))
    );
    let t = v.turn(2_000);
    let cancelled: Vec<_> = t.out.iter().filter(|o| o.session == SessionId(1)).collect();
    assert_eq!(cancelled.len(), 1, "{:?}", t.out);
    assert_eq!(cancelled[0].to, 101);
    assert!(matches!(
        cancelled[0].msg,
        ToEdge::Error {
            error: VerifierError::Cancelled(SessionId(1)),
            fatal: true,
            retry_after_ms: None,
        }
    ));
    // Draining refuses a new session and keeps the open ones.
    v.drain();
    v.receive(3_000, open(4, SPEC));
    let t = v.turn(3_000);
    assert!(t.out.iter().any(|o| o.session == SessionId(4)
        && matches!(
            o.msg,
            ToEdge::Error {
                error: VerifierError::Draining,
                fatal: true,
                ..
            }
        )));
    assert_eq!(v.open_sessions(), 2);
    // The shut-down ends both, each told once on its own handle, and every block is free.
    v.shut_down();
    assert_eq!(v.open_sessions(), 0);
    let t = v.turn(4_000);
    let mut told: Vec<(u64, u64)> = t
        .out
        .iter()
        .filter(|o| {
            matches!(
                o.msg,
                ToEdge::Error {
                    error: VerifierError::Draining,
                    fatal: true,
                    ..
                }
            )
        })
        .map(|o| (o.session.0, o.to))
        .collect();
    told.sort();
    assert_eq!(told, vec![(2, 102), (3, 103)]);
    let pool = v.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_pages());
}

#[test]
fn a_speculation_session_whose_edge_goes_quiet_is_closed_at_its_idle_timeout() {
    // Idle timeout 100 ms. The session opens at 0 and its prefill answers at once; its edge
    // acks at 90 ms, so it lives past 100 ms; with nothing more it is closed at 190 ms (the
    // driver is woken for it), its edge told why, its usage ended as abandoned. A cloud-only
    // generation, whose client sends nothing by design, is never closed for it.
    let cfg = VerifierConfig {
        load: LoadConfig {
            idle_timeout_ms: Some(100),
            ..LoadConfig::FIXED
        },
        await_drafts_ms: 1000,
        ..VerifierConfig::default()
    };
    let mut v: VerifierCore<Flat, u64> = VerifierCore::new(FLAT, cfg, 0).unwrap();
    v.receive(0, open(1, SPEC));
    v.receive(0, open(2, Mode::Generate));
    let t = v.turn(0);
    assert!(t.out.iter().any(|o| matches!(o.msg, ToEdge::Opened { .. })));
    let opened_at = t.ends_us;
    v.receive(
        90_000,
        Inbound::Ack {
            session: SessionId(1),
            committed: 4,
        },
    );
    let mut closed = None;
    let mut now = 90_000;
    while closed.is_none() && now < 1_000_000 {
        let t = if v.has_work() {
            v.turn(now)
        } else {
            now = v
                .wake_at_us()
                .expect("a quiet session wakes the driver")
                .max(now);
            v.turn(now)
        };
        now = t.ends_us;
        for o in t.out {
            if let ToEdge::Error { error, fatal, .. } = o.msg {
                assert_eq!(o.session, SessionId(1), "the generation is never idle");
                assert!(fatal);
                assert_eq!(error.kind(), crate::ErrorKind::DeadlineExceeded);
                assert!(error
                    .to_string()
                    .starts_with("idle: nothing from the edge in 0.1 s"));
                closed = Some((now, t.finished.clone()));
                break;
            }
        }
    }
    let (at, finished) = closed.expect("closed for idleness");
    assert!(at >= 190_000.max(opened_at + 100_000), "closed at {at} µs");
    assert!(at < 200_000, "closed at {at} µs");
    let quiet: Vec<_> = finished
        .iter()
        .filter(|u| u.session == SessionId(1))
        .collect();
    assert_eq!(quiet.len(), 1);
    assert_eq!(quiet[0].finish, crate::Finish::Abort);
    assert!(v.session(SessionId(1)).is_none());
}

#[test]
fn an_admission_goes_out_before_the_forward_that_prefills_the_prompt() {
    let mut v = core();
    v.receive(0, open(1, SPEC));
    v.receive(0, open(2, Mode::Generate));
    // Both hear of their admission before the turn, whose forward is their prefill.
    let a = v.admissions();
    assert_eq!(a.len(), 2);
    assert!(matches!(
        (a[0].session, &a[0].msg),
        (SessionId(1), ToEdge::Admitted { cached: 0 })
    ));
    assert!(matches!(
        (a[1].session, &a[1].msg),
        (SessionId(2), ToEdge::Admitted { cached: 0 })
    ));
    assert!(v.admissions().is_empty(), "each once");
    let t = v.turn(0);
    assert!(t.forward.is_some());
    assert!(t
        .out
        .iter()
        .all(|o| !matches!(o.msg, ToEdge::Admitted { .. })));
    assert!(t
        .out
        .iter()
        .any(|o| o.session == SessionId(1) && matches!(o.msg, ToEdge::Opened { .. })));
}

/// A verifier that takes a speculation session whose edge says nothing for 50 ms for quiet,
/// forwards of 10 ms and 1 ms a token and a sequence, and a second tenant.
fn quiet_verifier() -> VerifierCore<Flat, u64> {
    let cfg = VerifierConfig {
        load: LoadConfig {
            quiet_ms: Some(50),
            ..LoadConfig::FIXED
        },
        ..VerifierConfig::default()
    };
    let mut v: VerifierCore<Flat, u64> = VerifierCore::new(Flat { ragged: true }, cfg, 0).unwrap();
    v.set_tenant(TenantId(1), tandem_sched::TenantConfig::default())
        .unwrap();
    v
}

/// An edge that is there but sends no block — the verifier decodes its session itself, or its
/// draft is still prefilling — speaks anyway (it acks the first token at once, then every
/// ACK_EVERY): its session is never taken for quiet, and is decoded in every forward while
/// another tenant works, however much longer than the quiet time ACK_EVERY tokens take.
#[test]
fn a_session_whose_edge_drafts_nothing_but_acks_is_never_quiet() {
    use tandem_spec::edge::{EdgeSession, Incoming, Opened, SessionConfig};
    let mut v = quiet_verifier();
    v.receive(0, open(1, SPEC));
    let mut other = open(100, Mode::Generate);
    if let Inbound::Open { new, .. } = &mut other {
        new.tenant = TenantId(1);
        new.max_tokens = 30;
    }
    v.receive(0, other);
    let mut edge: Option<EdgeSession> = None;
    let (mut now, mut forwards_while_other, mut decoded_while_other) = (0, 0, 0);
    let mut acks = 0;
    while v.session(SessionId(100)).is_some() && now < 3_000_000 {
        let t = v.turn(now);
        now = t.ends_us.max(now + 1000);
        let mut outputs = Vec::new();
        for o in &t.out {
            match (&o.msg, o.session.0) {
                (&ToEdge::Opened { first, grant, .. }, 1) => {
                    let (e, out) = EdgeSession::new(
                        now,
                        vec![3, 4, 5],
                        Opened {
                            first,
                            grant,
                            side_nodes: 0,
                        },
                        SessionConfig {
                            draft_len: 4,
                            depth: 2,
                            max_new_tokens: 40,
                            auto: None,
                            tree: tandem_spec::TreeConfig::LINEAR,
                        },
                        vec![],
                    )
                    .unwrap();
                    edge = Some(e);
                    outputs.extend(out);
                }
                (ToEdge::Decoded(d), 1) => {
                    decoded_while_other += 1;
                    let e = edge.as_mut().expect("opened first");
                    outputs.extend(e.on_message(now, Incoming::Decoded(*d)).unwrap().outputs);
                }
                (ToEdge::Token { .. }, 100) if edge.is_some() => forwards_while_other += 1,
                _ => {}
            }
        }
        // The edge never drafts: what it says is its acks.
        for o in outputs {
            if let tandem_spec::Output::Ack { committed } = o {
                acks += 1;
                v.receive(
                    now,
                    Inbound::Ack {
                        session: SessionId(1),
                        committed,
                    },
                );
            }
        }
        assert_eq!(v.stats.quiet_sessions, 0, "at {now} us");
    }
    assert!(v.session(SessionId(100)).is_none(), "the generation ended");
    assert!(acks >= 2, "the first token's ack and those after: {acks}");
    // One token a forward for both (the last of the generation's may come before the session's).
    assert!(
        decoded_while_other + 1 >= forwards_while_other,
        "{decoded_while_other} tokens decoded for the silent session in {forwards_while_other} forwards"
    );
}

/// Speculation sessions whose edge says nothing for `quiet_ms` are decoded in the background:
/// while another tenant's generation runs they get no forward of theirs (its forwards stay the
/// size of its own work); when it is done they go on; an ack brings one back to the foreground.
#[test]
fn quiet_sessions_wait_while_another_tenant_works_and_come_back_when_their_edge_speaks() {
    let mut v = quiet_verifier();
    // Tenant 0: eight speculation sessions whose edges never speak. Tenant 1: a generation.
    for id in 1..=8 {
        v.receive(0, open(id, SPEC));
    }
    let mut victim = open(100, Mode::Generate);
    if let Inbound::Open { new, .. } = &mut victim {
        new.tenant = TenantId(1);
        new.max_tokens = 60;
    }
    v.receive(0, victim);
    let mut now = 0;
    let (mut quiet_tokens, mut victim_done_at, mut victim_tokens) = (0, None, 0);
    let (mut acked, mut at_done) = (false, 0);
    while now < 3_000_000 {
        let t = v.turn(now);
        now = t.ends_us.max(now + 1000);
        for o in &t.out {
            match (&o.msg, o.session.0) {
                (ToEdge::Token { .. }, 100) => victim_tokens += 1,
                // Past the quiet time (50 ms after the `Open`; the first forward, the prompts',
                // answers at 46 ms) and the forward planned before it, no quiet session is
                // decoded while the generation runs.
                (ToEdge::Decoded(_), id)
                    if id <= 8 && victim_done_at.is_none() && now > 150_000 =>
                {
                    quiet_tokens += 1
                }
                _ => {}
            }
        }
        let s1 = || v.session(SessionId(1)).map_or(0, |s| s.committed_len);
        if victim_done_at.is_none() && v.session(SessionId(100)).is_none() {
            victim_done_at = Some(now);
            at_done = s1();
        }
        if let Some(done) = victim_done_at {
            if !acked && now > done + 200_000 {
                // The quiet sessions went on alone meanwhile; session 1's edge now speaks.
                assert!(s1() > at_done, "{} after {at_done}", s1());
                v.receive(
                    now,
                    Inbound::Ack {
                        session: SessionId(1),
                        committed: 4,
                    },
                );
                acked = true;
                assert_eq!(v.stats.quiet_sessions, 8);
                v.turn(now);
                assert_eq!(v.stats.quiet_sessions, 7);
                break;
            }
        }
    }
    assert!(victim_tokens >= 59, "the generation ran: {victim_tokens}");
    assert!(victim_done_at.is_some() && acked);
    assert_eq!(
        quiet_tokens, 0,
        "quiet sessions decoded while another tenant worked"
    );
}
