//! A seeded answer is reproducible: the same sampled request with a `seed`, sent to a real
//! `tandem serve` in front of a real `tandem cloud serve` through the project's emulated link at a
//! 0 and a 100 ms round trip, one client at a time and eight at once, gives the same text every
//! time — the target's own seeded sample, whatever the verifier decoded itself or judged. (Before
//! the draws were coupled the default rule was rejection sampling, whose committed token depends on
//! whether a draft was judged at a position: timing.) The model is pulled on first use.

mod common;

use common::serve::*;
use common::*;
use serde_json::json;

#[test]
fn the_same_seeded_request_gives_the_same_text_at_any_round_trip_and_load() {
    let (m, tok) = target();
    let question = "Write a short poem about the sea.";
    let (n, seed, temperature) = (28usize, 7u64, 0.8f32);
    let params = tandem_spec::sampling::SamplingParams {
        temperature,
        top_k: 0,
        top_p: 1.0,
        seed,
    };
    let ids = tok.encode_chat(question).unwrap();
    let own =
        tandem_client::generate::generate(&mut engine(m), tok, &ids, n, &params, |_| {}).unwrap();
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": n,
        "temperature": temperature,
        "seed": seed,
    });
    let v = verifier(&[]);
    let upstream: std::net::SocketAddr = format!("127.0.0.1:{}", v.port).parse().unwrap();
    for rtt in [0.0, 100.0] {
        let e = edge(&[netem_front(upstream, rtt, rtt / 10.0)], &[]);
        let ask = || {
            let (s, r) = post(e.port, "/v1/chat/completions", &body);
            assert_eq!(s, 200, "{r}");
            r["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        for k in 0..5 {
            assert_eq!(ask(), own.text, "RTT {rtt} ms, one client, request {k}");
        }
        let texts: Vec<String> = std::thread::scope(|s| {
            let clients: Vec<_> = (0..8).map(|_| s.spawn(ask)).collect();
            clients.into_iter().map(|c| c.join().unwrap()).collect()
        });
        for (k, t) in texts.iter().enumerate() {
            assert_eq!(t, &own.text, "RTT {rtt} ms, eight clients, client {k}");
        }
    }
}
