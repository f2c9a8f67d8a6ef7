//! The `tandem.v1.Verifier` gRPC service. Every incoming message is validated into a domain value or
//! answered with an `INVALID_ARGUMENT` error naming the field before anything reaches the batcher;
//! a bad draft is refused without ending the session.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use tandem_proto::v1::verifier_server::{Verifier as VerifierRpc, VerifierServer};
use tandem_proto::v1::{
    cloud_message, edge_message, CloudMessage, EdgeMessage, GenerateRequest, GenerateResponse,
    InfoRequest, InfoResponse, Load, ModelInfo, Opened,
};
use tandem_proto::{block_from_proto, params_from_proto, rule_from_proto, PROTOCOL_VERSION};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use tandem_sched::GrantPolicy;

use crate::{Gauges, ToCloud, ToEdge};

/// What the service tells edges about itself and grants them.
#[derive(Debug, Clone)]
pub struct ServiceInfo {
    pub model: ModelInfo,
    /// End-of-generation ids of the served tokenizer (cloud-only generation stops at them).
    pub eog: Vec<u32>,
    pub max_draft_len: u32,
    pub max_depth: u32,
    /// Tokens per forward at which the target turns compute-bound: new sessions get smaller
    /// grants as the load nears it ([`GrantPolicy`]).
    pub saturation_tokens: f64,
}

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
            max_draft_len: max_draft_len.max(1),
            max_depth: max_depth.max(1),
            saturation_tokens: DEFAULT_SATURATION_TOKENS,
        }
    }
}

/// Where the SmolLM2 target turns compute-bound on a 2-vCPU machine (`bench engine`: a ragged
/// forward stops gaining throughput beyond about 4 sessions × 5 tokens).
pub const DEFAULT_SATURATION_TOKENS: f64 = 32.0;

/// What [`serve_grpc`] fails with.
pub type TransportError = tonic::transport::Error;

pub struct Service {
    batcher: Arc<Mutex<Sender<ToCloud>>>,
    info: ServiceInfo,
    gauges: Arc<Gauges>,
    next_session: AtomicU64,
    grant: Mutex<GrantPolicy>,
}

const INVALID_ARGUMENT: u32 = 3;

fn error(code: u32, message: impl Into<String>) -> CloudMessage {
    CloudMessage {
        kind: Some(cloud_message::Kind::Error(tandem_proto::v1::Error {
            code,
            message: message.into(),
        })),
    }
}

impl Service {
    /// A service in front of the batcher fed by `batcher`; `gauges` are the ones that batcher's
    /// [`serve`](crate::serve) updates.
    pub fn new(batcher: Sender<ToCloud>, info: ServiceInfo, gauges: Arc<Gauges>) -> Self {
        Self {
            batcher: Arc::new(Mutex::new(batcher)),
            grant: Mutex::new(GrantPolicy::new(
                info.max_draft_len,
                info.max_depth,
                info.saturation_tokens,
            )),
            info,
            gauges,
            next_session: AtomicU64::new(1),
        }
    }

    /// The load gauges and metrics the batcher behind this service updates.
    pub fn gauges(&self) -> Arc<Gauges> {
        self.gauges.clone()
    }

    pub fn into_server(self) -> VerifierServer<Self> {
        VerifierServer::new(self)
    }

    fn send(&self, m: ToCloud) -> Result<(), Status> {
        self.batcher
            .lock()
            .map_err(|_| Status::internal("batcher lock poisoned"))?
            .send(m)
            .map_err(|_| Status::unavailable("the verifier is shutting down"))
    }

    /// Validate an `Open` into the batcher's message, or say which field is wrong.
    fn open(
        &self,
        o: tandem_proto::v1::Open,
        session: u64,
        out: UnboundedSender<Result<CloudMessage, Status>>,
    ) -> Result<(ToCloud, u32, u32), String> {
        let m = &self.info.model;
        if o.protocol_version != PROTOCOL_VERSION {
            return Err(format!(
                "open.protocol_version: {} is not supported (this verifier speaks {PROTOCOL_VERSION})",
                o.protocol_version
            ));
        }
        if o.tokenizer_fingerprint != m.tokenizer_fingerprint {
            return Err(format!(
                "open.tokenizer_fingerprint: the edge's tokenizer {} does not match the served model's {}: \
                 the draft and the target must share one tokenizer",
                o.tokenizer_fingerprint, m.tokenizer_fingerprint
            ));
        }
        if o.prompt_ids.is_empty() {
            return Err("open.prompt_ids: the prompt is empty".into());
        }
        if let Some(t) = o.prompt_ids.iter().find(|&&t| t >= m.vocab_size) {
            return Err(format!(
                "open.prompt_ids: token id {t} is outside the vocabulary ({})",
                m.vocab_size
            ));
        }
        if o.max_tokens == 0 {
            return Err("open.max_tokens: must be at least 1".into());
        }
        let end = o.prompt_ids.len() as u64 + o.max_tokens as u64;
        if end > m.context_length as u64 {
            return Err(format!(
                "open.max_tokens: prompt ({}) plus max_tokens ({}) exceed the context length {}",
                o.prompt_ids.len(),
                o.max_tokens,
                m.context_length
            ));
        }
        let params = params_from_proto(o.params).map_err(|e| format!("open.{e}"))?;
        let rule = rule_from_proto(o.rule).map_err(|e| format!("open.{e}"))?;
        let load = self.gauges.tokens_per_forward_x100.load(Ordering::Relaxed) as f64 / 100.0;
        let (max_gamma, max_depth) = self
            .grant
            .lock()
            .map(|mut g| g.grant(load))
            .unwrap_or((1, 1));
        let gamma = o.want_draft_len.clamp(1, max_gamma);
        let depth = o.want_depth.clamp(1, max_depth);
        let reply = Box::new(move |msg: ToEdge| {
            let m = match msg {
                ToEdge::Opened { session, first } => CloudMessage {
                    kind: Some(cloud_message::Kind::Opened(Opened {
                        session_id: session,
                        model: None,
                        draft_len: gamma,
                        depth,
                        first_token: first,
                    })),
                },
                ToEdge::Verdict(v) => CloudMessage {
                    kind: Some(cloud_message::Kind::Verdict(v.into())),
                },
                ToEdge::Error { message } => error(INVALID_ARGUMENT, message),
                ToEdge::Token { .. } => return true,
            };
            out.send(Ok(m)).is_ok()
        });
        Ok((
            ToCloud::Open {
                session,
                prompt: o.prompt_ids,
                params,
                rule,
                reply,
            },
            gamma,
            depth,
        ))
    }
}

#[tonic::async_trait]
impl VerifierRpc for Service {
    type SessionStream = UnboundedReceiverStream<Result<CloudMessage, Status>>;
    type GenerateStream = UnboundedReceiverStream<Result<GenerateResponse, Status>>;

    async fn session(
        &self,
        req: Request<Streaming<EdgeMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = unbounded_channel();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("the session stream closed before Open"))?;
        let Some(edge_message::Kind::Open(open)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first message of a session must be Open",
            ));
        };
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        let (msg, gamma, _) = self
            .open(open, session, tx.clone())
            .map_err(Status::invalid_argument)?;
        self.send(msg)?;
        let batcher = self.batcher.clone();
        let vocab = self.info.model.vocab_size as usize;
        tokio::spawn(async move {
            let send = |m: ToCloud| batcher.lock().map(|b| b.send(m).is_ok()).unwrap_or(false);
            loop {
                match inbound.message().await {
                    Ok(Some(EdgeMessage {
                        kind: Some(edge_message::Kind::Draft(d)),
                    })) => match block_from_proto(d, vocab, gamma as usize) {
                        Ok(block) => {
                            if !send(ToCloud::Draft { session, block }) {
                                break;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Ok(error(INVALID_ARGUMENT, e.to_string())));
                        }
                    },
                    Ok(Some(EdgeMessage {
                        kind: Some(edge_message::Kind::Open(_)),
                    })) => {
                        let _ = tx.send(Ok(error(
                            INVALID_ARGUMENT,
                            "open: the session is already open",
                        )));
                    }
                    Ok(Some(EdgeMessage { kind: None })) => {
                        let _ = tx.send(Ok(error(INVALID_ARGUMENT, "kind: empty message")));
                    }
                    // Close, end of stream or a broken connection: free the session.
                    _ => break,
                }
            }
            send(ToCloud::Close { session });
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let r = req.into_inner();
        let m = &self.info.model;
        if r.tokenizer_fingerprint != m.tokenizer_fingerprint {
            return Err(Status::invalid_argument(format!(
                "tokenizer_fingerprint: {} does not match the served model's {}",
                r.tokenizer_fingerprint, m.tokenizer_fingerprint
            )));
        }
        if r.prompt_ids.is_empty() {
            return Err(Status::invalid_argument("prompt_ids: the prompt is empty"));
        }
        if let Some(t) = r.prompt_ids.iter().find(|&&t| t >= m.vocab_size) {
            return Err(Status::invalid_argument(format!(
                "prompt_ids: token id {t} is outside the vocabulary ({})",
                m.vocab_size
            )));
        }
        if r.max_tokens == 0
            || r.prompt_ids.len() as u64 + r.max_tokens as u64 > m.context_length as u64
        {
            return Err(Status::invalid_argument(format!(
                "max_tokens: {} with a prompt of {} must be at least 1 and fit the context length {}",
                r.max_tokens,
                r.prompt_ids.len(),
                m.context_length
            )));
        }
        let params =
            params_from_proto(r.params).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let (tx, rx) = unbounded_channel();
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        let reply = Box::new(move |msg: ToEdge| {
            let m = match msg {
                ToEdge::Token { token, done } => Ok(GenerateResponse {
                    tokens: vec![token],
                    done,
                }),
                ToEdge::Error { message } => Err(Status::internal(message)),
                _ => return true,
            };
            tx.send(m).is_ok()
        });
        self.send(ToCloud::Generate {
            session,
            prompt: r.prompt_ids,
            params,
            max_tokens: r.max_tokens as usize,
            eog: self.info.eog.clone(),
            reply,
        })?;
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn info(&self, _req: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Ok(Response::new(InfoResponse {
            model: Some(self.info.model.clone()),
            protocol_version: PROTOCOL_VERSION,
            max_draft_len: self.info.max_draft_len,
            max_depth: self.info.max_depth,
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
}

/// Start the batcher thread over `engine` and the service in front of it. The thread ends (and
/// hands back the verifier) when the service is dropped.
pub fn start(
    engine: tandem_engine::Engine,
    info: ServiceInfo,
) -> std::io::Result<(Service, std::thread::JoinHandle<crate::Verifier>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let gauges = Arc::new(Gauges::default());
    let g = gauges.clone();
    let batcher = std::thread::Builder::new()
        .name("tandem-batcher".into())
        .spawn(move || crate::serve(crate::Verifier::new(engine), rx, g))?;
    Ok((Service::new(tx, info, gauges), batcher))
}

/// Serve `service` on `listener` until `shutdown` resolves, with the standard gRPC health service
/// (`grpc.health.v1.Health`) reporting `tandem.v1.Verifier` (and the server as a whole, `""`) as
/// serving.
pub async fn serve_grpc(
    service: Service,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<VerifierServer<Service>>().await;
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}
