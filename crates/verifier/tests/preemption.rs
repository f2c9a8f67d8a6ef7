//! The verifier under KV pressure, on a tiny random model: sessions whose KV is dropped to make room
//! are recomputed from their committed tokens and produce exactly what they produce alone — for
//! cloud-only generations and for speculation sessions alike.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{Engine, EngineConfig, LlamaModel, WeightMode};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, VerifyRule};
use tandem_verifier::{Event, VerifierConfig, VerifierCore};

const BLOCK: usize = 4;

fn model() -> Arc<LlamaModel> {
    let mut f = tiny_file(&TinySpec::default()).unwrap();
    Arc::new(LlamaModel::load(&mut f, WeightMode::F32).unwrap())
}

/// A verifier whose KV pool holds `blocks` blocks of 4 tokens.
fn verifier(m: &Arc<LlamaModel>, blocks: usize, token_budget: usize) -> VerifierCore {
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
    assert_eq!(engine.kv().tables.num_blocks(), blocks);
    let cfg = VerifierConfig {
        token_budget,
        ..VerifierConfig::default()
    };
    VerifierCore::new(engine, cfg).unwrap()
}

fn prompt(i: u64) -> Vec<u32> {
    (0..10)
        .map(|j| ((i * 31 + j * 7 + 3) % 90) as u32)
        .collect()
}

/// Greedy cloud-only generations of `n` tokens for prompts 0..k, all at once.
fn generate(v: &mut VerifierCore, k: u64, n: usize) -> HashMap<u64, Vec<u32>> {
    for i in 0..k {
        v.open_generation(
            SessionId(i),
            TenantId(0),
            &prompt(i),
            SamplingParams::default(),
            n,
            vec![],
        )
        .unwrap();
    }
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    for e in v.run_until_idle(0) {
        match e {
            Event::Token { session, token, .. } => out.entry(session.0).or_default().push(token),
            Event::Preempted { .. } => {}
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
        let mut v = verifier(&m, 64, 64);
        want.extend(
            generate(&mut v, i + 1, 20)
                .into_iter()
                .filter(|(s, _)| *s == i),
        );
    }
    // Three at once in a pool that holds 30 of the 90 tokens they need.
    let mut v = verifier(&m, 12, 64);
    let got = generate(&mut v, 3, 20);
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

/// A synchronous edge that drafts the target's own continuation, except at the positions it is
/// told to get wrong; returns the committed tokens after the prompt.
struct Edge {
    session: u64,
    want: Vec<u32>,
    wrong_every: usize,
    committed: Vec<u32>,
    epoch: u64,
    index: u64,
    waiting: bool,
}

impl Edge {
    /// The block it drafts after what it has committed: up to 3 tokens, every `wrong_every`-th
    /// position wrong.
    fn drafted(&self) -> Vec<u32> {
        let at = self.committed.len();
        (at..(at + 3).min(self.want.len()))
            .map(|p| {
                if (p + self.session as usize).is_multiple_of(self.wrong_every) {
                    (self.want[p] + 1) % 90
                } else {
                    self.want[p]
                }
            })
            .collect()
    }

    fn block(&mut self, prompt_len: usize) -> Option<Block> {
        if self.waiting || self.committed.len() >= self.want.len() {
            return None;
        }
        let at = self.committed.len();
        let tokens = self.drafted();
        self.waiting = true;
        self.index += 1;
        Some(Block {
            epoch: self.epoch,
            index: tandem_spec::BlockId(self.index),
            start_pos: prompt_len + at,
            tokens,
            q: vec![],
        })
    }
}

#[test]
fn preempted_speculation_sessions_resume_identically() {
    let m = model();
    let n = 24;
    let mut reference = verifier(&m, 64, 64);
    let want = generate(&mut reference, 4, n);
    // Four sessions of 10 + 24 tokens in a pool of 14 blocks (56 token slots).
    let mut v = verifier(&m, 14, 32);
    let mut edges: Vec<Edge> = (0..4)
        .map(|i| Edge {
            session: i,
            want: want[&i].clone(),
            wrong_every: 3 + i as usize,
            committed: Vec::new(),
            epoch: 0,
            index: 0,
            waiting: true,
        })
        .collect();
    for i in 0..4 {
        v.open(
            SessionId(i),
            TenantId(0),
            &prompt(i),
            SamplingParams::default(),
            VerifyRule::Greedy,
            n,
            vec![],
        )
        .unwrap();
    }
    let mut verdicts = 0;
    for clock in 0..10_000u64 {
        let mut events = Vec::new();
        for e in edges.iter_mut() {
            if let Some(b) = e.block(10) {
                events.extend(v.draft(SessionId(e.session), b));
            }
        }
        if !v.has_work() && events.is_empty() {
            println!("nothing to do at {clock}");
            break;
        }
        // 10 ms per iteration: an edge that is done goes idle and gives its KV away after 500 ms.
        events.extend(v.step(clock * 10));
        for ev in events {
            match ev {
                Event::Opened { session, first } => {
                    let e = &mut edges[session.0 as usize];
                    e.committed.push(first);
                    e.waiting = false;
                }
                Event::Verdict {
                    session, verdict, ..
                } => {
                    verdicts += 1;
                    let e = &mut edges[session.0 as usize];
                    let drafted = e.drafted();
                    e.committed
                        .extend_from_slice(&drafted[..verdict.accepted.min(drafted.len())]);
                    e.committed.push(verdict.token);
                    if verdict.accepted < drafted.len() {
                        e.epoch += 1;
                    }
                    e.waiting = false;
                }
                Event::Preempted { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    let s = v.scheduler().stats();
    println!(
        "{verdicts} verdicts, preemptions {}, {:?}",
        s.preemptions, v.stats
    );
    for e in &edges {
        println!(
            "edge {}: {} committed, waiting {}, {:?}",
            e.session,
            e.committed.len(),
            e.waiting,
            v.session(SessionId(e.session))
        );
    }
    assert!(s.preemptions > 0, "the pool must be too small for all four");
    for e in &edges {
        assert!(e.committed.len() >= n, "session {} stalled", e.session);
        assert_eq!(e.committed[..n], e.want[..], "session {}", e.session);
    }
}
