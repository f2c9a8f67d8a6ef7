//! `tandem serve` and `tandem cloud serve` keep what users say to themselves: after an answer, with
//! both logging at debug level, neither the prompt's rare words nor the answer's longest ones are
//! in either process's log, either one's metrics or the verifier's usage ledger. The model is
//! pulled on first use.

mod common;

use common::serve::*;
use common::*;

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
