//! The edge's gRPC link to a `tandem.v1.Verifier`: opens a `Session` stream, sends draft blocks and
//! hands verdicts to the (synchronous) edge runtime. The stream runs on a tokio runtime; the edge
//! thread blocks on a channel only when its pipeline is full.

use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{cloud_message, edge_message, Ack, EdgeMessage, Open, Opened};
use tandem_proto::{rule_to_proto, FromCloud, PROTOCOL_VERSION};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{Block, VerifyRule};
use tokio::runtime::Runtime;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;

use tandem_spec::edge::Reconnecting;
use tandem_spec::Incoming;

use crate::{EdgeError, Link};

/// Where a session's link puts the target's log-probabilities of its committed tokens, by
/// position (kept across reconnects: every reopen of the session shares it), and how many
/// alternatives each is asked with.
#[derive(Debug, Clone, Default)]
pub struct LogprobSink {
    pub top: usize,
    pub got: std::sync::Arc<
        std::sync::Mutex<std::collections::BTreeMap<usize, tandem_spec::sampling::TokenLogprob>>,
    >,
}

impl LogprobSink {
    pub fn new(top: usize) -> Self {
        Self {
            top,
            got: Default::default(),
        }
    }

    fn put(&self, l: tandem_spec::sampling::TokenLogprob) {
        self.got
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(l.pos, l);
    }

    /// The log-probabilities of positions `from..to`, in order (those that came).
    pub fn range(&self, from: usize, to: usize) -> Vec<tandem_spec::sampling::TokenLogprob> {
        self.got
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .range(from..to)
            .map(|(_, l)| l.clone())
            .collect()
    }
}

/// What the edge asks for when it opens a session.
#[derive(Debug, Clone)]
pub struct OpenRequest {
    pub tokenizer_fingerprint: String,
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: u32,
    pub rule: VerifyRule,
    pub want_draft_len: u32,
    pub want_depth: u32,
    /// Side nodes per block for token trees (0: linear blocks).
    pub want_side_nodes: u32,
    /// The tenant's API key, sent as `authorization: Bearer <key>` (None: a verifier without
    /// tenants).
    pub api_key: Option<String>,
    /// For an `https://` verifier: the certificate authority that signed its certificate (PEM;
    /// None: the public web PKI's roots).
    pub tls_ca: Option<String>,
    /// The session's routing key, sent as the [`ROUTE_HEADER`] of every open and reopen of it,
    /// so that a balancer hashing on it keeps the session on one replica while that replica
    /// lives (None: the link draws one at the first open and keeps it).
    pub route: Option<String>,
    /// Structured output: the grammar the output follows (protocol 6; None: free text).
    pub grammar: Option<tandem_spec::GrammarSource>,
    /// Where in `prompt_ids` the grammar's output starts (None: after them): a reopen sends the
    /// committed output as part of the prompt.
    pub output_from: Option<usize>,
    /// The target's log-probabilities of the committed tokens, asked for and kept here.
    pub logprobs: Option<LogprobSink>,
    /// Let the verifier draft for itself from the session's text while it decodes it alone
    /// (protocol 7; a verifier whose operator turned it off does not).
    pub self_draft: bool,
}

/// The header that carries a session's routing key (see `docs/protocol.md`, "Replicas").
pub const ROUTE_HEADER: &str = "tandem-route";

/// A fresh routing key: 128 random bits in hex. (The std hasher's keys are drawn from the
/// operating system's randomness once per process and stepped for each new hasher.)
pub fn new_route() -> String {
    use std::hash::{BuildHasher, Hasher};
    let draw = || {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    format!("{:016x}{:016x}", draw(), draw())
}

/// How often the edge pings its verifier's connection, and how long it waits for the answer.
pub const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(10);

/// The longest the edge waits for any message while it has blocks in flight: past it the
/// connection is taken for lost (and reopened).
pub const RECV_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// A client of the verifier at `url`: plaintext for `http://`, TLS (rustls) for `https://`,
/// trusting `tls_ca` (PEM) or, without it, the public web PKI's roots. A CA for a plaintext URL is
/// refused by name: the edge would send its key and prompt in the clear though it was told to
/// check a certificate.
pub async fn client(
    url: &str,
    tls_ca: Option<&str>,
) -> Result<VerifierClient<tonic::transport::Channel>, EdgeError> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let mut ep = Endpoint::from_shared(url.to_string())
        .map_err(|e| refused(format!("--cloud {url}: not a URL ({e})")))?;
    match (url.starts_with("https://"), tls_ca) {
        (true, ca) => {
            let tls = match ca {
                Some(pem) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
                None => ClientTlsConfig::new().with_webpki_roots(),
            };
            ep = ep
                .tls_config(tls)
                .map_err(|e| refused(format!("TLS for {url}: {e}")))?;
        }
        (false, Some(_)) => {
            return Err(refused(format!(
                "--tls-ca was given but --cloud {url} is not an https:// URL"
            )))
        }
        (false, None) => {}
    }
    // A verifier that went away without a word (a dead host, a half-open connection) is found by
    // HTTP/2 pings, not by waiting forever.
    ep = ep
        .connect_timeout(std::time::Duration::from_secs(5))
        .http2_keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE)
        .keep_alive_while_idle(true);
    let channel = ep.connect().await.map_err(|e| {
        let m = format!("connecting to {url}: {}", source_chain(&e));
        // A certificate (or TLS) that does not check out is a refusal; anything else, a
        // verifier that is not there (yet).
        let tls = ["certificate", "tls", "TLS", "handshake"]
            .iter()
            .any(|w| m.contains(w));
        plaintext_hint(
            url,
            if tls {
                refused(m)
            } else {
                EdgeError::Unreachable(m)
            },
        )
    })?;
    Ok(VerifierClient::new(channel))
}

/// An error with its causes, which name what went wrong (a refused certificate, a refused
/// connection) where the outermost says only "transport error".
fn source_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut at = e.source();
    while let Some(c) = at {
        // A cause that repeats the message it is under says nothing new.
        let c_text = c.to_string();
        if !s.ends_with(&c_text) {
            s.push_str(": ");
            s.push_str(&c_text);
        }
        at = c.source();
    }
    s
}

/// `msg` as a request that carries `api_key`.
pub fn authorized<T>(msg: T, api_key: Option<&str>) -> Result<tonic::Request<T>, EdgeError> {
    let mut r = tonic::Request::new(msg);
    if let Some(k) = api_key {
        let v = format!("Bearer {k}")
            .parse()
            .map_err(|_| refused("the API key is not a valid header value"))?;
        r.metadata_mut().insert("authorization", v);
    }
    Ok(r)
}

/// A plaintext client at a TLS port sees only an HTTP/2 protocol or transport error: say what it
/// may mean. A refused connection is not that: nothing listens at the address (a verifier that is
/// down, or restarting), and the answer says so instead.
fn plaintext_hint(url: &str, e: EdgeError) -> EdgeError {
    match e {
        EdgeError::Refused(m) | EdgeError::Unreachable(m) if m.contains("onnection refused") => {
            EdgeError::Unreachable(format!(
                "{m} (nothing accepts connections at {url}: is the verifier running?)"
            ))
        }
        EdgeError::Refused(m)
            if url.starts_with("http://")
                && (m.contains("h2 protocol error") || m.contains("transport error")) =>
        {
            EdgeError::Refused(format!(
                "{m} (a verifier that serves TLS answers a plaintext client so: if it does, try https://)"
            ))
        }
        e => e,
    }
}

/// A refusal that keeps the status code's name (e.g. `ResourceExhausted: ... retry after ...`),
/// and the verifier's `retry-after-ms` when it sent one.
fn status(s: tonic::Status) -> EdgeError {
    let message = format!("{:?}: {}", s.code(), s.message());
    let retry = s
        .metadata()
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    match retry {
        Some(retry_after_ms) => EdgeError::Busy {
            message,
            retry_after_ms,
        },
        None if s.code() == tonic::Code::Unavailable => EdgeError::Unreachable(message),
        None => EdgeError::Refused(message),
    }
}

/// Try `attempt` until it succeeds, fails for good, or `window_ms` is spent, waiting between
/// tries as a lost session's reconnect does ([`Reconnecting::wait_ms`]): only a verifier that
/// is not there (yet), lost the connection, or is busy (after its `retry-after-ms`) is tried
/// again; any other refusal ends it at once.
pub async fn within_window<T, F, Fut>(window_ms: u64, mut attempt: F) -> Result<T, EdgeError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, EdgeError>>,
{
    let t0 = std::time::Instant::now();
    for tries in 0u32.. {
        let e = match attempt().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let retry_after_ms = match &e {
            EdgeError::Unreachable(_) | EdgeError::LinkClosed => None,
            EdgeError::Busy { retry_after_ms, .. } => Some(*retry_after_ms),
            _ => return Err(e),
        };
        let r = Reconnecting {
            attempt: tries,
            elapsed_ms: t0.elapsed().as_millis() as u64,
            window_ms,
            retry_after_ms,
            jitter: crate::driver::jitter(),
        };
        let Some(wait) = r.wait_ms() else {
            return Err(e);
        };
        tracing::info!("{e}: trying again in {wait} ms");
        tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
    }
    unreachable!("a u32 of tries outlasts any window")
}

/// Called whenever a message for a session arrives (a loop that drives many sessions sleeps until
/// one of them has something).
pub type Waker = std::sync::Arc<dyn Fn() + Send + Sync>;

pub struct GrpcLink {
    out: UnboundedSender<EdgeMessage>,
    /// Rung by the reader task after each message it passes on.
    waker: std::sync::Arc<std::sync::Mutex<Option<Waker>>>,
    verdicts: UnboundedReceiver<Result<Incoming, EdgeError>>,
    /// What reopening a session after a lost connection needs.
    rt: tokio::runtime::Handle,
    url: String,
    req: OpenRequest,
}

/// The verifier's `Opened` as the edge session takes it.
pub fn opened(o: &Opened) -> tandem_spec::Opened {
    tandem_spec::Opened {
        first: o.first_token,
        grant: tandem_spec::Shape::new(o.draft_len, o.depth),
        side_nodes: o.side_nodes as usize,
    }
}

fn refused(e: impl std::fmt::Display) -> EdgeError {
    EdgeError::Refused(e.to_string())
}

/// The stream of a session's messages from the verifier.
type Inbound = tonic::Streaming<tandem_proto::v1::CloudMessage>;

/// How far an `Open` got: admitted (its prefill to come; protocol 5), or opened.
enum Stage {
    Admitted,
    Opened(Opened),
}

/// The next stage of an `Open` on its stream: `Admitted`, `Opened`, or the refusal.
async fn next_stage(inbound: &mut Inbound, url: &str) -> Result<Stage, EdgeError> {
    let m = inbound
        .message()
        .await
        .map_err(|e| plaintext_hint(url, status(e)))?;
    match m.and_then(|m| m.kind) {
        Some(cloud_message::Kind::Admitted(_)) => Ok(Stage::Admitted),
        Some(cloud_message::Kind::Opened(o)) => Ok(Stage::Opened(o)),
        Some(cloud_message::Kind::Error(e)) => Err(refused(e.message)),
        Some(_) => Err(refused("the verifier did not open the session")),
        None => Err(EdgeError::LinkClosed),
    }
}

/// Wait on `inbound` for `Opened`, past the admission if it has not come yet.
async fn until_opened(inbound: &mut Inbound, stage: Stage, url: &str) -> Result<Opened, EdgeError> {
    let mut stage = stage;
    loop {
        match stage {
            Stage::Opened(o) => return Ok(o),
            Stage::Admitted => stage = next_stage(inbound, url).await?,
        }
    }
}

/// A session the verifier admitted: `Opened` (its first token, once the prompt is prefilled) is
/// still to come. Only the wait for the admission is bounded by an edge's connect timeout: a long
/// prompt is prefill, not unreachability.
pub struct Admission {
    link: GrpcLink,
    inbound: Inbound,
    vtx: UnboundedSender<Result<Incoming, EdgeError>>,
    stage: Stage,
}

impl Admission {
    /// Wait for `Opened`, however long the prefill takes (HTTP/2 pings find a verifier that
    /// went away), and start the link's reader.
    pub async fn opened(self) -> Result<(GrpcLink, Opened), EdgeError> {
        let Self {
            link,
            mut inbound,
            vtx,
            stage,
        } = self;
        let opened = until_opened(&mut inbound, stage, &link.url).await?;
        if let (Some(sink), Some(l)) = (&link.req.logprobs, &opened.first_logprob) {
            sink.put(l.clone().into());
        }
        link.spawn_reader(vtx, async move { Some((inbound, None)) });
        Ok((link, opened))
    }
}

impl GrpcLink {
    /// Connect to `url`, open the session and wait for `Opened` (which carries the granted γ and
    /// depth and the target's first token).
    pub fn connect(rt: &Runtime, url: &str, req: OpenRequest) -> Result<(Self, Opened), EdgeError> {
        Self::connect_within(rt, url, req, 0)
    }

    /// [`GrpcLink::connect`], trying again while no verifier is reachable (or it is busy) for
    /// up to `window_ms`, as a session whose connection was lost: an edge started while its
    /// verifier restarts waits for it.
    pub fn connect_within(
        rt: &Runtime,
        url: &str,
        req: OpenRequest,
        window_ms: u64,
    ) -> Result<(Self, Opened), EdgeError> {
        let h = rt.handle().clone();
        rt.block_on(async {
            within_window(window_ms, || {
                Self::admit_async(h.clone(), url, req.clone(), None)
            })
            .await?
            .opened()
            .await
        })
    }

    fn open(
        rt: tokio::runtime::Handle,
        url: &str,
        req: OpenRequest,
        waker: Option<Waker>,
    ) -> Result<(Self, Opened), EdgeError> {
        rt.block_on(Self::open_async(rt.clone(), url, req, waker))
    }

    /// [`GrpcLink::connect`] from async code: the session's reader runs on `rt`, and rings `waker`
    /// (if any) after each message it passes on.
    pub async fn open_async(
        rt: tokio::runtime::Handle,
        url: &str,
        req: OpenRequest,
        waker: Option<Waker>,
    ) -> Result<(Self, Opened), EdgeError> {
        Self::admit_async(rt, url, req, waker).await?.opened().await
    }

    /// Connect to `url`, send the session's `Open` and wait until the verifier admits it (before
    /// its prefill) or refuses it.
    pub async fn admit_async(
        rt: tokio::runtime::Handle,
        url: &str,
        req: OpenRequest,
        waker: Option<Waker>,
    ) -> Result<Admission, EdgeError> {
        let (link, call, vtx) = Self::send_open(rt, url, req, waker).await?;
        let (inbound, stage) = call.await?;
        Ok(Admission {
            link,
            inbound,
            vtx,
            stage,
        })
    }

    /// Connect to `url` and send the session's `Open` without waiting for `Opened`: blocks may
    /// go at once (the verifier reads them once it has prefilled the prompt), and `Opened`
    /// arrives as a message ([`Incoming::Opened`]: the first token and the grant; see
    /// [`tandem_spec::EdgeSession::opening`]). A
    /// refusal of the `Open` itself (a wrong key, another tokenizer, a full verifier) comes from
    /// [`Link::recv`] as [`EdgeError::NotOpened`]: it is not a connection to reopen.
    pub fn start(rt: &Runtime, url: &str, req: OpenRequest) -> Result<Self, EdgeError> {
        Self::start_within(rt, url, req, 0)
    }

    /// [`GrpcLink::start`], trying to connect again while no verifier is reachable for up to
    /// `window_ms` (see [`GrpcLink::connect_within`]).
    pub fn start_within(
        rt: &Runtime,
        url: &str,
        req: OpenRequest,
        window_ms: u64,
    ) -> Result<Self, EdgeError> {
        let h = rt.handle().clone();
        let u = url.to_string();
        rt.block_on(async {
            let (link, call, vtx) = within_window(window_ms, || {
                Self::send_open(h.clone(), url, req.clone(), None)
            })
            .await?;
            let tx = vtx.clone();
            let opened = async move {
                let got = match call.await {
                    Ok((mut inbound, stage)) => until_opened(&mut inbound, stage, &u)
                        .await
                        .map(|o| (inbound, o)),
                    Err(e) => Err(e),
                };
                match got {
                    Ok((inbound, o)) => Some((inbound, Some(Incoming::Opened(opened(&o))))),
                    Err(e) => {
                        let _ = tx.send(Err(EdgeError::NotOpened(e.to_string())));
                        None
                    }
                }
            };
            link.spawn_reader(vtx, opened);
            Ok(link)
        })
    }

    /// Connect and send `Open`; returns the link (its reader not started), the call that ends
    /// in the first stage of the open (admitted, or opened), and the sender of the link's
    /// messages (for the reader: the link sees the stream end when the reader drops it).
    async fn send_open(
        rt: tokio::runtime::Handle,
        url: &str,
        req: OpenRequest,
        waker: Option<Waker>,
    ) -> Result<
        (
            Self,
            impl std::future::Future<Output = Result<(Inbound, Stage), EdgeError>> + Send + 'static,
            UnboundedSender<Result<Incoming, EdgeError>>,
        ),
        EdgeError,
    > {
        let mut req = req;
        let route = req.route.get_or_insert_with(new_route).clone();
        let keep = req.clone();
        let mut client = client(url, req.tls_ca.as_deref()).await?;
        let (out, rx) = unbounded_channel::<EdgeMessage>();
        let resumed = req
            .output_from
            .map_or(0, |f| req.prompt_ids.len().saturating_sub(f)) as u32;
        let open = Open {
            protocol_version: PROTOCOL_VERSION,
            tokenizer_fingerprint: req.tokenizer_fingerprint,
            prompt_ids: req.prompt_ids,
            params: Some(req.params.into()),
            max_tokens: req.max_tokens,
            rule: rule_to_proto(req.rule) as i32,
            want_draft_len: req.want_draft_len,
            want_depth: req.want_depth,
            want_side_nodes: req.want_side_nodes,
            grammar: req.grammar.as_ref().map(|g| tandem_proto::v1::Grammar {
                resumed,
                ..g.into()
            }),
            logprobs: req.logprobs.is_some(),
            top_logprobs: req.logprobs.as_ref().map_or(0, |l| l.top as u32),
            self_draft: req.self_draft,
        };
        out.send(EdgeMessage {
            kind: Some(edge_message::Kind::Open(open)),
        })
        .map_err(|_| EdgeError::LinkClosed)?;
        let mut stream = authorized(UnboundedReceiverStream::new(rx), req.api_key.as_deref())?;
        let route = route.parse().map_err(|_| {
            refused(format!(
                "the routing key {route:?} is not a valid header value"
            ))
        })?;
        stream.metadata_mut().insert(ROUTE_HEADER, route);
        let u = url.to_string();
        let call = async move {
            let mut inbound = client
                .session(stream)
                .await
                .map_err(|e| plaintext_hint(&u, status(e)))?
                .into_inner();
            let stage = next_stage(&mut inbound, &u).await?;
            Ok((inbound, stage))
        };
        let (vtx, verdicts) = unbounded_channel();
        let link = Self {
            out,
            waker: std::sync::Arc::new(std::sync::Mutex::new(waker)),
            verdicts,
            rt,
            url: url.to_string(),
            req: keep,
        };
        Ok((link, call, vtx))
    }

    /// Pass each message of the session's stream on to `vtx`, once `opened` gives the stream
    /// and the message to pass first, if any (None: the open failed, and said so).
    fn spawn_reader(
        &self,
        vtx: UnboundedSender<Result<Incoming, EdgeError>>,
        opened: impl std::future::Future<
                Output = Option<(
                    tonic::Streaming<tandem_proto::v1::CloudMessage>,
                    Option<Incoming>,
                )>,
            > + Send
            + 'static,
    ) {
        let ring = self.waker.clone();
        let sink = self.req.logprobs.clone();
        let wake = move || {
            if let Some(w) = ring.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                w();
            }
        };
        self.rt.spawn(async move {
            let Some((mut inbound, first)) = opened.await else {
                wake();
                return;
            };
            if let Some(m) = first {
                if vtx.send(Ok(m)).is_err() {
                    return;
                }
                wake();
            }
            loop {
                let m = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    // A broken stream: the verifier's own refusals come as messages.
                    Err(s) => {
                        tracing::warn!("the session stream broke: {}", s.message());
                        let _ = vtx.send(Err(EdgeError::LinkClosed));
                        wake();
                        break;
                    }
                };
                if let Some(cloud_message::Kind::Logprobs(l)) = &m.kind {
                    if let Some(sink) = &sink {
                        for e in &l.entries {
                            sink.put(e.clone().into());
                        }
                    }
                    continue;
                }
                let item = match tandem_proto::from_cloud(m) {
                    FromCloud::Message(m) => Ok(m),
                    FromCloud::Refused(message) => Err(refused(message)),
                    FromCloud::Other => continue,
                };
                if vtx.send(item).is_err() {
                    break;
                }
                wake();
            }
        });
    }

    /// Ring `w` whenever a message arrives (also after a reconnect).
    pub fn set_waker(&self, w: Waker) {
        *self.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(w);
    }

    /// End the session politely.
    pub fn close(&self) {
        let _ = self.out.send(EdgeMessage {
            kind: Some(edge_message::Kind::Close(Default::default())),
        });
    }
}

impl Link for GrpcLink {
    fn send(&mut self, block: Block) -> Result<(), EdgeError> {
        self.out
            .send(EdgeMessage {
                kind: Some(edge_message::Kind::Draft((&block).into())),
            })
            .map_err(|_| EdgeError::LinkClosed)
    }

    fn ack(&mut self, committed: usize) -> Result<(), EdgeError> {
        self.out
            .send(EdgeMessage {
                kind: Some(edge_message::Kind::Ack(Ack {
                    committed: committed as u64,
                })),
            })
            .map_err(|_| EdgeError::LinkClosed)
    }

    fn reopen(&mut self, history: &[u32], max_tokens: usize) -> Result<u32, EdgeError> {
        let req = OpenRequest {
            prompt_ids: history.to_vec(),
            max_tokens: max_tokens as u32,
            output_from: Some(self.req.output_from.unwrap_or(self.req.prompt_ids.len())),
            ..self.req.clone()
        };
        let w = self.waker.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (fresh, opened) = Self::open(self.rt.clone(), &self.url, req, w)?;
        *self = fresh;
        Ok(opened.first_token)
    }

    fn recv(&mut self, wait: bool) -> Result<Option<Incoming>, EdgeError> {
        let item = if wait {
            // Every wait has a deadline (the connection's pings find most losses sooner).
            let rx = &mut self.verdicts;
            // (The timer is made inside the runtime: it needs its time driver.)
            let got = self
                .rt
                .block_on(async move { tokio::time::timeout(RECV_DEADLINE, rx.recv()).await });
            match got {
                Ok(v) => v,
                Err(_) => {
                    tracing::warn!(
                        "no message from the verifier in {} s: taking the connection for lost",
                        RECV_DEADLINE.as_secs()
                    );
                    None
                }
            }
        } else {
            match self.verdicts.try_recv() {
                Ok(v) => Some(v),
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => return Ok(None),
                Err(_) => None,
            }
        };
        match item {
            Some(v) => v.map(Some),
            None => Err(EdgeError::LinkClosed),
        }
    }
}

/// A verifier to call: its URL, the tenant's API key, and for `https://` the CA that signed its
/// certificate (PEM; None: the web PKI's roots).
#[derive(Debug, Clone, Copy)]
pub struct Remote<'a> {
    pub url: &'a str,
    pub api_key: Option<&'a str>,
    pub tls_ca: Option<&'a str>,
}

impl<'a> Remote<'a> {
    /// A verifier without tenants, in plaintext (loopback, tests, benchmarks).
    pub fn plain(url: &'a str) -> Self {
        Self {
            url,
            api_key: None,
            tls_ca: None,
        }
    }
}

/// Cloud-only generation (the baseline): the verifier decodes every token itself and streams them.
/// Calls `on_token` with each token as it arrives; returns the prompt tokens the verifier's prefix
/// cache served.
pub fn generate_remote(
    rt: &Runtime,
    remote: Remote<'_>,
    tokenizer_fingerprint: &str,
    prompt_ids: &[u32],
    params: SamplingParams,
    max_tokens: u32,
    on_token: impl FnMut(u32),
) -> Result<u64, EdgeError> {
    generate_remote_with(
        rt,
        remote,
        tokenizer_fingerprint,
        prompt_ids,
        params,
        max_tokens,
        GenerateOptions::default(),
        on_token,
    )
}

/// What a cloud-only generation asks of the verifier besides its prompt and parameters.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerateOptions<'a> {
    /// Structured output: the grammar the output follows (None: free text).
    pub grammar: Option<&'a tandem_spec::GrammarSource>,
    /// The verifier verifies guesses copied from the generation's own text in each decode step
    /// (protocol 7): cloud-only with the server's own suffix drafts.
    pub self_draft: bool,
}

/// [`generate_remote`] with [`GenerateOptions`] (a structured output's grammar, self-drafting).
#[allow(clippy::too_many_arguments)]
pub fn generate_remote_with(
    rt: &Runtime,
    remote: Remote<'_>,
    tokenizer_fingerprint: &str,
    prompt_ids: &[u32],
    params: SamplingParams,
    max_tokens: u32,
    options: GenerateOptions<'_>,
    mut on_token: impl FnMut(u32),
) -> Result<u64, EdgeError> {
    let Remote {
        url,
        api_key,
        tls_ca,
    } = remote;
    rt.block_on(async {
        let mut client = client(url, tls_ca).await?;
        let req = tandem_proto::v1::GenerateRequest {
            tokenizer_fingerprint: tokenizer_fingerprint.to_string(),
            prompt_ids: prompt_ids.to_vec(),
            params: Some(params.into()),
            max_tokens,
            grammar: options.grammar.map(Into::into),
            self_draft: options.self_draft,
        };
        let mut stream = client
            .generate(authorized(req, api_key)?)
            .await
            .map_err(|e| plaintext_hint(url, status(e)))?
            .into_inner();
        let mut cached = 0;
        while let Some(r) = stream.message().await.map_err(status)? {
            cached = cached.max(r.cached_tokens);
            for t in r.tokens {
                on_token(t);
            }
            if r.done {
                break;
            }
        }
        Ok(cached)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_port_is_not_diagnosed_as_tls() {
        let refused = "Unavailable: error trying to connect: tcp connect error: Connection refused (os error 111)";
        let EdgeError::Unreachable(m) =
            plaintext_hint("http://127.0.0.1:9", EdgeError::Refused(refused.into()))
        else {
            panic!("a verifier that is not there");
        };
        assert!(
            m.contains("is the verifier running?") && !m.contains("https"),
            "{m}"
        );
        let h2 = "Unknown: transport error: h2 protocol error: http2 error";
        let EdgeError::Refused(m) =
            plaintext_hint("http://127.0.0.1:9", EdgeError::Refused(h2.into()))
        else {
            panic!("still a refusal");
        };
        assert!(m.contains("try https://"), "{m}");
    }
}
