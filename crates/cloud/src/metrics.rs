//! Prometheus metrics of the verifier, served as text on `GET /metrics`. Names follow vLLM's where
//! they exist (`time_to_first_token_seconds`, `inter_token_latency_seconds`,
//! `spec_decode_num_drafts_total`, `spec_decode_num_draft_tokens_total`,
//! `spec_decode_num_accepted_tokens_total`, accepted tokens per position), under a `tandem:` prefix
//! as vLLM's are under `vllm:`; Tandem's own add batch size, tokens per forward, the time of a
//! forward, queue time, the KV cache, preemptions, refused sessions, prompt tokens waiting, and per
//! tenant: verified positions, drafted and accepted tokens (α = accepted / drafted).

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
    pub queue_time: Histogram,
    pub batch_size: Histogram,
    pub tokens_per_forward: Histogram,
    pub forward_time: Histogram,
    pub drafts: IntCounter,
    pub draft_tokens: IntCounter,
    pub accepted_tokens: IntCounter,
    pub accepted_per_pos: IntCounterVec,
    pub forwards: IntCounter,
    pub preemptions: IntCounter,
    pub takeovers: IntCounter,
    pub refused: IntCounter,
    /// Per tenant (label `tenant`, its name).
    pub tenant_verified: IntCounterVec,
    pub tenant_drafted: IntCounterVec,
    pub tenant_accepted: IntCounterVec,
    waiting: IntGauge,
    sessions: IntGauge,
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
            queue_time: seconds(
                "tandem:queue_time_seconds",
                "From a draft block's arrival to the forward that verifies it.",
                latency.clone(),
            ),
            batch_size: seconds(
                "tandem:batch_size",
                "Sessions in one forward.",
                counts.clone(),
            ),
            tokens_per_forward: seconds(
                "tandem:tokens_per_forward",
                "Tokens computed in one forward, all sessions together.",
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
                    "tandem:spec_decode_num_accepted_tokens_per_pos",
                    "Accepted drafted tokens by position in their block.",
                ),
                &["position"],
            )
            .expect("valid"),
            forwards: IntCounter::new(
                "tandem:target_forwards_total",
                "Forward passes of the target.",
            )
            .expect("valid"),
            preemptions: IntCounter::new(
                "tandem:preemptions_total",
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
            tenant_verified: IntCounterVec::new(
                Opts::new(
                    "tandem:tenant_verified_positions_total",
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
            waiting: IntGauge::new(
                "tandem:waiting_prompt_tokens",
                "Prompt and recompute tokens not yet prefilled.",
            )
            .expect("valid"),
            sessions: IntGauge::new("tandem:sessions", "Open speculation sessions.")
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
            Box::new(m.queue_time.clone()),
            Box::new(m.batch_size.clone()),
            Box::new(m.tokens_per_forward.clone()),
            Box::new(m.forward_time.clone()),
            Box::new(m.drafts.clone()),
            Box::new(m.draft_tokens.clone()),
            Box::new(m.accepted_tokens.clone()),
            Box::new(m.accepted_per_pos.clone()),
            Box::new(m.forwards.clone()),
            Box::new(m.preemptions.clone()),
            Box::new(m.takeovers.clone()),
            Box::new(m.refused.clone()),
            Box::new(m.tenant_verified.clone()),
            Box::new(m.tenant_drafted.clone()),
            Box::new(m.tenant_accepted.clone()),
            Box::new(m.waiting.clone()),
            Box::new(m.sessions.clone()),
            Box::new(m.generations.clone()),
            Box::new(m.kv_used.clone()),
            Box::new(m.kv_total.clone()),
        ] {
            r.register(c).expect("metric names are unique");
        }
        m
    }
}

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
                    for pos in 0..accepted {
                        self.accepted_per_pos
                            .with_label_values(&[&pos.to_string()])
                            .inc();
                    }
                    self.tenant_verified
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
    }

    /// The text exposition of every metric, gauges refreshed from `g`.
    pub fn render(&self, g: &Gauges) -> String {
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as i64;
        self.sessions.set(get(&g.sessions));
        self.generations.set(get(&g.generations));
        self.kv_used.set(get(&g.kv_blocks_used));
        self.kv_total.set(get(&g.kv_blocks_total));
        self.waiting.set(get(&g.waiting_tokens));
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// Serve `GET /metrics` on `listener` until `shutdown` resolves.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    gauges: Arc<Gauges>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
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
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
