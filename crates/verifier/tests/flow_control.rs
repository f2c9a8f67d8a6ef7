//! Flow control: the verifier commits at most FLOW_WINDOW tokens of a speculation session past
//! the last one its edge acknowledged, so a session whose edge stops reading is not decoded
//! further; each ack lets it go on, and an ack of tokens never committed is refused by name.

mod common;

use common::{core, next};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{VerifyRule, FLOW_WINDOW};
use tandem_verifier::Event;

const PROMPT: [u32; 3] = [3, 4, 5];
const S: SessionId = SessionId(1);

/// Decoded tokens among `events`, as (position, token).
fn decoded(events: &[Event]) -> Vec<(usize, u32)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Decoded { decoded, .. } => Some((decoded.pos, decoded.token)),
            _ => None,
        })
        .collect()
}

#[test]
fn an_edge_that_does_not_acknowledge_is_decoded_one_window_ahead_and_no_further() {
    let (mut v, _) = core();
    v.open(
        S,
        TenantId(0),
        &PROMPT,
        SamplingParams::default(),
        VerifyRule::Greedy,
        500,
        vec![],
    )
    .unwrap();
    // Opened (the first token, acknowledged by the Open itself), then one window of decodes.
    let first = v.run_until_idle(0);
    let d = decoded(&first);
    assert_eq!(d.len(), FLOW_WINDOW, "{d:?}");
    assert_eq!(d[0].0, PROMPT.len() + 1);
    assert!(!v.has_work(), "the session waits for its edge");
    let committed = PROMPT.len() + 1 + FLOW_WINDOW;
    assert_eq!(v.session(S).unwrap().committed_len, committed);

    // An ack of 20 tokens opens the window to 20 + FLOW_WINDOW.
    let mut events = v.ack(S, 20);
    events.extend(v.run_until_idle(0));
    let more = decoded(&events);
    assert_eq!(more.len(), 20 + FLOW_WINDOW - committed, "{more:?}");
    assert_eq!(more[0].0, committed, "decoding goes on where it stopped");

    // Acks never go back: an older one changes nothing.
    let events = v.ack(S, 10);
    assert!(decoded(&events).is_empty() && !v.has_work());

    // An ack of tokens never committed is refused by name; the session goes on.
    let events = v.ack(S, 10_000);
    let refused = events.iter().find_map(|e| match e {
        Event::Error { error, fatal, .. } => Some((error.to_string(), *fatal)),
        _ => None,
    });
    let (msg, fatal) = refused.expect("the bad ack is answered");
    assert!(msg.contains("ack.committed") && !fatal, "{msg}");
    let now = v.session(S).unwrap().committed_len;
    let mut events = v.ack(S, now);
    events.extend(v.run_until_idle(0));
    assert_eq!(decoded(&events).len(), FLOW_WINDOW);

    // Every decoded token is the target's.
    let all: Vec<(usize, u32)> = decoded(&first).into_iter().chain(more).collect();
    for w in all.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 1);
        assert_eq!(w[1].1, next(w[0].0, w[0].1));
    }
}
