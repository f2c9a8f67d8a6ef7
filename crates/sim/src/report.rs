//! One simulation run, end to end: the replicas and users set up as `cloud serve` and `bench
//! load` would be, the event loop run, and the row measured beside the analytic model's
//! prediction.

use std::collections::{BinaryHeap, HashMap};

use tandem_spec::capacity::{operate_on, recommend_fleet, Workload};
use tandem_spec::never_idle::Copying;
use tandem_spec::policy::Costs;
use tandem_spec::suffix::{priced, SuffixPolicy};
use tandem_verifier::{LoadConfig, VerifierConfig, VerifierCore};

use crate::stats::Summary;
use crate::target::{SimTarget, Texts};
use crate::world::{gaps, Replica, Session, Sim};
use crate::{SimConfig, SimError, SimRow};

/// Run one simulation.
pub fn simulate(cfg: &SimConfig) -> Result<SimRow, SimError> {
    cfg.validate()?;
    let wall = std::time::Instant::now();
    let per_replica = cfg.users.div_ceil(cfg.replicas);
    let mut replicas = Vec::new();
    let texts = Texts::new(cfg.seed);
    for r in 0..cfg.replicas {
        let target = SimTarget::new(cfg.cost, cfg.kv_blocks, texts.clone());
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
        texts,
        copy_share: (0.0, 0),
        copied: (0, 0, 0),
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
    let (self_guesses, self_drafted) = sim.replicas.iter().fold((0, 0), |(g, d), r| {
        (
            g + r.core.stats.self_draft_guesses,
            d + r.core.stats.self_drafted,
        )
    });
    let done_committed: usize = sim.done_sessions.iter().map(|s| s.committed).sum();
    let span = (sim.window.1 - sim.window.0) as f64 / 1e6;
    let forwards: u64 = sim.replicas.iter().map(|r| r.forwards).sum();
    let fwd_tokens: u64 = sim.replicas.iter().map(|r| r.tokens).sum();
    let busy: u64 = sim.replicas.iter().map(|r| r.busy_us).sum();
    let per = cfg.users.div_ceil(cfg.replicas);
    let spans = span_model(cfg, per);
    let copying = if cfg.self_draft {
        spans.copying
    } else {
        Copying::NONE
    };
    // The edges draft that share of their tokens by copy, without a forward.
    let edge_copies = cfg.suffix && cfg.gamma > 0 && cfg.tree.0.is_none();
    let (alpha, draft_ms) = if edge_copies {
        let s = spans.edge_share;
        (
            (1.0 - s) * cfg.alpha + s * spans.edge_alpha,
            (1.0 - s) * cfg.draft_ms,
        )
    } else {
        (cfg.alpha, cfg.draft_ms)
    };
    let costs = Costs {
        alpha,
        draft_ms,
        verify_ms: 0.0,
        verify_ms_per_token: 0.0,
        rtt_ms: cfg.rtt_ms,
        // A simulated edge handles verdicts in no time.
        verdict_ms: 0.0,
    };
    let work = Workload {
        prompt_tokens: cfg.prompt_tokens,
        cached_tokens: (cfg.prompt_tokens as f64 * cfg.prefix_hit) as usize,
        new_tokens: cfg.new_tokens,
        token_budget: cfg.token_budget,
        copying,
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
        copy_share: r2(sim.copy_share.0 / sim.copy_share.1.max(1) as f64),
        self_drafted_share: r2(self_drafted as f64 / committed.max(1) as f64),
        self_draft_acceptance: r2(self_drafted as f64 / self_guesses.max(1) as f64),
        edge_copied_share: r2(sim.copied.0 as f64 / done_committed.max(1) as f64),
        edge_copy_acceptance: r2(sim.copied.2 as f64 / sim.copied.1.max(1) as f64),
        predicted_itl_ms: r2(pred.itl_ms),
        predicted_tokens_per_s: r2(pred.tokens_per_s * (cfg.users as f64 / per as f64)),
        predicted_ttft_ms: r2(pred.ttft_ms),
        events: sim.events,
        wall_s: r2(wall.elapsed().as_secs_f64()),
    })
}

/// What the model is given for a text that copies itself (`--copy-share`, `--copy-span`).
struct SpanModel {
    /// The verifier's decodes of a session alone, with its own guesses in them.
    copying: Copying,
    /// The share of an edge's drafted tokens it copies, and how often those are right.
    edge_share: f64,
    edge_alpha: f64,
}

/// The model of the drawn texts: a span starts at a fresh position with probability q and is
/// `L` tokens long (an exponential of mean `--copy-span`, rounded, at least 1). The verifier
/// decodes a span's first [`LOCK_ON`] tokens alone (its match is one token long until then: too
/// short to be worth a guess in a text whose single tokens recur), then feeds guesses, two per
/// matched token up to the number its drafter prices at this load for a guess right with the
/// span's continuation probability `1 − 1/span`; each decode commits the guesses the span still
/// covers plus its own token. The edges copy once their path matches two tokens: the span's rest,
/// and one wrong copy past its end.
fn span_model(cfg: &SimConfig, sessions: usize) -> SpanModel {
    const LOCK_ON: usize = 2;
    let none = SpanModel {
        copying: Copying::NONE,
        edge_share: 0.0,
        edge_alpha: 0.0,
    };
    if cfg.copy_share <= 0.0 {
        return none;
    }
    let (share, l) = (cfg.copy_share.min(0.99), cfg.copy_span.max(1.0));
    let q = share / (l * (1.0 - share) + share);
    let policy = SuffixPolicy::DEFAULT;
    let most = VerifierConfig::default().self_draft_max;
    // A position's cost as the replicas measure it on their small forwards (1 to 17 positions).
    let cost = (cfg.cost.ms(17.0) - cfg.cost.ms(1.0)) / 16.0 / cfg.cost.ms(1.0).max(1e-9);
    let g = priced(1.0 - 1.0 / l, cost * sessions as f64, most);
    // Per span of each length: tokens committed, decodes, positions; the edge's copies and the
    // right ones. P(L = n) of the rounded exponential.
    let cdf = |x: f64| 1.0 - (-x.max(0.0) / l).exp();
    let (mut span, mut tokens, mut decodes, mut positions) = (0.0, 0.0, 0.0, 0.0);
    let (mut copies, mut right) = (0.0, 0.0);
    for n in 1..=(40.0 * l) as usize {
        let p = cdf(n as f64 + 0.5) - if n == 1 { 0.0 } else { cdf(n as f64 - 0.5) };
        let alone = n.min(LOCK_ON);
        let (mut t, mut f, mut x, mut m) = (alone, alone as f64, alone as f64, alone);
        while t < n {
            let k = policy.guesses(m).min(g);
            if k == 0 {
                // No guess is worth its position: the span is decoded alone.
                f += (n - t) as f64;
                x += (n - t) as f64;
                t = n;
                break;
            }
            let accepted = k.min(n - t);
            f += 1.0;
            x += 1.0 + k as f64;
            t += accepted + 1;
            m += accepted + 1;
        }
        span += p * n as f64;
        tokens += p * t as f64;
        decodes += p * f;
        positions += p * x;
        if n > LOCK_ON {
            copies += p * (n - LOCK_ON + 1) as f64;
            right += p * (n - LOCK_ON) as f64;
        }
    }
    // Per fresh position: a fresh token with probability 1 − q, else a span.
    let per = |fresh: f64, spans: f64| (1.0 - q) * fresh + q * spans;
    let (tokens, decodes, positions) = (per(1.0, tokens), per(1.0, decodes), per(1.0, positions));
    SpanModel {
        copying: Copying::from_rates(tokens / decodes, positions / decodes, g.max(1)),
        edge_share: (q * copies / per(1.0, span)).min(1.0),
        edge_alpha: right / copies.max(1e-9),
    }
}

pub fn table(rows: &[SimRow]) -> String {
    let mut s = String::from(
        "| sessions | replicas | mode | tok/s | predicted tok/s | ITL mean | predicted ITL | ITL p99 | TTFT mean | predicted TTFT | tokens/fwd | busy | accepted | cloud-decoded | verifier's guesses: share of tokens (taken) | edge copies per token (right) | takeovers | sessions done | wrong tokens | protocol errors | events | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
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
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0}% | {:.2} | {:.0}% | {:.0}% ({:.0}%) | {:.2} ({:.0}%) | {} | {} | {} | {} | {} | {:.1} |\n",
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
            r.self_drafted_share * 100.0,
            r.self_draft_acceptance * 100.0,
            r.edge_copied_share,
            r.edge_copy_acceptance * 100.0,
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
