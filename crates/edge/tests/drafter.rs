//! The draft model grows a tree of leaves in one forward each step, keeping its KV across steps:
//! every leaf's proposal is what a fresh draft run linearly over that leaf's whole path proposes,
//! bit for bit, while the leaves change the way the edge changes them (a lane forks, a commit
//! picks the lane, another ends the lanes), and the draft's KV never holds more than the live
//! tree.

use std::sync::Arc;

use tandem_edge::{Drafter, EngineDrafter, SpecConfig};
use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{Engine, EngineConfig, LlamaModel, SeqChunk, SeqId, Wanted, WeightMode};
use tandem_spec::sampling::{second_choice, SamplingParams};
use tandem_spec::{SessionConfig, TreeConfig, VerifyRule};

fn model() -> Arc<LlamaModel> {
    let spec = TinySpec {
        context_len: 64,
        ..TinySpec::default()
    };
    Arc::new(LlamaModel::load(&mut tiny_file(&spec).unwrap(), WeightMode::Native).unwrap())
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

fn spec() -> SpecConfig {
    SpecConfig {
        session: SessionConfig {
            draft_len: 2,
            depth: 2,
            max_new_tokens: 32,
            auto: None,
            tree: TreeConfig {
                side_nodes: 8,
                lanes: 3,
                below: 0.5,
                min_chance: 0.0,
            },
        },
        rule: VerifyRule::Greedy,
        params: SamplingParams::default(),
        q_top_k: 8,
        self_draft: true,
        suffix: true,
    }
}

/// What a fresh draft proposes after `seq`, run linearly: the greedy token, and its second
/// choice and confidence.
fn fresh(m: &Arc<LlamaModel>, seq: &[u32]) -> (u32, Option<(u32, f32)>) {
    let mut e = engine(m);
    let l = e
        .forward(&[SeqChunk::new(SeqId(0), 0, seq.to_vec(), Wanted::Last)])
        .unwrap();
    let row = l.row(0);
    let t = tandem_spec::sampling::argmax(row);
    (t, second_choice(row, &SamplingParams::default(), t))
}

#[test]
fn every_leaf_proposes_what_a_linear_run_of_its_path_does() {
    let m = model();
    let mut e = engine(&m);
    let prompt = vec![3u32, 1, 4, 1, 5];
    let cfg = spec();
    let mut d = EngineDrafter::new(&mut e, &prompt, &cfg);
    let check = |d: &mut EngineDrafter, base: &[u32], leaves: &[Vec<u32>]| -> Vec<u32> {
        let props = d.grow(base, leaves).unwrap();
        assert_eq!(props.len(), leaves.len());
        props
            .iter()
            .zip(leaves)
            .map(|(p, leaf)| {
                let mut seq = base.to_vec();
                seq.extend(leaf);
                let (t, h) = fresh(&m, &seq);
                assert_eq!(p.token, t, "leaf {leaf:?} after {base:?}");
                assert_eq!(p.hedge.map(|h| (h.alt, h.p_top)), h, "leaf {leaf:?}");
                p.token
            })
            .collect()
    };
    // Linear: the prompt (a prefill), then a token.
    let t1 = check(&mut d, &prompt, &[vec![]])[0];
    let mut base = prompt.clone();
    base.push(t1);
    let t2 = check(&mut d, &base, &[vec![]])[0];
    // A lane forks at the next position (token 9 beside t2): both leaves grow in one forward,
    // then again (each leaf's tip is new; the nodes below the base stay).
    let g = check(&mut d, &base, &[vec![t2], vec![9]]);
    let g2 = check(&mut d, &base, &[vec![t2, g[0]], vec![9, g[1]]]);
    // A third leaf forks from the lane.
    let g3 = check(
        &mut d,
        &base,
        &[
            vec![t2, g[0], g2[0]],
            vec![9, g[1], g2[1]],
            vec![9, g[1], 11],
        ],
    );
    // The commit at the fork picks the lane: its two leaves go on from a longer base.
    let mut lane = base.clone();
    lane.extend([9, g[1]]);
    check(&mut d, &lane, &[vec![g2[1], g3[1]], vec![11, g3[2]]]);
    // A commit nothing guessed ends the lanes: back to one linear leaf after the correction.
    let mut fixed = lane.clone();
    fixed.push(13);
    check(&mut d, &fixed, &[vec![]]);
    drop(d);
    assert_eq!(
        e.seq_len(SeqId(0)),
        fixed.len(),
        "the draft's KV holds the committed path and nothing else"
    );
    assert!(!e.has_tree(SeqId(0)));
}

#[test]
fn sessions_share_one_forward_and_each_proposes_what_it_would_alone() {
    use tandem_edge::drafter::DraftSeq;
    let m = model();
    let mut e = engine(&m);
    let cfg = spec();
    let (p1, p2) = (vec![3u32, 1, 4, 1, 5], vec![2u32, 7, 1, 8]);
    let mut a = DraftSeq::new(&mut e, SeqId(1), &p1, &cfg);
    let mut b = DraftSeq::new(&mut e, SeqId(2), &p2, &cfg);
    let (mut base1, mut base2) = (p1.clone(), p2.clone());
    for step in 0..4 {
        // Session 1 linear; session 2 with a lane from the second step on.
        let leaves1 = vec![Vec::new()];
        let leaves2 = if step == 0 {
            vec![Vec::new()]
        } else {
            vec![vec![9 + step as u32], vec![11]]
        };
        let s1 = a.grow_step(&mut e, &base1, &leaves1).unwrap();
        let s2 = b.grow_step(&mut e, &base2, &leaves2).unwrap();
        let logits = e.forward(&[s1.chunk.clone(), s2.chunk.clone()]).unwrap();
        let g1 = a.finish(s1, &logits).unwrap();
        let g2 = b.finish(s2, &logits).unwrap();
        assert_eq!(g1[0].token, fresh(&m, &base1).0, "step {step}");
        for (leaf, g) in leaves2.iter().zip(&g2) {
            let path = [&base2[..], &leaf[..]].concat();
            assert_eq!(g.token, fresh(&m, &path).0, "step {step} leaf {leaf:?}");
        }
        base1.push(g1[0].token);
        if step == 0 {
            base2.push(g2[0].token);
        }
    }
    a.free(&mut e);
    b.free(&mut e);
    assert_eq!((e.seq_len(SeqId(1)), e.seq_len(SeqId(2))), (0, 0));
}
