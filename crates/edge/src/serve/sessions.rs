//! The draft thread in `tandem serve`: it drives every open request's session — one [`Driver`]
//! per request on its own gRPC link to the verifier — and runs the draft steps they ask for
//! together, one ragged forward per round, each session one step per round (fair: a long answer
//! does not hold up a short one). The forward runs on a thread of its own ([`forward_thread`]):
//! meanwhile the draft thread goes on taking the verifier's messages and streaming what it
//! commits to every client (a draft step whose frontier a message moved meanwhile is dropped,
//! [`Driver::grown_at`]). Prompts go into the
//! draft a chunk a round, [`ROUND_PREFILL`] tokens across all sessions, before their sessions
//! draft; so do committed tokens the draft lacks ([`CATCH_UP`]). A session whose link is lost
//! reconnects on a thread of its own while the others go on; when it cannot, and the server was
//! started with `--fallback local`, the draft alone finishes the answer, every such token marked
//! unverified. A request whose client went away is cancelled: its link closes, and the verifier
//! frees its KV at its next step.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::tokenizer::TextStream;
use tandem_engine::{Engine, Logits, SeqChunk, SeqId, Tokenizer};
use tandem_proto::v1::Opened;
use tandem_spec::SpecError;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{oneshot, OwnedSemaphorePermit};

use super::api::{ApiError, Request, Stats};
use super::metrics::EdgeMetrics;
use super::stops::Stops;
use crate::drafter::{DraftSeq, DraftStep};
use crate::grpc::GrpcLink;
use crate::{Driver, EdgeError, SpecConfig, SpecReport, Update, Want};

/// What the draft thread is told.
pub enum Msg {
    /// A new request (its link follows on the job's `link`).
    Job(Box<Job>),
    /// A message arrived on some session's link, or a link was handed over.
    Wake,
    /// A lost connection was recovered, or not (the driver is back from its thread).
    Recovered(Box<Recovery>),
    /// The server is stopping: end when the last session has.
    Shutdown,
    /// The forward thread ran a round's forward: the engine is back, with its output.
    Forwarded(Box<Forwarded>),
}

/// A round's forward for the forward thread: the engine (it is the forward's while it runs)
/// and the chunks.
pub type Forward = (Engine, Vec<SeqChunk>);

/// A round's forward, run: the engine back, the logits (or why there are none), and how long
/// it took.
pub struct Forwarded {
    engine: Engine,
    logits: Result<Logits, String>,
    ms: f64,
}

/// Run `chunks` on `engine`: the logits, or why not (a forward that panicked fails its round's
/// sessions, not the server: the draft thread would otherwise wait for the engine forever).
fn run_forward(engine: &mut Engine, chunks: &[SeqChunk]) -> (Result<Logits, String>, f64) {
    let t0 = Instant::now();
    let logits =
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.forward(chunks))) {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err("the draft forward panicked".into()),
        };
    (logits, t0.elapsed().as_secs_f64() * 1e3)
}

/// Run each forward sent on `rx` and send the engine back on `tx`, until `rx` closes: the
/// draft thread goes on relaying what the verifier commits while a forward runs.
pub fn forward_thread(rx: Receiver<Forward>, tx: Sender<Msg>) {
    for (mut engine, chunks) in rx {
        let (logits, ms) = run_forward(&mut engine, &chunks);
        let f = Forwarded { engine, logits, ms };
        if tx.send(Msg::Forwarded(Box::new(f))).is_err() {
            return;
        }
    }
}

/// A request for the draft thread.
pub struct Job {
    pub req: Request,
    /// Where the link puts the target's log-probabilities, when the request asked for them.
    pub logprobs: Option<crate::grpc::LogprobSink>,
    /// A structured output's grammar, compiled (its draft proposes only what it allows).
    pub grammar: Option<tandem_spec::Grammar>,
    /// The session's shape and rule for this request.
    pub spec: SpecConfig,
    pub events: UnboundedSender<Event>,
    /// The verifier's session, once the HTTP side has opened it (or why there is none).
    pub link: oneshot::Receiver<Linked>,
    /// When the request arrived, and how long it waited for room in the draft's KV cache.
    pub start: Instant,
    pub queued_s: f64,
    /// Its reservation of the draft's KV cache, given back when the session ends.
    pub permit: OwnedSemaphorePermit,
}

/// How a request reached the verifier.
pub enum Linked {
    Open(Box<GrpcLink>, Opened),
    /// No verifier could be reached: the draft answers alone (`--fallback local`).
    Local(String),
    /// No verifier could be reached, and the client was told so.
    Failed,
}

/// What a request's client is sent.
#[derive(Debug, Clone)]
pub enum Event {
    /// Text of the answer, in order: verified by the target, or (`unverified`) the draft's own
    /// after the verifier was lost.
    Text {
        text: String,
        unverified: bool,
        /// The target's log-probabilities of the tokens committed since the last text, when
        /// asked for (OpenAI's chat entries: [`logprob_entries`]).
        logprobs: Vec<serde_json::Value>,
    },
    /// The live view's extension: the target's correction of a drafted token (draft's,
    /// target's; sent before the text it commits), or the draft's unverified tail as it stands
    /// now, with the session's counts so far.
    Live {
        tentative: Option<String>,
        correction: Option<(String, String)>,
        counts: LiveCounts,
    },
    Done(Box<Finished>),
    Error(ApiError),
}

/// What the live view shows beside the text: α so far and the tokens committed.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct LiveCounts {
    /// Drafted positions the target accepted, and those it judged.
    pub accepted: usize,
    pub judged: usize,
    /// Completion tokens committed.
    pub tokens: usize,
}

/// How an answer ended.
#[derive(Debug, Clone)]
pub struct Finished {
    /// OpenAI's: `stop` (end of generation or a stop sequence) or `length`.
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    /// Of them, those the verifier's prefix cache served (its first `Opened` said).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub stats: Stats,
    /// Completion tokens the draft produced alone, unverified (the last ones of the answer).
    pub unverified_tokens: usize,
    /// Milliseconds from the request to its first and to each later token, and to its end.
    pub token_ms: Vec<f64>,
    pub e2e_ms: f64,
    /// The target's log-probabilities of the completion tokens, when asked for: OpenAI's chat
    /// entries (`token`, `logprob`, `bytes`, `top_logprobs`).
    pub logprobs: Option<Vec<serde_json::Value>>,
    /// Of them, the first ones already streamed with the text.
    pub logprobs_streamed: usize,
}

/// OpenAI's chat entries (`token`, `logprob`, `bytes`, `top_logprobs`) of the target's
/// log-probabilities `l`.
pub fn logprob_entries(
    tok: &Tokenizer,
    l: &[tandem_spec::sampling::TokenLogprob],
) -> Vec<serde_json::Value> {
    let entry = |t: u32, lp: f32| {
        let bytes = tok.token_bytes(t);
        serde_json::json!({
            "token": String::from_utf8_lossy(&bytes),
            "logprob": lp,
            "bytes": bytes,
        })
    };
    l.iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(t, lp)| entry(t, lp)).collect();
            e
        })
        .collect()
}

/// Tokens committed while reconnecting, and the correction among them.
type Recommit = (Vec<u32>, Option<(u32, u32)>);

/// A session whose connection was lost, back from reconnecting.
pub struct Recovery {
    id: u64,
    driver: Driver<GrpcLink>,
    /// What reconnecting committed (the reopened session's first token), to show.
    updates: Vec<Recommit>,
    result: Result<bool, EdgeError>,
}

/// What the draft thread serves with.
pub struct Sessions {
    pub tok: Arc<Tokenizer>,
    pub fallback_local: bool,
    /// How long a lost connection may take to reopen.
    pub reconnect_window_ms: u64,
    /// Sessions publish and attach the draft's KV pages.
    pub prefix_cache: bool,
    pub metrics: Arc<EdgeMetrics>,
    /// Rings the draft thread (given to each link, to recovery threads and the forward thread).
    pub tx: Sender<Msg>,
}

/// The answer's text as it is committed: decoded, held back at a stop sequence's possible start,
/// sent to the client; and what the answer counts.
struct Out {
    tok: Arc<Tokenizer>,
    events: UnboundedSender<Event>,
    stream: TextStream,
    stops: Stops,
    /// Text decoded so far (what went into `stops`).
    decoded: usize,
    /// Every completion token committed, in order; the last `unverified` are the draft's own.
    ids: Vec<u32>,
    unverified: usize,
    live: bool,
    /// max_tokens.
    max: usize,
    /// The session's accepted and judged draft positions so far.
    accepted: usize,
    judged: usize,
    start: Instant,
    token_ms: Vec<f64>,
    /// The target's log-probabilities, when asked for; the prompt's length (where the answer's
    /// positions start), and how many of the answer's were streamed.
    logprobs: Option<crate::grpc::LogprobSink>,
    prompt_len: usize,
    logprobs_sent: usize,
}

impl Out {
    /// The log-probabilities of the tokens committed since the last call that have come.
    fn take_logprobs(&mut self) -> Vec<serde_json::Value> {
        let Some(sink) = &self.logprobs else {
            return Vec::new();
        };
        let from = self.prompt_len + self.logprobs_sent;
        let got: Vec<_> = sink
            .range(from, self.prompt_len + self.ids.len())
            .into_iter()
            .enumerate()
            .take_while(|(i, l)| l.pos == from + i)
            .map(|(_, l)| l)
            .collect();
        self.logprobs_sent += got.len();
        logprob_entries(&self.tok, &got)
    }

    fn send(&self, e: Event) {
        let _ = self.events.send(e);
    }

    /// A committed token.
    fn push(&mut self, id: u32, unverified: bool) {
        // Nothing counts past the end of generation (the verifier may commit past it) or
        // max_tokens. Past a stop sequence tokens still count (not as text): the verifier
        // committed them in the same step as the one that completed it, and the usage, the
        // statistics and the verifier's ledger all count what was committed.
        if self.ids.len() >= self.max || self.ids.last().is_some_and(|&t| self.tok.is_eog(t)) {
            return;
        }
        self.ids.push(id);
        self.unverified += unverified as usize;
        self.token_ms.push(self.start.elapsed().as_secs_f64() * 1e3);
        if self.tok.is_eog(id) || self.stops.stopped() {
            return;
        }
        let piece = self.stream.push(&self.tok, id).unwrap_or_default();
        self.decoded += piece.len();
        let text = self.stops.push(&piece);
        if !text.is_empty() {
            let logprobs = self.take_logprobs();
            self.send(Event::Text {
                text,
                unverified,
                logprobs,
            });
        }
    }

    /// What the live view shows beside the text.
    fn counts(&self) -> LiveCounts {
        LiveCounts {
            accepted: self.accepted,
            judged: self.judged,
            tokens: self.ids.len(),
        }
    }

    /// The answer has ended: a stop sequence, the end of generation, or max_tokens.
    fn over(&self) -> bool {
        self.stops.stopped()
            || self.ids.len() >= self.max
            || self.ids.last().is_some_and(|&t| self.tok.is_eog(t))
    }

    fn name(&self, t: u32) -> String {
        if self.tok.is_eog(t) {
            "⟨end⟩".into()
        } else {
            self.tok.decode(&[t]).unwrap_or_default()
        }
    }

    fn update(
        &mut self,
        committed: &[u32],
        tentative: Option<&[u32]>,
        correction: Option<(u32, u32)>,
        stats: Option<&tandem_spec::PipelineStats>,
    ) {
        let live = self.live;
        if let Some(s) = stats {
            self.accepted = s.accepted;
            self.judged = s.accepted + s.rejections;
        }
        // The correction is the last token committed: it is shown just before it.
        let split = if correction.is_some() {
            committed.len().saturating_sub(1)
        } else {
            committed.len()
        };
        for &id in &committed[..split] {
            self.push(id, false);
        }
        if let (true, Some((d, t))) = (live && !self.over(), correction) {
            self.send(Event::Live {
                tentative: None,
                correction: Some((self.name(d), self.name(t))),
                counts: self.counts(),
            });
        }
        for &id in &committed[split..] {
            self.push(id, false);
        }
        if let (true, Some(tentative)) = (live && !self.over(), tentative) {
            let ids: Vec<u32> = tentative
                .iter()
                .copied()
                .filter(|&t| !self.tok.is_eog(t))
                .collect();
            self.send(Event::Live {
                tentative: Some(self.tok.decode(&ids).unwrap_or_default()),
                correction: None,
                counts: self.counts(),
            });
        }
    }

    fn on_update(&mut self, u: Update<'_>) {
        self.update(u.committed, Some(u.tentative), u.correction, Some(u.stats));
    }

    /// The answer is over: what the text stream still held is text after all (a stop sequence
    /// that never completed, the end of a character).
    fn flush(&mut self) {
        if self.stops.stopped() {
            return;
        }
        let ids: Vec<u32> = self
            .ids
            .iter()
            .copied()
            .filter(|&t| !self.tok.is_eog(t))
            .collect();
        let all = self.tok.decode(&ids).unwrap_or_default();
        let mut rest = all
            .get(self.decoded..)
            .map(|r| self.stops.push(r))
            .unwrap_or_default();
        rest.push_str(&self.stops.finish());
        if !rest.is_empty() {
            let logprobs = self.take_logprobs();
            self.send(Event::Text {
                text: rest,
                unverified: self.unverified > 0,
                logprobs,
            });
        }
    }

    fn finish_reason(&self) -> &'static str {
        if self.stops.stopped() || self.ids.last().is_some_and(|&t| self.tok.is_eog(t)) {
            "stop"
        } else {
            "length"
        }
    }
}

/// The draft alone, after the verifier was lost (or never reached).
struct Local {
    /// Prompt and every token committed so far.
    history: Vec<u32>,
    /// Completion tokens it may still add.
    left: usize,
}

enum Phase {
    /// Waiting for the HTTP side to open the verifier's session (the draft prefills meanwhile).
    Connecting(oneshot::Receiver<Linked>),
    Spec(Box<Driver<GrpcLink>>),
    /// The driver is on a thread of its own, reconnecting.
    Recovering,
    Local(Local),
}

struct Active {
    id: u64,
    req: Request,
    logprobs: Option<crate::grpc::LogprobSink>,
    spec: SpecConfig,
    seq: DraftSeq,
    phase: Phase,
    out: Out,
    /// Prompt tokens the verifier's prefix cache served.
    cached_tokens: usize,
    /// The prompt tokens the draft's KV has (all of them: the session may draft).
    prefill_at: usize,
    queued_s: f64,
    reconnects: usize,
    /// What the spec sessions did before the last reconnect that fell back (their stats).
    report: Option<SpecReport>,
    /// Once over: its prompt and committed tokens, for the draft's prefix cache.
    history: Vec<u32>,
    _permit: OwnedSemaphorePermit,
}

impl Active {
    /// The session's prompt and committed tokens, as far as they are final.
    fn done(&self) -> &[u32] {
        match &self.phase {
            Phase::Spec(d) => d.session().committed(),
            Phase::Local(l) => &l.history,
            _ => &self.req.prompt_ids[..self.prefill_at],
        }
    }

    /// Offer the draft's prefix cache the session's final tokens (prompt and committed ones)
    /// that its draft sequence holds.
    fn publish(&self, engine: &mut Engine) {
        self.seq.publish(engine, self.done());
    }

    /// The prefill step the session takes next, while the draft lacks some of its prompt (it
    /// drafts only after).
    fn prefill_step(&self) -> Option<RoundWork> {
        let n = self.req.prompt_ids.len();
        (self.prefill_at < n).then(|| RoundWork::Prefill {
            from: self.prefill_at,
            to: (self.prefill_at + PREFILL_CHUNK).min(n),
        })
    }

    /// The step that feeds the draft the committed tokens it lacks before it drafts at
    /// `base` (the verifier decoded them while it had the session), a chunk a round within the
    /// round's prefill budget, when they are more than [`CATCH_UP`]: the draft step after it
    /// then feeds a few, not all of them in one forward every session's next step waits for.
    fn catch_up(&self, base: usize) -> Option<RoundWork> {
        let Phase::Spec(d) = &self.phase else {
            return None;
        };
        let committed = d.session().committed();
        let from = self.seq.held(committed);
        (base.min(committed.len()) > from + CATCH_UP).then(|| RoundWork::CatchUp {
            from,
            to: (from + PREFILL_CHUNK).min(committed.len()),
        })
    }
}

/// Prompt tokens one round's forward prefills for a session at most: a long prompt takes several
/// rounds, so that it never stalls the other sessions' drafting for its whole length.
pub const PREFILL_CHUNK: usize = 64;

/// Prompt tokens one round's forward prefills, all sessions together: a burst of new requests
/// prefills over several rounds, so that the sessions already streaming wait for one short
/// forward at most, not for every newcomer's prompt.
pub const ROUND_PREFILL: usize = PREFILL_CHUNK;

/// Hold this round's prefill steps to [`ROUND_PREFILL`] tokens in all, in the order of the
/// sessions (the oldest requests first); a step cut to nothing waits for a later round.
fn limit_prefill(plans: &mut Vec<(usize, RoundWork)>) {
    let mut left = ROUND_PREFILL;
    plans.retain_mut(|(_, p)| {
        let (RoundWork::Prefill { from, to } | RoundWork::CatchUp { from, to }) = p else {
            return true;
        };
        let take = to.saturating_sub(*from).min(left);
        left -= take;
        *to = *from + take;
        take > 0
    });
}

/// Committed tokens the draft may lack when it drafts: more, and they are fed first in steps of
/// their own (see [`Active::catch_up`]).
pub const CATCH_UP: usize = 16;

/// A round's forward on the forward thread: each step's session, work and plan; its tokens.
struct InFlight {
    steps: Vec<(u64, RoundWork, DraftStep)>,
    tokens: usize,
}

/// The step a session takes in this round's forward.
enum RoundWork {
    /// Prefill the prompt's tokens `from..to` (the draft holds those before).
    Prefill {
        from: usize,
        to: usize,
    },
    /// Feed the committed tokens `from..to` the draft lacks (it holds those before).
    CatchUp {
        from: usize,
        to: usize,
    },
    /// The frontier the session's driver asked to grow (from this round's poll).
    Draft(tandem_spec::Frontier),
    Local,
}

impl Sessions {
    /// Run the draft thread until it is told to shut down (or every sender of `rx` is gone) and
    /// no session is left. Each round's forward runs on the forward thread (`forward`, see
    /// [`forward_thread`]): meanwhile this thread goes on taking the verifier's messages and
    /// streaming what it commits, for every session (a draft step whose frontier moved is
    /// dropped when it is back); sessions that come or end meanwhile are admitted or freed
    /// when the engine is back.
    pub fn run(self, engine: Engine, rx: Receiver<Msg>, forward: Sender<Forward>) {
        let mut engine = Some(engine);
        let mut flight: Option<InFlight> = None;
        let mut actives: Vec<Active> = Vec::new();
        // Requests the engine admits when it is back; sessions over, whose KV it then frees.
        let mut jobs: Vec<Job> = Vec::new();
        let mut over: Vec<Active> = Vec::new();
        let mut next_id = 0u64;
        let mut pending: Vec<Msg> = Vec::new();
        let mut closing = false;
        loop {
            pending.extend(rx.try_iter());
            for m in pending.drain(..) {
                match m {
                    Msg::Job(job) => jobs.push(*job),
                    Msg::Wake => {}
                    Msg::Recovered(r) => self.recovered(&mut actives, &mut over, *r),
                    Msg::Shutdown => closing = true,
                    Msg::Forwarded(f) => {
                        let Forwarded {
                            engine: mut e,
                            logits,
                            ms,
                        } = *f;
                        if let Some(fl) = flight.take() {
                            self.finish_round(&mut e, &mut actives, fl, logits, ms);
                        }
                        engine = Some(e);
                    }
                }
            }
            if let Some(e) = engine.as_mut() {
                for a in over.drain(..) {
                    self.release(e, a);
                }
                for job in jobs.drain(..) {
                    actives.push(self.admit(e, next_id, job));
                    next_id += 1;
                }
            }
            // Advance every session, those with a step in the forward in flight too (a draft
            // step whose frontier a message moved meanwhile is dropped when it is back); those
            // that are over leave (the client is told now, the KV freed when the engine is back).
            let mut plans: Vec<(usize, RoundWork)> = Vec::new();
            let mut i = 0;
            while i < actives.len() {
                match self.advance(&mut actives[i]) {
                    Ok(Some(p)) => {
                        if engine.is_some() {
                            plans.push((i, p));
                        }
                        i += 1;
                    }
                    Ok(None) => i += 1,
                    Err(end) => {
                        // The plans so far index sessions before `i`: unaffected.
                        let mut a = actives.swap_remove(i);
                        self.end(&mut a, end);
                        over.push(a);
                    }
                }
            }
            let Some(e) = engine.as_mut() else {
                self.wait(&rx, &mut pending);
                continue;
            };
            for a in over.drain(..) {
                self.release(e, a);
            }
            limit_prefill(&mut plans);
            self.metrics.set_running(actives.len(), e.kv());
            if plans.is_empty() {
                if closing && actives.is_empty() && jobs.is_empty() {
                    return;
                }
                self.wait(&rx, &mut pending);
                continue;
            }
            let Some((fl, chunks)) = self.plan_round(e, &mut actives, plans) else {
                continue;
            };
            let e = engine.take().expect("invariant: the engine is here");
            match forward.send((e, chunks)) {
                Ok(()) => flight = Some(fl),
                // No forward thread: the forward runs here.
                Err(std::sync::mpsc::SendError((mut e, chunks))) => {
                    let (logits, ms) = run_forward(&mut e, &chunks);
                    self.finish_round(&mut e, &mut actives, fl, logits, ms);
                    engine = Some(e);
                }
            }
        }
    }

    /// Wait for the next message, at most 50 ms.
    fn wait(&self, rx: &Receiver<Msg>, pending: &mut Vec<Msg>) {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(m) => pending.push(m),
            Err(RecvTimeoutError::Timeout) => {}
            // Not while `self.tx` is a sender.
            Err(RecvTimeoutError::Disconnected) => std::thread::sleep(Duration::from_millis(5)),
        }
    }

    fn admit(&self, engine: &mut Engine, id: u64, job: Job) -> Active {
        let Job {
            req,
            logprobs,
            grammar,
            spec,
            events,
            link,
            start,
            queued_s,
            permit,
        } = job;
        let mut seq = DraftSeq::new(engine, SeqId(id), &[], &spec);
        if let Some(g) = grammar {
            seq.constrain(g, req.prompt_ids.len());
        }
        // An earlier turn of the conversation left the draft's KV of its history in the cache:
        // only the new tokens are prefilled.
        let draft_cached = if self.prefix_cache {
            seq.attach_cached(engine, &req.prompt_ids)
                .unwrap_or_else(|e| {
                    tracing::warn!("request {id}: the draft's prefix cache was not used: {e}");
                    0
                })
        } else {
            0
        };
        self.metrics.draft_prefix_hits.inc_by(draft_cached as u64);
        Active {
            id,
            out: Out {
                tok: self.tok.clone(),
                events,
                stream: TextStream::default(),
                stops: Stops::new(req.stops.clone()),
                decoded: 0,
                ids: Vec::new(),
                unverified: 0,
                live: req.tentative,
                max: req.max_tokens,
                accepted: 0,
                judged: 0,
                start,
                token_ms: Vec::new(),
                logprobs: logprobs.clone(),
                prompt_len: req.prompt_ids.len(),
                logprobs_sent: 0,
            },
            req,
            logprobs,
            spec,
            seq,
            phase: Phase::Connecting(link),
            prefill_at: draft_cached,
            cached_tokens: 0,
            queued_s,
            reconnects: 0,
            report: None,
            history: Vec::new(),
            _permit: permit,
        }
    }

    /// Take what arrived for the session; says the step it wants in this round's forward, or
    /// that it is over (`Err`: how).
    fn advance(&self, a: &mut Active) -> Result<Option<RoundWork>, End> {
        if let Phase::Connecting(rx) = &mut a.phase {
            match rx.try_recv() {
                Ok(Linked::Open(link, opened)) => {
                    a.cached_tokens = opened.cached_tokens as usize;
                    let out = &mut a.out;
                    let d = Driver::new(
                        &a.req.prompt_ids,
                        Some(crate::grpc::opened(&opened)),
                        a.spec.session,
                        self.tok.eog_ids(),
                        *link,
                        out.start,
                        &mut |u| out.on_update(u),
                    )
                    .map_err(End::Failed)?;
                    let mut d = d;
                    d.set_reconnect_window(self.reconnect_window_ms);
                    a.phase = Phase::Spec(Box::new(d));
                }
                Ok(Linked::Local(why)) => {
                    tracing::warn!(
                        "no verifier for request {}: the draft answers alone ({why})",
                        a.id
                    );
                    a.phase = Phase::Local(Local {
                        history: a.req.prompt_ids.clone(),
                        left: a.req.max_tokens,
                    });
                }
                Ok(Linked::Failed) => return Err(End::Refused),
                Err(oneshot::error::TryRecvError::Empty) => {}
                // The request went away while its session was opening.
                Err(oneshot::error::TryRecvError::Closed) => return Err(End::Cancelled),
            }
        }
        if a.out.events.is_closed() {
            return Err(End::Cancelled);
        }
        if a.out.over() {
            return Err(End::Done);
        }
        // The prompt goes into the draft a chunk a round (while the verifier's answer streams)
        // before the session drafts: its first draft step never feeds the whole prompt. Not
        // while the verifier has taken the session over (below).
        match &mut a.phase {
            Phase::Connecting(_) => Ok(a.prefill_step()),
            Phase::Spec(d) => {
                let out = &mut a.out;
                match d.poll(false, &mut |u| out.on_update(u)) {
                    Ok((Want::Done, _)) => Err(End::Done),
                    // While the verifier decodes the session itself (γ 0), the draft has no use
                    // for its prompt: the prefill waits for a grant to draft with (the steps
                    // below then prefill and catch up first), and the edge's core goes to the
                    // sessions that draft.
                    Ok((Want::Wait, _)) if !d.session().drafting_granted() => Ok(None),
                    Ok((Want::Wait, _)) => Ok(a.prefill_step()),
                    Ok((Want::Draft(f), _)) => Ok(Some(
                        a.prefill_step()
                            .or_else(|| a.catch_up(f.base))
                            .unwrap_or(RoundWork::Draft(f)),
                    )),
                    Err(EdgeError::LinkClosed) => {
                        self.recover(a);
                        Ok(None)
                    }
                    Err(e) => Err(End::Failed(e)),
                }
            }
            Phase::Recovering => Ok(None),
            Phase::Local(l) => {
                if l.left == 0 || a.out.ids.last().is_some_and(|&t| self.tok.is_eog(t)) {
                    Err(End::Done)
                } else {
                    Ok(Some(a.prefill_step().unwrap_or(RoundWork::Local)))
                }
            }
        }
    }

    /// Reconnect `a`'s session on a thread of its own (the reopen waits between tries).
    fn recover(&self, a: &mut Active) {
        let Phase::Spec(d) = std::mem::replace(&mut a.phase, Phase::Recovering) else {
            return;
        };
        let (id, tx) = (a.id, self.tx.clone());
        self.metrics.reconnects.inc();
        std::thread::spawn(move || {
            let mut driver = *d;
            let mut updates = Vec::new();
            let result = driver.recover(&mut |u: Update<'_>| {
                updates.push((u.committed.to_vec(), u.correction));
            });
            let _ = tx.send(Msg::Recovered(Box::new(Recovery {
                id,
                driver,
                updates,
                result,
            })));
        });
    }

    fn recovered(&self, actives: &mut Vec<Active>, over: &mut Vec<Active>, r: Recovery) {
        let Some(i) = actives.iter().position(|a| a.id == r.id) else {
            r.driver.link.close();
            return;
        };
        let a = &mut actives[i];
        for (c, corr) in &r.updates {
            a.out.update(c, None, *corr, None);
        }
        match r.result {
            Ok(_) => {
                a.reconnects += 1;
                a.phase = Phase::Spec(Box::new(r.driver));
            }
            Err(e) if self.fallback_local => {
                tracing::warn!(
                    "request {}: the verifier is gone ({e}); the draft finishes the answer alone",
                    a.id
                );
                let report = r.driver.report();
                let left = a.req.max_tokens.saturating_sub(report.output_ids.len());
                a.phase = Phase::Local(Local {
                    history: r.driver.session().committed().to_vec(),
                    left,
                });
                a.report = Some(report);
            }
            Err(e) => {
                let mut a = actives.swap_remove(i);
                self.end(&mut a, End::Lost(e));
                over.push(a);
            }
        }
    }

    /// Plan a round: every planned step, for one forward of the draft (None: no step needs
    /// the forward). Steps that fail end their sessions now.
    fn plan_round(
        &self,
        engine: &mut Engine,
        actives: &mut Vec<Active>,
        plans: Vec<(usize, RoundWork)>,
    ) -> Option<(InFlight, Vec<SeqChunk>)> {
        let mut steps: Vec<(usize, RoundWork, DraftStep)> = Vec::with_capacity(plans.len());
        let mut failed: Vec<(usize, EdgeError)> = Vec::new();
        for (i, p) in plans {
            let a = &mut actives[i];
            // A structured output's tokens that its grammar forces, and copies from the
            // session's text, are drafted without the draft model (the next step that needs
            // their KV feeds them).
            if let (RoundWork::Draft(f), Phase::Spec(d)) = (&p, &mut a.phase) {
                let base = &d.session().pipeline().tokens()[..f.base];
                a.seq.sync(d.session().committed());
                match a.seq.skip_forward(base, &f.leaves) {
                    Ok(Some(props)) => {
                        let out = &mut a.out;
                        match d.grown(props, 0.0, &mut |u| out.on_update(u)) {
                            Ok(()) | Err(EdgeError::LinkClosed) => {}
                            Err(e) => failed.push((i, e)),
                        }
                        continue;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        failed.push((i, e));
                        continue;
                    }
                }
            }
            let planned = match (&p, &a.phase) {
                (RoundWork::Prefill { to, .. }, _) => {
                    a.seq
                        .grow_step(engine, &a.req.prompt_ids[..*to], &[Vec::new()])
                }
                (RoundWork::CatchUp { to, .. }, Phase::Spec(d)) => {
                    a.seq
                        .grow_step(engine, &d.session().committed()[..*to], &[Vec::new()])
                }
                (RoundWork::Draft(f), Phase::Spec(d)) => a.seq.grow_step(
                    engine,
                    &d.session().pipeline().tokens()[..f.base],
                    &f.leaves,
                ),
                (RoundWork::Local, Phase::Local(l)) => {
                    a.seq.grow_step(engine, &l.history, &[Vec::new()])
                }
                _ => continue,
            };
            match planned {
                Ok(s) => steps.push((i, p, s)),
                Err(e) => failed.push((i, e)),
            }
        }
        let chunks: Vec<_> = steps.iter().map(|s| s.2.chunk.clone()).collect();
        let steps = steps
            .into_iter()
            .map(|(i, p, s)| (actives[i].id, p, s))
            .collect();
        self.fail_all(engine, actives, failed);
        if chunks.is_empty() {
            return None;
        }
        let tokens = chunks.iter().map(|c| c.tokens.len()).sum();
        Some((InFlight { steps, tokens }, chunks))
    }

    /// The round's forward ran (`logits` its output, `ms` its time): finish each step of a
    /// session that is still there.
    fn finish_round(
        &self,
        engine: &mut Engine,
        actives: &mut Vec<Active>,
        flight: InFlight,
        logits: Result<Logits, String>,
        ms: f64,
    ) {
        let InFlight { steps, tokens } = flight;
        let mut failed: Vec<(usize, EdgeError)> = Vec::new();
        let steps: Vec<(usize, RoundWork, DraftStep)> = steps
            .into_iter()
            .filter_map(|(id, p, s)| Some((actives.iter().position(|a| a.id == id)?, p, s)))
            .collect();
        let logits = match logits {
            Ok(l) => l,
            Err(why) => {
                tracing::error!("a draft forward failed: {why}");
                failed.extend(steps.into_iter().map(|s| {
                    (
                        s.0,
                        EdgeError::Spec(SpecError::Protocol(format!(
                            "the draft model failed: {why}"
                        ))),
                    )
                }));
                self.fail_all(engine, actives, failed);
                return;
            }
        };
        self.metrics.iteration_tokens.observe(tokens as f64);
        tracing::trace!(
            sessions = actives.len(),
            steps = steps.len(),
            prefills = steps
                .iter()
                .filter(|s| matches!(s.1, RoundWork::Prefill { .. } | RoundWork::CatchUp { .. }))
                .count(),
            tokens,
            ms,
            "draft forward"
        );
        for (i, p, step) in steps {
            let a = &mut actives[i];
            let props = match a.seq.finish(step, &logits) {
                Ok(p) => p,
                Err(e) => {
                    failed.push((i, e));
                    continue;
                }
            };
            let r = match (&p, &mut a.phase) {
                (RoundWork::Prefill { to, .. }, _) => {
                    a.prefill_at = *to;
                    Ok(())
                }
                (RoundWork::Draft(f), Phase::Spec(d)) => {
                    let out = &mut a.out;
                    d.grown_at(f, props, ms, &mut |u| out.on_update(u))
                }
                (RoundWork::Local, Phase::Local(l)) => {
                    let t = props[0].token;
                    l.history.push(t);
                    l.left -= 1;
                    a.out.push(t, true);
                    Ok(())
                }
                _ => Ok(()),
            };
            if self.prefix_cache {
                a.publish(engine);
            }
            match r {
                Ok(()) => {}
                // Found at the next advance (the link says it again).
                Err(EdgeError::LinkClosed) => {}
                Err(e) => failed.push((i, e)),
            }
        }
        self.fail_all(engine, actives, failed);
    }

    fn fail_all(
        &self,
        engine: &mut Engine,
        actives: &mut Vec<Active>,
        mut failed: Vec<(usize, EdgeError)>,
    ) {
        // Highest index first, so that swap_remove leaves the others' indices alone.
        failed.sort_by_key(|f| std::cmp::Reverse(f.0));
        failed.dedup_by_key(|f| f.0);
        for (i, e) in failed {
            let mut a = actives.swap_remove(i);
            self.end(&mut a, End::Failed(e));
            self.release(engine, a);
        }
    }

    /// The session is over: free its draft KV (what the conversation's next turn will start
    /// with stays in the draft's prefix cache).
    fn release(&self, engine: &mut Engine, mut a: Active) {
        if self.prefix_cache {
            a.seq.publish(engine, &a.history);
        }
        a.seq.free(engine);
    }

    /// The session is over: tell the client how and close the link (its KV is
    /// [`Sessions::release`]d after, by the engine).
    fn end(&self, a: &mut Active, end: End) {
        a.history = a.done().to_vec();
        let report = match std::mem::replace(&mut a.phase, Phase::Recovering) {
            Phase::Spec(d) => {
                d.link.close();
                Some(d.report())
            }
            _ => a.report.take(),
        };
        match end {
            End::Refused => {
                self.metrics.finished("error");
                return;
            }
            End::Cancelled => {
                self.metrics.finished("abort");
                return;
            }
            End::Failed(e) => {
                tracing::error!("request {}: {e}", a.id);
                self.metrics.finished("error");
                a.out.send(Event::Error(ApiError {
                    status: 500,
                    message: format!("the answer failed: {e}"),
                    kind: "server_error",
                    param: None,
                }));
                return;
            }
            End::Lost(e) => {
                self.metrics.finished("error");
                a.out.send(Event::Error(ApiError {
                    status: 503,
                    message: format!(
                        "the verifier was lost mid-answer and could not be reached again ({e}); \
                         start the server with --fallback local to finish answers with the draft alone"
                    ),
                    kind: "service_unavailable",
                    param: None,
                }));
                return;
            }
            End::Done => {}
        }
        a.out.flush();
        let stats = report
            .as_ref()
            .map(|r| stats_of(r, a.reconnects))
            .unwrap_or_default();
        let f = Finished {
            finish_reason: a.out.finish_reason(),
            prompt_tokens: a.req.prompt_ids.len(),
            cached_tokens: a.cached_tokens,
            completion_tokens: a.out.ids.len(),
            stats,
            unverified_tokens: a.out.unverified,
            token_ms: std::mem::take(&mut a.out.token_ms),
            e2e_ms: a.out.start.elapsed().as_secs_f64() * 1e3,
            logprobs: a.logprobs.as_ref().map(|sink| {
                let from = a.req.prompt_ids.len();
                logprob_entries(&self.tok, &sink.range(from, from + a.out.ids.len()))
            }),
            logprobs_streamed: a.out.logprobs_sent,
        };
        self.metrics.record(&f, report.as_ref(), a.queued_s);
        a.out.send(Event::Done(Box::new(f)));
    }
}

/// How a session ended.
enum End {
    Done,
    Cancelled,
    /// No verifier could be reached (the HTTP side answered the client).
    Refused,
    Failed(EdgeError),
    /// The verifier was lost and could not be reached again (no fallback).
    Lost(EdgeError),
}

/// The answer's speculation statistics, from what the edge's session did.
pub fn stats_of(r: &SpecReport, reconnects: usize) -> Stats {
    let s = &r.stats;
    // Every committed token is an accepted draft token or the verifier's own; of the verifier's,
    // the first token of each (re)opened session and a verdict's correction or bonus came with
    // verification, the rest it decoded with no block to verify.
    let cloud = r.output_ids.len().saturating_sub(s.verdict_accepted);
    let decoded = r
        .output_ids
        .len()
        .saturating_sub(s.verdict_tokens + 1 + reconnects);
    let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Stats {
        num_drafts: s.verdicts,
        num_draft_tokens: s.drafted,
        num_accepted_draft_tokens: s.verdict_accepted,
        mean_acceptance_length: if s.verdicts == 0 {
            0.0
        } else {
            1.0 + ratio(s.verdict_accepted, s.verdicts)
        },
        draft_acceptance_rate: ratio(s.verdict_accepted, s.drafted),
        alpha: s.acceptance_rate(),
        cloud_tokens: cloud,
        cloud_decoded_tokens: decoded,
        reconnects,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(p: &RoundWork) -> Option<(usize, usize)> {
        match p {
            RoundWork::Prefill { from, to } | RoundWork::CatchUp { from, to } => Some((*from, *to)),
            _ => None,
        }
    }

    #[test]
    fn a_round_prefills_and_catches_up_at_most_its_budget_oldest_first_and_drafts_untouched() {
        let draft = || {
            RoundWork::Draft(tandem_spec::Frontier {
                base: 10,
                leaves: vec![vec![1, 2]],
                cuts: 0,
            })
        };
        let mut plans = vec![
            (0, RoundWork::Prefill { from: 0, to: 40 }),
            (1, draft()),
            (2, RoundWork::CatchUp { from: 30, to: 64 }),
            (3, RoundWork::Prefill { from: 64, to: 128 }),
            (4, draft()),
        ];
        limit_prefill(&mut plans);
        let kept: Vec<(usize, Option<(usize, usize)>)> =
            plans.iter().map(|(i, p)| (*i, span(p))).collect();
        // 40 + 24 = ROUND_PREFILL; the third fill waits for a later round.
        assert_eq!(ROUND_PREFILL, 64);
        assert_eq!(
            kept,
            vec![
                (0, Some((0, 40))),
                (1, None),
                (2, Some((30, 54))),
                (4, None)
            ]
        );
    }
}
