use super::*;

/// A prompt of `n` tokens (the prefix cache is off in these tests).
fn prompt(n: usize) -> Vec<u32> {
    vec![1; n]
}

fn sched(budget: usize, blocks: usize) -> Scheduler {
    let mut s = Scheduler::new(SchedConfig {
        max_waiting_tokens: 10_000,
        ..SchedConfig::new(budget, 4, blocks)
    })
    .unwrap();
    s.set_tenant(TenantId(1), TenantConfig::weight(1.0))
        .unwrap();
    s.set_tenant(TenantId(2), TenantConfig::weight(3.0))
        .unwrap();
    s
}

#[test]
fn a_long_prefill_never_delays_a_verify() {
    let mut s = sched(16, 64);
    s.open(SessionId(1), TenantId(1), &prompt(200)).unwrap(); // a long prompt
    s.open(SessionId(2), TenantId(1), &prompt(4)).unwrap();
    // Prefill takes turns: session 2's short prompt is done by the second iteration.
    for _ in 0..2 {
        let p = s.schedule(0);
        s.update(&p, &[]);
    }
    assert_eq!(s.sessions[&SessionId(2)].computed, 4);
    assert!(s.sessions[&SessionId(1)].computed < 200);
    for _ in 0..5 {
        s.enqueue_verify(SessionId(2), 5).unwrap();
        let p = s.schedule(0);
        assert_eq!(p.chunks[0].session, SessionId(2), "{p:?}");
        assert_eq!(p.chunks[0].kind, WorkKind::Decode);
        assert!(p.tokens() <= 16);
        let kv = p.chunks[0].start + 3; // two positions rejected
        s.update(&p, &[(SessionId(2), kv)]);
    }
    assert_eq!(s.stats().max_verify_wait, 1);
    assert!(s.pool().conserved());
}

#[test]
fn weights_split_the_budget_under_saturation() {
    let mut s = sched(12, 1000);
    for id in 0..6u64 {
        s.open(
            SessionId(id),
            TenantId(if id < 3 { 1 } else { 2 }),
            &prompt(4),
        )
        .unwrap();
    }
    for _ in 0..400 {
        for id in (0..6u64).map(SessionId) {
            if s.sessions[&id].verifies.is_empty() {
                s.enqueue_verify(id, 4).unwrap();
            }
        }
        let p = s.schedule(0);
        let kv: Vec<_> = p
            .chunks
            .iter()
            .map(|c| (c.session, c.start + 1)) // everything but one position rejected
            .collect();
        s.update(&p, &kv);
    }
    let (a, b) = (
        s.tenant_positions(TenantId(1)) as f64,
        s.tenant_positions(TenantId(2)) as f64,
    );
    let share = b / (a + b);
    assert!((share - 0.75).abs() < 0.075, "{a} vs {b}");
}

#[test]
fn a_full_pool_preempts_the_least_recently_active_session() {
    // 4 blocks of 4 tokens: two sessions of 8 tokens fill it.
    let mut s = sched(32, 4);
    s.open(SessionId(1), TenantId(1), &prompt(8)).unwrap();
    s.open(SessionId(2), TenantId(1), &prompt(8)).unwrap();
    let p = s.schedule(0);
    s.update(&p, &[]);
    assert_eq!(s.pool().num_free(), 0);
    s.enqueue_verify(SessionId(2), 4).unwrap();
    let p = s.schedule(0);
    assert_eq!(p.preempted, vec![SessionId(1)]);
    assert_eq!(p.chunks.len(), 1);
    s.update(&p, &[(SessionId(2), 12)]);
    // Idle, session 1 costs nothing; once its edge sends a block it recomputes its 8 known
    // tokens (there is room again), then verifies.
    s.close(SessionId(2));
    assert!(!s.has_work());
    s.enqueue_verify(SessionId(1), 2).unwrap();
    let p = s.schedule(0);
    assert_eq!(
        (p.chunks[0].session, p.chunks[0].start, p.chunks[0].len),
        (SessionId(1), 0, 8)
    );
    assert_eq!(p.chunks[0].kind, WorkKind::Prefill);
    s.update(&p, &[]);
    assert_eq!(s.sessions[&SessionId(1)].computed, 8);
    let p = s.schedule(0);
    assert_eq!((p.chunks[0].kind, p.chunks[0].start), (WorkKind::Decode, 8));
    assert!(s.pool().conserved());
}

#[test]
fn admission_refuses_a_saturated_verifier_and_enforces_session_quotas() {
    let mut s = Scheduler::new(SchedConfig {
        max_sessions: 3,
        max_waiting_tokens: 20,
        ..SchedConfig::new(8, 4, 64)
    })
    .unwrap();
    // Tenant 1 weighs nearly all: its fair share is (about) the whole verifier, so the global
    // limits are what it meets here.
    s.set_tenant(TenantId(1), TenantConfig::weight(1000.0))
        .unwrap();
    let quota = TenantConfig {
        max_sessions: Some(1),
        ..TenantConfig::default()
    };
    s.set_tenant(TenantId(2), quota).unwrap();
    s.open(SessionId(1), TenantId(1), &prompt(16)).unwrap();
    // 16 tokens wait; 8 more would pass 20.
    let e = s.open(SessionId(2), TenantId(1), &prompt(8)).unwrap_err();
    assert!(
        matches!(
            e,
            SchedError::Saturated {
                retry_iterations: 1,
                ..
            }
        ),
        "{e}"
    );
    s.open(SessionId(2), TenantId(1), &prompt(4)).unwrap();
    let p = s.schedule(0);
    s.update(&p, &[]);
    s.open(SessionId(3), TenantId(2), &prompt(4)).unwrap();
    assert_eq!(
        s.open(SessionId(4), TenantId(2), &prompt(4)),
        Err(SchedError::QuotaExceeded {
            tenant: TenantId(2),
            what: "sessions",
            limit: 1
        })
    );
    for _ in 0..4 {
        let p = s.schedule(0);
        s.update(&p, &[]);
    }
    assert_eq!(s.waiting_tokens(), 0);
    assert!(matches!(
        s.open(SessionId(5), TenantId(1), &prompt(4)),
        Err(SchedError::Saturated { .. })
    ));
    assert_eq!(s.stats().refused, 3);
    s.close(SessionId(1));
    s.open(SessionId(5), TenantId(1), &prompt(4)).unwrap();
}

#[test]
fn a_tenant_over_its_kv_quota_preempts_only_its_own_sessions() {
    let mut s = sched(64, 64);
    let quota = TenantConfig {
        max_kv_blocks: Some(3),
        ..TenantConfig::default()
    };
    s.set_tenant(TenantId(2), quota).unwrap();
    s.open(SessionId(1), TenantId(1), &prompt(4)).unwrap(); // tenant 1: one block, the least recently active
    s.open(SessionId(2), TenantId(2), &prompt(4)).unwrap();
    s.open(SessionId(3), TenantId(2), &prompt(8)).unwrap(); // tenant 2: three blocks, its quota
    let p = s.schedule(0);
    s.update(&p, &[]);
    assert_eq!(s.tenant_blocks(TenantId(2)), 3);
    s.enqueue_verify(SessionId(3), 4).unwrap(); // needs a fourth block
    let p = s.schedule(0);
    assert_eq!(p.preempted, vec![SessionId(2)], "{p:?}");
    s.update(&p, &[(SessionId(3), 12)]);
    assert_eq!(s.tenant_blocks(TenantId(2)), 3);
    assert_eq!(s.pool().held(SessionId(1)), 1);
    // Session 2 cannot come back while session 3 holds the quota.
    let p = s.schedule(0);
    assert!(p.chunks.is_empty(), "{p:?}");
    assert!(s.pool().conserved());
}

#[test]
fn a_rate_quota_holds_a_tenant_to_its_tokens_per_second() {
    let mut s = sched(16, 1000);
    let quota = TenantConfig {
        tokens_per_s: Some(100.0),
        ..TenantConfig::default()
    };
    s.set_tenant(TenantId(2), quota).unwrap();
    s.open(SessionId(1), TenantId(1), &prompt(4)).unwrap();
    s.open(SessionId(2), TenantId(2), &prompt(4)).unwrap();
    // Ten simulated seconds, an iteration every 10 ms, both sessions always with a block.
    for i in 0..1000u64 {
        for id in [SessionId(1), SessionId(2)] {
            if s.sessions[&id].verifies.is_empty() && s.sessions[&id].computed > 0 {
                s.enqueue_verify(id, 4).unwrap();
            }
        }
        let p = s.schedule(i * 10_000);
        let kv: Vec<_> = p.chunks.iter().map(|c| (c.session, c.start + 1)).collect();
        s.update(&p, &kv);
    }
    // 100/s for 10 s, plus a first burst of one second and one block of overdraft.
    let limited = s.tenant_positions(TenantId(2));
    assert!((990..=100 * 11 + 4).contains(&limited), "{limited}");
    assert!(s.tenant_positions(TenantId(1)) > 3 * limited);
}

#[test]
fn an_idle_session_gives_its_kv_to_a_waiting_prompt() {
    // 4 blocks of 4 tokens; session 1 takes three and goes quiet.
    let mut s = sched(32, 4);
    s.open(SessionId(1), TenantId(1), &prompt(12)).unwrap();
    let p = s.schedule(0);
    s.update(&p, &[]);
    assert_eq!(s.pool().num_free(), 1);
    // (A session of the same tenant: another tenant's prompt would take the KV at once, as
    // tenant 1 holds more than its share of the pool.)
    s.open(SessionId(2), TenantId(1), &prompt(8)).unwrap();
    // Quiet for less than idle_evict_ms: the new prompt takes the free block and waits.
    let p = s.schedule(100_000);
    assert!(p.preempted.is_empty(), "{p:?}");
    assert_eq!((p.chunks[0].session, p.chunks[0].len), (SessionId(2), 4));
    s.update(&p, &[]);
    let p = s.schedule(600_000);
    assert_eq!(p.preempted, vec![SessionId(1)]);
    assert_eq!((p.chunks[0].session, p.chunks[0].start), (SessionId(2), 4));
    s.update(&p, &[]);
    // Session 1's edge sends a block: it recomputes when there is room, then verifies.
    s.enqueue_verify(SessionId(1), 2).unwrap();
    s.close(SessionId(2));
    let p = s.schedule(0);
    assert_eq!((p.chunks[0].session, p.chunks[0].len), (SessionId(1), 12));
    s.update(&p, &[]);
    let p = s.schedule(0);
    assert_eq!(p.chunks[0].kind, WorkKind::Decode);
    assert!(s.pool().conserved());
}

#[test]
fn a_block_that_could_never_fit_is_refused_and_a_failed_forward_computes_nothing() {
    // 4 blocks of 4 tokens: a session at 14 tokens can take 2 more, never 3.
    let mut s = sched(32, 4);
    s.open(SessionId(1), TenantId(1), &prompt(14)).unwrap();
    let p = s.schedule(0);
    assert_eq!((p.chunks[0].start, p.chunks[0].len), (0, 14));
    // The forward failed: nothing is computed and the same chunk is planned again.
    s.update(&p, &[(SessionId(1), 0)]);
    assert!(s.has_work());
    let again = s.schedule(0);
    assert_eq!(again.chunks, p.chunks);
    s.update(&again, &[]);
    assert!(matches!(
        s.enqueue_verify(SessionId(1), 3),
        Err(SchedError::CannotFit {
            tokens: 17,
            needed: 5,
            capacity: 4
        })
    ));
    s.enqueue_verify(SessionId(1), 2).unwrap();
    // A tenant quota caps it the same way, and a prompt past the quota is refused.
    let quota = TenantConfig {
        max_kv_blocks: Some(2),
        ..TenantConfig::default()
    };
    s.set_tenant(TenantId(2), quota).unwrap();
    assert!(matches!(
        s.open(SessionId(2), TenantId(2), &prompt(9)),
        Err(SchedError::QuotaExceeded { what, .. }) if what.starts_with("KV blocks")
    ));
    s.open(SessionId(2), TenantId(2), &prompt(8)).unwrap();
    assert!(matches!(
        s.enqueue_verify(SessionId(2), 1),
        Err(SchedError::CannotFit { .. })
    ));
    assert!(s.pool().conserved());
}

#[test]
fn refusals_name_the_problem() {
    let mut s = sched(8, 4);
    assert_eq!(
        s.open(SessionId(1), TenantId(9), &prompt(4)),
        Err(SchedError::UnknownTenant(TenantId(9)))
    );
    s.open(SessionId(1), TenantId(1), &prompt(4)).unwrap();
    assert_eq!(
        s.open(SessionId(1), TenantId(1), &prompt(4)),
        Err(SchedError::DuplicateSession(SessionId(1)))
    );
    assert!(matches!(
        s.enqueue_verify(SessionId(1), 9),
        Err(SchedError::BlockTooLarge { len: 9, budget: 8 })
    ));
    assert_eq!(
        s.enqueue_verify(SessionId(7), 1),
        Err(SchedError::UnknownSession(SessionId(7)))
    );
    assert!(matches!(
        s.open(SessionId(2), TenantId(1), &prompt(17)),
        Err(SchedError::PromptTooLarge { .. })
    ));
    assert!(s
        .set_tenant(TenantId(3), TenantConfig::weight(0.0))
        .is_err());
}

#[test]
fn the_evictor_is_billed_for_the_victims_recompute() {
    // 4 blocks of 4 tokens. Tenant 1's session fills half; tenant 2's fills the rest and then
    // needs room for a block: tenant 1's session is preempted. Its recompute of 8 tokens is
    // billed to tenant 2's fair share, which caused it (the compute itself is tenant 1's).
    // Equal weights: tenant 1 holds no more than its share of the pool (a tenant over its
    // share pays for its own recompute).
    let mut s = sched(32, 4);
    s.set_tenant(TenantId(1), TenantConfig::weight(3.0))
        .unwrap();
    s.open(SessionId(1), TenantId(1), &prompt(8)).unwrap();
    s.open(SessionId(2), TenantId(2), &prompt(8)).unwrap();
    let p = s.schedule(0);
    s.update(&p, &[]);
    assert_eq!(
        (s.tenant_billed(TenantId(1)), s.tenant_billed(TenantId(2))),
        (8, 8)
    );
    s.enqueue_verify(SessionId(2), 4).unwrap();
    let p = s.schedule(0);
    assert_eq!(p.preempted, vec![SessionId(1)]);
    s.update(&p, &[(SessionId(2), 12)]);
    s.close(SessionId(2));
    s.enqueue_verify(SessionId(1), 2).unwrap();
    let p = s.schedule(0);
    assert_eq!((p.chunks[0].kind, p.chunks[0].len), (WorkKind::Prefill, 8));
    s.update(&p, &[]);
    assert_eq!(
        s.tenant_billed(TenantId(1)),
        8,
        "the victim's share pays nothing for its recompute"
    );
    assert_eq!(
        s.tenant_billed(TenantId(2)),
        8 + 4 + 8,
        "the evictor's does"
    );
    assert_eq!(
        s.tenant_positions(TenantId(1)),
        16,
        "computed for the victim"
    );
    // Its own work after that is its own again.
    let p = s.schedule(0);
    assert_eq!(p.chunks[0].kind, WorkKind::Decode);
    s.update(&p, &[]);
    assert_eq!(s.tenant_billed(TenantId(1)), 8 + 2);
}

/// The forward of `p` ran: every verify chunk's tokens are in its KV.
fn update_verified(s: &mut Scheduler, p: &Batch) {
    let kv: Vec<_> = p
        .chunks
        .iter()
        .filter(|c| c.kind == WorkKind::Decode)
        .map(|c| (c.session, c.start + c.len))
        .collect();
    s.update(p, &kv);
}

/// Tenants 1 and 2 of weight 1 under `cfg`.
fn equal_tenants(cfg: SchedConfig) -> Scheduler {
    let mut s = Scheduler::new(cfg).unwrap();
    for t in [1, 2] {
        s.set_tenant(TenantId(t), TenantConfig::weight(1.0))
            .unwrap();
    }
    s
}

/// Two tenants of weight 1 under these global limits.
fn two_equal_tenants(max_sessions: usize, max_waiting_tokens: usize) -> Scheduler {
    equal_tenants(SchedConfig {
        max_sessions,
        max_waiting_tokens,
        ..SchedConfig::new(64, 4, 1024)
    })
}

#[test]
fn one_tenants_burst_leaves_the_others_their_share() {
    // Two tenants of equal weight, 8 sessions at most. Tenant 1 opens as many as it can: past
    // half of the limit it is held to its share (4), and tenant 2 still opens its 4.
    let mut s = two_equal_tenants(8, 10_000);
    let mut opened = 0;
    for i in 0..20 {
        if s.open(SessionId(i), TenantId(1), &prompt(4)).is_ok() {
            opened += 1;
        }
    }
    assert_eq!(opened, 4, "the burst is held to its share");
    for i in 100..104 {
        s.open(SessionId(i), TenantId(2), &prompt(4)).unwrap();
    }
    let e = s.open(SessionId(200), TenantId(2), &prompt(4)).unwrap_err();
    assert!(matches!(e, SchedError::Saturated { .. }), "{e}");

    // Waiting prompt tokens likewise: a tenant with its share of the queue waiting waits.
    let mut s = two_equal_tenants(100, 100);
    let mut queued = 0;
    for i in 0..20 {
        if s.open(SessionId(i), TenantId(1), &prompt(10)).is_ok() {
            queued += 10;
        }
    }
    assert_eq!(queued, 50, "half of the prefill queue");
    for i in 100..105 {
        s.open(SessionId(i), TenantId(2), &prompt(10)).unwrap();
    }
}

#[test]
fn prompts_take_at_most_a_quarter_of_a_forward_while_sessions_decode() {
    let mut s = sched(64, 1024);
    s.open(SessionId(1), TenantId(1), &prompt(8)).unwrap();
    let p = s.schedule(0);
    s.update(&p, &[]);
    // A 400-token prompt arrives while session 1 verifies every iteration.
    s.open(SessionId(2), TenantId(2), &prompt(400)).unwrap();
    for _ in 0..5 {
        s.enqueue_verify(SessionId(1), 4).unwrap();
        let p = s.schedule(0);
        let prefill: usize = p
            .chunks
            .iter()
            .filter(|c| c.kind == WorkKind::Prefill)
            .map(|c| c.len)
            .sum();
        assert!(p.chunks.iter().any(|c| c.kind == WorkKind::Decode));
        assert!(prefill <= 16, "{prefill} prompt tokens beside a decode");
        update_verified(&mut s, &p);
    }
    // Alone, a prompt takes the whole budget.
    s.close(SessionId(1));
    let p = s.schedule(0);
    assert_eq!(p.tokens(), 64);
}

/// Tenants 1 and 2 of equal weight, `budget` tokens a forward, `blocks` KV blocks of 4 tokens.
fn budgeted_tenants(budget: usize, blocks: usize, contended_budget: Option<usize>) -> Scheduler {
    equal_tenants(SchedConfig {
        max_waiting_tokens: 10_000,
        contended_budget,
        ..SchedConfig::new(budget, 4, blocks)
    })
}

#[test]
fn while_two_tenants_are_open_forwards_keep_to_the_contended_budget() {
    let mut s = budgeted_tenants(32, 1000, Some(6));
    // One tenant's forty decoding sessions alone: the whole budget.
    for id in 0..40u64 {
        s.open(SessionId(id), TenantId(1), &prompt(4)).unwrap();
    }
    let decode_all = |s: &mut Scheduler| {
        for _ in 0..200 {
            let ids: Vec<SessionId> = s.sessions.keys().copied().collect();
            for id in ids {
                let st = &s.sessions[&id];
                if st.computed == st.known && st.verifies.is_empty() {
                    s.enqueue_verify(id, 1).unwrap();
                }
            }
            let p = s.schedule(0);
            update_verified(s, &p);
            if p.chunks.iter().all(|c| c.kind == WorkKind::Decode) {
                return p;
            }
        }
        panic!("the prompts were never done");
    };
    let p = decode_all(&mut s);
    assert_eq!(p.tokens(), 32, "{p:?}");
    assert_eq!(s.budget(), 32);
    // Another tenant's one session opens: every forward from then on keeps to 6 tokens, the new
    // session's prompt and then its token are in each one, and a block larger than the
    // contended budget still goes alone.
    s.open(SessionId(100), TenantId(2), &prompt(4)).unwrap();
    assert_eq!(s.budget(), 6);
    // Its prompt gets its tenant's share of the forward (half), not a quarter.
    for id in 0..40u64 {
        if s.sessions[&SessionId(id)].verifies.is_empty() {
            s.enqueue_verify(SessionId(id), 1).unwrap();
        }
    }
    let p = s.schedule(0);
    let prefill: Vec<_> = p
        .chunks
        .iter()
        .filter(|c| c.kind == WorkKind::Prefill)
        .map(|c| (c.session, c.len))
        .collect();
    assert_eq!(prefill, vec![(SessionId(100), 3)], "{p:?}");
    assert_eq!(p.tokens(), 6, "{p:?}");
    update_verified(&mut s, &p);
    for _ in 0..20 {
        let p = decode_all(&mut s);
        assert!(p.tokens() <= 6, "{p:?}");
        assert!(
            p.chunks.iter().any(|c| c.session == SessionId(100)),
            "{p:?}"
        );
    }
    s.enqueue_verify(SessionId(100), 9).unwrap();
    let p = s.schedule(0);
    assert_eq!(
        p.chunks
            .iter()
            .map(|c| (c.session, c.len))
            .collect::<Vec<_>>(),
        vec![(SessionId(100), 9)],
        "alone, as it is larger than 6: {p:?}"
    );
    // It closes: one tenant again, the whole budget.
    s.close(SessionId(100));
    assert_eq!(s.budget(), 32);
    assert!(s.pool().conserved());
}

#[test]
fn a_full_pool_makes_room_from_the_tenant_over_its_share() {
    // 8 blocks of 4 tokens, two tenants of equal weight: a share of 4 blocks each.
    let mut s = budgeted_tenants(32, 8, None);
    // Tenant 2's one session (a block) is computed first, then tenant 1's three (seven blocks):
    // the pool is full and tenant 2's session is the least recently active.
    s.open(SessionId(20), TenantId(2), &prompt(4)).unwrap();
    let p = s.schedule(0);
    s.update(&p, &[]);
    for (id, len) in [(10, 12), (11, 8), (12, 8)] {
        s.open(SessionId(id), TenantId(1), &prompt(len)).unwrap();
    }
    let p = s.schedule(0);
    s.update(&p, &[]);
    assert_eq!(
        (s.tenant_blocks(TenantId(1)), s.tenant_blocks(TenantId(2))),
        (7, 1)
    );
    assert_eq!(s.pool().num_free(), 0);
    // Tenant 1 needs a block more: it is over its share, so it gives one of its own sessions
    // up, not tenant 2's (which plain least-recently-active order would pick).
    s.enqueue_verify(SessionId(10), 4).unwrap();
    let p = s.schedule(0);
    assert_eq!(p.preempted.len(), 1, "{p:?}");
    assert_ne!(p.preempted[0], SessionId(20), "{p:?}");
    assert_eq!(s.tenant_blocks(TenantId(2)), 1);
    assert!(p.chunks.iter().any(|c| c.session == SessionId(10)));
    s.update(&p, &[(SessionId(10), 16)]);
    // Tenant 2, within its share, now needs room: it takes it from tenant 1, over its share.
    s.enqueue_verify(SessionId(20), 8).unwrap();
    let p = s.schedule(0);
    assert!(p.chunks.iter().any(|c| c.session == SessionId(20)), "{p:?}");
    assert!(p.preempted.iter().all(|v| v.0 >= 10 && v.0 < 20), "{p:?}");
    assert!(s.pool().conserved());
}

#[test]
fn a_prompt_within_its_tenants_share_takes_room_from_a_busy_tenant_over_its_share() {
    // 8 blocks of 4 tokens, two tenants of equal weight. Tenant 1's four sessions of 7 tokens
    // fill the pool and keep busy: each has a one-token block queued every iteration (rejected,
    // so its KV stays within its two blocks), and none is ever idle. (A budget of 4: a forward
    // holds three of them, the fourth waits for the next.)
    let mut s = budgeted_tenants(4, 8, None);
    for id in 10..14 {
        s.open(SessionId(id), TenantId(1), &prompt(7)).unwrap();
    }
    let step = |s: &mut Scheduler, now: u64| {
        for id in (10..14).map(SessionId) {
            let st = &s.sessions[&id];
            if st.computed == st.known && st.verifies.is_empty() {
                s.enqueue_verify(id, 1).unwrap();
            }
        }
        let p = s.schedule(now * 1000);
        let kv: Vec<_> = p
            .chunks
            .iter()
            .filter(|c| c.kind == WorkKind::Decode)
            .map(|c| (c.session, c.start))
            .collect();
        s.update(&p, &kv);
        p
    };
    for i in 0..40 {
        step(&mut s, i);
    }
    assert_eq!(s.tenant_blocks(TenantId(1)), 8);
    // Tenant 2's prompt waits for room: it evicts one of tenant 1's busy sessions (tenant 1 is
    // over its share of 4 blocks), and tenant 1, not tenant 2, owes the recompute.
    s.open(SessionId(20), TenantId(2), &prompt(4)).unwrap();
    let mut prefilled = false;
    for i in 40..44 {
        let p = step(&mut s, i);
        prefilled |= p
            .chunks
            .iter()
            .any(|c| c.session == SessionId(20) && c.kind == WorkKind::Prefill);
        assert!(p.preempted.iter().all(|v| v.0 >= 10 && v.0 < 14), "{p:?}");
        if prefilled {
            break;
        }
    }
    assert!(prefilled, "tenant 2's prompt was never prefilled");
    assert!(s.sessions.values().all(|st| st.evicted_by.is_none()));
    assert!(s.pool().conserved());
}

/// A scheduler with the prefix cache: tenant 1 alone, tenants 2 and 3 sharing a salt.
fn cached(budget: usize, blocks: usize) -> Scheduler {
    let mut s = Scheduler::new(SchedConfig {
        prefix_cache: true,
        ..SchedConfig::new(budget, 4, blocks)
    })
    .unwrap();
    s.set_tenant(TenantId(1), TenantConfig::weight(1.0))
        .unwrap();
    let public = TenantConfig {
        cache_salt: Some(shared_salt("public")),
        ..TenantConfig::weight(1.0)
    };
    s.set_tenant(TenantId(2), public).unwrap();
    s.set_tenant(TenantId(3), public).unwrap();
    s.set_tenant(TenantId(4), TenantConfig::weight(1.0))
        .unwrap();
    s
}

/// Prefill everything waiting and publish it.
fn prefill_all(s: &mut Scheduler, prompts: &[(SessionId, &[u32])]) {
    while s.has_work() {
        let p = s.schedule(0);
        s.update(&p, &[]);
        for &(id, t) in prompts {
            s.publish(id, t);
        }
    }
}

#[test]
fn a_prompt_reuses_the_pages_of_its_tenants_earlier_prompt_and_never_another_tenants() {
    let text: Vec<u32> = (0..30).collect();
    let mut s = cached(64, 64);
    assert_eq!(s.open(SessionId(1), TenantId(1), &text).unwrap(), 0);
    prefill_all(&mut s, &[(SessionId(1), &text)]);
    s.close(SessionId(1));
    // Its own tenant: every full page but the one with the last token.
    assert_eq!(s.open(SessionId(2), TenantId(1), &text).unwrap(), 28);
    assert_eq!(s.session_kv(SessionId(2)), Some((30, 28)));
    // A longer prompt with the same start hits the same pages, all seven.
    let longer: Vec<u32> = (0..40).collect();
    assert_eq!(s.open(SessionId(3), TenantId(1), &longer).unwrap(), 28);
    // Another tenant, same tokens: nothing (its own salt).
    assert_eq!(s.open(SessionId(4), TenantId(4), &text).unwrap(), 0);
    // Tenants sharing a salt share pages.
    assert_eq!(s.open(SessionId(5), TenantId(2), &text).unwrap(), 0);
    prefill_all(&mut s, &[(SessionId(5), &text)]);
    assert_eq!(s.open(SessionId(6), TenantId(3), &text).unwrap(), 28);
    assert_eq!(s.open(SessionId(7), TenantId(1), &text).unwrap(), 28);
    assert_eq!(s.stats().prefix_queries, 30 * 6 + 40);
    assert_eq!(s.stats().prefix_hits, 28 * 4);
    // A page held by two sessions is charged once, to the first.
    assert_eq!(s.tenant_blocks(TenantId(2)), 8);
    assert_eq!(s.tenant_blocks(TenantId(3)), 0);
    assert!(s.pool().conserved());
}

#[test]
fn cached_pages_make_room_before_any_session_is_preempted() {
    // 16 pages of 4: one 30-token prompt cached (7 pages published, 9 empty), then two sessions
    // that need all 16 pages between them.
    let text: Vec<u32> = (0..30).collect();
    let mut s = cached(64, 16);
    s.open(SessionId(1), TenantId(1), &text).unwrap();
    prefill_all(&mut s, &[(SessionId(1), &text)]);
    s.close(SessionId(1));
    assert_eq!(s.pool().num_cached_unheld(), 7);
    let other: Vec<u32> = (100..132).collect();
    s.open(SessionId(2), TenantId(1), &other).unwrap();
    let third: Vec<u32> = (200..232).collect();
    s.open(SessionId(3), TenantId(1), &third).unwrap();
    prefill_all(&mut s, &[]);
    assert_eq!(s.stats().preemptions, 0);
    assert_eq!(s.pool().counts().evictions, 7);
    assert_eq!(s.pool().num_cached_unheld(), 0);
    assert!(s.pool().conserved());
}

#[test]
fn a_preempted_session_recomputes_only_what_is_no_longer_cached() {
    let text: Vec<u32> = (0..32).collect();
    let mut s = cached(64, 10);
    s.open(SessionId(1), TenantId(1), &text).unwrap();
    prefill_all(&mut s, &[(SessionId(1), &text)]);
    // A second session needs room a second later: session 1, idle, is preempted, its 8 pages
    // cached; the two let go last (its last two) make room.
    let other: Vec<u32> = (100..116).collect();
    s.open(SessionId(2), TenantId(4), &other).unwrap();
    let p = s.schedule(1_000_000);
    assert_eq!((p.preempted.clone(), p.tokens()), (vec![SessionId(1)], 16));
    s.update(&p, &[]);
    assert_eq!(s.pool().counts().evictions, 2);
    assert_eq!(s.session_kv(SessionId(1)), Some((32, 0)));
    // Session 2 ends. Session 1's next block: it re-attaches its 6 pages still cached and
    // recomputes the rest.
    s.close(SessionId(2));
    s.enqueue_verify(SessionId(1), 3).unwrap();
    let p = s.schedule(0);
    let c = p.chunks.iter().find(|c| c.session == SessionId(1)).unwrap();
    assert_eq!((c.kind, c.start, c.len), (WorkKind::Prefill, 24, 8));
    assert!(s.pool().conserved());
}

/// Conversations under KV pressure: 16 sessions at once, each turn's prompt the last turn's plus
/// its answer and a new question, decoded a token per iteration, in a pool that holds a fraction
/// of them. Every turn of every conversation ends: nothing waits forever. (Without the cache too:
/// before the oldest prompt could take a younger one's pages, a pool full of half-prefilled
/// prompts waited for ever, with the cache or without.)
#[test]
fn conversations_under_kv_pressure_all_finish() {
    for cache in [false, true] {
        let mut s = Scheduler::new(SchedConfig {
            prefix_cache: cache,
            max_waiting_tokens: 1 << 20,
            ..SchedConfig::new(64, 16, 120)
        })
        .unwrap();
        s.set_tenant(TenantId(0), TenantConfig::default()).unwrap();
        let users = 16u64;
        // Each user's history, and its open session (id, tokens still to decode).
        let mut history: Vec<Vec<u32>> = (0..users)
            .map(|u| (0..30).map(|i| (u * 1000 + i) as u32).collect())
            .collect();
        let mut open: Vec<Option<(SessionId, usize)>> = vec![None; users as usize];
        let mut turns = vec![0usize; users as usize];
        let mut next = 0u64;
        let mut now = 0u64;
        for it in 0..200_000 {
            if turns.iter().all(|&t| t >= 6) {
                break;
            }
            assert!(it < 199_999, "stuck at turns {turns:?} (cache {cache})");
            for u in 0..users as usize {
                if open[u].is_none() && turns[u] < 6 {
                    let id = SessionId(next);
                    next += 1;
                    if s.open(id, TenantId(0), &history[u]).is_ok() {
                        open[u] = Some((id, 40));
                    }
                }
            }
            now += 10_000;
            let p = s.schedule(now);
            let mut kv = Vec::new();
            for c in p.chunks.iter().filter(|c| c.kind == WorkKind::Decode) {
                kv.push((c.session, c.start + c.len));
            }
            s.update(&p, &kv);
            for u in 0..users as usize {
                let Some((id, left)) = open[u] else { continue };
                s.publish(id, &history[u]);
                let (known, computed) = s.session_kv(id).unwrap();
                let prefilled_now = p.chunks.iter().any(|c| {
                    c.session == id && (c.kind == WorkKind::Decode || c.start + c.len == known)
                });
                if !prefilled_now || computed < known {
                    continue;
                }
                // A token committed: it joins the history; the next is queued.
                if left == 0 {
                    s.close(id);
                    open[u] = None;
                    turns[u] += 1;
                    history[u].extend((0..12).map(|i| (u as u32 * 7 + i) % 5000));
                    continue;
                }
                history[u].push((u as u32 * 31 + known as u32) % 5000);
                let _ = s.enqueue_verify(id, 1);
                open[u] = Some((id, left - 1));
            }
        }
        assert!(s.pool().conserved());
    }
}

#[test]
fn admission_counts_only_the_prompt_tokens_the_cache_does_not_hold() {
    let mut s = Scheduler::new(SchedConfig {
        prefix_cache: true,
        max_waiting_tokens: 100,
        ..SchedConfig::new(64, 4, 200)
    })
    .unwrap();
    s.set_tenant(TenantId(1), TenantConfig::default()).unwrap();
    let first: Vec<u32> = (0..90).collect();
    s.open(SessionId(1), TenantId(1), &first).unwrap();
    prefill_all(&mut s, &[(SessionId(1), &first)]);
    s.close(SessionId(1));
    // Another prompt waits: 60 tokens.
    s.open(SessionId(2), TenantId(1), &(500..560).collect::<Vec<u32>>())
        .unwrap();
    // The next turn of the first conversation: 100 tokens, 88 of them cached. 60 + 12 wait.
    let next: Vec<u32> = (0..100).collect();
    assert_eq!(s.open(SessionId(3), TenantId(1), &next).unwrap(), 88);
    assert_eq!(s.waiting_tokens(), 60 + 12);
    // A prompt the cache does not hold is refused: 72 + 40 > 100.
    assert!(matches!(
        s.open(SessionId(4), TenantId(1), &(900..940).collect::<Vec<u32>>()),
        Err(SchedError::Saturated { .. })
    ));
}

#[test]
fn a_decode_widens_only_into_free_pages_and_its_tenants_quota() {
    // Page size 4, a pool of 4 pages: sessions 1 and 2 hold one each after their prompts.
    let mut s = sched(64, 4);
    let quota = TenantConfig {
        max_kv_blocks: Some(2),
        ..TenantConfig::default()
    };
    s.set_tenant(TenantId(2), quota).unwrap();
    s.open(SessionId(1), TenantId(1), &prompt(3)).unwrap();
    s.open(SessionId(2), TenantId(2), &prompt(3)).unwrap();
    let p = s.schedule(0);
    s.update(&p, &[]);
    s.enqueue_verify(SessionId(1), 1).unwrap();
    s.enqueue_verify(SessionId(2), 1).unwrap();
    let mut p = s.schedule(0);
    assert_eq!(p.tokens(), 2);
    let i1 = p
        .chunks
        .iter()
        .position(|c| c.session == SessionId(1))
        .unwrap();
    let i2 = p
        .chunks
        .iter()
        .position(|c| c.session == SessionId(2))
        .unwrap();
    // Session 2's tenant may hold two pages: positions 3..8 at most.
    assert_eq!(s.widen(&mut p, i2, 10), 4);
    assert_eq!((p.chunks[i2].start, p.chunks[i2].len), (3, 5));
    // One page is left in the pool for session 1: positions up to 8.
    assert_eq!(s.widen(&mut p, i1, 10), 4);
    assert_eq!(s.pool().num_free(), 0);
    assert_eq!(s.widen(&mut p, i1, 10), 0, "nothing to preempt for it");
    // The forward ran; the verifier accepted one guess of session 1 and none of session 2's.
    s.update(&p, &[(SessionId(1), 5), (SessionId(2), 4)]);
    assert_eq!(s.sessions[&SessionId(1)].computed, 5);
    assert_eq!(s.sessions[&SessionId(2)].computed, 4);
    assert_eq!(
        s.pool().held(SessionId(2)),
        1,
        "the page past what was kept went back"
    );
    assert!(s.pool().conserved());
}

/// A background session (a speculation session whose edge went quiet) never joins a forward
/// another tenant's foreground session waits on, however many of them there are and whatever
/// their tenants' virtual times; it runs when no other tenant has work, and its own tenant's
/// foreground sessions do not hold it back. Put back in the foreground, it is planned again.
#[test]
fn background_sessions_run_only_in_forwards_no_other_tenant_waits_on() {
    let mut s = sched(64, 1000);
    // The victim: one session of tenant 2. The attacker: 20 sessions of tenant 1, 19 of them
    // in the background, and one in the foreground.
    s.open(SessionId(100), TenantId(2), &prompt(4)).unwrap();
    for id in 0..20u64 {
        s.open(SessionId(id), TenantId(1), &prompt(4)).unwrap();
    }
    // Their prompts (84 tokens, a budget of 64: two forwards; a prefill is not held back).
    for _ in 0..2 {
        let p = s.schedule(0);
        s.update(&p, &[]);
    }
    for id in 1..20u64 {
        s.set_background(SessionId(id), true);
    }
    let all: Vec<SessionId> = (0..20u64).map(SessionId).chain([SessionId(100)]).collect();
    let enqueue_all = |s: &mut Scheduler| {
        for &id in &all {
            if s.sessions.get(&id).is_some_and(|x| x.verifies.is_empty()) {
                s.enqueue_verify(id, 1).unwrap();
            }
        }
    };
    for _ in 0..50 {
        enqueue_all(&mut s);
        let p = s.schedule(0);
        let planned: Vec<SessionId> = p.chunks.iter().map(|c| c.session).collect();
        assert!(planned.contains(&SessionId(100)), "{planned:?}");
        assert!(planned.contains(&SessionId(0)), "{planned:?}");
        assert_eq!(
            planned.len(),
            2,
            "the background sessions wait: {planned:?}"
        );
        s.update(&p, &[]);
    }
    // The victim's stream ends (its session has no work): the background runs, beside the
    // attacker's own foreground session.
    s.close(SessionId(100));
    enqueue_all(&mut s);
    let p = s.schedule(0);
    assert_eq!(p.chunks.len(), 20, "{p:?}");
    s.update(&p, &[]);
    // Another tenant with work again: background waits; back in the foreground, it goes.
    s.open(SessionId(101), TenantId(2), &prompt(4)).unwrap();
    enqueue_all(&mut s);
    let p = s.schedule(0);
    assert!(
        p.chunks
            .iter()
            .all(|c| c.session.0 == 0 || c.session.0 == 101),
        "{p:?}"
    );
    s.update(&p, &[]);
    s.set_background(SessionId(5), false);
    enqueue_all(&mut s);
    s.enqueue_verify(SessionId(101), 1).ok();
    let p = s.schedule(0);
    assert!(p.chunks.iter().any(|c| c.session.0 == 5), "{p:?}");
    assert!(s.pool().conserved());
}
