//! Under any sequence of opens, verify blocks, verdicts (with any truncation) and closes, the
//! scheduler never exceeds the token budget or the block pool, keeps every block owned once, gives
//! each chunk a block table that holds it, and never loses a session's known tokens.

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tandem_sched::{Batch, SchedConfig, Scheduler, SessionId, TenantConfig, TenantId, WorkKind};

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
                    if s.open(SessionId(next_id), TenantId(tenant), prompt).is_ok() {
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
                    if s.open(SessionId(next_id), TenantId(tenant), prompt).is_ok() {
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
