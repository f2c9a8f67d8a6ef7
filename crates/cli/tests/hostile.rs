//! Hostile clients against a real verifier (tonic over loopback, the batcher and the target
//! behind it): each attack is refused or cut by a rule that does not depend on the clock, and
//! another tenant's stream completes while it is on.

mod common;

use std::time::Duration;

use common::*;
use tandem_proto::v1::{
    cloud_message, verifier_client::VerifierClient, CloudMessage, EdgeMessage, GenerateRequest,
    SparseDist, TokenProb,
};
use tokio_stream::wrappers::ReceiverStream;

use std::sync::Arc;
use tandem_bench::hostile::{frozen_peers, idle_sessions, slow_readers, Tally, Tenant};
use tokio::sync::watch;

fn open(prompt: &[u32], temperature: f32, rule: i32, max_tokens: u32) -> EdgeMessage {
    tandem_bench::hostile::open(
        target().1.fingerprint(),
        prompt,
        temperature,
        rule,
        max_tokens,
    )
}

/// A session opened with `open` on `c` (sending through a channel of `cap`), its `Opened`
/// read: the sender and the rest of the stream.
async fn opened(
    mut c: VerifierClient<tonic::transport::Channel>,
    open: EdgeMessage,
    cap: usize,
) -> (
    tokio::sync::mpsc::Sender<EdgeMessage>,
    tonic::Streaming<CloudMessage>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(cap);
    tx.send(open).await.unwrap();
    let mut s = c
        .session(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = s.message().await.unwrap().unwrap();
    assert!(matches!(first.kind, Some(cloud_message::Kind::Admitted(_))));
    let opened = s.message().await.unwrap().unwrap();
    assert!(matches!(opened.kind, Some(cloud_message::Kind::Opened(_))));
    (tx, s)
}

/// A cloud-only stream of `n` tokens another tenant would run: its token count.
async fn bystander(url: String, prompt: Vec<u32>, n: u32) -> usize {
    let t = Tenant {
        url,
        key: String::new(),
        fingerprint: target().1.fingerprint().to_string(),
        prompt,
    };
    t.answer(n).await.unwrap()
}

#[test]
fn a_flood_of_bad_drafts_from_a_client_that_never_reads_is_cut() {
    let (url, _) = new_grpc_server(1e9);
    let tok = &target().1;
    let prompt = tok.encode("The capital of France is").unwrap();
    let rt = rt();
    rt.block_on(async {
        let c = VerifierClient::connect(url.clone()).await.unwrap();
        let (tx, mut s) = opened(c, open(&prompt, 0.0, 1, 200), 20_000).await;
        // 10,000 drafts, each refused, and the client reads none of the refusals.
        let start = prompt.len() as u64 + 1;
        // (Once the verifier cuts the stream, the client cannot send more.)
        for _ in 0..10_000 {
            if tx
                .send(tandem_bench::hostile::draft(start, vec![999_999], vec![]))
                .await
                .is_err()
            {
                break;
            }
        }
        // Then it reads: a bounded number of refusals, and the stream is cut.
        let mut refusals = 0;
        let end = loop {
            match s.message().await {
                Ok(Some(CloudMessage {
                    kind: Some(cloud_message::Kind::Error(_)),
                })) => refusals += 1,
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without a status after {refusals} refusals"),
                Err(status) => break status,
            }
        };
        assert_eq!(
            refusals,
            tandem_cloud::grpc::BAD_MESSAGES,
            "refusals answered"
        );
        assert_eq!(end.code(), tonic::Code::ResourceExhausted, "{end:?}");
        assert!(end.message().contains("refused messages"), "{end:?}");
        drop(tx);
        // The verifier still serves others.
        assert_eq!(bystander(url, prompt, 8).await, 8);
    });
}

#[test]
fn an_oversized_q_is_refused_by_validation_and_another_tenants_stream_completes() {
    let (url, _) = new_grpc_server(1e9);
    let tok = &target().1;
    let prompt = tok.encode("Once upon a time").unwrap();
    let rt = rt();
    rt.block_on(async {
        let other = tokio::spawn(bystander(url.clone(), prompt.clone(), 24));
        let c = VerifierClient::connect(url.clone())
            .await
            .unwrap()
            .max_encoding_message_size(8 << 20);
        // Rejection sampling at temperature 0.8: the rule that reads q.
        let (tx, mut s) = opened(c, open(&prompt, 0.8, 3, 64), 16).await;
        // One entry repeated 100k times (0.9 MB, under the 1 MiB message limit; the attack
        // that stalled every tenant repeated it 360k times, which the limit now refuses).
        let entry = TokenProb {
            token: 5,
            prob: 1e-6,
        };
        let q = SparseDist {
            entries: vec![entry; 100_000],
        };
        let start = prompt.len() as u64 + 1;
        tx.send(tandem_bench::hostile::draft(start, vec![5], vec![q]))
            .await
            .unwrap();
        let refusal = loop {
            match s.message().await {
                Ok(Some(CloudMessage {
                    kind: Some(cloud_message::Kind::Error(e)),
                })) => break e,
                Ok(Some(_)) => {}
                other => panic!("expected a refusal, got {other:?}"),
            }
        };
        assert_eq!(refusal.code, tonic::Code::InvalidArgument as u32);
        assert!(
            refusal.message.starts_with("draft.q") && refusal.message.contains("at most 256"),
            "{}",
            refusal.message
        );
        drop(tx);
        assert_eq!(
            other.await.unwrap(),
            24,
            "the other tenant's stream completes"
        );
    });
}

#[test]
fn streams_that_never_open_are_cut_by_the_open_deadline_and_big_messages_by_the_size_limit() {
    let v = verifier(&["--open-deadline-ms", "500"]);
    let url = format!("http://127.0.0.1:{}", v.port);
    let tok = &target().1;
    let rt = rt();
    rt.block_on(async {
        // 300 session streams on one connection, none of which ever sends Open (more than the
        // 256 streams a connection may hold at once: the rest wait their turn).
        let c = VerifierClient::connect(url.clone()).await.unwrap();
        let mut silent = Vec::new();
        let mut keep = Vec::new();
        for _ in 0..300 {
            let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(1);
            keep.push(tx);
            let mut c = c.clone();
            silent.push(tokio::spawn(async move {
                c.session(ReceiverStream::new(rx)).await.map(|_| ())
            }));
        }
        let other = tokio::spawn(bystander(url.clone(), tok.encode("Hello").unwrap(), 8));
        for h in silent {
            // Each ends with the server's deadline, while this client still holds it open.
            let e = h.await.unwrap().unwrap_err();
            assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
            assert!(e.message().contains("no Open within 500 ms"), "{e:?}");
        }
        drop(keep);
        assert_eq!(
            other.await.unwrap(),
            8,
            "the other tenant's stream completes"
        );

        // A message past the 1 MiB limit is refused before it is decoded (an Open with 400k
        // prompt ids of three bytes each, 1.2 MB, which tonic's default 4 MiB would have let
        // through to validation).
        let mut c = VerifierClient::connect(url.clone())
            .await
            .unwrap()
            .max_encoding_message_size(8 << 20);
        let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(1);
        tx.send(open(&vec![40_000; 400_000], 0.0, 1, 8))
            .await
            .unwrap();
        let e = match c.session(ReceiverStream::new(rx)).await {
            Ok(mut s) => s.get_mut().message().await.unwrap_err(),
            Err(e) => e,
        };
        assert!(
            e.message().contains("too large") || e.message().contains("length"),
            "{e:?}"
        );
        assert_ne!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    });
}

#[test]
fn a_drain_ends_even_when_streams_never_open_or_a_client_stops_reading() {
    // An Open deadline far past the drain's: only the drain's own deadline can end it.
    let mut v = verifier(&["--drain-timeout-s", "1", "--open-deadline-ms", "600000"]);
    let url = format!("http://127.0.0.1:{}", v.port);
    let tok = &target().1;
    let rt = rt();
    let held = rt.block_on(async {
        let mut c = VerifierClient::connect(url).await.unwrap();
        let mut s = c
            .generate(GenerateRequest {
                tokenizer_fingerprint: tok.fingerprint().to_string(),
                prompt_ids: tok.encode("Once upon a time").unwrap(),
                params: None,
                max_tokens: 4000,
                grammar: None,
                self_draft: false,
            })
            .await
            .unwrap()
            .into_inner();
        // One token read, then never another.
        assert!(s.message().await.unwrap().is_some());
        // A session stream that never sends Open.
        let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(1);
        let mut c2 = c.clone();
        let silent =
            tokio::spawn(async move { c2.session(ReceiverStream::new(rx)).await.map(|_| ()) });
        (s, tx, silent)
    });
    std::thread::sleep(Duration::from_secs(1));
    let pid = v.child.id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    // The verifier exits while this client still holds both streams open (the old drain waited
    // for them: this wait did not end).
    let status = v.child.wait().unwrap();
    assert!(status.success(), "{status}");
    drop(held);
}

#[test]
fn sessions_whose_edge_neither_sends_nor_reads_are_closed_when_idle() {
    let v = verifier(&["--idle-timeout-s", "1", "--metrics-listen", "127.0.0.1:0"]);
    let url = format!("http://127.0.0.1:{}", v.port);
    let tok = &target().1;
    let prompt = tok.encode("The capital of France is").unwrap();
    let rt = rt();
    rt.block_on(async {
        // 40 sessions opened, then left alone: no blocks, no acks, nothing read.
        let c = VerifierClient::connect(url.clone()).await.unwrap();
        let mut held = Vec::new();
        for _ in 0..40 {
            let mut c = c.clone();
            let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(4);
            tx.send(open(&prompt, 0.0, 1, 2000)).await.unwrap();
            let s = c
                .session(ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            held.push((tx, s));
        }
        // Each is closed for idleness: its stream ends with the reason.
        for (_tx, mut s) in held {
            let end = loop {
                match s.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => panic!("ended without a status"),
                    Err(status) => break status,
                }
            };
            assert_eq!(end.code(), tonic::Code::DeadlineExceeded, "{end:?}");
            assert!(end.message().starts_with("idle"), "{end:?}");
        }
        // The verifier serves others as before, and holds nothing once that answer is done
        // (the gauge is set at the batcher's next turn).
        assert_eq!(bystander(url, prompt, 8).await, 8);
        until("nothing running", || running(&v) == 0.0).await;
    });
}

/// The verifier's /metrics text.
fn metrics_of(port: u16) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut s = String::new();
    c.read_to_string(&mut s).unwrap();
    s
}

/// A verifier process with two tenants, `victim` and `attacker` (and `extra` flags), and each
/// as a client of it.
fn two_tenants(extra: &[&str]) -> (Proc, Tenant, Tenant) {
    let dir = scratch("two-tenants");
    let file = dir.join("tenants.toml");
    std::fs::write(
        &file,
        "[[tenant]]\nname = \"victim\"\nkeys = [\"victim-key-0123456789\"]\n\n\
         [[tenant]]\nname = \"attacker\"\nkeys = [\"attacker-key-0123456789\"]\n",
    )
    .unwrap();
    let mut args = vec![
        "--tenants",
        file.to_str().unwrap(),
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let v = verifier(&args);
    let tok = &target().1;
    let tenant = |key: &str, text: &str| Tenant {
        url: format!("http://127.0.0.1:{}", v.port),
        key: key.to_string(),
        fingerprint: tok.fingerprint().to_string(),
        prompt: tok.encode(text).unwrap(),
    };
    let victim = tenant("victim-key-0123456789", "Once upon a time");
    let attacker = tenant("attacker-key-0123456789", "The capital of France is");
    (v, victim, attacker)
}

/// Requests the verifier is running, from its metrics.
fn running(v: &Proc) -> f64 {
    let m = metrics_of(v.also_port.unwrap());
    metric(&m, "tandem:num_requests_running").expect("the running gauge")
}

/// Poll `ok` (a wait that never ends is a hung test, not a clock's verdict).
async fn until(what: &str, mut ok: impl FnMut() -> bool) {
    for polls in 1u64.. {
        if ok() {
            return;
        }
        if polls % 100 == 0 {
            eprintln!("still waiting: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn eleven_hundred_idle_sessions_take_only_their_tenants_share() {
    let (_v, victim, attacker) = two_tenants(&[]);
    let rt = rt();
    rt.block_on(async {
        let tally = Arc::new(Tally::default());
        let (stop_tx, stop) = watch::channel(false);
        let (t, a) = (tally.clone(), attacker.clone());
        let attack = tokio::spawn(async move { idle_sessions(&a, 1100, &t, stop).await });
        until("every Open is answered", || {
            Tally::get(&tally.opened) + Tally::get(&tally.refused) == 1100
        })
        .await;
        let (opened, refused) = (Tally::get(&tally.opened), Tally::get(&tally.refused));
        eprintln!("attacker: {opened} sessions opened, {refused} refused");
        // Past half the verifier's 1,024 sessions a tenant at its share is refused: the
        // attacker holds at most its half, and the other tenant is served while it does.
        assert!(opened <= 1024 / 2 + 1, "{opened} opened");
        assert_eq!(victim.answer(8).await.unwrap(), 8);
        stop_tx.send(true).unwrap();
        attack.await.unwrap().unwrap();
    });
}

#[test]
fn a_peer_that_freezes_mid_session_is_dropped_by_keepalive() {
    // An idle timeout far past the keepalive's: only the pings can find the frozen peers.
    let (v, victim, attacker) = two_tenants(&["--idle-timeout-s", "600"]);
    let rt = rt();
    rt.block_on(async {
        let tally = Arc::new(Tally::default());
        let (stop_tx, stop) = watch::channel(false);
        let (t, a) = (tally.clone(), attacker.clone());
        let attack = tokio::spawn(async move { frozen_peers(&a, 10, &t, stop).await });
        until("ten sessions open", || Tally::get(&tally.opened) == 10).await;
        assert_eq!(victim.answer(8).await.unwrap(), 8);
        // The proxy holds every socket open and forwards nothing: the verifier's HTTP/2 pings
        // go unanswered, and it drops the connections and frees the sessions.
        until("the frozen sessions are freed", || running(&v) == 0.0).await;
        assert!(
            !attack.is_finished(),
            "the attacker still holds its sockets"
        );
        stop_tx.send(true).unwrap();
        attack.await.unwrap().unwrap();
    });
}

#[test]
fn a_client_that_reads_a_byte_a_second_does_not_hold_the_verifier() {
    let (v, victim, attacker) = two_tenants(&[]);
    let rt = rt();
    rt.block_on(async {
        let tally = Arc::new(Tally::default());
        let (stop_tx, stop) = watch::channel(false);
        let (t, a) = (tally.clone(), attacker.clone());
        let attack = tokio::spawn(async move { slow_readers(&a, 2, 300, &t, stop).await });
        until("two slow streams open", || Tally::get(&tally.opened) == 2).await;
        assert_eq!(victim.answer(8).await.unwrap(), 8);
        // The verifier finishes both answers and lets them go (what is unread waits in the
        // connection's bounded windows), while the readers have had only a trickle.
        until("the slow answers are done on the verifier", || {
            running(&v) == 0.0
        })
        .await;
        let read = Tally::get(&tally.tokens);
        assert!(read < 2 * 300, "{read} tokens read");
        stop_tx.send(true).unwrap();
        attack.await.unwrap().unwrap();
    });
}

/// Forwards of more than `tokens` tokens so far (a bucket's bound: 1, 2, 4, … 512), from the
/// verifier's metrics.
fn forwards_over(v: &Proc, tokens: u32) -> f64 {
    let m = metrics_of(v.also_port.unwrap());
    let value =
        |series: &str| metric(&m, series).unwrap_or_else(|| panic!("{series} in the metrics"));
    value("tandem:iteration_tokens_total_count")
        - value(&format!(
            "tandem:iteration_tokens_total_bucket{{le=\"{tokens}\"}}"
        ))
}

#[test]
fn while_another_tenant_decodes_no_forward_passes_the_contended_budget() {
    // The test verifier's forward cost (40 ms alone, 2 ms a token past the ridge): within 100%
    // of a lone token's forward, 20 tokens to start with, and fewer once the forwards show that
    // 20 one-token sessions take longer on this machine; the token budget is 64.
    // (Quiet sessions stay in the foreground here: what is tested is the contended budget.)
    let (v, victim, attacker) = two_tenants(&["--tenant-slowdown-pct", "100", "--quiet-ms", "0"]);
    let rt = rt();
    rt.block_on(async {
        let tally = Arc::new(Tally::default());
        let (stop_tx, stop) = watch::channel(false);
        let (t, a) = (tally.clone(), attacker.clone());
        // Sixty sessions the verifier decodes on its own, up to the flow window each: alone,
        // their tenant fills every forward to the token budget.
        let attack = tokio::spawn(async move { idle_sessions(&a, 60, &t, stop).await });
        until("sixty sessions open", || Tally::get(&tally.opened) == 60).await;
        until("the attacker's forwards fill the budget", || {
            forwards_over(&v, 32) > 0.0
        })
        .await;
        // From the victim's second token (its session is open and decoding) to its last but
        // one, no forward is larger than the contended budget.
        victim_streams_while(&victim, || forwards_over(&v, 32), "more than 32 tokens").await;
        assert_eq!(Tally::get(&tally.refused), 0);
        stop_tx.send(true).unwrap();
        attack.await.unwrap().unwrap();
    });
}

/// Speculation sessions whose edge says nothing go to the background once quiet (`--quiet-ms`,
/// here 300): while another tenant's stream decodes, every forward is that stream's one token
/// (none of the forty quiet sessions' decoding or prefill joins it); an edge that speaks (an
/// ack) brings its session back to the foreground.
#[test]
fn quiet_speculation_sessions_never_join_another_tenants_forwards() {
    let (v, victim, attacker) = two_tenants(&["--quiet-ms", "300"]);
    let quiet = || metric(&metrics_of(v.also_port.unwrap()), "tandem:quiet_sessions");
    let rt = rt();
    rt.block_on(async {
        let mut held = Vec::new();
        for _ in 0..40 {
            let c = attacker.client().await.unwrap();
            let (tx, s) = opened_as(&attacker, c, open(&attacker.prompt, 0.0, 1, 2000)).await;
            held.push((tx, s));
        }
        until("forty quiet sessions", || quiet() == Some(40.0)).await;
        // From the victim's second token to its last but one, every forward is its own.
        victim_streams_while(&victim, || forwards_over(&v, 1), "more than its one token").await;
        // The first session's edge speaks (an ack every 100 ms): back in the foreground.
        let tx = held[0].0.clone();
        let committed = attacker.prompt.len() as u64 + 1;
        let speaks = tokio::spawn(async move {
            loop {
                let ack = tandem_proto::v1::Ack { committed };
                let m = EdgeMessage {
                    kind: Some(tandem_proto::v1::edge_message::Kind::Ack(ack)),
                };
                if tx.send(m).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        until("thirty-nine quiet sessions", || quiet() == Some(39.0)).await;
        speaks.abort();
    });
}

/// [`opened`] with `t`'s key.
async fn opened_as(
    t: &Tenant,
    mut c: VerifierClient<tonic::transport::Channel>,
    open: EdgeMessage,
) -> (
    tokio::sync::mpsc::Sender<EdgeMessage>,
    tonic::Streaming<CloudMessage>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(4);
    tx.send(open).await.unwrap();
    let mut s = c
        .session(t.request(ReceiverStream::new(rx)))
        .await
        .unwrap()
        .into_inner();
    loop {
        let m = s.message().await.unwrap().unwrap();
        match m.kind {
            Some(cloud_message::Kind::Admitted(_)) => continue,
            Some(cloud_message::Kind::Opened(_)) => break,
            other => panic!("not opened: {other:?}"),
        }
    }
    (tx, s)
}

/// The victim streams a cloud-only answer of 40 tokens; from its second token (its session open
/// and decoding) to its last but one, `count` (forwards of some kind so far) does not move.
async fn victim_streams_while(victim: &Tenant, count: impl Fn() -> f64, what: &str) {
    let mut c = victim.client().await.unwrap();
    let mut s = c
        .generate(victim.request(victim.generate(40)))
        .await
        .unwrap()
        .into_inner();
    let (mut got, mut before) = (0, None);
    while let Some(m) = s.message().await.unwrap() {
        got += m.tokens.len();
        if got >= 2 && before.is_none() {
            before = Some(count());
        }
        if got == 39 {
            assert_eq!(
                count(),
                before.unwrap(),
                "a forward of {what} ran while the victim decoded"
            );
        }
    }
    assert_eq!(got, 40);
}
