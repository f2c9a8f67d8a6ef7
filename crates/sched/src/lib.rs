//! Tandem's multi-tenant scheduler: pure, deterministic, no tensors, sockets or clocks.
//!
//! One rule, as in vLLM v1: every session has tokens the cloud *knows* (its prompt and committed
//! history, then each queued verify block) and tokens whose KV it has *computed*; each iteration
//! lets computed catch up with known under a token budget. Verify blocks are small and
//! latency-critical: they are scheduled first and whole; prompt prefill (and the recompute of a
//! preempted session) takes what budget is left, in chunks. A session whose edge has sent nothing
//! is simply not in the batch. Between tenants the budget is shared by weighted fair queueing,
//! charged in computed positions. When the page pool cannot hold a verify block, the least
//! recently active other session is preempted: its KV is dropped and recomputed later from its
//! committed tokens — the session and its committed tokens are never dropped.
//!
//! The shell calls [`Scheduler::schedule`], runs the returned [`Batch`] as one ragged forward,
//! and reports each session's KV length after it (a rejection truncates) with
//! [`Scheduler::update`].

pub mod pool;

mod admission;
mod eviction;
mod fairness;

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

pub use pool::{CacheCounts, PageHash, PagePool};

/// A session, speculation or cloud-only generation, as the verifier numbers it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct SessionId(pub u64);

/// A tenant: who pays for a session (an API key names one; 0 is the default tenant).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct TenantId(pub u32);

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::fmt::Display for TenantId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

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
    /// The session would outgrow every block it may ever hold (the pool, or its tenant's quota).
    #[error("the session has outgrown the KV cache: {tokens} tokens need {needed} blocks, at most {capacity} are available to it")]
    CannotFit {
        tokens: usize,
        needed: usize,
        capacity: usize,
    },
    #[error("a prompt of {len} tokens cannot fit the KV pool ({capacity} token slots)")]
    PromptTooLarge { len: usize, capacity: usize },
    /// The verifier is saturated: try again after about `retry_iterations` iterations.
    #[error("the verifier is saturated ({reason}); retry in about {retry_iterations} iterations")]
    Saturated {
        reason: String,
        retry_iterations: u64,
    },
    #[error("tenant {tenant} is at its quota of {limit} {what}")]
    QuotaExceeded {
        tenant: TenantId,
        what: &'static str,
        limit: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SchedConfig {
    /// Tokens one forward may compute, all sessions together.
    pub token_budget: usize,
    /// The KV page pool: tokens per page, and pages.
    pub page_size: usize,
    pub num_pages: usize,
    /// Admission: open sessions (all tenants) beyond which new ones are refused.
    pub max_sessions: usize,
    /// Admission: prompt tokens waiting for prefill beyond which new sessions are refused.
    pub max_waiting_tokens: usize,
    /// A session idle this long (ms: nothing queued since its last computed chunk) gives its KV
    /// to sessions that wait for room; so does one idle since before they started waiting.
    pub idle_evict_ms: u64,
    /// The prefix cache: a session's prompt starts from the KV pages of the same tokens (under
    /// the same salt) that earlier sessions computed, and its pages of committed tokens are kept
    /// for later ones (see [`pool`]).
    pub prefix_cache: bool,
    /// The token budget while sessions of two tenants or more are open (None: `token_budget`).
    /// A session's next token waits for the whole forward it is in, so a forward sized for one
    /// tenant's load slows every other tenant's tokens; sized by the forward's cost, this bounds
    /// that slowdown (a lone block that needs more still goes, within `token_budget`).
    pub contended_budget: Option<usize>,
}

impl SchedConfig {
    /// A budget and a pool, with admission limits that refuse only a verifier that is clearly
    /// behind: 1024 sessions, eight iterations' worth of waiting prompt tokens.
    pub fn new(token_budget: usize, page_size: usize, num_pages: usize) -> Self {
        Self {
            token_budget,
            page_size,
            num_pages,
            max_sessions: 1024,
            max_waiting_tokens: 8 * token_budget,
            idle_evict_ms: 500,
            prefix_cache: false,
            contended_budget: None,
        }
    }
}

/// A tenant's share and limits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantConfig {
    /// Share of the verifier under saturation, relative to other tenants' weights.
    pub weight: f64,
    /// Open sessions at once.
    pub max_sessions: Option<usize>,
    /// KV blocks held by all its sessions; past it the tenant's own least recently active
    /// session is preempted, never another tenant's.
    pub max_kv_blocks: Option<usize>,
    /// Positions computed per second (verify and prefill), a token bucket with one second of burst.
    pub tokens_per_s: Option<f64>,
    /// The salt of its pages' content addresses in the prefix cache. None, the default: its own
    /// (from its id), so that it never hits, nor learns by timing, another tenant's prompts.
    /// Tenants given the same salt share their cached pages (a public system prompt);
    /// [`shared_salt`] makes one from a name.
    pub cache_salt: Option<u64>,
}

/// The prefix-cache salt tenants opt into by sharing `name` (a tenant's own salt is its id, below
/// 2^32; a shared one has its top bit set, so that the two never meet).
pub fn shared_salt(name: &str) -> u64 {
    PageHash::next(None, 0, &name.bytes().map(u32::from).collect::<Vec<_>>()).0 as u64 | 1 << 63
}

impl Default for TenantConfig {
    fn default() -> Self {
        Self {
            weight: 1.0,
            max_sessions: None,
            max_kv_blocks: None,
            tokens_per_s: None,
            cache_salt: None,
        }
    }
}

impl TenantConfig {
    pub fn weight(weight: f64) -> Self {
        Self {
            weight,
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum WorkKind {
    /// Prompt prefill, or recomputing a preempted session's committed history.
    Prefill,
    /// Decoding: a speculation session's draft block to verify, or the one token the verifier
    /// decodes itself (a taken-over session, a cloud-only generation), with any unfed committed
    /// token in front.
    Decode,
}

/// One session's share of an iteration: compute positions `start .. start + len`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Chunk {
    pub session: SessionId,
    pub start: usize,
    pub len: usize,
    pub kind: WorkKind,
    /// The session's KV page table, holding at least `start + len` slots.
    pub pages: Vec<u32>,
}

/// What to run this iteration.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Batch {
    pub iteration: u64,
    pub chunks: Vec<Chunk>,
    /// Sessions whose KV was dropped to make room; they recompute later.
    pub preempted: Vec<SessionId>,
    /// Sessions of two tenants or more were open: the batch kept to the contended budget
    /// ([`SchedConfig::contended_budget`]), if there is one.
    pub contended: bool,
}

impl Batch {
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
    /// When (ms) it last had a chunk planned.
    last_planned_ms: u64,
    /// Its prompt was computed once: after preemption it is recomputed only when it has a verify
    /// block again (an idle session costs nothing).
    prefilled: bool,
    arrival: u64,
    /// Preempted by another tenant's session: that tenant, and the positions (from 0) it owes
    /// the recompute of.
    evicted_by: Option<(TenantId, usize)>,
    /// The content addresses of its full pages of known tokens, as far as computed, and how
    /// many of its pages (from the first) are published or were attached from the cache.
    hashes: Vec<PageHash>,
    published: usize,
    /// Its work runs in the background ([`Scheduler::set_background`]): only in a forward that
    /// no other tenant is waiting on.
    background: bool,
}

impl Session {
    /// Tokens to compute before anything else: the prompt, or a preempted history that a queued
    /// verify block needs.
    fn needs_compute(&self) -> bool {
        self.computed < self.known && (!self.prefilled || !self.verifies.is_empty())
    }
}

#[derive(Debug, Clone)]
struct Tenant {
    cfg: TenantConfig,
    /// Token bucket of the rate quota, and when it was last filled (ms).
    bucket: f64,
    filled_at: Option<u64>,
    /// Virtual time: computed positions charged to the tenant over its weight.
    vtime: f64,
    /// Positions computed for the tenant in all.
    positions: u64,
    /// Positions billed to its fair share (see [`Scheduler::tenant_billed`]).
    billed: u64,
}

/// Counters of the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SchedStats {
    pub iterations: u64,
    pub preemptions: u64,
    /// Most iterations a verify block waited between arriving and being scheduled.
    pub max_verify_wait: u64,
    /// Sessions refused at admission (saturated or over quota).
    pub refused: u64,
    /// Prompt tokens looked up in the prefix cache, and those found (vLLM's
    /// `prefix_cache_queries` and `prefix_cache_hits`).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

pub struct Scheduler {
    cfg: SchedConfig,
    pool: PagePool,
    sessions: BTreeMap<SessionId, Session>,
    tenants: BTreeMap<TenantId, Tenant>,
    iteration: u64,
    /// The clock of the last `schedule` call.
    now_ms: u64,
    stats: SchedStats,
}

/// A contended budget, when there is one, is at least a token.
fn check_contended_budget(budget: Option<usize>) -> Result<(), SchedError> {
    if budget == Some(0) {
        return Err(SchedError::InvalidConfig(
            "contended_budget must be at least 1".into(),
        ));
    }
    Ok(())
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Result<Self, SchedError> {
        if cfg.token_budget == 0 {
            return Err(SchedError::InvalidConfig(
                "token_budget must be at least 1".into(),
            ));
        }
        check_contended_budget(cfg.contended_budget)?;
        Ok(Self {
            pool: PagePool::new(cfg.num_pages, cfg.page_size)?,
            cfg,
            sessions: BTreeMap::new(),
            tenants: BTreeMap::new(),
            iteration: 0,
            now_ms: 0,
            stats: SchedStats::default(),
        })
    }

    /// See [`SchedConfig::contended_budget`].
    pub fn set_contended_budget(&mut self, budget: Option<usize>) -> Result<(), SchedError> {
        check_contended_budget(budget)?;
        self.cfg.contended_budget = budget;
        Ok(())
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }
    pub fn stats(&self) -> SchedStats {
        self.stats
    }
    pub fn config(&self) -> SchedConfig {
        self.cfg
    }

    /// Add a tenant or change its share and limits. Weights and rates must be positive and finite.
    pub fn set_tenant(&mut self, id: TenantId, cfg: TenantConfig) -> Result<(), SchedError> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(cfg.weight) {
            return Err(SchedError::InvalidConfig(format!(
                "tenant {id}: weight must be positive, got {}",
                cfg.weight
            )));
        }
        if let Some(r) = cfg.tokens_per_s.filter(|&r| !positive(r)) {
            return Err(SchedError::InvalidConfig(format!(
                "tenant {id}: tokens_per_s must be positive, got {r}"
            )));
        }
        let t = self.tenants.entry(id).or_insert(Tenant {
            cfg,
            bucket: 0.0,
            filled_at: None,
            vtime: 0.0,
            positions: 0,
            billed: 0,
        });
        t.cfg = cfg;
        Ok(())
    }

    /// Open sessions of `tenant`.
    pub fn tenant_sessions(&self, tenant: TenantId) -> usize {
        self.sessions
            .values()
            .filter(|s| s.tenant == tenant)
            .count()
    }

    /// KV blocks charged to `tenant`'s sessions: a page several sessions hold (a cached
    /// prefix) counts once, against the earliest of them ([`PagePool::charged`]).
    pub fn tenant_blocks(&self, tenant: TenantId) -> usize {
        self.sessions
            .iter()
            .filter(|(_, s)| s.tenant == tenant)
            .map(|(id, _)| self.pool.charged(*id))
            .sum()
    }

    /// The salt of `tenant`'s content addresses (see [`TenantConfig::cache_salt`]).
    fn salt(&self, tenant: TenantId) -> u64 {
        self.tenants
            .get(&tenant)
            .and_then(|t| t.cfg.cache_salt)
            .unwrap_or(u64::from(tenant.0))
    }

    /// Session `id`'s tokens known to the cloud, and those whose KV is computed.
    pub fn session_kv(&self, id: SessionId) -> Option<(usize, usize)> {
        self.sessions.get(&id).map(|s| (s.known, s.computed))
    }

    /// Open sessions, all tenants.
    pub fn num_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Whether any session has work to plan: tokens to (re)compute or a verify block.
    pub fn has_work(&self) -> bool {
        self.sessions
            .values()
            .any(|s| s.needs_compute() || !s.verifies.is_empty())
    }

    /// Positions computed for `tenant` so far.
    pub fn tenant_positions(&self, tenant: TenantId) -> u64 {
        self.tenants.get(&tenant).map_or(0, |t| t.positions)
    }

    /// A new session with `prompt` to prefill. With the prefix cache on, it starts from the
    /// cached pages its prompt matches under its tenant's salt, up to the last token's page (the
    /// last token is always computed: its logits give the first token). The prompt tokens served
    /// from the cache.
    pub fn open(
        &mut self,
        id: SessionId,
        tenant: TenantId,
        prompt: &[u32],
    ) -> Result<usize, SchedError> {
        let prompt_len = prompt.len();
        if self.sessions.contains_key(&id) {
            return Err(SchedError::DuplicateSession(id));
        }
        // With the prefix cache, only the tokens it does not hold wait for prefill.
        let mut hashes = Vec::new();
        let mut new = prompt_len;
        if self.cfg.prefix_cache {
            let ps = self.pool.page_size();
            PageHash::extend_chain(&mut hashes, self.salt(tenant), ps, prompt);
            let n = (prompt_len.saturating_sub(1) / ps).min(hashes.len());
            new -= self.pool.lookup(&hashes[..n]).len() * ps;
        }
        if let Err(e) = self.admit_new(tenant, prompt_len, new) {
            if matches!(
                e,
                SchedError::Saturated { .. } | SchedError::QuotaExceeded { .. }
            ) {
                self.stats.refused += 1;
            }
            return Err(e);
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
                last_planned_ms: self.now_ms,
                prefilled: false,
                arrival: self.iteration,
                evicted_by: None,
                hashes,
                published: 0,
                background: false,
            },
        );
        if !self.cfg.prefix_cache {
            return Ok(0);
        }
        let cached = self.attach_cached(id, prompt_len - 1);
        self.stats.prefix_queries += prompt_len as u64;
        self.stats.prefix_hits += cached as u64;
        Ok(cached)
    }

    /// `id`, which holds no KV, takes the cached pages that match its first `upto` tokens; the
    /// tokens it now has computed.
    fn attach_cached(&mut self, id: SessionId, upto: usize) -> usize {
        let ps = self.pool.page_size();
        let Some(s) = self.sessions.get_mut(&id) else {
            return 0;
        };
        let n = (upto / ps).min(s.hashes.len());
        let pages = self.pool.lookup(&s.hashes[..n]);
        if pages.is_empty() || self.pool.attach(id, &pages).is_err() {
            return 0;
        }
        s.computed = pages.len() * ps;
        s.published = pages.len();
        s.computed
    }

    /// Publish `id`'s pages that now hold committed tokens only (known and computed) in the
    /// prefix cache; `tokens` are its tokens from position 0 (at least its known ones). Nothing
    /// without the prefix cache.
    pub fn publish(&mut self, id: SessionId, tokens: &[u32]) {
        if !self.cfg.prefix_cache {
            return;
        }
        let ps = self.pool.page_size();
        let Some(tenant) = self.sessions.get(&id).map(|s| s.tenant) else {
            return;
        };
        let salt = self.salt(tenant);
        let s = self.sessions.get_mut(&id).expect("checked");
        let full = s.computed.min(s.known).min(tokens.len()) / ps;
        if full <= s.published {
            return;
        }
        PageHash::extend_chain(&mut s.hashes, salt, ps, &tokens[..full * ps]);
        for i in s.published..full {
            self.pool.publish(id, i, s.hashes[i]);
        }
        s.published = full;
    }

    /// Blocks a session of `tenant` may ever hold: the pool, or less under its quota.
    fn block_capacity(&self, tenant: TenantId) -> usize {
        let quota = self.tenants.get(&tenant).and_then(|t| t.cfg.max_kv_blocks);
        quota.map_or(self.pool.num_pages(), |q| q.min(self.pool.num_pages()))
    }

    /// A verify block of `len` tokens arrived for `id` (to be computed whole, after what is known).
    /// Refused when it exceeds the token budget or the session could never hold it.
    pub fn enqueue_verify(&mut self, id: SessionId, len: usize) -> Result<(), SchedError> {
        self.room_for_verify(id, len, false)?;
        let it = self.iteration;
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(SchedError::UnknownSession(id))?;
        s.verifies.push_back((len, it));
        s.last_active = it;
        Ok(())
    }

    /// Replace `id`'s last queued verify (not yet planned) with one of `len` tokens, keeping its
    /// place: a speculation session's decode step becomes a block's verify when the block
    /// arrives before the step runs. Refused like [`enqueue_verify`](Self::enqueue_verify), and
    /// with `UnknownSession` when nothing is queued; nothing changes when refused.
    pub fn replace_verify(&mut self, id: SessionId, len: usize) -> Result<(), SchedError> {
        self.room_for_verify(id, len, true)?;
        if let Some(v) = self
            .sessions
            .get_mut(&id)
            .and_then(|s| s.verifies.back_mut())
        {
            v.0 = len;
        }
        Ok(())
    }

    /// Refuse a verify of `len` tokens that could never be computed: larger than the budget, or
    /// more KV than the session's tenant may hold (with its queued verifies, the last one
    /// `replaced`).
    fn room_for_verify(&self, id: SessionId, len: usize, replaced: bool) -> Result<(), SchedError> {
        if len > self.cfg.token_budget {
            return Err(SchedError::BlockTooLarge {
                len,
                budget: self.cfg.token_budget,
            });
        }
        let s = self
            .sessions
            .get(&id)
            .ok_or(SchedError::UnknownSession(id))?;
        let mut queued: usize = s.verifies.iter().map(|v| v.0).sum();
        if replaced {
            queued -= s.verifies.back().ok_or(SchedError::UnknownSession(id))?.0;
        }
        let tokens = s.known + queued + len;
        let (needed, capacity) = (self.pool.pages_for(tokens), self.block_capacity(s.tenant));
        if needed > capacity {
            return Err(SchedError::CannotFit {
                tokens,
                needed,
                capacity,
            });
        }
        Ok(())
    }

    pub fn close(&mut self, id: SessionId) {
        self.sessions.remove(&id);
        self.pool.free_all(id);
    }

    /// The weighted share of the tenants with prompt tokens waiting, among the tenants with
    /// sessions open.
    fn waiting_share(&self) -> f64 {
        let (mut open, mut waiting) = (BTreeMap::new(), BTreeMap::new());
        for s in self.sessions.values() {
            let w = self.tenants.get(&s.tenant).map_or(0.0, |t| t.cfg.weight);
            open.insert(s.tenant, w);
            if s.needs_compute() && !s.background {
                waiting.insert(s.tenant, w);
            }
        }
        let total: f64 = open.values().sum();
        waiting.values().sum::<f64>() / total.max(f64::MIN_POSITIVE)
    }

    /// Put session `id`'s decode work in the background, or back: a background session's next
    /// block (or token) is planned only into a forward that no other tenant is waiting on — none
    /// of another tenant's foreground sessions has work — so it never lengthens another tenant's
    /// forward and runs on what would otherwise be idle time, and background work takes at most
    /// the contended budget of a forward, so that a request that arrives meanwhile waits for a
    /// short forward at most. The same holds for its prompt's prefill (and recompute). (The
    /// verifier puts a speculation session there whose edge has gone quiet: its work is paid by
    /// its own tenant's idle time, not by everyone's.)
    pub fn set_background(&mut self, id: SessionId, background: bool) {
        if let Some(s) = self.sessions.get_mut(&id) {
            s.background = background;
        }
    }

    /// What background work may still add to `batch`: background work runs in forwards no
    /// longer than a contended one, so that whoever arrives meanwhile waits for a short forward
    /// at most.
    fn background_room(&self, batch: &Batch) -> usize {
        let cap = self.cfg.contended_budget.unwrap_or(self.cfg.token_budget);
        let used: usize = batch
            .chunks
            .iter()
            .filter(|c| self.sessions.get(&c.session).is_some_and(|s| s.background))
            .map(|c| c.len)
            .sum();
        cap.saturating_sub(used)
    }

    /// The tenants with a foreground session that has work (a block to verify, tokens to
    /// compute), once per plan: what a background session must not hold back.
    fn foreground_waiting(&self) -> Vec<TenantId> {
        let mut v: Vec<TenantId> = self
            .sessions
            .values()
            .filter(|s| !s.background && (s.needs_compute() || !s.verifies.is_empty()))
            .map(|s| s.tenant)
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Whether another tenant than `tenant` waits on the forward `batch` plans: one of the
    /// `waiting` tenants ([`Scheduler::foreground_waiting`] when the plan began: those planned
    /// since are in the batch), or a chunk of its in the batch.
    fn others_waiting(&self, tenant: TenantId, batch: &Batch, waiting: &[TenantId]) -> bool {
        waiting.iter().any(|&w| w != tenant)
            || batch.chunks.iter().any(|c| {
                self.sessions
                    .get(&c.session)
                    .is_some_and(|s| s.tenant != tenant)
            })
    }

    /// Sessions with work of `kind`, in fair order: foreground before background, then lowest
    /// tenant virtual time, then oldest.
    fn candidates(&self, kind: WorkKind) -> Vec<SessionId> {
        let mut v: Vec<(bool, f64, u64, SessionId)> = self
            .sessions
            .iter()
            .filter(|(_, s)| match kind {
                WorkKind::Decode => s.computed == s.known && !s.verifies.is_empty(),
                WorkKind::Prefill => s.needs_compute(),
            })
            .map(|(id, s)| {
                let vt = self.tenants.get(&s.tenant).map_or(0.0, |t| t.vtime);
                // Verify: oldest block first. Prefill: least recently served first, so one long
                // prompt does not hold the others back until it is done.
                let since = match kind {
                    WorkKind::Decode => s.verifies.front().map_or(0, |v| v.1),
                    WorkKind::Prefill => s.last_active,
                };
                (s.background, vt, since, *id)
            })
            .collect();
        v.sort_by(|a, b| {
            a.0.cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(a.3.cmp(&b.3))
        });
        v.into_iter().map(|x| x.3).collect()
    }

    /// Whether sessions of two tenants or more are open.
    pub fn contended(&self) -> bool {
        let mut tenants = self.sessions.values().map(|s| s.tenant);
        let first = tenants.next();
        tenants.any(|t| Some(t) != first)
    }

    /// The token budget of the next forward: [`SchedConfig::contended_budget`] while sessions of
    /// two tenants or more are open, else [`SchedConfig::token_budget`].
    pub fn budget(&self) -> usize {
        self.budget_when(self.contended())
    }

    /// [`Scheduler::budget`], given whether sessions of two tenants or more are open.
    fn budget_when(&self, contended: bool) -> usize {
        let full = self.cfg.token_budget;
        match self.cfg.contended_budget {
            Some(c) if c < full && contended => c,
            _ => full,
        }
    }

    /// Plan the next iteration; `now_us` is the driver's clock, for the rate quotas.
    pub fn schedule(&mut self, now_us: u64) -> Batch {
        let now_ms = now_us / 1000;
        self.refill(now_ms);
        self.now_ms = self.now_ms.max(now_ms);
        self.iteration += 1;
        self.stats.iterations += 1;
        let mut batch = Batch {
            iteration: self.iteration,
            ..Batch::default()
        };
        batch.contended = self.contended();
        let full = self.budget_when(batch.contended);
        let mut budget = full;
        let mut taken: Vec<SessionId> = Vec::new();
        // Verify comes first, but while prompts wait it leaves them a quarter of the budget, so a
        // busy verifier still admits new sessions (a lone block that needs more still goes).
        let prompts_wait = self
            .sessions
            .values()
            .any(|s| s.needs_compute() && !s.background);
        let reserve = if !prompts_wait {
            0
        } else if full < self.cfg.token_budget {
            // Between tenants, the prompts waiting keep their tenants' share of the forward (a
            // quarter at least, half at most), so that another tenant's decoding does not hold
            // back their first token.
            let share = (full as f64 * self.waiting_share()).ceil() as usize;
            share.clamp((full / PREFILL_RESERVE_DIV).max(1), (full / 2).max(1))
        } else {
            full / PREFILL_RESERVE_DIV
        };
        let waiting = self.foreground_waiting();
        self.schedule_decodes(&mut batch, &mut taken, &mut budget, reserve, &waiting);
        // While sessions decode (verify work ran), prompts get at most a quarter of the budget
        // per forward: a burst of prompts lengthens everyone's forwards, and so their ITL, by
        // that much at most.
        if !batch.chunks.is_empty() {
            budget = budget.min(reserve.max(full / PREFILL_RESERVE_DIV).max(1));
        }
        self.schedule_prefills(&mut batch, &mut taken, budget, &waiting);
        batch
    }

    /// Decode work first: each session's next block to verify (or its one token to decode),
    /// whole, one per session, in fair order (re-sorted after each charge), within `budget` less
    /// the `reserve` kept for waiting prompts (a lone block that needs more still goes). A
    /// session that needs KV preempts its own tenant's sessions past the tenant's quota, then
    /// the least recently active others.
    fn schedule_decodes(
        &mut self,
        batch: &mut Batch,
        taken: &mut Vec<SessionId>,
        budget: &mut usize,
        reserve: usize,
        waiting: &[TenantId],
    ) {
        loop {
            let next = self
                .candidates(WorkKind::Decode)
                .into_iter()
                .find(|id| !taken.contains(id));
            let Some(id) = next else { break };
            let s = &self.sessions[&id];
            let (len, since) = *s.verifies.front().expect("candidate has a block");
            let fits = len <= budget.saturating_sub(reserve)
                || (batch.chunks.is_empty() && len <= self.cfg.token_budget);
            if !fits {
                // Not this iteration; smaller blocks of others may still fit.
                taken.push(id);
                continue;
            }
            let start = s.computed;
            let tenant = s.tenant;
            if !self.within_rate(tenant)
                || (s.background
                    && ((len > self.background_room(batch) && !batch.chunks.is_empty())
                        || self.others_waiting(tenant, batch, waiting)))
            {
                taken.push(id);
                continue;
            }
            // Over its KV quota a tenant preempts its own sessions, never another tenant's.
            while self.pool.shortfall(id, start + len) > self.tenant_room(tenant) {
                let mut keep = taken.clone();
                keep.push(id);
                match self.preempt_one(&keep, Some(tenant), tenant) {
                    Some(v) => {
                        batch.preempted.push(v);
                        taken.push(v);
                    }
                    None => break,
                }
            }
            if self.pool.shortfall(id, start + len) > self.tenant_room(tenant) {
                taken.push(id);
                continue;
            }
            while self.pool.shortfall(id, start + len) > self.pool.num_free() {
                let mut keep = taken.clone();
                keep.push(id);
                match self.preempt_one(&keep, None, tenant) {
                    Some(v) => {
                        batch.preempted.push(v);
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
            s.last_planned_ms = self.now_ms;
            self.stats.max_verify_wait = self.stats.max_verify_wait.max(self.iteration - since);
            assert!(
                self.pool.writable(id, start, start + len),
                "invariant: a session never writes into a page it shares"
            );
            *budget = budget.saturating_sub(len);
            self.charge(tenant, len);
            batch.chunks.push(Chunk {
                session: id,
                start,
                len,
                kind: WorkKind::Decode,
                pages: self.pool.table(id).to_vec(),
            });
        }
    }

    /// Widen decode chunk `index` of `batch` (just planned, not yet run) by up to `extra`
    /// positions past its end — a session the verifier decodes alone, with guesses of its own to
    /// verify in the same forward — where that costs no one else: within the rate quota of its
    /// tenant and the KV pages free now (no preemption, within the tenant's KV quota). The
    /// caller bounds `extra` by the room the forward has. Returns the positions added, charged to
    /// the tenant like any computed position.
    pub fn widen(&mut self, batch: &mut Batch, index: usize, extra: usize) -> usize {
        let Some(c) = batch.chunks.get(index) else {
            return 0;
        };
        let Some(tenant) = self.sessions.get(&c.session).map(|s| s.tenant) else {
            return 0;
        };
        if c.kind != WorkKind::Decode || extra == 0 || !self.within_rate(tenant) {
            return 0;
        }
        let (id, end) = (c.session, c.start + c.len);
        let free = self.pool.num_free().min(self.tenant_room(tenant));
        let mut add = extra;
        while add > 0 && self.pool.shortfall(id, end + add) > free {
            add -= 1;
        }
        if add == 0 || self.pool.grow(id, end + add).is_err() {
            return 0;
        }
        assert!(
            self.pool.writable(id, end, end + add),
            "invariant: a session never writes into a page it shares"
        );
        self.charge(tenant, add);
        let c = &mut batch.chunks[index];
        c.len += add;
        c.pages = self.pool.table(id).to_vec();
        add
    }

    /// Prefill (and recompute) with what is left of `budget`, in chunks. It preempts only idle
    /// sessions (nothing queued) that have been idle since before it started waiting: a session
    /// whose edge went quiet does not keep its KV from those with work.
    fn schedule_prefills(
        &mut self,
        batch: &mut Batch,
        taken: &mut Vec<SessionId>,
        budget: usize,
        waiting: &[TenantId],
    ) {
        let mut left = budget;
        for id in self.candidates(WorkKind::Prefill) {
            if left == 0 {
                break;
            }
            let budget = left;
            if taken.contains(&id) {
                continue;
            }
            // A preempted session recomputes from what is still cached of its history (up to
            // its prompt's last token, when that token's logits are still to come).
            let s = &self.sessions[&id];
            if self.cfg.prefix_cache && s.computed == 0 && self.pool.held(id) == 0 {
                let upto = if s.prefilled { s.known } else { s.known - 1 };
                self.attach_cached(id, upto);
            }
            let s = &self.sessions[&id];
            let (start, known, tenant) = (s.computed, s.known, s.tenant);
            if start >= known {
                continue;
            }
            let since = s.verifies.front().map_or(s.last_active, |v| v.1);
            if !self.within_rate(tenant) {
                continue;
            }
            // A background session's prompt, like its decoding, goes only into a forward no
            // other tenant waits on, and within the background's share of it.
            let budget = match s.background {
                true if self.others_waiting(tenant, batch, waiting) => continue,
                true => budget.min(self.background_room(batch)),
                false => budget,
            };
            if budget == 0 {
                continue;
            }
            let bs = self.pool.page_size();
            let want = (known - start).min(budget);
            loop {
                let free = self.pool.num_free().min(self.tenant_room(tenant));
                let room = free * bs + (self.pool.held(id) * bs).saturating_sub(start);
                if room >= want {
                    break;
                }
                // Over its own quota only its own idle sessions can make room.
                let own = self.tenant_room(tenant) < self.pool.num_free();
                let mut keep = taken.clone();
                keep.push(id);
                let mut planned: Vec<SessionId> = batch.chunks.iter().map(|c| c.session).collect();
                planned.push(id);
                let v = self
                    .preempt_idle(&keep, since, own.then_some(tenant), tenant)
                    .or_else(|| {
                        if own {
                            return None;
                        }
                        // (Sessions passed over this iteration hold nothing it needs.)
                        self.preempt_over_share(&planned, tenant)
                    })
                    // A pool full of prompts half prefilled would wait forever: the oldest
                    // prompt takes the pages of a younger one.
                    .or_else(|| self.preempt_younger_prompt(&planned, id, own.then_some(tenant)));
                match v {
                    Some(v) => batch.preempted.push(v),
                    None => break,
                }
            }
            let free = self.pool.num_free().min(self.tenant_room(tenant));
            let room = free * self.pool.page_size()
                + (self.pool.held(id) * self.pool.page_size()).saturating_sub(start);
            let len = (known - start).min(budget).min(room);
            if len == 0 {
                continue;
            }
            if self.pool.grow(id, start + len).is_err() {
                continue;
            }
            assert!(
                self.pool.writable(id, start, start + len),
                "invariant: a session never writes into a page it shares"
            );
            taken.push(id);
            left -= len;
            self.charge_prefill(id, tenant, start, len);
            if let Some(s) = self.sessions.get_mut(&id) {
                s.last_active = self.iteration;
                s.last_planned_ms = self.now_ms;
            }
            batch.chunks.push(Chunk {
                session: id,
                start,
                len,
                kind: WorkKind::Prefill,
                pages: self.pool.table(id).to_vec(),
            });
        }
    }

    /// The batch ran. `kv_len` gives, for decode chunks, each session's KV length after its verdict
    /// (a rejection truncates), and for a chunk whose forward failed, its start (nothing was
    /// computed); prefill chunks not listed computed what they were given. Whatever the cloud
    /// committed is then known.
    pub fn update(&mut self, batch: &Batch, kv_len: &[(SessionId, usize)]) {
        for c in &batch.chunks {
            let Some(s) = self.sessions.get_mut(&c.session) else {
                continue; // closed meanwhile
            };
            let mut end = c.start + c.len;
            if let Some(&(_, kv)) = kv_len.iter().find(|(id, _)| *id == c.session) {
                end = end.min(kv);
            }
            if c.kind == WorkKind::Decode {
                s.known = end;
            }
            s.prefilled |= end >= s.known;
            // The pool keeps less only when the end falls in a shared page (never, as only
            // pages of committed tokens are shared): then that page is computed again.
            let kept = self.pool.truncate(c.session, end);
            s.computed = end.min(kept);
            s.published = s.published.min(kept / self.pool.page_size());
        }
    }
}

#[cfg(test)]
mod tests;
