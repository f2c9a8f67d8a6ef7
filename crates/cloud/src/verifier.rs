//! [`Verifier`]: the target engine driven by the multi-tenant [`Scheduler`]. The scheduler plans
//! every iteration (verify blocks first and whole, then chunks of prompt prefill and the recompute
//! of preempted sessions, under one token budget, over its own KV block pool); the verifier turns
//! the plan into one ragged forward over the scheduler's block tables, folds the logits into
//! verdicts and tokens, and reports back. The scheduler never sees a tensor; the engine never
//! allocates.
//!
//! Each session keeps the tokens its target KV holds (`history`), so a preempted session is
//! recomputed from them and resumes exactly where it was: the same positions, the same logits.

use std::collections::{HashMap, VecDeque};

use tandem_engine::{Engine, EngineError, Logits, SamplingParams, SeqChunk, SeqId, Wanted};
use tandem_sched::{
    SchedConfig, SchedError, Scheduler, SessionId, StepPlan, TenantConfig, TenantId, WorkKind,
};
use tandem_spec::sampling::sample;
use tandem_spec::{
    Block, BlockAction, DecodeAction, Decoded, ForwardPlan, Verdict, VerifierSession, VerifyRule,
};

use crate::CloudError;

/// Blocks one session may have waiting behind the one being verified (a well-behaved edge has at
/// most its granted depth in flight).
pub const MAX_QUEUED_BLOCKS: usize = 16;

/// Settings of the verifier's scheduler, checked by [`Verifier::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VerifierConfig {
    /// Tokens one forward may compute, all sessions together.
    pub token_budget: usize,
    /// Admission: open sessions beyond which new ones are refused.
    pub max_sessions: usize,
    /// Admission: prompt tokens waiting for prefill beyond which new sessions are refused.
    pub max_waiting_tokens: usize,
}

impl Default for VerifierConfig {
    fn default() -> Self {
        Self {
            token_budget: 64,
            max_sessions: 1024,
            max_waiting_tokens: 4096,
        }
    }
}

/// Something a step (or a draft) produced for one session.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A speculation session's prompt is prefilled; `first` is the target's first token.
    Opened { session: SessionId, first: u32 },
    /// A block's verdict; `drafted` tokens were judged (0 for a verdict decided without compute)
    /// in a forward over `positions` positions (with an unfed correction or bonus in front).
    Verdict {
        session: SessionId,
        verdict: Verdict,
        drafted: usize,
        positions: usize,
    },
    /// A token of a cloud-only generation.
    Token {
        session: SessionId,
        token: u32,
        done: bool,
    },
    /// A message of the session was refused; the session goes on unless `fatal`.
    Error {
        session: SessionId,
        error: CloudError,
        fatal: bool,
    },
    /// The session's KV was dropped to make room; it is recomputed before its next verify.
    Preempted { session: SessionId },
    /// A token of a speculation session the verifier decodes itself ([`Verifier::set_cloud_decode`]);
    /// `handback`: the last one, the edge drafts again from here.
    Decoded {
        session: SessionId,
        decoded: Decoded,
        handback: bool,
    },
}

/// A speculation session the verifier has taken over.
struct CloudDecode {
    /// Hand it back after the next token.
    stop: bool,
    /// The decode step planned for a forward, and the session as it was before.
    step: Option<(ForwardPlan, VerifierSession)>,
}

/// Counters of the verifier.
#[derive(Debug, Clone, Copy, Default)]
pub struct VerifierStats {
    /// Forward passes of the target (prefill chunks included).
    pub target_forwards: u64,
    /// Blocks verified in a forward, decided without one, and dropped as stale.
    pub blocks_verified: u64,
    pub blocks_early: u64,
    pub blocks_stale: u64,
    /// Largest number of sessions in one forward.
    pub max_batch: usize,
    /// Running mean of the tokens per forward (0 once the verifier goes idle): its load.
    pub tokens_per_forward: f64,
    /// Sessions and tokens of the last forward.
    pub last_batch: (usize, usize),
    /// Tokens recomputed after preemption.
    pub recomputed_tokens: u64,
}

/// Per-tenant counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantStats {
    /// Positions the target verified (drafted tokens judged in a forward).
    pub verified_positions: u64,
    pub drafted: u64,
    pub accepted: u64,
}

// One per session, never moved in bulk: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
enum Work {
    Spec {
        rule: VerifyRule,
        /// None until the prompt is prefilled.
        vs: Option<VerifierSession>,
        queue: VecDeque<Block>,
        /// The block planned for a forward, its plan and the session as it was before.
        inflight: Option<(Block, ForwardPlan, VerifierSession)>,
        /// Set while the verifier decodes the session itself.
        cloud: Option<CloudDecode>,
        /// Committed tokens (prompt included) at which it ends, and its end-of-generation ids.
        limit: usize,
        eog: Vec<u32>,
    },
    Decode {
        /// The last sampled token, fed next; None until the prompt is prefilled.
        next: Option<u32>,
        produced: usize,
        max_tokens: usize,
        eog: Vec<u32>,
    },
}

struct Session {
    tenant: TenantId,
    params: SamplingParams,
    prompt_len: usize,
    /// The tokens the session's target KV holds (or will hold once recomputed).
    history: Vec<u32>,
    work: Work,
}

/// One open session's state, for the `GetSession` RPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionState {
    pub tenant: TenantId,
    /// Tokens committed (prompt included).
    pub committed_len: usize,
    pub epoch: u64,
    pub verified_positions: u64,
    /// Blocks waiting behind the one in verification, and whether one is.
    pub queued_blocks: usize,
    pub verifying: bool,
    pub prefilled: bool,
}

/// What the verifier needs from the target model: its vocabulary, the KV geometry its scheduler
/// plans for, and one ragged forward over the chunks the scheduler chose. [`Engine`] is the real
/// one; `tandem simulate` runs the same verifier over a cost model.
pub trait Target {
    fn vocab(&self) -> usize;
    /// Positions a sequence may reach.
    fn context_len(&self) -> usize;
    /// Token slots per KV block, and blocks.
    fn kv_geometry(&self) -> (usize, usize);
    /// One forward over `batch` (with the scheduler's block `tables`), and how long it took (µs).
    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32);
}

impl Target for Engine {
    fn vocab(&self) -> usize {
        self.model().cfg.vocab
    }

    fn context_len(&self) -> usize {
        self.model().cfg.context_len
    }

    fn kv_geometry(&self) -> (usize, usize) {
        let t = &self.kv().tables;
        (t.block_size(), t.num_blocks())
    }

    fn forward_timed(
        &mut self,
        batch: &[SeqChunk],
        tables: &[Vec<u32>],
    ) -> (Result<Logits, EngineError>, u32) {
        let t0 = std::time::Instant::now();
        let r = self.forward_paged(batch, tables);
        (r, t0.elapsed().as_micros().min(u32::MAX as u128) as u32)
    }
}

pub struct Verifier<T: Target = Engine> {
    engine: T,
    sched: Scheduler,
    sessions: HashMap<SessionId, Session>,
    tenants: HashMap<TenantId, TenantStats>,
    pub stats: VerifierStats,
}

impl<T: Target> Verifier<T> {
    /// A verifier over `engine`, whose KV cache becomes the scheduler's block pool. One tenant, 0,
    /// exists with weight 1 and no quota.
    pub fn new(engine: T, cfg: VerifierConfig) -> Result<Self, CloudError> {
        let (block_size, num_blocks) = engine.kv_geometry();
        let sched = Scheduler::new(SchedConfig {
            max_sessions: cfg.max_sessions,
            max_waiting_tokens: cfg.max_waiting_tokens,
            ..SchedConfig::new(cfg.token_budget, block_size, num_blocks)
        })?;
        let mut v = Self {
            engine,
            sched,
            sessions: HashMap::new(),
            tenants: HashMap::new(),
            stats: VerifierStats::default(),
        };
        v.set_tenant(0, TenantConfig::default())?;
        Ok(v)
    }

    pub fn engine(&self) -> &T {
        &self.engine
    }
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    pub fn set_tenant(&mut self, id: TenantId, cfg: TenantConfig) -> Result<(), CloudError> {
        self.sched.set_tenant(id, cfg)?;
        self.tenants.entry(id).or_default();
        Ok(())
    }

    pub fn tenant_stats(&self, id: TenantId) -> TenantStats {
        self.tenants.get(&id).copied().unwrap_or_default()
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

    pub fn session(&self, id: SessionId) -> Option<SessionState> {
        let s = self.sessions.get(&id)?;
        Some(match &s.work {
            Work::Spec {
                vs,
                queue,
                inflight,
                ..
            } => SessionState {
                tenant: s.tenant,
                committed_len: vs.as_ref().map_or(s.prompt_len, |v| v.committed_len()),
                epoch: vs.as_ref().map_or(0, |v| v.epoch()),
                verified_positions: vs.as_ref().map_or(0, |v| v.verified_positions),
                queued_blocks: queue.len(),
                verifying: inflight.is_some(),
                prefilled: vs.is_some(),
            },
            Work::Decode { next, produced, .. } => SessionState {
                tenant: s.tenant,
                committed_len: s.prompt_len + produced,
                epoch: 0,
                verified_positions: 0,
                queued_blocks: 0,
                verifying: false,
                prefilled: next.is_some(),
            },
        })
    }

    fn admit(
        &mut self,
        id: SessionId,
        tenant: TenantId,
        prompt: &[u32],
        params: SamplingParams,
        work: Work,
    ) -> Result<(), CloudError> {
        if self.sessions.contains_key(&id) {
            return Err(CloudError::DuplicateSession(id));
        }
        let vocab = self.engine.vocab();
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(CloudError::Invalid(format!(
                "prompt: token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        self.sched.open(id, tenant, prompt.len())?;
        self.sessions.insert(
            id,
            Session {
                tenant,
                params,
                prompt_len: prompt.len(),
                history: prompt.to_vec(),
                work,
            },
        );
        Ok(())
    }

    /// Admit a speculation session of at most `max_tokens` new tokens (ending at `eog`, which
    /// matters when the verifier decodes it itself); its prompt is prefilled by later steps,
    /// which report [`Event::Opened`]. Refused with [`CloudError::Sched`] when saturated or over
    /// quota.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        &mut self,
        id: SessionId,
        tenant: TenantId,
        prompt: &[u32],
        params: SamplingParams,
        rule: VerifyRule,
        max_tokens: usize,
        eog: Vec<u32>,
    ) -> Result<(), CloudError> {
        let work = Work::Spec {
            rule,
            vs: None,
            queue: VecDeque::new(),
            inflight: None,
            cloud: None,
            limit: prompt.len() + max_tokens.max(1),
            eog,
        };
        self.admit(id, tenant, prompt, params, work)
    }

    /// Admit a cloud-only generation of at most `max_tokens` tokens (stopping at `eog`); later
    /// steps report each token as [`Event::Token`].
    pub fn open_generate(
        &mut self,
        id: SessionId,
        tenant: TenantId,
        prompt: &[u32],
        params: SamplingParams,
        max_tokens: usize,
        eog: Vec<u32>,
    ) -> Result<(), CloudError> {
        let work = Work::Decode {
            next: None,
            produced: 0,
            max_tokens: max_tokens.max(1),
            eog,
        };
        self.admit(id, tenant, prompt, params, work)
    }

    pub fn close(&mut self, id: SessionId) {
        self.sessions.remove(&id);
        self.sched.close(id);
    }

    /// A draft block for `id`: queued behind the block in verification, or judged at once (a
    /// stale block is dropped, a first token that contradicts the pending prediction is answered
    /// without a forward). Returns what can be answered now.
    pub fn draft(&mut self, id: SessionId, block: Block) -> Vec<Event> {
        let Some(s) = self.sessions.get_mut(&id) else {
            return vec![Event::Error {
                session: id,
                error: CloudError::UnknownSession(id),
                fatal: false,
            }];
        };
        let Work::Spec { queue, .. } = &mut s.work else {
            return vec![Event::Error {
                session: id,
                error: CloudError::Invalid(format!(
                    "session {id} is a cloud-only generation: it takes no drafts"
                )),
                fatal: false,
            }];
        };
        if queue.len() >= MAX_QUEUED_BLOCKS {
            return vec![Event::Error {
                session: id,
                error: CloudError::Invalid(format!(
                    "draft.block: {} blocks already wait for verification (at most {MAX_QUEUED_BLOCKS})",
                    queue.len()
                )),
                fatal: false,
            }];
        }
        queue.push_back(block);
        let mut events = Vec::new();
        self.advance(id, &mut events);
        events
    }

    /// Move `id`'s queued blocks on while nothing of it is planned: stale blocks are dropped,
    /// early verdicts answered, the first block that needs the target is enqueued.
    fn advance(&mut self, id: SessionId, events: &mut Vec<Event>) {
        let budget = self.sched.config().token_budget;
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let Work::Spec {
            vs: Some(vs),
            queue,
            inflight,
            cloud: None,
            ..
        } = &mut s.work
        else {
            return;
        };
        while inflight.is_none() {
            let Some(b) = queue.pop_front() else { break };
            let before = vs.clone();
            let refuse = |e: CloudError| Event::Error {
                session: id,
                error: e,
                fatal: false,
            };
            match vs.on_block(&b) {
                Ok(BlockAction::Stale) => self.stats.blocks_stale += 1,
                Ok(BlockAction::Verdict(v)) => {
                    self.stats.blocks_early += 1;
                    events.push(Event::Verdict {
                        session: id,
                        verdict: v,
                        drafted: 0,
                        positions: 0,
                    });
                }
                Ok(BlockAction::Forward(plan)) => {
                    if plan.tokens.len() > budget {
                        *vs = before;
                        events.push(refuse(CloudError::Invalid(format!(
                            "draft.tokens: a block of {} tokens exceeds the verifier's token budget {budget}",
                            b.tokens.len()
                        ))));
                        continue;
                    }
                    if let Err(e) = self.sched.enqueue_verify(id, plan.tokens.len()) {
                        // It could never be computed (the session outgrew the KV cache).
                        *vs = before;
                        events.push(refuse(e.into()));
                        continue;
                    }
                    *inflight = Some((b, plan, before));
                }
                Err(e) => {
                    *vs = before;
                    events.push(refuse(e.into()));
                }
            }
        }
    }

    /// Move a speculation session on: its next block, or its next decoded token when the verifier
    /// has taken it over.
    fn proceed(&mut self, id: SessionId, events: &mut Vec<Event>) {
        let cloud = matches!(
            self.sessions.get(&id).map(|s| &s.work),
            Some(Work::Spec { cloud: Some(_), .. })
        );
        if cloud {
            self.decode_next(id, events);
        } else {
            self.advance(id, events);
        }
    }

    /// Take a speculation session over (`on`) and decode it like a cloud-only generation, each
    /// token an [`Event::Decoded`] — what a saturated verifier does, since a verified position
    /// costs it as much as a decoded one and rejected ones are waste — or hand it back after the
    /// next token (`!on`). A session not yet prefilled is taken over once it is.
    pub fn set_cloud_decode(&mut self, id: SessionId, on: bool) -> Vec<Event> {
        let mut events = Vec::new();
        let Some(s) = self.sessions.get_mut(&id) else {
            return events;
        };
        let Work::Spec {
            cloud, inflight, ..
        } = &mut s.work
        else {
            return events;
        };
        match (on, cloud.as_mut()) {
            (true, Some(c)) => c.stop = false,
            (true, None) => {
                *cloud = Some(CloudDecode {
                    stop: false,
                    step: None,
                });
                // A block already planned is verified first; the takeover follows its verdict.
                if inflight.is_none() {
                    self.decode_next(id, &mut events);
                }
            }
            (false, Some(c)) => c.stop = true,
            (false, None) => {}
        }
        events
    }

    /// The next step of a session the verifier decodes: tokens known at once are sent at once,
    /// then one forward is enqueued. Hands the session back when asked to, and ends it at its
    /// limit or end-of-generation token.
    fn decode_next(&mut self, id: SessionId, events: &mut Vec<Event>) {
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let Work::Spec {
            vs: Some(vs),
            inflight: None,
            cloud: Some(c),
            limit,
            eog,
            ..
        } = &mut s.work
        else {
            return;
        };
        if c.step.is_some() {
            return;
        }
        let handed_back = loop {
            if vs.committed_len() >= *limit {
                return; // the edge has every token it asked for and closes
            }
            let before = vs.clone();
            match vs.decode() {
                Ok(DecodeAction::Ready(d)) => {
                    let end = eog.contains(&d.token) || vs.committed_len() >= *limit;
                    let handback = c.stop && !end;
                    events.push(Event::Decoded {
                        session: id,
                        decoded: d,
                        handback,
                    });
                    if end {
                        return;
                    }
                    if handback {
                        break true;
                    }
                }
                Ok(DecodeAction::Forward(plan)) => {
                    if let Err(e) = self.sched.enqueue_verify(id, plan.tokens.len()) {
                        *vs = before;
                        events.push(Event::Error {
                            session: id,
                            error: e.into(),
                            fatal: true,
                        });
                        return;
                    }
                    c.step = Some((plan, before));
                    return;
                }
                Err(e) => {
                    *vs = before;
                    events.push(Event::Error {
                        session: id,
                        error: e.into(),
                        fatal: true,
                    });
                    return;
                }
            }
        };
        if handed_back {
            if let Work::Spec { cloud, .. } = &mut s.work {
                *cloud = None;
            }
            self.advance(id, events);
        }
    }

    /// Whether any session has work the scheduler could plan.
    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    /// Run one iteration: plan, one ragged forward, verdicts and tokens. `now_ms` is the clock the
    /// rate quotas run on. Returns nothing when there was nothing to plan.
    pub fn step(&mut self, now_ms: u64) -> Vec<Event> {
        let plan = self.sched.schedule(now_ms);
        let mut events: Vec<Event> = plan
            .preempted
            .iter()
            .map(|&session| Event::Preempted { session })
            .collect();
        if plan.chunks.is_empty() {
            return events;
        }
        let mut chunks = Vec::with_capacity(plan.chunks.len());
        let mut tables = Vec::with_capacity(plan.chunks.len());
        for c in &plan.chunks {
            let s = &self.sessions[&c.session];
            let seq = SeqId(c.session);
            let chunk = match (c.kind, &s.work) {
                (WorkKind::Prefill, work) => {
                    let end = c.start + c.len;
                    let prefilled = match work {
                        Work::Spec { vs, .. } => vs.is_some(),
                        Work::Decode { next, .. } => next.is_some(),
                    };
                    if prefilled {
                        self.stats.recomputed_tokens += c.len as u64;
                    }
                    let wants_first = !prefilled && end == s.history.len();
                    let wanted = if wants_first {
                        Wanted::Last
                    } else {
                        Wanted::None
                    };
                    SeqChunk::new(seq, c.start, s.history[c.start..end].to_vec(), wanted)
                }
                (
                    WorkKind::Verify,
                    Work::Spec {
                        cloud:
                            Some(CloudDecode {
                                step: Some((p, _)), ..
                            }),
                        ..
                    },
                ) => {
                    assert_eq!(
                        (p.start_pos, p.tokens.len()),
                        (c.start, c.len),
                        "invariant: the scheduler's decode step matches the session's plan"
                    );
                    SeqChunk::new(seq, c.start, p.tokens.clone(), Wanted::Last)
                }
                (WorkKind::Verify, Work::Spec { inflight, .. }) => {
                    let (_, p, _) = inflight.as_ref().expect("invariant: a verify has a block");
                    assert_eq!(
                        (p.start_pos, p.tokens.len()),
                        (c.start, c.len),
                        "invariant: the scheduler's verify matches the session's plan"
                    );
                    SeqChunk::new(
                        seq,
                        c.start,
                        p.tokens.clone(),
                        Wanted::At(p.logits_at.clone()),
                    )
                }
                (WorkKind::Verify, Work::Decode { next, .. }) => {
                    let t = next.expect("invariant: a decode step follows the prefill");
                    SeqChunk::new(seq, c.start, vec![t], Wanted::Last)
                }
            };
            chunks.push(chunk);
            tables.push(c.blocks.clone());
        }
        let n: usize = plan.tokens();
        self.stats.max_batch = self.stats.max_batch.max(chunks.len());
        self.stats.last_batch = (chunks.len(), n);
        let avg = &mut self.stats.tokens_per_forward;
        *avg += 0.2 * (n as f64 - *avg);
        let (forward, verify_us) = self.engine.forward_timed(&chunks, &tables);
        match forward {
            Ok(logits) => {
                self.stats.target_forwards += 1;
                self.fold(&plan, &logits, verify_us, &mut events);
            }
            Err(e) => self.failed(&plan, e, &mut events),
        }
        events
    }

    /// Verdicts and tokens from a forward's logits, then the scheduler's update.
    fn fold(
        &mut self,
        plan: &StepPlan,
        logits: &tandem_engine::Logits,
        verify_us: u32,
        events: &mut Vec<Event>,
    ) {
        let mut kv_len = Vec::new();
        let mut follow = Vec::new();
        let mut decode_follow = Vec::new();
        let mut enqueue = Vec::new();
        let mut finished = Vec::new();
        for c in &plan.chunks {
            let id = c.session;
            let seq = SeqId(id);
            let s = self
                .sessions
                .get_mut(&id)
                .expect("invariant: planned sessions are open");
            let stats = self.tenants.entry(s.tenant).or_default();
            match (c.kind, &mut s.work) {
                (WorkKind::Prefill, work) => {
                    let Some(row) = logits.last_for(seq) else {
                        continue; // a chunk of a longer prompt, or a recompute
                    };
                    let first = sample(row, &s.params, s.prompt_len as u64);
                    match work {
                        Work::Spec { rule, vs, .. } => {
                            // Positions end at the context, or where the KV pool ends.
                            let pool = self.sched.pool();
                            let max_len = self
                                .engine
                                .context_len()
                                .min(pool.num_blocks() * pool.block_size());
                            *vs = Some(VerifierSession::new(
                                *rule,
                                s.params,
                                s.prompt_len,
                                first,
                                max_len,
                            ));
                            events.push(Event::Opened { session: id, first });
                            follow.push(id);
                        }
                        Work::Decode {
                            next,
                            produced,
                            max_tokens,
                            eog,
                        } => {
                            *produced = 1;
                            let done = *max_tokens <= 1 || eog.contains(&first);
                            *next = Some(first);
                            events.push(Event::Token {
                                session: id,
                                token: first,
                                done,
                            });
                            if done {
                                finished.push(id);
                            } else {
                                enqueue.push(id);
                            }
                        }
                    }
                }
                (
                    WorkKind::Verify,
                    Work::Spec {
                        vs,
                        cloud: Some(cd),
                        limit,
                        eog,
                        ..
                    },
                ) if cd.step.is_some() => {
                    let (p, _) = cd.step.take().expect("invariant: checked");
                    let vs = vs.as_mut().expect("invariant: prefilled");
                    let row = logits.last_for(seq).expect("invariant: asked for");
                    let d = vs.finish_decode(row);
                    s.history.truncate(p.start_pos);
                    s.history.extend_from_slice(&p.tokens);
                    kv_len.push((id, p.start_pos + p.tokens.len()));
                    let end = eog.contains(&d.token) || vs.committed_len() >= *limit;
                    let handback = cd.stop && !end;
                    events.push(Event::Decoded {
                        session: id,
                        decoded: d,
                        handback,
                    });
                    if let (true, Work::Spec { cloud, .. }) = (handback, &mut s.work) {
                        *cloud = None;
                        follow.push(id);
                    } else if !end {
                        decode_follow.push(id);
                    }
                }
                (
                    WorkKind::Verify,
                    Work::Spec {
                        vs,
                        inflight,
                        cloud,
                        ..
                    },
                ) => {
                    let taken_over = cloud.is_some();
                    let (b, p, before) = inflight.take().expect("invariant: planned");
                    let vs = vs.as_mut().expect("invariant: prefilled");
                    let rows: Vec<&[f32]> = logits.for_seq(seq).map(|(_, r)| r).collect();
                    self.stats.blocks_verified += 1;
                    match vs.finish(&b, &rows) {
                        Ok(f) => {
                            s.history.truncate(p.start_pos);
                            s.history.extend_from_slice(&p.tokens);
                            s.history.truncate(f.kv_len);
                            kv_len.push((id, f.kv_len));
                            stats.verified_positions += b.tokens.len() as u64;
                            stats.drafted += b.tokens.len() as u64;
                            stats.accepted += f.verdict.accepted.min(b.tokens.len()) as u64;
                            events.push(Event::Verdict {
                                session: id,
                                verdict: Verdict {
                                    verify_us,
                                    ..f.verdict
                                },
                                drafted: b.tokens.len(),
                                positions: p.tokens.len(),
                            });
                        }
                        Err(e) => {
                            *vs = before;
                            kv_len.push((id, c.start));
                            events.push(Event::Error {
                                session: id,
                                error: e.into(),
                                fatal: false,
                            });
                        }
                    }
                    if taken_over {
                        decode_follow.push(id);
                    } else {
                        follow.push(id);
                    }
                }
                (
                    WorkKind::Verify,
                    Work::Decode {
                        next,
                        produced,
                        max_tokens,
                        eog,
                    },
                ) => {
                    let fed = next.expect("invariant: planned after the prefill");
                    s.history.push(fed);
                    let row = logits.last_for(seq).expect("invariant: asked for");
                    let token = sample(row, &s.params, s.history.len() as u64);
                    *produced += 1;
                    *next = Some(token);
                    let done = *produced >= *max_tokens || eog.contains(&token);
                    events.push(Event::Token {
                        session: id,
                        token,
                        done,
                    });
                    if done {
                        finished.push(id);
                    } else {
                        enqueue.push(id);
                    }
                }
            }
        }
        self.sched.update(plan, &kv_len);
        for id in follow.into_iter().chain(decode_follow) {
            self.proceed(id, events);
        }
        for id in enqueue {
            // A generation that outgrew the KV cache ends with the reason.
            if let Err(e) = self.sched.enqueue_verify(id, 1) {
                events.push(Event::Error {
                    session: id,
                    error: e.into(),
                    fatal: true,
                });
                finished.push(id);
            }
        }
        for id in finished {
            self.close(id);
        }
    }

    /// The engine refused the batch: nothing was computed. Verify blocks are put back as they
    /// were and refused; cloud-only generations end with the error.
    fn failed(&mut self, plan: &StepPlan, e: EngineError, events: &mut Vec<Event>) {
        let msg = e.to_string();
        let kv_len: Vec<(SessionId, usize)> =
            plan.chunks.iter().map(|c| (c.session, c.start)).collect();
        self.sched.update(plan, &kv_len);
        let (mut ended, mut follow, mut decode_follow) = (Vec::new(), Vec::new(), Vec::new());
        for c in &plan.chunks {
            let Some(s) = self.sessions.get_mut(&c.session) else {
                continue;
            };
            let error = CloudError::Engine(msg.clone());
            match &mut s.work {
                Work::Spec {
                    vs: Some(vs),
                    cloud: Some(cd),
                    ..
                } if c.kind == WorkKind::Verify && cd.step.is_some() => {
                    // Decoded again next turn.
                    if let Some((_, before)) = cd.step.take() {
                        *vs = before;
                    }
                    decode_follow.push(c.session);
                }
                Work::Spec { vs, inflight, .. } if c.kind == WorkKind::Verify => {
                    if let (Some(vs), Some((_, _, before))) = (vs.as_mut(), inflight.take()) {
                        *vs = before;
                    }
                    events.push(Event::Error {
                        session: c.session,
                        error,
                        fatal: false,
                    });
                    follow.push(c.session);
                }
                Work::Decode { .. } => {
                    events.push(Event::Error {
                        session: c.session,
                        error,
                        fatal: true,
                    });
                    ended.push(c.session);
                }
                Work::Spec { .. } => {} // its prefill chunk is planned again
            }
        }
        for id in follow.into_iter().chain(decode_follow) {
            self.proceed(id, events);
        }
        for id in ended {
            self.close(id);
        }
    }

    /// Step until no session has work left (tests and the in-process link); returns every event.
    pub fn run_until_idle(&mut self, now_ms: u64) -> Vec<Event> {
        let mut events = Vec::new();
        while self.has_work() {
            let forwards = self.stats.target_forwards;
            let e = self.step(now_ms);
            let stuck = e.is_empty() && self.stats.target_forwards == forwards;
            events.extend(e);
            if stuck {
                break; // only rate-limited work is left
            }
        }
        events
    }
}

impl From<SchedError> for CloudError {
    fn from(e: SchedError) -> Self {
        CloudError::Sched(e)
    }
}
