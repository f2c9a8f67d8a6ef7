//! `bench paper`'s outputs: the PNG plots and the Markdown report.

use std::path::Path;
use tandem_client::Mode;

use anyhow::Result;
use tandem_spec::policy::expected_accepted;

use super::{rel, sim_for, ModelCheck, PaperReport};
use crate::load::{shape_label, LoadRow};
use crate::plots::{Chart, Series};
use tandem_sim::SimRow;

pub(super) fn draw_plots(r: &PaperReport, dir: &Path) -> Result<Vec<String>> {
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
            let mut shapes: Vec<(Mode, usize)> = Vec::new();
            for x in &l.rows {
                if !shapes.contains(&(x.mode, x.depth)) {
                    shapes.push((x.mode, x.depth));
                }
            }
            for (i, &(mode, depth)) in shapes.iter().enumerate() {
                let pts: Vec<(f64, f64)> = l
                    .rows
                    .iter()
                    .filter(|x| x.mode == mode && x.depth == depth)
                    .map(|x| (x.sessions as f64, f(x)))
                    .collect();
                let color = match mode {
                    Mode::CloudOnly => 7,
                    Mode::Sync => 0,
                    _ => 1 + i,
                };
                let sim: Vec<(f64, f64)> = pts
                    .iter()
                    .filter_map(|p| {
                        sim_for(&r.simulated, l.rtt_ms, p.0 as usize, (mode, depth))
                            .map(|row| (p.0, s(row)))
                    })
                    .collect();
                let label = shape_label(mode, depth);
                series.push(Series::line(format!("{label}, measured"), color, pts));
                series.push(Series::dashed(format!("{label}, simulated"), color, sim));
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
            .find(|x| x.draft == v.draft && x.rtt_ms == v.rtt_ms && x.mode == Mode::Async)
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
        "Synthetic edges with the first draft's α and speed. The simulator and the model are fed the target's forward {}: max({:.1} ms, {:.2} ms × tokens). Measured alone on the verifier's core before the sweep it was max({:.1} ms, {:.2} ms × tokens); the last column is the model fed that.\n\n",
        if r.forward_cost_under_load {
            "as the verifier ran it under load (fitted to each row's mean tokens per forward and mean forward time)"
        } else {
            "measured alone"
        },
        r.forward_cost.one_token_ms,
        r.forward_cost.ms_per_token,
        r.isolated_forward_cost.one_token_ms,
        r.isolated_forward_cost.ms_per_token
    ));
    s.push_str("| RTT ms | sessions | mode | tok/s measured | simulated | model | ITL mean / p99 ms | simulated mean / p99 | TTFT p50 ms | cloud-decoded | forward ms (busy) | sessions | wrong | model, isolated forward |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for l in &r.load {
        for x in &l.rows {
            let sim = sim_for(&r.simulated, l.rtt_ms, x.sessions, (x.mode, x.depth));
            let iso = sim_for(
                &r.simulated_isolated,
                l.rtt_ms,
                x.sessions,
                (x.mode, x.depth),
            );
            s.push_str(&format!(
                "| {} | {} | {} | {:.1} | {} | {} | {:.1} / {:.1} | {} | {:.0} | {:.0}% | {:.1} ({:.0}%) | {} | {} | {} |\n",
                l.rtt_ms,
                x.sessions,
                shape_label(x.mode, x.depth),
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
                x.forward_ms_mean,
                100.0 * x.forward_busy_share,
                x.sessions_run,
                x.mismatches + x.failures,
                iso.map_or("-".into(), |s| format!(
                    "{:.1} ({})",
                    s.predicted_tokens_per_s,
                    pct(rel(s.predicted_tokens_per_s, x.throughput_tok_s))
                )),
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
    let mut keys: Vec<(f64, Mode, usize)> = Vec::new();
    for p in &r.simulated {
        let k = (p.rtt_ms, p.mode, p.row.depth);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (rtt, mode, depth) in keys {
        s.push_str(&format!("| {rtt} | {} |", shape_label(mode, depth)));
        for &u in &users {
            s.push_str(
                &sim_for(&r.simulated, rtt, u, (mode, depth)).map_or(" - |".into(), |x| {
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
