//! Prometheus metrics of the verifier, served as text on `GET /metrics`. Names and meanings follow
//! vLLM's, under a `tandem:` prefix as vLLM's are under `vllm:`:
//! `time_to_first_token_seconds`, `inter_token_latency_seconds`,
//! `request_time_per_output_token_seconds`, `e2e_request_latency_seconds`,
//! `request_queue_time_seconds`, `num_requests_running`, `num_requests_waiting`,
//! `kv_cache_usage_perc`, `num_preemptions_total`, `prompt_tokens_total`,
//! `prefix_cache_queries_total`, `prefix_cache_hits_total` (tokens),
//! `generation_tokens_total`, `request_success_total{finished_reason}`, `iteration_tokens_total`,
//! and speculative decoding's `spec_decode_num_drafts_total`, `spec_decode_num_draft_tokens_total`,
//! `spec_decode_num_accepted_tokens_total`, `spec_decode_num_accepted_tokens_per_pos_total`.
//! Tandem's own beside them: batch size, the time of a forward, a block's queue time, takeovers,
//! refused sessions, prompt tokens waiting, tokens the verifier produced itself
//! (`cloud_tokens_total`, of them `cloud_decoded_tokens_total`), per tenant positions computed to verify,
//! drafted and accepted tokens (α = accepted / drafted), and `draft_acceptance_rate`: the share of
//! drafted tokens accepted over the last few hundred, the gauge to alarm on (a broken draft — a
//! wrong file, a mismatched quantization — is speculative decoding's most common failure, and
//! shows as an acceptance near zero while every answer stays right and slow).
//!
//! A request's counts come from the verifier's usage record of the session when it ends
//! ([`tandem_verifier::Usage`]), the same the ledger writes: a token counts once, as an accepted
//! draft token or as one of the verifier's.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

use tandem_verifier::{Observation, Turn};

use crate::Gauges;

pub struct Metrics {
    registry: Registry,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub request_queue: Histogram,
    pub queue_time: Histogram,
    pub batch_size: Histogram,
    pub tokens_per_forward: Histogram,
    pub forward_time: Histogram,
    pub prompt_tokens: IntCounter,
    /// Prompt tokens looked up in the prefix cache, and those it served (vLLM's
    /// `prefix_cache_queries` and `prefix_cache_hits`, in tokens).
    pub prefix_queries: IntCounter,
    pub prefix_hits: IntCounter,
    pub generation_tokens: IntCounter,
    pub cloud_tokens: IntCounter,
    pub cloud_decoded: IntCounter,
    pub success: IntCounterVec,
    /// Drafted and accepted tokens, decayed: the recent acceptance.
    recent: std::sync::Mutex<(f64, f64)>,
    acceptance: prometheus::Gauge,
    running: IntGauge,
    waiting_requests: IntGauge,
    kv_usage: prometheus::Gauge,
    pub drafts: IntCounter,
    pub draft_tokens: IntCounter,
    pub accepted_tokens: IntCounter,
    pub self_draft_guesses: IntCounter,
    pub self_drafted: IntCounter,
    pub accepted_per_pos: IntCounterVec,
    pub forwards: IntCounter,
    pub preemptions: IntCounter,
    pub takeovers: IntCounter,
    pub refused: IntCounter,
    /// Per tenant (label `tenant`, its name).
    pub tenant_verify_positions: IntCounterVec,
    pub tenant_drafted: IntCounterVec,
    pub tenant_accepted: IntCounterVec,
    waiting: IntGauge,
    sessions: IntGauge,
    quiet_sessions: IntGauge,
    generations: IntGauge,
    kv_used: IntGauge,
    kv_total: IntGauge,
}

fn seconds(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
        .expect("a valid histogram")
}

impl Default for Metrics {
    fn default() -> Self {
        let latency = vec![
            0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0,
        ];
        let counts = vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
        let m = Self {
            registry: Registry::new(),
            ttft: seconds(
                "tandem:time_to_first_token_seconds",
                "From a session's Open (or Generate) to its first token, in the verifier.",
                latency.clone(),
            ),
            itl: seconds(
                "tandem:inter_token_latency_seconds",
                "Between committed tokens of a session, as the verifier sends them.",
                latency.clone(),
            ),
            tpot: seconds(
                "tandem:request_time_per_output_token_seconds",
                "A request's time per output token after its first (from its first token to its end).",
                latency.clone(),
            ),
            e2e: seconds(
                "tandem:e2e_request_latency_seconds",
                "From a request's admission to its end.",
                vec![0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0],
            ),
            request_queue: seconds(
                "tandem:request_queue_time_seconds",
                "From a request's admission to its prompt's first prefill chunk.",
                latency.clone(),
            ),
            queue_time: seconds(
                "tandem:block_queue_time_seconds",
                "From a draft block's arrival to the forward that verifies it.",
                latency.clone(),
            ),
            batch_size: seconds(
                "tandem:batch_size",
                "Sessions in one forward.",
                counts.clone(),
            ),
            tokens_per_forward: seconds(
                "tandem:iteration_tokens_total",
                "Tokens computed in one forward (an engine step), all sessions together.",
                counts,
            ),
            forward_time: seconds(
                "tandem:forward_seconds",
                "Time of one step that ran the target's forward (the forward and the step's bookkeeping).",
                latency.clone(),
            ),
            drafts: IntCounter::new(
                "tandem:spec_decode_num_drafts_total",
                "Draft blocks verified.",
            )
            .expect("valid"),
            draft_tokens: IntCounter::new(
                "tandem:spec_decode_num_draft_tokens_total",
                "Drafted tokens in verified blocks.",
            )
            .expect("valid"),
            accepted_tokens: IntCounter::new(
                "tandem:spec_decode_num_accepted_tokens_total",
                "Drafted tokens the target accepted.",
            )
            .expect("valid"),
            accepted_per_pos: IntCounterVec::new(
                Opts::new(
                    "tandem:spec_decode_num_accepted_tokens_per_pos_total",
                    "Accepted drafted tokens by position among the tokens verified.",
                ),
                &["position"],
            )
            .expect("valid"),
            self_draft_guesses: IntCounter::new(
                "tandem:self_draft_guesses_total",
                "Guesses the verifier copied from sessions' own text and verified while it decoded them alone (--self-draft-max).",
            )
            .expect("valid"),
            self_drafted: IntCounter::new(
                "tandem:self_drafted_tokens_total",
                "The verifier's own guesses the target accepted: tokens committed besides the one each decode step produces.",
            )
            .expect("valid"),
            forwards: IntCounter::new(
                "tandem:target_forwards_total",
                "Forward passes of the target.",
            )
            .expect("valid"),
            preemptions: IntCounter::new(
                "tandem:num_preemptions_total",
                "Sessions whose KV was dropped to make room (recomputed later).",
            )
            .expect("valid"),
            takeovers: IntCounter::new(
                "tandem:takeovers_total",
                "Speculation sessions the verifier took over to decode itself (for load or pace).",
            )
            .expect("valid"),
            refused: IntCounter::new(
                "tandem:refused_sessions_total",
                "Sessions refused at admission (saturated or over a tenant quota).",
            )
            .expect("valid"),
            tenant_verify_positions: IntCounterVec::new(
                Opts::new(
                    "tandem:tenant_verify_positions_total",
                    "Positions the target computed to verify the tenant's blocks: drafted tokens plus an unfed correction or bonus in front.",
                ),
                &["tenant"],
            )
            .expect("valid"),
            tenant_drafted: IntCounterVec::new(
                Opts::new(
                    "tandem:tenant_draft_tokens_total",
                    "Drafted tokens verified, by tenant.",
                ),
                &["tenant"],
            )
            .expect("valid"),
            tenant_accepted: IntCounterVec::new(
                Opts::new(
                    "tandem:tenant_accepted_tokens_total",
                    "Drafted tokens accepted, by tenant.",
                ),
                &["tenant"],
            )
            .expect("valid"),
            prompt_tokens: IntCounter::new(
                "tandem:prompt_tokens_total",
                "Prompt tokens of the requests that ended.",
            )
            .expect("valid"),
            prefix_queries: IntCounter::new(
                "tandem:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache (of the requests that ended).",
            )
            .expect("valid"),
            prefix_hits: IntCounter::new(
                "tandem:prefix_cache_hits_total",
                "Prompt tokens the prefix cache served: their KV was not computed again.",
            )
            .expect("valid"),
            generation_tokens: IntCounter::new(
                "tandem:generation_tokens_total",
                "Tokens the requests that ended committed (accepted draft tokens and the verifier's own).",
            )
            .expect("valid"),
            cloud_tokens: IntCounter::new(
                "tandem:cloud_tokens_total",
                "Committed tokens the verifier produced itself (first tokens, corrections, bonuses, decoded ones, cloud-only generations).",
            )
            .expect("valid"),
            cloud_decoded: IntCounter::new(
                "tandem:cloud_decoded_tokens_total",
                "Tokens of speculation sessions the verifier decoded itself, having no block of theirs to verify.",
            )
            .expect("valid"),
            success: IntCounterVec::new(
                Opts::new(
                    "tandem:request_success_total",
                    "Requests that ended, by why: stop, length, abort (the edge closed it), cancelled, error, shutdown.",
                ),
                &["finished_reason"],
            )
            .expect("valid"),
            recent: std::sync::Mutex::new((0.0, 0.0)),
            acceptance: prometheus::Gauge::new(
                "tandem:draft_acceptance_rate",
                "Share of drafted tokens accepted over about the last 300 verified (1 before any): near 0 means a broken draft.",
            )
            .expect("valid"),
            running: IntGauge::new(
                "tandem:num_requests_running",
                "Requests whose prompt is prefilled (speculation sessions and cloud-only generations).",
            )
            .expect("valid"),
            waiting_requests: IntGauge::new(
                "tandem:num_requests_waiting",
                "Requests admitted whose prompt is not yet prefilled.",
            )
            .expect("valid"),
            kv_usage: prometheus::Gauge::new(
                "tandem:kv_cache_usage_perc",
                "Share of the KV cache's blocks in use (0 to 1).",
            )
            .expect("valid"),
            waiting: IntGauge::new(
                "tandem:waiting_prompt_tokens",
                "Prompt and recompute tokens not yet prefilled.",
            )
            .expect("valid"),
            sessions: IntGauge::new("tandem:sessions", "Open speculation sessions.")
                .expect("valid"),
            quiet_sessions: IntGauge::new(
                "tandem:quiet_sessions",
                "Speculation sessions decoded in the background: their edge said nothing for --quiet-ms.",
            )
            .expect("valid"),
            generations: IntGauge::new("tandem:generations", "Running cloud-only generations.")
                .expect("valid"),
            kv_used: IntGauge::new("tandem:kv_blocks_used", "KV cache blocks in use.")
                .expect("valid"),
            kv_total: IntGauge::new("tandem:kv_blocks_total", "KV cache blocks in all.")
                .expect("valid"),
        };
        let r = &m.registry;
        for c in [
            Box::new(m.ttft.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.itl.clone()),
            Box::new(m.tpot.clone()),
            Box::new(m.e2e.clone()),
            Box::new(m.request_queue.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.prefix_queries.clone()),
            Box::new(m.prefix_hits.clone()),
            Box::new(m.generation_tokens.clone()),
            Box::new(m.cloud_tokens.clone()),
            Box::new(m.cloud_decoded.clone()),
            Box::new(m.success.clone()),
            Box::new(m.acceptance.clone()),
            Box::new(m.running.clone()),
            Box::new(m.waiting_requests.clone()),
            Box::new(m.kv_usage.clone()),
            Box::new(m.queue_time.clone()),
            Box::new(m.batch_size.clone()),
            Box::new(m.tokens_per_forward.clone()),
            Box::new(m.forward_time.clone()),
            Box::new(m.drafts.clone()),
            Box::new(m.draft_tokens.clone()),
            Box::new(m.accepted_tokens.clone()),
            Box::new(m.self_draft_guesses.clone()),
            Box::new(m.self_drafted.clone()),
            Box::new(m.accepted_per_pos.clone()),
            Box::new(m.forwards.clone()),
            Box::new(m.preemptions.clone()),
            Box::new(m.takeovers.clone()),
            Box::new(m.refused.clone()),
            Box::new(m.tenant_verify_positions.clone()),
            Box::new(m.tenant_drafted.clone()),
            Box::new(m.tenant_accepted.clone()),
            Box::new(m.waiting.clone()),
            Box::new(m.sessions.clone()),
            Box::new(m.quiet_sessions.clone()),
            Box::new(m.generations.clone()),
            Box::new(m.kv_used.clone()),
            Box::new(m.kv_total.clone()),
        ] {
            r.register(c).expect("metric names are unique");
        }
        m.acceptance.set(1.0);
        // Every finish reason is there from the start, at 0 (a rate over a missing series is
        // nothing, not zero).
        for f in tandem_verifier::Finish::ALL {
            m.success.with_label_values(&[f.as_str()]);
        }
        m
    }
}

/// The recent acceptance forgets a drafted token's weight by this per token after it.
const RECENT_DECAY: f64 = 0.997;

impl Metrics {
    /// Record a turn of the verifier core that took `step_s` seconds of wall time; tenant `t` is
    /// labelled `tenant_names[t]`.
    pub fn record<H>(&self, turn: &Turn<H>, step_s: f64, tenant_names: &[String]) {
        self.takeovers.inc_by(turn.takeovers as u64);
        self.preemptions.inc_by(turn.preemptions as u64);
        self.refused.inc_by(turn.refused as u64);
        if let Some(f) = turn.forward {
            self.forwards.inc();
            self.batch_size.observe(f.sessions as f64);
            self.tokens_per_forward.observe(f.tokens as f64);
            self.forward_time.observe(step_s);
        }
        for o in &turn.observations {
            match *o {
                Observation::FirstToken { seconds } => self.ttft.observe(seconds),
                Observation::InterToken { seconds, tokens } => {
                    for _ in 0..tokens {
                        self.itl.observe(seconds);
                    }
                }
                Observation::QueueTime { seconds } => self.queue_time.observe(seconds),
                Observation::SelfDrafted { guessed, accepted } => {
                    self.self_draft_guesses.inc_by(guessed);
                    self.self_drafted.inc_by(accepted);
                }
                Observation::Verified {
                    tenant,
                    drafted,
                    accepted,
                    positions,
                } => {
                    let t = tenant_names
                        .get(tenant.0 as usize)
                        .cloned()
                        .unwrap_or_else(|| tenant.to_string());
                    self.drafts.inc();
                    self.draft_tokens.inc_by(drafted as u64);
                    self.accepted_tokens.inc_by(accepted as u64);
                    let mut r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
                    let d = RECENT_DECAY.powi(drafted as i32);
                    *r = (d * r.0 + accepted as f64, d * r.1 + drafted as f64);
                    if r.1 > 0.0 {
                        self.acceptance.set(r.0 / r.1);
                    }
                    for pos in 0..accepted {
                        self.accepted_per_pos
                            .with_label_values(&[&pos.to_string()])
                            .inc();
                    }
                    self.tenant_verify_positions
                        .with_label_values(&[&t])
                        .inc_by(positions as u64);
                    self.tenant_drafted
                        .with_label_values(&[&t])
                        .inc_by(drafted as u64);
                    self.tenant_accepted
                        .with_label_values(&[&t])
                        .inc_by(accepted as u64);
                }
            }
        }
        for u in &turn.finished {
            self.requests(u);
        }
    }

    /// A request that ended: its counts, its reason and its times.
    fn requests(&self, u: &tandem_verifier::Usage) {
        let s = |us: u64| us as f64 / 1e6;
        self.prompt_tokens.inc_by(u.prompt_tokens as u64);
        self.prefix_queries.inc_by(u.prompt_tokens as u64);
        self.prefix_hits.inc_by(u.cached_tokens as u64);
        self.generation_tokens.inc_by(u.committed_tokens as u64);
        self.cloud_tokens.inc_by(u.cloud_tokens as u64);
        self.cloud_decoded.inc_by(u.decoded_tokens as u64);
        self.success.with_label_values(&[u.finish.as_str()]).inc();
        self.e2e.observe(s(u.closed_us.saturating_sub(u.opened_us)));
        if let Some(q) = u.scheduled_us {
            self.request_queue.observe(s(q.saturating_sub(u.opened_us)));
        }
        if let (Some(f), n) = (u.first_token_us, u.committed_tokens) {
            if n > 1 {
                self.tpot
                    .observe(s(u.closed_us.saturating_sub(f)) / (n - 1) as f64);
            }
        }
    }

    /// The text exposition of every metric, gauges refreshed from `g`.
    pub fn render(&self, g: &Gauges) -> String {
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as i64;
        self.sessions.set(get(&g.sessions));
        self.quiet_sessions.set(get(&g.quiet_sessions));
        self.generations.set(get(&g.generations));
        self.kv_used.set(get(&g.kv_blocks_used));
        self.kv_total.set(get(&g.kv_blocks_total));
        self.running.set(get(&g.running));
        self.waiting_requests.set(get(&g.waiting));
        let total = get(&g.kv_blocks_total);
        if total > 0 {
            self.kv_usage
                .set(get(&g.kv_blocks_used) as f64 / total as f64);
        }
        self.waiting.set(get(&g.waiting_tokens));
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// Serve `GET /metrics` on `listener` until `shutdown` resolves; a connection whose request
/// head takes longer than `head_timeout` is closed ([`tandem_http::HEAD_TIMEOUT`] in `cloud
/// serve`): the process that serves every tenant keeps no socket for a client that never
/// finishes asking.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    gauges: Arc<Gauges>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    head_timeout: std::time::Duration,
) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let g = gauges.clone();
            async move {
                (
                    [("content-type", "text/plain; version=0.0.4")],
                    g.metrics.render(&g),
                )
            }
        }),
    );
    tandem_http::serve_http(listener, app, shutdown, head_timeout).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that never finishes its request head loses its connection to `/metrics` after
    /// the head timeout, and a scrape meanwhile is answered.
    #[test]
    fn a_slow_metrics_client_loses_its_connection_and_a_scrape_is_answered() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop) = tokio::sync::oneshot::channel::<()>();
        let server = rt.spawn(serve_metrics(
            listener,
            Arc::new(Gauges::default()),
            async {
                let _ = stop.await;
            },
            std::time::Duration::from_millis(300),
        ));
        let answer = tandem_testkit::slow_head_is_cut_and_a_request_is_answered(
            addr,
            "/metrics",
            std::time::Duration::from_secs(20),
        );
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.contains("tandem:"),
            "{answer}"
        );
        let _ = stop_tx.send(());
        rt.block_on(server).unwrap().unwrap();
    }

    /// Every `tandem:` series the shipped Grafana dashboard and Prometheus alerts query is one
    /// the verifier exports (a histogram's `_bucket`, `_sum` and `_count` included).
    #[test]
    fn the_dashboard_and_alerts_query_only_exported_metrics() {
        let g = Gauges::default();
        // Series with labels show once they have one.
        let m = &g.metrics;
        for v in [
            &m.tenant_verify_positions,
            &m.tenant_drafted,
            &m.tenant_accepted,
        ] {
            v.with_label_values(&["a"]);
        }
        m.accepted_per_pos.with_label_values(&["0"]);
        let text = g.metrics.render(&g);
        let exported: std::collections::HashSet<String> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.split(['{', ' ']).next().unwrap_or_default().to_string())
            .collect();
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/");
        let mut asked = 0;
        for file in ["grafana-dashboard.json", "prometheus-alerts.yml"] {
            let s = std::fs::read_to_string(format!("{root}{file}")).unwrap();
            if file.ends_with(".json") {
                serde_json::from_str::<serde_json::Value>(&s).expect("the dashboard is JSON");
            }
            for (i, _) in s.match_indices("tandem:") {
                let name: String = s[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                asked += 1;
                assert!(
                    exported.contains(&name),
                    "{file} asks for {name}, not exported"
                );
            }
        }
        assert!(asked > 20, "{asked}");
    }
}
