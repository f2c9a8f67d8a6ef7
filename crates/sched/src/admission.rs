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

    /// `tenant`'s prompt (and recompute) tokens not yet computed.
    pub(crate) fn tenant_waiting_tokens(&self, tenant: TenantId) -> usize {
        self.sessions
            .values()
            .filter(|s| s.tenant == tenant && s.needs_compute())
            .map(|s| s.known - s.computed)
            .sum()
    }

    /// Prompt (and recompute) tokens not yet computed.
    pub fn waiting_tokens(&self) -> usize {
        self.sessions
            .values()
            .filter(|s| s.needs_compute())
            .map(|s| s.known - s.computed)
            .sum()
    }

    /// Whether a session of `tenant` with a `prompt_len`-token prompt would be admitted now.
    pub fn admit(&self, tenant: TenantId, prompt_len: usize) -> Result<(), SchedError> {
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
        if waiting > 0 && waiting + prompt_len > self.cfg.max_waiting_tokens {
            return Err(SchedError::Saturated {
                reason: format!("{waiting} prompt tokens wait for prefill"),
                retry_iterations: 1
                    + (waiting + prompt_len - self.cfg.max_waiting_tokens) as u64 / budget,
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
                && mine_waiting + prompt_len > fair
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
