//! OpenAI's HTTP API as `tandem serve` speaks it: the requests of `POST /v1/chat/completions` and
//! `POST /v1/completions`, each checked into a [`Request`] or refused with OpenAI's error object
//! naming the field; the responses and the streamed chunks. A field that would change the answer
//! and that Tandem does not honour yet is refused by name ([`UNHONOURED`]), never ignored; fields
//! that do not change it (`user`, `metadata`, `store`, …) are accepted and ignored.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tandem_engine::Tokenizer;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::GrammarSource;

use super::tools::{self, ToolCall, ToolFormat, Tools};

/// An error as OpenAI sends it: an HTTP status and `{"error": {message, type, param, code}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param),
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": Value::Null,
        }})
    }
}

/// A message's content: text, or parts of which the text ones count.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant's earlier tool calls (rendered as their JSON), a tool result's call id.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// `stop`: one string or up to four.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Tandem's opt-in extension of a request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Extension {
    /// Stream the draft's tentative tokens and its corrections too (the live view).
    #[serde(default)]
    pub tentative: bool,
}

/// The fields of both endpoints' requests that Tandem reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Body {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    #[serde(default)]
    pub prompt: Option<Value>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// vLLM's and llama.cpp server's extension: keep the `top_k` likeliest tokens (0 or -1: all).
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub tandem: Option<Extension>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": …}}`.
    #[serde(default)]
    pub response_format: Option<Value>,
    /// Functions the model may call, and whether and which it must (`auto`, `none`, `required`,
    /// a named function; `auto` needs a chat template with a tool format: [`super::tools`]).
    #[serde(default)]
    pub tools: Option<Value>,
    /// Chat: `true` and `top_logprobs` 0–20; completions: the number of alternatives, 0–5.
    #[serde(default)]
    pub logprobs: Option<Value>,
    #[serde(default)]
    pub top_logprobs: Option<Value>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Whether the model may make several calls in one answer (the model's tags; Tandem's JSON
    /// is one call).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Fields that would change the answer, read only to refuse them unless they are no-ops.
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// A field of OpenAI's (or vLLM's, or llama.cpp server's) requests that changes the answer and
/// that Tandem does not honour (yet): when its value is a no-op, accepted (`null` always is), and
/// how to say so. A request that sets one otherwise is refused with a 400 naming it, never answered
/// as if it had not been sent.
pub struct Unhonoured {
    pub field: &'static str,
    pub noop: fn(&Value) -> bool,
    pub noop_is: &'static str,
}

const fn unhonoured_field(
    field: &'static str,
    noop: fn(&Value) -> bool,
    noop_is: &'static str,
) -> Unhonoured {
    Unhonoured {
        field,
        noop,
        noop_is,
    }
}

fn never(_: &Value) -> bool {
    false
}
fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}
fn is_false(v: &Value) -> bool {
    v == &Value::Bool(false)
}
fn is_empty_array(v: &Value) -> bool {
    v.as_array().is_some_and(|a| a.is_empty())
}

/// Every field Tandem refuses by name unless it is a no-op.
pub const UNHONOURED: &[Unhonoured] = &[
    unhonoured_field(
        "logit_bias",
        |v| v.as_object().is_some_and(|m| m.is_empty()),
        "an empty object",
    ),
    unhonoured_field("presence_penalty", is_zero, "0"),
    unhonoured_field("frequency_penalty", is_zero, "0"),
    unhonoured_field("repetition_penalty", |v| v.as_f64() == Some(1.0), "1"),
    unhonoured_field("min_p", is_zero, "0"),
    unhonoured_field("min_tokens", is_zero, "0"),
    unhonoured_field("echo", is_false, "false"),
    unhonoured_field("best_of", |v| v.as_u64() == Some(1), "1"),
    unhonoured_field("suffix", |v| v.as_str() == Some(""), "\"\""),
    unhonoured_field("ignore_eos", is_false, "false"),
    unhonoured_field("stop_token_ids", is_empty_array, "[]"),
    unhonoured_field("functions", is_empty_array, "[]"),
    unhonoured_field("function_call", |v| v.as_str() == Some("none"), "\"none\""),
    unhonoured_field("guided_json", never, "absent"),
    unhonoured_field("guided_regex", never, "absent"),
    unhonoured_field("guided_choice", never, "absent"),
    unhonoured_field("guided_grammar", never, "absent"),
    unhonoured_field("grammar", never, "absent"),
    unhonoured_field("json_schema", never, "absent"),
    unhonoured_field(
        "reasoning_effort",
        never,
        "absent (this model does not reason)",
    ),
    unhonoured_field("audio", never, "absent (this model answers in text)"),
    unhonoured_field(
        "modalities",
        |v| v.as_array().is_some_and(|a| a.iter().all(|m| m == "text")),
        "[\"text\"]",
    ),
];

/// The first field of `rest` that [`UNHONOURED`] names with a value that is not its no-op
/// (`null` is always one), as the refusal to send.
fn unhonoured(rest: &serde_json::Map<String, Value>) -> Option<ApiError> {
    UNHONOURED.iter().find_map(|u| {
        let (field, what) = (u.field, u.noop_is);
        let v = rest.get(field).filter(|v| !v.is_null() && !(u.noop)(v))?;
        Some(ApiError::invalid(
            field,
            format!(
                "`{field}` is not supported by this server yet (it would change the answer, so it is \
                 refused rather than ignored): leave it out, or set it to {what}; got {v}"
            ),
        ))
    })
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// A request checked and tokenized: what a session needs.
#[derive(Debug, Clone)]
pub struct Request {
    pub kind: Kind,
    pub model: String,
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub tentative: bool,
    /// Structured output (`response_format` `json_schema` or `json_object`, or a forced tool
    /// call's arguments).
    pub grammar: Option<tandem_spec::GrammarSource>,
    /// The call asked for (the output becomes `tool_calls`), and how the model writes it.
    pub tool_call: Option<ToolCall>,
    pub tool_format: ToolFormat,
    /// The target's log-probabilities of the answer's tokens, with this many alternatives each.
    pub logprobs: Option<usize>,
}

/// What the server serves, for the checks.
pub struct Served<'a> {
    pub model: &'a str,
    pub tok: &'a Tokenizer,
    pub context_len: usize,
    /// The seed of a request that names none.
    pub seed: u64,
    /// How the model writes a tool call.
    pub tool_format: ToolFormat,
}

/// Parse and check a request's body for endpoint `kind`.
pub fn parse(kind: Kind, body: &[u8], served: &Served) -> Result<Request, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let b: Body = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let param = match inner.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => "body",
            _ => field_of(&path).unwrap_or_else(|| field_of(&format!("{inner}")).unwrap_or("body")),
        };
        let at = if path == "." {
            String::new()
        } else {
            format!(" at `{path}`")
        };
        ApiError::invalid(param, format!("the request body is not valid{at}: {inner}"))
    })?;
    let model = b.model.clone().unwrap_or_else(|| served.model.to_string());
    if model != served.model {
        return Err(ApiError {
            status: 404,
            message: format!(
                "The model `{model}` does not exist: this server serves `{}`",
                served.model
            ),
            kind: "invalid_request_error",
            param: Some("model"),
        });
    }
    if let Some(e) = unhonoured(&b.rest) {
        return Err(e);
    }
    if let Some(n) = b.n.filter(|&n| n != 1) {
        return Err(ApiError::invalid(
            "n",
            format!("n must be 1 (one answer per request), got {n}"),
        ));
    }
    let temperature = b.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature must be within 0 and 2, got {temperature}"),
        ));
    }
    let top_p = b.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("top_p must be within (0, 1], got {top_p}"),
        ));
    }
    let top_k = match b.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => k as usize,
        k => {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k must be at least 1 (or 0 or -1: no cut), got {k}"),
            ))
        }
    };
    let stops = match b.stop.clone() {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) if v.len() <= 4 => v,
        Some(Stop::Many(v)) => {
            return Err(ApiError::invalid(
                "stop",
                format!("at most 4 stop sequences, got {}", v.len()),
            ))
        }
    };
    // The tools are checked once; a chat's prompt tells a forced call's functions (its error, if
    // any, comes after the messages' own, as it always has).
    let tools = tools::parse(&b, kind, served.tool_format);
    let prompt_ids = match kind {
        Kind::Chat => chat_prompt(&b, served.tok, &tools)?,
        Kind::Completion => completion_prompt(&b, served.tok)?,
    };
    if prompt_ids.len() >= served.context_len {
        return Err(ApiError::invalid(
            if kind == Kind::Chat {
                "messages"
            } else {
                "prompt"
            },
            format!(
                "the prompt is {} tokens, the model's context {}",
                prompt_ids.len(),
                served.context_len
            ),
        ));
    }
    let room = served.context_len - prompt_ids.len();
    let (asked, param) = match (b.max_completion_tokens, b.max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, Some(m)) => (Some(m), "max_tokens"),
        (None, None) => (None, "max_tokens"),
    };
    let max_tokens = match asked {
        Some(0) => {
            return Err(ApiError::invalid(
                param,
                format!("{param} must be at least 1"),
            ))
        }
        Some(m) if m as usize > room => {
            return Err(ApiError::invalid(
                param,
                format!(
                    "{param} {m} and the prompt's {} tokens exceed the model's context {}",
                    prompt_ids.len(),
                    served.context_len
                ),
            ))
        }
        Some(m) => m as usize,
        None if kind == Kind::Completion => 16.min(room),
        None => room,
    };
    let logprobs = logprobs(&b, kind)?;
    let format = response_format(b.response_format.as_ref())?;
    let tools = tools?;
    let (tool_call, tool_grammar, tool_format) = (tools.call, tools.grammar, tools.format);
    let grammar =
        match (format, tool_grammar) {
            (Some(_), Some(_)) => return Err(ApiError::invalid(
                "response_format",
                "with tools the answer follows the tools' grammar (each call's arguments their \
                 function's schema): leave response_format out (or text), or tool_choice `none`",
            )),
            (f, t) => f.or(t),
        };
    let stream = b.stream.unwrap_or(false);
    if b.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    Ok(Request {
        kind,
        model,
        prompt_ids,
        params: SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: b.seed.unwrap_or(served.seed),
        },
        max_tokens,
        stops,
        stream,
        include_usage: b.stream_options.is_some_and(|o| o.include_usage),
        tentative: b.tandem.is_some_and(|t| t.tentative),
        grammar,
        tool_call,
        tool_format,
        logprobs,
    })
}

/// The log-probabilities a request asks for (alternatives each), as each endpoint spells it: chat
/// `logprobs: true` with `top_logprobs` 0–20, completions `logprobs` 0–5.
fn logprobs(b: &Body, kind: Kind) -> Result<Option<usize>, ApiError> {
    let top = |v: Option<&Value>, field: &'static str, most: u64| match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(k) if k <= most => Ok(Some(k as usize)),
            _ => Err(ApiError::invalid(
                field,
                format!("{field} must be an integer from 0 to {most}, got {v}"),
            )),
        },
    };
    match kind {
        Kind::Chat => {
            let on = match &b.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(v) => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        format!("logprobs must be true or false, got {v}"),
                    ))
                }
            };
            let k = top(b.top_logprobs.as_ref(), "top_logprobs", 20)?;
            match (on, k) {
                (false, Some(k)) if k > 0 => Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                )),
                (false, _) => Ok(None),
                (true, k) => Ok(Some(k.unwrap_or(0))),
            }
        }
        Kind::Completion => {
            if b.top_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "completions take the number of alternatives in logprobs",
                ));
            }
            top(b.logprobs.as_ref(), "logprobs", 5)
        }
    }
}

/// OpenAI's `response_format` as a grammar: `text` (or none) is free text; `json_object` any JSON
/// object; `json_schema` its `json_schema.schema` (with `strict` or without: the schema is always
/// enforced). Anything else is refused naming the field.
fn response_format(v: Option<&Value>) -> Result<Option<GrammarSource>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |m: String| ApiError::invalid("response_format", m);
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSource::JsonObject)),
        Some("json_schema") => {
            let js = v.get("json_schema").ok_or_else(|| {
                bad("a json_schema response_format needs `json_schema: {\"name\": …, \"schema\": {…}}`".into())
            })?;
            if let Some(s) = js.get("strict").filter(|s| !s.is_null() && !s.is_boolean()) {
                return Err(bad(format!(
                    "json_schema.strict must be a boolean, got {s}"
                )));
            }
            match js.get("schema") {
                Some(schema) if schema.is_object() || schema.is_boolean() => {
                    Ok(Some(GrammarSource::JsonSchema(schema.to_string())))
                }
                Some(other) => Err(bad(format!(
                    "json_schema.schema must be a JSON schema (an object), got {other}"
                ))),
                None => Err(bad("json_schema.schema is missing".into())),
            }
        }
        Some(t) => Err(bad(format!(
            "type `{t}` is not supported (text, json_object, json_schema)"
        ))),
        None => Err(bad(format!("`type` is missing in {v}"))),
    }
}

/// The request field a serde path (`messages[0].role`) or error message (`missing field
/// `messages``) names.
fn field_of(s: &str) -> Option<&'static str> {
    const FIELDS: [&str; 21] = [
        "logprobs",
        "parallel_tool_calls",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "messages",
        "prompt",
        "model",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "max_completion_tokens",
        "seed",
        "stop",
        "stream_options",
        "stream",
        "n",
        "tandem",
        "role",
    ];
    let head = s.split(['.', '[']).next().unwrap_or_default();
    FIELDS
        .into_iter()
        .find(|f| *f == head || s.contains(&format!("`{f}`")))
}

fn chat_prompt(
    b: &Body,
    tok: &Tokenizer,
    tools: &Result<Tools, ApiError>,
) -> Result<Vec<u32>, ApiError> {
    let messages = b
        .messages
        .as_ref()
        .ok_or_else(|| ApiError::invalid("messages", "messages is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let tags = tools.as_ref().is_ok_and(|t| t.format == ToolFormat::Tags);
    let mut chat: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    for (i, m) in messages.iter().enumerate() {
        if !["system", "developer", "user", "assistant", "tool"].contains(&m.role.as_str()) {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "messages[{i}].role must be system, developer, user, assistant or tool, got `{}`",
                    m.role
                ),
            ));
        }
        if m.role == "tool" && m.tool_call_id.is_none() {
            return Err(ApiError::invalid(
                "messages",
                format!("messages[{i}]: a tool result needs the tool_call_id it answers"),
            ));
        }
        let content = match &m.content {
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(x)) => t.push_str(x),
                        (k, _) => {
                            return Err(ApiError::invalid(
                                "messages",
                                format!(
                                    "messages[{i}].content: only text parts are served, got `{k}`"
                                ),
                            ))
                        }
                    }
                }
                t
            }
            // An assistant's turn that called tools: the calls, as the model would write them
            // (the model's tags render them from `tool_calls` below).
            None => match &m.tool_calls {
                Some(calls) if m.role == "assistant" && !tags => calls.to_string(),
                _ => String::new(),
            },
        };
        let role = if m.role == "developer" {
            "system".to_string()
        } else {
            m.role.clone()
        };
        let mut turn = json!({"role": role, "content": content});
        if let (true, "assistant", Some(calls)) = (tags, m.role.as_str(), &m.tool_calls) {
            turn["tool_calls"] = earlier_calls(i, calls)?;
        }
        chat.push(turn);
    }
    let tools = tools.as_ref().map_err(Clone::clone)?;
    let listed = if tags {
        // The model's template tells the functions (when a call may come) and renders earlier
        // calls in its tags.
        tools.call.is_some().then_some(tools.listed.as_slice())
    } else {
        // Functions a forced call may use are told in the system message (the template has no
        // tool format of its own).
        if tools.call.is_some() {
            let listed: Vec<Value> = b
                .tools
                .as_ref()
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|t| t.get("function").cloned())
                        .collect()
                })
                .unwrap_or_default();
            let told = format!(
                "You can call these functions; answer with a call as JSON.\n{}",
                Value::Array(listed)
            );
            match chat.first_mut() {
                Some(first) if first["role"] == "system" => {
                    first["content"] = json!(format!(
                        "{}\n\n{told}",
                        first["content"].as_str().unwrap_or_default()
                    ))
                }
                _ => chat.insert(0, json!({"role": "system", "content": told})),
            }
        }
        None
    };
    let text = tok
        .render_chat_with(&chat, listed)
        .map_err(|e| ApiError::invalid("messages", format!("the chat template failed: {e}")))?;
    tok.encode(&text)
        .map_err(|e| ApiError::invalid("messages", format!("tokenizing failed: {e}")))
}

/// An assistant's earlier `tool_calls` (message `i`) as a template reads them: each
/// `{"type": "function", "function": {"name", "arguments"}}` with its `arguments` (OpenAI's JSON
/// text) parsed into the object the model wrote.
fn earlier_calls(i: usize, calls: &Value) -> Result<Value, ApiError> {
    let bad = |m: String| ApiError::invalid("messages", format!("messages[{i}].tool_calls: {m}"));
    let list = calls
        .as_array()
        .ok_or_else(|| bad(format!("a list of calls, got {calls}")))?;
    let mut out = Vec::with_capacity(list.len());
    for (k, c) in list.iter().enumerate() {
        let f = c
            .get("function")
            .ok_or_else(|| bad(format!("[{k}]: `function` is missing")))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("[{k}]: function.name is missing")))?;
        let arguments = match f.get("arguments") {
            Some(Value::String(a)) => serde_json::from_str::<Value>(a)
                .map_err(|e| bad(format!("[{k}]: function.arguments is not JSON: {e}")))?,
            Some(a @ Value::Object(_)) => a.clone(),
            None | Some(Value::Null) => json!({}),
            Some(a) => {
                return Err(bad(format!(
                    "[{k}]: function.arguments must be JSON text, got {a}"
                )))
            }
        };
        out.push(json!({"type": "function", "id": c.get("id"),
                        "function": {"name": name, "arguments": arguments}}));
    }
    Ok(Value::Array(out))
}

fn completion_prompt(b: &Body, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let ids =
        match &b.prompt {
            Some(Value::String(s)) if !s.is_empty() => tok
                .encode(s)
                .map_err(|e| ApiError::invalid("prompt", format!("tokenizing failed: {e}")))?,
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => tok
                .encode(a[0].as_str().unwrap_or_default())
                .map_err(|e| ApiError::invalid("prompt", format!("tokenizing failed: {e}")))?,
            Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.is_u64()) => {
                let ids: Vec<u32> = a
                    .iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect();
                if let Some(&t) = ids.iter().find(|&&t| t as usize >= tok.vocab_size()) {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!(
                            "token id {t} is outside the vocabulary ({})",
                            tok.vocab_size()
                        ),
                    ));
                }
                ids
            }
            None => return Err(ApiError::invalid("prompt", "prompt is required")),
            Some(_) => return Err(ApiError::invalid(
                "prompt",
                "prompt must be a non-empty string, one string in a list, or a list of token ids",
            )),
        };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt has no tokens"));
    }
    Ok(ids)
}

/// Speculation statistics of one answer, with vLLM's per-request names (a vendor extension:
/// `tandem` beside OpenAI's fields).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Blocks the verifier judged (vLLM's drafts).
    pub num_drafts: usize,
    /// Tokens the draft proposed, and those the target accepted.
    pub num_draft_tokens: usize,
    pub num_accepted_draft_tokens: usize,
    /// vLLM's: 1 + accepted draft tokens per judged block.
    pub mean_acceptance_length: f64,
    /// vLLM's: accepted over proposed draft tokens (drafts in blocks that an earlier rejection
    /// made stale count as proposed).
    pub draft_acceptance_rate: f64,
    /// Tandem's α: accepted over judged positions (a stale block's drafts are not judged).
    pub alpha: f64,
    /// Committed tokens the verifier produced itself (first token, corrections, bonuses,
    /// decoded), and of those the ones it decoded with no block to verify.
    pub cloud_tokens: usize,
    pub cloud_decoded_tokens: usize,
    /// Reconnections to a verifier during the answer.
    pub reconnects: usize,
}

/// The usage object of a response: OpenAI's, with `prompt_tokens_details.cached_tokens`, the
/// prompt tokens the verifier's prefix cache served.
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}
