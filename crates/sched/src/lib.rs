//! Tandem's multi-tenant scheduler: pure, deterministic, no tensors, sockets or clocks.
//!
//! One rule, as in vLLM v1: every session has tokens the cloud *knows* (its prompt and committed
//! history, then each queued verify block) and tokens whose KV it has *computed*; each iteration
//! lets computed catch up with known under a token budget. Verify blocks are small and
//! latency-critical: they are scheduled first and whole; prompt prefill (and the recompute of a
//! preempted session) takes what budget is left, in chunks. A session whose edge has sent nothing
//! is simply not in the batch. Between tenants the budget is shared by weighted fair queueing,
//! charged in computed positions. When the block pool cannot hold a verify block, the least
//! recently active other session is preempted: its KV is dropped and recomputed later from its
//! committed tokens — the session and its committed tokens are never dropped.
//!
//! The shell calls [`Scheduler::schedule`], runs the returned [`StepPlan`] as one ragged forward,
//! and reports each session's KV length after it (a rejection truncates) with
//! [`Scheduler::update`].

pub mod grant;
pub mod pool;

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;

pub use grant::GrantPolicy;
pub use pool::BlockPool;

pub type SessionId = u64;
pub type TenantId = u32;

/// While prompts wait, verify work leaves them `token_budget / PREFILL_RESERVE_DIV` tokens.
pub const PREFILL_RESERVE_DIV: usize = 4;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchedError {
    #[error("invalid scheduler setting: {0}")]
    InvalidConfig(String),
    #[error("out of KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("unknown session {0}")]
    UnknownSession(SessionId),
    #[error("session {0} is already open")]
    DuplicateSession(SessionId),
    #[error("unknown tenant {0}")]
    UnknownTenant(TenantId),
    #[error("a verify block of {len} tokens exceeds the token budget {budget}")]
    BlockTooLarge { len: usize, budget: usize },
    #[error("a prompt of {len} tokens cannot fit the KV pool ({capacity} token slots)")]
    PromptTooLarge { len: usize, capacity: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SchedConfig {
    /// Tokens one forward may compute, all sessions together.
    pub token_budget: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum WorkKind {
    /// Prompt prefill, or recomputing a preempted session's committed history.
    Prefill,
    /// A verify block (with any unfed committed token in front).
    Verify,
}

/// One session's share of an iteration: compute positions `start .. start + len`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Chunk {
    pub session: SessionId,
    pub start: usize,
    pub len: usize,
    pub kind: WorkKind,
    /// The session's block table, holding at least `start + len` slots.
    pub blocks: Vec<u32>,
}

/// What to run this iteration.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct StepPlan {
    pub iteration: u64,
    pub chunks: Vec<Chunk>,
    /// Sessions whose KV was dropped to make room; they recompute later.
    pub preempted: Vec<SessionId>,
}

impl StepPlan {
    pub fn tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.len).sum()
    }
}

#[derive(Debug, Clone)]
struct Session {
    tenant: TenantId,
    /// Prompt and committed history the cloud holds (recomputed after preemption).
    known: usize,
    computed: usize,
    /// Verify blocks waiting, by length, with the iteration each arrived in.
    verifies: VecDeque<(usize, u64)>,
    /// Last iteration this session was scheduled or given work (for preemption order).
    last_active: u64,
    arrival: u64,
}

#[derive(Debug, Clone)]
struct Tenant {
    weight: f64,
    /// Virtual time: computed positions charged to the tenant over its weight.
    vtime: f64,
    /// Positions computed for the tenant in all.
    positions: u64,
}

/// Counters of the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SchedStats {
    pub iterations: u64,
    pub preemptions: u64,
    /// Most iterations a verify block waited between arriving and being scheduled.
    pub max_verify_wait: u64,
}

pub struct Scheduler {
    cfg: SchedConfig,
    pool: BlockPool,
    sessions: BTreeMap<SessionId, Session>,
    tenants: BTreeMap<TenantId, Tenant>,
    iteration: u64,
    stats: SchedStats,
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Result<Self, SchedError> {
        if cfg.token_budget == 0 {
            return Err(SchedError::InvalidConfig(
                "token_budget must be at least 1".into(),
            ));
        }
        Ok(Self {
            pool: BlockPool::new(cfg.num_blocks, cfg.block_size)?,
            cfg,
            sessions: BTreeMap::new(),
            tenants: BTreeMap::new(),
            iteration: 0,
            stats: SchedStats::default(),
        })
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    pub fn stats(&self) -> SchedStats {
        self.stats
    }
    pub fn config(&self) -> SchedConfig {
        self.cfg
    }

    /// Add (or reweigh) a tenant. Weights must be positive and finite.
    pub fn set_tenant(&mut self, id: TenantId, weight: f64) -> Result<(), SchedError> {
        if !(weight.is_finite() && weight > 0.0) {
            return Err(SchedError::InvalidConfig(format!(
                "tenant {id}: weight must be positive, got {weight}"
            )));
        }
        let t = self.tenants.entry(id).or_insert(Tenant {
            weight,
            vtime: 0.0,
            positions: 0,
        });
        t.weight = weight;
        Ok(())
    }

    /// Positions computed for `tenant` so far.
    pub fn tenant_positions(&self, tenant: TenantId) -> u64 {
        self.tenants.get(&tenant).map_or(0, |t| t.positions)
    }

    /// A new session with a prompt of `prompt_len` tokens to prefill.
    pub fn open(
        &mut self,
        id: SessionId,
        tenant: TenantId,
        prompt_len: usize,
    ) -> Result<(), SchedError> {
        if self.sessions.contains_key(&id) {
            return Err(SchedError::DuplicateSession(id));
        }
        if !self.tenants.contains_key(&tenant) {
            return Err(SchedError::UnknownTenant(tenant));
        }
        let capacity = self.pool.num_blocks() * self.pool.block_size();
        if prompt_len == 0 || prompt_len > capacity {
            return Err(SchedError::PromptTooLarge {
                len: prompt_len,
                capacity,
            });
        }
        // A tenant that was idle does not bank credit: it rejoins at the busiest tenants' time.
        let floor = self.min_active_vtime();
        if let (Some(f), Some(t)) = (floor, self.tenants.get_mut(&tenant)) {
            t.vtime = t.vtime.max(f);
        }
        self.sessions.insert(
            id,
            Session {
                tenant,
                known: prompt_len,
                computed: 0,
                verifies: VecDeque::new(),
                last_active: self.iteration,
                arrival: self.iteration,
            },
        );
        Ok(())
    }

    /// A verify block of `len` tokens arrived for `id` (to be computed whole, after what is known).
    pub fn enqueue_verify(&mut self, id: SessionId, len: usize) -> Result<(), SchedError> {
        if len > self.cfg.token_budget {
            return Err(SchedError::BlockTooLarge {
                len,
                budget: self.cfg.token_budget,
            });
        }
        let it = self.iteration;
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(SchedError::UnknownSession(id))?;
        s.verifies.push_back((len, it));
        s.last_active = it;
        Ok(())
    }

    pub fn close(&mut self, id: SessionId) {
        self.sessions.remove(&id);
        self.pool.free_all(id);
    }

    fn min_active_vtime(&self) -> Option<f64> {
        self.sessions
            .values()
            .filter_map(|s| self.tenants.get(&s.tenant).map(|t| t.vtime))
            .reduce(f64::min)
    }

    fn charge(&mut self, tenant: TenantId, positions: usize) {
        if let Some(t) = self.tenants.get_mut(&tenant) {
            t.vtime += positions as f64 / t.weight;
            t.positions += positions as u64;
        }
    }

    /// Drop the KV of the least recently active session not in `keep` that holds blocks.
    fn preempt_one(&mut self, keep: &[SessionId]) -> Option<SessionId> {
        let victim = self
            .sessions
            .iter()
            .filter(|(id, s)| !keep.contains(id) && s.computed > 0)
            .min_by_key(|(id, s)| (s.last_active, std::cmp::Reverse(s.arrival), **id))
            .map(|(id, _)| *id)?;
        self.pool.free_all(victim);
        if let Some(s) = self.sessions.get_mut(&victim) {
            s.computed = 0;
        }
        self.stats.preemptions += 1;
        Some(victim)
    }

    /// Sessions with work of `kind`, in fair order: lowest tenant virtual time, then oldest.
    fn candidates(&self, kind: WorkKind) -> Vec<SessionId> {
        let mut v: Vec<(f64, u64, SessionId)> = self
            .sessions
            .iter()
            .filter(|(_, s)| match kind {
                WorkKind::Verify => s.computed == s.known && !s.verifies.is_empty(),
                WorkKind::Prefill => s.computed < s.known,
            })
            .map(|(id, s)| {
                let vt = self.tenants.get(&s.tenant).map_or(0.0, |t| t.vtime);
                // Verify: oldest block first. Prefill: least recently served first, so one long
                // prompt does not hold the others back until it is done.
                let since = match kind {
                    WorkKind::Verify => s.verifies.front().map_or(0, |v| v.1),
                    WorkKind::Prefill => s.last_active,
                };
                (vt, since, *id)
            })
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        v.into_iter().map(|x| x.2).collect()
    }

    /// Plan the next iteration.
    pub fn schedule(&mut self) -> StepPlan {
        self.iteration += 1;
        self.stats.iterations += 1;
        let mut plan = StepPlan {
            iteration: self.iteration,
            ..StepPlan::default()
        };
        let mut budget = self.cfg.token_budget;
        let mut taken: Vec<SessionId> = Vec::new();
        // Verify comes first, but while prompts wait it leaves them a quarter of the budget, so a
        // busy verifier still admits new sessions (a lone block that needs more still goes).
        let prompts_wait = self.sessions.values().any(|s| s.computed < s.known);
        let reserve = if prompts_wait {
            self.cfg.token_budget / PREFILL_RESERVE_DIV
        } else {
            0
        };
        // Verify blocks first, whole, one per session, in fair order (re-sorted after each charge).
        loop {
            let next = self
                .candidates(WorkKind::Verify)
                .into_iter()
                .find(|id| !taken.contains(id));
            let Some(id) = next else { break };
            let s = &self.sessions[&id];
            let (len, since) = *s.verifies.front().expect("candidate has a block");
            let fits =
                len <= budget.saturating_sub(reserve) || (plan.chunks.is_empty() && len <= budget);
            if !fits {
                // Not this iteration; smaller blocks of others may still fit.
                taken.push(id);
                continue;
            }
            let start = s.computed;
            let tenant = s.tenant;
            while self.pool.shortfall(id, start + len) > self.pool.num_free() {
                let mut keep = taken.clone();
                keep.push(id);
                match self.preempt_one(&keep) {
                    Some(v) => {
                        plan.preempted.push(v);
                        // It recomputes in a later iteration, not in the one that evicted it.
                        taken.push(v);
                    }
                    None => break,
                }
            }
            taken.push(id);
            if self.pool.grow(id, start + len).is_err() {
                continue;
            }
            let s = self.sessions.get_mut(&id).expect("exists");
            s.verifies.pop_front();
            s.last_active = self.iteration;
            self.stats.max_verify_wait = self.stats.max_verify_wait.max(self.iteration - since);
            budget -= len;
            self.charge(tenant, len);
            plan.chunks.push(Chunk {
                session: id,
                start,
                len,
                kind: WorkKind::Verify,
                blocks: self.pool.table(id).to_vec(),
            });
        }
        // Prefill (and recompute) with what is left, in chunks; it never preempts.
        for id in self.candidates(WorkKind::Prefill) {
            if budget == 0 {
                break;
            }
            if taken.contains(&id) {
                continue;
            }
            let s = &self.sessions[&id];
            let start = s.computed;
            let room = self.pool.num_free() * self.pool.block_size()
                + (self.pool.held(id) * self.pool.block_size()).saturating_sub(start);
            let len = (s.known - start).min(budget).min(room);
            if len == 0 {
                continue;
            }
            let tenant = s.tenant;
            if self.pool.grow(id, start + len).is_err() {
                continue;
            }
            taken.push(id);
            budget -= len;
            self.charge(tenant, len);
            if let Some(s) = self.sessions.get_mut(&id) {
                s.last_active = self.iteration;
            }
            plan.chunks.push(Chunk {
                session: id,
                start,
                len,
                kind: WorkKind::Prefill,
                blocks: self.pool.table(id).to_vec(),
            });
        }
        plan
    }

    /// The plan ran. `kv_len` gives, for verify chunks, each session's KV length after its verdict
    /// (a rejection truncates); prefill chunks computed what they were given. Whatever the cloud
    /// committed is then known.
    pub fn update(&mut self, plan: &StepPlan, kv_len: &[(SessionId, usize)]) {
        for c in &plan.chunks {
            let Some(s) = self.sessions.get_mut(&c.session) else {
                continue; // closed meanwhile
            };
            let mut end = c.start + c.len;
            if c.kind == WorkKind::Verify {
                if let Some(&(_, kv)) = kv_len.iter().find(|(id, _)| *id == c.session) {
                    end = end.min(kv);
                }
                s.known = end;
            }
            s.computed = end;
            self.pool.truncate(c.session, end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(budget: usize, blocks: usize) -> Scheduler {
        let mut s = Scheduler::new(SchedConfig {
            token_budget: budget,
            block_size: 4,
            num_blocks: blocks,
        })
        .unwrap();
        s.set_tenant(1, 1.0).unwrap();
        s.set_tenant(2, 3.0).unwrap();
        s
    }

    #[test]
    fn a_long_prefill_never_delays_a_verify() {
        let mut s = sched(16, 64);
        s.open(1, 1, 200).unwrap(); // a long prompt
        s.open(2, 1, 4).unwrap();
        // Prefill takes turns: session 2's short prompt is done by the second iteration.
        for _ in 0..2 {
            let p = s.schedule();
            s.update(&p, &[]);
        }
        assert_eq!(s.sessions[&2].computed, 4);
        assert!(s.sessions[&1].computed < 200);
        for _ in 0..5 {
            s.enqueue_verify(2, 5).unwrap();
            let p = s.schedule();
            assert_eq!(p.chunks[0].session, 2, "{p:?}");
            assert_eq!(p.chunks[0].kind, WorkKind::Verify);
            assert!(p.tokens() <= 16);
            let kv = p.chunks[0].start + 3; // two positions rejected
            s.update(&p, &[(2, kv)]);
        }
        assert_eq!(s.stats().max_verify_wait, 1);
        assert!(s.pool().conserved());
    }

    #[test]
    fn weights_split_the_budget_under_saturation() {
        let mut s = sched(12, 1000);
        for id in 0..6u64 {
            s.open(id, if id < 3 { 1 } else { 2 }, 4).unwrap();
        }
        for _ in 0..400 {
            for id in 0..6u64 {
                if s.sessions[&id].verifies.is_empty() {
                    s.enqueue_verify(id, 4).unwrap();
                }
            }
            let p = s.schedule();
            let kv: Vec<_> = p
                .chunks
                .iter()
                .map(|c| (c.session, c.start + 1)) // everything but one position rejected
                .collect();
            s.update(&p, &kv);
        }
        let (a, b) = (s.tenant_positions(1) as f64, s.tenant_positions(2) as f64);
        let share = b / (a + b);
        assert!((share - 0.75).abs() < 0.075, "{a} vs {b}");
    }

    #[test]
    fn a_full_pool_preempts_the_least_recently_active_session() {
        // 4 blocks of 4 tokens: two sessions of 8 tokens fill it.
        let mut s = sched(32, 4);
        s.open(1, 1, 8).unwrap();
        s.open(2, 1, 8).unwrap();
        let p = s.schedule();
        s.update(&p, &[]);
        assert_eq!(s.pool().num_free(), 0);
        s.enqueue_verify(2, 4).unwrap();
        let p = s.schedule();
        assert_eq!(p.preempted, vec![1]);
        assert_eq!(p.chunks.len(), 1);
        s.update(&p, &[(2, 12)]);
        // Session 1 recomputes its 8 known tokens once there is room again.
        s.close(2);
        let p = s.schedule();
        assert_eq!(
            (p.chunks[0].session, p.chunks[0].start, p.chunks[0].len),
            (1, 0, 8)
        );
        assert_eq!(p.chunks[0].kind, WorkKind::Prefill);
        s.update(&p, &[]);
        assert_eq!(s.sessions[&1].computed, 8);
        assert!(s.pool().conserved());
    }

    #[test]
    fn refusals_name_the_problem() {
        let mut s = sched(8, 4);
        assert_eq!(s.open(1, 9, 4), Err(SchedError::UnknownTenant(9)));
        s.open(1, 1, 4).unwrap();
        assert_eq!(s.open(1, 1, 4), Err(SchedError::DuplicateSession(1)));
        assert!(matches!(
            s.enqueue_verify(1, 9),
            Err(SchedError::BlockTooLarge { len: 9, budget: 8 })
        ));
        assert_eq!(s.enqueue_verify(7, 1), Err(SchedError::UnknownSession(7)));
        assert!(matches!(
            s.open(2, 1, 17),
            Err(SchedError::PromptTooLarge { .. })
        ));
        assert!(s.set_tenant(3, 0.0).is_err());
    }
}
