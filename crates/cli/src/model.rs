//! `tandem simulate` and `tandem plan`: the simulator and the analytic model.

use super::*;

#[derive(Args)]
pub(crate) struct SimulateArgs {
    /// Closed-loop users (each opens session after session), comma-separated for several runs.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    sessions: Vec<usize>,
    /// Also run cloud-only at every session count.
    #[arg(long)]
    cloud_only: bool,
    /// The target's forward cost `ONE_TOKEN_MS,MS_PER_TOKEN` (default: from --engine-json, else
    /// 44,2.2: `cloud serve --threads 1` on this project's CI machine).
    #[arg(long)]
    forward_cost: Option<tandem_spec::capacity::ForwardCost>,
    /// A `tandem bench engine --out` report to take the forward cost from (one-token forward and
    /// the kernels' FLOP rate).
    #[arg(long)]
    engine_json: Option<PathBuf>,
    #[command(flatten)]
    sim: tandem_sim::SimConfig,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    query: tandem_bench::model_report::PlanQuery,
    #[command(flatten)]
    roofline: tandem_bench::model_report::RooflineArgs,
    /// Print the JSON report instead of tables.
    #[arg(long)]
    json: bool,
}

/// Simulate each session count (and cloud-only beside it with `--cloud-only`) and report the rows.
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
        (None, None) => tandem_sim::DEFAULT_FORWARD_COST,
    };
    let mut rows = Vec::new();
    for &users in &a.sessions {
        let gamma = a.sim.gamma;
        let modes: Vec<usize> = if a.cloud_only && gamma > 0 {
            vec![0, gamma]
        } else {
            vec![gamma]
        };
        for gamma in modes {
            let cfg = SimConfig {
                users,
                gamma,
                cost,
                ..a.sim.clone()
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
    let c = &a.sim;
    let preface = format!(
        "target forward max({:.1} ms, {:.2} ms × tokens); α {}, draft {} ms/token, RTT {} ms (± {}% per session, ± {}% per message), {} prompt ({:.0}% of it the user's history: measured prefix-cache hit {}) + {} new tokens per session, token budget {}, {} s measured after {} s; {:.0}% of the output copies spans of its own text ({} tokens long on average); the verifier drafts for itself: {}, the edges copy: {}\n\n",
        cost.one_token_ms,
        cost.ms_per_token,
        c.alpha,
        c.draft_ms,
        c.rtt_ms,
        c.rtt_spread_pct,
        c.jitter_pct,
        c.prompt_tokens,
        100.0 * c.prefix_hit,
        rows.iter()
            .map(|r| format!("{:.0}%", 100.0 * r.prefix_hit))
            .collect::<Vec<_>>()
            .join(", "),
        c.new_tokens,
        c.token_budget,
        c.duration_s,
        c.warmup_s,
        100.0 * c.copy_share,
        c.copy_span,
        if c.self_draft { "on" } else { "off" },
        if c.suffix { "on" } else { "off" },
    );
    report(&rows, a.report.out.as_deref(), a.report.json, |r| {
        format!("{preface}{}", table(r))
    })
}

pub(crate) fn cmd_plan(a: PlanArgs) -> Result<()> {
    let r = tandem_bench::model_report::run(&a.query, &a.roofline)?;
    report(&r, None, a.json, tandem_bench::model_report::table)
}
