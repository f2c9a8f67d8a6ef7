//! Flow control: the verifier commits at most FLOW_WINDOW tokens of a speculation session past
//! the last one its edge acknowledged, so a session whose edge stops reading is not decoded
//! further; each ack lets it go on, and an ack of tokens never committed is refused by name.

mod common;

use common::{driver, next, Sent};
use tandem_sched::SessionId;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{VerifyRule, FLOW_WINDOW};
use tandem_verifier::ToEdge;

const PROMPT: [u32; 3] = [3, 4, 5];
const S: SessionId = SessionId(1);

/// Decoded tokens among `sent`, as (position, token).
fn decoded(sent: &[Sent]) -> Vec<(usize, u32)> {
    sent.iter()
        .filter_map(|(_, m)| match m {
            ToEdge::Decoded(d) => Some((d.pos, d.token)),
            _ => None,
        })
        .collect()
}

#[test]
fn an_edge_that_does_not_acknowledge_is_decoded_one_window_ahead_and_no_further() {
    let (mut d, _) = driver();
    d.open(
        S,
        &PROMPT,
        SamplingParams::default(),
        VerifyRule::Greedy,
        500,
    );
    // Opened (the first token, acknowledged by the Open itself), then one window of decodes.
    let first = d.run_until_idle();
    let dec = decoded(&first);
    assert_eq!(dec.len(), FLOW_WINDOW, "{dec:?}");
    assert_eq!(dec[0].0, PROMPT.len() + 1);
    assert!(!d.core.has_work(), "the session waits for its edge");
    let committed = PROMPT.len() + 1 + FLOW_WINDOW;
    assert_eq!(d.core.session(S).unwrap().committed_len, committed);

    // An ack of 20 tokens opens the window to 20 + FLOW_WINDOW.
    d.ack(S, 20);
    let more = decoded(&d.run_until_idle());
    assert_eq!(more.len(), 20 + FLOW_WINDOW - committed, "{more:?}");
    assert_eq!(more[0].0, committed, "decoding goes on where it stopped");

    // Acks never go back: an older one changes nothing.
    d.ack(S, 10);
    let sent = d.turn();
    assert!(decoded(&sent).is_empty() && !d.core.has_work());

    // An ack of tokens never committed is refused by name; the session goes on.
    d.ack(S, 10_000);
    let sent = d.turn();
    let refused = sent.iter().find_map(|(_, m)| match m {
        ToEdge::Error { error, fatal, .. } => Some((error.to_string(), *fatal)),
        _ => None,
    });
    let (msg, fatal) = refused.expect("the bad ack is answered");
    assert!(msg.contains("ack.committed") && !fatal, "{msg}");
    let now = d.core.session(S).unwrap().committed_len;
    d.ack(S, now);
    assert_eq!(decoded(&d.run_until_idle()).len(), FLOW_WINDOW);

    // Every decoded token is the target's.
    let all: Vec<(usize, u32)> = decoded(&first).into_iter().chain(more).collect();
    for w in all.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 1);
        assert_eq!(w[1].1, next(w[0].0, w[0].1));
    }
}
