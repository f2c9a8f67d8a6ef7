//! `tandem serve`: the edge as a local server that speaks OpenAI's HTTP API (axum). Each request
//! is a speculation session of its own against the verifier (`--cloud`), its draft steps run by
//! one draft thread together with every other request's ([`sessions`]). Endpoints:
//! `POST /v1/chat/completions`, `POST /v1/completions` (streamed as SSE in OpenAI's chunk format,
//! ending with `data: [DONE]`), `GET /v1/models`, `GET /health`, `GET /metrics` and `GET /`, the
//! live view.
//!
//! Speculation's statistics come in a vendor extension, `tandem`, beside OpenAI's fields, with
//! vLLM's per-request names; a request that sets `"tandem": {"tentative": true}` is also streamed
//! the draft's unverified tail and the target's corrections (the live view uses it; plain clients
//! see committed text only).

pub mod api;
pub mod metrics;
mod respond;
pub mod sessions;
pub mod stops;
pub mod tools;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tandem_engine::{Engine, Tokenizer};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::grpc::{GrpcLink, OpenRequest};
use crate::{EdgeError, SpecConfig};
use api::{ApiError, Kind, Request, Served};
use metrics::EdgeMetrics;
use respond::{stream, Envelope};
use sessions::{Event, Job, Linked, Msg, Sessions};
use tools::ToolFormat;

/// How `tandem serve` serves.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Verifiers to try, in order, for each request.
    pub clouds: Vec<String>,
    /// The tenant's key the edge presents to the verifier.
    pub api_key: Option<String>,
    /// The CA (PEM) that signed an `https://` verifier's certificate (None: the web PKI's).
    pub tls_ca: Option<String>,
    /// Keys local clients must present as `Authorization: Bearer …` (empty: none).
    pub client_keys: Vec<String>,
    /// The model's name in the API.
    pub model_name: String,
    /// Each request's session: its shape (γ, depth), and the rule for sampled drafts (greedy at
    /// temperature 0); the request sets the sampling parameters and the length.
    pub spec: SpecConfig,
    /// No verifier reachable, or lost for good mid-answer: answer with the draft alone, every
    /// such token marked unverified (else a 503).
    pub fallback_local: bool,
    /// How long opening a session on one verifier may take.
    pub connect_timeout: Duration,
    /// How long a session whose connection was lost keeps trying to reopen it.
    pub reconnect_window: Duration,
    /// Keep the draft's KV of finished requests for later ones that start the same way (a
    /// conversation's next turn); off, every request prefills its whole prompt.
    pub prefix_cache: bool,
}

struct AppState {
    cfg: ServeConfig,
    tok: Arc<Tokenizer>,
    context_len: usize,
    tx: Sender<Msg>,
    /// The draft's KV cache, in blocks: a request reserves what its prompt and answer can fill.
    kv: Arc<Semaphore>,
    kv_blocks: usize,
    block_size: usize,
    metrics: Arc<EdgeMetrics>,
    rt: tokio::runtime::Handle,
    requests: AtomicU64,
    /// The draft's vocabulary for structured outputs (None: `response_format` other than text
    /// is refused).
    grammar: Option<tandem_spec::GrammarVocab>,
    /// How the model writes a tool call (its own tags where its template and vocabulary have
    /// them).
    tool_format: ToolFormat,
}

/// Start the draft thread (and its forward thread) over `draft` and serve the API on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    draft: Engine,
    tok: Arc<Tokenizer>,
    cfg: ServeConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    let metrics = Arc::new(EdgeMetrics::default());
    let tables = &draft.kv().tables;
    let (kv_blocks, block_size) = (tables.num_pages(), tables.page_size());
    let context_len = draft.model().cfg.context_len;
    let grammar = match tok.grammar_vocab(draft.model().cfg.vocab) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!("structured outputs are refused: {e}");
            None
        }
    };
    let sessions = Sessions {
        tok: tok.clone(),
        fallback_local: cfg.fallback_local,
        reconnect_window_ms: cfg.reconnect_window.as_millis() as u64,
        prefix_cache: cfg.prefix_cache,
        metrics: metrics.clone(),
        tx: tx.clone(),
    };
    let (forward, forwards) = std::sync::mpsc::channel();
    let forwarded = tx.clone();
    let forward_thread = std::thread::Builder::new()
        .name("tandem-draft-forward".into())
        .spawn(move || sessions::forward_thread(forwards, forwarded))?;
    let engine_thread = std::thread::Builder::new()
        .name("tandem-draft".into())
        .spawn(move || sessions.run(draft, rx, forward))?;
    let tool_format = if grammar.is_some() && tok.calls_tools_in_tags() {
        ToolFormat::Tags
    } else {
        ToolFormat::Json
    };
    let stop = tx.clone();
    let state = Arc::new(AppState {
        cfg,
        tok,
        context_len,
        tx,
        kv: Arc::new(Semaphore::new(kv_blocks)),
        kv_blocks,
        block_size,
        metrics,
        rt: tokio::runtime::Handle::current(),
        requests: AtomicU64::new(0),
        grammar,
        tool_format,
    });
    // Each SSE chunk (a token's text) goes out when it is written, not held by Nagle's
    // algorithm for the last one's ACK; a request's head that takes too long loses its
    // connection.
    let served =
        tandem_http::serve_http(listener, app(state), shutdown, tandem_http::HEAD_TIMEOUT).await;
    // No request is left in the router: the draft thread ends when its last session has.
    let _ = stop.send(Msg::Shutdown);
    let _ = tokio::task::spawn_blocking(move || {
        let _ = engine_thread.join();
        // The draft thread's end closed the forward thread's queue.
        forward_thread.join()
    })
    .await;
    served
}

fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route(
            "/v1/chat/completions",
            post(|s: State<Arc<AppState>>, h: HeaderMap, b: Bytes| complete(s, h, b, Kind::Chat)),
        )
        .route(
            "/v1/completions",
            post(|s: State<Arc<AppState>>, h: HeaderMap, b: Bytes| {
                complete(s, h, b, Kind::Completion)
            }),
        )
        .fallback(|| async {
            error(ApiError {
                status: 404,
                message: "no such endpoint: this server has /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics and /".into(),
                kind: "invalid_request_error",
                param: None,
            })
        })
        .with_state(state)
}

fn json_response(status: u16, v: &Value) -> Response {
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [("content-type", "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn error(e: ApiError) -> Response {
    json_response(e.status, &e.body())
}

const PAGE: &str = include_str!("page.html");

async fn page() -> Response {
    ([("content-type", "text/html; charset=utf-8")], PAGE).into_response()
}

async fn health() -> Response {
    json_response(200, &json!({"status": "ok"}))
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    json_response(
        200,
        &json!({"object": "list", "data": [{
            "id": s.cfg.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "max_model_len": s.context_len,
        }]}),
    )
}

/// The client's key, when the server asks for one.
fn authorize(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    if s.cfg.client_keys.is_empty() {
        return Ok(());
    }
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(k) if s.cfg.client_keys.iter().any(|c| c == k) => Ok(()),
        Some(_) => Err(ApiError {
            status: 401,
            message: "Incorrect API key provided".into(),
            kind: "invalid_request_error",
            param: None,
        }),
        None => Err(ApiError {
            status: 401,
            message: "This server needs an API key: send `Authorization: Bearer <key>`".into(),
            kind: "invalid_request_error",
            param: None,
        }),
    }
}

/// A seed for a request that names none (OpenAI's answers differ from call to call then).
fn fresh_seed(s: &AppState) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = s.requests.fetch_add(1, Ordering::Relaxed);
    (t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

/// Blocks of the draft's KV cache a request may fill: its prompt, its answer, and the drafts in
/// flight past the committed tokens.
fn reservation(s: &AppState, req: &Request) -> usize {
    let sess = &s.cfg.spec.session;
    let (len, depth) = sess.auto.map_or((sess.draft_len, sess.depth), |a| {
        (a.max_draft_len, a.max_depth)
    });
    let slack = (len + 1) * (depth + 1) + sess.tree.side_nodes * depth + 1;
    let tokens = req.prompt_ids.len() + req.max_tokens + slack;
    tokens.div_ceil(s.block_size) + 1
}

async fn complete(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
    kind: Kind,
) -> Response {
    let start = Instant::now();
    if let Err(e) = authorize(&s, &headers) {
        return error(e);
    }
    let served = Served {
        model: &s.cfg.model_name,
        tok: &s.tok,
        context_len: s.context_len,
        seed: fresh_seed(&s),
        tool_format: s.tool_format,
    };
    let req = match api::parse(kind, &body, &served) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    // A structured output's grammar, compiled off the runtime's threads (a schema may take
    // milliseconds); one llguidance refuses is a 400 naming the field.
    let grammar = match (&req.grammar, &s.grammar) {
        (None, _) => None,
        (Some(_), None) => {
            return error(ApiError::invalid(
                "response_format",
                "this server has no grammar support for its model: leave response_format out",
            ))
        }
        (Some(src), Some(vocab)) => {
            let (src, vocab) = (src.clone(), vocab.clone());
            match tokio::task::spawn_blocking(move || vocab.compile(&src)).await {
                Ok(Ok(g)) => Some(g),
                Ok(Err(e)) => {
                    return error(ApiError::invalid(
                        "response_format",
                        format!("the schema cannot be used: {e}"),
                    ))
                }
                Err(e) => return error(unavailable(format!("compiling the schema: {e}"))),
            }
        }
    };
    let blocks = reservation(&s, &req);
    if blocks > s.kv_blocks {
        return error(ApiError::invalid(
            "max_tokens",
            format!(
                "the prompt ({} tokens) and max_tokens {} need {} tokens of the edge's draft KV \
                 cache, which holds {}: ask for fewer tokens, or start tandem serve with a larger --kv-mb",
                req.prompt_ids.len(),
                req.max_tokens,
                blocks * s.block_size,
                s.kv_blocks * s.block_size
            ),
        ));
    }
    // Room in the draft's KV cache, first come first served.
    s.metrics.waiting.inc();
    let permit = s.kv.clone().acquire_many_owned(blocks as u32).await;
    s.metrics.waiting.dec();
    let Ok(permit) = permit else {
        return error(unavailable("the server is shutting down".into()));
    };
    let queued_s = start.elapsed().as_secs_f64();
    let mut spec = s.cfg.spec;
    spec.session.max_new_tokens = req.max_tokens;
    spec.params = req.params;
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let (link_tx, link_rx) = oneshot::channel();
    let logprobs = req.logprobs.map(crate::grpc::LogprobSink::new);
    let job = Job {
        req: req.clone(),
        logprobs: logprobs.clone(),
        grammar,
        spec,
        events: events_tx,
        link: link_rx,
        start,
        queued_s,
        permit,
    };
    // The draft prefills the prompt while the verifier's session opens.
    if s.tx.send(Msg::Job(Box::new(job))).is_err() {
        return error(unavailable("the draft engine has stopped".into()));
    }
    match connect(&s, &req, &spec, logprobs).await {
        Ok((link, opened)) => {
            let _ = link_tx.send(Linked::Open(Box::new(link), opened));
        }
        Err(why) if s.cfg.fallback_local => {
            let _ = link_tx.send(Linked::Local(why));
        }
        Err(why) => {
            let _ = link_tx.send(Linked::Failed);
            let _ = s.tx.send(Msg::Wake);
            return error(unavailable(format!(
                "{why}; start the server with --fallback local to answer with the draft alone"
            )));
        }
    }
    let _ = s.tx.send(Msg::Wake);
    let id = format!(
        "{}-{:016x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        fresh_seed(&s)
    );
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let envelope = Envelope {
        id,
        created,
        model: req.model.clone(),
        kind,
        tool_call: req.tool_call.clone(),
        tool_format: req.tool_format,
    };
    if req.stream {
        return stream(envelope, req, events);
    }
    // Not streamed: the whole answer, or the error that ended it.
    let (mut text, mut unverified_from) = (String::new(), None);
    while let Some(e) = events.recv().await {
        match e {
            Event::Text {
                text: t,
                unverified,
                ..
            } => {
                if unverified && unverified_from.is_none() {
                    unverified_from = Some(text.len());
                }
                text.push_str(&t);
            }
            Event::Live { .. } => {}
            Event::Error(e) => return error(e),
            Event::Done(f) => {
                return json_response(200, &envelope.whole(&text, &f, unverified_from))
            }
        }
    }
    error(ApiError {
        status: 500,
        message: "the answer ended without a reason".into(),
        kind: "server_error",
        param: None,
    })
}

fn unavailable(message: String) -> ApiError {
    ApiError {
        status: 503,
        message,
        kind: "service_unavailable",
        param: None,
    }
}

/// Open the request's session on the first verifier that answers.
async fn connect(
    s: &AppState,
    req: &Request,
    spec: &SpecConfig,
    logprobs: Option<crate::grpc::LogprobSink>,
) -> Result<(GrpcLink, tandem_proto::v1::Opened), String> {
    let sess = &spec.session;
    let open = OpenRequest {
        tokenizer_fingerprint: s.tok.fingerprint().to_string(),
        prompt_ids: req.prompt_ids.clone(),
        params: req.params,
        max_tokens: req.max_tokens as u32,
        rule: spec.rule,
        want_draft_len: sess.auto.map_or(sess.draft_len, |a| a.max_draft_len) as u32,
        want_depth: sess.auto.map_or(sess.depth, |a| a.max_depth) as u32,
        want_side_nodes: sess.tree.side_nodes as u32,
        grammar: req.grammar.clone(),
        api_key: s.cfg.api_key.clone(),
        tls_ca: s.cfg.tls_ca.clone(),
        route: None,
        output_from: None,
        logprobs,
        self_draft: spec.self_draft,
    };
    let tx = s.tx.clone();
    let waker: crate::grpc::Waker = Arc::new(move || {
        let _ = tx.send(Msg::Wake);
    });
    // Admitted by the first verifier that answers; while none is reachable, tried again within
    // the reconnect window, as a session whose connection was lost (with the draft to fall back
    // on, at once). Only the admission is bounded by the connect timeout: the prefill of a long
    // prompt (a conversation's history) is not unreachability.
    let window = if s.cfg.fallback_local {
        0
    } else {
        s.cfg.reconnect_window.as_millis() as u64
    };
    let timeout = s.cfg.connect_timeout;
    let admission = crate::grpc::within_window(window, || async {
        let mut why = Vec::new();
        let mut retry = true;
        let mut busy = None;
        for url in &s.cfg.clouds {
            let admitted = tokio::time::timeout(
                timeout,
                GrpcLink::admit_async(s.rt.clone(), url, open.clone(), Some(waker.clone())),
            )
            .await;
            match admitted {
                Ok(Ok(a)) => return Ok((url.clone(), a)),
                Ok(Err(e)) => {
                    match &e {
                        EdgeError::Unreachable(_) | EdgeError::LinkClosed => {}
                        EdgeError::Busy { retry_after_ms, .. } => {
                            busy =
                                Some(busy.map_or(*retry_after_ms, |b: u64| b.min(*retry_after_ms)));
                        }
                        _ => retry = false,
                    }
                    why.push(format!("{url}: {e}"));
                }
                Err(_) => why.push(format!(
                    "{url}: not admitted within {} ms",
                    timeout.as_millis()
                )),
            }
        }
        let message = why.join("; ");
        Err(match (retry, busy) {
            (false, _) => EdgeError::Refused(message),
            (true, Some(retry_after_ms)) => EdgeError::Busy {
                message,
                retry_after_ms,
            },
            (true, None) => EdgeError::Unreachable(message),
        })
    })
    .await;
    let (url, admission) = admission.map_err(|e| match e {
        EdgeError::Refused(m) => format!("the verifiers refused the session ({m})"),
        e => e.to_string(),
    })?;
    admission
        .opened()
        .await
        .map_err(|e| format!("{url} admitted the session but did not open it ({e})"))
}
