//! `tandem serve`'s `GET /metrics`: the edge's view of its requests under vLLM's names and
//! meanings with the `tandem:` prefix, as the verifier's `/metrics` has them (a Prometheus job
//! label tells the two apart): time to first token, inter-token latency, time per output token
//! and end-to-end latency as the API's clients see them (from the HTTP request), the queue time
//! for room in the draft's KV cache, requests running and waiting, the draft's KV usage, prompt
//! and generation tokens, `prefix_cache_queries_total` and `prefix_cache_hits_total` (prompt
//! tokens, and those the verifier's prefix cache served, as its `Opened` said),
//! `request_success_total{finished_reason}` (stop, length, abort: the
//! client went away, error), the tokens of each draft forward (`iteration_tokens_total`) and
//! speculation's counters (`spec_decode_num_drafts_total`: blocks the verifier judged,
//! `…_num_draft_tokens_total`: tokens the draft proposed, `…_num_accepted_tokens_total` and
//! `…_per_pos_total{position}`). Tandem's own beside them: the verifier's tokens (of them the
//! ones it decoded with no block to verify), tokens the draft produced alone after the verifier
//! was lost (`unverified_tokens_total`), reconnections, and `draft_acceptance_rate` (the gauge to
//! alarm on). Counts, never content.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};
use tandem_engine::kv::PagedKvCache;

use super::sessions::Finished;
use crate::SpecReport;

pub struct EdgeMetrics {
    registry: Registry,
    ttft: Histogram,
    itl: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    queue: Histogram,
    pub iteration_tokens: Histogram,
    prompt_tokens: IntCounter,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    /// Prompt tokens whose draft KV the edge's own prefix cache held.
    pub draft_prefix_hits: IntCounter,
    generation_tokens: IntCounter,
    success: IntCounterVec,
    running: IntGauge,
    pub waiting: IntGauge,
    kv_usage: prometheus::Gauge,
    preemptions: IntCounter,
    drafts: IntCounter,
    draft_tokens: IntCounter,
    accepted: IntCounter,
    accepted_per_pos: IntCounterVec,
    cloud_tokens: IntCounter,
    cloud_decoded: IntCounter,
    unverified: IntCounter,
    pub reconnects: IntCounter,
    acceptance: prometheus::Gauge,
}

fn hist(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("a valid histogram")
}

fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("a valid counter")
}

impl Default for EdgeMetrics {
    fn default() -> Self {
        let latency = [
            0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0,
        ];
        let m = Self {
            registry: Registry::new(),
            ttft: hist(
                "tandem:time_to_first_token_seconds",
                "From the HTTP request to its first committed token.",
                &latency,
            ),
            itl: hist(
                "tandem:inter_token_latency_seconds",
                "Between a request's committed tokens, as the edge commits them.",
                &latency,
            ),
            tpot: hist(
                "tandem:request_time_per_output_token_seconds",
                "A request's time per output token after its first.",
                &latency,
            ),
            e2e: hist(
                "tandem:e2e_request_latency_seconds",
                "From the HTTP request to its last token.",
                &[0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0],
            ),
            queue: hist(
                "tandem:request_queue_time_seconds",
                "How long a request waited for room in the draft's KV cache.",
                &latency,
            ),
            iteration_tokens: hist(
                "tandem:iteration_tokens_total",
                "Tokens of one draft forward, all requests together.",
                &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0],
            ),
            prompt_tokens: counter("tandem:prompt_tokens_total", "Prompt tokens of the requests that ended."),
            prefix_queries: counter(
                "tandem:prefix_cache_queries_total",
                "Prompt tokens of the requests that ended whose session reached a verifier.",
            ),
            prefix_hits: counter(
                "tandem:prefix_cache_hits_total",
                "Of those, the ones the verifier's prefix cache served (its Opened said).",
            ),
            draft_prefix_hits: counter(
                "tandem:draft_prefix_cache_hits_total",
                "Prompt tokens of the requests admitted whose draft KV the edge's own prefix cache held (an earlier turn's).",
            ),
            generation_tokens: counter(
                "tandem:generation_tokens_total",
                "Completion tokens of the requests that ended (verified, and unverified ones after a fallback).",
            ),
            success: IntCounterVec::new(
                Opts::new(
                    "tandem:request_success_total",
                    "Requests that ended, by why: stop, length, abort (the client went away), error.",
                ),
                &["finished_reason"],
            )
            .expect("valid"),
            running: IntGauge::new("tandem:num_requests_running", "Requests being answered.")
                .expect("valid"),
            waiting: IntGauge::new(
                "tandem:num_requests_waiting",
                "Requests waiting for room in the draft's KV cache.",
            )
            .expect("valid"),
            kv_usage: prometheus::Gauge::new(
                "tandem:kv_cache_usage_perc",
                "Share of the draft's KV cache blocks in use (0 to 1).",
            )
            .expect("valid"),
            preemptions: counter(
                "tandem:num_preemptions_total",
                "Requests whose draft KV was dropped for room (the edge reserves room at admission: none).",
            ),
            drafts: counter(
                "tandem:spec_decode_num_drafts_total",
                "Draft blocks the verifier judged.",
            ),
            draft_tokens: counter(
                "tandem:spec_decode_num_draft_tokens_total",
                "Tokens the draft proposed.",
            ),
            accepted: counter(
                "tandem:spec_decode_num_accepted_tokens_total",
                "Drafted tokens the target accepted.",
            ),
            accepted_per_pos: IntCounterVec::new(
                Opts::new(
                    "tandem:spec_decode_num_accepted_tokens_per_pos_total",
                    "Judged blocks that accepted their drafted token at this position.",
                ),
                &["position"],
            )
            .expect("valid"),
            cloud_tokens: counter(
                "tandem:cloud_tokens_total",
                "Committed tokens the verifier produced itself (first tokens, corrections, bonuses, decoded ones).",
            ),
            cloud_decoded: counter(
                "tandem:cloud_decoded_tokens_total",
                "Tokens the verifier decoded itself, having no block of the request's to verify.",
            ),
            unverified: counter(
                "tandem:unverified_tokens_total",
                "Tokens the draft produced alone after the verifier was lost (--fallback local).",
            ),
            reconnects: counter(
                "tandem:reconnects_total",
                "Sessions whose link to the verifier was lost (each tried to reconnect).",
            ),
            acceptance: prometheus::Gauge::new(
                "tandem:draft_acceptance_rate",
                "Accepted over judged drafted tokens of the requests that ended lately (1 before any): near 0 means a broken draft.",
            )
            .expect("valid"),
        };
        for c in [
            Box::new(m.ttft.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.itl.clone()),
            Box::new(m.tpot.clone()),
            Box::new(m.e2e.clone()),
            Box::new(m.queue.clone()),
            Box::new(m.iteration_tokens.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.prefix_queries.clone()),
            Box::new(m.prefix_hits.clone()),
            Box::new(m.draft_prefix_hits.clone()),
            Box::new(m.generation_tokens.clone()),
            Box::new(m.success.clone()),
            Box::new(m.running.clone()),
            Box::new(m.waiting.clone()),
            Box::new(m.kv_usage.clone()),
            Box::new(m.preemptions.clone()),
            Box::new(m.drafts.clone()),
            Box::new(m.draft_tokens.clone()),
            Box::new(m.accepted.clone()),
            Box::new(m.accepted_per_pos.clone()),
            Box::new(m.cloud_tokens.clone()),
            Box::new(m.cloud_decoded.clone()),
            Box::new(m.unverified.clone()),
            Box::new(m.reconnects.clone()),
            Box::new(m.acceptance.clone()),
        ] {
            m.registry.register(c).expect("metric names are unique");
        }
        m.acceptance.set(1.0);
        for f in ["stop", "length", "abort", "error"] {
            m.success.with_label_values(&[f]);
        }
        m
    }
}

impl EdgeMetrics {
    pub fn set_running(&self, n: usize, kv: &PagedKvCache) {
        self.running.set(n as i64);
        let total = kv.tables.num_pages();
        if total > 0 {
            let used = total - kv.tables.num_free_blocks();
            self.kv_usage.set(used as f64 / total as f64);
        }
    }

    /// A request ended without an answer (`abort`, `error`).
    pub fn finished(&self, reason: &str) {
        self.success.with_label_values(&[reason]).inc();
    }

    /// A request answered: its times and counts (`report`: what its speculation did, if it
    /// reached the verifier).
    pub fn record(&self, f: &Finished, report: Option<&SpecReport>, queued_s: f64) {
        self.finished(f.finish_reason);
        self.queue.observe(queued_s);
        self.prompt_tokens.inc_by(f.prompt_tokens as u64);
        if report.is_some() {
            self.prefix_queries.inc_by(f.prompt_tokens as u64);
            self.prefix_hits.inc_by(f.cached_tokens as u64);
        }
        self.generation_tokens.inc_by(f.completion_tokens as u64);
        self.unverified.inc_by(f.unverified_tokens as u64);
        self.e2e.observe(f.e2e_ms / 1e3);
        if let Some(&first) = f.token_ms.first() {
            self.ttft.observe(first / 1e3);
            for w in f.token_ms.windows(2) {
                self.itl.observe((w[1] - w[0]) / 1e3);
            }
            if f.token_ms.len() > 1 {
                self.tpot
                    .observe((f.e2e_ms - first) / 1e3 / (f.token_ms.len() - 1) as f64);
            }
        }
        let s = &f.stats;
        self.cloud_tokens.inc_by(s.cloud_tokens as u64);
        self.cloud_decoded.inc_by(s.cloud_decoded_tokens as u64);
        if let Some(r) = report {
            let p = &r.stats;
            self.drafts.inc_by(p.verdicts as u64);
            self.draft_tokens.inc_by(p.drafted as u64);
            self.accepted.inc_by(p.verdict_accepted as u64);
            for (pos, &n) in p.accepted_at.iter().enumerate().filter(|e| *e.1 > 0) {
                self.accepted_per_pos
                    .with_label_values(&[&pos.to_string()])
                    .inc_by(n as u64);
            }
            if p.accepted + p.rejections > 0 {
                // Recent requests weigh most: a broken draft shows within a few answers.
                let a = p.acceptance_rate();
                self.acceptance.set(0.7 * self.acceptance.get() + 0.3 * a);
            }
        }
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
