//! The `tandem.v1.Verifier` gRPC service. Each RPC authenticates its caller (an API key names the
//! tenant, [`Tenants`]), validates every message ([`validation`](crate::validation)) before
//! anything reaches the batcher, and binds a session to the tenant that opened it: another
//! tenant's key finds nothing. A session refused for load ends its RPC with `RESOURCE_EXHAUSTED`
//! and a `retry-after-ms` trailer; a bad draft is refused without ending the session; shutting
//! down drains: no new sessions, open ones finish (up to a timeout).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_proto::v1::verifier_server::{Verifier as VerifierRpc, VerifierServer};
use tandem_proto::v1::{
    cloud_message, edge_message, Admitted, Cancelled, CloudMessage, EdgeMessage, GenerateRequest,
    GenerateResponse, InfoRequest, InfoResponse, Load, ModelInfo, Opened, SessionRef, SessionState,
};
use tandem_proto::PROTOCOL_VERSION;
use tandem_sched::{SessionId, TenantId};
use tokio::sync::mpsc::{channel, Receiver};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::tenants::Tenants;
use tandem_verifier::{Inbound, LoadConfig, Mode, NewSession, ToEdge, VerifierError};

use crate::validation::{OnStream, SessionStream};
use crate::{code, validation, Gauges, Reply, ToCloud};

/// What the service tells edges about itself and grants them.
#[derive(Debug, Clone)]
pub struct ServiceInfo {
    pub model: ModelInfo,
    /// End-of-generation ids of the served tokenizer (cloud-only generation stops at them).
    pub eog: Vec<u32>,
    /// How long a session stream may take to send its `Open`: past it the stream is cut
    /// (DEADLINE_EXCEEDED), so that streams that never open hold nothing.
    pub open_deadline: Duration,
    /// The served model's vocabulary for structured outputs (None: grammars are refused).
    pub grammar: Option<tandem_spec::GrammarVocab>,
}

/// The largest message either side may send: a block (γ ≤ 8 tokens, each with a q of at most
/// 256 entries) or an Open (a prompt of the whole context) is far below it.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// Streams one HTTP/2 connection may hold open at once (sessions of one edge process share a
/// connection).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

/// How often the verifier pings each connection, and how long it waits for the answer: a dead
/// peer (a half-open TCP connection) is found and its sessions freed.
pub const KEEPALIVE: Duration = Duration::from_secs(10);

/// A session's idle timeout by default (ms).
pub const IDLE_TIMEOUT_MS: u64 = 60_000;

/// How a verifier serving over gRPC meets its load by default: grants of at most
/// `max_draft_len` and `max_depth` that adapt to the load, and sessions closed after
/// [`IDLE_TIMEOUT_MS`] without a word from their edge.
pub fn serving_load(max_draft_len: u32, max_depth: u32) -> LoadConfig {
    LoadConfig {
        idle_timeout_ms: Some(IDLE_TIMEOUT_MS),
        ..LoadConfig::new(max_draft_len, max_depth)
    }
}

/// A session's `Open` deadline by default.
pub const OPEN_DEADLINE: Duration = Duration::from_secs(10);

impl ServiceInfo {
    /// What a verifier serving `model` (with its `tokenizer`) tells edges.
    pub fn new(
        name: &str,
        model: &tandem_engine::LlamaModel,
        tokenizer: &tandem_engine::Tokenizer,
    ) -> Self {
        Self {
            model: ModelInfo {
                name: name.to_string(),
                tokenizer_fingerprint: tokenizer.fingerprint().to_string(),
                vocab_size: model.cfg.vocab as u32,
                context_length: model.cfg.context_len as u32,
                weights: model.format(),
            },
            eog: tokenizer.eog_ids(),
            open_deadline: OPEN_DEADLINE,
            grammar: match tokenizer.grammar_vocab(model.cfg.vocab) {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::warn!("structured outputs are refused: {e}");
                    None
                }
            },
        }
    }
}

pub use tandem_verifier::DEFAULT_SATURATION_TOKENS;

/// What [`serve_grpc`] fails with.
pub type TransportError = tonic::transport::Error;

pub struct Service {
    batcher: Arc<Mutex<Sender<ToCloud>>>,
    info: ServiceInfo,
    /// What the core grants at most (its [`VerifierConfig::load`](tandem_verifier::VerifierConfig)):
    /// told in `Info`, and the size a session's blocks are checked against.
    load: LoadConfig,
    gauges: Arc<Gauges>,
    tenants: Arc<Tenants>,
    /// Session ids: a keyed permutation of a counter (they reveal no volume).
    ids: crate::ids::SessionIds,
    /// Set when the drain begins: new sessions are refused here at once. The core refuses them
    /// too (it drains on the same signal), in order with the messages already on their way.
    draining: Arc<AtomicBool>,
}

type Batcher = Arc<Mutex<Sender<ToCloud>>>;

fn send_to(batcher: &Batcher, m: ToCloud) -> Result<(), Status> {
    batcher
        .lock()
        .map_err(|_| Status::internal("batcher lock poisoned"))?
        .send(m)
        .map_err(|_| Status::unavailable("the verifier is shutting down"))
}

/// Send the request `make` builds around its reply, and wait for the answer.
async fn ask<T: Send + 'static>(
    batcher: &Batcher,
    make: impl FnOnce(Box<dyn FnOnce(T) + Send>) -> ToCloud,
) -> Result<T, Status> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    send_to(
        batcher,
        make(Box::new(move |t| {
            let _ = tx.send(t);
        })),
    )?;
    rx.await
        .map_err(|_| Status::unavailable("the verifier is shutting down"))
}

fn error(code: tonic::Code, message: impl Into<String>) -> CloudMessage {
    CloudMessage {
        kind: Some(cloud_message::Kind::Error(tandem_proto::v1::Error {
            code: code as u32,
            message: message.into(),
        })),
    }
}

/// A session-ending refusal as a status, with the retry hint as a `retry-after-ms` trailer (and
/// in the message).
fn refusal(e: &VerifierError, retry_after_ms: Option<u64>) -> Status {
    let message = match retry_after_ms {
        Some(ms) => format!("{e}; retry after about {ms} ms"),
        None => e.to_string(),
    };
    let mut s = Status::new(code(e), message);
    if let Some(ms) = retry_after_ms {
        if let Ok(v) = ms.to_string().parse() {
            s.metadata_mut().insert("retry-after-ms", v);
        }
    }
    s
}

/// Messages a session's stream may hold unread before the verifier ends the session: an edge
/// reads every message as it comes, so only one that has stopped reading fills it.
pub const OUTBOX: usize = 1024;

/// Messages of one session refused (bad drafts, a second Open, empty ones) before its stream is
/// cut: a working edge sends none.
pub const BAD_MESSAGES: usize = 32;

/// Answer a refused message on the session's stream; `false` when the stream must end: past
/// [`BAD_MESSAGES`] (then the stream ends with RESOURCE_EXHAUSTED), or when the edge is not
/// reading what it was sent.
fn refuse(
    tx: &tokio::sync::mpsc::Sender<Result<CloudMessage, Status>>,
    bad: &mut usize,
    m: CloudMessage,
) -> bool {
    *bad += 1;
    if *bad > BAD_MESSAGES {
        let _ = tx.try_send(Err(Status::resource_exhausted(format!(
            "more than {BAD_MESSAGES} refused messages on this session: the stream is closed"
        ))));
        return false;
    }
    tx.try_send(Ok(m)).is_ok()
}

/// Wait for the batcher's first answer: a refusal becomes the RPC's error, anything else starts
/// the response stream.
async fn first_answer<T: Send + 'static>(
    mut rx: Receiver<Result<T, Status>>,
) -> Result<Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>, Status> {
    let first = match rx.recv().await {
        Some(Err(s)) => return Err(s),
        Some(Ok(m)) => m,
        None => return Err(Status::unavailable("the verifier is shutting down")),
    };
    let rest = tokio_stream::wrappers::ReceiverStream::new(rx);
    Ok(Box::pin(tokio_stream::StreamExt::chain(
        tokio_stream::once(Ok(first)),
        rest,
    )))
}

impl Service {
    /// A service in front of the batcher fed by `batcher`; `gauges` are the ones that batcher's
    /// [`run_batcher`](crate::run_batcher) updates; `tenants` authenticates callers.
    pub fn new(
        batcher: Sender<ToCloud>,
        info: ServiceInfo,
        load: LoadConfig,
        gauges: Arc<Gauges>,
        tenants: Arc<Tenants>,
    ) -> Self {
        Self {
            batcher: Arc::new(Mutex::new(batcher)),
            info,
            load,
            gauges,
            tenants,
            ids: crate::ids::SessionIds::new(),
            draining: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The load gauges and metrics the batcher behind this service updates.
    pub fn gauges(&self) -> Arc<Gauges> {
        self.gauges.clone()
    }

    /// Set once the server drains (the batcher may then end).
    pub fn draining(&self) -> Arc<AtomicBool> {
        self.draining.clone()
    }

    pub fn into_server(self) -> VerifierServer<Self> {
        VerifierServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    fn send(&self, m: ToCloud) -> Result<(), Status> {
        send_to(&self.batcher, m)
    }

    /// The caller's tenant, from its `authorization` header.
    fn tenant<T>(&self, req: &Request<T>) -> Result<TenantId, Status> {
        let header = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        self.tenants
            .authenticate(header)
            .map_err(|e| Status::unauthenticated(e.to_string()))
    }

    fn admitting(&self) -> Result<(), Status> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(Status::unavailable(
                "the verifier is draining for shutdown: open the session on another replica",
            ));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl VerifierRpc for Service {
    type SessionStream = Pin<Box<dyn Stream<Item = Result<CloudMessage, Status>> + Send>>;
    type GenerateStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

    async fn session(
        &self,
        req: Request<Streaming<EdgeMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let tenant = self.tenant(&req)?;
        self.admitting()?;
        let mut inbound = req.into_inner();
        let deadline = self.info.open_deadline;
        let first = tokio::time::timeout(deadline, inbound.message())
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "open: no Open within {} ms of the stream's start",
                    deadline.as_millis()
                ))
            })??
            .ok_or_else(|| Status::invalid_argument("the session stream closed before Open"))?;
        let Some(edge_message::Kind::Open(open)) = first.kind else {
            return Err(Status::invalid_argument(
                "kind: the first message of a session must be Open",
            ));
        };
        let mut o = validation::open(open, &self.info.model)?;
        let grammar = validation::compile(
            "open.grammar",
            o.grammar.take(),
            &o.prompt,
            self.info.grammar.as_ref(),
        )
        .await?;
        // The batcher grants within what the edge asks for, as its load allows.
        // Token trees: the side nodes a block may carry (their positions count in the forward's
        // token budget like any other).
        let want = tandem_spec::Shape::new(o.want_draft_len, o.want_depth);
        let (want, side_nodes) = self.load.clamp(want, o.want_side_nodes);
        let (gamma, depth) = (want.draft_len, want.depth);
        let session = SessionId(self.ids.next());
        let (out, rx) = channel(OUTBOX);
        // Only the batcher's record of the session holds the outbox while it opens: if the
        // batcher is gone, the wait for its first answer ends (UNAVAILABLE) instead of hanging.
        let weak = out.downgrade();
        // Dropped with the core's record of the session (closed, refused, failed, idle): the
        // stream's reader ends then, whether or not the edge still sends or reads.
        let (held, mut released) = tokio::sync::oneshot::channel::<()>();
        let reply: Reply = Arc::new(move |msg: ToEdge| {
            let _held = &held;
            let m = match msg {
                ToEdge::Admitted { cached } => Ok(CloudMessage {
                    kind: Some(cloud_message::Kind::Admitted(Admitted {
                        session_id: session.0,
                        cached_tokens: cached as u64,
                    })),
                }),
                ToEdge::Opened {
                    first,
                    grant,
                    cached,
                    first_logprob,
                } => Ok(CloudMessage {
                    kind: Some(cloud_message::Kind::Opened(Opened {
                        first_logprob: first_logprob.as_ref().map(Into::into),
                        session_id: session.0,
                        model: None,
                        draft_len: grant.draft_len,
                        depth: grant.depth,
                        first_token: first,
                        side_nodes,
                        cached_tokens: cached as u64,
                    })),
                }),
                ToEdge::Verdict(v) => Ok(CloudMessage {
                    kind: Some(cloud_message::Kind::Verdict(v.into())),
                }),
                ToEdge::Decoded(d) => Ok(CloudMessage {
                    kind: Some(cloud_message::Kind::Decoded(d.into())),
                }),
                ToEdge::Logprobs(entries) => Ok(CloudMessage {
                    kind: Some(cloud_message::Kind::Logprobs(tandem_proto::v1::Logprobs {
                        entries: entries.iter().map(Into::into).collect(),
                    })),
                }),
                ToEdge::Error {
                    error,
                    retry_after_ms,
                    fatal,
                } => {
                    if fatal {
                        Err(refusal(&error, retry_after_ms))
                    } else {
                        Ok(self::error(code(&error), error.to_string()))
                    }
                }
                ToEdge::Token { .. } => return true,
            };
            // A full outbox is an edge that does not read: the session ends (the batcher
            // closes it), rather than the verifier holding its messages without bound.
            out.try_send(m).is_ok()
        });
        self.send(ToCloud::Core(Inbound::Open {
            session,
            new: NewSession {
                tenant,
                prompt: o.prompt,
                params: o.params,
                max_tokens: o.max_tokens,
                eog: self.info.eog.clone(),
                mode: Mode::Speculate {
                    rule: o.rule,
                    want: tandem_spec::Shape::new(gamma, depth),
                },
                grammar: grammar.map(Box::new),
                logprobs: o.logprobs,
                self_draft: o.self_draft,
            },
            handle: reply,
        }))?;
        let batcher = self.batcher.clone();
        let check = SessionStream {
            session,
            vocab: self.info.model.vocab_size as usize,
            max_len: gamma as usize,
            max_side: side_nodes as usize,
            uses_q: o.rule.effective(&o.params) == tandem_spec::VerifyRule::Rejection,
        };
        // The stream is read from the start: blocks an edge sends right behind its Open (it
        // drafts while the prompt is prefilled) wait in the session's queue for the first
        // forward. What the edge is told (a refusal) goes after `Opened`. (The outbox comes
        // over `opened` once the session is open; the reader holds it from then on, as the
        // batcher does, so the response stream lasts while either does.) The reader ends when
        // the edge hangs up, when the response stream is gone, or when the core lets the
        // session go (`released`: closed, failed, or idle past its timeout, even if its edge
        // neither sends nor reads).
        let (opened, on_open) = tokio::sync::oneshot::channel();
        let reader = tokio::spawn(async move {
            let send = |m: ToCloud| batcher.lock().map(|b| b.send(m).is_ok()).unwrap_or(false);
            // Messages refused so far: past BAD_MESSAGES the stream is cut.
            let mut bad = 0usize;
            let mut on_open = Some(on_open);
            let mut tx: Option<tokio::sync::mpsc::Sender<Result<CloudMessage, Status>>> = None;
            loop {
                let next = tokio::select! {
                    m = inbound.message() => m,
                    t = async { on_open.as_mut().expect("guarded").await }, if on_open.is_some() => {
                        on_open = None;
                        match t {
                            Ok(t) => {
                                tx = Some(t);
                                continue;
                            }
                            // The session failed to open.
                            Err(_) => break,
                        }
                    }
                    _ = async { tx.as_ref().expect("guarded").closed().await }, if tx.is_some() => break,
                    _ = &mut released => break,
                };
                let to_edge = match next {
                    Ok(Some(m)) => match check.message(m) {
                        OnStream::Core(m) => {
                            if !send(ToCloud::Core(m)) {
                                break;
                            }
                            continue;
                        }
                        OnStream::Refuse(e) => Ok(error(e.code(), e.message())),
                        OnStream::End => break,
                    },
                    // End of stream: free the session.
                    Ok(None) => break,
                    // A message the transport refused (past the size limit, undecodable): the
                    // edge is told why, and the session ends.
                    Err(status) => Err(status),
                };
                if let Some(w) = on_open.take() {
                    // Wait for the session to open (a failed open ends the reader).
                    match w.await {
                        Ok(t) => tx = Some(t),
                        Err(_) => break,
                    }
                }
                let Some(tx) = tx.as_ref() else { break };
                match to_edge {
                    Ok(m) => {
                        if !refuse(tx, &mut bad, m) {
                            break;
                        }
                    }
                    Err(status) => {
                        let _ = tx.try_send(Err(status));
                        break;
                    }
                }
            }
            send(ToCloud::Core(Inbound::Close { session }));
        });
        let stream = match first_answer(rx).await {
            Ok(s) => s,
            Err(e) => {
                reader.abort();
                return Err(e);
            }
        };
        let Some(tx) = weak.upgrade() else {
            reader.abort();
            return Err(Status::unavailable("the verifier is shutting down"));
        };
        let _ = opened.send(tx);
        Ok(Response::new(stream))
    }

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let tenant = self.tenant(&req)?;
        self.admitting()?;
        let mut g = validation::generate(req.into_inner(), &self.info.model)?;
        let grammar = validation::compile(
            "generate.grammar",
            g.grammar.take(),
            &g.prompt,
            self.info.grammar.as_ref(),
        )
        .await?;
        let (tx, rx) = channel(OUTBOX);
        let session = SessionId(self.ids.next());
        let reply: Reply = Arc::new(move |msg: ToEdge| {
            let m = match msg {
                ToEdge::Token { token, done } => Ok(GenerateResponse {
                    tokens: vec![token],
                    done,
                    cached_tokens: 0,
                }),
                ToEdge::Admitted { cached } => Ok(GenerateResponse {
                    tokens: Vec::new(),
                    done: false,
                    cached_tokens: cached as u64,
                }),
                ToEdge::Error {
                    error,
                    retry_after_ms,
                    ..
                } => Err(refusal(&error, retry_after_ms)),
                _ => return true,
            };
            // A full outbox: the client does not read; the stream ends.
            tx.try_send(m).is_ok()
        });
        self.send(ToCloud::Core(Inbound::Open {
            session,
            new: NewSession {
                tenant,
                prompt: g.prompt,
                params: g.params,
                max_tokens: g.max_tokens,
                eog: self.info.eog.clone(),
                mode: Mode::Generate,
                grammar: grammar.map(Box::new),
                logprobs: None,
                self_draft: g.self_draft,
            },
            handle: reply,
        }))?;
        Ok(Response::new(first_answer(rx).await?))
    }

    async fn info(&self, req: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        self.tenant(&req)?;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Ok(Response::new(InfoResponse {
            model: Some(self.info.model.clone()),
            protocol_version: PROTOCOL_VERSION,
            max_draft_len: self.load.max_draft_len,
            max_depth: self.load.max_depth,
            load: Some(Load {
                sessions: g(&self.gauges.sessions),
                generations: g(&self.gauges.generations),
                kv_blocks_used: g(&self.gauges.kv_blocks_used),
                kv_blocks_total: g(&self.gauges.kv_blocks_total),
                target_forwards: g(&self.gauges.target_forwards),
                tokens_per_forward: g(&self.gauges.tokens_per_forward_x100) as f64 / 100.0,
            }),
        }))
    }

    async fn get_session(
        &self,
        req: Request<SessionRef>,
    ) -> Result<Response<SessionState>, Status> {
        let tenant = self.tenant(&req)?;
        let id = SessionId(req.into_inner().session_id);
        let s = ask(&self.batcher, |reply| ToCloud::Query {
            session: id,
            tenant,
            reply,
        })
        .await?
        .ok_or_else(|| {
            Status::not_found(format!("session_id: no open session {id} for this caller"))
        })?;
        Ok(Response::new(SessionState {
            session_id: id.0,
            committed_len: s.committed_len as u64,
            epoch: s.epoch,
            verified_positions: s.verified_positions,
            queued_blocks: s.queued_blocks as u32,
            prefilled: s.prefilled,
        }))
    }

    async fn cancel(&self, req: Request<SessionRef>) -> Result<Response<Cancelled>, Status> {
        let tenant = self.tenant(&req)?;
        let id = SessionId(req.into_inner().session_id);
        ask(&self.batcher, |reply| ToCloud::Cancel {
            session: id,
            tenant,
            reply,
        })
        .await?
        .map_err(|_| {
            Status::not_found(format!("session_id: no open session {id} for this caller"))
        })?;
        Ok(Response::new(Cancelled {}))
    }
}

mod serve;
mod start;
mod watchdog;

pub use serve::{serve_grpc, serve_grpc_tls, ServerTls, DRAIN_GRACE, LIVENESS};
pub use start::{start, start_with_ledger};
pub use watchdog::batcher_failure;
