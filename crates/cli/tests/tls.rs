//! TLS on the link, against real processes: `tandem cloud serve --tls-cert --tls-key` with
//! tenants, and `tandem generate --cloud https://… --tls-ca` as the edge. The certificates are
//! made here (rcgen): a CA, and the verifier's certificate for `localhost` signed by it.
//! Speculation through TLS commits the target's greedy output; a plaintext client, and a client
//! that trusts another CA, are refused; a verifier with tenants off loopback refuses to start
//! without TLS unless told a proxy terminates it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use serde_json::Value;
use tandem_engine::SeqId;

const KEY: &str = "tk-tls-test-key-0123";

fn tenants(dir: &Path) -> PathBuf {
    let p = dir.join("tenants.toml");
    std::fs::write(
        &p,
        format!("[[tenant]]\nname = \"a\"\nkeys = [\"{KEY}\"]\n"),
    )
    .unwrap();
    p
}

fn generate(cloud: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "generate",
            "--model",
            "draft",
            "--mode",
            "async",
            "--cloud",
            cloud,
            "--chat",
            "--prompt",
            "Name three colours.",
            "--max-tokens",
            "12",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn speculation_over_tls_is_the_targets_and_plaintext_or_a_wrong_ca_is_refused() {
    model_path();
    draft_path();
    let dir = std::env::temp_dir().join(format!("tandem-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, cert, key) = certificates(&dir, "right");
    let (other_ca, _, _) = certificates(&dir, "other");
    let tenants = tenants(&dir);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let mut verifier = try_verifier(&[
        "--tenants",
        &s(&tenants),
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &s(&cert),
        "--tls-key",
        &s(&key),
    ])
    .unwrap_or_else(|said| panic!("the verifier did not start: {said}"));
    let port = verifier.port;

    // The edge through TLS: the target's greedy output, token for token.
    let (m, tok) = target();
    let prompt = tok.encode_chat("Name three colours.").unwrap();
    let want = greedy(&mut engine(m), SeqId(1), &prompt, 12);
    let cut = want
        .iter()
        .position(|&t| tok.is_eog(t))
        .map_or(want.len(), |i| i + 1);
    let url = format!("https://localhost:{port}");
    let out = generate(&url, &["--tls-ca", &s(&ca), "--api-key", KEY]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids(&v["output_ids"]), want[..cut], "through TLS");

    // A plaintext client at the TLS port, a client trusting another CA, and a CA with an
    // http:// URL are refused, each with a reason.
    let plain = generate(&format!("http://127.0.0.1:{port}"), &["--api-key", KEY]);
    let e = String::from_utf8_lossy(&plain.stderr);
    assert!(
        !plain.status.success() && e.contains("try https://"),
        "a plaintext client: {e}"
    );
    let wrong = generate(&url, &["--tls-ca", &s(&other_ca), "--api-key", KEY]);
    assert!(
        !wrong.status.success(),
        "a client trusting another CA got through"
    );
    let e = String::from_utf8_lossy(&wrong.stderr);
    assert!(
        e.contains("certificate") || e.contains("Certificate"),
        "{e}"
    );
    let mixed = generate(
        &format!("http://127.0.0.1:{port}"),
        &["--tls-ca", &s(&ca), "--api-key", KEY],
    );
    let e = String::from_utf8_lossy(&mixed.stderr);
    assert!(
        !mixed.status.success() && e.contains("not an https:// URL"),
        "{e}"
    );
    verifier.kill();

    // Tenants off loopback: no start without TLS, unless a proxy is said to terminate it.
    let said = try_verifier(&["--tenants", &s(&tenants), "--listen", "0.0.0.0:0"])
        .map(|_| panic!("started without TLS off loopback"))
        .unwrap_err();
    assert!(said.starts_with("exited with exit status: 1"), "{said}");
    assert!(
        said.contains("needs TLS") && said.contains("--tls-cert"),
        "{said}"
    );
    let proxied = try_verifier(&[
        "--tenants",
        &s(&tenants),
        "--listen",
        "0.0.0.0:0",
        "--insecure-behind-proxy",
    ])
    .unwrap_or_else(|said| panic!("behind a proxy it starts: {said}"));
    drop(proxied);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The certificate everyone makes first (`openssl req -x509` marks it a CA) is refused at
/// start-up, naming the problem and a command that makes one that works, instead of every edge
/// failing later with rustls's `CaUsedAsEndEntity`; a self-signed one that is not a CA starts.
#[test]
fn a_ca_certificate_as_the_verifiers_own_is_refused_at_start_up() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let dir = scratch("tls-ca-own");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let write = |name: &str, ca: bool| {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        params.is_ca = match ca {
            true => IsCa::Ca(BasicConstraints::Unconstrained),
            false => IsCa::ExplicitNoCa,
        };
        let cert = params.self_signed(&key).unwrap();
        let (c, k) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}-key.pem")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (s(&c), s(&k))
    };
    let (cert, key) = write("ca", true);
    let said = try_verifier(&["--tls-cert", &cert, "--tls-key", &key])
        .map(|_| panic!("a CA certificate was taken as the verifier's own"))
        .unwrap_err();
    assert!(
        said.contains("is a CA certificate")
            && said.contains("CaUsedAsEndEntity")
            && said.contains("basicConstraints=critical,CA:FALSE"),
        "{said}"
    );
    let (cert, key) = write("server", false);
    let v = try_verifier(&["--tls-cert", &cert, "--tls-key", &key])
        .unwrap_or_else(|said| panic!("a server certificate was refused: {said}"));
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tandem cloud cert` makes what a self-hosted verifier needs: a CA and a server certificate it
/// signs (keys readable by their owner alone); the verifier serves with them and an edge that
/// trusts the CA speculates through them; a second run overwrites nothing. `tandem serve` checks
/// the certificate at start-up.
#[test]
fn cloud_cert_makes_a_ca_and_a_certificate_that_work() {
    model_path();
    draft_path();
    let dir = scratch("tls-cloud-cert");
    let out = dir.join("certs");
    let cert = || {
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["cloud", "cert", "--out", out.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let made = cert();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    #[cfg(unix)]
    for k in ["ca-key.pem", "server-key.pem"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(out.join(k)).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{k} is readable by others: {mode:o}");
    }
    let before = std::fs::read(out.join("server.pem")).unwrap();
    let again = cert();
    let e = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && e.contains("not overwriting"),
        "{e}"
    );
    assert_eq!(std::fs::read(out.join("server.pem")).unwrap(), before);
    let s = |f: &str| out.join(f).to_str().unwrap().to_string();
    let v = try_verifier(&[
        "--tls-cert",
        &s("server.pem"),
        "--tls-key",
        &s("server-key.pem"),
    ])
    .unwrap_or_else(|said| panic!("the verifier did not start: {said}"));
    for host in ["localhost", "127.0.0.1"] {
        let url = format!("https://{host}:{}", v.port);
        let o = generate(&url, &["--tls-ca", &s("ca.pem")]);
        assert!(
            o.status.success(),
            "{host}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }

    // `tandem serve` checks its --tls-ca and the verifier's certificate at start-up: trusted, it
    // says so and serves; anything else stops it before it listens, naming what is wrong.
    let url = format!("https://localhost:{}", v.port);
    let serve = |ca: Option<&str>, cloud: &str| {
        let mut args: Vec<String> = [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
            "--kv-mb",
            "64",
            "--cloud",
            cloud,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(ca) = ca {
            args.extend(["--tls-ca".to_string(), ca.to_string()]);
        }
        spawn_tandem(&args, "tandem serve listening on ", None)
    };
    let e = serve(Some(&s("ca.pem")), &url)
        .unwrap_or_else(|said| panic!("an edge trusting the CA did not start: {said}"));
    assert!(
        e.log()
            .contains(&format!("verifier {url}: certificate trusted")),
        "{}",
        e.log()
    );
    drop(e);
    let refused = |ca: Option<&str>, cloud: &str, why: &str| {
        let said = serve(ca, cloud)
            .map(|_| panic!("{why}: the edge started"))
            .unwrap_err();
        assert!(said.starts_with("exited with exit status: 1"), "{said}");
        said
    };
    // Another CA; the public roots alone; the CA's key in place of its certificate; no PEM.
    let (other_ca, _, _) = certificates(&dir, "other");
    let said = refused(Some(other_ca.to_str().unwrap()), &url, "another CA");
    assert!(said.contains("is not the CA that signed"), "{said}");
    let said = refused(None, &url, "no --tls-ca");
    assert!(said.contains("give --tls-ca"), "{said}");
    let said = refused(Some(&s("ca-key.pem")), &url, "a key as --tls-ca");
    assert!(said.contains("holds a private key"), "{said}");
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let said = refused(Some(junk.to_str().unwrap()), &url, "no certificate");
    assert!(said.contains("holds no PEM certificate"), "{said}");
    drop(v);
    // A verifier that is not up yet is reported, not fatal: it may come after the edge.
    let e = serve(Some(&s("ca.pem")), &url)
        .unwrap_or_else(|said| panic!("an edge whose verifier is down did not start: {said}"));
    assert!(e.log().contains("not reachable yet"), "{}", e.log());
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}
