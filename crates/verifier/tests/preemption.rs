//! The verifier under KV pressure, on a tiny random model: sessions whose KV is dropped to make room
//! are recomputed from their committed tokens and produce exactly what they produce alone — for
//! cloud-only generations and for speculation sessions alike.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::Driver;
use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{Engine, EngineConfig, LlamaModel, WeightMode};
use tandem_sched::SessionId;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Next, Output, Pipeline, PipelineConfig, VerifyRule};
use tandem_verifier::{ToEdge, VerifierConfig, VerifierCore};

const BLOCK: usize = 4;

fn model() -> Arc<LlamaModel> {
    let mut f = tiny_file(&TinySpec::default()).unwrap();
    Arc::new(LlamaModel::load(&mut f, WeightMode::F32).unwrap())
}

/// A verifier whose KV pool holds `blocks` blocks of 4 tokens.
fn verifier(m: &Arc<LlamaModel>, blocks: usize, token_budget: usize) -> Driver<Engine> {
    let bytes_per_block = 2 * m.cfg.n_layer * BLOCK * m.cfg.kv_dim() * 4;
    let engine = Engine::new(
        m.clone(),
        EngineConfig {
            threads: 1,
            kv_budget_bytes: blocks * bytes_per_block,
            kv_block_size: BLOCK,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_eq!(engine.kv().tables.num_pages(), blocks);
    let cfg = VerifierConfig {
        token_budget,
        ..VerifierConfig::default()
    };
    Driver::new(VerifierCore::new(engine, cfg, 0).unwrap())
}

fn prompt(i: u64) -> Vec<u32> {
    (0..10)
        .map(|j| ((i * 31 + j * 7 + 3) % 90) as u32)
        .collect()
}

/// Greedy cloud-only generations of `n` tokens for prompts 0..k, all at once.
fn generate(d: &mut Driver<Engine>, k: u64, n: usize) -> HashMap<u64, Vec<u32>> {
    for i in 0..k {
        d.open_generation(SessionId(i), &prompt(i), SamplingParams::default(), n);
    }
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    for (session, m) in d.run_until_idle() {
        match m {
            ToEdge::Token { token, .. } => out.entry(session.0).or_default().push(token),
            ToEdge::Admitted { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    out
}

#[test]
fn preempted_generations_resume_identically() {
    let m = model();
    // Alone, with room to spare.
    let mut want = HashMap::new();
    for i in 0..3 {
        let mut d = verifier(&m, 64, 64);
        want.extend(
            generate(&mut d, i + 1, 20)
                .into_iter()
                .filter(|(s, _)| *s == i),
        );
    }
    // Three at once in a pool that holds 30 of the 90 tokens they need.
    let mut d = verifier(&m, 12, 64);
    let got = generate(&mut d, 3, 20);
    let v = &d.core;
    let s = v.scheduler().stats();
    println!(
        "preemptions {}, recomputed tokens {}",
        s.preemptions, v.stats.recomputed_tokens
    );
    assert!(s.preemptions > 0 && v.stats.recomputed_tokens > 0);
    assert_eq!(got, want);
    assert!(v.scheduler().pool().conserved());
    assert_eq!(v.scheduler().pool().num_free(), 12);
}

/// The edge's token at output position `k` of session `i`: the target's, except every
/// `wrong_every`-th.
fn drafted(want: &[u32], i: u64, k: usize, wrong_every: usize) -> u32 {
    let t = want.get(k).copied().unwrap_or(0);
    if (k + i as usize).is_multiple_of(wrong_every) {
        (t + 1) % 90
    } else {
        t
    }
}

#[test]
fn preempted_speculation_sessions_resume_identically() {
    let m = model();
    let n = 24;
    let mut reference = verifier(&m, 64, 64);
    let want = generate(&mut reference, 4, n);
    // Four sessions of 10 + 24 tokens in a pool of 14 blocks (56 token slots), each driven by the
    // real edge pipeline: blocks of 3, one in flight, drafts wrong every few positions.
    let mut d = verifier(&m, 14, 32);
    let mut edges: Vec<Option<Pipeline>> = (0..4).map(|_| None).collect();
    for i in 0..4 {
        d.open(
            SessionId(i),
            &prompt(i),
            SamplingParams::default(),
            VerifyRule::Greedy,
            n,
        );
    }
    let cfg = PipelineConfig {
        draft_len: 3,
        depth: 1,
        max_new_tokens: n,
    };
    let (mut verdicts, mut decoded) = (0, 0);
    for clock in 0..10_000u64 {
        // 10 ms per iteration: an edge that is done goes idle and gives its KV away after 500 ms.
        d.now_us = clock * 10_000;
        for (i, e) in edges.iter_mut().enumerate() {
            let Some(p) = e.as_mut() else { continue };
            while p.next() == Next::Draft {
                let k = p.tokens().len() - 10;
                let t = drafted(&want[&(i as u64)], i as u64, k, 3 + i);
                for o in p.on_drafted(t, None) {
                    if let Output::Send(b) = o {
                        d.draft(SessionId(i as u64), b);
                    }
                }
            }
            if p.next() == Next::Done {
                d.close(SessionId(i as u64));
            }
        }
        // With no work, a turn sends only the answers to the blocks sent since the last one (a
        // refusal, which fails the test below: each block must be accepted as sent).
        let idle = !d.core.has_work();
        let sent = d.turn();
        if idle && sent.is_empty() {
            println!("nothing to do at {clock}");
            break;
        }
        for (session, msg) in sent {
            let i = session.0 as usize;
            let got = match msg {
                ToEdge::Opened { first, .. } => {
                    edges[i] = Some(
                        Pipeline::with_first(prompt(i as u64), first, cfg, vec![])
                            .unwrap()
                            .0,
                    );
                    Ok(Vec::new())
                }
                ToEdge::Admitted { .. } => Ok(Vec::new()),
                ToEdge::Verdict(verdict) => {
                    verdicts += 1;
                    edges[i].as_mut().unwrap().on_verdict(verdict)
                }
                ToEdge::Decoded(dec) => {
                    decoded += 1;
                    edges[i].as_mut().unwrap().on_decoded(dec)
                }
                other => panic!("unexpected {other:?}"),
            };
            for o in got.unwrap() {
                if let Output::Send(b) = o {
                    d.draft(SessionId(i as u64), b);
                }
            }
        }
    }
    let v = &d.core;
    let s = v.scheduler().stats();
    println!(
        "{verdicts} verdicts, {decoded} decoded, preemptions {}, {:?}",
        s.preemptions, v.stats
    );
    assert!(s.preemptions > 0, "the pool must be too small for all four");
    assert!(verdicts > 0, "blocks were verified");
    for (i, e) in edges.iter().enumerate() {
        let p = e.as_ref().expect("opened");
        assert_eq!(p.output(), &want[&(i as u64)][..], "session {i}");
    }
}
