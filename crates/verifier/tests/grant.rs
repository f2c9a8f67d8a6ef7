//! The current grant is enforced: a block longer than the γ the session was last told (drafted
//! before the grant shrank, or by an edge that ignores it) is trimmed to it, not refused. Its
//! tokens are judged γ a forward; those found right go out as decoded tokens, and the block's one
//! verdict comes when it is judged to its end or rejected.

mod common;

use common::{core_with, next, oracle};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::tree::SideNode;
use tandem_spec::{Block, BlockId, Shape, Verdict, VerifyRule};
use tandem_verifier::{
    Inbound, LoadConfig, Mode, NewSession, ToEdge, VerifierConfig, VerifierCore,
};

const PROMPT: [u32; 3] = [3, 4, 5];
const S: SessionId = SessionId(1);

/// Open a greedy session whose grants are γ 2 at most (it asks for 8): the verifier and the
/// target's first tokens from the prompt on, its first one at `want[0]`.
fn open() -> (VerifierCore<common::OneHot, ()>, Vec<u32>) {
    let cfg = VerifierConfig {
        load: LoadConfig {
            max_draft_len: 2,
            max_depth: 4,
            ..LoadConfig::FIXED
        },
        ..VerifierConfig::default()
    };
    let (mut v, _) = core_with(cfg);
    v.receive(
        0,
        Inbound::Open {
            session: S,
            new: NewSession {
                tenant: TenantId(0),
                prompt: PROMPT.to_vec(),
                params: SamplingParams::default(),
                max_tokens: 100,
                eog: vec![],
                mode: Mode::Speculate {
                    rule: VerifyRule::Greedy,
                    want: Shape::new(8, 2),
                },
                grammar: None,
                logprobs: None,
                self_draft: false,
            },
            handle: (),
        },
    );
    let t = v.turn(0);
    let Some(ToEdge::Opened { first, grant, .. }) = t
        .out
        .iter()
        .map(|o| o.msg.clone())
        .find(|m| matches!(m, ToEdge::Opened { .. }))
    else {
        panic!("{:?}", t.out)
    };
    assert_eq!(grant.draft_len, 2);
    let want = oracle(&PROMPT, 12);
    assert_eq!(first, want[0]);
    (v, want)
}

/// What the session was told, one forward's tokens after another and its verdicts, once the
/// edge (which ignores its grant) sent `block` and the verifier turned until ten tokens were
/// told; every told token checked against the block's tokens on the path its verdict names.
fn run(
    mut v: VerifierCore<common::OneHot, ()>,
    block: Block,
) -> (Vec<u32>, Vec<Option<usize>>, Vec<Verdict>, u64) {
    let first = oracle(&PROMPT, 1)[0];
    v.receive(
        1_000,
        Inbound::Draft {
            session: S,
            block: block.clone(),
        },
    );
    let (mut told, mut forwards, mut verdicts) = (vec![first], Vec::new(), Vec::new());
    let mut now = 1_000;
    while told.len() < 10 {
        let t = v.turn(now);
        now = t.ends_us + 1;
        forwards.push(t.forward.map(|f| f.tokens));
        for o in t.out {
            match o.msg {
                ToEdge::Decoded(d) => {
                    assert_eq!(d.pos, PROMPT.len() + told.len(), "told once, in order");
                    told.push(d.token);
                }
                ToEdge::Verdict(v) => {
                    assert_eq!(v.block, block.index);
                    // It counts from the block's start; what it tells past the told tokens
                    // is the path it names and then its own token.
                    let path = block
                        .named_path(v.accepted, v.side_end)
                        .expect("a path of the block");
                    let known = told.len() - 1;
                    told.extend(path[known..].iter().map(|&n| block.token(n).unwrap()));
                    told.push(v.token);
                    verdicts.push(v);
                }
                other => panic!("{other:?}"),
            }
        }
    }
    (told, forwards, verdicts, v.stats.partial_verifies)
}

#[test]
fn a_block_longer_than_the_grant_is_trimmed_to_it_and_its_tokens_are_the_targets() {
    let (v, want) = open();
    // An edge that ignores its grant: eight tokens, all the target's.
    let block = Block {
        epoch: 0,
        index: BlockId(0),
        start_pos: PROMPT.len() + 1,
        tokens: want[1..9].to_vec(),
        q: vec![],
        side: vec![],
    };
    let (told, forwards, verdicts, partial) = run(v, block);
    // Two drafted tokens and the committed one a forward, three forwards: after the first two,
    // the target's next token was the draft's next (three tokens told each time); the third
    // judged the block's last two and answered it.
    assert_eq!(forwards, vec![Some(3), Some(3), Some(3)]);
    assert_eq!(verdicts.iter().map(|v| v.accepted).collect::<Vec<_>>(), [8]);
    assert_eq!(told, want[..10]);
    assert_eq!(partial, 2);
    for (p, w) in told.windows(2).enumerate() {
        assert_eq!(w[1], next(PROMPT.len() + p, w[0]));
    }
}

#[test]
fn a_token_tree_deeper_than_the_grant_is_trimmed_to_it_and_keeps_its_numbering() {
    let (v, want) = open();
    // Eight main tokens, the target's for four positions and wrong after; beside the fifth, a
    // lane of four that is the target's.
    let wrong = |t: u32| (t + 1) % common::VOCAB as u32;
    let mut tokens = want[1..5].to_vec();
    tokens.extend(want[5..9].iter().map(|&t| wrong(t)));
    let side = (0..4)
        .map(|m| SideNode {
            parent: if m == 0 { 4 } else { 8 + m - 1 },
            token: want[5 + m as usize],
            point: true,
        })
        .collect();
    let block = Block {
        epoch: 0,
        index: BlockId(0),
        start_pos: PROMPT.len() + 1,
        tokens,
        q: vec![],
        side,
    };
    let (told, forwards, verdicts, partial) = run(v, block);
    // Two levels below the committed token a forward: the main 1-2; 3-4 and the lane's first
    // beside the main 5; the lane's last two. The one verdict names the lane's end in the
    // block's numbering (its fourth side node), eight positions from the block's start.
    assert_eq!(forwards, vec![Some(3), Some(4), Some(3)]);
    assert_eq!(
        verdicts
            .iter()
            .map(|v| (v.accepted, v.side_end))
            .collect::<Vec<_>>(),
        [(8, Some(3))]
    );
    assert_eq!(told, want[..10]);
    assert_eq!(partial, 2);
}
