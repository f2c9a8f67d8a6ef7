//! The edge pipeline against the real verifier bookkeeping, with a fake target and draft, under
//! arbitrary interleavings of drafting, block delivery, verdict delivery, dropped connections,
//! reshapes and the verifier taking the session over (decoding it itself) and handing it back:
//! the committed sequence is exactly the target's greedy continuation, no unverified token is ever
//! committed, none twice, and stale blocks are dropped.

use std::collections::VecDeque;

use proptest::prelude::*;
use tandem_spec::sampling::{uniform, SamplingParams};
use tandem_spec::{
    Block, BlockAction, CloudSession, DecodeAction, Decoded, Next, Output, Pipeline,
    PipelineConfig, Verdict, VerifyRule,
};

const VOCAB: usize = 8;
const EOG: u32 = 7;

/// The fake target's greedy token at `pos` after `last`.
fn target(last: u32, pos: usize, seed: u64) -> u32 {
    let t = (uniform(seed, (pos as u64) << 8 | last as u64, 9) * VOCAB as f64) as u32;
    // Make end-of-generation rare.
    if t == EOG && uniform(seed, pos as u64, 10) < 0.8 {
        (last + 1) % (VOCAB as u32 - 1)
    } else {
        t
    }
}

fn logits_for(t: u32) -> Vec<f32> {
    let mut l = vec![0f32; VOCAB];
    l[t as usize] = 4.0;
    l
}

/// The draft guesses the target's token with probability alpha, else a wrong one.
fn draft(seq: &[u32], seed: u64, alpha: f64, salt: u64) -> u32 {
    let pos = seq.len();
    let t = target(*seq.last().unwrap(), pos, seed);
    if uniform(seed ^ 0xd4af, (pos as u64) << 16 | salt, 4) < alpha {
        t
    } else {
        (t + 1 + (salt % 3) as u32) % VOCAB as u32
    }
}

fn oracle(prompt: &[u32], max_new: usize, seed: u64) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_new {
        let t = target(*seq.last().unwrap(), seq.len(), seed);
        seq.push(t);
        out.push(t);
        if t == EOG {
            break;
        }
    }
    out
}

/// The cloud side: verifier bookkeeping plus an emulated target KV holding real token history.
struct Cloud {
    session: CloudSession,
    kv: Vec<u32>,
    seed: u64,
    /// Decoding the session itself, and whether to hand it back after the next token.
    taken_over: bool,
    stop: bool,
}

/// What the verifier sends the edge.
#[derive(Debug, Clone, Copy)]
enum ToEdge {
    Verdict(Verdict),
    Decoded(Decoded),
}

impl Cloud {
    /// Open (or re-open) a session from the edge's committed history.
    fn open(history: &[u32], seed: u64) -> Self {
        let first = target(*history.last().unwrap(), history.len(), seed);
        let session = CloudSession::new(
            VerifyRule::Greedy,
            SamplingParams::default(),
            history.len(),
            first,
            10_000,
        );
        Self {
            session,
            kv: history.to_vec(),
            seed,
            taken_over: false,
            stop: false,
        }
    }

    /// One token decoded by the verifier itself (it has taken the session over).
    fn decode(&mut self) -> Decoded {
        let mut d = match self
            .session
            .decode()
            .expect("a committed token to decode from")
        {
            DecodeAction::Ready(d) => d,
            DecodeAction::Forward(plan) => {
                assert_eq!(
                    self.kv.len(),
                    plan.start_pos,
                    "plan starts at the KV length"
                );
                self.kv.extend_from_slice(&plan.tokens);
                let p = self.kv.len() - 1;
                let row = logits_for(target(self.kv[p], p + 1, self.seed));
                self.session.finish_decode(&row)
            }
        };
        if self.stop {
            self.taken_over = false;
            self.stop = false;
            d.resume = Some(tandem_spec::Shape::new(2, 2));
        }
        d
    }

    fn on_block(&mut self, b: &Block) -> Option<Verdict> {
        match self.session.on_block(b).expect("edge sends valid blocks") {
            BlockAction::Stale => None,
            BlockAction::Verdict(v) => Some(v),
            BlockAction::Forward(plan) => {
                assert_eq!(
                    self.kv.len(),
                    plan.start_pos,
                    "plan starts at the KV length"
                );
                self.kv.extend_from_slice(&plan.tokens);
                let rows: Vec<Vec<f32>> = plan
                    .logits_at
                    .iter()
                    .map(|&i| {
                        let p = plan.start_pos + i;
                        logits_for(target(self.kv[p], p + 1, self.seed))
                    })
                    .collect();
                let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
                let f = self.session.finish(b, &refs).expect("rows match the plan");
                self.kv.truncate(f.kv_len);
                Some(f.verdict)
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Step {
    Draft,
    DeliverBlock,
    DeliverVerdict,
    DropConnection,
    /// The policy changes γ and depth mid-stream.
    Reshape(usize, usize),
    /// The verifier takes the session over, decodes a token, hands it back after the next one.
    TakeOver,
    CloudDecode,
    HandBack,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => Just(Step::Draft),
        3 => Just(Step::DeliverBlock),
        3 => Just(Step::DeliverVerdict),
        1 => Just(Step::DropConnection),
        1 => (1usize..8, 1usize..5).prop_map(|(g, d)| Step::Reshape(g, d)),
        1 => Just(Step::TakeOver),
        2 => Just(Step::CloudDecode),
        1 => Just(Step::HandBack),
    ]
}

fn run(
    seed: u64,
    alpha: f64,
    gamma: usize,
    depth: usize,
    max_new: usize,
    schedule: &[Step],
) -> Result<(), TestCaseError> {
    let prompt: Vec<u32> = (0..3).map(|i| (seed as u32 + i) % 7).collect();
    let want = oracle(&prompt, max_new, seed);
    let cfg = PipelineConfig {
        draft_len: gamma,
        depth,
        max_new_tokens: max_new,
    };
    let mut edge = Pipeline::new(prompt.clone(), cfg, vec![EOG]).unwrap();
    let mut cloud = Cloud::open(&prompt, seed);
    let (mut to_cloud, mut to_edge) = (VecDeque::<Block>::new(), VecDeque::<ToEdge>::new());
    let limit = prompt.len() + max_new;
    let mut committed: Vec<u32> = Vec::new();
    let mut draft_kv = 0usize;
    let mut salt = 0u64;
    let handle = |outs: Vec<Output>,
                  committed: &mut Vec<u32>,
                  draft_kv: &mut usize,
                  to_cloud: &mut VecDeque<Block>|
     -> Result<(), TestCaseError> {
        for o in outs {
            match o {
                Output::Send(b) => to_cloud.push_back(b),
                Output::Rollback { to } => {
                    prop_assert!(
                        to < *draft_kv + 1,
                        "rollback to {} beyond fed {}",
                        to,
                        draft_kv
                    );
                    *draft_kv = to;
                }
                Output::Commit { pos, tokens } => {
                    prop_assert_eq!(
                        pos,
                        prompt.len() + committed.len(),
                        "commits are contiguous, never repeated"
                    );
                    for (i, t) in tokens.iter().enumerate() {
                        let k = committed.len() + i;
                        prop_assert!(k < want.len(), "committed past the end");
                        prop_assert_eq!(*t, want[k], "committed token {} is not the target's", k);
                    }
                    committed.extend(tokens);
                }
            }
        }
        Ok(())
    };
    let mut i = 0;
    let mut steps = 0;
    while edge.next() != Next::Done {
        steps += 1;
        prop_assert!(steps < 20_000, "no progress");
        // Follow the schedule, then a fair round-robin.
        let s = schedule.get(i).copied().unwrap_or(match steps % 4 {
            0 => Step::Draft,
            1 => Step::DeliverBlock,
            2 => Step::DeliverVerdict,
            _ if cloud.taken_over && !cloud.stop => Step::HandBack,
            _ => Step::CloudDecode,
        });
        i += 1;
        match s {
            Step::Draft if edge.next() == Next::Draft => {
                prop_assert!(edge.draft_fed() <= edge.tokens().len());
                draft_kv = edge.tokens().len(); // the shell feeds everything before drafting
                salt += 1;
                let t = draft(edge.tokens(), seed, alpha, salt);
                let outs = edge.on_drafted(t, None);
                prop_assert_eq!(edge.draft_fed() + 1, edge.tokens().len());
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
            }
            // While the verifier decodes the session, blocks wait in its queue.
            Step::DeliverBlock if !cloud.taken_over => {
                if let Some(b) = to_cloud.pop_front() {
                    if let Some(v) = cloud.on_block(&b) {
                        to_edge.push_back(ToEdge::Verdict(v));
                    }
                }
            }
            Step::DeliverVerdict => {
                let outs = match to_edge.pop_front() {
                    Some(ToEdge::Verdict(v)) => edge.on_verdict(v),
                    Some(ToEdge::Decoded(d)) => edge.on_decoded(d),
                    None => Ok(Vec::new()),
                }
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
            }
            Step::TakeOver => cloud.taken_over = true,
            Step::HandBack if cloud.taken_over => cloud.stop = true,
            Step::CloudDecode if cloud.taken_over && cloud.session.committed_len() < limit => {
                let d = cloud.decode();
                to_edge.push_back(ToEdge::Decoded(d));
            }
            Step::DropConnection => {
                to_cloud.clear();
                to_edge.clear();
                let outs = edge.on_connection_lost();
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
                let history = edge.tokens()[..edge.committed_len()].to_vec();
                cloud = Cloud::open(&history, seed);
                // The edge either commits the new session's first token at once or lets its next
                // block be judged against it; both must stay exact.
                if salt.is_multiple_of(2) {
                    let first = target(*history.last().unwrap(), history.len(), seed);
                    let outs = edge.on_reopened(first);
                    handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
                }
            }
            Step::Reshape(g, d) => {
                let outs = edge
                    .set_shape(g, d)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                handle(outs, &mut committed, &mut draft_kv, &mut to_cloud)?;
            }
            _ => {}
        }
    }
    prop_assert_eq!(&committed, &want);
    prop_assert_eq!(edge.output(), &want[..]);
    let s = edge.stats();
    prop_assert!(s.accepted <= s.drafted);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn committed_sequence_is_the_targets(
        seed in 0u64..10_000,
        alpha in prop_oneof![Just(0.0), Just(0.5), Just(0.8), Just(1.0), 0.0f64..1.0],
        gamma in 1usize..8,
        depth in 1usize..5,
        max_new in 1usize..40,
        schedule in proptest::collection::vec(step(), 0..300),
    ) {
        run(seed, alpha, gamma, depth, max_new, &schedule)?;
    }
}

#[test]
fn async_pipelining_keeps_blocks_in_flight() {
    // A perfect draft with depth 3 keeps three blocks in flight while verdicts are slow.
    let prompt = vec![1, 2, 3];
    let cfg = PipelineConfig {
        draft_len: 4,
        depth: 3,
        max_new_tokens: 64,
    };
    let mut edge = Pipeline::new(prompt, cfg, vec![EOG]).unwrap();
    let mut sent = 0;
    while edge.next() == Next::Draft {
        let t = draft(edge.tokens(), 5, 1.0, 0);
        sent += edge
            .on_drafted(t, None)
            .iter()
            .filter(|o| matches!(o, Output::Send(_)))
            .count();
    }
    assert_eq!(sent, 3);
    assert_eq!(edge.blocks_in_flight(), 3);
    assert_eq!(edge.next(), Next::Wait);
}

#[test]
fn depth_one_is_synchronous() {
    // With one block in flight the edge waits for its verdict; after a whole block passes, the
    // bonus is committed and the next block starts after it.
    let prompt = vec![1, 2, 3];
    let cfg = PipelineConfig {
        draft_len: 3,
        depth: 1,
        max_new_tokens: 64,
    };
    let mut edge = Pipeline::new(prompt.clone(), cfg, vec![EOG]).unwrap();
    let mut cloud = Cloud::open(&prompt, 5);
    let mut block = None;
    while edge.next() == Next::Draft {
        let t = draft(edge.tokens(), 5, 1.0, 0);
        for o in edge.on_drafted(t, None) {
            if let Output::Send(b) = o {
                block = Some(b);
            }
        }
    }
    assert_eq!(edge.next(), Next::Wait);
    assert_eq!(
        edge.tokens().len(),
        prompt.len() + 3,
        "nothing drafted past the block"
    );
    let v = cloud.on_block(&block.unwrap()).unwrap();
    assert_eq!(v.accepted, 3);
    let outs = edge.on_verdict(v).unwrap();
    let committed: usize = outs
        .iter()
        .map(|o| match o {
            Output::Commit { tokens, .. } => tokens.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(committed, 4, "three drafted tokens and the bonus");
    assert_eq!(edge.next(), Next::Draft);
}
