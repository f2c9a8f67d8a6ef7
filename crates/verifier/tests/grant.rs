//! The current grant is enforced: a block longer than the γ the session was last told (drafted
//! before the grant shrank, or by an edge that ignores it) is trimmed to it, not refused. Its
//! tokens are judged γ a forward; those found right go out as decoded tokens, and the block's one
//! verdict comes when it is judged to its end or rejected.

mod common;

use common::{core, next, oracle};
use tandem_sched::{GrantPolicy, SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, BlockId, Shape, VerifyRule};
use tandem_verifier::{Inbound, Mode, NewSession, ToEdge};

const PROMPT: [u32; 3] = [3, 4, 5];
const S: SessionId = SessionId(1);

#[test]
fn a_block_longer_than_the_grant_is_trimmed_to_it_and_its_tokens_are_the_targets() {
    let (v, _) = core();
    // Grants of γ 2 at most; the session asks for 8.
    let mut v = v.with_grants(GrantPolicy::new(2, 4, f64::INFINITY), 0);
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
            },
            handle: (),
        },
    );
    let t = v.turn(0);
    let Some(ToEdge::Opened { first, grant }) = t.out.first().map(|o| o.msg.clone()) else {
        panic!("{:?}", t.out)
    };
    assert_eq!(grant.draft_len, 2);
    let want = oracle(&PROMPT, 12);
    assert_eq!(first, want[0]);
    // An edge that ignores its grant: eight tokens, all the target's.
    v.receive(
        1_000,
        Inbound::Draft {
            session: S,
            block: Block {
                epoch: 0,
                index: BlockId(0),
                start_pos: PROMPT.len() + 1,
                tokens: want[1..9].to_vec(),
                q: vec![],
                side: vec![],
            },
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
                    assert_eq!(v.block, BlockId(0));
                    // It counts from the block's start; what it tells past the told tokens
                    // is the block's and then its own token.
                    let known = told.len() - 1;
                    told.extend_from_slice(&want[1 + known..1 + v.accepted]);
                    told.push(v.token);
                    verdicts.push(v.accepted);
                }
                other => panic!("{other:?}"),
            }
        }
    }
    // Two drafted tokens and the committed one a forward, three forwards: after the first two,
    // the target's next token was the draft's next (three tokens told each time); the third
    // judged the block's last two and answered it.
    assert_eq!(forwards, vec![Some(3), Some(3), Some(3)]);
    assert_eq!(verdicts, vec![8]);
    assert_eq!(told, want[..10]);
    assert_eq!(v.stats.partial_verifies, 2);
    for (p, w) in told.windows(2).enumerate() {
        assert_eq!(w[1], next(PROMPT.len() + p, w[0]));
    }
}
