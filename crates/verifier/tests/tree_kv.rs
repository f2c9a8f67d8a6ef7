//! Token trees on a real (tiny, f32) target through the verifier core: a tree whose main path is
//! right, one whose side branch is right, and one whose every path is wrong commit the target's
//! tokens (greedy and sample-and-match), and afterwards the session's KV holds only the accepted
//! path: the next forward's logits equal a fresh linear run's, bit for bit.

mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use common::Driver;
use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{
    Engine, EngineConfig, EngineError, LlamaModel, Logits, SeqChunk, SeqId, Wanted, WeightMode,
};
use tandem_sched::SessionId;
use tandem_spec::sampling::{sample, SamplingParams};
use tandem_spec::{Block, BlockId, SideNode, VerifyRule};
use tandem_verifier::{Target, ToEdge, VerifierConfig, VerifierCore};

fn model() -> Arc<LlamaModel> {
    let mut f = tiny_file(&TinySpec::default()).unwrap();
    Arc::new(LlamaModel::load(&mut f, WeightMode::F32).unwrap())
}

fn engine(m: &Arc<LlamaModel>) -> Engine {
    let cfg = EngineConfig {
        threads: 1,
        kv_budget_bytes: 4 << 20,
        kv_block_size: 4,
        ..EngineConfig::default()
    };
    Engine::new(m.clone(), cfg).unwrap()
}

/// The real engine, keeping the logits rows of every forward.
struct Recording {
    e: Engine,
    rows: Rc<RefCell<Vec<Vec<f32>>>>,
}

impl Target for Recording {
    fn vocab(&self) -> usize {
        Target::vocab(&self.e)
    }
    fn context_len(&self) -> usize {
        Target::context_len(&self.e)
    }
    fn kv_geometry(&self) -> (usize, usize) {
        Target::kv_geometry(&self.e)
    }
    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32) {
        let (r, us) = self.e.forward_timed(batch, tables);
        if let Ok(l) = &r {
            let mut rows = self.rows.borrow_mut();
            rows.extend((0..l.rows.len()).map(|i| l.row(i).to_vec()));
        }
        (r, us)
    }
    fn keep_path(&mut self, table: &[u32], len: usize, path: &[usize]) -> Result<(), EngineError> {
        Target::keep_path(&mut self.e, table, len, path)
    }
}

/// The target's own continuation of `prompt` under `params` (`n` tokens), and the logits after
/// each of its prefixes, from a fresh engine run linearly.
fn continuation(
    m: &Arc<LlamaModel>,
    prompt: &[u32],
    params: &SamplingParams,
    n: usize,
) -> Vec<u32> {
    let mut e = engine(m);
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    let mut fed = 0;
    for _ in 0..n {
        let l = e
            .forward(&[SeqChunk::new(
                SeqId(0),
                fed,
                seq[fed..].to_vec(),
                Wanted::Last,
            )])
            .unwrap();
        fed = seq.len();
        let t = sample(l.row(0), params, seq.len() as u64);
        seq.push(t);
        out.push(t);
    }
    out
}

fn last_logits(m: &Arc<LlamaModel>, seq: &[u32]) -> Vec<f32> {
    let mut e = engine(m);
    e.forward(&[SeqChunk::new(SeqId(0), 0, seq.to_vec(), Wanted::Last)])
        .unwrap()
        .row(0)
        .to_vec()
}

/// A tree case: its name, main path, side nodes, and the verdict's accepted count and side end.
type Case = (&'static str, Vec<u32>, Vec<SideNode>, usize, Option<u32>);

fn side(parent: u32, token: u32) -> SideNode {
    SideNode {
        parent,
        token,
        point: false,
    }
}

/// A token that is not `t`.
fn not(t: u32) -> u32 {
    (t + 1) % 90
}

#[test]
fn trees_commit_the_targets_tokens_and_keep_only_the_accepted_path() {
    let m = model();
    let prompt: Vec<u32> = (0..10).map(|j| (j * 7 + 3) % 90).collect();
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: 5,
    };
    for (params, rule) in [
        (SamplingParams::default(), VerifyRule::Greedy),
        (sampled, VerifyRule::SampleMatch),
    ] {
        let want = continuation(&m, &prompt, &params, 12);
        let w = |i: usize| want[i];
        // (main path, side nodes, accepted, side_end): the block starts after the first token.
        let cases: Vec<Case> = vec![
            (
                "main path right",
                vec![w(1), w(2), w(3)],
                vec![side(1, not(w(2))), side(0, not(w(1)))],
                3,
                None,
            ),
            (
                "side branch right",
                vec![w(1), not(w(2)), not(w(3)), not(w(4))],
                vec![
                    side(0, not(w(1))),
                    side(1, w(2)),
                    side(5, w(3)),
                    side(6, w(4)),
                ],
                4,
                Some(3),
            ),
            (
                "every path wrong",
                vec![not(w(1)), w(2)],
                vec![side(0, not(not(w(1)))), side(2, w(4))],
                0,
                None,
            ),
        ];
        for (name, tokens, side_nodes, accepted, side_end) in cases {
            let rows = Rc::new(RefCell::new(Vec::new()));
            let target = Recording {
                e: engine(&m),
                rows: rows.clone(),
            };
            let v: VerifierCore<Recording> =
                VerifierCore::new(target, VerifierConfig::default(), 0).unwrap();
            let mut d = Driver::new(v);
            let id = SessionId(1);
            d.open(id, &prompt, params, rule, 12);
            let first = d
                .turn()
                .into_iter()
                .find_map(|(_, m)| match m {
                    ToEdge::Opened { first, .. } => Some(first),
                    _ => None,
                })
                .expect("opened");
            assert_eq!(first, w(0));
            let block = Block {
                epoch: 0,
                index: BlockId(0),
                start_pos: prompt.len() + 1,
                tokens,
                q: vec![],
                side: side_nodes,
            };
            d.draft(id, block);
            d.now_us = 1_000;
            let sent = d.turn();
            assert!(
                !sent.iter().any(|(_, m)| matches!(m, ToEdge::Error { .. })),
                "{name}: accepted as sent: {sent:?}"
            );
            let verdict = sent
                .into_iter()
                .find_map(|(_, m)| match m {
                    ToEdge::Verdict(v) => Some(v),
                    _ => None,
                })
                .expect("a verdict");
            let token = w(1 + accepted);
            assert_eq!(
                (verdict.accepted, verdict.side_end, verdict.token),
                (accepted, side_end, token),
                "{rule:?} {name}"
            );
            // The next forward decodes after the verdict's token: its logits are a fresh linear
            // run's over the committed tokens (the rejected nodes' KV is gone).
            rows.borrow_mut().clear();
            d.now_us = 2_000;
            let decoded = d
                .turn()
                .into_iter()
                .find_map(|(_, m)| match m {
                    ToEdge::Decoded(decoded) => Some(decoded),
                    _ => None,
                })
                .expect("a decode");
            assert_eq!(decoded.token, w(2 + accepted), "{rule:?} {name}");
            let mut seq = prompt.clone();
            seq.extend_from_slice(&want[..=1 + accepted]);
            let got = rows.borrow()[0].clone();
            assert_eq!(
                got,
                last_logits(&m, &seq),
                "{rule:?} {name}: the KV after the tree"
            );
        }
    }
}
