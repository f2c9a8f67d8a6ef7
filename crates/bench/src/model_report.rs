//! `tandem plan`: the analytic model ([`tandem_spec::plan`]) for given costs — E[A], the sync and
//! async ITL, the roofline of the verifier's forward, the queueing of N sessions — and the γ,
//! depth and batch token budget it recommends.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tandem_spec::capacity::{
    recommend_fleet, FleetRecommendation, ForwardCost, Operating, Workload,
};
use tandem_spec::policy::Costs;

/// Weight bytes read per forward by the SmolLM2-135M target in f32.
pub const SMOLLM2_F32_BYTES: f64 = 538.06e6;
/// Multiply-add FLOPs per token of the SmolLM2-135M target's weight matmuls.
pub const SMOLLM2_FLOPS_PER_TOKEN: f64 = 0.269e9;

/// Where the roofline's two numbers come from: given directly, from the machine's bandwidth and
/// FLOP rate, or from a `tandem bench engine --out` report.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RooflineArgs {
    /// The target's forward time for one token, ms (memory-bound).
    #[arg(long)]
    pub verify_ms: Option<f64>,
    /// The target's forward time per token once compute-bound, ms.
    #[arg(long)]
    pub verify_ms_per_token: Option<f64>,
    /// Memory bandwidth, GB/s: the one-token time is the weights' bytes at this rate.
    #[arg(long)]
    pub bandwidth_gbs: Option<f64>,
    /// The kernels' FLOP rate, GFLOP/s: the time per token is the FLOPs per token at this rate.
    #[arg(long)]
    pub gflops: Option<f64>,
    /// The target's weight bytes, MB (default: the report's, else SmolLM2-135M f32: 538).
    #[arg(long)]
    pub weights_mb: Option<f64>,
    /// The target's FLOPs per token, GFLOP (default: the report's, else SmolLM2-135M: 0.269).
    #[arg(long)]
    pub gflop_per_token: Option<f64>,
    /// A `tandem bench engine --out` report: its measured one-token forward, bandwidth and FLOP
    /// rate fill what the flags above leave out.
    #[arg(long)]
    pub engine_json: Option<std::path::PathBuf>,
    /// Which of the report's runs (thread count).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
}

/// The target's figures in a `bench engine` report, for one thread count.
struct EngineFigures {
    one_token_ms: f64,
    bandwidth_gbs: f64,
    gflops: f64,
    bytes_per_token: f64,
    flops_per_token: f64,
}

fn engine_figures(path: &Path, threads: usize) -> Result<EngineFigures> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a `tandem bench engine --out` JSON report",
            path.display()
        )
    })?;
    let runs = v["runs"]
        .as_array()
        .with_context(|| format!("{}: no `runs`", path.display()))?;
    let run = runs
        .iter()
        .find(|r| r["threads"].as_u64() == Some(threads as u64))
        .with_context(|| format!("{}: no run with {threads} threads", path.display()))?;
    let num = |p: &serde_json::Value, what: &str| -> Result<f64> {
        p.as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .with_context(|| format!("{}: `{what}` missing or not positive", path.display()))
    };
    let t = &run["target"];
    let gflops = num(&t["kernel_gflops"], "target.kernel_gflops")?;
    Ok(EngineFigures {
        one_token_ms: num(&t["chunk_ms"]["1"], "target.chunk_ms.1")?,
        bandwidth_gbs: num(&run["read_bandwidth_gbs"], "read_bandwidth_gbs")?,
        gflops,
        bytes_per_token: num(&t["bytes_per_token"], "target.bytes_per_token")?,
        flops_per_token: gflops * 1e9
            / num(&t["compute_limit_tok_s"], "target.compute_limit_tok_s")?,
    })
}

fn positive(x: Option<f64>, flag: &str) -> Result<Option<f64>> {
    match x {
        Some(v) if !(v.is_finite() && v > 0.0) => {
            bail!("{flag} must be a positive number, got {v}")
        }
        _ => Ok(x),
    }
}

/// The verifier's roofline and a line saying where each half came from.
pub fn roofline(a: &RooflineArgs) -> Result<(ForwardCost, String)> {
    let verify_ms = positive(a.verify_ms, "--verify-ms")?;
    let per_token = positive(a.verify_ms_per_token, "--verify-ms-per-token")?;
    let bandwidth = positive(a.bandwidth_gbs, "--bandwidth-gbs")?;
    let gflops = positive(a.gflops, "--gflops")?;
    let weights_mb = positive(a.weights_mb, "--weights-mb")?;
    let gflop_per_token = positive(a.gflop_per_token, "--gflop-per-token")?;
    let eng = a
        .engine_json
        .as_deref()
        .map(|p| engine_figures(p, a.threads))
        .transpose()?;
    let bytes = weights_mb
        .map(|m| m * 1e6)
        .or(eng.as_ref().map(|e| e.bytes_per_token))
        .unwrap_or(SMOLLM2_F32_BYTES);
    let flops = gflop_per_token
        .map(|g| g * 1e9)
        .or(eng.as_ref().map(|e| e.flops_per_token))
        .unwrap_or(SMOLLM2_FLOPS_PER_TOKEN);
    let (one, one_src) = match (verify_ms, bandwidth, &eng) {
        (Some(v), _, _) => (v, "--verify-ms".to_string()),
        (None, Some(bw), _) => (
            bytes / (bw * 1e6),
            format!("{:.0} MB of weights at {bw} GB/s", bytes / 1e6),
        ),
        (None, None, Some(e)) => (e.one_token_ms, "the report's one-token forward".to_string()),
        _ => bail!("give the one-token verify time: --verify-ms, --bandwidth-gbs or --engine-json"),
    };
    let (slope, slope_src) = match (per_token, gflops, &eng) {
        (Some(s), _, _) => (s, "--verify-ms-per-token".to_string()),
        (None, Some(g), _) => (
            flops / (g * 1e6),
            format!("{:.3} GFLOP per token at {g} GFLOP/s", flops / 1e9),
        ),
        (None, None, Some(e)) => (
            flops / (e.gflops * 1e6),
            format!(
                "{:.3} GFLOP per token at the report's {:.1} GFLOP/s (bandwidth {:.1} GB/s)",
                flops / 1e9,
                e.gflops,
                e.bandwidth_gbs
            ),
        ),
        _ => bail!(
            "give the verify time per token: --verify-ms-per-token, --gflops or --engine-json"
        ),
    };
    Ok((
        ForwardCost {
            one_token_ms: one,
            ms_per_token: slope,
        },
        format!("one token: {one_src}; per token: {slope_src}"),
    ))
}

#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    pub workload: Workload,
    pub alpha: f64,
    pub draft_ms: f64,
    pub rtt_ms: f64,
    pub forward: ForwardCost,
    pub roofline_source: String,
    pub plans: Vec<FleetRecommendation>,
}

/// What to plan for: one edge's costs and the sessions' shape limits and workload (`tandem
/// plan`'s flags).
#[derive(Debug, Clone, clap::Args)]
pub struct PlanQuery {
    /// Greedy acceptance rate per drafted token.
    #[arg(long)]
    pub alpha: f64,
    /// The draft's time per token, ms.
    #[arg(long)]
    pub draft_ms: f64,
    /// Network round trip, ms.
    #[arg(long)]
    pub rtt_ms: f64,
    /// The edge's own work per verdict outside draft forwards, ms (`bench latency` measures it).
    #[arg(long, default_value_t = 0.0)]
    pub verdict_ms: f64,
    /// Session counts to plan for, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub sessions: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    pub max_gamma: usize,
    #[arg(long, default_value_t = 4)]
    pub max_depth: usize,
    /// Each session's prompt, prefilled by the verifier (0: none).
    #[arg(long, default_value_t = 0)]
    pub prompt_tokens: usize,
    /// The share of each prompt the verifier's prefix cache holds (a conversation's history, a
    /// shared system prompt): the prefill computes only the rest.
    #[arg(long, default_value_t = 0.0)]
    pub prefix_hit: f64,
    /// New tokens per session (0: endless sessions, the decoding steady state).
    #[arg(long = "tokens", default_value_t = 0)]
    pub new_tokens: usize,
    /// Tokens one forward may compute (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub token_budget: usize,
}

impl PlanQuery {
    /// Refuse a query the model cannot answer, naming the flag.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.alpha) {
            bail!("--alpha must be within 0..=1, got {}", self.alpha);
        }
        positive(Some(self.draft_ms), "--draft-ms")?;
        if !(self.verdict_ms.is_finite() && self.verdict_ms >= 0.0) {
            bail!(
                "--verdict-ms must be a non-negative number of ms, got {}",
                self.verdict_ms
            );
        }
        if !(self.rtt_ms.is_finite() && self.rtt_ms >= 0.0) {
            bail!("--rtt-ms must be 0 or more, got {}", self.rtt_ms);
        }
        if self.sessions.is_empty() || self.sessions.contains(&0) {
            bail!("--sessions must list session counts of at least 1");
        }
        if self.max_gamma == 0 || self.max_depth == 0 {
            bail!("--max-gamma and --max-depth must be at least 1");
        }
        if !(0.0..1.0).contains(&self.prefix_hit) {
            bail!("--prefix-hit must be in [0, 1), got {}", self.prefix_hit);
        }
        let budget = self.workload().token_budget;
        if budget <= self.max_gamma {
            bail!(
                "--token-budget {budget} must exceed --max-gamma {} (a block goes in one forward)",
                self.max_gamma
            );
        }
        Ok(())
    }

    /// The workload, with 0 (no limit) as `usize::MAX`.
    pub fn workload(&self) -> Workload {
        let unlimited = |n: usize| if n == 0 { usize::MAX } else { n };
        Workload {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: (self.prompt_tokens as f64 * self.prefix_hit) as usize,
            new_tokens: unlimited(self.new_tokens),
            token_budget: unlimited(self.token_budget),
            copying: tandem_spec::never_idle::Copying::NONE,
        }
    }
}

/// The model for each session count.
pub fn run(q: &PlanQuery, roof: &RooflineArgs) -> Result<PlanReport> {
    let PlanQuery {
        alpha,
        draft_ms,
        rtt_ms,
        verdict_ms,
        ref sessions,
        max_gamma,
        max_depth,
        ..
    } = *q;
    let workload = &q.workload();
    q.validate()?;
    let (forward, roofline_source) = roofline(roof)?;
    let c = Costs {
        alpha,
        draft_ms,
        verify_ms: forward.one_token_ms,
        verify_ms_per_token: 0.0,
        rtt_ms,
        verdict_ms,
    };
    Ok(PlanReport {
        workload: *workload,
        alpha,
        draft_ms,
        rtt_ms,
        forward,
        roofline_source,
        plans: sessions
            .iter()
            .map(|&n| recommend_fleet(&c, &forward, n, max_gamma, max_depth, workload))
            .collect(),
    })
}

fn shape(o: &Operating) -> String {
    if o.gamma == 0 {
        "γ 0 (verifier decodes)".to_string()
    } else {
        format!("γ {} depth {}", o.gamma, o.depth)
    }
}

pub fn table(r: &PlanReport) -> String {
    let f = &r.forward;
    let mut s = format!(
        "α {}, draft {} ms/token, RTT {} ms\nverifier roofline: max({:.1} ms, {:.2} ms × tokens), ridge {:.1} tokens ({})\n",
        r.alpha, r.draft_ms, r.rtt_ms, f.one_token_ms, f.ms_per_token, f.ridge_tokens(), r.roofline_source
    );
    let w = &r.workload;
    if w.new_tokens < usize::MAX {
        s += &format!(
            "sessions of {} prompt + {} new tokens, forwards of at most {} tokens\n",
            w.prompt_tokens, w.new_tokens, w.token_budget
        );
    }
    s += "\n| sessions | recommended | E[A] | ITL ms | TTFT ms | tokens/s | best sync (ITL ms) | cloud-only (ITL ms, tokens/s) | tokens/forward | tokens per session's forward | token budget |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for p in &r.plans {
        let b = &p.best;
        let ea = if b.gamma == 0 {
            1.0
        } else {
            tandem_spec::policy::expected_accepted(r.alpha, b.gamma)
        };
        s += &format!(
            "| {} | {} | {:.2} | {:.1} | {:.0} | {:.1} | γ {} ({:.1}) | {:.1}, {:.1} | {:.1} | {:.2} | {} |\n",
            p.sessions,
            shape(b),
            ea,
            b.itl_ms,
            b.ttft_ms,
            b.tokens_per_s,
            p.best_sync.gamma,
            p.best_sync.itl_ms,
            p.cloud_only.itl_ms,
            p.cloud_only.tokens_per_s,
            b.batch_tokens,
            b.tokens_per_block,
            p.token_budget
        );
    }
    if let Some(p) = r.plans.first() {
        let st = &p.stages;
        s += &format!(
            "\nstages at {} session(s), γ {}: drafting {:.1} ms, network {:.1} ms, verification {:.1} ms\n",
            p.sessions,
            if p.best.gamma > 0 { p.best.gamma } else { p.best_sync.gamma },
            st.draft_ms,
            st.network_ms,
            st.verify_ms,
        );
    }
    s
}
