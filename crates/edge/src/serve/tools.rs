//! Tool calls: a request's functions checked, the call `tool_choice` asks for, the grammar that
//! holds the output to it, and the output read back as OpenAI's `tool_calls`. Two formats:
//!
//! - **The model's own tags** ([`ToolFormat::Tags`]), for a model whose chat template renders
//!   `tools` and whose vocabulary has `<tool_call>` and `</tool_call>` tokens (Qwen2.5, Hermes):
//!   the functions go to the template, and the model writes text, calls, or text then calls, each
//!   call `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`. The grammar leaves the text
//!   free (but for the opening tag spelled out in pieces) and, from an opening tag on, holds the
//!   call to one of the functions and its parameters' schema. Every `tool_choice` is served:
//!   `auto` (the model chooses), `required` (calls only), a named function, `none`.
//! - **Tandem's JSON** ([`ToolFormat::Json`]), for a template with no tool format (SmolLM2): the
//!   functions are told in the system message and the output is the call's JSON. A call must be
//!   forced (named or `required`); `auto` is refused by name, as the server could not tell a call
//!   from an answer.
//!
//! Either way the grammar travels to the verifier, which masks the target's rows with it, so a
//! call is exact under speculation as every structured output is.

use serde_json::{json, Value};
use tandem_engine::tokenizer::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
use tandem_spec::GrammarSource;

use super::api::{ApiError, Body, Kind};

/// How the served model writes a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Tandem's: the output is the call's JSON (the model's template has no tool format).
    Json,
    /// The model's own: calls between `<tool_call>` tags, after any text.
    Tags,
}

/// The call a request asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolCall {
    /// This function (Tandem's JSON: the output is its arguments).
    Named(String),
    /// One of the tools (Tandem's JSON: the output is `{"name": …, "arguments": {…}}`).
    Required,
    /// The model chooses between an answer and calls (the model's tags only).
    Auto,
}

/// A request's tools checked.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The request's tools as sent, for the chat template (the model's tags only).
    pub listed: Vec<Value>,
    /// The call asked for (None: no tools, or `tool_choice: none`).
    pub call: Option<ToolCall>,
    /// The grammar that holds the output to it.
    pub grammar: Option<GrammarSource>,
    pub format: ToolFormat,
}

/// The request's tools checked: each `{"type": "function", "function": {"name", "description"?,
/// "parameters"?}}` with a unique name; and the call `tool_choice` asks for, with its grammar.
pub fn parse(b: &Body, kind: Kind, format: ToolFormat) -> Result<Tools, ApiError> {
    let list = match &b.tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(other) => {
            return Err(ApiError::invalid(
                "tools",
                format!("tools must be a list of functions, got {other}"),
            ))
        }
    };
    if !list.is_empty() && kind == Kind::Completion {
        return Err(ApiError::invalid(
            "tools",
            "tools are served on /v1/chat/completions only",
        ));
    }
    let mut fns: Vec<(String, Value)> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let bad = |m: String| ApiError::invalid("tools", format!("tools[{i}]: {m}"));
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("only `type: function` tools are served".into()));
        }
        let f = t
            .get("function")
            .ok_or_else(|| bad("`function` is missing".into()))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| {
                !n.is_empty()
                    && n.len() <= 64
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            })
            .ok_or_else(|| bad("function.name must be 1–64 of a-z, A-Z, 0-9, _ and -".into()))?;
        if fns.iter().any(|(n, _)| n == name) {
            return Err(bad(format!("a second function named `{name}`")));
        }
        let params = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p) if p.is_object() => p.clone(),
            Some(p) => {
                return Err(bad(format!(
                    "function.parameters must be a JSON schema, got {p}"
                )))
            }
        };
        fns.push((name.to_string(), params));
    }
    let parallel = b.parallel_tool_calls != Some(false);
    let none = Tools {
        listed: Vec::new(),
        call: None,
        grammar: None,
        format,
    };
    let call = match &b.tool_choice {
        None | Some(Value::Null) if fns.is_empty() => return Ok(none),
        None | Some(Value::Null) => ToolCall::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(none),
            "auto" => ToolCall::Auto,
            "required" if fns.is_empty() => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "tool_choice `required` needs tools",
                ))
            }
            "required" => ToolCall::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                    "tool_choice must be none, auto, required or a named function, got `{other}`"
                ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
            if !fns.iter().any(|(n, _)| n == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("no tool is named `{name}`"),
                ));
            }
            ToolCall::Named(name.to_string())
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "tool_choice must be none, auto, required or a named function, got {other}"
                ),
            ))
        }
    };
    let grammar =
        match (format, &call) {
            (ToolFormat::Json, ToolCall::Auto) => return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice `auto` (the default with tools) needs a chat template that defines a \
                 tool format, and this model's has none: name a function in tool_choice, or ask \
                 for `required` (or `none`)",
            )),
            (ToolFormat::Json, ToolCall::Named(n)) => {
                let params = fns.iter().find(|(f, _)| f == n).map(|(_, p)| p.to_string());
                GrammarSource::JsonSchema(params.unwrap_or_default())
            }
            (ToolFormat::Json, ToolCall::Required) => {
                GrammarSource::JsonSchema(call_schema(&fns, None).to_string())
            }
            (ToolFormat::Tags, call) => tag_grammar(&fns, call, parallel),
        };
    Ok(Tools {
        listed: if format == ToolFormat::Tags {
            list
        } else {
            Vec::new()
        },
        call: Some(call),
        grammar: Some(grammar),
        format,
    })
}

/// The schema of a call `{"name": …, "arguments": {…}}` to one of `fns` (or to `only`).
fn call_schema(fns: &[(String, Value)], only: Option<&str>) -> Value {
    let any: Vec<Value> = fns
        .iter()
        .filter(|(n, _)| only.is_none_or(|o| o == n))
        .map(|(n, p)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": p},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    if any.len() == 1 {
        any[0].clone()
    } else {
        json!({"anyOf": any})
    }
}

/// An answer whose whole text is one call, outside the tags: the call's JSON, or the same in a
/// Markdown fence. Small models given the tag format write these too (Qwen2.5-Coder 1.5B does,
/// greedily, for most questions that call for a tool; llama.cpp's Hermes parser takes them for
/// the same reason).
const BARE_OPEN: &str = "{";
const FENCE_OPEN: &str = "```json\n";
const FENCE_CLOSE: &str = "\n```";

/// The grammar of an answer in the model's tags (Lark, llguidance's dialect). Under `auto`: text
/// then calls in tags, either optional, or one call as the whole answer, bare or fenced. Where an
/// answer goes is told by its first bytes, as llguidance's lexer (greedy: it never splits text it
/// can extend) needs: an answer that begins with `{` is a bare call, one that begins with
/// ```` ```json ```` and a newline, then `{` or whitespace, is a fenced call; text never spells
/// out an opening tag. So every call is held to its schema from its first byte. Under `required`
/// or a named function: calls only (one for a named function, or when `parallel_tool_calls` is
/// false). A call in tags and a bare call are laid out as the template shows (`", "` and `": "`,
/// no free whitespace); a fenced call's layout is free (the model pretty-prints it).
fn tag_grammar(fns: &[(String, Value)], call: &ToolCall, parallel: bool) -> GrammarSource {
    let only = match call {
        ToolCall::Named(n) => Some(n.as_str()),
        _ => None,
    };
    let schema = |layout: Value| {
        let mut s = call_schema(fns, only);
        if let Some(o) = s.as_object_mut() {
            o.insert("x-guidance".into(), layout);
        }
        s
    };
    let (fixed, free) = (
        schema(GrammarSource::json_layout()),
        schema(json!({"whitespace_flexible": true})),
    );
    let calls = if parallel && only.is_none() {
        "call (\"\\n\" call)*"
    } else {
        "call"
    };
    let start = match call {
        ToolCall::Auto => "TEXT? calls? | bare | FENCE (fenced | FENCED_TEXT)",
        _ => "calls | bare | FENCE fenced",
    };
    let no_tag = format!("~/(.|\\n)*{}(.|\\n)*/", regex_escape(TOOL_CALL_OPEN));
    GrammarSource::Lark(format!(
        "start: {start}\n\
         calls: {calls}\n\
         call: {TOOL_CALL_OPEN} \"\\n\" %json {fixed} \"\\n\" {TOOL_CALL_CLOSE}\n\
         bare: %json {fixed}\n\
         fenced: %json {free} {fence_close}\n\
         FENCE: {fence_open}\n\
         FENCED_TEXT: /[^ \\t\\n\\r{{](.|\\n)*/ & {no_tag}\n\
         TEXT: /(.|\\n)+/ & {no_tag} & ~/\\{{(.|\\n)*/ & ~/{fence}(.|\\n)*/\n",
        fence_open = serde_json::to_string(FENCE_OPEN).unwrap_or_default(),
        fence_close = serde_json::to_string(FENCE_CLOSE).unwrap_or_default(),
        fence = regex_escape(FENCE_OPEN).replace('\n', "\\n"),
    ))
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$/`\"".contains(c);
            special.then_some('\\').into_iter().chain([c])
        })
        .collect()
}

/// What an answer's text, so far, is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Form {
    /// Text, then any calls in tags.
    Tagged,
    /// One call, the whole answer (bare, or fenced).
    Whole { fenced: bool },
}

/// The form of an answer that begins with `text`, once its beginning tells (None: not yet), as
/// [`tag_grammar`] tells it.
fn form_of(text: &str) -> Option<Form> {
    if text.starts_with(BARE_OPEN) {
        return Some(Form::Whole { fenced: false });
    }
    if let Some(rest) = text.strip_prefix(FENCE_OPEN) {
        return match rest.chars().next() {
            None => None,
            Some(c) if c == '{' || c.is_ascii_whitespace() => Some(Form::Whole { fenced: true }),
            Some(_) => Some(Form::Tagged),
        };
    }
    if FENCE_OPEN.starts_with(text) {
        return None;
    }
    Some(Form::Tagged)
}

/// An answer read as it grows: text before the first call in tags goes out as content (trailing
/// whitespace and what may be the start of a tag held back), each call as OpenAI's `tool_calls`
/// entry once its closing tag has come; an answer that is one whole call, bare or fenced, is held
/// and goes out as that call when the answer ends.
#[derive(Debug, Default)]
pub struct CallReader {
    text: String,
    form: Option<Form>,
    /// Bytes of `text` sent as content.
    sent: usize,
    /// Where the next call's opening tag is looked for, once the first call began.
    next: Option<usize>,
    calls: usize,
}

/// What a piece of the answer adds: content to send, and calls now whole.
#[derive(Debug, Default, PartialEq)]
pub struct Read {
    pub content: String,
    pub calls: Vec<Value>,
}

impl CallReader {
    /// Add `piece`; `id(i)` names the `i`-th call.
    pub fn push(&mut self, piece: &str, id: &dyn Fn(usize) -> String) -> Read {
        self.text.push_str(piece);
        let mut out = Read::default();
        if self.form.is_none() {
            self.form = form_of(&self.text);
        }
        match self.form {
            None => return out,
            // A whole call goes out when the answer ends (the grammar ends it with its JSON).
            Some(Form::Whole { .. }) => return out,
            Some(Form::Tagged) => {}
        }
        if self.next.is_none() {
            // No tag begins before what was sent (a tag's possible start is held back).
            let end = match self.text[self.sent..].find(TOOL_CALL_OPEN) {
                Some(k) => {
                    let at = self.sent + k;
                    self.next = Some(at);
                    self.text[..at].trim_end().len()
                }
                None => {
                    let held = (1..TOOL_CALL_OPEN.len())
                        .rev()
                        .find(|&k| self.text.ends_with(&TOOL_CALL_OPEN[..k]))
                        .unwrap_or(0);
                    self.text[..self.text.len() - held].trim_end().len()
                }
            };
            if end > self.sent {
                out.content = self.text[self.sent..end].to_string();
                self.sent = end;
            }
        }
        // `next`: where the next call's opening tag is looked for.
        while let Some(at) = self.next {
            let Some(open) = self.text[at..].find(TOOL_CALL_OPEN) else {
                break;
            };
            let body = at + open + TOOL_CALL_OPEN.len();
            let Some(close) = self.text[body..].find(TOOL_CALL_CLOSE) else {
                break;
            };
            let json = self.text[body..body + close].to_string();
            out.calls.extend(self.call(&json, id));
            self.next = Some(body + close + TOOL_CALL_CLOSE.len());
        }
        out
    }

    /// A call's JSON `{"name": …, "arguments": {…}}` as OpenAI's entry (None: not whole yet).
    fn call(&mut self, json: &str, id: &dyn Fn(usize) -> String) -> Option<Value> {
        let v: Value = serde_json::from_str(json.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = v.get("arguments").map_or("{}".into(), Value::to_string);
        let call = json!({
            "index": self.calls,
            "id": id(self.calls),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        });
        self.calls += 1;
        Some(call)
    }

    /// The answer is done: what was held back goes out, as content (an answer with no calls
    /// keeps its trailing whitespace; a call cut short goes out as the text it is) or as the
    /// call an answer that is one whole call makes.
    pub fn finish(&mut self, id: &dyn Fn(usize) -> String) -> Read {
        let mut out = Read::default();
        match (self.form, self.next) {
            (Some(Form::Tagged), Some(at)) => {
                if let Some(open) = self.text[at..].find(TOOL_CALL_OPEN) {
                    out.content = self.text[at + open..].to_string();
                }
            }
            (Some(Form::Whole { fenced }), _) => {
                let json = match fenced {
                    false => Some(self.text.clone()),
                    true => self.text[FENCE_OPEN.len()..]
                        .strip_suffix(FENCE_CLOSE)
                        .map(str::to_string),
                };
                match json.and_then(|j| self.call(&j, id)) {
                    Some(call) => out.calls.push(call),
                    None => out.content = self.text[self.sent..].to_string(),
                }
            }
            _ => out.content = self.text[self.sent..].to_string(),
        }
        self.sent = self.text.len();
        out
    }

    /// A whole answer read at once: its content and calls.
    pub fn read_whole(text: &str, id: &dyn Fn(usize) -> String) -> Read {
        let mut r = CallReader::default();
        let mut got = r.push(text, id);
        let last = r.finish(id);
        got.content.push_str(&last.content);
        got.calls.extend(last.calls);
        got
    }

    /// Calls read so far.
    pub fn calls(&self) -> usize {
        self.calls
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(i: usize) -> String {
        format!("call_{i}")
    }

    fn read_all(pieces: &[&str]) -> (String, Vec<Value>) {
        let mut r = CallReader::default();
        let (mut content, mut calls) = (String::new(), Vec::new());
        for p in pieces {
            let got = r.push(p, &id);
            content.push_str(&got.content);
            calls.extend(got.calls);
        }
        let last = r.finish(&id);
        content.push_str(&last.content);
        calls.extend(last.calls);
        (content, calls)
    }

    #[test]
    fn text_then_calls_read_the_same_in_any_pieces() {
        let whole = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                     {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \
                     \"arguments\": {}}\n</tool_call>";
        let expect_calls = vec![
            json!({"index": 0, "id": "call_0", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}),
            json!({"index": 1, "id": "call_1", "type": "function",
                   "function": {"name": "get_time", "arguments": "{}"}}),
        ];
        assert_eq!(
            read_all(&[whole]),
            ("Let me look.".to_string(), expect_calls.clone())
        );
        // Byte by byte (at char boundaries), and split inside each tag.
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(
            read_all(&pieces),
            ("Let me look.".to_string(), expect_calls)
        );
    }

    #[test]
    fn an_answer_with_no_call_is_all_content_and_a_cut_call_stays_text() {
        assert_eq!(
            read_all(&["Paris is ", "sunny <tool", "\n\n"]),
            ("Paris is sunny <tool\n\n".to_string(), vec![])
        );
        let (content, calls) = read_all(&["<tool_call>\n{\"name\": \"f\", \"argu"]);
        assert_eq!(content, "<tool_call>\n{\"name\": \"f\", \"argu");
        assert!(calls.is_empty());
    }

    #[test]
    fn the_grammar_names_each_function_and_the_choice() {
        let fns = vec![
            ("a".to_string(), json!({"type": "object"})),
            ("b".to_string(), json!({"type": "object"})),
        ];
        let GrammarSource::Lark(auto) = tag_grammar(&fns, &ToolCall::Auto, true) else {
            panic!("a Lark grammar")
        };
        assert!(auto.starts_with(
            "start: TEXT? calls? | bare | FENCE (fenced | FENCED_TEXT)\ncalls: call (\"\\n\" call)*\n"
        ));
        assert!(auto.contains("\"anyOf\""));
        assert!(auto.contains("~/(.|\\n)*<tool_call>(.|\\n)*/"));
        let GrammarSource::Lark(named) = tag_grammar(&fns, &ToolCall::Named("b".into()), true)
        else {
            panic!("a Lark grammar")
        };
        assert!(named.starts_with("start: calls | bare | FENCE fenced\ncalls: call\n"));
        assert!(!named.contains("anyOf") && named.contains("{\"const\":\"b\"}"));
        let GrammarSource::Lark(one) = tag_grammar(&fns, &ToolCall::Required, false) else {
            panic!("a Lark grammar")
        };
        assert!(one.starts_with("start: calls | bare | FENCE fenced\ncalls: call\n"));
    }

    /// A vocabulary of single bytes, the two tags and an end token, for the grammar.
    fn toy() -> (tandem_spec::GrammarVocab, impl Fn(&str) -> Vec<u32>, u32) {
        let mut tokens: Vec<Vec<u8>> = (0u8..128).map(|b| vec![b]).collect();
        let mut special = vec![false; 128];
        for t in [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<|end|>"] {
            tokens.push(t.as_bytes().to_vec());
            special.push(true);
        }
        let vocab = tandem_spec::GrammarVocab::new(&tokens, &special, &[130], 131).unwrap();
        let ids = |s: &str| {
            let mut out = Vec::new();
            let mut rest = s;
            while !rest.is_empty() {
                if let Some(r) = rest.strip_prefix(TOOL_CALL_OPEN) {
                    out.push(128);
                    rest = r;
                } else if let Some(r) = rest.strip_prefix(TOOL_CALL_CLOSE) {
                    out.push(129);
                    rest = r;
                } else {
                    out.push(rest.as_bytes()[0] as u32);
                    rest = &rest[1..];
                }
            }
            out
        };
        (vocab, ids, 130)
    }

    /// Whether the grammar takes `answer` whole and then the end token.
    fn takes(g: &GrammarSource, answer: &str) -> bool {
        let (vocab, ids, end) = toy();
        let mut g = vocab.compile(g).unwrap();
        ids(answer)
            .into_iter()
            .chain([end])
            .enumerate()
            .all(|(i, t)| {
                let ok = g.allows(t).unwrap() && g.advance(t).is_ok();
                if !ok {
                    eprintln!("refused at {i}: {t}");
                }
                ok
            })
    }

    fn weather() -> Vec<(String, Value)> {
        vec![
            (
                "get_weather".to_string(),
                json!({"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": false}),
            ),
            ("get_time".to_string(), json!({"type": "object"})),
        ]
    }

    #[test]
    fn auto_takes_text_calls_in_tags_and_whole_calls_and_holds_every_call_to_its_schema() {
        let auto = tag_grammar(&weather(), &ToolCall::Auto, true);
        let call = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}";
        let tagged = format!("{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}");
        for ok in [
            String::new(),
            "It is sunny {\"name\": 1} <tool call>.\n".to_string(),
            "```json\n[1, 2]\n```".to_string(),
            "```python\nprint(1)\n```".to_string(),
            tagged.clone(),
            format!("Let me look.\n{tagged}\n{tagged}"),
            call.to_string(),
            "```json\n{\n  \"name\": \"get_time\",\n  \"arguments\": {}\n}\n```".to_string(),
        ] {
            assert!(takes(&auto, &ok), "{ok:?}");
        }
        for bad in [
            // A call in tags, bare or fenced, to a function that is not there or with arguments
            // off the schema.
            format!(
                "{TOOL_CALL_OPEN}\n{{\"name\": \"fly\", \"arguments\": {{}}}}\n{TOOL_CALL_CLOSE}"
            ),
            "{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Oslo\"}}".to_string(),
            "```json\n{ \"name\": \"get_weather\", \"arguments\": {} }\n```".to_string(),
            // An answer that begins as a call is one: an object that is not a call is refused.
            "{\"city\": \"Oslo\"}".to_string(),
            "```json\n{\"city\": 1}\n```".to_string(),
            // The opening tag spelled out in text; text after the calls.
            "see <tool_call> here".to_string(),
            format!("{tagged} done"),
        ] {
            assert!(!takes(&auto, &bad), "{bad:?}");
        }
        // `required` and a named function take calls only; `parallel_tool_calls: false`, one.
        let required = tag_grammar(&weather(), &ToolCall::Required, false);
        assert!(takes(&required, &tagged) && takes(&required, call));
        assert!(!takes(&required, "Sunny.") && !takes(&required, &format!("{tagged}\n{tagged}")));
        let named = tag_grammar(&weather(), &ToolCall::Named("get_time".into()), true);
        assert!(!takes(&named, &tagged));
        assert!(takes(
            &named,
            &format!("{TOOL_CALL_OPEN}\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n{TOOL_CALL_CLOSE}")
        ));
    }

    #[test]
    fn a_whole_call_bare_or_fenced_is_read_as_a_call() {
        let bare = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}";
        let fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \"Oslo\"\n  }\n}\n```";
        for whole in [bare, fenced] {
            let chars: Vec<String> = whole.chars().map(String::from).collect();
            let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
            let (content, calls) = read_all(&pieces);
            assert_eq!(content, "", "{whole}");
            assert_eq!(calls.len(), 1);
            assert_eq!(calls[0]["function"]["name"], "get_weather");
            assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        }
        // Text that begins like a fence or a call but is neither stays text.
        for text in [
            "```json\n[1, 2]\n```",
            "```python\nx = 1\n```",
            "``` {\"name\": 1}",
        ] {
            assert_eq!(read_all(&[text]), (text.to_string(), vec![]));
        }
        // A whole call cut short goes out as its text.
        assert_eq!(read_all(&["{\"name\": \"get_w"]).0, "{\"name\": \"get_w");
    }

    proptest::proptest! {
        /// However an answer arrives in pieces, the content and calls read are those of the
        /// whole answer read at once.
        #[test]
        fn any_split_reads_as_the_whole(
            parts in proptest::collection::vec(0usize..9, 0..12),
            cuts in proptest::collection::vec(0usize..400, 0..8),
        ) {
            const PIECES: [&str; 9] = [
                "Sure. ", "\n", "<tool_call>", "</tool_call>", "{\"name\": \"f\", \"arguments\": {}}",
                "```json\n", "\n```", "<tool", "{",
            ];
            let text: String = parts.iter().map(|&i| PIECES[i]).collect();
            let whole = read_all(&[&text]);
            let at_once = CallReader::read_whole(&text, &id);
            proptest::prop_assert_eq!(&(at_once.content, at_once.calls), &whole);
            let mut at: Vec<usize> = cuts
                .into_iter()
                .map(|c| c % (text.len() + 1))
                .filter(|&c| text.is_char_boundary(c))
                .collect();
            at.sort_unstable();
            at.dedup();
            let mut pieces = Vec::new();
            let mut from = 0;
            for c in at.into_iter().chain([text.len()]) {
                pieces.push(&text[from..c]);
                from = c;
            }
            let split = read_all(&pieces);
            proptest::prop_assert_eq!(&split, &whole, "{:?} in {:?}", text, pieces);
        }
    }
}
