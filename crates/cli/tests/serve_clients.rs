//! `tandem serve` against clients that are not ours, with a real `tandem cloud serve` verifier
//! behind it: the unmodified `openai` Python client gets the target's answers, in plaintext and
//! over TLS (an edge that does not trust the verifier's CA refuses to start, saying why), and the live view in a
//! real headless Chromium shows the target's answer with its tentative drafts and corrections.
//! `scripts/test-deps` installs the clients. The model is pulled on first use.

mod common;

use common::serve::*;
use common::*;
use serde_json::{json, Value};

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
    // An edge that does not trust the verifier's CA says so at start-up and does not serve.
    let mut args: Vec<String> = ["serve", "--listen", "127.0.0.1:0", "--cloud"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(format!("https://localhost:{}", tv.port));
    let said = spawn_tandem(&args, "tandem serve listening on ", None)
        .map(|_| panic!("an edge that does not trust the verifier started"))
        .unwrap_err();
    assert!(said.contains("give --tls-ca"), "{said}");
}

#[test]
fn a_twelve_turn_conversation_through_the_openai_client_is_the_targets_and_reuses_each_turn() {
    let (python, _) = test_deps();
    let (m, tok) = target();
    // Every block judged, no session taken over: the draft prefills every turn (a session the
    // verifier decodes alone feeds its draft no prompt), however slow the draft is beside the
    // target (with the edge slowed, `scripts/skew edge 30`, the default verifier took sessions
    // over and the draft's cache served 1968 tokens of the 2528 asked below).
    let v = judging_verifier(&["--metrics-listen", "127.0.0.1:0"]);
    let e = edge(&[format!("http://127.0.0.1:{}", v.port)], &[]);
    let questions = [
        "What is a bicycle?",
        "How many wheels does it have?",
        "What are the pedals for?",
        "Why do bicycles have gears?",
        "What is the chain made of?",
        "How do brakes stop a bicycle?",
        "What is a tandem bicycle?",
        "Who rides at the front of one?",
        "Is it faster than a normal bicycle?",
        "What should a rider wear?",
        "How often should tyres be pumped?",
        "Summarise our conversation in one sentence.",
    ];
    let n = 24;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/chat_client.py");
    let stdout = stdout_of(
        "the openai client's conversation",
        std::process::Command::new(&python)
            .args([script, &format!("http://127.0.0.1:{}/v1", e.port), MODEL])
            .arg(n.to_string())
            .args(questions),
    );
    let r: Value = serde_json::from_slice(&stdout).unwrap();
    let turns = r["turns"].as_array().unwrap();
    assert_eq!(turns.len(), questions.len());
    // Each turn's answer is the target's greedy continuation of the whole history, computed here
    // without a cache; and each turn starts from the pages of the one before.
    let mut history = vec![tandem_engine::tokenizer::ChatMessage {
        role: "system".into(),
        content: r["system"].as_str().unwrap().into(),
    }];
    let mut last_prompt = 0;
    // The whole pages of each turn's prompt, which the next turn finds in the draft's own cache.
    let mut draft_reuse = 0;
    for (k, (t, q)) in turns.iter().zip(questions).enumerate() {
        history.push(tandem_engine::tokenizer::ChatMessage {
            role: "user".into(),
            content: q.into(),
        });
        let ids = tok.encode(&tok.render_chat(&history).unwrap()).unwrap();
        let want = greedy_with(m, &ids, n);
        assert_eq!(t["text"], want.text.as_str(), "turn {k}: {r}");
        assert_eq!(t["finish_reason"], want.finish, "turn {k}");
        assert_eq!(t["prompt_tokens"], ids.len(), "turn {k}");
        let cached = t["cached_tokens"].as_u64().unwrap() as usize;
        assert!(
            cached < ids.len(),
            "turn {k}: the last prompt token is computed"
        );
        if k > 0 {
            // The last turn's prompt (its full pages of 16), and more: its answer's pages.
            assert!(
                cached + 16 > last_prompt,
                "turn {k}: {cached} of {} prompt tokens cached, the last turn's prompt was {last_prompt}",
                ids.len()
            );
        }
        eprintln!(
            "turn {k}: {} prompt tokens, {cached} cached, answered in {:.2} s",
            ids.len(),
            t["seconds"].as_f64().unwrap()
        );
        last_prompt = ids.len();
        if k + 1 < turns.len() {
            draft_reuse += ids.len() / 16 * 16;
        }
        history.push(tandem_engine::tokenizer::ChatMessage {
            role: "assistant".into(),
            content: want.text.clone(),
        });
    }
    // Both sides count what the cache served.
    let cached: u64 = turns
        .iter()
        .map(|t| t["cached_tokens"].as_u64().unwrap())
        .sum();
    let prompts: u64 = turns
        .iter()
        .map(|t| t["prompt_tokens"].as_u64().unwrap())
        .sum();
    let counted = |port: u16| {
        let m = get(port, "/metrics").1;
        (
            sample(&m, "tandem:prefix_cache_hits_total") as u64,
            sample(&m, "tandem:prefix_cache_queries_total") as u64,
        )
    };
    assert_eq!(counted(e.port), (cached, prompts));
    // The edge's draft kept each turn's KV too: every later turn attached at least the whole
    // pages of the prompt before it, and prefilled only the rest.
    let draft_hits = sample(
        &get(e.port, "/metrics").1,
        "tandem:draft_prefix_cache_hits_total",
    );
    assert!(
        draft_hits as usize >= draft_reuse,
        "the draft's cache served {draft_hits} prompt tokens, want at least {draft_reuse}"
    );
    // The verifier counts a session when it closes, just after its answer.
    let cloud = v.also_port.unwrap();
    wait_until("the verifier counts every turn", || {
        counted(cloud) == (cached, prompts)
    });
}

#[test]
fn the_live_view_in_a_real_browser_shows_the_targets_answer() {
    let (_, node_path) = test_deps();
    // Every block judged, so that tentative drafts show however slow the draft.
    let v = judging_verifier(&[]);
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
