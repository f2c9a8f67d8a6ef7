//! The sessions of the sweep: synthetic speculation sessions and cloud-only generations, and the
//! closed-loop users that run them one after another.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use tandem_edge::grpc::{GrpcLink, OpenRequest};
use tandem_edge::synthetic::SyntheticDrafter;
use tandem_edge::SpecConfig;
use tandem_engine::Tokenizer;
use tandem_spec::sampling::SamplingParams;
use tandem_spec::{TreeConfig, VerifyRule};

use crate::cloudproc::CloudProcess;

use super::{mode_of, parse_metrics, LoadArgs, LoadRow};
use tandem_sim::stats::{round2, Summary};

/// What one session produced: its commit times (absolute) and whether it was the target's.
pub(super) struct SessionOut {
    pub(super) start: Instant,
    /// (time, tokens committed at it)
    pub(super) commits: Vec<(Instant, usize)>,
    pub(super) ok: bool,
    pub(super) gamma: usize,
    /// Drafted tokens the target accepted, and rejections (the edge's own counts).
    pub(super) accepted: usize,
    pub(super) rejections: usize,
    /// Tokens the verifier decoded itself (taken over), and all the session's tokens.
    pub(super) cloud_decoded: usize,
    pub(super) tokens: usize,
    /// Side nodes sent, and commits a branch guessed.
    pub(super) side_nodes: usize,
    pub(super) lane_hits: usize,
}

/// Per-token gaps of the commits inside `window`: a commit of k tokens after a gap g counts k
/// gaps of g / k; the first commit of a session counts its time to first token.
pub(super) fn gaps(outs: &[SessionOut], window: (Instant, Instant)) -> (Vec<f64>, Vec<f64>) {
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

pub(super) struct Job<'a> {
    pub(super) url: &'a str,
    pub(super) tok: &'a Tokenizer,
    pub(super) prompts: &'a [Vec<u32>],
    pub(super) wants: &'a [Vec<u32>],
    pub(super) vocab: u32,
    pub(super) a: &'a LoadArgs,
    /// The verifier drafts for the sessions (and the cloud-only generations) from their text.
    pub(super) self_draft: bool,
}

/// A speculative row's synthetic edges: α, blocks in flight, token trees.
pub(super) type Spec = (f64, usize, TreeConfig);

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
    /// Token trees (`TreeConfig::LINEAR`: none), and the share of misses the second choice
    /// covers.
    pub tree: TreeConfig,
    pub cover: f64,
    /// Let the verifier draft for the session from its own text (protocol 7).
    pub self_draft: bool,
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
        want_side_nodes: edge.tree.side_nodes as u32,
        api_key: None,
        tls_ca: None,
        route: None,
        grammar: None,
        output_from: None,
        logprobs: None,
        self_draft: edge.self_draft,
    };
    let (mut link, opened) = GrpcLink::connect(rt, url, req)?;
    let cfg = SpecConfig {
        session: tandem_spec::edge::SessionConfig {
            draft_len: edge.gamma,
            depth: edge.depth,
            max_new_tokens: want.len(),
            auto: None,
            tree: edge.tree,
        },
        rule: VerifyRule::Greedy,
        params: SamplingParams::default(),
        q_top_k: 0,
        self_draft: edge.self_draft,
        // A synthetic draft proposes every token itself.
        suffix: false,
    };
    let mut d = SyntheticDrafter::new(
        prompt.len(),
        want.to_vec(),
        edge.alpha,
        edge.draft_ms,
        edge.vocab,
        edge.seed,
    );
    if edge.tree.side_nodes > 0 {
        d = d.with_cover(edge.cover);
    }
    let r = tandem_edge::run_with(
        &mut d,
        tok.eog_ids(),
        prompt,
        Some(tandem_edge::grpc::opened(&opened)),
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
    (alpha, depth, tree): Spec,
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
        tree,
        cover: j.a.cover,
        self_draft: j.self_draft,
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
        side_nodes: r.stats.side_nodes,
        lane_hits: r.stats.lane_hits,
    })
}

/// One cloud-only generation.
fn cloud_session(j: &Job<'_>, rt: &tokio::runtime::Runtime, k: usize) -> Result<SessionOut> {
    let (prompt, want) = (&j.prompts[k], &j.wants[k]);
    let start = Instant::now();
    let mut commits = Vec::new();
    let mut out = Vec::new();
    tandem_edge::grpc::generate_remote_with(
        rt,
        tandem_edge::grpc::Remote::plain(j.url),
        j.tok.fingerprint(),
        prompt,
        SamplingParams::default(),
        want.len() as u32,
        tandem_edge::grpc::GenerateOptions {
            grammar: None,
            self_draft: j.self_draft,
        },
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
        side_nodes: 0,
        lane_hits: 0,
    })
}

/// N closed-loop users for `duration_s`: each starts sessions one after another (prompts in turn)
/// until the window closes, then finishes the one it is in.
/// `spec`: the synthetic edges' α, depth and trees; `None`: cloud-only clients.
pub(super) fn drive(
    j: &Job<'_>,
    n: usize,
    spec: Option<Spec>,
    cloud: &CloudProcess,
) -> Result<LoadRow> {
    let alpha = spec.map(|s| s.0);
    let rt = tandem_client::runtime()?;
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
        self_draft: j.self_draft,
        mode: match spec {
            Some((_, d, t)) if t.side_nodes > 0 && d > 1 => tandem_client::Mode::AsyncTree,
            s => mode_of(s.map(|s| s.1)),
        },
        depth: spec.map_or(0, |s| s.1),
        sessions: n,
        alpha,
        measured_alpha: round2(measured_alpha),
        throughput_tok_s: round2(in_window as f64 / j.a.duration_s),
        itl_ms: r2(Summary::of(&itl)),
        ttft_ms: r2(Summary::of(&ttft)),
        mean_batch_sessions: round2(ratio("tandem:batch_size_sum", "tandem:batch_size_count")),
        mean_tokens_per_forward: round2(ratio(
            "tandem:iteration_tokens_total_sum",
            "tandem:iteration_tokens_total_count",
        )),
        forward_ms_mean: round2(
            1e3 * ratio("tandem:forward_seconds_sum", "tandem:forward_seconds_count"),
        ),
        forward_busy_share: round2(delta("tandem:forward_seconds_sum") / j.a.duration_s),
        queue_ms_mean: round2(
            1e3 * ratio(
                "tandem:block_queue_time_seconds_sum",
                "tandem:block_queue_time_seconds_count",
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
        preemptions: delta("tandem:num_preemptions_total"),
        takeovers: delta("tandem:takeovers_total"),
        side_nodes_per_token: {
            let (n, t) = outs
                .iter()
                .fold((0, 0), |s, o| (s.0 + o.side_nodes, s.1 + o.tokens));
            round2(n as f64 / t.max(1) as f64)
        },
        lane_hits: outs.iter().map(|o| o.lane_hits).sum(),
        sessions_run: outs.len(),
        mismatches: outs.iter().filter(|o| !o.ok).count(),
        failures,
        self_draft_guesses_per_token: round2(
            delta("tandem:self_draft_guesses_total") / committed.max(1) as f64,
        ),
        self_draft_acceptance: round2(ratio(
            "tandem:self_drafted_tokens_total",
            "tandem:self_draft_guesses_total",
        )),
    })
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
            side_nodes: 0,
            lane_hits: 0,
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
