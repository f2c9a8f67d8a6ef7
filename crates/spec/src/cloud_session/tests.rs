use super::*;

/// A session over a 3-token prompt whose prefill predicted 7 (committed at position 3).
fn session() -> CloudSession {
    CloudSession::new(
        VerifyRule::Greedy,
        SamplingParams::default(),
        &[1, 2, 3],
        7,
        64,
    )
}

fn block(epoch: u64, index: u64, start_pos: usize, tokens: &[u32]) -> Block {
    Block {
        epoch,
        index: BlockId(index),
        start_pos,
        tokens: tokens.to_vec(),
        q: vec![],
        side: vec![],
    }
}

/// One-hot logits rows choosing `tokens`.
fn rows(tokens: &[u32]) -> Vec<Vec<f32>> {
    tokens
        .iter()
        .map(|&t| {
            let mut r = vec![0f32; 64];
            r[t as usize] = 1.0;
            r
        })
        .collect()
}

fn refs(r: &[Vec<f32>]) -> Vec<&[f32]> {
    r.iter().map(|x| x.as_slice()).collect()
}

#[test]
fn a_block_is_verified_past_the_committed_tokens_and_commits_its_run_and_bonus() {
    let mut s = session();
    let b = block(0, 0, 4, &[8, 9, 10]);
    s.check(&b).unwrap();
    let BlockAction::Forward(f) = s.block_action(&b).unwrap() else {
        panic!()
    };
    assert_eq!((f.start_pos, f.tokens.clone()), (3, vec![7, 8, 9, 10]));
    // The target agrees with 8 and 9, then wants 4 where the draft said 10.
    let r = rows(&[8, 9, 4, 12]);
    let done = s.finish(&b, &f, &refs(&r)).unwrap();
    assert_eq!((done.verdict.accepted, done.verdict.token), (2, 4));
    assert_eq!((done.judged, done.accepted), (3, 2));
    assert_eq!(done.kv_len, 6, "the rejected token's KV is cut");
    assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 4]);
    assert_eq!(s.epoch(), 1, "a rejection moves the epoch");
}

#[test]
fn a_block_trimmed_to_the_grant_is_judged_over_several_forwards_with_one_verdict() {
    // A block of five drafted under γ 5, verified under γ 2: two tokens a forward.
    let mut s = session();
    let b = block(0, 0, 4, &[8, 9, 10, 11, 12]);
    let plan = |s: &mut CloudSession| match s.block_action_within(&b, 2).unwrap() {
        BlockAction::Forward(f) => f,
        other => panic!("{other:?}"),
    };
    let f = plan(&mut s);
    assert_eq!((f.start_pos, f.tokens.clone()), (3, vec![7, 8, 9]));
    // 8 and 9 are right, and the target's token after them is the draft's next, 10: three
    // tokens committed, no verdict yet, the epoch where it was.
    let done = s.finish(&b, &f, &refs(&rows(&[8, 9, 10]))).unwrap();
    assert!(done.partial);
    assert_eq!((done.judged, done.accepted, done.kv_len), (2, 2, 6));
    assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 10]);
    assert_eq!(s.epoch(), 0);
    // The rest: 11 is right, then the target wants 4 where the draft said 12: the verdict
    // counts from the block's start, and the rejection moves the epoch.
    let f = plan(&mut s);
    assert_eq!(f.tokens, vec![10, 11, 12]);
    let done = s.finish(&b, &f, &refs(&rows(&[11, 4, 5]))).unwrap();
    assert!(!done.partial);
    assert_eq!((done.verdict.accepted, done.verdict.token), (4, 4));
    assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 10, 11, 4]);
    assert_eq!(s.epoch(), 1);

    // Where the target's token after the fed ones differs from the draft's next, that is
    // the block's rejection: a verdict now, and the epoch moves (on the edge too, whose
    // draft had another token there).
    let mut s = session();
    let f = plan(&mut s);
    let done = s.finish(&b, &f, &refs(&rows(&[8, 9, 6]))).unwrap();
    assert!(!done.partial);
    assert_eq!((done.verdict.accepted, done.verdict.token), (2, 6));
    assert_eq!((s.epoch(), s.committed().len()), (1, 7));
    // A block wholly committed by its partial forwards is covered: dropped, unanswered
    // (the edge had each token as a decoded one).
    let mut s = session();
    let b = block(0, 0, 4, &[8, 9, 10]);
    let BlockAction::Forward(f) = s.block_action_within(&b, 2).unwrap() else {
        panic!()
    };
    assert!(s.finish(&b, &f, &refs(&rows(&[8, 9, 10]))).unwrap().partial);
    assert_eq!(s.block_action_within(&b, 2).unwrap(), BlockAction::Covered);
}

#[test]
fn a_block_behind_the_decoded_tokens_is_rebased_not_replayed() {
    let mut s = session();
    // Two tokens decoded while the block travels: 8 at 4, 9 at 5.
    for t in [8, 9] {
        let f = s.decode_feed().unwrap();
        assert_eq!(f.tokens.len(), 1);
        let d = s.finish_decode(&rows(&[t])[0]).unwrap();
        assert_eq!((d.epoch, d.token), (0, t), "a decode keeps the epoch");
    }
    assert_eq!((s.committed_len(), s.kv_len()), (6, 5));
    // The block agrees with both and drafts two more: only those are verified.
    let b = block(0, 0, 4, &[8, 9, 10, 11]);
    let BlockAction::Forward(f) = s.block_action(&b).unwrap() else {
        panic!()
    };
    assert_eq!((f.start_pos, f.tokens.clone()), (5, vec![9, 10, 11]));
    let done = s.finish(&b, &f, &refs(&rows(&[10, 11, 12]))).unwrap();
    assert_eq!(
        (done.verdict.accepted, done.verdict.token),
        (4, 12),
        "counted from the block's start"
    );
    assert_eq!((done.judged, done.accepted), (2, 2));
    assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 10, 11, 12]);
    assert_eq!(s.epoch(), 0);
    // A block that contradicts a committed token moves the epoch, unanswered; the next one
    // of the old epoch is stale; one wholly committed is covered.
    let bad = block(0, 1, 8, &[11, 5]);
    assert_eq!(
        s.block_action(&bad).unwrap(),
        BlockAction::Contradicted { pos: 8 }
    );
    assert_eq!(s.epoch(), 1);
    assert_eq!(
        s.block_action(&block(0, 2, 9, &[1])).unwrap(),
        BlockAction::Stale
    );
    assert_eq!(
        s.block_action(&block(1, 3, 5, &[9, 10])).unwrap(),
        BlockAction::Covered
    );
}

/// Main 8 9 10; 20 beside 9, continued by 21; 30 beside 8.
fn tree_block() -> Block {
    use crate::tree::SideNode;
    Block {
        side: vec![
            SideNode {
                parent: 1,
                token: 20,
                point: false,
            },
            SideNode {
                parent: 3,
                token: 21,
                point: true,
            },
            SideNode {
                parent: 0,
                token: 30,
                point: false,
            },
        ],
        ..block(0, 0, 4, &[8, 9, 10])
    }
}

/// Rows for a tree feed from a target whose continuation after the prompt's first token is
/// `want`: a node on that path gets its next token, any other node token 0.
fn tree_rows(b: &Block, f: &Feed, want: &[u32]) -> Vec<Vec<f32>> {
    let next: Vec<u32> = f
        .nodes
        .iter()
        .map(|&n| {
            let path: Vec<u32> = b.path_to(n).iter().map(|&m| b.token(m).unwrap()).collect();
            if want.starts_with(&path) {
                want[path.len()]
            } else {
                0
            }
        })
        .collect();
    rows(&next)
}

#[test]
fn a_tree_commits_the_path_the_target_follows() {
    // The main path right: its run and the bonus, nothing moves.
    let b = tree_block();
    for (want, accepted, side_end, token, epoch, committed) in [
        (
            vec![8, 9, 10, 11],
            3,
            None,
            11,
            0,
            vec![1, 2, 3, 7, 8, 9, 10, 11],
        ),
        // The lane beside 9 right: the path 8 20 21 and the bonus; a diversion moves nothing
        // (the blocks behind carry the lane on).
        (
            vec![8, 20, 21, 5],
            3,
            Some(1),
            5,
            0,
            vec![1, 2, 3, 7, 8, 20, 21, 5],
        ),
        // The branch right at its first token only: a correction after it.
        (vec![8, 20, 6], 2, Some(0), 6, 1, vec![1, 2, 3, 7, 8, 20, 6]),
        // Every guess wrong at the first position: the correction.
        (vec![40], 0, None, 40, 1, vec![1, 2, 3, 7, 40]),
    ] {
        let mut s = session();
        s.check(&b).unwrap();
        let BlockAction::Forward(f) = s.block_action(&b).unwrap() else {
            panic!()
        };
        assert_eq!(f.tokens.len(), 7, "the committed token and every node");
        assert_eq!(f.nodes[0], Node::Root);
        let r = tree_rows(&b, &f, &want);
        let done = s.finish(&b, &f, &refs(&r)).unwrap();
        let v = done.verdict;
        assert_eq!(
            (v.accepted, v.side_end, v.token),
            (accepted, side_end, token),
            "{want:?}"
        );
        assert_eq!(s.committed(), &committed[..]);
        assert_eq!(s.epoch(), epoch, "{want:?}");
        assert_eq!(done.kv_len, committed.len() - 1);
        let kept: Vec<u32> = done.keep.iter().map(|&j| f.tokens[j]).collect();
        assert_eq!(
            kept,
            committed[4..committed.len() - 1],
            "the KV keeps the path"
        );
        assert!(b.named_path(v.accepted, v.side_end).is_some());
    }
}

#[test]
fn a_tree_trimmed_to_the_grant_is_judged_over_several_forwards_with_one_verdict() {
    let b = tree_block();
    // Trimmed to two levels: the root's children and theirs, not 10 nor 21 below them.
    let mut s = session();
    let BlockAction::Forward(f) = s.block_action_within(&b, 2).unwrap() else {
        panic!()
    };
    assert_eq!(f.tokens, vec![7, 8, 9, 20, 30]);
    // To one level: 8 and 30 beside it.
    let plan = |s: &mut CloudSession| match s.block_action_within(&b, 1).unwrap() {
        BlockAction::Forward(f) => f,
        other => panic!("{other:?}"),
    };
    // The target follows the lane 8 20 21, then 5. The first forward commits 8 and the
    // target's 20 after it, a child of 8 in the block: partial, the epoch stays.
    let want = [8, 20, 21, 5];
    let mut s = session();
    let f = plan(&mut s);
    assert_eq!(f.tokens, vec![7, 8, 30]);
    let done = s.finish(&b, &f, &refs(&tree_rows(&b, &f, &want))).unwrap();
    assert!(done.partial);
    assert_eq!((done.accepted, done.kv_len, s.epoch()), (1, 5, 0));
    assert_eq!(
        done.keep.iter().map(|&j| f.tokens[j]).collect::<Vec<_>>(),
        [8]
    );
    assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 20]);
    // The next walks the block from its start through the lane: its one verdict names the
    // lane's path in the block's own numbering, as the untrimmed forward's did.
    let f = plan(&mut s);
    assert_eq!(f.tokens, vec![20, 21]);
    let done = s.finish(&b, &f, &refs(&tree_rows(&b, &f, &want))).unwrap();
    assert!(!done.partial);
    let v = done.verdict;
    assert_eq!((v.accepted, v.side_end, v.token), (3, Some(1), 5));
    assert_eq!(
        (s.epoch(), s.committed()),
        (0, &[1, 2, 3, 7, 8, 20, 21, 5][..])
    );
    // The target's token below the trimmed node is none of the block's: the correction.
    let mut s = session();
    let f = plan(&mut s);
    let done = s
        .finish(&b, &f, &refs(&tree_rows(&b, &f, &[8, 6])))
        .unwrap();
    assert!(!done.partial);
    let v = done.verdict;
    assert_eq!((v.accepted, v.side_end, v.token), (1, None, 6));
    assert_eq!((s.epoch(), s.committed()), (1, &[1, 2, 3, 7, 8, 6][..]));
    // The main path right, a level a forward: 8 (and 9), 10 (and the bonus 11).
    let want = [8, 9, 10, 11];
    let mut s = session();
    let f = plan(&mut s);
    assert!(
        s.finish(&b, &f, &refs(&tree_rows(&b, &f, &want)))
            .unwrap()
            .partial
    );
    let f = plan(&mut s);
    assert_eq!(f.tokens, vec![9, 10]);
    let done = s.finish(&b, &f, &refs(&tree_rows(&b, &f, &want))).unwrap();
    let v = done.verdict;
    assert_eq!(
        (done.partial, v.accepted, v.side_end, v.token),
        (false, 3, None, 11)
    );
    assert_eq!(s.committed(), &[1, 2, 3, 7, 8, 9, 10, 11]);
}

#[test]
fn decodes_that_divert_a_tree_move_nothing_and_decodes_off_it_move_the_epoch() {
    let b = tree_block();
    let mut s = session();
    for t in [8, 20] {
        s.decode_feed().unwrap();
        s.finish_decode(&rows(&[t])[0]).unwrap();
    }
    let BlockAction::Forward(f) = s.block_action(&b).unwrap() else {
        panic!()
    };
    assert_eq!(f.tokens, vec![20, 21], "the subtree below the lane");
    let done = s
        .finish(&b, &f, &refs(&tree_rows(&b, &f, &[8, 20, 21, 5])))
        .unwrap();
    assert_eq!(
        (
            done.verdict.epoch,
            done.verdict.accepted,
            done.verdict.side_end
        ),
        (0, 3, Some(1))
    );
    assert_eq!(
        (s.epoch(), s.committed()),
        (0, &[1, 2, 3, 7, 8, 20, 21, 5][..])
    );
    // A tree the decodes walk to its end is covered; one they leave is contradicted.
    let mut s = session();
    for t in [8, 20, 21] {
        s.decode_feed().unwrap();
        s.finish_decode(&rows(&[t])[0]).unwrap();
    }
    assert_eq!(s.block_action(&b).unwrap(), BlockAction::Covered);
    assert_eq!(s.epoch(), 0);
    let mut s = session();
    for t in [8, 20, 3] {
        s.decode_feed().unwrap();
        s.finish_decode(&rows(&[t])[0]).unwrap();
    }
    assert_eq!(
        s.block_action(&b).unwrap(),
        BlockAction::Contradicted { pos: 6 }
    );
    assert_eq!(s.epoch(), 1);
}

#[test]
fn a_lane_that_ends_inside_the_block_is_a_correction_after_its_end() {
    // 30 beside 8 ends at block position 0 of 3: the walk to it leaves nothing to verify
    // but the committed token, whose verdict is a correction (the epoch moves).
    let b = tree_block();
    let mut s = session();
    s.decode_feed().unwrap();
    s.finish_decode(&rows(&[30])[0]).unwrap();
    let BlockAction::Forward(f) = s.block_action(&b).unwrap() else {
        panic!()
    };
    assert_eq!(
        (f.tokens.clone(), f.nodes.clone()),
        (vec![30], vec![Node::Side(2)])
    );
    let done = s.finish(&b, &f, &refs(&rows(&[6]))).unwrap();
    assert_eq!(
        (
            done.verdict.accepted,
            done.verdict.side_end,
            done.verdict.token
        ),
        (1, Some(2), 6)
    );
    assert_eq!(s.epoch(), 1);
    assert_eq!(s.committed(), &[1, 2, 3, 7, 30, 6]);
}

#[test]
fn under_rejection_sampling_a_side_node_marked_point_is_judged_as_a_point_mass() {
    // A main token drawn from q and, beside it, a token the edge chose itself (a lane's,
    // from another parent): marked `point`, the committed token follows p (χ², 5 dof, 0.999
    // quantile 20.5); judged as a second draw from q (unmarked), it does not.
    use crate::sampling::distribution;
    use crate::tree::SideNode;
    use crate::verify::draft_sample;
    let target = [1.0f32, 0.2, 0.5, -0.3, 0.9, 0.0];
    let draft = [0.1f32, 1.2, 0.4, 0.6, -0.2, 0.3];
    let at = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed,
    };
    let chi2 = |point: bool| {
        let mut counts = [0usize; 6];
        for seed in 0..20_000u64 {
            let p = at(seed);
            let mut s = CloudSession::new(VerifyRule::Rejection, p, &[1, 2, 3], 5, 64);
            let (d, q) = draft_sample(&draft, &p, 4, 6);
            let b = Block {
                q: vec![q],
                side: vec![SideNode {
                    parent: 0,
                    token: if d == 4 { 0 } else { 4 },
                    point,
                }],
                ..block(0, 0, 4, &[d])
            };
            let BlockAction::Forward(f) = s.block_action(&b).unwrap() else {
                panic!()
            };
            let rows = vec![target.to_vec(); f.tokens.len()];
            s.finish(&b, &f, &refs(&rows)).unwrap();
            counts[s.committed()[4] as usize] += 1;
        }
        let want = distribution(&target, &at(0));
        let n = counts.iter().sum::<usize>() as f64;
        want.iter()
            .map(|&(t, p)| {
                let e = n * p as f64;
                (counts[t as usize] as f64 - e).powi(2) / e
            })
            .sum::<f64>()
    };
    let (right, wrong) = (chi2(true), chi2(false));
    assert!(right < 20.5, "point masses: χ² {right}");
    assert!(wrong > 100.0, "judged as second draws: χ² {wrong}");
}

#[test]
fn bad_trees_are_refused_by_name() {
    let s = session();
    let mut b = tree_block();
    b.side[2].token = 8;
    let e = s.check(&b).unwrap_err().to_string();
    assert!(e.contains("two guesses of token 8"), "{e}");
    let rs = CloudSession::new(
        VerifyRule::Rejection,
        SamplingParams {
            temperature: 0.8,
            ..SamplingParams::default()
        },
        &[1, 2, 3],
        7,
        64,
    );
    // Under rejection sampling a tree's main path carries its q; side nodes are point masses.
    let e = rs.check(&tree_block()).unwrap_err().to_string();
    assert!(e.contains("needs one draft distribution per token"), "{e}");
    let mut with_q = tree_block();
    with_q.q = vec![vec![(0, 1.0)]; with_q.tokens.len()];
    rs.check(&with_q).unwrap();
    // A branch past the context limit, though the main path is within it.
    let short = CloudSession::new(
        VerifyRule::Greedy,
        SamplingParams::default(),
        &[1, 2, 3],
        7,
        5,
    );
    let deep = Block {
        side: vec![
            crate::tree::SideNode {
                parent: 0,
                token: 30,
                point: false,
            },
            crate::tree::SideNode {
                parent: 1,
                token: 31,
                point: true,
            },
        ],
        ..block(0, 0, 4, &[8])
    };
    let e = short.check(&deep).unwrap_err().to_string();
    assert!(e.contains("past the block's last position 0"), "{e}");
    let e = short
        .check(&block(0, 0, 4, &[8, 9, 10]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("reaches position 7"), "{e}");
    // Siblings share a position but not a KV slot: a tree whose positions fit but whose
    // nodes need slots past the limit is refused too (it could never be fed).
    let wide = CloudSession::new(
        VerifyRule::Greedy,
        SamplingParams::default(),
        &[1, 2, 3],
        7,
        8,
    );
    let mut bushy = block(0, 0, 4, &[8, 9]);
    bushy.side = (0..3)
        .map(|i| crate::tree::SideNode {
            parent: 0,
            token: 20 + i,
            point: false,
        })
        .collect();
    assert_eq!(bushy.start_pos + bushy.reach(), 6, "positions fit");
    let e = wide.check(&bushy).unwrap_err().to_string();
    assert!(
        e.contains("need KV slots beyond the context limit 8"),
        "{e}"
    );
    s.check(&tree_block()).unwrap();
}

#[test]
fn bad_blocks_are_refused_by_name() {
    let mut s = session();
    let e = s
        .block_action(&block(2, 0, 4, &[7]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("epoch 2") && e.contains("epoch 0"), "{e}");
    let e = s.check(&block(0, 0, 2, &[7])).unwrap_err().to_string();
    assert!(e.contains("inside the prompt"), "{e}");
    let e = s
        .block_action(&block(0, 0, 9, &[7]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("starts at position 9, beyond the 4 committed"),
        "{e}"
    );
    let e = s.check(&block(0, 0, 4, &[])).unwrap_err().to_string();
    assert!(e.contains("no tokens"), "{e}");
    let short = CloudSession::new(
        VerifyRule::Greedy,
        SamplingParams::default(),
        &[1, 2, 3],
        7,
        5,
    );
    let e = short
        .check(&block(0, 0, 4, &[7, 1, 2]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("beyond the context limit 5"), "{e}");
    s.accept_index(&block(0, 4, 4, &[7])).unwrap();
    let e = s
        .accept_index(&block(0, 4, 4, &[7]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("index 4 does not follow 4"), "{e}");
}
