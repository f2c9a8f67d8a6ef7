//! The verifier server's life on SmolLM2, served in-process on a loopback port: the standard health
//! service answers, and a client that hangs up stops costing forwards and KV blocks; a shutdown
//! drains (health NOT_SERVING, new sessions refused, open ones served to their end) and a drain
//! that times out ends the sessions left with UNAVAILABLE; a batcher that fails stops the server
//! instead of leaving it to answer every RPC UNAVAILABLE. The model is pulled on first use.

mod common;

use std::time::Duration;

use common::*;
use tandem_cloud::tenants::Tenants;
use tandem_engine::{Engine, EngineConfig};
use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{edge_message, EdgeMessage, SamplingParams};
use tandem_verifier::VerifierConfig;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

/// The standard health service answers; a client that hangs up in the middle of a cloud-only
/// generation or a speculation session stops costing the verifier forwards and KV blocks.
#[test]
fn grpc_health_and_hung_up_clients_are_freed() {
    use tandem_proto::v1::verifier_client::VerifierClient;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let (_, tok) = target();
    let url = new_grpc_server(tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS).0;
    let rt = tandem_testkit::rt();
    let p = tok
        .encode_chat("Write a long story about a dragon and a knight.")
        .unwrap();
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut h = HealthClient::new(ch.clone());
        for service in ["", "tandem.v1.Verifier"] {
            let r = h
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
        }
        let unknown = h
            .check(HealthCheckRequest {
                service: "tandem.v9.Nope".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound);

        let mut c = VerifierClient::new(ch);
        let load = |mut c: VerifierClient<tonic::transport::Channel>| async move {
            let r = c
                .info(tandem_proto::v1::InfoRequest {})
                .await
                .unwrap()
                .into_inner();
            r.load.unwrap()
        };
        let mut s = c
            .generate(tandem_proto::v1::GenerateRequest {
                tokenizer_fingerprint: tok.fingerprint().to_string(),
                prompt_ids: p.clone(),
                params: None,
                max_tokens: 500,
                grammar: None,
                self_draft: false,
            })
            .await
            .unwrap()
            .into_inner();
        for _ in 0..3 {
            s.message().await.unwrap().unwrap();
        }
        let busy = load(c.clone()).await;
        assert_eq!(busy.generations, 1, "{busy:?}");
        assert!(busy.kv_blocks_used > 0, "{busy:?}");
        drop(s);
        let mut freed = None;
        for _ in 0..100 {
            let l = load(c.clone()).await;
            if l.generations == 0 && l.kv_blocks_used == 0 {
                freed = Some(l);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let freed = freed.expect("the hung-up generation was not freed within 5 s");
        // It stopped well short of the 500 tokens asked for.
        assert!(
            freed.target_forwards < busy.target_forwards + 100,
            "{busy:?} -> {freed:?}"
        );
    });
}

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

/// Shutdown drains: health turns NOT_SERVING, a new session is refused with UNAVAILABLE, an open
/// one keeps getting verdicts until it closes, and then the server stops.
#[test]
fn shutdown_drains_open_sessions_and_refuses_new_ones() {
    let (url, probes_url, stop, done) = drainable_server(Duration::from_secs(30));
    let p = &fact_prompts(1)[0];
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
    let mut s = rt
        .block_on(open_raw(&url, None, &fact_prompts(1)[0]))
        .unwrap();
    stop.send(()).unwrap();
    let (code, msg) = rt.block_on(s.next()).unwrap_err();
    assert_eq!(code, Code::Unavailable, "{msg}");
    assert!(msg.contains("another replica"), "{msg}");
    drop(s);
    assert!(done.recv_timeout(Duration::from_secs(30)).unwrap());
}

#[test]
fn a_failed_batcher_stops_the_server_instead_of_answering_every_rpc_unavailable() {
    use std::sync::Arc;
    let (m, tok) = target();
    let info = tandem_cloud::grpc::ServiceInfo::new("SmolLM2-135M-Instruct", m, tok);
    // The batcher fails on its first message (a fault: the thread panics).
    let (tx, rx) = std::sync::mpsc::channel::<tandem_cloud::ToCloud>();
    let batcher = std::thread::spawn(move || {
        let _ = rx.recv();
        panic!("a fault in the batcher");
    });
    let service = tandem_cloud::grpc::Service::new(
        tx,
        info,
        tandem_cloud::grpc::serving_load(8, 4),
        Arc::new(tandem_cloud::Gauges::default()),
        Arc::new(tandem_cloud::tenants::Tenants::open()),
    );
    let (failure, watcher) = tandem_cloud::grpc::batcher_failure(batcher, service.draining());
    let rt = rt();
    let why = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let why = Arc::new(std::sync::Mutex::new(String::new()));
        let record = why.clone();
        let shutdown = async move {
            *record.lock().unwrap() = failure.await;
        };
        let server = tokio::spawn(tandem_cloud::grpc::serve_grpc_tls(
            service,
            listener,
            shutdown,
            Duration::from_secs(30),
            None,
            None,
        ));
        // A session reaches the batcher, which fails: the session is refused, and the server
        // stops (its health NOT_SERVING first) rather than answering UNAVAILABLE forever.
        let c = VerifierClient::connect(url.clone()).await.unwrap();
        let prompt = target().1.encode("Hello").unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(4);
        let params = SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
        };
        let open = open_message(target().1.fingerprint(), &prompt, Some(params), 1, 8);
        tx.send(open).await.unwrap();
        let mut c2 = c.clone();
        assert!(c2.session(ReceiverStream::new(rx)).await.is_err());
        // The server stops while this client still holds its connection.
        server.await.unwrap().unwrap();
        assert!(
            VerifierClient::connect(url).await.is_err(),
            "nothing listens any more"
        );
        let w = why.lock().unwrap().clone();
        w
    });
    assert!(
        why.contains("the batcher panicked: a fault in the batcher"),
        "{why}"
    );
    watcher.join().unwrap();
}

/// A speculation session whose edge goes quiet is closed by the verifier core at its idle
/// timeout, through the in-process service: the edge reads (the tokens the verifier decodes
/// alone, up to the flow window) but sends nothing, and its stream ends with DEADLINE_EXCEEDED
/// naming idleness about the timeout after `Opened`; the verifier then holds no session.
#[test]
fn a_quiet_session_is_closed_by_the_core_at_its_idle_timeout() {
    let cfg = VerifierConfig {
        load: tandem_verifier::LoadConfig {
            idle_timeout_ms: Some(700),
            ..tandem_verifier::LoadConfig::FIXED
        },
        ..VerifierConfig::default()
    };
    let (url, gauges) = grpc_server_with(
        tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS,
        false,
        Tenants::open(),
        cfg,
        256 << 20,
    );
    let (_, tok) = target();
    let prompt = tok.encode("The capital of France is").unwrap();
    tandem_testkit::rt().block_on(async {
        let mut raw = tandem_testkit::session::open_raw(&url, None, &prompt)
            .await
            .unwrap();
        let opened = std::time::Instant::now();
        let (code, message) = loop {
            match raw.message().await {
                Ok(_) => continue,
                Err(end) => break end,
            }
        };
        let after = opened.elapsed();
        assert_eq!(code, Code::DeadlineExceeded, "{message}");
        assert!(
            message.starts_with("idle: nothing from the edge in 0.7 s"),
            "{message}"
        );
        assert!(
            after >= Duration::from_millis(600) && after < Duration::from_secs(5),
            "closed {after:?} after Opened"
        );
        assert!(
            raw.decoded > 0,
            "the verifier decoded while the edge was quiet"
        );
        let t0 = std::time::Instant::now();
        while gauges.sessions.load(std::sync::atomic::Ordering::Relaxed) != 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the session is still held"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}
