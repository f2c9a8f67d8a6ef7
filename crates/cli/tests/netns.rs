//! The edge and the verifier on two hosts: network namespaces joined by a veth pair, its rate and
//! loss from the kernel (tbf, nftables `numgen random`), its delay from the project's proxy
//! (`tandem netem`, in the cloud's namespace in front of the verifier). Speculation and cloud-only generation over it give the target's
//! greedy tokens, through real packet loss that TCP repairs. Needs root, iproute2 and nftables
//! (`.ci/run` installs them); elsewhere it skips and says why.

mod common;

use common::*;
use serde_json::Value;
use tandem_bench::netns::{unavailable, KernelLink, Netns, Side};
use tandem_engine::SeqId;

#[test]
fn speculation_between_two_network_namespaces_with_rate_limit_and_loss_is_lossless() {
    if let Some(why) = unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let link = KernelLink {
        rate_kbit: 8_000,
        loss_pct: 3.0,
    };
    let net = Netns::create(&format!("t{}", std::process::id() % 100_000), link).unwrap();
    // The verifier in the cloud's namespace, on its loopback (no keys: nothing outside the
    // namespace reaches it), and the project's proxy in front of it on the cloud's end of the
    // veth, adding the round trip.
    let mut cmd = net.command(Side::Cloud, env!("CARGO_BIN_EXE_tandem"));
    cmd.args(["cloud", "serve", "--forward-cost", "40,2", "--threads", "1"])
        .args(["--no-ledger", "--no-auth", "--listen", "127.0.0.1:0"]);
    let v = spawn_ready(cmd, "tandem verifier listening on ", None)
        .unwrap_or_else(|e| panic!("the verifier did not start in its namespace: {e}"));
    let mut cmd = net.command(Side::Cloud, env!("CARGO_BIN_EXE_tandem"));
    cmd.args(["netem", "--listen", &format!("{}:0", net.cloud_ip)])
        .args([
            "--upstream",
            &format!("127.0.0.1:{}", v.port),
            "--rtt-ms",
            "40",
        ]);
    let proxy = spawn_ready(cmd, "netem ", None)
        .unwrap_or_else(|e| panic!("the proxy did not start in the cloud's namespace: {e}"));
    let url = format!("http://{}:{}", net.cloud_ip, proxy.port);

    let (m, tok) = target();
    let prompt = "The history of the printing press begins in";
    let prompt_ids = tok.encode(prompt).unwrap();
    const N: usize = 24;
    let want = greedy(&mut engine(m), SeqId(3), &prompt_ids, N);
    let cut = want
        .iter()
        .position(|&t| tok.is_eog(t))
        .map_or(want.len(), |i| i + 1);
    // The edge in its namespace: speculation, then cloud-only, through the kernel's rate limit
    // and loss and the proxy's 40 ms. The loss is a random draw over the packets sent: one round
    // of the two modes sends about a hundred, so at 3% a round drops none about one time in
    // twenty (a CI run saw (0, 0)). The rounds go on, each checked, until the kernel has dropped
    // a packet, at most eight of them (all eight dropping none: about one time in 10^10).
    let mut dropped = (None, None);
    for round in 0..8 {
        for mode in ["async", "cloud-only"] {
            let mut edge = net.command(Side::Edge, env!("CARGO_BIN_EXE_tandem"));
            edge.args(["generate", "--model", "draft", "--mode", mode])
                .args(["--cloud", &url])
                .args(["--prompt", prompt, "--json"])
                .args(["--max-tokens", &N.to_string()]);
            let out: Value = serde_json::from_slice(&stdout_of(mode, &mut edge)).unwrap();
            assert_eq!(
                ids(&out["output_ids"]),
                want[..cut],
                "{mode} between two namespaces, round {round}"
            );
        }
        dropped = (net.dropped(Side::Edge), net.dropped(Side::Cloud));
        eprintln!("round {round}: packets dropped (edge, cloud): {dropped:?}");
        assert!(dropped.0.is_some() && dropped.1.is_some(), "{dropped:?}");
        if dropped.0.unwrap_or(0) + dropped.1.unwrap_or(0) > 0 {
            break;
        }
    }
    // The kernel dropped packets, and TCP carried the answers through.
    let total = dropped.0.unwrap_or(0) + dropped.1.unwrap_or(0);
    assert!(total > 0, "no packet dropped in eight rounds: {dropped:?}");
    // Nothing reaches the cloud from outside the two namespaces: the root one has no route.
    let addr = std::net::SocketAddr::from((net.cloud_ip, proxy.port));
    assert!(
        std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(500)).is_err(),
        "reached from the root namespace"
    );
    drop((proxy, v));
}
