//! The sweep's report: mode names and the Markdown tables.

use super::LoadReport;
use tandem_client::Mode;

/// A row's mode by the blocks in flight its edges asked for: `cloud-only` (none), `sync` (1) or
/// `async`.
pub fn mode_of(depth: Option<usize>) -> Mode {
    depth.map_or(Mode::CloudOnly, Mode::of_depth)
}

/// A row's mode for tables and legends: async rows name their depth.
pub fn shape_label(mode: Mode, depth: usize) -> String {
    if matches!(mode, Mode::Async | Mode::AsyncTree) {
        format!("{mode} (depth {depth})")
    } else {
        mode.to_string()
    }
}

/// The report as Markdown tables.
pub fn table(r: &LoadReport) -> String {
    let mut s = String::new();
    s.push_str("Target forward time vs tokens per forward (verifier cores):\n\n| tokens | ms | ms/token |\n|---|---|---|\n");
    for (n, t) in &r.roofline.points {
        s.push_str(&format!("| {n} | {t:.1} | {:.2} |\n", t / *n as f64));
    }
    s.push_str(&format!(
        "\nCompute slope {:.2} ms/token; ridge ≈ {:.1} tokens per forward (one-token time / slope); grants shrink above ¾ of {:.1} tokens per forward.\n",
        r.roofline.ms_per_token, r.roofline.ridge_tokens, r.saturation_tokens
    ));
    if !r.real_alpha.is_empty() {
        let a: Vec<String> = r
            .real_alpha
            .iter()
            .map(|(n, a)| format!("{n} {a:.2}"))
            .collect();
        s.push_str(&format!(
            "Real drafts' greedy α on these prompts: {}.\n",
            a.join(", ")
        ));
    }
    s.push_str(&format!(
        "\nRTT {} ms, synthetic draft {} ms/token, γ ≤ {}, depth {:?}, token budget {}, {} s measured per row; SLOs: p99 ITL ≤ {:.1} ms, mean ITL ≤ {:.1} ms (3× and 1.5× the single-session cloud-only mean).\n\n",
        r.rtt_ms, r.draft_ms, r.gamma, r.depths, r.token_budget, r.duration_s, r.slo_ms, r.mean_slo_ms
    ));
    s.push_str("| mode | verifier drafts (guesses/token, taken) | N | α (set / measured) | tok/s | ITL mean | ITL p50 | ITL p99 | TTFT p50 | batch | tokens/fwd | fwd ms (busy) | queue ms | fwd/token (bound) | γ granted | cloud-decoded | ÷ cloud-only | side nodes/token (lane hits) | sessions | wrong |\n");
    s.push_str(
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for x in &r.rows {
        let alpha = x
            .alpha
            .map_or("-".into(), |a| format!("{a:.2} / {:.2}", x.measured_alpha));
        let bound = x
            .forwards_per_token_bound
            .map_or(String::new(), |b| format!(" ({b:.2})"));
        let base = r
            .rows
            .iter()
            .find(|c| c.alpha.is_none() && c.sessions == x.sessions && c.self_draft == x.self_draft)
            .filter(|c| c.throughput_tok_s > 0.0);
        let side = if x.mode == Mode::AsyncTree {
            format!("{:.2} ({})", x.side_nodes_per_token, x.lane_hits)
        } else {
            "-".into()
        };
        let ratio = base.map_or("-".into(), |c| {
            format!("{:.2}", x.throughput_tok_s / c.throughput_tok_s)
        });
        s.push_str(&format!(
            "| {} | {} | {} | {alpha} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {:.1} ({:.0}%) | {:.1} | {:.2}{bound} | {:.1} | {:.0}% | {ratio} | {side} | {} | {} |\n",
            shape_label(x.mode, x.depth),
            if x.self_draft {
                format!(
                    "on ({:.2}, {:.0}%)",
                    x.self_draft_guesses_per_token,
                    100.0 * x.self_draft_acceptance
                )
            } else {
                "off".into()
            },
            x.sessions,
            x.throughput_tok_s,
            x.itl_ms.mean,
            x.itl_ms.p50,
            x.itl_ms.p99,
            x.ttft_ms.p50,
            x.mean_batch_sessions,
            x.mean_tokens_per_forward,
            x.forward_ms_mean,
            100.0 * x.forward_busy_share,
            x.queue_ms_mean,
            x.forwards_per_token,
            x.mean_granted_gamma,
            100.0 * x.cloud_decoded_share,
            x.sessions_run,
            x.mismatches + x.failures,
        ));
    }
    s.push_str("\nSessions served within each SLO (largest N of the sweep; p99 / mean):\n\n");
    for c in &r.capacity {
        let a = c.alpha.map_or(String::new(), |a| format!(" α {a:.2}"));
        let d = if c.depth > 1 {
            format!(" depth {}", c.depth)
        } else {
            String::new()
        };
        s.push_str(&format!(
            "- {}{d}{a}: {} / {}\n",
            c.mode, c.sessions_within_p99_slo, c.sessions_within_mean_slo
        ));
    }
    s
}
