//! The verifier's gRPC sessions on SmolLM2, served in-process on a loopback port: a bad session
//! or draft is refused by name and the session goes on; cloud-only generation streams exactly the
//! target's greedy tokens; an edge that stops acknowledging what it received is decoded no further
//! (flow control). The model is pulled on first use.

mod common;

use std::time::Duration;

use common::*;
use tandem_engine::SeqId;
use tandem_proto::v1::{edge_message, EdgeMessage};
use tonic::Code;

#[test]
fn grpc_refuses_bad_sessions_and_drafts_by_name() {
    use tandem_edge::grpc::GrpcLink;
    use tandem_edge::Link;
    let (_, tok) = target();
    let url = grpc_server().clone();
    let rt = tandem_testkit::rt();
    let open = |fp: &str, ids: Vec<u32>| greedy_open(fp, &ids);
    let prompt = tok.encode("The capital of France is").unwrap();
    let err = GrpcLink::connect(&rt, &url, open("0123", prompt.clone()))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("tokenizer_fingerprint"), "{err}");
    let err = GrpcLink::connect(&rt, &url, open(tok.fingerprint(), vec![1, 999_999]))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("open.prompt_ids") && err.contains("999999"),
        "{err}"
    );
    let mut long = open(tok.fingerprint(), prompt.clone());
    long.max_tokens = 100_000;
    let err = GrpcLink::connect(&rt, &url, long)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("context length"), "{err}");

    // A bad draft is refused by name and the session goes on.
    let (mut link, opened) =
        GrpcLink::connect(&rt, &url, open(tok.fingerprint(), prompt.clone())).unwrap();
    let start = prompt.len() + 1; // after the committed first token
    let block_at = |tokens: Vec<u32>, index: u64, start_pos: usize| tandem_spec::Block {
        epoch: 0,
        index: tandem_spec::BlockId(index),
        start_pos,
        tokens,
        q: vec![],
        side: vec![],
    };
    let block = |tokens: Vec<u32>, index: u64| block_at(tokens, index, start);
    // Past the tokens the verifier decodes meanwhile (each position once, in order), the next
    // refusal.
    let mut decoded = Vec::new();
    let mut refusal = |link: &mut GrpcLink| loop {
        match link.recv(true) {
            Ok(Some(tandem_spec::Incoming::Decoded(d))) => decoded.push(d.pos),
            Err(e) => break e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    link.send(block(vec![5, 999_999], 0)).unwrap();
    let err = refusal(&mut link);
    assert!(
        err.contains("draft.tokens") && err.contains("999999"),
        "{err}"
    );
    link.send(block(vec![5; 9], 1)).unwrap();
    let err = refusal(&mut link);
    assert!(err.contains("granted draft length"), "{err}");
    link.send(block_at(vec![5], 2, start - 2)).unwrap();
    let err = refusal(&mut link);
    assert!(err.contains("starts at position"), "{err}");
    // The session goes on: the verifier keeps decoding it.
    match link.recv(true).unwrap() {
        Some(tandem_spec::Incoming::Decoded(d)) => decoded.push(d.pos),
        other => panic!("expected decoded tokens, got {other:?}"),
    }
    assert_eq!(
        decoded,
        (start..start + decoded.len()).collect::<Vec<_>>(),
        "each position once, in order"
    );
    let _ = opened;

    // An edge that drafts from its Open on: a refused Open comes from its first read, by name
    // (not a lost connection to reopen); on an open session, blocks sent right behind the Open
    // are read once it opens, after `Opened` (the first token's commit), and a bad one is
    // refused by name after it.
    let mut early = GrpcLink::start(&rt, &url, open("0123", prompt.clone())).unwrap();
    match early.recv(true) {
        Err(e @ tandem_edge::EdgeError::NotOpened(_)) => {
            assert!(e.to_string().contains("tokenizer_fingerprint"), "{e}")
        }
        other => panic!("expected the open refused, got {other:?}"),
    }
    let mut early = GrpcLink::start(&rt, &url, open(tok.fingerprint(), prompt.clone())).unwrap();
    let n = prompt.len();
    early.send(block_at(vec![5], 0, n - 1)).unwrap();
    match early.recv(true).unwrap() {
        Some(tandem_spec::Incoming::Opened(o)) => {
            assert_eq!(o.first, opened.first_token, "the same prompt's first token");
            assert!(o.grant.draft_len > 0, "{o:?}");
        }
        other => panic!("expected the first token, got {other:?}"),
    }
    let err = loop {
        match early.recv(true) {
            Ok(Some(tandem_spec::Incoming::Decoded(_))) => {}
            Err(e) => break e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    assert!(err.contains("inside the prompt"), "{err}");
}

/// Cloud-only generation over gRPC streams exactly the target's greedy tokens.
#[test]
fn grpc_generate_is_the_targets_greedy_output() {
    use tandem_proto::v1::verifier_client::VerifierClient;
    let (m, tok) = target();
    let url = grpc_server().clone();
    let p = tok.encode("The capital of France is").unwrap();
    let want = greedy(&mut engine(m), SeqId(8), &p, 12);
    let rt = tandem_testkit::rt();
    let got: Vec<u32> = rt.block_on(async {
        let mut c = VerifierClient::connect(url).await.unwrap();
        let req = tandem_proto::v1::GenerateRequest {
            tokenizer_fingerprint: tok.fingerprint().to_string(),
            prompt_ids: p.clone(),
            params: None,
            max_tokens: 12,
            grammar: None,
            self_draft: false,
        };
        let mut s = c.generate(req.clone()).await.unwrap().into_inner();
        let mut out = Vec::new();
        while let Some(r) = s.message().await.unwrap() {
            out.extend(r.tokens);
            if r.done {
                break;
            }
        }
        let bad = tandem_proto::v1::GenerateRequest {
            prompt_ids: vec![],
            ..req
        };
        let err = c.generate(bad).await.unwrap_err();
        assert!(err.message().contains("prompt_ids"), "{}", err.message());
        out
    });
    assert_eq!(got, want);
}

/// A cloud-only generation that lets the verifier draft for itself (protocol 7) streams exactly
/// the target's greedy tokens, and on a request that copies its prompt the verifier's own
/// guesses are accepted (its metrics count them).
#[test]
fn a_generation_the_verifier_drafts_for_is_the_targets_and_its_copies_are_accepted() {
    use tandem_proto::v1::verifier_client::VerifierClient;
    let (_, tok) = target();
    let (url, gauges) = new_grpc_server(tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS);
    let p = tok
        .encode_chat(
            "Rename the variable `total` to `running_sum` in this function and write the whole \
             function out again:\n\n```python\ndef average(values):\n    total = 0\n    \
             count = 0\n    for value in values:\n        total += value\n        count += 1\n    \
             if count == 0:\n        return 0\n    return total / count\n```",
        )
        .unwrap();
    let n = 48;
    let want = target_answer(&p, n, 1);
    let rt = rt();
    let got: Vec<u32> = rt.block_on(async {
        let mut c = VerifierClient::connect(url).await.unwrap();
        let req = tandem_proto::v1::GenerateRequest {
            tokenizer_fingerprint: tok.fingerprint().to_string(),
            prompt_ids: p.clone(),
            params: None,
            max_tokens: n as u32,
            grammar: None,
            self_draft: true,
        };
        let mut s = c.generate(req).await.unwrap().into_inner();
        let mut out = Vec::new();
        while let Some(r) = s.message().await.unwrap() {
            out.extend(r.tokens);
            if r.done {
                break;
            }
        }
        out
    });
    assert_eq!(got, want);
    // The counters move with the batcher's turn, just after the last token went out.
    let accepted = (0..100)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            gauges.metrics.self_drafted.get()
        })
        .find(|&a| a > 0)
        .unwrap_or(0);
    let guessed = gauges.metrics.self_draft_guesses.get();
    // (The model rewrites part of the function rather than copy it all: a few copies are taken,
    // none when the verifier does not draft for itself.)
    assert!(
        accepted >= 4,
        "{accepted} of {guessed} guesses accepted copying the prompt: {:?}",
        tok.decode(&got)
    );
}

/// Flow control over gRPC: an edge that stops acknowledging what it received gets one window of
/// decoded tokens and then nothing, however long it waits; each Ack lets the verifier go on from
/// where it stopped, with the target's tokens.
#[test]
fn an_edge_that_stops_acknowledging_is_not_decoded_further() {
    use tandem_spec::FLOW_WINDOW;
    let (_, tok) = target();
    let (url, _) = new_grpc_server(tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS);
    let p = tok
        .encode_chat("Count from 1 to 200, separated by commas.")
        .unwrap();
    let w = target_answer(&p, FLOW_WINDOW + 20, 1);
    assert!(w.len() > FLOW_WINDOW + 17, "a fixture this long: {w:?}");
    let rt = rt();
    rt.block_on(async {
        let mut r = open_raw(&url, None, &p).await.unwrap();
        for _ in 0..FLOW_WINDOW {
            assert!(matches!(r.message().await, Ok(Reply::Decoded)));
        }
        let quiet = Duration::from_millis(1500);
        assert!(
            tokio::time::timeout(quiet, r.inbound.message())
                .await
                .is_err(),
            "nothing past the window without an ack"
        );
        // Ack 16 more tokens than Open did: 16 more come, then nothing again.
        let acked = r.start + 16;
        r.out
            .send(EdgeMessage {
                kind: Some(edge_message::Kind::Ack(tandem_proto::v1::Ack {
                    committed: acked as u64,
                })),
            })
            .unwrap();
        for _ in 0..16 {
            assert!(matches!(r.message().await, Ok(Reply::Decoded)));
        }
        assert_eq!(r.decoded, FLOW_WINDOW + 16);
        assert!(
            tokio::time::timeout(quiet, r.inbound.message())
                .await
                .is_err(),
            "nothing past the new window"
        );
        // An ack of tokens never sent is refused by name; the session goes on.
        r.out
            .send(EdgeMessage {
                kind: Some(edge_message::Kind::Ack(tandem_proto::v1::Ack {
                    committed: 1 << 40,
                })),
            })
            .unwrap();
        match r.message().await {
            Err((Code::InvalidArgument | Code::FailedPrecondition, m)) => {
                assert!(m.contains("ack.committed"), "{m}")
            }
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("expected the refusal"),
        }
    });
}

#[test]
fn a_reopened_structured_output_resumes_its_grammar_after_the_output_it_sends() {
    use tandem_edge::grpc::GrpcLink;
    use tandem_spec::GrammarSource;
    let (_, tok) = target();
    let url = grpc_server().clone();
    let rt = tandem_testkit::rt();
    let prompt = tok.encode_chat("Describe a cat as JSON.").unwrap();
    let want = tandem_testkit::model::constrained(
        &prompt,
        12,
        &GrammarSource::JsonObject,
        &tandem_spec::sampling::SamplingParams::default(),
    );
    assert!(want.len() > 6, "{want:?}");
    // A reopen sends the committed output in the prompt and says where it starts: the grammar
    // goes on after it, and the first token is the target's next under the grammar.
    let k = 5;
    let history: Vec<u32> = prompt.iter().chain(&want[..k]).copied().collect();
    let open = |output_from| tandem_edge::grpc::OpenRequest {
        grammar: Some(GrammarSource::JsonObject),
        output_from,
        ..greedy_open(tok.fingerprint(), &history)
    };
    let (link, opened) = GrpcLink::connect(&rt, &url, open(Some(prompt.len()))).unwrap();
    link.close();
    assert_eq!(opened.first_token, want[k]);
    // Without it, the grammar would start over (a second JSON object): not the same token.
    let (link, fresh) = GrpcLink::connect(&rt, &url, open(None)).unwrap();
    link.close();
    assert_eq!(
        tok.decode(&[fresh.first_token])
            .unwrap()
            .trim_start()
            .chars()
            .next(),
        Some('{'),
        "a grammar that starts over opens a new object"
    );
    // Output the grammar does not allow is refused by name.
    let mut bad = prompt.clone();
    bad.extend(tok.encode("hello").unwrap());
    let err = GrpcLink::connect(
        &rt,
        &url,
        tandem_edge::grpc::OpenRequest {
            grammar: Some(GrammarSource::JsonObject),
            output_from: Some(prompt.len()),
            ..greedy_open(tok.fingerprint(), &bad)
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("open.grammar.resumed"), "{err}");
}
