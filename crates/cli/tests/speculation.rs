//! Speculation on SmolLM2 commits exactly the target's output: in-process behind an emulated round
//! trip and over a real gRPC verifier, synchronous and asynchronous, greedy and sample-and-match,
//! with a fixed shape and with the adaptive policy (which measures the link as it goes); and the
//! verifier's `/metrics`, scraped over HTTP, count what a speculative session did. The model is
//! pulled on first use.

mod common;

use common::*;
use tandem_engine::{EngineConfig, SeqId};

fn spec_run(
    prompt: &[u32],
    gamma: usize,
    depth: usize,
    rtt_ms: f64,
    params: tandem_spec::sampling::SamplingParams,
    rule: tandem_spec::VerifyRule,
    max_new: usize,
) -> Vec<u32> {
    spec_out(prompt, gamma, depth, rtt_ms, params, rule, max_new, None).output_ids
}

/// Sync (depth 1) and async speculation commit exactly the target's greedy output, whatever γ,
/// depth and round trip.
#[test]
fn speculation_is_lossless_greedy() {
    let (m, tok) = target();
    let prompts = [
        tok.encode("The capital of France is").unwrap(),
        tok.encode_chat("Explain how a bicycle stays upright while moving.")
            .unwrap(),
    ];
    let n = 20;
    for (pi, p) in prompts.iter().enumerate() {
        let want = greedy(&mut engine(m), SeqId(5), p, n);
        let configs: &[(usize, usize, f64)] = if pi == 0 {
            &[
                (1, 1, 0.0),
                (4, 1, 50.0),
                (8, 1, 0.0),
                (2, 2, 0.0),
                (4, 3, 50.0),
                (3, 4, 150.0),
            ]
        } else {
            &[(4, 1, 0.0), (5, 2, 50.0), (8, 4, 20.0)]
        };
        for &(g, d, rtt) in configs {
            let got = spec_run(
                p,
                g,
                d,
                rtt,
                tandem_spec::sampling::SamplingParams::default(),
                tandem_spec::VerifyRule::Greedy,
                n,
            );
            assert_eq!(got, want, "prompt {pi}, γ={g} depth={d} rtt={rtt}");
        }
    }
}

/// The adaptive policy re-plans γ and depth from what it measures; the output stays the target's,
/// and what it measured is what the link and the models cost.
#[test]
fn adaptive_policy_is_lossless_and_measures_the_link() {
    let (m, tok) = target();
    let (d, _) = draft();
    let p = tok
        .encode_chat("Explain how a bicycle stays upright while moving.")
        .unwrap();
    let n = 40;
    let want = greedy(&mut engine(m), SeqId(6), &p, n);
    let one = EngineConfig {
        threads: 1,
        ..EngineConfig::default()
    };
    for (depth, rtt) in [(1, 60.0), (2, 60.0)] {
        let run = tandem_client::speculate::SpecRun {
            target: m.clone(),
            draft: d.clone(),
            tokenizer: tok,
            cloud: one,
            edge: one,
            spec: tandem_edge::SpecConfig {
                session: tandem_spec::edge::SessionConfig {
                    draft_len: 1,
                    depth,
                    max_new_tokens: n,
                    auto: Some(tandem_spec::edge::AutoShape {
                        max_draft_len: 8,
                        max_depth: depth,
                        prior: tandem_spec::edge::default_prior(rtt),
                    }),
                    tree: tandem_spec::TreeConfig::LINEAR,
                },
                rule: tandem_spec::VerifyRule::Greedy,
                params: tandem_spec::sampling::SamplingParams::default(),
                q_top_k: 32,
                self_draft: true,
                suffix: true,
            },
            rtt_ms: rtt,
            jitter_ms: 0.0,
            // Behind the delay line, a verifier that verifies every block.
            cloud_url: Some(awaiting_server().clone()),
            api_key: None,
            tls_ca: None,
            grammar: None,
        };
        let out = tandem_client::speculate::run(&run, &p, |_| {}).unwrap();
        assert_eq!(out.output_ids, want, "depth {depth}");
        let s = out.spec.unwrap();
        let mm = s.measured;
        eprintln!("auto depth ≤ {depth}: {mm:?}");
        assert!(s.auto);
        // Measured, both (how long each takes is this CPU's, not the test's).
        assert!(mm.draft_ms > 0.0 && mm.verify_ms > 0.0, "{mm:?}");
        // The delay line adds the round trip; the policy sees at least that (how much more a
        // busy machine adds is measured by `bench latency`).
        assert!(mm.net_ms >= rtt * 0.95, "{mm:?}");
        assert!(mm.final_depth <= depth && mm.final_draft_len <= 8, "{mm:?}");
        // Which shape it ends at depends on this CPU: where the draft is slower than the target
        // (an AVX2 laptop on the portable kernels), no shape beats the verifier's own pace and
        // γ 1 stays. That the policy re-plans when its model predicts a clear gain is
        // `tandem_spec::edge`'s test on a test clock.
    }
}

/// With sample-and-match, speculation commits exactly what the target samples by itself with the
/// same seed: every position's draw is keyed by (seed, position).
#[test]
fn sample_and_match_reproduces_the_targets_own_sampling() {
    let (m, tok) = target();
    let p = tok.encode("Once upon a time").unwrap();
    let params = tandem_spec::sampling::SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 11,
    };
    let mut e = engine(m);
    let out = tandem_client::generate::generate(&mut e, tok, &p, 16, &params, |_| {}).unwrap();
    let got = spec_run(
        &p,
        4,
        3,
        20.0,
        params,
        tandem_spec::VerifyRule::SampleMatch,
        16,
    );
    assert_eq!(got, out.output_ids);
}

#[test]
fn speculation_over_real_grpc_is_lossless() {
    let (m, tok) = target();
    let url = grpc_server().clone();
    let p = tok.encode_chat("What is the capital of France?").unwrap();
    let want = greedy(&mut engine(m), SeqId(6), &p, 16);
    for (g, d) in [(4, 1), (3, 3), (8, 4)] {
        let greedy_p = tandem_spec::sampling::SamplingParams::default();
        let out = spec_out(
            &p,
            g,
            d,
            0.0,
            greedy_p,
            tandem_spec::VerifyRule::Greedy,
            16,
            Some(url.clone()),
        );
        let cut = want
            .iter()
            .position(|&t| tok.is_eog(t))
            .map_or(want.len(), |i| i + 1);
        assert_eq!(out.output_ids, want[..cut], "γ={g} depth={d}");
    }
}

/// `/metrics` is served over real HTTP, parses as Prometheus text, and counts what a speculative
/// session did.
#[test]
fn metrics_are_scraped_over_http_and_parse() {
    use std::io::{Read, Write};
    let (_, tok) = target();
    // Its own verifier (the counters are its alone), awaiting the edge's blocks: some are
    // verified with accepted tokens however slow the draft.
    let (url, g) = new_awaiting_server();
    let maddr = on_loopback(move |l| async move {
        tandem_cloud::metrics::serve_metrics(
            l,
            g,
            std::future::pending(),
            std::time::Duration::from_secs(30),
        )
        .await
        .unwrap();
    });
    let p = tok.encode("The capital of France is").unwrap();
    let out = spec_out(
        &p,
        4,
        2,
        0.0,
        tandem_spec::sampling::SamplingParams::default(),
        tandem_spec::VerifyRule::Greedy,
        48,
        Some(url),
    );
    // The session's usage is counted when the verifier takes its edge's Close: scrape until it
    // is there.
    let scrape = || {
        let mut c = std::net::TcpStream::connect(maddr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: tandem\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let mut values = std::collections::HashMap::new();
        for line in body
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let (name, value) = line.rsplit_once(' ').unwrap();
            let v: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("not a value: {line}"));
            values.insert(name.to_string(), v);
        }
        (values, body.to_string())
    };
    let ended = |v: &std::collections::HashMap<String, f64>| -> f64 {
        v.iter()
            .filter(|(k, _)| k.starts_with("tandem:request_success_total"))
            .map(|(_, x)| x)
            .sum()
    };
    // (The running gauge is set at the batcher's turn after the one that ended the session:
    // wait for both, with no time limit.)
    let (mut values, mut body) = scrape();
    while ended(&values) < 1.0 || values.get("tandem:num_requests_running") != Some(&0.0) {
        std::thread::sleep(std::time::Duration::from_millis(20));
        (values, body) = scrape();
    }
    let s = out.spec.unwrap();
    // Every verdict the edge applied was a verified draft (some it found stale on arrival).
    let drafts = values["tandem:spec_decode_num_drafts_total"];
    assert!(
        drafts >= s.rounds as f64 && drafts <= (s.rounds + s.stale_blocks + 2) as f64,
        "{drafts} drafts for {} rounds: {body}",
        s.rounds
    );
    assert!(values["tandem:spec_decode_num_accepted_tokens_total"] >= 1.0);
    assert!(values["tandem:time_to_first_token_seconds_count"] >= 1.0);
    assert!(values["tandem:target_forwards_total"] >= 2.0);
    assert!(
        values.contains_key("tandem:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}")
    );
    // The session's usage, counted once each, as the edge counted it.
    let reason = if out.finish_reason == "stop" {
        "stop"
    } else {
        "length"
    };
    let key = format!("tandem:request_success_total{{finished_reason=\"{reason}\"}}");
    assert_eq!((ended(&values), values[&key]), (1.0, 1.0), "{body}");
    assert_eq!(values["tandem:prompt_tokens_total"], p.len() as f64);
    assert_eq!(
        values["tandem:generation_tokens_total"],
        out.output_ids.len() as f64
    );
    assert_eq!(
        values["tandem:spec_decode_num_accepted_tokens_total"], s.accepted_draft_tokens as f64,
        "{body}"
    );
    assert_eq!(values["tandem:cloud_tokens_total"], s.cloud_tokens as f64);
    assert_eq!(values["tandem:num_requests_running"], 0.0);
    assert!((0.0..=1.0).contains(&values["tandem:draft_acceptance_rate"]));
    assert!(values["tandem:e2e_request_latency_seconds_count"] == 1.0);
}
