//! The verifier's prefix cache on a tiny random model: a conversation's next turn starts from
//! the pages of the last one and generates exactly what a verifier without the cache does;
//! tenants never hit each other's pages unless they share a salt; and a speculation session whose
//! drafts are rejected right after a shared prefix leaves the other holder's output unchanged.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::Driver;
use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{Engine, EngineConfig, LlamaModel, WeightMode};
use tandem_sched::{shared_salt, SessionId, TenantConfig, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Next, Output, Pipeline, PipelineConfig, Shape, VerifyRule};
use tandem_verifier::{Inbound, Mode, NewSession, ToEdge, Usage, VerifierConfig, VerifierCore};

const PAGE: usize = 4;

fn model() -> Arc<LlamaModel> {
    let mut f = tiny_file(&TinySpec::default()).unwrap();
    Arc::new(LlamaModel::load(&mut f, WeightMode::F32).unwrap())
}

fn verifier(m: &Arc<LlamaModel>, pages: usize, cache: bool) -> Driver<Engine> {
    let bytes_per_page = 2 * m.cfg.n_layer * PAGE * m.cfg.kv_dim() * 4;
    let engine = Engine::new(
        m.clone(),
        EngineConfig {
            threads: 1,
            kv_budget_bytes: pages * bytes_per_page,
            kv_block_size: PAGE,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let cfg = VerifierConfig {
        token_budget: 32,
        no_prefix_cache: !cache,
        ..VerifierConfig::default()
    };
    Driver::new(VerifierCore::new(engine, cfg, 0).unwrap())
}

fn text(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7 + seed * 13 + 3) % 90)
        .collect()
}

/// A greedy cloud-only generation of `n` tokens for `prompt`, by `tenant`: its tokens and usage.
fn generate(
    d: &mut Driver<Engine>,
    id: u64,
    tenant: u32,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Usage) {
    d.core.receive(
        d.now_us,
        Inbound::Open {
            session: SessionId(id),
            new: NewSession {
                tenant: TenantId(tenant),
                prompt: prompt.to_vec(),
                params: SamplingParams::default(),
                max_tokens: n,
                eog: vec![],
                mode: Mode::Generate,
                grammar: None,
                logprobs: None,
                self_draft: false,
            },
            handle: (),
        },
    );
    let mut out = Vec::new();
    for _ in 0..1000 {
        let t = d.core.turn(d.now_us);
        for o in t.out {
            match o.msg {
                ToEdge::Token { token, .. } => out.push(token),
                ToEdge::Admitted { .. } => {}
                m => panic!("unexpected {m:?}"),
            }
        }
        if let Some(u) = t.finished.into_iter().find(|u| u.session == SessionId(id)) {
            return (out, u);
        }
    }
    panic!("generation {id} never finished");
}

#[test]
fn each_turn_of_a_conversation_starts_from_the_last_and_generates_what_a_fresh_verifier_does() {
    let m = model();
    let mut cached = verifier(&m, 64, true);
    let mut fresh = verifier(&m, 64, false);
    let mut history = text(1, 10);
    for turn in 0..6u64 {
        let (got, usage) = generate(&mut cached, turn, 0, &history, 8);
        let (want, plain) = generate(&mut fresh, turn, 0, &history, 8);
        assert_eq!(got, want, "turn {turn}");
        assert_eq!(plain.cached_tokens, 0);
        // Every full page of the last turn's prompt and answer (its last token's KV is never
        // computed: it was sampled, not fed), short of the page with the new prompt's last token.
        let reusable = if turn == 0 { 0 } else { usage.prompt_tokens };
        assert!(usage.cached_tokens <= reusable.saturating_sub(1));
        if turn > 0 {
            assert!(
                usage.cached_tokens + 2 * PAGE >= usage.prompt_tokens - 4,
                "turn {turn}: {} of {} prompt tokens cached",
                usage.cached_tokens,
                usage.prompt_tokens
            );
        }
        // The next turn: the answer, then the user's next message.
        history.extend(&got);
        history.extend(text(10 + turn as u32, 4));
    }
    let s = cached.core.scheduler().stats();
    assert!(s.prefix_hits > 0 && s.prefix_hits < s.prefix_queries);
    assert!(cached.core.scheduler().pool().conserved());
}

#[test]
fn tenants_never_hit_each_others_pages_unless_they_share_a_salt() {
    let m = model();
    let mut d = verifier(&m, 64, true);
    let public = TenantConfig {
        cache_salt: Some(shared_salt("public")),
        ..TenantConfig::default()
    };
    d.core
        .set_tenant(TenantId(1), TenantConfig::default())
        .unwrap();
    d.core.set_tenant(TenantId(2), public).unwrap();
    d.core.set_tenant(TenantId(3), public).unwrap();
    let prompt = text(4, 21);
    let (first, u) = generate(&mut d, 1, 0, &prompt, 4);
    assert_eq!(u.cached_tokens, 0);
    // Its own tenant hits the five pages before the last token's.
    assert_eq!(generate(&mut d, 2, 0, &prompt, 4).1.cached_tokens, 20);
    // Another tenant does not, nor does one with a shared salt, at first.
    let (other, u) = generate(&mut d, 3, 1, &prompt, 4);
    assert_eq!((u.cached_tokens, &other), (0, &first));
    assert_eq!(generate(&mut d, 4, 2, &prompt, 4).1.cached_tokens, 0);
    // Tenants sharing a salt hit each other's pages.
    let (shared, u) = generate(&mut d, 5, 3, &prompt, 4);
    assert_eq!((u.cached_tokens, &shared), (20, &first));
}

/// The edge's token at output position `k`: the target's, or always a wrong one.
fn drafted(want: &[u32], k: usize, wrong: bool) -> u32 {
    let t = want.get(k).copied().unwrap_or(0);
    if wrong {
        (t + 1) % 90
    } else {
        t
    }
}

#[test]
fn a_session_rolled_back_after_a_shared_prefix_leaves_the_other_holders_output_unchanged() {
    let m = model();
    let prompt = text(5, 18);
    let n = 16;
    let (want, _) = generate(&mut verifier(&m, 64, false), 0, 0, &prompt, n);
    let mut d = verifier(&m, 64, true);
    // Session 0 opens and is prefilled; session 1 opens on the same prompt and holds its first
    // four pages too. Session 0 drafts right, session 1 always wrong: every one of its blocks
    // is rejected at its first draft token, rolling it back to just past the shared pages at
    // first.
    let cfg = PipelineConfig {
        draft_len: 3,
        depth: 1,
        max_new_tokens: n,
    };
    let mut edges: HashMap<u64, Pipeline> = HashMap::new();
    let mut cached = HashMap::new();
    let open = |d: &mut Driver<Engine>, i: u64| {
        d.core.receive(
            d.now_us,
            Inbound::Open {
                session: SessionId(i),
                new: NewSession {
                    tenant: TenantId(0),
                    prompt: prompt.clone(),
                    params: SamplingParams::default(),
                    max_tokens: n,
                    eog: vec![],
                    mode: Mode::Speculate {
                        rule: VerifyRule::Greedy,
                        want: Shape::UNLIMITED,
                    },
                    grammar: None,
                    logprobs: None,
                    self_draft: false,
                },
                handle: (),
            },
        )
    };
    open(&mut d, 0);
    for clock in 0..2_000u64 {
        d.now_us = clock * 10_000;
        if clock == 2 {
            open(&mut d, 1);
        }
        for (&i, p) in edges.iter_mut() {
            while p.next() == Next::Draft {
                let k = p.tokens().len() - prompt.len();
                for o in p.on_drafted(drafted(&want, k, i == 1), None) {
                    if let Output::Send(b) = o {
                        d.core.receive(
                            d.now_us,
                            Inbound::Draft {
                                session: SessionId(i),
                                block: b,
                            },
                        );
                    }
                }
            }
        }
        let done = edges.len() == 2 && edges.values().all(|p| p.next() == Next::Done);
        if done {
            break;
        }
        for (session, msg) in d.turn() {
            let i = session.0;
            let got = match msg {
                ToEdge::Opened {
                    first, cached: c, ..
                } => {
                    cached.insert(i, c);
                    let p = Pipeline::with_first(prompt.clone(), first, cfg, vec![]).unwrap();
                    edges.insert(i, p.0);
                    Ok(Vec::new())
                }
                ToEdge::Admitted { .. } => Ok(Vec::new()),
                ToEdge::Verdict(v) => edges.get_mut(&i).unwrap().on_verdict(v),
                ToEdge::Decoded(dec) => edges.get_mut(&i).unwrap().on_decoded(dec),
                other => panic!("unexpected {other:?}"),
            };
            for o in got.unwrap() {
                if let Output::Send(b) = o {
                    d.core.receive(
                        d.now_us,
                        Inbound::Draft {
                            session: SessionId(i),
                            block: b,
                        },
                    );
                }
            }
        }
    }
    assert_eq!(cached[&0], 0);
    assert_eq!(
        cached[&1], 16,
        "session 1 holds session 0's four prompt pages"
    );
    assert_eq!(edges[&0].output(), &want[..], "the session drafting right");
    assert_eq!(edges[&1].output(), &want[..], "the session rolled back");
    assert!(d.core.scheduler().pool().conserved());
}
