use super::*;

/// The verifier's answer: first token 7, `grant`, any side nodes.
fn opened(grant: Shape) -> Opened {
    Opened {
        first: 7,
        grant,
        side_nodes: usize::MAX,
    }
}

fn session(auto: Option<AutoShape>) -> (EdgeSession, Vec<Output>) {
    let cfg = SessionConfig {
        draft_len: 4,
        depth: 2,
        max_new_tokens: 20,
        auto,
        tree: TreeConfig::LINEAR,
    };
    EdgeSession::new(0, vec![1, 2, 3], opened(Shape::new(4, 2)), cfg, vec![]).unwrap()
}

/// Draft `tokens` at 10 ms each from `t0` (µs); returns the blocks sent.
fn draft(s: &mut EdgeSession, t0: u64, tokens: &[u32]) -> Vec<crate::Block> {
    let mut sent = Vec::new();
    for (i, &t) in tokens.iter().enumerate() {
        assert_eq!(s.next(), Next::Draft);
        for o in s.on_drafted(t0 + 10_000 * (i as u64 + 1), t, None, 10.0, false) {
            if let Output::Send(b) = o {
                sent.push(b);
            }
        }
    }
    sent
}

#[test]
fn a_verdict_is_timed_from_its_send_and_its_grant_narrows_the_shape() {
    let (mut s, first) = session(None);
    // The first token, acknowledged at once (the edge has said nothing yet).
    assert_eq!(
        first,
        vec![
            Output::Commit {
                pos: 3,
                tokens: vec![7]
            },
            Output::Ack { committed: 4 }
        ]
    );
    let sent = draft(&mut s, 0, &[8, 9, 10, 11]);
    assert_eq!(sent.len(), 1, "a block of γ 4 leaves after the 4th token");
    let verdict = Verdict {
        epoch: 0,
        block: sent[0].index,
        accepted: 4,
        side_end: None,
        token: 12,
        verify_us: 30_000,
        grant: Some(Shape::new(2, 1)),
    };
    let r = s.on_message(100_000, Incoming::Verdict(verdict)).unwrap();
    assert!(r.correction.is_none());
    assert!(r.outputs.iter().any(|o| matches!(o, Output::Commit { .. })));
    let c = s.pipeline().config();
    assert_eq!((c.draft_len, c.depth), (2, 1), "within the new grant");
    let m = s.measured();
    // Sent at 40 ms, answered at 100 ms after a 30 ms forward.
    assert_eq!(
        (m.block_round_trip_ms, m.verify_ms, m.net_ms),
        (60.0, 30.0, 30.0)
    );
    assert_eq!((m.draft_ms, m.reshapes), (10.0, 1));
    // The edge's own work is spread over the verdicts since it last said.
    s.on_edge_work(2.0);
    s.on_edge_work(5.0);
    assert_eq!(s.measured().verdict_ms, 7.0);
}

/// An edge that sends no block (the verifier took its session over, or its draft is still
/// prefilling) acks the first token at once, then every ACK_EVERY tokens; one that drafted before
/// `Opened` has spoken already, and acks every ACK_EVERY only.
#[test]
fn an_edge_that_drafts_nothing_acks_the_first_token_at_once() {
    let cfg = SessionConfig {
        draft_len: 4,
        depth: 2,
        max_new_tokens: 100,
        auto: None,
        tree: TreeConfig::LINEAR,
    };
    let acks = |out: &[Output]| -> Vec<usize> {
        out.iter()
            .filter_map(|o| match o {
                Output::Ack { committed } => Some(*committed),
                _ => None,
            })
            .collect()
    };
    let decoded = |pos: usize| Decoded {
        epoch: 0,
        pos,
        token: 5,
        grant: None,
        guessed: false,
    };
    // Taken over at Open (γ 0): the first token's ack goes with it.
    let (mut s, out) =
        EdgeSession::new(0, vec![1, 2, 3], opened(Shape::new(0, 0)), cfg, vec![]).unwrap();
    assert_eq!(acks(&out), vec![4]);
    let mut later = Vec::new();
    for pos in 4..40 {
        let r = s
            .on_message(1000 * pos as u64, Incoming::Decoded(decoded(pos)))
            .unwrap();
        later.extend(acks(&r.outputs));
    }
    assert_eq!(later, vec![4 + ACK_EVERY, 4 + 2 * ACK_EVERY]);
    // Opened while the session waits to draft (its first token commits then): acked at once.
    let (mut s, out) = EdgeSession::opening(0, vec![1, 2, 3], cfg, vec![]).unwrap();
    assert!(out.is_empty());
    let r = s
        .on_message(1000, Incoming::Opened(opened(Shape::new(4, 2))))
        .unwrap();
    assert_eq!(acks(&r.outputs), vec![4]);
    // A block sent before `Opened`: the edge has spoken, no ack comes with the first token.
    let (mut s, _) = EdgeSession::opening(0, vec![1, 2, 3], cfg, vec![]).unwrap();
    assert_eq!(draft(&mut s, 0, &[8, 9, 10, 11]).len(), 1);
    let r = s
        .on_message(100_000, Incoming::Opened(opened(Shape::new(4, 2))))
        .unwrap();
    assert!(acks(&r.outputs).is_empty(), "{:?}", r.outputs);
}

#[test]
fn a_session_drafts_from_its_open_and_the_first_token_judges_its_guess() {
    // Before `Opened`: the first block starts at the first token's position (3), drafted
    // from the prompt alone, within what the edge asked for (no grant yet).
    let cfg = SessionConfig {
        draft_len: 4,
        depth: 2,
        max_new_tokens: 20,
        auto: None,
        tree: TreeConfig::LINEAR,
    };
    let opening = || EdgeSession::opening(0, vec![1, 2, 3], cfg, vec![]).unwrap();
    let (mut s, out) = opening();
    assert!(
        out.is_empty(),
        "nothing is committed before the verifier answers"
    );
    let sent = draft(&mut s, 0, &[7, 8, 9, 10, 11, 12, 13, 14]);
    let starts: Vec<_> = sent.iter().map(|b| (b.epoch, b.start_pos)).collect();
    assert_eq!(starts, vec![(0, 3), (0, 7)]);
    let first = |token| Opened {
        first: token,
        grant: Shape::new(2, 1),
        side_nodes: 0,
    };
    // The guess was right: it is committed, the blocks stay, the grant narrows what follows.
    let r = s.on_message(50_000, Incoming::Opened(first(7))).unwrap();
    assert_eq!(
        r.outputs.first(),
        Some(&Output::Commit {
            pos: 3,
            tokens: vec![7]
        })
    );
    assert_eq!(
        (s.pipeline().epoch(), s.pipeline().blocks_in_flight()),
        (0, 2)
    );
    assert_eq!(s.pipeline().config().draft_len, 2);
    assert_eq!(
        s.measured().cloud_decoded,
        0,
        "the first token is the prefill's"
    );
    let v = Verdict {
        epoch: 0,
        block: sent[0].index,
        accepted: 4,
        side_end: None,
        token: 11,
        verify_us: 30_000,
        grant: None,
    };
    s.on_message(80_000, Incoming::Verdict(v)).unwrap();
    assert_eq!(s.pipeline().committed_len(), 8);
    // The guessed first token, three verified, and the bonus (11) that block 1 guessed too.
    assert_eq!(s.pipeline().stats().accepted, 5);
    // The guess was wrong: the verifier finds the same contradiction in the first block,
    // both move to epoch 1, and the edge drafts on from the verifier's first token.
    let (mut s, _) = opening();
    draft(&mut s, 0, &[7, 8, 9, 10]);
    let r = s.on_message(50_000, Incoming::Opened(first(5))).unwrap();
    assert_eq!(r.correction, Some((7, 5)));
    assert_eq!(
        (s.pipeline().epoch(), s.pipeline().blocks_in_flight()),
        (1, 0)
    );
    assert_eq!(s.pipeline().tokens(), &[1, 2, 3, 5]);
    let sent = draft(&mut s, 60_000, &[6, 7]);
    assert_eq!(
        sent.iter()
            .map(|b| (b.epoch, b.start_pos))
            .collect::<Vec<_>>(),
        vec![(1, 4)]
    );
}

#[test]
fn a_shrinking_grant_drops_the_trees_first_and_the_full_grant_brings_them_back() {
    let tree = TreeConfig {
        side_nodes: 4,
        lanes: 1,
        below: 0.5,
        min_chance: 0.0,
    };
    let cfg = SessionConfig {
        draft_len: 4,
        depth: 2,
        max_new_tokens: 40,
        auto: None,
        tree,
    };
    let (mut s, _) =
        EdgeSession::new(0, vec![1, 2, 3], opened(Shape::new(4, 2)), cfg, vec![]).unwrap();
    assert_eq!(s.pipeline().tree(), tree);
    let decoded = |s: &EdgeSession, grant| Decoded {
        epoch: s.pipeline().epoch(),
        pos: s.pipeline().committed_len(),
        token: 9,
        grant: Some(grant),
        guessed: false,
    };
    let d = decoded(&s, Shape::new(2, 1));
    s.on_message(10_000, Incoming::Decoded(d)).unwrap();
    assert_eq!(s.pipeline().tree(), TreeConfig::LINEAR);
    let d = decoded(&s, Shape::new(4, 2));
    s.on_message(20_000, Incoming::Decoded(d)).unwrap();
    assert_eq!(s.pipeline().tree(), tree);
}

#[test]
fn a_rejection_names_the_draft_token_and_the_targets() {
    let (mut s, _) = session(None);
    let sent = draft(&mut s, 0, &[8, 9, 10, 11]);
    let verdict = Verdict {
        epoch: 0,
        block: sent[0].index,
        accepted: 1,
        side_end: None,
        token: 42,
        verify_us: 0,
        grant: None,
    };
    let r = s.on_message(50_000, Incoming::Verdict(verdict)).unwrap();
    assert_eq!(r.correction, Some((9, 42)));
    assert!(
        r.outputs.contains(&Output::Rollback { to: 5 }),
        "{:?}",
        r.outputs
    );
    assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 42]);
}

#[test]
fn a_draft_that_is_almost_always_wrong_is_paused_and_tried_again() {
    let cfg = SessionConfig {
        draft_len: 2,
        depth: 1,
        max_new_tokens: 60,
        auto: None,
        tree: TreeConfig::LINEAR,
    };
    let (mut s, _) =
        EdgeSession::new(0, vec![1, 2, 3], opened(Shape::new(2, 1)), cfg, vec![]).unwrap();
    // Every token the verifier decodes contradicts what the edge drafted there.
    let mut t = 0;
    let mut decode = |s: &mut EdgeSession| {
        t += 40_000;
        let pos = s.pipeline().committed_len();
        let d = Decoded {
            epoch: s.pipeline().epoch(),
            pos,
            token: 50,
            grant: None,
            guessed: false,
        };
        s.on_message(t, Incoming::Decoded(d)).unwrap();
    };
    let mut paused_at = None;
    for k in 0..20 {
        if s.next() == Next::Draft {
            draft(&mut s, 0, &[9]);
        }
        decode(&mut s);
        if s.measured().draft_pauses > 0 {
            paused_at = Some(k);
            break;
        }
    }
    let at = paused_at.expect("paused");
    assert!(at >= 7, "judged on a few positions first: {at}");
    assert_eq!(s.next(), Next::Wait, "no drafting while paused");
    for _ in 0..PAUSE_TOKENS - 1 {
        decode(&mut s);
        assert_eq!(s.next(), Next::Wait);
    }
    decode(&mut s);
    assert_eq!(s.next(), Next::Draft, "tried again after the pause");
}

#[test]
fn a_lost_connection_is_reopened_over_the_committed_history_within_the_window() {
    let (mut s, _) = session(None);
    draft(&mut s, 0, &[8, 9, 10, 11]);
    let out = s.on_connection_lost();
    assert!(out.contains(&Output::Rollback { to: 4 }), "{out:?}");
    // Tries over the 30 s window: waits double from 100 ms to 2 s (no jitter: the longest),
    // and stop when the window is spent.
    let (mut elapsed, mut waits) = (0, Vec::new());
    for attempt in 0.. {
        let at = Reconnecting {
            attempt,
            elapsed_ms: elapsed,
            window_ms: RECONNECT_WINDOW_MS,
            retry_after_ms: None,
            jitter: 1.0,
        };
        let Some(r) = s.reopen(at) else { break };
        assert_eq!(r.max_tokens, 19, "one token of 20 is committed");
        waits.push(r.after_ms);
        elapsed += r.after_ms;
    }
    assert_eq!(waits[..6], [100, 200, 400, 800, 1600, 2000]);
    assert_eq!(
        waits.iter().sum::<u64>(),
        RECONNECT_WINDOW_MS,
        "the whole window"
    );
    assert!(waits.len() > 15, "{waits:?}");
    let at = |attempt, retry_after_ms, jitter| Reconnecting {
        attempt,
        elapsed_ms: 1_000,
        window_ms: RECONNECT_WINDOW_MS,
        retry_after_ms,
        jitter,
    };
    // Jitter takes the wait down to half; a verifier's retry-after is honoured; the last wait
    // ends with the window.
    assert_eq!(s.reopen(at(3, None, 0.0)).unwrap().after_ms, 400);
    assert_eq!(s.reopen(at(3, Some(5_000), 0.0)).unwrap().after_ms, 5_000);
    assert_eq!(s.reopen(at(3, Some(60_000), 0.0)).unwrap().after_ms, 29_000);
    let spent = Reconnecting {
        elapsed_ms: RECONNECT_WINDOW_MS,
        ..at(0, None, 0.5)
    };
    assert_eq!(s.reopen(spent), None);
    s.on_reopened(5);
    assert_eq!(s.committed(), &[1, 2, 3, 7, 5]);
    assert_eq!(s.measured().reconnects, 1);
}

#[test]
fn the_adaptive_policy_replans_when_the_model_predicts_a_clear_gain() {
    // A prior with a long round trip and a perfect draft: deeper pipelines and longer blocks
    // pay, so the first verdict re-plans to more than γ 1, depth 1.
    let auto = AutoShape {
        max_draft_len: 4,
        max_depth: 2,
        prior: Costs {
            alpha: 0.99,
            ..default_prior(200.0)
        },
    };
    let cfg = SessionConfig {
        draft_len: 1,
        depth: 1,
        max_new_tokens: 50,
        auto: Some(auto),
        tree: TreeConfig::LINEAR,
    };
    let (mut s, _) =
        EdgeSession::new(0, vec![1, 2, 3], opened(Shape::UNLIMITED), cfg, vec![]).unwrap();
    let sent = draft(&mut s, 0, &[8]);
    let verdict = Verdict {
        epoch: 0,
        block: sent[0].index,
        accepted: 1,
        side_end: None,
        token: 9,
        verify_us: 60_000,
        grant: None,
    };
    s.on_message(300_000, Incoming::Verdict(verdict)).unwrap();
    let c = s.pipeline().config();
    assert!((c.draft_len, c.depth) != (1, 1), "{c:?}");
    assert_eq!(s.measured().reshapes, 1);
}
