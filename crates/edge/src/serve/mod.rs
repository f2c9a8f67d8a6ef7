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
use axum::response::sse::{Event as SseEvent, Sse};
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
use sessions::{Event, Finished, Job, Linked, Msg, Sessions};
use tools::{CallReader, ToolCall, ToolFormat};

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

/// What every response and chunk of one request shares.
struct Envelope {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// The answer is (or, under `auto`, may be) a tool call: its text becomes `tool_calls`.
    tool_call: Option<ToolCall>,
    tool_format: ToolFormat,
}

impl Envelope {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// Tandem's extension of a finished answer: vLLM's per-request speculation counts and the
    /// unverified tokens (the draft's alone, after the verifier was lost).
    fn extension(f: &Finished) -> Value {
        let mut v = serde_json::to_value(f.stats).unwrap_or_default();
        v["unverified_tokens"] = json!(f.unverified_tokens);
        v
    }

    /// A forced tool call's answer as OpenAI's `tool_calls` (the output is the function's
    /// arguments, or `{"name", "arguments"}` under `required`), and its finish reason; None when
    /// the answer is not a call, or its JSON was cut short (then it goes out as text).
    fn tool_calls(&self, text: &str, f: &Finished) -> Option<(Value, &'static str)> {
        let call = self.tool_call.as_ref()?;
        let (name, arguments) = match call {
            ToolCall::Auto => return None,
            // Cut short by max_tokens, a named call still goes out (finish_reason `length`), as
            // OpenAI's does.
            ToolCall::Named(n) => (n.clone(), text.to_string()),
            ToolCall::Required => {
                let v: Value = serde_json::from_str(text).ok()?;
                (
                    v["name"].as_str()?.to_string(),
                    v.get("arguments")?.to_string(),
                )
            }
        };
        Some((
            json!([{"index": 0, "id": self.call_id(), "type": "function",
                    "function": {"name": name, "arguments": arguments}}]),
            Self::call_finish(f),
        ))
    }

    /// A tool call's id: the response's own hex.
    fn call_id(&self) -> String {
        format!("call_{}", self.id.rsplit('-').next().unwrap_or_default())
    }

    /// The id of the answer's `i`-th call.
    fn call_id_at(&self, i: usize) -> String {
        match i {
            0 => self.call_id(),
            i => format!("{}_{i}", self.call_id()),
        }
    }

    /// The streamed chunks of what a [`CallReader`] read: its content, then each call whole.
    fn read_chunks(&self, got: tools::Read) -> Vec<Value> {
        let mut chunks = Vec::new();
        if !got.content.is_empty() {
            chunks.push(self.chunk(Some(&got.content), None, false));
        }
        for call in got.calls {
            let mut c = self.chunk(None, None, false);
            c["choices"][0]["delta"]["tool_calls"] = json!([call]);
            chunks.push(c);
        }
        chunks
    }

    /// Whether the answer is read for calls in the model's tags.
    fn in_tags(&self) -> bool {
        self.tool_call.is_some() && self.tool_format == ToolFormat::Tags
    }

    /// An answer in the model's tags, whole: its message (content, calls) and finish reason.
    fn tagged_message(&self, text: &str, f: &Finished) -> (Value, &'static str) {
        let mut r = CallReader::default();
        let id = |i| self.call_id_at(i);
        let mut got = r.push(text, &id);
        let last = r.finish(&id);
        let content = got.content + &last.content;
        got.calls.extend(last.calls);
        let mut message = json!({
            "role": "assistant",
            "content": if content.is_empty() { Value::Null } else { json!(content) },
        });
        let finish = if got.calls.is_empty() {
            f.finish_reason
        } else {
            message["tool_calls"] = Value::Array(got.calls);
            Self::call_finish(f)
        };
        (message, finish)
    }

    /// A tool call's finish reason: `tool_calls` when its JSON is whole.
    fn call_finish(f: &Finished) -> &'static str {
        if f.finish_reason == "stop" {
            "tool_calls"
        } else {
            f.finish_reason
        }
    }

    /// The target's log-probabilities of the answer (null when not asked for): the chat's
    /// `{"content": [...]}`, or the completions' `tokens` / `token_logprobs` / `top_logprobs` /
    /// `text_offset`.
    fn logprobs(&self, f: &Finished) -> Value {
        match &f.logprobs {
            Some(entries) => self.logprobs_of(entries),
            None => Value::Null,
        }
    }

    /// [`Envelope::logprobs`] of some of the answer's tokens (a streamed chunk's).
    fn logprobs_of(&self, entries: &[Value]) -> Value {
        match self.kind {
            Kind::Chat => json!({"content": entries}),
            Kind::Completion => {
                let mut offset = 0;
                let mut offsets = Vec::with_capacity(entries.len());
                for e in entries {
                    offsets.push(offset);
                    offset += e["token"].as_str().map_or(0, str::len);
                }
                json!({
                    "tokens": entries.iter().map(|e| e["token"].clone()).collect::<Vec<_>>(),
                    "token_logprobs": entries.iter().map(|e| e["logprob"].clone()).collect::<Vec<_>>(),
                    "top_logprobs": entries.iter().map(|e| {
                        let m: serde_json::Map<String, Value> = e["top_logprobs"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|t| (t["token"].as_str().unwrap_or_default().to_string(), t["logprob"].clone()))
                            .collect();
                        Value::Object(m)
                    }).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }

    /// The whole answer (not streamed).
    fn whole(&self, text: &str, f: &Finished, unverified_from: Option<usize>) -> Value {
        let choice = match self.kind {
            Kind::Chat if self.in_tags() => {
                let (message, finish) = self.tagged_message(text, f);
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": self.logprobs(f),
                    "finish_reason": finish,
                })
            }
            Kind::Chat => match self.tool_calls(text, f) {
                Some((calls, finish)) => json!({
                    "index": 0,
                    "message": {"role": "assistant", "content": null, "tool_calls": calls},
                    "logprobs": self.logprobs(f),
                    "finish_reason": finish,
                }),
                None => json!({
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self.logprobs(f),
                    "finish_reason": f.finish_reason,
                }),
            },
            Kind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": self.logprobs(f),
                "finish_reason": f.finish_reason,
            }),
        };
        let mut ext = Self::extension(f);
        if let Some(at) = unverified_from {
            // Where in the text the unverified part begins (bytes of UTF-8).
            ext["unverified_from"] = json!(at);
        }
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": api::usage(f.prompt_tokens, f.completion_tokens, f.cached_tokens),
            "tandem": ext,
        })
    }

    /// A streamed chunk: `text` as the choice's delta (chat) or text (completion).
    fn chunk(&self, text: Option<&str>, finish: Option<&str>, role: bool) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t);
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Completion => json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The SSE events for one of the session's events.
    fn events(&self, e: Event, include_usage: bool) -> Vec<SseEvent> {
        let data = |v: Value| SseEvent::default().data(v.to_string());
        match e {
            Event::Text {
                text,
                unverified,
                logprobs,
            } => {
                let mut c = self.chunk(Some(&text), None, false);
                if !logprobs.is_empty() {
                    c["choices"][0]["logprobs"] = self.logprobs_of(&logprobs);
                }
                if unverified {
                    c["tandem"] = json!({"unverified": true});
                }
                vec![data(c)]
            }
            Event::Live {
                tentative,
                correction,
                counts,
            } => {
                let mut c = self.chunk(None, None, false);
                let mut ext = serde_json::to_value(counts).unwrap_or_default();
                if let Some(t) = tentative {
                    ext["tentative"] = json!(t);
                }
                if let Some((d, t)) = correction {
                    ext["correction"] = json!({"draft": d, "target": t});
                }
                c["tandem"] = ext;
                vec![data(c)]
            }
            Event::Done(f) => {
                let mut c = self.chunk(None, Some(f.finish_reason), false);
                // The answer's log-probabilities not streamed with its text yet.
                c["choices"][0]["logprobs"] = match &f.logprobs {
                    Some(all) => self.logprobs_of(&all[f.logprobs_streamed.min(all.len())..]),
                    None => Value::Null,
                };
                c["tandem"] = Self::extension(&f);
                let mut out = vec![data(c)];
                if include_usage {
                    let mut u = self.chunk(None, None, false);
                    u["choices"] = json!([]);
                    u["usage"] = api::usage(f.prompt_tokens, f.completion_tokens, f.cached_tokens);
                    out.push(data(u));
                }
                out
            }
            // Once the stream has begun, an error is an event in it.
            Event::Error(e) => vec![SseEvent::default()
                .event("error")
                .data(e.body().to_string())],
        }
    }
}

/// Send one chunk of a stream (Err: the client went away).
async fn send(
    tx: &mpsc::Sender<Result<SseEvent, std::convert::Infallible>>,
    chunk: &Value,
) -> Result<(), ()> {
    let event = SseEvent::default().data(chunk.to_string());
    tx.send(Ok(event)).await.map_err(|_| ())
}

/// Stream the answer as SSE; a client that goes away cancels its session.
fn stream(
    envelope: Envelope,
    req: Request,
    mut events: mpsc::UnboundedReceiver<Event>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<SseEvent, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        if envelope.kind == Kind::Chat {
            let first = envelope.chunk(Some(""), None, true);
            if send(&tx, &first).await.is_err() {
                return;
            }
        }
        // A named function's call streams as OpenAI streams it: the call with its name first,
        // then its arguments in pieces. A `required` call (whose name is in its JSON) goes out
        // whole, as one delta, once its JSON is complete.
        // In the model's tags, text streams as content and each call goes out whole once its
        // closing tag has come (log-probabilities ride on the next chunk sent).
        let tags = envelope.in_tags();
        let mut reader = tags.then(CallReader::default);
        let mut pending: Vec<Value> = Vec::new();
        let named = !tags && matches!(envelope.tool_call, Some(ToolCall::Named(_)));
        let mut call_text = envelope
            .tool_call
            .as_ref()
            .filter(|_| !named && !tags)
            .map(|_| String::new());
        let mut call_started = false;
        loop {
            let e = tokio::select! {
                e = events.recv() => e,
                // The client went away: dropping `events` cancels the session.
                _ = tx.closed() => return,
            };
            let Some(e) = e else { break };
            let e = match (&mut reader, e) {
                (Some(r), Event::Text { text, logprobs, .. }) => {
                    pending.extend(logprobs);
                    let got = r.push(&text, &|i| envelope.call_id_at(i));
                    let mut chunks = envelope.read_chunks(got);
                    if let Some(c) = chunks.first_mut().filter(|_| !pending.is_empty()) {
                        c["choices"][0]["logprobs"] = envelope.logprobs_of(&pending);
                        pending.clear();
                    }
                    for c in chunks {
                        if send(&tx, &c).await.is_err() {
                            return;
                        }
                    }
                    continue;
                }
                (Some(_), Event::Live { .. }) => continue,
                (Some(r), Event::Done(mut f)) => {
                    let last = r.finish(&|i| envelope.call_id_at(i));
                    for c in envelope.read_chunks(last) {
                        if send(&tx, &c).await.is_err() {
                            return;
                        }
                    }
                    if r.calls() > 0 {
                        f.finish_reason = Envelope::call_finish(&f);
                    }
                    // What was held back goes with the last chunk.
                    f.logprobs_streamed = f.logprobs_streamed.saturating_sub(pending.len());
                    Event::Done(f)
                }
                (_, e) => e,
            };
            let e = match (named, e) {
                (true, Event::Text { text, logprobs, .. }) => {
                    let mut call = json!({"index": 0, "function": {"arguments": text}});
                    if !call_started {
                        call_started = true;
                        call["id"] = json!(envelope.call_id());
                        call["type"] = json!("function");
                        if let Some(ToolCall::Named(n)) = &envelope.tool_call {
                            call["function"]["name"] = json!(n);
                        }
                    }
                    let mut c = envelope.chunk(None, None, false);
                    c["choices"][0]["delta"]["tool_calls"] = json!([call]);
                    if !logprobs.is_empty() {
                        c["choices"][0]["logprobs"] = envelope.logprobs_of(&logprobs);
                    }
                    if send(&tx, &c).await.is_err() {
                        return;
                    }
                    continue;
                }
                (true, Event::Live { .. }) => continue,
                (true, Event::Done(mut f)) => {
                    f.finish_reason = Envelope::call_finish(&f);
                    Event::Done(f)
                }
                (_, e) => e,
            };
            let e = match (&mut call_text, e) {
                (Some(t), Event::Text { text, .. }) => {
                    t.push_str(&text);
                    continue;
                }
                (Some(_), Event::Live { .. }) => continue,
                (Some(t), Event::Done(mut f)) => {
                    let mut c = envelope.chunk(None, None, false);
                    match envelope.tool_calls(t, &f) {
                        Some((calls, finish)) => {
                            c["choices"][0]["delta"]["tool_calls"] = calls;
                            f.finish_reason = finish;
                        }
                        None => c["choices"][0]["delta"]["content"] = json!(t),
                    }
                    let data = SseEvent::default().data(c.to_string());
                    if tx.send(Ok(data)).await.is_err() {
                        return;
                    }
                    Event::Done(f)
                }
                (_, e) => e,
            };
            let last = matches!(e, Event::Done(_) | Event::Error(_));
            for ev in envelope.events(e, req.include_usage) {
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
            if last {
                break;
            }
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).into_response()
}
