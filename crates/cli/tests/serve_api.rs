//! `tandem serve`'s OpenAI API against real processes (a `tandem cloud serve` verifier and the edge
//! daemon), spoken to over HTTP as OpenAI's clients speak to it: at temperature 0 every answer,
//! whole or streamed, chat or completion, is the target's greedy output token for token; a stop
//! sequence ends the text before it; usage, the speculation statistics and the metrics agree
//! exactly; a client that goes away cancels its session on both sides; bad requests are refused
//! naming the field, and client keys are asked for. The model is pulled on first use.

mod common;

use common::serve::*;
use common::*;
use serde_json::{json, Value};

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
    let u = &r["usage"];
    assert_eq!(
        [
            &u["prompt_tokens"],
            &u["completion_tokens"],
            &u["total_tokens"]
        ],
        [
            &json!(prompt_tokens),
            &json!(want.ids.len()),
            &json!(prompt_tokens + want.ids.len())
        ]
    );
    // What the verifier's prefix cache served of the prompt (a prompt asked before: its pages).
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached < prompt_tokens as u64, "{u}");
    tally.add(&r["usage"], want.finish, &r["tandem"]);
}

#[test]
fn the_openai_api_answers_with_the_targets_greedy_output_and_counts_it_exactly() {
    let tok = &target().1;
    // Every block judged (no takeover, no decoding a session alone), so that some drafts are
    // accepted however slow the draft is beside the target.
    let v = judging_verifier(&["--metrics-listen", "127.0.0.1:0"]);
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
    // Every field that would change the answer and is not honoured is refused by name, on both
    // endpoints, never answered as if it had not been sent (`response_format`, `tools` and
    // `tool_choice` are honoured: tests/structured_outputs.rs).
    let refused: Vec<(&str, Value)> = vec![
        ("logit_bias", json!({"42": 10})),
        ("presence_penalty", json!(0.5)),
        ("frequency_penalty", json!(-0.2)),
        ("repetition_penalty", json!(1.1)),
        ("min_p", json!(0.1)),
        ("min_tokens", json!(4)),
        ("echo", json!(true)),
        ("best_of", json!(2)),
        ("suffix", json!("end")),
        ("ignore_eos", json!(true)),
        ("stop_token_ids", json!([2])),
        ("functions", json!([{"name": "f"}])),
        ("function_call", json!("auto")),
        ("guided_json", json!({"type": "object"})),
        ("guided_regex", json!("[0-9]+")),
        ("guided_choice", json!(["a", "b"])),
        ("guided_grammar", json!("root ::= \"a\"")),
        ("grammar", json!("root ::= \"a\"")),
        ("json_schema", json!({"type": "object"})),
        ("reasoning_effort", json!("high")),
        ("audio", json!({"voice": "alloy"})),
        ("modalities", json!(["text", "audio"])),
    ];
    for (field, value) in &refused {
        for (path, mut body) in [
            (
                "/v1/chat/completions",
                json!({"messages": msgs, "max_tokens": 2}),
            ),
            ("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})),
        ] {
            body[*field] = value.clone();
            let (s, r) = post(e.port, path, &body);
            assert_eq!(
                (s, r["error"]["param"].as_str()),
                (400, Some(*field)),
                "{path} {body}: {r}"
            );
            let m = r["error"]["message"].as_str().unwrap();
            assert!(m.contains(field) && m.contains("refused"), "{m}");
        }
    }
    // Their no-op values, and fields that never change the answer, are accepted.
    let (s, r) = post(
        e.port,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 2, "temperature": 0,
                "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
                "logprobs": false, "top_logprobs": null, "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "modalities": ["text"],
                "user": "u-1", "metadata": {"k": "v"}, "store": false,
                "parallel_tool_calls": true, "service_tier": "auto", "top_k": -1}),
    );
    assert_eq!(s, 200, "{r}");
    let (s, r) = post(
        e.port,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 2, "top_k": -5}),
    );
    assert_eq!(
        (s, r["error"]["param"].as_str()),
        (400, Some("top_k")),
        "{r}"
    );
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

/// Draft forwards of more than `tokens` tokens so far (a bucket's bound: 1, 2, 4, … 512), from
/// the edge's metrics.
fn edge_forwards_over(port: u16, tokens: u32) -> f64 {
    let m = metrics(port);
    sample(&m, "tandem:iteration_tokens_total_count")
        - sample(
            &m,
            &format!("tandem:iteration_tokens_total_bucket{{le=\"{tokens}\"}}"),
        )
}

/// A prompt of 24 notes (about 720 tokens), then `ask`.
fn notes(ask: &str) -> String {
    format!(
        "{} {ask}",
        "Note: the verifier checks the draft's guesses in one shared batch, and the edge keeps \
         guessing while a correction travels back over the network. "
            .repeat(24)
    )
}

#[test]
fn a_long_prompt_goes_into_the_draft_a_chunk_a_round_beside_the_answers_streaming() {
    // A prompt of about 700 tokens arrives while three short answers stream. The verifier opens
    // its session (its first token) long before the draft has the prompt (its prefix cache
    // has the prompt, the draft's is off): the draft still takes the prompt a chunk a round (64
    // tokens, all sessions together), never in one forward beside the other sessions' draft
    // steps, and every answer is the target's. (Fixed grants: the verifier never takes a
    // session over, so each session asks for draft steps from its first token.)
    let v = verifier(&["--fixed-grants"]);
    let e = edge(
        &[format!("http://127.0.0.1:{}", v.port)],
        &["--no-prefix-cache"],
    );
    let port = e.port;
    let long = notes("Summarize the notes above in one sentence.");
    let prompts = [
        long.as_str(),
        "Name three colours.",
        "What is the capital of France?",
        "Count from one to ten.",
    ];
    let tok = &target().1;
    assert!(tok.encode_chat(&long).unwrap().len() > 600);
    let wants: Vec<Expect> = prompts.iter().map(|p| expected_chat(p, 32)).collect();
    let (s, r) = post(port, "/v1/chat/completions", &chat(&long, 1));
    assert_eq!(s, 200, "{r}");
    let before = edge_forwards_over(port, 128);
    let texts: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                s.spawn(move || {
                    // The short answers are streaming when the long prompt comes.
                    if i == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(300));
                    }
                    let mut body = chat(p, 32);
                    body["stream"] = json!(true);
                    text_of(&stream(port, "/v1/chat/completions", &body))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (got, want) in texts.iter().zip(&wants) {
        assert_eq!(got, &want.text, "the answer is the target's greedy output");
    }
    // 64 prompt tokens and a few draft steps at most, each feeding a few tokens.
    assert_eq!(edge_forwards_over(port, 128), before, "{}", metrics(port));
}

#[test]
fn the_draft_takes_no_prompt_while_the_verifier_decodes_the_session_itself() {
    // A verifier whose forward cost makes every verified position dear (1 ms for one token,
    // 100 ms a token past it) grants γ 0 from a session's Open: it decodes the session itself,
    // and the draft has no use for the prompt. The draft takes at most the chunk it started
    // before `Opened` came (the prompt is in the verifier's prefix cache, so the session opens
    // within a forward), not the 12 chunks of the prompt (about 740 tokens) while the answer
    // streams; the answer is the target's. (No copies from the prompt: one token a forward.)
    let v = verifier(&["--forward-cost", "1,100", "--self-draft-max", "0"]);
    let e = edge(
        &[format!("http://127.0.0.1:{}", v.port)],
        &["--no-prefix-cache"],
    );
    let port = e.port;
    let long = notes("Repeat the first note above, word for word, five times.");
    let tok = &target().1;
    assert!(tok.encode_chat(&long).unwrap().len() > 700);
    let want = expected_chat(&long, 96);
    // The verifier's prefix cache takes the prompt.
    let (s, r) = post(port, "/v1/chat/completions", &chat(&long, 4));
    assert_eq!(s, 200, "{r}");
    let before = edge_forwards_over(port, 32);
    let (s, r) = post(port, "/v1/chat/completions", &chat(&long, 96));
    assert_eq!(s, 200, "{r}");
    assert_eq!(
        r["choices"][0]["message"]["content"].as_str(),
        Some(want.text.as_str()),
        "the answer is the target's greedy output"
    );
    assert_eq!(r["tandem"]["num_drafts"], 0, "{r}");
    let chunks = edge_forwards_over(port, 32) - before;
    assert!(chunks <= 2.0, "{chunks} prompt chunks: {}", metrics(port));
}

#[test]
fn a_short_soak_through_tandem_serve_checks_every_answer_of_every_kind() {
    // `bench soak --serve`: a real verifier process, a real tandem serve process, two API
    // clients sending conversation turns, JSON-schema answers and answers that copy their
    // prompt; every answer must be the verifier's own greedy one, and the conversations' turns
    // must find their history in the draft's prefix cache.
    draft_path();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "bench",
            "soak",
            "--serve",
            "--sessions",
            "2",
            "--minutes",
            "0.3",
            "--tokens",
            "24",
            "--no-hostile",
            "--json",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let answers = r["answers"].as_u64().unwrap();
    assert!(answers > 0, "{r}");
    assert_eq!(
        (r["wrong"].as_u64(), r["lost"].as_u64()),
        (Some(0), Some(0)),
        "{r}"
    );
    assert_eq!(r["exact"].as_u64(), Some(answers));
    for k in r["kinds"].as_array().unwrap() {
        assert_eq!(k["answers"], k["exact"], "{k}");
    }
    let counter = |name: &str| {
        r["edge_counters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c[0] == name)
            .and_then(|c| c[1].as_f64())
            .unwrap_or_else(|| panic!("{name} in {r}"))
    };
    // Each client's second request is its conversation's next turn.
    if answers >= 4 {
        assert!(counter("tandem:draft_prefix_cache_hits_total") > 0.0, "{r}");
    }
    assert!(r["edge_rss_max_mb"].as_f64().unwrap() > 0.0, "{r}");
}
