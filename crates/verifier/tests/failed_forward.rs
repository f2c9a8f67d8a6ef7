//! A forward the target fails computes nothing: a speculation session is put back exactly as it
//! was and planned again (its block verifies afterwards as if nothing had happened, a decode step
//! runs again), and a cloud-only generation ends with the error and frees its KV.

mod common;

use common::{core, oracle};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, Verdict, VerifyRule};
use tandem_verifier::Event;

const PROMPT: [u32; 3] = [3, 4, 5];

fn opened(events: &[Event]) -> u32 {
    events
        .iter()
        .find_map(|e| match e {
            Event::Opened { first, .. } => Some(*first),
            _ => None,
        })
        .expect("opened")
}

fn verdicts(events: &[Event]) -> Vec<Verdict> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Verdict { verdict, .. } => Some(*verdict),
            _ => None,
        })
        .collect()
}

#[test]
fn a_failed_verify_puts_the_session_back_and_the_block_verifies_afterwards() {
    let want = oracle(&PROMPT, 6);
    let (mut v, fail) = core();
    v.open(
        SessionId(1),
        TenantId(0),
        &PROMPT,
        SamplingParams::default(),
        VerifyRule::Greedy,
        20,
        vec![],
    )
    .unwrap();
    assert_eq!(opened(&v.step(0)), want[0]);
    // A block of the target's next three tokens, after the first: it takes the place of the
    // decode step planned with the Opened.
    let block = Block {
        epoch: 0,
        index: tandem_spec::BlockId(0),
        start_pos: 4,
        tokens: want[1..4].to_vec(),
        q: vec![],
        side: vec![],
    };
    assert!(v.draft(SessionId(1), block).is_empty());
    let before = v.session(SessionId(1)).unwrap();
    assert!(before.verifying, "the block is planned");
    fail.set(true);
    let events = v.step(0);
    assert!(
        events.is_empty(),
        "a failed forward is not the edge's error: {events:?}"
    );
    let after = v.session(SessionId(1)).unwrap();
    assert_eq!(
        (after.committed_len, after.epoch, after.verified_positions),
        (
            before.committed_len,
            before.epoch,
            before.verified_positions
        ),
        "nothing was committed or judged"
    );
    assert!(after.verifying, "the block is planned again");
    assert_eq!(
        v.stats.target_forwards, 1,
        "the failed forward does not count"
    );
    // On a target that works, the block verifies as if nothing had happened: accepted whole,
    // with the target's bonus.
    fail.set(false);
    let vs = verdicts(&v.step(0));
    assert_eq!(vs.len(), 1);
    assert_eq!((vs[0].accepted, vs[0].token), (3, want[4]));
    assert_eq!(
        v.session(SessionId(1)).unwrap().committed_len,
        PROMPT.len() + 5,
        "the first token, three verified and the bonus"
    );
}

#[test]
fn a_failed_decode_step_is_decoded_again() {
    let want = oracle(&PROMPT, 8);
    let (mut v, fail) = core();
    v.open(
        SessionId(1),
        TenantId(0),
        &PROMPT,
        SamplingParams::default(),
        VerifyRule::Greedy,
        8,
        vec![],
    )
    .unwrap();
    let mut decoded = Vec::new();
    let mut events = v.step(0);
    events.extend(v.set_takeover(SessionId(1), true));
    let mut failures = 0;
    for i in 0..40 {
        for e in events.drain(..) {
            match e {
                Event::Decoded { decoded: d, .. } => decoded.push((d.pos, d.token)),
                Event::Error { .. } => panic!("a failed decode step is not the edge's error"),
                _ => {}
            }
        }
        if !v.has_work() {
            break;
        }
        // Every third forward fails.
        fail.set(i % 3 == 1);
        failures += usize::from(fail.get());
        events = v.step(0);
    }
    assert!(failures >= 2);
    let positions: Vec<usize> = decoded.iter().map(|d| d.0).collect();
    let tokens: Vec<u32> = decoded.iter().map(|d| d.1).collect();
    // After the first token (committed at Open) to the limit.
    assert_eq!(
        positions,
        (PROMPT.len() + 1..PROMPT.len() + 8).collect::<Vec<_>>(),
        "each once, in order"
    );
    assert_eq!(tokens, want[1..]);
}

#[test]
fn a_failed_generation_ends_with_the_error_and_frees_its_kv() {
    let (mut v, fail) = core();
    v.open_generation(
        SessionId(2),
        TenantId(0),
        &PROMPT,
        SamplingParams::default(),
        10,
        vec![],
    )
    .unwrap();
    assert!(matches!(
        v.step(0).as_slice(),
        [Event::Token { done: false, .. }]
    ));
    fail.set(true);
    let events = v.step(0);
    assert!(
        matches!(
            events.as_slice(),
            [Event::Error {
                session: SessionId(2),
                fatal: true,
                ..
            }]
        ),
        "{events:?}"
    );
    assert!(v.session(SessionId(2)).is_none(), "closed");
    let pool = v.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_blocks(), "its KV is freed");
    assert!(!v.has_work());
}
