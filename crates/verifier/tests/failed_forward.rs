//! A forward the target fails computes nothing: a speculation session is put back exactly as it
//! was and planned again (its block verifies afterwards as if nothing had happened, a decode step
//! runs again), and a cloud-only generation ends with the error and frees its KV.

mod common;

use common::{driver, oracle, Sent};
use tandem_sched::SessionId;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, Verdict, VerifyRule};
use tandem_verifier::ToEdge;

const PROMPT: [u32; 3] = [3, 4, 5];

fn opened(sent: &[Sent]) -> u32 {
    sent.iter()
        .find_map(|(_, m)| match m {
            ToEdge::Opened { first, .. } => Some(*first),
            _ => None,
        })
        .expect("opened")
}

fn verdicts(sent: &[Sent]) -> Vec<Verdict> {
    sent.iter()
        .filter_map(|(_, m)| match m {
            ToEdge::Verdict(v) => Some(*v),
            _ => None,
        })
        .collect()
}

#[test]
fn a_failed_verify_puts_the_session_back_and_the_block_verifies_afterwards() {
    let want = oracle(&PROMPT, 6);
    let (mut d, fail) = driver();
    d.open(
        SessionId(1),
        &PROMPT,
        SamplingParams::default(),
        VerifyRule::Greedy,
        20,
    );
    assert_eq!(opened(&d.turn()), want[0]);
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
    d.draft(SessionId(1), block);
    let before = d.core.session(SessionId(1)).unwrap();
    assert!(before.verifying, "the block is planned");
    fail.set(true);
    // The turn sends nothing: the block is not refused, and a failed forward is not the edge's
    // error.
    let sent = d.turn();
    assert!(
        sent.is_empty(),
        "a failed forward is not the edge's error: {sent:?}"
    );
    let after = d.core.session(SessionId(1)).unwrap();
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
        d.core.stats.target_forwards, 1,
        "the failed forward does not count"
    );
    // On a target that works, the block verifies as if nothing had happened: accepted whole,
    // with the target's bonus.
    fail.set(false);
    let vs = verdicts(&d.turn());
    assert_eq!(vs.len(), 1);
    assert_eq!((vs[0].accepted, vs[0].token), (3, want[4]));
    assert_eq!(
        d.core.session(SessionId(1)).unwrap().committed_len,
        PROMPT.len() + 5,
        "the first token, three verified and the bonus"
    );
}

#[test]
fn a_failed_decode_step_is_decoded_again() {
    let want = oracle(&PROMPT, 8);
    let (mut d, fail) = driver();
    d.open(
        SessionId(1),
        &PROMPT,
        SamplingParams::default(),
        VerifyRule::Greedy,
        8,
    );
    // The edge drafts nothing: every forward after the prefill is a decode step.
    let mut decoded = Vec::new();
    let mut sent = d.turn();
    let mut failures = 0;
    for i in 0..40 {
        for (_, m) in sent.drain(..) {
            match m {
                ToEdge::Decoded(dec) => decoded.push((dec.pos, dec.token)),
                ToEdge::Error { .. } => panic!("a failed decode step is not the edge's error"),
                _ => {}
            }
        }
        if !d.core.has_work() {
            break;
        }
        // Every third forward fails.
        fail.set(i % 3 == 1);
        failures += usize::from(fail.get());
        sent = d.turn();
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
    let (mut d, fail) = driver();
    d.open_generation(SessionId(2), &PROMPT, SamplingParams::default(), 10);
    assert!(matches!(
        d.turn().as_slice(),
        [
            (_, ToEdge::Admitted { .. }),
            (_, ToEdge::Token { done: false, .. })
        ]
    ));
    fail.set(true);
    let sent = d.turn();
    assert!(
        matches!(
            sent.as_slice(),
            [(SessionId(2), ToEdge::Error { fatal: true, .. })]
        ),
        "{sent:?}"
    );
    assert!(d.core.session(SessionId(2)).is_none(), "closed");
    let pool = d.core.scheduler().pool();
    assert_eq!(pool.num_free(), pool.num_pages(), "its KV is freed");
    assert!(!d.core.has_work());
}
