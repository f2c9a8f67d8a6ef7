//! The shipped nginx configuration (`deploy/nginx/tandem.conf`) in front of three real verifier
//! replicas (`tandem cloud serve`), with three `tandem serve` edges behind it: it passes `nginx
//! -t`, and twelve streamed answers survive the loss of the replica that holds the most of them,
//! each the target's token for token, their sessions reopened on the other replicas. Needs
//! Debian's nginx (`.ci/run` installs it); elsewhere it skips and says why. The deployment files
//! themselves are read in `deploy.rs`. The model is pulled on first use.

mod common;

use std::path::{Path, PathBuf};

use common::serve::*;
use common::*;
use serde_json::{json, Value};

/// Debian's nginx, or None (with why) where it is not installed (`.ci/run` installs it).
fn nginx() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// `deploy/nginx/tandem.conf` as shipped, with its replica addresses replaced by `replicas` and
/// its listener by `listen`, inside a minimal main configuration of its own in `dir`.
fn nginx_config(dir: &Path, listen: &str, replicas: &[String]) -> PathBuf {
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nginx/tandem.conf"),
    )
    .unwrap();
    let mut servers = replicas.iter();
    let site: String = shipped
        .lines()
        .map(|l| {
            let t = l.trim_start();
            if t.starts_with("server 10.0.0.") {
                let (_, rest) = t.split_once(' ').unwrap();
                let (_, options) = rest.split_once(' ').unwrap();
                let addr = servers.next().expect("as many replicas as the file lists");
                format!("    server {addr} {options}\n")
            } else if t.starts_with("listen 50051 http2;") {
                format!("    listen {listen} http2;\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    assert!(servers.next().is_none(), "the file lists every replica");
    std::fs::write(dir.join("tandem.conf"), site).unwrap();
    let d = dir.display();
    let main = format!(
        "worker_processes 1;\nerror_log {d}/error.log info;\npid {d}/nginx.pid;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
         include {d}/tandem.conf;\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, main).unwrap();
    path
}

/// nginx in the foreground, stopped when dropped (SIGTERM: the master takes its workers with it,
/// where SIGKILL would leave them running).
struct Nginx(std::process::Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

#[test]
fn twelve_sessions_through_nginx_survive_the_loss_of_one_of_three_replicas() {
    let Some(bin) = nginx() else {
        eprintln!(
            "SKIPPED: nginx is not installed (/usr/sbin/nginx); `.ci/run` installs Debian's \
             package. This test puts three verifier replicas behind deploy/nginx/tandem.conf."
        );
        return;
    };
    let dir = scratch("nginx");
    let mut replicas: Vec<Proc> = (0..3)
        .map(|_| verifier(&["--metrics-listen", "127.0.0.1:0"]))
        .collect();
    let addrs: Vec<String> = replicas
        .iter()
        .map(|r| format!("127.0.0.1:{}", r.port))
        .collect();
    let port = free_port();
    let conf = nginx_config(&dir, &format!("127.0.0.1:{port}"), &addrs);
    let check = std::process::Command::new(&bin)
        .args(["-t", "-p"])
        .arg(&dir)
        .arg("-c")
        .arg(&conf)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "nginx -t: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    let _nginx = Nginx(
        std::process::Command::new(&bin)
            .args(["-g", "daemon off;", "-p"])
            .arg(&dir)
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("nginx listens", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let balancer = format!("http://127.0.0.1:{port}");
    // Twelve sessions: three edges, four answers each, at once.
    // Twelve prefills at once on a shared machine (CI runs the other serve tests beside this
    // one): the first answer of a session may take longer than the default 3 s to open.
    let edges: Vec<Proc> = (0..3)
        .map(|_| {
            edge(
                std::slice::from_ref(&balancer),
                &["--connect-timeout-ms", "120000"],
            )
        })
        .collect();
    let prompts: Vec<String> = (0..12)
        .map(|i| format!("Tell me fact number {i} about the sea, in a few sentences."))
        .collect();
    let n = 64;
    let wants: Vec<Expect> = prompts.iter().map(|p| expected_chat(p, n)).collect();
    // Each answer's first chunk is in before the kill: every session is open on some replica.
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    let readers: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let port = edges[i % 3].port;
            let mut body = chat(p, n);
            body["stream"] = json!(true);
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut events = open_stream(port, "/v1/chat/completions", &body).unwrap();
                let mut seen: Vec<(String, Value)> = Vec::new();
                let mut told = false;
                for (ev, d) in events.by_ref() {
                    if d == "[DONE]" {
                        break;
                    }
                    seen.push((ev, serde_json::from_str(&d).unwrap()));
                    if !told && !text_of(&seen).is_empty() {
                        told = true;
                        tx.send(i).unwrap();
                    }
                }
                seen
            })
        })
        .collect();
    drop(tx);
    for _ in 0..prompts.len() {
        rx.recv().expect("every answer starts");
    }
    // The replica holding the most sessions dies.
    let running = |r: &Proc| {
        let (status, text) = get(r.also_port.unwrap(), "/metrics");
        assert_eq!(status, 200);
        sample(&text, "tandem:num_requests_running")
    };
    let loads: Vec<f64> = replicas.iter().map(running).collect();
    let (victim, &lost) = loads
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap();
    eprintln!("sessions per replica before the kill: {loads:?}; killing replica {victim}");
    assert!(lost >= 1.0, "the replicas hold the sessions: {loads:?}");
    replicas[victim].kill();
    let mut reconnects = 0;
    for ((i, r), want) in readers.into_iter().enumerate().zip(&wants) {
        let seen = r.join().unwrap();
        assert!(
            seen.iter().all(|(ev, _)| ev == "message"),
            "answer {i}: no error event: {seen:?}"
        );
        assert_eq!(
            text_of(&seen),
            want.text,
            "answer {i}: the target's, token for token"
        );
        let fin = &seen.last().unwrap().1;
        assert_eq!(
            fin["choices"][0]["finish_reason"], want.finish,
            "answer {i}"
        );
        assert_eq!(fin["tandem"]["unverified_tokens"], 0, "answer {i}");
        reconnects += fin["tandem"]["reconnects"].as_u64().unwrap();
    }
    eprintln!("{reconnects} sessions reopened on the other replicas");
    // (A session of the victim's may have ended between the count and the kill.)
    assert!(
        reconnects >= 1,
        "the killed replica's sessions were reopened on the others"
    );
}
