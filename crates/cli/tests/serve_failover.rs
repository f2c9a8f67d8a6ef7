//! `tandem serve` when the verifier is gone, against real processes: with no verifier the answer
//! is a 503 once the reconnect window is spent, or with `--fallback local` the draft's own, marked
//! unverified, until a verifier is there again; a request sent while the verifier restarts waits
//! for it and is answered exactly; a prompt whose prefill takes longer than the connect timeout
//! is answered (only the admission is bounded by it); a verifier killed mid-answer ends the answer with an error event, or the draft
//! finishes it marked unverified; a verifier restarted ten seconds later resumes the answer token
//! for token. (Failover across replicas behind nginx: `deploy_failover.rs`.) The model is pulled
//! on first use.

mod common;

use std::time::Duration;

use common::serve::*;
use common::*;
use serde_json::{json, Value};

#[test]
fn with_no_verifier_the_answer_is_a_503_or_the_drafts_own_marked_unverified() {
    let tok = &target().1;
    let port = free_port();
    let cloud = format!("http://127.0.0.1:{port}");
    let q = "Name three colours.";

    // (Tried again within the reconnect window, short here, before the answer is a 503.)
    let strict = edge(
        std::slice::from_ref(&cloud),
        &[
            "--connect-timeout-ms",
            "1000",
            "--reconnect-window-ms",
            "1500",
        ],
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
fn a_request_sent_while_the_verifier_is_down_is_answered_exactly_once_it_is_back() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // The default reconnect window (30 s) covers the first Open too.
    let e = edge(&[format!("http://{listen}")], &[]);
    let q = "Name three colours.";
    let want = expected_chat(q, 24);
    let edge_port = e.port;
    let answer = std::thread::spawn(move || post(edge_port, "/v1/chat/completions", &chat(q, 24)));
    std::thread::sleep(Duration::from_secs(8));
    assert!(!answer.is_finished(), "the request waits for the verifier");
    let _v = verifier(&["--listen", &listen]);
    let (s, r) = answer.join().unwrap();
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], want.text.as_str());
    assert_eq!(r["tandem"]["unverified_tokens"], 0);
}

#[test]
fn a_prompt_whose_prefill_outlasts_the_connect_timeout_is_answered() {
    // A conversation's history of ~900 tokens: its prefill takes seconds on these CPUs, far
    // past a 300 ms connect timeout, which bounds only the admission.
    let v = verifier(&[]);
    let e = edge(
        &[format!("http://127.0.0.1:{}", v.port)],
        &[
            "--connect-timeout-ms",
            "300",
            "--reconnect-window-ms",
            "1000",
        ],
    );
    let mut history = String::new();
    for i in 0..60 {
        history.push_str(&format!(
            "Note {i}: the dragon flew over the hills at dawn. "
        ));
    }
    let q = format!("{history}\nWhat did the dragon do?");
    let tok = &target().1;
    let n = tok.encode_chat(&q).unwrap().len();
    assert!(n > 600, "{n} prompt tokens");
    let want = expected_chat(&q, 8);
    let (s, r) = post(e.port, "/v1/chat/completions", &chat(&q, 8));
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], want.text.as_str());
}
