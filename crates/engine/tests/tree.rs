//! Token trees: each node's logits are those of a linear run of its path, bit for bit, and the
//! KV kept after a path is chosen is exactly a linear run's.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use tandem_engine::testing::{tiny_file, TinySpec, TINY_FAMILIES};
use tandem_engine::{
    Engine, EngineConfig, LlamaModel, Parent, SeqChunk, SeqId, Wanted, WeightMode,
};
use tandem_spec::sampling as sampler;

fn model(dtype: GgmlDType, mode: WeightMode) -> Arc<LlamaModel> {
    model_of("llama", dtype, mode)
}

/// A tiny model of family `arch` (see [`TinySpec::family`]).
fn model_of(arch: &'static str, dtype: GgmlDType, mode: WeightMode) -> Arc<LlamaModel> {
    let spec = TinySpec {
        dtype,
        ..TinySpec::family(arch)
    };
    Arc::new(LlamaModel::load(&mut tiny_file(&spec).unwrap(), mode).unwrap())
}

fn engine(m: &Arc<LlamaModel>) -> Engine {
    let cfg = EngineConfig {
        threads: 2,
        kv_budget_bytes: 4 << 20,
        kv_block_size: 4,
        ..EngineConfig::default()
    };
    Engine::new(m.clone(), cfg).unwrap()
}

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (sampler::uniform(seed, i, 1) * vocab as f64) as u32)
        .collect()
}

/// The logits after the last token of `seq`, run linearly on a fresh engine.
fn linear_last(m: &Arc<LlamaModel>, seq: &[u32]) -> Vec<f32> {
    let mut e = engine(m);
    let l = e
        .forward(&[SeqChunk::new(SeqId(0), 0, seq.to_vec(), Wanted::Last)])
        .unwrap();
    l.row(0).to_vec()
}

/// A tree after a 9-token context at slots 9..: node tokens and parents (as chunk indices, or
/// `None` for a child of the context's last token).
struct Tree {
    tokens: Vec<u32>,
    parents: Vec<Option<usize>>,
}

impl Tree {
    /// The path from the root to node `i`, as node indices.
    fn path(&self, i: usize) -> Vec<usize> {
        let mut p = vec![i];
        while let Some(q) = self.parents[*p.last().unwrap()] {
            p.push(q);
        }
        p.reverse();
        p
    }

    fn chunk(&self, seq: SeqId, start: usize) -> SeqChunk {
        let parents = self
            .parents
            .iter()
            .map(|p| Parent::Slot(p.map_or(start - 1, |q| start + q)))
            .collect();
        SeqChunk::tree(seq, start, self.tokens.clone(), parents, Wanted::All)
    }
}

/// The two weight formats the tree tests run on.
const FORMATS: [(GgmlDType, WeightMode); 2] = [
    (GgmlDType::F32, WeightMode::F32),
    (GgmlDType::Q4_0, WeightMode::Native),
];

/// A model of `arch` and `format`, its 9-token context, the tree of [`tree`] and an engine.
fn setup(
    arch: &'static str,
    format: (GgmlDType, WeightMode),
) -> (Arc<LlamaModel>, Vec<u32>, Tree, Engine) {
    let m = model_of(arch, format.0, format.1);
    let v = m.cfg.vocab;
    let e = engine(&m);
    (m, tokens(1, 9, v), tree(v), e)
}

/// Main path 0-1-2-3; 4 a sibling of 0 with child 5; 6 a sibling of 2; 7 a second child of 5.
fn tree(vocab: usize) -> Tree {
    Tree {
        tokens: tokens(7, 8, vocab),
        parents: vec![
            None,
            Some(0),
            Some(1),
            Some(2),
            None,
            Some(4),
            Some(1),
            Some(5),
        ],
    }
}

#[test]
fn each_node_sees_its_path_only_and_keeping_a_path_is_a_linear_run() {
    // Every family (Gemma 3's windows of 5 tokens end inside the 9-token context), every format.
    for (arch, format) in TINY_FAMILIES
        .iter()
        .flat_map(|a| FORMATS.iter().map(move |f| (*a, *f)))
    {
        let mode = (arch, format.1);
        let (m, ctx, t, mut e) = setup(arch, format);
        let v = m.cfg.vocab;
        let other = tokens(2, 5, v);
        e.forward(&[
            SeqChunk::new(SeqId(1), 0, ctx.clone(), Wanted::None),
            SeqChunk::new(SeqId(2), 0, other.clone(), Wanted::None),
        ])
        .unwrap();
        // The tree beside another sequence's linear chunk.
        let l = e
            .forward(&[
                t.chunk(SeqId(1), 9),
                SeqChunk::new(SeqId(2), 5, vec![3], Wanted::Last),
            ])
            .unwrap();
        assert!(e.has_tree(SeqId(1)) && !e.has_tree(SeqId(2)));
        let rows: Vec<_> = l.for_seq(SeqId(1)).collect();
        for (i, (row, logits)) in rows.iter().enumerate() {
            let path = t.path(i);
            assert_eq!(row.pos, 9 + path.len() - 1, "{mode:?} node {i}'s position");
            let mut seq = ctx.clone();
            seq.extend(path.iter().map(|&n| t.tokens[n]));
            assert_eq!(*logits, &linear_last(&m, &seq)[..], "{mode:?} node {i}");
        }
        let mut o = other.clone();
        o.push(3);
        assert_eq!(l.last_for(SeqId(2)).unwrap(), &linear_last(&m, &o)[..]);

        // Keep the side path 4-5-7: the sequence is linear, and what follows it computes what a
        // fresh run does.
        e.keep_path(SeqId(1), 9, &[9 + 4, 9 + 5, 9 + 7]).unwrap();
        assert!(!e.has_tree(SeqId(1)));
        assert_eq!(e.seq_len(SeqId(1)), 12);
        let l = e
            .forward(&[SeqChunk::new(SeqId(1), 12, vec![5, 6], Wanted::All)])
            .unwrap();
        let mut seq = ctx.clone();
        seq.extend([4, 5, 7].map(|n| t.tokens[n]));
        seq.push(5);
        assert_eq!(l.row(0), &linear_last(&m, &seq)[..], "{mode:?} after keep");
        seq.push(6);
        assert_eq!(l.row(1), &linear_last(&m, &seq)[..], "{mode:?} after keep");
    }
}

#[test]
fn a_tree_grows_across_forwards_as_a_drafter_grows_it() {
    let m = model(GgmlDType::Q4_0, WeightMode::Native);
    let v = m.cfg.vocab;
    let main = tokens(3, 12, v);
    let mut e = engine(&m);
    // The main path, linear, 12 slots; then a branch from slot 7 (a sibling of slot 8), one node
    // per forward, as a drafter draws it; then the main path continues as tree nodes.
    e.forward(&[SeqChunk::new(SeqId(0), 0, main.clone(), Wanted::None)])
        .unwrap();
    let branch = [11u32, 12, 13];
    let mut parent = 7;
    for (i, &b) in branch.iter().enumerate() {
        let slot = 12 + i;
        let l = e
            .forward(&[SeqChunk::tree(
                SeqId(0),
                slot,
                vec![b],
                vec![Parent::Slot(parent)],
                Wanted::Last,
            )])
            .unwrap();
        let mut seq = main[..8].to_vec();
        seq.extend_from_slice(&branch[..=i]);
        assert_eq!(l.rows[0].pos, 8 + i);
        assert_eq!(l.row(0), &linear_last(&m, &seq)[..], "branch node {i}");
        parent = slot;
    }
    let l = e
        .forward(&[SeqChunk::tree(
            SeqId(0),
            15,
            vec![9],
            vec![Parent::Slot(11)],
            Wanted::Last,
        )])
        .unwrap();
    let mut seq = main.clone();
    seq.push(9);
    assert_eq!(
        l.row(0),
        &linear_last(&m, &seq)[..],
        "the main path goes on"
    );
    // A linear token cannot follow tree nodes; a parent must come before its slot; a kept path
    // must be a chain.
    let e1 = e
        .forward(&[SeqChunk::new(SeqId(0), 16, vec![1], Wanted::Last)])
        .unwrap_err();
    assert!(e1.to_string().contains("after tree nodes"), "{e1}");
    let e2 = e
        .forward(&[SeqChunk::tree(
            SeqId(0),
            16,
            vec![1],
            vec![Parent::Slot(16)],
            Wanted::Last,
        )])
        .unwrap_err();
    assert!(e2.to_string().contains("not before its slot 16"), "{e2}");
    let e3 = e.keep_path(SeqId(0), 8, &[12, 14]).unwrap_err();
    assert!(e3.to_string().contains("slot 14 is not the child"), "{e3}");
    assert_eq!(e.seq_len(SeqId(0)), 16, "a refused keep changes nothing");
    // Truncating into the tail keeps its nodes before the cut; keeping the branch works.
    e.truncate(SeqId(0), 15).unwrap();
    assert!(e.has_tree(SeqId(0)));
    e.keep_path(SeqId(0), 8, &[12, 13, 14]).unwrap();
    let l = e
        .forward(&[SeqChunk::new(SeqId(0), 11, vec![4], Wanted::Last)])
        .unwrap();
    let mut seq = main[..8].to_vec();
    seq.extend_from_slice(&branch);
    seq.push(4);
    assert_eq!(l.row(0), &linear_last(&m, &seq)[..]);
    // Truncating below the tail makes the sequence linear.
    e.forward(&[SeqChunk::tree(
        SeqId(0),
        12,
        vec![1],
        vec![Parent::Slot(10)],
        Wanted::None,
    )])
    .unwrap();
    assert!(e.has_tree(SeqId(0)));
    e.truncate(SeqId(0), 12).unwrap();
    assert!(!e.has_tree(SeqId(0)));
}

#[test]
fn keeping_a_subtree_moves_it_down_and_its_nodes_grow_as_before() {
    for (arch, format) in TINY_FAMILIES
        .iter()
        .flat_map(|a| FORMATS.iter().map(move |f| (*a, *f)))
    {
        let mode = (arch, format.1);
        let (m, ctx, t, mut e) = setup(arch, format);
        e.forward(&[SeqChunk::new(SeqId(1), 0, ctx.clone(), Wanted::None)])
            .unwrap();
        e.forward(&[t.chunk(SeqId(1), 9)]).unwrap();
        // Node 4 is committed: keep it and its subtree (5, 7), dropping the main path and 6.
        // Node 4 continues the linear run (it becomes slot 9, linear); 5 and 7 stay a tree.
        e.keep_tree(SeqId(1), 9, &[9 + 4, 9 + 5, 9 + 7]).unwrap();
        assert_eq!(e.seq_len(SeqId(1)), 12);
        assert!(!e.has_tree(SeqId(1)), "4-5-7 is a chain: linear again");
        // Now a real subtree: keep 0-1 (linear) with 2 and 6 (siblings below 1), dropping 3 and
        // the side path 4-5-7.
        let mut e = engine(&m);
        e.forward(&[SeqChunk::new(SeqId(1), 0, ctx.clone(), Wanted::None)])
            .unwrap();
        e.forward(&[t.chunk(SeqId(1), 9)]).unwrap();
        e.keep_tree(SeqId(1), 9, &[9, 10, 11, 15]).unwrap();
        assert_eq!(e.seq_len(SeqId(1)), 13);
        assert!(e.has_tree(SeqId(1)), "2 and 6 are siblings");
        // Grow each kept leaf by a token: both are what a linear run of their path computes.
        let l = e
            .forward(&[SeqChunk::tree(
                SeqId(1),
                13,
                vec![3, 4],
                vec![Parent::Slot(11), Parent::Slot(12)],
                Wanted::All,
            )])
            .unwrap();
        for (row, (path, tok)) in [(&[0usize, 1, 2][..], 3u32), (&[0, 1, 6][..], 4)]
            .iter()
            .enumerate()
        {
            let mut seq = ctx.clone();
            seq.extend(path.iter().map(|&n| t.tokens[n]));
            seq.push(*tok);
            assert_eq!(
                l.row(row),
                &linear_last(&m, &seq)[..],
                "{mode:?} leaf {row}"
            );
        }
        // A node whose parent is dropped cannot be kept.
        let err = e.keep_tree(SeqId(1), 9, &[9, 13]).unwrap_err();
        assert!(err.to_string().contains("which is not kept"), "{err}");
    }
}

#[test]
fn a_scheduler_owned_tree_is_one_chunk_and_its_kept_path_moves_down() {
    let m = model(GgmlDType::F32, WeightMode::F32);
    let v = m.cfg.vocab;
    let ctx = tokens(4, 9, v);
    let t = tree(v);
    let mut e = engine(&m);
    let table: Vec<u32> = vec![5, 2, 7, 0, 9]; // 20 slots
    e.forward_paged(
        &[SeqChunk::new(SeqId(3), 0, ctx.clone(), Wanted::None)],
        std::slice::from_ref(&table),
    )
    .unwrap();
    let l = e
        .forward_paged(&[t.chunk(SeqId(3), 9)], std::slice::from_ref(&table))
        .unwrap();
    for (i, (_, logits)) in l.for_seq(SeqId(3)).enumerate() {
        let mut seq = ctx.clone();
        seq.extend(t.path(i).iter().map(|&n| t.tokens[n]));
        assert_eq!(logits, &linear_last(&m, &seq)[..], "node {i}");
    }
    // Keep 0-1-6 (the sibling of 2).
    e.keep_path_paged(&table, 9, &[9, 10, 15]).unwrap();
    let l = e
        .forward_paged(
            &[SeqChunk::new(SeqId(3), 12, vec![2], Wanted::Last)],
            std::slice::from_ref(&table),
        )
        .unwrap();
    let mut seq = ctx.clone();
    seq.extend([0, 1, 6].map(|n| t.tokens[n]));
    seq.push(2);
    assert_eq!(l.row(0), &linear_last(&m, &seq)[..]);
    let e1 = e.keep_path_paged(&table, 9, &[12, 11]).unwrap_err();
    assert!(e1.to_string().contains("not ascending"), "{e1}");
}
