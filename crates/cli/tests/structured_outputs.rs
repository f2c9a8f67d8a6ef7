//! Structured outputs through `tandem serve` with a real `tandem cloud serve` verifier behind it:
//! a `json_schema` answer (a nested object, an enum, an array, required keys) is the target's own
//! output under the schema's mask — token for token what the target alone decodes in-process with
//! the same mask, and what a cloud-only generation with the same schema returns — whole and
//! streamed, greedy and sampled; `json_object` answers with a JSON object; a schema llguidance
//! refuses is a 400 naming `response_format`, and an Open whose grammar the verifier refuses is
//! INVALID_ARGUMENT naming `open.grammar`. The model is pulled on first use.

mod common;

use common::serve::*;
use common::*;
use serde_json::{json, Value};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::GrammarSource;

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "job": {"type": "string", "enum": ["mathematician", "poet", "engineer"]},
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": false
            },
            "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
        },
        "required": ["name", "age", "job", "city", "hobbies"],
        "additionalProperties": false
    })
}

const QUESTION: &str = "Extract the person as JSON: Ada Lovelace, 36 years old, a mathematician \
                        from London who likes chess and poetry.";

fn request(format: Value, max_tokens: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": format,
    })
}

fn json_schema_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema()}})
}

/// The text of `ids` without end-of-generation tokens.
fn text(ids: &[u32]) -> String {
    let tok = &target().1;
    let words: Vec<u32> = ids.iter().copied().filter(|&t| !tok.is_eog(t)).collect();
    tok.decode(&words).unwrap()
}

/// The answer's fields a schema requires, checked by hand (the Python client's test validates
/// with `jsonschema` too).
fn check_person(v: &Value) {
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    assert_eq!(keys, ["name", "age", "job", "city", "hobbies"], "{v}");
    assert!(o["name"].is_string() && o["age"].is_i64(), "{v}");
    assert!(
        ["mathematician", "poet", "engineer"].contains(&o["job"].as_str().unwrap()),
        "{v}"
    );
    assert!(o["city"]["name"].is_string(), "{v}");
    let hobbies = o["hobbies"].as_array().unwrap();
    assert!(
        hobbies.len() <= 3 && hobbies.iter().all(Value::is_string),
        "{v}"
    );
}

#[test]
fn a_json_schema_answer_is_the_targets_own_under_the_schema_whole_streamed_and_cloud_only() {
    let tok = &target().1;
    // Every block judged, so that some drafts are accepted however slow the draft is beside the
    // target (with the edge slowed, the default verifier decoded all but one token itself).
    let v = judging_verifier(&[]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    let prompt = tok.encode_chat(QUESTION).unwrap();
    let source = GrammarSource::JsonSchema(schema().to_string());
    let n = 96;

    // The target alone, in-process, under the schema's mask.
    let greedy = SamplingParams::default();
    let want = testkit_constrained(&prompt, n, &source, &greedy);
    assert!(
        want.last().is_some_and(|&t| tok.is_eog(t)),
        "the schema's answer ends within {n} tokens"
    );
    let want_text = text(&want);
    check_person(&serde_json::from_str(&want_text).unwrap());

    // Through the edge, speculating: whole and streamed.
    let (s, r) = post(
        e.port,
        "/v1/chat/completions",
        &request(json_schema_format(), n),
    );
    assert_eq!(s, 200, "{r}");
    assert_eq!(
        r["choices"][0]["message"]["content"],
        want_text.as_str(),
        "{r}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["usage"]["completion_tokens"], want.len());
    assert!(
        r["tandem"]["num_accepted_draft_tokens"].as_u64().unwrap() > 0,
        "the draft, masked the same way, has some of its tokens accepted: {r}"
    );
    let mut body = request(json_schema_format(), n);
    body["stream"] = json!(true);
    assert_eq!(
        text_of(&stream(e.port, "/v1/chat/completions", &body)),
        want_text
    );

    // Cloud-only with the same schema: the verifier alone.
    let rt = tandem_proto::runtime().unwrap();
    let remote = tandem_edge::grpc::Remote {
        url: &format!("http://127.0.0.1:{}", v.port),
        api_key: None,
        tls_ca: None,
    };
    let mut cloud = Vec::new();
    tandem_edge::grpc::generate_remote_with(
        &rt,
        remote,
        tok.fingerprint(),
        &prompt,
        greedy,
        n as u32,
        tandem_edge::grpc::GenerateOptions {
            grammar: Some(&source),
            // The verifier's own guesses are judged under the mask too.
            self_draft: true,
        },
        |t| cloud.push(t),
    )
    .unwrap();
    assert_eq!(
        cloud, want,
        "cloud-only under the schema is the same output"
    );

    // Sampled (seeded), verified by sample-and-match (the default): the edge's answer is the
    // target's own draw under the mask. (Rejection sampling commits a draw distributed as the
    // target's under the mask, not this one: `spec`'s χ² test covers it.)
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: 11,
        ..SamplingParams::default()
    };
    let want = testkit_constrained(&prompt, n, &source, &sampled);
    let mut body = request(json_schema_format(), n);
    body["temperature"] = json!(0.8);
    body["top_p"] = json!(0.95);
    body["seed"] = json!(11);
    let (s, r) = post(e.port, "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], text(&want).as_str());
    if want.last().is_some_and(|&t| tok.is_eog(t)) {
        check_person(&serde_json::from_str(&text(&want)).unwrap());
    }

    // json_object: any JSON object, whole (greedy).
    let (s, r) = post(
        e.port,
        "/v1/chat/completions",
        &request(json!({"type": "json_object"}), 64),
    );
    assert_eq!(s, 200, "{r}");
    let want = testkit_constrained(&prompt, 64, &GrammarSource::JsonObject, &greedy);
    let got = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(got, text(&want));
    if r["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(got).unwrap().is_object(),
            "{got}"
        );
    }
}

fn testkit_constrained(
    prompt: &[u32],
    n: usize,
    source: &GrammarSource,
    params: &SamplingParams,
) -> Vec<u32> {
    tandem_testkit::model::constrained(prompt, n, source, params)
}

#[test]
fn schemas_that_cannot_be_used_are_refused_by_name_on_both_sides() {
    let v = verifier(&[]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    for format in [
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wibble"}}}),
        json!({"type": "json_schema", "json_schema": {"name": "x"}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}),
        json!({"type": "yaml"}),
        json!({"json_schema": {}}),
    ] {
        let (s, r) = post(e.port, "/v1/chat/completions", &request(format.clone(), 8));
        assert_eq!(
            (s, r["error"]["param"].as_str()),
            (400, Some("response_format")),
            "{format}: {r}"
        );
    }
    // The verifier refuses a grammar it cannot compile by name, before it opens anything.
    let tok = &target().1;
    let rt = tandem_proto::runtime().unwrap();
    let remote = tandem_edge::grpc::Remote {
        url: &format!("http://127.0.0.1:{}", v.port),
        api_key: None,
        tls_ca: None,
    };
    let err = tandem_edge::grpc::generate_remote_with(
        &rt,
        remote,
        tok.fingerprint(),
        &tok.encode_chat("hi").unwrap(),
        SamplingParams::default(),
        4,
        tandem_edge::grpc::GenerateOptions {
            grammar: Some(&GrammarSource::Lark("start: ( ".into())),
            self_draft: false,
        },
        |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("generate.grammar"), "{err}");
    // And both still answer.
    let (s, r) = post(
        e.port,
        "/v1/chat/completions",
        &request(json!({"type": "text"}), 3),
    );
    assert_eq!(s, 200, "{r}");
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city", "unit"],
                "additionalProperties": false
            }
        }},
        {"type": "function", "function": {
            "name": "book_table",
            "parameters": {
                "type": "object",
                "properties": {"restaurant": {"type": "string"}, "people": {"type": "integer"}},
                "required": ["restaurant", "people"],
                "additionalProperties": false
            }
        }}
    ])
}

fn tool_request(choice: Value) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        "max_tokens": 64,
        "temperature": 0,
        "tools": weather_tools(),
        "tool_choice": choice,
    })
}

/// A call's arguments checked against the tool's schema by hand.
fn check_call(call: &Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {call}"));
    match call["function"]["name"].as_str().unwrap() {
        "get_weather" => {
            assert!(args["city"].is_string(), "{args}");
            assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()));
            assert_eq!(args.as_object().unwrap().len(), 2, "{args}");
        }
        "book_table" => {
            assert!(
                args["restaurant"].is_string() && args["people"].is_i64(),
                "{args}"
            )
        }
        other => panic!("a call of {other}"),
    }
}

#[test]
fn forced_tool_calls_come_back_as_openais_tool_calls_and_auto_is_refused_by_name() {
    let v = verifier(&[]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    let named = json!({"type": "function", "function": {"name": "get_weather"}});

    // A named function, whole and streamed.
    let (s, r) = post(e.port, "/v1/chat/completions", &tool_request(named.clone()));
    assert_eq!(s, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    assert_eq!(choice["message"]["content"], Value::Null);
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    check_call(call);
    let mut body = tool_request(named.clone());
    body["stream"] = json!(true);
    let chunks = stream(e.port, "/v1/chat/completions", &body);
    // Streamed as OpenAI streams a call: its id and name first, then the arguments in pieces.
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|(_, c)| c["choices"][0]["delta"].get("tool_calls"))
        .map(|t| &t[0])
        .collect();
    assert!(calls.len() > 1, "{chunks:?}");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(calls[1..].iter().all(|c| c.get("id").is_none()));
    let arguments: String = calls
        .iter()
        .map(|c| c["function"]["arguments"].as_str().unwrap())
        .collect();
    assert_eq!(arguments, call["function"]["arguments"].as_str().unwrap());
    let fin = chunks
        .iter()
        .rev()
        .find_map(|(_, c)| c["choices"][0]["finish_reason"].as_str())
        .unwrap();
    assert_eq!(fin, "tool_calls");

    // `required`: one of the tools, by the model's choice.
    let (s, r) = post(
        e.port,
        "/v1/chat/completions",
        &tool_request(json!("required")),
    );
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
    check_call(&r["choices"][0]["message"]["tool_calls"][0]);

    // `none`: a plain answer.
    let (s, r) = post(e.port, "/v1/chat/completions", &tool_request(json!("none")));
    assert_eq!(s, 200, "{r}");
    assert!(r["choices"][0]["message"]["content"].is_string(), "{r}");

    // `auto`, said or by default: this model's template has no tool format.
    for body in [tool_request(json!("auto")), {
        let mut b = tool_request(Value::Null);
        b.as_object_mut().unwrap().remove("tool_choice");
        b
    }] {
        let (s, r) = post(e.port, "/v1/chat/completions", &body);
        assert_eq!(
            (s, r["error"]["param"].as_str()),
            (400, Some("tool_choice")),
            "{r}"
        );
        assert!(r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tool format"));
    }
    // Bad tools and choices are named.
    for (body, param) in [
        (
            tool_request(json!({"type": "function", "function": {"name": "fly"}})),
            "tool_choice",
        ),
        (tool_request(json!("sometimes")), "tool_choice"),
        (
            {
                let mut b = tool_request(named.clone());
                b["tools"] = json!([{"type": "function", "function": {"name": "bad name!"}}]);
                b
            },
            "tools",
        ),
        (
            {
                let mut b = tool_request(named.clone());
                b["response_format"] = json!({"type": "json_object"});
                b
            },
            "response_format",
        ),
    ] {
        let (s, r) = post(e.port, "/v1/chat/completions", &body);
        assert_eq!(
            (s, r["error"]["param"].as_str()),
            (400, Some(param)),
            "{body}: {r}"
        );
    }

    // The call's result in the history, rendered through the template: the conversation goes on.
    let (s, r) = post(
        e.port,
        "/v1/chat/completions",
        &json!({
            "model": MODEL,
            "max_tokens": 16,
            "temperature": 0,
            "messages": [
                {"role": "user", "content": "What is the weather in Paris, in celsius?"},
                {"role": "assistant", "content": null, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "{\"temperature\": 18}"},
            ],
        }),
    );
    assert_eq!(s, 200, "{r}");
    assert!(r["choices"][0]["message"]["content"].is_string(), "{r}");
}

#[test]
fn the_unmodified_openai_client_gets_valid_json_tool_calls_and_refusals_by_name() {
    let tok = &target().1;
    let (python, _) = test_deps();
    let v = verifier(&[]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    let n = 96;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/clients/structured_client.py"
    );
    let stdout = stdout_of(
        "the openai client (structured outputs)",
        std::process::Command::new(&python)
            .args([script, &format!("http://127.0.0.1:{}/v1", e.port), MODEL])
            .arg(schema().to_string())
            .arg(QUESTION)
            .arg(n.to_string()),
    );
    let r: Value = serde_json::from_slice(&stdout).unwrap();
    // The client validated each answer with jsonschema; here: they are the target's own.
    let want = testkit_constrained(
        &tok.encode_chat(QUESTION).unwrap(),
        n,
        &GrammarSource::JsonSchema(schema().to_string()),
        &SamplingParams::default(),
    );
    assert_eq!(r["whole"]["text"], text(&want).as_str(), "{r}");
    assert_eq!(r["whole"]["finish_reason"], "stop");
    assert_eq!(r["stream"], text(&want).as_str());
    assert_eq!(r["calls"][0]["name"], "get_weather", "{r}");
    for c in r["calls"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "tool_calls", "{r}");
    }
    assert_eq!(
        r["refused"]["auto"],
        json!({"status": 400, "param": "tool_choice"})
    );
    assert_eq!(
        r["refused"]["bad_schema"],
        json!({"status": 400, "param": "response_format"})
    );
}

#[test]
fn logprobs_are_the_targets_own_on_both_endpoints() {
    let tok = &target().1;
    let v = verifier(&[]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    let q = "Name three colours.";
    let n = 24;
    let check = |prompt: &[u32], ids: &[u32], lps: &[f32], tops: &[Vec<(u32, f32)>], k: usize| {
        let rows = tandem_testkit::model::rows_of(prompt, ids);
        assert_eq!(lps.len(), ids.len());
        for (i, row) in rows.iter().enumerate() {
            let want = tandem_spec::sampling::token_logprob(row, ids[i], 0, k);
            assert!(
                (want.logprob - lps[i]).abs() < 1e-5,
                "token {i}: {} against the target's {}",
                lps[i],
                want.logprob
            );
            assert_eq!(tops[i].len(), k);
            for (a, b) in tops[i].iter().zip(&want.top) {
                assert_eq!(a.0, b.0);
                assert!((a.1 - b.1).abs() < 1e-5);
            }
        }
    };
    let bytes_id = |v: &Value| {
        let b: Vec<u8> = v["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u8)
            .collect();
        (0..tok.vocab_size() as u32)
            .find(|&t| tok.token_bytes(t) == b)
            .unwrap()
    };
    // Chat, whole and streamed: `content` entries with their bytes and three alternatives.
    let mut body = chat(q, n);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let (s, r) = post(e.port, "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{r}");
    let want = expected_chat(q, n);
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let lps: Vec<f32> = content
        .iter()
        .map(|c| c["logprob"].as_f64().unwrap() as f32)
        .collect();
    let tops: Vec<Vec<(u32, f32)>> = content
        .iter()
        .map(|c| {
            c["top_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| (bytes_id(t), t["logprob"].as_f64().unwrap() as f32))
                .collect()
        })
        .collect();
    let ids: Vec<u32> = content.iter().map(bytes_id).collect();
    assert_eq!(ids, want.ids, "the entries are the answer's tokens");
    check(&tok.encode_chat(q).unwrap(), &ids, &lps, &tops, 3);
    body["stream"] = json!(true);
    let chunks = stream(e.port, "/v1/chat/completions", &body);
    let streamed: Vec<&Value> = chunks
        .iter()
        .filter_map(|(_, c)| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .collect();
    assert_eq!(streamed.len(), content.len());
    let carrying = chunks
        .iter()
        .filter(|(_, c)| c["choices"][0]["logprobs"]["content"].is_array())
        .count();
    assert!(carrying > 1, "each chunk carries its own tokens' logprobs");
    for (a, b) in streamed.iter().zip(content) {
        assert_eq!(a["logprob"], b["logprob"]);
    }

    // Completions: `logprobs: 2`, OpenAI's legacy layout.
    let p = "The capital of France is";
    let (s, r) = post(
        e.port,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(s, 200, "{r}");
    let want = expected_completion(p, 8);
    let l = &r["choices"][0]["logprobs"];
    let lps: Vec<f32> = l["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    let tops: Vec<Vec<(u32, f32)>> = l["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let mut v: Vec<(u32, f32)> = m
                .as_object()
                .unwrap()
                .iter()
                .map(|(t, lp)| (tok.encode(t).unwrap()[0], lp.as_f64().unwrap() as f32))
                .collect();
            v.sort_by(|a, b| b.1.total_cmp(&a.1));
            v
        })
        .collect();
    assert_eq!(lps.len(), want.ids.len());
    check(&tok.encode(p).unwrap(), &want.ids, &lps, &tops, 2);
    // Bad values are named.
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": q}], "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": q}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": p, "logprobs": 6}),
            "logprobs",
        ),
    ] {
        let (s, r) = post(e.port, path, &body);
        assert_eq!((s, r["error"]["param"].as_str()), (400, Some(param)), "{r}");
    }
}
