//! `tandem simulate` and `tandem plan`: the simulator and the analytic model.

use super::*;

#[derive(Args)]
pub(crate) struct SimulateArgs {
    /// Closed-loop users (each opens session after session), comma-separated for several runs.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    sessions: Vec<usize>,
    /// Verifier replicas; users are spread over them round-robin.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    #[arg(long, default_value_t = 0.8)]
    alpha: f64,
    /// The draft's time per token, ms.
    #[arg(long, default_value_t = 20.0)]
    draft_ms: f64,
    #[arg(long, default_value_t = 50.0)]
    rtt_ms: f64,
    /// Each session's round trip is drawn within ± this share of --rtt-ms.
    #[arg(long, default_value_t = 0.0)]
    rtt_spread_pct: f64,
    /// Each message's half of the round trip varies by ± this share.
    #[arg(long, default_value_t = 10.0)]
    jitter_pct: f64,
    /// Draft length (0: cloud-only, the verifier decodes every session).
    #[arg(long, default_value_t = 4)]
    gamma: usize,
    #[arg(long, default_value_t = 2)]
    depth: usize,
    /// Also run cloud-only at every session count.
    #[arg(long)]
    cloud_only: bool,
    /// Hold γ and depth fixed (by default each replica adapts them to its load and takes slow
    /// sessions over, as `cloud serve` does).
    #[arg(long)]
    fixed_shape: bool,
    #[arg(long, default_value_t = 40)]
    prompt_tokens: usize,
    /// New tokens per session.
    #[arg(long, default_value_t = 48)]
    tokens: usize,
    #[arg(long, default_value_t = 64)]
    token_budget: usize,
    /// KV blocks of 16 token slots per replica.
    #[arg(long, default_value_t = 65536)]
    kv_blocks: usize,
    /// The target's forward cost `ONE_TOKEN_MS,MS_PER_TOKEN` (default: from --engine-json, else
    /// 44,2.2: `cloud serve --threads 1` on this project's CI machine).
    #[arg(long, value_parser = parse_forward_cost)]
    forward_cost: Option<tandem_sched::ForwardCost>,
    /// A `tandem bench engine --out` report to take the forward cost from (one-token forward and
    /// the kernels' FLOP rate).
    #[arg(long)]
    engine_json: Option<PathBuf>,
    /// Simulated seconds before measuring, and measured.
    #[arg(long, default_value_t = 20.0)]
    warmup_s: f64,
    #[arg(long, default_value_t = 40.0)]
    duration_s: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
pub(crate) struct PlanArgs {
    /// Greedy acceptance rate per drafted token.
    #[arg(long)]
    alpha: f64,
    /// The draft's time per token, ms.
    #[arg(long)]
    draft_ms: f64,
    /// Network round trip, ms.
    #[arg(long)]
    rtt_ms: f64,
    /// The edge's own work per verdict outside draft forwards, ms (`bench latency` measures it).
    #[arg(long, default_value_t = 0.0)]
    verdict_ms: f64,
    #[command(flatten)]
    roofline: tandem_bench::model_report::RooflineArgs,
    /// Session counts to plan for, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    sessions: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    max_gamma: usize,
    #[arg(long, default_value_t = 4)]
    max_depth: usize,
    /// Each session's prompt, prefilled by the verifier (0: none).
    #[arg(long, default_value_t = 0)]
    prompt_tokens: usize,
    /// New tokens per session (0: endless sessions, the decoding steady state).
    #[arg(long, default_value_t = 0)]
    tokens: usize,
    /// Tokens one forward may compute (0: no limit).
    #[arg(long, default_value_t = 0)]
    token_budget: usize,
    /// Print the JSON report instead of tables.
    #[arg(long)]
    json: bool,
}

/// A benchmark's report: JSON to `out` when given, and JSON or the tables on stdout.
pub(crate) fn cmd_simulate(a: SimulateArgs) -> Result<()> {
    use tandem_sim::{simulate, table, SimConfig};
    let cost = match (a.forward_cost, &a.engine_json) {
        (Some(c), _) => c,
        (None, Some(p)) => {
            let roof = tandem_bench::model_report::RooflineArgs {
                engine_json: Some(p.clone()),
                threads: 1,
                ..Default::default()
            };
            tandem_bench::model_report::roofline(&roof)?.0
        }
        (None, None) => tandem_sched::ForwardCost {
            one_token_ms: 44.0,
            ms_per_token: 2.2,
        },
    };
    let mut rows = Vec::new();
    for &users in &a.sessions {
        let modes: Vec<usize> = if a.cloud_only && a.gamma > 0 {
            vec![0, a.gamma]
        } else {
            vec![a.gamma]
        };
        for gamma in modes {
            let cfg = SimConfig {
                users,
                replicas: a.replicas,
                alpha: a.alpha,
                draft_ms: a.draft_ms,
                rtt_ms: a.rtt_ms,
                rtt_spread_pct: a.rtt_spread_pct,
                jitter_pct: a.jitter_pct,
                gamma,
                depth: a.depth,
                adaptive: !a.fixed_shape,
                prompt_tokens: a.prompt_tokens,
                new_tokens: a.tokens,
                token_budget: a.token_budget,
                kv_blocks: a.kv_blocks,
                cost,
                warmup_s: a.warmup_s,
                duration_s: a.duration_s,
                seed: a.seed,
            };
            let row = simulate(&cfg)?;
            if !a.report.json {
                eprintln!(
                    "simulated {users} sessions, {}: {:.1} tok/s in {:.1} s",
                    if gamma == 0 {
                        "cloud-only".to_string()
                    } else {
                        format!("γ {gamma}")
                    },
                    row.tokens_per_s,
                    row.wall_s
                );
            }
            rows.push(row);
        }
    }
    let preface = format!(
        "target forward max({:.1} ms, {:.2} ms × tokens); α {}, draft {} ms/token, RTT {} ms (± {}% per session, ± {}% per message), {} prompt + {} new tokens per session, token budget {}, {} s measured after {} s\n\n",
        cost.one_token_ms,
        cost.ms_per_token,
        a.alpha,
        a.draft_ms,
        a.rtt_ms,
        a.rtt_spread_pct,
        a.jitter_pct,
        a.prompt_tokens,
        a.tokens,
        a.token_budget,
        a.duration_s,
        a.warmup_s
    );
    report(&rows, a.report.out.as_deref(), a.report.json, |r| {
        format!("{preface}{}", table(r))
    })
}

pub(crate) fn cmd_plan(a: PlanArgs) -> Result<()> {
    let roof = a.roofline;
    let q = tandem_bench::model_report::PlanQuery {
        alpha: a.alpha,
        draft_ms: a.draft_ms,
        rtt_ms: a.rtt_ms,
        verdict_ms: a.verdict_ms,
        sessions: a.sessions,
        max_gamma: a.max_gamma,
        max_depth: a.max_depth,
        workload: tandem_spec::capacity::Workload {
            prompt_tokens: a.prompt_tokens,
            new_tokens: if a.tokens == 0 { usize::MAX } else { a.tokens },
            token_budget: if a.token_budget == 0 {
                usize::MAX
            } else {
                a.token_budget
            },
        },
    };
    let r = tandem_bench::model_report::run(&q, &roof)?;
    report(&r, None, a.json, tandem_bench::model_report::table)
}
