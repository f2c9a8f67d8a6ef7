//! One verifier, many tenants, for real: SmolLM2 behind a gRPC server with API keys, and edges
//! that speculate against it. Concurrent sessions each get exactly the target's output; a tenant
//! cannot read, draft into or close another's session, and its malformed messages get the
//! documented statuses without changing anyone else's output; a slow speculation session is taken
//! over by the verifier and a fast one is not. (Admission, drain and flow control, which need no
//! edge: `crates/cloud/tests`.) The model is pulled on first use.

mod common;

use common::*;
use tandem_cloud::tenants::Tenants;
use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{Draft, EdgeMessage, SessionRef};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::VerifyRule;
use tandem_verifier::VerifierConfig;
use tonic::Code;

/// Sixteen edges, each with its own draft engine and gRPC stream, share one verifier: every one
/// commits exactly the target's greedy output, and the verifier batched them.
#[test]
fn sixteen_concurrent_sessions_each_get_the_targets_output() {
    let n = 16;
    let max_new = 24;
    let ps = fact_prompts(n);
    let wants: Vec<Vec<u32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| target_answer(p, max_new, i as u64))
        .collect();
    let (url, gauges) = grpc_server_with(
        32.0,
        false,
        Tenants::open(),
        VerifierConfig::default(),
        256 << 20,
    );
    let outs: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = ps
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let url = url.clone();
                s.spawn(move || {
                    spec_out(
                        p,
                        2 + i % 3,
                        1 + i % 3,
                        0.0,
                        SamplingParams::default(),
                        VerifyRule::Greedy,
                        max_new,
                        Some(url),
                    )
                    .output_ids
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (o, w)) in outs.iter().zip(&wants).enumerate() {
        assert_eq!(o, w, "session {i}");
    }
    let m = gauges.metrics.render(&gauges);
    let batched = m
        .lines()
        .find(|l| l.starts_with("tandem:batch_size_bucket{le=\"1\"}"))
        .and_then(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .unwrap();
    let forwards = m
        .lines()
        .find(|l| l.starts_with("tandem:batch_size_count"))
        .and_then(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .unwrap();
    println!("{forwards} forwards, {batched} with one session");
    assert!(
        batched < forwards,
        "some forwards must batch several sessions"
    );
}

/// Tenant B holds a key of its own and tries everything against tenant A's session while A
/// generates: B cannot read it, draft into it or close it; B's own malformed messages get the
/// documented statuses; A's output is the target's, token for token.
#[test]
fn a_hostile_tenant_cannot_touch_or_disturb_another() {
    let (url, _) = grpc_server_with(
        32.0,
        false,
        tenants(""),
        VerifierConfig::default(),
        256 << 20,
    );
    let ps = fact_prompts(2);
    let max_new = 32;
    let want_a = target_answer(&ps[0], max_new, 0);
    let rt = rt();
    // A's probe session, held open (for B to aim at).
    let mut a = rt.block_on(open_raw(&url, Some(KEY_A), &ps[1])).unwrap();
    let a_id = a.session;
    let mut c = rt.block_on(VerifierClient::connect(url.clone())).unwrap();
    let get = |c: &mut VerifierClient<_>, key: Option<&str>, id: u64| {
        rt.block_on(c.get_session(authorized(SessionRef { session_id: id }, key)))
    };

    // Missing and unknown keys.
    assert_eq!(
        get(&mut c, None, a_id).unwrap_err().code(),
        Code::Unauthenticated
    );
    assert_eq!(
        get(&mut c, Some("tenant-x-0123456789abcdef"), a_id)
            .unwrap_err()
            .code(),
        Code::Unauthenticated
    );
    let e = rt.block_on(open_raw(&url, None, &ps[1])).err().unwrap();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");

    // A, meanwhile, generates through a real edge.
    let url_a = url.clone();
    let p0 = ps[0].clone();
    let gen_a = std::thread::spawn(move || {
        spec_out_as(
            Some(KEY_A.into()),
            &p0,
            4,
            2,
            0.0,
            SamplingParams::default(),
            VerifyRule::Greedy,
            max_new,
            Some(url_a),
            tandem_spec::TreeConfig::LINEAR,
        )
        .output_ids
    });

    // B cannot read or close A's session: it does not exist for B.
    let e = get(&mut c, Some(KEY_B), a_id).unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = rt
        .block_on(c.cancel(authorized(SessionRef { session_id: a_id }, Some(KEY_B))))
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert_eq!(
        get(&mut c, Some(KEY_B), 999_999).unwrap_err().code(),
        Code::NotFound
    );

    // B's own session: a block aimed at A's session, then every kind of malformed block. Those
    // refused on arrival are answered at once; a future epoch and a start past the committed
    // tokens are refused when the block is planned (with the session's next forward). Between
    // the answers the verifier keeps decoding B's session ([`Raw::next`] skips those tokens).
    let mut b = rt.block_on(open_raw(&url, Some(KEY_B), &ps[1])).unwrap();
    let ok = |index: u64, epoch: u64, start: usize, tokens: Vec<u32>| Draft {
        epoch,
        block: index,
        start_pos: start as u64,
        tokens,
        q: vec![],
        session_id: 0,
        side: vec![],
    };
    let first = b.first;
    let start = b.start;
    let cases: Vec<(Draft, Code, &str)> = vec![
        (
            Draft {
                session_id: a_id,
                ..ok(0, 0, start, vec![first])
            },
            Code::NotFound,
            "draft.session_id",
        ),
        (
            ok(1, 0, start, vec![999_999]),
            Code::InvalidArgument,
            "draft.tokens",
        ),
        (
            ok(2, 0, start, vec![first; 9]),
            Code::InvalidArgument,
            "granted draft length",
        ),
        (
            ok(3, 0, start, vec![]),
            Code::InvalidArgument,
            "draft.tokens",
        ),
        (
            ok(4, 0, start - 2, vec![first]),
            Code::InvalidArgument,
            "inside the prompt",
        ),
        (ok(5, 3, start, vec![first]), Code::InvalidArgument, "epoch"),
        (
            ok(6, 0, start + 4000, vec![first]),
            Code::InvalidArgument,
            "beyond the",
        ),
        (
            ok(6, 0, start, vec![first]),
            Code::InvalidArgument,
            "does not follow",
        ),
    ];
    for (d, code, text) in cases {
        b.draft(d);
        let (got, msg) = rt.block_on(b.next()).unwrap_err();
        assert_eq!(got, code, "{text}: {msg}");
        assert!(msg.contains(text), "{text}: {msg}");
    }
    // An empty message and a second Open are refused; the session goes on.
    b.out.send(EdgeMessage { kind: None }).unwrap();
    assert_eq!(rt.block_on(b.next()).unwrap_err().0, Code::InvalidArgument);

    // A still owns its probe: B drafted nothing into it, A can read and cancel it.
    let s = get(&mut c, Some(KEY_A), a_id).unwrap().into_inner();
    assert_eq!((s.verified_positions, s.queued_blocks), (0, 0));
    rt.block_on(c.cancel(authorized(SessionRef { session_id: a_id }, Some(KEY_A))))
        .unwrap();
    let (code, _) = rt.block_on(a.next()).unwrap_err();
    assert_eq!(code, Code::Cancelled);
    assert_eq!(
        get(&mut c, Some(KEY_A), a_id).unwrap_err().code(),
        Code::NotFound
    );

    assert_eq!(gen_a.join().unwrap(), want_a, "A's output changed");
}

/// On an unloaded verifier: an edge whose drafts are always wrong and slow is decoded by the
/// verifier (which never idles a session, and takes a slow one over by pace); an edge whose drafts
/// are right and fast commits most of its tokens by verdicts. Both get exactly the target's
/// output.
#[test]
fn a_slow_speculation_session_is_taken_over_and_a_fast_one_is_not() {
    let (m, tok) = target();
    // Grants never shrink for load here (saturation far away): only pace decides.
    let (url, _) = grpc_server_with(
        1000.0,
        true,
        Tenants::open(),
        VerifierConfig::default(),
        256 << 20,
    );
    let p = &fact_prompts(1)[0];
    let n = 24;
    let w = target_answer(p, n, 1);
    let rt = rt();
    let run = |alpha: f64, draft_ms: f64| {
        let edge = tandem_bench::load::SyntheticEdge {
            alpha,
            draft_ms,
            gamma: 4,
            depth: 2,
            seed: 7,
            vocab: m.cfg.vocab as u32,
            tree: tandem_spec::TreeConfig::LINEAR,
            cover: 0.0,
            self_draft: true,
        };
        tandem_bench::load::synthetic_session(&rt, &url, tok, p, &w, edge).unwrap()
    };
    let slow = run(0.0, 40.0);
    assert_eq!(slow.output_ids, w, "slow session");
    assert!(
        slow.measured.cloud_decoded >= w.len() / 2,
        "the verifier should have decoded most of the slow session: {:?}",
        slow.measured
    );
    let fast = run(1.0, 1.0);
    assert_eq!(fast.output_ids, w, "fast session");
    assert!(
        fast.measured.cloud_decoded < w.len() / 4,
        "verdicts should have committed most of the fast session: {:?}",
        fast.measured
    );
}
