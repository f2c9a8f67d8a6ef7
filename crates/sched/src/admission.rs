//! Admission: whether a new session may open now, by the verifier's limits and, once they are
//! half used, by each tenant's weighted share of them.

use super::*;

impl Scheduler {
    /// `tenant`'s weight over all tenants' weights.
    pub(crate) fn share(&self, tenant: TenantId) -> f64 {
        let total: f64 = self.tenants.values().map(|t| t.cfg.weight).sum();
        self.tenants
            .get(&tenant)
            .map_or(0.0, |t| t.cfg.weight / total.max(f64::MIN_POSITIVE))
    }

    /// Tokens `s` still has to compute: those it has not, less those the prefix cache would give
    /// back to a preempted session when it recomputes.
    fn to_compute(&self, id: SessionId, s: &Session) -> usize {
        let cached = if self.cfg.prefix_cache && s.computed == 0 && self.pool.held(id) == 0 {
            let n = (s.known / self.pool.page_size()).min(s.hashes.len());
            self.pool.lookup(&s.hashes[..n]).len() * self.pool.page_size()
        } else {
            0
        };
        s.known - s.computed.max(cached)
    }

    /// `tenant`'s prompt (and recompute) tokens not yet computed.
    pub(crate) fn tenant_waiting_tokens(&self, tenant: TenantId) -> usize {
        self.sessions
            .iter()
            .filter(|(_, s)| s.tenant == tenant && s.needs_compute())
            .map(|(id, s)| self.to_compute(*id, s))
            .sum()
    }

    /// Prompt (and recompute) tokens not yet computed (what the prefix cache holds of them
    /// not counted).
    pub fn waiting_tokens(&self) -> usize {
        self.sessions
            .iter()
            .filter(|(_, s)| s.needs_compute())
            .map(|(id, s)| self.to_compute(*id, s))
            .sum()
    }

    /// Whether a session of `tenant` with a `prompt_len`-token prompt would be admitted now.
    pub fn admit(&self, tenant: TenantId, prompt_len: usize) -> Result<(), SchedError> {
        self.admit_new(tenant, prompt_len, prompt_len)
    }

    /// [`Scheduler::admit`] for a prompt of which `new` tokens are to be computed (the rest the
    /// prefix cache serves): only those wait for prefill.
    pub(crate) fn admit_new(
        &self,
        tenant: TenantId,
        prompt_len: usize,
        new: usize,
    ) -> Result<(), SchedError> {
        let t = self
            .tenants
            .get(&tenant)
            .ok_or(SchedError::UnknownTenant(tenant))?;
        let capacity = self.pool.num_pages() * self.pool.page_size();
        if prompt_len == 0 || prompt_len > capacity {
            return Err(SchedError::PromptTooLarge {
                len: prompt_len,
                capacity,
            });
        }
        if self.pool.pages_for(prompt_len) > self.block_capacity(tenant) {
            return Err(SchedError::QuotaExceeded {
                tenant,
                what: "KV blocks (for this prompt)",
                limit: self.block_capacity(tenant),
            });
        }
        if let Some(limit) = t.cfg.max_sessions {
            if self.tenant_sessions(tenant) >= limit {
                return Err(SchedError::QuotaExceeded {
                    tenant,
                    what: "sessions",
                    limit,
                });
            }
        }
        let waiting = self.waiting_tokens();
        let budget = self.cfg.token_budget as u64;
        if self.sessions.len() >= self.cfg.max_sessions {
            return Err(SchedError::Saturated {
                reason: format!("{} sessions open", self.sessions.len()),
                retry_iterations: 1 + waiting as u64 / budget,
            });
        }
        if waiting > 0 && waiting + new > self.cfg.max_waiting_tokens {
            return Err(SchedError::Saturated {
                reason: format!("{waiting} prompt tokens wait for prefill"),
                retry_iterations: 1 + (waiting + new - self.cfg.max_waiting_tokens) as u64 / budget,
            });
        }
        // Fair admission: past half of a global limit, a tenant holding its weighted share of it
        // waits, so that one tenant's burst leaves every other tenant its share.
        if self.tenants.len() > 1 {
            let share = self.share(tenant);
            let mine = self.tenant_sessions(tenant);
            let fair = (share * self.cfg.max_sessions as f64).ceil() as usize;
            if self.sessions.len() * 2 >= self.cfg.max_sessions && mine >= fair.max(1) {
                return Err(SchedError::Saturated {
                    reason: format!(
                        "tenant {} holds {mine} sessions, its share of the verifier's {}",
                        tenant.0, self.cfg.max_sessions
                    ),
                    retry_iterations: 1 + waiting as u64 / budget,
                });
            }
            let mine_waiting = self.tenant_waiting_tokens(tenant);
            let fair = (share * self.cfg.max_waiting_tokens as f64).ceil() as usize;
            // (One prompt of a tenant may always wait, however small its share.)
            if waiting * 2 >= self.cfg.max_waiting_tokens
                && mine_waiting > 0
                && mine_waiting + new > fair
            {
                return Err(SchedError::Saturated {
                    reason: format!(
                        "tenant {} has {mine_waiting} prompt tokens waiting, its share of {}",
                        tenant.0, self.cfg.max_waiting_tokens
                    ),
                    retry_iterations: 1 + mine_waiting as u64 / budget,
                });
            }
        }
        Ok(())
    }
}
