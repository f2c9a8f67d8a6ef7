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

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tandem_cloud::ForwardCost;
use tandem_engine::{Engine, EngineConfig, LlamaModel, SamplingParams, Tokenizer};
use tandem_spec::policy::expected_accepted;

use crate::latency::{Draft, LatencyArgs, LatencyReport};
use crate::load::{LoadArgs, LoadReport, LoadRow};
use crate::plots::{Chart, Series};
use crate::simulate::{SimConfig, SimRow};
use crate::stats::round2;

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
    pub mode: String,
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
    /// The forward cost the simulator and the model were fed (the first load sweep's roofline).
    pub forward_cost: ForwardCost,
    pub simulated: Vec<SimPoint>,
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
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    Machine {
        cpu,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_gib: round2(mem_kb / 1024.0 / 1024.0),
    }
}

fn score(d: &Draft, r: &LatencyReport) -> DraftScore {
    let rows: Vec<_> = r.rows.iter().filter(|x| x.draft == d.name).collect();
    let spec: Vec<_> = rows.iter().filter(|x| x.drafted > 0).collect();
    // α weighted by the tokens each row judged.
    let judged: f64 = spec.iter().map(|x| x.drafted as f64).sum();
    let alpha = if judged > 0.0 {
        spec.iter()
            .map(|x| x.acceptance_rate * x.drafted as f64)
            .sum::<f64>()
            / judged
    } else {
        0.0
    };
    let mut ea: Vec<(usize, f64, f64)> = Vec::new();
    for g in r
        .rows
        .iter()
        .filter(|x| x.draft == d.name && x.mode == "sync")
    {
        let same: Vec<_> = rows
            .iter()
            .filter(|x| x.mode == "sync" && x.gamma == g.gamma)
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
            .find(|x| x.mode == "edge-only")
            .map_or(0.0, |x| x.itl_ms.mean),
        expected_accepted: ea,
    }
}

/// The simulator's mode name for a load row's shape.
fn mode_of(gamma: usize, depth: usize) -> &'static str {
    match (gamma, depth) {
        (0, _) => "cloud-only",
        (_, 1) => "sync",
        _ => "async",
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
    if drafts.is_empty() {
        bail!("--drafts: name at least one draft scheme");
    }
    if a.load_rtts.is_empty() {
        bail!("--load-rtts: name at least one round trip");
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
        let o = crate::generate::generate(
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
    let cost = ForwardCost {
        one_token_ms: roof.one_token_ms,
        ms_per_token: roof.ms_per_token,
    };
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
    let mut simulated = Vec::new();
    let mut shapes = vec![(0, 1)];
    shapes.extend(load_args.depths.iter().map(|&d| (load_args.gamma, d)));
    for &rtt in &rtts {
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
                    gamma,
                    depth,
                    adaptive: true,
                    prompt_tokens,
                    new_tokens: load_args.max_new,
                    token_budget: load_args.token_budget,
                    kv_blocks: 65536,
                    cost,
                    warmup_s: load_args.warmup_s,
                    duration_s: load_args.duration_s,
                    seed: 1,
                };
                simulated.push(SimPoint {
                    rtt_ms: rtt,
                    mode: mode_of(gamma, depth).to_string(),
                    row: crate::simulate::simulate(&cfg)?,
                });
            }
        }
    }
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
        simulated,
        checks,
        plots: Vec::new(),
        sanity: Vec::new(),
    };
    log("drawing the plots");
    report.plots = draw_plots(&report, &a.out_dir)?;
    report.sanity = sanity(&report, &target_greedy, &a.out_dir);
    report.wall_s = round2(t0.elapsed().as_secs_f64());
    std::fs::write(
        a.out_dir.join("results.json"),
        serde_json::to_string_pretty(&report)?,
    )
    .with_context(|| format!("writing results.json into {}", a.out_dir.display()))?;
    std::fs::write(a.out_dir.join("results.md"), markdown(&report))
        .with_context(|| format!("writing results.md into {}", a.out_dir.display()))?;
    Ok(report)
}

fn rel(predicted: f64, measured: f64) -> f64 {
    if measured > 0.0 {
        round2((predicted - measured) / measured * 100.0) / 100.0
    } else {
        f64::NAN
    }
}

fn sim_for<'a>(sims: &'a [SimPoint], rtt: f64, users: usize, mode: &str) -> Option<&'a SimRow> {
    sims.iter()
        .find(|s| s.rtt_ms == rtt && s.row.users == users && s.mode == mode)
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
            let Some(s) = sim_for(sims, l.rtt_ms, x.sessions, &x.mode) else {
                continue;
            };
            out.push(ModelCheck {
                setting: "load".into(),
                draft: "synthetic".into(),
                rtt_ms: l.rtt_ms,
                sessions: x.sessions,
                mode: x.mode.clone(),
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
    for mode in ["edge-only", "cloud-only", "sync", "async"] {
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
    let spec: Vec<_> = lat.rows.iter().filter(|x| x.mode != "edge-only").collect();
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
    for mode in ["cloud-only", "sync", "async"] {
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

fn draw_plots(r: &PaperReport, dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    let lat = &r.latency;
    // ITL vs RTT per mode, one panel per draft.
    let mut panels = Vec::new();
    for d in &r.drafts {
        let pts = |f: &dyn Fn(&crate::latency::Verdict) -> f64| {
            lat.summary
                .iter()
                .filter(|v| v.draft == d.draft)
                .map(|v| (v.rtt_ms, f(v)))
                .collect::<Vec<_>>()
        };
        panels.push(Chart {
            title: format!("1 session, draft {}", d.draft),
            x_desc: "RTT (ms)".into(),
            y_desc: "mean ITL (ms)".into(),
            log2_x: false,
            diagonal: false,
            series: vec![
                Series::line("edge-only (draft alone)", 2, pts(&|v| v.edge_only_itl_ms)),
                Series::line("cloud-only", 7, pts(&|v| v.cloud_only_itl_ms)),
                Series::line("sync (best γ)", 0, pts(&|v| v.best_sync_itl_ms)),
                Series::line("async (planned)", 1, pts(&|v| v.async_itl_ms)),
                Series::dashed("async, adaptive", 1, pts(&|v| v.auto_itl_ms)),
            ],
        });
    }
    crate::plots::draw(&dir.join("itl_vs_rtt.png"), &panels, 560, 420)?;
    names.push("itl_vs_rtt.png".to_string());
    // Under load: throughput and p99 ITL against sessions, measured and simulated.
    for (file, title, y, f, s) in [
        (
            "load_throughput.png",
            "verifier throughput",
            "committed tok/s",
            (|x: &LoadRow| x.throughput_tok_s) as fn(&LoadRow) -> f64,
            (|s: &SimRow| s.tokens_per_s) as fn(&SimRow) -> f64,
        ),
        (
            "load_p99_itl.png",
            "p99 ITL",
            "p99 ITL (ms)",
            |x: &LoadRow| x.itl_ms.p99,
            |s: &SimRow| s.itl_ms.p99,
        ),
    ] {
        let mut panels = Vec::new();
        for l in &r.load {
            let mut series = Vec::new();
            for (i, mode) in ["cloud-only", "sync", "async"].iter().enumerate() {
                let pts: Vec<(f64, f64)> = l
                    .rows
                    .iter()
                    .filter(|x| x.mode == *mode)
                    .map(|x| (x.sessions as f64, f(x)))
                    .collect();
                if pts.is_empty() {
                    continue;
                }
                let color = [7, 0, 1][i];
                let sim: Vec<(f64, f64)> = pts
                    .iter()
                    .filter_map(|p| {
                        sim_for(&r.simulated, l.rtt_ms, p.0 as usize, mode).map(|row| (p.0, s(row)))
                    })
                    .collect();
                series.push(Series::line(format!("{mode}, measured"), color, pts));
                series.push(Series::dashed(format!("{mode}, simulated"), color, sim));
            }
            panels.push(Chart {
                title: format!("{title}, RTT {} ms", l.rtt_ms),
                x_desc: "concurrent sessions".into(),
                y_desc: y.into(),
                log2_x: true,
                diagonal: false,
                series,
            });
        }
        crate::plots::draw(&dir.join(file), &panels, 560, 420)?;
        names.push(file.to_string());
    }
    // α and E[A] per draft scheme.
    let ea = Chart {
        title: "tokens per verdict vs γ".into(),
        x_desc: "γ (drafted tokens per block)".into(),
        y_desc: "E[A]".into(),
        log2_x: false,
        diagonal: false,
        series: r
            .drafts
            .iter()
            .enumerate()
            .flat_map(|(i, d)| {
                let model: Vec<(f64, f64)> = (1..=8)
                    .map(|g| (g as f64, expected_accepted(d.alpha, g)))
                    .collect();
                [
                    Series::scatter(
                        format!("{}, measured", d.draft),
                        i,
                        d.expected_accepted
                            .iter()
                            .map(|e| (e.0 as f64, e.1))
                            .collect(),
                    ),
                    Series::dashed(format!("{}, model at α {:.2}", d.draft, d.alpha), i, model),
                ]
            })
            .collect(),
    };
    let alpha = Chart {
        title: "acceptance rate per row".into(),
        x_desc: "RTT (ms)".into(),
        y_desc: "α".into(),
        log2_x: false,
        diagonal: false,
        series: r
            .drafts
            .iter()
            .enumerate()
            .map(|(i, d)| {
                Series::scatter(
                    d.draft.clone(),
                    i,
                    lat.rows
                        .iter()
                        .filter(|x| x.draft == d.draft && x.drafted > 0)
                        .map(|x| (x.rtt_ms, x.acceptance_rate))
                        .collect(),
                )
            })
            .collect(),
    };
    crate::plots::draw(&dir.join("acceptance.png"), &[ea, alpha], 560, 420)?;
    names.push("acceptance.png".to_string());
    // Predicted against measured.
    let by = |setting: &str, f: &dyn Fn(&ModelCheck) -> Option<f64>| -> Vec<(f64, f64)> {
        r.checks
            .iter()
            .filter(|c| c.setting == setting)
            .filter_map(|c| f(c).map(|p| (c.measured, p)))
            .collect()
    };
    let one = Chart {
        title: "1 session: ITL".into(),
        x_desc: "measured ITL (ms)".into(),
        y_desc: "predicted ITL (ms)".into(),
        log2_x: false,
        diagonal: true,
        series: vec![Series::scatter(
            "model (sync and async rows)",
            0,
            by("1 session", &|c| Some(c.predicted)),
        )],
    };
    let load = Chart {
        title: "under load: throughput".into(),
        x_desc: "measured tok/s".into(),
        y_desc: "predicted tok/s".into(),
        log2_x: false,
        diagonal: true,
        series: vec![
            Series::scatter("model", 0, by("load", &|c| Some(c.predicted))),
            Series::scatter("simulator", 1, by("load", &|c| c.simulated)),
        ],
    };
    crate::plots::draw(
        &dir.join("predicted_vs_measured.png"),
        &[one, load],
        520,
        420,
    )?;
    names.push("predicted_vs_measured.png".to_string());
    Ok(names)
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:+.0}%", x * 100.0)
    } else {
        "-".into()
    }
}

/// The report as Markdown: summary tables, the plots, the checks, and the sweeps' own tables.
pub fn markdown(r: &PaperReport) -> String {
    let lat = &r.latency;
    let mut s = format!(
        "# Tandem: the paper's comparison{}\n\n`{}` — {:.0} s on {} ({} cores, {:.0} GiB).\n\n",
        if r.quick { " (quick)" } else { "" },
        r.command,
        r.wall_s,
        r.machine.cpu,
        r.machine.cores,
        r.machine.memory_gib
    );
    s.push_str(&format!(
        "## One session: ITL vs RTT\n\nReal edges on cpu {}, the verifier in its own process on cpu {}, netem between them (jitter ±{:.0}% of the RTT); {} prompts × {} tokens, greedy. Mean ITL in ms.\n\n",
        lat.edge_cpus, lat.cloud_cpus, lat.jitter_frac * 100.0, lat.prompts, lat.tokens
    ));
    s.push_str("| draft | RTT ms | edge-only | cloud-only | sync, best γ | async (planned) | async, adaptive | async ÷ sync | async ÷ cloud-only |\n|---|---|---|---|---|---|---|---|---|\n");
    for v in &lat.summary {
        let shape = lat
            .rows
            .iter()
            .find(|x| x.draft == v.draft && x.rtt_ms == v.rtt_ms && x.mode == "async")
            .map_or(String::new(), |x| {
                format!(" (γ {}, depth {})", x.gamma, x.depth)
            });
        s.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.1} (γ {}) | {:.1}{shape} | {:.1} | {:.2} | {:.2} |\n",
            v.draft,
            v.rtt_ms,
            v.edge_only_itl_ms,
            v.cloud_only_itl_ms,
            v.best_sync_itl_ms,
            v.best_sync_gamma,
            v.async_itl_ms,
            v.auto_itl_ms,
            v.async_over_sync,
            if v.cloud_only_itl_ms > 0.0 {
                v.async_itl_ms / v.cloud_only_itl_ms
            } else {
                f64::NAN
            },
        ));
    }
    s.push_str("\n![ITL vs RTT](itl_vs_rtt.png)\n\n");
    s.push_str("## Drafts: α and E[A]\n\n| draft | size MB | α | draft ms/token | tokens per verdict by γ: measured / model |\n|---|---|---|---|---|\n");
    for d in &r.drafts {
        let ea: Vec<String> = d
            .expected_accepted
            .iter()
            .map(|e| format!("γ {}: {:.2} / {:.2}", e.0, e.1, e.2))
            .collect();
        s.push_str(&format!(
            "| {} | {:.1} | {:.2} | {:.1} | {} |\n",
            d.draft,
            d.size_mb,
            d.alpha,
            d.draft_ms,
            ea.join(", ")
        ));
    }
    s.push_str("\n![α and E[A]](acceptance.png)\n\n## Many sessions\n\n");
    s.push_str(&format!(
        "Synthetic edges with the first draft's α and speed; the simulator and the model fed the target's measured forward, max({:.1} ms, {:.2} ms × tokens).\n\n",
        r.forward_cost.one_token_ms, r.forward_cost.ms_per_token
    ));
    s.push_str("| RTT ms | sessions | mode | tok/s measured | simulated | model | ITL mean / p99 ms | simulated mean / p99 | TTFT p50 ms | cloud-decoded | sessions | wrong |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for l in &r.load {
        for x in &l.rows {
            let sim = sim_for(&r.simulated, l.rtt_ms, x.sessions, &x.mode);
            s.push_str(&format!(
                "| {} | {} | {} | {:.1} | {} | {} | {:.1} / {:.1} | {} | {:.0} | {:.0}% | {} | {} |\n",
                l.rtt_ms,
                x.sessions,
                x.mode,
                x.throughput_tok_s,
                sim.map_or("-".into(), |s| format!(
                    "{:.1} ({})",
                    s.tokens_per_s,
                    pct(rel(s.tokens_per_s, x.throughput_tok_s))
                )),
                sim.map_or("-".into(), |s| format!(
                    "{:.1} ({})",
                    s.predicted_tokens_per_s,
                    pct(rel(s.predicted_tokens_per_s, x.throughput_tok_s))
                )),
                x.itl_ms.mean,
                x.itl_ms.p99,
                sim.map_or("-".into(), |s| format!("{:.1} / {:.1}", s.itl_ms.mean, s.itl_ms.p99)),
                x.ttft_ms.p50,
                100.0 * x.cloud_decoded_share,
                x.sessions_run,
                x.mismatches + x.failures,
            ));
        }
    }
    s.push_str("\n![throughput](load_throughput.png)\n\n![p99 ITL](load_p99_itl.png)\n\n");
    s.push_str(
        "### Simulated: every RTT × sessions × mode\n\ntok/s (mean ITL ms) per session count.\n\n",
    );
    let users: Vec<usize> = {
        let mut u: Vec<usize> = r.simulated.iter().map(|p| p.row.users).collect();
        u.sort_unstable();
        u.dedup();
        u
    };
    s.push_str("| RTT ms | mode |");
    for u in &users {
        s.push_str(&format!(" {u} |"));
    }
    s.push_str("\n|---|---|");
    s.push_str(&"---|".repeat(users.len()));
    s.push('\n');
    let mut keys: Vec<(f64, String)> = Vec::new();
    for p in &r.simulated {
        if !keys.iter().any(|k| k.0 == p.rtt_ms && k.1 == p.mode) {
            keys.push((p.rtt_ms, p.mode.clone()));
        }
    }
    for (rtt, mode) in keys {
        s.push_str(&format!("| {rtt} | {mode} |"));
        for &u in &users {
            s.push_str(
                &sim_for(&r.simulated, rtt, u, &mode).map_or(" - |".into(), |x| {
                    format!(" {:.1} ({:.0}) |", x.tokens_per_s, x.itl_ms.mean)
                }),
            );
        }
        s.push('\n');
    }
    s.push_str("\n## The model against the measurements\n\n");
    for (setting, bound) in [("1 session", 0.15), ("load", 0.25)] {
        let c: Vec<_> = r.checks.iter().filter(|c| c.setting == setting).collect();
        if c.is_empty() {
            continue;
        }
        let worst = c.iter().map(|c| c.error.abs()).fold(0.0, f64::max);
        let within = c.iter().filter(|c| c.error.abs() <= bound).count();
        s.push_str(&format!(
            "- **{setting}** ({}): {within} of {} within ±{:.0}%, worst {:.0}%.",
            c[0].metric,
            c.len(),
            bound * 100.0,
            worst * 100.0
        ));
        let sims: Vec<f64> = c.iter().filter_map(|c| c.sim_error).collect();
        if !sims.is_empty() {
            let w = sims.iter().map(|e| e.abs()).fold(0.0, f64::max);
            let n = sims.iter().filter(|e| e.abs() <= 0.15).count();
            s.push_str(&format!(
                " Simulator: {n} of {} within ±15%, worst {:.0}%.",
                sims.len(),
                w * 100.0
            ));
        }
        s.push('\n');
    }
    s.push_str("\n| setting | draft | RTT ms | sessions | mode | metric | measured | model | error | simulated | error |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for c in &r.checks {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {} |\n",
            c.setting,
            c.draft,
            c.rtt_ms,
            c.sessions,
            c.mode,
            c.metric,
            c.measured,
            c.predicted,
            pct(c.error),
            c.simulated.map_or("-".into(), |x| format!("{x:.1}")),
            c.sim_error.map_or("-".into(), pct),
        ));
    }
    s.push_str("\n![predicted vs measured](predicted_vs_measured.png)\n\n## Sanity checks\n\n");
    for c in &r.sanity {
        s.push_str(&format!(
            "- [{}] {}: {}\n",
            if c.ok { "x" } else { " " },
            c.check,
            c.detail
        ));
    }
    s.push_str("\n## Details: the one-session sweep\n\n");
    s.push_str(&crate::latency::table(lat));
    for l in &r.load {
        s.push_str(&format!(
            "\n## Details: the load sweep at RTT {} ms\n\n",
            l.rtt_ms
        ));
        s.push_str(&crate::load::table(l));
    }
    s
}
