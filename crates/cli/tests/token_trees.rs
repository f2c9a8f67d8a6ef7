//! Token trees on SmolLM2 through a real gRPC verifier: hand-made trees and lanes across blocks
//! commit only the target's tokens, and the edge runtime drafting trees gives the target's own
//! output under greedy and sample-and-match verification. The model is pulled on first use.

mod common;

use common::*;
use tandem_engine::SeqId;

/// Token trees on SmolLM2 through a real gRPC verifier. Hand-made trees (the main path right,
/// a side branch right, every path wrong): whatever the verifier decoded before the block
/// landed, every token it commits is the target's, and a verdict names a path of its block. The
/// edge runtime with trees (greedy, and sample-and-match at temperature 0.9): the output is the
/// target's own.
#[test]
fn token_trees_over_real_grpc_commit_the_targets_tokens() {
    use tandem_edge::grpc::{GrpcLink, OpenRequest};
    use tandem_edge::Link;
    use tandem_spec::{Incoming, SideNode};
    let (m, tok) = target();
    let url = grpc_server().clone();
    let prompt = tok.encode_chat("Name three colours.").unwrap();
    let want = greedy(&mut engine(m), SeqId(9), &prompt, 16);
    let rt = tandem_testkit::rt();
    let not = |t: u32| (t + 1) % 1000;
    let w = |i: usize| want[i];
    let side = |parent, token| SideNode {
        parent,
        token,
        point: false,
    };
    let cases: Vec<(&str, Vec<u32>, Vec<SideNode>)> = vec![
        (
            "main path right",
            want[1..9].to_vec(),
            vec![side(4, not(w(5))), side(6, not(w(7)))],
        ),
        (
            "side branch right",
            [&want[1..5], &[not(w(5)), w(6), w(7), w(8)][..]].concat(),
            vec![
                side(2, not(w(3))),
                side(4, w(5)),
                side(9, w(6)),
                side(10, w(7)),
            ],
        ),
        (
            "every path wrong",
            [&want[1..5], &[not(w(5)), not(w(6))][..]].concat(),
            vec![side(4, not(not(w(5)))), side(6, w(7))],
        ),
    ];
    // A tree is granted only as many side nodes as fit one forward with γ and the committed
    // token (the test server: a budget of 64 tokens, γ up to 8).
    let tree_open = |want_side_nodes| OpenRequest {
        want_draft_len: 8,
        want_side_nodes,
        ..greedy_open(tok.fingerprint(), &prompt)
    };
    let (link, opened) = GrpcLink::connect(&rt, &url, tree_open(1000)).unwrap();
    assert_eq!(opened.side_nodes, 64 - 8 - 1);
    link.close();
    let mut side_verdicts = 0;
    // A lane across two blocks: block 0's branch beside its third token runs to its end, and
    // block 1 carries it on from its root (whatever is committed before it), beside a main path
    // that went on from block 0's main path. Committing the lane keeps block 1: it is verified
    // along the lane, not dropped as stale.
    let lane_blocks = {
        let s0 = prompt.len() + 1;
        vec![
            tandem_spec::Block {
                epoch: 0,
                index: tandem_spec::BlockId(0),
                start_pos: s0,
                tokens: vec![w(1), w(2), not(w(3)), not(w(4))],
                q: vec![],
                side: vec![side(2, w(3)), side(4, w(4))],
            },
            tandem_spec::Block {
                epoch: 0,
                index: tandem_spec::BlockId(1),
                start_pos: s0 + 4,
                tokens: vec![not(w(5)), w(6), w(7), w(8)],
                q: vec![],
                side: vec![side(0, w(5)), side(4, w(6)), side(5, w(7)), side(6, w(8))],
            },
        ]
    };
    {
        let (mut link, _) = GrpcLink::connect(&rt, &url, tree_open(8)).unwrap();
        for b in &lane_blocks {
            link.send(b.clone()).unwrap();
        }
        let mut told = vec![w(0)];
        let mut lane_verdicts = 0;
        while told.len() < 16 {
            match link.recv(true).unwrap().expect("a message") {
                Incoming::Decoded(d) => told.push(d.token),
                Incoming::Opened(o) => panic!("a second Opened: {o:?}"),
                Incoming::Verdict(v) => {
                    let b = &lane_blocks[v.block.0 as usize];
                    let path = b.named_path(v.accepted, v.side_end).expect("a path");
                    let known = prompt.len() + told.len() - b.start_pos;
                    told.extend(path[known..].iter().map(|&n| b.token(n).unwrap()));
                    told.push(v.token);
                    lane_verdicts += usize::from(v.block.0 == 1 && v.side_end.is_some());
                    assert_eq!(v.epoch, 0, "a diversion moves no epoch");
                }
            }
        }
        told.truncate(16);
        assert_eq!(told, want, "a lane across two blocks");
        assert_eq!(lane_verdicts, 1, "block 1 was verified along the lane");
        link.close();
    }
    for (name, tokens, side_nodes) in cases {
        let (mut link, opened) = GrpcLink::connect(&rt, &url, tree_open(8)).unwrap();
        assert_eq!((opened.first_token, opened.side_nodes), (w(0), 8));
        let block = tandem_spec::Block {
            epoch: 0,
            index: tandem_spec::BlockId(0),
            start_pos: prompt.len() + 1,
            tokens,
            q: vec![],
            side: side_nodes,
        };
        link.send(block.clone()).unwrap();
        // Every position the verifier tells, once and in order, is the target's.
        let mut told = vec![w(0)];
        while told.len() < 16 {
            match link.recv(true).unwrap().expect("a message") {
                Incoming::Decoded(d) => {
                    assert_eq!(d.pos, prompt.len() + told.len(), "{name}");
                    told.push(d.token);
                }
                Incoming::Opened(o) => panic!("{name}: a second Opened: {o:?}"),
                Incoming::Verdict(v) => {
                    let path = block
                        .named_path(v.accepted, v.side_end)
                        .unwrap_or_else(|| panic!("{name}: {v:?} names no path of the block"));
                    let known = prompt.len() + told.len() - block.start_pos;
                    told.extend(path[known..].iter().map(|&n| block.token(n).unwrap()));
                    told.push(v.token);
                    side_verdicts += usize::from(v.side_end.is_some());
                }
            }
        }
        told.truncate(16);
        assert_eq!(told, want, "{name}");
        link.close();
    }
    eprintln!("{side_verdicts} verdicts ended in a branch");

    // The edge runtime drafting trees: the target's greedy output, and its own sampling. The
    // verifier awaits the blocks, so every tree the edge drafts is judged.
    let url = awaiting_server();
    let cut = want
        .iter()
        .position(|&t| tok.is_eog(t))
        .map_or(want.len(), |i| i + 1);
    let mut sent = 0;
    for (g, d, tree) in [
        (
            4,
            2,
            tandem_spec::TreeConfig {
                side_nodes: 8,
                lanes: 2,
                below: 0.6,
                min_chance: 0.0,
            },
        ),
        (
            3,
            3,
            tandem_spec::TreeConfig {
                side_nodes: 9,
                lanes: 3,
                below: 0.8,
                min_chance: 0.0,
            },
        ),
    ] {
        let out = spec_out_as(
            None,
            &prompt,
            g,
            d,
            0.0,
            tandem_spec::sampling::SamplingParams::default(),
            tandem_spec::VerifyRule::Greedy,
            16,
            Some(url.clone()),
            tree,
        );
        assert_eq!(out.output_ids, want[..cut], "γ={g} depth={d} {tree:?}");
        sent += out.spec.as_ref().unwrap().side_nodes;
    }
    assert!(
        sent > 0,
        "the draft was unsure somewhere: side nodes went out"
    );
    let p = tok.encode("Once upon a time").unwrap();
    let params = tandem_spec::sampling::SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 11,
    };
    // Long enough that the draft is unsure somewhere, where it forks lanes.
    const SAMPLED: usize = 40;
    let own = tandem_client::generate::generate(&mut engine(m), tok, &p, SAMPLED, &params, |_| {})
        .unwrap()
        .output_ids;
    let runs = |rule, check: &dyn Fn(&[u32])| {
        let out = spec_out_as(
            None,
            &p,
            4,
            2,
            0.0,
            params,
            rule,
            SAMPLED,
            Some(url.clone()),
            tandem_spec::TreeConfig {
                side_nodes: 8,
                lanes: 2,
                below: 0.9,
                min_chance: 0.0,
            },
        );
        check(&out.output_ids);
        let stats = out.spec.as_ref().unwrap();
        assert!(
            stats.side_nodes > 0,
            "{rule:?}: side nodes went out: {stats:?}"
        );
    };
    runs(tandem_spec::VerifyRule::SampleMatch, &|ids| {
        assert_eq!(ids, own, "sample-and-match over trees")
    });
    // Rejection sampling over trees goes through too (its distribution is tested on the tiny
    // models, crates/edge/tests/distribution.rs): the verifier judges the main tokens with their
    // q and the second draws beside them on what the main token left.
    runs(tandem_spec::VerifyRule::Rejection, &|ids| {
        assert!(
            ids.len() == SAMPLED || ids.last().is_some_and(|&t| tok.is_eog(t)),
            "{ids:?}"
        )
    });
}
