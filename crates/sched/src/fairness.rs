//! Fair shares of the verifier's forwards: each tenant's virtual time, the positions it is
//! charged and billed, and its token rate.

use super::*;

impl Scheduler {
    pub(crate) fn min_active_vtime(&self) -> Option<f64> {
        self.sessions
            .values()
            .filter_map(|s| self.tenants.get(&s.tenant).map(|t| t.vtime))
            .reduce(f64::min)
    }

    pub(crate) fn charge(&mut self, tenant: TenantId, positions: usize) {
        self.bill(tenant, positions);
        if let Some(t) = self.tenants.get_mut(&tenant) {
            t.positions += positions as u64;
            if t.cfg.tokens_per_s.is_some() {
                t.bucket -= positions as f64;
            }
        }
    }

    /// Bill `positions` to `tenant`'s fair share (its virtual time), without counting them as
    /// computed for it.
    pub(crate) fn bill(&mut self, tenant: TenantId, positions: usize) {
        if let Some(t) = self.tenants.get_mut(&tenant) {
            t.vtime += positions as f64 / t.cfg.weight;
            t.billed += positions as u64;
        }
    }

    /// Positions billed to `tenant`'s fair share so far: what its sessions computed, less the
    /// recomputes others' evictions caused, plus those it caused.
    pub fn tenant_billed(&self, tenant: TenantId) -> u64 {
        self.tenants.get(&tenant).map_or(0, |t| t.billed)
    }

    /// Refill the rate quotas' buckets up to `now_ms`.
    pub(crate) fn refill(&mut self, now_ms: u64) {
        let burst_floor = self.cfg.token_budget as f64;
        for t in self.tenants.values_mut() {
            let Some(rate) = t.cfg.tokens_per_s else {
                continue;
            };
            let burst = rate.max(burst_floor);
            t.bucket = match t.filled_at {
                None => burst,
                Some(at) => {
                    (t.bucket + rate * now_ms.saturating_sub(at) as f64 / 1000.0).min(burst)
                }
            };
            t.filled_at = Some(now_ms);
        }
    }

    /// Whether `tenant` may compute now (its rate quota has tokens left).
    pub(crate) fn within_rate(&self, tenant: TenantId) -> bool {
        self.tenants
            .get(&tenant)
            .is_none_or(|t| t.cfg.tokens_per_s.is_none() || t.bucket > 0.0)
    }
}
