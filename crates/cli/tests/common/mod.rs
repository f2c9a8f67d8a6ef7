//! Helpers shared by the binary's integration tests: those of `tandem-testkit` (the model files,
//! pulled and made on first use, and a reference greedy decoder), the in-process gRPC verifiers
//! of the verifier server's tests (`crates/cloud/tests/common`, included here), speculative runs
//! through the client, and `tandem` processes started and read.
#![allow(dead_code)]

pub mod serve;

#[path = "../../../cloud/tests/common/mod.rs"]
mod in_process;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use in_process::*;
use tandem_engine::EngineConfig;

/// A fixture of `fixtures/` (made by `fixtures/make_fixtures.py`, the independent numpy
/// reference), parsed.
pub fn fixture(name: &str) -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// A greedy speculative run of `draft` for `target` against the verifier at `url` (one serving
/// `target`: [`awaiting_server_of`] judges every block, however fast the machine), async with γ
/// `gamma` and `depth` blocks in flight behind an emulated `rtt_ms` link (±10% jitter).
pub fn speculate_pair(
    (target, draft): (
        &Arc<tandem_engine::LlamaModel>,
        &Arc<tandem_engine::LlamaModel>,
    ),
    tok: &tandem_engine::Tokenizer,
    prompt: &[u32],
    max_new: usize,
    (gamma, depth): (usize, usize),
    (url, rtt_ms): (&str, f64),
) -> tandem_client::generate::GenOutput {
    let session = tandem_spec::edge::SessionConfig {
        draft_len: gamma,
        depth,
        max_new_tokens: max_new,
        auto: None,
        tree: tandem_spec::TreeConfig::LINEAR,
    };
    let greedy = (
        tandem_spec::VerifyRule::Greedy,
        tandem_spec::sampling::SamplingParams::default(),
    );
    let link = (rtt_ms, Some(url.to_string()), None);
    run_pair((target, draft), tok, prompt, (session, greedy), link)
}

/// One speculative run of `draft` for `target`, one core each, with this session and rule;
/// in-process behind `rtt_ms`, or against the verifier at `cloud_url`, as the tenant whose API key
/// is given (None: no key).
pub fn run_pair(
    (target, draft): (
        &Arc<tandem_engine::LlamaModel>,
        &Arc<tandem_engine::LlamaModel>,
    ),
    tok: &tandem_engine::Tokenizer,
    prompt: &[u32],
    (session, (rule, params)): (
        tandem_spec::edge::SessionConfig,
        (
            tandem_spec::VerifyRule,
            tandem_spec::sampling::SamplingParams,
        ),
    ),
    (rtt_ms, cloud_url, api_key): (f64, Option<String>, Option<String>),
) -> tandem_client::generate::GenOutput {
    let one = EngineConfig {
        threads: 1,
        kv_budget_bytes: 32 << 20,
        ..EngineConfig::default()
    };
    let run = tandem_client::speculate::SpecRun {
        target: target.clone(),
        draft: draft.clone(),
        tokenizer: tok,
        cloud: one,
        edge: one,
        spec: tandem_edge::SpecConfig {
            session,
            rule,
            params,
            q_top_k: 32,
            self_draft: true,
            suffix: true,
        },
        rtt_ms,
        jitter_ms: rtt_ms / 10.0,
        cloud_url,
        api_key,
        tls_ca: None,
        grammar: None,
    };
    tandem_client::speculate::run(&run, prompt, |_| {}).unwrap()
}

/// One speculative run: in-process behind `rtt_ms`, or against the verifier at `cloud_url`.
#[allow(clippy::too_many_arguments)]
pub fn spec_out(
    prompt: &[u32],
    gamma: usize,
    depth: usize,
    rtt_ms: f64,
    params: tandem_spec::sampling::SamplingParams,
    rule: tandem_spec::VerifyRule,
    max_new: usize,
    cloud_url: Option<String>,
) -> tandem_client::generate::GenOutput {
    spec_out_as(
        None,
        prompt,
        gamma,
        depth,
        rtt_ms,
        params,
        rule,
        max_new,
        cloud_url,
        tandem_spec::TreeConfig::LINEAR,
    )
}

/// [`spec_out`] as the tenant whose API key is `api_key` (None: no key), sending token trees
/// shaped by `tree`.
#[allow(clippy::too_many_arguments)]
pub fn spec_out_as(
    api_key: Option<String>,
    prompt: &[u32],
    gamma: usize,
    depth: usize,
    rtt_ms: f64,
    params: tandem_spec::sampling::SamplingParams,
    rule: tandem_spec::VerifyRule,
    max_new: usize,
    cloud_url: Option<String>,
    tree: tandem_spec::TreeConfig,
) -> tandem_client::generate::GenOutput {
    let (draft, tok) = draft();
    let (target, _) = target();
    let session = tandem_spec::edge::SessionConfig {
        draft_len: gamma,
        depth,
        max_new_tokens: max_new,
        auto: None,
        tree,
    };
    let link = (rtt_ms, cloud_url, api_key);
    let out = run_pair(
        (target, draft),
        tok,
        prompt,
        (session, (rule, params)),
        link,
    );
    let s = out.spec.as_ref().unwrap();
    eprintln!(
        "γ={gamma} depth={depth} rtt={rtt_ms}: α={} E[A]={} rounds={} stale={} wasted={} side nodes={} lane hits={}",
        s.acceptance_rate,
        s.mean_accepted,
        s.rounds,
        s.stale_blocks,
        s.wasted_draft_tokens,
        s.side_nodes,
        s.lane_hits
    );
    out
}

/// A `tandem` process a test started, killed when dropped, with what it wrote to stderr.
pub struct Proc {
    pub child: std::process::Child,
    /// The port of the address its ready line named.
    pub port: u16,
    /// Every line it wrote to stderr so far.
    pub log: Arc<std::sync::Mutex<String>>,
    /// The second address it announced (`metrics on http://…`), when `also` asked for one.
    pub also_port: Option<u16>,
}

impl Proc {
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGKILL, at once (a crash).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and its exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status();
        self.child.wait().unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One series of a Prometheus text exposition (`name` or `name{label="v"}`): its value, None
/// when absent.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().unwrap())
    })
}

/// A JSON array of token ids (`output_ids` in `generate --json`, a fixture's).
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A fixture's list of numbers (top-2 margins, logits).
pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// `m`'s greedy tokens and first logits against llama.cpp's on the same weights (`fixtures/NAME`,
/// made by `fixtures/make_peer_fixture.py`): for each prompt, the tokens the same up to the
/// first difference, which may only fall where llama.cpp's top-2 margin is below `near_tie`
/// (after it the two continue different texts), and the first step's highest token the same.
/// Returns the greedy steps compared and the largest difference among each first step's eight
/// highest logits.
pub fn against_peer(m: &Arc<tandem_engine::LlamaModel>, name: &str, near_tie: f64) -> (usize, f64) {
    let (mut compared, mut worst) = (0, 0f64);
    for case in fixture(name)["greedy"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["output_ids"]);
        let margins = floats(&case["top2_margin"]);
        let got = greedy(&mut engine(m), tandem_engine::SeqId(1), &prompt, want.len());
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        if same < want.len() {
            assert!(
                margins[same] < near_tie,
                "{}: step {same} differs at a margin of {} ({:?} against llama.cpp's {:?})",
                case["prompt"],
                margins[same],
                &got[same..],
                &want[same..]
            );
        }
        compared += same;
        let l = engine(m)
            .forward(&[tandem_engine::SeqChunk::new(
                tandem_engine::SeqId(2),
                0,
                prompt,
                tandem_engine::Wanted::Last,
            )])
            .unwrap();
        let row = l.row(0);
        for pair in case["first_logits"].as_array().unwrap() {
            let (i, v) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap(),
            );
            worst = worst.max((row[i] as f64 - v).abs());
        }
        assert_eq!(
            tandem_spec::sampling::argmax(row),
            case["first_logits"][0][0].as_u64().unwrap() as u32,
            "{}: the first step's highest token",
            case["prompt"]
        );
    }
    (compared, worst)
}

/// The port of the first `HOST:PORT` (or `scheme://HOST:PORT`) word of `rest`.
fn port_of(rest: &str) -> Option<u16> {
    rest.split_whitespace()
        .next()?
        .trim_end_matches('/')
        .rsplit(':')
        .next()?
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .ok()
}

/// Start `tandem ARGS` and wait for its stderr line that begins with `ready` (and, with `also`,
/// for a line beginning with that, before it); the process, or what it said before it exited.
pub fn spawn_tandem(args: &[String], ready: &str, also: Option<&str>) -> Result<Proc, String> {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"));
    cmd.args(args);
    spawn_ready(cmd, ready, also)
}

/// [`spawn_tandem`] for any command (`tandem` run some other way: in a network namespace).
pub fn spawn_ready(
    mut cmd: std::process::Command,
    ready: &str,
    also: Option<&str>,
) -> Result<Proc, String> {
    use std::io::{BufRead, BufReader};
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let log = Arc::new(std::sync::Mutex::new(String::new()));
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut also_port = None;
    while let Some(Ok(line)) = lines.next() {
        {
            let mut l = log.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
        if let Some(rest) = also.and_then(|a| line.strip_prefix(a)) {
            also_port = port_of(rest);
        }
        if let Some(rest) = line.strip_prefix(ready) {
            let port = port_of(rest).expect("a port in the ready line");
            let keep = log.clone();
            std::thread::spawn(move || {
                for line in lines.map_while(Result::ok) {
                    let mut l = keep.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
            return Ok(Proc {
                child,
                port,
                log,
                also_port,
            });
        }
    }
    let status = child.wait().unwrap();
    let said = log.lock().unwrap().clone();
    Err(format!("exited with {status}: {said}"))
}

/// `tandem cloud serve` on a loopback port of its own (a fixed forward cost: no measuring at
/// start-up; no ledger, no auth, a 2 s drain unless `extra` says otherwise), with `extra` flags.
pub fn verifier(extra: &[&str]) -> Proc {
    try_verifier(extra).unwrap_or_else(|e| panic!("the verifier did not start: {e}"))
}

/// [`verifier`], or what it said when it exited instead of listening.
pub fn try_verifier(extra: &[&str]) -> Result<Proc, String> {
    let mut args: Vec<String> = ["cloud", "serve", "--threads", "1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let defaults: [(&str, &[&str]); 5] = [
        ("--forward-cost", &["--forward-cost", "40,2"]),
        ("--ledger", &["--no-ledger"]),
        ("--tenants", &["--no-auth"]),
        ("--listen", &["--listen", "127.0.0.1:0"]),
        ("--drain-timeout-s", &["--drain-timeout-s", "2"]),
    ];
    for (unless, flags) in defaults {
        if !extra.contains(&unless) {
            args.extend(flags.iter().map(|s| s.to_string()));
        }
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    spawn_tandem(&args, "tandem verifier listening on ", Some("metrics on "))
}

/// A CA and a server certificate for `localhost` and 127.0.0.1 it signed, as PEM files in
/// `dir`: (ca, cert, key).
pub fn certificates(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("tandem test CA {name}"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    let p = |f: &str| dir.join(format!("{name}-{f}"));
    std::fs::write(p("ca.pem"), ca.pem()).unwrap();
    std::fs::write(p("cert.pem"), cert.pem()).unwrap();
    std::fs::write(p("key.pem"), key.serialize_pem()).unwrap();
    (p("ca.pem"), p("cert.pem"), p("key.pem"))
}

/// A fresh directory under the system's temp dir for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Run `cmd` to its end; its stdout, or a panic with its stderr (and `what` it was) when it
/// failed.
pub fn stdout_of(what: &str, cmd: &mut std::process::Command) -> Vec<u8> {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The project's emulated link (a TCP proxy with a round trip of `rtt_ms` and `jitter_ms` each
/// way) in front of `upstream`, on a loopback port of its own: its `http://` URL.
pub fn netem_front(upstream: std::net::SocketAddr, rtt_ms: f64, jitter_ms: f64) -> String {
    let addr = tandem_testkit::on_loopback(move |l| async move {
        let cfg = tandem_client::netem::NetemConfig {
            rtt_ms,
            jitter_ms,
            ..Default::default()
        };
        tandem_client::netem::proxy(l, upstream, cfg).await.unwrap();
    });
    format!("http://{addr}")
}

/// A `tandem cloud serve` (with `extra` flags) that judges every block: no takeover, no grant
/// that shrinks, and it waits for a speculating session's next block (`--await-drafts-ms`, as
/// [`AWAIT_DRAFTS_MS`]) rather than decode that session alone — so that a test of what happens to
/// drafts sees them judged however fast either side is (`scripts/skew` found two that did not).
pub fn judging_verifier(extra: &[&str]) -> Proc {
    let wait = AWAIT_DRAFTS_MS.to_string();
    let judging = ["--fixed-grants", "--await-drafts-ms", wait.as_str()];
    verifier(&[&judging[..], extra].concat())
}

/// `tandem cloud serve --model MODEL` refuses SmolLM2's draft at Open (`generate --mode async`),
/// naming both tokenizers' fingerprints, the served model's being `fingerprint`.
pub fn assert_refuses_smollm2_draft(model: &str, fingerprint: &str) {
    tandem_testkit::draft_path();
    let (_, stok) = target();
    let v = verifier(&["--model", model]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["generate", "--model", "draft", "--mode", "async"])
        .args(["--max-tokens", "4", "--prompt", "Hi"])
        .args(["--cloud", &format!("http://127.0.0.1:{}", v.port)])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the mismatched draft ran: {err}");
    assert!(
        err.contains("tokenizer_fingerprint")
            && err.contains(stok.fingerprint())
            && err.contains(fingerprint),
        "{err}"
    );
}
