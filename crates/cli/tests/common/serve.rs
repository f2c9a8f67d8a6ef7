//! `tandem serve` for the tests: the edge daemon started against verifiers, and spoken to over
//! HTTP as OpenAI's clients speak to it (a plain HTTP client); the target's greedy answers to
//! compare with.

use std::io::{BufRead, BufReader};
use std::time::Duration;

use serde_json::{json, Value};
use tandem_engine::SeqId;

use super::*;

/// The model's name in the API (`/v1/models`, a request's `model`).
pub const MODEL: &str = "SmolLM2-135M-Instruct";

/// `tandem serve` against the verifiers on `clouds` (URLs), with `extra` flags.
pub fn edge(clouds: &[String], extra: &[&str]) -> Proc {
    let mut args: Vec<String> = ["serve", "--listen", "127.0.0.1:0", "--threads", "1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if !extra.contains(&"--kv-mb") {
        args.extend(["--kv-mb".into(), "64".into()]);
    }
    for c in clouds {
        args.extend(["--cloud".into(), c.clone()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    draft_path();
    spawn_tandem(&args, "tandem serve listening on ", None)
        .unwrap_or_else(|e| panic!("tandem serve did not start: {e}"))
}

/// The base URL of the edge process `p`.
pub fn local(p: &Proc) -> String {
    format!("http://127.0.0.1:{}", p.port)
}

/// An HTTP client that waits up to three minutes for an answer.
pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(180))
        .build()
}

/// GET `path` on the loopback port `port`: the status and the body.
pub fn get(port: u16, path: &str) -> (u16, String) {
    match agent()
        .get(&format!("http://127.0.0.1:{port}{path}"))
        .call()
    {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
        Err(e) => panic!("GET {path}: {e}"),
    }
}

/// POST a body (JSON text, sent as is): the status and the JSON answer.
pub fn post_text(port: u16, path: &str, body: &str) -> (u16, Value) {
    let r = agent()
        .post(&format!("http://127.0.0.1:{port}{path}"))
        .set("content-type", "application/json")
        .send_string(body);
    match r {
        Ok(r) => (r.status(), r.into_json().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap()),
        Err(e) => panic!("POST {path}: {e}"),
    }
}

/// [`post_text`] of a JSON value.
pub fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    post_text(port, path, &body.to_string())
}

/// A streamed answer as it is read: the response (to read events from), or the error status and
/// body when the server refused before streaming.
pub fn open_stream(port: u16, path: &str, body: &Value) -> Result<Events, (u16, Value)> {
    let r = agent()
        .post(&format!("http://127.0.0.1:{port}{path}"))
        .set("content-type", "application/json")
        .send_string(&body.to_string());
    match r {
        Ok(r) => {
            assert_eq!(
                r.header("content-type"),
                Some("text/event-stream"),
                "a stream is SSE"
            );
            Ok(Events {
                lines: BufReader::new(r.into_reader()).lines(),
            })
        }
        Err(ureq::Error::Status(code, r)) => Err((code, r.into_json().unwrap())),
        Err(e) => panic!("POST {path}: {e}"),
    }
}

/// Server-sent events: (event name, data).
pub struct Events {
    pub lines: std::io::Lines<BufReader<Box<dyn std::io::Read + Send + Sync>>>,
}

impl Iterator for Events {
    type Item = (String, String);
    fn next(&mut self) -> Option<(String, String)> {
        let (mut event, mut data) = ("message".to_string(), None::<String>);
        for line in self.lines.by_ref() {
            let line = line.ok()?;
            if line.is_empty() {
                if let Some(d) = data.take() {
                    return Some((event, d));
                }
                continue;
            }
            if let Some(e) = line.strip_prefix("event:") {
                event = e.trim().to_string();
            } else if let Some(d) = line.strip_prefix("data:") {
                data = Some(d.trim_start().to_string());
            }
        }
        None
    }
}

/// A whole stream: its events up to `[DONE]`, which must end it.
pub fn stream(port: u16, path: &str, body: &Value) -> Vec<(String, Value)> {
    let events = open_stream(port, path, body).unwrap_or_else(|e| panic!("refused: {e:?}"));
    let mut out = Vec::new();
    let mut done = false;
    for (event, data) in events {
        assert!(!done, "nothing after [DONE]");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push((event, serde_json::from_str(&data).unwrap()));
    }
    assert!(done, "the stream ends with data: [DONE]");
    out
}

/// The text of a stream's chunks (chat deltas or completion text).
pub fn text_of(chunks: &[(String, Value)]) -> String {
    chunks
        .iter()
        .filter(|(e, _)| e == "message")
        .filter_map(|(_, c)| {
            let ch = c["choices"].get(0)?;
            ch["delta"]["content"]
                .as_str()
                .or_else(|| ch["text"].as_str())
                .map(str::to_string)
        })
        .collect()
}

/// The answer the target gives greedily: its tokens (up to and with the end of generation),
/// text and finish reason.
pub struct Expect {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: &'static str,
}

/// The answer `m` gives greedily to `prompt` (at most `n` tokens) on an engine of its own.
pub fn greedy_with(
    m: &std::sync::Arc<tandem_engine::LlamaModel>,
    prompt: &[u32],
    n: usize,
) -> Expect {
    let tok = &target().1;
    let mut e = tandem_testkit::model::lone_engine(m, 64);
    let mut ids = greedy(&mut e, SeqId(0), prompt, n);
    if let Some(i) = ids.iter().position(|&t| tok.is_eog(t)) {
        ids.truncate(i + 1);
    }
    let finish = if ids.last().is_some_and(|&t| tok.is_eog(t)) {
        "stop"
    } else {
        "length"
    };
    let words: Vec<u32> = ids.iter().copied().filter(|&t| !tok.is_eog(t)).collect();
    Expect {
        text: tok.decode(&words).unwrap(),
        ids,
        finish,
    }
}

/// The target's greedy answer to `prompt` as a user's chat message.
pub fn expected_chat(prompt: &str, n: usize) -> Expect {
    let (m, tok) = target();
    greedy_with(m, &tok.encode_chat(prompt).unwrap(), n)
}

/// The target's greedy continuation of the text `prompt`.
pub fn expected_completion(prompt: &str, n: usize) -> Expect {
    let (m, tok) = target();
    greedy_with(m, &tok.encode(prompt).unwrap(), n)
}

/// A chat completion request for `prompt` at temperature 0.
pub fn chat(prompt: &str, max_tokens: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// One series of a Prometheus text exposition ([`metric`]); 0 when absent.
pub fn sample(text: &str, series: &str) -> f64 {
    metric(text, series).unwrap_or(0.0)
}

/// The Prometheus text at `/metrics` on the loopback port `port`.
pub fn metrics(port: u16) -> String {
    let (status, text) = get(port, "/metrics");
    assert_eq!(status, 200);
    text
}

/// Poll until `ok` holds (it says what it waits for now and then; a wait that never ends shows
/// as a hung test, not as a clock's verdict).
pub fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    for polls in 1u64.. {
        if ok() {
            return;
        }
        if polls % 200 == 0 {
            eprintln!("still waiting: {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A loopback port nobody listens on (for a moment).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The paths `scripts/test-deps` set up (the openai client's Python, playwright-core).
pub fn test_deps() -> (String, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/test-deps");
    let stdout = stdout_of(
        "scripts/test-deps",
        std::process::Command::new("bash").arg(script),
    );
    let text = String::from_utf8(stdout).unwrap();
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap()
            .to_string()
    };
    (get("OPENAI_PYTHON="), get("NODE_PATH="))
}
