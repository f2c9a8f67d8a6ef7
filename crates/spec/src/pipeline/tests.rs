use super::*;

fn pipeline(draft_len: usize, depth: usize) -> Pipeline {
    let cfg = PipelineConfig {
        draft_len,
        depth,
        max_new_tokens: 20,
    };
    Pipeline::with_first(vec![1, 2, 3], 7, cfg, vec![99])
        .unwrap()
        .0
}

/// Draft `tokens`; returns the blocks sent.
fn draft(p: &mut Pipeline, tokens: &[u32]) -> Vec<Block> {
    let mut sent = Vec::new();
    for &t in tokens {
        assert_eq!(p.next(), Next::Draft);
        for o in p.on_drafted(t, None) {
            if let Output::Send(b) = o {
                sent.push(b);
            }
        }
    }
    sent
}

fn verdict(b: &Block, accepted: usize, token: u32) -> Verdict {
    Verdict {
        epoch: b.epoch,
        block: b.index,
        accepted,
        side_end: None,
        token,
        verify_us: 0,
        grant: None,
    }
}

#[test]
fn committed_positions_are_counted_by_the_drafts_confidence() {
    // Linear blocks (no side-node budget), second choices named all the same.
    let mut p = pipeline(3, 1);
    let mut sent = Vec::new();
    for (t, alt, p_top) in [(8, 18, 0.2), (9, 19, 0.95), (10, 20, 0.6)] {
        sent.extend(
            p.on_drafted_hedged(t, None, Some(Hedge { alt, p_top }))
                .into_iter()
                .filter_map(|o| match o {
                    Output::Send(b) => Some(b),
                    _ => None,
                }),
        );
    }
    // The target takes 8 and 19 (the second choice where the draft was sure): two judged,
    // one accepted, one covered; position 2 is never judged.
    p.on_verdict(verdict(&sent[0], 1, 19)).unwrap();
    let c = p.stats().by_confidence;
    assert_eq!(
        c[0],
        ConfidenceCount {
            judged: 1,
            accepted: 1,
            covered: 0
        }
    );
    assert_eq!(
        c[4],
        ConfidenceCount {
            judged: 1,
            accepted: 0,
            covered: 1
        }
    );
    assert_eq!(c.iter().map(|c| c.judged).sum::<usize>(), 2);
    // A token the verifier decoded over a drafted one counts too.
    let b = p.on_drafted_hedged(
        30,
        None,
        Some(Hedge {
            alt: 31,
            p_top: 0.1,
        }),
    );
    assert!(b.is_empty(), "γ 3: the block is not full");
    p.on_decoded(Decoded {
        epoch: p.epoch(),
        pos: p.committed_len(),
        token: 32,
        grant: None,
        guessed: false,
    })
    .unwrap();
    assert_eq!(
        p.stats().by_confidence[0],
        ConfidenceCount {
            judged: 2,
            accepted: 1,
            covered: 0
        }
    );
}

#[test]
fn depth_one_waits_for_each_verdict_and_depth_two_drafts_on() {
    let mut sync = pipeline(2, 1);
    let b = draft(&mut sync, &[8, 9]);
    assert_eq!(b.len(), 1);
    assert_eq!(sync.next(), Next::Wait, "one block in flight at depth 1");
    let out = sync.on_verdict(verdict(&b[0], 2, 10)).unwrap();
    let committed: Vec<u32> = out
        .iter()
        .flat_map(|o| match o {
            Output::Commit { tokens, .. } => tokens.clone(),
            _ => vec![],
        })
        .collect();
    assert_eq!(committed, vec![8, 9, 10], "the block and its bonus");
    assert_eq!(sync.committed_len(), 7);
    assert_eq!(sync.next(), Next::Draft);
    let mut deep = pipeline(2, 2);
    let b = draft(&mut deep, &[8, 9, 10, 11]);
    assert_eq!(b.len(), 2, "a second block while the first is in flight");
    assert_eq!(b[1].start_pos, 6);
    assert_eq!(deep.next(), Next::Wait);
}

#[test]
fn a_rejection_moves_the_epoch_and_stales_the_blocks_behind_it() {
    let mut p = pipeline(2, 2);
    let b = draft(&mut p, &[8, 9, 10, 11]);
    let out = p.on_verdict(verdict(&b[0], 1, 42)).unwrap();
    assert!(out.contains(&Output::Rollback { to: 5 }), "{out:?}");
    assert_eq!((p.epoch(), p.blocks_in_flight()), (1, 0));
    assert_eq!(
        p.committed_len(),
        6,
        "the accepted token and the correction"
    );
    // The second block's verdict belongs to the old epoch: counted, ignored.
    assert!(p.on_verdict(verdict(&b[1], 2, 5)).unwrap().is_empty());
    assert_eq!(p.stats().stale_verdicts, 1);
    assert_eq!(p.tokens(), &[1, 2, 3, 7, 8, 42]);
}

#[test]
fn a_verdict_for_no_block_in_flight_or_too_many_tokens_is_refused_by_name() {
    let mut p = pipeline(2, 2);
    let b = draft(&mut p, &[8, 9]);
    let mut wrong = verdict(&b[0], 1, 3);
    wrong.block = BlockId(5);
    let e = p.on_verdict(wrong).unwrap_err().to_string();
    assert!(e.contains("block 5") && e.contains("block 0"), "{e}");
    let e = p.on_verdict(verdict(&b[0], 3, 3)).unwrap_err().to_string();
    assert!(e.contains("accepts 3 tokens of a 2-token block"), "{e}");
    // Nothing changed: the right verdict still applies.
    assert!(!p.on_verdict(verdict(&b[0], 2, 3)).unwrap().is_empty());
}

const LANES: TreeConfig = TreeConfig {
    side_nodes: 8,
    lanes: 2,
    below: 0.5,
    min_chance: 0.0,
};

/// Grow the frontier `steps` times: the main path takes `main(pos)`, a lane whose last token
/// is `t` takes `t + 1`; the main path is unsure (second choice `fork(pos)`) where given.
/// Returns the blocks sent.
fn grow(
    p: &mut Pipeline,
    steps: usize,
    main: impl Fn(usize) -> u32,
    fork: impl Fn(usize) -> Option<u32>,
) -> Vec<Block> {
    let mut sent = Vec::new();
    for _ in 0..steps {
        assert_eq!(p.next(), Next::Draft);
        let f = p.frontier();
        let pos = p.tokens().len();
        let mut grown = vec![Grown {
            token: main(pos),
            q: None,
            hedge: fork(pos).map(|alt| Hedge { alt, p_top: 0.1 }),
        }];
        for leaf in &f.leaves[1..] {
            grown.push(Grown {
                token: leaf.last().unwrap() + 1,
                q: None,
                hedge: None,
            });
        }
        for o in p.on_grown(grown).unwrap() {
            if let Output::Send(b) = o {
                sent.push(b);
            }
        }
    }
    sent
}

#[test]
fn an_unsure_position_forks_a_lane_that_every_block_carries() {
    let mut p = pipeline(2, 3);
    p.set_tree(LANES);
    // Main 8 9 10 11 at 4..8; unsure at 4 (second choice 40): a lane 40 41 42 43.
    let main = |pos: usize| pos as u32 + 4;
    let b = grow(&mut p, 4, main, |pos| (pos == 4).then_some(40));
    assert_eq!(p.frontier().base, 4, "the lane leaves the main path at 4");
    assert_eq!(
        p.frontier().leaves,
        vec![vec![8, 9, 10, 11], vec![40, 41, 42, 43]]
    );
    assert_eq!(b.len(), 2);
    let sides = |b: &Block| -> Vec<(u32, u32, bool)> {
        b.side
            .iter()
            .map(|s| (s.parent, s.token, s.point))
            .collect()
    };
    // Block 0: 40 beside 8 (the second draw), 41 continuing it.
    assert_eq!(
        (b[0].tokens.clone(), sides(&b[0])),
        (vec![8, 9], vec![(0, 40, false), (2, 41, true)])
    );
    // Block 1: the lane goes on from the block's root (whatever is committed at 5).
    assert_eq!(
        (b[1].tokens.clone(), sides(&b[1])),
        (vec![10, 11], vec![(0, 42, true), (2, 43, true)])
    );
    assert_eq!(p.stats().side_nodes, 4);
    assert_eq!(
        p.stats().drafted,
        4 + 3,
        "the lane's tokens are drafted too"
    );
}

#[test]
fn a_commit_that_a_lane_guessed_makes_it_the_main_path_and_keeps_the_blocks() {
    let mut p = pipeline(2, 3);
    p.set_tree(LANES);
    let b = grow(
        &mut p,
        4,
        |pos| pos as u32 + 4,
        |pos| (pos == 4).then_some(40),
    );
    // The verifier decodes 40 at 4: the lane's; nothing goes stale.
    let out = p
        .on_decoded(Decoded {
            epoch: 0,
            pos: 4,
            token: 40,
            grant: None,
            guessed: false,
        })
        .unwrap();
    assert!(out.contains(&Output::Rollback { to: 4 }), "{out:?}");
    assert_eq!(&p.tokens()[4..], &[40, 41, 42, 43]);
    assert_eq!((p.epoch(), p.blocks_in_flight()), (0, 2));
    assert_eq!((p.stats().lane_hits, p.stats().rejections), (1, 1));
    assert_eq!(p.frontier().leaves, vec![Vec::<u32>::new()], "no lane left");
    // Block 0's verdict ends on the lane (41, side node 1) with the bonus 42: block 1 carries
    // the lane on, so the walk into it diverts and nothing moves.
    let v = Verdict {
        side_end: Some(1),
        ..verdict(&b[0], 2, 42)
    };
    p.on_verdict(v).unwrap();
    assert_eq!(p.output(), &[7, 40, 41, 42]);
    assert_eq!((p.epoch(), p.blocks_in_flight()), (0, 1));
    // A commit off block 1's tree (neither 43 nor 11 at 7) is a rejection: stale from here.
    p.on_decoded(Decoded {
        epoch: 0,
        pos: 7,
        token: 5,
        grant: None,
        guessed: false,
    })
    .unwrap();
    assert_eq!((p.epoch(), p.blocks_in_flight()), (1, 0));
    assert_eq!(p.output(), &[7, 40, 41, 42, 5]);
}

#[test]
fn a_commit_the_main_path_guessed_ends_the_lanes_that_disagree() {
    let mut p = pipeline(2, 3);
    p.set_tree(LANES);
    grow(
        &mut p,
        2,
        |pos| pos as u32 + 4,
        |pos| (pos == 4).then_some(40),
    );
    p.on_decoded(Decoded {
        epoch: 0,
        pos: 4,
        token: 8,
        grant: None,
        guessed: false,
    })
    .unwrap();
    assert_eq!(p.frontier().leaves.len(), 1);
    assert_eq!((p.stats().accepted, p.stats().lane_hits), (1, 0));
    // At most `lanes` grow; a fork the estimates find too unlikely is not taken.
    let mut p = pipeline(2, 3);
    p.set_tree(TreeConfig { lanes: 1, ..LANES });
    grow(&mut p, 3, |pos| pos as u32 + 4, |_| Some(60));
    assert_eq!(p.frontier().leaves.len(), 2, "one lane");
    let mut p = pipeline(2, 3);
    p.set_tree(TreeConfig {
        min_chance: 0.5,
        ..LANES
    });
    grow(&mut p, 3, |pos| pos as u32 + 4, |_| Some(60));
    assert_eq!(p.frontier().leaves.len(), 1, "no lane worth it");
}

#[test]
fn a_lane_that_does_not_fit_the_grant_stops_and_keeps_what_it_sent() {
    let mut p = pipeline(2, 3);
    p.set_tree(TreeConfig {
        side_nodes: 2,
        ..LANES
    });
    // Two lanes fork at 4 and 5; a block holds two side nodes: the likelier lane only.
    let b = grow(&mut p, 2, |pos| pos as u32 + 4, |pos| Some(40 + pos as u32));
    assert_eq!(b[0].side.len(), 2);
    assert!(b[0].side.len() <= 2);
    p.set_tree(TreeConfig::LINEAR);
    assert_eq!(p.growing_lanes(), 0, "the grant took the trees");
    let b = grow(&mut p, 2, |pos| pos as u32 + 4, |_| Some(70));
    assert!(b[0].side.is_empty());
}

#[test]
fn an_end_of_generation_token_ends_it_and_drops_what_follows() {
    let mut p = pipeline(3, 2);
    let b = draft(&mut p, &[8, 99]);
    assert_eq!(p.next(), Next::Wait, "no drafting past a drafted end");
    assert_eq!(b.len(), 1, "the block goes out short");
    let out = p.on_verdict(verdict(&b[0], 2, 11)).unwrap();
    assert_eq!(
        out,
        vec![Output::Commit {
            pos: 4,
            tokens: vec![8, 99]
        }]
    );
    assert_eq!(p.next(), Next::Done);
    assert_eq!(p.output(), &[7, 8, 99]);
}

#[test]
fn a_fork_under_rejection_sampling_keeps_the_q_it_was_drawn_from() {
    // The fork is a second draw: from the parent's q without the parent's token. Should its
    // lane become the main path, that is the q its token goes out with.
    let mut p = pipeline(4, 2);
    p.set_tree(LANES);
    let q = vec![(8, 0.6), (40, 0.3), (5, 0.1)];
    p.on_grown(vec![Grown {
        token: 8,
        q: Some(q.clone()),
        hedge: Some(Hedge {
            alt: 40,
            p_top: 0.1,
        }),
    }])
    .unwrap();
    let fork = p.lanes[0].nodes.last().unwrap().1.clone();
    assert!(fork.second);
    assert_eq!(fork.q, Some(crate::verify::without(&q, &[8])));
    // Forked from a lane, from that lane's q without its token.
    let ql = vec![(41, 0.7), (50, 0.3)];
    p.on_grown(vec![
        Grown {
            token: 9,
            q: Some(vec![(9, 1.0)]),
            hedge: None,
        },
        Grown {
            token: 41,
            q: Some(ql.clone()),
            hedge: Some(Hedge {
                alt: 50,
                p_top: 0.1,
            }),
        },
    ])
    .unwrap();
    let forked = p.lanes.iter().find(|l| l.token(5) == Some(50)).unwrap();
    assert_eq!(
        forked.nodes.last().unwrap().1.q,
        Some(crate::verify::without(&ql, &[41]))
    );
}
