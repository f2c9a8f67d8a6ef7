//! One verifier, many tenants, for real: SmolLM2 behind a gRPC server with API keys. Concurrent
//! sessions each get exactly the target's output; a tenant cannot read, draft into or close
//! another's session, and its malformed messages get the documented statuses without changing
//! anyone else's output; a saturated verifier refuses with RESOURCE_EXHAUSTED and a retry hint; a
//! draining one finishes its sessions and refuses new ones.

mod common;

use std::time::Duration;

use common::*;
use tandem_cloud::tenants::Tenants;
use tandem_engine::{Engine, EngineConfig, SeqId};
use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{
    cloud_message, edge_message, CloudMessage, Draft, EdgeMessage, Open, SessionRef,
};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::VerifyRule;
use tandem_verifier::VerifierConfig;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tonic::{Code, Request, Status, Streaming};

const KEY_A: &str = "tenant-a-0123456789abcdef";
const KEY_B: &str = "tenant-b-0123456789abcdef";

fn tenants(extra: &str) -> Tenants {
    Tenants::from_toml(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n{extra}"
    ))
    .unwrap()
}

fn authorized<T>(msg: T, key: Option<&str>) -> Request<T> {
    let mut r = Request::new(msg);
    if let Some(k) = key {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {k}").parse().unwrap());
    }
    r
}

/// The target's greedy continuation of `prompt`, cut after its first end-of-generation token.
fn want(prompt: &[u32], n: usize, seq: u64) -> Vec<u32> {
    let (m, tok) = target();
    let mut e = Engine::new(
        m.clone(),
        EngineConfig {
            threads: 1,
            kv_budget_bytes: 32 << 20,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let out = greedy(&mut e, SeqId(seq), prompt, n);
    let cut = out
        .iter()
        .position(|&t| tok.is_eog(t))
        .map_or(out.len(), |i| i + 1);
    out[..cut].to_vec()
}

/// A session driven by hand over a raw stream.
struct Raw {
    out: UnboundedSender<EdgeMessage>,
    inbound: Streaming<CloudMessage>,
    session: u64,
    first: u32,
    start: usize,
    /// Tokens the verifier decoded and sent since Open.
    decoded: usize,
}

async fn open_raw(url: &str, key: Option<&str>, prompt: &[u32]) -> Result<Raw, Status> {
    let (_, tok) = target();
    let mut c = VerifierClient::connect(url.to_string()).await.unwrap();
    let (out, rx) = unbounded_channel();
    out.send(EdgeMessage {
        kind: Some(edge_message::Kind::Open(Open {
            protocol_version: tandem_proto::PROTOCOL_VERSION,
            tokenizer_fingerprint: tok.fingerprint().to_string(),
            prompt_ids: prompt.to_vec(),
            params: None,
            max_tokens: 400,
            rule: 0,
            want_draft_len: 4,
            want_depth: 2,
            want_side_nodes: 0,
        })),
    })
    .unwrap();
    let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
    let mut inbound = c.session(authorized(stream, key)).await?.into_inner();
    match inbound.message().await?.and_then(|m| m.kind) {
        Some(cloud_message::Kind::Opened(o)) => Ok(Raw {
            out,
            inbound,
            session: o.session_id,
            first: o.first_token,
            start: prompt.len() + 1,
            decoded: 0,
        }),
        other => panic!("expected Opened, got {other:?}"),
    }
}

impl Raw {
    fn draft(&self, d: Draft) {
        self.out
            .send(EdgeMessage {
                kind: Some(edge_message::Kind::Draft(d)),
            })
            .unwrap();
    }

    /// The next message: a decoded token (checked to come at the next position), a verdict or
    /// a refusal (its code and text).
    async fn message(&mut self) -> Result<Reply, (Code, String)> {
        match tokio::time::timeout(Duration::from_secs(60), self.inbound.message()).await {
            Ok(Ok(Some(CloudMessage {
                kind: Some(cloud_message::Kind::Decoded(d)),
            }))) => {
                assert_eq!(
                    d.position as usize,
                    self.start + self.decoded,
                    "each position once, in order"
                );
                self.decoded += 1;
                Ok(Reply::Decoded)
            }
            Ok(Ok(Some(CloudMessage {
                kind: Some(cloud_message::Kind::Verdict(v)),
            }))) => Ok(Reply::Verdict(v)),
            Ok(Ok(Some(CloudMessage {
                kind: Some(cloud_message::Kind::Error(e)),
            }))) => Err((Code::from_i32(e.code as i32), e.message)),
            Ok(Err(s)) => Err((s.code(), s.message().to_string())),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// The next verdict (Ok) or refusal, past the tokens the verifier decodes meanwhile.
    async fn next(&mut self) -> Result<tandem_proto::v1::Verdict, (Code, String)> {
        loop {
            if let Reply::Verdict(v) = self.message().await? {
                return Ok(v);
            }
        }
    }
}

/// What a raw session's next message was, past refusals.
enum Reply {
    Decoded,
    Verdict(tandem_proto::v1::Verdict),
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    let (_, tok) = target();
    let topics = [
        "the moon",
        "rivers",
        "honey bees",
        "volcanoes",
        "the piano",
        "glass",
        "owls",
        "tea",
        "bridges",
        "snow",
        "maps",
        "copper",
        "whales",
        "clocks",
        "deserts",
        "paper",
    ];
    topics
        .iter()
        .cycle()
        .take(n)
        .map(|t| {
            tok.encode_chat(&format!("Tell me one fact about {t}."))
                .unwrap()
        })
        .collect()
}

/// Sixteen edges, each with its own draft engine and gRPC stream, share one verifier: every one
/// commits exactly the target's greedy output, and the verifier batched them.
#[test]
fn sixteen_concurrent_sessions_each_get_the_targets_output() {
    let n = 16;
    let max_new = 24;
    let ps = prompts(n);
    let wants: Vec<Vec<u32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| want(p, max_new, i as u64))
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
    let ps = prompts(2);
    let max_new = 32;
    let want_a = want(&ps[0], max_new, 0);
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
    let p = &prompts(1)[0];
    let n = 24;
    let w = want(p, n, 1);
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

/// Admission: past the verifier's session limit, or a tenant's quota, a new session is refused
/// with RESOURCE_EXHAUSTED and a `retry-after-ms` trailer; a freed slot admits again.
#[test]
fn a_saturated_verifier_refuses_with_a_retry_hint() {
    let cfg = VerifierConfig {
        max_sessions: 2,
        ..VerifierConfig::default()
    };
    let (url, _) = grpc_server_with(32.0, false, tenants("max_sessions = 1"), cfg, 256 << 20);
    let p = &prompts(1)[0];
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

/// Shutdown drains: health turns NOT_SERVING, a new session is refused with UNAVAILABLE, an open
/// one keeps getting verdicts until it closes, and then the server stops.
/// A verifier served with `drain_timeout`: its url, the url of its plaintext health listener, the
/// trigger of its shutdown, and the server's result once it stops.
fn drainable_server(
    drain_timeout: Duration,
) -> (
    String,
    String,
    tokio::sync::oneshot::Sender<()>,
    std::sync::mpsc::Receiver<bool>,
) {
    let (m, tok) = target();
    let engine = Engine::new(
        m.clone(),
        EngineConfig {
            threads: 1,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let info = tandem_cloud::grpc::ServiceInfo::new("SmolLM2-135M-Instruct", m, tok);
    let cfg = VerifierConfig {
        load: tandem_cloud::grpc::serving_load(8, 4),
        ..VerifierConfig::default()
    };
    let (service, _batcher) =
        tandem_cloud::grpc::start(engine, cfg, info, Tenants::open()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done) = std::sync::mpsc::channel();
    let probes = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let probes_url = format!("http://{}", probes.local_addr().unwrap());
    probes.set_nonblocking(true).unwrap();
    let addr = on_loopback(move |l| async move {
        let r = tandem_cloud::grpc::serve_grpc_tls(
            service,
            l,
            async {
                let _ = stopped.await;
            },
            drain_timeout,
            None,
            Some(tokio::net::TcpListener::from_std(probes).unwrap()),
        )
        .await;
        done_tx.send(r.is_ok()).unwrap();
    });
    (format!("http://{addr}"), probes_url, stop, done)
}

#[test]
fn shutdown_drains_open_sessions_and_refuses_new_ones() {
    let (url, probes_url, stop, done) = drainable_server(Duration::from_secs(30));
    let p = &prompts(1)[0];
    let rt = rt();
    let mut s = rt.block_on(open_raw(&url, None, p)).unwrap();
    let client = |url: &str| {
        let ch = rt
            .block_on(
                tonic::transport::Endpoint::from_shared(url.to_string())
                    .unwrap()
                    .connect(),
            )
            .unwrap();
        tonic_health::pb::health_client::HealthClient::new(ch)
    };
    let (mut h, mut probe) = (client(&url), client(&probes_url));
    let ask = |h: &mut tonic_health::pb::health_client::HealthClient<_>, service: &str| {
        rt.block_on(h.check(tonic_health::pb::HealthCheckRequest {
            service: service.to_string(),
        }))
        .unwrap()
        .into_inner()
        .status
    };
    let mut health = || ask(&mut h, "");
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    assert_eq!(health(), serving);
    // The plaintext probe listener (Kubernetes' gRPC probes) answers the same.
    let liveness = tandem_cloud::grpc::LIVENESS;
    assert_eq!(ask(&mut probe, ""), serving);
    assert_eq!(ask(&mut probe, "tandem.v1.Verifier"), serving);
    assert_eq!(ask(&mut probe, liveness), serving);
    stop.send(()).unwrap();
    // The drain has begun once health says so (the service stops admitting before it does).
    let mut status = health();
    for _ in 0..200 {
        if status == not_serving {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        status = health();
    }
    assert_eq!(status, not_serving);
    // Draining: not ready (the Service stops sending sessions), still alive (no restart).
    assert_eq!(ask(&mut probe, ""), not_serving);
    assert_eq!(ask(&mut probe, "tandem.v1.Verifier"), not_serving);
    assert_eq!(ask(&mut probe, liveness), serving);
    let e = rt.block_on(open_raw(&url, None, p)).err().unwrap();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    // The open session is still served: its tokens keep coming.
    assert!(matches!(rt.block_on(s.message()), Ok(Reply::Decoded)));
    assert!(done.try_recv().is_err(), "the server waits for the session");
    s.out
        .send(EdgeMessage {
            kind: Some(edge_message::Kind::Close(Default::default())),
        })
        .unwrap();
    drop(s);
    assert!(done.recv_timeout(Duration::from_secs(10)).unwrap());
}

/// A session still open when the drain times out is ended by the verifier with UNAVAILABLE
/// (open it again on another replica), and then the server stops.
#[test]
fn a_drain_that_times_out_ends_open_sessions_with_unavailable() {
    let (url, _, stop, done) = drainable_server(Duration::from_millis(200));
    let rt = rt();
    let mut s = rt.block_on(open_raw(&url, None, &prompts(1)[0])).unwrap();
    stop.send(()).unwrap();
    let (code, msg) = rt.block_on(s.next()).unwrap_err();
    assert_eq!(code, Code::Unavailable, "{msg}");
    assert!(msg.contains("another replica"), "{msg}");
    drop(s);
    assert!(done.recv_timeout(Duration::from_secs(30)).unwrap());
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
    let w = want(&p, FLOW_WINDOW + 20, 1);
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
