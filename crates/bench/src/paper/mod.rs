//! `tandem bench paper`: the paper's comparison in one command.
//!
//! 1. **One session, real edges** ([`crate::latency`]): edge-only, cloud-only, sync (a γ sweep),
//!    async (planned γ and depth) and the adaptive policy, for each draft and each RTT, with the
//!    verifier in its own process on its own core and netem between them. Every speculative output
//!    is checked against the cloud-only one, and that against the target's greedy output computed
//!    here.
//! 2. **Many sessions** ([`crate::load`]): synthetic edges with the first draft's measured α and
//!    speed, speaking the real protocol to the real verifier, sync and async beside cloud-only
//!    clients, at each session count.
//! 3. **The simulator and the model** ([`crate::simulate`], `tandem_spec::plan`) fed the measured
//!    roofline, α and draft speed, at every RTT × session count × mode: predicted and simulated
//!    against measured wherever a measurement exists.
//!
//! It writes `results.json`, `results.md` and PNG plots into the output folder, and checks its
//! own output: every mode produced tokens, every output equals the target's, the plots exist.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tandem_client::Mode;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tandem_engine::{Engine, EngineConfig, LlamaModel, Tokenizer};
use tandem_spec::capacity::ForwardCost;
use tandem_spec::policy::expected_accepted;
use tandem_spec::sampling::SamplingParams;

mod report;

pub use report::markdown;

use crate::latency::{Draft, LatencyArgs, LatencyReport};
use crate::load::{mode_of, shape_label, LoadArgs, LoadReport, LoadRow};
use tandem_sim::stats::round2;
use tandem_sim::{SimConfig, SimRow};

#[derive(Debug, Clone)]
pub struct PaperArgs {
    pub out_dir: PathBuf,
    pub quick: bool,
    /// The one-session sweep (drafts are passed to [`run`]).
    pub latency: LatencyArgs,
    /// The load sweep; its α and draft speed are set from the first draft's measurements.
    pub load: LoadArgs,
    /// RTTs at which the load sweep is measured (the simulator covers every RTT of `latency`).
    pub load_rtts: Vec<f64>,
    /// The command line, for the report.
    pub command: String,
}

/// A draft scheme's accuracy and speed, from the one-session sweep.
#[derive(Debug, Clone, Serialize)]
pub struct DraftScore {
    pub draft: String,
    pub size_mb: f64,
    /// Acceptance per drafted token over all its speculative rows (accepted / judged).
    pub alpha: f64,
    /// The draft's own decode time per token (edge-only ITL).
    pub draft_ms: f64,
    /// Per γ of the sync sweep: (γ, measured tokens per verdict, E[A] at the row's α).
    pub expected_accepted: Vec<(usize, f64, f64)>,
}

/// A simulated point of the RTT × sessions × mode grid.
#[derive(Debug, Clone, Serialize)]
pub struct SimPoint {
    pub rtt_ms: f64,
    pub mode: Mode,
    pub row: SimRow,
}

/// One measurement beside the model's (and the simulator's) prediction of it.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCheck {
    /// `1 session` or `load`.
    pub setting: String,
    pub draft: String,
    pub rtt_ms: f64,
    pub sessions: usize,
    pub mode: String,
    /// `ITL ms` or `tok/s`.
    pub metric: String,
    pub measured: f64,
    pub predicted: f64,
    /// (predicted − measured) / measured.
    pub error: f64,
    pub simulated: Option<f64>,
    pub sim_error: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sanity {
    pub check: String,
    pub ok: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PaperReport {
    pub command: String,
    pub quick: bool,
    pub machine: Machine,
    pub wall_s: f64,
    pub latency: LatencyReport,
    pub drafts: Vec<DraftScore>,
    pub load: Vec<LoadReport>,
    /// The forward cost the simulator and the model were fed: fitted to the verifier's own
    /// forwards under load (`forward_cost_under_load`), else the isolated calibration.
    pub forward_cost: ForwardCost,
    pub forward_cost_under_load: bool,
    /// The target's forward measured alone on the verifier's core before the load sweep.
    pub isolated_forward_cost: ForwardCost,
    pub simulated: Vec<SimPoint>,
    /// The simulator at the load sweep's RTTs fed the isolated calibration instead.
    pub simulated_isolated: Vec<SimPoint>,
    pub checks: Vec<ModelCheck>,
    pub plots: Vec<String>,
    pub sanity: Vec<Sanity>,
}

fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown".to_string(), |(_, v)| v.trim().to_string());
    let mem = tandem_models::store::meminfo_bytes("MemTotal").unwrap_or(0) as f64;
    Machine {
        cpu,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_gib: round2(mem / (1u64 << 30) as f64),
    }
}

fn score(d: &Draft, r: &LatencyReport) -> DraftScore {
    let rows: Vec<_> = r.rows.iter().filter(|x| x.draft == d.name).collect();
    let spec: Vec<_> = rows.iter().filter(|x| x.drafted > 0).collect();
    // α weighted by the tokens each row judged (drafted less those dropped unjudged).
    let judged = |x: &crate::latency::Row| x.drafted.saturating_sub(x.wasted_draft_tokens) as f64;
    let total: f64 = spec.iter().map(|x| judged(x)).sum();
    let alpha = if total > 0.0 {
        spec.iter()
            .map(|x| x.acceptance_rate * judged(x))
            .sum::<f64>()
            / total
    } else {
        0.0
    };
    let mut ea: Vec<(usize, f64, f64)> = Vec::new();
    for g in r
        .rows
        .iter()
        .filter(|x| x.draft == d.name && x.mode == Mode::Sync)
    {
        let same: Vec<_> = rows
            .iter()
            .filter(|x| x.mode == Mode::Sync && x.gamma == g.gamma)
            .collect();
        if ea.iter().any(|e| e.0 == g.gamma) {
            continue;
        }
        let n = same.len() as f64;
        let measured = same.iter().map(|x| x.mean_accepted).sum::<f64>() / n;
        let a = same.iter().map(|x| x.acceptance_rate).sum::<f64>() / n;
        ea.push((
            g.gamma,
            round2(measured),
            round2(expected_accepted(a, g.gamma)),
        ));
    }
    ea.sort_by_key(|e| e.0);
    DraftScore {
        draft: d.name.clone(),
        size_mb: round2(std::fs::metadata(&d.path).map_or(0.0, |m| m.len() as f64 / 1e6)),
        alpha: round2(alpha),
        draft_ms: rows
            .iter()
            .find(|x| x.mode == Mode::EdgeOnly)
            .map_or(0.0, |x| x.itl_ms.mean),
        expected_accepted: ea,
    }
}

/// Run everything; `log` hears about progress.
pub fn run(
    a: &PaperArgs,
    target: &Arc<LlamaModel>,
    tok: &Tokenizer,
    drafts: &[Draft],
    mut log: impl FnMut(&str),
) -> Result<PaperReport> {
    let t0 = Instant::now();
    // Every setting is checked before the first measurement (the full run takes ~18 minutes).
    if drafts.is_empty() {
        bail!("--drafts: name at least one draft scheme");
    }
    let rtt_ok = |v: &[f64]| !v.is_empty() && v.iter().all(|x| x.is_finite() && *x >= 0.0);
    if !rtt_ok(&a.load_rtts) {
        bail!("--load-rtts: give one or more round trips in ms, each 0 or more");
    }
    if !rtt_ok(&a.latency.rtts) {
        bail!("--rtts: give one or more round trips in ms, each 0 or more");
    }
    if a.load.sessions.is_empty() || a.load.sessions.contains(&0) {
        bail!("--sessions: give one or more session counts, each at least 1");
    }
    if !(0.0..1.0).contains(&a.latency.jitter_frac) {
        bail!("--jitter-pct must be within 0..100");
    }
    if a.latency.tokens < 2 {
        bail!("--tokens must be at least 2 (a gap between tokens is what is measured)");
    }
    if !(a.load.duration_s > 0.0 && a.load.warmup_s >= 0.0) {
        bail!("--duration must be positive and --warmup 0 or more");
    }
    std::fs::create_dir_all(&a.out_dir)
        .with_context(|| format!("creating {}", a.out_dir.display()))?;
    log("one session, real edges: edge-only, cloud-only, sync, async per draft and RTT");
    let latency = crate::latency::run(&a.latency, target, tok, drafts, |r| {
        log(&format!(
            "  {} RTT {} ms {} γ{} d{}: ITL {:.1} ms, α {:.2}",
            r.draft, r.rtt_ms, r.mode, r.gamma, r.depth, r.itl_ms.mean, r.acceptance_rate
        ))
    })?;
    // The verifier's output against the target's greedy decode here, on the edge's core.
    let mut local = Engine::new(
        target.clone(),
        EngineConfig {
            threads: a.latency.edge_cpus.len().max(1),
            cpus: a.latency.edge_cpus,
            ..EngineConfig::default()
        },
    )?;
    let mut target_greedy = Vec::new();
    for p in &a.latency.prompts {
        let ids = tok.encode_chat(p)?;
        let o = tandem_client::generate::generate(
            &mut local,
            tok,
            &ids,
            a.latency.tokens,
            &SamplingParams::default(),
            |_| {},
        )?;
        target_greedy.push(o.output_ids);
    }
    drop(local);
    let scores: Vec<DraftScore> = drafts.iter().map(|d| score(d, &latency)).collect();
    let first = &scores[0];
    let mut load_args = a.load.clone();
    load_args.alphas = vec![first.alpha];
    load_args.draft_ms = first.draft_ms;
    let real: Vec<(String, Arc<LlamaModel>)> = drafts
        .iter()
        .map(|d| (d.name.clone(), d.model.clone()))
        .collect();
    let mut loads = Vec::new();
    for &rtt in &a.load_rtts {
        load_args.rtt_ms = rtt;
        log(&format!(
            "many sessions at RTT {rtt} ms: synthetic edges (α {}, {} ms/token) and cloud-only clients",
            first.alpha, first.draft_ms
        ));
        loads.push(crate::load::run(&load_args, target, tok, &real, |r| {
            log(&format!(
                "  {} N={}: {:.1} tok/s, ITL mean {:.1} p99 {:.1} ms, {} sessions, {} wrong",
                r.mode,
                r.sessions,
                r.throughput_tok_s,
                r.itl_ms.mean,
                r.itl_ms.p99,
                r.sessions_run,
                r.mismatches + r.failures
            ))
        })?);
    }
    let roof = &loads[0].roofline;
    let isolated = ForwardCost {
        one_token_ms: roof.one_token_ms,
        ms_per_token: roof.ms_per_token,
    };
    // The forward as the verifier ran it under load: a roofline fitted to each row's mean tokens
    // per forward and mean forward time, from its own metrics.
    let mut pts: Vec<(usize, f64)> = loads
        .iter()
        .flat_map(|l| &l.rows)
        .filter(|x| x.forward_ms_mean > 0.0 && x.mean_tokens_per_forward > 0.0)
        .map(|x| {
            (
                (x.mean_tokens_per_forward.round() as usize).max(1),
                x.forward_ms_mean,
            )
        })
        .collect();
    pts.sort_by(|x, y| x.0.cmp(&y.0).then(x.1.total_cmp(&y.1)));
    let under_load = ForwardCost::fit(&pts).map(|c| ForwardCost {
        one_token_ms: round2(c.one_token_ms),
        ms_per_token: round2(c.ms_per_token),
    });
    let cost = under_load.unwrap_or(isolated);
    let prompt_tokens = {
        let lens: Vec<usize> = load_args
            .prompts
            .iter()
            .map(|p| tok.encode_chat(p).map(|v| v.len()))
            .collect::<Result<_, _>>()?;
        (lens.iter().sum::<usize>() as f64 / lens.len().max(1) as f64).round() as usize
    };
    let mut rtts: Vec<f64> = a.latency.rtts.clone();
    rtts.extend(&a.load_rtts);
    rtts.sort_by(f64::total_cmp);
    rtts.dedup();
    log("simulating every RTT × sessions × mode with the measured costs");
    let mut shapes = vec![(0, 1)];
    shapes.extend(load_args.depths.iter().map(|&d| (load_args.gamma, d)));
    let grid = |rtts: &[f64], cost: ForwardCost| -> Result<Vec<SimPoint>> {
        let mut out = Vec::new();
        for &rtt in rtts {
            for &users in &load_args.sessions {
                for &(gamma, depth) in &shapes {
                    let cfg = SimConfig {
                        users,
                        replicas: 1,
                        alpha: first.alpha,
                        draft_ms: first.draft_ms,
                        rtt_ms: rtt,
                        rtt_spread_pct: 0.0,
                        jitter_pct: load_args.jitter_frac * 100.0,
                        tree: tandem_spec::pipeline::TreeArg(None),
                        cover: load_args.cover,
                        leaf_cost: tandem_sim::DEFAULT_LEAF_COST,
                        gamma,
                        depth,
                        adaptive: true,
                        prompt_tokens,
                        prefix_hit: 0.0,
                        new_tokens: load_args.max_new,
                        copy_share: 0.0,
                        copy_span: 12.0,
                        self_draft: true,
                        suffix: true,
                        token_budget: load_args.token_budget,
                        kv_blocks: 65536,
                        cost,
                        warmup_s: load_args.warmup_s,
                        duration_s: load_args.duration_s,
                        seed: 1,
                    };
                    out.push(SimPoint {
                        rtt_ms: rtt,
                        mode: mode_of((gamma > 0).then_some(depth)),
                        row: tandem_sim::simulate(&cfg)?,
                    });
                }
            }
        }
        Ok(out)
    };
    let simulated = grid(&rtts, cost)?;
    let simulated_isolated = grid(&a.load_rtts, isolated)?;
    let checks = model_checks(&latency, &loads, &simulated);
    let mut report = PaperReport {
        command: a.command.clone(),
        quick: a.quick,
        machine: machine(),
        wall_s: 0.0,
        latency,
        drafts: scores,
        load: loads,
        forward_cost: cost,
        forward_cost_under_load: under_load.is_some(),
        isolated_forward_cost: isolated,
        simulated,
        simulated_isolated,
        checks,
        plots: Vec::new(),
        sanity: Vec::new(),
    };
    log("drawing the plots");
    report.plots = report::draw_plots(&report, &a.out_dir)?;
    report.sanity = sanity(&report, &target_greedy, &a.out_dir);
    report.wall_s = round2(t0.elapsed().as_secs_f64());
    std::fs::write(
        a.out_dir.join("results.json"),
        serde_json::to_string_pretty(&report)?,
    )
    .with_context(|| format!("writing results.json into {}", a.out_dir.display()))?;
    std::fs::write(a.out_dir.join("results.md"), report::markdown(&report))
        .with_context(|| format!("writing results.md into {}", a.out_dir.display()))?;
    Ok(report)
}

pub(crate) fn rel(predicted: f64, measured: f64) -> f64 {
    if measured > 0.0 {
        round2((predicted - measured) / measured * 100.0) / 100.0
    } else {
        f64::NAN
    }
}

/// The simulated point for a measured row: same RTT, sessions, mode and (speculating) depth.
pub(crate) fn sim_for(
    sims: &[SimPoint],
    rtt: f64,
    users: usize,
    (mode, depth): (Mode, usize),
) -> Option<&SimRow> {
    sims.iter()
        .find(|s| {
            s.rtt_ms == rtt
                && s.row.users == users
                && s.mode == mode
                && (s.row.gamma == 0 || s.row.depth == depth)
        })
        .map(|s| &s.row)
}

fn model_checks(lat: &LatencyReport, loads: &[LoadReport], sims: &[SimPoint]) -> Vec<ModelCheck> {
    let mut out = Vec::new();
    for r in &lat.rows {
        let Some(p) = r.predicted_itl_ms else {
            continue;
        };
        out.push(ModelCheck {
            setting: "1 session".into(),
            draft: r.draft.clone(),
            rtt_ms: r.rtt_ms,
            sessions: 1,
            mode: format!("{} (γ {}, depth {})", r.mode, r.gamma, r.depth),
            metric: "ITL ms".into(),
            measured: r.itl_ms.mean,
            predicted: p,
            error: rel(p, r.itl_ms.mean),
            simulated: None,
            sim_error: None,
        });
    }
    for l in loads {
        for x in &l.rows {
            let Some(s) = sim_for(sims, l.rtt_ms, x.sessions, (x.mode, x.depth)) else {
                continue;
            };
            out.push(ModelCheck {
                setting: "load".into(),
                draft: "synthetic".into(),
                rtt_ms: l.rtt_ms,
                sessions: x.sessions,
                mode: shape_label(x.mode, x.depth),
                metric: "tok/s".into(),
                measured: x.throughput_tok_s,
                predicted: round2(s.predicted_tokens_per_s),
                error: rel(s.predicted_tokens_per_s, x.throughput_tok_s),
                simulated: Some(round2(s.tokens_per_s)),
                sim_error: Some(rel(s.tokens_per_s, x.throughput_tok_s)),
            });
        }
    }
    out
}

fn sanity(r: &PaperReport, target_greedy: &[Vec<u32>], dir: &Path) -> Vec<Sanity> {
    let mut out = Vec::new();
    let mut check = |check: &str, ok: bool, detail: String| {
        out.push(Sanity {
            check: check.into(),
            ok,
            detail,
        })
    };
    let lat = &r.latency;
    for mode in [Mode::EdgeOnly, Mode::CloudOnly, Mode::Sync, Mode::Async] {
        let rows: Vec<_> = lat.rows.iter().filter(|x| x.mode == mode).collect();
        let empty = rows.iter().filter(|x| x.tokens == 0).count();
        check(
            &format!("{mode} produced tokens (1 session)"),
            !rows.is_empty() && empty == 0,
            format!("{} rows, {empty} without tokens", rows.len()),
        );
    }
    check(
        "the verifier's output is the target's greedy output",
        !lat.target_outputs.is_empty() && lat.target_outputs == target_greedy,
        format!(
            "{} prompts: cloud-only vs this process's target engine",
            target_greedy.len()
        ),
    );
    let spec: Vec<_> = lat
        .rows
        .iter()
        .filter(|x| x.mode != Mode::EdgeOnly)
        .collect();
    let wrong = spec
        .iter()
        .filter(|x| x.same_as_target != Some(true))
        .count();
    check(
        "every cloud and speculative output equals the target's (1 session)",
        wrong == 0,
        format!("{} rows, {wrong} differ", spec.len()),
    );
    let rows: Vec<&LoadRow> = r.load.iter().flat_map(|l| &l.rows).collect();
    for mode in [Mode::CloudOnly, Mode::Sync, Mode::Async, Mode::AsyncTree] {
        let m: Vec<_> = rows.iter().filter(|x| x.mode == mode).collect();
        if m.is_empty() {
            continue;
        }
        let idle = m
            .iter()
            .filter(|x| x.throughput_tok_s <= 0.0 || x.sessions_run == 0)
            .count();
        check(
            &format!("{mode} committed tokens under load"),
            idle == 0,
            format!("{} rows, {idle} idle", m.len()),
        );
    }
    let (sessions, wrong, failed) = rows.iter().fold((0, 0, 0), |s, x| {
        (s.0 + x.sessions_run, s.1 + x.mismatches, s.2 + x.failures)
    });
    check(
        "every session under load got the target's tokens",
        wrong == 0 && failed == 0 && sessions > 0,
        format!("{sessions} sessions, {wrong} wrong, {failed} failed"),
    );
    let (bad_tokens, bad_protocol) = r.simulated.iter().fold((0, 0), |s, p| {
        (s.0 + p.row.wrong_tokens, s.1 + p.row.protocol_errors)
    });
    check(
        "the simulator committed only the target's tokens",
        bad_tokens == 0 && bad_protocol == 0 && !r.simulated.is_empty(),
        format!(
            "{} points, {bad_tokens} wrong tokens, {bad_protocol} protocol errors",
            r.simulated.len()
        ),
    );
    let missing: Vec<&String> = r
        .plots
        .iter()
        .filter(|p| !crate::plots::looks_like_png(&dir.join(p)))
        .collect();
    check(
        "plots written",
        !r.plots.is_empty() && missing.is_empty(),
        format!("{} plots, missing or not PNG: {missing:?}", r.plots.len()),
    );
    out
}
