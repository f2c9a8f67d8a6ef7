//! The verifier under load, on SmolLM2 served in-process on a loopback port: its grants shrink
//! while it is busy (down to decoding sessions itself) and grow back once it is idle; past its
//! session limit or a tenant's quota it refuses a new session with RESOURCE_EXHAUSTED and a retry
//! hint. The model is pulled on first use.

mod common;

use std::time::Duration;

use common::*;
use tandem_verifier::VerifierConfig;
use tonic::Code;

/// Grants follow the load: while a generation keeps a verifier (saturated at 1 token per forward)
/// busy, the grant shrinks a level every few forwards down to γ 0 — the verifier decodes sessions
/// itself: a new session is granted γ 0, and a session opened before gets the target's tokens
/// streamed instead of verdicts; once the verifier is idle again, grants grow back a level at a
/// time.
#[test]
fn grants_shrink_under_load_and_grow_back() {
    use tandem_edge::Link;
    use tandem_proto::v1::verifier_client::VerifierClient;
    let (_, tok) = target();
    let url = new_grpc_server(1.0).0;
    let rt = tandem_testkit::rt();
    let p = tok
        .encode_chat("Write a long story about a dragon.")
        .unwrap();
    // Probes ask for one token: the first, committed at Open, so the verifier has nothing to
    // decode for them (a decode would be load at a saturation of one token per forward).
    let connect = |rt: &tokio::runtime::Runtime, max_tokens: u32| {
        let req = tandem_edge::grpc::OpenRequest {
            max_tokens,
            want_draft_len: 8,
            want_depth: 4,
            ..greedy_open(tok.fingerprint(), &p)
        };
        tandem_edge::grpc::GrpcLink::connect(rt, &url, req).unwrap()
    };
    let open = |rt: &tokio::runtime::Runtime| {
        let (link, o) = connect(rt, 1);
        link.close();
        (o.draft_len, o.depth)
    };
    let (mut early, opened) = connect(&rt, 8);
    assert_eq!((opened.draft_len, opened.depth), (8, 4), "idle");
    let mut c = rt.block_on(VerifierClient::connect(url.clone())).unwrap();
    let mut stream = rt
        .block_on(c.generate(tandem_proto::v1::GenerateRequest {
            tokenizer_fingerprint: tok.fingerprint().to_string(),
            prompt_ids: p.clone(),
            params: None,
            max_tokens: 400,
            grammar: None,
            self_draft: false,
        }))
        .unwrap()
        .into_inner();
    // 40 forwards at about one token each: all four levels down.
    for _ in 0..40 {
        rt.block_on(stream.message()).unwrap().unwrap();
    }
    assert_eq!(open(&rt), (0, 1), "under load");
    // The session opened at (8, 4) drafted nothing: the verifier decoded it all along, each of
    // its tokens once and in order after the first, and told it each smaller grant on the way.
    let mut decoded = Vec::new();
    while decoded.len() < 7 {
        match early.recv(true).unwrap() {
            Some(tandem_spec::Incoming::Decoded(d)) => decoded.push(d),
            other => panic!("expected decoded tokens, got {other:?}"),
        }
    }
    let positions: Vec<usize> = decoded.iter().map(|d| d.pos).collect();
    assert_eq!(
        positions,
        (p.len() + 1..p.len() + 8).collect::<Vec<_>>(),
        "{decoded:?}"
    );
    let grants: Vec<tandem_spec::Shape> = decoded.iter().filter_map(|d| d.grant).collect();
    assert!(
        grants.windows(2).all(|w| w[0] >= w[1]),
        "grants only shrink under load: {grants:?}"
    );
    early.close();
    drop(stream);
    // Idle again, the grant climbs back to the full one and never shrinks on the way (one level
    // per idle spell: the verifier's own test times that on its clock). Each probe opens a
    // session, so probes are further apart than an idle spell; the bound only keeps a broken
    // build from hanging.
    let gap = std::time::Duration::from_millis(2 * tandem_verifier::control::IDLE_RELAX_MS);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut idle: Vec<(u32, u32)> = Vec::new();
    while idle.last() != Some(&(8, 4)) && std::time::Instant::now() < deadline {
        std::thread::sleep(gap);
        let g = open(&rt);
        if idle.last() != Some(&g) {
            idle.push(g);
        }
    }
    assert!(idle.windows(2).all(|w| w[0] <= w[1]), "{idle:?}");
    assert_eq!(idle.last(), Some(&(8, 4)), "idle again: {idle:?}");
}

/// Admission: past the verifier's session limit, or a tenant's quota, a new session is refused
/// with RESOURCE_EXHAUSTED and a `retry-after-ms` trailer; a freed slot admits again.
#[test]
fn a_saturated_verifier_refuses_with_a_retry_hint() {
    let cfg = VerifierConfig {
        max_sessions: 2,
        ..VerifierConfig::default()
    };
    let (url, _) = grpc_server_with(32.0, false, tenants("max_sessions = 1"), cfg, 256 << 20);
    let p = &fact_prompts(1)[0];
    let rt = rt();
    let b1 = rt.block_on(open_raw(&url, Some(KEY_B), p)).unwrap();
    let e = rt.block_on(open_raw(&url, Some(KEY_B), p)).err().unwrap();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("quota"), "{}", e.message());
    let a1 = rt.block_on(open_raw(&url, Some(KEY_A), p)).unwrap();
    let e = rt.block_on(open_raw(&url, Some(KEY_A), p)).err().unwrap();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("saturated"), "{}", e.message());
    let retry: u64 = e
        .metadata()
        .get("retry-after-ms")
        .expect("a retry hint")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1, "{retry}");
    drop(b1);
    drop(a1);
    // The closes reach the batcher; then there is room again.
    let mut admitted = None;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        if let Ok(r) = rt.block_on(open_raw(&url, Some(KEY_A), p)) {
            admitted = Some(r);
            break;
        }
    }
    assert!(admitted.is_some(), "freed slots admit again");
}
