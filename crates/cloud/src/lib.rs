//! Tandem's cloud verifier as a server: the IO around the verifier core (`tandem-verifier`).
//!
//! - [`batcher`]: the thread that owns the [`VerifierCore`] and drives it with the wall clock: it
//!   takes every message that has arrived ([`ToCloud`]), runs the core's turn, sends each
//!   outgoing message through its session's [`Reply`] and records the turn in the metrics.
//! - [`validation`]: every incoming protobuf message becomes a valid domain value or a
//!   field-named `INVALID_ARGUMENT` before anything is queued.
//! - [`tenants`]: API keys → tenants (`--tenants` TOML), their weights and quotas.
//! - [`grpc`]: the `tandem.v1.Verifier` service, health, admission, drain; [`metrics`]: Prometheus.

pub mod batcher;
pub mod commands;
pub mod grpc;
pub mod ids;
pub mod ledger;
pub mod metrics;
pub mod tenants;
pub mod validation;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tandem_sched::{SessionId, TenantId};
use tandem_verifier::{ErrorKind, Inbound, SessionState, ToEdge, VerifierCore, VerifierError};

pub use batcher::run_batcher;

/// The gRPC status code a refusal of the verifier is answered with.
pub fn code(e: &VerifierError) -> tonic::Code {
    match e.kind() {
        ErrorKind::NotFound => tonic::Code::NotFound,
        ErrorKind::AlreadyExists => tonic::Code::AlreadyExists,
        ErrorKind::InvalidArgument => tonic::Code::InvalidArgument,
        ErrorKind::ResourceExhausted => tonic::Code::ResourceExhausted,
        ErrorKind::Cancelled => tonic::Code::Cancelled,
        ErrorKind::Unavailable => tonic::Code::Unavailable,
        ErrorKind::DeadlineExceeded => tonic::Code::DeadlineExceeded,
        ErrorKind::Internal => tonic::Code::Internal,
    }
}

/// Live load of a verifier, updated by [`run_batcher`] after every turn and read by the `Info`
/// RPC, admission in the service, and its Prometheus metrics.
#[derive(Default)]
pub struct Gauges {
    pub metrics: metrics::Metrics,
    /// Open speculation sessions.
    pub sessions: AtomicU64,
    /// Of them, those decoded in the background (their edge went quiet).
    pub quiet_sessions: AtomicU64,
    /// Running cloud-only generations.
    pub generations: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub target_forwards: AtomicU64,
    /// Tokens per forward (running mean), in hundredths.
    pub tokens_per_forward_x100: AtomicU64,
    /// Prompt (and recompute) tokens waiting for prefill.
    pub waiting_tokens: AtomicU64,
    /// Requests prefilled, and admitted but not yet prefilled.
    pub running: AtomicU64,
    pub waiting: AtomicU64,
}

impl Gauges {
    fn update<H>(&self, v: &VerifierCore<tandem_engine::Engine, H>) {
        let pool = v.scheduler().pool();
        let set = |g: &AtomicU64, x: usize| g.store(x as u64, Ordering::Relaxed);
        let (spec, gen) = v.counts();
        set(&self.sessions, spec);
        set(&self.quiet_sessions, v.stats.quiet_sessions);
        set(&self.generations, gen);
        set(&self.kv_blocks_used, pool.num_pages() - pool.num_free());
        set(&self.kv_blocks_total, pool.num_pages());
        set(&self.waiting_tokens, v.scheduler().waiting_tokens());
        let (running, waiting) = v.request_counts();
        set(&self.running, running);
        set(&self.waiting, waiting);
        self.target_forwards
            .store(v.stats.target_forwards, Ordering::Relaxed);
        self.tokens_per_forward_x100.store(
            (v.stats.tokens_per_forward * 100.0).round() as u64,
            Ordering::Relaxed,
        );
    }
}

/// Where the batcher sends a session's messages (a gRPC stream, or a channel in tests). Returns
/// false when the edge is gone: the batcher then closes the session.
pub type Reply = Arc<dyn Fn(ToEdge) -> bool + Send + Sync>;

/// Messages to the batcher. The requests among them are carried out in order with the messages
/// before them, and answered once the turn that follows has sent its messages to the edges.
pub enum ToCloud {
    /// A message for the verifier core (open, draft, close).
    Core(Inbound<Reply>),
    /// The state of `tenant`'s open session (`None`: not open, or another tenant's).
    Query {
        session: SessionId,
        tenant: TenantId,
        reply: Box<dyn FnOnce(Option<SessionState>) + Send>,
    },
    /// `tenant` ends its session ([`VerifierCore::cancel`]).
    Cancel {
        session: SessionId,
        tenant: TenantId,
        reply: Box<dyn FnOnce(Result<(), VerifierError>) + Send>,
    },
    /// Stop admitting ([`VerifierCore::drain`]); answered with the sessions still open.
    Drain {
        reply: Box<dyn FnOnce(usize) + Send>,
    },
    /// End every open session ([`VerifierCore::shut_down`]); answered once they are told.
    ShutDown { reply: Box<dyn FnOnce() + Send> },
}

/// Time the target's forward of a chunk of `n` new tokens for each of `sizes` (ascending; the
/// median of `reps` runs each) and fit its roofline ([`tandem_spec::capacity::ForwardCost`]). The engine
/// is left as it was found (the scratch sequence is freed).
pub fn measure_forward_cost(
    engine: &mut tandem_engine::Engine,
    sizes: &[usize],
    reps: usize,
) -> Result<(Vec<(usize, f64)>, tandem_spec::capacity::ForwardCost), VerifierError> {
    use tandem_engine::{SeqChunk, SeqId, Wanted};
    let scratch = SeqId(u64::MAX);
    let mut points = Vec::new();
    for &n in sizes {
        let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
        let mut t = Vec::new();
        for _ in 0..reps.max(1) {
            let t0 = std::time::Instant::now();
            let r = engine.forward(&[SeqChunk::new(scratch, 0, tokens.clone(), Wanted::Last)]);
            t.push(t0.elapsed().as_secs_f64() * 1e3);
            engine.free(scratch);
            r?;
        }
        t.sort_by(f64::total_cmp);
        points.push((n, t[t.len() / 2]));
    }
    let cost = tandem_spec::capacity::ForwardCost::fit(&points).ok_or_else(|| {
        VerifierError::Engine(format!(
            "cannot fit a roofline to the forward times {points:?}"
        ))
    })?;
    Ok((points, cost))
}

/// Forward sizes `cloud serve` times at start-up: three memory-bound ones for the one-token time,
/// two compute-bound ones for the slope (about 3 s for SmolLM2 on one core).
pub const CALIBRATION_SIZES: [usize; 5] = [1, 2, 4, 24, 48];
