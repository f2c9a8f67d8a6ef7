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
    cloud_message, edge_message, Cancelled, CloudMessage, EdgeMessage, GenerateRequest,
    GenerateResponse, InfoRequest, InfoResponse, Load, ModelInfo, Opened, SessionRef, SessionState,
};
use tandem_proto::PROTOCOL_VERSION;
use tandem_sched::{SessionId, TenantId};
use tokio::sync::mpsc::{channel, Receiver};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::tenants::Tenants;
use tandem_verifier::{Inbound, LoadConfig, Mode, NewSession, ToEdge, VerifierCore, VerifierError};

use crate::validation::{OnStream, SessionStream};
use crate::{code, validation, Gauges, Reply, ToCloud};

/// What the service tells edges about itself and grants them.
#[derive(Debug, Clone)]
pub struct ServiceInfo {
    pub model: ModelInfo,
    /// End-of-generation ids of the served tokenizer (cloud-only generation stops at them).
    pub eog: Vec<u32>,
    /// What it grants and how it adapts to its load ([`start`] keeps a token tree's side nodes
    /// within the forward's token budget: a tree that exceeded it could never be verified).
    pub load: LoadConfig,
    /// How long a session stream may take to send its `Open`: past it the stream is cut
    /// (DEADLINE_EXCEEDED), so that streams that never open hold nothing.
    pub open_deadline: Duration,
    /// How long an open session may go without a message from its edge (a block, an ack, a
    /// close) before it is closed.
    pub idle_timeout: Duration,
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

/// A session's idle timeout by default.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A session's `Open` deadline by default.
pub const OPEN_DEADLINE: Duration = Duration::from_secs(10);

impl ServiceInfo {
    /// What a verifier serving `model` (with its `tokenizer`) tells edges, granting at most
    /// `max_draft_len` and `max_depth`.
    pub fn new(
        name: &str,
        model: &tandem_engine::LlamaModel,
        tokenizer: &tandem_engine::Tokenizer,
        max_draft_len: u32,
        max_depth: u32,
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
            load: LoadConfig::new(max_draft_len, max_depth),
            open_deadline: OPEN_DEADLINE,
            idle_timeout: IDLE_TIMEOUT,
        }
    }
}

pub use tandem_verifier::DEFAULT_SATURATION_TOKENS;

/// What [`serve_grpc`] fails with.
pub type TransportError = tonic::transport::Error;

pub struct Service {
    batcher: Arc<Mutex<Sender<ToCloud>>>,
    info: ServiceInfo,
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
        gauges: Arc<Gauges>,
        tenants: Arc<Tenants>,
    ) -> Self {
        Self {
            batcher: Arc::new(Mutex::new(batcher)),
            info,
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
        let o = validation::open(open, &self.info.model)?;
        // The batcher grants within what the edge asks for, as its load allows.
        // Token trees: the side nodes a block may carry (their positions count in the forward's
        // token budget like any other).
        let want = tandem_spec::Shape::new(o.want_draft_len, o.want_depth);
        let (want, side_nodes) = self.info.load.clamp(want, o.want_side_nodes);
        let (gamma, depth) = (want.draft_len, want.depth);
        let session = SessionId(self.ids.next());
        let (out, rx) = channel(OUTBOX);
        // Only the batcher's record of the session holds the outbox while it opens: if the
        // batcher is gone, the wait for its first answer ends (UNAVAILABLE) instead of hanging.
        let weak = out.downgrade();
        let reply: Reply = Arc::new(move |msg: ToEdge| {
            let m = match msg {
                ToEdge::Opened { first, grant } => Ok(CloudMessage {
                    kind: Some(cloud_message::Kind::Opened(Opened {
                        session_id: session.0,
                        model: None,
                        draft_len: grant.draft_len,
                        depth: grant.depth,
                        first_token: first,
                        side_nodes,
                    })),
                }),
                ToEdge::Verdict(v) => Ok(CloudMessage {
                    kind: Some(cloud_message::Kind::Verdict(v.into())),
                }),
                ToEdge::Decoded(d) => Ok(CloudMessage {
                    kind: Some(cloud_message::Kind::Decoded(d.into())),
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
        let idle = self.info.idle_timeout;
        // The stream is read from the start: blocks an edge sends right behind its Open (it
        // drafts while the prompt is prefilled) wait in the session's queue for the first
        // forward. What the edge is told (a refusal, the idle deadline) goes after `Opened`.
        // (The outbox comes over `opened` once the session is open; the reader holds it from
        // then on, as the batcher does, so the response stream lasts while either does.)
        let (opened, on_open) = tokio::sync::oneshot::channel();
        let reader = tokio::spawn(async move {
            let send = |m: ToCloud| batcher.lock().map(|b| b.send(m).is_ok()).unwrap_or(false);
            // Messages refused so far: past BAD_MESSAGES the stream is cut.
            let mut bad = 0usize;
            let mut on_open = Some(on_open);
            let mut tx = None;
            loop {
                // An edge that neither sends nor reads is idle: one that reads acks what it is
                // sent, one that drafts sends blocks.
                let next = tokio::time::timeout(idle, inbound.message()).await;
                if let Some(w) = on_open.as_mut() {
                    if let Ok(t) = w.try_recv() {
                        (tx, on_open) = (Some(t), None);
                    }
                }
                let to_edge = match next {
                    Ok(Ok(Some(m))) => match check.message(m) {
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
                    Ok(Ok(None)) => break,
                    // A message the transport refused (past the size limit, undecodable): the
                    // edge is told why, and the session ends.
                    Ok(Err(status)) => Err(status),
                    Err(_) => Err(Status::deadline_exceeded(format!(
                        "idle: nothing from the edge in {} s; the session is closed",
                        idle.as_secs_f64()
                    ))),
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
        let g = validation::generate(req.into_inner(), &self.info.model)?;
        let (tx, rx) = channel(OUTBOX);
        let session = SessionId(self.ids.next());
        let reply: Reply = Arc::new(move |msg: ToEdge| {
            let m = match msg {
                ToEdge::Token { token, done } => Ok(GenerateResponse {
                    tokens: vec![token],
                    done,
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
            max_draft_len: self.info.load.max_draft_len,
            max_depth: self.info.load.max_depth,
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

/// Start the batcher thread over `engine` (a verifier core with `cfg`) and the service in front
/// of it, serving `tenants` (their weights and quotas are set on the core). The thread ends (and
/// hands back the core) when the service is dropped.
pub fn start(
    engine: tandem_engine::Engine,
    cfg: tandem_verifier::VerifierConfig,
    info: ServiceInfo,
    tenants: Tenants,
) -> Result<
    (
        Service,
        std::thread::JoinHandle<VerifierCore<tandem_engine::Engine, Reply>>,
    ),
    VerifierError,
> {
    start_with_ledger(engine, cfg, info, tenants, None)
}

/// [`start`], recording every ended session in `ledger` (see [`crate::ledger`]).
pub fn start_with_ledger(
    engine: tandem_engine::Engine,
    cfg: tandem_verifier::VerifierConfig,
    mut info: ServiceInfo,
    tenants: Tenants,
    ledger: Option<crate::ledger::Ledger>,
) -> Result<
    (
        Service,
        std::thread::JoinHandle<VerifierCore<tandem_engine::Engine, Reply>>,
    ),
    VerifierError,
> {
    // A block's forward feeds the last committed token, γ tokens and the side nodes.
    info.load = info.load.within_budget(cfg.token_budget);
    let mut core = VerifierCore::new(engine, cfg)?.with_grants(info.load.grants(), 0);
    if let Some(cost) = &info.load.forward_cost {
        core.set_contended_budget(cfg.contended_budget(cost))?;
    }
    for (id, cfg) in tenants.configs() {
        core.set_tenant(id, cfg)?;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let gauges = Arc::new(Gauges::default());
    let g = gauges.clone();
    let names = tenants.names().to_vec();
    let batcher = std::thread::Builder::new()
        .name("tandem-batcher".into())
        .spawn(move || crate::run_batcher(core, rx, g, names, ledger))
        .map_err(|e| VerifierError::Engine(format!("starting the batcher: {e}")))?;
    Ok((Service::new(tx, info, gauges, Arc::new(tenants)), batcher))
}

/// A verifier's TLS identity: its certificate chain and its private key, PEM.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl ServerTls {
    /// Whether rustls takes the certificate and key (checked before a server starts, so that a
    /// bad file is refused at once and by name).
    pub fn check(&self) -> Result<(), String> {
        let id = tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem);
        tonic::transport::Server::builder()
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(id))
            .map(|_| ())
            .map_err(|e| {
                let mut s = e.to_string();
                let mut at = std::error::Error::source(&e);
                while let Some(c) = at {
                    s.push_str(&format!(": {c}"));
                    at = c.source();
                }
                s
            })
    }
}

/// [`serve_grpc_tls`] in plaintext (loopback, or behind a proxy that terminates TLS).
pub async fn serve_grpc(
    service: Service,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
    drain_timeout: Duration,
) -> Result<(), tonic::transport::Error> {
    serve_grpc_tls(service, listener, shutdown, drain_timeout, None, None).await
}

/// Serve `service` on `listener` with the standard gRPC health service (`grpc.health.v1.Health`:
/// `""` and `tandem.v1.Verifier` SERVING), over TLS (rustls) when `tls` is given. When
/// `shutdown` resolves it drains: health turns NOT_SERVING, new sessions are refused with
/// UNAVAILABLE, open ones run until they end or `drain_timeout` passes (then their streams end
/// with UNAVAILABLE), and the server stops. A certificate or key that does not parse is an error
/// before anything is served.
///
/// With `health`, the same health service is served there too, in plaintext and alone (for
/// probes that cannot speak TLS, such as Kubernetes' gRPC probes), with one more service name,
/// [`LIVENESS`], SERVING for as long as the process serves (a drain does not turn it: a
/// draining verifier is alive, only not ready).
pub async fn serve_grpc_tls(
    service: Service,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
    drain_timeout: Duration,
    tls: Option<&ServerTls>,
    health_listener: Option<tokio::net::TcpListener>,
) -> Result<(), tonic::transport::Error> {
    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE))
        .tcp_keepalive(Some(Duration::from_secs(30)));
    if let Some(t) = tls {
        let id = tonic::transport::Identity::from_pem(&t.cert_pem, &t.key_pem);
        builder = builder.tls_config(tonic::transport::ServerTlsConfig::new().identity(id))?;
    }
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<VerifierServer<Service>>().await;
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    reporter
        .set_service_status(LIVENESS, tonic_health::ServingStatus::Serving)
        .await;
    if let Some(l) = health_listener {
        let probes = tonic::transport::Server::builder()
            .add_service(health.clone())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l));
        tokio::spawn(async move {
            if let Err(e) = probes.await {
                tracing::error!("the health listener stopped: {e}");
            }
        });
    }
    let (draining, batcher) = (service.draining.clone(), service.batcher.clone());
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = async move {
        shutdown.await;
        draining.store(true, Ordering::Relaxed);
        reporter.set_not_serving::<VerifierServer<Service>>().await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let deadline = tokio::time::Instant::now() + drain_timeout;
        // The core stops admitting with the first Drain; its answer counts what is still open
        // after it, so no session can slip in between the count and the shut-down.
        loop {
            match ask(&batcher, |reply| ToCloud::Drain { reply }).await {
                Ok(0) | Err(_) => break,
                Ok(_) if tokio::time::Instant::now() >= deadline => {
                    let _ = ask(&batcher, |reply| ToCloud::ShutDown {
                        reply: Box::new(move || reply(())),
                    })
                    .await;
                    break;
                }
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        tracing::info!("drained");
        let _ = drained_tx.send(());
    };
    let server = builder
        .add_service(health)
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            drain,
        );
    // Once drained, connections get a moment to flush their last messages; one whose client does
    // not read (its stream can never finish) does not hold the shutdown past it.
    tokio::select! {
        r = server => r,
        _ = async {
            if drained_rx.await.is_ok() {
                tokio::time::sleep(DRAIN_GRACE).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => {
            tracing::warn!(
                "connections still open {} ms after the drain: closing them",
                DRAIN_GRACE.as_millis()
            );
            Ok(())
        }
    }
}

/// The health service name that stays SERVING while the process serves, draining or not (a
/// liveness probe's; readiness asks for `""` or `tandem.v1.Verifier`, which a drain turns).
pub const LIVENESS: &str = "liveness";

/// Watch the batcher thread: the future resolves, with why, if it panics or ends while the server
/// is not draining (every RPC would fail while health said SERVING); it never resolves when the
/// batcher ends with a drain. The returned thread ends when the batcher has (join it to wait for
/// the batcher's last work: the ledger's flush).
pub fn batcher_failure<T: Send + 'static>(
    batcher: std::thread::JoinHandle<T>,
    draining: Arc<AtomicBool>,
) -> (
    impl std::future::Future<Output = String> + Send,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<String>();
    let watcher = std::thread::spawn(move || {
        let why = match batcher.join() {
            Err(p) => {
                let m = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Some(format!("the batcher panicked: {m}"))
            }
            Ok(_) if !draining.load(Ordering::Relaxed) => {
                Some("the batcher stopped while serving".to_string())
            }
            Ok(_) => None,
        };
        if let Some(w) = why {
            tracing::error!("{w}");
            let _ = tx.send(w);
        }
    });
    let failed = async move {
        match rx.await {
            Ok(why) => why,
            Err(_) => std::future::pending().await,
        }
    };
    (failed, watcher)
}

/// How long connections may take to flush after the drain before the server closes them.
pub const DRAIN_GRACE: Duration = Duration::from_secs(1);
