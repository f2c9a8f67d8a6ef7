//! What each session used, told once when it ends: every committed token counted once, as an
//! accepted draft token or a cloud token (the first token, corrections, bonuses, decoded ones),
//! with the reason it ended — for speculation and cloud-only generation, closed by its edge,
//! finished, cancelled or shut down.

mod common;

use common::{core, oracle, OneHot};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, BlockId, Shape, VerifyRule};
use tandem_verifier::{Finish, Inbound, Mode, NewSession, ToEdge, Usage, VerifierCore};

const PROMPT: [u32; 3] = [3, 4, 5];

fn open(v: &mut VerifierCore<OneHot>, id: u64, mode: Mode, max_tokens: usize, eog: Vec<u32>) {
    v.receive(
        0,
        Inbound::Open {
            session: SessionId(id),
            new: NewSession {
                tenant: TenantId(0),
                prompt: PROMPT.to_vec(),
                params: SamplingParams::default(),
                max_tokens,
                eog,
                mode,
                grammar: None,
                logprobs: None,
                self_draft: false,
            },
            handle: (),
        },
    );
}

/// Turn until nothing is left to do; the messages and the usage told.
fn settle(v: &mut VerifierCore<OneHot>, t: &mut u64) -> (Vec<ToEdge>, Vec<Usage>) {
    let (mut out, mut used) = (Vec::new(), Vec::new());
    for _ in 0..200 {
        *t += 1000;
        let turn = v.turn(*t);
        out.extend(turn.out.into_iter().map(|o| o.msg));
        used.extend(turn.finished);
        if !v.has_work() {
            break;
        }
    }
    (out, used)
}

fn block(index: u64, start_pos: usize, tokens: Vec<u32>) -> Block {
    Block {
        epoch: 0,
        index: BlockId(index),
        start_pos,
        tokens,
        q: vec![],
        side: vec![],
    }
}

#[test]
fn a_speculation_session_counts_each_token_once() {
    let (mut v, _) = core();
    let mut t = 0;
    let want = oracle(&PROMPT, 12);
    let spec = Mode::Speculate {
        rule: VerifyRule::Greedy,
        want: Shape::new(4, 2),
    };
    open(&mut v, 1, spec, 12, vec![]);
    let mut t1 = t + 1000;
    let opened = v.turn(t1);
    t = t1;
    assert!(matches!(opened.out[0].msg, ToEdge::Admitted { .. }));
    assert!(matches!(opened.out[1].msg, ToEdge::Opened { .. }));
    // Four right drafts (the bonus follows), then one right and one wrong (the correction).
    let p = PROMPT.len();
    v.receive(
        t,
        Inbound::Draft {
            session: SessionId(1),
            block: block(0, p + 1, want[1..5].to_vec()),
        },
    );
    t1 = t + 1000;
    let a = v.turn(t1);
    t = t1;
    assert!(matches!(a.out[0].msg, ToEdge::Verdict(v) if v.accepted == 4));
    v.receive(
        t,
        Inbound::Draft {
            session: SessionId(1),
            block: block(1, p + 6, vec![want[6], want[7] % 15 + 1, 9]),
        },
    );
    t1 = t + 1000;
    let b = v.turn(t1);
    t = t1;
    assert!(matches!(b.out[0].msg, ToEdge::Verdict(v) if v.accepted == 1));
    // The rest is decoded by the verifier; the edge closes once it has all 12.
    let (out, used) = settle(&mut v, &mut t);
    assert!(used.is_empty(), "still open: {used:?}");
    let decoded = out
        .iter()
        .filter(|m| matches!(m, ToEdge::Decoded(_)))
        .count();
    assert_eq!(decoded, 12 - 8);
    v.receive(
        t,
        Inbound::Close {
            session: SessionId(1),
        },
    );
    let (_, used) = settle(&mut v, &mut t);
    assert_eq!(used.len(), 1);
    let u = &used[0];
    assert_eq!(
        (u.committed_tokens, u.accepted_draft_tokens, u.cloud_tokens),
        (12, 5, 7),
        "{u:?}"
    );
    assert_eq!((u.drafted_tokens, u.decoded_tokens), (7, 4));
    assert_eq!(
        (u.prompt_tokens, u.finish, u.speculative),
        (3, Finish::Length, true)
    );
    assert!(u
        .first_token_us
        .is_some_and(|f| f >= u.opened_us && f <= u.closed_us));
}

#[test]
fn generations_end_by_stop_or_length_and_sessions_by_their_edge_tenant_or_a_shut_down() {
    let (mut v, _) = core();
    let mut t = 0;
    let want = oracle(&PROMPT, 8);
    // Stops at an end-of-generation token (the 4th), or runs to its limit.
    open(&mut v, 1, Mode::Generate, 8, vec![want[3]]);
    open(&mut v, 2, Mode::Generate, 5, vec![]);
    let (_, used) = settle(&mut v, &mut t);
    let by = |id| used.iter().find(|u| u.session == SessionId(id)).unwrap();
    assert_eq!((by(1).committed_tokens, by(1).finish), (4, Finish::Stop));
    assert_eq!((by(2).committed_tokens, by(2).finish), (5, Finish::Length));
    assert_eq!(by(2).cloud_tokens, 5);
    assert!(!by(2).speculative);
    // Closed early by its edge, cancelled by its tenant, shut down with the verifier.
    let spec = Mode::Speculate {
        rule: VerifyRule::Greedy,
        want: Shape::new(4, 2),
    };
    for id in [3, 4, 5] {
        open(&mut v, id, spec, 500, vec![]);
    }
    t += 1000;
    v.turn(t);
    v.receive(
        t,
        Inbound::Close {
            session: SessionId(3),
        },
    );
    v.cancel(SessionId(4), TenantId(0)).unwrap();
    v.shut_down();
    t += 1000;
    let used = v.turn(t).finished;
    let by = |id| used.iter().find(|u| u.session == SessionId(id)).unwrap();
    assert_eq!(by(3).finish, Finish::Abort);
    assert_eq!(by(4).finish, Finish::Cancelled);
    assert_eq!(by(5).finish, Finish::Shutdown);
    assert!(used
        .iter()
        .all(|u| u.committed_tokens == u.cloud_tokens + u.accepted_draft_tokens));
    assert_eq!(used.len(), 3, "each once");
}
