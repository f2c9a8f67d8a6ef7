//! `tandem bench load`: one verifier, many edges. N synthetic edges speak the real protocol to the
//! real verifier (its own pinned process) through a netem link: each knows the target's greedy
//! continuation of its prompt (computed once, by the verifier) and drafts each token right with
//! probability α at D ms per token, reacting to verdicts through the same pipeline state machine
//! as a real edge ([`tandem_edge::synthetic::SyntheticDrafter`]). Beside them, the cloud-only baseline: N
//! clients of the `Generate` RPC, so the verifier decodes every token itself. Before the sweep the
//! target's forward time is measured against tokens per forward, on the verifier's core, to find
//! the ridge where it turns compute-bound.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use tandem_client::Mode;

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use tandem_engine::{CpuSet, Engine, EngineConfig, LlamaModel, Tokenizer};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::TreeConfig;

use crate::cloudproc::{CloudProcess, Link};
use tandem_sim::stats::{round2, Summary};

mod report;
mod session;

pub use report::{mode_of, shape_label, table};
use session::{drive, Job};
pub use session::{synthetic_session, SyntheticEdge};

/// What `bench load` runs (its flags; the model directory and the cores are set by the caller).
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    #[arg(skip)]
    pub home: PathBuf,
    /// Concurrent sessions (users), one row each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub sessions: Vec<usize>,
    /// Acceptance rates of the synthetic drafts.
    #[arg(long = "alpha", value_delimiter = ',', default_value = "0.6,0.8,0.95")]
    pub alphas: Vec<f64>,
    #[arg(long, default_value_t = 50.0)]
    pub rtt_ms: f64,
    /// Jitter per direction, as a percentage of the RTT.
    #[arg(long = "jitter-pct", default_value = "10", value_parser = crate::percent)]
    pub jitter_frac: f64,
    /// Time a synthetic draft takes per token.
    #[arg(long, default_value_t = 20.0)]
    pub draft_ms: f64,
    /// Seconds measured per row, after --warmup seconds of load that are not measured (the
    /// first prompts' prefill burst).
    #[arg(long = "duration", default_value_t = 20.0)]
    pub duration_s: f64,
    #[arg(long = "warmup", default_value_t = 10.0)]
    pub warmup_s: f64,
    /// γ and depth each edge asks for (the verifier's load-aware grant may give less); several
    /// depths give a row each and α: depth 1 is synchronous speculation (`sync`), more is
    /// pipelined (`async`).
    #[arg(long, default_value_t = 4)]
    pub gamma: usize,
    #[arg(long = "depth", value_delimiter = ',', default_value = "2")]
    pub depths: Vec<usize>,
    /// Tokens per session.
    #[arg(long, default_value_t = 48)]
    pub max_new: usize,
    /// Chat prompts (repeat the flag for several; default: a few built-in ones).
    #[arg(long = "prompt")]
    pub prompts: Vec<String>,
    /// The verifier's token budget per forward.
    #[arg(long, default_value_t = tandem_verifier::VerifierConfig::default().token_budget)]
    pub token_budget: usize,
    /// The verifier's KV cache in MiB (large enough by default that 64 sessions run without
    /// preemption: the sweep measures compute, not memory pressure).
    #[arg(long, default_value_t = 2048)]
    pub kv_budget_mb: usize,
    /// Also measure cloud-only clients at each load (`--no-cloud-only` skips them).
    #[arg(long = "no-cloud-only", action = clap::ArgAction::SetFalse)]
    pub cloud_only: bool,
    /// Run every row with the verifier drafting for the sessions from their own text (on) and
    /// without (off), or one of them: `on,off`, `on`, `off`.
    #[arg(long = "self-draft", value_delimiter = ',', default_value = "on",
          value_parser = tandem_spec::pipeline::parse_on_off)]
    pub self_drafts: Vec<bool>,
    #[arg(skip)]
    pub edge_cpus: CpuSet,
    #[arg(skip)]
    pub cloud_cpus: CpuSet,
    /// Token trees for async-tree rows beside each async row (`LANES:BELOW[:MIN]`, as `bench
    /// latency --tree`; `none`: no tree rows). The synthetic draft is unsure at every miss and as
    /// often at a hit, its second choice is right for --cover of the misses, and each forward
    /// takes a quarter of a forward more per extra leaf (as the W4A16 draft).
    #[arg(long, default_value = "none", value_parser = crate::latency::parse_tree)]
    pub tree: crate::latency::TreeArg,
    #[arg(long, default_value_t = 0.6)]
    pub cover: f64,
    /// Grants shrink as tokens per forward near this (default: twice the measured ridge, where a
    /// forward takes about twice the one-token time).
    #[arg(long)]
    pub saturation_tokens: Option<f64>,
}

impl LoadArgs {
    /// Refuse settings the sweep cannot run, naming the flag.
    pub fn validate(&self) -> Result<()> {
        if self.sessions.is_empty() || self.sessions.contains(&0) {
            bail!("--sessions: give one or more counts, each at least 1");
        }
        if self.depths.contains(&0) {
            bail!("--depth: blocks in flight must each be at least 1");
        }
        if self.gamma == 0 {
            bail!("--gamma: each edge drafts at least 1 token per block");
        }
        if self.prompts.is_empty() {
            bail!("--prompt: give at least one prompt");
        }
        if self.self_drafts.is_empty() {
            bail!("--self-draft: on, off, or both");
        }
        if let Some(x) = self.alphas.iter().find(|x| !(0.0..=1.0).contains(*x)) {
            bail!("--alpha: {x} is not a probability");
        }
        if !(0.0..=1.0).contains(&self.cover) {
            bail!("--cover: {} is not a probability", self.cover);
        }
        Ok(())
    }
}

/// The chat prompts of the load sweep when none are given.
pub fn default_prompts() -> Vec<String> {
    [
        "Write a short story about a lighthouse keeper.",
        "Explain how a bicycle works, step by step.",
        "Describe a walk through a forest in autumn.",
        "Write a letter to a friend about learning to cook.",
    ]
    .map(String::from)
    .to_vec()
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
    pub mode: Mode,
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
    /// Token trees: side nodes sent per committed token, and commits a lane guessed (JSON:
    /// `branch_hits`, its first name).
    pub side_nodes_per_token: f64,
    #[serde(rename = "branch_hits")]
    pub lane_hits: usize,
    pub sessions_run: usize,
    /// Sessions whose output differed from the target's (must be 0), and refused or failed ones.
    pub mismatches: usize,
    pub failures: usize,
    /// The verifier drafted for the sessions from their own text: its guesses fed per committed
    /// token, and the share of them the target took (over the window).
    pub self_draft: bool,
    pub self_draft_guesses_per_token: f64,
    pub self_draft_acceptance: f64,
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
    pub mode: Mode,
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

/// Parse Prometheus text into `name{labels}` → value.
pub(crate) fn parse_metrics(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// Run the sweep; `on_row` sees each row as it finishes.
pub fn run(
    a: &LoadArgs,
    target: &Arc<LlamaModel>,
    tok: &Tokenizer,
    real_drafts: &[(String, Arc<LlamaModel>)],
    mut on_row: impl FnMut(&LoadRow),
) -> Result<LoadReport> {
    a.validate()?;
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
            let rt = tandem_client::runtime()?;
            let mut out = Vec::new();
            tandem_edge::grpc::generate_remote(
                &rt,
                tandem_edge::grpc::Remote::plain(&direct),
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
            sum += tandem_quant::eval::teacher_forced_alpha(d, p, w)?;
        }
        real_alpha.push((name.clone(), round2(sum / prompts.len() as f64)));
    }
    let mut link = Link::new()?;
    let url = link.set(&cloud.addr, a.rtt_ms, a.rtt_ms * a.jitter_frac)?;
    let mut rows = Vec::new();
    for &n in &a.sessions {
        for &self_draft in &a.self_drafts {
            let job = Job {
                url: &url,
                tok,
                prompts: &prompts,
                wants: &wants,
                vocab: target.cfg.vocab as u32,
                a,
                self_draft,
            };
            if a.cloud_only {
                let r = drive(&job, n, None, &cloud)?;
                on_row(&r);
                rows.push(r);
            }
            for &alpha in &a.alphas {
                for &depth in &a.depths {
                    let trees =
                        std::iter::once(TreeConfig::LINEAR).chain(a.tree.0.filter(|_| depth > 1));
                    for tree in trees {
                        let r = drive(&job, n, Some((alpha, depth, tree)), &cloud)?;
                        on_row(&r);
                        rows.push(r);
                    }
                }
            }
        }
    }
    let base = rows
        .iter()
        .filter(|r| r.mode == Mode::CloudOnly)
        .min_by_key(|r| r.sessions)
        .map(|r| r.itl_ms.mean)
        .ok_or_else(|| anyhow!("no cloud-only baseline was run"))
        .unwrap_or(0.0);
    let slo_ms = round2(3.0 * base);
    let mean_slo_ms = round2(1.5 * base);
    let mut capacity = Vec::new();
    let mut modes: Vec<(Mode, usize, Option<f64>)> = Vec::new();
    for r in &rows {
        let key = (r.mode, r.depth, r.alpha);
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
