//! [`VerifierCore`]: the target driven by the multi-tenant [`Scheduler`], with one record per
//! session. The scheduler makes every iteration's batch (decode work first and whole: draft blocks
//! to verify, tokens to decode; then chunks of prompt prefill and the recompute of preempted
//! sessions, under one token budget, over its own KV page pool); the core turns the batch into one
//! ragged forward over the scheduler's page tables,
//! folds the logits into verdicts and tokens, and reports back. The scheduler never sees a tensor;
//! the engine never allocates.
//!
//! Each session keeps the tokens its target KV holds (`history`), so a preempted session is
//! recomputed from them and resumes exactly where it was: the same positions, the same logits.
//!
//! A session is created in one place ([`VerifierCore::receive`] of an open) and closed in one
//! place ([`VerifierCore::close`]): its record, its scheduler entry and KV pages, and its part of
//! the load control go together.

use std::collections::{BTreeMap, VecDeque};

use tandem_engine::Engine;
use tandem_sched::{SchedConfig, Scheduler, SessionId, TenantConfig, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::VerifyRule;

use crate::control::{Ctl, LoadConfig, LoadControl};
use crate::session::{Meter, Session, SessionState, VerifierStats, Work};
use crate::{Target, VerifierError};

/// Blocks one session may have waiting behind the one being verified (a well-behaved edge has at
/// most its granted depth in flight).
pub const MAX_QUEUED_BLOCKS: usize = tandem_spec::pipeline::MAX_BLOCKS_IN_FLIGHT;

/// Settings of the verifier's scheduler, checked by [`VerifierCore::new`] (also `tandem cloud
/// serve`'s flags), and how it meets its load.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct VerifierConfig {
    /// Tokens one forward may compute, all sessions together (verify blocks first, then chunks
    /// of prompt prefill).
    #[arg(long, default_value_t = DEFAULTS.token_budget)]
    pub token_budget: usize,
    /// Admission: open sessions beyond which new ones are refused (RESOURCE_EXHAUSTED).
    #[arg(long, default_value_t = DEFAULTS.max_sessions)]
    pub max_sessions: usize,
    /// Admission: prompt tokens waiting for prefill beyond which new sessions are refused.
    #[arg(long, default_value_t = DEFAULTS.max_waiting_tokens)]
    pub max_waiting_tokens: usize,
    /// While sessions of two tenants or more are open, plan forwards that take at most this
    /// percent of a one-token forward (by the measured forward cost): one tenant's load slows
    /// another tenant's tokens by at most this much. 0: no such limit, only --token-budget.
    #[arg(long, default_value_t = DEFAULTS.tenant_slowdown_pct)]
    pub tenant_slowdown_pct: u32,
    /// Before decoding a token of a speculating session alone (it has no block to verify),
    /// wait up to this many ms for its edge's next block, and verify every block (as protocol 1
    /// did). 0, the default: never wait (the verifier never idles a session). For tests and
    /// measurements of the draft as such: its blocks are judged however slow it is beside the
    /// target. A session taken over or granted γ 0 is decoded at once; an edge that drafts
    /// nothing (its draft paused as almost always wrong) gets a token per wait.
    #[arg(long, default_value_t = DEFAULTS.await_drafts_ms)]
    pub await_drafts_ms: u64,
    /// Compute every prompt in full: no prefix cache. By default a prompt starts from the KV
    /// pages of the same tokens its tenant (or tenants sharing its salt) sent before, and each
    /// session's pages of committed tokens are kept, while the pool has room, for the next
    /// turn of a conversation.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// When it decodes a session alone (no usable block from its edge, a cloud-only generation
    /// that asked for it), verify up to this many guesses copied from the session's own text
    /// (prompt and output: the continuation of its longest earlier match) in the same forward,
    /// where the forward has room below the target's ridge. 0: never.
    #[arg(long, default_value_t = DEFAULTS.self_draft_max)]
    pub self_draft_max: usize,
    /// The shortest match of a session's text's end (in tokens) the verifier copies guesses
    /// after (one guess per matched token, at most --self-draft-max).
    #[arg(long, default_value_t = DEFAULTS.self_draft_min_match)]
    pub self_draft_min_match: usize,
    /// Grants, takeovers and the idle timeout (`cloud serve` builds it from its own flags and
    /// the measured forward cost). Default: every session keeps the shape it asks for.
    #[arg(skip)]
    #[serde(skip)]
    pub load: LoadConfig,
}

/// The smallest contended budget: one session's token and a waiting prompt's chunk.
const MIN_CONTENDED: usize = 2;

/// How far one forward moves the contended budget towards what it measured.
const CONTENDED_SMOOTHING: f64 = 0.25;

const DEFAULTS: VerifierConfig = VerifierConfig {
    token_budget: 64,
    max_sessions: 1024,
    max_waiting_tokens: 4096,
    tenant_slowdown_pct: 125,
    await_drafts_ms: 0,
    no_prefix_cache: false,
    self_draft_max: tandem_spec::SuffixPolicy::DEFAULT.max_tokens,
    self_draft_min_match: tandem_spec::SuffixPolicy::DEFAULT.min_match,
    load: LoadConfig::FIXED,
};

impl VerifierConfig {
    /// The budget while tenants share the verifier (see [`SchedConfig::contended_budget`]): a
    /// forward-time target of [`VerifierConfig::tenant_slowdown_pct`] of a one-token forward,
    /// and the largest forward the cost model predicts within it (at least two tokens, a
    /// session's and a waiting prompt's; at most the token budget). None: no such limit (0 percent).
    pub fn contended_budget(
        &self,
        cost: &tandem_spec::capacity::ForwardCost,
    ) -> Option<ContendedBudget> {
        if self.tenant_slowdown_pct == 0 {
            return None;
        }
        let slowdown = f64::from(self.tenant_slowdown_pct) / 100.0;
        let tokens = (cost.one_token_ms * slowdown / cost.ms_per_token)
            .floor()
            .clamp(
                MIN_CONTENDED as f64,
                self.token_budget.max(MIN_CONTENDED) as f64,
            );
        Some(ContendedBudget {
            one_token_ms: cost.one_token_ms,
            slowdown,
            tokens: tokens as usize,
        })
    }
}

/// How large a forward may be while tenants share the verifier: at most `slowdown` times a
/// one-token forward's time, and the tokens that take it. Both the one-token time and the
/// tokens start from the cost model and follow the forwards that run
/// ([`VerifierCore::set_contended_budget`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContendedBudget {
    pub one_token_ms: f64,
    pub slowdown: f64,
    pub tokens: usize,
}

impl ContendedBudget {
    /// The longest a forward should take.
    pub fn target_ms(&self) -> f64 {
        self.one_token_ms * self.slowdown
    }
}

impl Default for VerifierConfig {
    fn default() -> Self {
        DEFAULTS
    }
}

/// See the module docs. `H` is the driver's handle to each session's edge, kept in the session's
/// record and handed back with every message for it.
pub struct VerifierCore<T: Target = Engine, H = ()> {
    pub(crate) engine: T,
    pub(crate) sched: Scheduler,
    pub(crate) sessions: BTreeMap<SessionId, Session<H>>,
    pub(crate) control: LoadControl,
    /// Answers decided when a message arrived (a stale block, an early verdict, a refusal), sent
    /// with the next turn.
    pub(crate) held: Vec<crate::session::Event>,
    /// Sessions ended outside an iteration (refused at admission, cancelled by their tenant,
    /// shut down), told so with the next turn.
    pub(crate) dismissed: Vec<(SessionId, H, VerifierError)>,
    /// Draining: new sessions are refused, open ones go on ([`VerifierCore::drain`]).
    pub(crate) draining: bool,
    /// Sessions that ended (a finished generation, anything that failed for good), closed once
    /// their last messages are out, by the turn that sends them. Every place that ends a
    /// session with a fatal error puts it here.
    pub(crate) ended: Vec<SessionId>,
    /// Mean forward time (ms), for the retry hint of a refused session.
    pub(crate) iteration_ms: f64,
    /// The driver's clock at the last message or turn (µs).
    pub(crate) now_us: u64,
    /// The contended budget's target and its tokens now, unrounded
    /// ([`VerifierCore::set_contended_budget`]).
    pub(crate) contended: Option<(ContendedBudget, f64)>,
    /// What the sessions that ended used, told with the next turn ([`Turn::finished`]).
    pub(crate) finished: Vec<crate::Usage>,
    /// [`VerifierConfig::await_drafts_ms`], in µs.
    pub(crate) await_drafts_us: u64,
    /// How sessions that asked for it are drafted for from their own text
    /// ([`VerifierConfig::self_draft_max`]; None: never).
    pub(crate) self_draft: Option<tandem_spec::SuffixPolicy>,
    /// How often the guesses it copied for its sessions were accepted, over all of them: each
    /// new session's drafter starts from it.
    pub(crate) guess_record: tandem_spec::GuessRecord,
    /// What a position costs its small forwards, as measured.
    pub(crate) position_fit: PositionFit,
    /// What it grants, and its idle timeout ([`VerifierConfig::load`]).
    pub(crate) load: LoadConfig,
    /// No opened session can be idle before this (µs): a lower bound of their idle deadlines,
    /// set by each scan and by each `Opened`, so that a turn scans the sessions only when one
    /// may be due (u64::MAX: none open).
    pub(crate) idle_check_us: u64,
    pub stats: VerifierStats,
}

/// What one more position costs a small forward, beside a one-token forward, as measured: a
/// least-squares line through the recent forwards of at most [`PositionFit::MAX_TOKENS`]
/// positions (decayed), its slope over its one-token time. On a CPU a forward grows with its
/// tokens well below the roofline's ridge; on a GPU it barely does. None until the forwards'
/// sizes vary enough to fit a slope.
#[derive(Debug, Clone, Default)]
pub(crate) struct PositionFit {
    /// Decayed sums: weight, x, y, x², xy (x the positions, y the forward's ms).
    sums: [f64; 5],
}

impl PositionFit {
    const MAX_TOKENS: usize = 32;
    const DECAY: f64 = 0.995;
    /// At least this much weight and this variance of the sizes before the fit is used.
    const MIN_WEIGHT: f64 = 20.0;
    const MIN_VARIANCE: f64 = 0.25;

    pub(crate) fn observe(&mut self, tokens: usize, ms: f64) {
        if tokens == 0 || tokens > Self::MAX_TOKENS || !ms.is_finite() || ms <= 0.0 {
            return;
        }
        let x = tokens as f64;
        for (s, v) in self.sums.iter_mut().zip([1.0, x, ms, x * x, x * ms]) {
            *s = Self::DECAY * *s + v;
        }
    }

    /// The fitted cost of a position over a one-token forward's time.
    pub(crate) fn cost(&self) -> Option<f64> {
        let [w, x, y, xx, xy] = self.sums;
        if w < Self::MIN_WEIGHT {
            return None;
        }
        let (mx, my) = (x / w, y / w);
        let var = xx / w - mx * mx;
        if var < Self::MIN_VARIANCE {
            return None;
        }
        let slope = (xy / w - mx * my) / var;
        let one = my - slope * (mx - 1.0);
        (one > 0.0).then(|| (slope / one).clamp(0.0, 1.0))
    }
}

impl<T: Target, H> VerifierCore<T, H> {
    /// A guessed position's cost beside a one-token forward: as measured on this target's
    /// small forwards ([`PositionFit`]), else the configured forward cost's compute slope (below
    /// the ridge a CPU's forward still grows with its tokens), else the default.
    pub(crate) fn position_cost(&self) -> f64 {
        self.position_fit.cost().unwrap_or_else(|| {
            self.load
                .forward_cost
                .map_or(tandem_spec::suffix::DEFAULT_POSITION_COST, |c| {
                    c.ms_per_token / c.one_token_ms.max(1e-9)
                })
        })
    }

    /// A verifier over `engine`, whose KV cache becomes the scheduler's page pool. One tenant, 0,
    /// exists with weight 1 and no quota. Grants follow [`VerifierConfig::load`] from `now_us`
    /// on the driver's clock. (A token tree's side nodes are the transport's to bound: the gRPC
    /// service checks them against `LoadConfig::within_budget`.)
    pub fn new(engine: T, cfg: VerifierConfig, now_us: u64) -> Result<Self, VerifierError> {
        let (page_size, num_pages) = engine.kv_geometry();
        let sched = Scheduler::new(SchedConfig {
            max_sessions: cfg.max_sessions,
            max_waiting_tokens: cfg.max_waiting_tokens,
            prefix_cache: !cfg.no_prefix_cache,
            ..SchedConfig::new(cfg.token_budget, page_size, num_pages)
        })?;
        let load = cfg.load.within_budget(cfg.token_budget);
        let mut v = Self {
            engine,
            sched,
            sessions: BTreeMap::new(),

            control: LoadControl::new(load.grants(), now_us),
            load,
            idle_check_us: u64::MAX,
            held: Vec::new(),
            dismissed: Vec::new(),
            draining: false,
            ended: Vec::new(),
            iteration_ms: 50.0,
            now_us: 0,
            contended: None,
            finished: Vec::new(),
            await_drafts_us: cfg.await_drafts_ms.saturating_mul(1000),
            self_draft: (cfg.self_draft_max > 0).then_some(tandem_spec::SuffixPolicy {
                max_tokens: cfg.self_draft_max,
                min_match: cfg.self_draft_min_match.max(1),
                ..tandem_spec::SuffixPolicy::DEFAULT
            }),
            guess_record: Default::default(),
            position_fit: PositionFit::default(),
            stats: VerifierStats::default(),
        };
        v.set_tenant(TenantId(0), TenantConfig::default())?;
        Ok(v)
    }

    /// While sessions of two tenants or more are open, keep each forward to `budget`. Every
    /// forward moves its one-token time (a forward of two tokens at most: memory-bound, and what
    /// the cost model's start-up calibration, run cold and alone, misses while serving), and
    /// every forward while tenants share the verifier moves its tokens towards what would have
    /// taken the target at that forward's pace (the cost model is fitted to one sequence's
    /// forwards; a ragged batch of many sessions costs more). None: the token budget always.
    pub fn set_contended_budget(
        &mut self,
        budget: Option<ContendedBudget>,
    ) -> Result<(), VerifierError> {
        self.sched.set_contended_budget(budget.map(|b| b.tokens))?;
        self.contended = budget.map(|b| (b, b.tokens as f64));
        Ok(())
    }

    /// The contended budget now, in tokens (see [`VerifierCore::set_contended_budget`]).
    #[cfg(test)]
    pub(crate) fn contended_tokens(&self) -> Option<usize> {
        self.sched.config().contended_budget
    }

    /// A forward of `tokens` tokens took `ms`: follow the one-token time with it, and correct
    /// the contended budget by it (`contended`: tenants shared the verifier) when it was
    /// (nearly) full or too slow.
    pub(crate) fn adapt_contended(&mut self, tokens: usize, ms: f64, contended: bool) {
        let Some((b, cap)) = &mut self.contended else {
            return;
        };
        if tokens == 0 || !(ms.is_finite() && ms > 0.0) {
            return;
        }
        if tokens <= MIN_CONTENDED {
            b.one_token_ms += CONTENDED_SMOOTHING * (ms - b.one_token_ms);
        }
        let target = b.target_ms();
        if contended && (ms > target || tokens + 1 >= *cap as usize) {
            let within = tokens as f64 * target / ms;
            *cap += CONTENDED_SMOOTHING * (within - *cap);
            let most = self.sched.config().token_budget.max(MIN_CONTENDED);
            *cap = cap.clamp(MIN_CONTENDED as f64, most as f64);
            let n = cap.floor() as usize;
            tracing::debug!(tokens, ms, target, budget = *cap, "contended budget");
            self.sched
                .set_contended_budget(Some(n))
                .expect("invariant: at least two tokens");
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }
    #[cfg(test)]
    pub(crate) fn control(&self) -> &LoadControl {
        &self.control
    }

    pub fn set_tenant(&mut self, id: TenantId, cfg: TenantConfig) -> Result<(), VerifierError> {
        self.sched.set_tenant(id, cfg)?;
        Ok(())
    }

    /// Open speculation sessions and cloud-only generations.
    pub fn counts(&self) -> (usize, usize) {
        let spec = self
            .sessions
            .values()
            .filter(|s| matches!(s.work, Work::Spec { .. }))
            .count();
        (spec, self.sessions.len() - spec)
    }

    /// Requests whose prompt is prefilled, and those admitted and waiting for it.
    pub fn request_counts(&self) -> (usize, usize) {
        let waiting = self
            .sessions
            .values()
            .filter(|s| !s.state().prefilled)
            .count();
        (self.sessions.len() - waiting, waiting)
    }

    pub fn session(&self, id: SessionId) -> Option<SessionState> {
        Some(self.sessions.get(&id)?.state())
    }

    /// Whether the verifier decodes speculation session `id` itself.
    #[cfg(test)]
    pub(crate) fn is_taken_over(&self, id: SessionId) -> bool {
        self.sessions.get(&id).is_some_and(|s| s.ctl.is_cloud())
    }

    /// Whether any session has work the scheduler could plan.
    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    /// When the core must turn even with nothing to do, on the driver's clock (µs): a session
    /// that waits for its edge's block runs out of patience
    /// ([`VerifierConfig::await_drafts_ms`]) and is decoded, or one whose edge went quiet
    /// reaches its idle timeout ([`LoadConfig::idle_timeout_ms`]). None: neither can happen.
    pub fn wake_at_us(&self) -> Option<u64> {
        let idle_us = self.idle_timeout_us();
        if self.await_drafts_us == 0 && idle_us.is_none() {
            return None;
        }
        let idle =
            (idle_us.is_some() && self.idle_check_us < u64::MAX).then_some(self.idle_check_us);
        if self.await_drafts_us == 0 {
            return idle;
        }
        self.sessions
            .values()
            .filter_map(|s| match &s.work {
                Work::Spec {
                    waiting_since: Some(t),
                    planned: None,
                    ..
                } => Some(t + self.await_drafts_us),
                _ => None,
            })
            .chain(idle)
            .min()
    }

    /// [`LoadConfig::idle_timeout_ms`] in µs.
    pub(crate) fn idle_timeout_us(&self) -> Option<u64> {
        self.load.idle_timeout_ms.map(|ms| ms.saturating_mul(1000))
    }

    /// Close the speculation sessions whose edge said nothing for the idle timeout by `now_us`
    /// ([`LoadConfig::idle_timeout_ms`]): each edge is told with the turn
    /// ([`VerifierError::Idle`]); its usage ends by what it committed, as a close's does.
    pub(crate) fn expire_idle(&mut self, now_us: u64) {
        let Some(idle_us) = self.idle_timeout_us() else {
            return;
        };
        if now_us < self.idle_check_us {
            return;
        }
        let mut quiet = Vec::new();
        let mut next = u64::MAX;
        for (&id, s) in &self.sessions {
            if !s.opened_speculation() {
                continue;
            }
            let due = s.meter.heard_us.saturating_add(idle_us);
            if due <= now_us {
                quiet.push(id);
            } else {
                next = next.min(due);
            }
        }
        self.idle_check_us = next;
        for id in quiet {
            // Ended by what it committed, as when its edge closes it: abandoned mid-answer, or
            // finished and never closed.
            let s = self.retire(id, None).expect("invariant: open");
            let error = VerifierError::Idle {
                seconds: idle_us as f64 / 1e6,
            };
            self.dismissed.push((id, s.handle, error));
        }
    }

    /// Stop admitting: every new session is refused with [`VerifierError::Draining`] from now
    /// on; open ones go on until they end or [`VerifierCore::shut_down`].
    pub fn drain(&mut self) {
        self.draining = true;
    }

    /// Open sessions of every kind.
    pub fn open_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Admit a session: the one place a record is created. Refused with
    /// [`VerifierError::Sched`] when saturated or over quota, [`VerifierError::Draining`] when
    /// draining.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn admit(
        &mut self,
        id: SessionId,
        tenant: TenantId,
        prompt: &[u32],
        params: SamplingParams,
        grammar: Option<Box<tandem_spec::Grammar>>,
        logprobs: Option<usize>,
        work: Work,
        want: Option<tandem_spec::Shape>,
        now_us: u64,
        handle: H,
    ) -> Result<(), VerifierError> {
        if self.draining {
            return Err(VerifierError::Draining);
        }
        if self.sessions.contains_key(&id) {
            return Err(VerifierError::DuplicateSession(id));
        }
        let vocab = self.engine.vocab();
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(VerifierError::Invalid(format!(
                "prompt: token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        if let Some(g) = grammar.as_ref().filter(|g| g.vocab_size() < vocab) {
            return Err(VerifierError::Invalid(format!(
                "grammar: compiled for a vocabulary of {} tokens, the model's is {vocab}",
                g.vocab_size()
            )));
        }
        let cached = self.sched.open(id, tenant, prompt)?;
        self.sessions.insert(
            id,
            Session {
                tenant,
                params,
                grammar,
                logprobs,
                prompt_len: prompt.len(),
                history: prompt.to_vec(),
                work,
                ctl: Ctl::new(want, tenant),
                meter: Meter {
                    opened_us: now_us,
                    heard_us: now_us,
                    spoke_us: now_us,
                    ..Meter::default()
                },
                counts: crate::usage::Counts {
                    cached,
                    ..Default::default()
                },
                handle,
            },
        );
        Ok(())
    }

    pub(crate) fn spec_work(
        rule: VerifyRule,
        prompt_len: usize,
        max_tokens: usize,
        eog: Vec<u32>,
        self_draft: bool,
    ) -> Work {
        Work::Spec {
            rule,
            self_draft,
            vs: None,
            queue: VecDeque::new(),
            planned: None,
            draft: Default::default(),
            waiting_since: None,
            limit: prompt_len + max_tokens.max(1),
            eog,
        }
    }

    /// A cloud-only generation; `suffix`: the index of its prompt, when the verifier drafts for
    /// it from its own text.
    pub(crate) fn generation_work(
        max_tokens: usize,
        eog: Vec<u32>,
        suffix: Option<tandem_spec::SelfDrafter>,
    ) -> Work {
        Work::Generation {
            next: None,
            produced: 0,
            max_tokens: max_tokens.max(1),
            eog,
            suffix,
            guesses: Vec::new(),
        }
    }

    /// Positions the forward about to run may add for sessions' own guesses: up to the target's
    /// ridge (where a forward stops costing the same as a one-token one: the measured cost
    /// model's, else half the saturation point the grants follow) and within the forward's
    /// budget, less what `plan` already holds.
    pub(crate) fn self_draft_room(&self, plan: &tandem_sched::Batch) -> usize {
        let ridge = match &self.load.forward_cost {
            Some(c) => c.ridge_tokens(),
            None => self.load.saturation_tokens / 2.0,
        };
        let cap = match ridge.is_finite() {
            true => (ridge.floor() as usize).max(1),
            false => usize::MAX,
        };
        cap.min(self.sched.budget()).saturating_sub(plan.tokens())
    }

    /// Close session `id`: its record goes, with its scheduler entry, its KV pages and its part
    /// of the load control, and what it used is told with the next turn. Closing a session that
    /// is not open does nothing.
    pub fn close(&mut self, id: SessionId) {
        self.retire(id, None);
    }

    /// The one place a record goes (closed, cancelled, shut down): its usage is kept for the
    /// next turn, ended for `why` (None: by what it committed).
    pub(crate) fn retire(
        &mut self,
        id: SessionId,
        why: Option<crate::Finish>,
    ) -> Option<Session<H>> {
        let s = self.sessions.remove(&id)?;
        self.sched.close(id);
        self.finished
            .push(crate::Usage::of(id, &s, self.now_us, why));
        Some(s)
    }

    /// What the sessions that ended since the last call used (a driver that runs turns gets
    /// them in [`Turn::finished`](crate::Turn::finished)).
    pub fn take_finished(&mut self) -> Vec<crate::Usage> {
        std::mem::take(&mut self.finished)
    }

    /// End `tenant`'s session `id` at its tenant's request: it is closed now, and its edge is
    /// told with the next turn ([`VerifierError::Cancelled`]). A session that is not open, or is
    /// another tenant's, is [`VerifierError::UnknownSession`] — the same answer for both, so that
    /// a tenant cannot learn of another's sessions.
    pub fn cancel(&mut self, id: SessionId, tenant: TenantId) -> Result<(), VerifierError> {
        match self.sessions.get(&id) {
            Some(s) if s.tenant == tenant => {
                let s = self
                    .retire(id, Some(crate::Finish::Cancelled))
                    .expect("invariant: open");
                self.dismissed
                    .push((id, s.handle, VerifierError::Cancelled(id)));
                Ok(())
            }
            _ => Err(VerifierError::UnknownSession(id)),
        }
    }

    /// End every open session (the end of a drain): each is closed now and its edge told with
    /// the next turn ([`VerifierError::Draining`]: open it again elsewhere). Admission stays
    /// closed.
    pub fn shut_down(&mut self) {
        self.draining = true;
        let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
        for id in ids {
            let s = self
                .retire(id, Some(crate::Finish::Shutdown))
                .expect("invariant: open");
            self.dismissed.push((id, s.handle, VerifierError::Draining));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_positions_cost_is_fitted_from_the_small_forwards() {
        let mut f = PositionFit::default();
        // One-token forwards only: no slope to fit.
        for _ in 0..100 {
            f.observe(1, 25.0);
        }
        assert_eq!(f.cost(), None);
        // A CPU's forward: 25 ms and 3.5 ms a position more; large prefill chunks left out.
        for n in [1, 2, 5, 1, 3, 17, 1, 9, 300] {
            for _ in 0..10 {
                f.observe(
                    n,
                    25.0 + 3.5 * (n as f64 - 1.0) + if n > 32 { 1e4 } else { 0.0 },
                );
            }
        }
        let c = f.cost().unwrap();
        assert!((c - 0.14).abs() < 0.01, "{c}");
        // Below a GPU's ridge a position costs nothing.
        let mut f = PositionFit::default();
        for n in 1..=40 {
            f.observe(n, 8.0);
        }
        assert_eq!(f.cost(), Some(0.0));
    }
    use tandem_spec::capacity::ForwardCost;

    #[test]
    fn the_contended_budget_is_the_largest_forward_within_the_slowdown() {
        // This machine's calibration (docs/bench/load-lanes.json): 34.72 ms alone, 2.96 ms a
        // token past the ridge. 150% of 34.72 ms is 52.08 ms: 17 tokens (50.3 ms), not 18.
        let cost = ForwardCost {
            one_token_ms: 34.72,
            ms_per_token: 2.96,
        };
        let cfg = VerifierConfig {
            tenant_slowdown_pct: 150,
            ..VerifierConfig::default()
        };
        let b = cfg.contended_budget(&cost).unwrap();
        assert_eq!(b.tokens, 17);
        assert!((b.target_ms() - 52.08).abs() < 1e-9);
        assert!(cost.ms(17.0) <= b.target_ms() && cost.ms(18.0) > b.target_ms());
        let at = |pct, token_budget| {
            VerifierConfig {
                tenant_slowdown_pct: pct,
                token_budget,
                ..cfg
            }
            .contended_budget(&cost)
            .map(|b| b.tokens)
        };
        assert_eq!(at(125, 64), Some(14), "the default: 43.4 ms");
        assert_eq!(at(0, 64), None, "0: no limit");
        assert_eq!(at(150, 16), Some(16), "no more than the token budget");
        assert_eq!(at(100, 64), Some(11), "at the ridge");
        assert_eq!(at(1, 64), Some(2), "two tokens at least");
    }
}
