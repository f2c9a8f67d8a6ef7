//! The latency benchmark's verdicts per draft and round trip, and its report as tables.

use super::*;

pub(super) fn summarize(rows: &[Row], drafts: &[Draft], rtts: &[f64]) -> Vec<Verdict> {
    let mut out = Vec::new();
    let find = |d: &str, rtt: f64, mode: Mode| {
        rows.iter()
            .filter(|r| r.draft == d && r.rtt_ms == rtt && r.mode == mode && r.temperature == 0.0)
            .collect::<Vec<_>>()
    };
    for d in drafts {
        let edge = find(&d.name, 0.0, Mode::EdgeOnly)
            .first()
            .map_or(0.0, |r| r.itl_ms.mean);
        for &rtt in rtts {
            let Some(best) = find(&d.name, rtt, Mode::Sync)
                .into_iter()
                .min_by(|x, y| x.itl_ms.mean.total_cmp(&y.itl_ms.mean))
            else {
                continue;
            };
            let itl = |mode| {
                find(&d.name, rtt, mode)
                    .first()
                    .map_or(0.0, |r| r.itl_ms.mean)
            };
            let asy = itl(Mode::Async);
            out.push(Verdict {
                draft: d.name.clone(),
                rtt_ms: rtt,
                best_sync_gamma: best.gamma,
                best_sync_itl_ms: best.itl_ms.mean,
                async_itl_ms: asy,
                auto_itl_ms: itl(Mode::AsyncAuto),
                tree_itl_ms: itl(Mode::AsyncTree),
                async_over_sync: round2(asy / best.itl_ms.mean),
                edge_only_itl_ms: edge,
                cloud_only_itl_ms: find("-", rtt, Mode::CloudOnly)
                    .first()
                    .map_or(0.0, |r| r.itl_ms.mean),
            });
        }
    }
    out
}

/// The line above a report's tables: its prompts, tokens, jitter and cores.
pub(super) fn header(r: &LatencyReport) -> String {
    format!(
        "{} prompts × {} tokens, greedy; jitter ±{:.0}% of the RTT; edge on cpus {}, verifier (own process) on cpus {}\n\n",
        r.prompts,
        r.tokens,
        r.jitter_frac * 100.0,
        if r.edge_cpus.is_empty() { "any" } else { &r.edge_cpus },
        if r.cloud_cpus.is_empty() { "any" } else { &r.cloud_cpus },
    )
}

/// Markdown tables of the report.
pub fn table(r: &LatencyReport) -> String {
    let mut s = header(r);
    s += "| draft | RTT ms | mode | schema | T | rule | γ | depth | TTFT ms | ITL mean | p50 | p99 | α | α with lanes | E[A] | side nodes | lane hits | wasted drafts | forced | draft ms | edge ms/verdict | model ITL | model err | = target |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for x in &r.rows {
        let spec = x.mode != Mode::EdgeOnly && x.mode != Mode::CloudOnly;
        let opt = |v: Option<f64>, pct: bool| match v {
            Some(v) if pct => format!("{:+.0}%", v * 100.0),
            Some(v) => format!("{v:.1}"),
            None => "-".into(),
        };
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            x.draft,
            if x.mode == Mode::EdgeOnly { "-".into() } else { format!("{:.0}", x.rtt_ms) },
            x.mode,
            if x.schema { "json" } else { "-" },
            x.temperature,
            if spec { x.rule.as_str() } else { "-" },
            if spec { x.gamma.to_string() } else { "-".into() },
            if spec { x.depth.to_string() } else { "-".into() },
            x.ttft_ms,
            x.itl_ms.mean,
            x.itl_ms.p50,
            x.itl_ms.p99,
            if spec { format!("{:.2}", x.acceptance_rate) } else { "-".into() },
            if spec { format!("{:.2}", x.tree_acceptance_rate) } else { "-".into() },
            if spec { format!("{:.2}", x.mean_accepted) } else { "-".into() },
            if spec { x.side_nodes.to_string() } else { "-".into() },
            if spec { x.lane_hits.to_string() } else { "-".into() },
            if spec { format!("{}/{}", x.wasted_draft_tokens, x.drafted) } else { "-".into() },
            if spec { x.forced_tokens.to_string() } else { "-".into() },
            if spec { format!("{:.1}", x.draft_ms) } else { "-".into() },
            if spec { format!("{:.1}", x.verdict_ms) } else { "-".into() },
            opt(x.predicted_itl_ms, false),
            opt(x.model_error, true),
            x.same_as_target.map_or("-", |b| if b { "yes" } else { "NO" }),
        );
    }
    s += "\n| draft | RTT ms | edge-only ITL | cloud-only ITL | best sync ITL (γ) | async ITL | async / best sync | auto ITL | tree ITL | async / cloud-only | tree / cloud-only |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for v in &r.summary {
        let over = |x: f64| {
            if x > 0.0 && v.cloud_only_itl_ms > 0.0 {
                format!("{:.2}", x / v.cloud_only_itl_ms)
            } else {
                "-".into()
            }
        };
        s += &format!(
            "| {} | {:.0} | {:.1} | {:.1} | {:.1} ({}) | {:.1} | {:.2} | {:.1} | {:.1} | {} | {} |\n",
            v.draft,
            v.rtt_ms,
            v.edge_only_itl_ms,
            v.cloud_only_itl_ms,
            v.best_sync_itl_ms,
            v.best_sync_gamma,
            v.async_itl_ms,
            v.async_over_sync,
            v.auto_itl_ms,
            v.tree_itl_ms,
            over(v.async_itl_ms),
            over(v.tree_itl_ms)
        );
    }
    s +=
        "\nCalibration (first RTT, sync sweep) from which async's γ / depth (≥ 2) are planned:\n\n";
    for (d, c) in &r.calibration {
        s += &format!(
            "- {d}: α {:.2}, draft {:.1} ms/token, verify {:.1} + {:.1}·(γ+1) ms, round trip {:.1} ms\n",
            c.alpha, c.draft_ms, c.verify_ms, c.verify_ms_per_token, c.rtt_ms
        );
    }
    if let Some(Value::Object(p)) = &r.peer {
        s += "\nllama.cpp 0.3.36 (`../shared/peer`), 1 thread, same files:\n\n";
        for (d, v) in p {
            let chunks: Vec<String> = v["chunk_ms"]
                .as_object()
                .map(|c| c.iter().map(|(k, ms)| format!("k={k} {ms}")).collect())
                .unwrap_or_default();
            s += &format!(
                "- {d}: decode {} tok/s; forward of k tokens (ms): {}\n",
                v["decode_tok_s"],
                chunks.join(", ")
            );
        }
    }
    if !r.peer_model.is_empty() {
        s += "\nThe same model with llama.cpp's forward times and the measured α (ITL ms):\n\n";
        s += "| draft | RTT ms | edge-only | cloud-only | best sync | best async |\n|---|---|---|---|---|---|\n";
        for m in &r.peer_model {
            s += &format!(
                "| {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
                m.draft,
                m.rtt_ms,
                m.edge_only_itl_ms,
                m.cloud_only_itl_ms,
                m.best_sync_itl_ms,
                m.best_async_itl_ms
            );
        }
    }
    s
}
