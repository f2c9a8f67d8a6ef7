//! The responses of `tandem serve`: a finished answer as OpenAI's response object, and an answer
//! streamed as SSE chunks (content, a tool call's deltas, the live view's tentative tokens and
//! corrections, usage), each with Tandem's speculation figures beside OpenAI's fields.

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::{self, Kind, Request};
use super::sessions::{Event, Finished};
use super::tools::{self, CallReader, ToolCall, ToolFormat};

/// What every response and chunk of one request shares.
pub(super) struct Envelope {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) kind: Kind,
    /// The answer is (or, under `auto`, may be) a tool call: its text becomes `tool_calls`.
    pub(super) tool_call: Option<ToolCall>,
    pub(super) tool_format: ToolFormat,
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
        let got = CallReader::read_whole(text, &|i| self.call_id_at(i));
        let content = got.content;
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
    pub(super) fn whole(&self, text: &str, f: &Finished, unverified_from: Option<usize>) -> Value {
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
pub(super) fn stream(
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
