//! `tandem bench load`: one verifier, many edges. N synthetic edges speak the real protocol to the
//! real verifier (its own pinned process) through a netem link: each knows the target's greedy
//! continuation of its prompt (computed once, by the verifier) and drafts each token right with
//! probability α at D ms per token, reacting to verdicts through the same pipeline state machine
//! as a real edge ([`crate::synthetic::SyntheticDrafter`]). Beside them, the cloud-only baseline: N
//! clients of the `Generate` RPC, so the verifier decodes every token itself. Before the sweep the
//! target's forward time is measured against tokens per forward, on the verifier's core, to find
//! the ridge where it turns compute-bound.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::synthetic::SyntheticDrafter;
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use tandem_edge::grpc::{GrpcLink, OpenRequest};
use tandem_edge::SpecConfig;
use tandem_engine::{
    CpuSet, Engine, EngineConfig, LlamaModel, SamplingParams, SeqChunk, SeqId, Tokenizer, Wanted,
};
use tandem_spec::VerifyRule;

use crate::cloudproc::{CloudProcess, Link};
use tandem_sim::stats::{round2, Summary};

#[derive(Debug, Clone)]
pub struct LoadArgs {
    pub home: PathBuf,
    pub sessions: Vec<usize>,
    pub alphas: Vec<f64>,
    pub rtt_ms: f64,
    pub jitter_frac: f64,
    pub draft_ms: f64,
    /// Seconds measured, after `warmup_s` seconds of load that are not (the first prompts'
    /// prefill burst).
    pub duration_s: f64,
    pub warmup_s: f64,
    /// What each edge asks for; the verifier's load-aware grant may give less. One row per depth
    /// and α: depth 1 is synchronous speculation (`sync`), more is pipelined (`async`).
    pub gamma: usize,
    pub depths: Vec<usize>,
    pub max_new: usize,
    pub prompts: Vec<String>,
    pub token_budget: usize,
    pub kv_budget_mb: usize,
    pub cloud_only: bool,
    pub edge_cpus: CpuSet,
    pub cloud_cpus: CpuSet,
    /// Grants shrink as tokens per forward near this; `None`: twice the measured ridge (where a
    /// forward takes about twice the one-token time).
    pub saturation_tokens: Option<f64>,
}

/// Target forward time against tokens per forward, on the verifier's cores.
#[derive(Debug, Clone, Serialize)]
pub struct Roofline {
    /// The time of a one-token forward (the weights read once).
    pub one_token_ms: f64,
    /// (tokens per forward, ms).
    pub points: Vec<(usize, f64)>,
    /// ms per extra token once compute-bound (the slope over the largest sizes).
    pub ms_per_token: f64,
    /// Tokens per forward where the compute line meets the one-token time.
    pub ridge_tokens: f64,
}

/// One mode at one load.
#[derive(Debug, Clone, Serialize)]
pub struct LoadRow {
    /// `cloud-only`, `sync` (depth 1) or `async`.
    pub mode: String,
    /// Blocks in flight each edge asked for (0 for cloud-only).
    pub depth: usize,
    pub sessions: usize,
    /// The synthetic edges' α (None for cloud-only), and the α the verifier measured.
    pub alpha: Option<f64>,
    pub measured_alpha: f64,
    /// Committed tokens per second, all sessions together, within the window.
    pub throughput_tok_s: f64,
    pub itl_ms: Summary,
    pub ttft_ms: Summary,
    /// From the verifier's metrics over the window.
    pub mean_batch_sessions: f64,
    pub mean_tokens_per_forward: f64,
    /// The verifier's mean time per forward step under this load, and the share of the window
    /// it spent in forward steps (the rest: waiting, and the protocol's work on its core).
    pub forward_ms_mean: f64,
    pub forward_busy_share: f64,
    pub queue_ms_mean: f64,
    pub forwards_per_token: f64,
    /// 1 / E[A] at the measured α and the mean granted γ (speculation only).
    pub forwards_per_token_bound: Option<f64>,
    pub mean_granted_gamma: f64,
    /// Share of the sessions' tokens the verifier decoded itself (1 for cloud-only).
    pub cloud_decoded_share: f64,
    /// Within the window: sessions whose KV was dropped for room (recomputed later), and
    /// speculation sessions the verifier took over.
    pub preemptions: f64,
    pub takeovers: f64,
    pub sessions_run: usize,
    /// Sessions whose output differed from the target's (must be 0), and refused or failed ones.
    pub mismatches: usize,
    pub failures: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    pub rtt_ms: f64,
    pub draft_ms: f64,
    pub duration_s: f64,
    pub gamma: usize,
    pub depths: Vec<usize>,
    pub token_budget: usize,
    pub roofline: Roofline,
    /// Tokens per forward the verifier's grants were tuned to.
    pub saturation_tokens: f64,
    /// α of the real drafts against the target on the same prompts (greedy, teacher-forced).
    pub real_alpha: Vec<(String, f64)>,
    pub rows: Vec<LoadRow>,
    /// ITL SLOs (ms): p99 within 3×, and mean within 1.5×, the single-session cloud-only mean ITL.
    pub slo_ms: f64,
    pub mean_slo_ms: f64,
    pub capacity: Vec<Capacity>,
    pub edge_cpus: String,
    pub cloud_cpus: String,
}

/// The most sessions of the sweep a mode served within each SLO.
#[derive(Debug, Clone, Serialize)]
pub struct Capacity {
    pub mode: String,
    /// Blocks in flight (0 for cloud-only).
    pub depth: usize,
    pub alpha: Option<f64>,
    /// p99 ITL ≤ `slo_ms`.
    pub sessions_within_p99_slo: usize,
    /// Mean ITL ≤ `mean_slo_ms`.
    pub sessions_within_mean_slo: usize,
}

/// Measure the target's forward time against tokens per forward on `cpus` (one chunk of n new
/// tokens; median of 3), and fit the compute slope over the largest sizes.
pub fn roofline(target: &Arc<LlamaModel>, cpus: &CpuSet) -> Result<Roofline> {
    let mut e = Engine::new(
        target.clone(),
        EngineConfig {
            threads: cpus.len().max(1),
            kv_budget_bytes: 64 << 20,
            cpus: *cpus,
            ..EngineConfig::default()
        },
    )?;
    let (points, cost) =
        tandem_cloud::measure_forward_cost(&mut e, &[1, 2, 4, 8, 16, 32, 64, 128], 3)?;
    Ok(Roofline {
        one_token_ms: round2(cost.one_token_ms),
        ridge_tokens: round2(cost.ridge_tokens()),
        ms_per_token: round2(cost.ms_per_token),
        points: points.into_iter().map(|(n, t)| (n, round2(t))).collect(),
    })
}

/// Greedy acceptance of `draft` against the target's continuation `want` of `prompt`: the share
/// of positions where the draft's argmax, fed the target's prefix, is the target's token.
pub fn teacher_forced_alpha(draft: &Arc<LlamaModel>, prompt: &[u32], want: &[u32]) -> Result<f64> {
    let hits = teacher_forced_hits(draft, prompt, want)?;
    Ok(hits.iter().filter(|&&h| h).count() as f64 / hits.len().max(1) as f64)
}

/// For each token of the target's continuation `want` of `prompt`: whether the draft's argmax, fed
/// the target's prefix, is that token.
pub fn teacher_forced_hits(
    draft: &Arc<LlamaModel>,
    prompt: &[u32],
    want: &[u32],
) -> Result<Vec<bool>> {
    if want.is_empty() {
        return Ok(Vec::new());
    }
    let mut e = Engine::new(
        draft.clone(),
        EngineConfig {
            threads: 1,
            kv_budget_bytes: 64 << 20,
            ..EngineConfig::default()
        },
    )?;
    let mut tokens = prompt.to_vec();
    tokens.extend_from_slice(&want[..want.len() - 1]);
    let at: Vec<usize> = (prompt.len() - 1..tokens.len()).collect();
    let l = e.forward(&[SeqChunk::new(SeqId(1), 0, tokens, Wanted::At(at))])?;
    Ok(want
        .iter()
        .enumerate()
        .map(|(i, &w)| tandem_engine::sampler::argmax(l.row(i)) == w)
        .collect())
}

/// Parse Prometheus text into `name{labels}` → value.
fn parse_metrics(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// What one session produced: its commit times (absolute) and whether it was the target's.
struct SessionOut {
    start: Instant,
    /// (time, tokens committed at it)
    commits: Vec<(Instant, usize)>,
    ok: bool,
    gamma: usize,
    /// Drafted tokens the target accepted, and rejections (the edge's own counts).
    accepted: usize,
    rejections: usize,
    /// Tokens the verifier decoded itself (taken over), and all the session's tokens.
    cloud_decoded: usize,
    tokens: usize,
}

/// Per-token gaps of the commits inside `window`: a commit of k tokens after a gap g counts k
/// gaps of g / k; the first commit of a session counts its time to first token.
fn gaps(outs: &[SessionOut], window: (Instant, Instant)) -> (Vec<f64>, Vec<f64>) {
    let (mut itl, mut ttft) = (Vec::new(), Vec::new());
    let inside = |t: Instant| t >= window.0 && t <= window.1;
    for o in outs {
        let mut last: Option<Instant> = None;
        for &(t, k) in &o.commits {
            match last {
                None if inside(t) => ttft.push((t - o.start).as_secs_f64() * 1e3),
                Some(l) if inside(t) => {
                    let g = (t - l).as_secs_f64() * 1e3 / k.max(1) as f64;
                    itl.extend(std::iter::repeat_n(g, k.max(1)));
                }
                _ => {}
            }
            last = Some(t);
        }
    }
    (itl, ttft)
}

/// Group a report's per-token commit times (ms from `start`) into commits.
fn commits_of(start: Instant, commit_ms: &[f64]) -> Vec<(Instant, usize)> {
    let mut out: Vec<(Instant, usize)> = Vec::new();
    let mut prev = f64::NAN;
    for &ms in commit_ms {
        if ms == prev {
            if let Some(l) = out.last_mut() {
                l.1 += 1;
            }
        } else {
            out.push((start + Duration::from_secs_f64(ms / 1e3), 1));
            prev = ms;
        }
    }
    out
}

struct Job<'a> {
    url: &'a str,
    tok: &'a Tokenizer,
    prompts: &'a [Vec<u32>],
    wants: &'a [Vec<u32>],
    vocab: u32,
    a: &'a LoadArgs,
}

/// What one synthetic edge asks the verifier for, and how it drafts.
#[derive(Debug, Clone, Copy)]
pub struct SyntheticEdge {
    pub alpha: f64,
    pub draft_ms: f64,
    pub gamma: usize,
    pub depth: usize,
    pub seed: u64,
    /// The target's vocabulary size (a wrong guess is a token id below it).
    pub vocab: u32,
}

/// One synthetic speculation session against the verifier at `url`: `want` is the target's greedy
/// continuation of `prompt` (the session asks for that many tokens). Returns the edge's run.
pub fn synthetic_session(
    rt: &tokio::runtime::Runtime,
    url: &str,
    tok: &Tokenizer,
    prompt: &[u32],
    want: &[u32],
    edge: SyntheticEdge,
) -> Result<tandem_edge::SpecReport> {
    let start = Instant::now();
    let req = OpenRequest {
        tokenizer_fingerprint: tok.fingerprint().to_string(),
        prompt_ids: prompt.to_vec(),
        params: SamplingParams::default(),
        max_tokens: want.len() as u32,
        rule: VerifyRule::Greedy,
        want_draft_len: edge.gamma as u32,
        want_depth: edge.depth as u32,
        api_key: None,
    };
    let (mut link, opened) = GrpcLink::connect(rt, url, req)?;
    let cfg = SpecConfig {
        draft_len: edge.gamma,
        depth: edge.depth,
        max_new_tokens: want.len(),
        rule: VerifyRule::Greedy,
        params: SamplingParams::default(),
        q_top_k: 0,
        auto: None,
        granted: Some((opened.draft_len as usize, opened.depth as usize)),
    };
    let mut d = SyntheticDrafter::new(
        prompt.len(),
        want.to_vec(),
        edge.alpha,
        edge.draft_ms,
        edge.vocab,
        edge.seed,
    );
    let r = tandem_edge::run_with(
        &mut d,
        tok.eog_ids(),
        prompt,
        opened.first_token,
        &cfg,
        &mut link,
        start,
        |_| {},
    )?;
    link.close();
    Ok(r)
}

/// One synthetic speculative session of the sweep.
fn spec_session(
    j: &Job<'_>,
    rt: &tokio::runtime::Runtime,
    k: usize,
    (alpha, depth): (f64, usize),
    seed: u64,
) -> Result<SessionOut> {
    let (prompt, want) = (&j.prompts[k], &j.wants[k]);
    let start = Instant::now();
    let edge = SyntheticEdge {
        alpha,
        draft_ms: j.a.draft_ms,
        gamma: j.a.gamma,
        depth,
        seed,
        vocab: j.vocab,
    };
    let r = synthetic_session(rt, j.url, j.tok, prompt, want, edge)?;
    Ok(SessionOut {
        start,
        commits: commits_of(start, &r.commit_ms),
        ok: r.output_ids == *want,
        gamma: r.measured.final_draft_len,
        accepted: r.stats.accepted,
        rejections: r.stats.rejections,
        cloud_decoded: r.measured.cloud_decoded,
        tokens: r.output_ids.len(),
    })
}

/// One cloud-only generation.
fn cloud_session(j: &Job<'_>, rt: &tokio::runtime::Runtime, k: usize) -> Result<SessionOut> {
    let (prompt, want) = (&j.prompts[k], &j.wants[k]);
    let start = Instant::now();
    let mut commits = Vec::new();
    let mut out = Vec::new();
    tandem_edge::grpc::generate_remote(
        rt,
        j.url,
        None,
        j.tok.fingerprint(),
        prompt,
        SamplingParams::default(),
        want.len() as u32,
        |t| {
            commits.push((Instant::now(), 1));
            out.push(t);
        },
    )?;
    Ok(SessionOut {
        start,
        commits,
        ok: out == *want,
        gamma: 0,
        accepted: 0,
        rejections: 0,
        cloud_decoded: out.len(),
        tokens: out.len(),
    })
}

/// N closed-loop users for `duration_s`: each starts sessions one after another (prompts in turn)
/// until the window closes, then finishes the one it is in.
/// `spec`: the synthetic edges' α and depth; `None`: cloud-only clients.
fn drive(
    j: &Job<'_>,
    n: usize,
    spec: Option<(f64, usize)>,
    cloud: &CloudProcess,
) -> Result<LoadRow> {
    let alpha = spec.map(|s| s.0);
    let rt = crate::runtime()?;
    let t0 = Instant::now();
    let from = t0 + Duration::from_secs_f64(j.a.warmup_s);
    let deadline = from + Duration::from_secs_f64(j.a.duration_s);
    let mut before = None;
    type Users = Vec<(Vec<SessionOut>, usize)>;
    let (results, after): (Users, Option<String>) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|u| {
                let rt = &rt;
                s.spawn(move || {
                    if let Err(e) = tandem_engine::affinity::pin_current_thread(&j.a.edge_cpus) {
                        tracing::warn!("edge thread not pinned: {e}");
                    }
                    // Stagger the users over the first half second.
                    std::thread::sleep(Duration::from_millis((u as u64 * 7919) % 500));
                    let (mut outs, mut failures) = (Vec::new(), 0);
                    let mut k = u;
                    while Instant::now() < deadline {
                        let p = k % j.prompts.len();
                        let r = match spec {
                            Some(s) => spec_session(j, rt, p, s, (u as u64) << 32 | k as u64),
                            None => cloud_session(j, rt, p),
                        };
                        match r {
                            Ok(o) => outs.push(o),
                            Err(e) => {
                                failures += 1;
                                tracing::warn!("session failed: {e:#}");
                                std::thread::sleep(Duration::from_millis(100));
                            }
                        }
                        k += n;
                    }
                    (outs, failures)
                })
            })
            .collect();
        // The verifier's counters over the window.
        std::thread::sleep(from.saturating_duration_since(Instant::now()));
        before = cloud.scrape().ok();
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
        let after = cloud.scrape().ok();
        let r = hs
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect();
        (r, after)
    });
    let before = parse_metrics(&before.ok_or_else(|| anyhow!("scraping /metrics"))?);
    let after = parse_metrics(&after.ok_or_else(|| anyhow!("scraping /metrics"))?);
    let delta = |k: &str| after.get(k).unwrap_or(&0.0) - before.get(k).unwrap_or(&0.0);
    let failures = results.iter().map(|r| r.1).sum();
    let outs: Vec<SessionOut> = results.into_iter().flat_map(|r| r.0).collect();
    let in_window: usize = outs
        .iter()
        .flat_map(|o| o.commits.iter())
        .filter(|(t, _)| *t >= from && *t <= deadline)
        .map(|(_, k)| k)
        .sum();
    let (itl, ttft) = gaps(&outs, (from, deadline));
    let committed = in_window;
    let forwards = delta("tandem:target_forwards_total");
    // α per judged position: accepted / (accepted + rejections), as the edges counted.
    let (acc, rej) = outs
        .iter()
        .fold((0, 0), |s, o| (s.0 + o.accepted, s.1 + o.rejections));
    let measured_alpha = if acc + rej > 0 {
        acc as f64 / (acc + rej) as f64
    } else {
        0.0
    };
    let gamma = if alpha.is_some() && !outs.is_empty() {
        outs.iter().map(|o| o.gamma as f64).sum::<f64>() / outs.len() as f64
    } else {
        0.0
    };
    let ratio = |a: &str, b: &str| {
        let d = delta(b);
        if d > 0.0 {
            delta(a) / d
        } else {
            0.0
        }
    };
    let r2 = |s: Summary| Summary {
        mean: round2(s.mean),
        p50: round2(s.p50),
        p99: round2(s.p99),
    };
    Ok(LoadRow {
        mode: mode_name(spec.map(|s| s.1)).into(),
        depth: spec.map_or(0, |s| s.1),
        sessions: n,
        alpha,
        measured_alpha: round2(measured_alpha),
        throughput_tok_s: round2(in_window as f64 / j.a.duration_s),
        itl_ms: r2(Summary::of(&itl)),
        ttft_ms: r2(Summary::of(&ttft)),
        mean_batch_sessions: round2(ratio("tandem:batch_size_sum", "tandem:batch_size_count")),
        mean_tokens_per_forward: round2(ratio(
            "tandem:tokens_per_forward_sum",
            "tandem:tokens_per_forward_count",
        )),
        forward_ms_mean: round2(
            1e3 * ratio("tandem:forward_seconds_sum", "tandem:forward_seconds_count"),
        ),
        forward_busy_share: round2(delta("tandem:forward_seconds_sum") / j.a.duration_s),
        queue_ms_mean: round2(
            1e3 * ratio(
                "tandem:queue_time_seconds_sum",
                "tandem:queue_time_seconds_count",
            ),
        ),
        forwards_per_token: if committed > 0 {
            round2(forwards / committed as f64)
        } else {
            0.0
        },
        forwards_per_token_bound: alpha.map(|_| {
            let g = gamma.max(1.0);
            let a = measured_alpha.clamp(0.0, 0.999_999);
            round2((1.0 - a) / (1.0 - a.powf(g + 1.0)))
        }),
        mean_granted_gamma: round2(gamma),
        cloud_decoded_share: {
            let (c, t) = outs
                .iter()
                .fold((0, 0), |s, o| (s.0 + o.cloud_decoded, s.1 + o.tokens));
            round2(c as f64 / t.max(1) as f64)
        },
        preemptions: delta("tandem:preemptions_total"),
        takeovers: delta("tandem:takeovers_total"),
        sessions_run: outs.len(),
        mismatches: outs.iter().filter(|o| !o.ok).count(),
        failures,
    })
}

/// A row's mode by the blocks in flight its edges asked for: `cloud-only` (none), `sync` (1) or
/// `async`.
pub fn mode_name(depth: Option<usize>) -> &'static str {
    match depth {
        None => "cloud-only",
        Some(1) => "sync",
        Some(_) => "async",
    }
}

/// A row's mode for tables and legends: async rows name their depth.
pub fn shape_label(mode: &str, depth: usize) -> String {
    if mode == "async" {
        format!("async (depth {depth})")
    } else {
        mode.to_string()
    }
}

/// Run the sweep; `on_row` sees each row as it finishes.
pub fn run(
    a: &LoadArgs,
    target: &Arc<LlamaModel>,
    tok: &Tokenizer,
    real_drafts: &[(String, Arc<LlamaModel>)],
    mut on_row: impl FnMut(&LoadRow),
) -> Result<LoadReport> {
    if a.sessions.is_empty() || a.sessions.contains(&0) {
        bail!("--sessions: give one or more counts, each at least 1");
    }
    if a.depths.contains(&0) {
        bail!("--depth: blocks in flight must each be at least 1");
    }
    if let Some(x) = a.alphas.iter().find(|x| !(0.0..=1.0).contains(*x)) {
        bail!("--alpha: {x} is not a probability");
    }
    let roof = roofline(target, &a.cloud_cpus).context("measuring the roofline")?;
    let saturation = a
        .saturation_tokens
        .unwrap_or(2.0 * roof.ridge_tokens.max(1.0));
    let cloud = CloudProcess::start(
        &a.home,
        &a.cloud_cpus,
        &[
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
            "--token-budget".into(),
            a.token_budget.to_string(),
            "--saturation-tokens".into(),
            saturation.to_string(),
            "--forward-cost".into(),
            format!("{},{}", roof.one_token_ms, roof.ms_per_token),
            "--max-draft-len".into(),
            a.gamma.to_string(),
            "--max-depth".into(),
            a.depths.iter().max().copied().unwrap_or(1).to_string(),
            "--max-waiting-tokens".into(),
            "100000".into(),
            "--kv-budget-mb".into(),
            a.kv_budget_mb.to_string(),
        ],
    )?;
    let prompts: Vec<Vec<u32>> = a
        .prompts
        .iter()
        .map(|p| tok.encode_chat(p))
        .collect::<Result<_, _>>()?;
    // The target's continuations, once, from the verifier itself.
    let direct = format!("http://{}", cloud.addr);
    let wants: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let rt = crate::runtime()?;
            let mut out = Vec::new();
            tandem_edge::grpc::generate_remote(
                &rt,
                &direct,
                None,
                tok.fingerprint(),
                p,
                SamplingParams::default(),
                a.max_new as u32,
                |t| out.push(t),
            )?;
            Ok(out)
        })
        .collect::<Result<_>>()?;
    if wants.iter().any(|w| w.len() < 2) {
        bail!("a prompt's answer is shorter than 2 tokens: choose longer-answer prompts");
    }
    let mut real_alpha = Vec::new();
    for (name, d) in real_drafts {
        let mut sum = 0.0;
        for (p, w) in prompts.iter().zip(&wants) {
            sum += teacher_forced_alpha(d, p, w)?;
        }
        real_alpha.push((name.clone(), round2(sum / prompts.len() as f64)));
    }
    let mut link = Link::new()?;
    let url = link.set(&cloud.addr, a.rtt_ms, a.rtt_ms * a.jitter_frac)?;
    let job = Job {
        url: &url,
        tok,
        prompts: &prompts,
        wants: &wants,
        vocab: target.cfg.vocab as u32,
        a,
    };
    let mut rows = Vec::new();
    for &n in &a.sessions {
        if a.cloud_only {
            let r = drive(&job, n, None, &cloud)?;
            on_row(&r);
            rows.push(r);
        }
        for &alpha in &a.alphas {
            for &depth in &a.depths {
                let r = drive(&job, n, Some((alpha, depth)), &cloud)?;
                on_row(&r);
                rows.push(r);
            }
        }
    }
    let base = rows
        .iter()
        .filter(|r| r.mode == "cloud-only")
        .min_by_key(|r| r.sessions)
        .map(|r| r.itl_ms.mean)
        .ok_or_else(|| anyhow!("no cloud-only baseline was run"))
        .unwrap_or(0.0);
    let slo_ms = round2(3.0 * base);
    let mean_slo_ms = round2(1.5 * base);
    let mut capacity = Vec::new();
    let mut modes: Vec<(String, usize, Option<f64>)> = Vec::new();
    for r in &rows {
        let key = (r.mode.clone(), r.depth, r.alpha);
        if !modes.contains(&key) {
            modes.push(key);
        }
    }
    for (mode, depth, alpha) in modes {
        let within = |ok: &dyn Fn(&LoadRow) -> bool| {
            rows.iter()
                .filter(|r| {
                    r.mode == mode
                        && r.depth == depth
                        && r.alpha == alpha
                        && r.mismatches == 0
                        && ok(r)
                })
                .map(|r| r.sessions)
                .max()
                .unwrap_or(0)
        };
        capacity.push(Capacity {
            sessions_within_p99_slo: within(&|r| r.itl_ms.p99 <= slo_ms),
            sessions_within_mean_slo: within(&|r| r.itl_ms.mean <= mean_slo_ms),
            mode,
            depth,
            alpha,
        });
    }
    Ok(LoadReport {
        rtt_ms: a.rtt_ms,
        draft_ms: a.draft_ms,
        duration_s: a.duration_s,
        gamma: a.gamma,
        depths: a.depths.clone(),
        token_budget: a.token_budget,
        roofline: roof,
        saturation_tokens: round2(saturation),
        real_alpha,
        rows,
        slo_ms,
        mean_slo_ms,
        capacity,
        edge_cpus: a.edge_cpus.to_string(),
        cloud_cpus: a.cloud_cpus.to_string(),
    })
}

/// The report as Markdown tables.
pub fn table(r: &LoadReport) -> String {
    let mut s = String::new();
    s.push_str("Target forward time vs tokens per forward (verifier cores):\n\n| tokens | ms | ms/token |\n|---|---|---|\n");
    for (n, t) in &r.roofline.points {
        s.push_str(&format!("| {n} | {t:.1} | {:.2} |\n", t / *n as f64));
    }
    s.push_str(&format!(
        "\nCompute slope {:.2} ms/token; ridge ≈ {:.1} tokens per forward (one-token time / slope); grants shrink above ¾ of {:.1} tokens per forward.\n",
        r.roofline.ms_per_token, r.roofline.ridge_tokens, r.saturation_tokens
    ));
    if !r.real_alpha.is_empty() {
        let a: Vec<String> = r
            .real_alpha
            .iter()
            .map(|(n, a)| format!("{n} {a:.2}"))
            .collect();
        s.push_str(&format!(
            "Real drafts' greedy α on these prompts: {}.\n",
            a.join(", ")
        ));
    }
    s.push_str(&format!(
        "\nRTT {} ms, synthetic draft {} ms/token, γ ≤ {}, depth {:?}, token budget {}, {} s measured per row; SLOs: p99 ITL ≤ {:.1} ms, mean ITL ≤ {:.1} ms (3× and 1.5× the single-session cloud-only mean).\n\n",
        r.rtt_ms, r.draft_ms, r.gamma, r.depths, r.token_budget, r.duration_s, r.slo_ms, r.mean_slo_ms
    ));
    s.push_str("| mode | N | α (set / measured) | tok/s | ITL mean | ITL p50 | ITL p99 | TTFT p50 | batch | tokens/fwd | fwd ms (busy) | queue ms | fwd/token (bound) | γ granted | cloud-decoded | ÷ cloud-only | sessions | wrong |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for x in &r.rows {
        let alpha = x
            .alpha
            .map_or("-".into(), |a| format!("{a:.2} / {:.2}", x.measured_alpha));
        let bound = x
            .forwards_per_token_bound
            .map_or(String::new(), |b| format!(" ({b:.2})"));
        let base = r
            .rows
            .iter()
            .find(|c| c.alpha.is_none() && c.sessions == x.sessions)
            .filter(|c| c.throughput_tok_s > 0.0);
        let ratio = base.map_or("-".into(), |c| {
            format!("{:.2}", x.throughput_tok_s / c.throughput_tok_s)
        });
        s.push_str(&format!(
            "| {} | {} | {alpha} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {:.1} ({:.0}%) | {:.1} | {:.2}{bound} | {:.1} | {:.0}% | {ratio} | {} | {} |\n",
            shape_label(&x.mode, x.depth),
            x.sessions,
            x.throughput_tok_s,
            x.itl_ms.mean,
            x.itl_ms.p50,
            x.itl_ms.p99,
            x.ttft_ms.p50,
            x.mean_batch_sessions,
            x.mean_tokens_per_forward,
            x.forward_ms_mean,
            100.0 * x.forward_busy_share,
            x.queue_ms_mean,
            x.forwards_per_token,
            x.mean_granted_gamma,
            100.0 * x.cloud_decoded_share,
            x.sessions_run,
            x.mismatches + x.failures,
        ));
    }
    s.push_str("\nSessions served within each SLO (largest N of the sweep; p99 / mean):\n\n");
    for c in &r.capacity {
        let a = c.alpha.map_or(String::new(), |a| format!(" α {a:.2}"));
        let d = if c.depth > 1 {
            format!(" depth {}", c.depth)
        } else {
            String::new()
        };
        s.push_str(&format!(
            "- {}{d}{a}: {} / {}\n",
            c.mode, c.sessions_within_p99_slo, c.sessions_within_mean_slo
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_group_and_gaps_spread_over_tokens() {
        let t0 = Instant::now();
        let c = commits_of(t0, &[10.0, 30.0, 30.0, 30.0, 40.0]);
        assert_eq!(c.iter().map(|x| x.1).collect::<Vec<_>>(), vec![1, 3, 1]);
        let o = SessionOut {
            start: t0,
            commits: c,
            ok: true,
            gamma: 2,
            accepted: 0,
            rejections: 0,
            cloud_decoded: 0,
            tokens: 5,
        };
        let (itl, ttft) = gaps(&[o], (t0, t0 + Duration::from_secs(1)));
        assert_eq!(ttft.len(), 1);
        assert!((ttft[0] - 10.0).abs() < 0.01);
        assert_eq!(itl.len(), 4);
        assert!((itl[0] - 20.0 / 3.0).abs() < 0.01 && (itl[3] - 10.0).abs() < 0.01);
        let m = parse_metrics("# HELP x\na_total 3\nb{l=\"1\"} 2.5\n");
        assert_eq!(m["a_total"], 3.0);
        assert_eq!(m["b{l=\"1\"}"], 2.5);
    }
}
