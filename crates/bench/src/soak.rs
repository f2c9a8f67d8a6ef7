//! `tandem bench soak`: one verifier process under churn for minutes. N synthetic edges (the load
//! benchmark's: right with probability α, speaking the real protocol) open session after session,
//! each checked against the target's greedy answer, while hostile clients of
//! [`crate::hostile`] take turns beside them; every 10 s the verifier's resident memory and the
//! tokens committed are sampled. It reports lost sessions (errors), wrong answers, and the memory
//! trend, and draws memory and throughput over time.
//!
//! With `serve`, the sessions are real: a `tandem serve` process in front of the verifier, and N
//! API clients sending it, one after another, what users send — the turns of conversations (the
//! whole history each turn: both prefix caches), JSON-schema answers (structured outputs: the
//! draft and the verifier under the schema's mask), and answers that copy from their prompt (the
//! edge's suffix drafts) — each answer checked against the verifier's own cloud-only greedy
//! answer to the same tokens (which the tests prove is the target's), and the edge's memory
//! sampled beside the verifier's. Hostile API clients of `tandem serve` then take turns too
//! (streams never read, clients that hang up after the first event, headers a byte a second),
//! beside the verifier's attackers.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use tandem_engine::tokenizer::ChatMessage;
use tandem_engine::{CpuSet, GgufFile, Tokenizer};
use tandem_spec::{GrammarSource, TreeConfig};
use tokio::sync::watch;

use crate::cloudproc::{CloudProcess, EdgeProcess};
use crate::hostile::{run_attack, Attack, Tenant};
use crate::load::{synthetic_session, SyntheticEdge};
use crate::plots::{Chart, Series};
use tandem_sim::stats::round2;

/// The attacks that take turns during a soak (a minute each). Idle sessions are left out: in a
/// one-tenant soak they would take the honest sessions' admission (`bench hostile` measures them).
const ATTACKS: [Attack; 5] = [
    Attack::BadDraftFlood,
    Attack::SilentStreams,
    Attack::OversizedQ,
    Attack::SlowReader,
    Attack::FrozenPeer,
];

#[derive(Debug, Clone)]
pub struct SoakArgs {
    pub home: PathBuf,
    pub sessions: usize,
    pub minutes: f64,
    /// Tokens per answer.
    pub tokens: usize,
    pub alpha: f64,
    pub hostile: bool,
    pub cloud_cpus: CpuSet,
    /// Where the plot goes.
    pub png: Option<PathBuf>,
    /// Real edges: a `tandem serve` process (its draft on `edge_cpus`) and API clients.
    pub serve: bool,
    pub edge_cpus: CpuSet,
}

/// tandem serve's counters the soak reports: its prompts, what the verifier's prefix cache and
/// the draft's served of them, the completion tokens and the draft tokens accepted.
const EDGE_COUNTERS: [&str; 6] = [
    "tandem:prompt_tokens_total",
    "tandem:prefix_cache_hits_total",
    "tandem:draft_prefix_cache_hits_total",
    "tandem:generation_tokens_total",
    "tandem:spec_decode_num_draft_tokens_total",
    "tandem:spec_decode_num_accepted_tokens_total",
];

/// A request the soak's API clients send `tandem serve`, and the answer it must get.
#[derive(Debug, Clone)]
struct Work {
    kind: &'static str,
    messages: Vec<ChatMessage>,
    response_format: Option<serde_json::Value>,
    /// The verifier's own greedy answer (cloud-only) to the same tokens: its text.
    want: String,
}

/// Answers of one kind of request.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KindCount {
    pub kind: &'static str,
    pub answers: usize,
    pub exact: usize,
}

/// The JSON schema of the structured answers.
fn person_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "city": {"type": "string"},
            "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
        },
        "required": ["name", "age", "city", "hobbies"],
        "additionalProperties": false
    })
}

/// What the soak's clients send: three conversations of three turns, two JSON-schema answers and
/// two answers that copy from their prompt, each with the verifier's greedy answer of at most
/// `tokens` tokens (the turns' histories carry the earlier answers).
fn works(
    rt: &tokio::runtime::Runtime,
    url: &str,
    tok: &Tokenizer,
    tokens: usize,
) -> Result<Vec<Work>> {
    let user = |c: &str| ChatMessage {
        role: "user".into(),
        content: c.into(),
    };
    // The verifier's own greedy answer, cloud-only (the tests prove it the target's).
    let answer = |messages: &[ChatMessage], grammar: Option<&GrammarSource>| -> Result<String> {
        Ok(crate::chat_bench::cloud_turn(rt, url, tok, messages, tokens, grammar)?.text)
    };
    let mut works = Vec::new();
    for c in 0..3 {
        let mut history = vec![ChatMessage {
            role: "system".into(),
            content: format!("[soak {c}] You are a helpful assistant. Answer briefly."),
        }];
        for t in 0..3 {
            history.push(user(crate::chat_bench::QUESTIONS[(c * 3 + t) % 12]));
            let want = answer(&history, None)?;
            works.push(Work {
                kind: "conversation",
                messages: history.clone(),
                response_format: None,
                want: want.clone(),
            });
            history.push(ChatMessage {
                role: "assistant".into(),
                content: want,
            });
        }
    }
    let schema = person_schema();
    let source = GrammarSource::JsonSchema(schema.to_string());
    for q in [
        "Extract the person as JSON: Ada Lovelace, 36, from London, likes chess and poetry.",
        "Extract the person as JSON: Alan Turing, 41, from Wilmslow, likes running.",
    ] {
        let messages = vec![user(q)];
        works.push(Work {
            kind: "json_schema",
            want: answer(&messages, Some(&source))?,
            messages,
            response_format: Some(serde_json::json!({
                "type": "json_schema",
                "json_schema": {"name": "person", "strict": true, "schema": schema},
            })),
        });
    }
    for q in [
        "Repeat this list exactly, one item per line: apples, pears, plums, cherries, grapes, \
         lemons, limes, oranges, melons, peaches.",
        "Copy this sentence word for word, twice: the quick brown fox jumps over the lazy dog \
         while the cat sleeps in the warm afternoon sun.",
    ] {
        let messages = vec![user(q)];
        works.push(Work {
            kind: "copy",
            want: answer(&messages, None)?,
            messages,
            response_format: None,
        });
    }
    Ok(works)
}

/// What hostile API clients do to `tandem serve` during a `--serve` soak, taking turns beside
/// the verifier's attackers (a minute each), over plain TCP: nothing of the project's client.
#[derive(Debug, Clone, Copy)]
enum HttpAttack {
    /// Streamed answers whose client never reads a byte of them (4 at a time, held open).
    UnreadStreams,
    /// Streamed answers whose client hangs up after the first event, one after another.
    Vanishing,
    /// Requests whose headers come a byte a second (50 connections).
    SlowHeaders,
}

const HTTP_ATTACKS: [HttpAttack; 3] = [
    HttpAttack::UnreadStreams,
    HttpAttack::Vanishing,
    HttpAttack::SlowHeaders,
];

/// A streamed chat request for `max_tokens`, as raw HTTP/1.1.
fn stream_request(host: &str, max_tokens: usize) -> Vec<u8> {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    })
    .to_string();
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Run `attack` against `tandem serve` at `url` until `until`; what it did, in words.
fn run_http_attack(attack: HttpAttack, url: &str, until: Instant) -> String {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let host = url.trim_start_matches("http://").to_string();
    let connect = || -> std::io::Result<TcpStream> {
        let c = TcpStream::connect(&host)?;
        c.set_read_timeout(Some(Duration::from_secs(30)))?;
        c.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(c)
    };
    let wait_until = |t: Instant| std::thread::sleep(t.saturating_duration_since(Instant::now()));
    match attack {
        HttpAttack::UnreadStreams => {
            let mut held = Vec::new();
            let mut failed = 0;
            for _ in 0..4 {
                match connect()
                    .and_then(|mut c| c.write_all(&stream_request(&host, 256)).map(|_| c))
                {
                    Ok(c) => held.push(c),
                    Err(_) => failed += 1,
                }
            }
            wait_until(until);
            format!(
                "{} streams never read, held open; {failed} failed to connect",
                held.len()
            )
        }
        HttpAttack::Vanishing => {
            let (mut cut, mut failed) = (0usize, 0usize);
            while Instant::now() < until {
                let first_event = connect().and_then(|mut c| {
                    c.write_all(&stream_request(&host, 128))?;
                    let mut buf = [0u8; 4096];
                    let mut seen = Vec::new();
                    while !seen.windows(5).any(|w| w == b"data:") {
                        let n = c.read(&mut buf)?;
                        if n == 0 {
                            return Err(std::io::ErrorKind::UnexpectedEof.into());
                        }
                        seen.extend_from_slice(&buf[..n]);
                    }
                    Ok(())
                });
                match first_event {
                    Ok(()) => cut += 1,
                    Err(_) => failed += 1,
                }
            }
            format!("{cut} streams cut after their first event; {failed} failed")
        }
        HttpAttack::SlowHeaders => {
            let req = stream_request(&host, 16);
            let mut conns: Vec<Option<TcpStream>> = (0..50).map(|_| connect().ok()).collect();
            let opened = conns.iter().flatten().count();
            let (mut sent, mut closed) = (0usize, 0usize);
            // Until the server has closed them all (what each sent is then `sent` at most).
            while Instant::now() < until && sent < req.len() && conns.iter().any(Option::is_some) {
                for c in conns.iter_mut() {
                    if let Some(s) = c {
                        if s.write_all(&req[sent..sent + 1]).is_err() {
                            *c = None;
                            closed += 1;
                        }
                    }
                }
                sent += 1;
                wait_until((Instant::now() + Duration::from_secs(1)).min(until));
            }
            format!("{opened} connections sent {sent} bytes of their headers a second at a time; the server closed {closed}")
        }
    }
}

/// One answer from `tandem serve` at `url` for `w` (greedy, at most `tokens`): its text and its
/// completion tokens.
fn ask(agent: &ureq::Agent, url: &str, w: &Work, tokens: usize) -> Result<(String, usize)> {
    let mut body = serde_json::json!({
        "messages": w.messages,
        "max_tokens": tokens,
        "temperature": 0,
    });
    if let Some(f) = &w.response_format {
        body["response_format"] = f.clone();
    }
    let r: serde_json::Value = agent
        .post(&format!("{url}/v1/chat/completions"))
        .send_json(body)
        .map_err(|e| anyhow::anyhow!("POST /v1/chat/completions: {e}"))?
        .into_json()?;
    let text = r["choices"][0]["message"]["content"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow::anyhow!("an answer without content: {r}"))?;
    let n = r["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
    Ok((text, n))
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub rss_mb: f64,
    /// The edge process's (`serve`).
    pub edge_rss_mb: Option<f64>,
    /// Tokens committed per second since the last sample, all sessions.
    pub tok_s: f64,
    pub answers: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub sessions: usize,
    pub minutes: f64,
    pub tokens_per_answer: usize,
    pub alpha: f64,
    pub answers: usize,
    pub exact: usize,
    pub wrong: usize,
    /// Sessions that ended in an error.
    pub lost: usize,
    pub attacks: Vec<String>,
    pub rss_first_mb: f64,
    pub rss_last_mb: f64,
    pub rss_max_mb: f64,
    /// Least-squares slope of the RSS over the second half of the run, MB per minute.
    pub rss_slope_mb_per_min: f64,
    /// The same of the edge process (`serve`).
    pub edge_rss_first_mb: Option<f64>,
    pub edge_rss_last_mb: Option<f64>,
    pub edge_rss_max_mb: Option<f64>,
    pub edge_rss_slope_mb_per_min: Option<f64>,
    /// Answers by kind of request (`serve`).
    pub kinds: Vec<KindCount>,
    /// What tandem serve's `/metrics` counted at the end (`serve`): the features at work.
    pub edge_counters: Vec<(String, f64)>,
    pub samples: Vec<Sample>,
    pub errors: Vec<String>,
}

/// The least-squares slope of `(x, y)`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    if den == 0.0 {
        0.0
    } else {
        num / den
    }
}

pub fn run(a: &SoakArgs, progress: &mut dyn FnMut(&str)) -> Result<Report> {
    let model = tandem_models::pull::ensure_model(&a.home, true)?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&model)?)?;
    let extra: Vec<String> = ["--metrics-listen", "127.0.0.1:0"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    progress("starting the verifier");
    let cloud = CloudProcess::start(&a.home, &a.cloud_cpus, &extra)?;
    let url = format!("http://{}", cloud.addr);
    let rt = tandem_client::runtime()?;
    // The target's greedy answers, from the verifier itself (cloud-only decoding).
    let prompts: Vec<Vec<u32>> = crate::load::default_prompts()
        .iter()
        .map(|p| tok.encode_chat(p))
        .collect::<Result<_, _>>()?;
    let wants: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut out = Vec::new();
            tandem_edge::grpc::generate_remote(
                &rt,
                tandem_edge::grpc::Remote::plain(&url),
                tok.fingerprint(),
                p,
                tandem_spec::sampling::SamplingParams::default(),
                a.tokens as u32,
                |t| out.push(t),
            )?;
            Ok(out)
        })
        .collect::<Result<_>>()?;
    let edge = if a.serve {
        progress("starting tandem serve");
        Some(EdgeProcess::start(&a.home, &url, &a.edge_cpus, &[])?)
    } else {
        None
    };
    let works = if a.serve {
        progress("the verifier's answers to the soak's requests");
        works(&rt, &url, &tok, a.tokens)?
    } else {
        Vec::new()
    };
    let kinds = Mutex::new(std::collections::BTreeMap::<&'static str, (usize, usize)>::new());
    let vocab = tok.vocab_size() as u32;
    let deadline = Instant::now() + Duration::from_secs_f64(a.minutes * 60.0);
    let (answers, exact, wrong, lost, committed) = (
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    let errors = Mutex::new(Vec::<String>::new());
    let done = AtomicBool::new(false);
    let attacks = Mutex::new(Vec::<String>::new());
    let mut samples = Vec::new();
    progress(&format!(
        "{} sessions for {:.1} min{}",
        a.sessions,
        a.minutes,
        if a.hostile {
            ", hostile clients taking turns"
        } else {
            ""
        }
    ));
    std::thread::scope(|s| -> Result<()> {
        if let Some(edge) = &edge {
            for i in 0..a.sessions {
                let (works, kinds) = (&works, &kinds);
                let (answers, exact, wrong, lost, committed, errors) =
                    (&answers, &exact, &wrong, &lost, &committed, &errors);
                s.spawn(move || {
                    let agent = ureq::AgentBuilder::new()
                        .timeout(Duration::from_secs(300))
                        .build();
                    let mut round = 0usize;
                    while Instant::now() < deadline {
                        let w = &works[(i + round) % works.len()];
                        round += 1;
                        match ask(&agent, &edge.url, w, a.tokens) {
                            Ok((text, n)) => {
                                answers.fetch_add(1, Ordering::Relaxed);
                                committed.fetch_add(n, Ordering::Relaxed);
                                let ok = text == w.want;
                                if ok {
                                    exact.fetch_add(1, Ordering::Relaxed);
                                } else {
                                    wrong.fetch_add(1, Ordering::Relaxed);
                                    let mut es = errors.lock().unwrap_or_else(|e| e.into_inner());
                                    if es.len() < 20 {
                                        es.push(format!(
                                            "{}: {text:?} where the target says {:?}",
                                            w.kind, w.want
                                        ));
                                    }
                                }
                                let mut k = kinds.lock().unwrap_or_else(|e| e.into_inner());
                                let e = k.entry(w.kind).or_default();
                                e.0 += 1;
                                e.1 += ok as usize;
                            }
                            Err(e) => {
                                lost.fetch_add(1, Ordering::Relaxed);
                                let mut es = errors.lock().unwrap_or_else(|e| e.into_inner());
                                if es.len() < 20 {
                                    es.push(format!("{}: {e}", w.kind));
                                }
                            }
                        }
                    }
                });
            }
        }
        for i in 0..if edge.is_some() { 0 } else { a.sessions } {
            let (rt, url, tok, prompts, wants) = (&rt, &url, &tok, &prompts, &wants);
            let (answers, exact, wrong, lost, committed, errors) =
                (&answers, &exact, &wrong, &lost, &committed, &errors);
            s.spawn(move || {
                let mut round = 0u64;
                while Instant::now() < deadline {
                    let k = (i + round as usize) % prompts.len();
                    let edge = SyntheticEdge {
                        alpha: a.alpha,
                        draft_ms: 15.0,
                        gamma: 4,
                        depth: 2,
                        seed: (i as u64) << 32 | round,
                        vocab,
                        tree: TreeConfig::LINEAR,
                        cover: 0.0,
                        self_draft: true,
                    };
                    round += 1;
                    match synthetic_session(rt, url, tok, &prompts[k], &wants[k], edge) {
                        Ok(r) => {
                            answers.fetch_add(1, Ordering::Relaxed);
                            committed.fetch_add(r.output_ids.len(), Ordering::Relaxed);
                            if r.output_ids == wants[k] {
                                exact.fetch_add(1, Ordering::Relaxed);
                            } else {
                                wrong.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(e) => {
                            lost.fetch_add(1, Ordering::Relaxed);
                            let mut es = errors.lock().unwrap_or_else(|e| e.into_inner());
                            if es.len() < 20 {
                                es.push(e.to_string());
                            }
                        }
                    }
                }
            });
        }
        if a.hostile {
            let (url, tok, prompts, done, attacks) = (&url, &tok, &prompts, &done, &attacks);
            s.spawn(move || {
                let Ok(hrt) = tandem_client::runtime() else {
                    return;
                };
                let t = Tenant {
                    url: url.clone(),
                    key: String::new(),
                    fingerprint: tok.fingerprint().to_string(),
                    prompt: prompts[0].clone(),
                };
                for attack in ATTACKS.iter().cycle() {
                    if done.load(Ordering::Relaxed) || Instant::now() >= deadline {
                        break;
                    }
                    let (stop_tx, stop) = watch::channel(false);
                    let what = hrt.block_on(async {
                        let h = tokio::spawn(run_attack(*attack, t.clone(), stop));
                        let left = deadline.saturating_duration_since(Instant::now());
                        tokio::time::sleep(left.min(Duration::from_secs(60))).await;
                        let _ = stop_tx.send(true);
                        h.await.unwrap_or_else(|e| format!("panicked: {e}"))
                    });
                    attacks
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("{attack:?}: {what}"));
                }
            });
        }
        if let (true, Some(edge)) = (a.hostile, &edge) {
            let (done, attacks) = (&done, &attacks);
            s.spawn(move || {
                for attack in HTTP_ATTACKS.iter().cycle() {
                    if done.load(Ordering::Relaxed) || Instant::now() >= deadline {
                        break;
                    }
                    let until = deadline.min(Instant::now() + Duration::from_secs(60));
                    let what = run_http_attack(*attack, &edge.url, until);
                    attacks
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("HTTP {attack:?}: {what}"));
                }
            });
        }
        // The sampler (this thread).
        let t0 = Instant::now();
        let mut last = (0.0, 0usize);
        while Instant::now() < deadline {
            std::thread::sleep(
                Duration::from_secs(10).min(deadline.saturating_duration_since(Instant::now())),
            );
            let t = t0.elapsed().as_secs_f64();
            let c = committed.load(Ordering::Relaxed);
            let sample = Sample {
                t_s: round2(t),
                rss_mb: round2(cloud.rss_mb().context("the verifier's memory")?),
                edge_rss_mb: match &edge {
                    Some(e) => Some(round2(e.rss_mb().context("tandem serve's memory")?)),
                    None => None,
                },
                tok_s: round2((c - last.1) as f64 / (t - last.0).max(1e-9)),
                answers: answers.load(Ordering::Relaxed),
            };
            progress(&format!(
                "{:>5.0} s  RSS {:>6.1} MB{}  {:>6.1} tok/s  {} answers",
                sample.t_s,
                sample.rss_mb,
                sample
                    .edge_rss_mb
                    .map_or(String::new(), |m| format!(" (edge {m:.1} MB)")),
                sample.tok_s,
                sample.answers
            ));
            samples.push(sample);
            last = (t, c);
        }
        done.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    // What the features did: the draft's and the verifier's prefix caches, drafts accepted.
    let edge_counters = match &edge {
        Some(e) => {
            let text = ureq::get(&format!("{}/metrics", e.url))
                .call()
                .map_err(|err| anyhow::anyhow!("tandem serve's /metrics: {err}"))?
                .into_string()?;
            EDGE_COUNTERS
                .iter()
                .map(|c| {
                    let v = text
                        .lines()
                        .find_map(|l| l.strip_prefix(c)?.strip_prefix(' ')?.parse().ok())
                        .unwrap_or(0.0);
                    (c.to_string(), v)
                })
                .collect()
        }
        None => Vec::new(),
    };
    let rss: Vec<(f64, f64)> = samples.iter().map(|s| (s.t_s / 60.0, s.rss_mb)).collect();
    let half = &rss[rss.len() / 2..];
    let edge_rss: Vec<(f64, f64)> = samples
        .iter()
        .filter_map(|s| Some((s.t_s / 60.0, s.edge_rss_mb?)))
        .collect();
    let some = |v: f64| (!edge_rss.is_empty()).then_some(v);
    let r = Report {
        sessions: a.sessions,
        minutes: a.minutes,
        tokens_per_answer: a.tokens,
        alpha: a.alpha,
        answers: answers.into_inner(),
        exact: exact.into_inner(),
        wrong: wrong.into_inner(),
        lost: lost.into_inner(),
        attacks: attacks.into_inner().unwrap_or_else(|e| e.into_inner()),
        rss_first_mb: rss.first().map_or(0.0, |p| p.1),
        rss_last_mb: rss.last().map_or(0.0, |p| p.1),
        rss_max_mb: rss.iter().map(|p| p.1).fold(0.0, f64::max),
        rss_slope_mb_per_min: round2(slope(half)),
        edge_rss_first_mb: edge_rss.first().map(|p| p.1),
        edge_rss_last_mb: edge_rss.last().map(|p| p.1),
        edge_rss_max_mb: some(edge_rss.iter().map(|p| p.1).fold(0.0, f64::max)),
        edge_rss_slope_mb_per_min: some(round2(slope(&edge_rss[edge_rss.len() / 2..]))),
        edge_counters,
        kinds: kinds
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .into_iter()
            .map(|(kind, (answers, exact))| KindCount {
                kind,
                answers,
                exact,
            })
            .collect(),
        samples,
        errors: errors.into_inner().unwrap_or_else(|e| e.into_inner()),
    };
    if let Some(png) = &a.png {
        let chart = |title: &str, y: &str, points: Vec<(f64, f64)>| Chart {
            title: title.into(),
            x_desc: "minutes".into(),
            y_desc: y.into(),
            log2_x: false,
            diagonal: false,
            series: vec![Series::line(title, 0, points)],
        };
        let tput = r.samples.iter().map(|s| (s.t_s / 60.0, s.tok_s)).collect();
        let mut charts = vec![chart("verifier RSS", "MB", rss)];
        if !edge_rss.is_empty() {
            charts.push(chart("tandem serve RSS", "MB", edge_rss));
        }
        charts.push(chart("committed tokens/s", "tokens/s", tput));
        crate::plots::draw(png, &charts, 640, 400)?;
    }
    Ok(r)
}

pub fn table(r: &Report) -> String {
    let mut s = format!(
        "{} for {:.1} min ({} tokens per answer, {}): {} answers, {} exact, {} wrong, {} lost\n\
         verifier RSS: first {:.0} MB, last {:.0} MB, max {:.0} MB, slope over the second half {:+.2} MB/min\n",
        if r.kinds.is_empty() {
            format!("{} synthetic sessions", r.sessions)
        } else {
            format!("{} API clients of tandem serve", r.sessions)
        },
        r.minutes,
        r.tokens_per_answer,
        if r.kinds.is_empty() {
            format!("α {}", r.alpha)
        } else {
            "greedy, checked against the verifier's cloud-only answers".into()
        },
        r.answers,
        r.exact,
        r.wrong,
        r.lost,
        r.rss_first_mb,
        r.rss_last_mb,
        r.rss_max_mb,
        r.rss_slope_mb_per_min
    );
    if let (Some(f), Some(l), Some(m), Some(sl)) = (
        r.edge_rss_first_mb,
        r.edge_rss_last_mb,
        r.edge_rss_max_mb,
        r.edge_rss_slope_mb_per_min,
    ) {
        s += &format!(
            "tandem serve RSS: first {f:.0} MB, last {l:.0} MB, max {m:.0} MB, slope over the second half {sl:+.2} MB/min\n"
        );
    }
    for k in &r.kinds {
        s += &format!("  {}: {} answers, {} exact\n", k.kind, k.answers, k.exact);
    }
    for (c, v) in &r.edge_counters {
        s += &format!("  tandem serve {c} {v}\n");
    }
    for a in &r.attacks {
        s += &format!("  attack {a}\n");
    }
    for e in &r.errors {
        s += &format!("  error: {e}\n");
    }
    s
}
