//! Tandem's cloud verifier core: the target engine, one [`VerifierSession`] per session, and one
//! ragged forward per step over the blocks of every session that is ready. Transport-agnostic: the
//! in-process link ([`serve`]) and, later, the gRPC service drive the same [`Verifier`].

pub mod grpc;
pub mod metrics;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use tandem_engine::{Engine, EngineError, SamplingParams, SeqChunk, SeqId, Wanted};
use tandem_spec::sampling::sample;
use tandem_spec::{Block, BlockAction, SpecError, Verdict, VerifierSession, VerifyRule};

#[derive(Debug, thiserror::Error)]
pub enum CloudError {
    #[error("session {0} is not open")]
    UnknownSession(u64),
    #[error("session {0} is already open")]
    DuplicateSession(u64),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Counters of the verifier.
#[derive(Debug, Clone, Copy, Default)]
pub struct VerifierStats {
    /// Forward passes of the target (prefills included).
    pub target_forwards: u64,
    /// Blocks verified in a forward, and blocks decided without one.
    pub blocks_verified: u64,
    pub blocks_early: u64,
    pub blocks_stale: u64,
    /// Largest number of sessions in one forward.
    pub max_batch: usize,
    /// Running mean of the tokens per step forward (0 once the verifier goes idle): its load.
    pub tokens_per_forward: f64,
    /// Sessions and tokens of the last step forward.
    pub last_batch: (usize, usize),
}

/// Live load of a verifier, updated by [`serve`] after every step and read by the `Info` RPC, and
/// its Prometheus metrics.
#[derive(Default)]
pub struct Gauges {
    pub metrics: metrics::Metrics,
    /// Open speculation sessions.
    pub sessions: AtomicU64,
    /// Running cloud-only generations.
    pub generations: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub target_forwards: AtomicU64,
    /// Tokens per step forward (running mean), in hundredths.
    pub tokens_per_forward_x100: AtomicU64,
}

impl Gauges {
    fn update(&self, v: &Verifier) {
        let t = &v.engine.kv().tables;
        let set = |g: &AtomicU64, x: usize| g.store(x as u64, Ordering::Relaxed);
        set(&self.sessions, v.sessions.len());
        set(&self.generations, v.decodes.len());
        set(&self.kv_blocks_used, t.num_blocks() - t.num_free_blocks());
        set(&self.kv_blocks_total, t.num_blocks());
        self.target_forwards
            .store(v.stats.target_forwards, Ordering::Relaxed);
        self.tokens_per_forward_x100.store(
            (v.stats.tokens_per_forward * 100.0).round() as u64,
            Ordering::Relaxed,
        );
    }
}

/// A cloud-only generation (the baseline): the target decodes every token itself.
struct Decode {
    /// The last sampled token, fed at `pos` in the next step.
    next: u32,
    pos: usize,
    produced: usize,
    max_tokens: usize,
    params: SamplingParams,
    eog: Vec<u32>,
}

/// One token of a cloud-only generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    pub session: u64,
    pub token: u32,
    pub done: bool,
}

pub struct Verifier {
    engine: Engine,
    sessions: HashMap<u64, VerifierSession>,
    decodes: HashMap<u64, Decode>,
    pub stats: VerifierStats,
}

impl Verifier {
    pub fn new(engine: Engine) -> Self {
        Self {
            engine,
            sessions: HashMap::new(),
            decodes: HashMap::new(),
            stats: VerifierStats::default(),
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Prefill `prompt` for a new session; returns the target's first token (its pending prediction).
    pub fn open(
        &mut self,
        id: u64,
        prompt: &[u32],
        params: SamplingParams,
        rule: VerifyRule,
    ) -> Result<u32, CloudError> {
        let first = self.prefill(id, prompt, &params)?;
        let max_len = self.engine.model().cfg.context_len;
        self.sessions.insert(
            id,
            VerifierSession::new(rule, params, prompt.len(), first, max_len),
        );
        Ok(first)
    }

    /// Feed a new session's prompt; returns the target's token after it.
    fn prefill(
        &mut self,
        id: u64,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<u32, CloudError> {
        if self.sessions.contains_key(&id) || self.decodes.contains_key(&id) {
            return Err(CloudError::DuplicateSession(id));
        }
        let logits =
            self.engine
                .forward(&[SeqChunk::new(SeqId(id), 0, prompt.to_vec(), Wanted::Last)])?;
        self.stats.target_forwards += 1;
        Ok(sample(logits.row(0), params, prompt.len() as u64))
    }

    pub fn close(&mut self, id: u64) {
        self.sessions.remove(&id);
        self.decodes.remove(&id);
        self.engine.free(SeqId(id));
    }

    /// Start a cloud-only generation: prefill and the first token. Later tokens come from [`step`].
    ///
    /// [`step`]: Verifier::step
    pub fn open_generate(
        &mut self,
        id: u64,
        prompt: &[u32],
        params: SamplingParams,
        max_tokens: usize,
        eog: Vec<u32>,
    ) -> Result<Decoded, CloudError> {
        let token = self.prefill(id, prompt, &params)?;
        let seq = SeqId(id);
        let done = max_tokens <= 1 || eog.contains(&token);
        if done {
            self.engine.free(seq);
        } else {
            self.decodes.insert(
                id,
                Decode {
                    next: token,
                    pos: prompt.len(),
                    produced: 1,
                    max_tokens,
                    params,
                    eog,
                },
            );
        }
        Ok(Decoded {
            session: id,
            token,
            done,
        })
    }

    /// Whether any cloud-only generation is running.
    pub fn decoding(&self) -> bool {
        !self.decodes.is_empty()
    }

    /// Verify at most one block per session, and decode one token of every cloud-only generation,
    /// in one ragged forward. Returns each block's verdict (`None` for a stale block) or the error
    /// that refused it — a refused block leaves its session as it was — and the decoded tokens.
    pub fn step(&mut self, blocks: &[(u64, Block)]) -> StepResult {
        let mut results = Vec::with_capacity(blocks.len());
        let mut planned = Vec::new();
        let mut chunks: Vec<SeqChunk> = self
            .decodes
            .iter()
            .map(|(id, d)| SeqChunk::new(SeqId(*id), d.pos, vec![d.next], Wanted::Last))
            .collect();
        for (id, b) in blocks {
            let Some(s) = self.sessions.get_mut(id) else {
                results.push((*id, Err(CloudError::UnknownSession(*id))));
                continue;
            };
            let before = s.clone();
            match s.on_block(b) {
                Ok(BlockAction::Stale) => {
                    self.stats.blocks_stale += 1;
                    results.push((*id, Ok(None)));
                }
                Ok(BlockAction::Verdict(v)) => {
                    self.stats.blocks_early += 1;
                    results.push((*id, Ok(Some(v))));
                }
                Ok(BlockAction::Forward(plan)) => {
                    let n = plan.tokens.len();
                    chunks.push(SeqChunk::new(
                        SeqId(*id),
                        plan.start_pos,
                        plan.tokens,
                        Wanted::At(plan.logits_at),
                    ));
                    planned.push((*id, b, before, n));
                }
                Err(e) => {
                    *s = before;
                    results.push((*id, Err(e.into())));
                }
            }
        }
        if chunks.is_empty() {
            return StepResult {
                verdicts: results,
                decoded: Vec::new(),
                failed: Vec::new(),
            };
        }
        self.stats.max_batch = self.stats.max_batch.max(chunks.len());
        let n: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        self.stats.last_batch = (chunks.len(), n);
        let avg = &mut self.stats.tokens_per_forward;
        *avg += 0.2 * (n as f64 - *avg);
        let t0 = std::time::Instant::now();
        let forward = self.engine.forward(&chunks);
        let verify_us = t0.elapsed().as_micros().min(u32::MAX as u128) as u32;
        let logits = match forward {
            Ok(l) => l,
            Err(e) => {
                // Nothing was verified: put the sessions back and report the engine's error.
                let msg = e.to_string();
                for (id, _, before, _) in planned {
                    self.sessions.insert(id, before);
                    results.push((
                        id,
                        Err(CloudError::Engine(EngineError::InvalidBatch(msg.clone()))),
                    ));
                }
                // A generation that cannot step ends with the error rather than retrying forever.
                let failed = self
                    .decodes
                    .drain()
                    .map(|(id, _)| (id, msg.clone()))
                    .collect::<Vec<_>>();
                for (id, _) in &failed {
                    self.engine.free(SeqId(*id));
                }
                return StepResult {
                    verdicts: results,
                    decoded: Vec::new(),
                    failed,
                };
            }
        };
        self.stats.target_forwards += 1;
        for (id, b, _, _) in planned {
            let rows: Vec<&[f32]> = logits.for_seq(SeqId(id)).map(|(_, r)| r).collect();
            let s = self
                .sessions
                .get_mut(&id)
                .expect("invariant: planned sessions exist");
            let r = s.finish(b, &rows).map_err(CloudError::from).and_then(|f| {
                self.engine.truncate(SeqId(id), f.kv_len)?;
                Ok(Some(Verdict {
                    verify_us,
                    ..f.verdict
                }))
            });
            self.stats.blocks_verified += 1;
            results.push((id, r));
        }
        let mut decoded = Vec::new();
        let mut finished = Vec::new();
        for (id, d) in self.decodes.iter_mut() {
            let Some(row) = logits.last_for(SeqId(*id)) else {
                continue;
            };
            let pos = d.pos + 1;
            let token = sample(row, &d.params, pos as u64);
            d.next = token;
            d.pos = pos;
            d.produced += 1;
            let done = d.produced >= d.max_tokens || d.eog.contains(&token);
            if done {
                finished.push(*id);
            }
            decoded.push(Decoded {
                session: *id,
                token,
                done,
            });
        }
        for id in finished {
            self.decodes.remove(&id);
            self.engine.free(SeqId(id));
        }
        StepResult {
            verdicts: results,
            decoded,
            failed: Vec::new(),
        }
    }
}

/// Where the batcher sends a session's messages (a channel of the in-process link, or a gRPC
/// stream). Returns false when the edge is gone: the batcher then frees the session.
pub type Reply = Box<dyn Fn(ToEdge) -> bool + Send>;

/// A [`Reply`] into a std channel.
pub fn reply_to(tx: Sender<ToEdge>) -> Reply {
    Box::new(move |m| tx.send(m).is_ok())
}

/// What one [`Verifier::step`] produced.
pub struct StepResult {
    pub verdicts: Vec<(u64, Result<Option<Verdict>, CloudError>)>,
    pub decoded: Vec<Decoded>,
    /// Cloud-only generations ended by an engine error.
    pub failed: Vec<(u64, String)>,
}

/// Messages from edges.
pub enum ToCloud {
    Open {
        session: u64,
        prompt: Vec<u32>,
        params: SamplingParams,
        rule: VerifyRule,
        reply: Reply,
    },
    Draft {
        session: u64,
        block: Block,
    },
    /// Cloud-only generation: the verifier decodes every token.
    Generate {
        session: u64,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_tokens: usize,
        eog: Vec<u32>,
        reply: Reply,
    },
    Close {
        session: u64,
    },
}

/// Messages to an edge.
#[derive(Debug, Clone)]
pub enum ToEdge {
    Opened {
        session: u64,
        first: u32,
    },
    Verdict(Verdict),
    /// A token of a cloud-only generation.
    Token {
        token: u32,
        done: bool,
    },
    Error {
        message: String,
    },
}

/// Serve edges over in-process channels until every sender is gone: each iteration takes all
/// messages that have arrived, opens new sessions, then verifies the oldest queued block of every
/// session in one ragged forward.
pub fn serve(mut v: Verifier, rx: Receiver<ToCloud>, gauges: Arc<Gauges>) -> Verifier {
    let mut replies: HashMap<u64, Reply> = HashMap::new();
    let mut queued: HashMap<u64, VecDeque<(Block, Instant)>> = HashMap::new();
    // When each session last got tokens (for the inter-token latency).
    let mut last_commit: HashMap<u64, Instant> = HashMap::new();
    let mx = &gauges.metrics;
    let itl = |id: u64, tokens: usize, last_commit: &mut HashMap<u64, Instant>| {
        let now = Instant::now();
        if let Some(t) = last_commit.insert(id, now) {
            let gap = (now - t).as_secs_f64() / tokens.max(1) as f64;
            for _ in 0..tokens.max(1) {
                mx.itl.observe(gap);
            }
        }
    };
    loop {
        let idle = queued.values().all(|q| q.is_empty()) && !v.decoding();
        if idle {
            v.stats.tokens_per_forward = 0.0;
        }
        gauges.update(&v);
        let first = if idle {
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => return v,
            }
        } else {
            None
        };
        for m in first.into_iter().chain(rx.try_iter()) {
            match m {
                ToCloud::Open {
                    session,
                    prompt,
                    params,
                    rule,
                    reply,
                } => {
                    let t0 = Instant::now();
                    let msg = match v.open(session, &prompt, params, rule) {
                        Ok(first) => {
                            mx.ttft.observe(t0.elapsed().as_secs_f64());
                            mx.forwards.inc();
                            last_commit.insert(session, Instant::now());
                            ToEdge::Opened { session, first }
                        }
                        Err(e) => ToEdge::Error {
                            message: e.to_string(),
                        },
                    };
                    if reply(msg) {
                        replies.insert(session, reply);
                        queued.entry(session).or_default();
                    } else {
                        v.close(session);
                    }
                }
                ToCloud::Draft { session, block } => queued
                    .entry(session)
                    .or_default()
                    .push_back((block, Instant::now())),
                ToCloud::Generate {
                    session,
                    prompt,
                    params,
                    max_tokens,
                    eog,
                    reply,
                } => {
                    let t0 = Instant::now();
                    let started = v.open_generate(session, &prompt, params, max_tokens, eog);
                    if started.is_ok() {
                        mx.ttft.observe(t0.elapsed().as_secs_f64());
                        mx.forwards.inc();
                        last_commit.insert(session, Instant::now());
                    }
                    match started {
                        Ok(d) => {
                            let alive = reply(ToEdge::Token {
                                token: d.token,
                                done: d.done,
                            });
                            if !alive {
                                v.close(session);
                            } else if !d.done {
                                replies.insert(session, reply);
                            }
                        }
                        Err(e) => {
                            reply(ToEdge::Error {
                                message: e.to_string(),
                            });
                        }
                    }
                }
                ToCloud::Close { session } => {
                    v.close(session);
                    replies.remove(&session);
                    queued.remove(&session);
                    last_commit.remove(&session);
                }
            }
        }
        let now = Instant::now();
        let batch: Vec<(u64, Block)> = queued
            .iter_mut()
            .filter_map(|(id, q)| {
                q.pop_front().map(|(b, at)| {
                    mx.queue_time.observe((now - at).as_secs_f64());
                    (*id, b)
                })
            })
            .collect();
        let forwards = v.stats.target_forwards;
        let step = v.step(&batch);
        if v.stats.target_forwards > forwards {
            mx.forwards.inc();
            mx.batch_size.observe(v.stats.last_batch.0 as f64);
            mx.tokens_per_forward.observe(v.stats.last_batch.1 as f64);
        }
        for (id, message) in step.failed {
            if let Some(reply) = replies.remove(&id) {
                reply(ToEdge::Error { message });
            }
        }
        let mut gone = Vec::new();
        for d in step.decoded {
            itl(d.session, 1, &mut last_commit);
            if let Some(reply) = replies.get(&d.session) {
                let alive = reply(ToEdge::Token {
                    token: d.token,
                    done: d.done,
                });
                if !alive && !d.done {
                    gone.push(d.session);
                }
            }
            if d.done {
                replies.remove(&d.session);
            }
        }
        for (id, r) in step.verdicts {
            let msg = match r {
                Ok(Some(verdict)) => {
                    if let Some((_, b)) = batch.iter().find(|(s, _)| *s == id) {
                        let accepted = verdict.accepted.min(b.tokens.len());
                        mx.drafts.inc();
                        mx.draft_tokens.inc_by(b.tokens.len() as u64);
                        mx.accepted_tokens.inc_by(accepted as u64);
                        for pos in 0..accepted {
                            mx.accepted_per_pos
                                .with_label_values(&[&pos.to_string()])
                                .inc();
                        }
                        itl(id, accepted + 1, &mut last_commit);
                    }
                    ToEdge::Verdict(verdict)
                }
                Ok(None) => continue,
                Err(e) => ToEdge::Error {
                    message: e.to_string(),
                },
            };
            if let Some(reply) = replies.get(&id) {
                if !reply(msg) {
                    gone.push(id);
                }
            }
        }
        // An edge that hung up (a dropped stream, a client that went away mid-generation) frees
        // its KV cache and stops costing forward passes.
        for id in gone {
            v.close(id);
            replies.remove(&id);
            queued.remove(&id);
            last_commit.remove(&id);
        }
    }
}
