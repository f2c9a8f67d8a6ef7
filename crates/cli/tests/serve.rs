//! `tandem serve` against real processes: a `tandem cloud serve` verifier and the edge daemon,
//! spoken to over HTTP as OpenAI's clients speak to it (a plain HTTP client here; the unmodified
//! `openai` Python client and a real headless Chromium for the live view further down). At
//! temperature 0 every answer is the target's greedy output token for token; usage, the
//! speculation statistics and the metrics agree exactly; bad requests are refused naming the
//! field; a client that goes away cancels its session on both sides; with no verifier the answer
//! is a 503, or with `--fallback local` the draft's own, marked unverified; a verifier killed
//! mid-answer ends the answer with an error event, or the draft finishes it marked unverified;
//! nothing of the content reaches the logs, the metrics or the ledger.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tandem_engine::{Engine, EngineConfig, SeqId};

const MODEL: &str = "SmolLM2-135M-Instruct";

/// `tandem serve` against the verifiers on `clouds` (URLs), with `extra` flags.
fn edge(clouds: &[String], extra: &[&str]) -> Proc {
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

fn local(p: &Proc) -> String {
    format!("http://127.0.0.1:{}", p.port)
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(180))
        .build()
}

fn get(port: u16, path: &str) -> (u16, String) {
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
fn post_text(port: u16, path: &str, body: &str) -> (u16, Value) {
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

fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    post_text(port, path, &body.to_string())
}

/// A streamed answer as it is read: the response (to read events from), or the error status and
/// body when the server refused before streaming.
fn open_stream(port: u16, path: &str, body: &Value) -> Result<Events, (u16, Value)> {
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
struct Events {
    lines: std::io::Lines<BufReader<Box<dyn std::io::Read + Send + Sync>>>,
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
fn stream(port: u16, path: &str, body: &Value) -> Vec<(String, Value)> {
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
fn text_of(chunks: &[(String, Value)]) -> String {
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
struct Expect {
    ids: Vec<u32>,
    text: String,
    finish: &'static str,
}

fn greedy_with(m: &std::sync::Arc<tandem_engine::LlamaModel>, prompt: &[u32], n: usize) -> Expect {
    let tok = &target().1;
    let mut e = Engine::new(
        m.clone(),
        EngineConfig {
            threads: 1,
            kv_budget_bytes: 64 << 20,
            ..EngineConfig::default()
        },
    )
    .unwrap();
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

fn expected_chat(prompt: &str, n: usize) -> Expect {
    let (m, tok) = target();
    greedy_with(m, &tok.encode_chat(prompt).unwrap(), n)
}

fn expected_completion(prompt: &str, n: usize) -> Expect {
    let (m, tok) = target();
    greedy_with(m, &tok.encode(prompt).unwrap(), n)
}

fn chat(prompt: &str, max_tokens: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// One series of a Prometheus text exposition ([`metric`]); 0 when absent.
fn sample(text: &str, series: &str) -> f64 {
    metric(text, series).unwrap_or(0.0)
}

fn metrics(port: u16) -> String {
    let (status, text) = get(port, "/metrics");
    assert_eq!(status, 200);
    text
}

/// Poll until `ok` holds (it says what it waits for now and then; a wait that never ends shows
/// as a hung test, not as a clock's verdict).
fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
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

/// What the responses of a run counted, to compare with the metrics.
#[derive(Default, Debug)]
struct Tally {
    requests: u64,
    prompt: u64,
    completion: u64,
    stop: u64,
    length: u64,
    drafts: u64,
    draft_tokens: u64,
    accepted: u64,
    cloud: u64,
}

impl Tally {
    fn add(&mut self, usage: &Value, finish: &str, ext: &Value) {
        self.requests += 1;
        self.prompt += usage["prompt_tokens"].as_u64().unwrap();
        self.completion += usage["completion_tokens"].as_u64().unwrap();
        match finish {
            "stop" => self.stop += 1,
            "length" => self.length += 1,
            f => panic!("finish reason {f}"),
        }
        self.drafts += ext["num_drafts"].as_u64().unwrap();
        self.draft_tokens += ext["num_draft_tokens"].as_u64().unwrap();
        self.accepted += ext["num_accepted_draft_tokens"].as_u64().unwrap();
        self.cloud += ext["cloud_tokens"].as_u64().unwrap();
        // Every committed token is an accepted draft token or the verifier's own.
        assert_eq!(
            ext["num_accepted_draft_tokens"].as_u64().unwrap()
                + ext["cloud_tokens"].as_u64().unwrap(),
            usage["completion_tokens"].as_u64().unwrap(),
            "{ext}"
        );
        assert_eq!(ext["unverified_tokens"], 0);
    }
}

/// A non-streamed answer checked against `want`; the tally gains it.
fn check_whole(r: &Value, want: &Expect, prompt_tokens: usize, tally: &mut Tally) {
    let choice = &r["choices"][0];
    let text = choice["message"]["content"]
        .as_str()
        .or_else(|| choice["text"].as_str())
        .unwrap();
    assert_eq!(text, want.text, "the answer is the target's greedy output");
    assert_eq!(choice["finish_reason"], want.finish);
    assert_eq!(
        r["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": want.ids.len(),
               "total_tokens": prompt_tokens + want.ids.len()})
    );
    tally.add(&r["usage"], want.finish, &r["tandem"]);
}

#[test]
fn the_openai_api_answers_with_the_targets_greedy_output_and_counts_it_exactly() {
    let tok = &target().1;
    // Every block judged (no takeover, no decoding a session alone), so that some drafts are
    // accepted however slow the draft is beside the target.
    let v = verifier(&[
        "--metrics-listen",
        "127.0.0.1:0",
        "--fixed-grants",
        "--await-drafts-ms",
        "5000",
    ]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    let port = e.port;

    let (s, health) = get(port, "/health");
    assert_eq!((s, health.contains("ok")), (200, true));
    let (s, models) = get(port, "/v1/models");
    assert_eq!(s, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
    let (s, page) = get(port, "/");
    assert_eq!((s, page.contains("<form id=\"ask\"")), (200, true));
    let (s, nothing) = get(port, "/v2/nothing");
    assert_eq!(s, 404, "{nothing}");

    let before = metrics(port);
    let mut tally = Tally::default();

    // A chat completion, whole and streamed.
    let q = "Name three colours.";
    let want = expected_chat(q, 24);
    let prompt_tokens = tok.encode_chat(q).unwrap().len();
    let (s, r) = post(port, "/v1/chat/completions", &chat(q, 24));
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["model"], MODEL);
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    check_whole(&r, &want, prompt_tokens, &mut tally);

    let mut body = chat(q, 24);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let chunks = stream(port, "/v1/chat/completions", &body);
    assert_eq!(text_of(&chunks), want.text);
    assert!(chunks.iter().all(|(e, c)| e == "message"
        && c["object"] == "chat.completion.chunk"
        && c["tandem"].get("tentative").is_none()));
    assert_eq!(chunks[0].1["choices"][0]["delta"]["role"], "assistant");
    let last = &chunks[chunks.len() - 1].1;
    assert_eq!(last["choices"], json!([]), "the usage chunk comes last");
    let fin = &chunks[chunks.len() - 2].1;
    assert_eq!(fin["choices"][0]["finish_reason"], want.finish);
    assert_eq!(last["usage"]["completion_tokens"], want.ids.len());
    tally.add(&last["usage"], want.finish, &fin["tandem"]);

    // A completion, whole and streamed; text parts as the prompt.
    let p = "The capital of France is";
    let want = expected_completion(p, 12);
    let prompt_tokens = tok.encode(p).unwrap().len();
    let (s, r) = post(
        port,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    check_whole(&r, &want, prompt_tokens, &mut tally);
    let chunks = stream(
        port,
        "/v1/completions",
        &json!({"prompt": [p], "max_tokens": 12, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    assert_eq!(text_of(&chunks), want.text);
    let n = chunks.len();
    tally.add(
        &chunks[n - 1].1["usage"],
        chunks[n - 2].1["choices"][0]["finish_reason"]
            .as_str()
            .unwrap(),
        &chunks[n - 2].1["tandem"],
    );

    // A stop sequence from the middle of the answer: the text ends before it, and the usage
    // counts the tokens up to the one that completed it, and those committed with it.
    let q = "Explain how a bicycle works.";
    let want = expected_chat(q, 32);
    let words: Vec<&str> = want.text.split_whitespace().collect();
    let stop = format!(" {}", words[words.len() / 2]);
    let at = want.text.find(&stop).unwrap();
    let upto = (1..=want.ids.len())
        .find(|&k| tok.decode(&want.ids[..k]).unwrap().contains(&stop))
        .unwrap();
    let mut body = chat(q, 32);
    body["stop"] = json!([stop, "never-said-zzzz"]);
    let (s, r) = post(port, "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], &want.text[..at]);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let counted = r["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert!(
        counted >= upto && counted <= want.ids.len(),
        "{counted} vs {upto}"
    );
    tally.add(&r["usage"], "stop", &r["tandem"]);

    // Three requests at once, each its own session: each is the target's.
    let qs = [
        "What is the capital of Italy?",
        "Write a haiku about the sea.",
        "List two prime numbers.",
    ];
    let wants: Vec<Expect> = qs.iter().map(|q| expected_chat(q, 20)).collect();
    let answers: Vec<Value> = std::thread::scope(|s| {
        let hs: Vec<_> = qs
            .iter()
            .map(|q| s.spawn(move || post(port, "/v1/chat/completions", &chat(q, 20))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().1).collect()
    });
    for ((q, want), r) in qs.iter().zip(&wants).zip(&answers) {
        check_whole(r, want, tok.encode_chat(q).unwrap().len(), &mut tally);
    }

    // The metrics moved by exactly what the answers said.
    let after = metrics(port);
    let delta = |series: &str| (sample(&after, series) - sample(&before, series)) as u64;
    assert_eq!(
        delta("tandem:e2e_request_latency_seconds_count"),
        tally.requests
    );
    assert_eq!(delta("tandem:prompt_tokens_total"), tally.prompt);
    assert_eq!(delta("tandem:generation_tokens_total"), tally.completion);
    assert_eq!(
        delta("tandem:request_success_total{finished_reason=\"stop\"}"),
        tally.stop
    );
    assert_eq!(
        delta("tandem:request_success_total{finished_reason=\"length\"}"),
        tally.length
    );
    assert_eq!(delta("tandem:spec_decode_num_drafts_total"), tally.drafts);
    assert_eq!(
        delta("tandem:spec_decode_num_draft_tokens_total"),
        tally.draft_tokens
    );
    assert_eq!(
        delta("tandem:spec_decode_num_accepted_tokens_total"),
        tally.accepted
    );
    assert_eq!(delta("tandem:cloud_tokens_total"), tally.cloud);
    assert!(
        tally.accepted > 0,
        "the draft was accepted somewhere: {tally:?}"
    );
    let per_pos: f64 = after
        .lines()
        .filter(|l| l.starts_with("tandem:spec_decode_num_accepted_tokens_per_pos_total{"))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
    assert_eq!(
        per_pos as u64, tally.accepted,
        "accepted by position sums up"
    );
    assert_eq!(sample(&after, "tandem:num_requests_running"), 0.0);

    // A client that goes away cancels its session, here and on the verifier.
    let vm = v.also_port.expect("the verifier's metrics port");
    let aborted = sample(
        &after,
        "tandem:request_success_total{finished_reason=\"abort\"}",
    );
    let mut body = chat("Write a long story about a dragon who learns to fly.", 400);
    body["stream"] = json!(true);
    let mut events = open_stream(port, "/v1/chat/completions", &body).unwrap();
    let mut content = 0;
    for (_, d) in events.by_ref() {
        content += d.contains("\"content\"") as usize;
        if content >= 4 {
            break;
        }
    }
    assert_eq!(sample(&metrics(vm), "tandem:num_requests_running"), 1.0);
    drop(events);
    // In order: the edge ends the session, then the verifier frees it.
    wait_until("the edge ends the session", || {
        let m = metrics(port);
        sample(
            &m,
            "tandem:request_success_total{finished_reason=\"abort\"}",
        ) == aborted + 1.0
            && sample(&m, "tandem:num_requests_running") == 0.0
    });
    wait_until("the verifier frees the session", || {
        sample(&metrics(vm), "tandem:num_requests_running") == 0.0
    });
    assert_eq!(
        sample(&metrics(port), "tandem:kv_cache_usage_perc"),
        0.0,
        "the draft's KV cache is free again"
    );
}

#[test]
fn bad_requests_are_refused_naming_the_field() {
    let v = verifier(&[]);
    let e = edge(
        &[format!("http://127.0.0.1:{}", v.port)],
        &["--kv-mb", "16"],
    );
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (
            "/v1/chat/completions",
            "{\"messages\": [".into(),
            400,
            "body",
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL}).to_string(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "temperature": 3}).to_string(),
            400,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "temperature": "warm"}).to_string(),
            400,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "top_p": 0}).to_string(),
            400,
            "top_p",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 0}).to_string(),
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": -3}).to_string(),
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 100000}).to_string(),
            400,
            "max_tokens",
        ),
        // More than the draft's KV cache (16 MiB) holds.
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 4000}).to_string(),
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_completion_tokens": 0}).to_string(),
            400,
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "n": 2}).to_string(),
            400,
            "n",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "stop": ["a", "b", "c", "d", "e"]}).to_string(),
            400,
            "stop",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "stream_options": {"include_usage": true}}).to_string(),
            400,
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "model": "gpt-9"}).to_string(),
            404,
            "model",
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 4}).to_string(),
            400,
            "prompt",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 99999999]}).to_string(),
            400,
            "prompt",
        ),
    ];
    for (path, body, status, param) in cases {
        let (s, r) = post_text(e.port, path, &body);
        assert_eq!(
            (s, r["error"]["param"].as_str()),
            (status, Some(param)),
            "{body}: {r}"
        );
        let m = r["error"]["message"].as_str().unwrap();
        assert!(!m.is_empty() && r["error"]["type"].is_string(), "{r}");
    }
    // The KV refusal says what to do.
    let (_, r) = post(
        e.port,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 4000}),
    );
    assert!(
        r["error"]["message"].as_str().unwrap().contains("--kv-mb"),
        "{r}"
    );
    // And the server still answers.
    let (s, r) = post(
        e.port,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(s, 200, "{r}");
    // Client keys: without one a server that asks gets 401.
    let k = edge(
        &[format!("http://127.0.0.1:{}", v.port)],
        &["--client-key", "local-secret"],
    );
    let (s, r) = post(
        k.port,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 2}),
    );
    assert_eq!(s, 401, "{r}");
    let r = agent()
        .post(&format!("http://127.0.0.1:{}/v1/chat/completions", k.port))
        .set("authorization", "Bearer local-secret")
        .send_json(json!({"messages": msgs, "max_tokens": 2}))
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// A loopback port nobody listens on (for a moment).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn with_no_verifier_the_answer_is_a_503_or_the_drafts_own_marked_unverified() {
    let tok = &target().1;
    let port = free_port();
    let cloud = format!("http://127.0.0.1:{port}");
    let q = "Name three colours.";

    let strict = edge(
        std::slice::from_ref(&cloud),
        &["--connect-timeout-ms", "1000"],
    );
    let (s, r) = post(strict.port, "/v1/chat/completions", &chat(q, 8));
    assert_eq!(s, 503, "{r}");
    let m = r["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("no verifier is reachable") && m.contains("--fallback local"),
        "{m}"
    );
    let mut body = chat(q, 8);
    body["stream"] = json!(true);
    let refused = open_stream(strict.port, "/v1/chat/completions", &body).err();
    assert_eq!(
        refused.map(|r| r.0),
        Some(503),
        "a stream is refused before it starts"
    );

    let loose = edge(
        std::slice::from_ref(&cloud),
        &["--fallback", "local", "--connect-timeout-ms", "1000"],
    );
    let (dm, _) = draft();
    let drafts = greedy_with(dm, &tok.encode_chat(q).unwrap(), 16);
    let (s, r) = post(loose.port, "/v1/chat/completions", &chat(q, 16));
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], drafts.text.as_str());
    assert_eq!(r["tandem"]["unverified_tokens"], drafts.ids.len());
    assert_eq!(r["tandem"]["unverified_from"], 0);
    assert_eq!(r["usage"]["completion_tokens"], drafts.ids.len());
    let chunks = stream(loose.port, "/v1/chat/completions", &{
        let mut b = chat(q, 16);
        b["stream"] = json!(true);
        b
    });
    assert_eq!(text_of(&chunks), drafts.text);
    assert!(chunks
        .iter()
        .filter(|(_, c)| c["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty()))
        .all(|(_, c)| c["tandem"]["unverified"] == true));
    assert_eq!(
        sample(&metrics(loose.port), "tandem:unverified_tokens_total") as usize,
        2 * drafts.ids.len()
    );

    // A later request tries the cloud again: with a verifier there, the answer is verified.
    let _v = verifier(&["--listen", &format!("127.0.0.1:{port}")]);
    let want = expected_chat(q, 16);
    let (s, r) = post(loose.port, "/v1/chat/completions", &chat(q, 16));
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], want.text.as_str());
    assert_eq!(r["tandem"]["unverified_tokens"], 0);
    assert!(r["tandem"].get("unverified_from").is_none());
}

#[test]
fn a_verifier_killed_mid_answer_is_an_error_event_or_the_draft_finishes_marked_unverified() {
    let mut v = verifier(&[]);
    let cloud = format!("http://127.0.0.1:{}", v.port);
    // A short reconnect window: the verifier does not come back.
    let strict = edge(
        std::slice::from_ref(&cloud),
        &["--reconnect-window-ms", "2000"],
    );
    let loose = edge(
        std::slice::from_ref(&cloud),
        &["--fallback", "local", "--reconnect-window-ms", "2000"],
    );
    let q = "Write a long story about a dragon who learns to fly.";
    let mut body = chat(q, 300);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let mut a = open_stream(strict.port, "/v1/chat/completions", &body).unwrap();
    let mut b = open_stream(loose.port, "/v1/chat/completions", &body).unwrap();
    // Both answers are under way...
    let mut seen_a: Vec<(String, Value)> = Vec::new();
    let mut seen_b: Vec<(String, Value)> = Vec::new();
    for (events, seen) in [(&mut a, &mut seen_a), (&mut b, &mut seen_b)] {
        while text_of(seen).split_whitespace().count() < 4 {
            let (e, d) = events.next().expect("the answer goes on");
            seen.push((e, serde_json::from_str(&d).unwrap()));
        }
    }
    // ...when the verifier dies.
    v.kill();
    for (events, seen) in [(a, &mut seen_a), (b, &mut seen_b)] {
        let mut done = false;
        for (e, d) in events {
            if d == "[DONE]" {
                done = true;
                continue;
            }
            seen.push((e, serde_json::from_str(&d).unwrap()));
        }
        assert!(done, "the stream ends with [DONE]");
    }
    let want = expected_chat(q, 48);
    let agrees =
        |verified: &str| verified.starts_with(&want.text) || want.text.starts_with(verified);

    // Without fallback: the committed text, then an error event naming the cause.
    let (event, err) = seen_a.last().unwrap();
    assert_eq!(event, "error", "{seen_a:?}");
    assert_eq!(err["error"]["type"], "service_unavailable");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("verifier"),
        "{err}"
    );
    assert!(
        agrees(&text_of(&seen_a)),
        "what came before the error is the target's"
    );

    // With fallback: the answer completes; the draft's part is marked, in the chunks and counts.
    let n = seen_b.len();
    let (usage, fin) = (&seen_b[n - 1].1["usage"], &seen_b[n - 2].1);
    assert!(fin["choices"][0]["finish_reason"].is_string(), "{fin}");
    let unverified = fin["tandem"]["unverified_tokens"].as_u64().unwrap();
    assert!(unverified > 0, "{fin}");
    let verified: String = seen_b
        .iter()
        .filter(|(_, c)| c["tandem"]["unverified"] != true)
        .map(|c| text_of(std::slice::from_ref(c)))
        .collect();
    assert!(
        agrees(&verified),
        "the verified part is the target's: {verified:?}"
    );
    let marked = seen_b
        .iter()
        .position(|(_, c)| c["tandem"]["unverified"] == true)
        .expect("unverified chunks are marked");
    assert!(
        seen_b[marked..]
            .iter()
            .filter(|(_, c)| c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty()))
            .all(|(_, c)| c["tandem"]["unverified"] == true),
        "once unverified, every later token is"
    );
    assert!(usage["completion_tokens"].as_u64().unwrap() > unverified);
    assert_eq!(
        sample(&metrics(loose.port), "tandem:unverified_tokens_total") as u64,
        unverified
    );
    assert_eq!(
        sample(
            &metrics(strict.port),
            "tandem:request_success_total{finished_reason=\"error\"}"
        ),
        1.0
    );
}

#[test]
fn a_verifier_restarted_ten_seconds_later_resumes_the_answer_token_for_token() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut v = verifier(&["--listen", &listen]);
    // The default reconnect window (30 s).
    let e = edge(&[format!("http://{listen}")], &[]);
    let q = "Write a long story about a dragon who learns to fly.";
    let want = expected_chat(q, 96);
    let mut body = chat(q, 96);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let mut events = open_stream(e.port, "/v1/chat/completions", &body).unwrap();
    let mut seen: Vec<(String, Value)> = Vec::new();
    while text_of(&seen).split_whitespace().count() < 4 {
        let (ev, d) = events.next().expect("the answer goes on");
        seen.push((ev, serde_json::from_str(&d).unwrap()));
    }
    v.kill();
    std::thread::sleep(Duration::from_secs(10));
    let _back = verifier(&["--listen", &listen]);
    for (ev, d) in events {
        if d == "[DONE]" {
            break;
        }
        seen.push((ev, serde_json::from_str(&d).unwrap()));
    }
    assert!(
        seen.iter().all(|(ev, _)| ev == "message"),
        "no error: {seen:?}"
    );
    assert_eq!(text_of(&seen), want.text, "no token lost or doubled");
    let n = seen.len();
    let fin = &seen[n - 2].1;
    assert_eq!(fin["choices"][0]["finish_reason"], want.finish);
    assert!(fin["tandem"]["reconnects"].as_u64().unwrap() >= 1, "{fin}");
    assert_eq!(fin["tandem"]["unverified_tokens"], 0);
    assert_eq!(seen[n - 1].1["usage"]["completion_tokens"], want.ids.len());
}

#[test]
fn nothing_of_the_content_reaches_logs_metrics_or_the_ledger() {
    let dir = scratch("privacy");
    let ledger = dir.join("ledger.sqlite");
    let mut v = verifier(&[
        "--ledger",
        ledger.to_str().unwrap(),
        "--metrics-listen",
        "127.0.0.1:0",
        "--log",
        "debug",
    ]);
    let e = edge(
        &[format!("http://127.0.0.1:{}", v.port)],
        &["--log", "debug"],
    );
    let q = "Tell me about the zephyrine quokkas of Kalbarri.";
    let (s, r) = post(e.port, "/v1/chat/completions", &chat(q, 24));
    assert_eq!(s, 200, "{r}");
    let answer = r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let edge_metrics = metrics(e.port);
    let cloud_metrics = metrics(v.also_port.unwrap());
    assert!(v.terminate().success());
    let mut secrets: Vec<String> = ["zephyrine", "quokkas", "Kalbarri"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    // The answer's longest words (not ones the logs might say anyway).
    let mut words: Vec<&str> = answer
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.len() >= 7)
        .collect();
    words.sort_by_key(|w| std::cmp::Reverse(w.len()));
    secrets.extend(words.iter().take(3).map(|w| w.to_string()));
    assert!(secrets.len() >= 4, "an answer with long words: {answer}");
    let ledger_bytes = String::from_utf8_lossy(&std::fs::read(&ledger).unwrap()).to_string();
    assert!(!ledger_bytes.is_empty());
    for (what, text) in [
        ("the verifier's log", v.log()),
        ("the edge's log", e.log()),
        ("the edge's metrics", edge_metrics),
        ("the verifier's metrics", cloud_metrics),
        ("the ledger", ledger_bytes),
    ] {
        assert!(text.len() > 100, "{what} has something in it");
        for s in &secrets {
            assert!(!text.contains(s.as_str()), "{what} holds `{s}`");
        }
    }
}

/// The paths `scripts/test-deps` set up (the openai client's Python, playwright-core).
fn test_deps() -> (String, String) {
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

/// The openai client's run against the edge at `base`, checked against the target.
fn openai_client(python: &str, port: u16) {
    let tok = &target().1;
    let (q, p, n) = ("Name three colours.", "The capital of France is", 16);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/clients/openai_client.py"
    );
    let stdout = stdout_of(
        "the openai client",
        std::process::Command::new(python)
            .args([script, &format!("http://127.0.0.1:{port}/v1"), MODEL, q, p])
            .arg(n.to_string()),
    );
    let r: Value = serde_json::from_slice(&stdout).unwrap();
    let chat = expected_chat(q, n);
    let completion = expected_completion(p, n);
    let usage = |prompt: usize, e: &Expect| {
        (
            prompt as u64,
            e.ids.len() as u64,
            (prompt + e.ids.len()) as u64,
        )
    };
    let got = |v: &Value| {
        (
            v["prompt_tokens"].as_u64().unwrap(),
            v["completion_tokens"].as_u64().unwrap(),
            v["total_tokens"].as_u64().unwrap(),
        )
    };
    let chat_prompt = tok.encode_chat(q).unwrap().len();
    assert_eq!(r["chat"]["text"], chat.text.as_str(), "{r}");
    assert_eq!(r["chat"]["finish_reason"], chat.finish);
    assert_eq!(got(&r["chat"]["usage"]), usage(chat_prompt, &chat));
    assert_eq!(r["stream"]["text"], chat.text.as_str());
    assert_eq!(r["stream"]["finish_reason"], chat.finish);
    assert_eq!(got(&r["stream"]["usage"]), usage(chat_prompt, &chat));
    assert_eq!(r["completion"]["text"], completion.text.as_str());
    assert_eq!(
        got(&r["completion"]["usage"]),
        usage(tok.encode(p).unwrap().len(), &completion)
    );
    assert_eq!(r["bad"]["status"], 400, "{r}");
    assert_eq!(r["bad"]["param"], "temperature");
    assert_eq!(r["unknown_model"]["status"], 404);
    assert_eq!(r["models"], json!([MODEL]));
}

#[test]
fn the_unmodified_openai_client_gets_the_targets_answers_in_plaintext_and_over_tls() {
    let (python, _) = test_deps();
    let v = verifier(&[]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    openai_client(&python, e.port);

    // The same with TLS on the link (the edge trusts the test's CA).
    let dir = scratch("serve-tls");
    let (ca, cert, key) = certificates(&dir, "serve");
    let tv = verifier(&[
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    let te = edge(
        &[format!("https://localhost:{}", tv.port)],
        &["--tls-ca", ca.to_str().unwrap()],
    );
    openai_client(&python, te.port);
    // An edge that does not trust the verifier's CA gets no verifier: a 503.
    let untrusting = edge(&[format!("https://localhost:{}", tv.port)], &[]);
    let (s, r) = post(untrusting.port, "/v1/chat/completions", &chat("Hi", 4));
    assert_eq!(s, 503, "{r}");
}

#[test]
fn the_live_view_in_a_real_browser_shows_the_targets_answer() {
    let (_, node_path) = test_deps();
    // Every block judged, so that tentative drafts show however slow the draft.
    let v = verifier(&["--fixed-grants", "--await-drafts-ms", "5000"]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    let q = "Explain how a bicycle works in three sentences.";
    let want = expected_chat(q, 48);
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("live-view.png");
    let _ = std::fs::remove_file(&shot);
    let profile = scratch("chromium-profile");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/live_view.cjs");
    let stdout = stdout_of(
        "the browser",
        std::process::Command::new("node")
            .env("NODE_PATH", &node_path)
            .args([script, &format!("{}/", local(&e)), q, "48"])
            .arg(&shot)
            .arg(&profile),
    );
    let r: Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(r["done"], "1", "{r}");
    assert_eq!(r["page_errors"], json!([]));
    assert_eq!(
        r["text"],
        want.text.as_str(),
        "the page shows the target's answer: {r}"
    );
    assert_eq!(
        r["saw_tentative"], true,
        "the view was given tentative draft tokens: {r}"
    );
    assert_eq!(r["unverified"], 0);
    assert!(r["status"].as_str().unwrap().starts_with("done"), "{r}");
    assert!(
        r["alpha"].as_str().unwrap().parse::<f64>().is_ok(),
        "α shown: {r}"
    );
    assert!(
        r["itl"].as_str().unwrap().parse::<f64>().is_ok(),
        "ITL shown: {r}"
    );
    // Each correction shown is the target's token after a struck-through draft token.
    assert!(
        r["rejected"].as_array().unwrap().len() >= r["fixes"].as_array().unwrap().len(),
        "{r}"
    );
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a screenshot"
    );
    eprintln!("screenshot: {}", shot.display());
}

/// Debian's nginx, or None (with why) where it is not installed (`.ci/run` installs it).
fn nginx() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// `deploy/nginx/tandem.conf` as shipped, with its replica addresses replaced by `replicas` and
/// its listener by `listen`, inside a minimal main configuration of its own in `dir`.
fn nginx_config(dir: &Path, listen: &str, replicas: &[String]) -> PathBuf {
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nginx/tandem.conf"),
    )
    .unwrap();
    let mut servers = replicas.iter();
    let site: String = shipped
        .lines()
        .map(|l| {
            let t = l.trim_start();
            if t.starts_with("server 10.0.0.") {
                let (_, rest) = t.split_once(' ').unwrap();
                let (_, options) = rest.split_once(' ').unwrap();
                let addr = servers.next().expect("as many replicas as the file lists");
                format!("    server {addr} {options}\n")
            } else if t.starts_with("listen 50051 http2;") {
                format!("    listen {listen} http2;\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    assert!(servers.next().is_none(), "the file lists every replica");
    std::fs::write(dir.join("tandem.conf"), site).unwrap();
    let d = dir.display();
    let main = format!(
        "worker_processes 1;\nerror_log {d}/error.log info;\npid {d}/nginx.pid;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
         include {d}/tandem.conf;\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, main).unwrap();
    path
}

/// nginx in the foreground, stopped when dropped (SIGTERM: the master takes its workers with it,
/// where SIGKILL would leave them running).
struct Nginx(std::process::Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

#[test]
fn twelve_sessions_through_nginx_survive_the_loss_of_one_of_three_replicas() {
    let Some(bin) = nginx() else {
        eprintln!(
            "SKIPPED: nginx is not installed (/usr/sbin/nginx); `.ci/run` installs Debian's \
             package. This test puts three verifier replicas behind deploy/nginx/tandem.conf."
        );
        return;
    };
    let dir = scratch("nginx");
    let mut replicas: Vec<Proc> = (0..3)
        .map(|_| verifier(&["--metrics-listen", "127.0.0.1:0"]))
        .collect();
    let addrs: Vec<String> = replicas
        .iter()
        .map(|r| format!("127.0.0.1:{}", r.port))
        .collect();
    let port = free_port();
    let conf = nginx_config(&dir, &format!("127.0.0.1:{port}"), &addrs);
    let check = std::process::Command::new(&bin)
        .args(["-t", "-p"])
        .arg(&dir)
        .arg("-c")
        .arg(&conf)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "nginx -t: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    let _nginx = Nginx(
        std::process::Command::new(&bin)
            .args(["-g", "daemon off;", "-p"])
            .arg(&dir)
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("nginx listens", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let balancer = format!("http://127.0.0.1:{port}");
    // Twelve sessions: three edges, four answers each, at once.
    // Twelve prefills at once on a shared machine (CI runs the other serve tests beside this
    // one): the first answer of a session may take longer than the default 3 s to open.
    let edges: Vec<Proc> = (0..3)
        .map(|_| {
            edge(
                std::slice::from_ref(&balancer),
                &["--connect-timeout-ms", "120000"],
            )
        })
        .collect();
    let prompts: Vec<String> = (0..12)
        .map(|i| format!("Tell me fact number {i} about the sea, in a few sentences."))
        .collect();
    let n = 64;
    let wants: Vec<Expect> = prompts.iter().map(|p| expected_chat(p, n)).collect();
    // Each answer's first chunk is in before the kill: every session is open on some replica.
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    let readers: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let port = edges[i % 3].port;
            let mut body = chat(p, n);
            body["stream"] = json!(true);
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut events = open_stream(port, "/v1/chat/completions", &body).unwrap();
                let mut seen: Vec<(String, Value)> = Vec::new();
                let mut told = false;
                for (ev, d) in events.by_ref() {
                    if d == "[DONE]" {
                        break;
                    }
                    seen.push((ev, serde_json::from_str(&d).unwrap()));
                    if !told && !text_of(&seen).is_empty() {
                        told = true;
                        tx.send(i).unwrap();
                    }
                }
                seen
            })
        })
        .collect();
    drop(tx);
    for _ in 0..prompts.len() {
        rx.recv().expect("every answer starts");
    }
    // The replica holding the most sessions dies.
    let running = |r: &Proc| {
        let (status, text) = get(r.also_port.unwrap(), "/metrics");
        assert_eq!(status, 200);
        sample(&text, "tandem:num_requests_running")
    };
    let loads: Vec<f64> = replicas.iter().map(running).collect();
    let (victim, &lost) = loads
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap();
    eprintln!("sessions per replica before the kill: {loads:?}; killing replica {victim}");
    assert!(lost >= 1.0, "the replicas hold the sessions: {loads:?}");
    replicas[victim].kill();
    let mut reconnects = 0;
    for ((i, r), want) in readers.into_iter().enumerate().zip(&wants) {
        let seen = r.join().unwrap();
        assert!(
            seen.iter().all(|(ev, _)| ev == "message"),
            "answer {i}: no error event: {seen:?}"
        );
        assert_eq!(
            text_of(&seen),
            want.text,
            "answer {i}: the target's, token for token"
        );
        let fin = &seen.last().unwrap().1;
        assert_eq!(
            fin["choices"][0]["finish_reason"], want.finish,
            "answer {i}"
        );
        assert_eq!(fin["tandem"]["unverified_tokens"], 0, "answer {i}");
        reconnects += fin["tandem"]["reconnects"].as_u64().unwrap();
    }
    eprintln!("{reconnects} sessions reopened on the other replicas");
    // (A session of the victim's may have ended between the count and the kill.)
    assert!(
        reconnects >= 1,
        "the killed replica's sessions were reopened on the others"
    );
}
