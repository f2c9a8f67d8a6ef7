//! `tandem bench hostile`: what each hostile client does to another tenant. One verifier (its own
//! process, with two tenants); a victim tenant streams cloud-only answers (`Generate`) one after
//! another while an attacker tenant runs one attack at a time, and the victim's largest gap
//! between tokens and its token rate are measured against the same victim with no attack, in the
//! same run. The goal (issue 36): no gap over 0.5 s, at least 0.7× the unattacked rate, with the
//! project's own client as the attacker or an independent one (`--attacker grpcio`:
//! `scripts/hostile_grpcio.py`, on connections of its own).
//!
//! The attacks are the ones the hostile-client tests assert rules about (`tests/hostile.rs`):
//! the oversized `q`, a flood of bad drafts from a client that never reads, 1,100 idle sessions,
//! 300 streams that never send `Open`, clients that read one byte a second, and peers that freeze
//! mid-session (a half-open connection: the proxy in front of them stops forwarding and holds the
//! sockets). Each is a function here that runs until told to stop and says what it saw.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use tandem_engine::{CpuSet, GgufFile, Tokenizer};
use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{
    cloud_message, edge_message, Draft, EdgeMessage, GenerateRequest, SamplingParams, SparseDist,
    TokenProb,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio_stream::wrappers::ReceiverStream;

use crate::cloudproc::CloudProcess;
use tandem_sim::stats::round2;

/// One attack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Attack {
    /// No attack: the victim's own rate and gaps.
    None,
    /// Rejection-sampling drafts whose `q` holds 100,000 entries (refused by validation).
    OversizedQ,
    /// 10,000 malformed drafts per session from a client that never reads its refusals.
    BadDraftFlood,
    /// 1,100 sessions opened and then left alone (no blocks, no acks, nothing read).
    IdleSessions,
    /// 300 session streams that never send `Open`.
    SilentStreams,
    /// Cloud-only streams read one byte a second.
    SlowReader,
    /// Sessions whose peer freezes after `Opened`: a half-open connection.
    FrozenPeer,
}

pub const ALL: [Attack; 7] = [
    Attack::None,
    Attack::OversizedQ,
    Attack::BadDraftFlood,
    Attack::IdleSessions,
    Attack::SilentStreams,
    Attack::SlowReader,
    Attack::FrozenPeer,
];

/// Who attacks: the project's own client (tonic), or an independent one written from the
/// protocol alone (`scripts/hostile_grpcio.py`: grpcio, run by this Python).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attacker {
    Tandem,
    Grpcio { python: std::path::PathBuf },
}

impl Attacker {
    pub fn name(&self) -> &'static str {
        match self {
            Attacker::Tandem => "tandem (tonic)",
            Attacker::Grpcio { .. } => "grpcio (scripts/hostile_grpcio.py)",
        }
    }
}

#[derive(Debug, Clone)]
pub struct HostileArgs {
    pub home: std::path::PathBuf,
    pub attacker: Attacker,
    /// More flags for the verifier process.
    pub cloud_args: Vec<String>,
    pub attacks: Vec<Attack>,
    /// How long each attack runs while the victim is measured.
    pub seconds: f64,
    /// Tokens per victim answer.
    pub victim_tokens: u32,
    pub cloud_cpus: CpuSet,
}

/// The victim's streams while one attack ran.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub attack: Attack,
    pub victim_answers: usize,
    pub victim_tokens: usize,
    pub victim_tok_s: f64,
    /// The victim's rate over its rate with no attack (same run).
    pub rate_vs_unattacked: f64,
    /// The longest wait between two tokens of one answer, s.
    pub largest_gap_s: f64,
    /// The longest wait for an answer's first token, s.
    pub largest_ttft_s: f64,
    /// Gap ≤ 0.5 s and rate ≥ 0.7× the unattacked rate.
    pub within_goal: bool,
    /// What the attacker saw (refusals, cuts).
    pub attacker: String,
    /// The verifier's resident memory when the attack ended, MB.
    pub verifier_rss_mb: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The attacking client, and the verifier's extra flags.
    pub attacker: String,
    pub cloud_args: Vec<String>,
    pub seconds_per_attack: f64,
    pub victim_tokens_per_answer: u32,
    pub cloud_cpus: String,
    pub rows: Vec<Row>,
}

/// What a client needs to speak to the verifier as a tenant.
#[derive(Clone)]
pub struct Tenant {
    pub url: String,
    pub key: String,
    pub fingerprint: String,
    pub prompt: Vec<u32>,
}

impl Tenant {
    pub async fn client(&self) -> Result<VerifierClient<tonic::transport::Channel>> {
        Ok(VerifierClient::connect(self.url.clone())
            .await?
            .max_encoding_message_size(4 << 20))
    }

    /// `msg` with this tenant's key (none when the key is empty: a verifier without tenants).
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if !self.key.is_empty() {
            let v = format!("Bearer {}", self.key)
                .parse()
                .expect("a key is a header value");
            r.metadata_mut().insert("authorization", v);
        }
        r
    }

    /// A cloud-only answer of `n` tokens, read to its end: its token count.
    pub async fn answer(&self, n: u32) -> Result<usize> {
        let mut c = self.client().await?;
        let mut s = c
            .generate(self.request(self.generate(n)))
            .await?
            .into_inner();
        let mut got = 0;
        while let Some(m) = s.message().await? {
            got += m.tokens.len();
        }
        Ok(got)
    }

    /// An `Open` of this tenant's prompt (see [`open`]).
    pub fn open(&self, temperature: f32, rule: i32, max_tokens: u32) -> EdgeMessage {
        open(
            &self.fingerprint,
            &self.prompt,
            temperature,
            rule,
            max_tokens,
        )
    }

    pub fn generate(&self, max_tokens: u32) -> GenerateRequest {
        GenerateRequest {
            tokenizer_fingerprint: self.fingerprint.clone(),
            prompt_ids: self.prompt.clone(),
            params: None,
            max_tokens,
            grammar: None,
            self_draft: false,
        }
    }

    /// A session stream opened with `open`: its sender (of `cap` messages) and its replies.
    pub async fn session(
        &self,
        c: &mut VerifierClient<tonic::transport::Channel>,
        open: EdgeMessage,
        cap: usize,
    ) -> Result<
        (
            tokio::sync::mpsc::Sender<EdgeMessage>,
            tonic::Streaming<tandem_proto::v1::CloudMessage>,
        ),
        tonic::Status,
    > {
        let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(cap);
        tx.send(open)
            .await
            .map_err(|_| tonic::Status::internal("send"))?;
        let s = c
            .session(self.request(ReceiverStream::new(rx)))
            .await?
            .into_inner();
        Ok((tx, s))
    }
}

/// An `Open` of `prompt` (rule 3 is rejection sampling, which reads `q`, at temperature > 0),
/// asking for γ 4 and depth 2.
pub fn open(
    fingerprint: &str,
    prompt: &[u32],
    temperature: f32,
    rule: i32,
    max_tokens: u32,
) -> EdgeMessage {
    let params = SamplingParams {
        temperature,
        top_k: 0,
        top_p: 1.0,
        seed: 1,
    };
    tandem_proto::open_message(fingerprint, prompt, Some(params), rule, max_tokens, (4, 2))
}

/// A draft of `tokens` at `start_pos` (block 0 of epoch 0) with `q`.
pub fn draft(start_pos: u64, tokens: Vec<u32>, q: Vec<SparseDist>) -> EdgeMessage {
    EdgeMessage {
        kind: Some(edge_message::Kind::Draft(Draft {
            epoch: 0,
            block: 0,
            start_pos,
            tokens,
            q,
            ..Default::default()
        })),
    }
}

/// What an attack saw, counted as it runs.
#[derive(Default)]
pub struct Tally {
    pub refused: AtomicUsize,
    pub cut: AtomicUsize,
    pub opened: AtomicUsize,
    pub tokens: AtomicUsize,
}

impl Tally {
    fn add(n: &AtomicUsize) {
        n.fetch_add(1, Ordering::Relaxed);
    }
    pub fn get(n: &AtomicUsize) -> usize {
        n.load(Ordering::Relaxed)
    }
}

/// Run `attack` from `t` until `stop` turns true; what it saw, in words.
pub async fn run_attack(attack: Attack, t: Tenant, stop: watch::Receiver<bool>) -> String {
    let tally = Arc::new(Tally::default());
    let r = match attack {
        Attack::None => Ok(()),
        Attack::OversizedQ => oversized_q(&t, &tally, stop.clone()).await,
        Attack::BadDraftFlood => bad_draft_flood(&t, &tally, stop.clone()).await,
        Attack::IdleSessions => idle_sessions(&t, 1100, &tally, stop.clone()).await,
        Attack::SilentStreams => silent_streams(&t, 300, &tally, stop.clone()).await,
        Attack::SlowReader => slow_readers(&t, 4, 1500, &tally, stop.clone()).await,
        Attack::FrozenPeer => frozen_peers(&t, 50, &tally, stop.clone()).await,
    };
    let g = Tally::get;
    let what = format!(
        "{} opened, {} refused, {} cut, {} tokens read",
        g(&tally.opened),
        g(&tally.refused),
        g(&tally.cut),
        g(&tally.tokens)
    );
    match r {
        Ok(()) => what,
        Err(e) => format!("{what}; stopped: {e:#}"),
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Drafts with a 100,000-entry `q`, each refused by name, one after another.
pub async fn oversized_q(t: &Tenant, tally: &Tally, stop: watch::Receiver<bool>) -> Result<()> {
    let q = SparseDist {
        entries: vec![
            TokenProb {
                token: 5,
                prob: 1e-6,
            };
            100_000
        ],
    };
    let start = t.prompt.len() as u64 + 1;
    while !*stop.borrow() {
        let mut c = t.client().await?;
        let (tx, mut s) = match t.session(&mut c, t.open(0.8, 3, 64), 4).await {
            Ok(x) => x,
            Err(_) => {
                Tally::add(&tally.refused);
                continue;
            }
        };
        Tally::add(&tally.opened);
        loop {
            if *stop.borrow()
                || tx
                    .send(draft(start, vec![5], vec![q.clone()]))
                    .await
                    .is_err()
            {
                break;
            }
            match next_refusal(&mut s).await {
                Some(true) => Tally::add(&tally.refused),
                _ => {
                    Tally::add(&tally.cut);
                    break;
                }
            }
        }
    }
    Ok(())
}

/// The next refusal on a session stream (Some(true)), or its end (Some(false) / None).
async fn next_refusal(s: &mut tonic::Streaming<tandem_proto::v1::CloudMessage>) -> Option<bool> {
    loop {
        match s.message().await {
            Ok(Some(m)) => {
                if matches!(m.kind, Some(cloud_message::Kind::Error(_))) {
                    return Some(true);
                }
            }
            Ok(None) => return Some(false),
            Err(_) => return None,
        }
    }
}

/// Sessions flooded with 10,000 bad drafts each, none of whose refusals is read.
pub async fn bad_draft_flood(t: &Tenant, tally: &Tally, stop: watch::Receiver<bool>) -> Result<()> {
    let start = t.prompt.len() as u64 + 1;
    while !*stop.borrow() {
        let mut c = t.client().await?;
        let Ok((tx, mut s)) = t.session(&mut c, t.open(0.0, 1, 200), 20_000).await else {
            Tally::add(&tally.refused);
            continue;
        };
        Tally::add(&tally.opened);
        for _ in 0..10_000 {
            if tx.send(draft(start, vec![999_999], vec![])).await.is_err() {
                break;
            }
        }
        // Then read to the end: the cut.
        while next_refusal(&mut s).await == Some(true) {
            Tally::add(&tally.refused);
        }
        Tally::add(&tally.cut);
    }
    Ok(())
}

/// `n` sessions opened at once and left alone until `stop` (at most 200 on a connection).
pub async fn idle_sessions(
    t: &Tenant,
    n: usize,
    tally: &Tally,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let mut opens = Vec::new();
    for chunk in 0..n.div_ceil(200) {
        let c = t.client().await?;
        for _ in (chunk * 200)..((chunk + 1) * 200).min(n) {
            let mut c = c.clone();
            opens.push(async move {
                let r = t.session(&mut c, t.open(0.0, 1, 2000), 1).await;
                Tally::add(if r.is_ok() {
                    &tally.opened
                } else {
                    &tally.refused
                });
                r.ok()
            });
        }
    }
    let held = futures_util::future::join_all(opens).await;
    stopped(&mut stop).await;
    drop(held);
    Ok(())
}

/// `n` session streams that never send `Open`, each started again when the verifier cuts it.
pub async fn silent_streams(
    t: &Tenant,
    n: usize,
    tally: &Arc<Tally>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let c = t.client().await?;
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (mut c, t, tally, stop) = (c.clone(), t.clone(), tally.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !*stop.borrow() {
                let (tx, rx) = tokio::sync::mpsc::channel::<EdgeMessage>(1);
                Tally::add(&tally.opened);
                let r = c.session(t.request(ReceiverStream::new(rx))).await;
                drop(tx);
                if r.is_err() {
                    Tally::add(&tally.cut);
                }
            }
        }));
    }
    stopped(&mut stop).await;
    for t in tasks {
        t.abort();
    }
    Ok(())
}

/// `n` cloud-only streams of `tokens` tokens, each read through a proxy that passes one byte a
/// second from the verifier.
pub async fn slow_readers(
    t: &Tenant,
    n: usize,
    tokens: u32,
    tally: &Tally,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let upstream: SocketAddr = t.url.trim_start_matches("http://").parse()?;
    let proxy = Proxy::start(upstream, Some(Duration::from_secs(1))).await?;
    let slow = Tenant {
        url: proxy.url(),
        ..t.clone()
    };
    // Each stream is read as fast as the proxy lets it, until told to stop.
    let read = async {
        let mut readers = Vec::new();
        for _ in 0..n {
            let slow = slow.clone();
            readers.push(async move {
                let mut c = slow.client().await.ok()?;
                let mut s = c
                    .generate(slow.request(slow.generate(tokens)))
                    .await
                    .ok()?
                    .into_inner();
                Tally::add(&tally.opened);
                while let Ok(Some(m)) = s.message().await {
                    tally.tokens.fetch_add(m.tokens.len(), Ordering::Relaxed);
                }
                Some(())
            });
        }
        for r in futures_util::future::join_all(readers).await {
            if r.is_none() {
                Tally::add(&tally.refused);
            }
        }
    };
    tokio::select! {
        _ = read => {}
        _ = stopped(&mut stop) => {}
    }
    Ok(())
}

/// `n` sessions opened through a proxy that then freezes: it stops forwarding both ways and
/// holds the sockets open (a peer gone without a FIN or RST).
pub async fn frozen_peers(
    t: &Tenant,
    n: usize,
    tally: &Tally,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let upstream: SocketAddr = t.url.trim_start_matches("http://").parse()?;
    let proxy = Proxy::start(upstream, None).await?;
    let via = Tenant {
        url: proxy.url(),
        ..t.clone()
    };
    let mut held = Vec::new();
    let open = async {
        for _ in 0..n {
            let Ok(mut c) = via.client().await else {
                continue;
            };
            match via.session(&mut c, via.open(0.0, 1, 2000), 4).await {
                Ok((tx, mut s)) => {
                    // Opened: the session holds KV on the verifier.
                    if s.message().await.is_ok() {
                        Tally::add(&tally.opened);
                    }
                    held.push((tx, s, c));
                }
                Err(_) => Tally::add(&tally.refused),
            }
        }
    };
    let mut early = stop.clone();
    tokio::select! {
        _ = open => {}
        _ = stopped(&mut early) => {}
    }
    proxy.freeze();
    stopped(&mut stop).await;
    Ok(())
}

/// Bytes a trickling proxy passes whole first (the HTTP/2 handshake, the response's headers).
const TRICKLE_AFTER: usize = 512;

/// A TCP proxy on loopback in front of `upstream`: whole, or passing the upstream's bytes one
/// per `trickle`; [`Proxy::freeze`] stops it forwarding either way while it holds every socket.
pub struct Proxy {
    addr: SocketAddr,
    frozen: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr, trickle: Option<Duration>) -> Result<Self> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let frozen = Arc::new(AtomicBool::new(false));
        let f = frozen.clone();
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = l.accept().await {
                let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let (mut dr, mut dw) = down.into_split();
                let (mut ur, mut uw) = up.into_split();
                let (f1, f2) = (f.clone(), f.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 << 10];
                    while let Ok(n) = dr.read(&mut buf).await {
                        if n == 0 || f1.load(Ordering::Relaxed) {
                            break;
                        }
                        if uw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    // Frozen: hold the socket, forward nothing.
                    if f1.load(Ordering::Relaxed) {
                        std::future::pending::<()>().await;
                    }
                });
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 << 10];
                    let mut passed = 0;
                    loop {
                        // The connection's setup and the stream's first messages pass whole;
                        // then one byte per `trickle`.
                        let want = match trickle {
                            Some(_) if passed >= TRICKLE_AFTER => 1,
                            _ => buf.len(),
                        };
                        let Ok(n) = ur.read(&mut buf[..want]).await else {
                            break;
                        };
                        if n == 0 || f2.load(Ordering::Relaxed) {
                            break;
                        }
                        if dw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        passed += n;
                        if let Some(d) = trickle.filter(|_| passed >= TRICKLE_AFTER) {
                            tokio::time::sleep(d).await;
                        }
                    }
                    if f2.load(Ordering::Relaxed) {
                        std::future::pending::<()>().await;
                    }
                });
            }
        });
        Ok(Self { addr, frozen, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::Relaxed);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The victim's answers until `stop`: (answers, tokens, seconds, largest gap, largest TTFT).
async fn victim(
    t: Tenant,
    tokens: u32,
    stop: watch::Receiver<bool>,
) -> Result<(usize, usize, f64, f64, f64)> {
    let t0 = Instant::now();
    let (mut answers, mut got, mut gap, mut ttft) = (0, 0, 0f64, 0f64);
    let mut c = t.client().await?;
    while !*stop.borrow() {
        let asked = Instant::now();
        let mut s = c
            .generate(t.request(t.generate(tokens)))
            .await
            .context("the victim's Generate")?
            .into_inner();
        let mut last: Option<Instant> = None;
        while let Some(m) = s.message().await.context("the victim's stream")? {
            let now = Instant::now();
            match last {
                None => ttft = ttft.max((now - asked).as_secs_f64()),
                Some(l) => gap = gap.max((now - l).as_secs_f64()),
            }
            last = Some(now);
            got += m.tokens.len();
        }
        answers += 1;
    }
    Ok((answers, got, t0.elapsed().as_secs_f64(), gap, ttft))
}

/// `attack` by the independent client (`scripts/hostile_grpcio.py` under `python`) for
/// `seconds`, on connections of its own; what it saw, in words.
async fn grpcio_attack(
    python: std::path::PathBuf,
    attack: Attack,
    t: Tenant,
    seconds: f64,
) -> String {
    if attack == Attack::None {
        return "0 opened, 0 refused, 0 cut, 0 tokens read".to_string();
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/hostile_grpcio.py"
    );
    let name = serde_json::to_value(attack)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let ids: Vec<String> = t.prompt.iter().map(u32::to_string).collect();
    let out = tokio::process::Command::new(&python)
        .arg(script)
        .args(["--target", t.url.trim_start_matches("http://")])
        .args(["--key", &t.key, "--fingerprint", &t.fingerprint])
        .args(["--prompt-ids", &ids.join(",")])
        .args(["--attack", &name, "--seconds", &format!("{seconds:.1}")])
        .kill_on_drop(true)
        .output()
        .await;
    let out = match out {
        Ok(o) => o,
        Err(e) => return format!("stopped: {} did not run: {e}", python.display()),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(v) = text
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    else {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
        return format!("stopped: the grpcio attacker said nothing ({tail})");
    };
    let g = |k: &str| v[k].as_u64().unwrap_or(0);
    format!(
        "{} opened, {} refused, {} cut, {} tokens read",
        g("opened"),
        g("refused"),
        g("cut"),
        g("tokens")
    )
}

/// A key of `name`'s: its name and 128 random bits (the edge's routing-key draw).
fn key(name: &str) -> String {
    format!("{name}-{}", tandem_edge::grpc::new_route())
}

/// Run every attack of `a` in turn against one verifier; `progress` hears what runs.
pub fn run(a: &HostileArgs, progress: &mut dyn FnMut(&str)) -> Result<Report> {
    let model = tandem_models::pull::ensure_model(&a.home, true)?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&model)?)?;
    let dir = std::env::temp_dir().join(format!("tandem-bench-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (victim_key, attacker_key) = (key("victim"), key("attacker"));
    let tenants = dir.join("tenants.toml");
    std::fs::write(
        &tenants,
        format!(
            "[[tenant]]\nname = \"victim\"\nkeys = [\"{victim_key}\"]\n\n\
             [[tenant]]\nname = \"attacker\"\nkeys = [\"{attacker_key}\"]\n"
        ),
    )?;
    let extra: Vec<String> = [
        "--tenants",
        tenants.to_str().context("a temp path")?,
        "--metrics-listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(a.cloud_args.iter().cloned())
    .collect();
    progress("starting the verifier (two tenants: victim, attacker)");
    let cloud = CloudProcess::start(&a.home, &a.cloud_cpus, &extra)?;
    let url = format!("http://{}", cloud.addr);
    let tenant = |key: &str, text: &str| -> Result<Tenant> {
        Ok(Tenant {
            url: url.clone(),
            key: key.to_string(),
            fingerprint: tok.fingerprint().to_string(),
            prompt: tok.encode(text)?,
        })
    };
    let v = tenant(
        &victim_key,
        "Once upon a time, in a quiet village by the sea,",
    )?;
    let at = tenant(&attacker_key, "The capital of France is")?;
    let rt = tandem_client::runtime()?;
    let mut rows: Vec<Row> = Vec::new();
    let mut base_rate = None;
    let mut attacks = a.attacks.clone();
    if attacks.first() != Some(&Attack::None) {
        attacks.insert(0, Attack::None);
    }
    for attack in attacks {
        progress(&format!("{attack:?} for {:.0} s", a.seconds));
        let (stop_tx, stop) = watch::channel(false);
        let hold = (a.seconds / 4.0).min(5.0);
        let (answers, tokens, secs, gap, ttft, attacker) = rt.block_on(async {
            let attacker = match &a.attacker {
                Attacker::Tandem => tokio::spawn(run_attack(attack, at.clone(), stop.clone())),
                Attacker::Grpcio { python } => tokio::spawn(grpcio_attack(
                    python.clone(),
                    attack,
                    at.clone(),
                    hold + a.seconds,
                )),
            };
            // The attack takes hold first (opens its sessions, starts its flood).
            tokio::time::sleep(Duration::from_secs_f64(hold)).await;
            let victim = tokio::spawn(victim(v.clone(), a.victim_tokens, stop.clone()));
            tokio::time::sleep(Duration::from_secs_f64(a.seconds)).await;
            let _ = stop_tx.send(true);
            let r = victim.await??;
            let what = attacker.await.unwrap_or_else(|e| format!("panicked: {e}"));
            anyhow::Ok((r.0, r.1, r.2, r.3, r.4, what))
        })?;
        let rate = tokens as f64 / secs.max(1e-9);
        let base = *base_rate.get_or_insert(rate);
        let ratio = rate / base.max(1e-9);
        rows.push(Row {
            attack,
            victim_answers: answers,
            victim_tokens: tokens,
            victim_tok_s: round2(rate),
            rate_vs_unattacked: round2(ratio),
            largest_gap_s: round2(gap),
            largest_ttft_s: round2(ttft),
            within_goal: gap <= 0.5 && ratio >= 0.7,
            attacker,
            verifier_rss_mb: round2(cloud.rss_mb().unwrap_or(0.0)),
        });
        // Let the verifier close what the attack left before the next one.
        std::thread::sleep(Duration::from_secs(2));
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Report {
        attacker: a.attacker.name().to_string(),
        cloud_args: a.cloud_args.clone(),
        seconds_per_attack: a.seconds,
        victim_tokens_per_answer: a.victim_tokens,
        cloud_cpus: a.cloud_cpus.to_string(),
        rows,
    })
}

pub fn table(r: &Report) -> String {
    let mut s = format!(
        "attacker: {}; verifier flags: [{}]; victim: cloud-only answers of {} tokens, one after another, {:.0} s per attack; verifier on cores {}\n\n\
         | attack | victim tok/s | vs unattacked | largest gap | largest TTFT | within goal | verifier RSS | attacker saw |\n\
         |---|---|---|---|---|---|---|---|\n",
        r.attacker,
        r.cloud_args.join(" "),
        r.victim_tokens_per_answer,
        r.seconds_per_attack,
        r.cloud_cpus
    );
    for row in &r.rows {
        s += &format!(
            "| {:?} | {:.1} | {:.2}× | {:.2} s | {:.2} s | {} | {:.0} MB | {} |\n",
            row.attack,
            row.victim_tok_s,
            row.rate_vs_unattacked,
            row.largest_gap_s,
            row.largest_ttft_s,
            if row.within_goal { "yes" } else { "no" },
            row.verifier_rss_mb,
            row.attacker
        );
    }
    s
}
