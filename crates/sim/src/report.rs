//! One simulation run, end to end: the replicas and users set up as `cloud serve` and `bench
//! load` would be, the event loop run, and the row measured beside the analytic model's
//! prediction.

use std::collections::{BinaryHeap, HashMap};

use tandem_spec::capacity::{operate_on, recommend_fleet, Workload};
use tandem_spec::policy::Costs;
use tandem_verifier::{LoadConfig, VerifierConfig, VerifierCore};

use crate::stats::Summary;
use crate::target::SimTarget;
use crate::world::{gaps, Replica, Session, Sim};
use crate::{SimConfig, SimError, SimRow};

/// Run one simulation.
pub fn simulate(cfg: &SimConfig) -> Result<SimRow, SimError> {
    cfg.validate()?;
    let wall = std::time::Instant::now();
    let per_replica = cfg.users.div_ceil(cfg.replicas);
    let mut replicas = Vec::new();
    for r in 0..cfg.replicas {
        let target = SimTarget {
            cost: cfg.cost,
            num_blocks: cfg.kv_blocks,
            seed: cfg.seed,
        };
        // As `cloud serve` sets it up: grants within the configured shape, saturating at twice
        // the ridge, γ 0 as the last level, takeovers by pace.
        let load = if cfg.adaptive && cfg.gamma > 0 {
            LoadConfig {
                saturation_tokens: 2.0 * cfg.cost.ridge_tokens().max(1.0),
                forward_cost: Some(cfg.cost),
                ..LoadConfig::new(cfg.gamma as u32, cfg.depth as u32)
            }
        } else {
            LoadConfig::FIXED
        };
        let core = VerifierCore::new(
            target,
            VerifierConfig {
                token_budget: cfg.token_budget,
                max_sessions: per_replica * 2 + 16,
                max_waiting_tokens: (per_replica + 16) * cfg.prompt_tokens,
                load,
                ..VerifierConfig::default()
            },
            0,
        )
        .map_err(|e| SimError::Replica {
            replica: r,
            message: e.to_string(),
        })?;
        replicas.push(Replica {
            core,
            takeovers: 0,
            busy: false,
            inbox: Vec::new(),
            outbox: Vec::new(),
            busy_us: 0,
            forwards: 0,
            tokens: 0,
        });
    }
    let w0 = (cfg.warmup_s * 1e6) as u64;
    let mut sim = Sim {
        cfg: cfg.clone(),
        now: 0,
        seq: 0,
        queue: BinaryHeap::new(),
        sessions: HashMap::new(),
        next_sid: 1,
        replicas,
        window: (w0, w0 + (cfg.duration_s * 1e6) as u64),
        wrong: 0,
        errors: 0,
        last_arrival: HashMap::new(),
        drafted: 0,
        accepted: 0,
        judged: 0,
        lane_hits: 0,
        done_sessions: Vec::new(),
        events: 0,
    };
    sim.run();
    let all: Vec<&Session> = sim
        .done_sessions
        .iter()
        .chain(sim.sessions.values())
        .collect();
    let (itl, ttft, tokens) = gaps(&all, sim.window);
    let committed: usize = all.iter().map(|s| s.committed).sum();
    // Tokens that came as `Decoded` (the replica decoded them), as each edge counted them.
    let decoded: usize = all
        .iter()
        .filter_map(|s| s.edge.as_ref())
        .map(|e| e.measured().cloud_decoded)
        .sum();
    let takeovers: usize = sim.replicas.iter().map(|r| r.takeovers).sum();
    let span = (sim.window.1 - sim.window.0) as f64 / 1e6;
    let forwards: u64 = sim.replicas.iter().map(|r| r.forwards).sum();
    let fwd_tokens: u64 = sim.replicas.iter().map(|r| r.tokens).sum();
    let busy: u64 = sim.replicas.iter().map(|r| r.busy_us).sum();
    let costs = Costs {
        alpha: cfg.alpha,
        draft_ms: cfg.draft_ms,
        verify_ms: 0.0,
        verify_ms_per_token: 0.0,
        rtt_ms: cfg.rtt_ms,
        // A simulated edge handles verdicts in no time.
        verdict_ms: 0.0,
    };
    let per = cfg.users.div_ceil(cfg.replicas);
    let work = Workload {
        prompt_tokens: cfg.prompt_tokens,
        cached_tokens: (cfg.prompt_tokens as f64 * cfg.prefix_hit) as usize,
        new_tokens: cfg.new_tokens,
        token_budget: cfg.token_budget,
    };
    // An adaptive replica is predicted at the model's best shape within γ and depth (γ 0
    // included), a fixed one at its shape.
    let pred = if cfg.adaptive && cfg.gamma > 0 {
        recommend_fleet(&costs, &cfg.cost, per, cfg.gamma, cfg.depth.max(1), &work).best
    } else {
        operate_on(&costs, &cfg.cost, per, cfg.gamma, cfg.depth.max(1), &work)
    };
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    let sum = |s: Summary| Summary {
        mean: r2(s.mean),
        p50: r2(s.p50),
        p99: r2(s.p99),
    };
    Ok(SimRow {
        users: cfg.users,
        replicas: cfg.replicas,
        gamma: cfg.gamma,
        depth: if cfg.gamma == 0 { 1 } else { cfg.depth },
        adaptive: cfg.adaptive && cfg.gamma > 0,
        tokens_per_s: r2(tokens as f64 / span),
        itl_ms: sum(Summary::of(&itl)),
        ttft_ms: sum(Summary::of(&ttft)),
        tokens_per_forward: r2(fwd_tokens as f64 / forwards.max(1) as f64),
        forwards,
        utilization: r2(busy as f64 / (span * 1e6 * cfg.replicas as f64)),
        sessions_done: sim.done_sessions.len(),
        wrong_tokens: sim.wrong,
        protocol_errors: sim.errors,
        cloud_decoded_share: if cfg.gamma == 0 {
            1.0
        } else {
            r2(decoded as f64 / committed.max(1) as f64)
        },
        takeovers,
        acceptance: r2(sim.accepted as f64 / sim.judged.max(1) as f64),
        prefix_hit: {
            let (hits, queries) = sim.replicas.iter().fold((0, 0), |(h, q), r| {
                let s = r.core.scheduler().stats();
                (h + s.prefix_hits, q + s.prefix_queries)
            });
            r2(hits as f64 / queries.max(1) as f64)
        },
        lane_cover: r2(sim.lane_hits as f64 / (sim.judged - sim.accepted).max(1) as f64),
        predicted_itl_ms: r2(pred.itl_ms),
        predicted_tokens_per_s: r2(pred.tokens_per_s * (cfg.users as f64 / per as f64)),
        predicted_ttft_ms: r2(pred.ttft_ms),
        events: sim.events,
        wall_s: r2(wall.elapsed().as_secs_f64()),
    })
}

pub fn table(rows: &[SimRow]) -> String {
    let mut s = String::from(
        "| sessions | replicas | mode | tok/s | predicted tok/s | ITL mean | predicted ITL | ITL p99 | TTFT mean | predicted TTFT | tokens/fwd | busy | accepted | cloud-decoded | takeovers | sessions done | wrong tokens | protocol errors | events | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let mode = if r.gamma == 0 {
            "cloud-only".to_string()
        } else {
            format!(
                "γ {} depth {}{}",
                r.gamma,
                r.depth,
                if r.adaptive { ", adaptive" } else { "" }
            )
        };
        s += &format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0}% | {:.2} | {:.0}% | {} | {} | {} | {} | {} | {:.1} |\n",
            r.users,
            r.replicas,
            mode,
            r.tokens_per_s,
            r.predicted_tokens_per_s,
            r.itl_ms.mean,
            r.predicted_itl_ms,
            r.itl_ms.p99,
            r.ttft_ms.mean,
            r.predicted_ttft_ms,
            r.tokens_per_forward,
            r.utilization * 100.0,
            r.acceptance,
            r.cloud_decoded_share * 100.0,
            r.takeovers,
            r.sessions_done,
            r.wrong_tokens,
            r.protocol_errors,
            r.events,
            r.wall_s
        );
    }
    s
}
