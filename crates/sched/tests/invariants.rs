//! Under any sequence of opens, verify blocks, verdicts (with any truncation) and closes, the
//! scheduler never exceeds the token budget or the block pool, keeps every block owned once, gives
//! each chunk a block table that holds it, and never loses a session's known tokens.

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tandem_sched::{
    shared_salt, Batch, SchedConfig, Scheduler, SessionId, TenantConfig, TenantId, WorkKind,
};

#[derive(Debug, Clone)]
enum Op {
    Open { tenant: u32, prompt: usize },
    Verify { session: usize, len: usize },
    Step { reject: Vec<usize> },
    Close { session: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1u32..4, 1usize..60).prop_map(|(tenant, prompt)| Op::Open { tenant, prompt }),
        4 => (0usize..12, 1usize..9).prop_map(|(session, len)| Op::Verify { session, len }),
        5 => proptest::collection::vec(0usize..9, 0..12).prop_map(|reject| Op::Step { reject }),
        1 => (0usize..12).prop_map(|session| Op::Close { session }),
    ]
}

/// One iteration at `now_ms` with the shell's verdicts (the `reject[i]`-th verify chunk loses
/// that many positions), checked before and after: the budget, the pool, one chunk per session,
/// block tables that hold each chunk, chunks within what is known, and no session holding more
/// blocks than its known tokens need.
fn step(
    s: &mut Scheduler,
    now_ms: u64,
    reject: &[usize],
    known: &mut BTreeMap<SessionId, usize>,
    open: &[SessionId],
) -> Result<Batch, TestCaseError> {
    let (budget, block_size) = (s.config().token_budget, s.pool().page_size());
    let p = s.schedule(now_ms * 1000);
    prop_assert!(p.tokens() <= budget, "{} > {budget}", p.tokens());
    prop_assert!(s.pool().conserved());
    let mut seen = std::collections::BTreeSet::new();
    for c in &p.chunks {
        prop_assert!(seen.insert(c.session), "one chunk per session");
        prop_assert!(c.len > 0);
        prop_assert!(c.pages.len() * block_size >= c.start + c.len);
        if c.kind == WorkKind::Prefill {
            prop_assert!(c.start + c.len <= known[&c.session]);
        } else {
            prop_assert_eq!(c.start, known[&c.session]);
        }
    }
    // Verdicts: each verify chunk keeps `len - r` of its positions (r rejected).
    let kv: Vec<(SessionId, usize)> = p
        .chunks
        .iter()
        .filter(|c| c.kind == WorkKind::Decode)
        .enumerate()
        .map(|(i, c)| {
            let r = reject.get(i).copied().unwrap_or(0).min(c.len - 1);
            (c.session, c.start + c.len - r)
        })
        .collect();
    s.update(&p, &kv);
    for &(id, k) in &kv {
        known.insert(id, k);
    }
    prop_assert!(s.pool().conserved());
    for &id in open {
        prop_assert!(s.pool().held(id) <= s.pool().pages_for(known[&id]));
    }
    Ok(p)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn budget_pool_and_tables_hold(
        budget in 8usize..40,
        block_size in 1usize..9,
        num_blocks in 4usize..40,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut s = Scheduler::new(SchedConfig::new(budget, block_size, num_blocks)).unwrap();
        for t in 1..4 {
            s.set_tenant(TenantId(t), TenantConfig::weight(t as f64)).unwrap();
        }
        let mut open: Vec<SessionId> = Vec::new();
        // What the shell knows of each session: tokens known to the cloud after the last verdict.
        let mut known: BTreeMap<SessionId, usize> = BTreeMap::new();
        let mut next_id = 0u64;
        for o in ops {
            match o {
                Op::Open { tenant, prompt } => {
                    if s.open(SessionId(next_id), TenantId(tenant), &vec![1; prompt]).is_ok() {
                        open.push(SessionId(next_id));
                        known.insert(SessionId(next_id), prompt);
                    }
                    next_id += 1;
                }
                Op::Verify { session, len } => {
                    if let Some(&id) = open.get(session) {
                        let _ = s.enqueue_verify(id, len.min(budget));
                    }
                }
                Op::Close { session } => {
                    if session < open.len() {
                        let id = open.remove(session);
                        s.close(id);
                        known.remove(&id);
                    }
                }
                Op::Step { reject } => {
                    step(&mut s, 0, &reject, &mut known, &open)?;
                }
            }
        }
        for id in open {
            s.close(id);
        }
        prop_assert_eq!(s.pool().num_free(), num_blocks);
    }
}

#[derive(Debug, Clone)]
enum TimedOp {
    Op(Op),
    /// The shell's clock moves on.
    Advance {
        ms: u64,
    },
}

fn timed_op() -> impl Strategy<Value = TimedOp> {
    prop_oneof![
        6 => op().prop_map(TimedOp::Op),
        2 => (0u64..400).prop_map(|ms| TimedOp::Advance { ms }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    /// With the clock moving: a tenant's rate quota bounds what is computed for it (one second of
    /// burst, at most one plan's overdraft), idle sessions are evicted and recomputed without
    /// losing a known token, and the budget, pool and tables hold as before.
    #[test]
    fn rate_quotas_and_idle_eviction_hold_as_the_clock_moves(
        budget in 8usize..40,
        block_size in 1usize..9,
        num_blocks in 4usize..40,
        rate in 20.0f64..300.0,
        idle_evict_ms in 1u64..600,
        ops in proptest::collection::vec(timed_op(), 1..160),
    ) {
        let cfg = SchedConfig {
            idle_evict_ms,
            ..SchedConfig::new(budget, block_size, num_blocks)
        };
        let mut s = Scheduler::new(cfg).unwrap();
        s.set_tenant(TenantId(1), TenantConfig { tokens_per_s: Some(rate), ..TenantConfig::weight(1.0) }).unwrap();
        s.set_tenant(TenantId(2), TenantConfig::weight(2.0)).unwrap();
        s.set_tenant(TenantId(3), TenantConfig::weight(1.0)).unwrap();
        let (mut now, mut rated) = (0u64, 0usize);
        let mut open: Vec<SessionId> = Vec::new();
        let mut tenant_of: BTreeMap<SessionId, u32> = BTreeMap::new();
        let mut known: BTreeMap<SessionId, usize> = BTreeMap::new();
        let mut next_id = 0u64;
        for o in ops {
            match o {
                TimedOp::Advance { ms } => now += ms,
                TimedOp::Op(Op::Open { tenant, prompt }) => {
                    if s.open(SessionId(next_id), TenantId(tenant), &vec![1; prompt]).is_ok() {
                        open.push(SessionId(next_id));
                        known.insert(SessionId(next_id), prompt);
                        tenant_of.insert(SessionId(next_id), tenant);
                    }
                    next_id += 1;
                }
                TimedOp::Op(Op::Verify { session, len }) => {
                    if let Some(&id) = open.get(session) {
                        let _ = s.enqueue_verify(id, len.min(budget));
                    }
                }
                TimedOp::Op(Op::Close { session }) => {
                    if session < open.len() {
                        let id = open.remove(session);
                        s.close(id);
                        known.remove(&id);
                    }
                }
                TimedOp::Op(Op::Step { reject }) => {
                    let p = step(&mut s, now, &reject, &mut known, &open)?;
                    rated += p
                        .chunks
                        .iter()
                        .filter(|c| tenant_of[&c.session] == 1)
                        .map(|c| c.len)
                        .sum::<usize>();
                    let budget = s.config().token_budget;
                    let burst = rate.max(budget as f64);
                    let allowed = burst + rate * now as f64 / 1000.0 + budget as f64;
                    prop_assert!(
                        rated as f64 <= allowed,
                        "{rated} positions for a tenant of {rate}/s by {now} ms (at most {allowed})"
                    );
                }
            }
        }
        for id in open {
            s.close(id);
        }
        prop_assert_eq!(s.pool().num_free(), num_blocks);
    }
}

#[derive(Debug, Clone)]
enum CacheOp {
    /// A prompt: the first `shared` tokens of family `family`'s text, then `own` tokens of its own.
    Open {
        tenant: u32,
        family: u32,
        shared: usize,
        own: usize,
    },
    Op(Op),
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    prop_oneof![
        3 => (1u32..4, 0u32..2, 1usize..50, 0usize..12).prop_map(|(tenant, family, shared, own)| {
            CacheOp::Open { tenant, family, shared, own }
        }),
        6 => op().prop_filter("opens are CacheOp::Open", |o| !matches!(o, Op::Open { .. }))
            .prop_map(CacheOp::Op),
    ]
}

/// What a model's KV slot holds after `seq`: a digest of the whole sequence up to each position
/// (a real K and V depend on every token before theirs, not only their own).
fn states(seq: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    seq.iter()
        .map(|&t| {
            h = (h ^ u64::from(t) ^ 0x100).wrapping_mul(0x0100_0000_01b3);
            h
        })
        .collect()
}

/// A token of family `f`'s text at `i`; a session's own tokens and drafts are made by `mix`.
fn mix(a: u64, b: u64, c: u64) -> u32 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ c;
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x >> 40) as u32 % 7
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    /// The prefix cache never corrupts a session's KV. The test plays the engine: every chunk
    /// writes its tokens into the slots of its page table, and after every iteration each
    /// session's computed positions must hold its own tokens, whoever computed them. Prompts
    /// share prefixes (tenants 2 and 3 share a salt), drafts are rejected anywhere, sessions are
    /// preempted and closed; the pool stays conserved, and at the end every page is free or
    /// cached.
    #[test]
    fn the_prefix_cache_never_corrupts_a_session(
        budget in 8usize..40,
        block_size in 1usize..9,
        num_blocks in 4usize..40,
        ops in proptest::collection::vec(cache_op(), 1..140),
    ) {
        let cfg = SchedConfig { prefix_cache: true, ..SchedConfig::new(budget, block_size, num_blocks) };
        let mut s = Scheduler::new(cfg).unwrap();
        s.set_tenant(TenantId(1), TenantConfig::weight(1.0)).unwrap();
        let public = TenantConfig { cache_salt: Some(shared_salt("public")), ..TenantConfig::weight(2.0) };
        s.set_tenant(TenantId(2), public).unwrap();
        s.set_tenant(TenantId(3), public).unwrap();
        // The KV memory: each page's slots, as the last chunk written to them left them.
        let mut kv: Vec<Vec<Option<u64>>> = vec![vec![None; block_size]; num_blocks];
        // Each open session's tokens (prompt, then what it committed).
        let mut tokens: BTreeMap<SessionId, Vec<u32>> = BTreeMap::new();
        let mut open: Vec<SessionId> = Vec::new();
        let (mut next_id, mut it) = (0u64, 0u64);
        let mut hits = 0usize;
        // Sessions whose prompt's last token was computed (the first token is due), and the
        // prompt length of the others.
        let mut first: std::collections::BTreeSet<SessionId> = Default::default();
        let mut prompt_len: BTreeMap<SessionId, usize> = BTreeMap::new();
        for o in ops {
            match o {
                CacheOp::Open { tenant, family, shared, own } => {
                    let id = SessionId(next_id);
                    next_id += 1;
                    let prompt: Vec<u32> = (0..shared)
                        .map(|i| mix(u64::from(family), i as u64, 1))
                        .chain((0..own).map(|i| mix(id.0, i as u64, 2) + 7))
                        .collect();
                    if let Ok(cached) = s.open(id, TenantId(tenant), &prompt) {
                        prop_assert!(cached < prompt.len(), "the last prompt token is computed");
                        prop_assert_eq!(s.session_kv(id), Some((prompt.len(), cached)));
                        hits += cached;
                        prompt_len.insert(id, prompt.len());
                        open.push(id);
                        tokens.insert(id, prompt);
                    }
                }
                CacheOp::Op(Op::Verify { session, len }) => {
                    if let Some(&id) = open.get(session) {
                        let _ = s.enqueue_verify(id, len.min(budget));
                    }
                }
                CacheOp::Op(Op::Close { session }) => {
                    if session < open.len() {
                        let id = open.remove(session);
                        s.close(id);
                        tokens.remove(&id);
                    }
                }
                CacheOp::Op(Op::Open { .. }) => {}
                CacheOp::Op(Op::Step { reject }) => {
                    it += 1;
                    let p = s.schedule(0);
                    prop_assert!(s.pool().conserved());
                    let mut verdicts = Vec::new();
                    let mut decodes = 0;
                    for c in &p.chunks {
                        if c.kind == WorkKind::Prefill && c.start + c.len == prompt_len[&c.session] {
                            first.insert(c.session);
                        }
                        let t = tokens.get_mut(&c.session).expect("planned sessions are open");
                        let written: Vec<u32> = match c.kind {
                            WorkKind::Prefill => t[c.start..c.start + c.len].to_vec(),
                            WorkKind::Decode => (0..c.len)
                                .map(|i| mix(c.session.0, (c.start + i) as u64, it))
                                .collect(),
                        };
                        let mut seq = t[..c.start].to_vec();
                        seq.extend_from_slice(&written);
                        let st = states(&seq);
                        for pos in c.start..c.start + c.len {
                            kv[c.pages[pos / block_size] as usize][pos % block_size] = Some(st[pos]);
                        }
                        if c.kind == WorkKind::Decode {
                            let r = reject.get(decodes).copied().unwrap_or(0).min(c.len - 1);
                            decodes += 1;
                            let keep = c.len - r;
                            t.truncate(c.start);
                            t.extend_from_slice(&written[..keep]);
                            verdicts.push((c.session, c.start + keep));
                        }
                    }
                    s.update(&p, &verdicts);
                    for (&id, t) in &tokens {
                        s.publish(id, t);
                    }
                    prop_assert!(s.pool().conserved());
                    for (&id, t) in &tokens {
                        let (known, computed) = s.session_kv(id).expect("open");
                        prop_assert_eq!(known, t.len());
                        let table = s.pool().table(id);
                        for (pos, &st) in states(t).iter().enumerate().take(computed) {
                            let slot = kv[table[pos / block_size] as usize][pos % block_size];
                            prop_assert_eq!(slot, Some(st), "session {} position {}", id, pos);
                        }
                    }
                }
            }
        }
        prop_assert!(u64::try_from(hits).unwrap() == s.stats().prefix_hits);
        // No prompt is lost: its last token was computed, or it still waits for it.
        for &id in &open {
            let (known, computed) = s.session_kv(id).expect("open");
            prop_assert!(first.contains(&id) || computed < known, "session {} is stuck", id);
        }
        for id in open {
            s.close(id);
        }
        prop_assert_eq!(s.pool().num_free(), num_blocks);
        prop_assert!(s.pool().conserved());
    }
}
