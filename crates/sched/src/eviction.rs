//! Preemption: whose KV pages go when a tenant needs room (over its share, or idle), and the
//! prefill that brings them back.

use super::*;

impl Scheduler {
    /// `tenant`'s weighted share of the pool, in blocks.
    pub(crate) fn kv_share(&self, tenant: TenantId) -> usize {
        (self.share(tenant) * self.pool.num_pages() as f64).ceil() as usize
    }

    /// The default KV quota between tenants: the tenants that hold more than their weighted
    /// share of the pool (none with one tenant). When the pool is full, a tenant over its share
    /// makes room from its own sessions only, and one within its share from those over theirs
    /// first, so that one tenant's sessions cannot take the KV of everyone else's.
    pub(crate) fn tenants_over_kv_share(&self) -> Vec<TenantId> {
        if self.tenants.len() < 2 {
            return Vec::new();
        }
        let mut held: BTreeMap<TenantId, usize> = BTreeMap::new();
        for (id, s) in &self.sessions {
            *held.entry(s.tenant).or_default() += self.pool.charged(*id);
        }
        held.into_iter()
            .filter(|&(t, n)| n > self.kv_share(t))
            .map(|(t, _)| t)
            .collect()
    }

    /// KV pages `tenant` may still take under its quota (`max_kv_blocks`).
    pub(crate) fn tenant_room(&self, tenant: TenantId) -> usize {
        match self.tenants.get(&tenant).and_then(|t| t.cfg.max_kv_blocks) {
            Some(limit) => limit.saturating_sub(self.tenant_blocks(tenant)),
            None => usize::MAX,
        }
    }

    /// Drop the KV of the least recently active session not in `keep` that holds blocks: of
    /// `tenant` only, when given, or of `by` itself when it is over its share of the pool; else
    /// of the tenants over their share first (see [`Scheduler::tenants_over_kv_share`]).
    pub(crate) fn preempt_one(
        &mut self,
        keep: &[SessionId],
        tenant: Option<TenantId>,
        by: TenantId,
    ) -> Option<SessionId> {
        let over = self.tenants_over_kv_share();
        let tenant = tenant.or_else(|| over.contains(&by).then_some(by));
        let victim = self.least_active(&over, |id, s| {
            !keep.contains(id) && tenant.is_none_or(|t| s.tenant == t)
        })?;
        self.evict(victim, by, &over);
        Some(victim)
    }

    /// The least recently active session that holds KV and is a `candidate`: of the tenants in
    /// `over` first, the latest to arrive among equals.
    pub(crate) fn least_active(
        &self,
        over: &[TenantId],
        candidate: impl Fn(&SessionId, &Session) -> bool,
    ) -> Option<SessionId> {
        self.sessions
            .iter()
            .filter(|(id, s)| s.computed > 0 && candidate(id, s))
            .min_by_key(|(id, s)| {
                (
                    !over.contains(&s.tenant),
                    s.last_active,
                    std::cmp::Reverse(s.arrival),
                    **id,
                )
            })
            .map(|(id, _)| *id)
    }

    /// Drop `victim`'s KV for a session of tenant `by`. When `by` is another tenant, it is
    /// billed the recompute of what the victim held (the victim did not choose to lose it),
    /// unless the victim's tenant is among `over`, those over their share of the pool
    /// ([`Scheduler::tenants_over_kv_share`]): such a tenant pays for its own recompute.
    pub(crate) fn evict(&mut self, victim: SessionId, by: TenantId, over: &[TenantId]) {
        self.pool.free_all(victim);
        if let Some(s) = self.sessions.get_mut(&victim) {
            if s.tenant != by && s.computed > 0 && !over.contains(&s.tenant) {
                let owed = s.evicted_by.map_or(0, |(_, n)| n).max(s.computed);
                s.evicted_by = Some((by, owed));
            }
            s.computed = 0;
            s.published = 0;
        }
        self.stats.preemptions += 1;
    }

    /// Charge the prefill chunk `start..start + len` of session `id` to its tenant (computed
    /// positions and rate quota: the compute is its sessions'), and bill the fair share of the
    /// part an evictor owes to the evictor.
    pub(crate) fn charge_prefill(
        &mut self,
        id: SessionId,
        tenant: TenantId,
        start: usize,
        len: usize,
    ) {
        let debt = self.sessions.get(&id).and_then(|s| s.evicted_by);
        let owed = match debt {
            Some((by, upto)) if start < upto => {
                let n = (upto - start).min(len);
                self.bill(by, n);
                if start + n >= upto {
                    if let Some(s) = self.sessions.get_mut(&id) {
                        s.evicted_by = None;
                    }
                }
                n
            }
            _ => 0,
        };
        if let Some(t) = self.tenants.get_mut(&tenant) {
            t.positions += len as u64;
            if t.cfg.tokens_per_s.is_some() {
                t.bucket -= len as f64;
            }
        }
        self.bill(tenant, len - owed);
    }

    /// The default KV quota enforced for a waiting prompt of `by`, within its share of the pool:
    /// drop the KV of the least recently active session (idle or not, not in `keep`) of a tenant
    /// over its share. Its tenant pays for its recompute: it held more than its share.
    pub(crate) fn preempt_over_share(
        &mut self,
        keep: &[SessionId],
        by: TenantId,
    ) -> Option<SessionId> {
        let over = self.tenants_over_kv_share();
        if over.contains(&by) {
            return None;
        }
        let victim = self.least_active(&over, |id, s| {
            !keep.contains(id) && over.contains(&s.tenant)
        })?;
        self.evict(victim, by, &over);
        Some(victim)
    }

    /// Drop the KV of the youngest session (arrived after `id`) whose prompt, or recompute, is
    /// only partly computed, of `tenant` only when given, for `id`'s prompt: when every page is
    /// held by prompts half prefilled, none could finish without this. The oldest prompt always
    /// can (admission refuses one that could never fit), so every prompt is computed in turn;
    /// the victim's computed pages stay in the prefix cache while the pool has room.
    pub(crate) fn preempt_younger_prompt(
        &mut self,
        keep: &[SessionId],
        id: SessionId,
        tenant: Option<TenantId>,
    ) -> Option<SessionId> {
        let (arrival, by) = self.sessions.get(&id).map(|s| (s.arrival, s.tenant))?;
        let over = self.tenants_over_kv_share();
        let victim = self
            .sessions
            .iter()
            .filter(|(v, s)| {
                !keep.contains(v)
                    && (s.arrival, **v) > (arrival, id)
                    && s.computed > 0
                    && s.needs_compute()
                    && tenant.is_none_or(|t| s.tenant == t)
            })
            .max_by_key(|(v, s)| (s.arrival, **v))
            .map(|(v, _)| *v)?;
        self.evict(victim, by, &over);
        Some(victim)
    }

    /// Drop the KV of the session idle the longest (no queued verify, nothing to compute), if it
    /// has been idle since before iteration `since` or for `idle_evict_ms`; of `tenant` only,
    /// when given, else of the tenants over their share of the pool first.
    pub(crate) fn preempt_idle(
        &mut self,
        keep: &[SessionId],
        since: u64,
        tenant: Option<TenantId>,
        by: TenantId,
    ) -> Option<SessionId> {
        let over = self.tenants_over_kv_share();
        let victim = self
            .sessions
            .iter()
            .filter(|(id, s)| {
                !keep.contains(id)
                    && s.computed > 0
                    && s.computed == s.known
                    && s.verifies.is_empty()
                    && (s.last_active < since
                        || self.now_ms.saturating_sub(s.last_planned_ms) >= self.cfg.idle_evict_ms)
                    && tenant.is_none_or(|t| s.tenant == t)
            })
            .min_by_key(|(id, s)| (!over.contains(&s.tenant), s.last_active, **id))
            .map(|(id, _)| *id)?;
        self.evict(victim, by, &over);
        Some(victim)
    }
}
