//! `tandem bench soak`: one verifier process under churn for minutes. N synthetic edges (the load
//! benchmark's: right with probability α, speaking the real protocol) open session after session,
//! each checked against the target's greedy answer, while hostile clients of
//! [`crate::hostile`] take turns beside them; every 10 s the verifier's resident memory and the
//! tokens committed are sampled. It reports lost sessions (errors), wrong answers, and the memory
//! trend, and draws memory and throughput over time.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use tandem_engine::{CpuSet, GgufFile, Tokenizer};
use tandem_spec::TreeConfig;
use tokio::sync::watch;

use crate::cloudproc::CloudProcess;
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
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub rss_mb: f64,
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
        for i in 0..a.sessions {
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
                tok_s: round2((c - last.1) as f64 / (t - last.0).max(1e-9)),
                answers: answers.load(Ordering::Relaxed),
            };
            progress(&format!(
                "{:>5.0} s  RSS {:>6.1} MB  {:>6.1} tok/s  {} answers",
                sample.t_s, sample.rss_mb, sample.tok_s, sample.answers
            ));
            samples.push(sample);
            last = (t, c);
        }
        done.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    let rss: Vec<(f64, f64)> = samples.iter().map(|s| (s.t_s / 60.0, s.rss_mb)).collect();
    let half = &rss[rss.len() / 2..];
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
        crate::plots::draw(
            png,
            &[
                chart("verifier RSS", "MB", rss),
                chart("committed tokens/s", "tokens/s", tput),
            ],
            640,
            400,
        )?;
    }
    Ok(r)
}

pub fn table(r: &Report) -> String {
    let mut s = format!(
        "{} sessions for {:.1} min ({} tokens per answer, α {}): {} answers, {} exact, {} wrong, {} lost\n\
         verifier RSS: first {:.0} MB, last {:.0} MB, max {:.0} MB, slope over the second half {:+.2} MB/min\n",
        r.sessions,
        r.minutes,
        r.tokens_per_answer,
        r.alpha,
        r.answers,
        r.exact,
        r.wrong,
        r.lost,
        r.rss_first_mb,
        r.rss_last_mb,
        r.rss_max_mb,
        r.rss_slope_mb_per_min
    );
    for a in &r.attacks {
        s += &format!("  attack {a}\n");
    }
    for e in &r.errors {
        s += &format!("  error: {e}\n");
    }
    s
}
